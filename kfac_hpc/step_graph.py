"""The stale part of an optimizer step as one CUDA graph (``cuda_graphs``).

On a GPU, K-FAC's stale step and Shampoo's plain step are host-bound: several hundred
operator dispatches for a few milliseconds of device work (benchmarks/RESULTS.md, GPU).
Between two inverse updates (K-FAC: preconditioning every layer, the KL clip, the writes
to ``.grad``) or two root computations (Shampoo: the block work,
:mod:`kfac_hpc.shampoo.optimizer`) that part runs the same kernels on the same shapes at
every step, so it can be captured once as a CUDA graph and replayed: one launch instead
of the dispatches.

How (:class:`StepGraph`):

* the gradients are copied into static buffers (one multi-tensor copy); the graph reads
  them there and writes its results there; the results are copied back into ``.grad``
  (one multi-tensor copy). While the graph is captured, each parameter's ``.grad`` *is*
  its static buffer, so what is captured is the eager step's own code;
* numbers that may change at every step are device tensors the graph reads, which the
  caller fills before each run (K-FAC's learning rate and KL bound, 0-dim float64:
  their products equal the host's, :func:`~kfac_hpc.kfac.linalg.kl_clip_factor`;
  Shampoo's bias corrections);
* everything else the captured kernels depend on makes up the graph's key, which the
  caller gives (K-FAC's: the decompositions' generation, the damping, which parameters
  have a gradient and whether the KL clip is on; Shampoo's: its state's generation, the
  hyper-parameters, the runs of blocks stepping and their gradients' dtypes).

A new key is captured in place of the graph held (into its memory pool, which the old
graph, never replayed again, no longer needs: a pool whose graph was freed cannot be
captured into again, and a fresh one per capture would only be freed by an
``empty_cache``), on a high-priority side stream the :class:`StepGraph` keeps (PyTorch
hands these out from a pool of its own, which the library's other side streams, of
default priority, do not draw from; small products make its cuBLAS workspaces first, so
that no lazy initialisation happens inside the capture), then replayed, at that step and
the next ones with the same key. A key that waits (below) drops the graph held. Work
that writes nothing but its buffers (K-FAC's) runs once on the current stream before
its capture and is captured at the first step of a key: with decompositions renewed every
``inv_update_steps``, each inverse step captures and the steps up to the next one
replay; when such a graph served no step after the one that captured it, keys are
changing too often, and a new key then waits for the next step to repeat it (a damping
schedule of every step costs one capture, then only its comparison). Work that updates
optimizer state (Shampoo's) always waits for a key's second step: a capture runs nothing,
and the first, eager step makes and binds the state the captured work will only update.
A capture that fails turns the graphs off for the run, with a warning naming the cause;
the step then runs eagerly, as it would have (a capture CUDA refused also leaves
PyTorch's caching allocator in capture mode, which is undone through torch's private
bindings, best effort).

Default: ``cuda_graphs=None`` (both optimizers' default) captures on the device types in
:data:`DEFAULT_DEVICES`: CUDA. On an H200 the graphs gave the eager steps' bits and
paid for K-FAC (``kfac-hpc train`` 25 % more samples/s; benchmarks/RESULTS.md, GPU,
fifth session; Shampoo's gain is not measured yet), and the whole GPU suite passed with
them on by default at 1 and 2 ranks (sixth session; ``KFAC_HPC_TEST_CUDA_GRAPHS=0`` runs
it with them off, tests/gpu/conftest.py).
Under the default, a model whose static buffers would take more than
:data:`DEFAULT_BUFFER_SHARE` of the device's memory runs eagerly (an info message; the
report says why); ``cuda_graphs=True`` captures whatever the size.

Memory: the static buffers (one copy of the gradients the work reads) and the graph's
pool, which keeps the step's intermediates (the stacked gradients and their products)
alive between replays.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

__all__ = ["DEFAULT_BUFFER_SHARE", "DEFAULT_DEVICES", "CudaGraph", "Graph", "StepGraph",
           "buffer_budget", "describe", "device_memory", "new_graph", "new_pool", "new_stream",
           "supported", "wanted"]

log = logging.getLogger("kfac_hpc")

#: The captured work; what it returns is kept (:attr:`StepGraph.output`).
Body = Callable[[], object]


#: Device types on which ``cuda_graphs=None`` captures the steps (see above).
DEFAULT_DEVICES: frozenset[str] = frozenset({"cuda"})
#: Under the default, the most of the device's memory the static gradient buffers may
#: take: a larger model runs eagerly (``cuda_graphs=True`` captures whatever the size).
DEFAULT_BUFFER_SHARE = 0.1


def supported(device: torch.device) -> bool:
    """Whether ``device`` can capture graphs (a CUDA device)."""
    return device.type == "cuda"


def device_memory(device: torch.device) -> int:
    """Bytes of memory of ``device``: a CUDA device's total, else the host's."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def buffer_budget(option: bool | None, device: torch.device) -> int | None:
    """The most bytes of static buffers a :class:`StepGraph` may hold (None: any).

    Args:
        option: ``cuda_graphs`` as given: None (the default) caps the buffers at
            :data:`DEFAULT_BUFFER_SHARE` of the device's memory.
        device: The device of the model and of the optimizer's state.
    """
    return None if option is not None else int(DEFAULT_BUFFER_SHARE * device_memory(device))


