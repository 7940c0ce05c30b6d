"""K-FAC where it is exact, against the curvature computed by autograd (issue 14).

In the spirit of Dangel et al., "Kronecker-factored approximate curvature (KFAC) from
scratch" (arXiv 2507.05127) and Eschenhagen et al., "Kronecker-Factored Approximate
Curvature for Modern Neural Network Architectures" (NeurIPS 2023, arXiv 2311.00636):
the factors are the ones ``KFACPreconditioner`` builds through its hooks on real
forward/backward passes (one rank, ``pre.factors`` after the first ``step()``, where the
running average is the batch factor whatever ``factor_decay``); the references are
built from autograd only (``torch.autograd.functional.jacobian``/``hessian`` through
``torch.func.functional_call``; not ``torch.func.jacrev``, whose first call imports
dynamo for seconds), in float64:

* ``GGN_l = (1/N) Σ_n J_nᵀ H_n J_n`` with ``J_n = ∂f(x_n)/∂vec(W̄_l)`` (column-major
  vec of ``W̄ = [W, b]``, the library's convention ``(A⊗G) vec(X) = vec(G X Aᵀ)``) and
  ``H_n = ∂²l_n/∂f²``; the loss is ``L = (1/N) Σ_n l_n`` (the library's batch mean);
* ``EF_l = (1/N) Σ_n g_n g_nᵀ`` with ``g_n = ∇_{vec W̄_l} l_n`` (empirical Fisher).

Which curvature the library approximates: its ``G`` is the second moment of the
output gradients that actually flow in backward, ``δ = b·∂L/∂y`` (design.md, "the math
contract"): with the training loss that is the **empirical Fisher** (no sampled
labels). To get the GGN (type-2 Fisher) from the same hooks, the tests backpropagate the
columns of a symmetric factor of the loss Hessian instead of the loss gradient (the
construction of "KFAC from scratch"): ``H_n = S_n S_nᵀ`` with ``C`` columns; micro-batch
``c`` of ``C`` (``accumulation_steps=C``, so its loss is divided by ``C``) backpropagates
``√C·s_{n,c}``: the library averages the ``C`` micro-batch factors, so (expand)
``G = (1/(bT)) Σ_{n,t} Σ_c (J_{z,t}ᵀ s_{n,c})(J_{z,t}ᵀ s_{n,c})ᵀ``, the type-2 ``G``
(``J_{z,t} = ∂f_n/∂z_{n,t}``, ``b = N``; reduce sums over ``t`` before the product).

Scaling made explicit: for a layer with ``T`` positions per example (``T = 1``
without weight sharing, ``Ho·Wo`` for Conv2d), ``A ⊗ G = curvature / T`` for expand
and reduce alike (layers.py docstring): the tests compare ``T·(A⊗G)`` with the block.

Exact cases (each derived at its test):

1. one example through one Linear (MSE, cross-entropy): ``GGN = āāᵀ ⊗ H``,
   ``EF = āāᵀ ⊗ δδᵀ``;
2. deep linear networks with MSE: ``H`` and ``B_l = ∂f/∂z_l`` do not depend on the
   example, so ``GGN_l = (1/N Σ āāᵀ) ⊗ B_lᵀHB_l`` exactly, for any batch;
3. weight sharing (Linear over sequences, Conv2d) in deep linear networks:
   K-FAC-expand is exact when the loss sums over positions that stay separate (expand
   setting), K-FAC-reduce when the positions are averaged before the loss (reduce
   setting), and each is not exact in the other's setting;
4. ``pre.step()``'s preconditioned gradient in exact cases equals the dense solve with
   the damping form of each ``compute_method`` (also on 2+ ranks with the batch split,
   ``test_step_exact_ggn_on_ranks``, run under MPI).

Tolerances: float64 on matrices of size ≤ ~230, so agreement is ~1e-14 relative;
``RTOL = 1e-10``. Non-exact cases must differ by more than ``INEXACT`` (their errors are
O(0.1–1)).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import Tensor, nn
from torch.autograd.functional import hessian, jacobian
from torch.func import functional_call

from kfac_hpc import KFACPreconditioner
from kfac_hpc.comm import Communicator

DT = torch.float64
RTOL = 1e-10
INEXACT = 1e-2

Loss = Callable[[Tensor, Tensor], Tensor]
"""A per-example loss ``l_n(f(x_n), t_n)`` on one example's (unbatched) output."""


