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

``--device`` says where (``auto``, the default: each rank's GPU when every rank has
one, as ``kfac-hpc train`` picks it, else the CPU). On a GPU the compute probes run
there, synchronised before each clock read, at sizes that fill a GPU
(:data:`PROBES`), its products at the library's default precision for float32 there
(TF32 on CUDA), the collectives on device buffers (the Communicator stages or passes
them as it would in training), and the profile's memory per rank is the GPU's memory
shared among the ranks using it.

``--merge`` adds the measurement to an existing profile as its ``by_ranks`` entry for
this world size (the first measurement also becomes the profile's base values).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import socket
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
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
from kfac_hpc.plan.profile import DEFAULT_PROFILE, ComputeRates, Profile, load_profile
from kfac_hpc.runtime.device import synchronizer

__all__ = ["PROBES", "ProbeSizes", "add_arguments", "calibration_device", "describe_device",
           "fit_alpha_beta", "gpu_identity", "gpu_memory_per_rank", "measure_compute",
           "measure_decomposition_concurrency", "measure_network", "probe_sizes",
           "recorded_device", "run"]

NETWORK_SIZES = (8, 4 << 10, 64 << 10, 512 << 10, 4 << 20)
QUICK_NETWORK_SIZES = (8, 64 << 10, 1 << 20)
DECOMP_SIZES = (16, 32, 64, 128, 256, 512, 1024)
QUICK_DECOMP_SIZES = (16, 64, 256)
CPU = torch.device("cpu")


@dataclass(frozen=True)
class ProbeSizes:
    """The sizes of the compute probes on one kind of device.

    Attributes:
        gemm: ``(rows, cols)`` of the ``xᵀx`` products whose median rate is ``gemm_flops``.
        copy_elements: float32 elements of the copy that measures memory bandwidth.
        decompositions: Matrix orders at which ``eigh`` and the inverse are timed.
        quick_decompositions: The orders of ``--quick``.
        train_batch: The batch of the probe net's forward+backward (``train_flops``).
        train_image: Its input's height and width.
    """

    gemm: tuple[tuple[int, int], ...]
    copy_elements: int
    decompositions: tuple[int, ...]
    quick_decompositions: tuple[int, ...]
    train_batch: int
    train_image: int


#: The probes' sizes by device type: a GPU needs larger ones to be busy rather than
#: launch-bound, and K-FAC's GPU runs decompose larger factors (ResNet-50: up to 4608).
PROBES = {
    "cpu": ProbeSizes(gemm=((4096, 256), (512, 512), (2048, 128)), copy_elements=4 << 20,
                      decompositions=DECOMP_SIZES, quick_decompositions=QUICK_DECOMP_SIZES,
                      train_batch=32, train_image=16),
    "cuda": ProbeSizes(gemm=((65536, 512), (16384, 1024), (8192, 2048)), copy_elements=64 << 20,
                       decompositions=(*DECOMP_SIZES, 2048, 4096),
                       quick_decompositions=(64, 256, 1024), train_batch=256, train_image=32),
}


def probe_sizes(device: torch.device) -> ProbeSizes:
    """The probes' sizes on ``device`` (a GPU's, or the CPU's for any other device)."""
    return PROBES["cuda" if device.type == "cuda" else "cpu"]


#: The clock of the probes (a module attribute, so a test can stand in for it).
_clock = time.perf_counter


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


def measure_network(comm: Communicator, sizes: Sequence[int], repeat: int,
                    device: torch.device = CPU
                    ) -> tuple[dict[str, LinkCost], list[dict[str, Any]]]:
    """Measure and fit α–β per collective (collective over ``comm``).

    Args:
        comm: The ranks to measure on.
        sizes: Block sizes in bytes.
        repeat: Samples per collective and size.
        device: Where the buffers live (a GPU's: the Communicator stages them or hands
            them to MPI as it would in training).

    Returns:
        The fitted cost per collective, and the raw samples (bytes in the counters'
        convention).
    """
    from kfac_hpc.comm.selfcheck import communicator_op, time_calls

    raw: list[dict[str, Any]] = []
    for block in sizes:
        calls = {c: communicator_op(comm, c, block, device=device) for c in COLLECTIVES}
        timed = time_calls(calls, comm.mpi, repeat=repeat, sync=synchronizer(device))
        for kind, s in timed.items():
            nbytes = block * comm.size if kind in ("reduce_scatter", "allgather") else block
            raw.append({"collective": kind, "bytes": nbytes, "seconds": s.median})
    links = {kind: fit_alpha_beta(kind, comm.size, [(r["bytes"], r["seconds"])
                                                    for r in raw if r["collective"] == kind])
             for kind in COLLECTIVES}
    return links, raw


def _slowest(mpi: MPI.Comm, fn: Callable[[], object], repeat: int, inner: int = 0,
             sample_s: float = 0.05, device: torch.device = CPU) -> float:
    """Time the seconds per call with every rank calling at once.

    On a GPU the device is synchronised before each clock read, so a call's time is its
    kernels' as much as its launches'.

    Each rank takes its mean over ``repeat`` samples (after a barrier), then the slowest
    rank's mean is the result. A sample repeats the call for at least ``sample_s``
    seconds (``inner=0``; the count agreed over ranks), so that time-sharing of
    oversubscribed cores averages out as in a real step. The mean, not the median: a
    training step is a sum of many calls and pays its share of descheduled time;
    per-sample maxima over ranks would instead charge every call the worst rank's hiccup.
    """
    sync = synchronizer(device)
    fn()
    sync()
    if inner <= 0:
        t0 = _clock()
        fn()
        sync()
        first = _clock() - t0
        inner = int(mpi.allreduce(max(1, min(1000, math.ceil(sample_s / max(first, 1e-9)))),
                                  op=MPI.MAX))
    values = []
    for _ in range(repeat):
        mpi.Barrier()
        t0 = _clock()
        for _ in range(inner):
            fn()
        sync()
        values.append((_clock() - t0) / inner)
    return float(mpi.allreduce(float(np.mean(values)), op=MPI.MAX))


def measure_sync(mpi: MPI.Comm, repeat: int) -> float:
    """Measure what a blocking collective costs beyond α–β when ranks reach it from computation.

    Scheduling and arrival skew; large on oversubscribed nodes. Collective over ``mpi``.
    Measured with host work whatever the device: the skew is the hosts' (a GPU job's
    ranks reach a collective when their hosts do).

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


def _spd(n: int, device: torch.device = CPU) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    x = torch.randn(4 * n, n, generator=g).to(device)
    return x.t() @ x / (4 * n)


def probe_net(image: int = 16) -> tuple[nn.Module, tuple[int, ...]]:
    """Build the small conv net whose forward+backward rate calibrates ``train_flops``.

    Args:
        image: The input's height and width.

    Returns:
        The model and its input sample shape.
    """
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(16, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    return net, (16, image, image)


def _library_products(device: torch.device) -> contextlib.AbstractContextManager[None]:
    """The precision K-FAC's float32 products take on ``device`` by default (TF32 on CUDA)."""
    from kfac_hpc.kfac.options import resolve_precision
    from kfac_hpc.kfac.precision import full_precision_products, tf32_products

    if device.type != "cuda":
        return contextlib.nullcontext()
    precision = resolve_precision("auto", device_type=device.type, dtype="float32")
    return tf32_products() if precision == "tf32" else full_precision_products()


def measure_compute(mpi: MPI.Comm, decomp_sizes: Sequence[int] | None, repeat: int,
                    report: Callable[[str], None] = lambda _: None,
                    device: torch.device = CPU) -> ComputeRates:
    """Measure the compute rates of one rank with every rank of ``mpi`` working at the same time.

    Collective over ``mpi`` (the slowest rank's times count).

    Args:
        mpi: The ranks that work at once.
        decomp_sizes: Matrix orders at which eigh and inverse are timed (None: the
            device's, :data:`PROBES`).
        repeat: Samples per measurement.
        report: Sees a line of progress per measurement.
        device: Where the probes run (a GPU: :data:`PROBES`' sizes for it, the library's
            default float32 precision for its products).

    Returns:
        The rates; ``overlap_efficiency`` is 0 (not measured).
    """
    from kfac_hpc.kfac import linalg
    from kfac_hpc.plan.model_shapes import model_spec

    sizes = probe_sizes(device)
    slowest = partial(_slowest, mpi, device=device)
    a, b = torch.randn(8, 8, device=device), torch.randn(8, 8, device=device)
    c = torch.empty(8, 8, device=device)

    def tiny() -> None:
        for _ in range(10):
            torch.add(a, b, out=c)
            c.mul_(0.5)

    op = slowest(tiny, repeat) / 20
    report(f"op overhead {op * 1e6:.1f} us")
    gemm_rates = []
    with _library_products(device):
        for rows, cols in sizes.gemm:
            x = torch.randn(rows, cols, device=device)
            t = slowest(partial(torch.mm, x.t(), x), repeat)
            gemm_rates.append(2 * rows * cols * cols / t)
    gemm = statistics.median(gemm_rates)
    report(f"gemm {gemm / 1e9:.1f} GFLOP/s")
    src = torch.randn(sizes.copy_elements, device=device)
    dst = torch.empty_like(src)
    bandwidth = 2 * src.nbytes / slowest(partial(dst.copy_, src), repeat)
    del src, dst  # 512 MiB on a GPU
    report(f"memory {bandwidth / 1e9:.1f} GB/s")
    eigh, inverse = [], []
    for n in sizes.decompositions if decomp_sizes is None else decomp_sizes:
        f = _spd(n, device)
        reps = max(3, repeat // 2) if n >= 512 else repeat
        eigh.append((n, slowest(partial(linalg.eigh_clamped, f), reps)))
        inverse.append((n, slowest(partial(linalg.damped_inverse, f, 1e-3), reps)))
        report(f"n={n}: eigh {eigh[-1][1] * 1e3:.2f} ms, inverse {inverse[-1][1] * 1e3:.2f} ms")
    from kfac_hpc.kfac.layers import curvature_for

    conv = nn.Conv2d(16, 16, 3, padding=1, bias=False).to(device)
    curv = curvature_for(conv)
    assert curv is not None
    patches = torch.randn(32, 16, 32, 32, device=device)
    unfold_s = slowest(partial(curv.a_rows, patches), repeat)
    im2col = 32 * 32 * 32 * curv.weight_cols * 4 / unfold_s
    report(f"im2col {im2col / 1e9:.2f} GB/s")
    net, shape = probe_net(sizes.train_image)
    net.to(device)
    spec = model_spec(net, input_shape=shape)
    batch = sizes.train_batch
    x = torch.randn(batch, *shape, device=device)
    y = torch.randint(0, 10, (batch,), device=device)

    def train_step() -> None:
        net.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()

    torch.manual_seed(0)
    tiny_net = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(4, 4), nn.ReLU())])
    tiny_net.to(device)
    tiny_x = torch.randn(1, 4, device=device)
    tiny_opt = torch.optim.SGD(tiny_net.parameters(), lr=0.0)

    def tiny_step() -> None:
        tiny_net.zero_grad()
        tiny_net(tiny_x).sum().backward()

    module = slowest(tiny_step, repeat) / 12
    param = slowest(tiny_opt.step, repeat) / 12
    report(f"per module (fwd+bwd) {module * 1e6:.1f} us, per parameter (SGD) "
           f"{param * 1e6:.1f} us")
    t = slowest(train_step, repeat)
    flops = 3 * sum(2.0 * batch * s.rows_per_sample * s.weight_cols * s.g_dim
                    for s in spec.layers)
    framework = spec.leaf_modules * module
    train = flops / max(t - framework, 0.2 * t)
    report(f"train {train / 1e9:.1f} GFLOP/s (forward+backward {t * 1e3:.2f} ms)")
    sync = measure_sync(mpi, repeat)
    report(f"collective after compute: {sync * 1e6:.1f} us beyond alpha-beta")
    concurrency = measure_decomposition_concurrency(mpi, device, repeat)
    report(f"decompositions together: {concurrency:.2f}x one after another")
    return ComputeRates(train_flops=train, gemm_flops=gemm, mem_bandwidth=bandwidth,
                        op_overhead_s=op, eigh=tuple(eigh), inverse=tuple(inverse),
                        overlap_efficiency=0.0, im2col_bandwidth=im2col,
                        module_overhead_s=module, param_overhead_s=param,
                        sync_overhead_s=sync, decomposition_concurrency=concurrency)


