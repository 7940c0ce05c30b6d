"""The sharded, resumable loader: :class:`ShardedLoader` and its ``DataLoader`` pipeline.

Conventions (a 1-rank run with batch ``B*P`` is the reference):

* The order of epoch ``e`` is one permutation seeded by ``(seed, e)``, the same on
  every rank and for every world size.
* Global batch ``s`` is positions ``[s*B*P, (s+1)*B*P)`` of that order; rank ``r``
  takes the ``r``-th contiguous slice of ``B`` samples. The concatenation of the
  ranks' batches in rank order is exactly global batch ``s``.
* The position is kept in global samples. A state saved on ``P`` ranks with batch
  ``B`` resumes on ``Q`` ranks with batch ``B'`` at the same sample whenever the
  saved position is a multiple of ``B'*Q`` — always when ``B'*Q == B*P``, the
  supported way to change the number of ranks; the rest of the run is then
  identical to the uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from kfac_hpc.train.data.datasets import BatchDataset
from kfac_hpc.train.data.seeds import STREAM_LOADER, STREAM_ORDER, generator

__all__ = ["ShardedBatchSampler", "ShardedLoader", "fetch_batch", "rescaled_batch_size"]


class ShardedLoader:
    """Deterministic, sharded, resumable batches of ``dataset`` for one rank.

    Each epoch uses one permutation seeded by ``(seed, epoch)`` (the identity when
    ``shuffle=False``), identical on all ranks. Global batch ``s`` is positions
    ``[s*G, (s+1)*G)`` of it, ``G = batch_size * world_size``; this rank yields the
    slice ``[rank*batch_size, (rank+1)*batch_size)`` of each global batch.

    With ``drop_last=False`` the final, short global batch is split as evenly as
    possible in rank order (``torch.tensor_split``): local sizes then differ by at
    most one and may be zero, but every rank yields the same number of batches, so
    collectives stay matched; weight per-rank means by the local size.

    Iteration continues from the current position to the end of the epoch, then moves
    to the start of the next epoch; :meth:`state_dict` inside the loop body therefore
    names the batch after the one just received. A position is kept in global samples
    (see the module docstring for resuming on another world size). One iterator at a
    time; batches are CPU tensors (move them to the device in the training loop).

    Input pipeline: with ``num_workers > 0`` the batches of the rest of the epoch
    (:class:`ShardedBatchSampler`, the same order) are decoded by a
    ``torch.utils.data.DataLoader`` with that many worker processes, each holding up
    to ``prefetch_factor`` batches ahead, in pinned memory when ``pin_memory`` (set it
    when the device is CUDA). Batches are yielded in order and are bitwise the same as
    with ``num_workers=0`` (augmentation depends only on ``(seed, epoch, index)``); the
    position counts yielded batches, not prefetched ones, so :meth:`state_dict` and
    resume are unchanged. Workers start with each ``for`` loop over the loader.
    """

    def __init__(
        self,
        dataset: torch.utils.data.Dataset[Any],
        *,
        batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
        shuffle: bool,
        drop_last: bool = True,
        num_workers: int = 0,
        pin_memory: bool = False,
        prefetch_factor: int = 2,
        augment: bool = True,
    ) -> None:
        """Shard ``dataset``; the position is the start of epoch 0.

        Args:
            dataset: A :class:`BatchDataset` or any map-style data set of
                ``(input, target)``.
            batch_size: Samples per rank and batch.
            rank: This rank.
            world_size: The number of ranks.
            seed: The seed of the sample order.
            shuffle: Shuffle every epoch (else the data set's order).
            drop_last: Drop the last, short global batch.
            num_workers: DataLoader worker processes (0: decode here).
            pin_memory: Batches in pinned memory (for CUDA).
            prefetch_factor: Batches each worker decodes ahead.
            augment: Fetch a :class:`BatchDataset`'s batches with the epoch's
                augmentation (False: ``epoch=None``, none; evaluation).

        Raises:
            ValueError: A bad rank, size, batch or pipeline option.
        """
        if num_workers < 0 or prefetch_factor < 1:
            raise ValueError(f"num_workers must be >= 0 and prefetch_factor >= 1, got "
                             f"{num_workers} and {prefetch_factor}")
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(
                f"rank must be in [0, {world_size}) for world_size {world_size}, got {rank}"
            )
        if batch_size < 1:
            raise ValueError(f"batch_size (per rank) must be >= 1, got {batch_size}")
        n = len(dataset)  # type: ignore[arg-type]
        if n < 1:
            raise ValueError("the data set is empty")
        global_batch = batch_size * world_size
        if batch_size > n or (drop_last and global_batch > n):
            raise ValueError(
                f"global batch size {global_batch} (batch_size {batch_size} per rank x "
                f"world_size {world_size}) is larger than the data set ({n} samples), "
                "which leaves no full batch; lower the batch size or use fewer ranks"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.prefetch_factor = prefetch_factor
        self.augment = augment
        self._n = n
        self._epoch = 0
        self._batch_index = 0
        self._order_cache: tuple[int, int, Tensor] | None = None

    # -- geometry
    @property
    def global_batch_size(self) -> int:
        """Samples per batch over all ranks."""
        return self.batch_size * self.world_size

    def __len__(self) -> int:
        """Batches per epoch (the same on every rank)."""
        g = self.global_batch_size
        return self._n // g if self.drop_last else -(-self._n // g)

    @property
    def epoch(self) -> int:
        """The epoch of the next batch to be yielded."""
        return self._epoch

    @property
    def batch_index(self) -> int:
        """Index, within the current epoch, of the next batch to be yielded."""
        return self._batch_index

    def order(self, epoch: int) -> Tensor:
        """Return the epoch's sample order (positions -> data set indices), same on all ranks."""
        if self._order_cache is not None and self._order_cache[:2] == (epoch, self.seed):
            return self._order_cache[2]
        if self.shuffle:
            order = torch.randperm(self._n, generator=generator(self.seed, epoch, STREAM_ORDER))
        else:
            order = torch.arange(self._n)
        self._order_cache = (epoch, self.seed, order)
        return order

    def indices(self, step: int, epoch: int | None = None) -> Tensor:
        """Return the indices of this rank's batch ``step`` of ``epoch`` (default: current)."""
        if not 0 <= step < len(self):
            raise IndexError(f"step {step} out of range for {len(self)} batches per epoch")
        order = self.order(self._epoch if epoch is None else epoch)
        g = self.global_batch_size
        chunk = order[step * g : (step + 1) * g]
        if chunk.numel() == g:
            return chunk[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]
        return torch.tensor_split(chunk, self.world_size)[self.rank]

    # -- iteration
    def _fetch(self, idx: Tensor, epoch: int) -> tuple[Tensor, Tensor]:
        return fetch_batch(self.dataset, idx, epoch if self.augment else None)

    def sampler(self, epoch: int | None = None, start: int | None = None) -> ShardedBatchSampler:
        """Return this rank's batches of ``epoch`` from batch ``start`` (default: the position)."""
        return ShardedBatchSampler(self, self._epoch if epoch is None else epoch,
                                   self._batch_index if start is None else start)

    def data_loader(self, epoch: int | None = None, start: int | None = None
                    ) -> torch.utils.data.DataLoader[tuple[Tensor, Tensor]]:
        """Build the ``DataLoader`` (workers, pinning, prefetch) that :meth:`__iter__` reads."""
        epoch = self._epoch if epoch is None else epoch
        workers = self.num_workers
        # An iterator draws a base seed for its workers: from its own generator, not
        # torch's global one, which the model's own draws (dropout) would then follow
        # otherwise (a resumed run, or one with evaluations or workers, drawing other bits).
        return torch.utils.data.DataLoader(
            _EpochBatches(self.dataset, epoch if self.augment else None),
            sampler=self.sampler(epoch, start), batch_size=None, num_workers=workers,
            pin_memory=self.pin_memory,
            prefetch_factor=self.prefetch_factor if workers else None,
            persistent_workers=False,
            generator=generator(self.seed, epoch, STREAM_LOADER))

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        """Yield this rank's batches from the position to the end of the epoch.

        Yields:
            ``(inputs, targets)`` CPU tensors.
        """
        epoch = self._epoch
        pipeline: Iterator[tuple[Tensor, Tensor]] | None = None
        if self._batch_index < len(self) and (self.num_workers > 0 or self.pin_memory):
            pipeline = iter(self.data_loader(epoch, self._batch_index))
        try:
            while self._batch_index < len(self):
                if pipeline is None:
                    batch = self._fetch(self.indices(self._batch_index, epoch), epoch)
                else:
                    batch = next(pipeline)
                self._batch_index += 1
                yield batch
                if self._epoch != epoch:  # repositioned while iterating
                    return
            self._epoch, self._batch_index = epoch + 1, 0
        finally:
            del pipeline  # stops the workers (an early break included)

    def with_batch_size(self, batch_size: int) -> ShardedLoader:
        """Return the same loader (data, rank, seed, position) with per-rank ``batch_size``."""
        other = ShardedLoader(self.dataset, batch_size=batch_size, rank=self.rank,
                              world_size=self.world_size, seed=self.seed,
                              shuffle=self.shuffle, drop_last=self.drop_last,
                              num_workers=self.num_workers, pin_memory=self.pin_memory,
                              prefetch_factor=self.prefetch_factor, augment=self.augment)
        other._epoch = self._epoch
        return other

    def set_epoch(self, epoch: int) -> None:
        """Move to the start of ``epoch``; no-op if already in it (keeps a resumed position)."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if epoch != self._epoch:
            self._epoch, self._batch_index = epoch, 0

    # -- resumption
    def state_dict(self) -> dict[str, int]:
        """Position as plain ints (HDF5-friendly).

        ``epoch``, ``batch_index`` (next batch), ``seed``, plus ``sample_index``
        (global samples consumed in the epoch: authoritative on load),
        ``global_batch_size`` and ``dataset_size`` (checked on load).
        """
        sample_index = min(self._batch_index * self.global_batch_size, self._n)
        return {
            "epoch": self._epoch,
            "batch_index": self._batch_index,
            "seed": self.seed,
            "sample_index": sample_index,
            "global_batch_size": self.global_batch_size,
            "dataset_size": self._n,
        }

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Continue exactly after the saved position (the saved ``seed`` is adopted).

        Raises ``ValueError`` if the data set size differs or the saved position is not
        at a global batch boundary of this loader.
        """
        missing = {"epoch", "batch_index", "seed"} - set(state)
        if missing:
            raise ValueError(f"loader state lacks {sorted(missing)}; got keys {sorted(state)}")
        size = int(state.get("dataset_size", self._n))
        if size != self._n:
            raise ValueError(
                f"loader state was saved for a data set of {size} samples, this one has "
                f"{self._n}; resume with the same data set"
            )
        epoch = int(state["epoch"])
        if epoch < 0:
            raise ValueError(f"loader state has negative epoch {epoch}")
        g = self.global_batch_size
        if "sample_index" in state:
            sample = int(state["sample_index"])
        else:
            sample = int(state["batch_index"]) * int(state.get("global_batch_size", g))
        end = len(self) * g if self.drop_last else self._n
        if sample < 0:
            raise ValueError(f"loader state has negative position {sample}")
        if sample >= end:
            batch_index = len(self)
        elif sample % g == 0:
            batch_index = sample // g
        else:
            saved_g = state.get("global_batch_size", "?")
            raise ValueError(
                f"loader state is at global sample {sample} of epoch {epoch} (global batch "
                f"{saved_g}), not a multiple of this loader's global batch {g} "
                f"(batch_size {self.batch_size} x world_size {self.world_size}); keep "
                "batch_size * world_size equal to the saved global batch when resuming"
            )
        self.seed = int(state["seed"])
        self._epoch, self._batch_index = epoch, batch_index


def fetch_batch(dataset: torch.utils.data.Dataset[Any], idx: Tensor,
                epoch: int | None) -> tuple[Tensor, Tensor]:
    """Return the batch of data set indices ``idx``.

    ``get_batch`` of a :class:`BatchDataset`, else the stacked ``dataset[i]`` (any
    map-style data set of ``(input, target)``).

    Args:
        dataset: The data set.
        idx: Data set indices.
        epoch: The epoch whose augmentation to draw (None: none).

    Returns:
        ``(inputs, targets)``.
    """
    if isinstance(dataset, BatchDataset):
        return dataset.get_batch(idx, epoch)
    items = [dataset[int(i)] for i in idx]
    if not items:  # a short last batch split over more ranks than it has samples
        x0, _ = dataset[0]
        return torch.empty((0, *torch.as_tensor(x0).shape)), torch.empty(0, dtype=torch.long)
    xs, ys = zip(*items)
    return torch.stack([torch.as_tensor(x) for x in xs]), torch.as_tensor(ys).long()


class ShardedBatchSampler(torch.utils.data.Sampler[Tensor]):
    """The sample order of a :class:`ShardedLoader` as a ``DataLoader`` sampler.

    It yields this rank's index tensor of each batch of ``epoch`` from batch ``start``
    on (use with ``batch_size=None``; the data set turns an index tensor into a batch).
    """

    def __init__(self, loader: ShardedLoader, epoch: int, start: int = 0) -> None:
        """Follow ``loader``'s order.

        Args:
            loader: The loader.
            epoch: The epoch.
            start: The first batch.
        """
        self.loader, self.epoch, self.start = loader, epoch, start

    def __len__(self) -> int:
        """Return the number of batches left."""
        return max(0, len(self.loader) - self.start)

    def __iter__(self) -> Iterator[Tensor]:
        """Yield this rank's index tensor of each batch.

        Yields:
            Data set indices of one batch.
        """
        for step in range(self.start, len(self.loader)):
            yield self.loader.indices(step, self.epoch)


class _EpochBatches(torch.utils.data.Dataset[tuple[Tensor, Tensor]]):
    """``dataset`` seen by a ``DataLoader`` worker: an index tensor -> its batch."""

    def __init__(self, dataset: torch.utils.data.Dataset[Any], epoch: int | None) -> None:
        self.dataset, self.epoch = dataset, epoch

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, idx: Tensor) -> tuple[Tensor, Tensor]:
        return fetch_batch(self.dataset, idx, self.epoch)


