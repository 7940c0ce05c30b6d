"""Nodes for the tests: ``launch/netns-nodes`` driven from pytest.

Every run makes its own set of namespaces (named ``t<pid><n>``), and the set is gone
when the run returns (the launcher's trap; :func:`assert_no_leftovers` checks it).
Each run is recorded (nodes x ranks per node, case, outcome, seconds) for the table in
the terminal summary and in docs/multinode.md.
"""

from __future__ import annotations

import functools
import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = ROOT / "launch" / "netns-nodes"
FAKE_SLURM = ROOT / "tests" / "fake_slurm"
_names = itertools.count(1)


@dataclass(frozen=True)
class Record:
    """One run on nodes, for the summary table."""

    shape: str  # "2x2": nodes x ranks per node
    case: str
    outcome: str
    seconds: float


RECORDS: list[Record] = []


@functools.cache
def why_not() -> str | None:
    """Why nodes cannot be made here (not root, no ``ip``, ...), or None when they can
    (and on the nodes themselves: ``KFAC_NETNS_NODES`` is set there)."""
    if os.environ.get("KFAC_NETNS_NODES"):
        return None
    if not LAUNCHER.exists():
        return f"{LAUNCHER} is missing"
    done = subprocess.run([str(LAUNCHER), "--why-not"], capture_output=True, text=True,
                          env=environment())
    return None if done.returncode == 0 else (done.stdout.strip() or done.stderr.strip())


def environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without the variables of an enclosing MPI or SLURM job,
    with this Python's ``bin`` first on PATH and the checkout first on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PRTE_", "SLURM_", "MPIEXEC_"))}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


@dataclass
class Run:
    """A running set of nodes and its command (``launch/netns-nodes`` in the background)."""

    name: str
    nodes: int
    per_node: int
    case: str
    proc: subprocess.Popen[str]
    started: float

    def link(self, node: int, state: str) -> None:
        _control("--link", self.name, str(node), state)

    def kill(self, node: int) -> None:
        _control("--kill", self.name, str(node))

    def qdisc(self, node: int, *args: str) -> None:
        _control("--qdisc", self.name, str(node), *args)

    def finish(self, timeout: float, fault_at: float | None = None) -> tuple[int, str, float]:
        """Wait for the end (at most ``timeout`` s, then SIGTERM to the launcher, which
        tears the set down): exit status, output, seconds since the start. ``fault_at``
        (a ``time.monotonic()``): the record says how long after it the run ended."""
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGTERM)
            out, _ = self.proc.communicate(timeout=60)
            out += f"\n[test: no end within {timeout} s; launcher terminated]"
        seconds = time.monotonic() - self.started
        rc = self.proc.returncode
        outcome = f"exit {rc}"
        if fault_at is not None:
            outcome += f", ended {time.monotonic() - fault_at:.1f} s after the fault"
        RECORDS.append(Record(f"{self.nodes}x{self.per_node}", self.case, outcome, seconds))
        assert_no_leftovers(self.name)
        return rc, out, seconds


def _control(*args: str) -> None:
    done = subprocess.run([str(LAUNCHER), *args], capture_output=True, text=True,
                          env=environment())
    assert done.returncode == 0, done.stdout + done.stderr


def start(nodes: int, per_node: int, command: Sequence[str], *, case: str, timeout: int,
          shell: bool = False, qdisc: str | None = None,
          env: dict[str, str] | None = None, cwd: Path = ROOT) -> Run:
    """``launch/netns-nodes -N nodes -n per_node [--shell] [--qdisc ..] --timeout ..
    COMMAND`` in the background, stdout and stderr together."""
    name = f"t{os.getpid()}{next(_names)}"
    args = [str(LAUNCHER), "-N", str(nodes), "-n", str(per_node), "--name", name,
            "--timeout", str(timeout)]
    if shell:
        args.append("--shell")
    if qdisc:
        args += ["--qdisc", qdisc]
    proc = subprocess.Popen([*args, *command], cwd=cwd, env=environment(env), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return Run(name, nodes, per_node, case, proc, time.monotonic())


#: The job script the multi-node job tests run (Shampoo: its requeue path is the shortest).
JOB_SCRIPT = "jobs/cifar10_resnet32_shampoo.sbatch"


def start_job_script(tmp_path: Path, extra: str, case: str) -> Run:
    """:data:`JOB_SCRIPT` under the fake SLURM on 2 nodes x 1 rank (2 tasks), up to 2
    restarts, with ``extra`` as its ``kfac-hpc train`` arguments; the fake SLURM's files
    in ``tmp_path/slurm``, the runs in ``tmp_path/runs``."""
    env = {"PATH": f"{FAKE_SLURM}{os.pathsep}{environment()['PATH']}",
           "FAKE_SLURM_DIR": str(tmp_path / "slurm"), "FAKE_SLURM_NODES": "2",
           "FAKE_SLURM_NTASKS": "2", "FAKE_SLURM_TIMEOUT": "200",
           "KFAC_RUNS": str(tmp_path / "runs"), "KFAC_EXTRA_ARGS": extra,
           "KFAC_MAX_RESTARTS": "2"}
    return start(2, 1, ["sbatch", JOB_SCRIPT], shell=True, env=env, case=case, timeout=240)


def run(nodes: int, per_node: int, command: Sequence[str], *, case: str, timeout: int,
        **kwargs: object) -> tuple[int, str, float]:
    """:func:`start` and wait (``timeout`` + 30 s at most)."""
    return start(nodes, per_node, command, case=case, timeout=timeout,
                 **kwargs).finish(timeout + 30)  # type: ignore[arg-type]


def assert_no_leftovers(name: str) -> None:
    """No namespace, /etc/netns entry or state folder of set ``name`` remains."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    left = [line.split()[0] for line in listed.splitlines()
            if line.split() and line.split()[0].startswith(f"{name}-")]
    left += [str(p) for p in Path("/etc/netns").glob(f"{name}-*")]
    left += [str(p) for p in Path("/run/kfac-netns").glob(name)]
    assert not left, f"set {name} left behind: {left}"


def wait_for_lines(path: Path, n: int, run: Run, timeout: float = 120) -> None:
    """Until ``path`` has more than ``n`` lines (e.g. a header and ``n`` steps)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path.exists() and len(path.read_text().splitlines()) > n:
            return
        if run.proc.poll() is not None:
            raise AssertionError(f"the run ended first:\n{run.proc.communicate()[0]}")
        time.sleep(0.2)
    raise AssertionError(f"{path} did not reach {n} lines in {timeout} s")


def wait_until(condition: Callable[[], bool], run: Run, timeout: float = 120) -> None:
    """Until ``condition()`` holds, while the run goes on."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return
        if run.proc.poll() is not None:
            raise AssertionError(f"the run ended first:\n{run.proc.communicate()[0]}")
        time.sleep(0.2)
    raise AssertionError(f"not reached in {timeout} s")
