"""Whether two identical K-FAC runs in one process give the same bits, and where not.

On an H200 (benchmarks/RESULTS.md, GPU, fifth session) two runs of the narrow ResNet-50
of tests/gpu/test_step_graph_gpu.py were bitwise equal with cuDNN's deterministic
algorithms, but not under ``torch.use_deterministic_algorithms(True)`` with
``CUBLAS_WORKSPACE_CONFIG=:4096:8``: step 0 differed for one layer whose ``A`` (576 rows)
is decomposed on a side stream. This script separates the candidates (the sixth session:
the solves spread over streams, under that setting only; since then nothing is spread
under deterministic algorithms, and its rows say "1 used"):

* ``runs``: ``--runs`` one-step trainings per ``--streams`` value (K-FAC's
  ``decomposition_streams``), each compared with the first: the preconditioned gradients
  and every tensor of ``state_dict()`` (factors, decompositions), first difference named.
  State equal but gradients not: the preconditioning; factors equal but decompositions
  not: the eigensolver; a first run that differs from the later ones: initialisation;
* ``eigh``: ``--eigh-repeats`` decompositions of a fixed batch list (three SPD matrices
  of 576 rows among smaller ones) through :func:`kfac_hpc.solves.eigh_batches` on each
  ``--streams`` value, and ``torch.linalg.eigh`` on the calling stream, each compared
  with its first repeat: whether the library's concurrent solves are reproducible.

The process-wide modes come from the command line and the environment:
``--deterministic-algorithms`` (``torch.use_deterministic_algorithms(True,
warn_only=True)``), ``--no-fill`` (with it, ``fill_uninitialized_memory=False``),
``CUBLAS_WORKSPACE_CONFIG`` (read when CUDA starts: set it in the environment). cuDNN's
deterministic algorithms are always on (the model's own backward must be reproducible).

Example (the device session; about 30 s each)::

    # mpi4py from the wheels on a GPU machine without it (docs/gpu.md)
    launch/with-wheels -- env CUBLAS_WORKSPACE_CONFIG=:4096:8 \
        python3 benchmarks/reproducibility.py --device cuda --deterministic-algorithms
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch
from mpi4py import MPI
from torch import Tensor, nn

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # the checkout's package; its test models
from shared_cases import narrow_resnet50, narrow_resnet50_batches  # noqa: E402

from kfac_hpc import KFACPreconditioner  # noqa: E402
from kfac_hpc.comm import Communicator  # noqa: E402
from kfac_hpc.solves import SolvePlacement, eigh_batches, spreads_over_streams  # noqa: E402


def tensors(obj: Any, prefix: str = "") -> dict[str, Tensor]:
    """Every tensor in a nested state dict, by its path."""
    if isinstance(obj, Tensor):
        return {prefix: obj.detach().clone()}
    items = (obj.items() if isinstance(obj, dict)
             else enumerate(obj) if isinstance(obj, list | tuple) else ())
    out: dict[str, Tensor] = {}
    for key, value in items:
        out.update(tensors(value, f"{prefix}/{key}" if prefix else str(key)))
    return out


def one_step(device: torch.device, dtype: torch.dtype, streams: int
             ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """One K-FAC step (factors, decompositions, preconditioning) of the narrow ResNet-50:
    the preconditioned gradients and the preconditioner's state tensors."""
    model = narrow_resnet50().to(device=device, dtype=dtype)
    pre = KFACPreconditioner(model, comm=Communicator(MPI.COMM_SELF), damping=0.01,
                             lr=0.1, kl_clip=1e-3, inv_update_steps=3, factor_dtype=dtype,
                             inv_dtype=dtype, decomposition_streams=streams,
                             cuda_graphs=False)
    x, y = narrow_resnet50_batches(1, device)[0]
    nn.functional.cross_entropy(model(x.to(dtype)), y).backward()
    pre.step()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    state = tensors(pre.state_dict())
    pre.close()
    return grads, state


