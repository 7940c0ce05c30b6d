"""Time to accuracy: SGD, Adam, K-FAC (comm-opt, mem-opt, dp-kfac; expand/reduce) and Shampoo.

For each task (the embedded digits data with the MLP; CIFAR-style ResNet-20 on the
``synthetic`` image set) every optimizer trains for the same epoch budget at ``-n``
ranks and for several seeds, with the ``kfac-hpc train`` driver (same flags in both
launch modes below). From each run's ``metrics.jsonl`` the script takes the per-epoch
test accuracy and wall time, then reports, per optimizer, mean +- std over seeds of

* epochs and wall time to a target test accuracy: the first evaluated epoch with
  ``test_acc >= target``, where ``target = mean over seeds of SGD's final test accuracy
  - margin`` (``--margin-digits``, ``--margin-resnet``; percentage points);
* the final test accuracy, the training wall time per epoch;

and plots test accuracy against epochs and against wall time (one line per optimizer,
mean over seeds, +- std shaded) into ``--fig-dir``.

K-FAC runs the driver's default ``--kfac-approx expand``; ``kfac-comm-opt-reduce`` (not
in the default list) is comm-opt with ``--kfac-approx reduce`` (K-FAC-reduce, Eschenhagen
et al. 2023), with its own learning rate (``--lr TASK:kfac-reduce=LR``);
``kfac-comm-opt-subspace`` (not in the default list either) is comm-opt with
``--kfac-eigen-refresh subspace`` at K-FAC's learning rate. ``--target-reference
kfac-comm-opt`` measures the target from K-FAC-expand's final accuracy instead of SGD's
(ratios in the tables are then against expand); with ``--reuse`` it re-analyses finished
runs without running anything. ``--fig-tag`` names the figures (and results JSON) apart
from earlier runs, ``--curves`` adds a table of mean test accuracy per epoch.

``--tasks gpt`` (not in the default) adds the byte-level language model: ``gpt``
(``--gpt-options``, default dim 64, depth 2, 4 heads) on ``stdlib-text`` (the standard
library's source), K-FAC comm-opt (on AdamW) and Shampoo against AdamW
(``--gpt-optimizers``). There "accuracy" is next-token test accuracy, the target is
AdamW's mean final value minus ``--margin-gpt``, and the table adds the final test
perplexity (``exp`` of the test loss). Its learning rates were not swept.

With a cosine schedule every run converges near its own end, so "the first epoch above
the target" mostly measures the schedule. The published comparisons (SC20, KAISA) give
each optimizer its own, shorter schedule instead; ``--budgets 0.5,0.75`` does that: the
optimizers of ``--budget-optimizers`` also train with that fraction of the epoch budget
(same seeds), and a second table gives, per optimizer, the shortest schedule whose mean
final test accuracy reaches the target and its training wall time (x SGD's full run).

Runs always use the full epoch budget (no early stop), so the learning-rate schedule
is the same for every optimizer and the curves are complete; "wall time" is the
driver's training clock (training + per-epoch evaluation, without process start-up,
data loading and model construction).

Launch modes (``--launch``):

* ``batched`` (default): one ``launch/local -n P python time_to_accuracy.py --worker
  PLAN`` job per task runs its configurations one after the other in the same
  processes through ``kfac_hpc.train.loop.train`` (flags parsed by the CLI's own
  parser). Saves the 15-25 s of interpreter/torch/MPI start-up and set-up per
  configuration that a loaded 2-core machine charges; each optimizer kind first runs
  a 2-step warm-up (not recorded) so lazy initialisation does not land on one run.
* ``per-config``: one ``launch/local -n P kfac-hpc train ... --out DIR --no-progress``
  job per configuration (simplest and most isolated; slower in total).

Configurations are interleaved (for each seed, every optimizer) so that load drift on
a shared machine hits all optimizers alike. With ``--reuse`` configurations whose
``summary.json`` already exists are not run again (resume, or re-analyse).

    python benchmarks/time_to_accuracy.py --markdown            # the full benchmark
    python benchmarks/time_to_accuracy.py --quick               # smoke run, ~2 min
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

from common import OUT_DIR, describe, format_table, mean_std, pyplot, save_figure, write_json

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
FIG_DIR = HERE / "figures"

# label -> driver flags (per-task flags are added by task_flags)
OPTIMIZERS: dict[str, list[str]] = {
    "sgd": ["--optimizer", "sgd", "--preconditioner", "none"],
    "adam": ["--optimizer", "adam", "--preconditioner", "none"],
    "kfac-comm-opt": ["--optimizer", "sgd", "--preconditioner", "kfac",
                      "--kfac-strategy", "comm-opt"],
    # K-FAC-reduce (issue 14): the same strategy, convolution factors from per-example
    # averaged inputs and summed output gradients
    "kfac-comm-opt-reduce": ["--optimizer", "sgd", "--preconditioner", "kfac",
                             "--kfac-strategy", "comm-opt", "--kfac-approx", "reduce"],
    # eigenbases renewed by one subspace-iteration step from the previous ones (the
    # first inverse update by eigh): K-FAC's cheaper inverse update, learning rate "kfac"
    "kfac-comm-opt-subspace": ["--optimizer", "sgd", "--preconditioner", "kfac",
                               "--kfac-strategy", "comm-opt", "--kfac-eigen-refresh",
                               "subspace"],
    "kfac-mem-opt": ["--optimizer", "sgd", "--preconditioner", "kfac",
                     "--kfac-strategy", "mem-opt"],
    "kfac-dp-kfac": ["--optimizer", "sgd", "--preconditioner", "kfac",
                     "--kfac-strategy", "dp-kfac"],
    "shampoo": ["--optimizer", "shampoo", "--preconditioner", "none"],
    "adamw": ["--optimizer", "adamw", "--preconditioner", "none"],
}
# the image tasks' default comparison (AdamW is the language model's reference)
DEFAULT_OPTIMIZERS = ("sgd", "adam", "kfac-comm-opt", "kfac-mem-opt", "kfac-dp-kfac", "shampoo")
# the language model: K-FAC and Shampoo against AdamW
GPT_OPTIMIZERS = ("adamw", "kfac-comm-opt", "shampoo")
LABELS = {"sgd": "SGD", "adam": "Adam", "kfac-comm-opt": "K-FAC comm-opt",
          "kfac-comm-opt-reduce": "K-FAC comm-opt reduce",
          "kfac-comm-opt-subspace": "K-FAC comm-opt subspace",
          "kfac-mem-opt": "K-FAC mem-opt", "kfac-dp-kfac": "K-FAC dp-kfac",
          "shampoo": "Shampoo", "adamw": "AdamW"}
COLORS = {"sgd": "black", "adam": "tab:orange", "kfac-comm-opt": "tab:blue",
          "kfac-comm-opt-reduce": "tab:brown", "kfac-comm-opt-subspace": "tab:olive",
          "kfac-mem-opt": "tab:cyan", "kfac-dp-kfac": "tab:purple", "shampoo": "tab:green",
          "adamw": "tab:red"}
TASKS = ("digits", "resnet20", "gpt")
DEFAULT_TASKS = ("digits", "resnet20")
# Peak learning rates (after 1 warm-up epoch, cosine decay): the best final test accuracy
# of a 1-seed sweep (seed 0, so the benchmark's default seeds are 1, 2, 3) over
# {0.3, 1, 3, 10} x a starting value per optimizer; "kfac" = every K-FAC strategy, on
# SGD (K-FAC-expand); "kfac-reduce" = K-FAC-reduce (tasks without it use "kfac"). Sweep
# tables: benchmarks/RESULTS.md, "Time to accuracy".
LEARNING_RATES: dict[str, dict[str, float]] = {
    "digits": {"sgd": 0.3, "adam": 0.03, "kfac": 1.0, "shampoo": 0.03},
    # kfac-reduce (K-FAC-reduce, issue 14): its own seed-0 sweep over {1.2, 4, 12}
    "resnet20": {"sgd": 0.4, "adam": 0.1, "kfac": 4.0, "kfac-reduce": 4.0, "shampoo": 0.3},
    # gpt: not swept (a common AdamW value for small transformers, used by all three)
    "gpt": {"sgd": 0.3, "adam": 3e-3, "adamw": 3e-3, "kfac": 3e-3, "shampoo": 3e-3},
}
for _lrs in LEARNING_RATES.values():
    _lrs.setdefault("adamw", _lrs["adam"])
LR_KEYS = ("sgd", "adam", "adamw", "kfac", "kfac-reduce", "shampoo")


# ------------------------------------------------------------------ configuration
def task_flags(task: str, args: argparse.Namespace) -> list[str]:
    """Flags of a task that every optimizer shares."""
    common = ["--batch-size", str(args.batch_size), "--log-every-steps", "1000000"]
    if task == "digits":
        return ["--dataset", "digits", "--model", "mlp",
                "--epochs", str(args.digits_epochs), *common]
    if task == "gpt":  # byte-level language model on the standard library's source
        return ["--dataset", "stdlib-text", "--model", "gpt",
                "--model-options", args.gpt_options, "--eval-batch-size", "256",
                "--epochs", str(args.gpt_epochs), *common]
    return ["--dataset", "synthetic", "--model", "resnet20",
            "--synthetic-shape", args.resnet_shape,
            "--synthetic-classes", str(args.resnet_classes),
            "--synthetic-train-size", str(args.resnet_train_size),
            "--synthetic-test-size", str(args.resnet_test_size),
            "--epochs", str(args.resnet_epochs), *common]


def lr_key(name: str) -> str:
    """The ``LEARNING_RATES`` key of an optimizer entry (every K-FAC strategy shares
    ``kfac``; K-FAC-reduce has its own, ``kfac-reduce``)."""
    if name.startswith("kfac"):
        return "kfac-reduce" if name.endswith("-reduce") else "kfac"
    return name


def peak_lr(name: str, task: str, args: argparse.Namespace) -> float:
    """The peak learning rate of an optimizer entry; K-FAC-reduce falls back to K-FAC's
    (overridden or not) on tasks without its own value."""
    lrs = args.lrs[task]
    key = lr_key(name)
    return float(lrs[key] if key in lrs else lrs["kfac"])


def optimizer_flags(name: str, task: str, args: argparse.Namespace) -> list[str]:
    flags = [*OPTIMIZERS[name], "--lr", str(peak_lr(name, task, args))]
    if task == "gpt" and name.startswith("kfac"):
        flags += ["--optimizer", "adamw"]  # K-FAC on AdamW there (the last flag wins)
    if name == "shampoo":
        flags += ["--shampoo-options", f"precondition_frequency={args.shampoo_frequency}"]
    if name.startswith("kfac"):
        flags += ["--factor-update-steps", str(args.factor_update_steps),
                  "--inv-update-steps", str(args.inv_update_steps)]
    return flags + shlex.split(getattr(args, "extra_" + name.replace("-", "_")) or "")


def task_epochs(task: str, args: argparse.Namespace) -> int:
    return int({"digits": args.digits_epochs, "gpt": args.gpt_epochs}.get(
        task, args.resnet_epochs))


def task_optimizers(task: str, args: argparse.Namespace) -> list[str]:
    return list(args.gpt_optimizer_list if task == "gpt" else args.optimizer_list)


def budget_epochs(task: str, args: argparse.Namespace) -> list[int]:
    """The shorter schedules of ``--budgets`` (whole epochs, at least 1, distinct)."""
    full = task_epochs(task, args)
    return sorted({max(1, round(f * full)) for f in args.budget_list} - {full})


def plan_task(task: str, args: argparse.Namespace, root: Path) -> list[dict[str, Any]]:
    """One entry per (seed, optimizer[, shorter schedule]), seeds outermost (interleaved
    optimizers)."""
    runs = []
    full = task_epochs(task, args)
    for seed in args.seed_list:
        for name in task_optimizers(task, args):
            schedules = [full] + (budget_epochs(task, args)
                                  if name in args.budget_optimizer_list else [])
            for epochs in schedules:
                suffix = "" if epochs == full else f"_e{epochs}"
                out = root / task / f"{name}{suffix}_s{seed}"
                flags = (task_flags(task, args) + optimizer_flags(name, task, args)
                         + ["--epochs", str(epochs)]  # the last --epochs wins
                         + ["--seed", str(seed), "--out", str(out), "--no-progress"])
                runs.append({"task": task, "optimizer": name, "seed": seed, "epochs": epochs,
                             "out": str(out), "flags": flags})
    return runs


def warmup_entries(task: str, args: argparse.Namespace, root: Path) -> list[dict[str, Any]]:
    """A 2-step run of each optimizer kind (batched mode): pays lazy initialisation
    (LAPACK, conv kernels, first collectives) before anything is timed."""
    out = []
    for name in task_optimizers(task, args):
        d = root / "_warmup" / f"{task}_{name}"
        flags = (task_flags(task, args) + optimizer_flags(name, task, args)
                 + ["--max-steps", "2", "--out", str(d), "--no-progress"])
        out.append({"optimizer": name, "out": str(d), "flags": flags})
    return out


# ------------------------------------------------------------------ running
def launch(ranks: int, command: list[str], timeout: float) -> int:
    cmd = [str(REPO / "launch" / "local"), "-n", str(ranks), "--timeout", str(int(timeout))]
    cmd += command
    proc = subprocess.run(cmd, cwd=REPO)
    return proc.returncode


def run_batched(task: str, runs: list[dict[str, Any]], args: argparse.Namespace,
                root: Path) -> None:
    plan = {"warmup": warmup_entries(task, args, root) if args.warmup else [], "runs": runs}
    plan_path = write_json(root / f"plan_{task}.json", plan)
    rc = launch(args.ranks, [sys.executable, str(Path(__file__).resolve()), "--worker",
                             str(plan_path)], args.timeout)
    if rc != 0:
        print(f"time_to_accuracy: {task} job exited {rc}", file=sys.stderr, flush=True)


def run_per_config(runs: list[dict[str, Any]], args: argparse.Namespace) -> None:
    for run in runs:
        t0 = time.perf_counter()
        load = os.getloadavg()[0]
        rc = launch(args.ranks, ["kfac-hpc", "train", *run["flags"]], args.timeout)
        summary = Path(run["out"]) / "summary.json"
        if rc != 0 or not summary.exists():
            print(f"time_to_accuracy: {run['out']} exited {rc}", file=sys.stderr, flush=True)
            continue
        write_json(Path(run["out"]) / "bench.json",
                   {"load_before": load, "load_after": os.getloadavg()[0],
                    "job_seconds": time.perf_counter() - t0})


def worker(plan_path: str) -> int:
    """Inside ``launch/local``: run a plan's configurations in this process set."""
    from kfac_hpc.comm import install_abort_on_error, world
    from kfac_hpc.train.cli import add_arguments, config_from_args
    from kfac_hpc.train.loop import train

    plan = json.loads(Path(plan_path).read_text())
    install_abort_on_error()  # a crash on one rank aborts all (no rank waits forever)
    comm = world()
    parser = argparse.ArgumentParser(prog="kfac-hpc train")
    add_arguments(parser)
    for entry in plan["warmup"]:
        cfg = config_from_args(parser.parse_args(entry["flags"]))
        cfg.validate()
        t0 = time.perf_counter()
        train(cfg, comm, verbose=False)
        if comm.rank == 0:
            print(f"  warm-up {entry['optimizer']:<14} {time.perf_counter() - t0:6.1f} s",
                  flush=True)
    for entry in plan["runs"]:
        cfg = config_from_args(parser.parse_args(entry["flags"]))
        cfg.validate()
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        res = train(cfg, comm, verbose=False)
        if comm.rank == 0:
            job = time.perf_counter() - t0
            write_json(Path(entry["out"]) / "bench.json",
                       {"load_before": load, "load_after": os.getloadavg()[0],
                        "job_seconds": job})
            print(f"  {entry['task']:<8} {entry['optimizer']:<14} seed {entry['seed']}  "
                  f"test acc {100 * res.test_acc:6.2f} %  train {res.wall_time:6.1f} s  "
                  f"(+{res.setup_time:.1f} s setup)  load {load:.1f}", flush=True)
    return 0


