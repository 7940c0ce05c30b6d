"""Your own model, loss and data: ``pkg.module:factory`` strings in ``kfac-hpc train``
(flags and TOML), their errors (one message on rank 0, exit 2 on every rank), and
examples/custom_model.py through the driver and through the library API.

MPI: ``launch/local -n 2 python -m mpi4py -m pytest --with-mpi --only-mpi
tests/test_train_plugins.py``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from fresh_env import fresh_env

from kfac_hpc.train.config import ConfigError, TrainConfig
from kfac_hpc.train.plugins import (
    build_plugin_model,
    load_factory,
    load_plugin_dataset,
    resolve_loss,
)

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = "examples.custom_model"


def clean_env(**extra: str) -> dict[str, str]:
    """A new job's environment (:func:`fresh_env`) that imports this checkout's examples."""
    import os

    pythonpath = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    return fresh_env(**{"OMPI_MCA_btl_tcp_if_include": "lo", "PYTHONPATH": pythonpath,
                        **extra})


def run(cmd: list[str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, env=clean_env(), capture_output=True, text=True,
                          timeout=timeout, check=False)


@pytest.fixture
def on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT))


def write_module(tmp_path: Path, name: str, body: str, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop(name, None)


# ------------------------------------------------------------ factory loading


@pytest.mark.parametrize("spec, message", [
    ("no_such_module_xyz:f", "no module named 'no_such_module_xyz'"),
    ("examples.custom_model:nope", "has no attribute 'nope'"),
    ("examples.custom_model:math", "'math' is a module, not callable"),
    ("examples.custom_model:", "expected pkg.module:factory"),
    ("bad-name:f", "expected pkg.module:factory"),
])
def test_bad_factory_strings_say_what_is_wrong(spec: str, message: str, on_path: None) -> None:
    with pytest.raises(ConfigError, match="--model") as info:
        load_factory(spec, "--model")
    assert message in str(info.value)


def test_module_that_fails_to_import_is_a_config_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_module(tmp_path, "broken_plugin_mod", "raise RuntimeError('boom at import')\n",
                 monkeypatch)
    with pytest.raises(ConfigError, match="importing 'broken_plugin_mod' failed: "
                                          "RuntimeError: boom at import"):
        load_factory("broken_plugin_mod:f", "--dataset")


def test_factory_results_are_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_module(tmp_path, "odd_plugin_mod", """
        import torch
        def not_a_model(**kw): return 42
        def raises(**kw): raise ValueError("needs more data")
        def not_splits(*, seed): return [1, 2]
        def empty(*, seed):
            t = torch.utils.data.TensorDataset(torch.zeros(0, 2), torch.zeros(0))
            return t, t, 2
    """, monkeypatch)
    kw: dict[str, Any] = {"num_classes": 2, "in_channels": 1, "image_size": None,
                          "input_dim": 4}
    with pytest.raises(ConfigError, match=r"returned a int, not a torch\.nn\.Module"):
        build_plugin_model("odd_plugin_mod:not_a_model", **kw)
    with pytest.raises(ConfigError, match="the factory raised ValueError: needs more data"):
        build_plugin_model("odd_plugin_mod:raises", **kw)
    ds_kw: dict[str, Any] = {"seed": 0, "path": None, "augment": False, "image_size": None,
                             "split_seed": 0}
    with pytest.raises(ConfigError, match="returned a list"):
        load_plugin_dataset("odd_plugin_mod:not_splits", **ds_kw)
    with pytest.raises(ConfigError, match="the train set is empty"):
        load_plugin_dataset("odd_plugin_mod:empty", **ds_kw)


def test_example_factories_follow_the_contract(on_path: None) -> None:
    splits = load_plugin_dataset(f"{EXAMPLE}:build_dataset", seed=0, path=None,
                                 augment=False, image_size=None, split_seed=0)
    assert splits.num_classes == 4 and splits.input_shape == (16,)
    model = build_plugin_model(f"{EXAMPLE}:build_model", **splits.model_kwargs(), width=8)
    assert isinstance(model, torch.nn.Module) and model.value.out_features == 8  # type: ignore[union-attr]
    loss = resolve_loss(f"{EXAMPLE}:smoothed_cross_entropy")
    assert float(loss(torch.zeros(2, 4), torch.tensor([0, 1]))) == pytest.approx(1.3862944)
    assert resolve_loss("cross_entropy") is torch.nn.functional.cross_entropy


def test_config_accepts_plugins_in_flags_and_toml(tmp_path: Path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text(f'model = "{EXAMPLE}:build_model"\ndataset = "{EXAMPLE}:build_dataset"\n'
                    f'loss = "{EXAMPLE}:smoothed_cross_entropy"\n')
    cfg = TrainConfig.from_sources(toml)
    cfg.validate()
    assert cfg.model == f"{EXAMPLE}:build_model"
    bad = TrainConfig(model="pkg module:f", dataset="x:1y", loss="mse")
    text = "\n".join(bad.problems())
    assert "--model: a plugin is named pkg.module:factory" in text
    assert "--dataset: a plugin is named" in text and "--loss: cross_entropy or" in text
    assert "--model: unknown value 'nope'" in "\n".join(TrainConfig(model="nope").problems())


def test_bad_plugin_exits_2_with_one_message(tmp_path: Path) -> None:
    p = run([sys.executable, "-m", "kfac_hpc", "train", "--model", f"{EXAMPLE}:nope",
             "--dataset", f"{EXAMPLE}:build_dataset", "--epochs", "1",
             "--out", str(tmp_path / "run")], tmp_path)
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.count("kfac-hpc train: error:") == 1, p.stderr
    assert f"--model '{EXAMPLE}:nope': module '{EXAMPLE}' has no attribute 'nope'" in p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec")
def test_bad_plugin_on_two_ranks_prints_once_and_all_exit_2(tmp_path: Path) -> None:
    p = run([str(ROOT / "launch" / "local"), "-n", "2", "--timeout", "200", sys.executable,
             "-m", "kfac_hpc", "train", "--dataset", "no_such_module_xyz:data",
             "--out", str(tmp_path / "run")], tmp_path, timeout=300)
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.count("kfac-hpc train: error:") == 1, p.stderr
    assert "no module named 'no_such_module_xyz'" in p.stderr
    assert "Traceback" not in p.stderr


# ------------------------------------------------------- training through both paths


def test_driver_trains_the_example_model_with_workers(tmp_path: Path) -> None:
    """Through the driver (own model, data, loss; 2 loader workers): the loss falls."""
    p = run([sys.executable, "-m", "kfac_hpc", "train", "--model", f"{EXAMPLE}:build_model",
             "--dataset", f"{EXAMPLE}:build_dataset",
             "--loss", f"{EXAMPLE}:smoothed_cross_entropy", "--epochs", "2",
             "--batch-size", "32", "--loader-workers", "2", "--threads", "1",
             "--out", str(tmp_path / "run")], tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    from kfac_hpc.train.metrics import read_jsonl

    epochs = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "epoch"]
    assert epochs[-1]["train_loss"] < 0.8 * epochs[0]["train_loss"]
    assert epochs[-1]["test_acc"] > 0.8


def test_library_path_of_the_example(tmp_path: Path) -> None:
    """``python examples/custom_model.py``: select_device() first, then MPI, K-FAC,
    the gradient averager and the sharded loader in the user's own loop."""
    p = run([sys.executable, str(ROOT / "examples" / "custom_model.py")], tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    acc = float(p.stdout.split("test accuracy")[1].split("%")[0])
    assert acc > 80


@pytest.mark.mpi(min_size=2)
def test_mpi_plugins_train_and_bad_ones_fail_alike(comm: Any, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from kfac_hpc.train.loop import train

    monkeypatch.syspath_prepend(str(ROOT))
    out = comm.allgather_object(str(tmp_path))[0]  # rank 0's directory
    base: dict[str, Any] = {"model": f"{EXAMPLE}:build_model",
                            "dataset": f"{EXAMPLE}:build_dataset", "epochs": 2,
                            "batch_size": 64 // comm.size, "progress": False, "threads": 1,
                            "loader_workers": 1, "out": str(Path(out) / "run")}
    result = train(TrainConfig(**base), comm, verbose=False)
    assert result.ranks_agree and result.history[-1]["train_loss"] < result.history[0][
        "train_loss"]
    with pytest.raises(ConfigError, match="has no attribute 'missing'"):
        train(TrainConfig(**{**base, "model": f"{EXAMPLE}:missing"}), comm, verbose=False)


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec")
def test_ranks_that_train_different_parameters_fail_alike(tmp_path: Path) -> None:
    """Issue 25's exact case through the driver: a model factory that freezes one layer
    on rank 1 only (shapes equal). Every rank ends with the same clear error naming the
    parameters (before: memory corruption, status 134), no rank hangs."""
    (tmp_path / "freeze_on_one_rank.py").write_text(textwrap.dedent(f"""
        from mpi4py import MPI

        from {EXAMPLE} import build_model as example_model


        def build_model(*, num_classes: int, input_dim: int):
            model = example_model(num_classes=num_classes, input_dim=input_dim)
            if MPI.COMM_WORLD.Get_rank() == 1:
                first = next(model.parameters())
                first.requires_grad_(False)
            return model
    """))
    env = clean_env()
    env["PYTHONPATH"] = str(tmp_path) + ":" + env["PYTHONPATH"]
    p = subprocess.run([str(ROOT / "launch" / "local"), "-n", "2", "--timeout", "200",
                        sys.executable, "-m", "kfac_hpc", "train",
                        "--model", "freeze_on_one_rank:build_model",
                        "--dataset", f"{EXAMPLE}:build_dataset", "--epochs", "1",
                        "--out", str(tmp_path / "run")],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
                       check=False)
    out = p.stdout + p.stderr
    assert p.returncode not in (0, 134, 124, 137), out
    assert "requires_grad=False" in out, out
    assert "munmap_chunk" not in out and "free(): invalid" not in out, out
