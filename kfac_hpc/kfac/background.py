"""Decompositions computed in the background while training goes on.

K-FAC's inverse update (an eigendecomposition of every factor: 1.5 s for ResNet-50 on
an H200) stalls the step that runs it. With ``decomposition_lag = L > 0`` the
preconditioner snapshots the factors at an inverse step ``k``, hands them to a
:class:`BackgroundJob` (a worker thread; on CUDA its own stream, which first waits for
the work queued so far) and keeps preconditioning with the previous decompositions;
at step ``k + L`` (fixed in advance) it waits for the job and swaps the new ones in.
The results depend only on the snapshot and the step numbers: the same on every run,
whatever the thread's timing. The solvers release the GIL, so the main thread keeps
queueing forward, backward and preconditioning kernels meanwhile.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from kfac_hpc.kfac.exchange import Piece, PieceKey
from kfac_hpc.kfac.placement import FactorKey
from kfac_hpc.solves import load_cuda_linalg

__all__ = ["BackgroundJob", "Decomposed"]


@dataclass
class Decomposed:
    """What a rank computed for one inverse update.

    The pieces it broadcasts (factors it owns), those of the local factors every worker decomposes
    itself, and the factors whose decomposition failed (sent as invalid; agreed when installed).
    """

    owned: dict[PieceKey, Piece] = field(default_factory=dict)
    local: dict[PieceKey, Piece] = field(default_factory=dict)
    failures: dict[FactorKey, BaseException] = field(default_factory=dict)

    def tensors(self) -> Iterable[Tensor]:
        """Yield every tensor piece (owned and local)."""
        for pieces in (self.owned, self.local):
            yield from (p for p in pieces.values() if isinstance(p, Tensor))


class BackgroundJob:
    """``compute()`` in a daemon thread, on a side stream on CUDA; ``result()`` joins.

    ``swap_at``: the step whose preconditioning first uses the result; ``inputs``: the
    tensors ``compute`` reads (on CUDA marked as used on the side stream, so their
    memory is not reused before the side stream is done with them).
    """

    def __init__(self, compute: Callable[[], Decomposed], device: torch.device,
                 swap_at: int, stream: torch.cuda.Stream | None = None,
                 inputs: Iterable[Tensor] = ()) -> None:
        """Start ``compute()`` in the worker thread.

        Args:
            compute: What the job computes (its decompositions).
            device: The device of the factors.
            swap_at: The step whose preconditioning first uses the result.
            stream: The side stream to run on (CUDA), or ``None``.
            inputs: The tensors ``compute`` reads (marked as used on the side stream).
        """
        self.swap_at = swap_at
        self._device = device
        self._stream = stream
        self._result: Decomposed | None = None
        self._error: BaseException | None = None
        if stream is not None:  # the snapshot was queued on the current stream
            load_cuda_linalg(device)  # the thread's first decomposition must not load it
            stream.wait_stream(torch.cuda.current_stream(device))
            for t in inputs:
                if t.device.type == "cuda":
                    t.record_stream(stream)
        # not a daemon: the interpreter's exit joins it (a daemon thread killed inside
        # torch's solvers at exit aborted the process, status 134, when a script ended
        # with a renewal pending and no close())
        self._thread = threading.Thread(target=self._run, args=(compute,),
                                        name="kfac-decompositions", daemon=False)
        self._thread.start()

    def _run(self, compute: Callable[[], Decomposed]) -> None:
        try:
            if self._stream is not None:
                with torch.cuda.device(self._device), torch.cuda.stream(self._stream):
                    self._result = compute()
            else:
                self._result = compute()
        except BaseException as exc:  # re-raised on the main thread by result()
            self._error = exc

    def result(self) -> Decomposed:
        """Wait for the job and return its result.

        Wait for the job; on CUDA the current stream then waits for the side stream,
        and every result tensor is marked as used on it (the caching allocator must not
        hand its memory to the side stream while the main stream still reads it).
        """
        self._thread.join()
        if self._error is not None:
            raise RuntimeError("K-FAC's background decompositions failed") from self._error
        assert self._result is not None
        if self._stream is not None:
            current = torch.cuda.current_stream(self._device)
            current.wait_stream(self._stream)
            for t in self._result.tensors():
                if t.device.type == "cuda":
                    t.record_stream(current)
        return self._result

    def cancel(self) -> None:
        """Wait for the thread and drop its result (e.g. a checkpoint was loaded)."""
        self._thread.join()
        self._result = None
