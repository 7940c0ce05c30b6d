"""``save``: one HDF5 file from the state of every rank, written atomically.

Serial h5py (the default, and the only choice with the PyPI wheel): rank 0 writes.
Replicated state (model, optimizer, ``extra``) is rank 0's own; every K-FAC factor is
sent by its owner to rank 0 in factor-key order, one message per factor, and written
as soon as it arrives, so rank 0 holds at most one factor beyond its own (two with
``prefetch=True``); every rank's RNG state follows the same way. Owners compute their
factors' digests, so checksumming is spread over the ranks; rank 0 computes its own
while HDF5 writes. HDF5 writes through a :class:`~kfac_hpc.checkpoint.storage.GuardedFile`
that writes the file back to disk as it grows (``fdatasync`` every 64 MiB, so that the
final fsync is short) and keeps a full disk away from HDF5 (see ``storage``).

K-FAC state: ``factors``, ``eigenbases`` (per factor key, each from its owner) and
``factor_updates`` are stored by factor key; ``step`` and ``config`` as attributes;
any other entry of ``state_dict()`` (nested dicts, lists, tensors, numbers) is stored
per rank under ``/kfac/@rank_<r>``, like RNG states.

Parallel HDF5 (h5py built with MPI, ``h5py.get_config().mpi``): every rank opens the
file with the ``mpio`` driver, the datasets are created collectively and each owner
writes its own data; the layout is the same except that datasets are contiguous
(HDF5 writes filtered datasets only collectively), which the CRC-32 digests cover.
Checked with h5py built against parallel HDF5 1.10.8 / Open MPI 4.1 (the MPI
checkpoint tests pass on 2 and 4 ranks; the files load with serial h5py).

Failures are agreed on: an error on any rank is raised on every rank as the same
:class:`CheckpointError`, and nothing is committed. State holding NaN or Inf in the
model, optimizer or K-FAC sections is refused (:class:`NonFiniteStateError`) before
anything is written or pruned; so is a checkpoint larger than the free space.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import platform
import queue
import threading
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import h5py
import numpy as np
import torch
from torch import nn

from kfac_hpc.checkpoint import atomic, contracts, rng, storage, tree
from kfac_hpc.checkpoint.contracts import (
    CheckpointOptimizer,
    CheckpointPreconditioner,
    RemoteLeaf,
    StreamingState,
)
from kfac_hpc.checkpoint.errors import CheckpointError, NonFiniteStateError
from kfac_hpc.checkpoint.finite import all_finite
from kfac_hpc.checkpoint.layout import (
    FORMAT,
    FORMAT_VERSION,
    KFAC,
    LATEST,
    LIBVER,
    MODEL,
    OPTIMIZER,
    RNG,
    SUFFIX,
    TRAIN,
    c_order,
    canonical_attrs,
    checkpoint_name,
    chunk_shape,
    digest,
    escape,
    step_of_name,
    tensor_to_storage,
    text_digest,
    to_json,
    walk,
)
from kfac_hpc.checkpoint.state import (
    optimizer_layout,
    torch_layout,
    torch_state_by_name,
    unwrap,
)
from kfac_hpc.kfac.state import KFACStateDict

if TYPE_CHECKING:
    from kfac_hpc.comm import Communicator

__all__ = ["KFAC_ENTRIES", "Entry", "factor_path", "kfac_rank_group", "save"]

TAG = 7306  # point-to-point tag of checkpoint traffic
#: Entries of a K-FAC ``state_dict()`` with their own layout; any other is stored per rank.
KFAC_ENTRIES = ("step", "config", "factors", "factor_updates", "eigenbases")


log = logging.getLogger("kfac_hpc")

@dataclass
class Entry:
    """One dataset: where it goes, who holds its data, what it is."""

    path: str
    owner: int
    shape: tuple[int, ...]
    dtype: str  # NumPy storage dtype, e.g. "<f4"
    attrs: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes of the dataset's data."""
        return int(np.dtype(self.dtype).itemsize * int(np.prod(self.shape, dtype=np.int64)))


def factor_path(key: str) -> str:
    """Return the dataset path of factor ``key``.

    Args:
        key: A factor name, e.g. ``"layer1.0.conv1/A"``.

    Returns:
        E.g. ``/kfac/layer1.0.conv1/A`` (each part escaped).
    """
    return f"/{KFAC}/" + "/".join(escape(p) for p in key.split("/"))


def kfac_rank_group(rank: int) -> str:
    """Return the group of rank ``rank``'s other K-FAC entries.

    Args:
        rank: The rank that saved them.

    Returns:
        ``/kfac/@rank_<rank>`` (``@`` keeps it apart from layers).
    """
    return f"/{KFAC}/@rank_{rank}"


