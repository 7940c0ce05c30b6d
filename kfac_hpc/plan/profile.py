"""Machine profiles: the numbers the cost model multiplies by, stored as JSON.

A profile holds, per collective, the α–β parameters of :mod:`kfac_hpc.plan.collectives`
and the compute rates of one rank. ``kfac-hpc calibrate`` measures them on the ranks it
runs on; the bundled profiles under ``kfac_hpc/plan/profiles/`` describe typical clusters
from public hardware figures, and say so (their ``assumptions`` list).

JSON layout (every time in seconds, every rate per second, every size in bytes)::

    {"name": ..., "description": ..., "source": "assumed" | "calibrated",
     "measured_on": "CPU" | "GPU <name>" | "" (not recorded),
     "assumptions": [...], "memory_per_rank_bytes": 42949672960,
     "network": {"allreduce": {"alpha": 5e-6, "beta": 4.5e-11, "algorithm": "auto"}, ...},
     "compute": {"train_flops": ..., "gemm_flops": ..., "mem_bandwidth": ...,
                 "op_overhead_s": ..., "overlap_efficiency": ...,
                 "eigh": [[n, seconds], ...], "inverse": [[n, seconds], ...]},
     "by_ranks": {"4": {"network": {...}, "compute": {...}}}}

``by_ranks`` holds values measured at a given world size (on an oversubscribed node
the compute rate of a rank depends on it); :meth:`Profile.at` applies the entry with
the largest world size not above the one asked for (the smallest entry below all).
"""

from __future__ import annotations

import bisect
import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from kfac_hpc.files import write_text_atomic
from kfac_hpc.plan.collectives import COLLECTIVES, LinkCost

log = logging.getLogger("kfac_hpc")

__all__ = ["PROFILE_DIR", "ComputeRates", "Profile", "bundled_profiles", "default_profile",
           "load_profile"]

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"
PROFILE_ENV = "KFAC_HPC_PLAN_PROFILE"
DEFAULT_PROFILE = "a100-ib200"


@dataclass(frozen=True)
class ComputeRates:
    """Compute speed of one rank.

    Attributes:
        train_flops: Effective flop/s of forward+backward counted over the K-FAC layers
            (convolutions and linear layers; the rest of the network is folded into the
            rate).
        gemm_flops: Flop/s of matrix products (factor statistics, preconditioning).
        mem_bandwidth: Bytes/s of elementwise work (running averages, packing, copies).
        op_overhead_s: Framework time per tensor operation (Python, dispatch, launch).
        eigh: ``[n, seconds]`` measured for one ``n x n`` eigendecomposition;
            interpolated log-log in between, ``∝ n³`` above the largest size and ``∝ n``
            below the smallest.
        inverse: ``[n, seconds]`` of one ``n x n`` inverse, read as ``eigh``.
        overlap_efficiency: Fraction (0..1) of the compute that communication started
            from hooks can hide behind (``overlap=True``, gradient averaging).
        im2col_bandwidth: Bytes/s of the patch matrix (unfold) a Conv2d's A needs (0:
            ``mem_bandwidth / 4``).
        module_overhead_s: Framework time of one leaf module's forward + backward beyond
            its FLOPs (0: 3 ``op_overhead_s``).
        param_overhead_s: Optimizer time per parameter tensor (0: 3 ``op_overhead_s``).
        sync_overhead_s: What each blocking collective costs beyond α–β when ranks reach
            it from computation (arrival skew, scheduling; large where ranks share cores).
        decomposition_concurrency: How many times faster a rank's decompositions run
            together than one after another (1: one after another, as on the CPU; on
            CUDA the library spreads them over streams, ``decomposition_streams``): the
            cost model divides a rank's sum of table times by it.
    """

    train_flops: float
    gemm_flops: float
    mem_bandwidth: float
    op_overhead_s: float
    eigh: tuple[tuple[int, float], ...]
    inverse: tuple[tuple[int, float], ...]
    overlap_efficiency: float = 1.0
    im2col_bandwidth: float = 0.0
    module_overhead_s: float = 0.0
    param_overhead_s: float = 0.0
    sync_overhead_s: float = 0.0
    decomposition_concurrency: float = 1.0

    def __post_init__(self) -> None:
        """Refuse a concurrency below 1 (one error naming the field and the fix)."""
        if not self.decomposition_concurrency >= 1.0:
            raise ValueError("profile compute.decomposition_concurrency must be >= 1 (1: "
                             f"decompositions one after another), got "
                             f"{self.decomposition_concurrency!r}")

    @property
    def unfold_bandwidth(self) -> float:
        """Bytes/s of building the patch matrix of a Conv2d (``mem_bandwidth / 4`` if unset)."""
        return self.im2col_bandwidth or self.mem_bandwidth / 4

    def decomposition_s(self, n: int, method: str) -> float:
        """Return the seconds for one eigendecomposition (``"eigen"``) or inverse of ``n x n``.

        Interpolated log-log in the measured table, ``∝ n³`` above the largest size and
        ``∝ n`` below the smallest.

        Args:
            n: The matrix's order.
            method: ``"eigen"``, or anything else for an inverse.

        Returns:
            Seconds (0 for ``n <= 0``).

        Raises:
            ValueError: The table for ``method`` is empty.
        """
        table = self.eigh if method == "eigen" else self.inverse
        return _interpolate(table, n)

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> ComputeRates:
        """Read rates from :meth:`to_json`'s form."""
        d = dict(data)
        for key in ("eigh", "inverse"):
            d[key] = tuple((int(n), float(t)) for n, t in sorted(d[key]))
        return ComputeRates(**d)

    def to_json(self) -> dict[str, Any]:
        """Return the rates as a JSON-ready dict (tables as lists of ``[n, seconds]``)."""
        d = asdict(self)
        d["eigh"] = [list(p) for p in self.eigh]
        d["inverse"] = [list(p) for p in self.inverse]
        return d


