"""K-FAC faults end in one agreed outcome on every rank, and resume is exact.

* Non-finite statistics on one rank: every rank raises ``KFACNumericalError`` (nothing
  updated, ``.grad`` untouched, the next steps run: no rank is left waiting); with a
  GradScaler every rank skips the factor update instead.
* A failed decomposition on one rank: every rank raises, the old decompositions stay.
* ``close()`` frees the sub-communicators.
* Save through ``checkpoint.save`` with its defaults between two inverse updates, load
  into fresh objects: the continued run is bitwise the run that saved, and every
  restored factor, decomposition and optimizer state tensor is laid out like the live
  one (shape, strides, 64-byte alignment): a BLAS that picks its kernel by layout (MKL
  on AMD CPUs) then computes the same bits, on any CPU.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from mpi4py import MPI
from torch import nn

from kfac_hpc import GradientAverager, KFACPreconditioner, checkpoint
from kfac_hpc.comm import Communicator
from kfac_hpc.kfac import linalg
from kfac_hpc.kfac.errors import KFACNumericalError

CASES = [
    ("comm-opt", {}),
    ("mem-opt", {}),
    ("comm-opt", {"compute_method": "inverse"}),
    ("mem-opt", {"factor_sync": "inverse"}),
    ("comm-opt", {"overlap": True}),
    ("dp-kfac", {}),
]
IDS = [f"{s}-" + "-".join(f"{k}={v}" for k, v in o.items()) for s, o in CASES]


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 20), nn.Tanh(), nn.Linear(20, 18), nn.Tanh(),
                         nn.Linear(18, 3)).double()


def batch(step: int, rank: int, per_rank: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return (torch.randn(per_rank, 6, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (per_rank,), generator=g))


def kfac(model: nn.Module, comm: Communicator, strategy: str, **options) -> KFACPreconditioner:
    return KFACPreconditioner(model, comm=comm, strategy=strategy, damping=0.01,
                              inv_update_steps=2, inv_dtype=torch.float64, **options)


def backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()


def factor_snapshot(pre: KFACPreconditioner) -> dict[str, torch.Tensor]:
    """Running averages, and the local ones of factor_sync='inverse'."""
    return {**{k: s.average.clone() for k, s in pre.factors.items() if s.average is not None},
            **{f"local {k}": s.delta.clone() for k, s in pre.local_averages.items()
               if s.delta is not None}}


def poison_one_rank(comm: Communicator, strategy: str, options: dict, scaler=None) -> None:
    model = mlp()
    pre = kfac(model, comm, strategy, grad_scaler=scaler, **options)
    bad_rank = pre.factor_owner("0/A")  # DP-KFAC: the rank whose batch makes that factor
    for step in range(3):
        backward(model, *batch(step, comm.rank))
        pre.step()
    before = factor_snapshot(pre)
    x, y = batch(3, comm.rank)  # between inverse updates (an inverse step also synchronises)
    if comm.rank == bad_rank:
        x[0, 0] = float("inf")
    backward(model, x, y)
    if scaler is None:
        grads = [p.grad.clone() for p in model.parameters()]
        with pytest.raises(KFACNumericalError, match="non-finite") as info:
            pre.step()
        assert info.value.ranks == 1
        assert bool(info.value.local) == (comm.rank == bad_rank)
        for p, g in zip(model.parameters(), grads):  # nor were the gradients preconditioned
            torch.testing.assert_close(p.grad, g, rtol=0, atol=0, equal_nan=True)
    else:
        pre.step()  # skipped on every rank, no error
    after = factor_snapshot(pre)
    assert after.keys() == before.keys()
    for key in before:  # nothing of the poisoned step was applied
        assert torch.equal(after[key], before[key]), key
    for step in range(4, 6):  # the job goes on: no rank waits in a collective
        backward(model, *batch(step, comm.rank))
        pre.step()
    assert all(torch.isfinite(t).all() for t in factor_snapshot(pre).values())
    pre.close()


@pytest.mark.parametrize("strategy, options", CASES, ids=IDS)
def test_nonfinite_statistics_one_rank(strategy, options):
    poison_one_rank(Communicator(MPI.COMM_SELF), strategy, options)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("strategy, options", CASES, ids=IDS)
def test_nonfinite_statistics_agreed(comm, strategy, options):
    poison_one_rank(comm, strategy, options)


def test_a_step_that_raises_before_its_fold_drops_its_statistics(monkeypatch):
    """Between inverse updates one rank folds after preconditioning; an error there
    leaves the factors as they were and drops the step's statistics, so the next step
    folds its own alone, as one that never captured the failed one's."""
    def run(fail: bool) -> dict[str, torch.Tensor]:
        model = mlp()
        pre = kfac(model, Communicator(MPI.COMM_SELF), "comm-opt")
        for step in range(3):
            backward(model, *batch(step, 0))
            pre.step()
        before = factor_snapshot(pre)
        if fail:
            backward(model, *batch(3, 0))
            real = pre._precondition_my_layers

            def raises(k: int):  # type: ignore[no-untyped-def]
                raise RuntimeError("injected")

            monkeypatch.setattr(pre, "_precondition_my_layers", raises)
            with pytest.raises(RuntimeError, match="injected"):
                pre.step()
            monkeypatch.setattr(pre, "_precondition_my_layers", real)
            for key, value in before.items():
                assert torch.equal(factor_snapshot(pre)[key], value), key
        backward(model, *batch(4, 0))
        pre.step()
        pre.close()
        return factor_snapshot(pre)

    failed, clean = run(True), run(False)
    for key in clean:
        assert torch.equal(failed[key], clean[key]), key


