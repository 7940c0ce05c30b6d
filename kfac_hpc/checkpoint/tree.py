"""Nested state (dicts, lists, tuples of tensors and scalars) <-> datasets + a JSON structure.

:func:`encode` turns e.g. an optimizer ``state_dict()`` into a JSON-able *structure*
and the list of its tensors with the relative dataset paths they are stored under;
:func:`decode` rebuilds the exact object from the structure and the loaded tensors.
Dict keys may be ``str``, ``int``, ``float``, ``bool``, ``None`` or tuples of those;
leaves may be tensors, NumPy arrays and scalars, ``None``, strings, NumPy scalars and
``torch.dtype``. Floats round-trip exactly (JSON keeps ``repr`` precision, NaN/inf
included).

Structure nodes are one-key dicts: ``{"tensor": path}``, ``{"ndarray": path}``,
``{"value": x}``, ``{"npscalar": [dtype, x]}``, ``{"dtype": name}``,
``{"dict": [[key, node], ...]}``, ``{"list": [...]}``, ``{"tuple": [...]}``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kfac_hpc.checkpoint.contracts import RemoteLeaf
from kfac_hpc.checkpoint.layout import escape, torch_dtype

#: What :func:`encode` stores as a dataset: a tensor, an array, or a placeholder for a
#: tensor another rank holds and sends (streaming saves).
Leaf = torch.Tensor | np.ndarray | RemoteLeaf


class UnsupportedValue(TypeError):
    """A value :func:`encode` cannot store (the message names where it is)."""


def _encode_key(key: Any) -> tuple[Any, str]:
    """(JSON form, link-name form) of a dict key."""
    if isinstance(key, str):
        return key, escape(key)
    if isinstance(key, bool):
        return {"bool": key}, str(key)
    if isinstance(key, int):
        return {"int": int(key)}, str(int(key))
    if isinstance(key, float):
        return {"float": key}, escape(repr(key))
    if key is None:
        return {"none": None}, "None"
    if isinstance(key, tuple):
        parts = [_encode_key(k) for k in key]
        return {"tuple": [p[0] for p in parts]}, ",".join(p[1] for p in parts) or "()"
    raise UnsupportedValue(f"dict key {key!r} of type {type(key).__name__}")


def _decode_key(key: Any) -> Any:
    if isinstance(key, str):
        return key
    (kind, value), = key.items()
    if kind == "tuple":
        return tuple(_decode_key(k) for k in value)
    if kind in ("bool", "int", "float", "none"):
        return value
    raise ValueError(f"unknown key form {key!r}")


def encode(obj: Any, where: str = "") -> tuple[Any, list[tuple[str, Leaf]]]:
    """Split ``obj`` into a JSON structure and its tensors.

    Args:
        obj: Nested dicts, lists and tuples of tensors, arrays and scalars.
        where: Where ``obj`` is stored (for messages).

    Returns:
        The structure and its ``(relative path, leaf)`` pairs, in order.

    Raises:
        UnsupportedValue: ``obj`` holds something that cannot be stored (the message
            names where).
    """
    leaves: list[tuple[str, Leaf]] = []

    def name(path: list[str]) -> str:
        return "/".join(path) or "value"

    def enc(o: Any, path: list[str]) -> Any:
        if isinstance(o, torch.Tensor):
            if o.is_sparse or o.layout != torch.strided:
                raise UnsupportedValue(f"{where}/{name(path)}: sparse tensors are not supported")
            leaves.append((name(path), o))
            return {"tensor": name(path)}
        if isinstance(o, RemoteLeaf):  # held by another rank (streaming saves): a tensor
            leaves.append((name(path), o))
            return {"tensor": name(path)}
        if isinstance(o, np.ndarray):
            if o.dtype.hasobject:
                raise UnsupportedValue(f"{where}/{name(path)}: object arrays are not supported")
            leaves.append((name(path), o))
            return {"ndarray": name(path)}
        if o is None or isinstance(o, bool | int | float | str):
            return {"value": o}
        if isinstance(o, np.generic):
            return {"npscalar": [o.dtype.str, o.item()]}
        if isinstance(o, torch.dtype):
            return {"dtype": str(o).removeprefix("torch.")}
        if isinstance(o, dict):
            items, used = [], set()
            for k, v in o.items():
                key_json, link = _encode_key(k)
                unique, n = link, 1
                while unique in used:
                    n += 1
                    unique = f"{link}~{n}"
                used.add(unique)
                items.append([key_json, enc(v, [*path, unique])])
            return {"dict": items}
        if isinstance(o, list | tuple):
            kind = "list" if isinstance(o, list) else "tuple"
            return {kind: [enc(v, [*path, str(i)]) for i, v in enumerate(o)]}
        raise UnsupportedValue(f"{where}/{name(path)}: cannot store a {type(o).__name__} "
                               "(use tensors, arrays, numbers, strings, None, dicts, lists)")

    return enc(obj, []), leaves


def held(path: str, leaf: Leaf) -> torch.Tensor | np.ndarray:
    """Return ``leaf`` if this rank holds its data.

    Args:
        path: Where the leaf is stored (for the message).
        leaf: A leaf of :func:`encode`.

    Returns:
        The tensor or array.

    Raises:
        UnsupportedValue: ``leaf`` is a placeholder of another rank's tensor, which only
            an optimizer's ``checkpoint_state_dict()`` may hold.
    """
    if isinstance(leaf, RemoteLeaf):
        raise UnsupportedValue(f"{path}: a placeholder of rank {leaf.remote_owner}'s tensor "
                               "(only an optimizer's checkpoint_state_dict() may hold them)")
    return leaf


KeyPath = tuple[Any, ...]  # dict keys from the root of a structure to one entry


def decode(structure: Any, fetch: Callable[[str], Any],
           skip: Callable[[KeyPath], bool] | None = None) -> Any:
    """Rebuild the object :func:`encode` split.

    Args:
        structure: The JSON structure.
        fetch: ``fetch(path)`` returns the tensor (or array) stored under ``path``.
        skip: Dict entries for whose key path it is true are left out, and their
            leaves never fetched (state another rank loads, see :func:`leaf_routes`).

    Returns:
        The object.

    Raises:
        ValueError: The structure is malformed.
    """
    def dec(node: Any, keys: KeyPath) -> Any:
        (kind, value), = node.items()
        if kind == "tensor":
            return fetch(value)
        if kind == "ndarray":
            leaf = fetch(value)
            return leaf.numpy() if isinstance(leaf, torch.Tensor) else leaf
        if kind == "value":
            return value
        if kind == "npscalar":
            return np.dtype(value[0]).type(value[1])
        if kind == "dtype":
            return torch_dtype(value)
        if kind == "dict":
            out = {}
            for k, v in value:
                key = _decode_key(k)
                if skip is None or not skip((*keys, key)):
                    out[key] = dec(v, (*keys, key))
            return out
        if kind == "list":
            return [dec(v, keys) for v in value]
        if kind == "tuple":
            return tuple(dec(v, keys) for v in value)
        raise ValueError(f"unknown structure node {kind!r}")

    return dec(structure, ())


def leaf_routes(structure: Any, rank_of: Callable[[KeyPath], int | None] | None = None
                ) -> list[tuple[str, int | None]]:
    """Say which rank loads each leaf of a structure.

    Args:
        structure: The JSON structure of :func:`encode`.
        rank_of: Names the rank that loads the entry at a key path, or None (not
            decided there).

    Returns:
        ``(dataset path, rank)`` of every leaf, in order: the rank ``rank_of`` names for
        the outermost dict entry above the leaf for which it names one; None (every
        rank) where it names none, or without ``rank_of``.
    """
    routes: list[tuple[str, int | None]] = []

    def walk(node: Any, keys: KeyPath, rank: int | None) -> None:
        (kind, value), = node.items()
        if kind in ("tensor", "ndarray"):
            routes.append((value, rank))
        elif kind == "dict":
            for k, v in value:
                path = (*keys, _decode_key(k))
                walk(v, path, rank if rank is not None or rank_of is None else rank_of(path))
        elif kind in ("list", "tuple"):
            for v in value:
                walk(v, keys, rank)

    walk(structure, (), None)
    return routes


def leaf_paths(structure: Any) -> list[str]:
    """List the relative dataset paths a structure references.

    Args:
        structure: The JSON structure of :func:`encode`.

    Returns:
        The paths, in order.
    """
    return [path for path, _ in leaf_routes(structure)]
