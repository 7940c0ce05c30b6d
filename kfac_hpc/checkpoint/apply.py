"""Phase 3 of ``load``: prepare and check everything, then apply it all or nothing.

1. *Prepare* (every rank; nothing changes yet): the staged arrays become tensors on
   their target devices (:mod:`kfac_hpc.checkpoint.devices`) inside the objects that
   each ``load_state_dict`` takes; dtypes, NaN/Inf and RNG states are checked (names
   and shapes were checked against the live objects in phase 1). The ranks agree: a
   problem on any rank stops every rank, and nothing was loaded.
2. *Snapshot* what is about to be replaced: the preconditioner's and optimizer's
   ``state_dict()`` (references: both replace their tensors on load rather than
   writing into them; restored with ``load_state_dict``), a host copy of the model's
   tensors (copied back into them), the RNG states.
3. *Apply*, in order: K-FAC (collective; it agrees on its own errors), optimizer, model,
   RNG, each agreed on. If one fails on any rank, every rank restores the snapshots of
   everything applied so far, and the same :class:`CheckpointError` says that nothing
   was loaded.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, cast

import numpy as np
import torch
from torch import nn

from kfac_hpc.checkpoint import devices, rng, tree
from kfac_hpc.checkpoint.contracts import (
    CheckpointOptimizer,
    CheckpointPreconditioner,
    ShardedState,
)
from kfac_hpc.checkpoint.errors import CheckpointError
from kfac_hpc.checkpoint.finite import checked, nonfinite_count
from kfac_hpc.checkpoint.layout import KFAC, MODEL, OPTIMIZER, RNG, TRAIN, escape
from kfac_hpc.checkpoint.routing import EVERY_RANK, Plan, fetcher
from kfac_hpc.checkpoint.state import (
    TORCH_LAYOUT,
    torch_layout,
    torch_state_from_names,
    unwrap,
)
from kfac_hpc.checkpoint.writer import factor_path, kfac_rank_group
from kfac_hpc.kfac.state import KFACStateDict

if TYPE_CHECKING:
    from kfac_hpc.comm import Communicator

__all__ = ["ORDER", "Ready", "apply", "prepare"]

_T = TypeVar("_T")

#: The order in which sections are applied (and restored in reverse).
ORDER = ("kfac", "optimizer", "model", "rng")


@dataclass
class Ready:
    """Everything :func:`apply` hands over, per section, and the decoded ``extra``."""

    sections: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] | None = None


def _kind(t: torch.Tensor) -> str:
    if t.is_complex():
        return "complex"
    if t.is_floating_point():
        return "floating-point"
    return "bool" if t.dtype == torch.bool else "integer"


# ------------------------------------------------------------------ prepare
def prepare(comm: Communicator, plan: Plan, staged: dict[str, np.ndarray], model: nn.Module,
            optimizer: CheckpointOptimizer | None,
            preconditioner: CheckpointPreconditioner | None) -> Ready:
    """Build what each section loads, on its target device (collective).

    Args:
        comm: The ranks of the load.
        plan: What rank 0 decided (:func:`kfac_hpc.checkpoint.reader.load`).
        staged: The datasets this rank received, by path.
        model: The live model.
        optimizer: The live optimizer, if the load has one.
        preconditioner: The live preconditioner, if the load has one.

    Returns:
        Every planned section's state and the decoded ``extra``.

    Raises:
        CheckpointError: On every rank, when a problem was found on any rank (a dtype
            that does not fit, NaN/Inf, a bad RNG state, no device memory); nothing has
            been changed.
    """
    ready = Ready()
    problems: list[str] = []
    for p, arr in staged.items():
        if checked(p):
            bad = nonfinite_count(arr, plan.torch_dtypes.get(p))
            if bad:
                problems.append(f"dataset {p} holds NaN/Inf ({bad} of {arr.size} values): "
                                "written by a run that had diverged; load an earlier checkpoint")
    builders: dict[str, Callable[[], object]] = {
        "kfac": lambda: _kfac_state(comm, plan, staged, model),
        "optimizer": lambda: _optimizer_state(comm, plan, staged, model, _given(optimizer)),
        "model": lambda: _model_state(plan, staged, model, problems),
        "rng": lambda: _rng_state(comm, plan, staged, problems),
    }
    try:
        for section in ORDER:
            if section in plan.sections:
                ready.sections[section] = builders[section]()
        tattrs = plan.groups.get(f"/{TRAIN}")
        if tattrs is not None:
            ready.extra = tree.decode(json.loads(tattrs["structure"]),
                                      fetcher(plan, staged, f"/{TRAIN}"))
    except Exception as exc:  # out of device memory, a malformed structure, ...
        problems.append(f"{type(exc).__name__}: {exc}")
    everyone = comm.allgather_object(problems)
    found = sorted({p for rank_problems in everyone for p in rank_problems})
    if found:
        raise CheckpointError(f"{plan.path} cannot be loaded into these objects (nothing was "
                              "loaded)", found, plan.path)
    return ready


def _model_state(plan: Plan, staged: dict[str, np.ndarray], model: nn.Module,
                 problems: list[str]) -> dict[str, torch.Tensor]:
    """Build the model's state, each entry in the dtype of the live entry it replaces.

    ``load_state_dict`` copies each into that entry, on its device (no second copy of
    the model on the device).
    """
    fetch = fetcher(plan, staged, f"/{MODEL}")
    live = unwrap(model).state_dict()
    sd: dict[str, torch.Tensor] = {}
    for name in plan.model_names:
        saved, want = fetch(escape(name)), live[name]
        if _kind(saved) != _kind(want):
            problems.append(f"model: {name} is {saved.dtype} in the checkpoint, {want.dtype} in "
                            f"the model ({_kind(saved)} vs {_kind(want)})")
            continue
        sd[name] = saved.to(dtype=want.dtype)
    return sd


def _given(obj: _T | None) -> _T:
    """``obj``, which the plan holds a section for (so it was given)."""
    assert obj is not None, "a section was planned for an object that was not given"
    return obj


def _optimizer_state(comm: Communicator, plan: Plan, staged: dict[str, np.ndarray],
                     model: nn.Module, optimizer: CheckpointOptimizer) -> Any:
    """The optimizer's ``state_dict`` for this rank, each tensor on its device."""
    attrs = plan.groups[f"/{OPTIMIZER}"]
    skip = None
    if isinstance(optimizer, ShardedState):  # other ranks' parts were routed to them
        sharded = optimizer

        def skip(key_path: tree.KeyPath) -> bool:
            rank = sharded.checkpoint_load_rank(key_path)
            return rank is not None and rank != comm.rank
    saved = tree.decode(json.loads(attrs["structure"]), fetcher(plan, staged, f"/{OPTIMIZER}"),
                        skip)
    torch_opt = torch_layout(optimizer)
    if attrs["layout"] == TORCH_LAYOUT and torch_opt is not None:  # the plan checked both
        sd, _ = torch_state_from_names(torch_opt, model, saved, set(plan.skip_optimizer_state),
                                       strict=False)
        return devices.place_torch_optimizer(torch_opt, sd)
    return devices.place_generic_optimizer(model, saved)