def half_sse(y: Tensor, t: Tensor) -> Tensor:
    """``½ Σ (y − t)²`` over all the example's outputs (positions summed): ``H = I``."""
    return 0.5 * ((y - t) ** 2).sum()


def mse_mean(y: Tensor, t: Tensor) -> Tensor:
    """PyTorch's ``mse_loss`` (mean over the example's outputs): ``H = (2/d)·I``."""
    return F.mse_loss(y, t)


def cross_entropy(y: Tensor, t: Tensor) -> Tensor:
    """Softmax cross-entropy of one example's logits: ``H = diag(p) − ppᵀ``."""
    return F.cross_entropy(y[None], t[None])


LOSSES: dict[str, Loss] = {"mse": mse_mean, "ce": cross_entropy}


def batch_loss(loss: Loss, y: Tensor, targets: Tensor) -> Tensor:
    """``L = (1/N) Σ_n l_n``: the mean loss the library's scaling assumes."""
    return torch.stack([loss(y[n], targets[n]) for n in range(y.shape[0])]).mean()


def rel_err(x: Tensor, ref: Tensor) -> float:
    return float((x - ref).norm() / ref.norm())


def vec(m: Tensor) -> Tensor:
    """Column-major vec (stacks the columns)."""
    return m.t().reshape(-1)


def unvec(v: Tensor, rows: int, cols: int) -> Tensor:
    return v.reshape(cols, rows).t()


class MeanOverPositions(nn.Module):
    """Averages the positions of ``(N, T, d)`` (Linear over sequences) or ``(N, C, H, W)``."""

    def forward(self, x: Tensor) -> Tensor:
        return x.mean(dim=1) if x.dim() == 3 else x.mean(dim=(2, 3))


def kfac_layers(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear | nn.Conv2d)]


def layer(model: nn.Module, name: str) -> nn.Linear | nn.Conv2d:
    m = model.get_submodule(name)
    assert isinstance(m, nn.Linear | nn.Conv2d)
    return m


def wbar(m: nn.Linear | nn.Conv2d) -> Tensor:
    """``W̄ = [W reshaped to (out, ·), b]``: the layer's parameters as the library sees them."""
    w = m.weight.detach().reshape(m.weight.shape[0], -1)
    return w if m.bias is None else torch.cat([w, m.bias.detach()[:, None]], dim=1)


@contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """Eval mode: the preconditioner's hooks capture nothing (references, real gradients)."""
    was = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was)


# --------------------------------------------------------------------------- references


@dataclass
class Reference:
    """Per layer name: GGN and EF blocks, the mean-loss gradient ``vec(∇W̄ L)``, positions."""

    ggn: dict[str, Tensor]
    ef: dict[str, Tensor]
    grad: dict[str, Tensor]
    positions: dict[str, int]
    hessians: Tensor  # (N, M, M): ∂²l_n/∂f² of each example, f flattened


def output_hessians(model: nn.Module, x: Tensor, targets: Tensor, loss: Loss) -> Tensor:
    with evaluating(model), torch.no_grad():
        y = model(x)
    shape = y.shape[1:]
    return torch.stack([
        hessian(lambda f, n=n: loss(f.reshape(shape), targets[n]), y[n].reshape(-1))
        for n in range(y.shape[0])])


def layer_jacobian(model: nn.Module, name: str, x: Tensor) -> Tensor:
    """``J_n = ∂f(x_n)/∂vec(W̄)`` for every example: ``(N, M, g·a)``."""
    m = layer(model, name)
    params = {k: v.detach() for k, v in model.named_parameters()}
    w_shape, cols = m.weight.shape, m.weight[0].numel()

    def f(w: Tensor) -> Tensor:
        p = dict(params)
        p[f"{name}.weight"] = w[:, :cols].reshape(w_shape)
        if m.bias is not None:
            p[f"{name}.bias"] = w[:, cols]
        return functional_call(model, p, (x,)).reshape(x.shape[0], -1)

    with evaluating(model):
        jac = jacobian(f, wbar(m))  # (N, M, g, a)
    return jac.transpose(-1, -2).reshape(jac.shape[0], jac.shape[1], -1)


