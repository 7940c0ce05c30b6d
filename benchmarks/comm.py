"""Collective latency and bandwidth: kfac_hpc Communicator vs raw mpi4py vs gloo.

    launch/local -n 4 python benchmarks/comm.py [--max-bytes 64M] [--repeat 20] [--quick]

For allreduce, reduce-scatter, broadcast and allgather, at block sizes from 8 B to
``--max-bytes`` (8 B, then powers of 4), on the current ranks, the same collective is
timed four ways in the same run, interleaved sample by sample:

* ``kfac_hpc``: :class:`kfac_hpc.comm.Communicator` on float32 torch tensors;
* ``mpi4py``: the same MPI call on numpy buffers of the same size (the floor);
* ``mpi4py_tensor``: the same again on the memory of torch tensors (no huge pages:
  separates the Communicator's own overhead from where its tensors live);
* ``gloo``: ``torch.distributed`` with the gloo backend (TCP rendezvous on 127.0.0.1,
  port broadcast over MPI; rank and world size from MPI).

A sample is the slowest rank's time for a batch of back-to-back calls after a barrier
(the same batch length for the three MPI implementations, gloo its own); each number
is the median of the samples (``--stat min``: their minimum, a better estimate of the
uncontended cost when other jobs share the cores; the JSON keeps both and every
sample, and ``--from-json`` re-analyses it). Sizes are one rank's block (see
``kfac_hpc.comm.selfcheck``). Per collective, ``t = alpha + beta * size`` is fitted by
least squares on relative error. Prints tables, writes ``comm_n<ranks>.json`` (raw
samples) and ``comm_n<ranks>.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import OUT_DIR, describe, format_table, machine, pyplot, save_figure, write_json
from mpi4py import MPI

from kfac_hpc.comm import Communicator, install_abort_on_error
from kfac_hpc.comm.selfcheck import (
    COLLECTIVES,
    block_elements,
    communicator_op,
    format_bytes,
    time_calls,
)
from kfac_hpc.units import parse_bytes

IMPLS = ("kfac_hpc", "mpi4py", "mpi4py_tensor", "gloo")
SMALL = 4 << 10  # "small message" bound of the added-latency goal
LARGE = 1 << 20  # "large message" bound of the relative-overhead goal
GOAL_OVERHEAD_PCT = 5.0
GOAL_ADDED_US = 20.0


def block_sizes(max_bytes: int, min_bytes: int = 8) -> list[int]:
    """``min_bytes`` (8 B), then powers of 4 above it, up to ``max_bytes``."""
    sizes = [min_bytes]
    p = 4
    while p <= max_bytes:
        if p > min_bytes:
            sizes.append(p)
        p *= 4
    return [s for s in sizes if s <= max_bytes]


def repeats_for(nbytes: int, repeat: int) -> int:
    """Samples at a size: ``repeat`` up to 1 MiB, fewer (at least 4) for larger blocks."""
    return repeat if nbytes <= LARGE else max(4, min(repeat, repeat * LARGE // nbytes))


def mpi4py_op(mpi: MPI.Comm, collective: str, nbytes: int,
              on_tensors: bool = False) -> Callable[[], object]:
    """The raw mpi4py call on float32 numpy buffers of the Communicator's sizes.

    ``on_tensors``: the buffers are numpy views of torch tensors. numpy asks the kernel
    for transparent huge pages on large arrays and torch's allocator does not, which
    changes how fast MPI's shared-memory transport copies; this variant separates
    that from the Communicator's own overhead.
    """
    n, size = block_elements(nbytes), mpi.Get_size()

    def zeros(*shape: int) -> np.ndarray:
        return torch.zeros(shape).numpy() if on_tensors else np.zeros(shape, np.float32)

    if collective == "allreduce":
        a = zeros(n)
        return lambda: mpi.Allreduce(MPI.IN_PLACE, a, MPI.SUM)
    if collective == "reduce_scatter":
        send, recv, counts = zeros(n * size), zeros(n), [n] * size
        return lambda: mpi.Reduce_scatter(send, recv, counts, MPI.SUM)
    if collective == "broadcast":
        a = zeros(n)
        return lambda: mpi.Bcast(a, 0)
    if collective == "allgather":
        send, recv = zeros(n), zeros(size, n)
        return lambda: mpi.Allgather(send, recv)
    raise ValueError(collective)


def init_gloo(mpi: MPI.Comm) -> None:
    """Start a gloo process group on the MPI ranks (TCP rendezvous on 127.0.0.1)."""
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    port = None
    if mpi.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = mpi.bcast(port, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=mpi.Get_rank(), world_size=mpi.Get_size(),
                            timeout=datetime.timedelta(seconds=120))


def gloo_op(collective: str, nbytes: int, size: int) -> Callable[[], object]:
    """The same collective through ``torch.distributed`` (gloo)."""
    import torch.distributed as dist

    n = block_elements(nbytes)
    # torch >= 2.13 renamed the tensor forms; older releases have only the old names.
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    if collective == "allreduce":
        t = torch.zeros(n)
        return lambda: dist.all_reduce(t)
    if collective == "reduce_scatter":
        send, recv = torch.zeros(n * size), torch.empty(n)
        return lambda: reduce_scatter(recv, send)
    if collective == "broadcast":
        t = torch.zeros(n)
        return lambda: dist.broadcast(t, 0)
    if collective == "allgather":
        send, recv = torch.zeros(n), torch.empty(n * size)
        return lambda: all_gather(recv, send)
    raise ValueError(collective)


def fit_alpha_beta(sizes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """``(alpha, beta)`` of ``t = alpha + beta * size``, least squares on relative error."""
    x, t = np.asarray(sizes, float), np.asarray(seconds, float)
    design = np.stack([1 / t, x / t], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    return float(alpha), float(beta)


def make_op(impl: str, comm: Communicator, collective: str,
            nbytes: int) -> Callable[[], object]:
    """One implementation's zero-argument call of ``collective`` on ``nbytes`` blocks."""
    if impl == "kfac_hpc":
        return communicator_op(comm, collective, nbytes)
    if impl in ("mpi4py", "mpi4py_tensor"):
        return mpi4py_op(comm.mpi, collective, nbytes, on_tensors=impl == "mpi4py_tensor")
    if impl == "gloo":
        return gloo_op(collective, nbytes, comm.size)
    raise ValueError(f"unknown implementation {impl!r}")


