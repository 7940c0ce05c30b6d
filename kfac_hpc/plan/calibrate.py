"""``kfac-hpc calibrate``: measure this machine and write a planner profile (JSON).

Run it the way the training job runs (same ranks per node, same launcher)::

    launch/local -n 4 kfac-hpc calibrate --out my-cluster.json
    srun -N 16 --ntasks-per-node 4 kfac-hpc calibrate --out my-cluster.json --merge

* network (more than one rank): for allreduce, reduce-scatter, broadcast and allgather,
  the Communicator's time per call at a few sizes (the slowest rank's, median of
  samples; :func:`kfac_hpc.comm.selfcheck.time_calls`), fitted by least squares on
  relative error to the ring formula of :mod:`kfac_hpc.plan.collectives` at this world
  size: ``t = a(P)·α + b(P)·n·β``;
* compute, measured on every rank at once (so a shared node is measured shared), the
  slowest rank counting: matrix-product rate, memory bandwidth (a large copy), the time
  of a tiny tensor operation, of a tiny module's forward+backward and of an SGD update
  per parameter tensor, the rate of building a Conv2d's patch matrix (unfold),
  ``eigh_clamped`` and ``damped_inverse`` of the library at several sizes, and the
  forward+backward rate of a small conv net (FLOPs of its conv and linear layers per
  second), and what a blocking collective costs beyond α–β when ranks reach it from
  computation (``sync_overhead_s``: scheduling and arrival skew).

``--merge`` adds the measurement to an existing profile as its ``by_ranks`` entry for
this world size (the first measurement also becomes the profile's base values).
"""

from __future__ import annotations

import argparse
import math
import socket
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from mpi4py import MPI
from torch import nn

from kfac_hpc.comm import Communicator
from kfac_hpc.files import write_text_atomic
from kfac_hpc.plan.collectives import COLLECTIVES, LinkCost, coefficients
from kfac_hpc.plan.profile import ComputeRates, Profile, load_profile

__all__ = ["add_arguments", "fit_alpha_beta", "measure_compute", "measure_network", "run"]

NETWORK_SIZES = (8, 4 << 10, 64 << 10, 512 << 10, 4 << 20)
QUICK_NETWORK_SIZES = (8, 64 << 10, 1 << 20)
DECOMP_SIZES = (16, 32, 64, 128, 256, 512, 1024)
QUICK_DECOMP_SIZES = (16, 64, 256)


def fit_alpha_beta(kind: str, p: int, samples: Sequence[tuple[float, float]]) -> LinkCost:
    """Fit α and β of ``t = a·α + b·n·β`` (ring coefficients at ``p``) to timings.

    Least squares on the relative error; both are kept >= 0.

    Args:
        kind: The collective, one of :data:`~kfac_hpc.plan.collectives.COLLECTIVES`.
        p: The number of ranks the samples were measured on.
        samples: ``(bytes, seconds)`` per call.

    Returns:
        α (s/message) and β (s/byte), with the ring algorithm.
    """
    _, c = coefficients(kind, p, "ring")
    n = np.array([s[0] for s in samples], dtype=float)
    t = np.array([s[1] for s in samples], dtype=float)
    design = np.stack([np.full_like(n, c.latency), c.bandwidth * n], axis=1) / t[:, None]
    alpha, beta = np.linalg.lstsq(design, np.ones_like(t), rcond=None)[0]
    if alpha < 0:
        alpha, beta = 0.0, float(np.sum(design[:, 1]) / np.sum(design[:, 1] ** 2))
    if beta < 0:
        beta, alpha = 0.0, float(np.sum(design[:, 0]) / np.sum(design[:, 0] ** 2))
    return LinkCost(float(alpha), float(beta), "ring")


