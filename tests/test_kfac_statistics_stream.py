"""Statistics on a side stream (``kfac.statistics_stream``): the protocol the capture and
the factor update follow, checked with a recording stand-in for the CUDA stream (the
GPU suite checks the real one: bitwise the same training)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import pytest
import torch
from mpi4py import MPI
from shared_cases import small_cnn, small_cnn_batches, train_kfac
from torch import Tensor

from kfac_hpc import KFACPreconditioner
from kfac_hpc.comm import Communicator
from kfac_hpc.kfac import capture, factor_update, statistics_stream
from kfac_hpc.kfac.statistics_stream import SameStream


class RecordingStream:
    """Stands in for :class:`~kfac_hpc.kfac.statistics_stream.SideStream` on the CPU."""

    made: list[RecordingStream] = []

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.inside = False
        self.pending = 0  # statistics run since the last join
        self.inputs: list[Tensor] = []
        self.released: list[int] = []
        RecordingStream.made.append(self)

    def run(self, inputs: Sequence[Tensor], work: Callable[[], None]) -> None:
        self.inside = True
        try:
            work()
        finally:
            self.inside = False
        self.inputs.extend(inputs)
        self.pending += 1

    def join(self) -> None:
        self.pending = 0

    def release(self, sums: Iterable[Tensor]) -> None:
        self.released.extend(id(t) for t in sums)


@pytest.fixture
def recording(monkeypatch: pytest.MonkeyPatch) -> list[RecordingStream]:
    """CPU statistics take the side-stream path, with the recording stand-in."""
    RecordingStream.made = []
    monkeypatch.setattr(statistics_stream, "SIDE_STREAM_DEVICES", frozenset({"cpu"}))
    monkeypatch.setattr(statistics_stream, "SideStream", RecordingStream)
    return RecordingStream.made


def _train(steps: int, **options) -> tuple[torch.nn.Module, KFACPreconditioner]:
    model = small_cnn()
    pre = KFACPreconditioner(model, comm=Communicator(MPI.COMM_SELF), damping=0.01,
                             inv_update_steps=2, **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train_kfac(model, opt, pre, small_cnn_batches(steps))
    pre.close()
    return model, pre


def test_statistics_run_on_the_stream_and_are_joined_before_they_are_read(monkeypatch,
                                                                            recording):
    """Every factor is computed and added inside ``run`` (given the tensor it reads),
    the factor update joins before it reads a sum, and every sum is released before the
    capture drops it."""
    added: list[bool] = []
    real_add = capture.LayerStatistics.add

    def add(self, factor: str, value: Tensor) -> None:  # type: ignore[no-untyped-def]
        added.append(recording[0].inside)
        real_add(self, factor, value)

    sums_read: list[int] = []
    real_sums = factor_update.FactorUpdate._captured_sums

    def captured_sums(self):  # type: ignore[no-untyped-def]
        sums_read.append(recording[0].pending)
        return real_sums(self)

    dropped: list[int] = []
    real_clear = capture.StatisticsCapture.clear

    def clear(self) -> None:  # type: ignore[no-untyped-def]
        dropped.extend(id(t) for s in self.stats.values() for t in s.sums.values()
                       if t is not None)
        real_clear(self)

    monkeypatch.setattr(capture.LayerStatistics, "add", add)
    monkeypatch.setattr(factor_update.FactorUpdate, "_captured_sums", captured_sums)
    monkeypatch.setattr(capture.StatisticsCapture, "clear", clear)
    _, pre = _train(3)
    assert len(recording) == 1 and pre.capture.stream is recording[0]
    layers = len(pre.layers)
    assert added == [True] * (2 * layers * 3)  # A and G of every layer, 3 steps
    assert len(recording[0].inputs) == 2 * layers * 3
    assert sums_read == [0, 0, 0]  # joined before every read
    assert sorted(recording[0].released) == sorted(dropped) and len(dropped) == 2 * layers * 3


def test_the_side_stream_path_trains_like_the_default(recording):
    with_stream, _ = _train(4)
    assert recording
    RecordingStream.made.clear()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(statistics_stream, "SIDE_STREAM_DEVICES", frozenset())
        plain, pre = _train(4)
    assert isinstance(pre.capture.stream, SameStream) and not recording
    for p, q in zip(with_stream.parameters(), plain.parameters()):
        assert torch.equal(p, q)


def test_the_pipeline_keeps_the_statistics_on_the_pass_stream(recording):
    """``overlap`` posts reductions from the hooks: no side stream with it."""
    _, pre = _train(2, overlap=True)
    assert isinstance(pre.capture.stream, SameStream) and not recording


def test_default_is_the_pass_stream() -> None:
    assert frozenset() == statistics_stream.SIDE_STREAM_DEVICES
    assert isinstance(statistics_stream.statistics_stream(torch.device("cpu"), pipelined=False),
                      SameStream)


class DeviceScaler:
    """A GradScaler whose scale is a device tensor (``_get_scale_async``), as on CUDA."""

    def is_enabled(self) -> bool:
        return True

    def get_scale(self) -> float:
        return 2.0

    def _get_scale_async(self) -> Tensor:
        return torch.tensor(2.0, dtype=torch.float64)


def test_a_device_loss_scale_is_among_what_the_statistics_read(recording):
    """Under AMP the loss scale G divides by is a tensor made on the pass's stream: it is
    handed to ``run`` with the gradient, so its memory outlives the side stream's use."""
    model = small_cnn()
    pre = KFACPreconditioner(model, comm=Communicator(MPI.COMM_SELF), damping=0.01,
                             grad_scaler=DeviceScaler())  # type: ignore[arg-type]
    x, y = small_cnn_batches(1)[0]
    torch.nn.functional.cross_entropy(model(x), y).mul(2.0).backward()
    pre.step()
    pre.close()
    scalars = [t for t in recording[0].inputs if t.dim() == 0]
    assert len(scalars) == len(pre.layers)  # one per G
