"""Model zoo and data layer of the training driver (serial, fast)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from kfac_hpc.models import build_model, model_names
from kfac_hpc.train.data import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    RandomCropFlip,
    ShardedLoader,
    TensorDataset,
    dataset_names,
    load_dataset,
)


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------------ models


def test_model_names() -> None:
    assert model_names() == ["gpt", "mlp", "resnet20", "resnet32", "resnet50", "resnet56"]


@pytest.mark.parametrize(
    ("name", "kwargs", "shape"),
    [
        ("mlp", {"input_dim": 64}, (4, 64)),
        ("mlp", {"in_channels": 1, "image_size": 8}, (4, 1, 8, 8)),
        ("resnet20", {"in_channels": 3}, (2, 3, 32, 32)),
        ("resnet32", {"in_channels": 1}, (2, 1, 8, 8)),
        ("resnet56", {"in_channels": 3}, (2, 3, 16, 16)),
        ("resnet50", {"in_channels": 3, "image_size": 32}, (2, 3, 32, 32)),
        ("resnet50", {"in_channels": 3, "image_size": 32, "stem": "imagenet"}, (2, 3, 32, 32)),
    ],
)
def test_forward_shapes(name: str, kwargs: dict, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    model = build_model(name, num_classes=7, **kwargs)
    out = model(torch.randn(shape))
    assert out.shape == (shape[0], 7)
    assert torch.isfinite(out).all()


def test_resnet50_stem_choice() -> None:
    small = build_model("resnet50", num_classes=10, image_size=32)
    large = build_model("resnet50", num_classes=10, image_size=224)
    assert small.stem[0].kernel_size == (3, 3) and len(small.stem) == 3  # no max-pool
    assert large.stem[0].kernel_size == (7, 7) and isinstance(large.stem[3], nn.MaxPool2d)


# Published counts: He et al. 2016, Table 6 (CIFAR, option-A shortcuts): 0.27M, 0.46M,
# 0.85M. Our 1x1-conv+BN projection shortcuts add 16*32+2*32 + 32*64+2*64 = 2,752
# parameters, i.e. +1.0% / +0.6% / +0.3%: tolerance 2%. Exact values pin the architecture:
# option-A counts 269,722 / 464,154 / 853,018 for 10 classes, plus 2,752.
@pytest.mark.parametrize(
    ("name", "published", "exact"),
    [("resnet20", 0.27e6, 272_474), ("resnet32", 0.46e6, 466_906), ("resnet56", 0.85e6, 855_770)],
)
def test_cifar_resnet_param_counts(name: str, published: float, exact: int) -> None:
    n = n_params(build_model(name, num_classes=10))
    assert abs(n - published) / published < 0.02
    assert n == exact


def test_resnet50_param_count() -> None:
    # Published ~25.5M (commonly quoted for ResNet-50, 1000 classes); tolerance 0.5%.
    # The exact 25,557,032 is torchvision's resnet50 (same layout, stride in the 3x3).
    n = n_params(build_model("resnet50", num_classes=1000, image_size=224))
    assert abs(n - 25.5e6) / 25.5e6 < 0.005
    assert n == 25_557_032


@pytest.mark.parametrize("name", ["mlp", "resnet20", "resnet50"])
def test_only_kfac_layer_types(name: str) -> None:
    model = build_model(name, num_classes=10, in_channels=3, image_size=32)
    allowed = (nn.Linear, nn.Conv2d, nn.BatchNorm2d)
    for mod in model.modules():
        if any(True for _ in mod.parameters(recurse=False)):
            assert isinstance(mod, allowed), type(mod)
        if isinstance(mod, nn.Conv2d):
            assert mod.groups == 1
        if isinstance(mod, nn.ReLU):
            assert not mod.inplace


def test_resnet_projection_shortcuts_are_conv() -> None:
    model = build_model("resnet20", num_classes=10)
    convs = [n for n, m in model.named_modules() if isinstance(m, nn.Conv2d)]
    assert len(convs) == 19 + 2  # 19 conv layers of ResNet-20 + 2 projection shortcuts
    assert sum("shortcut" in n for n in convs) == 2


def test_mlp_hidden_option() -> None:
    model = build_model("mlp", num_classes=3, input_dim=10, hidden=(5, 6, 7))
    widths = [m.out_features for m in model.modules() if isinstance(m, nn.Linear)]
    assert widths == [5, 6, 7, 3]


def _widths(model: nn.Module) -> list[int]:
    return [m.out_features for m in model.modules() if isinstance(m, nn.Linear)]


@pytest.mark.parametrize("text, widths", [
    ('hidden="64"', [64, 3]),  # a quoted number: one layer of 64, not (6, 4)
    ("hidden=64", [64, 3]),  # a scalar where a sequence is expected: (64,)
    ("hidden=[32,16]", [32, 16, 3]),
])
def test_mlp_hidden_option_from_text(text: str, widths: list[int]) -> None:
    """``--model-options`` text is parsed (JSON), then converted by the builder's
    annotation ``hidden: Sequence[int]``."""
    from kfac_hpc.train.config import parse_key_values

    options = parse_key_values([text])
    assert _widths(build_model("mlp", num_classes=3, input_dim=10, **options)) == widths


@pytest.mark.parametrize("text, message", [
    ("hidden=64.7", r'--model-options hidden=64\.7: expected int or a list of int .*got '
                    r"float 64\.7 \(a float is not an int\)"),
    ("hidden=abc", r'--model-options hidden="abc": expected int or a list of int .*got the '
                   r'text "abc"'),
    ("hidden=[8,2.5]", r"--model-options hidden=\[8, 2\.5\]: expected int or a list of int"),
])
def test_mlp_hidden_option_errors_name_the_option_and_type(text: str, message: str) -> None:
    from kfac_hpc.train.config import parse_key_values

    options = parse_key_values([text])
    with pytest.raises(ValueError, match=message):
        build_model("mlp", num_classes=3, input_dim=10, **options)


def test_other_model_options_are_converted_by_annotation() -> None:
    with pytest.raises(ValueError, match=r"--model-options stem=3: expected str, got int 3"):
        build_model("resnet50", num_classes=10, stem=3)
    with pytest.raises(ValueError, match=r'zero_init_residual="yes": expected bool'):
        build_model("resnet50", num_classes=10, zero_init_residual="yes")
    with pytest.raises(ValueError, match=r"context=2\.5: expected int or null"):
        build_model("gpt", num_classes=10, input_dim=8, context=2.5)
    gpt = build_model("gpt", num_classes=10, input_dim=8, dim="16", depth=1, context=None)
    assert isinstance(gpt, nn.Module)


def test_plugin_model_options_are_converted_by_annotation(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``pkg.module:factory``'s options follow its annotations too (examples/custom_model:
    ``width: int``); an error is a ConfigError naming the factory and the option."""
    from kfac_hpc.train.config import ConfigError
    from kfac_hpc.train.plugins import build_plugin_model

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    kw = {"num_classes": 3, "in_channels": 1, "image_size": None, "input_dim": 10}
    model = build_plugin_model("examples.custom_model:build_model", **kw, width="8")
    assert 8 in _widths(model)
    with pytest.raises(ConfigError, match=r"--model 'examples.custom_model:build_model': "
                                          r"--model-options width=64\.7: expected int"):
        build_plugin_model("examples.custom_model:build_model", **kw, width=64.7)


