"""K-FAC on CUDA: the same numbers as on the CPU, all state on the GPU, faults agreed.

Every rank uses the same batch (no gradient averaging needed), so a CPU run in the same
process is the reference. float64 throughout: results equal to 1e-10.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import pytest
import torch
from mpi4py import MPI
from shared_cases import case_ids, fraction_for, kfac_cases
from torch import nn

from kfac_hpc import GradientAverager, KFACPreconditioner
from kfac_hpc.comm import Communicator
from kfac_hpc.kfac.background import Decomposed
from kfac_hpc.kfac.decompositions import Decompositions

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-only check")

STEPS = 5
CASES = kfac_cases(input_shape=(4, 2, 6, 6))
IDS = case_ids(CASES)


def cnn(device: torch.device, dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, stride=2),
                         nn.ReLU(), nn.Flatten(), nn.Linear(32, 20), nn.ReLU(),
                         nn.Linear(20, 3)).to(device=device, dtype=dtype)


def batches(device: torch.device, dtype: torch.dtype = torch.float64, n: int = STEPS):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(4, 2, 6, 6, generator=g, dtype=dtype).to(device),
             torch.randint(0, 3, (4,), generator=g).to(device)) for _ in range(n)]


def train(device: torch.device, comm: Communicator, strategy: str, options: dict,
          steps: int = STEPS, before_step: Callable[[], object] | None = None
          ) -> tuple[nn.Module, KFACPreconditioner]:
    strategy, fraction = fraction_for(strategy, comm.size)
    model = cnn(device)
    pre = KFACPreconditioner(model, comm=comm, strategy=strategy, grad_worker_fraction=fraction,
                             damping=0.01, inv_update_steps=2, inv_dtype=torch.float64,
                             **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches(device, n=steps):
        if before_step is not None:
            before_step()
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        pre.step()
        opt.step()
    return model, pre


def assert_on(pre: KFACPreconditioner, device: torch.device) -> None:
    tensors = [s.average for s in pre.factors.values() if s.average is not None]
    tensors += [t for parts in pre.decompositions.values() for t in parts.values()]
    tensors += [s.delta for s in pre.local_averages.values() if s.delta is not None]
    assert tensors
    assert {t.device for t in tensors} == {device}
    assert pre.device == device


def compare(device: torch.device, comm: Communicator, strategy: str, options: dict,
            around: Callable[[], AbstractContextManager[object]] = nullcontext,
            steps: int = STEPS, before_step: Callable[[], object] | None = None) -> None:
    """``train`` on ``device`` (inside ``around()``, e.g. on another stream; with
    ``before_step`` before each of its steps) equals the CPU."""
    with around():
        on_device, pre = train(device, comm, strategy, options, steps, before_step)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
    assert_on(pre, device)
    pre.close()  # no renewal left running in the background
    on_cpu, _ = train(torch.device("cpu"), comm, strategy, options, steps)
    for (name, p), q in zip(on_device.named_parameters(), on_cpu.parameters()):
        assert p.device == device
        torch.testing.assert_close(p.cpu(), q, rtol=1e-10, atol=1e-12, msg=f"{name} differs")


@pytest.mark.parametrize("strategy, options", CASES, ids=IDS)
def test_cuda_equals_cpu_one_rank(device, strategy, options):
    compare(device, Communicator(MPI.COMM_SELF), strategy, options)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("strategy, options", CASES, ids=IDS)
def test_cuda_equals_cpu_ranks(device, comm, strategy, options):
    compare(device, comm, strategy, options)


#: Decompositions on the host while training goes on: every factor (``host_decomposition_
#: max_dim`` above all sizes) decomposed by LAPACK on a host thread, in the background
#: (``decomposition_lag``), the way a rank with few factors of its own can keep them
#: off its GPU; and the same with the inverse method and another strategy.
HOST_CASES = [("comm-opt", {"decomposition_lag": 1, "host_decomposition_max_dim": 4096}),
              ("comm-opt", {"decomposition_lag": 1, "host_decomposition_max_dim": 4096,
                            "compute_method": "inverse"}),
              ("mem-opt", {"decomposition_lag": 1, "host_decomposition_max_dim": 4096})]
HOST_IDS = case_ids(HOST_CASES)


@pytest.mark.parametrize("strategy, options", HOST_CASES, ids=HOST_IDS)
def test_background_host_decompositions_on_cuda_equal_cpu(device, strategy, options):
    compare(device, Communicator(MPI.COMM_SELF), strategy, options)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("strategy, options", HOST_CASES, ids=HOST_IDS)
def test_background_host_decompositions_on_cuda_equal_cpu_ranks(device, comm, strategy,
                                                                options):
    compare(device, comm, strategy, options)


#: Cycles of ``torch.cuda._sleep``: tens of milliseconds of one kernel.
SLEEP_CYCLES = 10**8


@needs_cuda
@pytest.mark.parametrize("options", [{"decomposition_lag": 1},
                                     {"decomposition_lag": 1, "decomposition_streams": 2}],
                         ids=["lag", "lag-2-streams"])
def test_training_on_a_high_priority_stream_equals_cpu(device, options, monkeypatch):
    """The training loop on a high-priority stream (so that a background inverse update,
    of default priority, runs in its idle time; benchmarks/gpu_profile.py
    ``--training-stream``): every wait is on the current stream, not the default one, so
    the results are the CPU's. Over 8 steps three renewals are installed (steps 3, 5, 7).

    A wait on the wrong stream would show: each step starts behind a long kernel on the
    training stream (a renewal that did not wait for it would decompose factors not yet
    folded), and each renewal's results are zeroed and written again behind a long kernel
    on its own stream (an install that did not wait for that stream would read zeros).
    """
    compute = Decompositions.compute

    def slow(self: Decompositions, *args: Any, **kwargs: Any) -> Decomposed:
        done = compute(self, *args, **kwargs)
        pieces = list(done.tensors())
        if pieces and pieces[0].is_cuda:
            saved = [t.clone() for t in pieces]
            torch._foreach_zero_(pieces)
            torch.cuda._sleep(SLEEP_CYCLES)
            torch._foreach_copy_(pieces, saved)
        return done

    monkeypatch.setattr(Decompositions, "compute", slow)
    high = torch.cuda.Stream(device, priority=-1)
    compare(device, Communicator(MPI.COMM_SELF), "comm-opt", options,
            around=lambda: torch.cuda.stream(high), steps=8,
            before_step=lambda: torch.cuda._sleep(SLEEP_CYCLES))


@pytest.mark.mpi(min_size=2)
def test_overlap_hooks_on_cuda_equal_plain_run(device, comm):
    """Reductions posted from backward hooks (staged on a side stream, or device-direct)
    give the plain run's parameters; buckets were posted during backward."""
    plain, _ = train(device, comm, "comm-opt", {})
    overlapped, pre = train(device, comm, "comm-opt", {"overlap": True, "bucket_cap_mb": 1e-4})
    assert pre.pipeline is not None and len(pre.pipeline.buckets) > 1
    for (name, p), q in zip(overlapped.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12, msg=f"{name} differs")


