"""Shampoo's product precisions in training: float64 factors, float32, float32 with TF32 products.

    python benchmarks/shampoo_precision.py [--steps 60] [--seeds 3] [--device cpu|cuda]

The package's ResNet-20 trained from the same weights on the same 8 synthetic batches
(batch 32, 32x32, 10 classes; cycled, so the loss falls as the batches are fitted) with
AdamW-grafted Shampoo (betas (0.9, 0.999), epsilon 1e-12, lr 1e-3, decoupled weight
decay 1e-4, roots every 10 steps), three ways: float64 factors (the reference), float32
factors with full float32 products (the default), and float32 with
``stats_precision="tf32"`` and ``precondition_precision="tf32"`` (on the CPU the
operands are rounded to TF32 explicitly, the same numbers a GPU's tensor cores use up
to summation order). Per seed it prints each float32 run's update (parameter change)
against the float64 run's at steps 1, 2, 11 and the last (relative 2-norm; after step 1
the runs have moved apart, so later rows mix rounding with the trajectories'
divergence), the mean loss of the last 20 steps, and the final parameters' distance
from the float64 run's.
"""

from __future__ import annotations

import argparse
import time

import torch
from mpi4py import MPI
from torch import Tensor, nn

from kfac_hpc.comm import Communicator
from kfac_hpc.models import build_model
from kfac_hpc.shampoo import DistributedShampoo

RUNS = {  # label: (factor dtype, product precision)
    "float64": (torch.float64, "full"),
    "float32": (torch.float32, "full"),
    "tf32": (torch.float32, "tf32"),
}


def train(steps: int, seed: int, dtype: torch.dtype, precision: str, device: torch.device
          ) -> tuple[list[float], list[Tensor], Tensor]:
    """Losses, per-step updates and final parameters (flattened) of one run."""
    torch.manual_seed(seed)
    model = build_model("resnet20", num_classes=10).to(device)
    opt = DistributedShampoo(
        model.named_parameters(), lr=1e-3, betas=(0.9, 0.999), epsilon=1e-12,
        weight_decay=1e-4, decoupled_weight_decay=True, precondition_frequency=10,
        grafting="adam", comm=Communicator(MPI.COMM_SELF), factor_dtype=dtype,
        stats_precision=precision, precondition_precision=precision)
    g = torch.Generator().manual_seed(seed + 1)
    batches = [(torch.randn(32, 3, 32, 32, generator=g).to(device),
                torch.randint(0, 10, (32,), generator=g).to(device)) for _ in range(8)]
    losses: list[float] = []
    updates: list[Tensor] = []
    for k in range(steps):
        x, y = batches[k % len(batches)]
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        losses.append(loss.item())
        updates.append(torch.cat([(p.detach() - b).flatten().double()
                                  for p, b in zip(model.parameters(), before)]))
    return losses, updates, torch.cat([p.detach().flatten().double()
                                       for p in model.parameters()])


def relative(a: Tensor, b: Tensor) -> float:
    """``‖a − b‖ / ‖b‖``."""
    return float((a - b).norm() / b.norm())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    start = time.perf_counter()
    at = sorted({0, 1, min(10, args.steps - 1), args.steps - 1})
    print(f"# Shampoo, ResNet-20, {args.steps} steps, {args.device}, torch {torch.__version__}")
    print(f"| seed | run | update vs float64 at steps {', '.join(str(k + 1) for k in at)} "
          "| loss, last 20 | params vs float64 |")
    print("|---:|---|---|---:|---:|")
    for seed in range(args.seeds):
        results = {label: train(args.steps, seed, dtype, precision, device)
                   for label, (dtype, precision) in RUNS.items()}
        _, ref_updates, ref_params = results["float64"]
        for label, (losses, updates, params) in results.items():
            tail = losses[-20:]
            errors = ("–" if label == "float64" else
                      " / ".join(f"{relative(updates[k], ref_updates[k]):.2e}" for k in at))
            distance = "–" if label == "float64" else f"{relative(params, ref_params):.3f}"
            print(f"| {seed} | {label} | {errors} | {sum(tail) / len(tail):.4f} | {distance} |")
    print(f"# {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