def resolve_comm(comm: Communicator | None,
                 preconditioner: CheckpointPreconditioner | None) -> Communicator:
    """Return the communicator of a save or load.

    Args:
        comm: The one given, if any.
        preconditioner: The preconditioner given, if any.

    Returns:
        ``comm`` if given, else the preconditioner's (when it follows
        :class:`~kfac_hpc.checkpoint.contracts.CheckpointPreconditioner`), else the
        world communicator.
    """
    if comm is not None:
        return comm
    if isinstance(preconditioner, CheckpointPreconditioner) and preconditioner.comm is not None:
        return preconditioner.comm
    from kfac_hpc.comm import world

    return world()


def agree(comm: Communicator, error: str | None, what: str) -> None:
    """Raise the same CheckpointError on every rank when ``error`` is set on any rank.

    Args:
        comm: The ranks (collective).
        error: This rank's error, if any.
        what: The operation, for the message.

    Raises:
        CheckpointError: Listing every rank's error, on every rank.
    """
    errors = comm.allgather_object(error)
    bad = [(r, e) for r, e in enumerate(errors) if e]
    if bad:
        problems = [f"rank {r}: {e}" for r, e in bad]
        raise CheckpointError(f"{what} failed on {len(bad)} rank(s)", problems)


def _add(entries: list[Entry], local: dict[str, np.ndarray], path: str, owner: int,
         value: torch.Tensor | np.ndarray, attrs: dict[str, Any] | None = None,
         defer_digest: bool = False, nonfinite: list[str] | None = None) -> None:
    """Record a dataset held by this rank (storage array + digest).

    ``defer_digest``: the writer computes it while HDF5 writes the data (rank 0's own).
    ``nonfinite``: check the value; its path is appended there if it holds NaN/Inf.
    """
    if nonfinite is not None and not all_finite(value):
        nonfinite.append(path)
    if isinstance(value, torch.Tensor):
        arr, tdt = tensor_to_storage(value)
        extra: dict[str, Any] = {"torch_dtype": tdt}
    else:
        arr, extra = c_order(value), {}
    a = {**extra, **(attrs or {}), "digest": None if defer_digest else digest(arr)}
    entries.append(Entry(path, owner, tuple(arr.shape), arr.dtype.str, a))
    local[path] = arr


def _versions() -> dict[str, str]:
    import mpi4py
    from mpi4py import MPI

    from kfac_hpc import __version__

    return {"kfac_hpc": __version__, "python": platform.python_version(),
            "torch": torch.__version__, "numpy": np.__version__, "h5py": h5py.__version__,
            "hdf5": h5py.version.hdf5_version, "mpi4py": mpi4py.__version__,
            "mpi_library": MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0]}


@dataclass
class _Prepared:
    """What this rank contributes, and (on rank 0) the file's groups and root attributes."""

    entries: list[Entry] = field(default_factory=list)  # datasets this rank holds
    local: dict[str, np.ndarray] = field(default_factory=dict)
    groups: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    root: dict[str, Any] = field(default_factory=dict)
    factors: dict[str, dict[str, Any]] = field(default_factory=dict)  # owned factor metadata
    rng_attrs: dict[str, Any] = field(default_factory=dict)
    kfac_structure: Any = None  # this rank's other K-FAC entries (tree structure)
    nonfinite: list[str] = field(default_factory=list)  # datasets holding NaN/Inf


