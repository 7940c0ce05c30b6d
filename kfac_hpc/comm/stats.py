"""Traffic accounting: calls and bytes per collective kind."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class KindCount:
    """Calls and bytes of one collective kind."""

    calls: int = 0
    bytes: int = 0


@dataclass
class TrafficStats:
    """Counters of what a communicator put on the wire.

    ``bytes`` of a call is the size of the message the collective operates on, in the
    datatype that travels: the whole vector for allreduce, reduce, broadcast and
    reduce-scatter (its input), the whole result for allgather(v), the payload for
    point-to-point, the pickled size for object collectives. The value is the same on
    every rank for collectives, so a test or the planner can predict it exactly.
    Nothing is counted on a world of one rank: nothing crosses a wire there.
    Counters can be tagged (``with stats.tagged("factors"): ...``) to attribute bytes
    to a phase of an algorithm.
    """

    kinds: dict[str, KindCount] = field(default_factory=dict)
    tags: dict[str, KindCount] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _tag_stack: list[str] = field(default_factory=list, repr=False)

    def record(self, kind: str, nbytes: int) -> None:
        """Add one call of ``kind`` carrying ``nbytes`` bytes, to its kind and to every open tag.

        Args:
            kind: The collective kind, e.g. ``"allreduce"``.
            nbytes: The message size (see the class docstring for which size).
        """
        with self._lock:
            count = self.kinds.setdefault(kind, KindCount())
            count.calls += 1
            count.bytes += nbytes
            for tag in dict.fromkeys(self._tag_stack):  # nested equal tags count once
                tagged = self.tags.setdefault(tag, KindCount())
                tagged.calls += 1
                tagged.bytes += nbytes

    def share_tags_with(self, parent: TrafficStats) -> None:
        """Use ``parent``'s open tags (a sub-communicator's calls inside a tagged block)."""
        self._tag_stack = parent._tag_stack

    def tagged(self, tag: str) -> _Tag:
        """Attribute the calls made inside a ``with`` block to ``tag`` as well.

        Args:
            tag: The phase's name; nested equal tags count a call once.

        Returns:
            The context manager.
        """
        return _Tag(self, tag)

    @property
    def total_bytes(self) -> int:
        """Bytes of every call, all kinds together."""
        return sum(c.bytes for c in self.kinds.values())

    @property
    def total_calls(self) -> int:
        """Calls of every kind together."""
        return sum(c.calls for c in self.kinds.values())

    def bytes_of(self, kind: str) -> int:
        """Return the bytes of the calls of ``kind`` (0 when none was made)."""
        return self.kinds.get(kind, KindCount()).bytes

    def calls_of(self, kind: str) -> int:
        """Return the number of calls of ``kind`` (0 when none was made)."""
        return self.kinds.get(kind, KindCount()).calls

    def tag_bytes(self, tag: str) -> int:
        """Return the bytes of the calls made inside ``tag`` blocks (0 when none was made)."""
        return self.tags.get(tag, KindCount()).bytes

    def reset(self) -> None:
        """Set every counter back to zero."""
        with self._lock:
            self.kinds.clear()
            self.tags.clear()

    def snapshot(self) -> dict[str, dict[str, int]]:
        """Copy the counters: ``{kind: {"calls": n, "bytes": b}}``, and ``"tag:<name>"`` too."""
        with self._lock:
            out = {k: {"calls": c.calls, "bytes": c.bytes} for k, c in self.kinds.items()}
            out.update(
                {f"tag:{k}": {"calls": c.calls, "bytes": c.bytes} for k, c in self.tags.items()}
            )
            return out

    @staticmethod
    def merged(stats: Iterable[TrafficStats]) -> TrafficStats:
        """Sum several counters (e.g. a communicator and its sub-communicators).

        Args:
            stats: The counters to add.

        Returns:
            A new counter; the inputs are not changed.
        """
        total = TrafficStats()
        for s in stats:
            for kind, c in s.kinds.items():
                t = total.kinds.setdefault(kind, KindCount())
                t.calls += c.calls
                t.bytes += c.bytes
            for tag, c in s.tags.items():
                t = total.tags.setdefault(tag, KindCount())
                t.calls += c.calls
                t.bytes += c.bytes
        return total


class _Tag:
    """The context of :meth:`TrafficStats.tagged`: the tag is open inside it."""
    def __init__(self, stats: TrafficStats, tag: str) -> None:
        self.stats, self.tag = stats, tag

    def __enter__(self) -> None:
        self.stats._tag_stack.append(self.tag)

    def __exit__(self, *exc: object) -> None:
        self.stats._tag_stack.remove(self.tag)