# ------------------------------------------------------------------ analysis
def read_run(out: str) -> dict[str, Any] | None:
    d = Path(out)
    if not (d / "summary.json").exists():
        return None
    epochs = []
    with open(d / "metrics.jsonl") as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("kind") == "epoch":
                epochs.append(rec)
    bench = json.loads((d / "bench.json").read_text()) if (d / "bench.json").exists() else {}
    return {"summary": json.loads((d / "summary.json").read_text()), "epochs": epochs,
            "bench": bench}


def to_target(epochs: list[dict[str, Any]], target: float) -> tuple[int | None, float | None]:
    for rec in epochs:
        acc = rec.get("test_acc")
        if acc is not None and not math.isnan(acc) and acc >= target:
            return round(rec["epoch"]), rec["wall_time"]
    return None, None


def analyse(task: str, runs: list[dict[str, Any]], margin: float,
            optimizers: list[str], reference: str | None = None,
            ratio_reference: str | None = None) -> dict[str, Any]:
    """Per-optimizer rows against ``target = reference's mean final test accuracy -
    margin``; ``reference`` defaults to SGD (else the first optimizer with results), the
    "x" ratios are against ``ratio_reference`` (default: the target's reference)."""
    data: dict[str, list[dict[str, Any]]] = {name: [] for name in optimizers}
    full = max(run["epochs"] for run in runs)
    shorter: dict[str, dict[int, list[dict[str, Any]]]] = {}
    for run in runs:
        r = read_run(run["out"])
        if r is not None and r["epochs"]:
            r["seed"] = run["seed"]
            if run["epochs"] == full:
                data[run["optimizer"]].append(r)
            else:
                shorter.setdefault(run["optimizer"], {}).setdefault(run["epochs"], []).append(r)
    if reference is not None and data.get(reference):
        ref = reference
    else:
        ref = "sgd" if data.get("sgd") else next(n for n in optimizers if data[n])
    sgd_final = mean_std([r["summary"]["test_acc"] for r in data[ref]])[0]
    target = sgd_final - margin / 100
    rows: dict[str, dict[str, Any]] = {}
    for name in optimizers:
        rs = data[name]
        if not rs:
            continue
        hits = [to_target(r["epochs"], target) for r in rs]
        reached = [(e, t) for e, t in hits if e is not None and t is not None]
        ep = mean_std([float(e) for e, _ in reached])
        tt = mean_std([t for _, t in reached])
        per_epoch = mean_std([r["summary"]["wall_time"] / r["summary"]["epochs"] for r in rs])
        loads = [v for r in rs for v in (r["bench"].get("load_before"),
                                         r["bench"].get("load_after")) if v is not None]
        rows[name] = {
            "seeds": [r["seed"] for r in rs],
            "reached": len(reached), "runs": len(rs),
            "epochs_to_target": ep, "time_to_target": tt,
            "epochs_to_target_each": [e for e, _ in hits],
            "time_to_target_each": [t for _, t in hits],
            "final_acc": mean_std([r["summary"]["test_acc"] for r in rs]),
            "final_ppl": mean_std([math.exp(min(r["summary"]["test_loss"], 700.0))
                                   for r in rs]),
            "best_acc": mean_std([max(e["test_acc"] for e in r["epochs"]) for r in rs]),
            "seconds_per_epoch": per_epoch,
            "train_seconds": mean_std([r["summary"]["wall_time"] for r in rs]),
            "bytes_per_step": mean_std([r["summary"]["bytes_per_step"] for r in rs])[0],
            "load_range": [min(loads), max(loads)] if loads else None,
            "curves": [[(e["epoch"], e["wall_time"], e["test_acc"]) for e in r["epochs"]]
                       for r in rs],
        }
    ratio_ref = ratio_reference if ratio_reference in rows else ref
    sgd = rows.get(ratio_ref)  # the reference: SGD, or AdamW for the language model
    for row in rows.values():
        for key, base in (("epochs_ratio", "epochs_to_target"), ("time_ratio", "time_to_target")):
            row[key] = (row[base][0] / sgd[base][0]
                        if sgd and sgd[base][0] and not math.isnan(row[base][0]) else math.nan)
    budgets = {}
    for name, by_epochs in shorter.items():
        schedules = {**by_epochs, full: data[name]}
        budgets[name] = {
            str(e): {"final_acc": mean_std([r["summary"]["test_acc"] for r in rs]),
                     "train_seconds": mean_std([r["summary"]["wall_time"] for r in rs]),
                     "runs": len(rs)}
            for e, rs in sorted(schedules.items()) if rs}
    return {"task": task, "reference": ref, "ratio_reference": ratio_ref,
            "reference_final_acc": sgd_final,
            "margin_pp": margin, "target": target, "epochs": full, "rows": rows,
            "budgets": budgets}


