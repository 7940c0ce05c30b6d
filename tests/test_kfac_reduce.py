"""K-FAC-reduce against a dense reference, and the fast conv expand path against unfold.

References are independent of the code under test (as in ``test_kfac_math``): patches
by slicing a zero-padded input in Python loops, δ by per-example autograd. Exactness
checks (arXiv 2507.05127 "KFAC from scratch" in spirit): where the approximation is
exact (one example; reduce when the loss sees only the positions' mean), the factors
reproduce the empirical Fisher ``vec(∇W̄) vec(∇W̄)ᵀ`` from autograd.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kfac_hpc.kfac.layers import (
    APPROXIMATIONS,
    Conv2dCurvature,
    LinearCurvature,
    approx_for,
    curvature_for,
    register_layers,
)
from kfac_hpc.kfac.patches import averaged_patches, patch_covariance
from tests.test_kfac_math import (
    CONV_CASES,
    DT,
    LINEAR_CASES,
    RTOL,
    capture,
    conv_pads,
    make,
    outer_mean,
    per_example_delta,
    rel_err,
    vec,
)


def ref_reduce_linear(module: nn.Linear, x: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """Paper's reduce: â = mean over positions (bias 1), ĝ = Σ_t δ; G in per-position units."""
    deltas = per_example_delta(module, x, target)
    a_vecs, g_vecs, positions = [], [], 1
    for i in range(x.shape[0]):
        xi = x[i].reshape(-1, module.in_features)
        di = deltas[i].reshape(-1, module.out_features)
        positions = xi.shape[0]
        a = xi.mean(dim=0)
        if module.bias is not None:
            a = torch.cat([a, torch.ones(1, dtype=DT)])
        a_vecs.append(a)
        g_vecs.append(di.sum(dim=0))
    return outer_mean(a_vecs), outer_mean(g_vecs) / positions


def ref_conv_patches(module: nn.Conv2d, xi: Tensor) -> list[Tensor]:
    (kh, kw), (sh, sw), (dh, dw) = module.kernel_size, module.stride, module.dilation
    pt, pb, pl, pr = conv_pads(module)
    c, h, wd = xi.shape
    xp = torch.zeros(c, h + pt + pb, wd + pl + pr, dtype=xi.dtype)
    xp[:, pt : pt + h, pl : pl + wd] = xi
    ho = (h + pt + pb - dh * (kh - 1) - 1) // sh + 1
    wo = (wd + pl + pr - dw * (kw - 1) - 1) // sw + 1
    out = []
    for oh in range(ho):
        for ow in range(wo):
            r0, c0 = oh * sh, ow * sw
            out.append(xp[:, r0 : r0 + dh * (kh - 1) + 1 : dh,
                          c0 : c0 + dw * (kw - 1) + 1 : dw].reshape(-1))
    return out


