"""Shampoo step: per-iteration time of DistributedShampoo against Adam, bytes, memory.

    launch/local -n 4 python benchmarks/shampoo_step.py [--model all|mlp|resnet20]
        [--steps N] [--warmup W] [--batch B] [--max-dim D] [--quick] [--markdown]
        [--out benchmarks/out]

Models: an MLP on 64-feature inputs (hidden 256, 128; 10 classes) and the CIFAR
ResNet-20 on a synthetic 32x32x3 batch; per-rank batch ``--batch`` (32), one fixed
synthetic batch per rank (data loading is not measured). Gradients are averaged with
:class:`kfac_hpc.GradientAverager` (its own communicator), then the optimizer steps.

Configurations, each with its own copy of the model (same initial weights) and its
own communicator (a ``Dup`` of the world):

* ``adam``: ``torch.optim.Adam`` (the diagonal adaptive baseline).
* ``shampoo``: ``DistributedShampoo`` (Adam grafting, ``max_preconditioner_dim`` D,
  float32 factors and communication). Two kinds of its steps are timed: ``root``
  (every block recomputes its roots: ``precondition_frequency=1``) and ``plain``
  (factor update + preconditioning with stale roots). An iteration with
  ``precondition_frequency`` F costs ``plain + (root - plain)/F`` (amortised); the
  table composes F = 1, 10, 100.

How it is measured:

* Configurations/kinds run round-robin, one iteration each per round, with a
  barrier before each, so drifts of a shared, oversubscribed machine hit all alike.
* Per iteration, per rank: *fwd+bwd* (forward, loss, backward, gradient averaging)
  and *step* (``optimizer.step()``); the iteration's time is the slowest rank's (MAX
  over ranks of each part); reported numbers are medians over ``--steps`` rounds after
  ``--warmup`` rounds.
* Bytes per step: the library's counters (``Communicator.traffic()``) of the
  optimizer's communicator (Shampoo's one ``allgatherv``) and of the averager's,
  divided by the steps; the counters are deterministic.
* Memory per rank: ``DistributedShampoo.memory_bytes()`` (block state this rank owns,
  plus the two gather buffers), max over ranks; "all blocks" is the sum over ranks of
  the state, i.e. what every rank would hold if every block's state were replicated.
  Adam: its ``exp_avg`` + ``exp_avg_sq`` (+ ``step``).

Writes ``shampoo_step_<model>_n<ranks>.json`` under ``--out``; prints the tables on
rank 0. Compare runs at 1, 2 and 4 ranks by running it three times.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from mpi4py import MPI
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import OUT_DIR, describe, format_table, machine, write_json

from kfac_hpc import GradientAverager
from kfac_hpc.comm import Communicator
from kfac_hpc.models import build_model
from kfac_hpc.shampoo import DistributedShampoo

FREQUENCIES = (1, 10, 100)
NEVER = 10**9


def make_model(name: str) -> tuple[nn.Module, Callable[[int], tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    if name == "mlp":
        model = build_model("mlp", num_classes=10, input_dim=64, hidden=(256, 128))

        def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.randn(n, 64), torch.randint(0, 10, (n,))
    else:
        model = build_model(name, num_classes=10, in_channels=3, image_size=32)

        def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,))
    return model, batch


class Runner:
    """One configuration: model copy, optimizer, gradient averager, communicators."""

    def __init__(self, base: nn.Module, make_opt: Callable[[nn.Module, Communicator], Any]) -> None:
        self.model = copy.deepcopy(base)
        self.opt_comm = Communicator(MPI.COMM_WORLD.Dup(), name="optimizer")
        self.grad_comm = Communicator(MPI.COMM_WORLD.Dup(), name="gradients")
        self.averager = GradientAverager(self.model, self.grad_comm)
        self.opt = make_opt(self.model, self.opt_comm)

    def iteration(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(self.model(x), y)
        loss.backward()
        self.averager.synchronize()
        t1 = time.perf_counter()
        self.opt.step()
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1


def state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(v.numel() * v.element_size() for s in opt.state.values()
               for v in (s.values() if isinstance(s, dict) else [])
               if isinstance(v, torch.Tensor))


def run_model(name: str, args: argparse.Namespace, comm: Communicator) -> dict[str, Any]:
    base, batch = make_model(name)
    torch.manual_seed(1 + comm.rank)
    x, y = batch(args.batch)
    runners = {
        "adam": Runner(base, lambda m, c: torch.optim.Adam(m.parameters(), lr=1e-3)),
        "shampoo": Runner(base, lambda m, c: DistributedShampoo(
            m.named_parameters(), lr=1e-3, max_preconditioner_dim=args.max_dim, comm=c)),
    }
    shampoo = runners["shampoo"].opt
    kinds = [("adam", "adam", None), ("shampoo root", "shampoo", 1),
             ("shampoo plain", "shampoo", NEVER)]
    samples: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for runner in runners.values():
        runner.iteration(x, y)  # first step: roots of every block, lazy state
        runner.opt_comm.reset_traffic()
        runner.grad_comm.reset_traffic()
    counted = defaultdict(int)
    for round_ in range(args.warmup + args.steps):
        for label, config, frequency in kinds:
            runner = runners[config]
            if frequency is not None:
                for group in shampoo.param_groups:
                    group["precondition_frequency"] = frequency
            comm.barrier()
            fwd_bwd, step = runner.iteration(x, y)
            counted[config] += 1
            worst = torch.tensor([fwd_bwd, step], dtype=torch.float64)
            comm.allreduce(worst, "max")
            if round_ >= args.warmup:
                samples[label].append((float(worst[0]), float(worst[1])))

    def med(label: str, part: int) -> float:
        return statistics.median(s[part] for s in samples[label])

    fwd_bwd = {label: med(label, 0) for label in samples}
    step = {label: med(label, 1) for label in samples}
    memory = shampoo.memory_bytes()
    state = sum(v for k, v in memory.items() if k != "buffers")
    gathered = comm.allgather_object((state, memory["buffers"]))
    n_params = sum(p.numel() for p in base.parameters())
    adam_fwd = fwd_bwd["adam"]
    adam_iter = adam_fwd + step["adam"]
    plain, root = step["shampoo plain"], step["shampoo root"]
    rows = [["adam", adam_fwd, step["adam"], adam_iter, 0.0]]
    for f in FREQUENCIES:
        amortised = plain + (root - plain) / f
        it = fwd_bwd["shampoo plain"] + amortised
        rows.append([f"shampoo F={f}", fwd_bwd["shampoo plain"], amortised, it,
                     100.0 * (it / adam_iter - 1.0)])
    traffic = {c: {"optimizer": r.opt_comm.traffic().snapshot(),
                   "gradients": r.grad_comm.traffic().snapshot()} for c, r in runners.items()}
    bytes_per_step = {
        c: {"optimizer": r.opt_comm.traffic().total_bytes / max(counted[c], 1),
            "gradients": r.grad_comm.traffic().total_bytes / max(counted[c], 1),
            "optimizer_calls": r.opt_comm.traffic().total_calls / max(counted[c], 1)}
        for c, r in runners.items()}
    return {
        "model": name, "params": n_params, "world_size": comm.size,
        "blocks": len(shampoo.layout.blocks), "max_dim": args.max_dim,
        "block_dims": sorted({d for b in shampoo.layout.blocks for d in b.shape}),
        "median_seconds": {"fwd_bwd": fwd_bwd, "step": step}, "table": rows,
        "bytes_per_step": bytes_per_step, "traffic": traffic,
        "memory": {"shampoo_state_max_rank": max(s for s, _ in gathered),
                   "shampoo_state_all_blocks": sum(s for s, _ in gathered),
                   "shampoo_buffers": gathered[0][1],
                   "shampoo_detail_rank0": memory if comm.rank == 0 else None,
                   "adam_state": state_bytes(runners["adam"].opt)},
        "steps": args.steps, "warmup": args.warmup, "batch_per_rank": args.batch,
    }


def report(result: dict[str, Any], markdown: bool) -> str:
    mib = 2**20
    mem = result["memory"]
    bps = result["bytes_per_step"]
    lines = [
        f"## {result['model']} ({result['params']:,} parameters, {result['blocks']} blocks, "
        f"max dim {result['max_dim']}), {result['world_size']} ranks",
        "",
        format_table(["config", "fwd+bwd s", "step s", "iteration s", "overhead %"],
                     result["table"], markdown=markdown),
        "",
        format_table(
            ["", "optimizer bytes/step", "optimizer calls/step", "gradient bytes/step",
             "state MiB/rank (max)", "state MiB, all blocks"],
            [["adam", bps["adam"]["optimizer"], bps["adam"]["optimizer_calls"],
              bps["adam"]["gradients"], mem["adam_state"] / mib, mem["adam_state"] / mib],
             ["shampoo", bps["shampoo"]["optimizer"], bps["shampoo"]["optimizer_calls"],
              bps["shampoo"]["gradients"],
              (mem["shampoo_state_max_rank"] + mem["shampoo_buffers"]) / mib,
              mem["shampoo_state_all_blocks"] / mib]],
            markdown=markdown),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="all", choices=["all", "mlp", "resnet20"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-dim", type=int, default=1024)
    parser.add_argument("--quick", action="store_true", help="3 steps, 1 warmup (smoke test)")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup = 3, 1
    torch.set_num_threads(1)
    comm = Communicator(MPI.COMM_WORLD.Dup(), name="bench")
    info = machine()
    models = ["mlp", "resnet20"] if args.model == "all" else [args.model]
    for name in models:
        result = run_model(name, args, comm)
        result["machine"] = info
        if comm.rank == 0:
            path = write_json(args.out / f"shampoo_step_{name}_n{comm.size}.json", result)
            print(report(result, args.markdown))
            print(f"\n{describe(info)}\nwrote {path}\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
