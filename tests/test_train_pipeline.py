"""The input pipeline: the sharded, resumable sample order as a DataLoader sampler with
worker processes, and the per-data-set augmentation (ImageNet random resized crop +
flip / resize + centre crop; CIFAR pad-crop + flip).

Serial tests simulate ranks in one process; the MPI test (``launch/local -n 2
python -m mpi4py -m pytest --with-mpi --only-mpi tests/test_train_pipeline.py``)
gathers the real ranks' batches.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from kfac_hpc.train.data import (
    RandomResizedCropFlip,
    ShardedBatchSampler,
    ShardedLoader,
    TensorDataset,
    load_dataset,
)
from kfac_hpc.train.data.augment import _resize_chw, resize_center_crop

WORKERS = 2


def index_dataset(n: int = 203) -> TensorDataset:
    """Input of sample i is i (exact in float32): batches reveal the indices served."""
    return TensorDataset(torch.arange(n).float()[:, None], torch.arange(n) % 7)


def augmented_images(n: int = 96) -> Any:
    return load_dataset("synthetic", seed=5, augment=True, input_shape=(3, 8, 8),
                        train_size=n, test_size=8).train


def batches(loader: ShardedLoader, limit: int | None = None) -> list[tuple[torch.Tensor, ...]]:
    out = []
    for x, y in loader:
        out.append((x, y))
        if limit is not None and len(out) == limit:
            break
    return out


def loader(ds: Any, *, batch: int, rank: int = 0, size: int = 1, workers: int = WORKERS,
           drop_last: bool = True, seed: int = 11) -> ShardedLoader:
    return ShardedLoader(ds, batch_size=batch, rank=rank, world_size=size, seed=seed,
                         shuffle=True, drop_last=drop_last, num_workers=workers)


def same(a: list[tuple[torch.Tensor, ...]], b: list[tuple[torch.Tensor, ...]]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(a, b))


# ------------------------------------------------------------------- the loader


def test_workers_serve_exactly_the_inline_batches() -> None:
    """Augmented batches from 2 worker processes are bitwise those decoded inline, in
    order (augmentation depends on (seed, epoch, index) only)."""
    ds = augmented_images()
    for epoch in (0, 1):
        a, b = loader(ds, batch=8, workers=0), loader(ds, batch=8)
        a.set_epoch(epoch)
        b.set_epoch(epoch)
        assert same(batches(a), batches(b))
        assert a.epoch == b.epoch == epoch + 1


@pytest.mark.parametrize("size", [2, 3])
def test_union_of_rank_batches_is_the_one_rank_batch_with_workers(size: int) -> None:
    ds = augmented_images()
    one = batches(loader(ds, batch=4 * size))
    ranks = [batches(loader(ds, batch=4, rank=r, size=size)) for r in range(size)]
    assert len(one) == len(ranks[0]) == len(ds) // (4 * size)
    for step, (x, y) in enumerate(one):
        assert torch.equal(torch.cat([ranks[r][step][0] for r in range(size)]), x)
        assert torch.equal(torch.cat([ranks[r][step][1] for r in range(size)]), y)


@pytest.mark.parametrize("stop_after", [1, 5, 12])
def test_resume_mid_epoch_gives_the_same_order_with_workers(stop_after: int) -> None:
    ds = augmented_images()
    whole = batches(loader(ds, batch=8)) + batches(_second_epoch(ds))
    first = loader(ds, batch=8)
    head = batches(first, limit=stop_after)
    state = first.state_dict()
    assert state["batch_index"] == stop_after  # yielded, not prefetched, batches count
    resumed = loader(ds, batch=8, seed=999)  # the saved seed is adopted
    resumed.load_state_dict(state)
    tail = batches(resumed)
    assert resumed.epoch == 1
    tail += batches(resumed)  # and the next epoch continues the same way
    assert same(head + tail, whole)


def _second_epoch(ds: Any) -> ShardedLoader:
    second = loader(ds, batch=8)
    second.set_epoch(1)
    return second


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("size", [1, 2, 4])
def test_workers_never_duplicate_or_drop_samples(size: int, drop_last: bool) -> None:
    n, batch = 203, 5
    ds = index_dataset(n)
    seen: list[int] = []
    for r in range(size):
        for x, _ in batches(loader(ds, batch=batch, rank=r, size=size, drop_last=drop_last)):
            seen += [int(v) for v in x[:, 0]]
    if drop_last:  # the epoch's first len*G positions of the permutation, once each
        ref = loader(ds, batch=batch, size=size)
        kept = ref.order(0)[: len(ref) * batch * size].tolist()
        assert sorted(seen) == sorted(kept) and len(set(seen)) == len(seen)
    else:
        assert sorted(seen) == list(range(n))


def test_stopping_early_stops_the_workers_and_keeps_the_position() -> None:
    ds = index_dataset()
    a = loader(ds, batch=4)
    for i, _ in enumerate(a):
        if i == 2:
            break
    assert a.batch_index == 3 and a.epoch == 0
    rest = batches(a)  # a new iteration (and new workers) from the position
    ref = batches(loader(ds, batch=4, workers=0))
    assert same(rest, ref[3:])


def test_batch_sampler_is_the_order() -> None:
    ds = index_dataset()
    ld = loader(ds, batch=4, rank=1, size=2)
    sampler = ld.sampler(epoch=2, start=3)
    assert isinstance(sampler, ShardedBatchSampler) and len(sampler) == len(ld) - 3
    got = list(sampler)
    assert all(torch.equal(g, ld.indices(3 + i, 2)) for i, g in enumerate(got))


def test_pinned_batches_without_cuda_are_refused_cleanly_or_pinned() -> None:
    """pin_memory is passed through (set by the driver only when the device is CUDA)."""
    ld = ShardedLoader(index_dataset(), batch_size=4, rank=0, world_size=1, seed=0,
                       shuffle=False, num_workers=1, pin_memory=True, prefetch_factor=3)
    dl = ld.data_loader()
    assert dl.pin_memory and dl.prefetch_factor == 3 and dl.num_workers == 1
    with pytest.raises(ValueError):
        ShardedLoader(index_dataset(), batch_size=4, rank=0, world_size=1, seed=0,
                      shuffle=False, num_workers=-1)


def test_plain_map_style_datasets_work_with_workers_and_short_batches() -> None:
    class Items(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
        def __len__(self) -> int:
            return 10

        def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
            return torch.full((3,), float(i)), i % 2

    got = [batches(loader(Items(), batch=1, rank=r, size=4, drop_last=False))
           for r in range(4)]
    served = sorted(int(x[0, 0]) for rank in got for x, _ in rank if len(x))
    assert served == list(range(10))
    assert any(len(x) == 0 for rank in got for x, _ in rank)  # 10 = 2*4 + 2: empty slots


# --------------------------------------------------------------- augmentation


def test_random_resized_crop_is_a_pure_function_of_seed_epoch_index() -> None:
    rrc = RandomResizedCropFlip(seed=3, size=16)
    p = rrc.params(2, 17, 120, 90)
    assert p == rrc.params(2, 17, 120, 90)
    assert p != rrc.params(3, 17, 120, 90) or p != rrc.params(2, 18, 120, 90)
    areas, flips = [], 0
    for i in range(300):
        top, left, h, w, flip = rrc.params(0, i, 120, 90)
        assert top >= 0 and top + h <= 120 and left >= 0 and left + w <= 90
        areas.append(h * w / (120 * 90))
        flips += flip
    assert min(areas) >= 0.07 and max(areas) <= 1.0 and max(areas) - min(areas) > 0.5
    assert 100 < flips < 200


def test_random_resized_crop_of_the_whole_image_is_a_resize() -> None:
    img = torch.arange(3 * 20 * 30, dtype=torch.float32).reshape(3, 20, 30) % 251
    img = img.to(torch.uint8)
    rrc = RandomResizedCropFlip(seed=0, size=10, scale=(1.0, 1.0), ratio=(1.5, 1.5))
    for i in range(4):
        out = rrc.apply(img, 0, i)
        *_, flip = rrc.params(0, i, 20, 30)
        plain = _resize_chw(img, 10, 10)
        assert out.shape == (3, 10, 10) and out.dtype == torch.uint8
        assert torch.equal(out, plain.flip(2) if flip else plain)


def test_resize_center_crop_is_the_imagenet_evaluation_transform() -> None:
    img = torch.randint(0, 256, (3, 300, 400), dtype=torch.uint8)
    out = resize_center_crop(img, 224)
    assert out.shape == (3, 224, 224)
    # shorter side to 256 (224 / 0.875), then the centre: equal to doing it by hand
    ref = _resize_chw(img, 256, 341)[:, 16:240, 58:282]
    assert torch.equal(out, ref)


def test_resize_is_antialiased_bilinear() -> None:
    """The resize (torchvision's when installed, else torch's) is antialiased bilinear:
    within 1 grey level of torch's float result."""
    img = torch.randint(0, 256, (3, 97, 131), dtype=torch.uint8)
    ref = torch.nn.functional.interpolate(img[None].float(), size=(40, 50), mode="bilinear",
                                          antialias=True)[0]
    out = _resize_chw(img, 40, 50)
    assert out.dtype == torch.uint8 and out.shape == (3, 40, 50)
    assert float((out.float() - ref).abs().max()) <= 1.0


