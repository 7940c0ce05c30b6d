"""The GPU path of K-FAC's statistics, run on the CPU: same numbers, few kernels.

On a GPU each factor is one unfold/copy and one GEMM, and decompositions are batched by
size (``kfac_hpc.kfac.linalg.uses_gpu_path``). Here that choice is forced on CPU
tensors (fixture ``gpu_path``) so that the path is checked without a GPU:

* it equals the CPU-tuned path in float64 (factors of every layer kind; whole training
  runs for every strategy at 1, 2 and 4 ranks);
* the operators it dispatches (about one kernel each on a GPU) are bounded per layer,
  with exactly one GEMM per factor update and one ``eigh`` per distinct factor size, so
  a per-sample, per-block or per-offset loop cannot come back unnoticed.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
from mpi4py import MPI
from op_count import GEMMS, count_host_reads, count_ops, timeline
from shared_cases import (
    case_ids,
    fraction_for,
    kfac_cases,
    narrow_resnet50,
    small_cnn,
    small_cnn_batches,
    train_kfac,
)
from torch import nn

from kfac_hpc import KFACPreconditioner
from kfac_hpc.comm import Communicator
from kfac_hpc.kfac import layers, linalg, statistics_groups
from kfac_hpc.kfac.layers import Conv2dCurvature, LinearCurvature

CASES = kfac_cases(input_shape=(4, 2, 5, 5))


@pytest.fixture
def gpu_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every device takes the GPU path (CPU tensors included) while the test runs."""
    for module in (linalg, layers, statistics_groups):
        monkeypatch.setattr(module, "uses_gpu_path", lambda device: True)
    yield


def _both_paths(monkeypatch: pytest.MonkeyPatch, fn):  # type: ignore[no-untyped-def]
    cpu = fn()
    for module in (linalg, layers, statistics_groups):
        monkeypatch.setattr(module, "uses_gpu_path", lambda device: True)
    gpu = fn()
    monkeypatch.undo()
    return cpu, gpu


