"""The file format: names, attributes, format version, dtypes, digests, chunking.

One HDF5 file per checkpoint (see ``docs/checkpoints.md`` for the layout). Everything
that identifies an object is a name (parameter name, factor key, ``rank_<r>``), never a
position, so a file written on P ranks is read on Q ranks.

Integrity: every dataset carries a ``digest`` attribute (CRC-32 of its bytes as
stored, C order) that the reader recomputes, so corruption is caught for every
dataset, including tiny and contiguous ones; datasets of at least
:data:`CHUNK_MIN_BYTES` are also chunked with HDF5's ``fletcher32`` filter, which any
HDF5 reader checks. The root ``manifest`` attribute lists every dataset (shape, dtype,
digest) and ``attrs_digest`` covers every attribute in the file.
"""

from __future__ import annotations

import json
import math
import urllib.parse
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

FORMAT = "kfac_hpc"
FORMAT_VERSION = 1

# top-level groups
MODEL = "model"
OPTIMIZER = "optimizer"
KFAC = "kfac"
RNG = "rng"
TRAIN = "train"
SECTIONS = (MODEL, OPTIMIZER, KFAC, RNG, TRAIN)

# root attributes
ROOT_ATTRS = ("format", "format_version", "step", "world_size", "strategy", "created_utc",
              "versions", "config", "contents", "manifest", "attrs_digest")

# files in a checkpoint directory
PREFIX = "ckpt_"
SUFFIX = ".h5"
TMP_SUFFIX = ".tmp"
LATEST = "latest"
#: Written by ``kfac-hpc train`` when a run ends complete (after its final checkpoint);
#: not a checkpoint: listings, pruning and ``latest`` ignore it.
COMPLETED = "completed"

# HDF5 file-format bounds: readable by HDF5 1.10 tools (h5ls/h5dump at most sites).
LIBVER = ("earliest", "v110")
CHUNK_BYTES = 1 << 20  # target chunk size of fletcher32-checked datasets
CHUNK_MIN_BYTES = 16 << 10  # smaller datasets are contiguous (digest-checked only)
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"

DIGEST_ALGORITHM = "crc32"


def escape(name: str) -> str:
    """Turn a dict key or parameter name into one HDF5 link name.

    Args:
        name: The name.

    Returns:
        ``name`` with ``/`` and ``%`` escaped (``"%"`` for the empty name).
    """
    if name == "":
        return "%"
    out = name.replace("%", "%25").replace("/", "%2F")
    return out.replace(".", "%2E") if out in (".", "..") else out


def unescape(link: str) -> str:
    """Invert :func:`escape`.

    Args:
        link: An HDF5 link name.

    Returns:
        The name it stands for.
    """
    return "" if link == "%" else urllib.parse.unquote(link)


# ------------------------------------------------------------------ dtypes
def c_order(arr: np.ndarray) -> np.ndarray:
    """Return ``arr`` in C order (copied only if it is not).

    Args:
        arr: An array (or anything ``np.asarray`` takes).

    Returns:
        The array, shape kept (unlike ``np.ascontiguousarray`` for 0-d arrays).
    """
    arr = np.asarray(arr)
    return arr if arr.flags.c_contiguous else arr.copy(order="C")


def tensor_to_storage(t: torch.Tensor) -> tuple[np.ndarray, str]:
    """Turn a tensor into the NumPy array stored for it.

    Dtypes NumPy lacks (bfloat16, float8, ...) are stored as unsigned integers of the
    same width (their exact bits); the ``torch_dtype`` attribute says how to view them.
    Which dtypes NumPy takes is torch's to say (``Tensor.numpy`` raises ``TypeError``
    for the others), so the conversion is tried and the bits stored when it is refused.

    Args:
        t: The tensor (any device).

    Returns:
        A CPU, C-contiguous NumPy view of ``t`` and its torch dtype name.
    """
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.resolve_conj().resolve_neg().contiguous()
    name = str(t.dtype).removeprefix("torch.")
    try:
        arr = t.numpy()
    except TypeError:
        raw = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.uint64}
        arr = t.view(raw[t.element_size()]).numpy()
    return arr, name


def torch_dtype(name: str) -> torch.dtype:
    """Look a torch dtype up by name.

    Args:
        name: E.g. ``"float32"`` (a ``"torch."`` prefix is allowed).

    Returns:
        The dtype, e.g. ``torch.float32``.

    Raises:
        ValueError: ``name`` is no torch dtype.
    """
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r}")
    return dtype


#: Bytes to which torch aligns the CPU tensors it allocates (c10's ``gAlignment``).
ALIGNMENT = 64


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype[Any] | str) -> np.ndarray:
    """Make an uninitialised C-order array in memory torch allocated.

    Such memory is aligned to :data:`ALIGNMENT` bytes, as a live tensor is;
    :func:`storage_to_tensor` takes the array without a copy. The reader reads datasets
    into such arrays.

    Args:
        shape: The array's shape.
        dtype: Its NumPy dtype.

    Returns:
        The array.
    """
    dt = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    return torch.empty(nbytes, dtype=torch.uint8, device="cpu").numpy().view(dt).reshape(shape)