def test_cifar_recipe_is_pad_crop_flip() -> None:
    ds = augmented_images()
    assert ds.augment is not None and ds.augment.padding == 1  # 8 // 8
    x0, _ = ds.get_batch(torch.arange(8), 0)
    x1, _ = ds.get_batch(torch.arange(8), 1)
    xe, _ = ds.get_batch(torch.arange(8), None)
    assert not torch.equal(x0, x1) and not torch.equal(x0, xe)


needs_pillow = pytest.mark.skipif(importlib.util.find_spec("PIL") is None,
                                  reason="needs Pillow")


def make_image_folder(root: Path, per_class: int = 6) -> Path:
    from PIL import Image

    g = torch.Generator().manual_seed(0)
    for split in ("train", "val"):
        for c in ("a", "b"):
            d = root / split / c
            d.mkdir(parents=True)
            for i in range(per_class):
                h, w = 40 + 7 * i, 60 - 3 * i
                arr = torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8)
                Image.fromarray(arr.numpy()).save(d / f"{i}.png")
    return root


@needs_pillow
def test_imagefolder_train_and_eval_transforms(tmp_path: Path) -> None:
    root = make_image_folder(tmp_path / "imgs")
    aug = load_dataset("imagefolder", path=root, augment=True, image_size=16, seed=1)
    assert isinstance(aug.train.augment, RandomResizedCropFlip)  # type: ignore[attr-defined]
    idx = torch.arange(len(aug.train))
    x0, _ = aug.train.get_batch(idx, 0)  # type: ignore[attr-defined]
    x0b, _ = aug.train.get_batch(idx, 0)  # type: ignore[attr-defined]
    x1, _ = aug.train.get_batch(idx, 1)  # type: ignore[attr-defined]
    assert x0.shape == (12, 3, 16, 16) and torch.equal(x0, x0b) and not torch.equal(x0, x1)
    xt, _ = aug.test.get_batch(torch.arange(4), 0)  # type: ignore[attr-defined]
    xt2, _ = aug.test.get_batch(torch.arange(4), 5)  # type: ignore[attr-defined]
    assert torch.equal(xt, xt2)  # evaluation: no augmentation whatever the epoch
    # with decoding workers: the same batches
    a = batches(loader(aug.train, batch=3, workers=0))
    b = batches(loader(aug.train, batch=3))
    assert same(a, b)


# ------------------------------------------------------------------------ MPI


@pytest.mark.mpi(min_size=2)
def test_mpi_union_of_rank_batches_is_the_one_rank_batch(comm: Any) -> None:
    """Each rank decodes its shard with 2 worker processes; gathered in rank order
    they are the batches of a 1-rank loader with the global batch."""
    ds = augmented_images(120)
    mine = batches(loader(ds, batch=3, rank=comm.rank, size=comm.size))
    gathered = comm.allgather_object(mine)
    one = batches(loader(ds, batch=3 * comm.size, workers=0))
    assert len(one) == len(mine)
    for step, (x, y) in enumerate(one):
        assert torch.equal(torch.cat([g[step][0] for g in gathered]), x)
        assert torch.equal(torch.cat([g[step][1] for g in gathered]), y)