def wanted(option: bool | None, device: torch.device) -> bool:
    """Whether an optimizer given ``cuda_graphs=option`` captures its steps on ``device``.

    Args:
        option: True or False as asked; None: whether :data:`DEFAULT_DEVICES` names
            ``device``'s type.
        device: The device of the model and of the optimizer's state.
    """
    return option if option is not None else device.type in DEFAULT_DEVICES


class Graph(Protocol):
    """Work recorded once and replayed."""

    def capture(self, work: Callable[[], None], warm_up: bool) -> None:
        """Record ``work``; with ``warm_up``, run it once first."""

    def replay(self) -> None:
        """Run what was recorded."""


class CudaGraph:
    """A ``torch.cuda.CUDAGraph`` captured on a side stream, replayed on the current one."""

    def __init__(self, device: torch.device, pool: Any, stream: Any) -> None:
        """Nothing recorded yet.

        Args:
            device: The CUDA device.
            pool: The memory pool of this capture (``torch.cuda.graph_pool_handle()``).
            stream: The side stream captures run on (:func:`new_stream`).
        """
        self.device = device
        self.pool = pool
        self.stream = stream
        self._graph: torch.cuda.CUDAGraph | None = None

    def capture(self, work: Callable[[], None], warm_up: bool) -> None:
        """Capture ``work`` on the side stream (after running it once, with ``warm_up``).

        The warm-up runs on the current stream, so what it builds and keeps (K-FAC's
        stacked solves) belongs to the stream that uses it. The side stream's cuBLAS
        workspaces are made first by small products, so that no lazy initialisation
        happens inside the capture even without a warm-up (which a step that updates
        optimizer state cannot have: it would update it twice). The current stream waits
        for the side stream afterwards, whether the capture succeeded or not.
        """
        if warm_up:
            work()
        current = torch.cuda.current_stream(self.device)
        side = self.stream
        side.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(side):
                _prime_blas(self.device)
                # thread-local: decompositions of a background renewal may run in other
                # threads meanwhile (decomposition_lag); only this thread must not sync
                graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
                failure: BaseException | None = None
                try:
                    work()
                except BaseException as exc:  # the capture is invalid: end it first
                    failure = exc
                try:
                    graph.capture_end()
                except RuntimeError as exc:  # CUDA refused it: the first error counts
                    _end_failed_capture(self.device, self.pool)
                    failure = failure or exc
                if failure is not None:
                    raise failure
        finally:
            current.wait_stream(side)
        self._graph = graph

    def replay(self) -> None:
        """Launch the captured graph on the current stream."""
        assert self._graph is not None
        self._graph.replay()