def measure(comm: Communicator, sizes: Sequence[int], repeat: int, impls: Sequence[str],
            collectives: Sequence[str], say: Callable[[str], None],
            sample_s: float = 2e-3) -> list[dict[str, Any]]:
    """Raw results: one record per (collective, size, implementation)."""
    records = []
    for collective in collectives:
        for nbytes in sizes:
            calls = {impl: make_op(impl, comm, collective, nbytes) for impl in impls}
            reps = repeats_for(nbytes, repeat)
            start = time.perf_counter()
            # the MPI implementations share one batch length; gloo (slower) gets its own
            groups = [[i for i in impls if i != "gloo"], ["gloo"]]
            samples = time_calls(calls, comm.mpi, repeat=reps, sample_s=sample_s,
                                 inner_groups=groups)
            del calls
            for impl, s in samples.items():
                records.append({"collective": collective, "impl": impl, "bytes": nbytes,
                                "elements": block_elements(nbytes), "inner": s.inner,
                                "repeat": reps, "median_s": s.median,
                                "min_s": float(s.seconds.min()),
                                "samples_s": [float(v) for v in s.seconds]})
            cells = "  ".join(f"{i} {s.median * 1e6:.1f} us" for i, s in samples.items())
            say(f"  {collective:<15}{format_bytes(nbytes):>9}  {cells}  "
                f"({time.perf_counter() - start:.1f} s)")
    return records


def _overheads(ours: dict[int, float], raw: dict[int, float]) -> dict[str, float]:
    """Worst relative overhead at >= 1 MiB and worst added time at <= 4 KiB."""
    out = {}
    large = [100 * (ours[s] / raw[s] - 1) for s in ours if s >= LARGE]
    small = [1e6 * (ours[s] - raw[s]) for s in ours if s <= SMALL]
    if large:
        out["max_overhead_pct_ge_1MiB"] = max(large)
    if small:
        out["max_added_us_le_4KiB"] = max(small)
    return out


def analyse(records: list[dict[str, Any]], impls: Sequence[str],
            stat: str = "median") -> dict[str, Any]:
    """Fits per (collective, implementation) and the three goals per collective.

    ``stat``: which statistic of the samples stands for a time, ``median`` or ``min``.
    """
    by = {(r["collective"], r["impl"], r["bytes"]): r[f"{stat}_s"] for r in records}
    fits: dict[str, dict[str, dict[str, Any]]] = {}
    goals: dict[str, dict[str, Any]] = {}
    for collective in dict.fromkeys(r["collective"] for r in records):
        sizes = sorted({r["bytes"] for r in records if r["collective"] == collective})
        fits[collective] = {}
        for impl in impls:
            alpha, beta = fit_alpha_beta(sizes, [by[collective, impl, s] for s in sizes])
            fits[collective][impl] = {"alpha_us": alpha * 1e6, "beta_s_per_byte": beta,
                                      "bandwidth_GBps": 1 / beta / 1e9 if beta > 0 else None}
        ours = {s: by[collective, "kfac_hpc", s] for s in sizes}
        g: dict[str, Any] = {}
        if "mpi4py" in impls:
            g.update(_overheads(ours, {s: by[collective, "mpi4py", s] for s in sizes}))
            if "max_overhead_pct_ge_1MiB" in g:
                g["overhead_goal_met"] = g["max_overhead_pct_ge_1MiB"] <= GOAL_OVERHEAD_PCT
            if "max_added_us_le_4KiB" in g:
                g["added_latency_goal_met"] = g["max_added_us_le_4KiB"] <= GOAL_ADDED_US
        if "mpi4py_tensor" in impls:
            wrapper = _overheads(ours, {s: by[collective, "mpi4py_tensor", s] for s in sizes})
            g.update({f"wrapper_{k}": v for k, v in wrapper.items()})
        if "gloo" in impls:
            faster = [s for s in sizes if ours[s] < by[collective, "gloo", s]]
            g["faster_than_gloo_sizes"] = f"{len(faster)}/{len(sizes)}"
            g["gloo_goal_met"] = len(faster) == len(sizes)
        goals[collective] = g
    return {"stat": stat, "fits": fits, "goals": goals}