@needs_cuda
@pytest.mark.mpi(min_size=2)
def test_amp_fp16_inf_on_one_rank_skips_everywhere(device, comm):
    """AMP fp16 with an Inf injected into one rank's batch: the GradScaler skips the
    optimizer step on every rank (gradients are averaged), K-FAC skips the factor update
    on every rank, factors stay finite, and the next steps run (no hang)."""
    model = cnn(device, torch.float32)
    scaler = torch.amp.GradScaler("cuda")
    pre = KFACPreconditioner(model, comm=comm, damping=0.01, inv_update_steps=2,
                             grad_scaler=scaler)
    averager = GradientAverager(model, comm)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scales = []
    for step, (x, y) in enumerate(batches(device, torch.float32, n=6)):
        if step == 3 and comm.rank == comm.size - 1:
            x = x.clone()
            x[0, 0, 0, 0] = float("inf")
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        averager.synchronize()
        scaler.unscale_(opt)
        before = {k: s.average.clone() for k, s in pre.factors.items() if s.average is not None}
        pre.step()
        if step == 3:
            for key, value in before.items():
                assert torch.equal(pre.factors[key].average, value), key
        scaler.step(opt)
        scaler.update()
        scales.append(float(scaler.get_scale()))
    everyone = comm.allgather_object(scales)
    assert all(s == everyone[0] for s in everyone), "ranks disagree on the skipped steps"
    assert scales[3] < scales[2], "the overflow step was not skipped"
    for s in pre.factors.values():
        assert s.average is None or bool(torch.isfinite(s.average).all())
    for p in model.parameters():
        assert bool(torch.isfinite(p).all())


