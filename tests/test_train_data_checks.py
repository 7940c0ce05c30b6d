"""What the driver checks of its data, and what its loaders leave alone.

* every rank reads the same data (:func:`kfac_hpc.train.setup.check_same_data`, by
  :func:`kfac_hpc.train.data.fingerprint.fingerprint`);
* a loader's worker seeds never come from torch's global generator (the model's own
  draws, e.g. dropout, would then depend on workers, evaluations and resumes);
* evaluation batches are never augmented;
* image folders: hidden folders are no classes, a training class without images is an
  error;
* plugins: a sample's shape is kept, a module in the current directory comes first.

The MPI test: ``launch/local -n 2 python -m mpi4py -m pytest --with-mpi --only-mpi
tests/test_train_data_checks.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from kfac_hpc.train.config import ConfigError, TrainConfig
from kfac_hpc.train.data import ShardedLoader, TensorDataset, load_dataset
from kfac_hpc.train.data import fingerprint as fingerprints
from kfac_hpc.train.data.fingerprint import fingerprint


def images(n: int = 40, seed: int = 3) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randint(0, 256, (n, 3, 4, 4), generator=g, dtype=torch.uint8),
                         torch.arange(n) % 5, scale=1 / 255)


# ------------------------------------------------------------------ fingerprints
def test_equal_tensor_data_sets_agree_and_one_changed_byte_does_not() -> None:
    a, b = images(), images()
    assert fingerprint(a) == fingerprint(b)
    b.inputs[17, 1, 2, 3] ^= 1
    assert fingerprint(a) != fingerprint(b)
    c = images()
    c.targets[39] = 0
    assert fingerprint(a) != fingerprint(c)
    assert fingerprint(images(39)) != fingerprint(images(40))


def test_large_tensor_data_sets_are_read_at_evenly_spaced_samples(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Above the bound, the first and last samples are among those read."""
    monkeypatch.setattr(fingerprints, "MAX_HASHED_BYTES", 10 * 48)  # about 10 samples
    a, b = images(), images()
    assert fingerprint(a) == fingerprint(b)
    b.inputs[39, 0, 0, 0] ^= 1
    assert fingerprint(a) != fingerprint(b)


def _folder(root: Path, files: dict[str, int]) -> None:
    image_module = pytest.importorskip("PIL.Image")
    for split in ("train", "val"):
        for cls, n in files.items():
            (root / split / cls).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                image = image_module.new("RGB", (6, 6), (40 * i, 0, 0))
                image.save(root / split / cls / f"{i}.png")


def test_image_folders_agree_where_copied_and_not_where_a_file_is_missing(tmp_path: Path) -> None:
    _folder(tmp_path / "a", {"cat": 3, "dog": 2})
    _folder(tmp_path / "b", {"cat": 3, "dog": 2})  # another node's copy, at another path
    a = load_dataset("imagefolder", path=tmp_path / "a", image_size=4)
    b = load_dataset("imagefolder", path=tmp_path / "b", image_size=4)
    assert fingerprint(a.train) == fingerprint(b.train)
    (tmp_path / "b" / "train" / "cat" / "1.png").unlink()
    b = load_dataset("imagefolder", path=tmp_path / "b", image_size=4)
    assert fingerprint(a.train) != fingerprint(b.train)


