"""Message fusion: many small tensors in one message, and symmetric-matrix packing."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from kfac_hpc.comm.communicator import Communicator, Handle, ReduceOp


def common_dtype(tensors: Sequence[torch.Tensor]) -> torch.dtype:
    """The dtype that holds every tensor's values: theirs, or the widest floating one.

    Args:
        tensors: One or more tensors.

    Raises:
        ValueError: Integer and floating-point tensors, or integers of several widths
            (no common dtype keeps every value).
    """
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) == 1:
        return dtypes.pop()
    if all(d.is_floating_point for d in dtypes):
        return functools.reduce(torch.promote_types, dtypes)
    raise ValueError(f"cannot fuse tensors of dtypes {sorted(map(str, dtypes))} into one "
                     "message without losing values: fuse tensors of one dtype (or give the "
                     "message's dtype)")


def flatten(tensors: Sequence[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    """Concatenate the tensors' elements into one 1-D tensor (a copy).

    Args:
        tensors: Tensors of any shapes, on one device.
        dtype: The result's dtype (default: :func:`common_dtype`, e.g. float64 for a
            float32 and a float64 tensor; float32 when there are none).

    Returns:
        A 1-D tensor of the tensors' elements, in order (empty on the CPU when there are
        no tensors).
    """
    if not tensors:
        return torch.empty(0, dtype=dtype or torch.float32, device="cpu")
    dtype = dtype or common_dtype(tensors)
    return torch.cat([t.detach().reshape(-1).to(dtype) for t in tensors])


def unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy consecutive slices of ``flat`` back into ``tensors`` (their shapes and dtypes).

    Args:
        flat: A 1-D tensor, e.g. from :func:`flatten`.
        tensors: Overwritten in order.

    Raises:
        ValueError: ``flat`` holds more elements than the tensors.
    """
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset:offset + n].view(t.shape))
            offset += n
    if offset != flat.numel():
        raise ValueError(f"flat tensor has {flat.numel()} elements, tensors hold {offset}")


def triu_count(n: int) -> int:
    """Count the elements of the upper triangle (diagonal included) of an ``n x n`` matrix."""
    return n * (n + 1) // 2


@functools.lru_cache(maxsize=256)
def _upper_indices(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat indices of the upper triangle (row-major) and of its mirror, cached per size."""
    rows, cols = torch.triu_indices(n, n, device=device)
    return rows * n + cols, cols * n + rows


def pack_upper(matrix: torch.Tensor) -> torch.Tensor:
    """Return the upper triangle (row-major, diagonal included) of a square matrix, 1-D.

    Args:
        matrix: A square 2-D matrix (read as symmetric).

    Returns:
        ``n * (n + 1) / 2`` elements.

    Raises:
        ValueError: The matrix is not square.
    """
    n = matrix.shape[-1]
    if matrix.dim() != 2 or matrix.shape[0] != n:
        raise ValueError(f"pack_upper needs a square matrix, got shape {tuple(matrix.shape)}")
    upper, _ = _upper_indices(n, matrix.device)
    return matrix.reshape(-1).index_select(0, upper)


def unpack_upper(packed: torch.Tensor, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rebuild the symmetric ``n x n`` matrix from :func:`pack_upper`'s output.

    Args:
        packed: ``n * (n + 1) / 2`` elements.
        n: The matrix's order.
        out: Receives the matrix (default a new one).

    Returns:
        The symmetric matrix (``out`` when given).

    Raises:
        ValueError: ``packed`` has the wrong number of elements.
    """
    if packed.numel() != triu_count(n):
        raise ValueError(f"{packed.numel()} elements cannot be the upper triangle of {n}x{n}")
    if out is None:
        out = torch.empty((n, n), dtype=packed.dtype, device=packed.device)
    upper, lower = _upper_indices(n, packed.device)
    flat = out.view(-1)
    with torch.no_grad():
        flat.index_copy_(0, upper, packed)
        flat.index_copy_(0, lower, packed)
    return out


def buckets_by_size(sizes_bytes: Sequence[int], cap_bytes: int) -> list[list[int]]:
    """Group consecutive items into buckets of at most ``cap_bytes``.

    An item larger than the cap gets a bucket of its own.

    Args:
        sizes_bytes: The items' sizes in bytes, in order.
        cap_bytes: The most bytes in a bucket (> 0).

    Returns:
        Lists of item indices, in order.

    Raises:
        ValueError: ``cap_bytes`` is not positive.
    """
    if cap_bytes <= 0:
        raise ValueError(f"bucket cap must be positive, got {cap_bytes} bytes")
    buckets: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, size in enumerate(sizes_bytes):
        if current and used + size > cap_bytes:
            buckets.append(current)
            current, used = [], 0
        current.append(i)
        used += size
    if current:
        buckets.append(current)
    return buckets


class FusedAllreduce:
    """Allreduce a list of tensors as few fused messages (each at most ``cap_mb``).

    ``start()`` posts non-blocking reductions; ``wait()`` completes them and writes the
    results back into the original tensors. The first ``start()`` is collective beyond
    the reductions: the ranks agree on the message sizes (one 16-byte allreduce,
    :meth:`~kfac_hpc.comm.Communicator.agree`) and every rank raises the same
    ``ValueError`` where they differ, before MPI sees any buffer; later starts reuse the
    agreement (the sizes are fixed at construction).
    """

    def __init__(self, comm: Communicator, tensors: Sequence[torch.Tensor], *,
                 op: ReduceOp = "avg", cap_mb: float = 25.0,
                 dtype: torch.dtype | None = None) -> None:
        """Group the tensors into messages; nothing is sent until :meth:`start`.

        Args:
            comm: The communicator to reduce over.
            tensors: Reduced in place; the same sizes, in the same order, on every rank.
            op: The reduction (default ``"avg"``).
            cap_mb: The most MiB in one message.
            dtype: The dtype the messages travel in (default: each group's
                :func:`common_dtype`).
        """
        self.comm, self.tensors, self.op = comm, list(tensors), op
        self.dtype = dtype
        sizes = [t.numel() * (dtype.itemsize if dtype else t.element_size()) for t in tensors]
        self.groups = buckets_by_size(sizes, int(cap_mb * 2**20))
        self._inflight: list[tuple[list[int], Handle[torch.Tensor]]] = []
        self._agreed = False

    def layout(self) -> list[tuple[int, str]]:
        """List the elements and dtype of each fused message, in posting order."""
        return [(sum(self.tensors[i].numel() for i in group),
                 str(self.dtype or common_dtype([self.tensors[i] for i in group])))
                for group in self.groups]

    def start(self) -> FusedAllreduce:
        """Post the fused non-blocking reductions (collective; the first call also agrees on sizes).

        Returns:
            This object, to chain ``.wait()``.

        Raises:
            ValueError: On every rank, when the ranks' message layouts differ (first call).
        """
        if not self._agreed:
            self.comm.agree(self.layout(), "the fused allreduce's messages (elements, dtype)",
                            hint="pass tensors of the same sizes, in the same order, and the "
                                 "same cap_mb and dtype on every rank")
            self._agreed = True
        for group in self.groups:
            flat = flatten([self.tensors[i] for i in group], self.dtype)
            self._inflight.append((group, self.comm.iallreduce(flat, self.op)))
        return self

    def wait(self) -> list[torch.Tensor]:
        """Complete the reductions and write the results into the tensors.

        Returns:
            The tensors, holding the reduced values.
        """
        for group, handle in self._inflight:
            unflatten_into(handle.wait(), [self.tensors[i] for i in group])
        self._inflight.clear()
        return self.tensors