@pytest.mark.parametrize("conv", [
    nn.Conv2d(16, 8, 3, padding=1),
    nn.Conv2d(16, 8, 3, stride=2, bias=False),
    nn.Conv2d(9, 12, (3, 2), padding="same", dilation=(1, 2)),
    nn.Conv2d(3, 70, 1),  # more output channels than positions: CPU's row path for G
], ids=["pad-bias", "stride", "same-dilation", "1x1-wide"])
@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_conv_factors_equal_the_cpu_path(monkeypatch, conv, approx):
    curv = Conv2dCurvature(conv.double(), approx)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, conv.in_channels, 9, 8, generator=g, dtype=torch.float64)
    out_shape = conv(x).shape
    dy = torch.randn(out_shape, generator=g, dtype=torch.float64)
    (a_cpu, g_cpu), (a_gpu, g_gpu) = _both_paths(
        monkeypatch, lambda: (curv.a_factor(x), curv.g_factor(dy, grad_scale=0.5)))
    torch.testing.assert_close(a_gpu, a_cpu, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(g_gpu, g_cpu, rtol=1e-12, atol=1e-14)
    for m in (a_cpu, g_cpu):
        assert torch.equal(m, m.t()), "the CPU path's factors are exactly symmetric"


def test_linear_factors_equal_the_cpu_path(monkeypatch):
    curv = LinearCurvature(nn.Linear(80, 70).double())
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 40, 80, generator=g, dtype=torch.float64)  # 240 rows >= 2·d
    dy = torch.randn(6, 40, 70, generator=g, dtype=torch.float64)
    (a_cpu, g_cpu), (a_gpu, g_gpu) = _both_paths(
        monkeypatch, lambda: (curv.a_factor(x), curv.g_factor(dy)))
    torch.testing.assert_close(a_gpu, a_cpu, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(g_gpu, g_cpu, rtol=1e-12, atol=1e-14)


def _train(comm: Communicator, strategy: str, options: dict) -> nn.Module:
    strategy, fraction = fraction_for(strategy, comm.size)
    model = small_cnn()
    pre = KFACPreconditioner(model, comm=comm, strategy=strategy, grad_worker_fraction=fraction,
                             damping=0.01, inv_update_steps=2, inv_dtype=torch.float64,
                             **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train_kfac(model, opt, pre, small_cnn_batches(5))
    pre.close()
    return model


def _compare_training(monkeypatch, comm: Communicator, strategy: str, options: dict) -> None:
    cpu, gpu = _both_paths(monkeypatch, lambda: _train(comm, strategy, options))
    for (name, p), q in zip(gpu.named_parameters(), cpu.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12, msg=f"{name} differs")


@pytest.mark.parametrize("strategy, options", CASES, ids=case_ids(CASES))
def test_training_on_the_gpu_path_equals_the_cpu_path(monkeypatch, strategy, options):
    _compare_training(monkeypatch, Communicator(MPI.COMM_SELF), strategy, options)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("strategy, options", CASES, ids=case_ids(CASES))
def test_training_on_the_gpu_path_equals_the_cpu_path_ranks(monkeypatch, comm, strategy,
                                                            options):
    _compare_training(monkeypatch, comm, strategy, options)


def _kfac_ops(pre: KFACPreconditioner | None, model: nn.Module):  # type: ignore[no-untyped-def]
    """Operators of one forward, backward and ``pre.step()`` (factor and inverse update)."""
    x = torch.randn(2, 3, 16, 16)
    y = torch.tensor([1, 2])

    def iteration() -> None:
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        if pre is not None:
            pre.step()

    iteration()  # warm: the second step folds into existing running averages
    return count_ops(iteration)


def _shape_groups(model: nn.Module, layers: dict[str, nn.Module]) -> int:
    """Factors of ``layers`` after grouping layers of one shape: distinct ``A`` inputs
    (shape and convolution geometry) plus distinct ``G`` outputs (shape)."""
    a_keys, g_keys = set(), set()

    def record(module, inputs, output):  # type: ignore[no-untyped-def]
        geometry = tuple(getattr(module, attr, None) for attr in (
            "kernel_size", "stride", "padding", "dilation"))
        a_keys.add((type(module), tuple(inputs[0].shape), geometry, module.bias is not None))
        g_keys.add((type(module), tuple(output.shape)))

    handles = [m.register_forward_hook(record) for m in layers.values()]
    model(torch.randn(2, 3, 16, 16))
    for h in handles:
        h.remove()
    return len(a_keys) + len(g_keys)


def test_resnet50_kernels_per_layer_are_bounded(gpu_path):
    """ResNet-50's layers (54): K-FAC's kernels beyond plain training are at most 30
    per layer for a step that updates factors and decompositions (measured: 24.8; 27.6
    before layers of one shape shared their statistics' products), with one GEMM per
    group of layers of one shape for the statistics (32 for 108 factors) and four per
    preconditioned layer, and one ``eigh`` per distinct factor size."""
    plain = _kfac_ops(None, narrow_resnet50())
    model = narrow_resnet50()
    pre = KFACPreconditioner(model, comm=Communicator(MPI.COMM_SELF), damping=0.01)
    ops = _kfac_ops(pre, model)
    n_layers = len(pre.layers)
    assert n_layers == 54
    extra = ops.kernels - plain.kernels
    assert extra <= 30 * n_layers, f"{extra} K-FAC kernels for {n_layers} layers"

    def calls(counter, prefixes: tuple[str, ...]) -> int:  # type: ignore[no-untyped-def]
        return sum(n for name, n in counter.counts.items() if name.startswith(prefixes))

    statistics = _shape_groups(model, {n: c.module for n, c in pre.layers.items()})
    assert statistics == 32  # of 2 * 54 factors
    preconditioning = 4 * n_layers  # Q_Gᵀ ∇W̄ Q_A and back
    assert calls(ops, GEMMS) - calls(plain, GEMMS) == statistics + preconditioning
    sizes = {(c.a_dim) for c in pre.layers.values()} | {c.g_dim for c in pre.layers.values()}
    assert calls(ops, ("aten._linalg_eigh.", "aten.linalg_eigh.")) == len(sizes)
    pre.close()


def test_host_reads_per_step_do_not_grow_with_layers(gpu_path):
    """Device-to-host reads (``.item()``, ``.tolist()``: a sync each on a GPU) in a step
    that updates factors and decompositions: the same for 3 and 10 layers of one width
    (eigh's own error check is one read per distinct factor size, counted as
    ``_linalg_eigh`` calls above)."""
    def reads(hidden: int) -> int:
        torch.manual_seed(0)
        mods: list[nn.Module] = [nn.Linear(8, 16)]
        for _ in range(hidden):
            mods += [nn.Tanh(), nn.Linear(16, 16)]
        model = nn.Sequential(*mods, nn.Tanh(), nn.Linear(16, 3))
        pre = KFACPreconditioner(model, comm=Communicator(MPI.COMM_SELF))
        x, y = torch.randn(8, 8), torch.randint(0, 3, (8,))
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        pre.step()
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        ops = count_ops(lambda: host.append(count_host_reads(pre.step)))
        pre.close()
        return host[-1].total + sum(n for name, n in ops.counts.items() if "eigh" in name)

    host: list = []
    shallow, deep = reads(1), reads(8)
    assert shallow == deep, f"{shallow} host reads with 3 layers, {deep} with 10"
    assert shallow <= 8


@pytest.mark.parametrize("precision", ["tf32", "bf16", "full"])
def test_bf16_activations_keep_their_rows_and_give_the_widened_factor(
        gpu_path, monkeypatch, precision):
    """GPU path, AMP (bf16) tensors and reduced-precision statistics: the rows of ``A``
    and ``G`` stay bf16 (on CUDA one bf16 GEMM accumulating in float32); the factors are
    those of the widened tensors, here bit for bit (the CPU widens the bf16 rows before
    its GEMM). With ``precision="full"`` (or a device-side loss scale, for ``G``) the
    tensors are widened first, as before."""
    seen: list[tuple[torch.dtype, torch.dtype | None]] = []

    def spy(rows, scale=1.0, *, precision="full", out_dtype=None):  # type: ignore[no-untyped-def]
        seen.append((rows.dtype, out_dtype))
        return linalg.covariance(rows, scale, precision=precision, out_dtype=out_dtype)

    torch.manual_seed(0)
    cases = [(Conv2dCurvature(nn.Conv2d(6, 4, 3, padding=1)), torch.randn(3, 6, 7, 5)),
             (Conv2dCurvature(nn.Conv2d(6, 4, 1, bias=False)), torch.randn(3, 6, 4, 4)),
             (LinearCurvature(nn.Linear(10, 3)), torch.randn(2, 5, 10))]
    for curv, x in cases:
        x16 = x.bfloat16()
        want = curv.a_factor(x16.float(), torch.float32, precision)
        seen.clear()
        with monkeypatch.context() as m:
            m.setattr(layers, "covariance", spy)
            got = curv.a_factor(x16, torch.float32, precision)
        assert got.dtype == torch.float32 and torch.equal(got, want), type(curv).__name__
        kept = (torch.bfloat16, torch.float32)
        assert seen == ([kept] if precision != "full" else [(torch.float32, None)]), seen
        # G of bf16 output gradients: the same; a device-side loss scale widens first
        dy = curv.module(x).detach().bfloat16().normal_()
        for grad_scale, keeps in ((0.5, precision != "full"), (torch.tensor(0.5), False)):
            want = curv.g_factor(dy.float(), torch.float32, grad_scale, precision)
            seen.clear()
            with monkeypatch.context() as m:
                m.setattr(layers, "covariance", spy)
                got = curv.g_factor(dy, torch.float32, grad_scale, precision)
            assert torch.equal(got, want), (type(curv).__name__, grad_scale)
            assert seen[0] == (kept if keeps else (torch.float32, None)), seen


@pytest.mark.parametrize("factor_update_steps, expected", [(1, 1), (3, 0)],
                         ids=["factor-step", "precondition-only"])
def test_steps_between_inverse_updates_read_back_only_the_statistics_screen(
        gpu_path, factor_update_steps, expected):
    """Between inverse updates a step on one rank reads the device once when it updates
    factors (the finiteness screen of all statistics) and never when it only
    preconditions: the KL clip's ν is computed and applied on the device."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    pre = KFACPreconditioner(model, comm=Communicator(MPI.COMM_SELF), kl_clip=1e-6,
                             factor_update_steps=factor_update_steps, inv_update_steps=6)
    x, y = torch.randn(8, 8), torch.randint(0, 3, (8,))
    reads = []
    for _ in range(4):
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        reads.append(count_host_reads(pre.step).total)
    pre.close()
    steps = [k for k in (1, 2) if k % factor_update_steps == (0 if expected else 1)]
    assert steps and all(reads[k] == expected for k in steps), reads


@pytest.mark.parametrize("options", [{}, {"kl_clip": 1e-3}, {"factor_sync": "inverse"}],
                         ids=["plain", "kl-clip", "factor-sync-inverse"])
def test_a_factor_step_reads_the_screen_after_queuing_the_preconditioning(gpu_path, options):
    """Between inverse updates the finiteness read of a factor step (a device sync on a
    GPU) comes after every precondition GEMM is queued and before ``.grad`` is written:
    the host then waits while those kernels run. At an inverse step the fold comes
    first, as the decompositions read the new factors."""
    model = narrow_resnet50()
    pre = KFACPreconditioner(model, comm=Communicator(MPI.COMM_SELF), damping=0.01,
                             inv_update_steps=3, **options)
    x, y = torch.randn(2, 3, 16, 16), torch.tensor([1, 2])
    lines = []
    for _ in range(4):  # steps 0 and 3 renew the decompositions, 1 and 2 do not
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        lines.append(timeline(pre.step))
    pre.close()
    for k, line in enumerate(lines):
        reads, gemms = line.positions("read "), line.positions(GEMMS)
        writes = line.positions("aten._foreach_copy_.")
        assert reads and gemms and writes, k
        screen = reads[0]
        if k in (1, 2):
            assert gemms[-1] < screen < writes[0], (k, screen, gemms[-1], writes[0])
        else:
            assert screen < gemms[0], (k, screen, gemms[0])


def test_kl_clip_on_the_device_equals_the_host_value() -> None:
    """ν on the device (GPU path) and on the host (CPU path) for clipped, unclipped and
    degenerate sums; equal up to the CPU's float64 ``sqrt`` (torch's on the CPU need not
    be correctly rounded; CUDA's and Python's are)."""
    for total, lr in [(128.55, 0.7), (-2.5, 0.29), (1e-9, 0.1), (0.0, 0.1), (3.0, 0.0),
                      (math.inf, 0.1), (math.nan, 0.1)]:
        t = torch.tensor(total, dtype=torch.float64)
        host = linalg.kl_clip_from_inner(t, lr, 1e-3)
        with pytest.MonkeyPatch.context() as m:
            m.setattr(linalg, "uses_gpu_path", lambda device: True)
            device = linalg.kl_clip_factor(t, lr, 1e-3)
        assert isinstance(device, torch.Tensor) and device.dtype == torch.float64
        assert device.item() == pytest.approx(host, rel=2**-52), (total, lr)
    assert linalg.kl_clip_factor(torch.tensor(1.0, dtype=torch.float64), 1.0, 1e-3) \
        == linalg.kl_clip_from_inner(torch.tensor(1.0, dtype=torch.float64), 1.0, 1e-3)


@pytest.mark.parametrize("conv", [
    nn.Conv2d(3, 4, 3, padding=1),
    nn.Conv2d(5, 2, (3, 2), stride=(2, 1), padding=(0, 1), dilation=(1, 2)),
    nn.Conv2d(4, 4, 2, padding="same"),
    nn.Conv2d(6, 3, 1),
], ids=["pad", "stride-dilation", "same-even", "1x1"])
def test_patch_rows_are_the_unfold_rows(conv):
    """The strided-view rows are bitwise the rows of ``F.unfold`` (one copy, no im2col
    kernel per sample)."""
    curv = Conv2dCurvature(conv)
    x = torch.randn(3, conv.in_channels, 7, 6)
    reference = curv._patches(x).transpose(1, 2).reshape(-1, curv.weight_cols)
    rows = curv._input_rows(x)
    assert torch.equal(rows, reference)
    assert rows.is_contiguous()
    ops = count_ops(lambda: curv._input_rows(x))
    assert ops.kernels <= 2 and "aten.im2col.default" not in ops.counts


@pytest.mark.parametrize("conv", [
    nn.Conv2d(3, 4, 3, padding=1),
    nn.Conv2d(5, 2, (3, 2), stride=(2, 1), padding=(0, 1), dilation=(1, 2)),
    nn.Conv2d(4, 4, 2, padding="same", bias=False),
    nn.Conv2d(6, 3, 1),
], ids=["pad-bias", "stride-dilation", "same-even", "1x1"])
def test_column_major_rows_are_the_rows_laid_out_by_column(conv):
    """With the device in ``COLUMN_MAJOR_ROWS_DEVICES`` a convolution's input rows (bias
    column included) and output-gradient rows are bitwise the row-major ones, held as the
    transposed view of one row-major copy (two kernels at most for the patches)."""
    curv = Conv2dCurvature(conv)
    x = torch.randn(3, conv.in_channels, 7, 6)
    dy = torch.randn(conv(x).shape)
    row_major = (curv.a_rows(x), curv._output_rows(dy)[0])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(layers, "COLUMN_MAJOR_ROWS_DEVICES", frozenset({"cpu"}))
        by_column = (curv.a_rows(x), curv._output_rows(dy)[0])
        ops = count_ops(lambda: curv._input_rows(x))
    for rows, columns in zip(row_major, by_column):
        assert rows.is_contiguous()
        assert torch.equal(columns, rows)
        assert columns.t().is_contiguous() and not columns.is_contiguous()
    assert ops.kernels <= 2 and "aten.im2col.default" not in ops.counts


@pytest.mark.parametrize("precision", ["full", "tf32", "bf16"])
def test_conv_factors_from_column_major_rows(monkeypatch, gpu_path, precision):
    """The factors of column-major rows equal those of row-major rows: the same products,
    handed to the GEMM transposed. In float64 to summation order; in float32 (TF32 and
    bf16 round the operands alike in both layouts) each GEMM is within the accumulation
    bound ``(K+2)·2⁻²⁴·(|R|ᵀ|R|)`` of the exact product of the same operands, so the two
    differ by at most twice that: a bound, not a rate, because the two layouts reach
    different BLAS kernels whose summation orders depend on the CPU (ATen's scalar
    kernels with MKL's AVX-512 GEMMs gave 1e-5 relative on an entry 1/100 of the
    diagonal)."""
    conv = nn.Conv2d(6, 10, 3, padding=1)
    dtype = torch.float64 if precision == "full" else torch.float32
    curv = Conv2dCurvature(conv.to(dtype))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 6, 9, 8, generator=g, dtype=dtype)
    dy = torch.randn(conv(x).shape, generator=g, dtype=dtype)

    def factors() -> tuple[torch.Tensor, torch.Tensor]:
        return (curv.a_factor(x, precision=precision),
                curv.g_factor(dy, grad_scale=0.5, precision=precision))

    rows = factors()
    monkeypatch.setattr(layers, "COLUMN_MAJOR_ROWS_DEVICES", frozenset({"cpu"}))
    columns = factors()
    if dtype == torch.float64:
        for by_column, by_row in zip(columns, rows):
            torch.testing.assert_close(by_column, by_row, rtol=1e-13, atol=1e-15)
        return
    k = x.shape[0] * x.shape[2] * x.shape[3]  # rows summed: samples x output positions
    magnitudes = (curv.a_factor(x.double().abs(), torch.float64, "full"),
                  curv.g_factor(dy.double().abs(), torch.float64, 0.5, "full"))
    for by_column, by_row, m in zip(columns, rows, magnitudes):
        excess = (by_column.double() - by_row.double()).abs() - 2 * (k + 2) * 2.0**-24 * m
        assert excess.max() <= 0, f"above twice the accumulation bound by {excess.max():.3g}"


@pytest.mark.parametrize("strategy, options", CASES[:3], ids=case_ids(CASES[:3]))
def test_training_with_column_major_rows_equals_the_cpu_path(monkeypatch, strategy, options):
    comm = Communicator(MPI.COMM_SELF)
    cpu = _train(comm, strategy, options)
    for module in (linalg, layers, statistics_groups):
        monkeypatch.setattr(module, "uses_gpu_path", lambda device: True)
    monkeypatch.setattr(layers, "COLUMN_MAJOR_ROWS_DEVICES", frozenset({"cpu"}))
    gpu = _train(comm, strategy, options)
    for (name, p), q in zip(gpu.named_parameters(), cpu.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12, msg=f"{name} differs")


@pytest.mark.parametrize("layer", [nn.Conv2d(6, 10, 3, padding=1), nn.Linear(12, 7)],
                         ids=["conv", "linear"])
def test_bf16_statistics_of_float32_tensors_build_bf16_rows(monkeypatch, gpu_path, layer):
    """``stats_precision="bf16"`` on float32 activations and output gradients (GPU path):
    the layer's tensor is cast to bf16 once and the rows are built in bf16, and the
    factors are bitwise those of float32 rows rounded to bf16 in the product (rounding
    commutes with the copies that build the rows)."""
    curv = (Conv2dCurvature if isinstance(layer, nn.Conv2d) else LinearCurvature)(layer)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(4, 6, 9, 8, generator=g) if isinstance(layer, nn.Conv2d) \
        else torch.randn(16, 12, generator=g)
    dy = torch.randn(layer(x).shape, generator=g)
    seen: list[torch.dtype] = []
    real = layers.covariance

    def covariance(rows, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(rows.dtype)
        return real(rows, *args, **kwargs)

    monkeypatch.setattr(layers, "covariance", covariance)
    a = curv.a_factor(x, torch.float32, "bf16")
    gf = curv.g_factor(dy, torch.float32, 0.5, "bf16")
    assert seen == [torch.bfloat16, torch.bfloat16]
    assert a.dtype == gf.dtype == torch.float32
    rows_a = curv.a_rows(x)
    rows_g, b = curv._output_rows(dy)
    scale = b / 0.5
    assert torch.equal(a, real(rows_a, precision="bf16"))
    assert torch.equal(gf, real(rows_g, scale * scale, precision="bf16"))


# ------------------------------------------- statistics summed over chunks of rows
@pytest.fixture
def split_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU sums long products over chunks as SPLIT_ROWS_DEVICES would (GPU path),
    with chunks of 8 rows and at least 16 rows, so small tensors take the split."""
    monkeypatch.setattr(linalg, "SPLIT_ROWS_DEVICES", frozenset({"cpu"}))
    monkeypatch.setattr(linalg, "SPLIT_ROWS", 8)
    monkeypatch.setattr(linalg, "SPLIT_ROWS_MIN_ROWS", 16)