def _prepare(comm: Communicator, model: nn.Module, optimizer: CheckpointOptimizer | None,
             preconditioner: CheckpointPreconditioner | None, step: int,
             extra: dict[str, Any] | None, store_eigenbases: bool,
             opt_sd: Mapping[str, object] | None, pre_sd: KFACStateDict | None, defer: bool,
             check_finite: bool = True, streaming: bool = False) -> _Prepared:
    rank = comm.rank
    defer = defer and rank == 0  # rank 0 writes: its digests overlap with the writes
    p = _Prepared()
    bad = p.nonfinite if check_finite else None
    # ---- K-FAC factors this rank owns (sent to the writer in factor-key order)
    if preconditioner is not None and pre_sd is not None:
        eig = pre_sd.get("eigenbases") or {}
        for key in preconditioner.factor_keys():
            if key not in pre_sd["factor_updates"]:
                continue
            p.factors[key] = {"updates": int(pre_sd["factor_updates"][key]), "owner": rank,
                              "stored": key in pre_sd["factors"] and
                              pre_sd["factors"][key] is not None}
            if p.factors[key]["stored"]:
                _add(p.entries, p.local, factor_path(key), rank, pre_sd["factors"][key],
                     {"key": key, "updates": p.factors[key]["updates"], "owner": rank}, defer,
                     bad)
            for part, tensor in sorted((eig.get(key) or {}).items()):
                _add(p.entries, p.local, f"{factor_path(key)}_{escape(part)}", rank, tensor,
                     {"key": key, "eigen": part}, defer, bad)
        others = {k: v for k, v in pre_sd.items() if k not in KFAC_ENTRIES}
        if others:
            group = kfac_rank_group(rank)
            p.kfac_structure, leaves = tree.encode(others, group)
            for rel, leaf in leaves:
                path = f"{group}/{rel}"
                _add(p.entries, p.local, path, rank, tree.held(path, leaf), nonfinite=bad)
    # ---- this rank's RNG states
    arrays, p.rng_attrs = rng.capture()
    for name, arr in arrays.items():
        _add(p.entries, p.local, f"/{RNG}/rank_{rank}/{name}", rank, arr)
    if rank != 0:
        if streaming and opt_sd is not None:  # this rank's optimizer blocks, sent first
            own: list[Entry] = []
            for rel, value in tree.encode(opt_sd, f"/{OPTIMIZER}")[1]:
                if not isinstance(value, RemoteLeaf):
                    _add(own, p.local, f"/{OPTIMIZER}/{rel}", rank, value, nonfinite=bad)
            p.entries = own + p.entries
        return p

    # ---- rank 0: replicated state and the file's metadata
    head: list[Entry] = []
    net = unwrap(model)
    msd = net.state_dict()
    names = list(msd)
    p.groups.append((f"/{MODEL}", {"names": to_json(names), "class": type(net).__name__}))
    for name in names:
        _add(head, p.local, f"/{MODEL}/{escape(name)}", 0, msd[name], defer_digest=defer,
             nonfinite=bad)
    if optimizer is not None and opt_sd is not None:
        torch_opt = torch_layout(optimizer)
        state = torch_state_by_name(torch_opt, model, opt_sd) if torch_opt is not None \
            else opt_sd
        structure, leaves = tree.encode(state, f"/{OPTIMIZER}")
        p.groups.append((f"/{OPTIMIZER}", {"layout": optimizer_layout(optimizer),
                                           "class": type(optimizer).__name__,
                                           "structure": to_json(structure)}))
        for rel, value in leaves:
            if isinstance(value, RemoteLeaf):  # streaming: its owner sends it (see _plan)
                head.append(Entry(f"/{OPTIMIZER}/{rel}", int(value.remote_owner),
                                  tuple(value.shape), "|u1", {"remote": True}))
                continue
            _add(head, p.local, f"/{OPTIMIZER}/{rel}", 0, value, defer_digest=defer,
                 nonfinite=bad)
    tail: list[Entry] = []
    if extra is not None:
        structure, leaves = tree.encode(extra, f"/{TRAIN}")
        p.groups.append((f"/{TRAIN}", {"structure": to_json(structure)}))
        for rel, leaf in leaves:
            path = f"/{TRAIN}/{rel}"
            _add(tail, p.local, path, 0, tree.held(path, leaf))
    p.entries = head + p.entries + tail
    config = pre_sd.get("config", {}) if pre_sd is not None else {}
    strategy = config.get("strategy", "none") if isinstance(config, dict) else "none"
    p.root = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "step": int(step),
        "world_size": comm.size, "strategy": str(strategy),
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"),
        "versions": to_json(_versions()), "config": to_json(config),
    }
    return p


