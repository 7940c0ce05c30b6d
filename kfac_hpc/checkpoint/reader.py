"""``load``: verify, stage, prepare, then apply, so that nothing is ever partially loaded.

1. *Check* (rank 0): open the file, check format, version, manifest and attribute
   digests, and compare names and shapes with the live model, optimizer and
   preconditioner. The outcome (a routing plan or one error) is broadcast, so every
   rank raises the same :class:`CheckpointError` or none does.
2. *Stage*: every dataset goes to the ranks that need it under the *current* world
   size: replicated state to all, each K-FAC factor to its current owner
   (``preconditioner.factor_owner``), each rank's RNG state to that rank. With
   ``read_mode="root"`` rank 0 reads (one dataset at a time) and broadcasts / sends;
   with ``"owners"`` each rank reads its own factors and RNG state itself (rank 0
   still broadcasts replicated state); with ``"all"`` every rank opens the file
   read-only and reads everything it needs. Every dataset's CRC-32 is checked (in a
   thread, overlapping the reads). Failures are agreed on.
3. *Prepare* (:mod:`kfac_hpc.checkpoint.apply`): every rank turns what it staged into
   tensors on their target devices (:mod:`kfac_hpc.checkpoint.devices`) and checks
   dtypes, NaN/Inf and RNG states; agreed on. *Apply*: preconditioner, optimizer, model,
   RNG, each agreed on; a failure anywhere restores what was applied, on every rank.

RNG on a different world size: when every rank's state was identical at save time
(``/rng`` attribute ``identical``) that state is restored on every rank; otherwise
RNG states are left as they are (per-rank streams do not map onto a new rank count),
and ``LoadInfo.rng`` says so.
"""

from __future__ import annotations

import contextlib
import json
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import h5py
import numpy as np
import torch
from torch import nn

from kfac_hpc.checkpoint import apply, atomic, contracts, tree
from kfac_hpc.checkpoint.contracts import (
    CheckpointOptimizer,
    CheckpointPreconditioner,
    ShardedState,
)
from kfac_hpc.checkpoint.errors import CheckpointError
from kfac_hpc.checkpoint.layout import (
    KFAC,
    MODEL,
    OPTIMIZER,
    RNG,
    TRAIN,
    c_order,
    digest,
    escape,
)
from kfac_hpc.checkpoint.routing import EVERY_RANK, Plan, Route
from kfac_hpc.checkpoint.state import (
    TORCH_LAYOUT,
    optimizer_layout,
    torch_layout,
    torch_state_from_names,
    unwrap,
)
from kfac_hpc.checkpoint.verify import (
    FileInfo,
    describe,
    open_checkpoint,
    read_chunks,
    read_header,
)
from kfac_hpc.checkpoint.writer import TAG, factor_path, kfac_rank_group, resolve_comm

if TYPE_CHECKING:
    from kfac_hpc.comm import Communicator

__all__ = ["LoadInfo", "load"]


@dataclass
class LoadInfo:
    """What :func:`load` did (identical on every rank except ``rng``)."""

    path: Path
    step: int
    world_size: int  # of the run that saved
    strategy: str
    extra: dict[str, Any] | None
    loaded: list[str] = field(default_factory=list)  # sections applied
    mismatches: list[str] = field(default_factory=list)  # strict=False: what was skipped
    rng: str = ""
    created_utc: str = ""
    versions: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)


class _Placeholder:
    """Stands for a tensor while only the structure of a saved object is examined."""


