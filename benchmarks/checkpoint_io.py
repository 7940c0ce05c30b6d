"""Checkpoint I/O for a ResNet-50-sized K-FAC state at 1, 2 and 4 ranks (issue 6).

    python benchmarks/checkpoint_io.py            # launches 1, 2, 4 ranks, writes RESULTS.md
    launch/local -n 4 python benchmarks/checkpoint_io.py --worker OUT.json DIR   # one size

Factor shapes come from ResNet-50's layers (torchvision layout: 53 convolutions and
the classifier): A is (in_ch*k*k + 1)^2 and G is out_ch^2 (fp32). Factors are spread
over the ranks by LPT on n^3 (mem-opt). For each world size we time

* ``save``: ``kfac_hpc.checkpoint.save`` (collective, fsync'd, fletcher32 + CRC-32),
  and the same with ``fletcher32=False`` (CRC-32 only);
* ``raw``: one process writing the same arrays with plain h5py (contiguous, no
  checksums) and fsync - the throughput goal is save >= 0.8 x raw;
* ``load``: ``kfac_hpc.checkpoint.load`` with ``read_mode`` ``"root"``, ``"owners"``
  and ``"all"``,
  after dropping the file from the page cache (``posix_fadvise(DONTNEED)``), and a
  raw h5py read of every dataset (also from a cold cache).

Best of ``--repeats`` runs (other jobs on a shared machine only add time). The results
go to ``benchmarks/RESULTS.md`` under "## Checkpoint I/O (issue 6)" (the section is
replaced when it exists).

``--stall`` (issue 15) measures instead how long training stalls for one checkpoint of
the same state: a stand-in training loop (matmuls of ~``--step-ms`` per step on every
rank, one allreduce per step) runs ``--steps`` steps with one checkpoint in the middle,
written in the foreground (``checkpoint.save``) or in the background
(``checkpoint.BackgroundSaver``: snapshot, then a writer thread); the stall is the wall
time beyond the same loop without a checkpoint, and "blocked" the time the ``save``
call itself took. ``--idle-steps``: the steps sleep instead (the host of a GPU-bound
run, whose CPU cores are free for the writer). It prints a JSON line per world size
and a table (RESULTS.md is not touched).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from kfac_hpc.kfac.state import KFACStateDict

ROOT = Path(__file__).resolve().parents[1]
HEADING = "## Checkpoint I/O (issue 6)"


def resnet50_layers() -> list[tuple[str, int, int, int]]:
    """(name, in_channels, out_channels, kernel size) of ResNet-50's conv/linear layers."""
    layers = [("conv1", 3, 64, 7)]
    cin = 64
    for stage, (width, blocks) in enumerate([(64, 3), (128, 4), (256, 6), (512, 3)], start=1):
        for b in range(blocks):
            name = f"layer{stage}.{b}"
            layers += [(f"{name}.conv1", cin, width, 1), (f"{name}.conv2", width, width, 3),
                       (f"{name}.conv3", width, width * 4, 1)]
            if b == 0:
                layers.append((f"{name}.downsample.0", cin, width * 4, 1))
            cin = width * 4
    layers.append(("fc", 2048, 1000, 1))
    return layers


def factor_dims() -> dict[str, tuple[int, int]]:
    """Layer -> (A dim, G dim) with A = in_ch*k*k + 1 and G = out_ch."""
    return {n: (cin * k * k + 1, cout) for n, cin, cout, k in resnet50_layers()}


def best(times: Iterable[float]) -> float:
    """Best of the repeats: on a shared machine other jobs only ever add time."""
    return min(times)


