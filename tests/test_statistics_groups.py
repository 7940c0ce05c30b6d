"""Statistics of same-shaped layers as one batched product (kfac_hpc.kfac.statistics_groups).

The GPU path is forced on CPU tensors (as in test_kfac_gpu_path.py), in float64: each
layer's factors from a group's product equal the layer's own product up to the
summation order, whatever the grouping (caps, micro-batches, a layer used twice, an
output without a gradient), and the grouping of a pass depends on that pass only.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from mpi4py import MPI
from shared_cases import narrow_resnet50, narrow_resnet50_batches, train_kfac, train_narrow_resnet50
from torch import nn

from kfac_hpc import KFACPreconditioner
from kfac_hpc.comm import Communicator
from kfac_hpc.kfac import layers, linalg, statistics_groups
from kfac_hpc.kfac.capture import StatisticsCapture
from kfac_hpc.kfac.layers import register_layers
from kfac_hpc.kfac.patches import patch_rows, stacked_patch_rows


@pytest.fixture
def gpu_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every device takes the GPU path (CPU tensors included), column-major rows too."""
    for module in (linalg, layers, statistics_groups):
        monkeypatch.setattr(module, "uses_gpu_path", lambda device: True)
    monkeypatch.setattr(layers, "COLUMN_MAJOR_ROWS_DEVICES", frozenset({"cpu"}))
    yield


def _per_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing stacks: every layer's statistics by its own product."""
    monkeypatch.setattr(statistics_groups, "STACKED_PRECISIONS", frozenset())


GEOMETRIES = {  # kernel, stride, dilation, (top, bottom, left, right)
    "1x1": ((1, 1), (1, 1), (1, 1), (0, 0, 0, 0)),
    "1x1-stride": ((1, 1), (2, 2), (1, 1), (0, 0, 0, 0)),
    "3x3-same": ((3, 3), (1, 1), (1, 1), (1, 1, 1, 1)),
    "3x2-dilated-stride": ((3, 2), (2, 1), (1, 2), (2, 0, 1, 1)),
    "3x3-valid": ((3, 3), (1, 1), (1, 1), (0, 0, 0, 0)),
}


