"""The preconditioning part of a K-FAC step as one CUDA graph (``cuda_graphs=True``).

On a GPU, K-FAC's stale step is host-bound: preconditioning every layer, the KL clip and
the writes to ``.grad`` are several hundred operator dispatches for a few milliseconds of
device work (benchmarks/RESULTS.md, GPU). Between two inverse updates that part runs the
same kernels on the same shapes at every step, so it can be captured once as a CUDA
graph and replayed: one launch instead of the dispatches.

How (:class:`StepGraph`):

* the gradients are copied into static buffers (one multi-tensor copy); the graph reads
  them there and writes its results there; the results are copied back into ``.grad``
  (one multi-tensor copy). While the graph is captured, each parameter's ``.grad`` *is*
  its static buffer, so what is captured is the eager step's own code;
* the learning rate and the KL bound, which schedules may change at every step, are 0-dim
  float64 device tensors the graph reads (their products equal the host's:
  :func:`~kfac_hpc.kfac.linalg.kl_clip_factor`);
* everything else the captured kernels depend on makes up the graph's key
  (:class:`GraphKey`): the decompositions' generation
  (:attr:`~kfac_hpc.kfac.decompositions.Decompositions.generation`), the damping, which
  parameters have a gradient (and its dtype) and whether the KL clip is on.

A new key drops the graph (its memory returns to the graph's pool) and is captured at
once (after a warm-up run on the capture's side stream, so that lazy initialisations
happen outside the capture), then replayed, at that step and the next ones with the same
key. With decompositions renewed every ``inv_update_steps``, each inverse step captures
and the steps up to the next one replay. When a graph served no step after the one that
captured it, keys are changing too often: a new key then waits for the next step to
repeat it before it is captured (running eagerly meanwhile), so a key that changes at
every step (a damping schedule of every step) costs one capture and then only its
comparison. A capture that fails turns the graphs off for the run, with a warning
naming the cause; the step then runs eagerly, as it would have.

Memory: the static buffers (one copy of the preconditioned layers' gradients) and the
graph's pool, which keeps the step's intermediates (the stacked gradients and their
products) alive between replays.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

__all__ = ["CudaGraph", "Graph", "GraphKey", "StepGraph", "supported"]

log = logging.getLogger("kfac_hpc")

#: ``body(lr, kl_clip)``: the captured work, given the learning rate and the KL bound as
#: 0-dim float64 tensors (``kl_clip`` ``None`` without clipping).
Body = Callable[[Tensor, "Tensor | None"], None]


def supported(device: torch.device) -> bool:
    """Whether ``device`` can capture graphs (a CUDA device)."""
    return device.type == "cuda"


class Graph(Protocol):
    """Work recorded once and replayed."""

    def capture(self, work: Callable[[], None]) -> None:
        """Record ``work`` (which may run it, once, to warm up)."""

    def replay(self) -> None:
        """Run what was recorded."""


class CudaGraph:
    """A ``torch.cuda.CUDAGraph`` captured on a side stream, replayed on the current one."""

    def __init__(self, device: torch.device, pool: Any) -> None:
        """Nothing recorded yet.

        Args:
            device: The CUDA device.
            pool: The memory pool of the captures (``torch.cuda.graph_pool_handle()``).
        """
        self.device = device
        self.pool = pool
        self._graph: torch.cuda.CUDAGraph | None = None

    def capture(self, work: Callable[[], None]) -> None:
        """Run ``work`` once on a side stream (warm-up), then capture it there."""
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            work()  # lazy initialisations (cuBLAS workspaces of this stream) happen here
            # thread-local: decompositions of a background renewal may run in other
            # threads meanwhile (decomposition_lag); only this thread must not sync
            graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                work()
            except BaseException:
                # the capture is invalid already: ending it may raise, the first error counts
                with contextlib.suppress(RuntimeError):
                    graph.capture_end()
                raise
            graph.capture_end()
        current.wait_stream(side)
        self._graph = graph

    def replay(self) -> None:
        """Launch the captured graph on the current stream."""
        assert self._graph is not None
        self._graph.replay()


@dataclass(frozen=True)
class GraphKey:
    """What a captured step depends on besides the gradients, the lr and the KL bound.

    Attributes:
        generation: The decompositions' generation.
        damping: The damping.
        grads: Per candidate parameter, in a fixed order, its gradient's dtype (``None``:
            no gradient this step).
        clips: Whether the KL clip is on.
    """

    generation: int
    damping: float
    grads: tuple[torch.dtype | None, ...]
    clips: bool


class StepGraph:
    """The captured preconditioning of a K-FAC step (module docstring).

    ``graph_type`` makes the recorder (:class:`CudaGraph` on CUDA; the CPU tests pass
    one that records and replays ATen operators, tests/recorded_graph.py).
    """

    def __init__(self, device: torch.device,
                 graph_type: Callable[[torch.device, object], Graph] | None = None) -> None:
        """Hold no graph yet.

        Args:
            device: The device of the model and of K-FAC's state.
            graph_type: Makes a recorder from the device and the pool (default:
                :class:`CudaGraph`).

        Raises:
            ValueError: ``device`` cannot capture graphs and no ``graph_type`` is given.
        """
        if graph_type is None and not supported(device):
            raise ValueError(f"cuda_graphs=True needs the model on a CUDA device, not {device}; "
                             "build the preconditioner after model.to('cuda'), or leave "
                             "cuda_graphs off")
        self.device = device
        self._graph_type = graph_type
        self._pool: object = None  # the captures' memory pool, made at the first
        self._lr = torch.zeros((), dtype=torch.float64, device=device)
        self._kl_clip = torch.zeros((), dtype=torch.float64, device=device)
        self._graph: Graph | None = None
        self._key: GraphKey | None = None  # the captured graph's
        self._served = False  # whether it ran a step after the one that captured it
        self._seen: GraphKey | None = None  # the last step's
        self._waiting = False  # for a key to repeat before capturing it
        self._grads: list[Tensor] = []  # this step's gradients, in the key's order
        self._static: list[Tensor] = []
        self.captures = 0  # graphs captured so far
        self.replays = 0  # steps that ran one (the capturing steps included)
        self.disabled: str | None = None  # why the graphs are off, after a failed capture

    def run(self, key: GraphKey, params: Sequence[Tensor], body: Body, lr: float,
            kl_clip: float | None) -> bool:
        """Run ``body`` as a graph on static copies of ``params``' gradients, if it may.

        Replays the graph of ``key``; a new key is captured first (unless the last graph
        never served a step after its capture and ``key`` is new since the last step: then
        this step runs eagerly). The results stay in the static buffers until
        :meth:`write_out`.

        Args:
            key: This step's key.
            params: The parameters whose gradients ``body`` reads and writes (those with
                a gradient, in the key's order).
            body: The step's work on ``.grad``, given the lr and the KL bound as tensors.
            lr: This step's learning rate.
            kl_clip: This step's KL bound (``None``: no clipping).

        Returns:
            Whether the graph ran (else the caller runs the step eagerly).
        """
        if self.disabled is not None:
            return False
        if key != self._key:
            unused = self._graph is not None and not self._served
            self._drop()
            seen, self._seen = self._seen, key
            if (unused or self._waiting) and key != seen:  # keys change too often: wait
                self._waiting = True
                return False
            self._waiting = False
            self._lr.fill_(lr)
            self._kl_clip.fill_(0.0 if kl_clip is None else kl_clip)
            if not self._capture(key, params, body):
                return False
        else:
            self._served = True
        self._grads = [p.grad for p in params]  # type: ignore[misc]
        torch._foreach_copy_(self._static, self._grads)
        self._lr.fill_(lr)
        self._kl_clip.fill_(0.0 if kl_clip is None else kl_clip)
        assert self._graph is not None
        self._graph.replay()
        self.replays += 1
        return True

    def write_out(self) -> None:
        """Copy the last replay's results into the gradients it read (one multi-tensor copy)."""
        torch._foreach_copy_(self._grads, self._static)
        self._grads = []

    def _capture(self, key: GraphKey, params: Sequence[Tensor], body: Body) -> bool:
        """Capture ``body`` on static buffers (allocated anew); False if it failed."""
        grads = [p.grad for p in params]
        self._static = [torch.empty_like(g) for g in grads]  # type: ignore[arg-type]
        torch._foreach_copy_(self._static, grads)  # type: ignore[arg-type]
        clip = self._kl_clip if key.clips else None

        def work() -> None:
            own = [p.grad for p in params]
            for p, static in zip(params, self._static):
                p.grad = static
            try:
                body(self._lr, clip)
            finally:
                for p, grad in zip(params, own):
                    p.grad = grad

        graph = self._new_graph()
        try:
            graph.capture(work)
        except Exception as exc:  # any failure: eager from now on
            self.disabled = f"{type(exc).__name__}: {exc}"
            self._static = []
            message = (f"cuda_graphs: capturing K-FAC's preconditioning failed "
                       f"({self.disabled}); the steps run without graphs from now on")
            log.warning(message)
            warnings.warn(message, RuntimeWarning, stacklevel=4)
            return False
        self._graph, self._key, self._served = graph, key, False
        self.captures += 1
        return True

    def buffer_bytes(self) -> int:
        """Bytes of the static gradient buffers held now."""
        return sum(t.numel() * t.element_size() for t in self._static)

    def release(self) -> None:
        """Forget the graph, its buffers and the last key (a later step starts afresh)."""
        self._drop()
        self._seen, self._waiting, self._grads = None, False, []

    def _new_graph(self) -> Graph:
        """A recorder (``graph_type``'s, or a CUDA graph in the captures' pool)."""
        if self._graph_type is not None:
            return self._graph_type(self.device, None)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return CudaGraph(self.device, self._pool)

    def _drop(self) -> None:
        """Forget the graph and its buffers (its memory returns to the pool)."""
        self._graph, self._key = None, None
        self._static = []