def measure_network(comm: Communicator, sizes: Sequence[int], repeat: int
                    ) -> tuple[dict[str, LinkCost], list[dict[str, Any]]]:
    """Measure and fit α–β per collective (collective over ``comm``).

    Args:
        comm: The ranks to measure on.
        sizes: Block sizes in bytes.
        repeat: Samples per collective and size.

    Returns:
        The fitted cost per collective, and the raw samples (bytes in the counters'
        convention).
    """
    from kfac_hpc.comm.selfcheck import communicator_op, time_calls

    raw: list[dict[str, Any]] = []
    for block in sizes:
        calls = {c: communicator_op(comm, c, block) for c in COLLECTIVES}
        timed = time_calls(calls, comm.mpi, repeat=repeat)
        for kind, s in timed.items():
            nbytes = block * comm.size if kind in ("reduce_scatter", "allgather") else block
            raw.append({"collective": kind, "bytes": nbytes, "seconds": s.median})
    links = {kind: fit_alpha_beta(kind, comm.size, [(r["bytes"], r["seconds"])
                                                    for r in raw if r["collective"] == kind])
             for kind in COLLECTIVES}
    return links, raw


def _slowest(mpi: MPI.Comm, fn: Callable[[], object], repeat: int, inner: int = 0,
             sample_s: float = 0.05) -> float:
    """Time the seconds per call with every rank calling at once.

    Each rank takes its mean over ``repeat`` samples (after a barrier), then the slowest
    rank's mean is the result. A sample repeats the call for at least ``sample_s``
    seconds (``inner=0``; the count agreed over ranks), so that time-sharing of
    oversubscribed cores averages out as in a real step. The mean, not the median: a
    training step is a sum of many calls and pays its share of descheduled time;
    per-sample maxima over ranks would instead charge every call the worst rank's hiccup.
    """
    fn()
    if inner <= 0:
        t0 = time.perf_counter()
        fn()
        first = time.perf_counter() - t0
        inner = int(mpi.allreduce(max(1, min(1000, math.ceil(sample_s / max(first, 1e-9)))),
                                  op=MPI.MAX))
    values = []
    for _ in range(repeat):
        mpi.Barrier()
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        values.append((time.perf_counter() - t0) / inner)
    return float(mpi.allreduce(float(np.mean(values)), op=MPI.MAX))


def measure_sync(mpi: MPI.Comm, repeat: int) -> float:
    """Measure what a blocking collective costs beyond α–β when ranks reach it from computation.

    Scheduling and arrival skew; large on oversubscribed nodes. Collective over ``mpi``.

    Args:
        mpi: The ranks to measure on.
        repeat: Samples.

    Returns:
        Seconds per collective call (0 on one rank).
    """
    if mpi.Get_size() == 1:
        return 0.0
    x = torch.randn(192, 192)
    flag = np.zeros(1)

    def work() -> None:
        for _ in range(4):
            torch.mm(x, x)

    def work_then_allreduce() -> None:
        work()
        mpi.Allreduce(MPI.IN_PLACE, flag, op=MPI.SUM)

    def allreduce() -> None:
        mpi.Allreduce(MPI.IN_PLACE, flag, op=MPI.SUM)

    pair = _slowest(mpi, work_then_allreduce, repeat, inner=10)
    alone = _slowest(mpi, work, repeat, inner=10)
    bare = _slowest(mpi, allreduce, repeat, inner=10)
    return max(0.0, pair - alone - bare)