@pytest.mark.parametrize("name", ["mlp", "resnet20"])
def test_deterministic_init(name: str) -> None:
    def params(seed: int) -> list[torch.Tensor]:
        torch.manual_seed(seed)
        return list(build_model(name, num_classes=10, input_dim=64).state_dict().values())

    a, b, c = params(1), params(1), params(2)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a, c, strict=True))


def test_model_errors() -> None:
    with pytest.raises(ValueError, match=r"unknown model 'vgg'.*mlp, resnet20"):
        build_model("vgg", num_classes=10)
    with pytest.raises(ValueError, match=r"does not take option.*stem"):
        build_model("resnet20", num_classes=10, stem="cifar")
    with pytest.raises(ValueError, match="mlp needs input_dim"):
        build_model("mlp", num_classes=10)
    with pytest.raises(ValueError, match="num_classes"):
        build_model("resnet20", num_classes=0)
    with pytest.raises(ValueError, match="stem"):
        build_model("resnet50", num_classes=10, stem="tiny")


# ---------------------------------------------------------------------- datasets


def test_digits_split_and_determinism() -> None:
    from sklearn.datasets import load_digits

    a = load_dataset("digits", seed=0)
    b = load_dataset("digits", seed=5)  # training seed does not move the split
    flat = load_dataset("digits", flat=True)
    other = load_dataset("digits", split_seed=1)
    assert (len(a.train), len(a.test)) == (1437, 360)
    assert a.num_classes == 10 and a.input_shape == (1, 8, 8) and flat.input_shape == (64,)
    assert a.model_kwargs() == {
        "num_classes": 10,
        "in_channels": 1,
        "image_size": 8,
        "input_dim": 64,
    }
    idx = torch.arange(len(a.test))
    xa, ya = a.test.get_batch(idx)
    xb, yb = b.test.get_batch(idx)
    xf, _ = flat.test.get_batch(idx)
    xo, _ = other.test.get_batch(idx)
    assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert torch.equal(xf, xa.reshape(360, 64))
    assert not torch.equal(xo, xa)
    # the split is a partition of the 1797 images: class histograms add up
    full = np.bincount(load_digits().target, minlength=10)
    parts = torch.bincount(a.train.targets, minlength=10) + torch.bincount(ya, minlength=10)
    assert parts.tolist() == full.tolist()
    xt, _ = a.train.get_batch(torch.arange(len(a.train)))
    assert abs(float(xt.mean())) < 1e-5 and abs(float(xt.std()) - 1) < 1e-3


