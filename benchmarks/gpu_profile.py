"""K-FAC on one GPU, phase by phase: operand precisions, decompositions, kernels, accuracy.

    python benchmarks/gpu_profile.py [--device cuda] [--batch 32] [--image-size 224]
        [--rounds 5] [--sections kinds schedule decompositions profile accuracy]
        [--kinds KEY...] [--schedule F I] [--lags L|L:H ...]
        [--training-stream default|high|both] [--markdown]
        [--out benchmarks/out/gpu]

ResNet-50 (torchvision's when it imports, else ``kfac_hpc.models``' with the ImageNet
stem), 1000 classes, one fixed synthetic batch, fp32 model, one process
(``Communicator(MPI.COMM_SELF)``), K-FAC comm-opt eigen with damping 0.001 and
``kl_clip`` 0.001 on SGD. Sections:

* ``kinds``: ms per iteration (median of ``--rounds`` after one warm-up) of SGD and of
  the K-FAC iteration kinds ``f`` (factor update), ``p`` (stale decompositions) and
  ``fi`` (factor and inverse update), with the device synchronised around each
  iteration, for each pair (``stats_precision``, ``precondition_precision``), for TF32
  statistics from column-major and from row-major convolution rows (whatever the
  default, ``layers.COLUMN_MAJOR_ROWS_DEVICES``: CUDA column-major) and on a side
  stream (``statistics_stream.SIDE_STREAM_DEVICES``, CUDA only), for
  stride-1 convolutions' ``A`` from shifted products on the GPU path (TF32 and full
  statistics; ``shifts.SHIFTED_PRODUCTS_PATHS``), with long products of few columns
  summed over chunks of rows (``linalg.SPLIT_ROWS_DEVICES``), with every layer's
  statistics by its own product (``layer-by-layer``: no groups of same-shaped layers,
  ``statistics_groups.STACKED_PRECISIONS`` empty), with the preconditioning captured as a
  CUDA graph (``graphs``: ``cuda_graphs=True``; each ``fi`` captures it, its ``f`` and
  ``p`` replay it) and for ``kfac_approx="reduce"``;
  the schedules (1,10) = (fi + 9f)/10 and (10,100) = (fi + 9f + 90p)/100 composed from
  them, and the ratios to SGD.
* ``schedule``: mean ms per iteration over two whole inverse periods of a real schedule
  (``--schedule F I``, default (1,10)) with each entry of ``--lags``: ``L``, a
  ``decomposition_lag`` (decompositions in a worker thread on a side stream), or
  ``L:H``, that lag with the factors of at most ``H`` rows decomposed on the host
  meanwhile (``host_decomposition_max_dim``), against SGD; with ``--training-stream
  high`` (or ``both``) the training loop runs on a high-priority CUDA stream, so a
  background inverse update's kernels (default priority, the lowest) fill only the
  training's idle time.
* ``decompositions``: one inverse update (``pre.decomps.update``) against the bare
  solver calls on the same factors: ``torch.linalg.eigh`` one factor at a time and
  batched by size (``linalg.eigh_clamped_many``, all on the device, one stream), and
  batched by size with the CUDA factors up to each ``--host-max-dims`` value decomposed on
  the host beside the device's (``host_decomposition_max_dim``; 0: none; one stream), and
  all on the device
  spread over each ``--device-streams`` count of CUDA streams and worker threads
  (``kfac_hpc.solves.SolvePlacement(device_streams=S)``). Then, per distinct factor size (one
  factor ``F`` of that size, the count of that size), the ms of one
  ``torch.linalg.eigh`` (median of 3 calls when the first takes under 0.25 s, else that
  one call) of: ``F`` in float32 on the device (what the preconditioner decomposes),
  ``F`` in float64 on the device, ``F`` in float32 on the host CPU (LAPACK), a KAISA-like
  ``0.95·mean(diag F)·I + 0.05·F`` (a factor started at a multiple of ``I``, one update
  of factor_decay 0.95 in) and ``F + 100·mean(diag F)·I``, both float32 on the device;
  with the routine torch picks for float32 on the device (cuSOLVER's Jacobi ``syevj``
  for 32..512 rows, divide and conquer ``syevd`` otherwise and for float64 always:
  ``eigh_routine``) and a row of Σ count x ms per variant (an inverse update's solver
  time if every factor of a size took as long as the one timed). Jacobi's sweeps stop
  early on a matrix near diagonal and divide and conquer deflates more, so the spectrum
  (data-dominated, or a multiple of ``I`` plus a small data term) moves these times.
* ``profile``: ``torch.profiler`` of one SGD iteration and one ``f``, ``fi`` and ``p``
  iteration: wall time under the profiler, host time, device time (the kernels' and
  copies' own, counted once), kernel launches, the 20 kernels with the most device time
  and the 20 operators whose kernels took the most (an operator's includes its children's:
  ``aten::addmm`` and the GEMM kernel it launched), and the library's phases (its
  ``kfac_hpc.<phase>`` profiler ranges, the hooks' statistics among them) with their host
  time and the device time of the kernels launched inside from the same thread (the
  decompositions spread over streams run in worker threads: not in their range); host
  time near or above device time: launch-bound.
* ``accuracy``: for five layers of the model (the first, the last, and three between
  at 15, 50 and 85 % of the K-FAC layers in model order) the factors of one batch in
  fp32 full/TF32/bf16 against float64 on the same device (the worst entry error normalised by
  ``√(A_ii A_jj)``, and the Frobenius relative error) and the preconditioned gradient
  from float32 eigenbases with each ``precondition_precision`` against float64.

Writes ``gpu_profile_<device>.json`` under ``--out`` and prints the tables. Runs on the
CPU too (``--device cpu``, small ``--image-size``: a dry run of the code, not a GPU
number). About 60-90 s on an H200 at the defaults.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
from mpi4py import MPI
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import format_table, machine, synchronize, write_json
from common import timed as common_timed

from kfac_hpc import KFACPreconditioner, solves, step_graph
from kfac_hpc.comm import Communicator
from kfac_hpc.kfac import layers, linalg, shifts, statistics_groups, statistics_stream
from kfac_hpc.kfac.layers import LayerCurvature, register_layers
from kfac_hpc.kfac.options import PRECISIONS
from kfac_hpc.models import build_model
from kfac_hpc.solves import SolvePlacement

PRECISION_PAIRS = [("full", "full"), ("tf32", "full"), ("tf32", "tf32"), ("bf16", "tf32")]
# the kinds section's runs with convolution rows column-major and row-major whatever the
# default (layers.COLUMN_MAJOR_ROWS_DEVICES)
COLUMNS_LABEL = "stats tf32, column-major rows"
ROWS_LABEL = "stats tf32, row-major rows"
# ... and with the statistics on a side stream (statistics_stream.SIDE_STREAM_DEVICES; CUDA)
SIDE_STREAM_LABEL = "stats tf32, side stream"
# ... and with stride-1 convolutions' A from shifted products (shifts.SHIFTED_PRODUCTS_PATHS)
SHIFTS_LABELS = ("stats tf32, shifted products", "stats full, shifted products")
# ... and with long products of few columns summed over chunks of rows
# (linalg.SPLIT_ROWS_DEVICES)
SPLIT_ROWS_LABEL = "stats tf32, split rows"
# ... and with every layer's statistics by its own product (no statistics_groups)
LAYER_BY_LAYER_LABEL = "stats tf32, layer by layer"


def make_model(name: str, device: torch.device, image_size: int) -> nn.Module:
    """``resnet50``: torchvision's when it imports, else the package's (ImageNet stem);
    ``resnet20``: the package's CIFAR ResNet-20 (small factors: for dry runs)."""
    torch.manual_seed(0)
    if name == "resnet20":
        return build_model("resnet20", num_classes=1000).to(device)
    try:
        from torchvision.models import resnet50 as tv_resnet50

        model: nn.Module = tv_resnet50()
    except ImportError:
        model = build_model("resnet50", num_classes=1000, image_size=image_size,
                            stem="imagenet")
    return model.to(device)


