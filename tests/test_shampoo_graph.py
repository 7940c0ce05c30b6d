"""Shampoo's captured block work (``cuda_graphs``), its plumbing checked on the CPU.

As for K-FAC (tests/test_kfac_step_graph.py), the step's
:class:`~kfac_hpc.step_graph.StepGraph` gets the recorder of :mod:`recorded_graph`,
which replays the captured ATen operators on the same tensors with the same scalars and
runs no Python. Checked: every step's parameters equal the eager run's, bit for bit, for
several settings (the bias corrections of each step read from the device vector, the
directions and flags the exchange keeps restored after each replay, root steps eager in
between, a learning rate of every step), a non-finite gradient at a replayed step raises
as eagerly with nothing applied, a load starts afresh, and two ranks (the gathered
directions) agree. On CUDA: tests/gpu/test_step_graph_gpu.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from mpi4py import MPI
from recorded_graph import RecordedGraph
from torch import Tensor, nn

from kfac_hpc import step_graph
from kfac_hpc.comm import Communicator
from kfac_hpc.shampoo import DistributedShampoo, ShampooNumericalError

STEPS = 9


@pytest.fixture(autouse=True)
def recorded(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``cuda_graphs=True`` on the CPU, capturing with the recorder."""
    monkeypatch.setattr(step_graph, "supported", lambda device: True)
    monkeypatch.setattr(step_graph, "new_graph", RecordedGraph)
    monkeypatch.setattr(step_graph, "new_pool", lambda: None)
    monkeypatch.setattr(step_graph, "new_stream", lambda device: None)
    yield


def model(dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Tanh(), nn.Flatten(),
                         nn.Linear(4 * 5 * 5, 12), nn.Tanh(), nn.Linear(12, 3)).to(dtype)


def batches(n: int, dtype: torch.dtype = torch.float64) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 3, 5, 5, generator=g, dtype=torch.float64).to(dtype),
             torch.randint(0, 3, (6,), generator=g)) for _ in range(n)]


def train(graphed: bool | None, comm: Communicator | None = None, steps: int = STEPS,
          poison_at: int | None = None, errors: list[str] | None = None,
          dtype: torch.dtype = torch.float64, **options: Any
          ) -> tuple[list[list[Tensor]], DistributedShampoo]:
    """Parameters after every step (eager or with the recorder); ``poison_at``: a NaN
    gradient at that step, which must raise (its message appended to ``errors``) and
    leave the parameters as they were; the run stops there."""
    errors = [] if errors is None else errors
    net = model(dtype)
    settings: dict[str, Any] = dict(lr=0.01, betas=(0.9, 0.999), epsilon=1e-10,
                                    weight_decay=0.01, max_preconditioner_dim=16,
                                    precondition_frequency=3)
    settings.update(options)
    opt = DistributedShampoo(net.named_parameters(), comm=comm or Communicator(MPI.COMM_SELF),
                             cuda_graphs=graphed, **settings)
    out = []
    for k, (x, y) in enumerate(batches(steps, dtype)):
        for group in opt.param_groups:
            group["lr"] = 0.01 / (1 + k)  # read outside the graph, at every step
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(net(x), y).backward()
        if k == poison_at:  # the state holds the NaN now: the run ends here
            before = [p.detach().clone() for p in net.parameters()]
            net[0].weight.grad[0, 0, 0, 0] = float("nan")  # type: ignore[index]
            with pytest.raises(ShampooNumericalError) as raised:
                opt.step()
            assert all(torch.equal(p, q) for p, q in zip(net.parameters(), before))
            errors.append(str(raised.value))
            break
        opt.step()
        out.append([p.detach().clone() for p in net.parameters()])
    return out, opt


def shampoo(net: nn.Module, graphed: bool) -> DistributedShampoo:
    """The settings of the tests that step by hand (one learning rate throughout)."""
    return DistributedShampoo(net.named_parameters(), comm=Communicator(MPI.COMM_SELF),
                              lr=0.01, epsilon=1e-10, weight_decay=0.01,
                              max_preconditioner_dim=16, precondition_frequency=3,
                              cuda_graphs=graphed)