def test_synthetic_deterministic_and_learnable() -> None:
    from sklearn.linear_model import LogisticRegression

    kw = {"input_shape": (20,), "num_classes": 4, "train_size": 1000, "test_size": 300}
    a, b = load_dataset("synthetic", seed=3, **kw), load_dataset("synthetic", seed=3, **kw)
    c = load_dataset("synthetic", seed=4, **kw)
    assert torch.equal(a.train.inputs, b.train.inputs)
    assert torch.equal(a.test.targets, b.test.targets)
    assert not torch.equal(a.train.inputs, c.train.inputs)
    assert torch.bincount(a.train.targets, minlength=4).min() > 50  # no empty class
    # labels come from a linear teacher: a linear model generalises well above chance (25%)
    clf = LogisticRegression(max_iter=1000).fit(a.train.inputs.numpy(), a.train.targets.numpy())
    assert clf.score(a.test.inputs.numpy(), a.test.targets.numpy()) > 0.85
    img = load_dataset("synthetic", input_shape=(3, 16, 16), num_classes=10, train_size=64)
    assert img.train.get_batch(torch.arange(4))[0].shape == (4, 3, 16, 16)


def write_cifar(root: Path, n_train: int = 2, n_test: int = 3) -> dict[str, np.ndarray]:
    """Fabricated CIFAR-10 binaries; pixel (c, h, w) of record k = (k + 7c + 3h + w) % 256."""
    c, h, w = np.meshgrid(np.arange(3), np.arange(32), np.arange(32), indexing="ij")
    files = {f"data_batch_{i}.bin": n_train for i in range(1, 6)} | {"test_batch.bin": n_test}
    labels: dict[str, np.ndarray] = {}
    k = 0
    root.mkdir(parents=True, exist_ok=True)
    for name, n in files.items():
        recs, labs = [], []
        for _ in range(n):
            lab = (3 * k + 1) % 10
            pix = ((k + 7 * c + 3 * h + w) % 256).astype(np.uint8)
            recs.append(np.concatenate([[lab], pix.reshape(-1)]).astype(np.uint8))
            labs.append(lab)
            k += 1
        (root / name).write_bytes(np.stack(recs).tobytes())
        labels[name] = np.array(labs)
    return labels