def repeat(fn: Callable[[], object], n: int) -> None:
    """Call ``fn`` ``n`` times."""
    for _ in range(n):
        fn()


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds of one call of ``fn``, ``device`` synchronised around it."""
    return common_timed(fn, device)[1]


class Trainer:
    """One model, optimizer and (optionally) preconditioner; ``run(kind)`` does one
    iteration of that kind."""

    def __init__(self, device: torch.device, batch: tuple[Tensor, Tensor],
                 args: argparse.Namespace, kfac: dict[str, Any] | None) -> None:
        self.device = device
        self.model = make_model(args.model, device, args.image_size)
        self.x, self.y = batch
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.pre = None if kfac is None else KFACPreconditioner(
            self.model, comm=Communicator(MPI.COMM_SELF), damping=0.001, kl_clip=0.001,
            lr=0.01, factor_update_steps=lambda k: 1 if self.kind != "p" else 10**9,
            inv_update_steps=lambda k: 1 if self.kind == "fi" else 10**9, **kfac)
        self.kind = "fi"

    def run(self, kind: str) -> None:
        self.kind = kind
        if self.pre is not None:
            self.pre.steps = 1  # the schedules above decide the kind (1 % 10**9 != 0)
        self.opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(self.model(self.x), self.y).backward()
        if self.pre is not None:
            self.pre.step()
        self.opt.step()

    def close(self) -> None:
        if self.pre is not None:
            self.pre.close()


KIND_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    **{f"{s}-{p}": (f"stats {s} / precond {p}",
                    {"stats_precision": s, "precondition_precision": p})
       for s, p in PRECISION_PAIRS},
    "columns": (COLUMNS_LABEL, {"stats_precision": "tf32"}),
    "rows": (ROWS_LABEL, {"stats_precision": "tf32"}),
    "side-stream": (SIDE_STREAM_LABEL, {"stats_precision": "tf32"}),
    "shifts": (SHIFTS_LABELS[0], {"stats_precision": "tf32"}),
    "shifts-full": (SHIFTS_LABELS[1], {"stats_precision": "full"}),
    "split-rows": (SPLIT_ROWS_LABEL, {"stats_precision": "tf32"}),
    "layer-by-layer": (LAYER_BY_LAYER_LABEL, {"stats_precision": "tf32"}),
    # the stale part of the step as a CUDA graph: captured at each fi, replayed by f and p
    "graphs": ("cuda_graphs", {"stats_precision": "tf32", "cuda_graphs": True}),
    "reduce": ("reduce, auto", {"kfac_approx": "reduce"}),
    # cheaper inverse updates: warm-started eigenbases, randomized low rank, inverses
    "subspace": ("eigen_refresh subspace", {"eigen_refresh": "subspace"}),
    "low-rank": ("low_rank 256 (d >= 1024)", {"low_rank": 256}),
    "inverse": ("compute_method inverse", {"compute_method": "inverse"}),
}
"""The kinds section's K-FAC configurations by ``--kinds`` key: (row label, options).