def ref_reduce_conv(module: nn.Conv2d, x: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    deltas = per_example_delta(module, x, target)
    a_vecs, g_vecs, positions = [], [], 1
    for i in range(x.shape[0]):
        patches = ref_conv_patches(module, x[i])
        positions = len(patches)
        a = torch.stack(patches).mean(dim=0)
        if module.bias is not None:
            a = torch.cat([a, torch.ones(1, dtype=DT)])
        a_vecs.append(a)
        g_vecs.append(deltas[i].sum(dim=(1, 2)))
    return outer_mean(a_vecs), outer_mean(g_vecs) / positions


ALL = [("linear", k, *v) for k, v in LINEAR_CASES.items()] + [
    ("conv", k, *v) for k, v in CONV_CASES.items()
]
IDS = [f"{kind}-{name}" for kind, name, *_ in ALL]


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
@pytest.mark.parametrize(("kind", "name", "kwargs", "shape"), ALL, ids=IDS)
def test_reduce_factors_match_dense_reference(kind: str, name: str, kwargs: dict,
                                              shape: tuple) -> None:
    module, x, target = make(kind, kwargs, shape)
    curv = curvature_for(module, "reduce")
    assert curv is not None and curv.approx == "reduce"
    inputs, grad_output = capture(module, x, target)
    if isinstance(module, nn.Linear):
        a_ref, g_ref = ref_reduce_linear(module, x, target)
    else:
        assert isinstance(module, nn.Conv2d)
        a_ref, g_ref = ref_reduce_conv(module, x, target)
    a, g = curv.a_factor(inputs), curv.g_factor(grad_output)
    assert a.shape == (curv.a_dim, curv.a_dim) and g.shape == (curv.g_dim, curv.g_dim)
    assert rel_err(a, a_ref) < RTOL and rel_err(g, g_ref) < RTOL
    assert torch.equal(a, a.t()) and torch.equal(g, g.t())
    # the loss scale is removed exactly as for expand
    scale = 256.0
    assert rel_err(curv.g_factor(grad_output * scale, grad_scale=scale), g_ref) < RTOL
    # the grad rows are the expand rows whatever approx is
    expand = curvature_for(module)
    assert expand is not None
    assert torch.equal(curv.a_rows(inputs), expand.a_rows(inputs))


def test_reduce_equals_expand_without_positions() -> None:
    module, x, target = make("linear", *LINEAR_CASES["bias_2d"])
    inputs, go = capture(module, x, target)
    red, exp = curvature_for(module, "reduce"), curvature_for(module, "expand")
    assert red is not None and exp is not None
    assert rel_err(red.a_factor(inputs), exp.a_factor(inputs)) < 1e-14
    assert rel_err(red.g_factor(go), exp.g_factor(go)) < 1e-14


def empirical_fisher(module: nn.Module, loss_of_output: Any, x: Tensor) -> Tensor:
    """vec(∇W̄) vec(∇W̄)ᵀ of one example's loss (∇W̄ = [∇W, ∇b], column-major vec)."""
    module.zero_grad(set_to_none=True)
    loss_of_output(module(x)).backward()
    curv = curvature_for(module)
    assert curv is not None
    gv = vec(curv.grad_matrix())
    return torch.outer(gv, gv)


@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_reduce_exact_when_loss_sees_the_mean_over_positions(kind: str) -> None:
    """One example, loss of the positions' mean output: reduce's T·(A⊗G) is exactly the
    empirical Fisher; expand's is not (positions are correlated through the loss)."""
    torch.manual_seed(20)
    module: nn.Module
    if kind == "linear":
        module, x = nn.Linear(3, 2).to(DT), torch.randn(1, 5, 3, dtype=DT)
        pool = lambda y: y.mean(dim=1)
    else:
        module = nn.Conv2d(2, 2, 3, padding=1, stride=2).to(DT)
        x = torch.randn(1, 2, 5, 5, dtype=DT)
        pool = lambda y: y.mean(dim=(2, 3))
    target = torch.randn(1, 2, dtype=DT)
    loss = lambda y: (torch.sin(pool(y)) * target).sum() + (pool(y) ** 2).sum()
    fisher = empirical_fisher(module, loss, x)
    store: dict[str, Tensor] = {}
    module.register_forward_pre_hook(lambda m, i: store.__setitem__("a", i[0].detach()))
    module.register_full_backward_hook(lambda m, gi, go: store.__setitem__("g", go[0].detach()))
    loss(module(x.clone().requires_grad_(True))).backward()
    results = {}
    for approx in APPROXIMATIONS:
        curv = curvature_for(module, approx)
        assert curv is not None
        y = module(x)
        positions = y[0, 0].numel() if kind == "conv" else y.shape[1]
        kron = torch.kron(curv.a_factor(store["a"]), curv.g_factor(store["g"])) * positions
        results[approx] = rel_err(kron, fisher)
    assert results["reduce"] < RTOL
    assert results["expand"] > 1e-3


def test_one_example_one_position_is_exact() -> None:
    torch.manual_seed(21)
    lin = nn.Linear(4, 3).to(DT)
    x, target = torch.randn(1, 4, dtype=DT), torch.randn(1, 3, dtype=DT)
    loss = lambda y: (0.5 * (y - target) ** 2 + torch.sin(y)).sum()
    fisher = empirical_fisher(lin, loss, x)
    inputs, go = capture(lin, x, target)
    del inputs, go
    store: dict[str, Tensor] = {}
    lin.register_forward_pre_hook(lambda m, i: store.__setitem__("a", i[0].detach()))
    lin.register_full_backward_hook(lambda m, gi, go: store.__setitem__("g", go[0].detach()))
    loss(lin(x.clone().requires_grad_(True))).backward()
    for approx in APPROXIMATIONS:
        curv = curvature_for(lin, approx)
        assert curv is not None
        kron = torch.kron(curv.a_factor(store["a"]), curv.g_factor(store["g"]))
        assert rel_err(kron, fisher) < RTOL


def test_approx_option() -> None:
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Flatten(), nn.Linear(12, 2))
    layers, _ = register_layers(model, approx={"Conv2d": "reduce"})
    assert layers["0"].approx == "reduce" and layers["2"].approx == "expand"
    layers, _ = register_layers(model, approx={"2": "reduce", "Linear": "expand"})
    assert layers["0"].approx == "expand" and layers["2"].approx == "reduce"
    layers, _ = register_layers(model, approx="reduce")
    assert all(c.approx == "reduce" for c in layers.values())
    with pytest.raises(ValueError):
        register_layers(model, approx="sum")
    with pytest.raises(ValueError):
        LinearCurvature(nn.Linear(2, 2), "mean")
    assert approx_for("x", nn.Linear(2, 2), {}) == "expand"
    assert "reduce" in repr(Conv2dCurvature(nn.Conv2d(1, 1, 1), "reduce"))


