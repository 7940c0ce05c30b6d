"""Gram products ``X Xᵀ`` by memory layout: which one the GPU's GEMM library runs fast.

    python benchmarks/gram_layouts.py [--device cuda] [--reps 5] [--markdown]
        [--out benchmarks/out/gpu]

Both optimizers spend their statistics time in Gram products of tall or wide
matrices: Shampoo's factor update ``F_i ← β2·F_i + (1-β2)·X_(i) X_(i)ᵀ`` per stack of
same-shaped blocks (:func:`kfac_hpc.shampoo.kronecker.accumulate_factors`, one batched
``baddbmm_`` per mode) and K-FAC's ``A = rowsᵀ rows / n`` per layer
(:func:`kfac_hpc.kfac.linalg.covariance`). The same product can be handed to the GEMM
library in two layouts, and cuBLAS picks its kernel by layout and shape: on an H200 a
Shampoo plain step of ResNet-50 spent 16.2 ms in its 47 factor ``baddbmm_`` calls
(11 of them in a 32x32-tile kernel, 14 ms) against 2.1 ms for the 47 preconditioning
``bmm`` calls of about the same flop count.

For every distinct (stack size ``n``, Gram dimension ``d``, contracted length ``K``)
of ResNet-50 (torchvision's when it imports, else ``kfac_hpc.models``'), the ms of:

* ``x·xᵀ``: ``X`` stored ``(n, d, K)`` row-major, ``baddbmm_(F, X, Xᵀ)``;
* ``yᵀ·y``: the same data stored ``(n, K, d)``, ``baddbmm_(F, Yᵀ, Y)``;
* ``copy+x·xᵀ`` / ``copy+yᵀ·y``: the layout the caller does not have, made by one copy
  first (what switching layouts would cost);
* ``split-K`` (Shampoo: ``d`` ≤ 64; K-FAC: where ``linalg.splits_rows``' sizes allow,
  ``d`` ≤ 1152 and ``K`` ≥ 16,384): the rows cut into ``s`` chunks of 4096, one batched
  product of the chunks and a sum: a small Gram matrix of a long ``K`` otherwise may
  leave most of the GPU idle, unless the GEMM library splits ``K`` itself (K-FAC's is
  ``linalg.split_gram`` on the rows in the layout it builds: a column-major one's chunks
  are strided views, no copy);
* ``outer`` (``K`` = 1 only, Shampoo's 1-D blocks): the outer product element-wise
  (``addcmul_``) instead of a GEMM with one column.

The totals row sums count x ms per column (a shortcut column counts "now" where it
was not timed).

A third table (``precondition``) times K-FAC's eigen preconditioning of every distinct
ResNet-50 layer shape with its eigenbases column-major (as ``eigh`` returns them: one
rank, and the owners), row-major (as other ranks receive them) and with the transposes
kept as well: four GEMMs whose layouts follow the eigenbases'; and, for the shapes of
two or more layers, one stacked call for all of them (the stacked path CUDA takes) in
the library's product order and in the direct one. Its Σ row counts a stacked call once
per shape and the single layers at "Q row-major".

A fourth table (``statistics``) times what a factor update does per convolution, from
a real forward and backward of ResNet-50 at ``--batch``: ``a_factor`` and ``g_factor``
(rows built from the NCHW tensors, then the Gram product) with the rows row-major
(``(K, d)``, the default) and column-major (the transposed view of a ``(d, K)`` copy:
runs of output positions copied in order, and ``x·xᵀ`` for the GEMM;
``layers.COLUMN_MAJOR_ROWS_DEVICES``), in full fp32 and in TF32 (the CUDA default).
Its Σ row says what switching the default would change per factor update.

A fifth table (``roots``) times Shampoo's root products ``Q diag(s) Qᵀ`` of a root step
(:func:`kfac_hpc.shampoo.roots.inverse_roots`: all the factors of one size in one
batched product), per distinct factor size of ResNet-50 with every factor of that size:
``Q`` column-major (as ``eigh`` returns it, what the eigen path multiplies: ``(Q·s)`` a
transposed view times ``Qᵀ`` row-major), row-major (as a subspace refresh returns it), and
one copy to row-major first (what making the eigen path's ``Q`` row-major would cost).

"layout now" names what the library runs on the device for that shape (Shampoo:
``kronecker.gram_operand``, row-major operands on CUDA, a copy where a mode is not
row-major, split-K where ``kronecker.splits_gram`` cuts a last mode of few rows into
chunks; on the CPU a block's last mode, a transposed view, is ``yᵀ·y``; K-FAC: its rows
as it builds them, a convolution's column-major on the devices of
``layers.COLUMN_MAJOR_ROWS_DEVICES`` (``x·xᵀ``), else ``yᵀ·y``), so the totals say what a
per-shape choice would save; "TFLOP/s now" is the shape's flops over that product's
time (how far each shape is from the GPU's peak). K-FAC's rows are timed in full fp32
and with TF32 products (its CUDA default). Runs on the CPU too (a dry run: CPU numbers
say nothing about a GPU).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter
from collections.abc import Callable
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import format_table, machine, synchronize, timed, write_json

from kfac_hpc.kfac import layers, linalg
from kfac_hpc.kfac.layers import Conv2dCurvature, register_layers
from kfac_hpc.kfac.precision import full_precision_products, tf32_products

SPLIT_MAX_DIM = 64  # split-K is timed for Shampoo's Gram dimensions up to this
SPLIT_ROWS = 4096  # rows per chunk of Shampoo's split-K (kronecker.SPLIT_COLUMNS)
# K-FAC's split-K is linalg.split_gram, timed where its rule's sizes allow
# (linalg.SPLIT_ROWS_MAX_DIM columns, linalg.SPLIT_ROWS_MIN_ROWS rows)


def resnet50() -> nn.Module:
    try:
        import torchvision
        model: nn.Module = torchvision.models.resnet50()
        return model
    except ImportError:
        from kfac_hpc.models import build_model
        return build_model("resnet50", num_classes=1000)


def shampoo_shapes(model: nn.Module, max_dim: int) -> Counter[tuple[int, int, int, str]]:
    """(n, d, K, native layout) of every factor product of a Shampoo plain step.

    The native layout is what ``X_(i)`` is without a copy: mode 0 a row-major ``X``
    ("x"), the last mode of a block a transposed view ("y"), a middle mode neither
    (``mode_matrices`` copies it).
    """
    from mpi4py import MPI

    from kfac_hpc.comm import Communicator
    from kfac_hpc.shampoo import DistributedShampoo

    opt = DistributedShampoo(model.named_parameters(), lr=1e-3, max_preconditioner_dim=max_dim,
                             comm=Communicator(MPI.COMM_SELF))
    blocks = Counter(tuple(b.shape) for b in opt.layout.blocks)
    shapes: Counter[tuple[int, int, int, str]] = Counter()
    for shape, n in blocks.items():
        size = 1
        for s in shape:
            size *= s
        for i, d in enumerate(shape):
            native = "x" if i == 0 else "y" if i == len(shape) - 1 else "none"
            shapes[(n, d, size // d, native)] += 1
    return shapes


def layout_now(native: str, n: int, d: int, k: int, device: torch.device) -> str:
    """The product the library runs for a ``native`` layout of ``n`` blocks of ``d`` rows
    and ``k`` columns on ``device``.

    :func:`kfac_hpc.shampoo.kronecker.gram_operand` (row-major on its devices, a copy
    where the native layout is not), or the chunks of :func:`~kfac_hpc.shampoo.kronecker.
    splits_gram`, for Shampoo; K-FAC's rows are "y" and stay.
    """
    from kfac_hpc.shampoo.kronecker import ROW_MAJOR_GRAM_DEVICES, splits_gram_shape

    if native == "x":
        return "x·xᵀ"
    if native == "y" and splits_gram_shape(n, d, k, device.type):
        return "split-K"
    if native == "y" and device.type not in ROW_MAJOR_GRAM_DEVICES:
        return "yᵀ·y"
    return "copy+x·xᵀ"


def kfac_shapes(model: nn.Module, batch: int, image: int, device: torch.device
                ) -> Counter[tuple[int, int, int, str]]:
    """(1, d, K, native) of every factor of a K-FAC factor update (``expand``) on
    ``device``: a convolution's rows column-major ("x", stored ``(d, K)``: the product
    "x·xᵀ") on the devices of ``layers.COLUMN_MAJOR_ROWS_DEVICES``, else row-major
    ("y", stored ``(K, d)``: "yᵀ·y"), as the library builds them; a Linear's "y"."""
    curvs, _ = register_layers(model)
    positions: dict[str, int] = {}  # output positions per sample (1 for a Linear)
    handles = []
    for name, curv in curvs.items():
        def hook(m: nn.Module, inputs: tuple[Tensor, ...], output: Tensor,
                 name: str = name) -> None:
            positions[name] = output[0, 0].numel() if output.dim() == 4 else 1
        handles.append(curv.module.register_forward_hook(hook))
    with torch.no_grad():
        model.eval()(torch.zeros(1, 3, image, image))
    for h in handles:
        h.remove()
    shapes: Counter[tuple[int, int, int, str]] = Counter()
    columns = device.type in layers.COLUMN_MAJOR_ROWS_DEVICES
    for name, curv in curvs.items():
        rows = batch * positions[name]
        native = "x" if columns and isinstance(curv, Conv2dCurvature) else "y"
        shapes[(1, curv.a_dim, rows, native)] += 1
        shapes[(1, curv.g_dim, rows, native)] += 1
    return shapes