def positions_of(model: nn.Module, x: Tensor) -> dict[str, int]:
    """Rows per example of every K-FAC layer: output elements / output features."""
    out: dict[str, int] = {}
    handles = []
    for name in kfac_layers(model):
        def hook(m: nn.Module, i: tuple[Tensor, ...], o: Tensor, name: str = name) -> None:
            features = o.shape[-1] if isinstance(m, nn.Linear) else o.shape[1]
            out[name] = o[0].numel() // features
        handles.append(layer(model, name).register_forward_hook(hook))
    with evaluating(model), torch.no_grad():
        model(x)
    for h in handles:
        h.remove()
    return out


def reference(model: nn.Module, x: Tensor, targets: Tensor, loss: Loss) -> Reference:
    h = output_hessians(model, x, targets, loss)
    with evaluating(model), torch.no_grad():
        y = model(x)
    # ∇_f l_n for every example
    dl = torch.stack([jacobian(lambda f, n=n: loss(f.reshape(y.shape[1:]), targets[n]),
                               y[n].reshape(-1)) for n in range(y.shape[0])])
    ggn, ef, grad = {}, {}, {}
    n_ex = x.shape[0]
    for name in kfac_layers(model):
        j = layer_jacobian(model, name, x)
        ggn[name] = torch.einsum("nmp,nmk,nkq->pq", j, h, j) / n_ex
        g_n = torch.einsum("nmp,nm->np", j, dl)
        ef[name] = g_n.t() @ g_n / n_ex
        grad[name] = g_n.mean(dim=0)
    return Reference(ggn, ef, grad, positions_of(model, x), h)


def hessian_factor(h: Tensor) -> Tensor:
    """``S`` with ``S Sᵀ = H`` (per example, ``(N, M, M)``): eigenvectors times √λ."""
    lam, q = torch.linalg.eigh(h)
    return q * lam.clamp(min=0).sqrt()[:, None, :]


# --------------------------------------------------------------------------- library side


def preconditioner(model: nn.Module, **kwargs: Any) -> KFACPreconditioner:
    options: dict[str, Any] = dict(comm=Communicator(MPI.COMM_SELF), kl_clip=None,
                                   factor_dtype=DT, inv_dtype=DT, factor_decay=0.5)
    options.update(kwargs)
    return KFACPreconditioner(model, **options)


def kfac_step(model: nn.Module, passes: Callable[[], None], **kwargs: Any
              ) -> KFACPreconditioner:
    """A preconditioner on ``model``, the ``passes`` it captures, one ``step()``; closed
    afterwards (hooks removed: ``factors`` stay readable)."""
    pre = preconditioner(model, **kwargs)
    passes()
    pre.step()
    pre.close()
    return pre


def empirical_pass(model: nn.Module, x: Tensor, targets: Tensor, loss: Loss) -> None:
    """A training step's backward: G from the loss gradient (empirical Fisher)."""
    model.train()
    model.zero_grad(set_to_none=True)
    batch_loss(loss, model(x), targets).backward()


def type2_passes(model: nn.Module, x: Tensor, factor: Tensor) -> None:
    """``C`` micro-batches backpropagating ``√C·s_{n,c}`` (the columns of ``S_n``) from the
    output: the loss of micro-batch ``c`` is ``(1/N) Σ_n √C ⟨s_{n,c}, f_n⟩``, divided by
    ``C = accumulation_steps``. Leaves garbage in ``.grad``."""
    model.train()
    n, c = x.shape[0], factor.shape[-1]
    for col in range(c):
        y = model(x).reshape(n, -1)
        ((y * factor[:, :, col]).sum() * math.sqrt(c) / (n * c)).backward()