class Scaler:
    """The two methods K-FAC reads from a ``torch.amp.GradScaler``."""

    def is_enabled(self) -> bool:
        return True

    def get_scale(self) -> float:
        return 1.0


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("strategy, options", CASES[:2] + CASES[3:4], ids=IDS[:2] + IDS[3:4])
def test_overflow_with_grad_scaler_skips_on_every_rank(comm, strategy, options):
    poison_one_rank(comm, strategy, options, scaler=Scaler())


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("strategy", ["comm-opt", "mem-opt"])
def test_failed_decomposition_agreed(comm, strategy, monkeypatch):
    model = mlp()
    pre = kfac(model, comm, strategy, local_decomposition_threshold=0)
    backward(model, *batch(0, comm.rank))
    pre.step()
    old = {k: {p: t.clone() for p, t in parts.items()} for k, parts in pre.decompositions.items()}
    real = linalg.eigh_clamped
    failing_rank = pre.factor_owner("0/A")

    def eigh_fails(F, dtype=torch.float32):
        raise torch.linalg.LinAlgError("injected: the algorithm failed to converge")

    if comm.rank == failing_rank:
        monkeypatch.setattr(linalg, "eigh_clamped", eigh_fails)
    backward(model, *batch(1, comm.rank))
    pre.step()  # not an inverse step
    backward(model, *batch(2, comm.rank))
    with pytest.raises(KFACNumericalError, match="decomposition") as info:
        pre.step()
    assert info.value.ranks == 1
    if comm.rank == failing_rank:
        assert isinstance(info.value.__cause__, torch.linalg.LinAlgError)
    assert pre.decompositions.keys() == old.keys()
    for key, parts in old.items():
        for part, value in parts.items():
            assert torch.equal(pre.decompositions[key][part], value)
    monkeypatch.setattr(linalg, "eigh_clamped", real)
    backward(model, *batch(3, comm.rank))
    pre.step()  # decomposes again, on every rank
    pre.close()


@pytest.mark.mpi(min_size=4)
def test_close_frees_subcommunicators(comm):
    pre = kfac(mlp(), comm, "hybrid-opt", grad_worker_fraction=0.5)
    subs = [c for c in (pre.worker_comm, pre.receiver_comm) if c is not comm]
    assert subs, "hybrid-opt at 4 ranks splits the world"
    pre.close()
    assert all(sub.mpi == MPI.COMM_NULL for sub in subs)
    with pytest.raises(RuntimeError, match="close"):
        pre.step()
    pre.close()  # idempotent