def report(records: list[dict[str, Any]], analysis: dict[str, Any], impls: Sequence[str],
           markdown: bool) -> str:
    """The tables: per collective times and overheads, then fits, then goals."""
    stat = analysis["stat"]
    by = {(r["collective"], r["impl"], r["bytes"]): r[f"{stat}_s"] for r in records}
    out = [f"times: {stat} of the samples"]
    for collective in analysis["fits"]:
        sizes = sorted({r["bytes"] for r in records if r["collective"] == collective})
        headers = ["size"] + [f"{i} us" for i in impls]
        if "mpi4py" in impls:
            headers += ["vs mpi4py %", "added us"]
        if "mpi4py_tensor" in impls:
            headers += ["vs mpi4py_tensor %"]
        if "gloo" in impls:
            headers += ["gloo/kfac_hpc"]
        headers += ["kfac_hpc GB/s"]
        rows = []
        for s in sizes:
            t = {i: by[collective, i, s] for i in impls}
            ours = t["kfac_hpc"]
            row: list[Any] = [format_bytes(s)] + [f"{t[i] * 1e6:.1f}" for i in impls]
            if "mpi4py" in impls:
                row += [f"{100 * (ours / t['mpi4py'] - 1):+.1f}",
                        f"{1e6 * (ours - t['mpi4py']):+.1f}"]
            if "mpi4py_tensor" in impls:
                row += [f"{100 * (ours / t['mpi4py_tensor'] - 1):+.1f}"]
            if "gloo" in impls:
                row += [f"{t['gloo'] / ours:.2f}x"]
            row += [f"{s / ours / 1e9:.3g}"]
            rows.append(row)
        out += [f"\n{collective}:", format_table(headers, rows, markdown)]
    rows = []
    for collective, fits in analysis["fits"].items():
        for impl, f in fits.items():
            bw = f["bandwidth_GBps"]
            rows.append([collective, impl, f"{f['alpha_us']:.1f}",
                         f"{f['beta_s_per_byte']:.3e}", f"{bw:.3g}" if bw else "-"])
    out += ["\nalpha-beta fits (t = alpha + beta * size, least squares on relative error):",
            format_table(["collective", "impl", "alpha us", "beta s/B", "1/beta GB/s"], rows,
                         markdown)]

    def num(v: Any) -> str:
        return "-" if v is None else f"{v:+.1f}"

    def yes(v: Any) -> str:
        return "-" if v is None else ("met" if v else "MISSED")

    rows = []
    for collective, g in analysis["goals"].items():
        rows.append([collective,
                     num(g.get("max_overhead_pct_ge_1MiB")), yes(g.get("overhead_goal_met")),
                     num(g.get("max_added_us_le_4KiB")), yes(g.get("added_latency_goal_met")),
                     g.get("faster_than_gloo_sizes", "-"), yes(g.get("gloo_goal_met")),
                     num(g.get("wrapper_max_overhead_pct_ge_1MiB")),
                     num(g.get("wrapper_max_added_us_le_4KiB"))])
    out += [f"\ngoals (<= {GOAL_OVERHEAD_PCT:g}% over mpi4py at >= 1 MiB; <= "
            f"{GOAL_ADDED_US:g} us added at <= 4 KiB; faster than gloo at every size), "
            "worst size; last two columns: against mpi4py on torch memory:",
            format_table(["collective", "overhead % >=1MiB", "goal", "added us <=4KiB", "goal",
                          "faster than gloo", "goal", "vs tensor-mem % >=1MiB",
                          "vs tensor-mem us <=4KiB"], rows, markdown)]
    return "\n".join(out)