def _interpolate(table: Sequence[tuple[int, float]], n: int) -> float:
    if not table:
        raise ValueError("decomposition table is empty")
    if n <= 0:
        return 0.0
    sizes = [p[0] for p in table]
    if n <= sizes[0]:
        return table[0][1] * n / sizes[0]
    if n >= sizes[-1]:
        return table[-1][1] * (n / sizes[-1]) ** 3
    i = bisect.bisect_left(sizes, n)
    (n0, t0), (n1, t1) = table[i - 1], table[i]
    if n == n1:
        return t1
    w = (math.log(n) - math.log(n0)) / (math.log(n1) - math.log(n0))
    return math.exp(math.log(t0) + w * (math.log(t1) - math.log(t0)))


@dataclass(frozen=True)
class Profile:
    """Network and compute parameters of a machine (see the module docstring)."""

    name: str
    network: Mapping[str, LinkCost]
    compute: ComputeRates
    description: str = ""
    source: str = "assumed"
    assumptions: tuple[str, ...] = ()
    memory_per_rank_bytes: int | None = None
    by_ranks: Mapping[int, Mapping[str, Any]] = field(default_factory=dict)
    measured_at_ranks: int | None = None
    measured_on: str = ""  # the device kfac-hpc calibrate measured ("": not recorded)

    def link(self, kind: str) -> LinkCost:
        """Return the α–β cost of collective ``kind``.

        Raises:
            ValueError: The profile has no entry for ``kind``.
        """
        try:
            return self.network[kind]
        except KeyError:
            raise ValueError(f"profile {self.name!r} has no network entry for {kind!r}") from None

    def at(self, ranks: int) -> Profile:
        """Apply the ``by_ranks`` entry for ``ranks`` (see the module docstring).

        Args:
            ranks: The world size.

        Returns:
            This profile with the entry of the largest measured world size not above
            ``ranks`` (the smallest if none) merged in; itself when there are none. An
            entry of one rank brings no network (a file written by an older calibrate
            may hold one of zero costs: nothing was measured).
        """
        resolved = self
        if self.by_ranks:
            keys = sorted(self.by_ranks)
            chosen = max((k for k in keys if k <= ranks), default=keys[0])
            entry = self.by_ranks[chosen]
            network = dict(self.network)
            for kind, link in (entry.get("network", {}) if chosen > 1 else {}).items():
                network[kind] = _link(link)
            compute = self.compute
            if "compute" in entry:
                merged = {**self.compute.to_json(), **entry["compute"]}
                compute = ComputeRates.from_json(merged)
            resolved = replace(self, network=network, compute=compute, by_ranks={},
                               measured_at_ranks=chosen)
        if ranks > 1 and all(link.alpha == 0 and link.beta == 0
                             for link in resolved.network.values()):
            log.warning("profile %r: every collective costs nothing (a network calibrated "
                        "on one rank?), so %d ranks are planned without communication "
                        "time; calibrate on 2 or more ranks, one per node",
                        self.name, ranks)
        return resolved

    # ------------------------------------------------------------------ JSON
    def to_json(self) -> dict[str, Any]:
        """Return the profile as a JSON-ready dict (:meth:`from_json` reads it back)."""
        return {
            "name": self.name,
            "description": self.description,
            "source": self.source,
            "measured_on": self.measured_on,
            "assumptions": list(self.assumptions),
            "memory_per_rank_bytes": self.memory_per_rank_bytes,
            "network": {k: asdict(v) for k, v in self.network.items()},
            "compute": self.compute.to_json(),
            "by_ranks": {str(k): _jsonable_entry(v) for k, v in sorted(self.by_ranks.items())},
        }

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> Profile:
        """Read a profile from :meth:`to_json`'s form.

        Args:
            data: The parsed JSON.

        Returns:
            The profile.

        Raises:
            ValueError: The network lacks a collective.
            KeyError: A required key is missing.
        """
        network = {k: _link(v) for k, v in data["network"].items()}
        missing = [k for k in COLLECTIVES if k not in network]
        if missing:
            raise ValueError(f"profile {data.get('name')!r}: network lacks {missing}")
        return Profile(
            name=str(data["name"]),
            network=network,
            compute=ComputeRates.from_json(data["compute"]),
            description=str(data.get("description", "")),
            source=str(data.get("source", "assumed")),
            measured_on=str(data.get("measured_on") or ""),
            assumptions=tuple(data.get("assumptions", ())),
            memory_per_rank_bytes=data.get("memory_per_rank_bytes"),
            by_ranks={int(k): v for k, v in data.get("by_ranks", {}).items()},
        )

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the profile as JSON, atomically, making missing folders.

        Args:
            path: The file to write.

        Returns:
            The path written.
        """
        return write_text_atomic(path, json.dumps(self.to_json(), indent=1) + "\n")


def _link(value: Mapping[str, Any] | LinkCost) -> LinkCost:
    if isinstance(value, LinkCost):
        return value
    return LinkCost(float(value["alpha"]), float(value["beta"]),
                    str(value.get("algorithm", "auto")))


def _jsonable_entry(entry: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "network" in entry:
        out["network"] = {k: asdict(v) if isinstance(v, LinkCost) else dict(v)
                          for k, v in entry["network"].items()}
    if "compute" in entry:
        c = entry["compute"]
        out["compute"] = c.to_json() if isinstance(c, ComputeRates) else dict(c)
    return out


def bundled_profiles() -> list[str]:
    """List the names of the profiles shipped with the package."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def load_profile(spec: str | os.PathLike[str] | Profile | None = None) -> Profile:
    """Load a profile from a :class:`Profile`, a JSON path, or a bundled name.

    Args:
        spec: The profile; ``None``: the file named by ``$KFAC_HPC_PLAN_PROFILE`` if set,
            else the bundled ``a100-ib200`` profile.

    Returns:
        The profile.

    Raises:
        FileNotFoundError: No such file and no bundled profile of that name.
        ValueError: The file is not a valid profile.
    """
    if isinstance(spec, Profile):
        return spec
    if spec is None:
        spec = os.environ.get(PROFILE_ENV) or DEFAULT_PROFILE
    path = Path(spec)
    if not path.is_file():
        bundled = PROFILE_DIR / f"{spec}.json"
        if not bundled.is_file():
            raise FileNotFoundError(f"no profile file {str(spec)!r} and no bundled profile of "
                                    f"that name (bundled: {', '.join(bundled_profiles())})")
        path = bundled
    try:
        return Profile.from_json(json.loads(path.read_text()))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: not a valid kfac_hpc profile ({e})") from e


def default_profile() -> Profile:
    """Return the profile ``strategy="auto"`` uses when none is given."""
    return load_profile(None)
