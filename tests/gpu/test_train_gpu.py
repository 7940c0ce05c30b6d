"""The GPU path end to end: device selection from the local rank, and ``kfac-hpc train
--device cuda --amp`` on two ranks whose final parameters agree (on the ``synthetic``
data set: no scikit-learn needed on the GPU machine, see docs/gpu.md).

``KFAC_HPC_TEST_DEVICE`` (default ``cuda``) is the device under test; without CUDA the
root conftest skips these tests. ``KFAC_HPC_TEST_DEVICE=cpu`` runs what the CPU allows
(selection of the CPU; training with ``--device cpu`` and without ``--amp``), which
checks the test code itself::

    pytest tests/gpu                                 # on a GPU node
    KFAC_HPC_TEST_DEVICE=cpu pytest tests/gpu        # anywhere
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

KIND = os.environ.get("KFAC_HPC_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER_PREFIXES = ("OMPI_", "PMIX_", "PRTE_", "PMI_", "SLURM_", "MV2_", "MPI_LOCAL", "PALS_",
                     "FLUX_")


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any launcher's variables (this test may run under one)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_PREFIXES)}
    env["OMPI_MCA_btl_tcp_if_include"] = "lo"
    return {**env, **extra}


def launch_env() -> dict[str, str]:
    """This environment for a job of its own on this node through ``launch/local``:
    without a scheduler's variables, with every MPI setting made here (the machine's
    ``OMPI_MCA_*`` may be what lets Open MPI start at all; launch/local itself drops
    what an MPI runtime set for this process)."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "FLUX_", "PALS_"))}


def selection(local_rank: int, **extra: str) -> str:
    """What a fresh process with launcher-set ``SLURM_LOCALID`` selects."""
    code = textwrap.dedent(f"""
        import sys
        import torch
        import kfac_hpc
        d = kfac_hpc.runtime.select_device({KIND!r})
        name = torch.cuda.get_device_name() if d.type == "cuda" else None
        current = torch.cuda.current_device() if d.type == "cuda" else None
        print(d, current, "mpi4py" in sys.modules, name, sep="|")
        """)
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env=clean_env(SLURM_LOCALID=str(local_rank), **extra), timeout=120,
                       check=False)
    assert p.returncode == 0, p.stderr
    return p.stdout.strip()


def test_select_device_sets_the_current_device_from_the_local_rank() -> None:
    if KIND != "cuda":
        assert selection(3) == "cpu|None|False|None"
        return
    count = torch.cuda.device_count()
    for local_rank in range(3):
        index = local_rank % count
        expected = f"cuda:{index}|{index}|False|{torch.cuda.get_device_name(index)}"
        assert selection(local_rank) == expected
    # Narrowed per task (srun --gpus-per-task=1): the one visible GPU is cuda:0.
    last = count - 1
    narrowed = selection(3, CUDA_VISIBLE_DEVICES=str(last))
    assert narrowed == f"cuda:0|0|False|{torch.cuda.get_device_name(last)}"


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec")
@pytest.mark.parametrize("optimizer", [[], ["--optimizer", "shampoo", "--preconditioner", "none"]],
                         ids=["kfac", "shampoo"])
def test_train_on_two_ranks_agrees(tmp_path: Path, optimizer: list[str]) -> None:
    device = ["--device", "cuda", "--amp"] if KIND == "cuda" else ["--device", "cpu"]
    # the driver's ranks with the graphs on or off as the suite's (tests/gpu/conftest.py)
    graphs = KIND == "cuda" and os.environ.get("KFAC_HPC_TEST_CUDA_GRAPHS", "1") != "0"
    if KIND == "cuda":
        # (Shampoo's graph covers the steps that compute no root: roots every 4 steps)
        shampoo = ["--shampoo-options", f"cuda_graphs={str(graphs).lower()},"
                   "precondition_frequency=4"]
        kfac = ["--kfac-cuda-graphs" if graphs else "--no-kfac-cuda-graphs"]
        optimizer = [*optimizer, *(shampoo if optimizer else kfac)]
    out = tmp_path / "run"
    cmd = [str(ROOT / "launch" / "local"), "-n", "2", "--timeout", "400", sys.executable, "-m",
           "kfac_hpc", "train", *device, *optimizer, "--dataset", "synthetic", "--epochs", "1",
           "--max-steps", "12", "--no-progress", "--out", str(out)]
    p = subprocess.run(cmd, cwd=tmp_path, env=launch_env(), capture_output=True, text=True,
                       timeout=500, check=False)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert "RANKS DIFFER" not in p.stdout and "differ between ranks" not in p.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ranks_agree"] is True  # every rank's parameter checksum is equal
    assert summary["world_size"] == 2 and summary["steps"] == 12
    assert summary["device"].startswith(KIND)
    if graphs:
        assert summary["step_graph"]["replays"] > 0 and not summary["step_graph"]["disabled"]
    elif KIND == "cuda":
        assert summary["step_graph"] is None
    assert len(summary["checksum"]) == 64 and math.isfinite(summary["train_loss"])
    config = json.loads((out / "config.json").read_text())["config"]
    assert config["amp"] is (KIND == "cuda") and config["device"] == KIND