# ----------------------------------------------------------------- phase 1
def _check(path: str, f: h5py.File, info: FileInfo, comm: Communicator, model: nn.Module,
           optimizer: CheckpointOptimizer | None,
           preconditioner: CheckpointPreconditioner | None, strict: bool,
           restore_rng: bool) -> Plan:
    """Compare the file with the live objects (rank 0) and route every dataset."""
    manifest = info.manifest
    mismatches: list[str] = []
    notes: list[str] = []
    routes: list[Route] = []
    sections: list[str] = []

    def route(p: str, dest: int) -> None:
        m = manifest[p]
        routes.append(Route(p, dest, tuple(m["shape"]), m["dtype"], m["digest"]))

    # ---- model
    net = unwrap(model)
    live = net.state_dict()
    saved_names = info.json_attr(MODEL, "names")
    model_names: list[str] = []
    bad_shape: set[str] = set()
    if saved_names is None:
        mismatches.append("model: the checkpoint has no model state (/model)")
    else:
        for name in saved_names:
            p = f"/{MODEL}/{escape(name)}"
            if name not in live:
                mismatches.append(f"model: {name} is in the checkpoint, not in the model")
            elif list(live[name].shape) != list(manifest[p]["shape"]):
                bad_shape.add(name)
                mismatches.append(f"model: {name} has shape {tuple(manifest[p]['shape'])} "
                                  f"in the checkpoint, {tuple(live[name].shape)} in the model")
            else:
                model_names.append(name)
                route(p, EVERY_RANK)
        saved_set = set(saved_names)
        missing = [n for n in live if n not in saved_set]
        mismatches += [f"model: {n} is missing from the checkpoint" for n in missing]
        sections.append("model")

    # ---- optimizer
    skip_state: list[str] = []
    if optimizer is not None:
        attrs = info.group(OPTIMIZER)
        ok = True
        if attrs is None:
            mismatches.append("optimizer: the checkpoint has no optimizer state (/optimizer)")
            ok = False
        elif attrs.get("class") != type(optimizer).__name__ or \
                attrs.get("layout") != optimizer_layout(optimizer):
            mismatches.append(f"optimizer: the checkpoint holds {attrs.get('class')} state, the "
                              f"optimizer is {type(optimizer).__name__}")
            ok = False
        if ok and attrs is not None:
            structure = json.loads(attrs["structure"])
            torch_opt = torch_layout(optimizer)
            if attrs.get("layout") == TORCH_LAYOUT and torch_opt is not None:  # checked above
                saved = tree.decode(structure, lambda _: _Placeholder())
                skip_state = sorted(bad_shape)
                _, problems = torch_state_from_names(torch_opt, model, saved, set(skip_state),
                                                     strict=False)
                mismatches += problems
            # a sharded optimizer's parts go to their owners now (any saved rank count)
            rank_of = optimizer.checkpoint_load_rank if isinstance(optimizer, ShardedState) \
                else None
            for rel, rank in tree.leaf_routes(structure, rank_of):
                route(f"/{OPTIMIZER}/{rel}", EVERY_RANK if rank is None else rank)
            sections.append("optimizer")

    elif info.group(OPTIMIZER) is not None:
        notes.append("optimizer state in the checkpoint not loaded (no optimizer given)")

    # ---- K-FAC
    kattrs = info.group(KFAC)
    kfac_source: dict[int, int] = {}
    if preconditioner is not None:
        if kattrs is None:
            mismatches.append("preconditioner: the checkpoint has no K-FAC state (/kfac)")
        else:
            table = json.loads(kattrs["factors"])
            keys = list(preconditioner.factor_keys())
            problems = [f"preconditioner: factor {k} is missing from the checkpoint"
                        for k in keys if k not in table]
            problems += [f"preconditioner: factor {k} is in the checkpoint, not in the "
                         "preconditioner" for k in table if k not in set(keys)]
            for k in keys:
                if k in table and tuple(table[k]["shape"]) != tuple(preconditioner.factor_shape(k)):
                    problems.append(f"preconditioner: factor {k} is {tuple(table[k]['shape'])} "
                                    f"in the checkpoint, {tuple(preconditioner.factor_shape(k))} "
                                    "in the preconditioner")
            mismatches += problems
            if problems:
                notes.append("K-FAC state not loaded (it does not match the preconditioner)")
            else:
                for k in keys:
                    owner = int(preconditioner.factor_owner(k))
                    prefix = factor_path(k)
                    for p in manifest:
                        if p == prefix or (p.startswith(prefix + "_") and
                                           "/" not in p[len(prefix) + 1:]):
                            route(p, owner)
                kfac_source = _kfac_sources(kattrs, comm.size, notes)
                for dest, src in kfac_source.items():
                    for p in manifest:
                        if p.startswith(kfac_rank_group(src) + "/"):
                            route(p, dest)
                sections.append("kfac")
    elif kattrs is not None:
        notes.append("K-FAC state in the checkpoint not loaded (no preconditioner given)")

    # ---- RNG
    rattrs = info.group(RNG) or {}
    saved_ws = int(rattrs.get("world_size", info.world_size))
    rng_source: dict[int, int] = {}
    if not restore_rng:
        rng_note = "not restored (restore_rng=False)"
    elif not rattrs:
        rng_note = "not restored (no RNG state in the checkpoint)"
    elif saved_ws == comm.size:
        rng_source = {r: r for r in range(comm.size)}
        rng_note = "restored: each rank its own state"
    elif bool(rattrs.get("identical")):
        rng_source = {EVERY_RANK: 0}
        rng_note = (f"restored: the state every rank shared at save time "
                    f"({saved_ws} ranks -> {comm.size})")
    else:
        rng_note = (f"not restored: world size changed ({saved_ws} -> {comm.size}) and the "
                    "ranks' states differed")
    for dest, src in rng_source.items():
        prefix = f"/{RNG}/rank_{src}/"
        for p in manifest:
            if p.startswith(prefix):
                route(p, dest)
    if rng_source:
        sections.append("rng")

    # ---- extra
    tattrs = info.group(TRAIN)
    if tattrs is not None:
        for rel in tree.leaf_paths(json.loads(tattrs["structure"])):
            route(f"/{TRAIN}/{rel}", EVERY_RANK)

    if strict and mismatches:
        raise CheckpointError(f"{path} does not match the model/optimizer/preconditioner "
                              "(nothing was loaded; strict=False loads what matches)",
                              mismatches, path)
    torch_dtypes = {p: m["torch_dtype"] for p, m in manifest.items() if "torch_dtype" in m}
    groups = {g: a for g, a in info.groups.items()
              if g in (f"/{KFAC}", f"/{OPTIMIZER}", f"/{TRAIN}", f"/{RNG}") or
              any(g == f"/{RNG}/rank_{s}" for s in rng_source.values()) or
              any(g == kfac_rank_group(s) for s in kfac_source.values())}
    return Plan(path, routes, torch_dtypes, info.root, groups, mismatches, sections,
                model_names, skip_state, rng_source, rng_note, notes, kfac_source)