def _kfac_state(comm: Communicator, plan: Plan, staged: dict[str, np.ndarray],
                model: nn.Module) -> KFACStateDict:
    """The preconditioner's ``state_dict`` for this rank, on the model's device."""
    attrs = plan.groups[f"/{KFAC}"]
    table = json.loads(attrs["factors"])
    fetch = fetcher(plan, staged, "")
    factors: dict[str, torch.Tensor] = {}
    eigen: dict[str, dict[str, torch.Tensor]] = {}
    for key in table:
        prefix = factor_path(key)
        for p in staged:
            if p == prefix:
                factors[key] = fetch(p[1:])
            elif p.startswith(prefix + "_") and "/" not in p[len(prefix) + 1:]:
                eigen.setdefault(key, {})[p[len(prefix) + 1:]] = fetch(p[1:])
    state: KFACStateDict = {
        "step": int(attrs["step"]), "factors": factors,
        "factor_updates": {k: int(v["updates"]) for k, v in table.items()},
        "config": json.loads(attrs["config"])}
    if eigen:
        state["eigenbases"] = eigen
    src = plan.kfac_source.get(comm.rank, plan.kfac_source.get(EVERY_RANK))
    if src is not None:  # the entries rank src's state_dict() had besides these (history, ...)
        group = kfac_rank_group(src)
        others = tree.decode(json.loads(plan.groups[group]["structure"]),
                             fetcher(plan, staged, group))
        # KFACStateDict names the entries every preconditioner has; a preconditioner's
        # own entries come back as they were saved, next to them
        state = cast("KFACStateDict", {**state, **{k: v for k, v in others.items()
                                                   if k not in state}})
    return cast("KFACStateDict", devices.to_device(state, devices.model_device(model)))


def _rng_state(comm: Communicator, plan: Plan, staged: dict[str, np.ndarray],
               problems: list[str]) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
    src = plan.rng_source.get(comm.rank, plan.rng_source.get(EVERY_RANK))
    if src is None:
        return None
    prefix = f"/{RNG}/rank_{src}/"
    arrays = {p[len(prefix):]: a for p, a in staged.items() if p.startswith(prefix)}
    attrs = plan.groups[f"/{RNG}/rank_{src}"]
    problems += [f"{p} (saved by rank {src})" for p in rng.check(arrays, attrs)]
    return arrays, attrs