def train_with_checkpoint(comm: Communicator, strategy: str, options: dict, directory,
                          resume: bool,
                          inspect: Callable[[KFACPreconditioner, torch.optim.Optimizer], None]
                          | None = None) -> nn.Module:
    """6 steps of K-FAC on SGD over sharded data; at step 3 (between inverse updates)
    save with ``checkpoint.save``'s defaults; ``resume``: load into fresh objects.
    ``inspect(pre, opt)`` is called at step 3 after ``pre.step()``, before ``opt.step()``
    (the decompositions restored, the optimizer state not yet rewritten)."""
    def build() -> tuple[nn.Module, torch.optim.Optimizer, KFACPreconditioner,
                         GradientAverager]:
        model = mlp()
        return (model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                kfac(model, comm, strategy, **options), GradientAverager(model, comm))

    model, opt, pre, avg = build()
    for step in range(6):
        if step == 3:
            checkpoint.save(directory, model=model, optimizer=opt, preconditioner=pre,
                            step=step, comm=comm)
            if resume:
                pre.close()
                model, opt, pre, avg = build()
                checkpoint.load(directory, model=model, optimizer=opt, preconditioner=pre,
                                comm=comm)
        backward(model, *batch(step, comm.rank))
        avg.synchronize()
        pre.step()
        if step == 3 and inspect is not None:
            inspect(pre, opt)
        opt.step()
    pre.close()
    return model


# low rank: its k=4 products with the full, local factors (d = 7, 3) round differently in
# MKL (Intel AVX-512) for a column-major Q (eigh's, live) and a row-major one (restored)
RESUME_CASES = [("comm-opt", {}), ("mem-opt", {}), ("comm-opt", {"factor_sync": "inverse"}),
                ("comm-opt", {"compute_method": "inverse"}), ("dp-kfac", {}),
                ("comm-opt", {"low_rank": 4, "low_rank_min_dim": 18})]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("strategy, options", RESUME_CASES,
                         ids=[f"{s}-{o}" for s, o in RESUME_CASES])
def test_checkpoint_resume_is_bitwise(comm, strategy, options, tmp_path_factory):
    root = tmp_path_factory.mktemp("resume") if comm.rank == 0 else None
    root = comm.broadcast_object(root)
    saving = train_with_checkpoint(comm, strategy, options, root / "a", resume=False)
    resumed = train_with_checkpoint(comm, strategy, options, root / "b", resume=True)
    for (name, p), q in zip(saving.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), f"{name}: resumed run differs from the run that saved"


Layout = tuple[tuple[int, ...], tuple[int, ...], int, int]


def layout(t: torch.Tensor) -> Layout:
    """What a BLAS sees of a tensor besides its values: shape, strides, offset into its
    storage and the alignment of its first element (64 bytes: torch's CPU allocations)."""
    return tuple(t.shape), t.stride(), t.storage_offset(), t.data_ptr() % 64


def layouts(pre: KFACPreconditioner, opt: torch.optim.Optimizer) -> dict[str, Layout]:
    """The layout of every factor (running averages), decomposition and optimizer state
    tensor this rank holds (of more than one element: a scalar never reaches a BLAS)."""
    out = {f"factor {k}": layout(s.average) for k, s in pre.factors.items()
           if s.average is not None}
    out.update({f"decomposition {k} {part}": layout(t)
                for k, parts in pre.decompositions.items() for part, t in parts.items()})
    out.update({f"optimizer {i} {name}": layout(t)
                for i, state in enumerate(opt.state.values())
                for name, t in state.items() if isinstance(t, torch.Tensor) and t.numel() > 1})
    return out


LAYOUT_IDS = [f"{s}-" + "-".join(f"{k}={v}" for k, v in o.items()) for s, o in RESUME_CASES]


