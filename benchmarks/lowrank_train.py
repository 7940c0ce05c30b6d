"""Low-rank factors in training: K-FAC iteration time and test accuracy, on vs off.

The small CNN of ``vs_kaisa.py`` / ``curvature_math.py`` (conv 1->16 5x5, pool, conv
16->32 5x5, pool, Linear 1568->128, Linear 128->10) on the digits data upsampled to
28x28. Only its first Linear's A factor (1569 x 1569) reaches ``low_rank_min_dim``
(1024), so ``low_rank=K`` replaces exactly that factor's ``eigh`` by a rank-K randomized
decomposition.

Two measurements::

    # iteration time (factor updates every step, inverses every 10), interleaved:
    # every round runs one 10-step period of each configuration, in rotating order
    launch/local -n 1 python benchmarks/lowrank_train.py time --ranks-label 1
    launch/local -n 2 python benchmarks/lowrank_train.py time --ranks-label 2

    # test accuracy after the same number of steps, `kfac-hpc train` with the flags
    python benchmarks/lowrank_train.py accuracy --epochs 3 --dampings 0.001,0.01,0.1

``time`` reports per configuration the median over rounds of: the whole iteration
(forward, backward, gradient averaging, K-FAC, SGD) averaged over a period, the
K-FAC ``step()`` alone at the inverse step and at the other steps. ``accuracy`` runs
``python -m kfac_hpc train --model benchmarks.lowrank_train:build_model --dataset
benchmarks.lowrank_train:build_dataset ...`` (the model and data plugins below) from
the repository root, once per (damping, low rank, seed), and reads ``summary.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

ROOT = Path(__file__).resolve().parent.parent
DIGITS_TEST_SIZE = 360  # as kfac_hpc.train.data.sources' digits split


# ------------------------------------------------------------- the driver plugins
def build_model(*, num_classes: int = 10) -> nn.Module:
    """Model plugin: the small CNN (its first Linear has a 1569 x 1569 A factor)."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, num_classes))