def _plan(comm: Communicator, mine: _Prepared, preconditioner: CheckpointPreconditioner | None,
          pre_sd: KFACStateDict | None, everything: bool) -> tuple[list[Entry], _Prepared,
                                                                    str | None]:
    """The global dataset order (identical on every rank that builds it).

    Rank 0's replicated datasets first, then factors in key order (each factor, then
    its eigenbasis parts), then the other K-FAC entries by rank, then RNG by rank, then
    ``extra``. Each rank sends its datasets in this order. ``everything``: every rank
    learns the whole plan (parallel HDF5); otherwise only rank 0 does. Returns (plan,
    prepared, error).
    """
    own = [e for e in mine.entries if e.path.startswith((f"/{KFAC}/", f"/{RNG}/"))
           or (comm.rank != 0 and e.path.startswith(f"/{OPTIMIZER}/"))]
    gathered = comm.allgather_object((own, mine.factors, mine.rng_attrs, mine.kfac_structure))
    if everything:
        meta = _Prepared([e for e in mine.entries
                          if not e.path.startswith((f"/{KFAC}/", f"/{RNG}/"))],
                         {}, mine.groups, mine.root) if comm.rank == 0 else None
        head_tail = comm.broadcast_object(meta)
    else:
        head_tail = mine
    if comm.rank != 0 and not everything:
        return [], mine, None
    # optimizer blocks streamed by their owners (DistributedShampoo) replace placeholders
    streamed = {e.path: e for g in gathered for e in g[0] if e.path.startswith(f"/{OPTIMIZER}/")}
    plan = []
    for e in head_tail.entries:
        if not e.path.startswith((f"/{MODEL}/", f"/{OPTIMIZER}/")):
            continue
        if e.attrs.get("remote"):
            got = streamed.get(e.path)
            if got is None or got.owner != e.owner:
                return [], mine, (f"optimizer state {e.path} should come from rank {e.owner}, "
                                  "which did not report it")
            e = got
        plan.append(e)
    groups = list(head_tail.groups)
    if preconditioner is not None and pre_sd is not None:
        factors: dict[str, dict[str, Any]] = {}
        by_key: dict[str, list[Entry]] = {}
        for rank_entries, f, _, _ in gathered:
            factors.update(f)
            for e in rank_entries:
                if "key" in e.attrs:
                    by_key.setdefault(e.attrs["key"], []).append(e)
        keys = list(preconditioner.factor_keys())
        missing = [k for k in keys if k not in factors]
        if missing:
            return [], mine, ("no rank reported factor_updates for factor(s) "
                              f"{missing[:10]} in preconditioner.state_dict()")
        reserved = [k for k in keys if factor_path(k).startswith(f"/{KFAC}/@")]
        if reserved:
            return [], mine, (f"layer names starting with '@' are reserved in checkpoints: "
                              f"{reserved[:10]}")
        for key in keys:
            plan += by_key.get(key, [])
        others = [(r, g[3]) for r, g in enumerate(gathered) if g[3] is not None]
        for r, _ in others:
            plan += [e for e in gathered[r][0] if e.path.startswith(kfac_rank_group(r) + "/")]
        table = {k: {"shape": list(preconditioner.factor_shape(k)), "path": factor_path(k),
                     **factors[k]} for k in keys}
        config = pre_sd.get("config", {})
        groups.append((f"/{KFAC}", {
            "step": int(pre_sd.get("step", 0)), "config": to_json(config),
            "strategy": str(config.get("strategy", "none")) if isinstance(config, dict)
            else "none", "world_size": comm.size, "factors": to_json(table),
            "eigenbases": any("eigen" in e.attrs for es in by_key.values() for e in es),
            "other_entries": to_json([r for r, _ in others]),
            "other_entries_identical": len(others) == comm.size and len(
                {_kfac_fingerprint(gathered[r]) for r, _ in others}) == 1}))
        groups += [(g, {}) for g in dict.fromkeys(factor_path(k).rsplit("/", 1)[0]
                                                  for k in keys)]
        groups += [(kfac_rank_group(r), {"structure": to_json(structure)})
                   for r, structure in others]
    fingerprints = [_rng_fingerprint(g) for g in gathered]
    groups.append((f"/{RNG}", {"world_size": comm.size,
                               "identical": all(fp == fingerprints[0] for fp in fingerprints)}))
    for r, (rank_entries, _, attrs, _) in enumerate(gathered):
        groups.append((f"/{RNG}/rank_{r}", attrs))
        plan += [e for e in rank_entries if e.path.startswith(f"/{RNG}/")]
    plan += [e for e in head_tail.entries if e.path.startswith(f"/{TRAIN}/")]
    return plan, _Prepared(plan, mine.local, groups, dict(head_tail.root)), None


def _kfac_fingerprint(gathered: tuple[list[Entry], Any, dict[str, Any], Any]) -> str:
    """The structure and digests of one rank's other K-FAC entries (for equality)."""
    entries, _, _, structure = gathered
    digests = [e.attrs["digest"] for e in entries if e.path.startswith(f"/{KFAC}/@")]
    return to_json([structure, digests])


def _rng_fingerprint(gathered: tuple[list[Entry], Any, dict[str, Any], Any]) -> str:
    """The digests and scalar attributes of one rank's RNG state (for equality)."""
    entries, _, attrs, _ = gathered
    digests = {e.path.rsplit("/", 1)[-1]: e.attrs["digest"] for e in entries
               if e.path.startswith(f"/{RNG}/")}
    return to_json([digests, attrs])


def _finish_file(f: h5py.File, plan: list[Entry], root: dict[str, Any]) -> None:
    """Root attributes, the manifest and the digest of all attributes (written last)."""
    manifest = {e.path: {"shape": list(e.shape), "dtype": e.dtype, "digest": e.attrs["digest"],
                         **({"torch_dtype": e.attrs["torch_dtype"]}
                            if "torch_dtype" in e.attrs else {})} for e in plan}
    f.attrs.update(root)
    f.attrs["contents"] = to_json(sorted(f.keys()))
    f.attrs["manifest"] = to_json(manifest)
    f.attrs["attrs_digest"] = text_digest(canonical_attrs(walk(f)))