def _end_failed_capture(device: torch.device, pool: Any) -> None:
    """Give the caching allocator back its normal mode after a capture CUDA refused.

    ``capture_end`` raising from ``cudaStreamEndCapture`` skips PyTorch's own
    ``endAllocateToPool``: the allocator would go on routing this stream's blocks to the
    capture's pool and keep that pool referenced (a slow leak of streams' freed blocks,
    and ``torch.cuda.empty_cache()`` failing an internal check). Best effort, through
    torch's private bindings where this torch has them.
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    for name in ("_cuda_endAllocateToPool", "_cuda_releasePool"):
        release = getattr(torch._C, name, None)
        if release is not None:
            with contextlib.suppress(RuntimeError):
                release(index, pool)


def _prime_blas(device: torch.device) -> None:
    """Small GEMMs on the current stream: its cuBLAS and cuBLASLt workspaces exist after."""
    a = torch.ones(8, 8, device=device)
    torch.addmm(a[0], a, a)  # a 1-D bias: the cuBLASLt path
    torch.addmm(a, a, a)
    torch.bmm(a[None], a[None])


def _new_stream(device: torch.device) -> Any:
    """A high-priority side stream for captures.

    Not one of the default-priority pool the library's other side streams (statistics,
    decompositions, a background renewal) are taken from. PyTorch hands out its
    high-priority streams round-robin from a small pool, so it may be a stream the
    caller trains on as well (which only makes the capture's waits on it trivial).
    """
    return torch.cuda.Stream(device, priority=-1)


#: Makes a recorder from the device, a memory pool and the side stream (the CPU tests put
#: one that records ATen operators here, tests/recorded_graph.py).
new_graph: Callable[[torch.device, Any, Any], Graph] = CudaGraph
#: Makes the memory pool of one capture (each capture its own: a pool whose graph was
#: dropped cannot be captured into again).
new_pool: Callable[[], Any] = torch.cuda.graph_pool_handle
#: Makes the side stream of one :class:`StepGraph`'s captures.
new_stream: Callable[[torch.device], Any] = _new_stream


class StepGraph:
    """The captured stale part of an optimizer step (module docstring).

    ``warm_up``: whether the body may run once more before its capture (it may when it
    writes nothing but its buffers, as K-FAC's; Shampoo's updates optimizer state).
    """

    def __init__(self, device: torch.device, *, warm_up: bool = True,
                 max_buffer_bytes: int | None = None) -> None:
        """Hold no graph yet.

        Args:
            device: The device of the model and of the optimizer's state.
            warm_up: Whether a capture runs the body once first.
            max_buffer_bytes: A capture whose static buffers would take more bytes is not
                made: the graphs are off, and the steps run eagerly (None: no bound;
                :func:`buffer_budget`).

        Raises:
            ValueError: ``device`` cannot capture graphs.
        """
        if not supported(device):
            raise ValueError(f"cuda_graphs=True needs the model on a CUDA device, not {device}; "
                             "build the optimizer after model.to('cuda'), or leave "
                             "cuda_graphs off")
        self.device = device
        self.warm_up = warm_up
        self.max_buffer_bytes = max_buffer_bytes
        self._stream: Any = None  # the captures' side stream, made at the first
        self._pool: Any = None  # the held graph's memory pool
        self._graph: Graph | None = None
        self._key: Hashable = None  # the captured graph's
        self._served = False  # whether it ran a step after the one that captured it
        self._seen: Hashable = None  # the last step's
        self._waiting = False  # for a key to repeat before capturing it
        self._static: list[Tensor] = []
        self.output: object = None  # what the body returned when captured
        self.captures = 0  # graphs captured so far
        self.replays = 0  # steps that ran one (the capturing steps included)
        self.disabled: str | None = None  # why the graphs are off (a failed capture, the bound)

    def run(self, key: Hashable, params: Sequence[Tensor], body: Body,
            fill: Callable[[], object]) -> bool:
        """Run ``body`` as a graph on static copies of ``params``' gradients, if it may.

        Replays the graph of ``key``; a new key is captured first (unless the last graph
        never served a step after its capture and ``key`` is new since the last step: then
        this step runs eagerly). The results stay in the static buffers until
        :meth:`write_out` (for a body that writes gradients); what the body returned is
        :attr:`output` (its tensors hold this replay's values). No reference to the
        gradients is kept.

        Args:
            key: What the captured work depends on besides the gradients and the values
                ``fill`` writes (equal keys: the same work).
            params: The parameters whose gradients ``body`` reads and writes (those with
                a gradient, in the key's order).
            body: The step's work on ``.grad``; it reads per-step numbers from tensors.
            fill: Writes this step's numbers into those tensors (before each run).

        Returns:
            Whether the graph ran (else the caller runs the step eagerly).
        """
        if self.disabled is not None or not params:
            return False
        if key != self._key:
            unused = self._graph is not None and not self._served
            seen, self._seen = self._seen, key
            # a new key waits for the next step to repeat it: where keys change too
            # often, and always for work that updates state (its first eager step makes
            # and binds what the captured one will only read)
            if key != seen and (unused or self._waiting or not self.warm_up):
                self._drop()
                self._waiting = True
                return False
            self._waiting = False
            fill()
            if not self._capture(key, params, body):
                return False
        else:
            self._served = True
        torch._foreach_copy_(self._static, [p.grad for p in params])  # type: ignore[misc]
        fill()
        assert self._graph is not None
        self._graph.replay()
        self.replays += 1
        return True

    def skip(self) -> None:
        """Note a step that ran without the graph (Shampoo's root steps).

        The graph stays for the next step of its key; a new key must repeat at the next
        step before it is captured (keys alternating around such steps, as factor updates
        every other step, are not captured for one step each).
        """
        self._seen, self._waiting = None, True

    def write_out(self, params: Sequence[Tensor]) -> None:
        """Copy the last replay's results into ``params``' gradients (one multi-tensor copy).

        Args:
            params: The parameters the last :meth:`run` was given.
        """
        torch._foreach_copy_([p.grad for p in params], self._static)  # type: ignore[misc]

    def _capture(self, key: Hashable, params: Sequence[Tensor], body: Body) -> bool:
        """Capture ``body`` in place of the graph held; False if it failed.

        Into the held graph's pool (it is never replayed again, so its memory can be
        reused; a new pool would only be freed by an ``empty_cache``) and on its static
        buffers where the gradients still fit them, then the held graph goes.
        """
        grads = [p.grad for p in params]
        need = sum(g.numel() * g.element_size() for g in grads if g is not None)
        if self.max_buffer_bytes is not None and need > self.max_buffer_bytes:
            self._drop()  # quietly: the default's bound, not a failure
            self.disabled = (f"the static gradient buffers would take {need} bytes, above "
                             f"the default's bound of {self.max_buffer_bytes} "
                             "(step_graph.DEFAULT_BUFFER_SHARE; cuda_graphs=True captures "
                             "anyway)")
            log.info("cuda_graphs: %s; the steps run without graphs", self.disabled)
            return False
        if [(g.shape, g.dtype) for g in grads] != [  # type: ignore[union-attr]
                (t.shape, t.dtype) for t in self._static]:
            self._static = [torch.empty_like(g) for g in grads]  # type: ignore[arg-type]
        torch._foreach_copy_(self._static, grads)  # type: ignore[arg-type]

        def work() -> None:
            own = [p.grad for p in params]
            for p, static in zip(params, self._static):
                p.grad = static
            try:
                self.output = body()
            finally:
                for p, grad in zip(params, own):
                    p.grad = grad

        if self._stream is None:
            self._stream = new_stream(self.device)
        pool = self._pool if self._graph is not None else new_pool()
        graph = new_graph(self.device, pool, self._stream)
        try:
            graph.capture(work, self.warm_up)
        except Exception as exc:  # any failure: eager from now on
            self._drop()
            self.disabled = f"{type(exc).__name__}: {exc}"
            message = (f"cuda_graphs: capturing the step failed ({self.disabled}); the "
                       "steps run without graphs from now on")
            log.warning(message)
            warnings.warn(message, RuntimeWarning, stacklevel=2)
            return False
        except BaseException:  # interrupted: the held graph's buffers may be gone
            self.release()
            raise
        self._graph, self._pool, self._key, self._served = graph, pool, key, False
        self.captures += 1
        return True

    def report(self) -> dict[str, object]:
        """Captures, replays and why the graphs are off (None: on), for run summaries."""
        return {"captures": self.captures, "replays": self.replays, "disabled": self.disabled}

    def buffer_bytes(self) -> int:
        """Bytes of the static gradient buffers held now."""
        return sum(t.numel() * t.element_size() for t in self._static)

    def release(self) -> None:
        """Forget the graph, its buffers and the last key (a later step starts afresh)."""
        self._drop()
        self._seen, self._waiting = None, False

    def _drop(self) -> None:
        """Forget the graph, its pool, its buffers and its output."""
        self._graph, self._pool, self._key, self.output = None, None, None, None
        self._static = []


def describe(report: Mapping[str, Any]) -> str:
    """One line of a :meth:`StepGraph.report` (or of several ranks' combined).

    Args:
        report: ``captures``, ``replays`` and ``disabled`` (why the graphs are off).
    """
    line = f"{report['captures']} captures, {report['replays']} replays"
    return line + (f"; off: {report['disabled']}" if report["disabled"] else "")