def syncs_per_step(device: torch.device, hidden_layers: int) -> int:
    """Synchronising CUDA calls that torch reports during one K-FAC step."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(8, 16)]
    for _ in range(hidden_layers):
        layers += [nn.Tanh(), nn.Linear(16, 16)]
    model = nn.Sequential(*layers, nn.Tanh(), nn.Linear(16, 3)).to(device)
    pre = KFACPreconditioner(model, comm=Communicator(MPI.COMM_SELF), strategy="comm-opt")
    x = torch.randn(8, 8, device=device)
    y = torch.randint(0, 3, (8,), device=device)
    for _ in range(2):  # warm: decompositions exist
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        pre.step()
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pre.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


@needs_cuda
def test_float32_defaults_on_the_device(device):
    """The defaults a float32 CUDA model gets (measured on an H200, docs/design.md): TF32
    operands for statistics and preconditioning, column-major convolution rows, the
    decompositions spread over the default streams; and one step runs with them."""
    from kfac_hpc import solves
    from kfac_hpc.kfac import layers

    model = cnn(device, torch.float32)
    pre = KFACPreconditioner(model, comm=Communicator(MPI.COMM_SELF))
    assert (pre.stats_precision, pre.precondition_precision) == ("tf32", "tf32")
    assert "cuda" in layers.COLUMN_MAJOR_ROWS_DEVICES
    assert pre.config()["decomposition_streams"] == solves.default_device_streams()
    x, y = batches(device, torch.float32, n=1)[0]
    nn.functional.cross_entropy(model(x), y).backward()
    pre.step()
    assert all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
    pre.close()


@needs_cuda
def test_host_syncs_do_not_grow_with_layers(device):
    """Counts, valid flags and finiteness are read once per phase, not per factor."""
    shallow, deep = syncs_per_step(device, 1), syncs_per_step(device, 8)
    assert deep == shallow, f"{shallow} syncs with 3 layers but {deep} with 10"


@needs_cuda
@pytest.mark.parametrize("precision", ["tf32", "bf16"])
def test_bf16_tensors_give_the_factors_of_their_widened_values(device, precision):
    """AMP (bf16) activations and output gradients: ``A`` and ``G`` from bf16 rows with a
    float32 GEMM (bf16 tensor cores) equal those of the widened rows in float64 to float32
    accumulation error.

    The products of bf16 (or TF32) values are exact in float32, so what remains is the
    summation over the K rows: entry by entry at most ``K·u·(|R|ᵀ|R|)_ij`` (Higham's bound
    for a dot product in any order), with the rows' scale applied alike. ``u = 2⁻²³``, not
    2⁻²⁴: tensor cores align and truncate their partial sums instead of rounding them.
    Off-diagonal entries are sums of terms of both signs, so their relative error can be
    far above ``u`` (an H200 gave 1e-4 on an entry 1/1500 of the diagonal), while a GEMM
    accumulating in bf16 would exceed this bound by orders of magnitude.
    """
    from kfac_hpc.kfac.layers import Conv2dCurvature, LinearCurvature

    def within_accumulation_error(got, want, magnitudes, rows):
        bound = (rows + 2) * 2.0 ** -23 * magnitudes
        excess = (got.double() - want).abs() - bound
        assert excess.max() <= 0, f"above the float32 accumulation bound by {excess.max():.3g}"

    torch.manual_seed(0)
    conv = Conv2dCurvature(nn.Conv2d(32, 16, 3, padding=1).to(device))
    lin = LinearCurvature(nn.Linear(96, 8).to(device))
    for curv, x, rows in ((conv, torch.randn(8, 32, 12, 12, device=device), 8 * 12 * 12),
                          (lin, torch.randn(64, 96, device=device), 64)):
        x16 = x.bfloat16()
        got = curv.a_factor(x16, torch.float32, precision)
        want = curv.a_factor(x16.double(), torch.float64, "full")
        assert got.dtype == torch.float32
        magnitudes = curv.a_factor(x16.double().abs(), torch.float64, "full")
        within_accumulation_error(got, want, magnitudes, rows)
        dy = curv.module(x).detach().bfloat16().normal_()
        got = curv.g_factor(dy, torch.float32, 0.5, precision)
        want = curv.g_factor(dy.double(), torch.float64, 0.5, "full")
        magnitudes = curv.g_factor(dy.double().abs(), torch.float64, 0.5, "full")
        within_accumulation_error(got, want, magnitudes, rows)


@pytest.mark.parametrize("precision", ["full", "tf32", "bf16"])
def test_column_major_rows_on_the_device_equal_row_major(device, monkeypatch, precision):
    """Convolution rows built column-major on the device (``COLUMN_MAJOR_ROWS_DEVICES``:
    the copy by runs of positions, the Gram product as ``x·xᵀ``) give the factors of the
    row-major rows: in float64 to summation order; in bf16 both products take the same
    operands, so each is within the float32 accumulation bound ``(K+2)·2⁻²³·(|R|ᵀ|R|)`` of
    their exact product (see the bf16 test above) and they differ by twice that at most;
    in TF32 the kernels may also round the operands differently (below)."""
    from kfac_hpc.kfac import layers
    from kfac_hpc.kfac.layers import Conv2dCurvature

    dtype = torch.float64 if precision == "full" else torch.float32
    torch.manual_seed(0)
    curv = Conv2dCurvature(nn.Conv2d(16, 24, 3, padding=1).to(device=device, dtype=dtype))
    x = torch.randn(8, 16, 14, 14, device=device, dtype=dtype)
    dy = torch.randn(8, 24, 14, 14, device=device, dtype=dtype)

    def factors() -> tuple[torch.Tensor, torch.Tensor]:
        return (curv.a_factor(x, precision=precision),
                curv.g_factor(dy, grad_scale=0.5, precision=precision))

    monkeypatch.setattr(layers, "COLUMN_MAJOR_ROWS_DEVICES", frozenset())
    by_row = factors()
    monkeypatch.setattr(layers, "COLUMN_MAJOR_ROWS_DEVICES", frozenset({device.type}))
    by_column = factors()
    if dtype == torch.float64:
        for got, want in zip(by_column, by_row):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13)
        return
    rows = 8 * 14 * 14
    magnitudes = (curv.a_factor(x.double().abs(), torch.float64, "full"),
                  curv.g_factor(dy.double().abs(), torch.float64, 0.5, "full"))
    # TF32: the two layouts may reach kernel families that round or truncate the operands
    # to 10 mantissa bits (rows 580 bytes apart are not 16-byte aligned, which can rule out
    # Hopper's), so each product may differ by 2·2⁻¹⁰ of its magnitude; bf16 operands are
    # cast before either GEMM, alike
    operands = 2.0**-9 if precision == "tf32" else 0.0
    for got, want, m in zip(by_column, by_row, magnitudes):
        bound = (2 * (rows + 2) * 2.0**-23 + operands) * m
        excess = (got.double() - want.double()).abs() - bound
        assert excess.max() <= 0, f"above the bound by {excess.max():.3g}"


@pytest.mark.parametrize("columns", [False, True], ids=["row-major", "column-major"])
@pytest.mark.parametrize("precision", ["full", "tf32"])
def test_split_rows_on_the_device_equal_one_product(device, monkeypatch, columns, precision):
    """Statistics summed over chunks of rows on the device (``linalg.SPLIT_ROWS_DEVICES``,
    which gram_layouts.py and gpu_profile.py --kinds split-rows may decide for), from
    row-major or column-major rows: the factors of one product, in float64 to summation
    order; in TF32 each product is within its operands' rounding (two of 2⁻¹⁰ each, the
    kernels may round or truncate) and the float32 accumulation bound of the exact one."""
    from kfac_hpc.kfac import layers, linalg
    from kfac_hpc.kfac.layers import Conv2dCurvature

    dtype = torch.float64 if precision == "full" else torch.float32
    torch.manual_seed(0)
    curv = Conv2dCurvature(nn.Conv2d(16, 24, 3, padding=1).to(device=device, dtype=dtype))
    x = torch.randn(8, 16, 14, 14, device=device, dtype=dtype)  # 1568 rows
    dy = torch.randn(8, 24, 14, 14, device=device, dtype=dtype)
    monkeypatch.setattr(layers, "COLUMN_MAJOR_ROWS_DEVICES",
                        frozenset({device.type}) if columns else frozenset())
    monkeypatch.setattr(linalg, "SPLIT_ROWS", 256)  # 6 chunks and a remainder of 32 rows
    monkeypatch.setattr(linalg, "SPLIT_ROWS_MIN_ROWS", 1024)

    def factors() -> tuple[torch.Tensor, torch.Tensor]:
        return (curv.a_factor(x, precision=precision),
                curv.g_factor(dy, grad_scale=0.5, precision=precision))

    whole = factors()
    monkeypatch.setattr(linalg, "SPLIT_ROWS_DEVICES", frozenset({device.type}))
    calls = []
    real = linalg.split_gram
    monkeypatch.setattr(linalg, "split_gram",
                        lambda rows, alpha=1.0: calls.append(rows.shape) or real(rows, alpha))
    split = factors()
    assert len(calls) == (2 if linalg.uses_gpu_path(device) else 0)
    if dtype == torch.float64:
        for got, want in zip(split, whole):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13)
        return
    rows = 8 * 14 * 14
    exact = (curv.a_factor(x.double(), torch.float64, "full"),
             curv.g_factor(dy.double(), torch.float64, 0.5, "full"))
    magnitudes = (curv.a_factor(x.double().abs(), torch.float64, "full"),
                  curv.g_factor(dy.double().abs(), torch.float64, 0.5, "full"))
    for got, want, m in zip(split, exact, magnitudes):
        bound = ((rows + 2) * 2.0**-23 + 2 * 2.0**-10) * m
        excess = (got.double() - want).abs() - bound
        assert excess.max() <= 0, f"above the bound by {excess.max():.3g}"


def test_shifted_products_on_the_device_equal_the_patch_rows(device, monkeypatch):
    """The GPU statistics path with shifted products (``shifts.SHIFTED_PRODUCTS_PATHS``
    with ``"gpu"``, which conv_shifts.py may decide for): a stride-1 convolution's ``A``
    computed on the device from 13 shifted products and a GEMM per border offset equals
    the patch rows' one GEMM in float64 to summation order, exactly symmetric, and the
    CPU's."""
    from kfac_hpc.kfac import shifts
    from kfac_hpc.kfac.layers import Conv2dCurvature

    torch.manual_seed(0)
    conv = nn.Conv2d(16, 24, 3, padding=1).to(device=device, dtype=torch.float64)
    curv = Conv2dCurvature(conv)
    x = torch.randn(8, 16, 14, 14, device=device, dtype=torch.float64)
    rows = curv.a_factor_unfold(x)
    monkeypatch.setattr(shifts, "SHIFTED_PRODUCTS_PATHS", frozenset({"cpu", "gpu"}))
    calls = []
    real = shifts.shifted_covariance
    monkeypatch.setattr(shifts, "shifted_covariance",
                        lambda *a, **k: calls.append(a[0].device) or real(*a, **k))
    got = curv.a_factor(x)
    assert calls == [x.device] and got.device == x.device
    assert torch.equal(got, got.t())
    torch.testing.assert_close(got, rows, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got.cpu(), curv.a_factor_unfold(x.cpu()), rtol=1e-12, atol=1e-14)


