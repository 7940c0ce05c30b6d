"""Fail fast, on every rank, when ranks do not hold the same model.

Data-parallel training assumes every rank holds the same parameters. Ranks that built
different models would post collectives of different sizes (MPI truncation errors, heap
corruption or a hang); ranks that start from different values silently train different
models. :func:`check_replicas` finds both before any training collective, with messages
of fixed size only:

1. the *structure* (names, shapes, dtypes, which parameters train (``requires_grad``:
   a frozen parameter is left out of every gradient reduction, so ranks that freeze
   different parameters would post reductions of different sizes), plus any
   ``settings`` that must agree, e.g. a message layout) as a 64-bit digest: one
   16-byte allreduce (max of ``d`` and of ``-d``) tells whether all ranks
   agree, whatever their models;
2. the *values*: rank 0 broadcasts one ``(sum, sum of |x|)`` row per parameter tensor
   (float64, read back from the device in one transfer), every rank compares its own,
   and a 4-byte allreduce agrees on the outcome.

Only when something differs are the details gathered (as objects) for the message, which
is the same ``ValueError`` on every rank.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from kfac_hpc.comm.communicator import Communicator

__all__ = ["check_replicas", "replica_check_bytes"]


def replica_check_bytes(param_tensors: int) -> list[int]:
    """Predict the bytes of each call :func:`check_replicas` makes when the ranks agree.

    The planner's prediction: structure allreduce, values broadcast, outcome allreduce.

    Args:
        param_tensors: The number of parameter tensors checked.

    Returns:
        Bytes per call, in call order.
    """
    return [16, 16 * param_tensors, 4]


def check_replicas(named_parameters: Iterable[tuple[str, Tensor]], comm: Communicator, *,
                   settings: Mapping[str, Any] | None = None, what: str = "model") -> None:
    """Raise the same ``ValueError`` on every rank unless all ranks hold the same parameters.

    Same names, shapes, dtypes and ``requires_grad``, equal values (a checksum, 1e-9
    relative), and equal ``settings`` (compared exactly). Collective; nothing at world
    size 1.

    Args:
        named_parameters: ``(name, parameter)`` pairs, e.g. ``model.named_parameters()``.
        comm: The ranks that must agree.
        settings: Anything else that must be equal on every rank (compared by ``repr``
            in the digest, by ``==`` for the message), e.g. the layout of the messages
            the caller will post.
        what: What the parameters belong to, for the message.

    Raises:
        ValueError: On every rank, naming the ranks and parameters or settings that
            differ from rank 0's, and the fix.
    """
    if comm.size == 1:
        return
    params = list(named_parameters)
    settings = dict(settings or {})
    structure = [(name, tuple(p.shape), str(p.dtype), bool(p.requires_grad))
                 for name, p in params]
    if not _agree(comm, _digest(repr((structure, sorted(settings.items()))))):
        _raise_structure(comm, structure, settings, what)
    sums = _checksums([p for _, p in params])
    reference = sums.clone()
    comm.broadcast(reference, root=0)
    same = torch.isclose(sums, reference, rtol=1e-9, atol=0).all(dim=1)
    mine = [params[i][0] for i in torch.nonzero(~same).flatten().tolist()]
    if comm.any(bool(mine)):
        everyone = comm.allgather_object(mine)
        differing = {r: names[:5] for r, names in enumerate(everyone) if names}
        raise ValueError(
            f"{what} parameters differ across ranks (rank: parameters differing from rank 0): "
            f"{differing}; seed every rank identically or broadcast the model from rank 0 "
            "before building the optimizer or preconditioner")


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.sha1(text.encode()).digest()[:8], "little") >> 2


def _agree(comm: Communicator, digest: int) -> bool:
    """True on every rank when every rank passed the same ``digest`` (one allreduce)."""
    both = torch.tensor([digest, -digest], dtype=torch.int64, device="cpu")
    comm.allreduce(both, "max")
    return int(both[0]) == -int(both[1])


def _checksums(params: list[Tensor]) -> Tensor:
    """``(sum, sum |x|)`` per tensor in float64 on the CPU, one device-to-host transfer."""
    if not params:
        return torch.zeros(0, 2, dtype=torch.float64, device="cpu")
    with torch.no_grad():
        home = params[0].device
        rows = [torch.stack([p.double().sum(), p.double().abs().sum()]).to(home) for p in params]
        return torch.stack(rows).cpu()


Structure = list[tuple[str, tuple[int, ...], str, bool]]


def _raise_structure(comm: Communicator, structure: Structure, settings: dict[str, Any],
                     what: str) -> None:
    everyone = comm.allgather_object((structure, settings))
    base_structure, base_settings = everyone[0]
    problems: dict[int, str] = {}
    trainable_only: list[bool] = []  # per rank whose structure differs
    for rank, (theirs, their_settings) in enumerate(everyone):
        parts = []
        if theirs != base_structure:
            text, only = _structure_difference(theirs, base_structure)
            trainable_only.append(only)
            parts.append(text)
        if their_settings != base_settings:
            keys = sorted(k for k in set(their_settings) | set(base_settings)
                          if their_settings.get(k) != base_settings.get(k))
            parts.append("; ".join(f"{k}={their_settings.get(k)!r} (rank 0: "
                                   f"{base_settings.get(k)!r})" for k in keys))
        if parts:
            problems[rank] = "; ".join(parts)
    if trainable_only and all(trainable_only):
        fix = ("every rank must train the same parameters: set requires_grad identically on "
               "every rank (freeze the same layers everywhere) before building the gradient "
               "averager, optimizer or preconditioner")
    else:
        fix = ("every rank must build the same model with the same settings (data-parallel "
               "training)")
    raise ValueError(
        f"ranks hold different {what}s (rank: difference from rank 0): {problems}; {fix}")


def _structure_difference(theirs: Structure, base: Structure) -> tuple[str, bool]:
    """Say how ``theirs`` differs from ``base``, and whether only in which parameters train."""
    mine = {n: (s, d) for n, s, d, _ in theirs}
    ref = {n: (s, d) for n, s, d, _ in base}
    extra = [n for n in mine if n not in ref][:3]
    missing = [n for n in ref if n not in mine][:3]
    changed = [f"{n} {mine[n][0]} {mine[n][1]} vs {ref[n][0]} {ref[n][1]}"
               for n in mine if n in ref and mine[n] != ref[n]][:3]
    trains = {n: t for n, _, _, t in theirs}
    ref_trains = {n: t for n, _, _, t in base}
    frozen = [n for n in trains if n in ref_trains and ref_trains[n] and not trains[n]]
    trained = [n for n in trains if n in ref_trains and trains[n] and not ref_trains[n]]
    parts = [f"extra {extra}" if extra else "", f"missing {missing}" if missing else "",
             f"different {changed}" if changed else "",
             f"requires_grad=False on {frozen[:5]} (rank 0 trains them)" if frozen else "",
             f"requires_grad=True on {trained[:5]} (rank 0 freezes them)" if trained else ""]
    text = ", ".join(p for p in parts if p)
    only_trainable = not (extra or missing or changed) and bool(frozen or trained)
    return text or "parameter order differs", only_trainable
