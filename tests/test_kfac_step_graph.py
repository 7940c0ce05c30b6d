"""K-FAC's captured step (``cuda_graphs``), its plumbing checked on the CPU.

A CUDA graph cannot be captured here, so these tests give the step's
:class:`~kfac_hpc.step_graph.StepGraph` the recorder of
:mod:`recorded_graph`, which replays the captured ATen operators on the same tensors
with the same scalars and runs no Python, as a CUDA graph does, with the GPU path and
the stacks forced on CPU tensors (as on CUDA: the KL clip's ν stays a device tensor, the
layers of one shape are one stack). What is checked: the gradients copied into the
static buffers and back, ``.grad`` pointing at the buffers only while capturing, the
learning rate and the KL bound read from tensors (a value taken from Python at each step
would replay as captured), no host read in the captured work, when a key captures,
replays or runs eagerly, and that the results are the eager step's, bit for bit. That
CUDA replays the same kernels is checked on a GPU (tests/gpu/test_step_graph_gpu.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from mpi4py import MPI
from recorded_graph import RecordedGraph
from torch import Tensor, nn

from kfac_hpc import KFACPreconditioner, step_graph
from kfac_hpc.comm import Communicator
from kfac_hpc.kfac import layers, linalg, stacked, statistics_groups
from kfac_hpc.step_graph import StepGraph

STEPS = 8


@pytest.fixture
def gpu_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every device takes the GPU path, with stacks, and captures with the recorder."""
    for module in (linalg, layers, statistics_groups):
        monkeypatch.setattr(module, "uses_gpu_path", lambda device: True)
    monkeypatch.setattr(stacked, "STACKED_DEVICES", frozenset({"cpu"}))
    monkeypatch.setattr(step_graph, "supported", lambda device: True)
    monkeypatch.setattr(step_graph, "new_graph", RecordedGraph)
    monkeypatch.setattr(step_graph, "new_pool", lambda: None)
    monkeypatch.setattr(step_graph, "new_stream", lambda device: None)
    yield


