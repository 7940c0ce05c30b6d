"""Statistics capture: forward/backward hooks that turn activations into batch factors.

A in the forward hook, G in a hook on the layer's output gradient. Each micro-batch
adds its factor to a running sum, so only ``a_dim²`` and ``g_dim²`` numbers are kept per
layer; on the GPU path the statistics groups hold a layer's input until its output's
gradient comes, to compute same-shaped layers' factors together
(:mod:`kfac_hpc.kfac.statistics_groups`; :meth:`StatisticsCapture.clear` and
:meth:`StatisticsCapture.remove` drop what they hold). Nothing is captured in eval mode,
under ``no_grad``, for an input without rows (an expert routed no token), or when the
owner of the capture says this step does not update factors. The input is the first
positional argument, or the ``input`` keyword (``layer(input=x)``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from kfac_hpc.kfac.layers import LayerCurvature
from kfac_hpc.kfac.precision import MatmulPrecision
from kfac_hpc.kfac.statistics_groups import StatisticsGroups
from kfac_hpc.kfac.statistics_stream import SameStream, StatisticsStream
from kfac_hpc.phases import profiler_range

FactorCallback = Callable[["LayerStatistics", str], None]

#: The profiler range of the statistics the hooks compute (``kfac_hpc.kfac_statistics``).
STATISTICS_RANGE = "kfac_statistics"


@dataclass
class LayerStatistics:
    """Sums of per-micro-batch factors of one layer since the last factor update."""

    name: str
    curvature: LayerCurvature
    sums: dict[str, Tensor | None] = field(default_factory=lambda: {"A": None, "G": None})
    counts: dict[str, int] = field(default_factory=lambda: {"A": 0, "G": 0})

    def add(self, factor: str, value: Tensor) -> None:
        """Add one micro-batch factor ``value`` to ``factor``'s sum."""
        current = self.sums[factor]
        self.sums[factor] = value if current is None else current.add_(value)
        self.counts[factor] += 1

    def clear(self) -> None:
        """Forget the sums and counts (after a factor update)."""
        self.sums = {"A": None, "G": None}
        self.counts = {"A": 0, "G": 0}

    @property
    def captured(self) -> bool:
        """Say whether both factors saw at least one micro-batch."""
        return self.counts["A"] > 0 and self.counts["G"] > 0


class StatisticsCapture:
    """Hooks on a set of layers; ``active()`` decides whether a pass is captured.

    ``precision``: the operand precision of the statistics' GEMMs
    (:mod:`kfac_hpc.kfac.precision`). ``grad_scale()`` gives the factor the loss was
    multiplied by (AMP loss scale times ``1/accumulation_steps``) so that G is computed
    from unscaled gradients.
    ``on_ready(stats, factor)`` is called when a micro-batch's A or G has been added
    (SPD-KFAC's pipelining starts communication from there). ``stream``: where the
    statistics run (:mod:`kfac_hpc.kfac.statistics_stream`); :meth:`join` before the
    sums are read, :meth:`clear` after. On the GPU path the statistics of same-shaped
    layers are computed together (:mod:`kfac_hpc.kfac.statistics_groups`), unless
    ``on_ready`` wants each layer's as soon as it is added.
    """

    def __init__(self, layers: dict[str, LayerCurvature], *, dtype_of: Callable[[str], torch.dtype],
                 active: Callable[[], bool], grad_scale: Callable[[], float | Tensor],
                 on_ready: FactorCallback | None = None,
                 precision: MatmulPrecision = "full",
                 stream: StatisticsStream | None = None) -> None:
        """Register the hooks on every layer of ``layers``.

        Args:
            layers: The layers to capture, by name.
            dtype_of: The factor dtype of a layer (by name).
            active: Whether the current pass is captured.
            grad_scale: The factor the loss was multiplied by.
            on_ready: Called after a micro-batch's A or G was added, or ``None``.
            precision: The operand precision of the statistics' GEMMs.
            stream: Where the statistics run (default: the pass's own stream).
        """
        self.stats = {name: LayerStatistics(name, curv) for name, curv in layers.items()}
        self.stream: StatisticsStream = stream if stream is not None else SameStream()
        self._dtype_of = dtype_of
        self._precision = precision
        self._active = active
        self._grad_scale = grad_scale
        self._on_ready = on_ready
        self._groups = None if on_ready is not None else StatisticsGroups(
            self._run_group, precision)
        self._handles: list[RemovableHandle] = []
        for name, curv in layers.items():
            self._handles.append(curv.module.register_forward_hook(self._forward_hook(name),
                                                                   with_kwargs=True))

    def _forward_hook(self, name: str) -> Callable[[nn.Module, tuple[Tensor, ...],
                                                    dict[str, object], Tensor], None]:
        stats = self.stats[name]

        def hook(module: nn.Module, args: tuple[Tensor, ...], kwargs: dict[str, object],
                 output: Tensor) -> None:
            if not (module.training and torch.is_grad_enabled() and self._active()):
                return
            if not isinstance(output, Tensor) or not output.requires_grad:
                return
            x = args[0] if args else kwargs.get("input")
            if not isinstance(x, Tensor) or x.numel() == 0:  # no rows: nothing to add
                return
            dtype = self._dtype_of(name)
            groups = self._groups
            if groups is None or not groups.hold_a(stats.curvature, stats.add, x, output, dtype):
                with profiler_range(STATISTICS_RANGE):
                    self.stream.run([x], lambda: stats.add("A", stats.curvature.a_factor(
                        x, dtype=dtype, precision=self._precision)))
                self._ready(stats, "A")

            def grad_hook(grad: Tensor) -> None:
                scale = self._grad_scale()  # a device tensor under AMP: read there too
                if groups is not None and groups.hold_g(stats.curvature, stats.add, grad, dtype,
                                                        scale):
                    return
                reads = [grad, scale] if isinstance(scale, Tensor) else [grad]
                with profiler_range(STATISTICS_RANGE):
                    self.stream.run(reads, lambda: stats.add("G", stats.curvature.g_factor(
                        grad, dtype=dtype, grad_scale=scale, precision=self._precision)))
                self._ready(stats, "G")

            output.register_hook(grad_hook)

        return hook

    def _ready(self, stats: LayerStatistics, factor: str) -> None:
        if self._on_ready is not None:
            self._on_ready(stats, factor)

    def _run_group(self, reads: list[Tensor], work: Callable[[], None]) -> None:
        with profiler_range(STATISTICS_RANGE):
            self.stream.run(reads, work)

    def join(self) -> None:
        """Compute the held statistics; make the current stream wait for every one so far."""
        if self._groups is not None:
            self._groups.flush()
        self.stream.join()

    def clear(self) -> None:
        """Forget every layer's sums and counts (used on the current stream until then)."""
        self.stream.release(t for stats in self.stats.values() for t in stats.sums.values()
                            if t is not None)
        if self._groups is not None:  # nothing held after join(); a discarded step's part
            self._groups.drop()
        for stats in self.stats.values():
            stats.clear()

    def remove(self) -> None:
        """Detach every hook from the model; drop the inputs the groups hold."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._groups is not None:
            self._groups.drop()