def _kfac_sources(kattrs: dict[str, Any], size: int, notes: list[str]) -> dict[int, int]:
    """Which saved rank's other K-FAC entries each rank gets (the rule of RNG states)."""
    ranks = json.loads(kattrs.get("other_entries", "[]"))
    saved = int(kattrs.get("world_size", size))
    if not ranks:
        return {}
    if saved == size:
        return {r: r for r in ranks}
    if bool(kattrs.get("other_entries_identical")):
        return {EVERY_RANK: ranks[0]}
    notes.append(f"K-FAC: the per-rank entries of state_dict() were not restored: world size "
                 f"changed ({saved} -> {size}) and they differed between ranks")
    return {}


# ----------------------------------------------------------------- phase 2
def _stage_root(comm: Communicator, plan: Plan, f: h5py.File | None,
                owners_read: bool = False) -> tuple[dict[str, np.ndarray], list[str]]:
    """Rank 0 reads each dataset and broadcasts it or sends it to its destination.

    ``owners_read``: datasets for one rank (factors, RNG) are read by that rank itself
    from its own read-only handle; rank 0 still reads and broadcasts replicated ones.
    """
    staged: dict[str, np.ndarray] = {}
    problems: list[str] = []
    checks = _Checks()
    if owners_read:
        mine = [r for r in plan.routes if r.dest == comm.rank and comm.rank != 0]
        if mine:
            own, own_problems = _read_own(plan, mine)
            staged.update(own)
            problems += own_problems
    for r in plan.routes:
        if owners_read and r.dest not in (EVERY_RANK, 0):
            continue
        arr = np.zeros(r.shape if not r.nbytes else (0,), dtype=np.dtype(r.dtype))
        if comm.rank == 0:
            read, problem = _read(f, r)
            if problem or read is None:
                problems.append(problem or f"dataset {r.path}: unreadable")
                arr = np.zeros(r.shape, dtype=np.dtype(r.dtype))  # sent in its place
            else:
                arr = read
                if r.dest in (EVERY_RANK, 0):
                    checks.add(r, arr, "")
        # the other ranks are inside the same transfer: a failure here ends the job
        with comm.aborting(f"checkpoint load: transferring {r.path}") if comm.size > 1 \
                else contextlib.nullcontext():
            if r.nbytes and r.dest == EVERY_RANK and comm.size > 1:
                buf = _as_bytes(arr) if comm.rank == 0 else torch.empty(
                    r.nbytes, dtype=torch.uint8, device="cpu")
                comm.broadcast(buf, root=0)
                arr = _from_bytes(buf, r)
            elif r.nbytes and r.dest not in (EVERY_RANK, 0):
                if comm.rank == 0:
                    comm.send(_as_bytes(arr), r.dest, TAG)
                elif comm.rank == r.dest:
                    buf = torch.empty(r.nbytes, dtype=torch.uint8, device="cpu")
                    comm.recv(buf, 0, TAG)
                    arr = _from_bytes(buf, r)
                    checks.add(r, arr, " after transfer")
        if r.dest in (EVERY_RANK, comm.rank):
            staged[r.path] = arr
    return staged, problems + checks.problems()


