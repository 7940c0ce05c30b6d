"""Random number generator states of one process, as arrays + attributes.

Stored per rank under ``/rng/rank_<r>``: ``torch_cpu`` (``torch.get_rng_state()``),
``cuda_<i>`` (one per device, only when CUDA was initialised), ``numpy_keys`` and
``python_state`` (the Mersenne-Twister states of NumPy's legacy global generator and
of Python's ``random``), with the scalar parts as attributes. Generators you create
yourself (``torch.Generator``, ``np.random.Generator``) are yours to put in ``extra``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["capture", "check", "restore", "same_state"]

#: ``torch.cuda.is_initialized``, typed (torch leaves it unannotated).
_cuda_initialized: Callable[[], bool] = torch.cuda.is_initialized


def capture() -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Capture this process's RNG states.

    Returns:
        ``(arrays, attributes)``, as stored under ``/rng/rank_<r>``.
    """
    arrays: dict[str, np.ndarray] = {"torch_cpu": torch.get_rng_state().numpy().copy()}
    attrs: dict[str, Any] = {}
    cuda = torch.cuda.is_available() and _cuda_initialized()
    states = torch.cuda.get_rng_state_all() if cuda else []
    for i, s in enumerate(states):
        arrays[f"cuda_{i}"] = s.cpu().numpy().copy()
    attrs["cuda_devices"] = len(states)
    algorithm, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    arrays["numpy_keys"] = np.asarray(keys, dtype=np.uint32).copy()
    attrs.update(numpy_algorithm=str(algorithm), numpy_pos=int(pos),
                 numpy_has_gauss=int(has_gauss), numpy_cached_gaussian=float(cached))
    version, internal, gauss_next = random.getstate()
    arrays["python_state"] = np.asarray(internal, dtype=np.int64)
    attrs.update(python_version=int(version), python_gauss_next=json.dumps(gauss_next))
    return arrays, attrs


_ATTRS = ("numpy_algorithm", "numpy_pos", "numpy_has_gauss", "numpy_cached_gaussian",
          "python_version", "python_gauss_next")


def check(arrays: Mapping[str, np.ndarray], attrs: Mapping[str, Any]) -> list[str]:
    """Say what would make :func:`restore` fail (checked before anything is applied).

    Args:
        arrays: Saved RNG arrays.
        attrs: Their attributes.

    Returns:
        The problems found (empty: restorable).
    """
    problems = [f"RNG state: attribute {a} is missing" for a in _ATTRS if a not in attrs]
    want = {"torch_cpu": (torch.get_rng_state().numel(), "u1"), "numpy_keys": (624, "u4"),
            "python_state": (625, "i8")}
    for name, (size, kind) in want.items():
        arr = arrays.get(name)
        if arr is None:
            problems.append(f"RNG state: {name} is missing")
        elif arr.ndim != 1 or arr.size != size or arr.dtype.str[1:] != kind:
            problems.append(f"RNG state: {name} is {arr.dtype.str}{list(arr.shape)}, "
                            f"expected {kind}[{size}]")
    return problems


def restore(arrays: Mapping[str, np.ndarray], attrs: Mapping[str, Any]) -> list[str]:
    """Set this process's RNG states.

    Args:
        arrays: Saved RNG arrays.
        attrs: Their attributes.

    Returns:
        What was restored (and what was not), one entry per generator.
    """
    done = []
    torch.set_rng_state(torch.from_numpy(np.ascontiguousarray(arrays["torch_cpu"]).copy()))
    done.append("torch")
    n_cuda = int(attrs.get("cuda_devices", 0))
    if n_cuda:
        if torch.cuda.is_available() and torch.cuda.device_count() == n_cuda:
            torch.cuda.set_rng_state_all(
                [torch.from_numpy(np.asarray(arrays[f"cuda_{i}"]).copy()) for i in range(n_cuda)])
            done.append("cuda")
        else:
            have = torch.cuda.device_count() if torch.cuda.is_available() else 0
            done.append(f"cuda not restored (saved {n_cuda} device(s), {have} here)")
    np.random.set_state((str(attrs["numpy_algorithm"]),
                         np.asarray(arrays["numpy_keys"], dtype=np.uint32),
                         int(attrs["numpy_pos"]), int(attrs["numpy_has_gauss"]),
                         float(attrs["numpy_cached_gaussian"])))
    done.append("numpy")
    internal = tuple(int(x) for x in np.asarray(arrays["python_state"]).tolist())
    random.setstate((int(attrs["python_version"]), internal,
                     json.loads(str(attrs["python_gauss_next"]))))
    done.append("python")
    return done


def same_state(a: tuple[Mapping[str, np.ndarray], Mapping[str, Any]],
               b: tuple[Mapping[str, np.ndarray], Mapping[str, Any]]) -> bool:
    """Say whether two captured states are identical.

    Args:
        a: One state, as :func:`capture` returns it.
        b: The other.

    Returns:
        True when every array and attribute is equal.
    """
    if set(a[0]) != set(b[0]) or dict(a[1]) != dict(b[1]):
        return False
    return all(np.array_equal(a[0][k], b[0][k]) for k in a[0])
