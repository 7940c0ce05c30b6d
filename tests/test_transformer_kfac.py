"""Transformers: K-FAC for nn.Embedding against a dense reference, the ``gpt`` language
model on ``stdlib-text``, the never-fired hook warning, regex ``skip_layers``, and the
language model trained with K-FAC on 2 ranks (loss falls; one step is world-size
invariant in float64).

The Embedding reference is built without the code under test: one-hot vectors written
out per (example, position), δ from per-example autograd, preconditioning from explicit
``torch.kron`` and ``torch.linalg.solve``.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from mpi4py import MPI
from torch import Tensor, nn

from kfac_hpc import GradientAverager, KFACPreconditioner
from kfac_hpc.comm import Communicator
from kfac_hpc.kfac import linalg
from kfac_hpc.kfac.layers import EmbeddingCurvature, curvature_for, register_layers
from kfac_hpc.models import GPT, build_model
from kfac_hpc.train.loop import perplexity, token_view
from kfac_hpc.train.text import EVAL_EVERY, TokenWindows, corpus_files, load_stdlib_text

DT = torch.float64
RTOL = 1e-10


def rel_err(x: Tensor, ref: Tensor) -> float:
    return float((x - ref).norm() / ref.norm())


def per_example_loss(y: Tensor, target: Tensor) -> Tensor:
    """A non-quadratic per-example loss l_i (sums over positions and features)."""
    e = 0.5 * (y - target) ** 2 + 0.3 * torch.sin(2.0 * y) * target
    return e.reshape(y.shape[0], -1).sum(dim=1)


def embedding_case(seed: int = 0, b: int = 3, t: int = 5, vocab: int = 7, dim: int = 4
                   ) -> tuple[nn.Embedding, Tensor, Tensor]:
    torch.manual_seed(seed)
    emb = nn.Embedding(vocab, dim).to(DT)
    idx = torch.randint(0, vocab - 1, (b, t))  # token vocab-1 never appears: A has a zero
    target = torch.randn(b, t, dim, dtype=DT)
    return emb, idx, target


def captured(emb: nn.Embedding, idx: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """Batched forward/backward of L = mean_i l_i; the input and output gradient."""
    store: dict[str, Tensor] = {}
    emb.zero_grad(set_to_none=True)
    y = emb(idx)
    y.register_hook(lambda g: store.__setitem__("g", g.detach()))
    per_example_loss(y, target).mean().backward()
    return idx, store["g"]


def embedding_reference(emb: nn.Embedding, idx: Tensor, target: Tensor
                        ) -> tuple[Tensor, Tensor, Tensor]:
    """A, G and ∇W̄ = (1/b) Σ δ eᵀ from explicit per-(example, position) loops."""
    vocab, dim = emb.num_embeddings, emb.embedding_dim
    b, t = idx.shape
    a_acc = torch.zeros(vocab, vocab, dtype=DT)
    g_acc = torch.zeros(dim, dim, dtype=DT)
    grad = torch.zeros(dim, vocab, dtype=DT)
    for i in range(b):
        yi = emb(idx[i:i + 1])
        (delta,) = torch.autograd.grad(per_example_loss(yi, target[i:i + 1]).sum(), yi)
        for p in range(t):
            e = torch.zeros(vocab, dtype=DT)
            e[int(idx[i, p])] = 1.0
            d = delta[0, p]
            a_acc += torch.outer(e, e)
            g_acc += torch.outer(d, d)
            grad += torch.outer(d, e) / b
    return a_acc / (b * t), g_acc / (b * t), grad


def test_embedding_factors_match_dense_reference() -> None:
    emb, idx, target = embedding_case()
    a_ref, g_ref, grad_ref = embedding_reference(emb, idx, target)
    x, gout = captured(emb, idx, target)
    curv = curvature_for(emb)
    assert isinstance(curv, EmbeddingCurvature)
    assert (curv.g_dim, curv.a_dim) == (4, 7)
    a = curv.a_factor(x, dtype=DT)
    g = curv.g_factor(gout, dtype=DT)
    assert torch.equal(a, torch.diag(torch.diagonal(a)))  # diagonal: token frequencies
    assert float(a[6, 6]) == 0.0
    assert rel_err(a, a_ref) < RTOL and rel_err(g, g_ref) < RTOL
    # the gradient layout is the weight gradient transposed, and equals (1/b) Σ δ eᵀ
    assert rel_err(curv.grad_matrix(), grad_ref) < RTOL
    rows_grad = curv.g_rows(gout).T @ curv.a_rows(x) / idx.shape[0]
    assert rel_err(rows_grad, grad_ref) < RTOL
    # preconditioning: (A⊗G + γI)⁻¹ vec(∇W̄) by an explicit Kronecker solve
    damping = 0.1
    qa, la = linalg.eigh_clamped(a, dtype=DT)
    qg, lg = linalg.eigh_clamped(g, dtype=DT)
    v = linalg.precondition_eigen(grad_ref, qa, la, qg, lg, damping)
    kron = torch.kron(a_ref, g_ref) + damping * torch.eye(7 * 4, dtype=DT)
    v_ref = torch.linalg.solve(kron, grad_ref.T.reshape(-1)).reshape(7, 4).T  # column-major vec
    assert rel_err(v, v_ref) < RTOL


def test_embedding_reduce_and_set_grad() -> None:
    emb, idx, target = embedding_case(seed=1)
    x, gout = captured(emb, idx, target)
    b, t = idx.shape
    curv = EmbeddingCurvature(emb, "reduce")
    hist = torch.stack([torch.bincount(idx[i], minlength=7).to(DT) / t for i in range(b)])
    a_ref = sum(torch.outer(h, h) for h in hist) / b
    sums = gout.sum(dim=1) * b  # Σ_t δ, δ = b·∂L/∂y
    g_ref = sum(torch.outer(s, s) for s in sums) / (b * t)
    assert rel_err(curv.a_factor(x, dtype=DT), a_ref) < RTOL
    assert rel_err(curv.g_factor(gout, dtype=DT), g_ref) < RTOL
    m = torch.randn(4, 7, dtype=DT)
    curv.set_grad(m)
    assert emb.weight.grad is not None and torch.equal(emb.weight.grad, m.T)
    assert torch.equal(curv.grad_matrix(), m)
    with pytest.raises(ValueError, match="shape"):
        curv.set_grad(m.T)


def test_embedding_support_rules() -> None:
    assert curvature_for(nn.Embedding(5, 3, sparse=True)) is None
    assert curvature_for(nn.EmbeddingBag(5, 3)) is None
    layers, skipped = register_layers(nn.Sequential(nn.Embedding(5, 3, sparse=True),
                                                    nn.Linear(3, 2)))
    assert list(layers) == ["1"] and "sparse" in skipped[0]


# ----------------------------------------------------------------- the model and data
def tiny_gpt(dtype: torch.dtype = torch.float32, seed: int = 0, context: int = 16) -> GPT:
    torch.manual_seed(seed)
    model = build_model("gpt", num_classes=256, input_dim=context, dim=16, depth=1, heads=2,
                        mlp_ratio=2)
    assert isinstance(model, GPT)
    return model.to(dtype)


def test_gpt_layers_seen_by_kfac() -> None:
    model = tiny_gpt()
    layers, _ = register_layers(model)
    assert list(layers) == ["tok", "pos", "blocks.0.attn.q", "blocks.0.attn.k",
                            "blocks.0.attn.v", "blocks.0.attn.out", "blocks.0.fc",
                            "blocks.0.proj", "head"]
    assert not any(isinstance(c.module, nn.LayerNorm) for c in layers.values())
    out = model(torch.randint(0, 256, (3, 16)))
    assert out.shape == (3, 16, 256)
    with pytest.raises(ValueError, match="context"):
        model(torch.randint(0, 256, (1, 17)))


def test_stdlib_text_is_deterministic_and_split_by_file() -> None:
    files = corpus_files()
    assert files == sorted(files) and all(f.suffix == ".py" for f in files)
    a = load_stdlib_text(context=32, train_bytes=20_000, eval_bytes=5_000)
    b = load_stdlib_text(context=32, train_bytes=20_000, eval_bytes=5_000)
    assert isinstance(a.train, TokenWindows) and isinstance(a.test, TokenWindows)
    assert isinstance(b.train, TokenWindows) and isinstance(b.test, TokenWindows)
    assert (a.train.digest, a.test.digest) == (b.train.digest, b.test.digest)
    assert a.train.digest != a.test.digest
    assert (a.num_classes, a.input_shape, a.model_kwargs()["input_dim"]) == (256, (32,), 32)
    assert len(a.train) == (20_000 - 1) // 32
    # train text starts with the first file, eval text with file EVAL_EVERY-1
    assert bytes(a.train.tokens[:200].tolist()) == files[0].read_bytes()[:200]
    assert bytes(a.test.tokens[:200].tolist()) == files[EVAL_EVERY - 1].read_bytes()[:200]
    x, y = a.train.get_batch(torch.tensor([0, 5]))
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (2, 32)
    assert torch.equal(x[:, 1:], y[:, :-1])  # next-token targets
    assert torch.equal(x[1], a.train.tokens[160:192].long())


def test_token_view_and_perplexity() -> None:
    out, y = torch.randn(2, 3, 5), torch.randint(0, 5, (2, 3))
    fo, fy = token_view(out, y)
    assert fo.shape == (6, 5) and fy.shape == (6,)
    cls, t = torch.randn(4, 3), torch.randint(0, 3, (4,))
    assert token_view(cls, t)[0] is cls
    assert perplexity(math.log(7.0)) == pytest.approx(7.0)
    assert perplexity(1e6) == math.inf


# ----------------------------------------------------------- warnings and skip_layers
class MHANet(nn.Module):
    """nn.MultiheadAttention uses out_proj.weight directly: its hooks never fire."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        return self.head(self.attn(h, h, h, need_weights=False)[0]).mean(dim=1)


