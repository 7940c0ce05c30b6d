"""Shampoo's inverse roots per block size: eigh against the coupled Newton iteration.

    python benchmarks/shampoo_roots.py [--device cpu|cuda] [--max-dim 1024]
        [--factors random|real] [--steps T] [--epsilon 1e-12] [--dtypes float32 float64]
        [--per-size N] [--max-size S] [--check-every 1 5 10 100] [--tolerance 1e-4]
        [--max-iterations 100] [--repeats R] [--device-streams 2 4 8] [--no-rank-bounds]
        [--quick] [--markdown] [--out benchmarks/out]

The factors are those of ResNet-50's Shampoo blocks at ``max_preconditioner_dim``
``--max-dim`` (torchvision's ``resnet50()`` when it imports, else ``kfac_hpc.models``'):
every parameter is merged and tiled as ``DistributedShampoo`` does
(:func:`kfac_hpc.shampoo.blocking.block_param`), and a block of order k gives k factors
of its side lengths, each with root order ``p = 2k``. Up to ``--per-size`` blocks per
(factor size, p) are kept (0: all), sizes above ``--max-size`` dropped (0: none). Each
factor is Shampoo's at step ``T = --steps``: ``F ← β2·F + (1 − β2)·X_(i)X_(i)ᵀ`` with
``β2 = 0.999`` over T gradients, bias-corrected by ``1 − β2^T`` (at T = 1 a block's
factor has rank at most its other sides' product: a first root step; larger T
accumulates rank), from Gaussian block gradients (``--factors random``) or from real
gradients (``--factors real``: T forward/backward passes of the model on random
3x``--image-size``² batches of ``--batch`` images and labels, no parameter update).
Factors accumulate in float64 and are rounded to each ``--dtypes`` dtype (what a
``factor_dtype`` run would hold, to its rounding).

For each dtype and each (size, p), one batched call as a root step makes it
(:func:`kfac_hpc.shampoo.roots.inverse_roots` over the requests of that size): the
median ms over ``--repeats`` calls (device synchronised around each) of ``EigenRoots()``
(batched ``eigh``) and of ``NewtonRoots(tolerance, max_iterations, check_every)`` with
the first ``--check-every`` value; Newton's iterations (the most any matrix ran), host
reads, the float32 factors sent to the eigen path without iterating because their rank
bound (``T·k`` for a factor summing products of ``k`` columns, as Shampoo computes it;
``--no-rank-bounds``: none) is below their size (``by rank``), and those it gave up on
(``fallback``); and the relative
Frobenius error ``‖R − R₆₄‖ / ‖R₆₄‖`` of both against the float64 ``eigh`` root ``R₆₄`` of the
same (rounded) factor (max over the matrices; for float64 factors eigh's is 0 by
construction). ``u·λmax/ε`` (``u`` the dtype's unit roundoff, ``λmax`` the largest
eigenvalue of the size's factors) is how much the dtype's rounding of a factor moves
``λ + ε`` in its (near-)null directions, relative: where it is not small, the roots
there are set by rounding, and two methods (or eigh in two dtypes) differ by about
that over ``p``. Then one call over every size at once
(``all``: a whole root step) for each ``--check-every`` value: how the host reads
(one per check) trade against the iterations run (converged matrices leave at checks),
and the same root step by eigh with its batches spread over each ``--device-streams``
count of CUDA streams (``decomposition_streams``; cuSOLVER's ``syevd`` reads its status
on the host, so one stream leaves the device idle between calls).

Writes ``shampoo_roots_<device>.json`` under ``--out`` and prints the tables (Markdown
with ``--markdown``). On the CPU use small sizes (``--quick``: ``--max-size 256
--per-size 2 --repeats 1``); its times are a dry run of the code, not GPU numbers.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    OUT_DIR,
    NoGPUError,
    describe,
    format_table,
    imagenet_resnet50,
    machine,
    select_device,
    synchronize,
    write_json,
)

from kfac_hpc.shampoo import EigenRoots, NewtonRoots
from kfac_hpc.shampoo.blocking import BlockSpec, block_param
from kfac_hpc.shampoo.roots import RootRequest, inverse_roots, newton_inverse_roots
from kfac_hpc.solves import SolvePlacement

BETA2 = 0.999
DTYPES = {"float32": torch.float32, "float64": torch.float64}
#: (factor size, p) -> the factors of that kind (float64, bias-corrected), each with the
#: bound of its rank Shampoo knows from its block's shape and step count
Factors = dict[tuple[int, int], list[tuple[Tensor, int]]]


def select_blocks(model: torch.nn.Module, max_dim: int, per_size: int, max_size: int
                  ) -> list[tuple[str, BlockSpec]]:
    """The blocks whose factors are measured: up to ``per_size`` per (size, p)."""
    taken: dict[tuple[int, int], int] = {}
    chosen = []
    for name, p in model.named_parameters():
        for spec in block_param(name, tuple(p.shape), max_dim):
            kinds = [(d, 2 * len(spec.shape)) for d in spec.shape]
            if max_size and max(spec.shape) > max_size:
                continue
            if per_size and all(taken.get(k, 0) >= per_size for k in kinds):
                continue
            for k in kinds:
                taken[k] = taken.get(k, 0) + 1
            chosen.append((name, spec))
    return chosen


def mode_gram(x: Tensor, i: int) -> Tensor:
    """``X_(i) X_(i)ᵀ``: the mode-i unfolding's Gram matrix."""
    rows = x.movedim(i, 0).reshape(x.shape[i], -1)
    return rows @ rows.T


