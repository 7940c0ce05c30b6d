"""Decompositions in the background (``decomposition_lag``): which ones are used when,
determinism, exact resume in the middle of a lag, and agreed failures."""

from __future__ import annotations

import copy
import threading
from typing import Any

import pytest
import torch
from mpi4py import MPI
from op_count import GEMMS
from shared_cases import small_cnn, small_cnn_batches
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from kfac_hpc import KFACPreconditioner
from kfac_hpc.comm import Communicator
from kfac_hpc.kfac import decompositions, linalg, precision
from kfac_hpc.kfac.background import BackgroundJob, Decomposed
from kfac_hpc.kfac.decompositions import Lagged
from kfac_hpc.kfac.errors import KFACNumericalError

INV = 3  # inverse update every 3 steps
LAG = 2


def build(comm: Communicator, lag: int, **options) -> tuple[nn.Module, KFACPreconditioner,
                                                           torch.optim.Optimizer]:
    model = small_cnn()
    pre = KFACPreconditioner(model, comm=comm, damping=0.01, inv_update_steps=INV,
                             inv_dtype=torch.float64, decomposition_lag=lag, **options)
    return model, pre, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def one_step(model: nn.Module, pre: KFACPreconditioner, opt: torch.optim.Optimizer,
             x: torch.Tensor, y: torch.Tensor) -> None:
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    pre.step()
    opt.step()


def test_lagged_decompositions_are_those_of_the_snapshot():
    """At step t the decompositions in use are those of the factors of the latest inverse
    step k with k + lag <= t (the first, at step 0, is computed in place)."""
    model, pre, opt = build(Communicator(MPI.COMM_SELF), LAG)
    snapshots: dict[int, dict[str, torch.Tensor]] = {}
    for t, (x, y) in enumerate(small_cnn_batches(10)):
        one_step(model, pre, opt, x, y)
        if t % INV == 0:
            snapshots[t] = {k: s.average.clone() for k, s in pre.factors.items()
                            if s.average is not None}
        k = max(s for s in snapshots if s == 0 or s + LAG <= t)
        for key, parts in pre.decompositions.items():
            expected = linalg.eigh_clamped(snapshots[k][key], torch.float64)
            assert torch.equal(parts["lambda"], expected[1]), (t, k, key)
    pre.close()


def test_lag_changes_the_trajectory_deterministically():
    def final(lag: int) -> list[torch.Tensor]:
        model, pre, opt = build(Communicator(MPI.COMM_SELF), lag)
        for x, y in small_cnn_batches(8):
            one_step(model, pre, opt, x, y)
        pre.close()
        return [p.detach().clone() for p in model.parameters()]

    first, second, in_place = final(LAG), final(LAG), final(0)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert not all(torch.equal(a, b) for a, b in zip(first, in_place))


def _resume_case(comm: Communicator, save_at: int, **options) -> None:
    """A run that saves at ``save_at`` (a background update pending) and goes on, against
    a run rebuilt from those state dicts: bitwise equal."""
    data = small_cnn_batches(9)
    model, pre, opt = build(comm, LAG, **options)
    saved = None
    for t, (x, y) in enumerate(data):
        if t == save_at:
            assert isinstance(pre.renewal, Lagged) and pre.renewal.pending is not None  # the case
            saved = copy.deepcopy((model.state_dict(), opt.state_dict(), pre.state_dict()))
        one_step(model, pre, opt, x, y)
    pre.close()
    assert saved is not None
    model2, pre2, opt2 = build(comm, LAG, **options)
    model2.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    pre2.load_state_dict(saved[2])
    for x, y in data[save_at:]:
        one_step(model2, pre2, opt2, x, y)
    pre2.close()
    for (name, p), q in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(p, q), f"{name} differs after resuming at step {save_at}"


@pytest.mark.parametrize("save_at", [4, 7])  # 4: pending from 3; 7: pending from 6
def test_resume_in_the_middle_of_a_lag_is_bitwise(save_at):
    _resume_case(Communicator(MPI.COMM_SELF), save_at)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("strategy", ["comm-opt", "mem-opt"])
def test_resume_in_the_middle_of_a_lag_is_bitwise_ranks(comm, strategy):
    _resume_case(comm, 4, strategy=strategy)