Every row but ``graphs`` runs without the step graph (``cuda_graphs=False``, whatever the
library's default), so that row is the one comparison of it."""
for _label, _options in KIND_CONFIGS.values():
    _options.setdefault("cuda_graphs", False)


def kinds_section(device: torch.device, batch: tuple[Tensor, Tensor], args: argparse.Namespace
                  ) -> dict[str, Any]:
    configs: list[tuple[str, dict[str, Any] | None]] = [("SGD", None)]
    configs += [KIND_CONFIGS[key] for key in args.kinds]
    out: dict[str, Any] = {}
    default_layout = layers.COLUMN_MAJOR_ROWS_DEVICES
    default_streams = statistics_stream.SIDE_STREAM_DEVICES
    default_shifts = shifts.SHIFTED_PRODUCTS_PATHS
    default_split = linalg.SPLIT_ROWS_DEVICES
    default_stacked = statistics_groups.STACKED_PRECISIONS
    for label, kfac in configs:
        if kfac is not None and kfac.get("cuda_graphs") and device.type != "cuda":
            print(f"{label}: CUDA graphs need a CUDA device; skipped", flush=True)
            continue
        statistics_groups.STACKED_PRECISIONS = (frozenset() if label == LAYER_BY_LAYER_LABEL
                                                else default_stacked)
        linalg.SPLIT_ROWS_DEVICES = (default_split | {device.type} if label == SPLIT_ROWS_LABEL
                                     else default_split)
        shifts.SHIFTED_PRODUCTS_PATHS = (default_shifts | {"gpu"} if label in SHIFTS_LABELS
                                         else default_shifts)
        layers.COLUMN_MAJOR_ROWS_DEVICES = (
            frozenset({device.type}) if label == COLUMNS_LABEL
            else frozenset() if label == ROWS_LABEL else default_layout)
        statistics_stream.SIDE_STREAM_DEVICES = (
            frozenset({"cuda"}) if label == SIDE_STREAM_LABEL and device.type == "cuda"
            else default_streams)
        trainer = Trainer(device, batch, args, kfac)
        kinds = ["sgd"] if kfac is None else ["fi", "f", "p"]
        times: dict[str, list[float]] = {k: [] for k in kinds}
        for kind in kinds:
            trainer.run(kind)  # warm-up (first decompositions, cuBLAS handles, caches)
        for _ in range(args.rounds):
            for kind in kinds:
                times[kind].append(timed(partial(trainer.run, kind), device))
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        if kfac is not None:
            med["(1,10)"] = (med["fi"] + 9 * med["f"]) / 10
            med["(10,100)"] = (med["fi"] + 9 * med["f"] + 90 * med["p"]) / 100
        if device.type == "cuda":
            med["peak MiB"] = torch.cuda.max_memory_allocated(device) / 2**20
            torch.cuda.reset_peak_memory_stats(device)
        out[label] = med
        graph = getattr(trainer.pre, "step_graph", None)
        if graph is not None:  # whether the timed steps replayed
            print(f"{label}: step graph {step_graph.describe(graph.report())}", flush=True)
        trainer.close()
    layers.COLUMN_MAJOR_ROWS_DEVICES = default_layout
    statistics_stream.SIDE_STREAM_DEVICES = default_streams
    linalg.SPLIT_ROWS_DEVICES = default_split
    shifts.SHIFTED_PRODUCTS_PATHS = default_shifts
    statistics_groups.STACKED_PRECISIONS = default_stacked
    return out


def kinds_table(res: dict[str, Any], md: bool) -> str:
    sgd = res["SGD"]["sgd"]
    rows = [["SGD", "", "", "", f"{sgd:.1f}", f"{sgd:.1f}", "1.00", "1.00"]]
    for label, m in res.items():
        if label == "SGD":
            continue
        rows.append([label, f"{m['fi']:.1f}", f"{m['f']:.1f}", f"{m['p']:.1f}",
                     f"{m['(1,10)']:.1f}", f"{m['(10,100)']:.1f}",
                     f"{m['(1,10)'] / sgd:.2f}", f"{m['(10,100)'] / sgd:.2f}"])
    return format_table(["configuration", "fi ms", "f ms", "p ms", "(1,10) ms", "(10,100) ms",
                         "(1,10)/SGD", "(10,100)/SGD"], rows, md)


def _lag_spec(text: str) -> str:
    """``--lags`` entries: ``L`` or ``L:H``, integers >= 0."""
    parts = text.split(":")
    if len(parts) > 2 or not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: expected LAG or LAG:HOST_MAX_DIM "
                                         "(integers >= 0)")
    return text


