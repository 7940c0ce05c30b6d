"""A convolution's expand ``A`` three ways: patch rows, the CPU's symmetric update, shifts.

    python benchmarks/conv_shifts.py [--device cpu|cuda] [--precision full|tf32|bf16]
                                     [--batches 32 128] [--repeat 7] [--quick]

Per stride-1 3x3 convolution of ResNet-20 (CIFAR maps) and ResNet-50 (ImageNet maps),
one process, no MPI: the best of ``--repeat`` interleaved calls of

* ``rows``: the patch rows (:func:`~kfac_hpc.kfac.patches.patch_rows`) and one GEMM
  (:func:`~kfac_hpc.kfac.linalg.covariance`), the GPU path;
* ``symmetric``: :func:`~kfac_hpc.kfac.patches.patch_covariance` (rows built in chunks,
  upper block rows only), the CPU path before shifts (CPU, full precision only);
* ``shifts``: :func:`~kfac_hpc.kfac.shifts.shifted_covariance`;

with the multiply-adds of the shifts over those of the symmetric update, whether the
CPU's rule (:func:`~kfac_hpc.kfac.shifts.pays`) takes the shifts, and the relative
difference of the shifts' factor from the rows' in float64 (CPU) or in the chosen
precision (CUDA). Writes ``benchmarks/out/conv_shifts_<device>.json``.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import format_table, machine, select_device, timed, write_json

from kfac_hpc.kfac import shifts
from kfac_hpc.kfac.linalg import covariance
from kfac_hpc.kfac.patches import patch_covariance, patch_rows

KERNEL, STRIDE, DILATION, PADS = (3, 3), (1, 1), (1, 1), (1, 1, 1, 1)

#: (model, channels, map size) of the stride-1 3x3 convolutions
LAYERS = [("resnet20", 16, 32), ("resnet20", 32, 16), ("resnet20", 64, 8),
          ("resnet50", 64, 56), ("resnet50", 128, 28), ("resnet50", 256, 14),
          ("resnet50", 512, 7)]


def best_interleaved(fns: dict[str, Callable[[], Any]], repeat: int,
                     device: torch.device) -> dict[str, float]:
    """Best seconds of each function, called round-robin after one warm-up call each."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, math.inf)
    for _ in range(repeat):
        for key, fn in fns.items():
            best[key] = min(best[key], timed(fn, device)[1])
    return best


def measure(model: str, c: int, hw: int, b: int, args: argparse.Namespace,
            device: torch.device) -> dict[str, Any]:
    """One layer at one batch size: times, flops model, decision and difference."""
    torch.manual_seed(0)
    x = torch.randn(b, c, hw, hw, device=device)
    p = args.precision
    fns: dict[str, Callable[[], Any]] = {
        "rows": lambda: covariance(patch_rows(x, KERNEL, STRIDE, DILATION, PADS), precision=p),
        "shifts": lambda: shifts.shifted_covariance(x, KERNEL, DILATION, PADS, precision=p),
    }
    if device.type == "cpu" and p == "full":
        fns["symmetric"] = lambda: patch_covariance(x, KERNEL, STRIDE, DILATION, PADS)
    times = best_interleaved(fns, args.repeat, device)
    ref_x = x[:4].double() if device.type == "cpu" else x[:4]
    ref = covariance(patch_rows(ref_x, KERNEL, STRIDE, DILATION, PADS), precision=p)
    got = shifts.shifted_covariance(ref_x, KERNEL, DILATION, PADS, precision=p)
    shifted, rows = shifts.shifted_products_flops(b, hw, hw, KERNEL, DILATION, PADS)
    return {"model": model, "channels": c, "map": hw, "batch": b,
            "ms": {k: v * 1e3 for k, v in times.items()},
            "flops_ratio": shifted / (rows / 2),
            "pays": shifts.pays(x, KERNEL, STRIDE, DILATION, PADS, "cpu"),
            "rel_diff": float((got - ref).norm() / ref.norm())}


def show(results: list[dict[str, Any]]) -> None:
    """Print the markdown table."""
    rows = []
    for r in results:
        ms = r["ms"]
        other = min(v for k, v in ms.items() if k != "shifts")
        rows.append([f"{r['model']} {r['channels']}ch {r['map']}x{r['map']}", r["batch"],
                     f"{ms['rows']:.1f}", f"{ms.get('symmetric', math.nan):.1f}",
                     f"{ms['shifts']:.1f}", f"{ms['shifts'] / other:.2f}",
                     f"{r['flops_ratio']:.2f}", "yes" if r["pays"] else "no",
                     f"{r['rel_diff']:.1e}"])
    print(format_table(["layer", "batch", "rows ms", "symmetric ms", "shifts ms",
                        "shifts / best other", "flops shifts / symmetric", "CPU takes it",
                        "rel diff"], rows, markdown=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--precision", choices=["full", "tf32", "bf16"], default="full")
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="two small layers, batch 8 (smoke)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "out")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = select_device(args.device)
    layers = [LAYERS[0], LAYERS[2]] if args.quick else LAYERS
    batches = [8] if args.quick else args.batches
    results = []
    with torch.no_grad():
        for model, c, hw in layers:
            for b in batches:
                if model == "resnet50" and b * c * hw * hw * 9 > 2**29:
                    continue  # patch rows over 2 GiB: too large for the rows path here
                results.append(measure(model, c, hw, b, args, device))
                print(f"# {model} {c}ch {hw}x{hw} batch {b}: "
                      + ", ".join(f"{k} {v:.1f} ms" for k, v in results[-1]["ms"].items()),
                      flush=True)
    info = machine()
    name = (torch.cuda.get_device_name(device) if device.type == "cuda"
            else info.get("cpu", "CPU"))
    print(f"\n{name}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"precision {args.precision}\n")
    show(results)
    path = write_json(args.out / f"conv_shifts_{device.type}.json",
                      {"device": name, "machine": info, "torch": torch.__version__,
                       "precision": args.precision, "results": results})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