def expected_cifar_image(k: int) -> torch.Tensor:
    c, h, w = torch.meshgrid(torch.arange(3), torch.arange(32), torch.arange(32), indexing="ij")
    pix = ((k + 7 * c + 3 * h + w) % 256).float() / 255
    return (pix - torch.tensor(CIFAR10_MEAN).view(3, 1, 1)) / torch.tensor(CIFAR10_STD).view(
        3, 1, 1
    )


def test_cifar10_reader(tmp_path: Path) -> None:
    labels = write_cifar(tmp_path / "cifar-10-batches-bin")
    s = load_dataset("cifar10", path=tmp_path)  # finds the archive's top-level folder
    assert (len(s.train), len(s.test), s.num_classes, s.input_shape) == (10, 3, 10, (3, 32, 32))
    train_labels = np.concatenate([labels[f"data_batch_{i}.bin"] for i in range(1, 6)])
    x, y = s.train.get_batch(torch.arange(10))
    assert y.tolist() == train_labels.tolist()
    for k in (0, 3, 9):
        torch.testing.assert_close(x[k], expected_cifar_image(k), rtol=0, atol=1e-5)
    xt, yt = s.test.get_batch(torch.arange(3))
    assert yt.tolist() == labels["test_batch.bin"].tolist()
    torch.testing.assert_close(xt[2], expected_cifar_image(12), rtol=0, atol=1e-5)
    flat = load_dataset("cifar10", path=tmp_path / "cifar-10-batches-bin", flat=True)
    assert flat.test.get_batch(torch.arange(2))[0].shape == (2, 3072)


def test_cifar10_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs path"):
        load_dataset("cifar10", path=None)
    write_cifar(tmp_path)
    (tmp_path / "data_batch_3.bin").unlink()
    with pytest.raises(ValueError, match=r"missing file .*data_batch_3\.bin.*test_batch\.bin"):
        load_dataset("cifar10", path=tmp_path)
    write_cifar(tmp_path)
    with (tmp_path / "test_batch.bin").open("ab") as f:
        f.write(b"\x00" * 10)
    with pytest.raises(ValueError, match=r"test_batch\.bin has 9229 bytes"):
        load_dataset("cifar10", path=tmp_path)
    write_cifar(tmp_path)
    raw = bytearray((tmp_path / "data_batch_1.bin").read_bytes())
    raw[0] = 42
    (tmp_path / "data_batch_1.bin").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="label 42"):
        load_dataset("cifar10", path=tmp_path)


def test_cifar10_augmentation(tmp_path: Path) -> None:
    write_cifar(tmp_path)
    plain = load_dataset("cifar10", path=tmp_path)
    aug = load_dataset("cifar10", path=tmp_path, augment=True, seed=1)
    idx = torch.arange(10)
    x0, _ = plain.train.get_batch(idx)
    assert torch.equal(aug.train.get_batch(idx)[0], x0)  # epoch=None: no augmentation
    e1, e2 = aug.train.get_batch(idx, epoch=1), aug.train.get_batch(idx, epoch=2)
    assert e1[0].shape == x0.shape and not torch.equal(e1[0], e2[0])
    assert torch.equal(e1[1], e2[1])
    # per-sample: independent of which batch a sample is fetched in
    assert torch.equal(aug.train.get_batch(idx[[7, 2]], epoch=1)[0], e1[0][[7, 2]])


def test_random_crop_flip_geometry() -> None:
    x = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).view(2, 3, 4, 5)
    aug = RandomCropFlip(seed=0, padding=2)
    centre = torch.tensor([[2, 2, 0], [2, 2, 1]])
    out = aug.apply(x, centre)
    assert torch.equal(out[0], x[0]) and torch.equal(out[1], x[1].flip(-1))
    shifted = aug.apply(x, torch.tensor([[0, 4, 0], [4, 0, 0]]))  # up-right, down-left
    assert torch.equal(shifted[0, :, 2:, :3], x[0, :, :2, 2:])
    assert torch.equal(shifted[0, :, :2], torch.zeros(3, 2, 5))
    assert torch.equal(shifted[1, :, :2, 2:], x[1, :, 2:, :3])
    p = aug.params(epoch=3, n=1000)
    assert p[:, :2].min() == 0 and p[:, :2].max() == 4 and set(p[:, 2].tolist()) == {0, 1}
    assert torch.equal(p, RandomCropFlip(seed=0, padding=2).params(epoch=3, n=1000))