def step(net: nn.Module, opt: DistributedShampoo, x: Tensor, y: Tensor) -> list[Tensor]:
    """One training step; the parameters after it."""
    opt.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(net(x), y).backward()
    opt.step()
    return [p.detach().clone() for p in net.parameters()]


def assert_same(a: list[list[Tensor]], b: list[list[Tensor]]) -> None:
    assert len(a) == len(b)
    for k, (pa, pb) in enumerate(zip(a, b)):
        for j, (x, y) in enumerate(zip(pa, pb)):
            assert torch.equal(x, y), (k, j)


SETTINGS = [
    {},
    dict(momentum=0.9, nesterov=True, decoupled_weight_decay=False, grafting="sgd",
         use_bias_correction=False),
    dict(grafting="adagrad", betas=(0.0, 1.0), weight_decay=0.0),
    dict(grafting="rmsprop", momentum=0.5, precondition_vectors=False),
    dict(start_preconditioning_step=3, momentum=0.9),
]
#: (captures, steps run by a graph) of each setting over 9 steps: roots at steps 1, 4
#: and 7, each key's first step eager, step 3 captures, steps 5, 6, 8 and 9 replay.
#: Starting at step 3: steps 1 and 2 (grafting only) are a key (step 2 captures), roots
#: at 3, 6 and 9, the key of preconditioned steps first seen at 4, captured at 5,
#: replayed at 7 and 8.
COUNTS = [(1, 5), (1, 5), (1, 5), (1, 5), (2, 4)]


@pytest.mark.parametrize("options, counts", list(zip(SETTINGS, COUNTS)),
                         ids=["adam-wd", "sgd-nesterov-coupled", "adagrad-sum",
                              "rmsprop-vectors-grafted", "start-3-momentum"])
def test_graphed_steps_equal_eager_steps(options: dict[str, Any],
                                         counts: tuple[int, int]) -> None:
    """Every step's parameters equal the eager run's, bit for bit; the roots, rewritten
    in place at root steps (which run eagerly), keep the graph valid."""
    eager, _ = train(False, **options)
    graphed, opt = train(True, **options)
    assert_same(graphed, eager)
    graph = opt.step_graph
    assert graph is not None
    assert (graph.captures, graph.replays) == counts


def test_statistics_every_second_step() -> None:
    """With factor updates every other step the key alternates, so no key repeats at
    the next step, even around root steps, and the steps run eagerly (a small cache of
    graphs would serve both keys)."""
    eager, _ = train(False, statistics_frequency=2)
    graphed, opt = train(True, statistics_frequency=2)
    assert_same(graphed, eager)
    assert opt.step_graph is not None
    assert (opt.step_graph.captures, opt.step_graph.replays) == (0, 0)


def test_a_parameter_given_new_storage_is_a_new_key() -> None:
    """``p.data = ...`` with the same shape and dtype: the captured work read the old
    storage (weight decay), so the key changes and the results stay the eager ones."""
    runs = []
    for graphed in (False, True):
        net = model()
        opt = shampoo(net, graphed)
        params = []
        for k, (x, y) in enumerate(batches(STEPS)):
            if k == 5:
                net[3].weight.data = net[3].weight.data.clone()  # type: ignore[index]
            params.append(step(net, opt, x, y))
        runs.append(params)
        if graphed:
            assert opt.step_graph is not None and opt.step_graph.captures == 2
            assert opt.memory_bytes()["graph buffers"] > 0
    assert_same(runs[1], runs[0])


def test_half_precision_parameters_run_eagerly() -> None:
    """bf16 parameters: a bias correction as a number divides them in float32, as a
    tensor it may be cast to bf16 first (not shown the same on CUDA), so their steps are
    not captured; the results stay the eager ones."""
    eager, _ = train(False, steps=4, dtype=torch.bfloat16)
    graphed, opt = train(True, steps=4, dtype=torch.bfloat16)
    assert_same(graphed, eager)
    assert opt.step_graph is not None and opt.step_graph.captures == 0
    assert graphed[-1][0].dtype == torch.bfloat16