# --------------------------------------------------------------------------- fast expand A

FAST_CONV: dict[str, tuple[dict[str, Any], tuple[int, ...]]] = {
    **CONV_CASES,
    "stride3_dil2_pad_asym": (dict(in_channels=3, out_channels=2, kernel_size=(2, 3),
                                   stride=(3, 2), dilation=(2, 1), padding=(2, 1)),
                              (3, 3, 11, 9)),
    "k5_pad2_nobias": (dict(in_channels=4, out_channels=2, kernel_size=5, padding=2,
                            bias=False), (2, 4, 7, 8)),
    "k1_stride2": (dict(in_channels=5, out_channels=3, kernel_size=1, stride=2), (3, 5, 7, 7)),
    "same_dil_nonsquare": (dict(in_channels=2, out_channels=2, kernel_size=(3, 4),
                                dilation=(2, 3), padding="same", bias=False), (2, 2, 9, 11)),
    "kernel_equals_input": (dict(in_channels=2, out_channels=2, kernel_size=(4, 5)),
                            (3, 2, 4, 5)),
    "resnet_like": (dict(in_channels=16, out_channels=16, kernel_size=3, padding=1,
                         bias=False), (4, 16, 8, 8)),
}


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
@pytest.mark.parametrize(("kwargs", "shape"), list(FAST_CONV.values()), ids=list(FAST_CONV))
def test_fast_conv_expand_equals_unfold(kwargs: dict, shape: tuple) -> None:
    torch.manual_seed(22)
    conv = nn.Conv2d(**kwargs).to(DT)
    curv = curvature_for(conv)
    assert isinstance(curv, Conv2dCurvature)
    x = torch.randn(*shape, dtype=DT)
    ref = curv.a_factor_unfold(x)
    geo = curv._conv_geometry()
    # the fast path itself (a_factor takes it from 8 input channels on)
    fast = patch_covariance(x, *geo, curv.pads(), append_one=curv.has_bias)
    assert fast.shape == ref.shape and torch.equal(fast, fast.t())
    assert rel_err(fast, ref) < 1e-12
    assert rel_err(curv.a_factor(x), ref) < 1e-12
    # every chunking and block split gives the same matrix
    for chunk_rows, blocks in itertools.product((1, 7, 1 << 20), (1, 2, 5)):
        got = patch_covariance(x, *geo, curv.pads(), append_one=curv.has_bias,
                               chunk_rows=chunk_rows, blocks=blocks)
        assert rel_err(got, ref) < 1e-12
    # unbatched input is one example
    assert rel_err(curv.a_factor(x[0]), curv.a_factor_unfold(x[0])) < 1e-12
    # averaged patches (reduce) equal unfold's mean
    unfolded = curv._patches(x)
    assert rel_err(averaged_patches(x, *geo, curv.pads()), unfolded.mean(dim=2)) < 1e-12


def test_fast_conv_float32_and_half_paths() -> None:
    torch.manual_seed(23)
    conv = nn.Conv2d(3, 4, 3, padding=1)
    curv = curvature_for(conv)
    assert isinstance(curv, Conv2dCurvature)
    x = torch.randn(4, 3, 9, 9)
    a32 = curv.a_factor(x)
    assert a32.dtype == torch.float32
    assert rel_err(a32.double(), curv.a_factor(x, dtype=DT)) < 1e-6
    ah = curv.a_factor(x.bfloat16())  # half precision keeps the unfold path
    assert ah.dtype == torch.bfloat16
    with pytest.raises(ValueError):
        patch_covariance(x[0], (3, 3), (1, 1), (1, 1), (1, 1, 1, 1))
    with pytest.raises(ValueError):
        averaged_patches(x[0], (3, 3), (1, 1), (1, 1), (1, 1, 1, 1))