def timed_ms(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median ms of ``reps`` calls after one warm-up (device synchronised around each)."""
    fn()
    synchronize(device)
    return statistics.median(timed(fn, device)[1] * 1e3 for _ in range(reps))


def variants(n: int, d: int, k: int, device: torch.device, batched: bool = True,
             native: str = "y") -> dict[str, Callable[[], object]]:
    """The products to time for one shape (fresh random data, fp32).

    ``batched``: ``baddbmm_`` into running factors, as Shampoo's stacks; else (``n`` = 1)
    one 2-D ``addmm`` with ``beta=0`` and the scale in ``alpha``, as K-FAC's
    :func:`~kfac_hpc.kfac.linalg.covariance`, whose split-K
    (:func:`~kfac_hpc.kfac.linalg.split_gram`) chunks the ``native`` layout.
    """
    gen = torch.Generator(device="cpu").manual_seed(d * 7919 + k)
    y = torch.randn(n, k, d, generator=gen).to(device)  # (n, K, d)
    x = y.mT.contiguous()  # (n, d, K)
    f = torch.zeros(n, d, d, device=device)
    if batched:
        xs, ys = x, y

        def product(a: Tensor, b: Tensor) -> object:
            return f.baddbmm_(a, b, beta=0.9, alpha=0.1)
    else:
        xs, ys = x[0], y[0]

        def product(a: Tensor, b: Tensor) -> object:
            return torch.addmm(a.new_empty(()), a, b, beta=0, alpha=0.1)
    out: dict[str, Callable[[], object]] = {
        "x·xᵀ": lambda: product(xs, xs.mT),
        "yᵀ·y": lambda: product(ys.mT, ys),
        "copy+x·xᵀ": lambda: (lambda c: product(c, c.mT))(ys.mT.contiguous()),
        "copy+yᵀ·y": lambda: (lambda c: product(c.mT, c))(xs.mT.contiguous()),
    }
    if k == 1:  # a 1-D block: its factor is an outer product, element-wise
        out["outer"] = lambda: f.mul_(0.9).addcmul_(x, x.mT, value=0.1)
    if not batched and d <= linalg.SPLIT_ROWS_MAX_DIM and k >= linalg.SPLIT_ROWS_MIN_ROWS:
        # the library's product on the rows as it builds them: column-major rows are
        # the transposed view of x
        out["split-K"] = partial(linalg.split_gram, x[0].t() if native == "x" else y[0], 0.1)
    elif batched and d <= SPLIT_MAX_DIM and k >= 2 * SPLIT_ROWS:
        s = k // SPLIT_ROWS
        rows = s * SPLIT_ROWS
        head = y[:, :rows].reshape(n * s, SPLIT_ROWS, d)
        tail = y[:, rows:]

        def split() -> None:
            partial = torch.bmm(head.mT, head).view(n, s, d, d).sum(1)
            if tail.shape[1]:
                partial.baddbmm_(tail.mT, tail)
            f.mul_(0.9).add_(partial, alpha=0.1)
        out["split-K"] = split
    return out


def precondition_variants(g: int, a: int, device: torch.device
                          ) -> dict[str, Callable[[], object]]:
    """K-FAC's eigen preconditioning ``Q_G [(Q_Gᵀ ∇W Q_A) / (λ_G λ_Aᵀ + γ)] Q_Aᵀ`` of one
    ``(g, a)`` gradient, the eigenbases in three layouts (fp32):

    * ``Q col-major``: as ``torch.linalg.eigh`` returns them (the owner's, and one
      rank's): products "nn", "tn", "nt", "nn";
    * ``Q row-major``: as a rank receives them packed: "nt", "nn", "nn", "tn";
    * ``Q and Qᵀ row-major``: both kept contiguous (twice the memory): all "nn".
    """
    gen = torch.Generator(device="cpu").manual_seed(g * 31 + a)
    grad = torch.randn(g, a, generator=gen).to(device)
    qa_rows = torch.randn(a, a, generator=gen).to(device)
    qg_rows = torch.randn(g, g, generator=gen).to(device)
    la, lg = torch.rand(a, generator=gen).to(device), torch.rand(g, generator=gen).to(device)
    qa_cols, qg_cols = qa_rows.t().contiguous().t(), qg_rows.t().contiguous().t()
    qa_t, qg_t = qa_rows.t().contiguous(), qg_rows.t().contiguous()

    def chain(qg: Tensor, qgt: Tensor, qa: Tensor, qat: Tensor) -> Tensor:
        v = (qgt @ grad) @ qa
        v.div_(torch.outer(lg, la).add_(1e-3))
        return (qg @ v) @ qat

    return {
        "Q col-major": lambda: chain(qg_cols, qg_cols.t(), qa_cols, qa_cols.t()),
        "Q row-major": lambda: chain(qg_rows, qg_rows.t(), qa_rows, qa_rows.t()),
        "Q and Qᵀ row-major": lambda: chain(qg_rows, qg_t, qa_rows, qa_t),
    }


PRECONDITION_COLUMNS = ["Q col-major", "Q row-major", "Q and Qᵀ row-major",
                        "stacked", "stacked direct"]


def stacked_variants(n: int, g: int, a: int, device: torch.device
                     ) -> dict[str, Callable[[], object]]:
    """The stacked path of ``n`` layers (row-major stacks, as the preconditioner keeps
    them): the library's order (``tt, tt, tn, nn``:
    :func:`kfac_hpc.kfac.linalg.precondition_eigen_stacked`) and the direct one
    (``Q_Gᵀ ∇W̄`` first: ``nt, nn, nn, tn``)."""
    gen = torch.Generator(device="cpu").manual_seed(n * 131 + g * 31 + a)
    grads = torch.randn(n, g, a, generator=gen).to(device)
    qa = torch.randn(n, a, a, generator=gen).to(device)
    qg = torch.randn(n, g, g, generator=gen).to(device)
    den = torch.rand(n, g, a, generator=gen).to(device).add_(1e-3)

    def direct() -> Tensor:
        v = (qg.mT @ grads) @ qa
        v.div_(den)
        return (qg @ v) @ qa.mT

    return {"stacked": lambda: linalg.precondition_eigen_stacked(grads, qa, qg, den),
            "stacked direct": direct}


def measure_preconditioning(model: nn.Module, device: torch.device, reps: int
                            ) -> list[dict[str, Any]]:
    curvs, _ = register_layers(model)
    shapes = Counter((c.g_dim, c.a_dim) for c in curvs.values())
    rows = []
    for (g, a), count in sorted(shapes.items(), key=lambda s: -s[0][0] * s[0][1]):
        fns = precondition_variants(g, a, device)
        if count > 1:
            fns.update(stacked_variants(count, g, a, device))
        ms = {name: timed_ms(fn, device, reps) for name, fn in fns.items()}
        rows.append({"g": g, "a": a, "count": count, "ms": ms,
                     "gflop": 4.0 * g * a * (g + a) / 1e9})
    return rows


def preconditioning_table(rows: list[dict[str, Any]], markdown: bool) -> str:
    body = [[str(r["g"]), str(r["a"]), str(r["count"]), f"{r['gflop']:.2f}",
             *[f"{r['ms'][c]:.3f}" if c in r["ms"] else "" for c in PRECONDITION_COLUMNS]]
            for r in rows]

    def total(c: str) -> float:  # a stacked call covers its count; single layers per layer
        return float(sum(r["ms"][c] if c in r["ms"] else r["count"] * r["ms"]["Q row-major"]
                         for r in rows)) if c.startswith("stacked") else \
            float(sum(r["count"] * r["ms"][c] for r in rows))

    body.append(["Σ", "", "", f"{sum(r['count'] * r['gflop'] for r in rows):.1f}",
                 *[f"{total(c):.2f}" for c in PRECONDITION_COLUMNS]])
    return format_table(["g", "a", "count", "GFLOP", *PRECONDITION_COLUMNS], body, markdown)


COLUMNS = ["x·xᵀ", "yᵀ·y", "copy+x·xᵀ", "copy+yᵀ·y", "split-K", "outer"]
SHORTCUTS = ("split-K", "outer")  # timed for some shapes only


def measure(shapes: Counter[tuple[int, int, int, str]], device: torch.device, reps: int,
            tf32: bool, batched: bool) -> list[dict[str, Any]]:
    rows = []
    for (n, d, k, native), count in sorted(shapes.items(),
                                           key=lambda s: -s[0][0] * s[0][1] ** 2 * s[0][2]):
        context = tf32_products() if tf32 and device.type == "cuda" else nullcontext()
        with context:
            ms = {name: timed_ms(fn, device, reps)
                  for name, fn in variants(n, d, k, device, batched, native).items()}
        # K-FAC multiplies its rows as they are; Shampoo as kronecker.gram_operand says
        now = {"x": "x·xᵀ", "y": "yᵀ·y"}[native] if not batched \
            else layout_now(native, n, d, k, device)
        # what the library could do: either layout after a copy, the copy-free one where
        # the data has it, the shortcuts
        free = {"x": ["x·xᵀ"], "y": ["yᵀ·y"]}.get(native, [])
        choices = {c: ms[c] for c in ["copy+x·xᵀ", "copy+yᵀ·y", *free, *SHORTCUTS] if c in ms}
        best = min(choices, key=lambda c: choices[c])
        rows.append({"n": n, "d": d, "K": k, "count": count, "now": now, "ms": ms,
                     "gflop": 2.0 * n * d * d * k / 1e9, "best": best,
                     "best ms": choices[best]})
    return rows


def table(rows: list[dict[str, Any]], markdown: bool) -> str:
    body = []
    for r in rows:
        cells = [f"{r['ms'][c]:.3f}" if c in r["ms"] else "" for c in COLUMNS]
        body.append([str(r["n"]), str(r["d"]), str(r["K"]), str(r["count"]), f"{r['gflop']:.2f}",
                     r["now"], f"{r['gflop'] / r['ms'][r['now']]:.1f}", *cells, r["best"]])
    totals = {c: sum(r["count"] * r["ms"].get(c, r["ms"][r["now"]] if c in SHORTCUTS else 0.0)
                     for r in rows) for c in COLUMNS}
    now_total = sum(r["count"] * r["ms"][r["now"]] for r in rows)
    best_total = sum(r["count"] * r["best ms"] for r in rows)
    gflop = sum(r["count"] * r["gflop"] for r in rows)
    body.append(["Σ count·ms", "", "", "", f"{gflop:.1f}", f"now {now_total:.2f}",
                 f"{gflop / now_total:.1f}", *[f"{totals[c]:.2f}" for c in COLUMNS],
                 f"best {best_total:.2f}"])
    # TFLOP/s now: the shape's flops over the time of the product the library runs
    return format_table(["n", "d", "K", "count", "GFLOP", "layout now", "TFLOP/s now",
                         *COLUMNS, "best"], body, markdown)


ROOT_COLUMNS = ["Q column-major", "Q row-major", "copy+row-major"]


def root_sizes(model: nn.Module, max_dim: int) -> Counter[int]:
    """Factors per size ``d`` of a Shampoo root step (one batched product per size)."""
    sizes: Counter[int] = Counter()
    for (n, d, _, _), count in shampoo_shapes(model, max_dim).items():
        sizes[d] += n * count
    return sizes


def measure_roots(sizes: Counter[int], device: torch.device, reps: int) -> list[dict[str, Any]]:
    """ms of the batched root products per size, by the layout of ``Q``."""
    rows = []
    for d, n in sorted(sizes.items(), key=lambda s: -s[1] * s[0] ** 3):
        g = torch.Generator(device=device).manual_seed(d)
        q_col = torch.linalg.qr(torch.randn(n, d, d, device=device, generator=g))[0].mT
        q_col = q_col.contiguous().mT  # column-major storage, as eigh returns it
        q_row = q_col.contiguous()
        scale = torch.rand(n, 1, d, device=device, generator=g)

        def product(q: Tensor, s: Tensor = scale) -> Tensor:
            return (q * s) @ q.mT

        fns: dict[str, Callable[[], object]] = {
            "Q column-major": partial(product, q_col),
            "Q row-major": partial(product, q_row),
            "copy+row-major": lambda q=q_col: product(q.contiguous()),  # type: ignore[misc]
        }
        with full_precision_products():
            ms = {name: timed_ms(fn, device, reps) for name, fn in fns.items()}
        rows.append({"d": d, "count": n, "ms": ms, "gflop": 2.0 * n * d**3 / 1e9})
    return rows


def roots_table(rows: list[dict[str, Any]], markdown: bool) -> str:
    body = [[str(r["d"]), str(r["count"]), f"{r['gflop']:.2f}",
             *[f"{r['ms'][c]:.3f}" for c in ROOT_COLUMNS]] for r in rows]
    body.append(["Σ", str(sum(r["count"] for r in rows)),
                 f"{sum(r['gflop'] for r in rows):.1f}",
                 *[f"{sum(r['ms'][c] for r in rows):.2f}" for c in ROOT_COLUMNS]])
    return format_table(["d", "count", "GFLOP", *ROOT_COLUMNS], body, markdown)


STATISTICS_COLUMNS = [f"{prec} {layout}" for prec in ("fp32", "tf32")
                      for layout in ("rows", "columns")]


def conv_tensors(model: nn.Module, batch: int, image: int, device: torch.device
                 ) -> dict[tuple[Any, ...], tuple[Conv2dCurvature, Tensor, Tensor, int]]:
    """One input and output gradient per distinct convolution (its count alongside),
    from one forward and backward of ``model`` on random images."""
    curvs, _ = register_layers(model)
    seen: dict[str, list[Tensor]] = {}
    handles = []
    for name, curv in curvs.items():
        if not isinstance(curv, Conv2dCurvature):
            continue

        def hook(m: nn.Module, inputs: tuple[Tensor, ...], output: Tensor,
                 name: str = name) -> None:
            seen[name] = [inputs[0].detach()]
            output.register_hook(lambda g, name=name: seen[name].append(g.detach()))
        handles.append(curv.module.register_forward_hook(hook))
    model.train()
    x = torch.randn(batch, 3, image, image, device=device)
    nn.functional.cross_entropy(model(x), torch.zeros(batch, dtype=torch.long,
                                                       device=device)).backward()
    for h in handles:
        h.remove()
    out: dict[tuple[Any, ...], tuple[Conv2dCurvature, Tensor, Tensor, int]] = {}
    for name, (inputs, grad) in seen.items():
        curv = curvs[name]
        m = curv.module
        key = (m.in_channels, m.out_channels, m.kernel_size, m.stride, m.padding,
               tuple(inputs.shape[2:]), curv.has_bias)
        count = out[key][3] + 1 if key in out else 1
        out[key] = (curv, inputs, grad, count)  # type: ignore[assignment]
    return out


def measure_statistics(model: nn.Module, batch: int, image: int, device: torch.device,
                       reps: int) -> list[dict[str, Any]]:
    """ms of ``a_factor`` + ``g_factor`` per distinct convolution, rows by layout."""
    rows = []
    default = layers.COLUMN_MAJOR_ROWS_DEVICES
    try:
        for key, (curv, x, g, count) in conv_tensors(model, batch, image, device).items():
            ms: dict[str, float] = {}
            for prec, precision in (("fp32", "full"), ("tf32", "tf32")):
                for layout in ("rows", "columns"):
                    layers.COLUMN_MAJOR_ROWS_DEVICES = (frozenset({device.type})
                                                        if layout == "columns" else frozenset())

                    def factors(curv: Conv2dCurvature = curv, x: Tensor = x, g: Tensor = g,
                                precision: str = precision) -> object:
                        return (curv.a_factor(x, precision=precision),  # type: ignore[arg-type]
                                curv.g_factor(g, precision=precision))  # type: ignore[arg-type]
                    ms[f"{prec} {layout}"] = timed_ms(factors, device, reps)
            rows.append({"conv": f"{key[0]}->{key[1]} k{key[2][0]} s{key[3][0]} "
                                 f"{key[5][0]}x{key[5][1]}",
                         "a_dim": curv.a_dim, "g_dim": curv.g_dim,
                         "K": x.shape[0] * g.shape[2] * g.shape[3], "count": count, "ms": ms})
    finally:
        layers.COLUMN_MAJOR_ROWS_DEVICES = default
    return rows


def statistics_table(rows: list[dict[str, Any]], markdown: bool) -> str:
    body = [[r["conv"], str(r["a_dim"]), str(r["g_dim"]), str(r["K"]), str(r["count"]),
             *[f"{r['ms'][c]:.3f}" for c in STATISTICS_COLUMNS]] for r in rows]
    body.append(["Σ count·ms", "", "", "", str(sum(r["count"] for r in rows)),
                 *[f"{sum(r['count'] * r['ms'][c] for r in rows):.2f}"
                   for c in STATISTICS_COLUMNS]])
    return format_table(["conv (input)", "a_dim", "g_dim", "K", "count", *STATISTICS_COLUMNS],
                        body, markdown)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--batch", type=int, default=32, help="K-FAC's batch (rows = batch·positions)")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--max-dim", type=int, default=1024, help="Shampoo's max_preconditioner_dim")
    p.add_argument("--sets", nargs="+",
                   default=["shampoo", "kfac", "precondition", "statistics", "roots"],
                   choices=["shampoo", "kfac", "precondition", "statistics", "roots"])
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--out", type=Path, default=Path("benchmarks/out/gpu"))
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gram_layouts: --device cuda but torch sees no GPU; use --device cpu for a dry run",
              file=sys.stderr)
        return 2
    device = torch.device(args.device)
    result: dict[str, Any] = {"machine": machine(), "device": str(device),
                              "gpu": torch.cuda.get_device_name() if device.type == "cuda"
                              else None, "torch": torch.__version__}
    print(f"# gram_layouts: {result['gpu'] or 'CPU (dry run)'}, torch {torch.__version__}, "
          f"median of {args.reps}", flush=True)
    runs = []
    if "shampoo" in args.sets:
        runs.append(("shampoo factor update (fp32, batched)",
                     shampoo_shapes(resnet50(), args.max_dim), False, True))
    if "kfac" in args.sets:
        shapes = kfac_shapes(resnet50(), args.batch, args.image_size, device)
        runs.append(("K-FAC factors (fp32, 2-D addmm)", shapes, False, False))
        runs.append(("K-FAC factors (TF32 products, 2-D addmm)", shapes, True, False))
    for title, shapes, tf32, batched in runs:
        rows = measure(shapes, device, args.reps, tf32, batched)
        result[title] = rows
        print(f"\n{title}: ms per product\n" + table(rows, args.markdown), flush=True)
    if "precondition" in args.sets:
        rows = measure_preconditioning(resnet50(), device, args.reps)
        result["K-FAC preconditioning"] = rows
        print("\nK-FAC eigen preconditioning (fp32) by eigenbasis layout: ms per layer\n"
              + preconditioning_table(rows, args.markdown), flush=True)
    if "statistics" in args.sets:
        rows = measure_statistics(resnet50().to(device), args.batch, args.image_size, device,
                                  args.reps)
        result["K-FAC statistics by row layout"] = rows
        print("\nK-FAC conv statistics (a_factor + g_factor) by row layout: ms per layer\n"
              + statistics_table(rows, args.markdown), flush=True)
    if "roots" in args.sets:
        rows = measure_roots(root_sizes(resnet50(), args.max_dim), device, args.reps)
        result["Shampoo root products"] = rows
        print("\nShampoo root products Q diag(s) Qᵀ (fp32, all factors of a size batched) by "
              "the layout of Q: ms per size\n" + roots_table(rows, args.markdown), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"\nwrote {write_json(args.out / f'gram_layouts_{device.type}.json', result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