@needs_cuda
@pytest.mark.parametrize("strategy, options", CASES[:2], ids=IDS[:2])
def test_statistics_on_a_side_stream_train_alike(device, monkeypatch, strategy,
                                                          options):
    """The hooks' statistics on a CUDA side stream (``SIDE_STREAM_DEVICES``): the same
    kernels on the same values, waited for before the factor update reads them and kept
    alive while either stream uses them, so training equals that of the pass's own stream
    (float64) to 1e-10 relative. Not bitwise: cuBLAS documents bitwise reproducibility for
    one active stream only, and cuDNN's default algorithms may use atomics (asked to be
    deterministic here). A missing wait or a buffer reused early gives errors of order
    one."""
    from kfac_hpc.kfac import statistics_stream

    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    comm = Communicator(MPI.COMM_SELF)
    plain, _ = train(device, comm, strategy, options)
    monkeypatch.setattr(statistics_stream, "SIDE_STREAM_DEVICES", frozenset({"cuda"}))
    side, pre = train(device, comm, strategy, options)
    assert isinstance(pre.capture.stream, statistics_stream.SideStream)
    for (name, p), q in zip(side.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=0, msg=f"{name} differs")


@needs_cuda
@pytest.mark.parametrize("kind", ["conv", "linear"])
def test_bf16_statistics_of_float32_tensors_equal_rounding_in_the_product(device, kind):
    """``stats_precision="bf16"`` on float32 tensors casts the layer's tensor once and
    builds bf16 rows; the product is the same bf16 GEMM (float32 accumulation) on the
    same operands as rounding float32 rows in the product: bitwise equal factors."""
    from kfac_hpc.kfac.layers import Conv2dCurvature, LinearCurvature
    from kfac_hpc.kfac.linalg import covariance

    torch.manual_seed(0)
    if kind == "conv":
        curv = Conv2dCurvature(nn.Conv2d(16, 24, 3, padding=1).to(device))
        x = torch.randn(8, 16, 14, 14, device=device)
    else:
        curv = LinearCurvature(nn.Linear(96, 40).to(device))
        x = torch.randn(64, 96, device=device)
    dy = curv.module(x).detach().normal_()
    rows_g, b = curv._output_rows(dy)
    assert torch.equal(curv.a_factor(x, torch.float32, "bf16"),
                       covariance(curv.a_rows(x), precision="bf16"))
    assert torch.equal(curv.g_factor(dy, torch.float32, 0.5, "bf16"),
                       covariance(rows_g, (b / 0.5) ** 2, precision="bf16"))


