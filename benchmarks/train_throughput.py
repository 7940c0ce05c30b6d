"""Throughput of the main job: ``kfac-hpc train`` with K-FAC, Shampoo and their baselines.

Each configuration is one ``kfac-hpc train`` process (one rank) on synthetic data of a
fixed shape, run to ``--steps`` optimizer steps, with the driver's defaults (on a GPU
``--phase-times auto`` records no per-phase times, which would synchronise the device
around every phase). Step records are written at step ``--warmup`` and at the last step
only, and the throughput is taken between them: ``(steps - warmup) · batch / (wall time at the
last step - wall time at step warmup)``. The first steps (cuDNN autotuning, the first
inverse update, allocator growth) are thereby left out, the steady state is measured
with the driver's own loop, data pipeline and defaults.

Configurations (``--configs``, comma-separated; default all but the AMP and graph ones on
a CPU):

* ``sgd``, ``adamw``: the baselines (``--preconditioner none``);
* ``kfac``: K-FAC with the driver's defaults (for ResNet-50 factors every 10 steps and
  inverses every 100, KAISA's ImageNet schedule; for the other models every step and
  every 10);
* ``kfac-1-10``: factors every step, inverses every 10;
* ``kfac-10-100``: factors every 10 steps, inverses every 100;
* ``kfac-lag``: the defaults with ``--kfac-decomposition-lag 5``;
* ``kfac-graphs`` (CUDA only): the defaults with ``--kfac-cuda-graphs``;
* ``kfac-eager``: the defaults with ``--no-kfac-cuda-graphs`` (``kfac`` captures on CUDA:
  ``kfac_hpc.step_graph.DEFAULT_DEVICES``);
* ``shampoo``: DistributedShampoo with the driver's defaults;
* ``sgd-amp``, ``kfac-amp``: the same with ``--amp --amp-dtype bfloat16``.

Prints a table (samples/s, ms per step, ratio to SGD's samples/s, and to the
same-precision SGD for AMP runs, the step graph's captures and replays from the run's
``summary.json``) and writes ``train_throughput_<model>_<device>.json``
under ``--out``. With ``--repeats N`` every configuration runs N times, the order of
the configurations reversed every other pass (drifts of the machine hit all alike): the
table gives the median run and the spread (lowest to highest samples/s); one run each
(the default) is a single sample per configuration.

Example (one GPU, the issue's setting)::

    python3 benchmarks/train_throughput.py --device cuda --model resnet50 \\
        --shape 3,224,224 --batch 32 --steps 60 --warmup 20 --markdown --out benchmarks/out/gpu
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import OUT_DIR, REPO_DIR, format_table, write_json

from kfac_hpc import step_graph

CONFIGS: dict[str, list[str]] = {
    "sgd": ["--preconditioner", "none", "--optimizer", "sgd"],
    "adamw": ["--preconditioner", "none", "--optimizer", "adamw"],
    "kfac": ["--optimizer", "sgd"],
    "kfac-1-10": ["--optimizer", "sgd", "--factor-update-steps", "1",
                  "--inv-update-steps", "10"],
    "kfac-10-100": ["--optimizer", "sgd", "--factor-update-steps", "10",
                    "--inv-update-steps", "100"],
    "kfac-lag": ["--optimizer", "sgd", "--kfac-decomposition-lag", "5"],
    "kfac-graphs": ["--optimizer", "sgd", "--kfac-cuda-graphs"],
    "kfac-eager": ["--optimizer", "sgd", "--no-kfac-cuda-graphs"],
    "shampoo": ["--preconditioner", "none", "--optimizer", "shampoo"],
    "sgd-amp": ["--preconditioner", "none", "--optimizer", "sgd", "--amp",
                "--amp-dtype", "bfloat16"],
    "kfac-amp": ["--optimizer", "sgd", "--amp", "--amp-dtype", "bfloat16"],
}
#: The baseline a configuration's ratio is taken against (besides plain SGD).
BASELINE = {"sgd-amp": "sgd-amp", "kfac-amp": "sgd-amp"}


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median throughput (the lower middle one of an even count), its spread.

    A failed run makes the configuration failed.
    """
    failed = [r for r in runs if "error" in r]
    if failed:
        return failed[0]
    ordered = sorted(runs, key=lambda r: r["samples_per_s"])
    chosen = dict(ordered[(len(ordered) - 1) // 2])
    chosen["spread"] = (ordered[0]["samples_per_s"], ordered[-1]["samples_per_s"])
    chosen["runs"] = len(runs)
    return chosen


def run_one(name: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Run configuration ``name``; its steady-state throughput from the step records."""
    run_dir = out / name
    cmd = [sys.executable, "-m", "kfac_hpc", "train", "--dataset", "synthetic",
           "--synthetic-shape", args.shape, "--synthetic-classes", str(args.classes),
           "--synthetic-train-size", str(args.batch * (args.steps + 1)),
           "--synthetic-test-size", str(args.batch), "--model", args.model,
           "--batch-size", str(args.batch), "--max-steps", str(args.steps),
           "--log-every-steps", str(args.warmup), "--read-every-steps", str(args.warmup),
           "--device", args.device,
           "--no-progress", "--out", str(run_dir), *CONFIGS[name], *args.extra]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_DIR), env.get("PYTHONPATH")]))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                          timeout=args.timeout)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-12:]
        return {"config": name, "error": f"exit {proc.returncode}", "output": tail,
                "command": cmd}
    steps = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
             if r.get("kind") == "step"]
    by_step = {r["step"]: r for r in steps}
    first, last = by_step.get(args.warmup), by_step.get(args.steps)
    if first is None or last is None:
        return {"config": name, "error": f"no step record at {args.warmup} and {args.steps}",
                "command": cmd}
    seconds = last["wall_time"] - first["wall_time"]
    samples = (args.steps - args.warmup) * args.batch
    summary = run_dir / "summary.json"
    graph = json.loads(summary.read_text()).get("step_graph") if summary.exists() else None
    return {"config": name, "samples_per_s": samples / seconds,
            "ms_per_step": 1000 * seconds / (args.steps - args.warmup),
            "process_s": wall, "step_graph": graph, "command": cmd}


def main() -> None:
    """Parse the arguments, run the configurations one after another, print the table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu | cuda (default: cpu)")
    p.add_argument("--model", default="resnet20")
    p.add_argument("--shape", default="3,32,32", help="sample shape (default: 3,32,32)")
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10,
                   help="steps left out of the timing (also the interval of the step records "
                        "and of the reads: a record's wall_time is its read's)")
    p.add_argument("--configs", default=None,
                   help=f"comma-separated, of {', '.join(CONFIGS)} (default: all; no AMP or graphs "
                   "on a CPU)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per configuration")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs per configuration, in alternating order (median and spread)")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                   help="further kfac-hpc train arguments for every configuration (last)")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--out", type=Path, default=OUT_DIR)
    args = p.parse_args()
    if not 0 < args.warmup < args.steps or args.steps % args.warmup:
        p.error("need 0 < --warmup < --steps with --steps a multiple of --warmup "
                "(step records are written every --warmup steps)")
    names = (args.configs.split(",") if args.configs else
             [n for n in CONFIGS if args.device != "cpu" or not n.endswith(("-amp", "-graphs"))])
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        p.error(f"unknown configuration(s) {unknown}; known: {', '.join(CONFIGS)}")
    if args.device == "cpu" and any(n.endswith("-graphs") for n in names):
        print("kfac-graphs: CUDA graphs need --device cuda; skipped")
        names = [n for n in names if not n.endswith("-graphs")]
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="train_throughput_") as tmp:
        for rep in range(args.repeats):
            for name in names if rep % 2 == 0 else names[::-1]:
                r = run_one(name, args, Path(tmp) / f"{rep}")
                runs[name].append(r)
                print(f"{name}: " + (f"{r['samples_per_s']:.1f} samples/s" if "error" not in r
                                     else f"FAILED ({r['error']}): "
                                     + " | ".join(r["output"][-3:])
                                     if "output" in r else r["error"]), flush=True)
    results = {name: median_run(rs) for name, rs in runs.items()}
    rows = []
    for name, r in results.items():
        if "error" in r:
            rows.append([name, "failed", "", "", "", ""])
            continue
        sgd = results.get("sgd", {}).get("samples_per_s")
        base = results.get(BASELINE.get(name, "sgd"), {}).get("samples_per_s")
        rows.append([name, f"{r['samples_per_s']:.1f}", f"{r['ms_per_step']:.1f}",
                     f"{r['samples_per_s'] / sgd:.2f}x" if sgd else "",
                     f"{r['samples_per_s'] / base:.2f}x" if base else "",
                     "–" if r.get("step_graph") is None
                     else step_graph.describe(r["step_graph"])[:60]])
    title = (f"kfac-hpc train throughput: {args.model}, {args.shape}, batch {args.batch}, "
             f"{args.device}, steps {args.warmup + 1}-{args.steps} timed")
    print(title)
    print(format_table(["config", "samples/s", "ms/step", "vs SGD", "vs same-precision SGD",
                        "step graph"], rows, args.markdown))
    if args.repeats > 1:
        print("spread (samples/s, lowest-highest of the runs): " + ", ".join(
            f"{name} {r['spread'][0]:.1f}-{r['spread'][1]:.1f}" for name, r in results.items()
            if "spread" in r))
    path = write_json(args.out / f"train_throughput_{args.model}_{args.device}.json",
                      {"settings": {k: v for k, v in vars(args).items() if k != "out"}
                       | {"out": str(args.out)}, "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