def true_gradient(model: nn.Module, x: Tensor, targets: Tensor, loss: Loss) -> None:
    """``.grad = ∇L`` of the mean loss, computed in eval mode (no statistics captured)."""
    with evaluating(model):
        model.zero_grad(set_to_none=True)
        batch_loss(loss, model(x), targets).backward()


def kron_factors(pre: KFACPreconditioner, name: str) -> Tensor:
    a, g = pre.factors[f"{name}/A"].average, pre.factors[f"{name}/G"].average
    assert a is not None and g is not None and a.dtype == g.dtype == DT
    return torch.kron(a, g)


def type2_kfac(model: nn.Module, x: Tensor, ref: Reference, **kwargs: Any
               ) -> KFACPreconditioner:
    """The library's factors of one step driven by the loss Hessian's factor (type-2)."""
    s = hessian_factor(ref.hessians)
    return kfac_step(model, lambda: type2_passes(model, x, s),
                     accumulation_steps=s.shape[-1], **kwargs)


def errors_to(pre: KFACPreconditioner, blocks: dict[str, Tensor], positions: dict[str, int]
              ) -> dict[str, float]:
    """Relative error of ``T·(A⊗G)`` against each layer's block."""
    return {n: rel_err(positions[n] * kron_factors(pre, n), blocks[n]) for n in blocks}


# --------------------------------------------------------------------------- 1. one Linear


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("loss_name", list(LOSSES))
def test_one_example_one_linear(loss_name: str, bias: bool) -> None:
    """One example, ``f = W̄ā``: ``J = āᵀ ⊗ I`` so ``GGN = āāᵀ ⊗ H`` and
    ``EF = (ā⊗δ)(ā⊗δ)ᵀ = āāᵀ ⊗ δδᵀ`` (``δ = ∂l/∂f``), both exactly Kronecker.

    The training backward gives the EF (the library's convention): ``A = āāᵀ``,
    ``G = δδᵀ``; it is *not* the GGN (``δδᵀ`` has rank one, ``H`` does not). Driven by
    the Hessian's factor, the same hooks give ``G = H`` and the GGN exactly.
    MSE: PyTorch's mean over the 3 outputs, ``H = (2/3)I``; CE: ``H = diag(p) − ppᵀ``.
    """
    torch.manual_seed(1)
    loss = LOSSES[loss_name]
    model = nn.Sequential(nn.Linear(5, 3, bias=bias)).to(DT)
    x = torch.randn(1, 5, dtype=DT)
    targets = torch.randn(1, 3, dtype=DT) if loss_name == "mse" else torch.tensor([2])
    ref = reference(model, x, targets, loss)
    if loss_name == "mse":
        assert torch.allclose(ref.hessians[0], 2 / 3 * torch.eye(3, dtype=DT))

    pre = kfac_step(model, lambda: empirical_pass(model, x, targets, loss))
    a_bar = x[0] if not bias else torch.cat([x[0], torch.ones(1, dtype=DT)])
    a = pre.factors["0/A"].average
    assert a is not None and rel_err(a, torch.outer(a_bar, a_bar)) < RTOL  # the split of A⊗G
    assert rel_err(kron_factors(pre, "0"), ref.ef["0"]) < RTOL
    assert rel_err(kron_factors(pre, "0"), ref.ggn["0"]) > INEXACT  # EF, not GGN

    model.zero_grad(set_to_none=True)
    pre2 = type2_kfac(model, x, ref)
    assert rel_err(kron_factors(pre2, "0"), ref.ggn["0"]) < RTOL
    g = pre2.factors["0/G"].average
    assert g is not None and rel_err(g, ref.hessians[0]) < RTOL


# --------------------------------------------------------------------------- 2. deep linear


def deep_net(activation: bool) -> nn.Sequential:
    act: list[nn.Module] = [nn.Tanh()] if activation else []
    return nn.Sequential(nn.Linear(4, 5), *act, nn.Linear(5, 3, bias=False), *act,
                         nn.Linear(3, 2)).to(DT)


