"""Eigenbasis refresh by subspace iteration against a fresh eigh: accuracy along training.

    python benchmarks/eigen_refresh.py [--model resnet20] [--steps 100] [--inv-steps 10]
        [--batch 32] [--damping 0.001] [--device cpu|cuda] [--markdown]
        [--out benchmarks/out]

Trains the CIFAR ResNet-20 (synthetic 32x32 data, fixed per step, SGD lr 0.1 with
K-FAC, damping ``--damping``, inverse updates every ``--inv-steps``) and, at every
inverse update ``k``, decomposes each factor ``F_k`` two ways: a fresh
``torch.linalg.eigh`` (the reference) and ``eigen_refresh="subspace"`` as the
preconditioner chains it, one subspace-iteration step from the previous refresh's basis
(``linalg.refresh_eigenbases``; the first update is an eigh). Reported per inverse update,
over all factors/layers: the worst and the median relative error of the reconstructed
factor ``‖F − QΛQᵀ‖_F / ‖F‖`` (refresh; eigh's own is ~1e-7 in float32), and of the
preconditioned gradient ``(A⊗G + γI)⁻¹ vec(∇W̄)`` against the one from the fresh
eigendecompositions, in float32; plus the time of both on the device for all factors.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from functools import partial
from pathlib import Path
from typing import Any

import torch
from mpi4py import MPI
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import OUT_DIR, format_table, timed, write_json

from kfac_hpc import KFACPreconditioner
from kfac_hpc.comm import Communicator
from kfac_hpc.kfac import linalg
from kfac_hpc.models import build_model


def rel(a: Tensor, b: Tensor) -> float:
    return float(torch.linalg.norm(a - b) / torch.linalg.norm(b).clamp(min=1e-300))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="resnet20")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--inv-steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--damping", type=float, default=0.001)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--out", type=Path, default=OUT_DIR)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = build_model(args.model, num_classes=10).to(device)
    pre = KFACPreconditioner(model, comm=Communicator(MPI.COMM_SELF), damping=args.damping,
                             inv_update_steps=args.inv_steps, kl_clip=None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    bases: dict[str, Tensor] = {}
    rows: list[list[str]] = []
    records: list[dict[str, Any]] = []
    for step in range(args.steps):
        x = torch.randn(args.batch, 3, 32, 32, generator=g).to(device)
        y = torch.randint(0, 10, (args.batch,), generator=g).to(device)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        grads = {n: c.grad_matrix(torch.float32) for n, c in pre.layers.items()}
        pre.step()
        opt.step()
        if step % args.inv_steps:
            continue
        averages = {n: avg for n, s in pre.factors.items() if (avg := s.average) is not None}
        names, factors = list(averages), list(averages.values())
        fresh_list, t_eigh = timed(partial(linalg.eigh_clamped_many, factors), device)
        fresh = {n: r for n, r in zip(names, fresh_list) if not isinstance(r, Exception)}
        if not bases:  # the first inverse update is an eigh in the preconditioner too
            bases = {n: q for n, (q, _) in fresh.items()}
            continue
        previous = [bases[n] for n in names]
        refreshed_list, t_refresh = timed(
            partial(linalg.refresh_eigenbases, factors, previous), device)
        refreshed = dict(zip(names, refreshed_list))
        bases = {n: q for n, (q, _) in refreshed.items()}
        factor_err = [rel(q @ torch.diag(lam) @ q.t(), averages[n])
                      for n, (q, lam) in refreshed.items()]
        grad_err = []
        for layer, grad in grads.items():
            a, gk = f"{layer}/A", f"{layer}/G"
            ref = linalg.precondition_eigen(grad, fresh[a][0], fresh[a][1], fresh[gk][0],
                                            fresh[gk][1], args.damping)
            got = linalg.precondition_eigen(grad, refreshed[a][0], refreshed[a][1],
                                            refreshed[gk][0], refreshed[gk][1], args.damping)
            grad_err.append(rel(got, ref))
        rec = {"step": step, "factor max": max(factor_err),
               "factor median": statistics.median(factor_err),
               "gradient max": max(grad_err), "gradient median": statistics.median(grad_err),
               "eigh s": t_eigh, "refresh s": t_refresh}
        records.append(rec)
        rows.append([str(step), f"{rec['factor median']:.1e}", f"{rec['factor max']:.1e}",
                     f"{rec['gradient median']:.1e}", f"{rec['gradient max']:.1e}",
                     f"{t_eigh * 1e3:.0f}", f"{t_refresh * 1e3:.0f}"])
        print(f"step {step}: factor error median {rec['factor median']:.1e} max "
              f"{rec['factor max']:.1e}; preconditioned gradient error median "
              f"{rec['gradient median']:.1e} max {rec['gradient max']:.1e}", flush=True)
    pre.close()
    print(f"# eigen_refresh: {args.model}, batch {args.batch}, damping {args.damping}, "
          f"inverse updates every {args.inv_steps} steps, {args.device}, "
          f"torch {torch.__version__}")
    print(format_table(["step", "factor err median", "factor err max", "V err median",
                        "V err max", "eigh ms", "refresh ms"], rows, args.markdown))
    path = write_json(args.out / f"eigen_refresh_{args.model}_{args.device}.json",
                      {"args": {k: str(v) for k, v in vars(args).items()},
                       "records": records})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