def _spd(n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    x = torch.randn(4 * n, n, generator=g)
    return x.t() @ x / (4 * n)


def probe_net() -> tuple[nn.Module, tuple[int, ...]]:
    """Build the small conv net whose forward+backward rate calibrates ``train_flops``.

    Returns:
        The model and its input batch shape.
    """
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(16, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    return net, (16, 16, 16)


def measure_compute(mpi: MPI.Comm, decomp_sizes: Sequence[int], repeat: int,
                    report: Callable[[str], None] = lambda _: None) -> ComputeRates:
    """Measure the compute rates of one rank with every rank of ``mpi`` working at the same time.

    Collective over ``mpi`` (the slowest rank's times count).

    Args:
        mpi: The ranks that work at once.
        decomp_sizes: Matrix orders at which eigh and inverse are timed.
        repeat: Samples per measurement.
        report: Sees a line of progress per measurement.

    Returns:
        The rates; ``overlap_efficiency`` is 0 (not measured).
    """
    from kfac_hpc.kfac import linalg
    from kfac_hpc.plan.model_shapes import model_spec

    a, b, c = torch.randn(8, 8), torch.randn(8, 8), torch.empty(8, 8)

    def tiny() -> None:
        for _ in range(10):
            torch.add(a, b, out=c)
            c.mul_(0.5)

    op = _slowest(mpi, tiny, repeat) / 20
    report(f"op overhead {op * 1e6:.1f} us")
    gemm_rates = []
    for rows, cols in ((4096, 256), (512, 512), (2048, 128)):
        x = torch.randn(rows, cols)
        t = _slowest(mpi, partial(torch.mm, x.t(), x), repeat)
        gemm_rates.append(2 * rows * cols * cols / t)
    gemm = statistics.median(gemm_rates)
    report(f"gemm {gemm / 1e9:.1f} GFLOP/s")
    src, dst = torch.randn(4 << 20), torch.empty(4 << 20)
    bandwidth = 2 * src.nbytes / _slowest(mpi, lambda: dst.copy_(src), repeat)
    report(f"memory {bandwidth / 1e9:.1f} GB/s")
    eigh, inverse = [], []
    for n in decomp_sizes:
        f = _spd(n)
        reps = max(3, repeat // 2) if n >= 512 else repeat
        eigh.append((n, _slowest(mpi, partial(linalg.eigh_clamped, f), reps)))
        inverse.append((n, _slowest(mpi, partial(linalg.damped_inverse, f, 1e-3), reps)))
        report(f"n={n}: eigh {eigh[-1][1] * 1e3:.2f} ms, inverse {inverse[-1][1] * 1e3:.2f} ms")
    from kfac_hpc.kfac.layers import curvature_for

    conv = nn.Conv2d(16, 16, 3, padding=1, bias=False)
    curv = curvature_for(conv)
    assert curv is not None
    patches = torch.randn(32, 16, 32, 32)
    unfold_s = _slowest(mpi, partial(curv.a_rows, patches), repeat)
    im2col = 32 * 32 * 32 * curv.weight_cols * 4 / unfold_s
    report(f"im2col {im2col / 1e9:.2f} GB/s")
    net, shape = probe_net()
    spec = model_spec(net, input_shape=shape)
    x = torch.randn(32, *shape)
    y = torch.randint(0, 10, (32,))

    def train_step() -> None:
        net.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()

    torch.manual_seed(0)
    tiny_net = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(4, 4), nn.ReLU())])
    tiny_x = torch.randn(1, 4)
    tiny_opt = torch.optim.SGD(tiny_net.parameters(), lr=0.0)

    def tiny_step() -> None:
        tiny_net.zero_grad()
        tiny_net(tiny_x).sum().backward()

    module = _slowest(mpi, tiny_step, repeat) / 12
    param = _slowest(mpi, tiny_opt.step, repeat) / 12
    report(f"per module (fwd+bwd) {module * 1e6:.1f} us, per parameter (SGD) "
           f"{param * 1e6:.1f} us")
    t = _slowest(mpi, train_step, repeat)
    flops = 3 * sum(2.0 * 32 * s.rows_per_sample * s.weight_cols * s.g_dim for s in spec.layers)
    framework = spec.leaf_modules * module
    train = flops / max(t - framework, 0.2 * t)
    report(f"train {train / 1e9:.1f} GFLOP/s (forward+backward {t * 1e3:.2f} ms)")
    sync = measure_sync(mpi, repeat)
    report(f"collective after compute: {sync * 1e6:.1f} us beyond alpha-beta")
    return ComputeRates(train_flops=train, gemm_flops=gemm, mem_bandwidth=bandwidth,
                        op_overhead_s=op, eigh=tuple(eigh), inverse=tuple(inverse),
                        overlap_efficiency=0.0, im2col_bandwidth=im2col,
                        module_overhead_s=module, param_overhead_s=param,
                        sync_overhead_s=sync)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``kfac-hpc calibrate`` options to ``parser``.

    Args:
        parser: The subcommand's parser.
    """
    parser.add_argument("--out", type=Path, default=Path("kfac-hpc-profile.json"),
                        help="profile file to write (default ./kfac-hpc-profile.json)")
    parser.add_argument("--name", default=None,
                        help="profile name (default calibrated-<host of rank 0>)")
    parser.add_argument("--merge", action="store_true",
                        help="add this world size to an existing --out profile")
    parser.add_argument("--repeat", type=int, default=7, help="samples per measurement")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per rank while measuring (default 1; use the "
                             "training job's setting)")
    parser.add_argument("--overlap-efficiency", type=float, default=0.0,
                        help="fraction of compute that hook-started communication hides "
                             "behind (not measured; default 0: CPU MPI progresses only "
                             "inside MPI calls)")
    parser.add_argument("--quick", action="store_true", help="fewer sizes (a smoke run)")


def run(args: argparse.Namespace) -> int:
    """Run ``kfac-hpc calibrate``: measure this machine and write (or merge) a profile on rank 0.

    Collective over the world.

    Args:
        args: The parsed options.

    Returns:
        The exit status (0).
    """
    from kfac_hpc.comm import install_abort_on_error

    install_abort_on_error()
    comm = Communicator(MPI.COMM_WORLD.Dup(), name="calibrate")
    torch.set_num_threads(args.threads)
    rank, size = comm.rank, comm.size

    def say(text: str) -> None:
        if rank == 0:
            print(text, flush=True)

    say(f"# kfac-hpc calibrate: {size} rank(s), {args.threads} torch thread(s) per rank")
    compute = measure_compute(comm.mpi, QUICK_DECOMP_SIZES if args.quick else DECOMP_SIZES,
                              3 if args.quick else args.repeat, say)
    compute = ComputeRates(**{**compute.__dict__,
                              "overlap_efficiency": args.overlap_efficiency})
    raw: list[dict[str, Any]] = []
    if size > 1:
        network, raw = measure_network(comm, QUICK_NETWORK_SIZES if args.quick
                                       else NETWORK_SIZES, 3 if args.quick else args.repeat)
        for kind, link in network.items():
            say(f"{kind:>15}: alpha {link.alpha * 1e6:8.2f} us, "
                f"beta {link.beta * 1e9:8.4f} s/GB ({1 / max(link.beta, 1e-30) / 1e9:.2f} GB/s)")
    else:
        network = {k: LinkCost(0.0, 0.0, "ring") for k in COLLECTIVES}
        say("one rank: no network measured (collectives cost nothing at world size 1)")
    host = comm.mpi.bcast(socket.gethostname(), 0)
    entry = {"network": network, "compute": compute}
    if rank == 0:
        base: Profile | None = None
        if args.merge and args.out.is_file():
            base = load_profile(args.out)
        if base is None:
            base = Profile(name=args.name or f"calibrated-{host}", network=network,
                           compute=compute, source="calibrated",
                           description=f"measured by kfac-hpc calibrate on {host}",
                           assumptions=("overlap_efficiency is not measured "
                                        f"(set to {args.overlap_efficiency})",))
        by_ranks = {**base.by_ranks, size: entry}
        profile = Profile(**{**base.__dict__, "by_ranks": by_ranks})
        profile.save(args.out)
        if raw:
            raw_path = args.out.with_suffix(f".n{size}.samples.json")
            import json

            write_text_atomic(raw_path, json.dumps(raw, indent=1) + "\n")
        say(f"wrote {args.out} (world size {size})")
    comm.mpi.Barrier()
    return 0


if __name__ == "__main__":  # pragma: no cover
    parser = argparse.ArgumentParser(prog="kfac-hpc calibrate")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