def storage_to_tensor(arr: np.ndarray, name: str) -> torch.Tensor:
    """Invert :func:`tensor_to_storage`.

    A restored tensor must be laid out like the live one it replaces: a CPU BLAS may
    choose its kernel by its operands' alignment (MKL does, unless ``MKL_CBWR`` pins
    one), and NumPy (h5py) allocates with 16-byte alignment only, so e.g. a momentum
    buffer in NumPy's memory could round differently from the run that saved. ``arr``
    is taken without a copy when it is writable, C-ordered and aligned (an
    :func:`aligned_empty` array), and copied into such memory otherwise.

    Args:
        arr: The stored array.
        name: The tensor's torch dtype name.

    Returns:
        A writable, contiguous tensor aligned as torch aligns the tensors it allocates
        (:data:`ALIGNMENT` bytes).
    """
    arr = np.asarray(arr)
    if not (arr.flags.c_contiguous and arr.flags.writeable
            and arr.ctypes.data % ALIGNMENT == 0):
        copy = aligned_empty(arr.shape, arr.dtype)
        copy[...] = arr
        arr = copy
    t = torch.from_numpy(arr)
    want = torch_dtype(name)
    return t if t.dtype == want else t.view(want)


# ------------------------------------------------------------------ digests
def digest(arr: np.ndarray) -> str:
    """Compute the digest of an array's bytes in C order.

    Args:
        arr: The array.

    Returns:
        ``"crc32:<8 hex digits>"``.
    """
    arr = c_order(arr)
    return f"{DIGEST_ALGORITHM}:{zlib.crc32(arr.data if arr.size else b'') & 0xFFFFFFFF:08x}"


def text_digest(text: str) -> str:
    """Compute the digest of a text (UTF-8).

    Args:
        text: The text.

    Returns:
        ``"crc32:<8 hex digits>"``.
    """
    return f"{DIGEST_ALGORITHM}:{zlib.crc32(text.encode()) & 0xFFFFFFFF:08x}"


def _canonical(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, np.ndarray):
        return [str(value.dtype), value.tolist()]
    if isinstance(value, np.generic):
        return value.item()
    return value


def canonical_attrs(objects: Iterator[tuple[str, Any]]) -> str:
    """Write every attribute of some HDF5 objects as one canonical JSON text.

    The root's ``attrs_digest`` is left out (it is the digest of this text).

    Args:
        objects: ``(path, h5py object)`` pairs (:func:`walk`).

    Returns:
        The JSON text, keys sorted.
    """
    out: dict[str, dict[str, Any]] = {}
    for path, obj in objects:
        attrs = {k: _canonical(v) for k, v in obj.attrs.items()
                 if not (path == "/" and k == "attrs_digest")}
        out[path] = attrs
    return json.dumps(out, sort_keys=True, default=repr)


def walk(f: Any) -> Iterator[tuple[str, Any]]:
    """Walk an open h5py file.

    Args:
        f: The file.

    Yields:
        ``("/", root)``, then every group and dataset as ``(path, object)``, by path.
    """
    yield "/", f
    items: list[tuple[str, Any]] = []
    f.visititems(lambda name, obj: items.append(("/" + name, obj)))
    yield from sorted(items, key=lambda kv: kv[0])


# ------------------------------------------------------------------ storage
def chunk_shape(shape: Sequence[int], itemsize: int,
                target: int = CHUNK_BYTES) -> tuple[int, ...] | None:
    """Choose the chunk shape of a dataset.

    Args:
        shape: The dataset's shape.
        itemsize: Bytes per element.
        target: Bytes per chunk to aim at.

    Returns:
        Chunks of about ``target`` bytes (leading dimensions split first), or None for
        contiguous storage (scalars, empty and small datasets).
    """
    numel = math.prod(shape)
    if not shape or numel == 0 or numel * itemsize < CHUNK_MIN_BYTES:
        return None
    chunk = list(shape)
    for i in range(len(chunk)):
        while chunk[i] > 1 and math.prod(chunk) * itemsize > target:
            chunk[i] = (chunk[i] + 1) // 2
    return tuple(chunk)


def to_json(value: Any) -> str:
    """Write ``value`` as compact JSON, keys sorted.

    Args:
        value: A JSON-able value (others are written by ``repr``).

    Returns:
        The JSON text.
    """
    return json.dumps(value, sort_keys=True, default=repr)


def checkpoint_name(step: int) -> str:
    """Name the checkpoint file of ``step`` in a checkpoint directory.

    Args:
        step: The training step.

    Returns:
        ``ckpt_<step, 8 digits>.h5``.
    """
    return f"{PREFIX}{step:08d}{SUFFIX}"


def step_of_name(name: str) -> int | None:
    """Invert :func:`checkpoint_name`.

    Args:
        name: A file name.

    Returns:
        The step, or None for a name that is not a checkpoint's.
    """
    if not (name.startswith(PREFIX) and name.endswith(SUFFIX)):
        return None
    core = name[len(PREFIX):-len(SUFFIX)]
    return int(core) if core.isdigit() else None