def run_steps(model: nn.Module, pre: KFACPreconditioner, steps: int, make) -> None:
    for step in range(steps):
        x, y = make(step)
        model.zero_grad()
        nn.functional.cross_entropy(*token_view(model(x), y)).backward()
        pre.step()


def test_never_fired_warning_once(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model = MHANet()
    pre = KFACPreconditioner(model, comm=Communicator(MPI.COMM_SELF), check_replicas=False)
    assert "attn.out_proj" in pre.layers
    make = lambda s: (torch.randn(4, 5, 4), torch.randint(0, 3, (4,)))
    with caplog.at_level(logging.WARNING, logger="kfac_hpc"):
        run_steps(model, pre, 3, make)
    warned = [r for r in caplog.records if "got no statistics" in r.getMessage()]
    assert len(warned) == 1
    assert "attn.out_proj" in warned[0].getMessage()
    assert "inp" not in warned[0].getMessage().replace("attn", "")
    assert "attn.out_proj/A" not in pre.decompositions  # not preconditioned
    assert "head/A" in pre.decompositions
    # skipping it by name silences the warning
    caplog.clear()
    pre2 = KFACPreconditioner(model, comm=Communicator(MPI.COMM_SELF), check_replicas=False,
                              skip_layers=["attn.out_proj"])
    with caplog.at_level(logging.WARNING, logger="kfac_hpc"):
        run_steps(model, pre2, 2, make)
    assert not [r for r in caplog.records if "got no statistics" in r.getMessage()]
    pre.close()
    pre2.close()


def test_skip_layers_regex() -> None:
    model = tiny_gpt()
    layers, skipped = register_layers(model, skip=[r"blocks\.\d+\.attn\.[qkv]", "Embedding",
                                                   "head"])
    assert list(layers) == ["blocks.0.attn.out", "blocks.0.fc", "blocks.0.proj"]
    assert any(s.startswith("tok ") for s in skipped)
    # full match only: "attn" alone matches the container, whose children are still seen
    layers, _ = register_layers(model, skip=["attn", "blocks"])
    assert "blocks.0.attn.q" in layers
    layers, _ = register_layers(model, skip=["blocks.0.attn"])  # a container name: kept
    assert "blocks.0.attn.q" in layers
    layers, _ = register_layers(model, skip=[".*fc", "Lin.*"])
    assert list(layers) == ["tok", "pos"]
    layers, _ = register_layers(model, skip=["[unclosed"])  # not a regex: exact names only
    assert len(layers) == 9
    pre = KFACPreconditioner(model, comm=Communicator(MPI.COMM_SELF), check_replicas=False,
                             skip_layers=r"blocks\..*")
    assert list(pre.layers) == ["tok", "pos", "head"]
    pre.close()


# ------------------------------------------------------------ training on 2 ranks
CONTEXT = 16
GLOBAL_BATCH = 8


def text_batches(context: int = CONTEXT):
    data = load_stdlib_text(context=context, train_bytes=40_000, eval_bytes=4_000)
    train = data.train
    assert isinstance(train, TokenWindows)
    n = len(train)

    def make(step: int) -> tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(step)
        return train.get_batch(torch.randint(0, n, (GLOBAL_BATCH,), generator=g))

    return make


def lm_train(model: nn.Module, comm: Communicator, steps: int, make, *, lr: float = 3e-3,
             **kwargs) -> tuple[KFACPreconditioner, list[float]]:
    rank, size = comm.rank, comm.size
    pre = KFACPreconditioner(model, comm=comm, damping=0.01, lr=lr, kl_clip=0.01, **kwargs)
    avg = GradientAverager(model, comm) if size > 1 else None
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    per = GLOBAL_BATCH // size
    losses = []
    for step in range(steps):
        x, y = make(step)
        x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        opt.zero_grad()
        loss = nn.functional.cross_entropy(*token_view(model(x), y))
        loss.backward()
        total = torch.tensor([float(loss.detach())], dtype=torch.float64)
        losses.append(float(comm.allreduce(total, "sum")[0]) / size)
        if avg is not None:
            avg.synchronize()
        pre.step()
        opt.step()
    return pre, losses


@pytest.mark.mpi(min_size=2)
def test_gpt_trains_with_kfac(comm: Communicator) -> None:
    make = text_batches()
    model = tiny_gpt(torch.float32)
    pre, losses = lm_train(model, comm, 40, make, inv_update_steps=5)
    # every layer, Embedding and Linear over sequences, was preconditioned (comm-opt:
    # every rank holds every decomposition)
    for name in ("tok", "pos", "blocks.0.attn.q", "blocks.0.attn.out", "blocks.0.fc", "head"):
        assert f"{name}/A" in pre.decompositions and f"{name}/G" in pre.decompositions
    start, end = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert start > 5.0  # ~ln 256 = 5.55 at initialisation
    assert end < start - 1.0, (start, end)
    pre.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("strategy", ["comm-opt", "mem-opt"])
def test_gpt_kfac_world_size_invariance_float64(comm: Communicator, strategy: str) -> None:
    """Three K-FAC steps of the language model on P ranks equal one rank with the whole
    batch (float64: only summation order differs)."""
    if GLOBAL_BATCH % comm.size:
        pytest.skip("the global batch must split evenly")
    make = text_batches()
    distributed = tiny_gpt(DT)
    pre, losses = lm_train(distributed, comm, 3, make, strategy=strategy, inv_dtype=DT)
    single = tiny_gpt(DT)
    pre1, losses1 = lm_train(single, Communicator(MPI.COMM_SELF), 3, make, inv_dtype=DT)
    assert losses == pytest.approx(losses1, rel=1e-10)
    for (name, p), q in zip(distributed.named_parameters(), single.parameters()):
        # atol: attn.k.bias has an exactly-zero gradient (softmax ignores a per-query
        # shift), so AdamW turns its 1e-17 rounding noise into ~1e-12 moves; every other
        # parameter moved ~1e-2 and agrees to ~1e-15
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-10, msg=f"{name} differs")
    # and K-FAC really changed the update: plain AdamW ends elsewhere
    plain = tiny_gpt(DT)
    opt = torch.optim.AdamW(plain.parameters(), lr=3e-3, weight_decay=0.0)
    for step in range(3):
        x, y = make(step)
        opt.zero_grad()
        nn.functional.cross_entropy(*token_view(plain(x), y)).backward()
        opt.step()
    assert not torch.allclose(plain.tok.weight, single.tok.weight, rtol=1e-6, atol=1e-9)
    pre.close()
    pre1.close()