def test_patch_covariance_is_psd_gram() -> None:
    torch.manual_seed(24)
    x = torch.randn(2, 3, 6, 6, dtype=DT)
    m = patch_covariance(x, (3, 3), (1, 1), (1, 1), (0, 0, 0, 0), append_one=True)
    rows = F.unfold(x, 3).transpose(1, 2).reshape(-1, 27)
    rows = torch.cat([rows, torch.ones(rows.shape[0], 1, dtype=DT)], 1)
    assert rel_err(m, rows.t() @ rows / rows.shape[0]) < 1e-13


def test_flop_counts() -> None:
    from kfac_hpc.kfac.shapes import (
        eigh_flops,
        lowrank_precondition_flops,
        randomized_eigh_flops,
        statistics_flops,
    )

    # expand: two Gram matrices over b·T rows; reduce: sums over positions + b rows
    assert statistics_flops(10, 4, 8, 5) == 2 * 40 * (100 + 16)
    assert statistics_flops(10, 4, 8, 5, symmetric=True) == 40 * (110 + 20)
    assert statistics_flops(10, 4, 8, 5, "reduce") == 40 * 14 + 2 * 8 * (100 + 16)
    assert statistics_flops(10, 4, 8, 1, "reduce") > statistics_flops(10, 4, 8, 1)
    with pytest.raises(ValueError):
        statistics_flops(1, 1, 1, 1, "sum")
    assert eigh_flops(10) == 4000
    d, k = 1569, 64
    assert randomized_eigh_flops(d, k) < eigh_flops(d) / 3
    assert lowrank_precondition_flops(128, d, 128, k) < 4 * 128 * d * (128 + d)


def test_new_paths_create_tensors_on_the_data_device(meta_default_device: Any) -> None:
    """Reduce, the fast conv path and the low-rank functions name their device."""
    from kfac_hpc.kfac.lowrank import precondition_lowrank, randomized_eigh

    torch.manual_seed(25)
    conv = nn.Conv2d(8, 4, 3, padding=1)
    lin = nn.Linear(6, 5)
    x, go = torch.randn(2, 8, 6, 6), torch.randn(2, 4, 6, 6)
    xs, gs = torch.randn(2, 3, 6), torch.randn(2, 3, 5)
    f = torch.randn(300, 300)
    f = f @ f.t()
    grad = torch.randn(5, 300)
    g5 = torch.randn(5, 5)
    gen = torch.Generator().manual_seed(0)
    meta_default_device()
    for approx in APPROXIMATIONS:
        cc, lc = Conv2dCurvature(conv, approx), LinearCurvature(lin, approx)
        for t in (cc.a_factor(x), cc.g_factor(go), lc.a_factor(xs), lc.g_factor(gs)):
            assert t.device.type == "cpu"
    a = randomized_eigh(f, rank=8, generator=gen)
    a_energy = randomized_eigh(f, energy=0.5, generator=gen)
    g = randomized_eigh(g5 @ g5.t(), rank=5)
    for t in (a.q, a.rho, a_energy.q, precondition_lowrank(grad, a, g, 1e-3), a.dense()):
        assert t.device.type == "cpu"


@pytest.mark.parametrize("approx", APPROXIMATIONS)
@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_data_parallel_average_is_the_global_factor(kind: str, approx: str) -> None:
    """Equal local batches: the mean of the local factors is the whole batch's factor
    (the data-parallel rule every strategy but DP-KFAC relies on), for 2 and 4 shards."""
    if kind == "linear":
        module, x, target = make("linear", *LINEAR_CASES["bias_seq"])
        x = torch.cat([x, x.flip(0) + 1, 2 * x[:2]])  # batch 8
        target = torch.cat([target, target.flip(0), target[:2]])
    else:
        module, x, target = make("conv", *CONV_CASES["k3_nobias_stride2_pad1"])
        x, target = torch.cat([x, -x[:1]]), torch.cat([target, target[:1]])
    curv = curvature_for(module, approx)
    assert curv is not None
    inputs, go = capture(module, x, target)
    a_all, g_all = curv.a_factor(inputs), curv.g_factor(go)
    for shards in (2, 4):
        parts_a, parts_g = [], []
        assert x.shape[0] % shards == 0
        for xs, ts in zip(x.chunk(shards), target.chunk(shards), strict=True):
            i, g = capture(module, xs, ts)  # each shard's own mean loss
            parts_a.append(curv.a_factor(i))
            parts_g.append(curv.g_factor(g))
        assert rel_err(torch.stack(parts_a).mean(0), a_all) < RTOL
        assert rel_err(torch.stack(parts_g).mean(0), g_all) < RTOL
