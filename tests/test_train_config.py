"""Training driver: configuration validation, files, flags, LR schedule (serial, fast)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest

from kfac_hpc.train.cli import add_arguments, config_from_args
from kfac_hpc.train.config import ConfigError, TrainConfig, load_config_file
from kfac_hpc.train.optim import lr_at, lr_schedule


def problems(**changes: object) -> str:
    """The validation message of a config with ``changes`` ("" if valid)."""
    try:
        TrainConfig.from_dict(changes).validate(cuda_available=False)
    except ConfigError as exc:
        return str(exc)
    return ""


# ------------------------------------------------------------------- validation


def test_defaults_are_valid_and_resolved() -> None:
    cfg = TrainConfig()
    cfg.validate(cuda_available=False)
    r = cfg.resolved()
    assert (r.dataset, r.model, r.optimizer, r.preconditioner) == ("digits", "mlp", "sgd", "kfac")
    assert (r.kfac_strategy, r.momentum, r.lr, r.damping) == ("comm-opt", 0.9, 0.1, 0.1)
    assert TrainConfig(optimizer="adam").resolved().lr == 1e-3
    assert TrainConfig(model="resnet20").resolved().damping == 0.003


@pytest.mark.parametrize(("model", "steps"), [("mlp", (1, 10)), ("resnet20", (1, 10)),
                                              ("resnet50", (10, 100))])
def test_the_update_schedule_defaults_by_model(model: str, steps: tuple[int, int]) -> None:
    """Unset, the schedule is the model's (ResNet-50: KAISA's ImageNet (10, 100)); given,
    it is kept; the preconditioner gets the resolved one."""
    r = TrainConfig(model=model).resolved()
    assert (r.factor_update_steps, r.inv_update_steps) == steps
    assert TrainConfig(model=model).base_update_steps == steps
    given = TrainConfig(model=model, factor_update_steps=2, inv_update_steps=7)
    assert given.resolved().base_update_steps == (2, 7)
    given = TrainConfig(model=model, inv_update_steps=7).resolved()
    assert (given.factor_update_steps, given.inv_update_steps) == (steps[0], 7)


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"model": "nope"}, "--model: unknown value 'nope'"),
        ({"optimizer": "lbfgs"}, "--optimizer: unknown value 'lbfgs'"),
        ({"dataset": "mnist"}, "--dataset: unknown value 'mnist'"),
        ({"dataset": "cifar10"}, "needs --data-path DIR"),
        ({"data_path": "/x"}, "takes no path"),
        ({"epochs": 0}, "--epochs: must be >= 1"),
        ({"batch_size": 30, "accumulation_steps": 4}, "must divide --batch-size 30"),
        ({"optimizer": "shampoo"}, "K-FAC on top of Shampoo is not supported"),
        ({"grad_worker_fraction": 0.5}, "only applies to --kfac-strategy hybrid-opt"),
        ({"kfac_strategy": "dp-kfac", "kfac_overlap": True}, "sends no factors"),
        ({"kfac_overlap": True, "kfac_factor_sync": "inverse"}, "pick one"),
        ({"nesterov": True, "optimizer": "adam"}, "only applies to --optimizer sgd"),
        ({"lr_schedule": "step"}, "needs --lr-milestones"),
        ({"lr_milestones": [5]}, "only apply to --lr-schedule step"),
        ({"target_accuracy": 95}, "fraction in (0, 1]"),
        ({"amp": True}, "--amp: mixed precision needs a CUDA device"),
        ({"device": "cuda"}, "no CUDA device"),
        ({"kfac_cuda_graphs": True}, "--kfac-cuda-graphs: CUDA graphs need a CUDA device"),
        ({"checkpoint_every_steps": 10}, "needs --checkpoint-dir"),
        ({"kl_clip": 0.0}, "--kl-clip: must be > 0"),
        ({"kfac_approx": "exact"}, "--kfac-approx: unknown value 'exact'"),
    ],
)
def test_invalid_options_are_named(changes: dict, expected: str) -> None:
    message = problems(**changes)
    assert expected in message, message
    assert message.startswith("invalid configuration:")


def test_every_problem_is_reported_at_once() -> None:
    message = problems(model="nope", epochs=0, lr=-1.0)
    assert "--model" in message and "--epochs" in message and "--lr" in message


def test_ddp_combines_with_every_strategy() -> None:
    # Decision: DDP only averages gradients; every K-FAC strategy (dp-kfac included)
    # runs after it, so no combination is rejected.
    for strategy in ("comm-opt", "mem-opt", "hybrid-opt", "dp-kfac"):
        assert problems(ddp=True, kfac_strategy=strategy) == ""


def test_type_errors_and_unknown_keys() -> None:
    with pytest.raises(ConfigError, match="--epochs: expected an integer, got 'x'"):
        TrainConfig.from_dict({"epochs": "x"})
    with pytest.raises(ConfigError, match="unknown option 'lerning_rate'"):
        TrainConfig.from_dict({"lerning_rate": 0.1})
    with pytest.raises(ConfigError, match="did you mean 'damping'"):
        TrainConfig.from_dict({"dampin": 0.1})


def test_coercion_of_strings_lists_none_and_key_values() -> None:
    cfg = TrainConfig.from_dict({
        "betas": "0.8,0.99", "kl_clip": "none", "augment": "true",
        "model_options": ["hidden=[32,16]"], "lr_milestones": [3, 6],
    })
    assert cfg.betas == (0.8, 0.99) and cfg.kl_clip is None and cfg.augment is True
    assert cfg.model_options == {"hidden": [32, 16]}
    assert cfg.lr_milestones == (3.0, 6.0)


# ------------------------------------------------------------- files and flags


def test_toml_file_with_groups_and_flag_override(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(
        'model = "resnet20"\nepochs = 7\n'
        '[kfac]\nkfac-strategy = "mem-opt"\ndamping = 0.01\n'
    )
    assert load_config_file(path)["kfac_strategy"] == "mem-opt"
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--config", str(path), "--epochs", "3", "--no-progress"])
    cfg = config_from_args(args)
    assert (cfg.model, cfg.epochs, cfg.kfac_strategy, cfg.damping) == ("resnet20", 3, "mem-opt",
                                                                       0.01)
    assert cfg.progress is False and cfg.batch_size == TrainConfig().batch_size


def test_bad_config_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_config_file(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("epochs = [\n")
    with pytest.raises(ConfigError, match="cannot parse"):
        load_config_file(bad)
    other = tmp_path / "run.ini"
    other.write_text("x")
    with pytest.raises(ConfigError, match="unknown format"):
        load_config_file(other)


def test_every_field_has_a_flag() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = {a.dest for a in parser._actions}
    missing = [f for f in TrainConfig.__dataclass_fields__ if f not in flags]
    assert not missing


# ------------------------------------------------------------------ LR schedule


def test_lr_warmup_then_cosine() -> None:
    kw = {"base_lr": 0.1, "total_steps": 110, "warmup_steps": 10, "schedule": "cosine"}
    assert lr_at(0, **kw) == pytest.approx(0.01)
    assert lr_at(4, **kw) == pytest.approx(0.05)
    assert lr_at(9, **kw) == pytest.approx(0.1)
    assert lr_at(10, **kw) == pytest.approx(0.1)  # cosine starts at its peak
    assert lr_at(60, **kw) == pytest.approx(0.05)  # half-way: (1 + cos(pi/2)) / 2
    assert lr_at(35, **kw) == pytest.approx(0.05 * (1 + math.cos(math.pi / 4)))
    assert lr_at(110, **kw) == pytest.approx(0.0, abs=1e-12)
    assert lr_at(500, **kw) == pytest.approx(0.0, abs=1e-12)  # clipped past the end
    assert lr_at(110, **{**kw, "min_lr": 0.001}) == pytest.approx(0.001)


def test_lr_step_and_constant_do_not_compound() -> None:
    kw = {"base_lr": 1.0, "total_steps": 100, "schedule": "step", "milestones": (30, 60),
          "gamma": 0.1}
    values = [lr_at(s, **kw) for s in (0, 29, 30, 59, 60, 99)]
    assert values == pytest.approx([1.0, 1.0, 0.1, 0.1, 0.01, 0.01])
    # a pure function: asking again (or out of order) gives the same values
    assert [lr_at(s, **kw) for s in (99, 0, 30)] == pytest.approx([0.01, 1.0, 0.1])
    assert lr_at(50, base_lr=0.3, total_steps=100, schedule="constant") == 0.3
    with pytest.raises(ValueError, match="unknown lr schedule"):
        lr_at(0, base_lr=1.0, total_steps=1, schedule="poly")


def test_lr_schedule_from_config_uses_epochs() -> None:
    cfg = TrainConfig(lr=0.2, warmup_epochs=0.5, lr_schedule="step", lr_milestones=(2.0,),
                      lr_gamma=0.5)
    fn = lr_schedule(cfg, steps_per_epoch=10, total_steps=40)
    assert fn(0) == pytest.approx(0.04)  # warm-up over 5 steps
    assert fn(5) == pytest.approx(0.2)
    assert fn(19) == pytest.approx(0.2) and fn(20) == pytest.approx(0.1)


def test_cuda_graphs_flag_has_three_states() -> None:
    """``--kfac-cuda-graphs`` / ``--no-kfac-cuda-graphs`` ask for on or off; neither leaves
    the library's device rule (None), which a CPU run passes without error."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for flags, expected in (([], None), (["--kfac-cuda-graphs"], True),
                            (["--no-kfac-cuda-graphs"], False)):
        assert config_from_args(parser.parse_args(flags)).kfac_cuda_graphs is expected, flags
    for word, expected in (("false", False), ("off", False), ("on", True), ("none", None)):
        assert TrainConfig.from_dict({"kfac_cuda_graphs": word}).kfac_cuda_graphs is expected
    assert problems(kfac_cuda_graphs=None) == "" and problems(kfac_cuda_graphs=False) == ""


def test_checkpoint_background_flag() -> None:
    assert TrainConfig().checkpoint_background is True
    assert TrainConfig.from_dict({"checkpoint_background": False}).checkpoint_background is False
