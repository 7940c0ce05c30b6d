"""Low-rank factors through the preconditioner (one process): math, state, options, driver.

``KFACPreconditioner(low_rank=K, ...)`` decomposes factors with ``d >= low_rank_min_dim``
and ``d > K`` by :func:`~kfac_hpc.kfac.lowrank.randomized_eigh` and preconditions their
layers with :func:`~kfac_hpc.kfac.lowrank.precondition_lowrank`. Checked here against
dense references in float64; world-size invariance and checkpoints on several ranks are
in ``tests/test_kfac_lowrank_dist.py``.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import h5py
import pytest
import torch
from fresh_env import fresh_env
from mpi4py import MPI
from torch import Tensor, nn

from kfac_hpc import KFACPreconditioner
from kfac_hpc.comm import Communicator
from kfac_hpc.kfac.lowrank import LowRankFactor, randomized_eigh, sketch_generator
from kfac_hpc.kfac.options import conflicts
from kfac_hpc.plan.options import KFACOptions
from kfac_hpc.train.config import ConfigError, TrainConfig

DAMPING = 0.01
IN, HIDDEN, OUT = 63, 24, 5  # factors: A 64, G 24 (layer 0); A 25, G 5 (layer 2)


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT)).double()


def batch(step: int, size: int = 16) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(10 + step)
    return (torch.randn(size, IN, generator=g, dtype=torch.float64),
            torch.randint(0, OUT, (size,), generator=g))


def self_comm() -> Communicator:
    return Communicator(MPI.COMM_SELF)


def build(model: nn.Module, **kwargs: Any) -> KFACPreconditioner:
    kwargs = {"damping": DAMPING, "kl_clip": None, "inv_dtype": torch.float64, **kwargs}
    return KFACPreconditioner(model, comm=self_comm(), **kwargs)


def grad_matrices(model: nn.Module) -> list[Tensor]:
    """``[∇W, ∇b]`` of every Linear (the preconditioner's ``g x (a)`` layout)."""
    return [torch.cat([m.weight.grad, m.bias.grad[:, None]], 1).clone()
            for m in model if isinstance(m, nn.Linear)]


def run(steps: int, size: int = 16, **kwargs: Any
        ) -> tuple[list[list[Tensor]], KFACPreconditioner]:
    """Preconditioned gradients of ``steps`` steps on fixed weights (no optimizer)."""
    model = net()
    pre = build(model, **kwargs)
    out = []
    for step in range(steps):
        x, y = batch(step, size)
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        pre.step()
        out.append(grad_matrices(model))
    return out, pre


def dense_solve(a: Tensor, g: Tensor, grad: Tensor, damping: float) -> Tensor:
    """``(A ⊗ G + γI)⁻¹ vec(∇W̄)`` by a dense solve (column-major vec)."""
    big = torch.kron(a, g) + damping * torch.eye(a.shape[0] * g.shape[0], dtype=a.dtype)
    v = torch.linalg.solve(big, grad.t().reshape(-1))
    return v.reshape(grad.shape[1], grad.shape[0]).t()


def as_factor(parts: dict[str, Tensor]) -> LowRankFactor:
    rho = parts.get("rho")
    return LowRankFactor(parts["Q"], parts["lambda"],
                         rho.reshape(()) if rho is not None else torch.zeros((), dtype=DT),
                         rho is None)


DT = torch.float64


# ------------------------------------------------------------------ the math
def test_full_rank_fallback_equals_the_dense_eigen_path() -> None:
    """k = d - 1 (exact eigh fallback) with remainder "mean": ρ is the one discarded
    eigenvalue, so Ã = A and the low-rank path must give the dense result (batch 96:
    A is full rank, so ρ matters)."""
    dense, _ = run(3, 96, inv_update_steps=2)
    low, pre = run(3, 96, inv_update_steps=2, low_rank=IN, low_rank_min_dim=IN + 1)
    assert pre.decompositions["0/A"]["Q"].shape == (IN + 1, IN)  # the low-rank path ran
    assert float(pre.decompositions["0/A"]["rho"]) > 1e-3
    assert "rho" not in pre.decompositions["0/G"]
    for step_dense, step_low in zip(dense, low):
        for d, lo in zip(step_dense, step_low):
            torch.testing.assert_close(lo, d, rtol=1e-10, atol=1e-12)


def test_small_rank_equals_the_dense_solve_of_the_approximated_factors() -> None:
    """Rank 4 on A 64 (sketched), G 24, A 25 (exact eigh, truncated); G 5 stays full.
    The preconditioned gradient is (Ã⊗G̃+γI)⁻¹ for the factors rebuilt from randomized_eigh with the
    sketch seeded by (factor, step), and it differs from exact K-FAC."""
    model = net()
    pre = build(model, low_rank=4, low_rank_min_dim=20)
    x, y = batch(0)
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    before = grad_matrices(model)
    pre.step()
    after = grad_matrices(model)
    dec = pre.decompositions
    assert {k for k, parts in dec.items() if "rho" in parts} == {"0/A", "0/G", "2/A"}
    for i, layer in enumerate(("0", "2")):
        approx = {}
        for f in ("A", "G"):
            name = f"{layer}/{f}"
            average = pre.factors[name].average
            assert average is not None
            if "rho" in dec[name]:  # the owner's sketch is reproducible from its name and step
                ref = randomized_eigh(average, rank=4,
                                      generator=sketch_generator(name, 0, torch.device("cpu")))
                assert ref.exact == (name != "0/A")  # 64 is sketched; 24, 25: exact eigh
                assert torch.equal(dec[name]["Q"], ref.q)
                assert torch.equal(dec[name]["lambda"], ref.lam)
                assert float(dec[name]["rho"]) == float(ref.rho) > 0
                approx[f] = ref.dense()
            else:
                approx[f] = as_factor(dec[name]).dense()
                torch.testing.assert_close(approx[f], average, rtol=1e-10, atol=1e-13)
        want = dense_solve(approx["A"], approx["G"], before[i], DAMPING)
        torch.testing.assert_close(after[i], want, rtol=1e-9, atol=1e-12)
        exact = dense_solve(pre.factors[f"{layer}/A"].average, pre.factors[f"{layer}/G"].average,
                            before[i], DAMPING)
        assert float((after[i] - exact).norm() / exact.norm()) > 1e-3  # it is an approximation


def test_energy_rule_keeps_fewer_pairs_within_the_cap() -> None:
    _, pre = run(1, low_rank=20, low_rank_energy=0.6, low_rank_min_dim=20)
    a = pre.decompositions["0/A"]
    average = pre.factors["0/A"].average
    assert average is not None
    ref = randomized_eigh(average, rank=20, energy=0.6,
                          generator=sketch_generator("0/A", 0, torch.device("cpu")))
    assert 1 <= ref.rank < 20 and a["Q"].shape == (IN + 1, ref.rank)
    assert torch.equal(a["lambda"], ref.lam)
    assert float(a["lambda"].sum()) >= 0.6 * float(average.trace()) * (1 - 1e-6)
    assert pre.state_dict()["eigenbases"]["0/A"]["rank"].tolist() == [ref.rank]


def test_sketch_seed_is_a_stable_hash_of_factor_and_step() -> None:
    """The seed is BLAKE2b of ``"<factor>@<step>"``: the same number in every process and
    on every rank (Python's salted ``hash()`` would change between processes)."""
    cpu = torch.device("cpu")
    assert sketch_generator("fc/A", 7, cpu).initial_seed() == 5908595911283465920
    draws = {(name, step): torch.randn(3, generator=sketch_generator(name, step, cpu))
             for name in ("fc/A", "fc/G") for step in (7, 8)}
    assert len({tuple(v.tolist()) for v in draws.values()}) == 4
    assert torch.equal(draws["fc/A", 7], torch.randn(3, generator=sketch_generator("fc/A", 7, cpu)))


def test_memory_config_and_describe() -> None:
    _, dense = run(1)
    _, low = run(1, low_rank=4, low_rank_min_dim=20)
    # Q (d x k), λ (k), ρ for the low-rank factors; Q, λ for G 5; float64
    want = sum(8 * (d * 4 + 4 + 1) for d in (64, 24, 25)) + 8 * (5 * 5 + 5)
    assert low.memory_bytes()["decompositions"] == want
    assert want < dense.memory_bytes()["decompositions"] / 4
    cfg = low.config()
    assert (cfg["low_rank"], cfg["low_rank_energy"], cfg["low_rank_min_dim"],
            cfg["low_rank_remainder"]) == (4, None, 20, "mean")
    assert "low_rank=4 for factors >= 20" in low.describe() and "64~" in low.describe()


def test_rank_beyond_bfloat16_integers_is_kept() -> None:
    """Without the energy rule the rank is the cap (not read from the message, where a
    16-bit inv_dtype would round 257 to 256)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(299, 3))
    pre = KFACPreconditioner(model, comm=self_comm(), low_rank=257, low_rank_min_dim=100,
                             inv_dtype=torch.bfloat16)
    nn.functional.cross_entropy(model(torch.randn(8, 299)), torch.arange(8) % 3).backward()
    pre.step()
    assert pre.decompositions["0/A"]["Q"].shape == (300, 257)


# ------------------------------------------------------------------ state
def train_steps(model: nn.Module, pre: KFACPreconditioner, opt: torch.optim.Optimizer,
                steps: range) -> None:
    for step in steps:
        x, y = batch(step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        pre.step()
        opt.step()


LOW = {"low_rank": 4, "low_rank_min_dim": 20, "inv_update_steps": 4}


@pytest.mark.parametrize("via", ["state_dict", "hdf5"])
def test_resume_between_inverse_updates_is_bitwise(tmp_path: Path, via: str) -> None:
    """Saved after step 2 (decomposed at step 0), resumed: the stored low-rank
    decompositions are used until step 4, as in the run that saved."""
    from kfac_hpc import checkpoint

    def fresh() -> tuple[nn.Module, KFACPreconditioner, torch.optim.Optimizer]:
        model = net()
        return model, build(model, **LOW), torch.optim.SGD(model.parameters(), lr=0.1)

    ref, ref_pre, ref_opt = fresh()
    train_steps(ref, ref_pre, ref_opt, range(2))
    if via == "hdf5":
        checkpoint.save(tmp_path, model=ref, optimizer=ref_opt, preconditioner=ref_pre, step=2,
                        comm=ref_pre.comm)
    else:
        saved = copy.deepcopy(ref_pre.state_dict())
        model_state = {k: v.clone() for k, v in ref.state_dict().items()}
        opt_state = ref_opt.state_dict()
    train_steps(ref, ref_pre, ref_opt, range(2, 6))

    model, pre, opt = fresh()
    train_steps(model, pre, opt, range(1))  # some state of its own first
    if via == "hdf5":
        checkpoint.load(tmp_path, model=model, optimizer=opt, preconditioner=pre,
                        comm=pre.comm)
        with h5py.File(checkpoint.latest(tmp_path), "r") as f:
            assert f["kfac/0/A_Q"].shape == (64, 4) and f["kfac/0/A_rho"].shape == (1,)
    else:
        model.load_state_dict(model_state)
        opt.load_state_dict(opt_state)
        pre.load_state_dict(saved)
    train_steps(model, pre, opt, range(2, 6))
    for p, q in zip(ref.parameters(), model.parameters()):
        assert torch.equal(p, q)


def test_stored_decompositions_that_do_not_fit_are_recomputed() -> None:
    """A state saved with low rank loads into a dense preconditioner and the other way
    round: the decompositions are recomputed, not mis-shaped."""
    _, low = run(1, **LOW)
    _, dense = run(1, inv_update_steps=4)
    for source, kwargs in ((low, {"inv_update_steps": 4}), (dense, LOW),
                           (low, {**LOW, "low_rank": 3}), (low, {**LOW, "low_rank": 8})):
        model = net()
        pre = build(model, **kwargs)
        pre.load_state_dict(source.state_dict())
        train_steps(model, pre, torch.optim.SGD(model.parameters(), lr=0.1), range(1, 2))
        q = pre.decompositions["0/A"]["Q"]
        k = kwargs.get("low_rank", 64)
        assert q.shape == (64, k)
        # orthonormal columns: a rank-4 decomposition is not padded with zeros to 8
        torch.testing.assert_close(q.T @ q, torch.eye(k, dtype=q.dtype), atol=1e-5, rtol=0)


def test_every_low_rank_tensor_names_its_device(meta_default_device: Any) -> None:
    """The CPU stand-in for a GPU (tests/test_kfac_device.py), resumed between inverse
    updates: sketches, padded messages, restored pieces and the low-rank
    preconditioning create nothing on the default device (A 36 is sketched, A 19 and
    A 17 truncated exactly)."""
    from test_kfac_device import check

    check(self_comm(), "comm-opt", {"low_rank": 3, "low_rank_min_dim": 16},
          meta_default_device, resume_at=3)


# ------------------------------------------------------------------ options
BAD = [
    ({"low_rank": 0}, "low_rank must be a whole number >= 1"),
    ({"low_rank": 2.5}, "low_rank must be a whole number >= 1"),
    ({"low_rank": 8, "low_rank_energy": 0.0}, r"low_rank_energy must be in \(0, 1\]"),
    ({"low_rank": 8, "low_rank_energy": 1.5}, r"low_rank_energy must be in \(0, 1\]"),
    ({"low_rank_energy": 0.9}, "low_rank_energy needs low_rank='K'"),
    ({"low_rank": 8, "low_rank_min_dim": 0}, "low_rank_min_dim must be a whole number >= 1"),
    ({"low_rank": 8, "low_rank_remainder": "tail"}, "low_rank_remainder must be one of"),
    ({"low_rank_remainder": "zero"}, "low_rank_remainder needs low_rank='K'"),
    ({"low_rank": 8, "compute_method": "inverse"},
     "low_rank needs compute_method='eigen': compute_method='inverse' has no low-rank form"),
    ({"low_rank": 300, "low_rank_energy": 0.9, "inv_dtype": torch.bfloat16},
     "exact only up to 256"),
]


@pytest.mark.parametrize("kwargs, match", BAD)
def test_bad_low_rank_options_are_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        KFACPreconditioner(net(), comm=self_comm(), **kwargs)


DRIVER_BAD = [
    ({"low_rank": 0}, "--low-rank: must be a whole number >= 1"),
    ({"low_rank_energy": 0.9}, "--low-rank-energy: needs --low-rank K"),
    ({"low_rank": 8, "kfac_compute_method": "inverse"},
     "--low-rank: needs --kfac-compute-method eigen"),
]


@pytest.mark.parametrize("changes, message", DRIVER_BAD)
def test_three_readers_agree_on_low_rank(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        TrainConfig(**changes).validate(cuda_available=False)
    assert message in str(err.value)
    kw = {{"kfac_compute_method": "compute_method"}.get(k, k): v for k, v in changes.items()}
    assert KFACOptions(**kw).problem() is not None
    assert conflicts(strategy="comm-opt", **kw)
    TrainConfig(low_rank=8, low_rank_energy=0.9, low_rank_min_dim=32).validate(
        cuda_available=False)
    assert KFACOptions(low_rank=8, low_rank_energy=0.9).problem() is None


def test_driver_flags_end_to_end(tmp_path: Path) -> None:
    """``kfac-hpc train --low-rank ...``: the run finishes and its checkpoint holds the
    low-rank decompositions (Q with 8 columns for the 65-row A of the first layer)."""
    cmd = [sys.executable, "-m", "kfac_hpc", "train", "--max-steps", "6", "--epochs", "1",
           "--low-rank", "8", "--low-rank-min-dim", "64", "--low-rank-remainder", "zero",
           "--inv-update-steps", "4", "--threads", "1", "--no-progress",
           "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every-steps", "5",
           "--out", str(tmp_path / "run")]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=fresh_env())
    assert done.returncode == 0, done.stderr
    from kfac_hpc import checkpoint

    with h5py.File(checkpoint.latest(tmp_path / "ck"), "r") as f:
        shapes = {name: f["kfac"][name].shape for name in f["kfac"]
                  if isinstance(f["kfac"][name], h5py.Group)
                  for name in [f"{name}/{d}" for d in f["kfac"][name]]}
        config = f.attrs["config"]
    low = {k: v for k, v in shapes.items() if k.endswith("A_Q") and v[1] == 8}
    assert low and all(v[0] >= 64 for v in low.values()), shapes
    assert any(k.endswith("A_rho") for k in shapes)
    assert '"low_rank": 8' in str(config) and '"low_rank_remainder": "zero"' in str(config)