@pytest.mark.parametrize("n", [16, 37])  # whole chunks; chunks and a remainder
@pytest.mark.parametrize("layout", ["row-major", "column-major"])
def test_split_products_equal_one_product(gpu_path, split_rows, n, layout):
    """One batched product of the chunks (views, whatever the layout), a sum and the
    remainder, scaled inside the products: the product of all rows up to the summation
    order, and three kernels at most whatever the number of chunks."""
    g = torch.Generator().manual_seed(n)
    data = torch.randn(n, 5, generator=g, dtype=torch.float64)
    rows = data if layout == "row-major" else data.t().contiguous().t()
    assert linalg.splits_rows(rows)
    ops = count_ops(lambda: linalg.covariance(rows, 4.0))
    got = linalg.covariance(rows, 4.0)
    torch.testing.assert_close(got, 4.0 * data.t() @ data / n, rtol=1e-13, atol=0)
    assert ops.calls("aten.baddbmm.") == 1 and ops.calls("aten.clone.") == 0
    assert ops.calls("aten.addmm") == (1 if n % 8 else 0)
    assert ops.kernels <= 3  # the chunks' product, their sum, the remainder's


def test_rows_outside_the_rule_take_one_product(gpu_path, split_rows, monkeypatch):
    """Too few rows, too many columns, a layout whose chunks are not views, half
    precision, or a device outside SPLIT_ROWS_DEVICES: one product."""
    g = torch.Generator().manual_seed(3)
    few = torch.randn(15, 5, generator=g, dtype=torch.float64)  # fewer than 16 rows
    wide = torch.randn(40, linalg.SPLIT_ROWS_MAX_DIM + 1, generator=g, dtype=torch.float64)
    strided = torch.randn(40, 10, generator=g, dtype=torch.float64)[:, ::2]  # no chunk views
    assert not linalg.splits_rows(torch.randn(40, 5, generator=g).bfloat16())
    for rows in (few, wide, strided):
        assert not linalg.splits_rows(rows)
        ops = count_ops(lambda rows=rows: linalg.covariance(rows))
        assert ops.calls("aten.bmm.") == 0 and ops.calls("aten.addmm.") == 1
    monkeypatch.setattr(linalg, "SPLIT_ROWS_DEVICES", frozenset({"cuda"}))
    assert not linalg.splits_rows(torch.randn(40, 5))  # not on a device of the set