def test_deep_linear_mse_is_exact_for_a_batch() -> None:
    """Deep linear network, MSE, ``N = 6`` examples: ``f_n = B_l z_{n,l} + c`` with
    ``B_l = W_L⋯W_{l+1}`` the same for every example and ``H = (2/d)I`` constant, so
    ``J_n = ā_nᵀ ⊗ B_l`` and ``GGN_l = (1/N)Σ ā_nā_nᵀ ⊗ B_lᵀHB_l = A ⊗ G`` exactly
    (type-2 ``G``). The reference is itself checked: here ``f`` is affine in each ``W̄_l``,
    so the GGN block is the loss Hessian's block (``autograd.functional.hessian``).

    Not exact (so the test can tell): the empirical Fisher of the batch
    (``δ_n = B_lᵀ(2/d)(f_n − t_n)`` varies with ``n``), and the same network with ``tanh``
    (``B_l`` varies with ``n``) except its last layer (``B = I``).
    """
    torch.manual_seed(2)
    model = deep_net(activation=False)
    x, targets = torch.randn(6, 4, dtype=DT), torch.randn(6, 2, dtype=DT)
    ref = reference(model, x, targets, mse_mean)
    names = kfac_layers(model)
    assert names == ["0", "1", "2"]

    for name in names:  # reference check: GGN block == Hessian block of L in W̄_l
        m = layer(model, name)
        cols = m.weight[0].numel()

        def loss_of(w: Tensor, name: str = name, m: nn.Linear | nn.Conv2d = m,
                    cols: int = cols) -> Tensor:
            p = {k: v.detach() for k, v in model.named_parameters()}
            p[f"{name}.weight"] = w[:, :cols].reshape(m.weight.shape)
            if m.bias is not None:
                p[f"{name}.bias"] = w[:, cols]
            return batch_loss(mse_mean, functional_call(model, p, (x,)), targets)

        w0 = wbar(m)
        hess = hessian(loss_of, w0).permute(1, 0, 3, 2).reshape(w0.numel(), w0.numel())
        assert rel_err(hess, ref.ggn[name]) < RTOL

    pre = type2_kfac(model, x, ref)
    assert all(e < RTOL for e in errors_to(pre, ref.ggn, ref.positions).values())

    model.zero_grad(set_to_none=True)
    pre_ef = kfac_step(model, lambda: empirical_pass(model, x, targets, mse_mean))
    assert all(e > INEXACT for e in errors_to(pre_ef, ref.ef, ref.positions).values())

    torch.manual_seed(2)
    nonlinear = deep_net(activation=True)
    ref_nl = reference(nonlinear, x, targets, mse_mean)
    err = errors_to(type2_kfac(nonlinear, x, ref_nl), ref_nl.ggn, ref_nl.positions)
    assert err["0"] > INEXACT and err["2"] > INEXACT  # tanh layers after them
    assert err["4"] < RTOL  # the output layer: B = I, H constant


@pytest.mark.parametrize("activation", [False, True], ids=["linear", "tanh"])
def test_one_example_every_layer_is_exact(activation: bool) -> None:
    """One example, any depth (also with ``tanh``): ``J = āᵀ ⊗ B`` with ``B = ∂f/∂z_l``,
    so ``GGN_l = āāᵀ ⊗ BᵀHB`` (type-2 ``G``) and ``EF_l = āāᵀ ⊗ δδᵀ`` (training
    backward) for every layer."""
    torch.manual_seed(3)
    model = deep_net(activation)
    x, targets = torch.randn(1, 4, dtype=DT), torch.randn(1, 2, dtype=DT)
    ref = reference(model, x, targets, mse_mean)
    pre = kfac_step(model, lambda: empirical_pass(model, x, targets, mse_mean))
    assert all(e < RTOL for e in errors_to(pre, ref.ef, ref.positions).values())
    model.zero_grad(set_to_none=True)
    pre2 = type2_kfac(model, x, ref)
    assert all(e < RTOL for e in errors_to(pre2, ref.ggn, ref.positions).values())


# --------------------------------------------------------------------------- 3. weight sharing