def test_a_nonfinite_gradient_at_a_replayed_step_raises_as_eagerly() -> None:
    """A NaN at step 6 (index 5, a replay): the error of the eager run, naming the same
    block (read from the flags the exchange keeps), and nothing applied."""
    eager_errors: list[str] = []
    graphed_errors: list[str] = []
    eager, _ = train(False, poison_at=5, errors=eager_errors)
    graphed, opt = train(True, poison_at=5, errors=graphed_errors)
    assert_same(graphed, eager)
    assert graphed_errors == eager_errors and "parameter '0.weight' block" in eager_errors[0]
    assert opt.step_graph is not None and opt.step_graph.replays == 3  # steps 3, 5, 6


def test_a_load_starts_afresh() -> None:
    """Loading a state dict installs new state (its tensors bound into the stacks at the
    next step): a new key, whose first step runs eagerly; the run continues as an eager
    run loaded from the same dict does, and the graph of before the load, which had
    served steps, is not replayed on the state it read."""
    _, saved = train(False, steps=5)
    state = saved.state_dict()
    runs = []
    for graphed in (False, True):
        net = model()
        for p, q in zip(net.parameters(), saved.param_groups[0]["params"]):
            p.data.copy_(q)
        opt = shampoo(net, graphed)
        if graphed:
            for x, y in batches(6):  # a graph captured at step 3, replayed at 5 and 6
                step(net, opt, x, y)
            for p, q in zip(net.parameters(), saved.param_groups[0]["params"]):
                p.data.copy_(q)
        opt.load_state_dict(state)
        runs.append([step(net, opt, x, y) for x, y in batches(4)])
        if graphed:
            assert opt.step_graph is not None
            assert (opt.step_graph.captures, opt.step_graph.replays) == (2, 4)
    assert_same(runs[1], runs[0])


def test_the_capture_does_not_run_the_stateful_work_first() -> None:
    """Shampoo's captured work updates the optimizer state: a run before the capture
    would update it twice (the recorder undoes what its recording wrote, as a capture
    runs nothing)."""
    _, opt = train(True, steps=2)
    assert opt.step_graph is not None and not opt.step_graph.warm_up


def test_the_default_follows_the_device_list(monkeypatch: pytest.MonkeyPatch) -> None:
    """``cuda_graphs=None`` (the default) captures on the device types that
    ``step_graph.DEFAULT_DEVICES`` names, with the steps ``True`` gives; elsewhere none."""
    _, opt = train(None, steps=2)
    assert opt.step_graph is None
    monkeypatch.setattr(step_graph, "DEFAULT_DEVICES", frozenset({"cpu"}))
    eager, _ = train(False)
    defaulted, opt = train(None)
    assert_same(defaulted, eager)
    assert opt.step_graph is not None and opt.step_graph.replays == 5


def test_the_default_leaves_large_buffers_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the default, static buffers above ``DEFAULT_BUFFER_SHARE`` of the device's
    memory are not made: the eager steps, no capture."""
    monkeypatch.setattr(step_graph, "DEFAULT_DEVICES", frozenset({"cpu"}))
    monkeypatch.setattr(step_graph, "DEFAULT_BUFFER_SHARE", 1e-12)
    eager, _ = train(False)
    defaulted, opt = train(None)
    assert_same(defaulted, eager)
    assert opt.step_graph is not None and opt.step_graph.captures == 0
    assert "above the default's bound" in str(opt.step_graph.disabled)


def test_cuda_graphs_need_a_cuda_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.undo()
    with pytest.raises(ValueError, match="cuda_graphs=True needs the model on a CUDA device"):
        DistributedShampoo(model().parameters(), comm=Communicator(MPI.COMM_SELF),
                           cuda_graphs=True)
    with pytest.raises(ValueError, match="invalid cuda_graphs"):
        DistributedShampoo(model().parameters(), comm=Communicator(MPI.COMM_SELF),
                           cuda_graphs="yes")  # type: ignore[arg-type]


@pytest.mark.mpi(min_size=2)
def test_ranks_graphed_equal_eager(comm: Communicator) -> None:
    """Several ranks: each captures its own blocks' work, which writes into the gather's
    send buffer; the gather and the update stay outside the graph."""
    eager, _ = train(False, comm=comm)
    graphed, opt = train(True, comm=comm)
    assert_same(graphed, eager)
    assert opt.step_graph is not None and opt.step_graph.replays == 5
