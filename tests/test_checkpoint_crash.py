"""Crash safety: SIGKILL a writer at random moments of a save, many times.

A helper process (no MPI initialised, so that forking is safe) imports everything
once, writes a first checkpoint and measures how long a save takes; then, per
trial, it forks a child that saves checkpoints back to back (``keep_last=2``, so
pruning and pointer updates are hit too) and kills it. Trials rotate through three
ways of choosing the moment, so that every phase of a save is hit however fast or
loaded the machine is: as soon as the child's ``.tmp`` file appears (mid-write), a
random delay after fork in [0, 3 x save time], and a random delay after the child's
first save of the trial has committed. After every kill, the checkpoint ``latest``
names must verify, load into a fresh model with the values saved, and every
``ckpt_*.h5`` in the directory must verify.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from fresh_env import fresh_env

ROOT = Path(__file__).resolve().parents[1]
TRIALS = 30
SEED = 20261122  # the kill delays: fixed so that a failing sequence can be replayed

SCRIPT = r'''
import json, os, random, signal, sys, time
import mpi4py
mpi4py.rc.initialize = False  # this process forks: keep MPI out of it
import torch
from torch import nn
torch.set_num_threads(1)
from kfac_hpc import checkpoint

class LocalComm:
    """A one-process stand-in for the Communicator (no MPI)."""
    rank, size = 0, 1
    def allgather_object(self, obj): return [obj]
    def broadcast_object(self, obj, root=0): return obj
    def barrier(self): pass

d, trials = sys.argv[1], int(sys.argv[2])
delays = random.Random(int(sys.argv[3]))  # own stream: load() restores `random`
comm = LocalComm()

def build(seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512), nn.Linear(512, 64))
    return model, torch.optim.Adam(model.parameters())

def stamp(model, step):
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(step))

model, opt = build(0)
opt.zero_grad(); model(torch.randn(2, 512)).sum().backward(); opt.step()
stamp(model, 1)
checkpoint.save(d, model=model, optimizer=opt, step=1, comm=comm, keep_last=2)
t0 = time.perf_counter()
stamp(model, 2)
checkpoint.save(d, model=model, optimizer=opt, step=2, comm=comm, keep_last=2)
duration = time.perf_counter() - t0

results = []
for trial in range(trials):
    first = 3 + 1000 * trial  # this trial's saves: steps first, first + 1, ...
    mode = ("mid-write", "after-fork", "after-commit")[trial % 3]
    if mode == "mid-write":  # leftovers of earlier kills would end the wait at once
        for f in os.listdir(d):
            if f.endswith(".tmp"):
                os.remove(os.path.join(d, f))
    pid = os.fork()
    if pid == 0:
        try:
            s = first
            while True:
                stamp(model, s)
                checkpoint.save(d, model=model, optimizer=opt, step=s, comm=comm, keep_last=2)
                s += 1
        finally:
            os._exit(0)
    start = time.perf_counter()
    deadline = start + 60
    if mode == "mid-write":  # kill the moment a partial file exists
        while not any(f.endswith(".h5.tmp") for f in os.listdir(d)):
            if time.perf_counter() > deadline:
                raise SystemExit("the child never started writing")
    elif mode == "after-commit":  # kill once this trial's first save is in
        while not ((latest := checkpoint.latest(d)) and int(latest.name[5:13]) >= first):
            if time.perf_counter() > deadline:
                raise SystemExit("the child never committed a checkpoint")
            time.sleep(duration / 50)
        time.sleep(delays.uniform(0, 1.5 * duration))
    else:
        time.sleep(delays.uniform(0, 3 * duration))
    delay = time.perf_counter() - start
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    problems = []
    latest = checkpoint.latest(d)
    if latest is None:
        problems.append("no latest checkpoint")
    else:
        report = checkpoint.verify_file(latest)
        problems += report.problems
        fresh, fresh_opt = build(1)
        try:
            info = checkpoint.load(d, model=fresh, optimizer=fresh_opt, comm=comm)
            if not all(bool((p == info.step).all()) for p in fresh.parameters()):
                problems.append(f"{latest}: parameters are not those of step {info.step}")
        except Exception as exc:
            problems.append(f"load: {exc}")
    for path in checkpoint.list_checkpoints(d):
        r = checkpoint.verify_file(path)
        problems += r.problems
    results.append({"mode": mode, "delay": round(delay / duration, 3),
                    "latest": latest and latest.name,
                    "committed": bool(latest) and int(latest.name[5:13]) >= first,
                    "files": sorted(os.listdir(d)), "problems": problems})
print(json.dumps({"save_seconds": duration, "results": results}))
'''


@pytest.mark.timeout(600)
def test_kill_minus_nine_during_save_never_loses_the_previous_checkpoint(tmp_path: Path) -> None:
    script = tmp_path / "crash.py"
    script.write_text(SCRIPT)
    directory = tmp_path / "ckpt"
    env = fresh_env()  # not an MPI job, even when pytest runs under mpiexec
    done = subprocess.run([sys.executable, str(script), str(directory), str(TRIALS),
                           str(SEED)], capture_output=True, text=True, timeout=500,
                          env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout.strip().splitlines()[-1])
    results = data["results"]
    assert len(results) == TRIALS
    bad = [r for r in results if r["problems"]]
    assert not bad, f"seed {SEED}: " + json.dumps(bad, indent=1)
    # The kills landed in different phases: mid-write (a partial .tmp file left behind),
    # before the trial's first save committed, and after it.
    assert all(r["committed"] for r in results if r["mode"] == "after-commit")
    assert not all(r["committed"] for r in results)
    assert any(any(f.endswith(".h5.tmp") for f in r["files"]) for r in results)