def test_grouped_statistics_on_the_device_equal_layer_by_layer(device, monkeypatch):
    """ResNet-50's 54 layers (an eighth of the widths) trained in float64 on the device
    with the statistics of same-shaped layers in one product each (32 for 108 factors,
    ``kfac_hpc.kfac.statistics_groups``; only on the GPU path) equal the same training
    with every factor's own product, to summation order."""
    from shared_cases import train_narrow_resnet50

    from kfac_hpc.kfac import linalg, statistics_groups

    sizes: list[int] = []
    product = linalg.stacked_covariance
    monkeypatch.setattr(linalg, "stacked_covariance",
                        lambda rows, *a, **k: sizes.append(rows.shape[0]) or product(rows, *a, **k))
    grouped = train_narrow_resnet50(device)
    assert len(sizes) == (3 * 32 if linalg.uses_gpu_path(device) else 0)
    monkeypatch.setattr(statistics_groups, "STACKED_PRECISIONS", frozenset())
    alone = train_narrow_resnet50(device)
    for (name, p), q in zip(grouped.named_parameters(), alone.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12, msg=f"{name} differs")


@pytest.mark.parametrize("dtype, precision", [(torch.float32, "full"), (torch.bfloat16, "tf32")],
                         ids=["fp32", "bf16-amp"])