def assert_restored_like_live(comm: Communicator, strategy: str, options: dict,
                              root) -> None:
    live: dict[str, Layout] = {}
    restored: dict[str, Layout] = {}
    train_with_checkpoint(comm, strategy, options, root / "live", resume=False,
                          inspect=lambda pre, opt: live.update(layouts(pre, opt)))
    train_with_checkpoint(comm, strategy, options, root / "restored", resume=True,
                          inspect=lambda pre, opt: restored.update(layouts(pre, opt)))
    # the check proves something: some rank holds decompositions (under mem-opt at 4
    # ranks a rank may be the gradient worker of no layer of this small model)
    assert comm.any(any(k.startswith("decomposition") for k in live))
    assert any(k.startswith("optimizer") for k in live)
    assert restored.keys() == live.keys()
    differ = {k: (live[k], restored[k]) for k in live if live[k] != restored[k]}
    assert not differ, (f"rank {comm.rank}: restored tensors laid out unlike the live ones "
                        f"(shape, strides, offset, address % 64: live, restored): {differ}")


@pytest.mark.parametrize("strategy, options", RESUME_CASES, ids=LAYOUT_IDS)
def test_restored_state_is_laid_out_like_the_live_state(strategy, options, tmp_path):
    assert_restored_like_live(Communicator(MPI.COMM_SELF), strategy, options, tmp_path)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("strategy, options", RESUME_CASES, ids=LAYOUT_IDS)
def test_restored_state_is_laid_out_like_the_live_state_ranks(comm, strategy, options,
                                                              tmp_path_factory):
    root = tmp_path_factory.mktemp("layout") if comm.rank == 0 else None
    assert_restored_like_live(comm, strategy, options, comm.broadcast_object(root))


def batched_failure_run(comm: Communicator, monkeypatch: pytest.MonkeyPatch | None,
                        failing_rank: int) -> list[torch.Tensor]:
    """Six steps (inverse updates at 0, 2, 4); with ``monkeypatch``, the batched
    eigendecompositions raise as a whole on ``failing_rank`` (as an out-of-memory error
    stacking a size's factors would)."""
    if monkeypatch is not None and comm.rank == failing_rank:
        def out_of_memory(*args: object, **kwargs: object) -> object:
            raise torch.OutOfMemoryError("injected: out of memory stacking the factors")

        monkeypatch.setattr(linalg, "eigh_clamped_many", out_of_memory)
    model = mlp()
    pre = kfac(model, comm, "comm-opt")
    for step in range(6):
        backward(model, *batch(step, comm.rank))
        pre.step()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
    pre.close()
    return [p.detach().clone() for p in model.parameters()]


def check_batched_failure(comm: Communicator, monkeypatch: pytest.MonkeyPatch,
                          caplog: pytest.LogCaptureFixture) -> None:
    """The failing rank decomposes its factors one by one (the same solver per factor
    as the CPU's batched path): no rank waits, and the run equals the normal one."""
    normal = batched_failure_run(comm, None, 0)
    with caplog.at_level("WARNING", logger="kfac_hpc"):
        degraded = batched_failure_run(comm, monkeypatch, 0)
    if comm.rank == 0:
        assert "decomposing the factors one by one" in caplog.text
    for a, b in zip(degraded, normal):
        assert torch.equal(a, b)