# ------------------------------------------------------------------------ devices
def lm_device_run(comm: Communicator, strategy: str, options: dict, stand_in=None) -> nn.Module:
    """Four K-FAC steps of the language model, every rank the same batch."""
    make = text_batches()
    model = tiny_gpt(DT)
    batches = [make(s) for s in range(4)]
    if stand_in is not None:
        stand_in()
    pre = KFACPreconditioner(model, comm=comm, strategy=strategy, damping=0.01,
                             inv_update_steps=2, inv_dtype=DT, **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches:
        opt.zero_grad()
        nn.functional.cross_entropy(*token_view(model(x), y)).backward()
        pre.step()
        opt.step()
    tensors = [*(s.average for s in pre.factors.values() if s.average is not None),
               *(t for parts in pre.decompositions.values() for t in parts.values())]
    assert {t.device.type for t in tensors} <= {"cpu"}
    pre.close()
    return model


DEVICE_CASES = [("comm-opt", {}), ("mem-opt", {"symmetric_packing": True}),
                ("dp-kfac", {"input_shape": (GLOBAL_BATCH, CONTEXT)})]


def check_lm_devices(comm: Communicator, strategy: str, options: dict, stand_in) -> None:
    reference = lm_device_run(comm, strategy, options)
    model = lm_device_run(comm, strategy, options, stand_in)
    torch.set_default_device(None)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), f"{name} differs from the run without the stand-in"