def build_dataset(*, split_seed: int = 0) -> tuple[TensorDataset, TensorDataset, int]:
    """Data plugin: scikit-learn's digits, normalised, upsampled 8x8 -> 28x28 (bilinear),
    split like the driver's ``digits`` (360 test images, order from ``split_seed``)."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = torch.as_tensor(bunch.images, dtype=torch.float32).unsqueeze(1)
    labels = torch.as_tensor(bunch.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(split_seed))
    test_idx, train_idx = order[:DIGITS_TEST_SIZE], order[DIGITS_TEST_SIZE:]
    mean, std = float(images[train_idx].mean()), float(images[train_idx].std())
    images = F.interpolate((images - mean) / std, size=28, mode="bilinear")
    return (TensorDataset(images[train_idx], labels[train_idx]),
            TensorDataset(images[test_idx], labels[test_idx]), 10)


# ------------------------------------------------------------------ iteration time
def _configs(ranks: list[int | None]) -> dict[str, dict[str, Any]]:
    return {("low rank off" if k is None else f"low_rank={k}"): (
        {} if k is None else {"low_rank": k, "low_rank_min_dim": 1024}) for k in ranks}


def time_iterations(args: argparse.Namespace) -> dict[str, Any]:
    """Interleaved rounds of one inverse period (``--inv-steps`` steps) per config."""
    from common import machine

    from kfac_hpc import GradientAverager, KFACPreconditioner
    from kfac_hpc.comm import Communicator

    comm = Communicator()
    load_before = os.getloadavg()[0]
    torch.set_num_threads(args.threads)
    train, _, _ = build_dataset()
    ranks = [None if r == "off" else int(r) for r in args.low_ranks.split(",")]
    configs = _configs(ranks)
    runs = {}
    for label, extra in configs.items():
        torch.manual_seed(0)
        model = build_model()
        pre = KFACPreconditioner(model, comm=comm, damping=args.damping, lr=0.1,
                                 factor_update_steps=1, inv_update_steps=args.inv_steps,
                                 input_shape=(args.batch, 1, 28, 28), **extra)
        runs[label] = (model, pre, GradientAverager(model, comm),
                       torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    x_all, y_all = train.tensors
    per_period = args.inv_steps
    records: dict[str, dict[str, list[float]]] = {
        label: {"iteration": [], "kfac_inverse": [], "kfac_other": []} for label in configs}
    cursor = {label: 0 for label in configs}

    def period(label: str, keep: bool) -> None:
        model, pre, avg, opt = runs[label]
        total = kfac_inv = 0.0
        others: list[float] = []
        comm.barrier()
        for _ in range(per_period):
            i = cursor[label]
            cursor[label] += 1
            offset = (i * comm.size + comm.rank) * args.batch
            start = offset % (len(y_all) - args.batch)
            x, y = x_all[start:start + args.batch], y_all[start:start + args.batch]
            t0 = time.perf_counter()
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            avg.synchronize()
            inverse = pre.steps % per_period == 0
            t1 = time.perf_counter()
            pre.step()
            t2 = time.perf_counter()
            opt.step()
            total += time.perf_counter() - t0
            if inverse:
                kfac_inv = t2 - t1
            else:
                others.append(t2 - t1)
        # the slowest rank's times: an iteration waits for it
        total, kfac_inv, other = (max(comm.allgather_object(v)) for v in (
            total / per_period, kfac_inv, statistics.mean(others)))
        if keep:
            records[label]["iteration"].append(total)
            records[label]["kfac_inverse"].append(kfac_inv)
            records[label]["kfac_other"].append(other)

    labels = list(configs)
    for label in labels:  # warm-up: one period each
        period(label, keep=False)
    for r in range(args.rounds):
        for label in labels[r % len(labels):] + labels[:r % len(labels)]:
            period(label, keep=True)
    result = {"machine": machine(), "batch_per_rank": args.batch, "inv_update_steps": per_period,
              "rounds": args.rounds, "threads": args.threads,
              "load_before": load_before, "load_after": os.getloadavg()[0],
              "medians_s": {label: {k: statistics.median(v) for k, v in rec.items()}
                            for label, rec in records.items()},
              "decompositions_bytes": {label: runs[label][1].memory_bytes()["decompositions"]
                                       for label in labels}}
    if comm.rank == 0:
        base = result["medians_s"][labels[0]]
        print(f"# {args.ranks_label} rank(s), batch {args.batch}/rank, inverse every "
              f"{per_period}; load (1 min) before {load_before:.2f}, "
              f"after {result['load_after']:.2f}; median of {args.rounds} interleaved rounds")
        print("| ranks | config | iteration ms | vs off | K-FAC step at inverse ms | "
              "K-FAC step other ms | decompositions MiB (rank 0) |")
        print("|---:|---|---:|---:|---:|---:|---:|")
        for label in labels:
            m = result["medians_s"][label]
            print(f"| {args.ranks_label} | {label} | {1e3 * m['iteration']:.1f} | "
                  f"{m['iteration'] / base['iteration']:.2f}x | {1e3 * m['kfac_inverse']:.1f} | "
                  f"{1e3 * m['kfac_other']:.1f} | "
                  f"{result['decompositions_bytes'][label] / 2**20:.2f} |")
    for label in labels:
        runs[label][1].close()
    return result


# ------------------------------------------------------------------------ accuracy
def accuracy(args: argparse.Namespace) -> list[dict[str, Any]]:
    """``kfac-hpc train`` per (damping, low rank, seed): final test accuracy."""
    rows = []
    ranks = [None if r == "off" else int(r) for r in args.low_ranks.split(",")]
    for damping in (float(d) for d in args.dampings.split(",")):
        for k in ranks:
            for seed in range(args.seeds):
                with tempfile.TemporaryDirectory() as out:
                    cmd = [sys.executable, "-m", "kfac_hpc", "train",
                           "--model", "benchmarks.lowrank_train:build_model",
                           "--dataset", "benchmarks.lowrank_train:build_dataset",
                           "--epochs", str(args.epochs), "--batch-size", str(args.batch),
                           "--lr", str(args.lr), "--damping", str(damping),
                           "--inv-update-steps", "10", "--seed", str(seed),
                           "--threads", str(args.threads), "--no-progress", "--out", out]
                    if k is not None:
                        cmd += ["--low-rank", str(k), "--low-rank-min-dim", "1024"]
                    t0 = time.perf_counter()
                    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
                    wall = time.perf_counter() - t0
                    summary = json.loads((Path(out) / "summary.json").read_text())
                rows.append({"damping": damping, "low_rank": k, "seed": seed,
                             "test_acc": summary["test_acc"], "test_loss": summary["test_loss"],
                             "train_loss": summary["train_loss"], "steps": summary["steps"],
                             "wall_s": wall, "load": os.getloadavg()[0]})
                print(json.dumps(rows[-1]), flush=True)
    print(f"\n# {args.epochs} epochs, batch {args.batch}, lr {args.lr}, inverse every 10; "
          f"mean (min-max) over {args.seeds} seeds")
    print("| damping | config | test accuracy % | test loss | train loss |")
    print("|---:|---|---:|---:|---:|")
    for damping in sorted({r["damping"] for r in rows}):
        for k in ranks:
            sel = [r for r in rows if r["damping"] == damping and r["low_rank"] == k]
            acc = [100 * r["test_acc"] for r in sel]
            print(f"| {damping:g} | {'low rank off' if k is None else f'low_rank={k}'} | "
                  f"{statistics.mean(acc):.2f} ({min(acc):.2f}-{max(acc):.2f}) | "
                  f"{statistics.mean(r['test_loss'] for r in sel):.4f} | "
                  f"{statistics.mean(r['train_loss'] for r in sel):.4f} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    t = sub.add_parser("time", help="K-FAC iteration time, interleaved (run under launch/local)")
    t.add_argument("--low-ranks", default="off,64,128")
    t.add_argument("--batch", type=int, default=32, help="per rank")
    t.add_argument("--inv-steps", type=int, default=10)
    t.add_argument("--rounds", type=int, default=5)
    t.add_argument("--damping", type=float, default=0.001)
    t.add_argument("--threads", type=int, default=1)
    t.add_argument("--ranks-label", default="?")
    t.add_argument("--json", type=Path, default=None)
    a = sub.add_parser("accuracy", help="test accuracy through kfac-hpc train (one rank)")
    a.add_argument("--low-ranks", default="off,64,128")
    a.add_argument("--dampings", default="0.001,0.01,0.1")
    a.add_argument("--epochs", type=int, default=3)
    a.add_argument("--batch", type=int, default=32)
    a.add_argument("--lr", type=float, default=0.1)
    a.add_argument("--seeds", type=int, default=2)
    a.add_argument("--threads", type=int, default=1)
    a.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    result: Any = time_iterations(args) if args.what == "time" else accuracy(args)
    if args.json is not None and (args.what != "time" or int(os.environ.get(
            "OMPI_COMM_WORLD_RANK", "0")) == 0):
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