class Net(nn.Module):
    """Three same-shaped convolutions (one stack), a convolution and a biased Linear."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Conv2d(3, 6, 3, padding=1)
        self.body = nn.Sequential(*(nn.Conv2d(6, 6, 3, padding=1, bias=False)
                                    for _ in range(3)))
        self.head = nn.Linear(6, 5)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.stem(x))
        for conv in self.body:
            h = torch.relu(conv(h)) + h
        return self.head(h.mean(dim=(2, 3)))


def batches(n: int) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(4, 3, 6, 6, generator=g, dtype=torch.float64),
             torch.randint(0, 5, (4,), generator=g)) for _ in range(n)]


Hook = Callable[[int, nn.Module, KFACPreconditioner], None]


def train(graphed: bool | None, *, steps: int = STEPS, before_step: Hook | None = None,
          model: Callable[[], nn.Module] = Net,
          **options: Any) -> tuple[list[dict[str, Tensor]], KFACPreconditioner]:
    """Train ``model()`` (:class:`Net`) in float64; every step's gradients after ``step()``.

    Each step must leave every ``.grad`` that backward made the same tensor.
    """
    model = model().double()
    settings: dict[str, Any] = dict(damping=0.01, lr=lambda k: 0.1 / (1 + k), kl_clip=1e-3,
                                    inv_update_steps=3, factor_dtype=torch.float64,
                                    inv_dtype=torch.float64)
    settings.update(options)
    settings.setdefault("comm", Communicator(MPI.COMM_SELF))
    pre = KFACPreconditioner(model, cuda_graphs=graphed, **settings)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    grads = []
    for k, (x, y) in enumerate(batches(steps)):
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        if before_step is not None:
            before_step(k, model, pre)
        made = [p.grad for p in model.parameters()]
        pre.step()
        assert all(g is None or p.grad is g for p, g in zip(model.parameters(), made)), k
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()
                      if p.grad is not None})
        opt.step()
    pre.close()
    return grads, pre


def assert_same(a: list[dict[str, Tensor]], b: list[dict[str, Tensor]]) -> None:
    assert len(a) == len(b)
    for k, (ga, gb) in enumerate(zip(a, b)):
        assert ga.keys() == gb.keys(), k
        for name in ga:
            assert torch.equal(ga[name], gb[name]), (k, name)


def test_graphed_steps_equal_eager_steps(gpu_path: None) -> None:
    """Decompositions renewed at steps 0, 3 and 6: each of those steps captures, and it
    and the steps up to the next replay (all 8), with a learning rate that changes at every
    step (read by the KL clip from its tensor)."""
    eager, _ = train(False)
    held: list[int] = []
    graphed, pre = train(True, before_step=lambda k, model, pre: held.append(
        pre.memory_bytes().get("graph buffers", -1)))
    assert_same(graphed, eager)
    grads = sum(p.numel() * 8 for p in Net().parameters())  # float64: every layer's
    assert held == [0] + [grads] * (STEPS - 1)  # from the first capture on
    graph = pre.step_graph
    assert graph is not None
    assert (graph.captures, graph.replays) == (3, 8)
    assert pre.stack_groups, "the network has a stack"
    assert graph.buffer_bytes() == 0, "close() releases the buffers"


def test_with_decompositions_in_the_background(gpu_path: None) -> None:
    """With ``decomposition_lag`` the renewals started at steps 3 and 6 are installed a
    step later (computed in a worker thread meanwhile): steps 0, 4 and 7 capture."""
    eager, _ = train(False, decomposition_lag=1)
    graphed, pre = train(True, decomposition_lag=1)
    assert_same(graphed, eager)
    assert pre.step_graph is not None
    assert (pre.step_graph.captures, pre.step_graph.replays) == (3, 8)


def test_without_kl_clip(gpu_path: None) -> None:
    eager, _ = train(False, kl_clip=None)
    graphed, pre = train(True, kl_clip=None)
    assert_same(graphed, eager)
    assert pre.step_graph is not None and pre.step_graph.replays == 8


def test_a_key_that_changes_at_every_step_never_captures(gpu_path: None) -> None:
    """A damping of every step changes the key at every step: step 0 captures; its graph
    serves no later step, so the next keys wait to repeat, and never do: eager from step 1."""
    eager, _ = train(False, damping=lambda k: 0.01 * (1 + k))
    graphed, pre = train(True, damping=lambda k: 0.01 * (1 + k))
    assert_same(graphed, eager)
    assert pre.step_graph is not None
    assert (pre.step_graph.captures, pre.step_graph.replays) == (1, 1)


def test_a_layer_without_gradient_changes_the_key(gpu_path: None) -> None:
    """At step 2 the head has no gradient: a new key, captured; step 3 renews the
    decompositions, a new key again while step 2's graph served no later step, so step 3
    runs eagerly and step 4 captures; step 6 captures (step 4's graph served step 5)."""
    def drop_head(k: int, model: nn.Module, pre: KFACPreconditioner) -> None:
        if k == 2:
            model.head.weight.grad = None  # type: ignore[union-attr]
            model.head.bias.grad = None  # type: ignore[union-attr]

    eager, _ = train(False, before_step=drop_head)
    graphed, pre = train(True, before_step=drop_head)
    assert_same(graphed, eager)
    assert pre.step_graph is not None
    assert (pre.step_graph.captures, pre.step_graph.replays) == (4, 7)  # all but step 3


def test_a_bias_without_gradient_runs_eagerly(gpu_path: None) -> None:
    """At step 1 the head's bias has no gradient but its weight has: the step creates the
    bias's ``.grad`` (as eagerly), so it runs eagerly and releases the graph; step 2
    captures anew; step 3 renews the decompositions, a new key while step 2's graph
    served no later step, so it runs eagerly and step 4 captures; step 6 captures."""
    def drop_bias(k: int, model: nn.Module, pre: KFACPreconditioner) -> None:
        if k == 1:
            model.head.bias.grad = None  # type: ignore[union-attr]

    eager, _ = train(False, before_step=drop_bias)
    graphed, pre = train(True, before_step=drop_bias)
    assert_same(graphed, eager)
    assert "head.bias" in graphed[1]
    assert pre.step_graph is not None
    assert (pre.step_graph.captures, pre.step_graph.replays) == (4, 6)  # not steps 1, 3


def test_a_frozen_bias_does_not_keep_the_steps_eager(gpu_path: None) -> None:
    """The head's bias frozen: K-FAC does not write it, so its missing gradient is no
    reason to run eagerly; every step runs from a graph (steps 0, 3 and 6 capture)."""
    def freeze(k: int, model: nn.Module, pre: KFACPreconditioner) -> None:
        model.head.bias.requires_grad_(False)  # type: ignore[union-attr]

    def frozen_net() -> Net:
        net = Net()
        net.head.bias.requires_grad_(False)
        return net

    eager, _ = train(False, model=frozen_net)
    graphed, pre = train(True, model=frozen_net)
    assert_same(graphed, eager)
    assert pre.step_graph is not None
    assert (pre.step_graph.captures, pre.step_graph.replays) == (3, 8)


def test_an_eager_step_with_another_damping_releases_the_graph(gpu_path: None) -> None:
    """At step 4 the head's bias has no gradient (an eager step) and the damping differs:
    the eager step rebuilds the solves (the decompositions' generation stays), which the
    graph captured at step 3 read. Step 5, with step 3's damping and key again, must not
    replay that graph (the recorder raises when a replay reads freed memory): it captures
    anew; step 6 renews the decompositions while step 5's graph served no later step, so
    it runs eagerly and step 7 captures."""
    def damping(k: int) -> float:
        return 0.02 if k == 4 else 0.01

    def drop_bias(k: int, model: nn.Module, pre: KFACPreconditioner) -> None:
        if k == 4:
            model.head.bias.grad = None  # type: ignore[union-attr]

    eager, _ = train(False, damping=damping, before_step=drop_bias)
    graphed, pre = train(True, damping=damping, before_step=drop_bias)
    assert_same(graphed, eager)
    assert pre.step_graph is not None
    assert (pre.step_graph.captures, pre.step_graph.replays) == (4, 6)  # not steps 4, 6


class InterruptedGraph(RecordedGraph):
    """A recorder whose second capture is interrupted (a ``KeyboardInterrupt``)."""

    captures = 0

    def capture(self, work: Callable[[], None], warm_up: bool) -> None:
        InterruptedGraph.captures += 1
        if InterruptedGraph.captures == 2:
            raise KeyboardInterrupt
        super().capture(work, warm_up)


def test_an_interrupted_capture_releases_the_graph(gpu_path: None,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The capture of step 2's new key (the head without gradients) is interrupted after
    the static buffers were remade for it. The graph of step 0's key, whose buffers are
    gone, must not replay at step 3 (step 0's key again: a replay on the wrong buffers
    fails, or reads freed memory, which the recorder raises on): step 3 captures anew and
    step 4 replays it."""
    monkeypatch.setattr(step_graph, "new_graph", InterruptedGraph)
    monkeypatch.setattr(InterruptedGraph, "captures", 0)
    model = Net().double()
    pre = KFACPreconditioner(model, cuda_graphs=True, damping=0.01, inv_update_steps=100,
                             kl_clip=1e-3, lr=0.1, factor_dtype=torch.float64,
                             inv_dtype=torch.float64, comm=Communicator(MPI.COMM_SELF))
    for k, (x, y) in enumerate(batches(5)):
        model.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        if k == 2:
            model.head.weight.grad = model.head.bias.grad = None
            with pytest.raises(KeyboardInterrupt):
                pre.step()
            pre.steps += 1
        else:
            pre.step()
    graph = pre.step_graph
    assert graph is not None and graph.disabled is None
    assert (graph.captures, graph.replays) == (2, 4)  # steps 0 and 3 capture; 0, 1, 3, 4 run
    pre.close()


class RefusedGraph(RecordedGraph):
    """A recorder whose every capture fails as CUDA refuses one."""

    def capture(self, work: Callable[[], None], warm_up: bool) -> None:
        raise RuntimeError("operation not permitted when stream is capturing")


def test_capture_failure_warns_and_runs_eagerly(gpu_path: None,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    eager, _ = train(False)
    monkeypatch.setattr(step_graph, "new_graph", RefusedGraph)
    with pytest.warns(RuntimeWarning, match="not permitted when stream is capturing"):
        graphed, pre = train(True)
    assert_same(graphed, eager)
    graph = pre.step_graph
    assert graph is not None and graph.disabled is not None
    assert (graph.captures, graph.replays) == (0, 0)


def test_a_fold_that_fails_after_a_replay_leaves_grad_untouched(
        gpu_path: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between inverse updates the factors fold after preconditioning; when that fold
    raises, ``.grad`` keeps backward's gradients: the replay's results stay in its buffers."""
    before: dict[str, Tensor] = {}
    models: list[nn.Module] = []

    def fail_at_2(k: int, model: nn.Module, pre: KFACPreconditioner) -> None:
        models[:] = [model]
        if k == 2:
            before.update((n, p.grad.clone()) for n, p in model.named_parameters())

            def raises(*args: Any) -> None:
                raise RuntimeError("injected fold failure")

            monkeypatch.setattr(pre, "_update_factors", raises)

    with pytest.raises(RuntimeError, match="injected fold failure"):
        train(True, before_step=fail_at_2)
    for name, p in models[0].named_parameters():
        assert torch.equal(p.grad, before[name]), name


def test_a_new_graph_takes_the_held_graphs_pool(gpu_path: None,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A new key is captured into the pool of the graph it replaces (never replayed
    again); a pool whose graph was dropped is not captured into again (PyTorch asserts on
    it), so after a key that waited a new pool is made. The head without gradient at
    step 2 as in :func:`test_a_layer_without_gradient_changes_the_key`: captures at steps
    0, 2 (into step 0's pool), 4 (a new pool: step 3 waited and dropped the graph) and 6
    (into step 4's)."""
    pools: list[object] = []
    used: list[object] = []
    streams: list[object] = []

    class Recording(RecordedGraph):
        def __init__(self, device: torch.device, pool: object, stream: object) -> None:
            super().__init__(device, pool, stream)
            used.append(pool)

    def drop_head(k: int, model: nn.Module, pre: KFACPreconditioner) -> None:
        if k == 2:
            model.head.weight.grad = None  # type: ignore[union-attr]
            model.head.bias.grad = None  # type: ignore[union-attr]

    monkeypatch.setattr(step_graph, "new_graph", Recording)
    monkeypatch.setattr(step_graph, "new_pool", lambda: pools.append(object()) or pools[-1])
    monkeypatch.setattr(step_graph, "new_stream",
                        lambda device: streams.append(object()) or streams[-1])
    _, pre = train(True, before_step=drop_head)
    assert pre.step_graph is not None and pre.step_graph.captures == 4
    assert len(pools) == 2 and used == [pools[0], pools[0], pools[1], pools[1]]
    assert len(streams) == 1


def test_the_capture_runs_the_idempotent_work_first(gpu_path: None) -> None:
    """K-FAC's captured work writes nothing but the graph's buffers: its capture runs it
    once first (lazy initialisations, the solves built outside the capture)."""
    _, pre = train(True, steps=2)
    assert pre.step_graph is not None and pre.step_graph.warm_up


def test_cuda_graphs_need_a_cuda_model() -> None:
    with pytest.raises(ValueError, match="cuda_graphs=True needs the model on a CUDA device"):
        KFACPreconditioner(Net(), comm=Communicator(MPI.COMM_SELF), cuda_graphs=True)
    with pytest.raises(TypeError, match="cuda_graphs must be True, False or None"):
        KFACPreconditioner(Net(), comm=Communicator(MPI.COMM_SELF),
                           cuda_graphs="yes")  # type: ignore[arg-type]


def test_the_default_follows_the_device_list(gpu_path: None,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """``cuda_graphs=None`` (the default) captures on the device types that
    ``step_graph.DEFAULT_DEVICES`` names, with the steps ``True`` gives; elsewhere none."""
    _, pre = train(None, steps=2)
    assert pre.step_graph is None
    monkeypatch.setattr(step_graph, "DEFAULT_DEVICES", frozenset({"cpu"}))
    eager, _ = train(False)
    defaulted, pre = train(None)
    assert pre.step_graph is not None and pre.step_graph.replays == STEPS
    assert_same(defaulted, eager)


def run_driver(comm: Communicator, out: Path) -> Any:
    """``kfac-hpc train`` (digits, MLP, K-FAC) for 7 steps, inverses every 3."""
    from kfac_hpc.train.config import TrainConfig
    from kfac_hpc.train.loop import train as train_driver

    cfg = TrainConfig(epochs=1, max_steps=7, factor_update_steps=1, inv_update_steps=3,
                      progress=False, threads=1, out=str(out))
    return cfg, train_driver(cfg, comm, verbose=False)


def test_the_driver_reports_the_graph(gpu_path: None, monkeypatch: pytest.MonkeyPatch,
                                      tmp_path: Path) -> None:
    """``kfac-hpc train`` with graphs by default: its summary (table and summary.json)
    gives the captures and replays; inverses every 3 of 7 steps capture at 0, 3 and 6."""
    import json

    monkeypatch.setattr(step_graph, "DEFAULT_DEVICES", frozenset({"cpu"}))
    cfg, result = run_driver(Communicator(MPI.COMM_SELF, name="self"), tmp_path / "run")
    expected = {"captures": 3, "replays": 7, "disabled": None, "ranks": 1}
    assert result.step_graph == expected
    rows = dict(result.summary_rows(cfg))
    assert rows["step graph (CUDA, fewest of the ranks)"] == "3 captures, 7 replays"
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["step_graph"] == expected
    assert json.loads((tmp_path / "run" / "config.json").read_text())["run"]["step_graph"]


@pytest.mark.parametrize("optimizer", [
    {},  # K-FAC on SGD
    {"optimizer": "shampoo", "preconditioner": "none",
     "shampoo_options": {"precondition_frequency": 3}}], ids=["kfac", "shampoo"])
def test_a_driver_run_with_graphs_resumes_bitwise(gpu_path: None,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path,
                                                  optimizer: dict[str, Any]) -> None:
    """``kfac-hpc train`` with graphs by default, stopped at step 4 (its checkpoint taken
    between two inverse updates or root steps) and resumed: the resumed run captures
    anew and ends on the uninterrupted run's parameters, bit for bit."""
    pytest.importorskip("h5py")
    from kfac_hpc.train.config import TrainConfig
    from kfac_hpc.train.loop import train as train_driver

    monkeypatch.setattr(step_graph, "DEFAULT_DEVICES", frozenset({"cpu"}))
    comm = Communicator(MPI.COMM_SELF, name="self")

    def config(**changes: Any) -> TrainConfig:
        return TrainConfig(**{"epochs": 1, "max_steps": 9, "factor_update_steps": 1,
                              "inv_update_steps": 3, "progress": False, "threads": 1,
                              "out": str(tmp_path / "run"), "checkpoint_background": False,
                              **optimizer, **changes})

    whole = train_driver(config(), comm, verbose=False)
    polls = iter(range(1, 1000))
    first = train_driver(config(checkpoint_dir=str(tmp_path / "ckpt")), comm, verbose=False,
                         should_stop=lambda: next(polls) == 4)
    assert first.steps == 4 and first.step_graph is not None
    resumed = train_driver(config(checkpoint_dir=str(tmp_path / "ckpt"), resume="auto"),
                           comm, verbose=False)
    assert resumed.step_graph is not None and resumed.step_graph["captures"] >= 1
    assert resumed.steps == whole.steps and resumed.checksum == whole.checksum


@pytest.mark.mpi(min_size=2)
def test_the_driver_reports_every_ranks_graph(comm: Communicator, gpu_path: None,
                                              monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    """On several ranks the summary gives the fewest replays and names the rank whose
    capture failed (its steps ran eagerly; the others' replayed)."""
    monkeypatch.setattr(step_graph, "DEFAULT_DEVICES", frozenset({"cpu"}))
    if comm.rank == 1:
        monkeypatch.setattr(step_graph, "new_graph", RefusedGraph)
    with pytest.warns(RuntimeWarning) if comm.rank == 1 else contextlib.nullcontext():
        _, result = run_driver(comm, tmp_path / "run")
    assert result.step_graph is not None
    assert result.step_graph["ranks"] == comm.size
    assert result.step_graph["replays"] == 0
    assert result.step_graph["disabled"].startswith("rank 1: RuntimeError")


def test_the_default_leaves_large_buffers_eager(gpu_path: None,
                                                monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    """Under the default, static buffers above ``DEFAULT_BUFFER_SHARE`` of the device's
    memory are not made: no capture, no warning, the eager steps; the report says why.
    ``cuda_graphs=True`` captures whatever the size."""
    monkeypatch.setattr(step_graph, "DEFAULT_DEVICES", frozenset({"cpu"}))
    monkeypatch.setattr(step_graph, "DEFAULT_BUFFER_SHARE", 1e-12)
    eager, _ = train(False)
    with caplog.at_level("INFO", logger="kfac_hpc"):
        defaulted, pre = train(None)
    assert_same(defaulted, eager)
    assert pre.step_graph is not None and pre.step_graph.captures == 0
    assert "above the default's bound" in str(pre.step_graph.disabled)
    assert "above the default's bound" in caplog.text
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    _, asked = train(True)
    assert asked.step_graph is not None and asked.step_graph.replays == STEPS


def test_kl_clip_factor_reads_tensors_as_floats(gpu_path: None) -> None:
    """ν from 0-dim float64 tensors of lr and κ equals ν from Python floats, bit for bit."""
    g = torch.Generator().manual_seed(0)
    for total in torch.randn(20, generator=g, dtype=torch.float64).abs() * 10.0 ** torch.arange(
            -6, 14, dtype=torch.float64):
        for lr, kappa in ((0.1, 1e-3), (0.037, 2.5e-4), (1.3, 1e-2)):
            from_floats = linalg.kl_clip_factor(total, lr, kappa)
            from_tensors = linalg.kl_clip_factor(
                total, torch.tensor(lr, dtype=torch.float64),
                torch.tensor(kappa, dtype=torch.float64))
            assert isinstance(from_floats, Tensor) and isinstance(from_tensors, Tensor)
            assert torch.equal(from_floats, from_tensors), (float(total), lr, kappa)


def test_step_graph_refuses_a_cpu_device_by_default() -> None:
    assert not step_graph.supported(torch.device("cpu"))
    with pytest.raises(ValueError, match="CUDA device"):
        StepGraph(torch.device("cpu"))


@pytest.mark.mpi(min_size=2)
def test_two_ranks_graphed_equal_eager(comm: Communicator, gpu_path: None) -> None:
    """comm-opt on two ranks: every rank preconditions every layer (nothing exchanged
    between preconditioning and the clip), so the step replays; the same gradients."""
    eager, _ = train(False, comm=comm)
    graphed, pre = train(True, comm=comm)
    assert_same(graphed, eager)
    assert pre.step_graph is not None and pre.step_graph.replays == STEPS


@pytest.mark.mpi(min_size=2)
def test_exchanged_gradients_run_without_graph(comm: Communicator, gpu_path: None,
                                               monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    """mem-opt: each layer's gradient worker sends its preconditioned gradient to the
    others before the clip, so ``cuda_graphs`` leaves the steps eager, and says so."""
    with caplog.at_level("WARNING", logger="kfac_hpc"):
        pre = KFACPreconditioner(Net().double(), comm=comm, strategy="mem-opt",
                                 cuda_graphs=True)
    assert pre.step_graph is None
    assert "run without a graph" in caplog.text
    pre.close()


@pytest.mark.mpi(min_size=2)
def test_exchanged_gradients_by_default_run_without_graph_quietly(
        comm: Communicator, gpu_path: None, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Where the device list turns graphs on by default, mem-opt runs its steps eagerly
    without a warning: nobody asked for graphs."""
    monkeypatch.setattr(step_graph, "DEFAULT_DEVICES", frozenset({"cpu"}))
    with caplog.at_level("WARNING", logger="kfac_hpc"):
        pre = KFACPreconditioner(Net().double(), comm=comm, strategy="mem-opt")
    assert pre.step_graph is None
    assert "without a graph" not in caplog.text
    pre.close()


def test_the_recorder_replays_as_a_graph_would() -> None:
    """The stand-in's own contract: replays write into the captured tensors with the
    captured scalars (Python does not run again), and a host read cannot be captured."""
    x, out = torch.ones(3), torch.zeros(3)
    scale = [2.0]

    def work() -> None:
        y = x * scale[0]  # a new tensor: its address is fixed at capture
        out.copy_(y + 1)

    graph = RecordedGraph(torch.device("cpu"))
    graph.capture(work, warm_up=False)
    assert torch.equal(out, torch.zeros(3)), "a capture changes no value"
    x.fill_(5.0)
    scale[0] = 100.0
    graph.replay()
    assert torch.equal(out, torch.full((3,), 11.0))  # 5 * 2 + 1: the scalar of the capture
    with pytest.raises(RuntimeError, match="host read"):
        RecordedGraph(torch.device("cpu")).capture(lambda: float(x.sum()) and None, False)