def test_imagefolder(tmp_path: Path) -> None:
    image_module = pytest.importorskip("PIL.Image")
    colours = {"cat": (255, 0, 0), "dog": (0, 0, 255)}
    for split, n in (("train", 3), ("val", 1)):
        for cls, rgb in colours.items():
            (tmp_path / split / cls).mkdir(parents=True)
            for i in range(n):
                img = image_module.new("RGB", (12 + i, 10), rgb)
                img.save(tmp_path / split / cls / f"{i}.{'png' if i % 2 else 'jpg'}")
    (tmp_path / "train" / "cat" / "notes.txt").write_text("not an image")
    s = load_dataset("imagefolder", path=tmp_path, image_size=8, num_threads=2)
    assert s.classes == ("cat", "dog") and s.num_classes == 2 and s.input_shape == (3, 8, 8)
    assert (len(s.train), len(s.test)) == (6, 2)
    x, y = s.train.get_batch(torch.arange(6))
    assert x.shape == (6, 3, 8, 8) and y.tolist() == [0, 0, 0, 1, 1, 1]
    # a red image: red channel at (1 - mean)/std, blue at (0 - mean)/std (JPEG: approx.)
    assert abs(float(x[1, 0].mean()) - (1 - 0.485) / 0.229) < 0.05
    assert abs(float(x[1, 2].mean()) - (0 - 0.406) / 0.225) < 0.05
    aug = load_dataset("imagefolder", path=tmp_path, image_size=8, augment=True)
    assert aug.train.get_batch(torch.arange(6), epoch=0)[0].shape == (6, 3, 8, 8)
    (tmp_path / "val" / "cat").rename(tmp_path / "val" / "bird")
    with pytest.raises(ValueError, match="bird has no counterpart"):
        load_dataset("imagefolder", path=tmp_path)


def test_imagefolder_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "train" / "a").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"missing directory .*val.*root/train/<class>"):
        load_dataset("imagefolder", path=tmp_path)
    with pytest.raises(ValueError, match="needs path"):
        load_dataset("imagefolder")
    monkeypatch.setitem(sys.modules, "PIL", None)
    with pytest.raises(ImportError, match=r"needs Pillow.*pip install pillow"):
        load_dataset("imagefolder", path=tmp_path)


def test_unknown_dataset() -> None:
    assert dataset_names() == ["cifar10", "digits", "imagefolder", "stdlib-text", "synthetic"]
    with pytest.raises(ValueError, match=r"unknown dataset 'mnist'.*cifar10, digits"):
        load_dataset("mnist")


# ------------------------------------------------------------------------ loader


def index_dataset(n: int, *, augment: bool = False) -> TensorDataset:
    """Targets are sample indices; inputs are random 1x4x4 images (augmentable)."""
    g = torch.Generator().manual_seed(0)
    images = torch.randn(n, 1, 4, 4, generator=g)
    return TensorDataset(
        images, torch.arange(n), augment=RandomCropFlip(seed=9, padding=1) if augment else None
    )