def _write_serial(comm: Communicator, plan: list[Entry], prep: _Prepared, tmp: Path | None,
                  fletcher32: bool, prefetch: bool = False) -> str | None:
    """Rank 0 writes every dataset; owners send theirs. Returns rank 0's error, if any."""
    if comm.rank != 0:
        with comm.aborting("checkpoint write: sending this rank's state to rank 0"):
            for e in prep.entries:
                if e.owner == comm.rank and e.nbytes and e.path.startswith(
                        (f"/{KFAC}/", f"/{RNG}/", f"/{OPTIMIZER}/")):
                    comm.send(_as_bytes(prep.local[e.path]), 0, TAG)
        return None
    assert tmp is not None
    error: str | None = None
    f: h5py.File | None = None
    guard: storage.GuardedFile | None = None
    hasher = ThreadPoolExecutor(1, thread_name_prefix="ckpt-digest")
    needed = sum(e.nbytes for e in plan)
    try:
        guard = storage.GuardedFile(tmp)
        f = h5py.File(guard, "w", libver=LIBVER, locking=False)
        for gpath, attrs in prep.groups:
            f.require_group(gpath).attrs.update(attrs)
    except Exception as exc:  # keep receiving so that no sender blocks forever
        error = f"cannot create {tmp}: {exc}"
    remote = _Receiver(comm, [e for e in plan if e.owner != 0], prefetch)
    for e in plan:
        data = prep.local.get(e.path) if e.owner == 0 else None
        if e.owner != 0:
            data = remote.next()
        if error is not None or f is None or (guard is not None and guard.error is not None):
            continue  # after a failed write HDF5 writes into the void; nothing more to add
        assert data is not None
        pending: Future[str] | None = None
        if e.attrs.get("digest") is None:  # CRC-32 (GIL released) while HDF5 writes
            pending = hasher.submit(digest, data)
        try:
            _write_dataset(f, e, data, fletcher32, pending)
        except Exception as exc:
            error = f"writing {e.path} to {tmp}: {exc}"
    hasher.shutdown()
    try:
        if f is not None and error is None and guard is not None and guard.error is None:
            _finish_file(f, plan, prep.root)
    except Exception as exc:
        error = f"finishing {tmp}: {exc}"
    finally:
        if f is not None:
            try:
                f.close()
            except Exception as exc:
                error = error or f"closing {tmp}: {exc}"
        if guard is not None:
            if error is None:
                guard.sync()
            guard.close()
            if guard.error is not None:  # the disk's word comes first: it explains the rest
                error = storage.space_problem(tmp.parent, needed, guard.error, guard.written,
                                              tmp.name)
    return error


class _Receiver:
    """Remote datasets in plan order.

    With ``prefetch`` the next one arrives (in a thread) while the current one is
    written, so at most two are held at once.
    """

    def __init__(self, comm: Communicator, entries: list[Entry], prefetch: bool) -> None:
        self._comm = comm
        self._entries = entries
        self._i = 0
        self._ready: queue.Queue[np.ndarray | BaseException] = queue.Queue()
        self._slots = threading.Semaphore(1)
        self._thread: threading.Thread | None = None
        if prefetch and entries:
            self._thread = threading.Thread(target=self._run, name="ckpt-recv", daemon=True)
            self._thread.start()

    def _recv(self, e: Entry) -> np.ndarray:
        # its owner is sending (and every later owner will): a rank that stops here
        # leaves them blocked, so a failure ends the job
        with self._comm.aborting(f"checkpoint write: receiving {e.path} from rank {e.owner}"):
            buf = torch.empty(e.nbytes, dtype=torch.uint8, device="cpu")
            if e.nbytes:
                self._comm.recv(buf, e.owner, TAG)
            return buf.numpy().view(np.dtype(e.dtype)).reshape(e.shape)

    def _run(self) -> None:
        try:
            for e in self._entries:
                self._slots.acquire()  # the one after the dataset being written waits
                self._ready.put(self._recv(e))
        except BaseException as exc:  # to next(), which would wait forever otherwise
            self._ready.put(exc)

    def next(self) -> np.ndarray:
        e = self._entries[self._i]
        self._i += 1
        if self._thread is None:
            return self._recv(e)
        data = self._ready.get()
        if isinstance(data, BaseException):
            raise data
        self._slots.release()
        if self._i == len(self._entries):
            self._thread.join()
        return data