def drop_cache(path: Path) -> None:
    """Evict ``path`` from the page cache (only this file)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class BenchKFAC:
    """The preconditioner contract with random factors of the given shapes."""

    def __init__(self, comm: Any, dims: dict[str, tuple[int, int]], seed: int = 0) -> None:
        import torch

        from kfac_hpc.assignment import cubic_cost, lpt_assign

        self.comm = comm
        self.shape = {f"{n}/{f}": d for n, (a, g) in dims.items() for f, d in (("A", a), ("G", g))}
        self.owner = lpt_assign([(k, cubic_cost(d)) for k, d in self.shape.items()], comm.size)
        gen = torch.Generator().manual_seed(seed + comm.rank)
        self.factors = {k: torch.randn(d, d, generator=gen) for k, d in self.shape.items()
                        if self.owner[k] == comm.rank}
        self.loaded: dict[str, Any] = {}

    def factor_keys(self) -> list[str]:
        return list(self.shape)

    def factor_owner(self, key: str) -> int:
        return self.owner[key]

    def factor_shape(self, key: str) -> tuple[int, int]:
        return (self.shape[key], self.shape[key])

    def state_dict(self, *, eigenbases: bool = False) -> KFACStateDict:
        """The owned factors (random; no decompositions, whatever ``eigenbases`` asks)."""
        return cast("KFACStateDict", {
            "step": 1, "factors": dict(self.factors),
            "factor_updates": dict.fromkeys(self.factors, 1),
            "config": {"strategy": "mem-opt", "world_size": self.comm.size}})

    def load_state_dict(self, state: KFACStateDict, /) -> None:
        self.loaded = {k: state["factors"][k] for k in self.factors}


def worker(out: Path, directory: Path, repeats: int) -> None:
    """One world size (run under mpiexec). Every repeat runs every variant once, in
    turn (save variants, raw write, loads, raw read), so load from other jobs on a
    shared machine hits all variants alike; the best time of each is kept."""
    import h5py
    import torch
    from torch import nn

    from kfac_hpc import checkpoint
    from kfac_hpc.comm import world

    comm = world()
    torch.set_num_threads(1)
    dims = factor_dims()
    pre = BenchKFAC(comm, dims)
    model = nn.Linear(1, 1)
    d = directory / f"p{comm.size}"
    raw = directory / "raw.h5"
    arrays: dict[str, Any] = {}
    if comm.rank == 0:  # raw h5py: the same arrays, one process, no checksums
        gen = torch.Generator().manual_seed(0)
        arrays = {k: torch.randn(n, n, generator=gen).numpy() for k, n in pre.shape.items()}
    times: dict[str, list[float]] = {}
    results_bytes = 0

    def timed(label: str, fn: Any) -> Any:
        comm.barrier()
        t0 = time.perf_counter()
        result = fn()
        comm.barrier()
        times.setdefault(label, []).append(time.perf_counter() - t0)
        return result

    def raw_write() -> None:
        if comm.rank == 0:
            with h5py.File(raw, "w") as f:
                for k, a in arrays.items():
                    f.create_dataset(k, data=a)
            fd = os.open(raw, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)

    def raw_read() -> None:
        if comm.rank == 0:
            with h5py.File(raw, "r") as f:
                for k in arrays:
                    f[k][()]

    variants = (("save", True, False), ("save_crc_only", False, False),
                ("save_prefetch", True, True))
    step = 0
    for _ in range(repeats):
        for label, fletcher, prefetch in variants:
            step += 1
            timed(label, lambda s=step, f=fletcher, p=prefetch: checkpoint.save(
                d, model=model, optimizer=None, preconditioner=pre, step=s, comm=comm,
                keep_last=None, fletcher32=f, prefetch=p))
            if label != "save" and comm.rank == 0:
                checkpoint.list_checkpoints(d)[-1].unlink()  # pruning is timed separately
        path = Path(comm.broadcast_object(  # the default variant's file
            str(checkpoint.list_checkpoints(d)[-1]) if comm.rank == 0 else None))
        timed("raw_write", raw_write)
        for mode in ("root", "owners", "all"):
            fresh = BenchKFAC(comm, dims, seed=1)
            if comm.rank == 0:
                drop_cache(path)
            timed(f"load_{mode}", lambda fresh=fresh, mode=mode, path=path: checkpoint.load(
                path, model=model, optimizer=None, preconditioner=fresh, comm=comm,
                read_mode=mode))
            assert all(torch.equal(fresh.loaded[k], pre.factors[k]) for k in pre.factors)
        if comm.rank == 0:
            drop_cache(raw)
        timed("raw_read", raw_read)
        if comm.rank == 0:
            results_bytes = path.stat().st_size
            t0 = time.perf_counter()
            path.unlink()
            times.setdefault("unlink", []).append(time.perf_counter() - t0)
            raw.unlink()
    if comm.rank == 0:
        results: dict[str, Any] = {"ranks": comm.size, **{k: best(v) for k, v in times.items()},
                                   "file_bytes": results_bytes,
                                   "factor_bytes": sum(a.nbytes for a in arrays.values()),
                                   "factors": len(arrays), "layers": len(dims)}
        out.write_text(json.dumps(results))


def stall_worker(out: Path, directory: Path, repeats: int, steps: int, step_ms: float,
                 idle: bool = False) -> None:
    """Training stall of one checkpoint, foreground vs background (run under mpiexec)."""
    import torch
    from torch import nn

    from kfac_hpc import checkpoint
    from kfac_hpc.comm import world

    comm = world()
    torch.set_num_threads(1)
    pre = BenchKFAC(comm, factor_dims())
    model = nn.Linear(1, 1)
    x = torch.randn(256, 256)
    flag = torch.zeros(1)
    n = 1  # matmuls per step, calibrated to ~step_ms
    t0 = time.perf_counter()
    for _ in range(20):
        x @ x
    per = (time.perf_counter() - t0) / 20
    n = max(1, round(step_ms / 1000 / per))
    saver = checkpoint.BackgroundSaver(comm)

    def loop(mode: str, step0: int) -> tuple[float, float, float]:
        comm.barrier()
        blocked, longest = 0.0, 0.0
        t_start = time.perf_counter()
        for s in range(steps):
            t_step = time.perf_counter()
            if idle:  # the host waits for an accelerator: the CPU is free meanwhile
                time.sleep(step_ms / 1000)
            else:
                for _ in range(n):
                    x @ x
            comm.allreduce(flag)
            if s == steps // 4 and mode != "none":
                tb = time.perf_counter()
                if mode == "foreground":
                    checkpoint.save(directory, model=model, optimizer=None, preconditioner=pre,
                                    step=step0 + s, comm=comm, keep_last=2,
                                    store_eigenbases=False)
                else:
                    saver.save(directory, model=model, optimizer=None, preconditioner=pre,
                               step=step0 + s, keep_last=2, store_eigenbases=False)
                blocked = time.perf_counter() - tb
            longest = max(longest, time.perf_counter() - t_step)
        total = time.perf_counter() - t_start
        if mode == "background":
            saver.wait()  # after the loop (the write normally ended during it)
        comm.barrier()
        return total, blocked, longest

    times: dict[str, list[tuple[float, float, float]]] = {}
    step0 = 0
    for _ in range(repeats):
        for mode in ("none", "foreground", "background"):
            step0 += steps
            times.setdefault(mode, []).append(loop(mode, step0))
    saver.close()
    if comm.rank == 0:
        base = min(t for t, _, _ in times["none"])
        res: dict[str, Any] = {"ranks": comm.size, "steps": steps,
                               "step_s": base / steps,
                               "state_bytes": sum(d * d * 4 for d in pre.shape.values())}
        for mode in ("foreground", "background"):
            best_total = min(t for t, _, _ in times[mode])
            res[f"{mode}_stall_s"] = best_total - base
            res[f"{mode}_blocked_s"] = min(b for _, b, _ in times[mode])
            res[f"{mode}_longest_step_s"] = min(m for _, _, m in times[mode])
        out.write_text(json.dumps(res))


def run_stall(ranks: list[int], repeats: int, steps: int, step_ms: float, idle: bool = False
              ) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        for n in ranks:
            out = Path(tmp) / f"s{n}.json"
            cmd = [str(ROOT / "launch" / "local"), "-n", str(n), "--timeout", "900",
                   sys.executable, "-m", "mpi4py", __file__, "--stall-worker", str(out),
                   str(Path(tmp) / f"ck{n}"), "--repeats", str(repeats), "--steps", str(steps),
                   "--step-ms", str(step_ms), *(["--idle-steps"] if idle else [])]
            subprocess.run(cmd, check=True, cwd=ROOT)
            rows.append(json.loads(out.read_text()))
            print(json.dumps(rows[-1]), flush=True)
    print("| ranks | step ms | state GB | foreground: stall s | blocked s | "
          "background: stall s | blocked s | longest step s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['ranks']} | {1000 * r['step_s']:.0f} | {r['state_bytes'] / 1e9:.2f} | "
              f"{r['foreground_stall_s']:.2f} | {r['foreground_blocked_s']:.2f} | "
              f"{r['background_stall_s']:.2f} | {r['background_blocked_s']:.2f} | "
              f"{r['background_longest_step_s']:.2f} |")
    return rows


def run_all(ranks: list[int], repeats: int, results_md: Path) -> list[dict[str, Any]]:
    rows = []
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        for n in ranks:
            out = Path(tmp) / f"r{n}.json"
            cmd = [str(ROOT / "launch" / "local"), "-n", str(n), "--timeout", "900",
                   sys.executable, "-m", "mpi4py", __file__, "--worker", str(out), tmp,
                   "--repeats", str(repeats)]
            subprocess.run(cmd, check=True, cwd=ROOT)
            rows.append(json.loads(out.read_text()))
            print(json.dumps(rows[-1]), flush=True)
            load.append(os.getloadavg()[0])
    write_results(rows, results_md, repeats, (min(load), max(load)))
    return rows


def write_results(rows: list[dict[str, Any]], results_md: Path, repeats: int,
                  load: tuple[float, float]) -> None:
    import h5py

    gb = rows[0]["factor_bytes"] / 1e9
    lines = [HEADING, "",
             f"`python benchmarks/checkpoint_io.py` - ResNet-50 K-FAC factors ({rows[0]['layers']} "
             f"layers, {rows[0]['factors']} factors, {gb:.3f} GB fp32; A = in_ch*k*k+1, "
             "G = out_ch), spread over the ranks by LPT (mem-opt). Local disk, "
             f"{os.cpu_count()} cores, ranks oversubscribed; h5py {h5py.__version__} (serial), "
             f"HDF5 {h5py.version.hdf5_version}, Python {platform.python_version()}; best of "
             f"{repeats}, variants interleaved (the machine was shared with other jobs: load "
             f"average {load[0]:.0f}-{load[1]:.0f} on {os.cpu_count()} cores). Writes include "
             "fsync; reads start from a cold page cache for the file (posix_fadvise DONTNEED). "
             "\"x raw\" = raw h5py time / checkpoint time for the same bytes (goal >= 0.8).", "",
             "| ranks | save s (GB/s) | x raw | CRC only s | x raw | prefetch s | x raw | "
             "raw write s | load: root s | owners s | all s | raw read s | file/data |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        fb, raw = r["factor_bytes"], r["raw_write"]
        lines.append(
            f"| {r['ranks']} | {r['save']:.2f} ({fb / r['save'] / 1e9:.2f}) | "
            f"{raw / r['save']:.2f} | {r['save_crc_only']:.2f} | "
            f"{raw / r['save_crc_only']:.2f} | {r['save_prefetch']:.2f} | "
            f"{raw / r['save_prefetch']:.2f} | {raw:.2f} | {r['load_root']:.2f} | "
            f"{r['load_owners']:.2f} | {r['load_all']:.2f} | {r['raw_read']:.2f} | "
            f"{r['file_bytes'] / fb:.3f} |")
    unlink = best(r["unlink"] for r in rows)
    lines += ["", "save: the default (fletcher32 + CRC-32, rank 0 holds one remote factor at "
              "a time); CRC only: `fletcher32=False`; prefetch: `prefetch=True` (receives the "
              "next factor while writing). raw: one process writes the same arrays with plain "
              "h5py (contiguous, no checksums) and fsyncs. Not in the save times: pruning an old "
              f"checkpoint (`keep_last`) unlinks a file, {unlink:.2f} s for one of this size. "
              "load: `read_mode` root (rank 0 reads and sends), owners (each rank reads its "
              "factors; rank 0 reads and broadcasts replicated state), all (every rank "
              "reads everything it needs).", ""]
    text = results_md.read_text() if results_md.exists() else "# Benchmark results\n"
    if HEADING in text:
        head, rest = text.split(HEADING, 1)
        tail = rest.split("\n## ", 1)
        text = head + "\n".join(lines) + ("\n## " + tail[1] if len(tail) > 1 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + "\n".join(lines)
    results_md.write_text(text.rstrip("\n") + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", nargs=2, metavar=("OUT", "DIR"), help=argparse.SUPPRESS)
    ap.add_argument("--ranks", default="1,2,4", help="world sizes (default 1,2,4)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "RESULTS.md"))
    ap.add_argument("--stall", action="store_true",
                    help="training stall of one checkpoint, foreground vs background")
    ap.add_argument("--stall-worker", nargs=2, metavar=("OUT", "DIR"), help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=200, help="--stall: steps per loop")
    ap.add_argument("--step-ms", type=float, default=50.0, help="--stall: compute per step")
    ap.add_argument("--idle-steps", action="store_true",
                    help="--stall: steps sleep instead of computing (a GPU-bound run's host)")
    args = ap.parse_args()
    if args.worker:
        worker(Path(args.worker[0]), Path(args.worker[1]), args.repeats)
        return
    if args.stall_worker:
        stall_worker(Path(args.stall_worker[0]), Path(args.stall_worker[1]), args.repeats,
                     args.steps, args.step_ms, args.idle_steps)
        return
    if args.stall:
        run_stall([int(x) for x in args.ranks.split(",")], args.repeats, args.steps,
                  args.step_ms, args.idle_steps)
        return
    run_all([int(x) for x in args.ranks.split(",")], args.repeats, Path(args.results))


if __name__ == "__main__":
    main()