def pm(ms: tuple[float, float], fmt: str, scale: float = 1.0) -> str:
    m, s = ms
    if math.isnan(m):
        return "-"
    if math.isnan(s):
        return format(m * scale, fmt)
    return f"{format(m * scale, fmt)} ± {format(s * scale, fmt)}"


def table(result: dict[str, Any], markdown: bool) -> str:
    ref = LABELS[result.get("ratio_reference", result["reference"])]
    headers = ["optimizer", "reached", "epochs to target", f"x {ref}", "time to target s",
               f"x {ref}", "final test acc %", "s / epoch", "KiB / step"]
    lm = result["task"] == "gpt"
    if lm:
        headers.insert(7, "final test ppl")
    rows = []
    for name, r in result["rows"].items():
        rows.append([
            LABELS[name], f"{r['reached']}/{r['runs']}",
            pm(r["epochs_to_target"], ".1f"),
            "-" if math.isnan(r["epochs_ratio"]) else f"{r['epochs_ratio']:.2f}",
            pm(r["time_to_target"], ".1f"),
            "-" if math.isnan(r["time_ratio"]) else f"{r['time_ratio']:.2f}",
            pm(r["final_acc"], ".2f", 100), pm(r["seconds_per_epoch"], ".2f"),
            f"{r['bytes_per_step'] / 1024:.0f}"])
        if lm:
            rows[-1].insert(7, pm(r["final_ppl"], ".2f"))
    return format_table(headers, rows, markdown=markdown)