#: The batches :func:`measure_decomposition_concurrency` decomposes: (matrices, order).
CONCURRENCY_BATCHES = ((6, 1024), (3, 2048))


def measure_decomposition_concurrency(mpi: MPI.Comm, device: torch.device, repeat: int
                                      ) -> float:
    """How many times faster the library decomposes batches together than one at a time.

    On CUDA :func:`~kfac_hpc.solves.eigh_batches` spreads a rank's batches over the
    default streams (:func:`~kfac_hpc.solves.default_device_streams`, as K-FAC does);
    the ratio of one stream's time to theirs, for :data:`CONCURRENCY_BATCHES`, at least
    1 (the slowest rank's times). On the CPU the library decomposes one after another:
    1, nothing measured. Collective over ``mpi`` on CUDA.

    Args:
        mpi: The ranks that work at once.
        device: Where the probes run.
        repeat: Samples per measurement.

    Returns:
        The concurrency (the profile's ``decomposition_concurrency``).
    """
    from kfac_hpc.solves import SolvePlacement, eigh_batches

    if device.type != "cuda":
        return 1.0
    # distinct matrices of one order: leading blocks of larger SPD ones (SPD themselves)
    batches = [torch.stack([_spd(n + i, device)[:n, :n] for i in range(count)])
               for count, n in CONCURRENCY_BATCHES]
    reps = max(3, repeat // 2)
    alone = _slowest(mpi, partial(eigh_batches, batches, SolvePlacement(0, 1)), reps,
                     device=device)
    together = _slowest(mpi, partial(eigh_batches, batches, SolvePlacement()), reps,
                        device=device)
    return max(1.0, alone / together)


def calibration_device(mpi: MPI.Comm, choice: str) -> torch.device | None:
    """The device every rank measures on (collective over ``mpi``).

    Args:
        mpi: The ranks.
        choice: ``"cpu"``; ``"cuda"`` (None when a rank has no GPU); ``"auto"`` (the GPU
            when every rank has one, else the CPU).

    Returns:
        This rank's device (its node-local rank's GPU, made current), or None.
    """
    if choice not in ("auto", "cuda", "cpu"):
        raise ValueError(f"calibrate: invalid device {choice!r}; allowed: 'auto', 'cuda', 'cpu'")
    if choice == "cpu":
        return CPU
    from kfac_hpc.runtime.device import cuda_on_every_rank, select_local_gpu

    if not cuda_on_every_rank(mpi):
        return None if choice == "cuda" else CPU
    return select_local_gpu(mpi)


def recorded_device(profile: Profile) -> str:
    """The device a profile was measured on (``""``: not known, e.g. an assumed one).

    Profiles calibrated before the device was recorded were measured on the CPU:
    ``kfac-hpc calibrate`` measured nothing else then.
    """
    if profile.measured_on or profile.source != "calibrated":
        return profile.measured_on
    return "CPU"


def describe_device(device: torch.device) -> str:
    """``"CPU"``, or the GPU's name (for the profile's description)."""
    if device.type != "cuda":
        return "CPU"
    return f"GPU {torch.cuda.get_device_name(device)}"


def gpu_identity(device: torch.device) -> str:
    """The physical GPU behind ``device``: its UUID.

    Not its index: ranks given one GPU each by ``CUDA_VISIBLE_DEVICES`` all see theirs as
    ``cuda:0``. Without a UUID (older torch, or an empty or all-zero one), the PCI
    location, else the index.
    """
    props = torch.cuda.get_device_properties(device)
    uuid = str(getattr(props, "uuid", "") or "")
    if uuid.strip("0-"):  # some stacks report an empty or all-zero UUID
        return uuid
    pci = tuple(getattr(props, f"pci_{k}_id", None) for k in ("domain", "bus", "device"))
    return f"pci {pci}" if None not in pci else f"index {device.index}"


def gpu_memory_per_rank(mpi: MPI.Comm, device: torch.device) -> int | None:
    """A GPU's memory divided among the ranks of its node that use it (collective).

    Ranks share a GPU when :func:`gpu_identity` says so.

    The smallest share over all ranks; None on the CPU (the profile then has no memory
    budget, as before). Every rank measures on the same kind of device
    (:func:`calibration_device`), so all or none make the collective calls.
    """
    if device.type != "cuda":
        return None
    node = mpi.Split_type(MPI.COMM_TYPE_SHARED, key=mpi.Get_rank())
    mine = gpu_identity(device)
    try:
        sharing = node.allgather(mine).count(mine)
    finally:
        node.Free()
    share = torch.cuda.get_device_properties(device).total_memory // sharing
    return int(mpi.allreduce(share, op=MPI.MIN))


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
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="where to measure: auto (default) each rank's GPU when every "
                             "rank has one (as kfac-hpc train picks it), else the CPU; "
                             "measure where the training job computes")