@dataclass
class SharingCase:
    model: Callable[[], nn.Module]
    x_shape: tuple[int, ...]
    y_shape: tuple[int, ...]
    setting: str  # "expand" or "reduce": which K-FAC is exact
    shared: tuple[str, ...]  # the layers with positions (T > 1)


SHARING: dict[str, SharingCase] = {
    # f_{n,t} = W₂(W₁x_{n,t}+b₁)+b₂, l_n = ½Σ_t‖f_{n,t}−y_{n,t}‖²: H block-diagonal over t
    "linear_seq_expand": SharingCase(
        lambda: nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)), (3, 4, 3), (3, 4, 2),
        "expand", ("0", "1")),
    # f_n = W₃ (1/T)Σ_t W₂(W₁x_{n,t}+b₁) + ...: the loss sees only the positions' mean
    "linear_seq_reduce": SharingCase(
        lambda: nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 3, bias=False),
                              MeanOverPositions(), nn.Linear(3, 2)), (3, 4, 3), (3, 2),
        "reduce", ("0", "1")),
    # 3x3 conv (8 channels: the fast patch path), stride 2, then a 1x1 conv: per-pixel
    # regression, so each output pixel depends on the 3x3 conv's output at that pixel only
    "conv_expand": SharingCase(
        lambda: nn.Sequential(nn.Conv2d(8, 3, 3, stride=2, padding=1),
                              nn.Conv2d(3, 2, 1, bias=False)), (2, 8, 5, 4), (2, 2, 3, 2),
        "expand", ("0", "1")),
    # conv, 1x1 conv, global mean pool, Linear: the loss sees the mean over output pixels
    "conv_reduce": SharingCase(
        lambda: nn.Sequential(nn.Conv2d(2, 3, 3, stride=2, padding=1, bias=False),
                              nn.Conv2d(3, 3, 1), MeanOverPositions(), nn.Linear(3, 2)),
        (3, 2, 5, 5), (3, 2), "reduce", ("0", "1")),
}


@pytest.mark.parametrize("case", list(SHARING))
def test_weight_sharing_expand_and_reduce(case: str) -> None:
    """Deep linear networks with weight sharing, MSE summed over outputs (type-2 ``G``),
    after Eschenhagen et al. (2023), with ``T`` the layer's positions per example and
    ``B`` the (constant) Jacobian of the output w.r.t. the layer's output:

    * expand setting (every position reaches the loss on its own): ``f_{n,t} = B z_{n,t}``,
      ``GGN = (1/N) Σ_{n,t} ā_{n,t}ā_{n,t}ᵀ ⊗ BᵀB = T·A_exp ⊗ G_exp`` with
      ``A_exp = (1/NT) Σ āāᵀ``, ``G_exp = (1/NT) Σ_{n,t,c} δδᵀ = BᵀB``;
    * reduce setting (the loss sees ``(1/T) Σ_t z_{n,t}``): ``f_n = B W â_n + c``,
      ``GGN = (1/N) Σ_n â_nâ_nᵀ ⊗ BᵀB = T·A_red ⊗ G_red`` with ``A_red = (1/N) Σ â âᵀ``
      and ``G_red = (1/NT) Σ_n Σ_c ĝĝᵀ = BᵀB/T`` (``ĝ = Σ_t δ_t = Bᵀs``): the library's
      per-position units.

    The other approximation is not exact in each setting; layers without positions
    (``T = 1``) are exact under both (reduce = expand there).
    """
    c = SHARING[case]
    torch.manual_seed(4)
    model = c.model().to(DT)
    x, targets = torch.randn(*c.x_shape, dtype=DT), torch.randn(*c.y_shape, dtype=DT)
    ref = reference(model, x, targets, half_sse)
    assert {n for n, t in ref.positions.items() if t > 1} == set(c.shared)
    for approx in ("expand", "reduce"):
        model.zero_grad(set_to_none=True)
        err = errors_to(type2_kfac(model, x, ref, kfac_approx=approx), ref.ggn, ref.positions)
        for name, e in err.items():
            if approx == c.setting or name not in c.shared:
                assert e < RTOL, (approx, name, e)
            else:
                assert e > INEXACT, (approx, name, e)


# --------------------------------------------------------------------------- 4. step()