def budget_table(result: dict[str, Any], markdown: bool) -> str:
    """Final test accuracy and training time per schedule length, and the shortest
    schedule whose mean final accuracy reaches the target."""
    budgets = result["budgets"]
    ratio_ref = result.get("ratio_reference", "sgd")
    sgd_time = result["rows"].get(ratio_ref, {}).get("train_seconds", (math.nan, math.nan))[0]
    headers = ["optimizer", *[f"{e} epochs: acc % / s" for e in
                              sorted({int(e) for b in budgets.values() for e in b})],
               "shortest reaching target", f"its time x {LABELS[ratio_ref]} full"]
    rows = []
    for name, by_epochs in budgets.items():
        cells = {int(e): f"{pm(v['final_acc'], '.1f', 100)} / {v['train_seconds'][0]:.1f}"
                 for e, v in by_epochs.items()}
        hit = next((int(e) for e, v in by_epochs.items()
                    if v["final_acc"][0] >= result["target"]), None)
        ratio = (by_epochs[str(hit)]["train_seconds"][0] / sgd_time
                 if hit is not None and sgd_time else math.nan)
        rows.append([LABELS[name], *[cells.get(e, "-") for e in
                                     sorted({int(e) for b in budgets.values() for e in b})],
                     "none" if hit is None else f"{hit} epochs",
                     "-" if math.isnan(ratio) else f"{ratio:.2f}"])
    return format_table(headers, rows, markdown=markdown)