def lag_row(f_steps: int, i_steps: int, spec: str) -> tuple[str, dict[str, Any]]:
    """The schedule section's row of one ``--lags`` entry: ``L`` (``decomposition_lag``)
    or ``L:H`` (and ``host_decomposition_max_dim=H``): (label, K-FAC options)."""
    lag, _, host = spec.partition(":")
    options: dict[str, Any] = {"factor_update_steps": f_steps, "inv_update_steps": i_steps,
                               "decomposition_lag": int(lag)}
    label = f"({f_steps},{i_steps}) lag {lag}"
    if host:
        options["host_decomposition_max_dim"] = int(host)
        label += f", host <= {host}"
    return label, options


#: ``--training-stream``: the rows' training loop on the current stream, on a
#: high-priority one, or each row both ways.
TRAINING_STREAMS = ("default", "high", "both")


def training_streams(choice: str, device: torch.device
                     ) -> list[tuple[str, Callable[[], contextlib.AbstractContextManager[Any]]]]:
    """The schedule rows' training streams for ``--training-stream``: (label suffix, context).

    ``high``: forward, backward and step on a CUDA stream of high priority (-1), so that
    the kernels of a background inverse update (``decomposition_lag``: its worker's side
    stream and the solver lanes, of default priority, the lowest) run only where the
    training's leave the GPU idle. CUDA only: on another device the high rows are left out.
    """
    default = ("", contextlib.nullcontext)
    if choice == "default":
        return [default]
    if device.type != "cuda":
        print(f"gpu_profile: --training-stream {choice}: a high-priority stream needs CUDA; "
              "its rows are left out on " + device.type, file=sys.stderr)
        return [default]
    high = torch.cuda.Stream(device, priority=-1)
    on_high: Callable[[], contextlib.AbstractContextManager[Any]] = partial(
        torch.cuda.stream, high)
    rows = [(", training on a high-priority stream", on_high)]
    return rows if choice == "high" else [default, *rows]


def schedule_section(device: torch.device, batch: tuple[Tensor, Tensor],
                     args: argparse.Namespace) -> dict[str, Any]:
    """Mean ms per iteration of real schedules (every step as the preconditioner's own
    schedule decides) over two whole inverse periods after one: SGD, and K-FAC with
    each ``decomposition_lag`` of ``--lags`` (``L`` or ``L:H``: :func:`lag_row`)."""
    out: dict[str, Any] = {}
    f_steps, i_steps = args.schedule
    configs: list[tuple[str, dict[str, Any] | None]] = [("SGD", None)]
    configs += [lag_row(f_steps, i_steps, spec) for spec in args.lags]
    streams = training_streams(args.training_stream, device)
    for (label, kfac), (stream_label, stream) in itertools.product(configs, streams):
        label += stream_label
        model = make_model(args.model, device, args.image_size)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        pre = None if kfac is None else KFACPreconditioner(
            model, comm=Communicator(MPI.COMM_SELF), damping=0.001, kl_clip=0.001, lr=0.01,
            **kfac)

        def iteration(model: nn.Module = model, opt: torch.optim.Optimizer = opt,
                      pre: KFACPreconditioner | None = pre) -> None:
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()
            if pre is not None:
                pre.step()
            opt.step()

        with stream():
            for _ in range(i_steps):  # one period: first decompositions, caches
                iteration()
            n = 2 * i_steps
            total = timed(partial(repeat, iteration, n), device)
        out[label] = {"ms per iteration": total / n * 1e3}
        if pre is not None:
            pre.close()
    sgd = out["SGD"]["ms per iteration"]
    for v in out.values():
        v["x SGD"] = v["ms per iteration"] / sgd
    return out