def test_failure_in_the_background_is_raised_at_the_swap(monkeypatch):
    model, pre, opt = build(Communicator(MPI.COMM_SELF), LAG)
    data = small_cnn_batches(6)
    for x, y in data[:3]:
        one_step(model, pre, opt, x, y)
    old = {k: {p: t.clone() for p, t in parts.items()} for k, parts in pre.decompositions.items()}

    def eigh_fails(factors, dtype=torch.float32, placement=None):
        return [torch.linalg.LinAlgError("injected") for _ in factors]

    monkeypatch.setattr(linalg, "eigh_clamped_many", eigh_fails)
    one_step(model, pre, opt, *data[3])  # step 3: the background update starts
    monkeypatch.undo()
    one_step(model, pre, opt, *data[4])  # step 4: still the old decompositions
    opt.zero_grad()
    nn.functional.cross_entropy(model(data[5][0]), data[5][1]).backward()
    with pytest.raises(KFACNumericalError, match="decomposition"):
        pre.step()  # step 5: the swap, where the failure is agreed
    for key, parts in old.items():
        for part, value in parts.items():
            assert torch.equal(pre.decompositions[key][part], value)
    pre.close()


def test_a_background_job_refreshes_from_its_own_view_of_the_held_decompositions(monkeypatch):
    """The job gets copies of the held dicts (the same tensors), and all of them as inputs
    (on CUDA marked as used on its stream): stacking for preconditioning replaces the held
    dicts' parts while the job runs, which must neither change what the job reads nor
    free a tensor it still reads."""
    model, pre, opt = build(Communicator(MPI.COMM_SELF), LAG, eigen_refresh="subspace")
    data = small_cnn_batches(4)
    for x, y in data[:3]:
        one_step(model, pre, opt, x, y)
    seen: dict[str, Any] = {}
    real_job = decompositions.BackgroundJob

    def spy_job(compute, device, swap_at, stream=None, inputs=()):
        seen["inputs"] = list(inputs)
        return real_job(compute, device, swap_at, stream=stream, inputs=seen["inputs"])

    real_compute = decompositions.Decompositions.compute

    def spy_compute(self, step, states=None, previous=None):
        seen["previous"] = previous
        return real_compute(self, step, states, previous)

    monkeypatch.setattr(decompositions, "BackgroundJob", spy_job)
    monkeypatch.setattr(decompositions.Decompositions, "compute", spy_compute)
    held = pre.decomps.held
    one_step(model, pre, opt, *data[3])  # step 3: the background update starts
    pre.renewal.pending.result()
    previous = seen["previous"]
    assert previous.keys() == held.keys()
    assert all(previous[k] is not held[k] and previous[k].keys() == held[k].keys()
               and all(previous[k][p] is held[k][p] for p in held[k]) for k in held)
    inputs = {id(t) for t in seen["inputs"]}
    assert all(id(t) in inputs for parts in previous.values() for t in parts.values())
    pre.close()


def test_lag_is_validated():
    with pytest.raises(ValueError, match="decomposition_lag must be a whole number"):
        KFACPreconditioner(nn.Linear(3, 2), decomposition_lag=-1)