def record_layers(model: nn.Module, x: Tensor, targets: Tensor, loss: Loss
                  ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Every Linear's input rows ``ā`` (bias entry 1 appended) and ``δ = ∂l/∂z`` rows
    (one example) by plain autograd, in eval mode."""
    inputs: dict[str, Tensor] = {}
    outputs: dict[str, Tensor] = {}
    handles = []
    for name in kfac_layers(model):
        def hook(m: nn.Module, i: tuple[Tensor, ...], o: Tensor, name: str = name) -> None:
            inputs[name] = i[0].detach()
            outputs[name] = o
        handles.append(layer(model, name).register_forward_hook(hook))
    with evaluating(model):
        total = batch_loss(loss, model(x), targets)
        names = list(outputs)
        deltas = torch.autograd.grad(total, [outputs[n] for n in names])
    for h in handles:
        h.remove()
    a_rows = {}
    for name in names:
        rows = inputs[name].reshape(-1, inputs[name].shape[-1])
        if layer(model, name).bias is not None:
            rows = torch.cat([rows, torch.ones(rows.shape[0], 1, dtype=DT)], dim=1)
        a_rows[name] = rows
    d_rows = {n: (d * x.shape[0]).reshape(-1, d.shape[-1]) for n, d in zip(names, deltas)}
    return a_rows, d_rows


def grads_of(model: nn.Module, name: str) -> Tensor:
    m = layer(model, name)
    assert m.weight.grad is not None
    w = m.weight.grad.reshape(m.weight.shape[0], -1)
    if m.bias is None:
        return w
    assert m.bias.grad is not None
    return torch.cat([w, m.bias.grad[:, None]], dim=1)


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_step_one_example_empirical_fisher_closed_form(method: str) -> None:
    """One example (``tanh`` MLP, cross-entropy), training backward: ``A⊗G = EF = ggᵀ``
    with ``g = vec(δāᵀ)``, so ``pre.step()`` gives in closed form

    * eigen ``(ggᵀ + γI)⁻¹ g = g / (‖g‖² + γ)``;
    * inverse ``((āāᵀ+√γI) ⊗ (δδᵀ+√γI))⁻¹ vec(δāᵀ) = δāᵀ / ((‖δ‖²+√γ)(‖ā‖²+√γ))``.
    """
    torch.manual_seed(5)
    damping = 0.3
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3, bias=False),
                          nn.Tanh(), nn.Linear(3, 4)).to(DT)
    x, targets = torch.randn(1, 4, dtype=DT), torch.tensor([1])
    a_rows, d_rows = record_layers(model, x, targets, cross_entropy)
    raw: dict[str, Tensor] = {}

    def passes() -> None:
        empirical_pass(model, x, targets, cross_entropy)
        raw.update({n: grads_of(model, n).clone() for n in kfac_layers(model)})

    kfac_step(model, passes, compute_method=method, damping=damping)
    for name, g in raw.items():
        a, d = a_rows[name][0], d_rows[name][0]
        assert rel_err(g, torch.outer(d, a)) < RTOL  # g = δāᵀ: the reference rows are right
        if method == "eigen":
            expected = g / (g.square().sum() + damping)
        else:
            s = math.sqrt(damping)
            expected = torch.outer(d, a) / ((d @ d + s) * (a @ a + s))
        assert rel_err(grads_of(model, name), expected) < RTOL, name


@pytest.mark.parametrize("method", ["eigen", "inverse"])
@pytest.mark.parametrize("case", ["deep_linear", "linear_seq_expand"])
def test_step_exact_ggn_matches_dense_solve(case: str, method: str) -> None:
    """In an exact case (deep linear MSE batch; expand setting with ``T = 4``), ``.grad``
    the true mean-loss gradient ``g``, factors from the type-2 passes:

    * eigen: ``V = (A⊗G + γI)⁻¹ g = (GGN/T + γI)⁻¹ g`` with the autograd GGN;
    * inverse: ``V = ((A+√γI) ⊗ (G+√γI))⁻¹ g``, which depends on the split of the
      Kronecker product: ``A = (1/NT) Σ āāᵀ`` (recorded inputs) and ``G = BᵀHB`` with
      ``B = W_L⋯W_{l+1}`` (from the weights); ``T·A⊗G = GGN`` is checked first.
    """
    torch.manual_seed(6)
    damping = 0.05
    model: nn.Module
    if case == "deep_linear":
        model = deep_net(activation=False)
        x, targets = torch.randn(6, 4, dtype=DT), torch.randn(6, 2, dtype=DT)
    else:
        model = SHARING["linear_seq_expand"].model().to(DT)
        x, targets = torch.randn(3, 4, 3, dtype=DT), torch.randn(3, 4, 2, dtype=DT)
    ref = reference(model, x, targets, half_sse)
    a_rows, _ = record_layers(model, x, targets, half_sse)
    s = hessian_factor(ref.hessians)
    names = kfac_layers(model)
    raw: dict[str, Tensor] = {}

    def passes() -> None:
        type2_passes(model, x, s)  # the factors
        true_gradient(model, x, targets, half_sse)  # then .grad = ∇L
        raw.update({n: grads_of(model, n).clone() for n in names})

    kfac_step(model, passes, compute_method=method, damping=damping,
              accumulation_steps=s.shape[-1])
    for n in names:
        assert rel_err(vec(raw[n]), ref.grad[n]) < RTOL

    linears = [layer(model, n) for n in names]
    for i, name in enumerate(names):
        g, t = raw[name], ref.positions[name]
        n_a, n_g = g.shape[1], g.shape[0]
        if method == "eigen":
            k = ref.ggn[name] / t + damping * torch.eye(n_a * n_g, dtype=DT)
        else:
            b = torch.eye(linears[-1].weight.shape[0], dtype=DT)
            for later in linears[i + 1:][::-1]:
                b = b @ later.weight.detach()
            a_ref = a_rows[name].t() @ a_rows[name] / a_rows[name].shape[0]
            g_ref = b.t() @ b  # H = I per position (½ sum of squares)
            assert rel_err(t * torch.kron(a_ref, g_ref), ref.ggn[name]) < RTOL
            root = math.sqrt(damping)
            k = torch.kron(a_ref + root * torch.eye(n_a, dtype=DT),
                           g_ref + root * torch.eye(n_g, dtype=DT))
        expected = unvec(torch.linalg.solve(k, vec(g)), n_g, n_a)
        assert rel_err(grads_of(model, name), expected) < RTOL, name


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("strategy", ["comm-opt", "mem-opt"])
def test_step_exact_ggn_on_ranks(comm: Communicator, strategy: str) -> None:
    """The deep linear MSE case with the batch split over the ranks: each rank's type-2
    factors come from its own shard (``G = BᵀHB`` on every rank, ``A`` averaged over
    equal shards = the global ``A``), so ``pre.step()`` still gives the exact
    ``(GGN + γI)⁻¹ g`` of the global batch (``.grad`` set to the global gradient ``g``)."""
    torch.manual_seed(7)
    damping = 0.05
    model = deep_net(activation=False)
    total = 4 * comm.size
    x, targets = torch.randn(total, 4, dtype=DT), torch.randn(total, 2, dtype=DT)
    ref = reference(model, x, targets, mse_mean)
    mine = slice(comm.rank * 4, (comm.rank + 1) * 4)
    s = hessian_factor(ref.hessians)[mine]
    names = kfac_layers(model)
    raw: dict[str, Tensor] = {}

    def passes() -> None:
        type2_passes(model, x[mine], s)
        true_gradient(model, x, targets, mse_mean)  # the global batch's gradient
        raw.update({n: grads_of(model, n).clone() for n in names})

    kfac_step(model, passes, comm=comm, strategy=strategy, damping=damping,
              accumulation_steps=s.shape[-1])
    for name in names:
        g = raw[name]
        k = ref.ggn[name] + damping * torch.eye(g.numel(), dtype=DT)
        expected = unvec(torch.linalg.solve(k, vec(g)), g.shape[0], g.shape[1])
        assert rel_err(grads_of(model, name), expected) < RTOL, name