def run(args: argparse.Namespace) -> int:
    """Run ``kfac-hpc calibrate``: measure this machine and write (or merge) a profile on rank 0.

    Collective over the world.

    Args:
        args: The parsed options.

    Returns:
        The exit status: 0; 2 when ``--device cuda`` finds a rank without a GPU, or
        ``--merge`` would mix measurements of different devices.
    """
    from kfac_hpc.comm import install_abort_on_error

    install_abort_on_error()
    comm = Communicator(MPI.COMM_WORLD.Dup(), name="calibrate")
    torch.set_num_threads(args.threads)
    rank, size = comm.rank, comm.size

    def say(text: str) -> None:
        if rank == 0:
            print(text, flush=True)

    device = calibration_device(comm.mpi, args.device)
    if device is None:
        say("kfac-hpc calibrate --device cuda: no CUDA device visible to every rank "
            f"(torch {torch.__version__}, CUDA build {torch.version.cuda}); run it on the GPU "
            "nodes the job trains on, or with --device cpu to measure the CPUs")
        return 2
    where = describe_device(device)
    mixed = None
    if rank == 0 and args.merge and args.out.is_file():
        measured_on = recorded_device(load_profile(args.out))
        if measured_on and measured_on != where:
            mixed = (f"kfac-hpc calibrate --merge: {args.out} was measured on {measured_on}, "
                     f"this run measures on {where}; merge runs of one device (--device), "
                     "or write this one to another --out")
    mixed = comm.mpi.bcast(mixed, 0)
    if mixed is not None:
        say(mixed)
        return 2
    say(f"# kfac-hpc calibrate: {size} rank(s), {args.threads} torch thread(s) per rank, "
        f"on {where}")
    compute = measure_compute(comm.mpi,
                              probe_sizes(device).quick_decompositions if args.quick else None,
                              3 if args.quick else args.repeat, say, device=device)
    compute = ComputeRates(**{**compute.__dict__,
                              "overlap_efficiency": args.overlap_efficiency})
    raw: list[dict[str, Any]] = []
    if size > 1:
        network, raw = measure_network(comm, QUICK_NETWORK_SIZES if args.quick
                                       else NETWORK_SIZES, 3 if args.quick else args.repeat,
                                       device)
        for kind, link in network.items():
            say(f"{kind:>15}: alpha {link.alpha * 1e6:8.2f} us, "
                f"beta {link.beta * 1e9:8.4f} s/GB ({1 / max(link.beta, 1e-30) / 1e9:.2f} GB/s)")
    else:  # nothing to measure: the network of the profile extended, or an assumed one
        network = {}
        say("one rank: no network measured; the profile keeps the network it extends "
            f"(--merge), or the bundled {DEFAULT_PROFILE!r} profile's as an assumption; "
            "calibrate on 2 or more ranks (one per node) to measure it")
    host = comm.mpi.bcast(socket.gethostname(), 0)
    memory = gpu_memory_per_rank(comm.mpi, device)
    entry: dict[str, Any] = {"compute": compute}
    if network:
        entry["network"] = network
    if rank == 0:
        base: Profile | None = None
        if args.merge and args.out.is_file():
            base = load_profile(args.out)
        if base is None:
            assumed: tuple[str, ...] = ("overlap_efficiency is not measured "
                                        f"(set to {args.overlap_efficiency})",)
            if not network:
                network = dict(load_profile(DEFAULT_PROFILE).network)
                assumed += (f"the network is not measured (calibrated on one rank): the "
                            f"bundled {DEFAULT_PROFILE!r} profile's",)
            base = Profile(name=args.name or f"calibrated-{host}", network=network,
                           compute=compute, source="calibrated",
                           description=f"measured by kfac-hpc calibrate on {host} ({where})",
                           assumptions=assumed,
                           memory_per_rank_bytes=memory, measured_on=where)
        else:  # a profile of this device (or an assumed one): the smaller memory share
            shares = [m for m in (base.memory_per_rank_bytes, memory) if m is not None]
            base = replace(base, measured_on=where,
                           memory_per_rank_bytes=min(shares) if shares else None)
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