def accumulate(model: torch.nn.Module, blocks: list[tuple[str, BlockSpec]], steps: int,
               gradients: Callable[[], dict[str, Tensor]], device: torch.device) -> Factors:
    """Shampoo's bias-corrected running-average factors of ``blocks`` after ``steps``."""
    sums: dict[tuple[str, int, int], Tensor] = {}
    for _ in range(steps):
        grads = gradients()
        for name, spec in blocks:
            x = grads[name].to(device, torch.float64).reshape(spec.merged_shape)[spec.slices]
            for i in range(len(spec.shape)):
                key = (name, spec.index, i)
                update = mode_gram(x, i) * (1 - BETA2)
                sums[key] = update if key not in sums else sums[key].mul_(BETA2).add_(update)
    factors: Factors = {}
    for name, spec in blocks:
        numel = math.prod(spec.shape)
        for i, d in enumerate(spec.shape):
            factors.setdefault((d, 2 * len(spec.shape)), []).append(
                (sums[(name, spec.index, i)] / (1 - BETA2**steps), steps * (numel // d)))
    return dict(sorted(factors.items()))


def random_gradients(model: torch.nn.Module, device: torch.device
                     ) -> Callable[[], dict[str, Tensor]]:
    def draw() -> dict[str, Tensor]:
        return {n: torch.randn(p.shape, device=device) for n, p in model.named_parameters()}
    return draw


def real_gradients(model: torch.nn.Module, device: torch.device, batch: int, size: int
                   ) -> Callable[[], dict[str, Tensor]]:
    def compute() -> dict[str, Tensor]:
        x = torch.randn(batch, 3, size, size, device=device)
        y = torch.randint(0, 1000, (batch,), device=device)
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        return {n: p.grad.detach().clone() for n, p in model.named_parameters()
                if p.grad is not None}
    return compute


def timed(fn: Callable[[], Any], device: torch.device, repeats: int) -> tuple[float, Any]:
    """Median ms of ``repeats`` calls (device synchronised around each), and the last result."""
    times, result = [], None
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        result = fn()
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), result


def errors(roots: Tensor, references: Tensor) -> list[float]:
    """Relative Frobenius error of each root against its float64 reference."""
    diff = torch.linalg.matrix_norm(roots.double() - references)
    relative: list[float] = (diff / torch.linalg.matrix_norm(references)).tolist()
    return relative


def reference_roots(factors: Tensor, p: int, epsilon: float) -> tuple[Tensor, float]:
    """float64 ``eigh`` roots of ``factors`` (as rounded to their dtype), and the largest
    eigenvalue of any of them."""
    values, vectors = torch.linalg.eigh(factors.double())
    roots = (vectors * (values.clamp(min=0) + epsilon).pow(-1.0 / p).unsqueeze(-2)) @ vectors.mT
    return roots, float(values[:, -1].max())


def measure(factors: Factors, dtype: torch.dtype, args: argparse.Namespace,
            device: torch.device) -> dict[str, Any]:
    """Per (size, p), then all sizes at once, for one dtype."""
    eigen = EigenRoots()
    newton = NewtonRoots(args.max_iterations, args.tolerance, args.check_every[0])
    rows = []
    requests_all = []
    for (n, p), mats in factors.items():
        # one request per rank bound (as Shampoo makes one per run of same-shape blocks)
        bounds = sorted({b for _, b in mats}) if args.rank_bounds else [None]
        requests = [RootRequest(torch.stack([f for f, b in mats if bound in (None, b)]).to(dtype),
                                1.0, float(p), args.epsilon, bound) for bound in bounds]
        stacked = torch.cat([r.factors for r in requests])
        requests_all += requests
        eigen_ms, eigen_results = timed(
            partial(inverse_roots, requests, method=eigen), device, args.repeats)
        newton_ms, (newton_results, run) = timed(
            partial(newton_inverse_roots, requests, newton), device, args.repeats)
        reference, top = reference_roots(stacked, p, args.epsilon)
        direct = sum(r.factors.shape[0] for r in requests if _skips_newton(r))
        rows.append({
            "size": n, "p": p, "count": len(mats), "eigh_ms": eigen_ms, "newton_ms": newton_ms,
            "iterations": max((i for o in run.outcomes for i in o.iterations), default=0),
            "host_reads": run.host_reads, "by_rank": direct,
            "fallback": sum(not c for o in run.outcomes for c in o.converged),
            "newton_error": max(errors(torch.cat([r.roots for r in newton_results]), reference)),
            "eigh_error": max(errors(torch.cat([r.roots for r in eigen_results]), reference)),
            "noise": torch.finfo(dtype).eps / 2 * top / args.epsilon,
            "failed": sum(sum(r.failed) for r in newton_results)})
    eigen_ms, _ = timed(partial(inverse_roots, requests_all, method=eigen), device, args.repeats)
    streams = [{"streams": count, "eigh_ms": timed(partial(
        inverse_roots, requests_all, method=eigen,
        placement=SolvePlacement(device_streams=count)), device, args.repeats)[0]}
        for count in args.device_streams]
    sweep = []
    for every in args.check_every:
        method = NewtonRoots(args.max_iterations, args.tolerance, every)
        ms, (_, run) = timed(partial(newton_inverse_roots, requests_all, method), device,
                             args.repeats)
        sweep.append({"check_every": every, "newton_ms": ms, "host_reads": run.host_reads,
                      "iterations": run.iterations,
                      "matrix_iterations": sum(sum(o.iterations) for o in run.outcomes),
                      "fallback": sum(not c for o in run.outcomes for c in o.converged)})
    return {"sizes": rows, "all": {
        "count": sum(len(m) for m in factors.values()), "eigh_ms": eigen_ms, "newton": sweep,
        "streams": streams,
        "by_rank": sum(r.factors.shape[0] for r in requests_all if _skips_newton(r))}}


def _skips_newton(request: RootRequest) -> bool:
    """Whether Newton hands the request to eigh at once (float32, known rank-deficient)."""
    bound = request.rank_bound
    return (request.factors.dtype == torch.float32 and bound is not None
            and bound < request.factors.shape[-1])


def report(result: dict[str, Any], markdown: bool) -> str:
    out = []
    for dtype, res in result["dtypes"].items():
        rows = [[r["size"], r["p"], r["count"], r["eigh_ms"], r["newton_ms"],
                 r["eigh_ms"] / r["newton_ms"], r["iterations"], r["host_reads"],
                 r["by_rank"], r["fallback"], f"{r['noise']:.0e}", f"{r['eigh_error']:.1e}",
                 f"{r['newton_error']:.1e}"]
                for r in res["sizes"]]
        out.append(f"\n{dtype} factors, eps {result['epsilon']:g}, "
                   f"{result['factors']} gradients, T = {result['steps']}, tolerance "
                   f"{result['tolerance']:g}, check every {result['check_every'][0]}:\n")
        out.append(format_table(
            ["size", "p", "count", "eigh ms", "newton ms", "speed-up", "iterations",
             "host reads", "by rank", "fallback", "u·λmax/ε", "eigh err", "newton err"], rows,
            markdown))
        whole = res["all"]
        sweep = [[s["check_every"], s["newton_ms"], whole["eigh_ms"] / s["newton_ms"],
                  s["host_reads"], s["iterations"], s["matrix_iterations"], s["fallback"]]
                 for s in whole["newton"]]
        out.append(f"\nall {whole['count']} {dtype} factors in one call ({whole['by_rank']} "
                   f"by rank to eigh): eigh {whole['eigh_ms']:.1f} ms; Newton:\n")
        out.append(format_table(["check every", "newton ms", "speed-up", "host reads",
                                 "iterations", "matrix-iterations", "fallback"], sweep,
                                markdown))
        if whole["streams"]:
            out.append(f"\nthe same {dtype} root step by eigh over CUDA streams "
                       "(decomposition_streams):\n")
            out.append(format_table(
                ["streams", "eigh ms", "speed-up"],
                [[s["streams"], s["eigh_ms"], whole["eigh_ms"] / s["eigh_ms"]]
                 for s in whole["streams"]], markdown))
    return "\n".join(out)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--max-dim", type=int, default=1024)
    parser.add_argument("--factors", choices=["random", "real"], default=None,
                        help="Gaussian or real ResNet-50 gradients (default: real on CUDA, "
                             "random on the CPU)")
    parser.add_argument("--steps", type=int, default=1,
                        help="gradients accumulated into each factor (default 1: a first "
                             "root step)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--epsilon", type=float, default=1e-12)
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES),
                        default=["float32", "float64"])
    parser.add_argument("--per-size", type=int, default=0,
                        help="blocks per (factor size, p), 0: all")
    parser.add_argument("--max-size", type=int, default=0, help="largest factor size, 0: all")
    parser.add_argument("--check-every", type=int, nargs="+", default=[5, 1, 10, 100])
    parser.add_argument("--tolerance", type=float, default=NewtonRoots().tolerance)
    parser.add_argument("--max-iterations", type=int, default=NewtonRoots().max_iterations)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device-streams", type=int, nargs="*", default=[2, 4, 8],
                        help="the whole root step by eigh spread over this many CUDA streams "
                             "and worker threads each (decomposition_streams; none: skip)")
    parser.add_argument("--rank-bounds", action=argparse.BooleanOptionalAction, default=True,
                        help="give each request its factors' rank bound, as Shampoo does "
                             "(float32 factors known rank-deficient skip Newton; default on)")
    parser.add_argument("--quick", action="store_true",
                        help="--max-size 256 --per-size 2 --repeats 1 (a CPU dry run)")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    args = parser.parse_args(argv)
    if args.quick:
        args.max_size, args.per_size, args.repeats = args.max_size or 256, 2, 1
    if args.factors is None:
        args.factors = "real" if args.device == "cuda" else "random"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        device = select_device(args.device)
    except NoGPUError as e:
        print(e, file=sys.stderr)
        return 1
    info = machine()
    torch.manual_seed(0)
    model, what = imagenet_resnet50(1000, args.image_size)
    blocks = select_blocks(model, args.max_dim, args.per_size, args.max_size)
    print(f"# shampoo_roots: {describe(info)}; device {device}; {what}, max dim "
          f"{args.max_dim}: {len(blocks)} blocks measured", flush=True)
    if args.factors == "real":
        model.to(device)
        gradients = real_gradients(model, device, args.batch, args.image_size)
    else:
        gradients = random_gradients(model, device)
    factors = accumulate(model, blocks, args.steps, gradients, device)
    del model
    result: dict[str, Any] = {
        "machine": info, "device": str(device), "model": what, "max_dim": args.max_dim,
        "factors": args.factors, "steps": args.steps, "epsilon": args.epsilon,
        "tolerance": args.tolerance, "max_iterations": args.max_iterations,
        "check_every": args.check_every, "repeats": args.repeats, "dtypes": {}}
    for name in args.dtypes:
        result["dtypes"][name] = measure(factors, DTYPES[name], args, device)
    path = write_json(args.out / f"shampoo_roots_{device.type}.json", result)
    print(report(result, args.markdown))
    print(f"\n{describe(info)}\nwrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