def test_other_data_sets_are_read_at_a_few_samples() -> None:
    class Plain(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
        def __init__(self, shift: float) -> None:
            self.shift = shift

        def __len__(self) -> int:
            return 100

        def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
            return torch.full((3,), float(i)) + (self.shift if i == 99 else 0.0), i % 2

    assert fingerprint(Plain(0.0)) == fingerprint(Plain(0.0))
    assert fingerprint(Plain(0.0)) != fingerprint(Plain(0.5))  # the last sample is read


@pytest.mark.mpi(min_size=2)
def test_ranks_with_other_data_are_refused_on_every_rank(comm: Any) -> None:
    """Rank 1 reads 39 samples, the others 40: the same usage error on every rank,
    naming rank 1; equal data passes."""
    from kfac_hpc.train.data import DatasetSplits
    from kfac_hpc.train.setup import check_same_data

    aux = comm

    def splits(n: int) -> DatasetSplits:
        return DatasetSplits("mine", images(n), images(8), 5, (3, 4, 4))

    check_same_data(aux, splits(40))
    with pytest.raises(ConfigError, match=r"read different data .*rank 0: 40 training "
                                          r"samples.*rank 1: 39 training samples"):
        check_same_data(aux, splits(39 if comm.rank == 1 else 40))


# ------------------------------------------------------------------ loaders
def test_loader_iterators_leave_the_global_generator_alone() -> None:
    """A worker-decoded epoch draws its workers' seed from the loader's own generator:
    the global one is where it was (on the old code a DataLoader iterator drew it)."""
    ds = images()
    loader = ShardedLoader(ds, batch_size=4, rank=0, world_size=1, seed=1, shuffle=True,
                           num_workers=1)
    torch.manual_seed(123)
    want = torch.rand(3)
    torch.manual_seed(123)
    batches = [x for x, _ in loader]
    assert len(batches) == 10
    assert torch.equal(torch.rand(3), want)


@pytest.mark.parametrize("workers", [0, 1])
def test_an_unaugmented_loader_serves_the_stored_samples(workers: int) -> None:
    """Evaluation's loader (``augment=False``) fetches with ``epoch=None``; the training
    loader of the same data set augments."""
    ds = load_dataset("synthetic", seed=5, augment=True, input_shape=(3, 8, 8),
                      train_size=16, test_size=8).train
    plain = ShardedLoader(ds, batch_size=16, rank=0, world_size=1, seed=0, shuffle=False,
                          num_workers=workers, augment=False)
    trained = ShardedLoader(ds, batch_size=16, rank=0, world_size=1, seed=0, shuffle=False,
                            num_workers=workers)
    (x, _), = list(plain)
    (xa, _), = list(trained)
    stored = ds.get_batch(torch.arange(16))[0]
    assert torch.equal(x, stored) and not torch.equal(xa, stored)
    assert plain.with_batch_size(8).augment is False


# ------------------------------------------------------------------ image folders
def test_hidden_folders_are_no_classes_and_a_class_without_images_is_an_error(
        tmp_path: Path) -> None:
    _folder(tmp_path, {"cat": 2, "dog": 2})
    (tmp_path / "train" / ".ipynb_checkpoints").mkdir()
    (tmp_path / "train" / "cat" / "._0.png").write_bytes(b"not an image")  # AppleDouble
    s = load_dataset("imagefolder", path=tmp_path, image_size=4)
    assert s.classes == ("cat", "dog") and len(s.train) == 4
    (tmp_path / "train" / "bird").mkdir()
    with pytest.raises(ValueError, match=r"class folder .*bird has no \.png"):
        load_dataset("imagefolder", path=tmp_path, image_size=4)


# ------------------------------------------------------------------ plugins, options
def test_a_plugin_samples_shape_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kfac_hpc.train.plugins import load_plugin_dataset

    (tmp_path / "seq_data_plugin.py").write_text(
        "import torch\n"
        "def data(**_):\n"
        "    ds = torch.utils.data.TensorDataset(torch.zeros(8, 10, 6), torch.zeros(8).long())\n"
        "    return ds, ds, 2\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    splits = load_plugin_dataset("seq_data_plugin:data", seed=0, path=None, augment=False,
                                 image_size=None, split_seed=0)
    assert splits.input_shape == (10, 6)
    assert splits.model_kwargs()["input_dim"] == 60


def test_a_plugin_module_in_the_current_directory_comes_first(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A module of the same name elsewhere on the path (the standard library's, with the
    console script) does not shadow the one next to the job, as with ``python -m``."""
    from kfac_hpc.train.plugins import load_factory

    elsewhere, here = tmp_path / "elsewhere", tmp_path / "here"
    for folder, value in ((elsewhere, "elsewhere"), (here, "here")):
        folder.mkdir()
        (folder / "shadowed_plugin_mod.py").write_text(f"def build():\n    return {value!r}\n")
    monkeypatch.chdir(here)
    monkeypatch.setattr(sys, "path", [str(elsewhere),
                                      *(p for p in sys.path if p not in ("", str(here)))])
    monkeypatch.delitem(sys.modules, "shadowed_plugin_mod", raising=False)
    assert load_factory("shadowed_plugin_mod:build", "--model")() == "here"
    monkeypatch.delitem(sys.modules, "shadowed_plugin_mod", raising=False)


def test_augment_with_the_text_corpus_is_refused() -> None:
    assert any("stdlib-text' data set has no augmentation" in p
               for p in TrainConfig(dataset="stdlib-text", model="gpt", augment=True).problems())
