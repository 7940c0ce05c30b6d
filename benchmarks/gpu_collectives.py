"""Collective throughput on CUDA tensors: staged through host memory vs device-direct.

    launch/local -n 2 python benchmarks/gpu_collectives.py --device cuda [--quick]
        [--min-size 1KiB] [--max-size 256MiB] [--direct auto|force|skip] [--markdown]
        [--out benchmarks/out]

For allreduce (sum, in place), reduce-scatter (sum, even counts) and broadcast (root 0)
of fp32 tensors from ``--min-size`` to ``--max-size`` (powers of 4; the size is the whole
vector the collective operates on, as the library's traffic counters count it), through
:class:`kfac_hpc.comm.Communicator`'s ``allreduce`` / ``reduce_scatter`` / ``broadcast``:

* ``staged``: ``Communicator(cuda_aware=False)`` on CUDA tensors: every call copies its
  buffers device -> pinned host, runs MPI on host memory, and copies back.
* ``direct``: ``Communicator(cuda_aware="all")`` on CUDA tensors: device pointers go to
  MPI in every call measured, including those a routing rule stages by default because
  they measured faster staged (Open MPI without UCX: the blocking reductions; see
  ``kfac_hpc.comm.cuda.ROUTING``), so the column is the library's own device path.
  Measured only where the MPI library is CUDA-aware, as ``Communicator()`` (no
  override: ``KFAC_HPC_CUDA_AWARE``, then its detection) decides on every rank;
  otherwise the column is skipped with the reason. ``--direct force`` measures it anyway
  (on a library that is not CUDA-aware that may crash or give wrong sums), ``skip``
  never does. Where a routing rule applies, the header names the calls it stages.
* ``host`` (CUDA only): the same calls on CPU tensors, the MPI library's host-memory
  speed: ``staged`` minus ``host`` is the cost of the copies.

Each trial: the device is synchronised and the ranks meet at a barrier, then ``reps``
calls back to back (``reps`` grows as messages shrink, up to ``--max-reps``), then the
device is synchronised again; time per call = trial time / reps, slowest rank. The
modes take turns trial by trial; reported: the median over ``--trials`` trials after
two untimed calls (which also allocate the staging buffers). Bandwidth: ``algbw`` =
bytes / time; ``busbw`` (in the JSON) scales it as nccl-tests do (allreduce
``2(n-1)/n``, reduce-scatter ``(n-1)/n``, broadcast 1). Every mode's results are checked
once per collective (rank-dependent data, 1 MiB or less).

``--device cuda`` picks ``cuda:<local rank mod GPUs>`` before MPI starts (from the
launcher's local-rank variable); ranks of a node share its GPUs. It exits with the reason
when torch sees no GPU. ``--device cpu`` runs every column on CPU tensors (nothing is
staged): a check of the script on a machine without a GPU, not a measurement of staging.

Writes ``gpu_collectives_n<ranks>_<device>.json`` and a PNG under ``--out``; prints the
tables on rank 0.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from common import (
    OUT_DIR,
    describe,
    figure_note,
    format_table,
    machine,
    pyplot,
    save_figure,
    select_device,
    synchronize,
    write_json,
)

from kfac_hpc.units import parse_bytes

if TYPE_CHECKING:
    from mpi4py import MPI

    from kfac_hpc.comm import Communicator

COLLECTIVES = ("allreduce", "reduce_scatter", "broadcast")
BUS_FACTOR: dict[str, Callable[[int], float]] = {
    "allreduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}
ELEMENT = 4  # bytes of fp32


def parse_size(text: str) -> int:
    """``"1KiB"``, ``"256MiB"``, ``"4096"`` -> bytes (a multiple of 4)."""
    size = parse_bytes(text)
    if size < ELEMENT or size % ELEMENT:
        raise argparse.ArgumentTypeError(f"size {text!r} must be a positive multiple of 4 bytes")
    return size


def human(size: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"


def sizes_between(lo: int, hi: int) -> list[int]:
    out = [lo]
    while out[-1] * 4 <= hi:
        out.append(out[-1] * 4)
    return out


def make_call(comm: Communicator, collective: str, buf: torch.Tensor,
              world_size: int) -> Callable[[], Any]:
    """One call of ``collective`` on ``buf`` through the library's public API."""
    if collective == "allreduce":
        return lambda: comm.allreduce(buf)
    if collective == "reduce_scatter":
        n = buf.numel()
        counts = [n // world_size] * world_size
        counts[-1] += n - sum(counts)
        return lambda: comm.reduce_scatter(buf, counts)
    return lambda: comm.broadcast(buf, root=0)


def check(comm: Communicator, collective: str, device: torch.device, world: MPI.Comm,
          numel: int) -> bool:
    """Whether one call gives the right numbers (rank-dependent input; every rank)."""
    rank, size = world.Get_rank(), world.Get_size()
    buf = torch.arange(numel, dtype=torch.float32, device=device) % 97 + rank
    base = torch.arange(numel, dtype=torch.float32) % 97
    if collective == "allreduce":
        got = comm.allreduce(buf)
        want = base * size + size * (size - 1) / 2
    elif collective == "reduce_scatter":
        counts = [numel // size] * size
        counts[-1] += numel - sum(counts)
        got = comm.reduce_scatter(buf, counts)
        start = sum(counts[:rank])
        want = (base * size + size * (size - 1) / 2)[start:start + counts[rank]]
    else:
        got = comm.broadcast(buf, root=0)
        want = base
    ok = bool(torch.equal(got.detach().cpu(), want))
    return all(world.allgather(ok))


def time_size(modes: dict[str, tuple[Communicator, torch.device]], collective: str,
              size: int, args: argparse.Namespace, world: MPI.Comm) -> dict[str, Any]:
    """Median over trials of the slowest rank's time per call, for every mode."""
    numel = size // ELEMENT
    reps = max(1, min(args.max_reps, math.ceil(args.trial_bytes / size)))
    calls = {}
    for mode, (comm, dev) in modes.items():
        buf = torch.zeros(numel, dtype=torch.float32, device=dev)
        calls[mode] = (make_call(comm, collective, buf, world.Get_size()), dev)
        for _ in range(2):  # untimed: staging buffers, first-touch, MPI connections
            calls[mode][0]()
        synchronize(dev)
    mine: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.trials):
        for mode, (call, dev) in calls.items():
            synchronize(dev)
            world.Barrier()
            t0 = time.perf_counter()
            for _ in range(reps):
                call()
            synchronize(dev)
            mine[mode].append((time.perf_counter() - t0) / reps)
    everyone = world.allgather(mine)
    n = world.Get_size()
    out: dict[str, Any] = {"bytes": size, "reps": reps}
    for mode in modes:
        slowest = [max(r[mode][i] for r in everyone) for i in range(args.trials)]
        t = statistics.median(slowest)
        out[mode] = {"time_s": t, "samples_s": slowest, "algbw_gbs": size / t / 1e9,
                     "busbw_gbs": size / t / 1e9 * BUS_FACTOR[collective](n)}
    return out


def direct_decision(args: argparse.Namespace, world: MPI.Comm) -> tuple[bool, str]:
    """Whether to measure the direct column, and why (the Communicator decides)."""
    from kfac_hpc.comm import Communicator

    if args.direct == "skip":
        return False, "skipped (--direct skip)"
    probe = Communicator(world.Dup(), name="detect")  # no override: env, then evidence
    summary = str(getattr(getattr(probe, "cuda", None), "summary", lambda: "")())
    routed = sorted(getattr(getattr(probe, "cuda", None), "routed", ()))
    if routed:
        summary += (f"; by default {', '.join(routed)} are staged by routing (faster staged "
                    f"here); the direct column hands them to MPI")
    verdicts = world.allgather(bool(probe.cuda_aware))
    probe.free()
    said = f" ({summary})" if summary else ""
    if args.direct == "force":
        return True, (f"forced with --direct force; Communicator() says "
                      f"{'CUDA-aware' if all(verdicts) else 'NOT CUDA-aware'}{said}")
    if all(verdicts):
        return True, f"the MPI library is CUDA-aware per Communicator(){said}"
    where = "" if not any(verdicts) else f" on ranks {[i for i, v in enumerate(verdicts) if not v]}"
    return False, (f"NOT MEASURED: the MPI library is not CUDA-aware here per "
                   f"Communicator(){where}{said}. KFAC_HPC_CUDA_AWARE=1 or --direct force "
                   f"measures it anyway, at your risk")


def tables(record: dict[str, Any], md: bool) -> str:
    modes = record["modes"]
    out = []
    for collective in COLLECTIVES:
        rows = []
        for r in record["results"][collective]:
            row: list[Any] = [human(r["bytes"])]
            for m in modes:
                row += [f"{r[m]['time_s'] * 1e6:.1f}", float(r[m]["algbw_gbs"])]
            if "direct" in modes:
                row.append(f"{r['staged']['time_s'] / r['direct']['time_s']:.2f}")
            rows.append(row)
        head = ["size"]
        for m in modes:
            head += [f"{m} us", f"{m} GB/s"]
        if "direct" in modes:
            head.append("staged/direct time")
        checks = ", ".join(f"{m} {'ok' if record['checks'][collective][m] else 'WRONG'}"
                           for m in modes)
        out += [f"\n{collective} (time per call, slowest rank, median of {record['trials']} "
                f"trials; GB/s = bytes/time; result check: {checks}):",
                format_table(head, rows, md)]
    return "\n".join(out)


def plot(record: dict[str, Any], path: Path) -> Path:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(COLLECTIVES), figsize=(5 * len(COLLECTIVES), 4.2))
    for ax, collective in zip(axes, COLLECTIVES):
        res = record["results"][collective]
        sizes = [r["bytes"] for r in res]
        for mode in record["modes"]:
            ax.plot(sizes, [r[mode]["algbw_gbs"] for r in res], marker="o", label=mode)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("bytes")
        ax.set_ylabel("algbw GB/s")
        ax.set_title(collective, fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{record['machine']['world_size']} ranks, {record['device']}", fontsize=9)
    return save_figure(fig, path)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda",
                   help="cuda (default) or cpu (a check of the script, nothing staged)")
    p.add_argument("--min-size", type=parse_size, default=None, help="default 1KiB")
    p.add_argument("--max-size", type=parse_size, default=None,
                   help="default 256MiB (1MiB with --quick)")
    p.add_argument("--trials", type=int, default=None, help="default 5 (3 with --quick)")
    p.add_argument("--max-reps", type=int, default=100,
                   help="most calls per trial, for small messages (default 100)")
    p.add_argument("--trial-bytes", type=parse_size, default=parse_size("64MiB"),
                   help="aim for this many bytes per trial: reps = bytes / size (default 64MiB)")
    p.add_argument("--direct", choices=("auto", "force", "skip"), default="auto",
                   help="measure device-direct calls: auto (where CUDA-aware), force, skip")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per rank (default: cores / ranks on the node, >= 1)")
    p.add_argument("--quick", action="store_true", help="sizes up to 1MiB, 3 trials")
    p.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    p.add_argument("--out", type=Path, default=OUT_DIR, help=f"output folder (default {OUT_DIR})")
    args = p.parse_args(argv)
    args.min_size = args.min_size or parse_size("1KiB")
    args.max_size = args.max_size or parse_size("1MiB" if args.quick else "256MiB")
    args.trials = args.trials or (3 if args.quick else 5)
    if args.max_size < args.min_size:
        p.error("--max-size is smaller than --min-size")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device = select_device(args.device)  # before MPI starts (some libraries bind a GPU there)
    from mpi4py import MPI

    from kfac_hpc.comm import Communicator

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    info = machine()
    threads = args.threads or max(1, (info["cores"] or 1) // max(1, info["ranks_on_node"]))
    torch.set_num_threads(threads)
    info["torch_threads_per_rank"] = threads
    info["devices"] = world.allgather(str(device))

    def say(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    direct, why = direct_decision(args, world)
    modes: dict[str, tuple[Communicator, torch.device]] = {
        "staged": (Communicator(world.Dup(), cuda_aware=False, name="staged"), device)}
    if direct:
        # "all": the library's own device path, routing rules off (the header says which)
        modes["direct"] = (Communicator(world.Dup(), cuda_aware="all", name="direct"), device)
    if device.type == "cuda":
        modes["host"] = (Communicator(world.Dup(), cuda_aware=False, name="host"),
                         torch.device("cpu"))
    say(f"# gpu_collectives: {describe(info)}; device per rank: {', '.join(info['devices'])}")
    say(f"# direct: {why}")
    if device.type == "cpu":
        say("# --device cpu: every column uses CPU tensors, nothing is staged: a check of "
            "the script, not a measurement")
    if size == 1:
        say("# 1 rank: no data moves between processes; this times the calls' overhead "
            "(and staging copies) only")
    gpus = info.get("gpus") or []
    if device.type == "cuda" and info["ranks_on_node"] > len(gpus):
        say(f"# {info['ranks_on_node']} ranks share {len(gpus)} GPU(s) on this node")
    sizes = sizes_between(args.min_size, args.max_size)
    record: dict[str, Any] = {"machine": info, "device": device.type, "direct": direct,
                              "direct_reason": why, "modes": list(modes),
                              "trials": args.trials, "max_reps": args.max_reps,
                              "trial_bytes": args.trial_bytes, "dtype": "float32",
                              "results": {}, "checks": {}}
    start = time.perf_counter()
    for collective in COLLECTIVES:
        numel = min(args.max_size, 2**20) // ELEMENT
        record["checks"][collective] = {m: check(c, collective, d, world, numel)
                                        for m, (c, d) in modes.items()}
        rows = []
        for s in sizes:
            rows.append(time_size(modes, collective, s, args, world))
            if device.type == "cuda":
                torch.cuda.empty_cache()
        record["results"][collective] = rows
        say(f"  {collective}: {len(sizes)} sizes in {time.perf_counter() - start:.1f} s")
    say(tables(record, args.markdown))
    if not direct:
        say(f"\n(no direct column: {why})")
    for comm, _ in modes.values():
        comm.free()
    if rank == 0:
        stem = f"gpu_collectives_n{size}_{device.type}"
        say(f"wrote {write_json(args.out / f'{stem}.json', record)}")
        say(figure_note(plot, record, args.out / f"{stem}.png"))
    return 0 if all(all(c.values()) for c in record["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