def _as_bytes(arr: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(c_order(arr).reshape(-1).view(np.uint8))


def _write_dataset(f: h5py.File, e: Entry, data: np.ndarray, fletcher32: bool,
                   pending: Future[str] | None = None) -> None:
    chunks = chunk_shape(e.shape, np.dtype(e.dtype).itemsize) if fletcher32 else None
    kwargs: dict[str, Any] = {"chunks": chunks, "fletcher32": True} if chunks else {}
    d = f.create_dataset(e.path, data=data, **kwargs)
    if pending is not None:
        e.attrs["digest"] = pending.result()
    d.attrs.update(e.attrs)


def _write_parallel(comm: Communicator, plan: list[Entry], prep: _Prepared,
                    tmp: Path) -> str | None:  # pragma: no cover - needs parallel h5py
    """Collective metadata, independent data writes (h5py with the ``mpio`` driver)."""
    error: str | None = None
    try:
        with h5py.File(tmp, "w", driver="mpio", comm=comm.mpi, libver=LIBVER) as f:
            for gpath, attrs in prep.groups:
                f.require_group(gpath).attrs.update(attrs)
            dsets = {}
            for e in plan:
                d = f.create_dataset(e.path, shape=e.shape, dtype=np.dtype(e.dtype))
                d.attrs.update(e.attrs)
                dsets[e.path] = d
            for e in plan:
                if e.owner == comm.rank and e.nbytes:
                    dsets[e.path][...] = prep.local[e.path]
            _finish_file(f, plan, prep.root)
            # collective (MPI_File_sync): every rank's data durable before rank 0 commits
            f.flush()
    except Exception as exc:
        error = f"parallel write of {tmp}: {exc}"
    return error


def _agree_finite(comm: Communicator, nonfinite: list[str], step: int) -> None:
    """Raise the same NonFiniteStateError on every rank when any rank found NaN/Inf."""
    found = comm.allgather_object(nonfinite[:1])
    bad = [(r, names[0]) for r, names in enumerate(found) if names]
    if bad:
        rank, name = bad[0]
        where = "" if comm.size == 1 else f" (on rank {rank})"
        raise NonFiniteStateError(
            f"refusing to write the checkpoint of step {step}: {name}{where} holds NaN/Inf "
            "values (the run has diverged); nothing was written and earlier checkpoints "
            "are kept", name, rank)


def _commit(tmp: Path, final: Path, is_dir: bool, keep_last: int | None,
            needed: int, keep_every_steps: int | None = None,
            keep: tuple[str, ...] = ()) -> str | None:
    """Rename ``tmp`` to ``final``, then (a directory) point ``latest`` at it and prune.

    Returns the error, if any. A pointer that cannot be written takes the new file back
    out (unless it replaced one of the same name), so ``latest`` and the directory are
    as before the save. Once ``latest`` names the new file the save has succeeded:
    files of later steps (a run this one abandoned) are moved aside
    (:func:`~kfac_hpc.checkpoint.atomic.set_aside_later`) and old ones pruned, and a
    failure there is logged, not raised.
    """
    existed = final.exists()
    try:
        atomic.commit(tmp, final)
    except OSError as exc:
        return f"committing {final}: " + storage.space_problem(final.parent, needed, exc,
                                                                name=tmp.name)
    if not is_dir:
        return None
    try:
        atomic.write_pointer(final.parent, final.name)
    except OSError as exc:
        problem = f"updating {final.parent / LATEST}: " + storage.space_problem(
            final.parent, needed, exc, name=LATEST)
        if not existed:
            with contextlib.suppress(OSError):
                final.unlink()
                atomic.fsync_dir(final.parent)
        return problem
    try:  # the checkpoint is committed: what follows only tidies the directory
        step = step_of_name(final.name)
        if step is not None:
            moved = atomic.set_aside_later(
                final.parent, step, now=datetime.datetime.now(datetime.timezone.utc)
                .strftime("%Y%m%dT%H%M%S.%fZ"))
            if moved:
                log.warning("checkpoint step %d is below %d file(s) of later steps in %s: "
                            "a run resumed from an older checkpoint; they were moved to %s",
                            step, len(moved), final.parent, moved[0].parent)
        atomic.prune(final.parent, keep_last, protect=final.name,
                     keep_every_steps=keep_every_steps, keep=keep)
    except OSError as exc:
        log.warning("%s was written and is the latest checkpoint, but tidying %s failed "
                    "(older checkpoints may remain): %s", final, final.parent, exc)
    return None


def _target(path: Path, step: int) -> tuple[Path, bool]:
    """(final file, whether ``path`` is a checkpoint directory)."""
    if path.suffix == SUFFIX or path.is_file():
        return path, False
    return path / checkpoint_name(step), True


def save(directory_or_path: str | os.PathLike[str], *, model: nn.Module,
         optimizer: CheckpointOptimizer | None,
         preconditioner: CheckpointPreconditioner | None = None, step: int,
         comm: Communicator | None = None,
         extra: dict[str, Any] | None = None, keep_last: int | None = 3,
         store_eigenbases: bool = True, fletcher32: bool = True,
         parallel: bool | None = None, prefetch: bool = False,
         check_finite: bool = True, keep_every_steps: int | None = None,
         keep: tuple[str, ...] = ()) -> Path:
    """Write a checkpoint (collective: every rank calls it with its own objects).

    Every failure raises :class:`CheckpointError` on every rank, with the same message;
    the temporary file is then removed and earlier checkpoints and ``latest`` are as
    they were. A checkpoint that does not fit in the free space is refused before it
    is written; a disk that fills up while writing ends the same way.

    Args:
        directory_or_path: A directory (file ``ckpt_<step>.h5`` in it, then the
            ``latest`` pointer, then pruning to the last ``keep_last``) or a ``.h5``
            file path (written atomically; no pointer, no pruning).
        model: The model (a DDP / DataParallel wrapper is unwrapped).
        optimizer: The optimizer, or None (no optimizer state).
        preconditioner: The K-FAC preconditioner, if any.
        step: The training step (names the file in a directory).
        comm: The ranks (default: the preconditioner's, else the world).
        extra: A JSON-able dict that may hold tensors and arrays (the driver's state,
            stored under ``/train``).
        keep_last: Checkpoints the pruning keeps in a directory; None or 0 keeps all.
        store_eigenbases: Also store the decompositions the preconditioner reports with
            ``state_dict(eigenbases=True)``: a run resumed between two inverse updates
            then continues bitwise. False halves the K-FAC part of the file; they are
            then recomputed from the factors on load.
        fletcher32: HDF5's per-chunk checksum on datasets >= 16 KiB (CRC-32 digests
            are always stored and verified).
        parallel: Use parallel HDF5 (default: when h5py has it and there is more than
            one rank).
        prefetch: Rank 0 receives the next factor while writing the current one
            (faster; it then holds two remote factors at a time instead of one).
        check_finite: Refuse model, optimizer and K-FAC state holding NaN or Inf
            (before anything is written or pruned).
        keep_every_steps: The pruning also keeps the first checkpoint at or after every
            multiple of this step count (milestones,
            :func:`kfac_hpc.checkpoint.atomic.milestones`; never deleted by it).
        keep: Names of checkpoints in the directory that the pruning never deletes
            either (e.g. the best by a monitored metric); they do not count against
            ``keep_last``.

    Returns:
        The file's path, on every rank.

    Raises:
        TypeError: On every rank, when the optimizer or preconditioner of some rank
            lacks a member of its protocol (:mod:`kfac_hpc.checkpoint.contracts`).
        NonFiniteStateError: State holding NaN or Inf (``check_finite``).
        CheckpointError: Any other failure.
    """
    comm = resolve_comm(comm, preconditioner)
    st = _stage(comm, directory_or_path, model=model, optimizer=optimizer,
                preconditioner=preconditioner, step=step, extra=extra, keep_last=keep_last,
                store_eigenbases=store_eigenbases, fletcher32=fletcher32, parallel=parallel,
                prefetch=prefetch, check_finite=check_finite)
    st.keep_every_steps, st.keep = keep_every_steps, tuple(keep)
    return _write_and_agree(comm, st)


@dataclass
class _Staged:
    """A save whose collective part is done: what remains is writing and committing."""

    final: Path
    tmp: Path
    is_dir: bool
    plan: list[Entry]
    prep: _Prepared
    keep_last: int | None
    fletcher32: bool
    prefetch: bool
    use_parallel: bool
    keep_every_steps: int | None = None
    keep: tuple[str, ...] = ()


def _stage(comm: Communicator, directory_or_path: str | os.PathLike[str], *, model: nn.Module,
           optimizer: CheckpointOptimizer | None,
           preconditioner: CheckpointPreconditioner | None, step: int,
           extra: dict[str, Any] | None,
           keep_last: int | None, store_eigenbases: bool, fletcher32: bool,
           parallel: bool | None, prefetch: bool, check_finite: bool,
           snapshot: dict[str, np.ndarray] | None = None) -> _Staged:
    """Everything of a save up to the writing (collective; errors agreed on every rank).

    ``snapshot``: copy this rank's datasets into host memory of its own, so that
    training may change the model, optimizer and preconditioner while they are
    written; the dict keeps those buffers (by dataset path) for the next snapshot,
    which then copies into memory already mapped (no page faults).
    """
    contracts.agree(comm, contracts.problems(optimizer=optimizer, preconditioner=preconditioner),
                    "checkpoint save")
    step = int(step)
    use_parallel = (bool(h5py.get_config().mpi) and comm.size > 1) if parallel is None \
        else parallel
    if use_parallel and not h5py.get_config().mpi:
        raise CheckpointError("parallel=True needs h5py built with MPI (parallel HDF5); "
                              "this h5py is serial")
    error: str | None = None
    opt_sd: Mapping[str, object] | None = None
    pre_sd: KFACStateDict | None = None
    # Streaming (serial HDF5): an optimizer whose state is sharded over the ranks
    # (DistributedShampoo) reports placeholders for other ranks' blocks, whose owners
    # send them to rank 0 one at a time, instead of gathering everything everywhere.
    streamer = optimizer if not use_parallel and isinstance(optimizer, StreamingState) \
        else None
    # Collective state_dict() calls first (DistributedShampoo's is a collective).
    try:
        if streamer is not None:
            opt_sd = streamer.checkpoint_state_dict()
        elif optimizer is not None:
            opt_sd = optimizer.state_dict()
    except Exception as exc:
        error = f"optimizer.state_dict(): {exc}"
    try:
        if preconditioner is not None:
            pre_sd = preconditioner.state_dict(eigenbases=store_eigenbases)
    except Exception as exc:
        error = error or f"preconditioner.state_dict(): {exc}"
    prep = _Prepared()
    if error is None:
        try:
            prep = _prepare(comm, model, optimizer, preconditioner, step, extra,
                            store_eigenbases, opt_sd, pre_sd, defer=not use_parallel,
                            check_finite=check_finite, streaming=streamer is not None)
        except Exception as exc:  # agreed below: no rank may be left in a collective
            error = f"{type(exc).__name__}: {exc}" if not isinstance(
                exc, tree.UnsupportedValue | ValueError) else str(exc)
    agree(comm, error, "checkpoint save")
    _agree_finite(comm, prep.nonfinite, step)

    final = tmp = None
    is_dir = False
    if comm.rank == 0:
        try:
            final, is_dir = _target(Path(directory_or_path), step)
            if not final.parent.is_dir():  # a new directory: its entry made durable too
                final.parent.mkdir(parents=True, exist_ok=True)
                atomic.fsync_dir(final.parent.parent)
            tmp = atomic.tmp_path(final)
            if is_dir:
                atomic.remove_stale_tmp(final.parent)
            elif tmp.exists():
                tmp.unlink()
        except OSError as exc:
            error = f"cannot prepare {directory_or_path}: {exc}"
    agree(comm, error, "checkpoint save")
    final, tmp, is_dir = comm.broadcast_object((final, tmp, is_dir))
    assert final is not None and tmp is not None

    plan: list[Entry] = []
    try:  # rank 0 builds the plan after the gather: its errors must be agreed on too
        plan, prep, error = _plan(comm, prep, preconditioner, pre_sd, everything=use_parallel)
    except Exception as exc:
        error = f"planning the checkpoint: {type(exc).__name__}: {exc}"
    agree(comm, error, "checkpoint save")
    no_room = None
    if comm.rank == 0:  # refuse what cannot fit before writing anything
        needed, free = sum(e.nbytes for e in plan), storage.free_bytes(final.parent)
        if free is not None and needed > free:
            no_room = storage.space_problem(final.parent, needed)
    no_room = comm.broadcast_object(no_room)
    if no_room is not None:
        raise CheckpointError(f"checkpoint save to {final} failed", [no_room], str(final))
    if snapshot is not None:
        try:  # a second host copy of this rank's state: may not fit (agreed below)
            prep.local = _snapshot(prep.local, snapshot)
        except Exception as exc:
            snapshot.clear()
            error = f"copying the state for the background write: {type(exc).__name__}: {exc}"
        agree(comm, error, "checkpoint save")
    return _Staged(final, tmp, is_dir, plan, prep, keep_last, fletcher32, prefetch, use_parallel)


def _snapshot(arrays: Mapping[str, np.ndarray], held: dict[str, np.ndarray]
              ) -> dict[str, np.ndarray]:
    """Copies of ``arrays`` in ``held``'s buffers where they fit (kept there for the next)."""
    local: dict[str, np.ndarray] = {}
    for key, value in arrays.items():
        buf = held.get(key)
        if buf is None or buf.shape != value.shape or buf.dtype != value.dtype:
            buf = np.empty_like(value, order="C")
        np.copyto(buf, value)
        local[key] = buf
    held.clear()
    held.update(local)
    return local


def _write_commit(comm: Communicator, st: _Staged) -> tuple[str | None, str | None]:
    """Write the staged datasets (owners send, rank 0 writes) and, on rank 0, commit.

    Serial HDF5 uses point-to-point messages of ``comm`` only (safe in a background
    thread on a communicator of its own). Returns (path, error) on rank 0, (None,
    None) elsewhere (parallel HDF5: the agreed error on every rank).
    """
    if st.use_parallel:  # pragma: no cover - needs parallel h5py
        error = _write_parallel(comm, st.plan, st.prep, st.tmp)
        agree(comm, error, "checkpoint write")
    else:
        error = _write_serial(comm, st.plan, st.prep, st.tmp if comm.rank == 0 else None,
                              st.fletcher32, st.prefetch)
    if comm.rank != 0:
        return None, error
    if error is None:
        error = _commit(st.tmp, st.final, st.is_dir, st.keep_last,
                        sum(e.nbytes for e in st.plan), st.keep_every_steps, st.keep)
    if error is not None:
        with contextlib.suppress(OSError):
            st.tmp.unlink()
    return (str(st.final) if error is None else None), error


def _write_and_agree(comm: Communicator, st: _Staged) -> Path:
    _, error = _write_commit(comm, st)
    result = (str(st.final) if error is None else None, error) if comm.rank == 0 \
        else (None, None)
    path, error = comm.broadcast_object(result)
    if error is not None:
        raise CheckpointError(f"checkpoint save to {st.final} failed", [error], str(st.final))
    return Path(path)