def rank_loaders(ds: TensorDataset, global_batch: int, world: int, **kw) -> list[ShardedLoader]:
    return [
        ShardedLoader(ds, batch_size=global_batch // world, rank=r, world_size=world, seed=7, **kw)
        for r in range(world)
    ]


def global_batches(loaders: list[ShardedLoader]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Run one epoch on all ranks; concatenate the ranks' batches in rank order."""
    out = []
    for per_rank in zip(*loaders, strict=True):
        xs, ys = zip(*per_rank, strict=True)
        out.append((torch.cat(xs), torch.cat(ys)))
    return out


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_sharding_union_equals_single_rank(world: int, drop_last: bool) -> None:
    ds = index_dataset(50, augment=True)  # 50 = 3 global batches of 16 + 2 left over
    for epoch in range(2):
        loaders = rank_loaders(ds, 16, world, shuffle=True, drop_last=drop_last)
        ref_loader = rank_loaders(ds, 16, 1, shuffle=True, drop_last=drop_last)[0]
        for ld in [*loaders, ref_loader]:
            ld.set_epoch(epoch)
        got = global_batches(loaders)
        reference = list(ref_loader)
        assert len(got) == len(reference) == (3 if drop_last else 4)
        for (gx, gy), (rx, ry) in zip(got, reference, strict=True):
            assert torch.equal(gy, ry) and torch.equal(gx, rx)
        seen = torch.cat([y for _, y in got])
        assert seen.unique().numel() == seen.numel() == (48 if drop_last else 50)


def test_short_last_batch_split_evenly() -> None:
    ds = index_dataset(50)
    loaders = rank_loaders(ds, 16, 4, shuffle=False, drop_last=False)
    last = [list(ld)[-1][1] for ld in loaders]
    assert [t.tolist() for t in last] == [[48], [49], [], []]  # same batch count on all ranks


def test_epoch_orders() -> None:
    ds = index_dataset(40)
    ld = ShardedLoader(ds, batch_size=10, rank=0, world_size=1, seed=3, shuffle=True)
    e0 = torch.cat([y for _, y in ld])
    e1 = torch.cat([y for _, y in ld])  # iteration moves on to epoch 1 by itself
    assert ld.epoch == 2 and ld.batch_index == 0
    assert sorted(e0.tolist()) == sorted(e1.tolist()) == list(range(40))
    assert not torch.equal(e0, e1)
    again = ShardedLoader(ds, batch_size=10, rank=0, world_size=1, seed=3, shuffle=True)
    assert torch.equal(torch.cat([y for _, y in again]), e0)
    other_seed = ShardedLoader(ds, batch_size=10, rank=0, world_size=1, seed=4, shuffle=True)
    assert not torch.equal(torch.cat([y for _, y in other_seed]), e0)
    plain = ShardedLoader(ds, batch_size=10, rank=0, world_size=1, seed=3, shuffle=False)
    assert torch.cat([y for _, y in plain]).tolist() == list(range(40))
    assert len(plain) == 4


def run(loader: ShardedLoader, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The next ``n`` batches, across epoch boundaries."""
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    while len(out) < n:
        for batch in loader:
            out.append(batch)
            if len(out) == n:
                break
    return out


def test_resume_mid_epoch_identical_batches() -> None:
    ds = index_dataset(70, augment=True)  # 7 batches of 10 per epoch

    def make() -> ShardedLoader:
        return ShardedLoader(ds, batch_size=5, rank=1, world_size=2, seed=11, shuffle=True)

    reference = run(make(), 17)  # 2 epochs + 3 batches
    for stop in (0, 3, 7, 9):
        first = make()
        head = run(first, stop)
        state = first.state_dict()
        # stopping right after an epoch's last batch leaves the position at its end
        epoch, index = (stop // 7 - 1, 7) if stop and stop % 7 == 0 else divmod(stop, 7)
        assert (state["epoch"], state["batch_index"]) == (epoch, index)
        assert state["sample_index"] == index * 10
        resumed = make()
        resumed.load_state_dict({k: int(v) for k, v in state.items()})
        resumed.set_epoch(state["epoch"])  # a driver's usual call: keeps the position
        tail = run(resumed, 17 - stop)
        for (x, y), (rx, ry) in zip(head + tail, reference, strict=True):
            assert torch.equal(y, ry) and torch.equal(x, rx)


def test_resume_at_epoch_end_inside_loop() -> None:
    ds = index_dataset(30)
    ld = ShardedLoader(ds, batch_size=10, rank=0, world_size=1, seed=0, shuffle=True)
    state = None
    for _ in ld:
        state = ld.state_dict()  # checkpoint in the loop body after the last batch
    assert state is not None and (state["epoch"], state["batch_index"]) == (0, 3)
    resumed = ShardedLoader(ds, batch_size=10, rank=0, world_size=1, seed=0, shuffle=True)
    resumed.load_state_dict(state)
    assert list(resumed) == []  # epoch 0 is finished ...
    nxt = torch.cat([y for _, y in resumed])  # ... and epoch 1 follows
    assert torch.equal(nxt, torch.cat([y for _, y in ld]))


@pytest.mark.parametrize(("world_a", "world_b"), [(2, 4), (4, 1), (1, 2)])
def test_resume_on_other_world_size(world_a: int, world_b: int) -> None:
    ds = index_dataset(96, augment=True)  # 6 global batches of 16
    before = rank_loaders(ds, 16, world_a, shuffle=True)
    for ld in before:
        run(ld, 8)  # one epoch + 2 batches
    states = [ld.state_dict() for ld in before]
    assert all(s == states[0] for s in states)  # the position is rank-independent
    assert states[0]["sample_index"] == 32 and states[0]["epoch"] == 1
    after = rank_loaders(ds, 16, world_b, shuffle=True)
    for ld in after:
        ld.load_state_dict(states[0])
    got = global_batches(after)
    uninterrupted = rank_loaders(ds, 16, 1, shuffle=True)[0]
    reference = run(uninterrupted, 12)[8:]
    assert len(got) == len(reference) == 4
    for (x, y), (rx, ry) in zip(got, reference, strict=True):
        assert torch.equal(y, ry) and torch.equal(x, rx)


def test_resume_errors() -> None:
    ds = index_dataset(96)
    saved = rank_loaders(ds, 16, 2, shuffle=True)[0]
    run(saved, 1)
    state = saved.state_dict()  # global sample 16
    wrong_batch = ShardedLoader(ds, batch_size=12, rank=0, world_size=2, seed=7, shuffle=True)
    with pytest.raises(ValueError, match="not a multiple of this loader's global batch 24"):
        wrong_batch.load_state_dict(state)
    smaller = ShardedLoader(
        index_dataset(80), batch_size=8, rank=0, world_size=2, seed=7, shuffle=True
    )
    with pytest.raises(ValueError, match="saved for a data set of 96 samples"):
        smaller.load_state_dict(state)
    with pytest.raises(ValueError, match="lacks"):
        smaller.load_state_dict({"epoch": 0})
    # a global batch of 8 divides sample 16: resumes at the same sample (batch 2)
    finer = ShardedLoader(ds, batch_size=4, rank=0, world_size=2, seed=0, shuffle=True)
    finer.load_state_dict(state)
    assert (finer.epoch, finer.batch_index, finer.seed) == (0, 2, 7)


def test_loader_bad_arguments() -> None:
    ds = index_dataset(20)
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        ShardedLoader(ds, batch_size=4, rank=0, world_size=0, seed=0, shuffle=True)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\)"):
        ShardedLoader(ds, batch_size=4, rank=2, world_size=2, seed=0, shuffle=True)
    with pytest.raises(ValueError, match=r"batch_size .* must be >= 1"):
        ShardedLoader(ds, batch_size=0, rank=0, world_size=1, seed=0, shuffle=True)
    with pytest.raises(ValueError, match=r"global batch size 24 .* larger than the data set \(20"):
        ShardedLoader(ds, batch_size=6, rank=0, world_size=4, seed=0, shuffle=True)
    with pytest.raises(ValueError, match="larger than the data set"):
        ShardedLoader(
            ds, batch_size=21, rank=0, world_size=1, seed=0, shuffle=True, drop_last=False
        )
    # an evaluation loader may have one short global batch
    ev = ShardedLoader(
        ds, batch_size=8, rank=0, world_size=4, seed=0, shuffle=False, drop_last=False
    )
    assert len(ev) == 1 and next(iter(ev))[1].tolist() == [0, 1, 2, 3, 4]


def test_plain_torch_dataset() -> None:
    base = torch.utils.data.TensorDataset(torch.randn(12, 3), torch.arange(12))
    ld = ShardedLoader(base, batch_size=3, rank=1, world_size=2, seed=0, shuffle=False)
    (x, y), *_ = list(ld)
    assert x.shape == (3, 3) and y.tolist() == [3, 4, 5]
