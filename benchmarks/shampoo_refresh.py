"""Shampoo's roots from refreshed eigenbases against fresh ``eigh``: accuracy, time, loss.

    python benchmarks/shampoo_refresh.py [--model resnet20] [--steps 300] [--frequency 10]
        [--fresh-every 10] [--tolerance 0.05] [--batch 32] [--max-dim 1024]
        [--device cpu|cuda] [--markdown] [--out benchmarks/out]

Trains the same model twice from the same initial weights on the same synthetic batches
(32x32 images, or 224x224 for ``--model resnet50``; labels fixed per step) with
AdamW-grafted Shampoo (betas (0.9, 0.999), epsilon 1e-12, lr 1e-3, weight decay 1e-4,
roots every ``--frequency`` steps): once with ``root_method=EigenRoots()`` and once with
``SubspaceRoots(fresh_every, tolerance)``. At every root step of the subspace run it
also computes that run's roots by a fresh ``eigh`` of the very same factors (the
reference), and reports per root step:

* how many matrices were refreshed, and how many of those drifted past the tolerance
  and were recomputed;
* over the refreshed ones kept: the median and largest share of the factor left off the
  diagonal ``r = ‖F − QΛQᵀ‖_F / ‖F‖_F``, and the relative error of the root
  ``‖R − R₆₄‖_F / ‖R₆₄‖_F`` against the root ``R₆₄`` of the same (float32) factor by a
  float64 ``eigh``; beside it the same error of the float32 ``eigh``'s root (what
  ``EigenRoots`` computes): with ε = 1e-12 the roots of rank-deficient factors are
  dominated by eigenvalues at float32's resolution, which no float32 method gets right;
  and, for scale, the median error of the previous root step's roots (float64) against
  this step's: what every step between two root steps preconditions with;
* the root computation's time (all matrices, device synchronised) with the subspace
  method and with ``eigh``, on the same factors.

At the end: the mean training loss of the last tenth of the steps of both runs (the
runs see the same batches; their losses differ by what the roots change).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from mpi4py import MPI
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import OUT_DIR, format_table, imagenet_resnet50, timed, write_json

import kfac_hpc.shampoo.optimizer as shampoo_optimizer
from kfac_hpc.comm import Communicator
from kfac_hpc.models import build_model
from kfac_hpc.shampoo import DistributedShampoo, EigenRoots, RootMethod, SubspaceRoots
from kfac_hpc.shampoo.roots import RootRequest, RootResult, inverse_roots
from kfac_hpc.solves import DEFAULT_PLACEMENT


def share_off_diagonal(f: Tensor, q: Tensor) -> float:
    """``‖F − Q diag(QᵀFQ) Qᵀ‖_F / ‖F‖_F`` in float64."""
    f, q = f.double(), q.double()
    inner = q.T @ f @ q
    off = inner - torch.diag(inner.diagonal())
    return float(torch.linalg.norm(off) / torch.linalg.norm(f).clamp(min=1e-300))


def relative(a: Tensor, b: Tensor) -> float:
    return float(torch.linalg.norm((a - b).double())
                 / torch.linalg.norm(b.double()).clamp(min=1e-300))


class RootProbe:
    """Wraps the optimizer's ``inverse_roots``: times it and checks it against ``eigh``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.records: list[dict[str, Any]] = []
        self.step = 0
        self._previous: list[Tensor] = []  # the last root step's float64 roots, per request

    def __call__(self, requests: list[RootRequest], **kwargs: Any) -> list[RootResult]:
        results, elapsed = timed(lambda: inverse_roots(requests, **kwargs), self.device)
        plain = [RootRequest(r.factors, r.correction, r.p, r.epsilon, r.rank_bound)
                 for r in requests]
        placement = kwargs.get("placement", DEFAULT_PLACEMENT)
        reference, eigh_time = timed(lambda: inverse_roots(plain, placement=placement),
                                     self.device)
        exact = inverse_roots([RootRequest(r.factors.double(), r.correction, r.p, r.epsilon)
                               for r in requests])
        refreshed = kept = 0
        shares: list[float] = []
        errors: list[float] = []
        eigh_errors: list[float] = []
        stale_errors: list[float] = []
        previous = self._previous if len(self._previous) == len(requests) else []
        for k, ref64 in enumerate(exact):
            if previous and previous[k].shape == ref64.roots.shape:
                stale_errors += [relative(a, b) for a, b in zip(previous[k], ref64.roots)]
        self._previous = [ref64.roots for ref64 in exact]
        for request, result, ref, ref64 in zip(requests, results, reference, exact):
            if request.bases is None or result.bases is None:
                continue
            assert result.refreshed is not None  # which refreshes the method kept
            factors = request.factors / request.correction
            for j, kept_refresh in enumerate(result.refreshed):
                refreshed += 1
                if result.failed[j] or not kept_refresh:
                    continue  # recomputed by the eigen path
                kept += 1
                shares.append(share_off_diagonal(factors[j], result.bases[j]))
                errors.append(relative(result.roots[j], ref64.roots[j]))
                eigh_errors.append(relative(ref.roots[j], ref64.roots[j]))
        matrices = sum(r.factors.shape[0] for r in requests)
        self.records.append({
            "step": self.step, "matrices": matrices, "refreshed": refreshed,
            "recomputed": refreshed - kept,
            "share median": statistics.median(shares) if shares else None,
            "share max": max(shares) if shares else None,
            "root error median": statistics.median(errors) if errors else None,
            "root error max": max(errors) if errors else None,
            "eigh error median": statistics.median(eigh_errors) if eigh_errors else None,
            "eigh error max": max(eigh_errors) if eigh_errors else None,
            "stale error median": statistics.median(stale_errors) if stale_errors else None,
            "time s": elapsed, "eigh time s": eigh_time})
        return results