def curve_table(result: dict[str, Any], markdown: bool) -> str:
    """Mean +- std test accuracy (%) and mean wall time (s) after each epoch of the full
    schedule, one column per optimizer."""
    curves = {name: r["curves"] for name, r in result["rows"].items()}
    n = max(min(len(c) for c in cs) for cs in curves.values())
    headers = ["epoch", *[f"{LABELS[name]}: acc % / s" for name in curves]]
    rows = []
    for i in range(n):
        row = [str(i + 1)]
        for cs in curves.values():
            if i >= min(len(c) for c in cs):
                row.append("-")
                continue
            acc = mean_std([c[i][2] for c in cs])
            row.append(f"{pm(acc, '.1f', 100)} / {mean_std([c[i][1] for c in cs])[0]:.1f}")
        rows.append(row)
    return format_table(headers, rows, markdown=markdown)


def mean_curve(curves: list[list[tuple[float, float, float]]]) -> tuple[list[float], ...]:
    n = min(len(c) for c in curves)
    ep, wt, acc, sd = [], [], [], []
    for i in range(n):
        ep.append(curves[0][i][0])
        wt.append(mean_std([c[i][1] for c in curves])[0])
        m, s = mean_std([c[i][2] for c in curves])
        acc.append(100 * m)
        sd.append(0.0 if math.isnan(s) else 100 * s)
    return ep, wt, acc, sd