@pytest.mark.parametrize("geometry", list(GEOMETRIES.values()), ids=list(GEOMETRIES))
@pytest.mark.parametrize("column_major", [False, True], ids=["row-major", "column-major"])
def test_stacked_patch_rows_are_each_inputs_rows(geometry, column_major):
    """The same numbers as each input's patch_rows, in the same layout."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(2, 3, 7, 6, generator=g, dtype=torch.float64) for _ in range(3)]
    stacked = stacked_patch_rows(xs, *geometry, column_major=column_major)
    for i, x in enumerate(xs):
        rows = patch_rows(x, *geometry, column_major=column_major)
        assert torch.equal(stacked[i], rows)
        assert stacked[i].stride() == rows.stride()


@pytest.mark.parametrize("column_major", [False, True], ids=["row-major", "column-major"])
def test_stacked_covariance_is_each_layers_covariance(gpu_path, column_major):
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(4, 37, 6, generator=g, dtype=torch.float64)
    if column_major:
        rows = rows.mT.contiguous().mT
    products = linalg.stacked_covariance(rows, 2.25)
    for i in range(4):
        torch.testing.assert_close(products[i], linalg.covariance(rows[i], 2.25),
                                   rtol=1e-13, atol=1e-15)
    with pytest.raises(ValueError, match="layers, rows, dim"):
        linalg.stacked_covariance(rows[0])


class _Repeated(nn.Module):
    """Layers of one shape, with and without bias, one used twice, one without gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.ModuleList([nn.Conv2d(4, 4, 3, padding=1, bias=i % 2 == 0)
                                    for i in range(4)])
        self.shared = nn.Conv2d(4, 4, 1)
        self.unused = nn.Conv2d(4, 4, 1)
        self.heads = nn.ModuleList([nn.Linear(4 * 36, 5) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv in self.convs:
            x = torch.tanh(conv(x))
        x = self.shared(torch.tanh(self.shared(x)))
        self.unused(x)  # captured in forward, never reached by backward
        flat = x.flatten(1)
        return sum(head(flat) for head in self.heads)


def _captured(model: nn.Module, batches: int = 2) -> tuple[dict, dict]:
    torch.manual_seed(0)
    found, _ = register_layers(model)
    capture = StatisticsCapture(found, dtype_of=lambda _: torch.float64, active=lambda: True,
                                grad_scale=lambda: 0.5)
    g = torch.Generator().manual_seed(3)
    for _ in range(batches):  # micro-batches, as under accumulation
        x = torch.randn(3, 4, 6, 6, generator=g, dtype=torch.float64)
        model(x).square().sum().backward()
    capture.join()
    sums = {(n, f): s.sums[f] for n, s in capture.stats.items() for f in "AG"}
    counts = {(n, f): s.counts[f] for n, s in capture.stats.items() for f in "AG"}
    capture.remove()
    return sums, counts


def _spy_products(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of layers of each batched product, in order."""
    sizes: list[int] = []
    product = linalg.stacked_covariance

    def spy(rows: torch.Tensor, *args, **kwargs):  # type: ignore[no-untyped-def]
        sizes.append(rows.shape[0])
        return product(rows, *args, **kwargs)

    monkeypatch.setattr(linalg, "stacked_covariance", spy)
    return sizes


@pytest.mark.parametrize("cap", [statistics_groups.GROUP_ROW_BYTES, 3000],
                         ids=["default-cap", "small-cap"])
def test_grouped_statistics_equal_layer_by_layer(gpu_path, monkeypatch, cap):
    """Every layer's sums and counts as its own products give them, over two
    micro-batches; groups formed (fewer products than factors), split where the cap
    says (3000 bytes: one layer's rows each, but the heads' 120-byte gradients), and
    the output never reached by backward is not waited for."""
    model = _Repeated().double()
    sizes = _spy_products(monkeypatch)
    monkeypatch.setattr(statistics_groups, "GROUP_ROW_BYTES", cap)
    grouped, grouped_counts = _captured(model)
    with monkeypatch.context() as m:
        _per_layer(m)
        alone, alone_counts = _captured(model)
    assert grouped_counts == alone_counts
    assert grouped_counts[("shared", "A")] == 4 and grouped_counts[("unused", "G")] == 0
    for key, value in alone.items():
        if value is None:
            assert grouped[key] is None, key
            continue
        torch.testing.assert_close(grouped[key], value, rtol=1e-12, atol=1e-14, msg=str(key))
    # per micro-batch: A of the biased and unbiased 3x3 pairs, the 1x1s (shared twice,
    # unused), the heads; G of the heads, then the six 4x6x6 outputs (computed when the
    # next forward begins or the sums are read: the unused layer's never comes)
    assert sizes == ([2, 2, 3, 3, 3, 6] * 2 if cap > 3000 else
                     [1] * 10 + [3] + [1] * 16 + [3] + [1] * 6)
    assert len(sizes) < sum(grouped_counts.values())


def test_grouping_is_decided_within_each_pass(gpu_path, monkeypatch):
    """The first pass groups as every later one does (so a resumed run's first step is
    computed as the uninterrupted run's)."""
    model = _Repeated().double()
    sizes = _spy_products(monkeypatch)
    _captured(model, batches=1)
    first = list(sizes)
    sizes.clear()
    _captured(model, batches=1)
    assert sizes == first and len(first) > 0


def test_how_a_layer_stacks_is_decided_once_per_shape(gpu_path, monkeypatch):
    """``LayerCurvature.stacking`` runs once per layer, factor and tensor shape, not in
    every hook of every pass; a batch of another size decides its shapes anew."""
    calls: list[tuple[int, str, tuple[int, ...]]] = []
    stacking = layers.LayerCurvature.stacking

    def spy(self, factor, t):  # type: ignore[no-untyped-def]
        calls.append((id(self), factor, tuple(t.shape)))
        return stacking(self, factor, t)

    monkeypatch.setattr(layers.LayerCurvature, "stacking", spy)
    model = _Repeated().double()
    found, _ = register_layers(model)
    capture = StatisticsCapture(found, dtype_of=lambda _: torch.float64, active=lambda: True,
                                grad_scale=lambda: 0.5)
    g = torch.Generator().manual_seed(3)
    made = []
    for batch in (3, 3, 3, 2):
        model(torch.randn(batch, 4, 6, 6, generator=g, dtype=torch.float64)).sum().backward()
        made.append(len(calls))
    capture.join()
    capture.remove()
    # every registered layer's A and G at the first pass (the unused layer's G too: the
    # forward asks), none at the next two, all again at batch 2
    assert made == [2 * len(found)] * 3 + [4 * len(found)]
    assert len(set(calls)) == len(calls)


def test_stacking_decisions_stay_bounded(gpu_path, monkeypatch):
    """Shapes that change with every pass do not grow the decisions without bound: past
    ``MAX_DECISIONS`` they are dropped and made again."""
    model = _Repeated().double()
    found, _ = register_layers(model)
    monkeypatch.setattr(statistics_groups, "MAX_DECISIONS", 3 * len(found))
    capture = StatisticsCapture(found, dtype_of=lambda _: torch.float64, active=lambda: True,
                                grad_scale=lambda: 0.5)
    groups = capture._groups
    assert groups is not None
    g = torch.Generator().manual_seed(3)
    for batch in range(1, 6):
        model(torch.randn(batch, 4, 6, 6, generator=g, dtype=torch.float64)).sum().backward()
        assert 0 < len(groups._decisions) <= 3 * len(found)
    capture.join()
    capture.remove()


def test_bf16_activations_stack_as_bf16_rows_of_float32_factors(gpu_path, monkeypatch):
    """bf16 (AMP) inputs and gradients with float32 factors at TF32 operands stack as
    each layer's path keeps them (bf16 rows, a float32 product): the same factors to
    float32 summation order, with fewer products than factors."""
    sizes = _spy_products(monkeypatch)
    model = _Repeated().bfloat16()

    def capture_sums() -> dict:
        found, _ = register_layers(model)
        capture = StatisticsCapture(found, dtype_of=lambda _: torch.float32,
                                    active=lambda: True, precision="tf32",
                                    grad_scale=lambda: 0.5)
        g = torch.Generator().manual_seed(3)
        x = torch.randn(3, 4, 6, 6, generator=g).bfloat16()
        model(x).float().square().sum().backward()
        capture.join()
        capture.remove()
        return {(n, f): s.sums[f] for n, s in capture.stats.items() for f in "AG"}

    grouped = capture_sums()
    assert 0 < len(sizes) < sum(v is not None for v in grouped.values())
    with monkeypatch.context() as m:
        _per_layer(m)
        alone = capture_sums()
    for key, value in alone.items():
        if value is None:
            assert grouped[key] is None, key
            continue
        assert grouped[key].dtype == torch.float32
        torch.testing.assert_close(grouped[key], value, rtol=1e-5, atol=1e-6, msg=str(key))


def test_what_does_not_stack(gpu_path, monkeypatch):
    """float32 tensors with bf16 operands (rows cast per layer), float16 tensors, and
    output gradients under a device-side loss scale (an AMP GradScaler's) take each
    layer's path."""
    sizes = _spy_products(monkeypatch)
    model = _Repeated().double()
    found, _ = register_layers(model)
    for precision, scale in (("bf16", 0.5), ("full", torch.tensor(0.5, dtype=torch.float64))):
        capture = StatisticsCapture(found, dtype_of=lambda _: torch.float64,
                                    active=lambda: True, precision=precision,
                                    grad_scale=lambda s=scale: s)  # type: ignore[misc]
        model(torch.randn(3, 4, 6, 6, dtype=torch.float64)).sum().backward()
        capture.join()
        capture.remove()
        if precision == "bf16":
            assert sizes == []
    assert sizes == [2, 2, 3, 3]  # the device scale: A stacks, G does not
    groups = statistics_groups.StatisticsGroups(lambda reads, work: work(), "tf32")
    half = torch.randn(3, 4, 6, 6).half()
    assert not groups.hold_a(found["convs.0"], lambda f, v: None, half, half, torch.float32)


class _WithAux(nn.Module):
    """Three Linear layers of one shape; ``aux``'s output never reaches the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.aux = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        self.aux(h)
        return self.b(torch.tanh(h))


def _step_factors(model: nn.Module, forwards_before: int = 0) -> dict:
    """The factors after one K-FAC step (``forwards_before`` forwards without backward
    first, in train mode: a logging pass)."""
    pre = KFACPreconditioner(model, comm=Communicator(MPI.COMM_SELF), damping=0.01,
                             factor_dtype=torch.float64, inv_dtype=torch.float64)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    for _ in range(forwards_before):
        model(x)
    model(x).square().sum().backward()
    pre.step()
    out = {key: state.average.clone() for key, state in pre.factors.items()
           if state.average is not None}
    pre.close()
    return out


@pytest.mark.parametrize("forwards_before", [0, 1], ids=["step", "logging-forward-first"])
def test_held_statistics_are_computed_before_the_step_reads_them(
        gpu_path, monkeypatch, caplog, forwards_before):
    """A group waiting for a gradient that never comes (an output outside the loss; a
    forward without backward that announced gradients) is computed when the step reads
    the statistics: the same factors as layer by layer, and the first step's warning
    names only the layer whose hooks did not fire."""
    torch.manual_seed(0)
    model = _WithAux().double()
    with monkeypatch.context() as m:
        _per_layer(m)
        alone = _step_factors(model, forwards_before)
    with caplog.at_level("WARNING"):
        grouped = _step_factors(model, forwards_before)
    assert grouped.keys() == alone.keys()
    for key, value in alone.items():
        torch.testing.assert_close(grouped[key], value, rtol=1e-12, atol=1e-14, msg=key)
    unfired = [r.getMessage() for r in caplog.records if "got no statistics" in r.getMessage()]
    assert len(unfired) == 2  # layer by layer, then grouped: the same warning
    assert all("first factor step (no forward, or no output gradient): aux." in m
               for m in unfired)


def test_held_rows_stay_under_the_cap_across_groups(gpu_path, monkeypatch):
    """The rows held for a factor, over all its groups, stay within GROUP_ROW_BYTES (it
    bounds what holding keeps alive): each product's layers fit under it together."""
    monkeypatch.setattr(statistics_groups, "GROUP_ROW_BYTES", 70_000)
    sizes = _spy_products(monkeypatch)
    held: list[int] = []
    compute_all = statistics_groups.StatisticsGroups._compute_all

    def spy(self, groups):  # type: ignore[no-untyped-def]
        held.append(sum(g.row_bytes for g in groups.values()))
        compute_all(self, groups)

    monkeypatch.setattr(statistics_groups.StatisticsGroups, "_compute_all", spy)
    model = _Repeated().double()
    grouped, _ = _captured(model, batches=1)
    assert max(held) <= 70_000 and max(sizes) > 1
    with monkeypatch.context() as m:
        _per_layer(m)
        alone, _ = _captured(model, batches=1)
    for key, value in alone.items():
        if value is not None:
            torch.testing.assert_close(grouped[key], value, rtol=1e-12, atol=1e-14)


def test_resnet50_training_with_groups_equals_layer_by_layer(gpu_path, monkeypatch):
    """ResNet-50's 54 layers (an eighth of the widths), trained in float64 with their
    statistics grouped by shape (32 products for 108 factors), equal the same training
    with every factor's own product."""
    sizes = _spy_products(monkeypatch)
    grouped = train_narrow_resnet50()
    assert len(sizes) == 3 * 32
    with monkeypatch.context() as m:
        _per_layer(m)
        alone = train_narrow_resnet50()
    for (name, p), q in zip(grouped.named_parameters(), alone.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12, msg=f"{name} differs")


def test_a_resumed_run_groups_its_first_step_as_the_uninterrupted_run(gpu_path, monkeypatch,
                                                                      tmp_path):
    """Saved between inverse updates and resumed in a fresh preconditioner, a run whose
    statistics are grouped (the GPU path forced) computes the same products as the run
    that saved, from the first pass after the load, and continues bit for bit (the
    products are compared too: on a CPU grouped and single products may agree to the
    bit, so equal parameters alone would not show the grouping)."""
    from kfac_hpc import checkpoint

    sizes = _spy_products(monkeypatch)

    comm = Communicator(MPI.COMM_SELF)
    data = narrow_resnet50_batches(6)

    def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, KFACPreconditioner]:
        model = narrow_resnet50(depths=(2, 2, 2, 2), widths=(8, 8, 8, 8)).double()
        torch.manual_seed(seed)  # the resumed run starts from other weights
        for p in model.parameters():
            p.data.add_(torch.randn_like(p), alpha=seed)
        pre = KFACPreconditioner(model, comm=comm, damping=0.01, inv_update_steps=2,
                                 factor_dtype=torch.float64, inv_dtype=torch.float64)
        return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), pre

    model, opt, pre = build(0)
    train_kfac(model, opt, pre, data[:3])
    checkpoint.save(tmp_path, model=model, optimizer=opt, preconditioner=pre, step=3, comm=comm)
    sizes.clear()
    train_kfac(model, opt, pre, data[3:])
    uninterrupted = list(sizes)
    resumed, resumed_opt, resumed_pre = build(1)
    checkpoint.load(tmp_path, model=resumed, optimizer=resumed_opt,
                    preconditioner=resumed_pre, comm=comm)
    sizes.clear()
    train_kfac(resumed, resumed_opt, resumed_pre, data[3:])
    assert sizes == uninterrupted and max(uninterrupted) > 1
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
    pre.close()
    resumed_pre.close()