def plot(records: list[dict[str, Any]], analysis: dict[str, Any], impls: Sequence[str],
         title: str, path: Path) -> Path:
    """Time per call vs block size, log-log, one panel per collective."""
    plt = pyplot()
    collectives = list(analysis["fits"])
    cols = min(2, len(collectives))
    rows = (len(collectives) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4.2 * rows), squeeze=False)
    for ax, collective in zip(axes.flat, collectives):
        for impl in impls:
            pts = sorted((r["bytes"], r[f"{analysis['stat']}_s"]) for r in records
                         if r["collective"] == collective and r["impl"] == impl)
            x = np.array([p[0] for p in pts], float)
            ax.loglog(x, [p[1] * 1e6 for p in pts], marker="o", ms=3, label=impl)
        fit = analysis["fits"][collective]["kfac_hpc"]
        ax.loglog(x, (fit["alpha_us"] + fit["beta_s_per_byte"] * 1e6 * x), "k:", lw=1,
                  label="kfac_hpc alpha-beta fit")
        ax.set_title(collective)
        ax.set_xlabel("block size (bytes)")
        ax.set_ylabel(f"time per call, {analysis['stat']} (us)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(collectives):]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=9)
    return save_figure(fig, path)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-bytes", type=parse_bytes, default=None,
                   help="largest block (default 64M; 64K with --quick)")
    p.add_argument("--repeat", type=int, default=None,
                   help="samples per size up to 1 MiB, fewer above (default 20; 3 with --quick)")
    p.add_argument("--quick", action="store_true", help="small sizes, few samples: a smoke run")
    p.add_argument("--sample-ms", type=float, default=None,
                   help="target length of one timing sample (default 2; 0.3 with --quick)")
    p.add_argument("--collectives", nargs="+", choices=COLLECTIVES, default=list(COLLECTIVES))
    p.add_argument("--no-gloo", action="store_true", help="skip torch.distributed gloo")
    p.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    p.add_argument("--stat", choices=("median", "min"), default="median",
                   help="statistic of the samples used for tables, fits and goals (default "
                        "median; min estimates the uncontended cost on a shared machine)")
    p.add_argument("--from-json", type=Path, metavar="PATH",
                   help="re-analyse the raw samples of an earlier run instead of measuring")
    p.add_argument("--out", type=Path, default=OUT_DIR, help=f"output folder (default {OUT_DIR})")
    args = p.parse_args(argv)
    if args.max_bytes is None:
        args.max_bytes = (64 << 10) if args.quick else (64 << 20)
    if args.repeat is None:
        args.repeat = 3 if args.quick else 20
    if args.sample_ms is None:
        args.sample_ms = 0.3 if args.quick else 2.0
    return args


def reanalyse(path: Path, stat: str, markdown: bool) -> int:
    """Print the tables of an earlier run's JSON with another statistic."""
    data = json.loads(path.read_text())
    for r in data["results"]:
        r["median_s"], r["min_s"] = float(np.median(r["samples_s"])), min(r["samples_s"])
    print(f"comm benchmark (from {path}): {describe(data['machine'])}")
    print(report(data["results"], analyse(data["results"], data["impls"], stat), data["impls"],
                 markdown))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json is not None:
        return reanalyse(args.from_json, args.stat, args.markdown)
    install_abort_on_error()
    torch.set_num_threads(1)
    comm = Communicator(name="bench")
    lead = comm.rank == 0

    def say(text: str) -> None:
        if lead:
            print(text, flush=True)

    info = machine()
    impls = [i for i in IMPLS if not (i == "gloo" and args.no_gloo)]
    if "gloo" in impls:
        init_gloo(comm.mpi)
    sizes = block_sizes(args.max_bytes)
    say(f"comm benchmark: {describe(info)}")
    say(f"block sizes {format_bytes(sizes[0])}..{format_bytes(sizes[-1])}, float32, "
        f"{args.repeat} samples (fewer above 1 MiB), {args.stat} of the slowest rank")
    start = time.perf_counter()
    records = measure(comm, sizes, args.repeat, impls, args.collectives, say,
                      args.sample_ms / 1e3)
    analysis = analyse(records, impls, args.stat)
    if "gloo" in impls:
        import torch.distributed as dist

        dist.destroy_process_group()
    if lead:
        print(report(records, analysis, impls, args.markdown))
        stem = args.out / f"comm_n{comm.size}"
        data = {"machine": info, "config": {k: str(v) if isinstance(v, Path) else v
                                            for k, v in vars(args).items()},
                "sizes_bytes": sizes, "impls": impls, "results": records, **analysis,
                "elapsed_s": time.perf_counter() - start,
                "load_average_1m_end": round(os.getloadavg()[0], 2)}
        json_path = write_json(stem.with_suffix(".json"), data)
        png_path = plot(records, analysis, impls, f"collectives: {describe(info)}",
                        stem.with_suffix(".png"))
        print(f"\nwrote {json_path} and {png_path} ({time.perf_counter() - start:.0f} s)")
    comm.mpi.Barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
