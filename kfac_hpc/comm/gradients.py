"""Gradient averaging over MPI that overlaps with backward (for users without DDP/NCCL)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from kfac_hpc.comm import replicas, threads
from kfac_hpc.comm.communicator import Communicator, Handle
from kfac_hpc.comm.fusion import buckets_by_size, common_dtype, flatten, unflatten_into


class GradientAverager:
    """Average ``.grad`` of a model's parameters over ranks, bucketed and non-blocking.

    Parameters are grouped into buckets of at most ``bucket_cap_mb`` in reverse
    registration order. Non-blocking collectives must be posted in the same order on
    every rank, so the first ``synchronize()`` posts every bucket in index order and the
    ranks agree on the order in which buckets completed during that backward (buckets
    that never completed, e.g. of unused parameters, go last). From then on a bucket's
    allreduce starts from a gradient hook as soon as it and every bucket before it in
    the agreed order are complete: communication overlaps with backward.
    ``synchronize()`` posts what is left, waits, and writes the averages back.

    Parameters without a gradient at a step (``grad=None``: unused in this forward)
    travel as zeros, and one flag per parameter travels with its bucket, so every rank
    ends the step with the same gradients: a parameter with a gradient on some rank gets
    the average (the missing ones counted as zeros) on every rank, one without a gradient
    on every rank keeps ``grad=None``. The message sizes never depend on the step.

    The constructor agrees, collectively, on the bucket layout (the message sizes every
    rank will post; one 16-byte allreduce) and raises the same ``ValueError`` on every
    rank where it differs, before MPI sees any bucket. With ``check_replicas`` (default)
    the layout is part of the replica check, which also checks that every rank holds the
    same parameters (names, shapes, dtypes, which ones train, values; see
    :func:`~kfac_hpc.comm.replicas.check_replicas`): ranks with different models or that
    freeze different parameters would otherwise post reductions of different sizes
    (memory corruption or a hang).

    With torch DDP the gradients are already averaged: do not use both.
    Inside ``with averager.no_sync():`` (gradient accumulation) nothing is sent.

    On CUDA the hooks never block the backward stream: a bucket's flat copy is queued
    on the stream that produced the gradients, staged or handed to MPI once its event
    completes (see :class:`~kfac_hpc.comm.Communicator`), and every hook tests the
    buckets in flight so they are posted as soon as their data is ready. The hooks run
    on autograd's worker thread, so the MPI library must provide at least
    ``MPI_THREAD_SERIALIZED`` (checked here).
    """

    def __init__(self, model: nn.Module, comm: Communicator, *, bucket_cap_mb: float = 25.0,
                 dtype: torch.dtype | None = None, check_replicas: bool = True) -> None:
        """Bucket the model's trainable parameters and install the gradient hooks (collective).

        Args:
            model: The model; every trainable parameter must be on one device.
            comm: The communicator to average over.
            bucket_cap_mb: The most MiB in one bucket's message.
            dtype: The dtype gradients travel in (default: each bucket's parameters' dtype).
            check_replicas: Check that every rank holds the same parameters (names, shapes,
                dtypes, which ones train, values) along with the bucket layout; False agrees
                on the layout only.

        Raises:
            ValueError: On every rank, when the ranks' models or bucket layouts differ, or
                when the parameters are on more than one device.
        """
        self.comm = comm
        self.params = [p for p in model.parameters() if p.requires_grad][::-1]
        sizes = [p.numel() * (dtype.itemsize if dtype else p.element_size()) for p in self.params]
        self.buckets = buckets_by_size(sizes, int(bucket_cap_mb * 2**20))
        # what each bucket's message holds (gradients, then one flag per parameter): every
        # rank must post the same sizes, agreed here once, before MPI sees any bucket
        layout = [(sum(self.params[i].numel() for i in idx) + len(idx),
                   str(dtype or self.params[idx[0]].dtype)) for idx in self.buckets]
        if check_replicas:  # ranks with different models would post mismatched buckets
            replicas.check_replicas(model.named_parameters(), comm,
                                    settings={"gradient buckets": layout})
        else:
            comm.agree(layout, "the GradientAverager's buckets (elements, dtype)",
                       hint="build the model, freeze the same parameters and pass the same "
                            "bucket_cap_mb and dtype on every rank")
        devices = sorted({str(p.device) for p in self.params})
        if len(devices) > 1:
            raise ValueError(f"GradientAverager needs every parameter on one device, got "
                             f"{', '.join(devices)}: move the model with model.to(device)")
        if any(p.is_cuda for p in self.params) and comm.size > 1:
            threads.require_hook_level(what="GradientAverager posts reductions from backward "
                                            "hooks, which run on autograd's CUDA worker thread")
        self.dtype = dtype
        self._bucket_of = {id(p): b for b, idx in enumerate(self.buckets)
                           for p in (self.params[i] for i in idx)}
        self._ready: list[set[int]] = [set() for _ in self.buckets]
        self._handles: list[Handle[torch.Tensor] | None] = [None] * len(self.buckets)
        self._next = 0  # position in the posting order
        self._order: list[int] | None = None  # agreed posting order (after the first step)
        self._completed: list[int] = []  # buckets in the order they completed this step
        self._posted: set[int] = set()
        self._posted_order: list[int] = []
        self._enabled = True
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]

    def _on_grad(self, param: torch.Tensor) -> None:
        if not self._enabled or self.comm.size == 1:
            return
        b = self._bucket_of[id(param)]
        self._ready[b].add(id(param))
        if len(self._ready[b]) == len(self.buckets[b]) and b not in self._completed:
            self._completed.append(b)
        if self._order is None:
            return
        while self._next < len(self._order) and len(self._ready[self._order[self._next]]) == len(
                self.buckets[self._order[self._next]]):
            self._post(self._order[self._next])
        self.progress()

    def progress(self) -> None:
        """Post buckets whose data is ready and let MPI advance them (cheap; hooks call it)."""
        for b in self._posted_order:
            handle = self._handles[b]
            if handle is not None:
                handle.test()

    def _post(self, b: int) -> None:
        params = [self.params[i] for i in self.buckets[b]]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        dtype = self.dtype or common_dtype(params)  # float64 when one gradient is
        if all(p.grad is not None for p in params):  # the usual step: a fill, no copy
            flags = torch.ones(len(params), dtype=dtype, device=params[0].device)
        else:
            flags = torch.tensor([float(p.grad is not None) for p in params], dtype=dtype,
                                 device=params[0].device)
        self._handles[b] = self.comm.iallreduce(flatten([*grads, flags], self.dtype), "avg")
        self._posted.add(b)
        self._posted_order.append(b)
        self._next += 1

    def synchronize(self) -> None:
        """Complete the averaging of every gradient (collective; after backward, before step).

        Parameters without a gradient anywhere keep ``grad=None``; a parameter with a gradient
        on some rank gets the average on every rank.
        """
        if self.comm.size == 1:
            return
        order = self._order if self._order is not None else list(range(len(self.buckets)))
        for b in order:
            if b not in self._posted:
                self._post(b)
        for b, handle in enumerate(self._handles):
            assert handle is not None
            params = [self.params[i] for i in self.buckets[b]]
            flat = handle.wait()
            # the flags (> 0: some rank had a gradient) matter only to a parameter without a
            # gradient here; read back (a device sync on a GPU) only when there is one
            flags = flat[flat.numel() - len(params):].tolist() \
                if any(p.grad is None for p in params) else [1.0] * len(params)
            offset = 0
            for p, flag in zip(params, flags):
                n = p.numel()
                if p.grad is not None:
                    unflatten_into(flat[offset:offset + n], [p.grad])
                elif flag > 0:  # a gradient on another rank: this rank takes the average
                    p.grad = flat[offset:offset + n].view(p.shape).to(p.dtype, copy=True)
                offset += n
        if self._order is None:
            self._order = self._agree_on_order()
        self._handles = [None] * len(self.buckets)
        self._ready = [set() for _ in self.buckets]
        self._completed, self._posted, self._next = [], set(), 0
        self._posted_order = []

    def _agree_on_order(self) -> list[int]:
        """Return this step's completion order if every rank saw the same, else index order."""
        mine = self._completed + [b for b in range(len(self.buckets)) if b not in self._completed]
        orders = self.comm.allgather_object(mine)
        return mine if all(o == mine for o in orders) else list(range(len(self.buckets)))

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no communication) inside this block.

        Yields:
            Nothing; hooks send nothing until the block ends.
        """
        previous, self._enabled = self._enabled, False
        try:
            yield
        finally:
            self._enabled = previous

    def remove(self) -> None:
        """Remove the gradient hooks from the parameters."""
        for h in self._hooks:
            h.remove()