def make_model(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "resnet50":
        return imagenet_resnet50(num_classes=10)[0]
    return build_model(name, num_classes=10)


def train(args: argparse.Namespace, method: RootMethod, probe: RootProbe | None
          ) -> list[float]:
    """Train one run; return its losses."""
    device = torch.device(args.device)
    model = make_model(args.model).to(device)
    opt = DistributedShampoo(
        model.named_parameters(), lr=1e-3, betas=(0.9, 0.999), epsilon=1e-12,
        weight_decay=1e-4, max_preconditioner_dim=args.max_dim,
        precondition_frequency=args.frequency, grafting="adam", grafting_beta2=0.999,
        grafting_epsilon=1e-8, comm=Communicator(MPI.COMM_SELF), root_method=method)
    side = 224 if args.model == "resnet50" else 32
    g = torch.Generator().manual_seed(1)
    losses: list[float] = []
    real = getattr(shampoo_optimizer, "inverse_roots")  # noqa: B009 (replaced below)
    if probe is not None:
        setattr(shampoo_optimizer, "inverse_roots", probe)  # noqa: B010
    try:
        for step in range(args.steps):
            x = torch.randn(args.batch, 3, side, side, generator=g).to(device)
            y = torch.randint(0, 10, (args.batch,), generator=g).to(device)
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            if probe is not None:
                probe.step = step + 1
            opt.step()
            losses.append(float(loss.detach()))
            if (step + 1) % max(1, args.steps // 10) == 0:
                print(f"  {type(method).__name__} step {step + 1}: loss {losses[-1]:.4f}",
                      flush=True)
    finally:
        setattr(shampoo_optimizer, "inverse_roots", real)  # noqa: B010
    return losses


def _fmt(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="resnet20")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--frequency", type=int, default=10, help="precondition_frequency")
    p.add_argument("--fresh-every", type=int, default=SubspaceRoots().fresh_every)
    p.add_argument("--tolerance", type=float, default=SubspaceRoots().tolerance)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-dim", type=int, default=1024)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--out", type=Path, default=OUT_DIR)
    args = p.parse_args(argv)
    method = SubspaceRoots(fresh_every=args.fresh_every, tolerance=args.tolerance)
    print(f"eigen run ({args.steps} steps)", flush=True)
    eigen_losses = train(args, EigenRoots(), None)
    print(f"subspace run: {method}", flush=True)
    probe = RootProbe(torch.device(args.device))
    subspace_losses = train(args, method, probe)
    rows = [[str(r["step"]), str(r["matrices"]), str(r["refreshed"]), str(r["recomputed"]),
             _fmt(r["share median"], ".1e"), _fmt(r["share max"], ".1e"),
             _fmt(r["root error median"], ".1e"), _fmt(r["root error max"], ".1e"),
             _fmt(r["eigh error median"], ".1e"), _fmt(r["eigh error max"], ".1e"),
             _fmt(r["stale error median"], ".1e"),
             f"{r['time s'] * 1e3:.0f}", f"{r['eigh time s'] * 1e3:.0f}"]
            for r in probe.records]
    tail = max(1, args.steps // 10)
    final = (statistics.fmean(eigen_losses[-tail:]), statistics.fmean(subspace_losses[-tail:]))
    refreshed_rounds = [r for r in probe.records if r["refreshed"]]
    time_ratio = (sum(r["time s"] for r in refreshed_rounds)
                  / max(1e-12, sum(r["eigh time s"] for r in refreshed_rounds)))
    print(f"# shampoo_refresh: {args.model}, batch {args.batch}, {args.steps} steps, roots "
          f"every {args.frequency}, max dim {args.max_dim}, {method}, {args.device}, "
          f"torch {torch.__version__}")
    print(format_table(["step", "matrices", "refreshed", "recomputed", "r median", "r max",
                        "root err median", "root err max", "eigh err median", "eigh err max",
                        "stale err median", "root ms", "eigh ms"],
                       rows, args.markdown))
    print(f"root steps with refreshes: time {time_ratio:.2f}x eigh's on the same factors")
    print(f"mean loss of the last {tail} steps: eigen {final[0]:.4f}, subspace {final[1]:.4f}")
    path = write_json(args.out / f"shampoo_refresh_{args.model}_{args.device}.json",
                      {"args": {k: str(v) for k, v in vars(args).items()},
                       "records": probe.records, "eigen losses": eigen_losses,
                       "subspace losses": subspace_losses,
                       "time ratio on refresh steps": time_ratio})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