@pytest.mark.parametrize("strategy, options", DEVICE_CASES)
def test_lm_stand_in_one_rank(strategy, options, meta_default_device) -> None:
    """Embedding K-FAC names the layer's device for every tensor it creates (the
    ``meta`` default-device stand-in of docs/design.md)."""
    check_lm_devices(Communicator(MPI.COMM_SELF), strategy, options, meta_default_device)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("strategy, options", DEVICE_CASES)
def test_lm_stand_in_ranks(comm, strategy, options, meta_default_device) -> None:
    check_lm_devices(comm, strategy, options, meta_default_device)


# ------------------------------------------------------------------------- the driver
def test_driver_trains_gpt_on_stdlib_text(tmp_path) -> None:
    """``kfac-hpc train --model gpt --dataset stdlib-text --preconditioner kfac``: the
    next-token loss falls and the records carry perplexity = exp(test loss)."""
    from kfac_hpc.train.config import TrainConfig
    from kfac_hpc.train.loop import train

    cfg = TrainConfig(model="gpt", dataset="stdlib-text", optimizer="adamw", lr=3e-3,
                      preconditioner="kfac", batch_size=8, epochs=1, max_steps=25,
                      lr_schedule="constant", warmup_epochs=0.0,
                      eval_batch_size=256, progress=False, threads=1,
                      model_options={"dim": 16, "depth": 1, "heads": 2, "mlp_ratio": 2},
                      out=str(tmp_path / "run"))
    result = train(cfg, Communicator(MPI.COMM_SELF, name="self"), verbose=False)
    assert result.steps == 25
    record = result.history[-1]
    assert record["test_ppl"] == pytest.approx(math.exp(record["test_loss"]))
    assert record["test_loss"] < math.log(256) - 1.0  # well below a uniform byte guess
    rows = dict(result.summary_rows(cfg))
    assert "test perplexity" in rows