def _mean_diag(f: Tensor) -> float:
    return float(f.diagonal().mean())


def _plus_identity(f: Tensor, c: float) -> Tensor:
    out = f.clone()
    out.diagonal().add_(c)
    return out


def kaisa_like(f: Tensor) -> Tensor:
    """``0.95·mean(diag F)·I + 0.05·F``: a factor started at a multiple of ``I`` one
    update of ``factor_decay`` 0.95 ago (as KAISA's are, at the data's scale)."""
    return _plus_identity(0.05 * f, 0.95 * _mean_diag(f))


def identity_dominated(f: Tensor) -> Tensor:
    """``F + 100·mean(diag F)·I``."""
    return _plus_identity(f, 100 * _mean_diag(f))


#: the variants of one factor ``F`` whose ``torch.linalg.eigh`` the decompositions
#: section times, by column label: (where, dtype, the matrix from ``F``)
EIGH_VARIANTS: dict[str, tuple[str, torch.dtype, Callable[[Tensor], Tensor]]] = {
    "fp32": ("device", torch.float32, lambda f: f),
    "fp64": ("device", torch.float64, lambda f: f),
    "fp32 host": ("host", torch.float32, lambda f: f),
    "KAISA-like fp32": ("device", torch.float32, kaisa_like),
    "F+100·m·I fp32": ("device", torch.float32, identity_dominated),
}
CHEAP_S = 0.25  # an eigh faster than this is timed 3 times (median), a slower one once


def eigh_routine(n: int, dtype: torch.dtype, device: torch.device) -> str:
    """The solver torch's ``torch.linalg.eigh`` uses for one ``n x n`` matrix.

    On CUDA (aten/src/ATen/native/cuda/linalg/BatchLinearAlgebraLib.cpp,
    ``linalg_eigh_cusolver``): cuSOLVER's Jacobi solver ``syevj`` for float32 with 32 <=
    n <= 512, divide and conquer ``syevd`` otherwise (float64 always); MAGMA instead when
    ``torch.backends.cuda.preferred_linalg_library()`` says so. On the CPU: LAPACK's
    ``syevd``.

    Args:
        n: The matrix size.
        dtype: Its dtype.
        device: Where it is decomposed.

    Returns:
        The routine's name.
    """
    if device.type != "cuda":
        return "LAPACK syevd"
    if torch.backends.cuda.preferred_linalg_library() == torch._C._LinalgBackend.Magma:
        return "MAGMA syevd"
    return "syevj" if dtype == torch.float32 and 32 <= n <= 512 else "syevd"


def time_eigh(m: Tensor) -> float:
    """ms of ``torch.linalg.eigh(m)`` where ``m`` lies: the median of 3 calls when the
    first is cheaper than :data:`CHEAP_S`, else that one call (NaN if it fails)."""
    times = []
    for _ in range(3):
        try:
            times.append(timed(lambda: torch.linalg.eigh(m), m.device))
        except torch.linalg.LinAlgError:
            return float("nan")
        if times[0] >= CHEAP_S:
            break
    return statistics.median(times) * 1e3