@pytest.mark.parametrize("conv", [nn.Conv2d(4, 6, 3, padding=1), nn.Conv2d(4, 6, 1)],
                         ids=["3x3", "1x1"])
@pytest.mark.parametrize("columns", [False, True], ids=["row-major", "column-major"])
def test_split_conv_factors_equal_the_cpu_path(monkeypatch, split_rows, conv, columns):
    """A convolution's factors from split products (rows of either layout) equal the
    CPU path's in float64."""
    curv = Conv2dCurvature(conv.double())
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 4, 5, 6, generator=g, dtype=torch.float64)  # 90 rows: 11 chunks + 2
    dy = torch.randn(conv(x).shape, generator=g, dtype=torch.float64)
    if columns:
        monkeypatch.setattr(layers, "COLUMN_MAJOR_ROWS_DEVICES", frozenset({"cpu"}))
    split = linalg.split_gram
    split_layouts: list[bool] = []  # whether each split's rows were row-major

    def spy(rows: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
        split_layouts.append(rows.is_contiguous())
        return split(rows, alpha)

    monkeypatch.setattr(linalg, "split_gram", spy)
    (a_cpu, g_cpu), (a_split, g_split) = _both_paths(
        monkeypatch, lambda: (curv.a_factor(x), curv.g_factor(dy, grad_scale=0.5)))
    assert split_layouts == [not columns] * 2  # A and G, only on the GPU path
    torch.testing.assert_close(a_split, a_cpu, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(g_split, g_cpu, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("strategy, options", CASES[:2], ids=case_ids(CASES[:2]))
def test_training_with_split_products_equals_the_cpu_path(monkeypatch, split_rows, strategy,
                                                          options):
    """Training whose statistics take the split products (on the GPU path) equals the
    CPU path's in float64."""
    split = linalg.split_gram
    calls: list[int] = []

    def spy(rows: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
        calls.append(rows.shape[0])
        return split(rows, alpha)

    monkeypatch.setattr(linalg, "split_gram", spy)
    _compare_training(monkeypatch, Communicator(MPI.COMM_SELF), strategy, options)
    assert calls, "no statistics took the split products"