def plot(result: dict[str, Any], path: Path, title: str) -> Path:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for name, r in result["rows"].items():
        ep, wt, acc, sd = mean_curve(r["curves"])
        for ax, x in zip(axes, (ep, wt)):
            ax.plot(x, acc, marker=".", color=COLORS[name], label=LABELS[name])
            ax.fill_between(x, [a - s for a, s in zip(acc, sd)],
                            [a + s for a, s in zip(acc, sd)], color=COLORS[name], alpha=0.12)
    lo = min(min(mean_curve(r["curves"])[2]) for r in result["rows"].values())
    for ax, xlabel in zip(axes, ("epoch", "wall time (s, training + evaluation)")):
        ax.axhline(100 * result["target"], color="red", ls="--", lw=1,
                   label=f"target {100 * result['target']:.1f} %")
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        ax.set_ylim(max(0.0, lo - 2), None)
    axes[0].set_ylabel("test accuracy (%)")
    axes[1].legend(loc="lower right", fontsize=8)
    fig.suptitle(textwrap.fill(title, 130), fontsize=9)
    return save_figure(fig, path)


def host_info(ranks: int) -> dict[str, Any]:
    """The keys of ``common.machine()`` without initialising MPI in this (launcher) process."""
    import platform

    import mpi4py
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                       cpu)
    except OSError:
        pass
    try:
        mpi = subprocess.run([os.environ.get("MPIEXEC", "mpiexec"), "--version"],
                             capture_output=True, text=True, timeout=60).stdout.splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        mpi = "unknown MPI"
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"host": platform.node(), "cpu": cpu, "cores": cores,
            "memory_gib": round(memory / 2**30, 1),
            "python": platform.python_version(), "torch": torch.__version__,
            "mpi4py": mpi4py.__version__, "mpi_library": mpi, "world_size": ranks,
            "ranks_on_node": ranks, "oversubscribed": cores is not None and ranks > cores}