def decompositions_section(device: torch.device, batch: tuple[Tensor, Tensor],
                           args: argparse.Namespace) -> dict[str, Any]:
    """One inverse update against bare solver calls, and per factor size the solver's
    time for the variants of :data:`EIGH_VARIANTS` (see the module docstring)."""
    trainer = Trainer(device, batch, args,
                      {"stats_precision": "full", "precondition_precision": "full"})
    for _ in range(2):
        trainer.run("fi")
    pre = trainer.pre
    assert pre is not None
    update = [timed(lambda: pre.decomps.update(pre.steps), device) for _ in range(3)]
    factors = [s.average for s in pre.factors.values() if s.average is not None]

    def one_by_one() -> None:
        for f in factors:
            torch.linalg.eigh(f)

    each = [timed(one_by_one, device) for _ in range(3)]
    batched = [timed(lambda: linalg.eigh_clamped_many(factors, placement=SolvePlacement(0, 1)),
                     device)
               for _ in range(3)]
    # host_decomposition_max_dim: CUDA factors up to this size on the host, beside the
    # device's (kfac_hpc.solves); the wall time of all of them, batched by size
    by_host_max_dim = {h: statistics.median(
        timed(partial(linalg.eigh_clamped_many, factors, placement=SolvePlacement(h, 1)), device)
        for _ in range(3)) * 1e3 for h in args.host_max_dims}
    sizes: dict[int, list[Tensor]] = {}
    for f in factors:
        sizes.setdefault(f.shape[0], []).append(f)
    # kfac_hpc.solves: the device's batches spread over S streams and worker threads
    stacks = [torch.stack(group) for group in sizes.values()]
    by_streams = {s: statistics.median(
        timed(partial(solves.eigh_batches, stacks, SolvePlacement(0, s)),
              device) for _ in range(3)) * 1e3 for s in args.device_streams}
    host = torch.device("cpu")
    for warm in {device, host}:  # solver handles, workspaces, thread pools: first calls
        for dtype in (torch.float32, torch.float64):
            for n in (64, 600):
                torch.linalg.eigh(torch.eye(n, dtype=dtype, device=warm))
    per_size: dict[int, dict[str, Any]] = {}
    for d, group in sorted(sizes.items()):
        f = group[0].detach()
        row: dict[str, Any] = {"count": len(group),
                               "routine fp32": eigh_routine(d, torch.float32, device)}
        for label, (where, dtype, make) in EIGH_VARIANTS.items():
            m = make(f.to(torch.float64)).to(dtype)
            row[label] = time_eigh(m.to(host) if where == "host" else m)
        per_size[d] = row
    totals = {label: sum(r["count"] * r[label] for r in per_size.values())
              for label in EIGH_VARIANTS}
    trainer.close()
    return {"inverse update ms": statistics.median(update) * 1e3,
            "eigh one by one ms": statistics.median(each) * 1e3,
            "eigh batched by size ms": statistics.median(batched) * 1e3,
            "batched by size, host_decomposition_max_dim -> ms": by_host_max_dim,
            "batched by size, device streams -> ms": by_streams,
            "factors": len(factors), "per size": per_size,
            "sum of count x ms": totals,
            "linalg library": str(torch.backends.cuda.preferred_linalg_library())
            if device.type == "cuda" else None}


def decompositions_table(dec: dict[str, Any], md: bool) -> str:
    """Per factor size: count, fp32 routine, ms per eigh of each variant; a total row."""
    labels = list(EIGH_VARIANTS)
    rows = [[str(d), str(r["count"]), r["routine fp32"], *(f"{r[v]:.2f}" for v in labels)]
            for d, r in dec["per size"].items()]
    rows.append(["Σ count x ms", str(dec["factors"]), "",
                 *(f"{dec['sum of count x ms'][v]:.0f}" for v in labels)])
    return format_table(["dim", "count", "routine (fp32)", *(f"{v} ms" for v in labels)],
                        rows, md)


def profile_section(device: torch.device, batch: tuple[Tensor, Tensor],
                    args: argparse.Namespace) -> dict[str, Any]:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    trainer = Trainer(device, batch, args, {})
    baseline = Trainer(device, batch, args, None)
    for kind in ("fi", "f"):
        trainer.run(kind)
    baseline.run("sgd")
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    out: dict[str, Any] = {}
    for kind in ("sgd", "f", "fi", "p"):
        runner = baseline if kind == "sgd" else trainer
        synchronize(device)
        start = time.perf_counter()
        with profile(activities=activities) as prof:
            runner.run(kind)
            synchronize(device)
        wall = time.perf_counter() - start
        events = prof.key_averages()
        launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel",
                                                            "cuLaunchKernel",
                                                            "cudaLaunchKernelExC"))
        # device-side events (kernels, copies) hold the device time once; host-side
        # operators hold their children's (device_time_total), which would count it twice,
        # and so do the device-side spans of named ranges (user annotations)
        on_device = [e for e in events
                     if e.device_type != DeviceType.CPU and not e.is_user_annotation]
        on_host = [e for e in events if e.device_type == DeviceType.CPU]
        kernels = sorted(on_device, key=lambda e: e.self_device_time_total, reverse=True)
        operators = sorted(on_host, key=lambda e: e.device_time_total, reverse=True)
        out[kind] = {
            "wall ms (profiled)": wall * 1e3,
            "host ms": sum(e.self_cpu_time_total for e in on_host) / 1e3,
            "device ms": sum(e.self_device_time_total for e in on_device) / 1e3,
            "kernel launches": launches,
            "top": [(e.key, e.count, e.self_device_time_total / 1e3) for e in kernels[:20]],
            "top operators": [(e.key, e.count, e.device_time_total / 1e3)
                              for e in operators[:20]],
            # the library's named ranges (kfac_hpc.phases.profiler_range): host time and
            # the device time of the kernels launched inside from the same thread (not
            # those of the decompositions' stream lanes, worker threads of their own)
            "phases": [(e.key, e.count, e.cpu_time_total / 1e3, e.device_time_total / 1e3)
                       for e in on_host if e.key.startswith("kfac_hpc.")],
        }
    trainer.close()
    baseline.close()
    return out