# ------------------------------------------------------------------ apply
def apply(comm: Communicator, plan: Plan, ready: Ready, model: nn.Module,
          optimizer: CheckpointOptimizer | None,
          preconditioner: CheckpointPreconditioner | None, strict: bool
          ) -> tuple[list[str], list[str]]:
    """Apply every prepared section, or (a failure on any rank) none (collective).

    Args:
        comm: The ranks of the load.
        plan: What rank 0 decided.
        ready: What :func:`prepare` built.
        model: The live model.
        optimizer: The live optimizer, if the load has one.
        preconditioner: The live preconditioner, if the load has one.
        strict: Load the model strictly (unless the plan found mismatches).

    Returns:
        The sections applied, in :data:`ORDER`, and the generators whose saved states
        were not restored, on every rank alike (``"rank R: cuda not restored (...)"``:
        a rank that sees another number of GPUs than at save time).

    Raises:
        CheckpointError: On every rank, when applying failed on any rank; what was
            applied has been put back (the message says if that failed too).
    """
    net = unwrap(model)
    sections = [s for s in ORDER if s in ready.sections]
    unrestored: list[str] = []  # this rank's generators rng.restore() left as they were

    def take(section: str) -> object:
        if section == "kfac":
            return _given(preconditioner).state_dict(eigenbases=True)
        if section == "optimizer":
            opt = _given(optimizer)
            sd = opt.local_state_dict() if isinstance(opt, ShardedState) else opt.state_dict()
            state = sd.get("state")
            if isinstance(state, dict):
                sd = {**sd, "state": {k: dict(v) if isinstance(v, dict) else v
                                      for k, v in state.items()}}
            return sd
        if section == "model":  # on the host (a meta tensor has no data to copy)
            return {k: v.detach().clone() if v.is_meta else v.detach().to("cpu", copy=True)
                    for k, v in net.state_dict().items()}
        return rng.capture()

    def put(section: str, value: Any, restoring: bool = False) -> None:
        if section == "kfac":
            _given(preconditioner).load_state_dict(value)
        elif section == "optimizer":
            _given(optimizer).load_state_dict(value)
        elif section == "model" and restoring:
            _copy_back(net, value)
        elif section == "model":
            net.load_state_dict(value, strict=strict and not plan.mismatches)
        elif value is not None:
            notes = rng.restore(*value)
            if not restoring:
                unrestored.extend(note for note in notes if "not restored" in note)

    snapshots: dict[str, Any] = {}
    error = None
    try:  # K-FAC's state_dict() is collective: every rank takes every section
        for section in sections:
            snapshots[section] = take(section)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    _agree(comm, plan, error, "taking a snapshot of the live state", [])

    done: list[str] = []
    for section in sections:
        error = None
        try:
            put(section, ready.sections[section])
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        if comm.allgather_object(error is not None) == [False] * comm.size:
            done.append(section)
            continue
        restore_errors = []
        for s in [section, *reversed(done)]:  # the failed one too: it may be half-applied
            try:
                put(s, snapshots[s], restoring=True)
            except Exception as exc:
                restore_errors.append(f"restoring the {s} state: {type(exc).__name__}: {exc}")
        _agree(comm, plan, error, f"loading the {section} state", restore_errors)
    everyone = comm.allgather_object(unrestored) if "rng" in done else []
    return done, [f"rank {r}: {note}" for r, notes in enumerate(everyone) for note in notes]


def _copy_back(net: nn.Module, snapshot: dict[str, torch.Tensor]) -> None:
    """Write the snapshot's bytes back into the model's own tensors.

    No load hooks run: they may be what failed.
    """
    live = net.state_dict(keep_vars=True)
    if live.keys() != snapshot.keys():
        net.load_state_dict(snapshot)
        return
    with torch.no_grad():
        for name, value in snapshot.items():
            live[name].copy_(value)


def _agree(comm: Communicator, plan: Plan, error: str | None, what: str,
           restore_errors: list[str]) -> None:
    """Raise the same CheckpointError on every rank when ``error`` is set on any rank."""
    everyone = comm.allgather_object((error, restore_errors))
    failed = [(r, e) for r, (e, _) in enumerate(everyone) if e]
    if not failed and not any(r for _, r in everyone):
        return
    problems = [f"rank {r}: {e}" for r, e in failed]
    unrestored = [f"rank {r}: {e}" for r, (_, es) in enumerate(everyone) for e in es]
    if unrestored:
        state = ("restoring the previous state failed too: the model, optimizer and "
                 "preconditioner are in an undefined state; rebuild them")
    else:
        state = "nothing was loaded: the previous state is back"
    raise CheckpointError(f"{plan.path}: {what} failed on {len(failed)} rank(s) ({state})",
                          problems + unrestored, plan.path)