# ------------------------------------------------------------------ main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", metavar="PLAN", help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true",
                   help="tiny smoke configuration (1 seed, 2-3 epochs, small ResNet data)")
    p.add_argument("--tasks", default=",".join(DEFAULT_TASKS),
                   help="comma list of digits, resnet20, gpt (the byte-level language model "
                        "on stdlib-text; not in the default)")
    p.add_argument("--optimizers", default=",".join(DEFAULT_OPTIMIZERS),
                   help=f"image tasks: comma list of {', '.join(OPTIMIZERS)}")
    p.add_argument("--gpt-optimizers", default=",".join(GPT_OPTIMIZERS),
                   help="the gpt task's optimizers (reference: the first with results, "
                        "AdamW by default; K-FAC runs on AdamW there)")
    p.add_argument("--gpt-epochs", type=int, default=4)
    p.add_argument("--gpt-options", default="dim=64,depth=2,heads=4",
                   help="--model-options of the gpt task")
    p.add_argument("--margin-gpt", type=float, default=1.0,
                   help="target = AdamW's mean final next-token test accuracy - this (pp)")
    p.add_argument("--seeds", default="1,2,3",
                   help="comma list of seeds (seed 0 chose the learning rates)")
    p.add_argument("--ranks", "-n", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--digits-epochs", type=int, default=20)
    p.add_argument("--resnet-epochs", type=int, default=8)
    p.add_argument("--resnet-shape", default="3,8,8")
    p.add_argument("--resnet-classes", type=int, default=10)
    p.add_argument("--resnet-train-size", type=int, default=4096)
    p.add_argument("--resnet-test-size", type=int, default=1024)
    p.add_argument("--factor-update-steps", type=int, default=5,
                   help="K-FAC (driver default 1; stale factors as in SC20/KAISA)")
    p.add_argument("--inv-update-steps", type=int, default=10, help="K-FAC (driver default)")
    p.add_argument("--shampoo-frequency", type=int, default=10,
                   help="Shampoo precondition_frequency (its own default is 1)")
    for name in OPTIMIZERS:
        p.add_argument("--extra-" + name, default="", metavar="FLAGS",
                       help=f"extra driver flags for {name}, e.g. \"--lr 0.05\"")
    p.add_argument("--lr", action="append", default=[], metavar="[TASK:]OPT=LR",
                   help=f"override a peak learning rate (OPT: {', '.join(LR_KEYS)}), "
                        "e.g. resnet20:sgd=0.2; repeatable; defaults: "
                        + "; ".join(f"{t} " + ", ".join(f"{o} {v:g}" for o, v in d.items())
                                    for t, d in LEARNING_RATES.items()))
    p.add_argument("--margin-digits", type=float, default=1.0,
                   help="target = SGD's mean final test accuracy - this (percentage points)")
    p.add_argument("--margin-resnet", type=float, default=2.0, help="same, for resnet20")
    p.add_argument("--target-reference", default=None, metavar="OPT",
                   help="optimizer whose mean final test accuracy - margin is the target "
                        "(default: SGD, AdamW for gpt; e.g. kfac-comm-opt: K-FAC-expand's)")
    p.add_argument("--ratio-reference", default=None, metavar="OPT",
                   help="optimizer the 'x' columns divide by (default: the target's "
                        "reference; e.g. kfac-comm-opt for reduce / expand)")
    p.add_argument("--curves", action="store_true",
                   help="also print mean test accuracy and wall time after each epoch")
    p.add_argument("--fig-tag", default="",
                   help="suffix of figure and results names, e.g. _reduce: "
                        "time_to_accuracy_resnet20_reduce.png, results_reduce.json")
    p.add_argument("--budgets", default="",
                   help="fractions of the epoch budget for shorter schedules, e.g. 0.5,0.75")
    p.add_argument("--budget-optimizers", default="sgd,kfac-comm-opt",
                   help="optimizers that also run the shorter schedules")
    p.add_argument("--launch", choices=("batched", "per-config"), default="batched")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="batched mode: skip the untimed 2-step warm-up of each optimizer")
    p.add_argument("--reuse", action="store_true",
                   help="do not re-run configurations whose summary.json exists")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per launch")
    p.add_argument("--out", type=Path, default=None, help="run directories and JSON")
    p.add_argument("--fig-dir", type=Path, default=None,
                   help=f"PNG folder (default {FIG_DIR.relative_to(REPO)}; --quick: --out)")
    p.add_argument("--markdown", action="store_true", help="Markdown tables")
    args = p.parse_args(argv)
    if args.quick:
        args.seeds = "0"
        args.digits_epochs, args.resnet_epochs = 3, 2
        args.resnet_train_size, args.resnet_test_size = 512, 256
        args.gpt_epochs = 2
    args.seed_list = [int(s) for s in args.seeds.split(",") if s.strip()]
    args.optimizer_list = [s.strip() for s in args.optimizers.split(",") if s.strip()]
    args.gpt_optimizer_list = [s.strip() for s in args.gpt_optimizers.split(",") if s.strip()]
    args.task_list = [s.strip() for s in args.tasks.split(",") if s.strip()]
    args.budget_list = [float(s) for s in args.budgets.split(",") if s.strip()]
    args.budget_optimizer_list = [s.strip() for s in args.budget_optimizers.split(",")
                                  if s.strip() in args.optimizer_list]
    if any(not 0 < f < 1 for f in args.budget_list):
        p.error(f"--budgets {args.budgets}: fractions must lie in (0, 1)")
    refs = [o for o in (args.target_reference, args.ratio_reference) if o is not None]
    bad = ([o for o in args.optimizer_list + args.gpt_optimizer_list + refs
            if o not in OPTIMIZERS]
           + [t for t in args.task_list if t not in TASKS])
    if bad:
        p.error(f"unknown optimizer/task: {', '.join(bad)}")
    args.lrs = {t: dict(d) for t, d in LEARNING_RATES.items()}
    for spec in args.lr:
        where, _, value = spec.rpartition("=")
        task, _, opt = where.rpartition(":")
        tasks = [task] if task else list(TASKS)
        if opt not in LR_KEYS or any(t not in TASKS for t in tasks):
            p.error(f"--lr {spec}: expected [TASK:]OPT=LR with OPT {'|'.join(LR_KEYS)}")
        for t in tasks:
            args.lrs[t][opt] = float(value)
    if args.out is None:
        args.out = OUT_DIR / ("time_to_accuracy_quick" if args.quick else "time_to_accuracy")
    if args.fig_dir is None:
        args.fig_dir = args.out if args.quick else FIG_DIR
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args.worker)
    root = args.out.resolve()
    t_start = time.perf_counter()
    load_start = os.getloadavg()
    results = {}
    for task in args.task_list:
        runs = plan_task(task, args, root)
        todo = [r for r in runs
                if not (args.reuse and (Path(r["out"]) / "summary.json").exists())]
        print(f"== {task}: {len(todo)} of {len(runs)} runs to do "
              f"({args.launch}, {args.ranks} ranks)", flush=True)
        if todo:
            if args.launch == "batched":
                run_batched(task, todo, args, root)
            else:
                run_per_config(todo, args)
        margin = {"digits": args.margin_digits, "gpt": args.margin_gpt}.get(
            task, args.margin_resnet)
        results[task] = analyse(task, runs, margin, task_optimizers(task, args),
                                args.target_reference, args.ratio_reference)
    elapsed = time.perf_counter() - t_start
    info = host_info(args.ranks)
    info["load_average_1m"] = f"{load_start[0]:.1f} at start, {os.getloadavg()[0]:.1f} at end"
    print(f"\nmachine: {describe(info)}")
    print(f"benchmark wall time {elapsed / 60:.1f} min ({args.launch})")
    for task, res in results.items():
        if not res["rows"]:
            continue
        cfg = " ".join(task_flags(task, args))
        loads = [v for r in res["rows"].values() if r["load_range"] for v in r["load_range"]]
        print(f"\n### {task}: {cfg}")
        print(f"target = {res['reference']} mean final test accuracy "
              f"{100 * res['reference_final_acc']:.2f} % - {res['margin_pp']:g} pp = "
              f"{100 * res['target']:.2f} %; {len(args.seed_list)} seeds "
              f"({args.seeds}); load average during runs "
              + (f"{min(loads):.1f}-{max(loads):.1f}" if loads else "n/a"))
        shown = {**args.lrs[task], **{lr_key(n): peak_lr(n, task, args)
                                      for n in task_optimizers(task, args)}}
        print("peak lr: " + ", ".join(f"{o} {v:g}" for o, v in shown.items())
              + f"; K-FAC factor/inv-update-steps {args.factor_update_steps}/"
              f"{args.inv_update_steps}, Shampoo "
              f"precondition_frequency {args.shampoo_frequency}\n")
        print(table(res, args.markdown))
        if res["budgets"]:
            print(f"\nshorter schedules (each its own warm-up + cosine decay), target "
                  f"{100 * res['target']:.2f} %:\n")
            print(budget_table(res, args.markdown))
        if args.curves:
            print("\nmean test accuracy after each epoch of the full schedule / mean wall "
                  "time:\n")
            print(curve_table(res, args.markdown))
        png = plot(res, args.fig_dir / f"time_to_accuracy_{task}{args.fig_tag}.png",
                   f"{task}: {cfg.replace('--log-every-steps 1000000', '').strip()}; "
                   f"{args.ranks} ranks, mean ± std over seeds {args.seeds}")
        print(f"\nfigure: {png}")
    write_json(root / f"results{args.fig_tag}.json", {
        "machine": info, "args": {k: (str(v) if isinstance(v, Path) else v)
                                  for k, v in vars(args).items()},
        "elapsed_s": elapsed, "results": results})
    print(f"results: {root / f'results{args.fig_tag}.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