class _GemmLocks(TorchDispatchMode):
    """Record, for each GEMM and QR dispatched on this thread, whether it held the precision
    lock (a CUDA QR of small matrices runs in cuBLAS, whose math mode follows the flag)."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[bool] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if str(func).startswith((*GEMMS, "aten.linalg_qr.")):
            self.held.append(precision._FLAGS._is_owned())  # type: ignore[attr-defined]
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("options", [{"eigen_refresh": "subspace"},
                                     {"low_rank": 3, "low_rank_min_dim": 8}],
                         ids=["subspace", "low-rank"])
def test_background_products_run_at_the_users_precision_setting(monkeypatch, options):
    """Torch's product precision flags are process-wide, and the step's TF32 blocks (on
    CUDA, the statistics' default) change them while a background job runs: every GEMM
    and QR of a background job is launched holding the lock those blocks hold, so it sees
    the user's own setting whatever the threads' timing."""
    seen: list[_GemmLocks] = []

    class Recorded(BackgroundJob):
        def __init__(self, compute, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
            def recorded() -> Decomposed:
                mode = _GemmLocks()
                seen.append(mode)
                with mode:
                    return compute()
            super().__init__(recorded, *args, **kwargs)

    monkeypatch.setattr(decompositions, "BackgroundJob", Recorded)
    model, pre, opt = build(Communicator(MPI.COMM_SELF), LAG, **options)
    for x, y in small_cnn_batches(8):
        one_step(model, pre, opt, x, y)
    pre.close()
    assert len(seen) >= 2  # inverse steps 3 and 6 ran in the background
    held = [h for mode in seen for h in mode.held]
    assert held and all(held), f"{held.count(False)} of {len(held)} GEMMs/QRs without the lock"


def _flags() -> str:
    return str(torch.backends.cuda.matmul.fp32_precision)


@pytest.mark.skipif(not hasattr(torch.backends.cuda.matmul, "fp32_precision"),
                    reason="torch without fp32_precision")
def test_precision_blocks_of_two_threads_restore_the_users_setting():
    """Two threads' precision blocks, the second started while the first runs: each
    waits its turn, and the user's setting is what remains (without the lock the first
    would restore its setting under the second, and the second then its own "tf32")."""
    user = _flags()
    first_in, second_in = threading.Event(), threading.Event()
    inside: list[str] = []

    def first() -> None:
        with precision.tf32_products():
            first_in.set()
            second_in.wait(timeout=0.3)  # the second cannot start while this block runs
            inside.append(_flags())

    def second() -> None:
        first_in.wait(timeout=10)
        with precision.full_precision_products():
            second_in.set()
            inside.append(_flags())

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert inside == ["tf32", "ieee"]
    assert _flags() == user


@pytest.mark.skipif(not hasattr(torch.backends.cuda.matmul, "fp32_precision"),
                    reason="torch without fp32_precision")
def test_user_setting_products_wait_for_a_running_precision_block():
    user = _flags()
    entered = threading.Event()
    seen: list[str] = []

    def products() -> None:
        entered.wait(timeout=10)
        with precision.user_setting_products():
            seen.append(_flags())

    worker = threading.Thread(target=products)
    worker.start()
    with precision.tf32_products():
        entered.set()
        worker.join(timeout=0.3)  # it waits for this block to end
    worker.join(timeout=10)
    assert seen == [user]


def test_a_script_that_ends_with_a_renewal_pending_exits_cleanly(tmp_path) -> None:
    """No close(), a background renewal still running at the end of the script: the
    process exits 0 (its daemon thread was killed inside torch: abort, status 134)."""
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "lag_exit.py"
    script.write_text(textwrap.dedent("""
        import torch
        from mpi4py import MPI
        from torch import nn
        from kfac_hpc import KFACPreconditioner
        from kfac_hpc.comm import Communicator
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(600, 600), nn.Tanh(), nn.Linear(600, 3))
        pre = KFACPreconditioner(model, comm=Communicator(MPI.COMM_SELF), inv_update_steps=2,
                                 decomposition_lag=1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for k in range(3):  # step 2 is an inverse step: its renewal is pending at the end
            opt.zero_grad()
            nn.functional.cross_entropy(model(torch.randn(32, 600)),
                                        torch.randint(0, 3, (32,))).backward()
            pre.step()
            opt.step()
        print("done", flush=True)
        """))
    for _ in range(2):
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                              timeout=240, check=False)
        assert done.returncode == 0 and done.stdout.strip() == "done", done.stderr[-2000:]


def test_a_refused_load_keeps_the_pending_renewal() -> None:
    """A load_state_dict that every rank refuses changes nothing: the renewal started at
    step 4 still lands at step 6 (it was cancelled first: 5e-2 off the run without it)."""
    from mpi4py import MPI

    from kfac_hpc.comm import Communicator

    def run(bad_load_at: int | None = None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 20), nn.Tanh(), nn.Linear(20, 3)).double()
        pre = KFACPreconditioner(model, comm=Communicator(MPI.COMM_SELF), inv_update_steps=4,
                                 decomposition_lag=2, damping=0.01, inv_dtype=torch.float64)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for k in range(8):
            if k == bad_load_at:
                with pytest.raises(KeyError, match="factor state missing"):
                    pre.load_state_dict({"step": k, "factors": {}, "factor_updates": {},
                                         "config": {}})  # not a K-FAC checkpoint
            g = torch.Generator().manual_seed(k)
            opt.zero_grad()
            nn.functional.cross_entropy(model(torch.randn(8, 6, generator=g, dtype=torch.float64)),
                                        torch.randint(0, 3, (8,), generator=g)).backward()
            pre.step()
            opt.step()
        pre.close()
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(run(), run(bad_load_at=5)):
        assert torch.equal(a, b)