def test_a_batched_decomposition_that_raises_falls_back_to_one_by_one(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    check_batched_failure(Communicator(MPI.COMM_SELF), monkeypatch, caplog)


@pytest.mark.mpi(min_size=2)
def test_a_batched_decomposition_that_raises_on_one_rank_hangs_no_rank(
        comm: Communicator, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    check_batched_failure(comm, monkeypatch, caplog)


class _Skipping(nn.Module):
    """``n`` equal layers in a chain; layer 1 is left out of the steps in ``skip``."""

    def __init__(self, n: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(n)])
        self.skip = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if not (self.skip and i == 1):
                x = torch.tanh(layer(x))
        return x


def _train_skipping(comm: Communicator, strategy: str, n: int) -> nn.Module:
    model = _Skipping(n).double()
    pre = KFACPreconditioner(model, comm=comm, strategy=strategy, damping=0.01,
                             inv_update_steps=2, inv_dtype=torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(5):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(6, 8, generator=g, dtype=torch.float64)
        model.skip = step in (1, 3)
        opt.zero_grad(set_to_none=True)
        model(x).square().sum().backward()
        pre.step()
        opt.step()
    pre.close()
    return model


@pytest.mark.mpi(min_size=2)
def test_dp_kfac_goes_on_when_one_ranks_layers_do_not_run(comm):
    """DP-KFAC: each rank hooks the layers it owns (one each here). At steps 1 and 3 the
    layer of one rank does not run: that rank's statistics are empty while the others'
    are not, which is no error (it raised on that rank alone, and the others waited).
    The parameters equal a one-rank run's."""
    model = _train_skipping(comm, "dp-kfac", comm.size)
    reference = _train_skipping(Communicator(MPI.COMM_SELF), "dp-kfac", comm.size)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)


@pytest.mark.mpi(min_size=2)
def test_overlap_with_a_layer_that_runs_on_some_ranks_only(comm):
    """``overlap`` posts a layer's statistics from its hooks. At step 1 the middle layer
    does not run on rank 1 (a skipped block): rank 1 posts that bucket at step(), after
    the others posted it from their hooks. Every rank posts the buckets before the
    step's other collectives, in the same order (the ranks' calls crossed and MPI
    aborted with a truncation), and the factors agree on every rank."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(),
                          nn.Linear(12, 4)).double()

    def forward(x: torch.Tensor, skip: bool) -> torch.Tensor:
        h = model[1](model[0](x))
        if not skip:
            h = model[3](model[2](h))
        return model[4](h)

    pre = KFACPreconditioner(model, comm=comm, overlap=True, bucket_cap_mb=1e-5,
                             damping=0.01, inv_dtype=torch.float64)
    GradientAverager(model, comm)  # its hooks post on the same communicator (unsynchronised)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(16, 6, generator=g, dtype=torch.float64)
        y = torch.randint(0, 4, (16,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(forward(x, step == 1 and comm.rank == 1), y).backward()
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        pre.step()
        opt.step()
    norms = [round(float(s.average.norm()), 12) for s in pre.factors.values()
             if s.average is not None]
    assert len(set(map(tuple, comm.allgather_object(norms)))) == 1
    pre.close()


def _preconditioned_after_an_overflow_at_step_0(comm: Communicator) -> list[bool]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 20), nn.Tanh(), nn.Linear(20, 3))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    pre = KFACPreconditioner(model, comm=comm, grad_scaler=scaler, damping=0.01,
                             inv_update_steps=10)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    preconditioned = []
    for k in range(4):
        g = torch.Generator().manual_seed(100 * comm.rank + k)
        opt.zero_grad()
        boost = 1e36 if k == 0 else 1.0  # step 0 overflows
        loss = boost * nn.functional.cross_entropy(model(torch.randn(8, 6, generator=g)),
                                                   torch.randint(0, 3, (8,), generator=g))
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        raw = model[0].weight.grad.clone()
        pre.step()
        preconditioned.append(not torch.equal(raw, model[0].weight.grad))
        scaler.step(opt)
        scaler.update()
    pre.close()
    return preconditioned


def test_an_overflow_at_the_first_step_does_not_leave_kfac_off() -> None:
    """fp16 AMP often overflows at its first steps: the decompositions of step 0 then
    come from no factor update, and the next factor update renews them (K-FAC was off
    until the next inverse step, steps 1 to 9 here)."""
    # (step 0's gradients are not finite: what happens to them is the scaler's business)
    assert _preconditioned_after_an_overflow_at_step_0(Communicator(MPI.COMM_SELF))[1:] == [
        True, True, True]


@pytest.mark.mpi(min_size=2)
def test_an_overflow_at_the_first_step_renews_on_every_rank_alike() -> None:
    comm = Communicator(MPI.COMM_WORLD.Dup())
    assert _preconditioned_after_an_overflow_at_step_0(comm)[1:] == [True, True, True]
