"""Planner validation: predicted vs measured iteration time, and the published shape.

Measure (run at each world size; writes ``plan_validation_n<P>.json``)::

    launch/local -n 1 python benchmarks/plan_validation.py
    launch/local -n 2 python benchmarks/plan_validation.py
    launch/local -n 4 python benchmarks/plan_validation.py

Report (one process; reads those files, prints Markdown tables)::

    python benchmarks/plan_validation.py --report

How a world size is measured:

1. calibration in the same run, just before and just after the timing (this machine is
   shared and its load drifts): :func:`kfac_hpc.plan.calibrate.measure_compute` on every
   rank at once and, above one rank, :func:`~kfac_hpc.plan.calibrate.measure_network`;
   the profile used is the mean of the two;
2. timing: for each model (``mlp``: 64-256-128-10, ``resnet20`` on 3x32x32; batch 32 per
   rank, a fixed synthetic batch) and each configuration (SGD, and K-FAC with every
   strategy that differs at this world size, factors and eigendecompositions every
   step unless ``--schedule`` says otherwise), iterations run round-robin, one per
   configuration per round; an iteration is zero_grad, forward, backward,
   :class:`~kfac_hpc.GradientAverager` ``synchronize()``, ``KFACPreconditioner.step()``,
   SGD step, after a barrier. Its time is the slowest rank's; the figure is the median
   over rounds. ``KFACPreconditioner.step()`` alone is timed too (slowest rank, median;
   the factor statistics run in the hooks, so the prediction it is compared with leaves
   out forward, backward, gradient averaging and factor statistics);
3. prediction: :func:`kfac_hpc.plan.estimate` (and ``estimate_sgd``) with that profile.

Report: error per configuration, and whether the predicted ranking of the strategies
matches the measured one (Kendall-style: pairs ordered alike, pairs closer than the
measurement noise counted as ties). Then the published shape: ResNet-50, 64 ranks,
batch 32, profile ``spd-kfac-2080ti-ib100``, D-KFAC / MPD-KFAC / SPD-KFAC / DP-KFAC /
S-SGD as modelled by :func:`kfac_hpc.plan.baselines`, next to the papers' numbers.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kfac_hpc.plan.model_shapes import ModelSpec

OUT = Path(__file__).resolve().parent / "out" / "plan"
PAPER_SPD = {"D-KFAC": 0.853, "MPD-KFAC": 0.764, "SPD-KFAC": 0.676, "S-SGD": 0.197}
PAPER_DP_TRAFFIC = (2.79, 3.15)
DECOMP_SIZES = (8, 16, 32, 64, 128, 256, 384, 512, 640)


def configs(world: int, f: int, i: int) -> list[tuple[str, Any]]:
    """(label, KFACOptions or None for SGD) measured at ``world`` ranks."""
    from kfac_hpc.plan import KFACOptions

    base = KFACOptions(factor_update_steps=f, inv_update_steps=i)
    out: list[tuple[str, Any]] = [("sgd", None), ("comm-opt", base)]
    if world > 1:
        out += [("mem-opt", replace(base, strategy="mem-opt")),
                ("dp-kfac", replace(base, strategy="dp-kfac")),
                ("comm-opt+pack+overlap", replace(base, symmetric_packing=True, overlap=True))]
    if world >= 4 and world % 2 == 0:
        out.append(("hybrid-opt(1/2)", replace(base, strategy="hybrid-opt",
                                               grad_worker_fraction=0.5)))
    return out


def measure(args: argparse.Namespace) -> int:
    import torch
    import torch.nn.functional as F
    from common import machine
    from mpi4py import MPI

    from kfac_hpc import GradientAverager, KFACPreconditioner
    from kfac_hpc.comm import Communicator, install_abort_on_error
    from kfac_hpc.plan import Profile, estimate, estimate_sgd, model_spec
    from kfac_hpc.plan.calibrate import measure_compute, measure_network
    from kfac_hpc.plan.cli import builtin_model
    from kfac_hpc.plan.collectives import COLLECTIVES, LinkCost
    from kfac_hpc.plan.profile import ComputeRates

    install_abort_on_error()
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    torch.set_num_threads(args.threads)
    info = machine()

    def say(message: str) -> None:
        if rank == 0:
            print(message, flush=True)

    say(f"# plan_validation: {size} rank(s), load {os.getloadavg()[0]:.2f}")
    comm = Communicator(world.Dup(), name="calibrate")

    def calibrate() -> tuple[ComputeRates, dict[str, LinkCost]]:
        c = measure_compute(world, DECOMP_SIZES, args.repeat)
        if size > 1:
            net, _ = measure_network(comm, (8, 16 << 10, 256 << 10, 2 << 20), args.repeat)
        else:
            net = {k: LinkCost(0.0, 0.0, "ring") for k in COLLECTIVES}
        return c, net


    from kfac_hpc.kfac import linalg
    from kfac_hpc.plan.calibrate import _slowest, _spd, probe_net

    probe, probe_shape = probe_net()
    probe_x = torch.randn(32, *probe_shape)
    spd = _spd(256)

    def tracker() -> float:
        """Slowest rank's seconds for a fixed bit of work (tracks the machine's load)."""
        def work() -> None:
            probe.zero_grad()
            probe(probe_x).sum().backward()
            linalg.eigh_clamped(spd)
        return _slowest(world, work, 1, inner=1)

    grad_comm = Communicator(world.Dup(), name="grad-avg")
    result: dict[str, Any] = {"world": size, "machine": info, "threads": args.threads,
                              "schedule": args.schedule, "load_before": os.getloadavg()[0],
                              "models": {}}
    f, i = args.schedule
    before = calibrate()
    track_calibration = [tracker() for _ in range(3)]
    track_rounds: list[float] = []
    say("calibrated (before)")
    runs: dict[str, tuple[ModelSpec, list[dict[str, Any]]]] = {}
    for name in args.models:
        model0, shape = builtin_model(name)
        spec = model_spec(model0, input_shape=shape, name=name)
        g = torch.Generator().manual_seed(1000 + rank)
        x = torch.randn((args.batch, *shape), generator=g)
        y = torch.randint(0, 10, (args.batch,), generator=g)
        runners = []
        for label, opts in configs(size, f, i):
            model = copy.deepcopy(model0)
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            averager = GradientAverager(model, grad_comm)
            pre = None
            if opts is not None:
                pre = KFACPreconditioner(model, comm=Communicator(world.Dup(), name=label),
                                         lr=0.01, **opts.preconditioner_kwargs())
            runners.append({"label": label, "options": opts, "model": model, "opt": opt,
                            "averager": averager, "pre": pre, "iter": [], "kfac": []})
        start = time.perf_counter()
        for rnd in range(args.warmup + args.steps):
            for r in runners:
                world.Barrier()
                t0 = time.perf_counter()
                r["opt"].zero_grad()
                F.cross_entropy(r["model"](x), y).backward()
                r["averager"].synchronize()
                t1 = time.perf_counter()
                if r["pre"] is not None:
                    r["pre"].step()
                t2 = time.perf_counter()
                r["opt"].step()
                t3 = time.perf_counter()
                if rnd >= args.warmup:
                    r["iter"].append(t3 - t0)
                    r["kfac"].append(t2 - t1)
            if rnd >= args.warmup:
                track_rounds.append(tracker())
        say(f"{name}: {len(runners)} configs x {args.warmup + args.steps} rounds in "
            f"{time.perf_counter() - start:.1f} s")
        for r in runners:
            per_rank_iter = world.allgather(r["iter"])
            per_rank_kfac = world.allgather(r["kfac"])
            r["iter_s"] = statistics.median(max(v[k] for v in per_rank_iter)
                                            for k in range(args.steps))
            r["kfac_s"] = statistics.median(max(v[k] for v in per_rank_kfac)
                                            for k in range(args.steps))
            r["iter_samples"] = [max(v[k] for v in per_rank_iter) for k in range(args.steps)]
        result["models"][name] = {"spec_layers": len(spec.layers), "runs": []}
        runs[name] = (spec, runners)
    track_calibration += [tracker() for _ in range(3)]
    after = calibrate()
    say("calibrated (after)")
    load = statistics.median(track_rounds) / statistics.median(track_calibration)
    result["load_factor"] = load
    say(f"load factor (tracker during rounds / during calibration): {load:.2f}")
    result["load_after"] = os.getloadavg()[0]

    def mean_rates(a: ComputeRates, b: ComputeRates) -> ComputeRates:
        avg = {k: (getattr(a, k) + getattr(b, k)) / 2 for k in
               ("train_flops", "gemm_flops", "mem_bandwidth", "op_overhead_s",
                "im2col_bandwidth", "module_overhead_s", "param_overhead_s",
                "sync_overhead_s")}
        return ComputeRates(**avg, overlap_efficiency=0.0,
                            eigh=tuple((n, (t1 + t2) / 2) for (n, t1), (_, t2)
                                       in zip(a.eigh, b.eigh)),
                            inverse=tuple((n, (t1 + t2) / 2) for (n, t1), (_, t2)
                                          in zip(a.inverse, b.inverse)))

    network = {k: LinkCost((before[1][k].alpha + after[1][k].alpha) / 2,
                           (before[1][k].beta + after[1][k].beta) / 2, "ring")
               for k in COLLECTIVES}
    mean = mean_rates(before[0], after[0])
    tracked = ComputeRates(
        train_flops=mean.train_flops / load, gemm_flops=mean.gemm_flops / load,
        mem_bandwidth=mean.mem_bandwidth / load, op_overhead_s=mean.op_overhead_s * load,
        eigh=tuple((n, t * load) for n, t in mean.eigh),
        inverse=tuple((n, t * load) for n, t in mean.inverse), overlap_efficiency=0.0,
        im2col_bandwidth=mean.im2col_bandwidth / load,
        module_overhead_s=mean.module_overhead_s * load,
        param_overhead_s=mean.param_overhead_s * load,
        sync_overhead_s=mean.sync_overhead_s * load)
    profiles = {"mean": Profile("measured", network, mean, source="calibrated"),
                "tracked": Profile("tracked", network, tracked, source="calibrated"),
                "before": Profile("before", before[1], before[0], source="calibrated"),
                "after": Profile("after", after[1], after[0], source="calibrated")}
    result["profile"] = profiles["mean"].to_json()
    for name in args.models:
        spec, runners = runs[name]
        for r in runners:
            row: dict[str, Any] = {"label": r["label"], "measured_s": r["iter_s"],
                                   "measured_kfac_s": r["kfac_s"],
                                   "samples_s": r["iter_samples"]}
            for key, prof in profiles.items():
                if r["options"] is None:
                    t = estimate_sgd(spec, size, args.batch, prof)
                    row[f"predicted_{key}_s"] = sum(t.values())
                    row[f"predicted_{key}_kfac_s"] = 0.0
                else:
                    e = estimate(spec, r["options"], size, args.batch, prof)
                    row[f"predicted_{key}_s"] = e.total_s
                    row[f"predicted_{key}_kfac_s"] = e.total_s - sum(
                        e.time[p] for p in ("forward", "backward", "grad avg",
                                            "factor stats"))
                    if key == "mean":
                        row["predicted_split_s"] = e.time
                        row["options"] = asdict(r["options"])
            result["models"][name]["runs"].append(row)
            say(f"  {name:9} {r['label']:24} measured {r['iter_s'] * 1e3:8.1f} ms  "
                f"predicted {row['predicted_mean_s'] * 1e3:8.1f} ms, load-tracked "
                f"{row['predicted_tracked_s'] * 1e3:8.1f} ms  (K-FAC step "
                f"{r['kfac_s'] * 1e3:7.1f} / {row['predicted_mean_kfac_s'] * 1e3:7.1f})")
    if rank == 0:
        OUT.mkdir(parents=True, exist_ok=True)
        path = OUT / f"plan_validation_n{size}.json"
        path.write_text(json.dumps(result, indent=1, default=str) + "\n")
        say(f"wrote {path}")
    return 0


# ------------------------------------------------------------------------ report
def ranking_agreement(measured: Sequence[float], predicted: Sequence[float],
                      noise: Sequence[float]) -> tuple[int, int]:
    """Pairs ordered alike (a pair whose measured gap is within the noise counts as
    agreeing either way), and the number of pairs."""
    agree = total = 0
    for a, b in itertools.combinations(range(len(measured)), 2):
        total += 1
        gap = measured[a] - measured[b]
        if abs(gap) <= noise[a] + noise[b] or (gap > 0) == (predicted[a] > predicted[b]):
            agree += 1
    return agree, total


def _iqr_half(samples: Sequence[float]) -> float:
    q = statistics.quantiles(samples, n=4) if len(samples) >= 2 else [samples[0]] * 3
    return (q[2] - q[0]) / 2


def report(args: argparse.Namespace) -> int:
    from kfac_hpc.plan import (
        KFACOptions,
        baselines,
        estimate,
        estimate_sgd,
        load_profile,
        model_spec,
    )
    from kfac_hpc.plan.cli import builtin_model

    lines: list[str] = []
    worst: dict[str, float] = {}
    for path in sorted(OUT.glob("plan_validation_n*.json")):
        data = json.loads(path.read_text())
        p = data["world"]
        lines.append(f"\n**{p} rank(s)** (load {data['load_before']:.1f} → "
                     f"{data['load_after']:.1f} on {data['machine']['cores']} cores; "
                     f"schedule factors/inverses every {data['schedule'][0]}/"
                     f"{data['schedule'][1]} step(s))\n")
        lines.append("| model | configuration | measured ms | predicted ms | error | "
                     "step() measured / predicted ms | spread (IQR/2) ms |")
        lines.append("|---|---|---:|---:|---:|---:|---:|")
        for name, m in data["models"].items():
            kfac = [r for r in m["runs"] if r["label"] != "sgd"]
            for r in m["runs"]:
                err = r["predicted_mean_s"] / r["measured_s"] - 1
                worst[f"{name}@{p}:{r['label']}"] = err
                lines.append(
                    f"| {name} | {r['label']} | {r['measured_s'] * 1e3:.1f} | "
                    f"{r['predicted_mean_s'] * 1e3:.1f} | {err * 100:+.0f}% | "
                    f"{r['measured_kfac_s'] * 1e3:.1f} / {r['predicted_mean_kfac_s'] * 1e3:.1f}"
                    f" | {_iqr_half(r['samples_s']) * 1e3:.1f} |")
            if len(kfac) > 1:
                meas = [r["measured_s"] for r in kfac]
                pred = [r["predicted_mean_s"] for r in kfac]
                noise = [_iqr_half(r["samples_s"]) for r in kfac]
                agree, total = ranking_agreement(meas, pred, noise)
                strict, _ = ranking_agreement(meas, pred, [0.0] * len(meas))
                order_m = " < ".join(r["label"] for r in sorted(kfac,
                                                                key=lambda r: r["measured_s"]))
                order_p = " < ".join(r["label"] for r in sorted(
                    kfac, key=lambda r: r["predicted_mean_s"]))
                lines.append(f"| {name} | ranking | {order_m} | {order_p} | "
                             f"{strict}/{total} pairs strict, {agree}/{total} within noise "
                             "| | |")
    errors = [abs(v) for v in worst.values()]
    if errors:
        lines.append(f"\nMedian |error| {statistics.median(errors) * 100:.0f}%, "
                     f"max {max(errors) * 100:.0f}%, within 25%: "
                     f"{sum(e < 0.25 for e in errors)}/{len(errors)}.")

    # -------------------------------------------------------------- published shape
    model, shape = builtin_model("resnet50")
    spec = model_spec(model, input_shape=shape, name="resnet50")
    prof = load_profile("spd-kfac-2080ti-ib100")
    base = KFACOptions(compute_method="inverse")
    lines.append("\n**Published shape**: ResNet-50 (ImageNet shapes), 64 ranks, batch 32 "
                 "per rank, factors and inverses every step, profile "
                 "`spd-kfac-2080ti-ib100` (assumed, see its `assumptions`).\n")
    lines.append("| system | modelled as | predicted s/iter | paper s/iter | "
                 "factor / decomp / grad MB per rank per step |")
    lines.append("|---|---|---:|---:|---|")
    ests = {}
    for name, opts in baselines(base).items():
        e = estimate(spec, opts, 64, 32, prof)
        ests[name] = e
        b = e.bytes_per_step
        paper = PAPER_SPD.get(name)
        lines.append(f"| {name} | `{opts.label()}` | {e.total_s:.3f} | "
                     f"{'-' if paper is None else f'{paper:.3f}'} | "
                     f"{b['factors'] / 2**20:.0f} / {b['decompositions'] / 2**20:.0f} / "
                     f"{b['gradients'] / 2**20:.0f} |")
    sgd = sum(estimate_sgd(spec, 64, 32, prof).values())
    lines.append(f"| S-SGD | no K-FAC | {sgd:.3f} | {PAPER_SPD['S-SGD']:.3f} | 0 / 0 / 0 |")
    # sensitivity: MPD-KFAC whose factors are allreduced (NCCL/Horovod have no uneven
    # reduce-scatter), everything else as MPD-KFAC
    mpd_ar = estimate(spec, replace(baselines(base)["MPD-KFAC"], factor_reduction="allreduce"),
                      64, 32, prof)
    ests["MPD-KFAC (factors allreduced)"] = mpd_ar
    b = mpd_ar.bytes_per_step
    lines.append(f"| MPD-KFAC, factors allreduced (sensitivity) | "
                 f"`{mpd_ar.options.label()}` | {mpd_ar.total_s:.3f} | {PAPER_SPD['MPD-KFAC']:.3f}"
                 f" | {b['factors'] / 2**20:.0f} / {b['decompositions'] / 2**20:.0f} / "
                 f"{b['gradients'] / 2**20:.0f} |")
    order = " > ".join(sorted(("D-KFAC", "MPD-KFAC", "SPD-KFAC"),
                              key=lambda k: -ests[k].total_s))
    order_ar = " > ".join(sorted(("D-KFAC", "MPD-KFAC (factors allreduced)", "SPD-KFAC"),
                                 key=lambda k: -ests[k].total_s))
    lines.append(f"\nPredicted order: {order}; with MPD-KFAC's factors allreduced: "
                 f"{order_ar} (paper: D-KFAC > MPD-KFAC > SPD-KFAC).")
    for name, e in ests.items():
        t = e.time
        lines.append(f"- {name}: " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in t.items()
                                               if v > 5e-4))
    del ests["MPD-KFAC (factors allreduced)"]
    dp = ests["DP-KFAC"].kfac_bytes
    lines.append("\n**DP-KFAC traffic reduction** (bytes per rank per second-order update, "
                 "the counters' convention: message sizes), paper "
                 f"{PAPER_DP_TRAFFIC[0]}–{PAPER_DP_TRAFFIC[1]}x:\n")
    lines.append("| D-KFAC variant | bytes/rank/step MB | ÷ DP-KFAC |")
    lines.append("|---|---:|---:|")
    variants = {
        "D-KFAC (full factors allreduced + inverses broadcast)": ests["D-KFAC"],
        "D-KFAC, upper-triangle factors, inverses broadcast": estimate(
            spec, replace(baselines(base)["D-KFAC"], symmetric_packing=True), 64, 32, prof),
        "SPD-KFAC (triangles, small inverses local)": ests["SPD-KFAC"],
        "factors only, upper triangles (allreduce)": None,
        "MPD-KFAC (reduce-scatter + gradient broadcast)": ests["MPD-KFAC"],
    }
    for label, variant in variants.items():
        if variant is None:
            nbytes = estimate(spec, replace(baselines(base)["D-KFAC"], symmetric_packing=True),
                              64, 32, prof).bytes_per_step["factors"]
        else:
            nbytes = variant.kfac_bytes
        lines.append(f"| {label} | {nbytes / 2**20:.0f} | {nbytes / dp:.2f} |")
    lines.append(f"| DP-KFAC (gradient broadcasts) | {dp / 2**20:.0f} | 1.00 |")
    text = "\n".join(lines)
    print(text)
    if args.write:
        (OUT / "report.md").write_text(text + "\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--report", action="store_true", help="print the tables from saved runs")
    p.add_argument("--write", action="store_true", help="with --report: also write report.md")
    p.add_argument("--models", nargs="+", default=["mlp", "resnet20"])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=9)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeat", type=int, default=5, help="calibration samples")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--schedule", type=int, nargs=2, default=[1, 1], metavar=("F", "I"),
                   help="factor and inverse update steps (default 1 1)")
    args = p.parse_args(argv)
    return report(args) if args.report else measure(args)


if __name__ == "__main__":
    sys.exit(main())