class _Checks:
    """CRC-32 checks run in a thread while the next dataset is read or received.

    zlib releases the GIL, so a check overlaps the next read.
    """

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt-check")
        self._pending: list[tuple[Route, str, Future[str]]] = []

    def add(self, r: Route, arr: np.ndarray, where: str) -> None:
        self._pending.append((r, where, self._pool.submit(digest, arr)))

    def problems(self) -> list[str]:
        out = [f"dataset {r.path}: checksum mismatch{where} (stored {r.digest}, data {got})"
               for r, where, fut in self._pending if (got := fut.result()) != r.digest]
        self._pool.shutdown()
        return out


def _stage_all(comm: Communicator, plan: Plan) -> tuple[dict[str, np.ndarray], list[str]]:
    """Every rank opens the file read-only and reads what it needs."""
    return _read_own(plan, [r for r in plan.routes if r.dest in (EVERY_RANK, comm.rank)])


def _read_own(plan: Plan, routes: list[Route]) -> tuple[dict[str, np.ndarray], list[str]]:
    """Open the file read-only and read (and check) ``routes``."""
    staged: dict[str, np.ndarray] = {}
    problems: list[str] = []
    try:
        f = h5py.File(plan.path, "r", locking=False)
    except Exception as exc:  # damaged bytes make h5py raise almost anything
        return staged, [f"cannot open {plan.path}: {describe(exc)}"]
    checks = _Checks()
    with f:
        for r in routes:
            arr, problem = _read(f, r)
            if problem or arr is None:
                problems.append(problem or f"dataset {r.path}: unreadable")
            else:
                checks.add(r, arr, "")
                staged[r.path] = arr
    return staged, problems + checks.problems()


def _read(f: h5py.File | None, r: Route) -> tuple[np.ndarray | None, str | None]:
    try:
        assert f is not None
        arr = c_order(read_chunks(f[r.path]))
    except Exception as exc:  # damaged bytes make h5py raise almost anything
        return None, f"dataset {r.path}: cannot read ({describe(exc)}); fletcher32 checksum " \
                     "failure or damage"
    if arr.shape != r.shape or arr.dtype.str != r.dtype:
        return None, f"dataset {r.path}: {arr.dtype.str}{list(arr.shape)} read, " \
                     f"{r.dtype}{list(r.shape)} expected"
    return arr, None