def _layer_io(model: nn.Module, curvs: dict[str, LayerCurvature], names: Sequence[str],
              batch: tuple[Tensor, Tensor]) -> dict[str, tuple[Tensor, Tensor]]:
    """Inputs and output gradients of the named layers for one batch."""
    seen: dict[str, list[Tensor]] = {n: [] for n in names}
    handles = []
    for n in names:
        def hook(module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor,
                 n: str = n) -> None:
            seen[n].append(inputs[0].detach())
            output.register_hook(lambda g, n=n: seen[n].append(g.detach()))
        handles.append(curvs[n].module.register_forward_hook(hook))
    x, y = batch
    nn.functional.cross_entropy(model(x), y).backward()
    for h in handles:
        h.remove()
    return {n: (v[0], v[1]) for n, v in seen.items()}


def accuracy_section(device: torch.device, batch: tuple[Tensor, Tensor],
                     args: argparse.Namespace) -> dict[str, Any]:
    model = make_model(args.model, device, args.image_size).double()
    curvs, _ = register_layers(model)
    names = list(curvs)
    picked = list(dict.fromkeys(names[round(q * (len(names) - 1))]
                                for q in (0.0, 0.15, 0.5, 0.85, 1.0)))
    x, y = batch
    io = _layer_io(model, curvs, picked, (x.double(), y))
    out: dict[str, Any] = {}
    for n in picked:
        curv = curvs[n]
        inputs, grads = io[n]
        exact = {"A": curv.a_factor(inputs), "G": curv.g_factor(grads)}
        row: dict[str, Any] = {"A dim": curv.a_dim, "G dim": curv.g_dim}
        for precision in PRECISIONS:
            approx = {"A": curv.a_factor(inputs, torch.float32, precision),
                      "G": curv.g_factor(grads, torch.float32, precision=precision)}
            for f in ("A", "G"):
                e, a = exact[f], approx[f].double()
                diag = e.diagonal().clamp(min=1e-300)
                row[f"{f} {precision} entry"] = float(
                    ((a - e).abs() / torch.sqrt(torch.outer(diag, diag))).max())
                row[f"{f} {precision} fro"] = float(torch.linalg.norm(a - e) / torch.linalg.norm(e))
        gen = torch.Generator(device="cpu").manual_seed(1)
        grad = torch.randn(curv.g_dim, curv.a_dim, generator=gen, dtype=torch.float64).to(device)
        qa, la = linalg.eigh_clamped(exact["A"], torch.float64)
        qg, lg = linalg.eigh_clamped(exact["G"], torch.float64)
        damping = 1e-3 * float(la.max() * lg.max())
        reference = linalg.precondition_eigen(grad, qa, la, qg, lg, damping)
        g32, qa32, la32, qg32, lg32 = (t.float() for t in (grad, qa, la, qg, lg))
        for precision in PRECISIONS:
            v = linalg.precondition_eigen(g32, qa32, la32, qg32, lg32, damping,
                                          precision).double()
            row[f"V {precision}"] = float(torch.linalg.norm(v - reference)
                                          / torch.linalg.norm(reference))
        out[n] = row
    return out