def test_grouped_float32_and_bf16_statistics_on_the_device_equal_layer_by_layer(
        device, monkeypatch, dtype, precision):
    """Factors of same-shaped layers from one product on the device equal each layer's
    own product to float32 summation order: float32 tensors at full precision, and bf16
    (AMP) tensors as bf16 rows accumulated in float32 (exact products of the same
    operands either way; TF32 kernels may round or truncate, so float32 tensors are
    compared at full precision, where the products are the same numbers)."""
    from kfac_hpc.kfac import statistics_groups
    from kfac_hpc.kfac.capture import StatisticsCapture
    from kfac_hpc.kfac.layers import register_layers

    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(3) for m in (nn.Conv2d(16, 16, 3, padding=1),
                                                            nn.Tanh())],
                          nn.Flatten(), nn.Linear(16 * 64, 10)).to(device=device, dtype=dtype)
    x = torch.randn(8, 16, 8, 8).to(device=device, dtype=dtype)

    def sums() -> dict:
        found, _ = register_layers(model)
        capture = StatisticsCapture(found, dtype_of=lambda _: torch.float32,
                                    active=lambda: True, precision=precision,
                                    grad_scale=lambda: 0.5)
        model(x).float().square().sum().backward()
        capture.join()
        capture.remove()
        return {(n, f): s.sums[f] for n, s in capture.stats.items() for f in "AG"}

    grouped = sums()
    monkeypatch.setattr(statistics_groups, "STACKED_PRECISIONS", frozenset())
    alone = sums()
    for key, value in alone.items():
        assert grouped[key].dtype == torch.float32
        torch.testing.assert_close(grouped[key], value, rtol=1e-4, atol=1e-5, msg=str(key))