def rescaled_batch_size(global_batch: int, world_size: int, *, multiple_of: int = 1) -> int:
    """Return the per-rank batch that keeps ``global_batch`` on ``world_size`` ranks.

    For a restart on a different number of ranks.

    Args:
        global_batch: The checkpoint's global batch.
        world_size: The number of ranks now.
        multiple_of: The per-rank batch must be a multiple of this (micro-batches).

    Returns:
        The per-rank batch.

    Raises:
        ValueError: No such batch exists (saying why and which rank counts would work).
    """
    if global_batch % world_size:
        fits = [p for p in range(1, min(global_batch, 4096) + 1) if global_batch % p == 0]
        raise ValueError(
            f"cannot keep the checkpoint's global batch {global_batch} on {world_size} "
            f"ranks: {global_batch} is not a multiple of {world_size}, and the sample order, "
            "learning-rate schedule and step count all depend on the global batch. Run on "
            f"a number of ranks dividing {global_batch} ({', '.join(map(str, fits[:12]))}"
            f"{', ...' if len(fits) > 12 else ''}), or start a new run")
    batch = global_batch // world_size
    if batch % multiple_of:
        raise ValueError(
            f"keeping the checkpoint's global batch {global_batch} on {world_size} ranks "
            f"needs {batch} samples per rank, which --accumulation-steps {multiple_of} does "
            "not divide; change --accumulation-steps or the number of ranks")
    return batch
