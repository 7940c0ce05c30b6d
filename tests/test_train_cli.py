"""``kfac-hpc train`` / ``kfac-hpc plot`` as users run them (subprocesses), metrics files."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from fresh_env import fresh_env

from kfac_hpc.cli import main
from kfac_hpc.train.metrics import MetricsWriter, WeightedMean, read_jsonl

ROOT = Path(__file__).resolve().parent.parent
KFAC_HPC = [sys.executable, "-m", "kfac_hpc"]



def clean_env() -> dict[str, str]:
    """The environment of a new job (:func:`fresh_env`), TCP on the loopback only."""
    return fresh_env(OMPI_MCA_btl_tcp_if_include="lo")


def run(cmd: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, env=clean_env(), capture_output=True, text=True,
                          timeout=timeout, check=False)


# --------------------------------------------------------------------- bad input


def test_unknown_model_exits_2_with_one_message(tmp_path: Path) -> None:
    p = run([*KFAC_HPC, "train", "--model", "nope", "--epochs", "0"], tmp_path)
    assert p.returncode == 2, p.stderr
    assert p.stderr.count("error:") == 1, p.stderr
    assert "--model: unknown value 'nope'" in p.stderr and "--epochs" in p.stderr
    assert "Traceback" not in p.stderr and p.stdout == ""
    assert not (tmp_path / "runs").exists()  # nothing started


def test_module_entry_point_reports_bad_values(tmp_path: Path) -> None:
    p = run([sys.executable, "-m", "kfac_hpc.train", "--epochs", "x"], tmp_path)
    assert p.returncode == 2
    assert "--epochs: expected an integer, got 'x'" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize("option, message", [
    ("hidden=64.7", "--model-options hidden=64.7: expected int or a list of int"),
    ("hidden=abc", '--model-options hidden="abc": expected int or a list of int'),
])
def test_bad_model_option_value_exits_2_naming_it(tmp_path: Path, option: str,
                                                  message: str) -> None:
    p = run([*KFAC_HPC, "train", "--model-options", option, "--epochs", "1", "--no-progress",
             "--out", str(tmp_path / "run")], tmp_path)
    assert p.returncode == 2, p.stdout + p.stderr
    assert message in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.count(message) == 1, p.stderr


#: A shell prelude per file-system fault: a private mount namespace (``unshare -rm``)
#: with a tmpfs at "$0", then the command. As root a chmod 0o500 directory is still
#: writable, so read-only and full file systems are real mounts here.
MOUNTS = {
    "read-only": 'mount -t tmpfs tmpfs "$0" && mkdir "$0/d" && mount -o remount,ro "$0"',
    "full": 'mount -t tmpfs -o size=64k tmpfs "$0" && mkdir "$0/d" && '
            '{ cat /dev/zero > "$0/fill" 2>/dev/null; true; }',
}


def _mount_prefix(mountpoint: Path, fault: str) -> list[str]:
    """A command prefix running the rest with ``fault``'s tmpfs at ``mountpoint``;
    skips where a user namespace cannot mount one."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) to mount a file system")
    prefix = ["unshare", "-rm", "sh", "-c", MOUNTS[fault] + ' && exec "$@"', str(mountpoint)]
    probe = subprocess.run([*prefix, "true"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a user namespace here: {probe.stderr.strip()}")
    return prefix


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec")
@pytest.mark.parametrize("flag", ["--out", "--checkpoint-dir"])
@pytest.mark.parametrize("fault", ["read-only", "full", "a file", "chmod 0o500"])
def test_unwritable_output_directory_is_one_usage_error_at_setup(
        tmp_path: Path, flag: str, fault: str) -> None:
    """At 2 ranks, an ``--out`` or ``--checkpoint-dir`` that cannot be written (read-only,
    a full file system, a file where a directory is expected, no permission) is found at
    setup, before any training: one message, status 2 on every rank, no traceback, no
    MPI_ABORT (before: a traceback and MPI_ABORT for ``--out``, and for
    ``--checkpoint-dir`` a failure only after the first epoch)."""
    prefix: list[str] = []
    mountpoint = tmp_path / "fs"
    mountpoint.mkdir()
    if fault in MOUNTS:
        prefix = _mount_prefix(mountpoint, fault)
        target = mountpoint / "d"
    elif fault == "a file":
        target = tmp_path / "file"
        target.write_text("not a directory\n")
    else:
        if os.geteuid() == 0:
            pytest.skip("as root a chmod 0o500 directory stays writable (the mounts and "
                        "'a file' cases cover root)")
        target = tmp_path / "locked"
        target.mkdir(mode=0o500)
    out = tmp_path / "run"
    dirs = ["--out", str(target)] if flag == "--out" else \
        ["--out", str(out), "--checkpoint-dir", str(target)]
    p = run([*prefix, str(ROOT / "launch" / "local"), "-n", "2", "--timeout", "240",
             *KFAC_HPC, "train", "--epochs", "1", "--no-progress", *dirs], tmp_path,
            timeout=300)
    text = p.stdout + p.stderr
    assert p.returncode == 2, text
    reason = {"read-only": "cannot write in the directory: Read-only file system",
              "full": "(the file system is full)", "a file": "exists and is not a directory",
              "chmod 0o500": "cannot write in the directory: Permission denied"}[fault]
    message = f"{flag} {target}: "
    assert text.count(message) == 1 and reason in text, text
    assert "Traceback" not in text and "MPI_ABORT" not in text, text
    assert "epoch 1" not in p.stdout.lower() and not (out / "epochs.csv").exists(), text


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec")
def test_bad_input_on_two_ranks_prints_once(tmp_path: Path) -> None:
    """A missing data path is found during setup (a file-system check): every rank
    fails, they agree, rank 0 alone prints, all exit 2, nobody hangs."""
    missing = tmp_path / "no-cifar-here"
    p = run([str(ROOT / "launch" / "local"), "-n", "2", "--timeout", "240", *KFAC_HPC,
             "train", "--dataset", "cifar10", "--model", "resnet20",
             "--data-path", str(missing)], tmp_path, timeout=300)
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.count("kfac-hpc train: error:") == 1, p.stderr
    assert f"CIFAR-10: {missing} is not a directory" in p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.parametrize("rank", ["0", "1"])
def test_flag_errors_print_on_rank_0_only(rank: str, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Argument errors happen before MPI starts: the rank comes from the launcher's
    environment, and only rank 0 prints (every rank exits 2)."""
    for name in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PMI_RANK", rank)
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--no-such-flag"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("unrecognized arguments: --no-such-flag") == (rank == "0"), err


# ------------------------------------------------------------- metrics and plot


def test_weighted_mean_uses_sample_counts() -> None:
    m = WeightedMean()
    m.add(1.0, 3, 4)  # 4 samples, mean loss 1, 3 correct
    m.add(4.0, 0, 1)
    assert m.loss == pytest.approx(8.0 / 5) and m.acc == pytest.approx(3 / 5)
    assert m.reduced(None).count == 5


def write_run(path: Path, label: str, offset: float) -> None:
    with MetricsWriter(path) as w:
        w.write_json("config.json", {"run": {"label": label}})
        for s in range(1, 11):
            w.step({"step": s, "epoch": s / 5, "lr": 0.1, "loss": 2.0 / s + offset,
                    "acc": 0.5, "samples": 8, "step_time": 0.01, "samples_per_s": 800.0,
                    "wall_time": s * 0.01})
            if s % 5 == 0:
                w.epoch({"epoch": s // 5, "step": s, "train_loss": 1.0, "train_acc": 0.8,
                         "test_loss": 1.1 + offset, "test_acc": 0.7 + offset,
                         "wall_time": s * 0.01, "extra_ignored_by_csv": 1})


def test_metrics_files(tmp_path: Path) -> None:
    write_run(tmp_path, "sgd", 0.0)
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["kind"] for r in records].count("step") == 10
    assert [r["kind"] for r in records].count("epoch") == 2
    with open(tmp_path / "epochs.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 and float(rows[1]["test_acc"]) == pytest.approx(0.7)
    assert "extra_ignored_by_csv" not in rows[0]
    with open(tmp_path / "steps.csv", newline="") as f:
        assert len(list(csv.DictReader(f))) == 10
    assert json.loads((tmp_path / "config.json").read_text())["run"]["label"] == "sgd"
    disabled = MetricsWriter(tmp_path / "other", enabled=False)  # ranks other than 0
    disabled.step({"step": 1})
    assert not (tmp_path / "other").exists()


def test_summary_json_is_strict_json(tmp_path: Path) -> None:
    """A run stopped before its first evaluation has NaN metrics: they are written as
    null (strict JSON parsers, e.g. jq, reject NaN), and no temporary file is left."""
    with MetricsWriter(tmp_path) as w:
        w.write_json("summary.json", {"test_acc": float("nan"), "loss": float("inf"),
                                      "history": [{"acc": float("nan")}, (1.0, 2)]})
    text = (tmp_path / "summary.json").read_text()
    data = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON: {c}"))
    assert data == {"test_acc": None, "loss": None, "history": [{"acc": None}, [1.0, 2]]}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_plot_writes_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_run(tmp_path / "a", "sgd", 0.0)
    write_run(tmp_path / "b", "kfac", 0.1)
    out = tmp_path / "fig" / "curves.png"
    # kfac_hpc.cli.main is the `kfac-hpc` console script (in-process: saves a start-up)
    rc = main(["plot", str(tmp_path / "a"), str(tmp_path / "b" / "metrics.jsonl"),
               "--out", str(out), "--x", "step"])
    assert rc == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert main(["plot", str(tmp_path / "missing"), "--out", str(out)]) == 2
    assert "no such metrics file" in capsys.readouterr().err



def test_plot_without_matplotlib_says_how_to_get_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Exit 2 and one line naming the package (a traceback before)."""
    write_run(tmp_path / "a", "sgd", 0.0)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["plot", str(tmp_path / "a"), "--out", str(tmp_path / "c.png")]) == 2
    err = capsys.readouterr().err
    assert "plotting needs matplotlib: pip install matplotlib" in err and "Traceback" not in err