def differences(a: dict[str, Tensor], b: dict[str, Tensor]) -> tuple[int, str]:
    """How many entries of ``b`` differ bitwise from ``a``'s, and the first one's name."""
    differ = [k for k in b if k not in a or not torch.equal(a[k], b[k])]
    return len(differ), differ[0] if differ else "-"


def runs_section(device: torch.device, dtype: torch.dtype, args: argparse.Namespace) -> None:
    for streams in args.streams:
        first = one_step(device, dtype, streams)
        for run in range(1, args.runs):
            grads, state = one_step(device, dtype, streams)
            ng, fg = differences(first[0], grads)
            ns, fs = differences(first[1], state)
            print(f"runs: streams {streams}, run {run} vs 0: {ng}/{len(grads)} gradients "
                  f"differ (first: {fg}); {ns}/{len(state)} state tensors differ "
                  f"(first: {fs})", flush=True)


def spd(n: int, count: int, seed: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """``count`` fixed symmetric positive definite ``n x n`` matrices (rank-deficient
    sums of outer products plus a small multiple of the identity, as factors are)."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(count, max(n // 8, 1), n, generator=g, dtype=torch.float64)
    m = rows.mT @ rows + 1e-3 * torch.eye(n, dtype=torch.float64)
    return m.to(device=device, dtype=dtype)


def eigh_section(device: torch.device, dtype: torch.dtype, args: argparse.Namespace) -> None:
    batches = [spd(576, 3, 0, device, dtype), spd(288, 6, 1, device, dtype),
               spd(144, 8, 2, device, dtype), spd(65, 4, 3, device, dtype)]
    solvers: list[tuple[str, Any]] = [
        (f"eigh_batches, {s} stream(s) asked"
         f"{'' if spreads_over_streams(batches[0], s) or s == 1 else ', 1 used'}",
         lambda s=s: eigh_batches(batches, SolvePlacement(0, s))) for s in args.streams]
    solvers.append(("torch.linalg.eigh, calling stream",
                    lambda: [torch.linalg.eigh(b) for b in batches]))
    for name, solve in solvers:
        reference = [tuple(t.clone() for t in r) for r in solve()]
        differing = 0
        for _ in range(1, args.eigh_repeats):
            again = solve()
            differing += any(not torch.equal(x, y) for r, s in zip(reference, again)
                             for x, y in zip(r, s))
        print(f"eigh: {name}: {differing}/{args.eigh_repeats - 1} repeats differ from the "
              "first", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--streams", type=int, nargs="+", default=[8, 1],
                   help="decomposition_streams values (default: 8 1)")
    p.add_argument("--eigh-repeats", type=int, default=20)
    p.add_argument("--sections", nargs="+", choices=["runs", "eigh"], default=["runs", "eigh"])
    p.add_argument("--deterministic-algorithms", action="store_true",
                   help="torch.use_deterministic_algorithms(True, warn_only=True)")
    p.add_argument("--no-fill", action="store_true",
                   help="torch.utils.deterministic.fill_uninitialized_memory = False")
    args = p.parse_args()
    torch.backends.cudnn.deterministic = True
    if args.deterministic_algorithms:
        torch.use_deterministic_algorithms(True, warn_only=True)
    if args.no_fill:
        torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    print(f"# reproducibility: {device}, {dtype}, torch {torch.__version__}, deterministic "
          f"algorithms {torch.are_deterministic_algorithms_enabled()}, fill uninitialised "
          f"{torch.utils.deterministic.fill_uninitialized_memory}, "  # type: ignore[attr-defined]
          f"CUBLAS_WORKSPACE_CONFIG={os.environ.get('CUBLAS_WORKSPACE_CONFIG', '(unset)')}",
          flush=True)
    if "runs" in args.sections:
        runs_section(device, dtype, args)
    if "eigh" in args.sections:
        eigh_section(device, dtype, args)


if __name__ == "__main__":
    main()