def _as_bytes(arr: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(c_order(arr).reshape(-1).view(np.uint8))


def _from_bytes(buf: torch.Tensor, r: Route) -> np.ndarray:
    return buf.numpy().view(np.dtype(r.dtype)).reshape(r.shape)


def _locate(directory_or_path: str | os.PathLike[str]) -> Path:
    path = Path(directory_or_path)
    if path.is_dir():
        found = atomic.latest(path)
        if found is None:
            raise CheckpointError(f"no checkpoint in {path}", path=str(path))
        return found
    return path


def load(directory_or_path: str | os.PathLike[str], *, model: nn.Module,
         optimizer: CheckpointOptimizer | None,
         preconditioner: CheckpointPreconditioner | None = None,
         comm: Communicator | None = None, strict: bool = True,
         read_mode: Literal["root", "owners", "all"] = "owners",
         restore_rng: bool = True) -> LoadInfo:
    """Load a checkpoint into live objects (collective: every rank calls it).

    Loading is all or nothing: a section that fails to apply on any rank puts back what
    was applied (see :mod:`kfac_hpc.checkpoint.apply`). Tensors go to the live objects'
    devices (:mod:`kfac_hpc.checkpoint.devices`).

    Args:
        directory_or_path: A checkpoint file, or a directory (its latest checkpoint).
        model: The model (a DDP / DataParallel wrapper is unwrapped).
        optimizer: The optimizer, or None (its state in the file is not loaded).
        preconditioner: The K-FAC preconditioner, if any.
        comm: The ranks (default: the preconditioner's, else the world).
        strict: Refuse a file that does not match the model, optimizer or
            preconditioner. False loads what matches (a mismatched preconditioner is
            left as it is) and lists the rest in ``LoadInfo.mismatches``.
        read_mode: ``"owners"``: rank 0 reads and broadcasts replicated state, each
            rank reads its own factors and RNG state. ``"root"``: rank 0 reads
            everything and broadcasts / sends it (one file open). ``"all"``: every rank
            reads all it needs, replicated state included.
        restore_rng: Restore the RNG states (when the world size allows; see the module
            docstring).

    Returns:
        What was loaded, the file's step and world size, the decoded ``extra``.

    Raises:
        ValueError: An unknown ``read_mode``.
        TypeError: On every rank, when the optimizer or preconditioner of some rank
            lacks a member of its protocol (:mod:`kfac_hpc.checkpoint.contracts`).
        CheckpointError: On every rank, with the same message, when the file is
            missing, damaged, of a newer format, holds NaN/Inf in its training state, or
            (``strict=True``) does not match the live objects; nothing is loaded then.
    """
    if read_mode not in ("root", "owners", "all"):
        raise ValueError(f"read_mode must be 'root', 'owners' or 'all', got {read_mode!r}")
    comm = resolve_comm(comm, preconditioner)
    contracts.agree(comm, contracts.problems(optimizer=optimizer, preconditioner=preconditioner),
                    "checkpoint load")
    plan: Plan | None = None
    f: h5py.File | None = None
    error: CheckpointError | None = None
    if comm.rank == 0:
        try:
            path = _locate(directory_or_path)
            f = open_checkpoint(path)
            info, problems = read_header(f, str(path))
            if problems:
                raise CheckpointError(f"{path} is damaged (nothing was loaded)", problems,
                                      str(path))
            plan = _check(os.path.abspath(path), f, info, comm, model, optimizer,
                          preconditioner, strict, restore_rng)
        except CheckpointError as exc:
            error = exc
        except Exception as exc:
            error = CheckpointError(f"cannot load {directory_or_path}: "
                                    f"{type(exc).__name__}: {exc}")
        if error is not None and f is not None:
            f.close()
            f = None
    outcome = comm.broadcast_object(
        (plan, None) if error is None else (None, (str(error), error.problems, error.path)))
    if outcome[1] is not None:
        message, problems, where = outcome[1]
        raise CheckpointError(message.split("\n")[0], problems, where)
    plan = outcome[0]
    assert plan is not None

    try:
        if read_mode in ("root", "owners"):
            staged, problems = _stage_root(comm, plan, f, owners_read=read_mode == "owners")
        else:
            if f is not None:
                f.close()
                f = None
            staged, problems = _stage_all(comm, plan)
    finally:
        if f is not None:
            f.close()
    everyone = comm.allgather_object(problems)
    found = sorted({p for rank_problems in everyone for p in rank_problems})
    if found:
        raise CheckpointError(f"{plan.path} is damaged (nothing was loaded)", found, plan.path)

    ready = apply.prepare(comm, plan, staged, model, optimizer, preconditioner)
    del staged
    done, unrestored = apply.apply(comm, plan, ready, model, optimizer, preconditioner, strict)
    root = plan.root
    rng_note = plan.rng_note if not unrestored else (
        f"{plan.rng_note}, but not every generator: {'; '.join(unrestored)}")
    return LoadInfo(
        path=Path(plan.path), step=int(root["step"]), world_size=int(root["world_size"]),
        strategy=str(root.get("strategy", "none")), extra=ready.extra, loaded=done,
        mismatches=list(plan.mismatches) + plan.notes, rng=rng_note,
        created_utc=str(root.get("created_utc", "")),
        versions=json.loads(root.get("versions", "{}")),
        config=json.loads(root.get("config", "{}")))