def accuracy_table(res: dict[str, Any], md: bool) -> str:
    head = ["layer", "A dim", "G dim"]
    cols = [f"{f} {p} {m}" for f in ("A", "G") for p in ("full", "tf32", "bf16")
            for m in ("entry",)] + [f"V {p}" for p in ("full", "tf32", "bf16")]
    rows = [[n, str(r["A dim"]), str(r["G dim"]), *(f"{r[c]:.1e}" for c in cols)]
            for n, r in res.items()]
    return format_table(head + cols, rows, md)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--model", choices=("resnet50", "resnet20"), default="resnet50",
                   help="resnet20: small factors, for a dry run on the CPU")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--sections", nargs="+", default=["kinds", "schedule", "decompositions",
                                                      "profile", "accuracy"],
                   choices=["kinds", "schedule", "decompositions", "profile", "accuracy"])
    p.add_argument("--schedule", type=int, nargs=2, default=(1, 10), metavar=("F", "I"),
                   help="schedule section: factor_update_steps and inv_update_steps")
    p.add_argument("--lags", type=_lag_spec, nargs="+", default=["0", "5", "9"],
                   help="schedule section: decomposition_lag values, each LAG or "
                        "LAG:HOST_MAX_DIM (that lag with host_decomposition_max_dim)")
    p.add_argument("--training-stream", choices=TRAINING_STREAMS, default="default",
                   help="schedule section: the training loop on the current stream, on a "
                        "high-priority CUDA stream (background decompositions fill only its "
                        "idle time), or every row both ways")
    p.add_argument("--device-streams", type=int, nargs="+", default=[1, 2, 4, 8],
                   help="decompositions: the device's batches spread over this many "
                        "streams (kfac_hpc.solves.eigh_batches)")
    p.add_argument("--host-max-dims", type=int, nargs="+", default=[0, 512, 1024, 1152],
                   help="decompositions section: host_decomposition_max_dim values timed "
                        "(all factors' decompositions, the small ones on the host)")
    p.add_argument("--kinds", nargs="+", choices=list(KIND_CONFIGS), default=list(KIND_CONFIGS),
                   metavar="KEY", help="the kinds section's K-FAC configurations (default: all "
                   f"of {', '.join(KIND_CONFIGS)})")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--out", type=Path, default=Path("benchmarks/out/gpu"))
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_profile: --device cuda but torch sees no GPU "
              f"(torch {torch.__version__}, CUDA {torch.version.cuda})", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(args.batch, 3, args.image_size, args.image_size, generator=g).to(device),
             torch.randint(0, 1000, (args.batch,), generator=g).to(device))
    md = args.markdown
    result: dict[str, Any] = {"machine": machine(), "device": str(device),
                              "torch": torch.__version__, "cuda": torch.version.cuda,
                              "gpu": torch.cuda.get_device_name(device)
                              if device.type == "cuda" else None,
                              "batch": args.batch, "image_size": args.image_size}
    print(f"# gpu_profile: {result['gpu'] or 'CPU (dry run)'}, torch {torch.__version__}, "
          f"CUDA {torch.version.cuda}, batch {args.batch}, {args.image_size}px", flush=True)
    if "kinds" in args.sections:
        result["kinds"] = kinds_section(device, batch, args)
        print(kinds_table(result["kinds"], md), flush=True)
    if "schedule" in args.sections:
        result["schedule"] = schedule_section(device, batch, args)
        print(format_table(["configuration", "ms per iteration", "x SGD"],
                           [[k, f"{v['ms per iteration']:.1f}", f"{v['x SGD']:.2f}"]
                            for k, v in result["schedule"].items()], md), flush=True)
    if "decompositions" in args.sections:
        dec = decompositions_section(device, batch, args)
        result["decompositions"] = dec
        print(f"\ninverse update {dec['inverse update ms']:.1f} ms; eigh one by one "
              f"{dec['eigh one by one ms']:.1f} ms; batched by size "
              f"{dec['eigh batched by size ms']:.1f} ms ({dec['factors']} factors)")
        print("all decompositions batched by size, the CUDA factors up to "
              "host_decomposition_max_dim on the host beside the device's: "
              + ", ".join(f"{h}: {ms:.1f} ms" for h, ms in
                          dec["batched by size, host_decomposition_max_dim -> ms"].items()))
        print("all decompositions batched by size, on the device, spread over S streams: "
              + ", ".join(f"{s}: {ms:.1f} ms" for s, ms in
                          dec["batched by size, device streams -> ms"].items()))
        where = (f"{result['gpu']}" if device.type == "cuda" else "the CPU (dry run)")
        print(f"ms per torch.linalg.eigh of one factor per size (median of 3 below "
              f"{CHEAP_S * 1e3:.0f} ms, else one call); fp32, fp64: our factor on {where}; "
              "fp32 host: on the CPU (LAPACK); KAISA-like: 0.95·mean(diag F)·I + 0.05·F; "
              "F+100·m·I: F + 100·mean(diag F)·I; routine: torch's choice for fp32 on the "
              "device (fp64: syevd always)"
              + (f"; preferred linalg library {dec['linalg library']}"
                 if dec["linalg library"] else ""))
        print(decompositions_table(dec, md), flush=True)
    if "profile" in args.sections:
        prof = profile_section(device, batch, args)
        result["profile"] = prof
        for kind, v in prof.items():
            print(f"\n{kind}: wall {v['wall ms (profiled)']:.1f} ms (profiled), host "
                  f"{v['host ms']:.1f} ms, device {v['device ms']:.1f} ms, "
                  f"{v['kernel launches']} kernel launches")
            print(format_table(["kernel", "calls", "device ms"],
                               [[k[:60], str(c), f"{t:.2f}"] for k, c, t in v["top"]], md),
                  flush=True)
            print(format_table(["operator", "calls", "device ms (with children)"],
                               [[k[:60], str(c), f"{t:.2f}"]
                                for k, c, t in v.get("top operators", [])], md), flush=True)
            if v.get("phases"):
                print(format_table(["phase", "calls", "host ms", "device ms"],
                                   [[k, str(c), f"{h:.2f}", f"{d:.2f}"]
                                    for k, c, h, d in v["phases"]], md), flush=True)
    if "accuracy" in args.sections:
        result["accuracy"] = accuracy_section(device, batch, args)
        print("\n" + accuracy_table(result["accuracy"], md), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = write_json(args.out / f"gpu_profile_{device.type}.json", result)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
