"""Per-layer curvature math on this machine: statistics (expand vs reduce), the conv A
factor (unfold vs the fast path), low-rank vs exact decompositions; flops/s against a
measured fp32 matmul.

    python benchmarks/curvature_math.py [--quick] [--markdown] [--threads N]

No MPI, one process. Times are the best of ``--repeat`` runs (the machine may be
shared: best-of is the least disturbed estimate). Flops are counted by
``kfac_hpc.kfac.shapes`` (one multiply-add = 2 flops; Gram matrices counted full,
``2·rows·d²``, also for the symmetric path, so its flops/s is "effective"); "% peak" =
flops/s divided by the measured fp32 matmul throughput (a ``--matmul``-sized square
product). Tables:

1. factor statistics per layer (``a_factor`` + ``g_factor``), batch 32: ResNet-20's
   convolutions (32x32 / 16x16 / 8x8 maps, 16/32/64 channels) and transformer-like
   Linear layers over sequences, expand (fast path) vs reduce;
2. the conv expand A factor: ``F.unfold`` path vs :func:`patch_covariance` (time,
   extra memory by formula, float64 difference);
3. low-rank factors: :func:`randomized_eigh` vs exact ``eigh`` at 1569x1569 (the
   exponentially averaged A factor of a small CNN's first Linear layer, trained on the
   digits data) and 4609x4609 (synthetic: random eigenvectors, power-law spectrum
   ``λ_i = (i+1)^-2``): time, error of the factor and of the preconditioned gradient.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kfac_hpc.kfac.layers import Conv2dCurvature, LayerCurvature, curvature_for
from kfac_hpc.kfac.linalg import eigh_clamped, precondition_eigen, update_running_average
from kfac_hpc.kfac.lowrank import precondition_lowrank, randomized_eigh
from kfac_hpc.kfac.shapes import (
    eigh_flops,
    randomized_eigh_flops,
    statistics_flops,
)


def best_of(fn: Callable[[], Any], repeat: int) -> float:
    fn()
    best = math.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def best_interleaved(fns: dict[str, Callable[[], Any]], repeat: int) -> dict[str, float]:
    """Best time of each function, run round-robin (one call each per round), so a load
    change on a shared machine hits every variant alike."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, math.inf)
    for _ in range(repeat):
        for key, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[key] = min(best[key], time.perf_counter() - t0)
    return best


class Peak:
    """The fp32 matmul reference: the best of every measurement taken during the run
    (re-measured between tables), so a busy moment does not lower the reference."""

    def __init__(self, n: int, repeat: int) -> None:
        self.n, self.repeat = n, repeat
        self.samples: list[float] = []

    def measure(self) -> float:
        self.samples.append(matmul_peak(self.n, self.repeat))
        return self.value

    @property
    def value(self) -> float:
        return max(self.samples)


def table(headers: list[str], rows: list[list[Any]], markdown: bool) -> str:
    cells = [[str(c) for c in r] for r in rows]
    if markdown:
        out = ["| " + " | ".join(headers) + " |", "|" + "---:|" * len(headers)]
        out += ["| " + " | ".join(r) + " |" for r in cells]
        return "\n".join(out)
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]

    def line(r: list[str]) -> str:
        return "  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True))

    return "\n".join([line(headers), *(line(r) for r in cells)])


def both(c: LayerCurvature, x: Tensor, go: Tensor, unfold: bool = False) -> None:
    if unfold:
        assert isinstance(c, Conv2dCurvature)
        c.a_factor_unfold(x)
    else:
        c.a_factor(x)
    c.g_factor(go)


def matmul_peak(n: int, repeat: int) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n**3 / best_of(lambda: a @ b, repeat)


# ----------------------------------------------------------------------------- 1 and 2


def stats_layers(quick: bool) -> list[tuple[str, nn.Module, tuple[int, ...]]]:
    b = 32

    def conv(ci: int, co: int, s: int = 1) -> nn.Conv2d:
        return nn.Conv2d(ci, co, 3, stride=s, padding=1, bias=False)

    layers: list[tuple[str, nn.Module, tuple[int, ...]]] = [
        ("conv 3->16 32x32", conv(3, 16), (b, 3, 32, 32)),
        ("conv 16->16 32x32", conv(16, 16), (b, 16, 32, 32)),
        ("conv 16->32 s2 32x32", conv(16, 32, 2), (b, 16, 32, 32)),
        ("conv 32->32 16x16", conv(32, 32), (b, 32, 16, 16)),
        ("conv 32->64 s2 16x16", conv(32, 64, 2), (b, 32, 16, 16)),
        ("conv 64->64 8x8", conv(64, 64), (b, 64, 8, 8)),
        ("linear 512->512 T=128", nn.Linear(512, 512), (b, 128, 512)),
        ("linear 512->2048 T=128", nn.Linear(512, 2048), (b, 128, 512)),
    ]
    if quick:
        layers = [layers[1], layers[5], layers[6]]
    return layers


def run_statistics(peak: Peak, repeat: int, quick: bool) -> Callable[[bool], None]:
    """Measure tables 1 and 2; returns the printer (called once the peak is final)."""
    raw1, raw2 = [], []
    for name, module, shape in stats_layers(quick):
        x = torch.randn(*shape)
        with torch.no_grad():
            go = torch.randn_like(module(x))
        curv = curvature_for(module)
        red = curvature_for(module, "reduce")
        assert curv is not None and red is not None
        per_sample = go[0, 0].numel() if isinstance(module, nn.Conv2d) else go.shape[1]
        fns: dict[str, Callable[[], Any]] = {
            "exp": partial(both, curv, x, go), "red": partial(both, red, x, go)}
        if isinstance(curv, Conv2dCurvature):
            fns["old"] = partial(both, curv, x, go, unfold=True)
            fns["a_old"] = partial(curv.a_factor_unfold, x)
            fns["a_new"] = partial(curv.a_factor, x)
        t = best_interleaved(fns, repeat)
        f_exp = statistics_flops(curv.a_dim, curv.g_dim, shape[0], per_sample, "expand")
        f_red = statistics_flops(curv.a_dim, curv.g_dim, shape[0], per_sample, "reduce")
        raw1.append((name, curv.a_dim, curv.g_dim, shape[0] * per_sample, t.get("old", math.nan),
                     t["exp"], f_exp, t["red"], f_red))
        if isinstance(curv, Conv2dCurvature):
            x64 = x[:8].double()
            ref = curv.a_factor_unfold(x64)
            err = float((curv.a_factor(x64) - ref).norm() / ref.norm())
            b, n_rows, d = shape[0], shape[0] * per_sample, curv.weight_cols
            # unfold path: patches + a transposed copy, or + b partial d×d products
            old_bytes = (2 * n_rows * d if d >= per_sample else n_rows * d + b * d * d) * 4
            per_chunk = max(1, 8192 // per_sample)
            new_bytes = (min(per_chunk, b) * per_sample * d + x[:per_chunk].numel() + d * d) * 4
            raw2.append((name, d, n_rows, t["a_old"], t["a_new"], old_bytes, new_bytes,
                         2 * n_rows * d * d, err))

    def show(markdown: bool) -> None:
        pk = peak.value
        rows1 = [[name, a, g, n, "-" if math.isnan(t_old) else f"{t_old * 1e3:.2f}",
                  f"{t_exp * 1e3:.2f}", f"{f_exp / t_exp / 1e9:.0f}",
                  f"{100 * f_exp / t_exp / pk:.0f}", f"{t_red * 1e3:.2f}",
                  f"{t_exp / t_red:.1f}x", f"{f_red / t_red / 1e9:.1f}"]
                 for name, a, g, n, t_old, t_exp, f_exp, t_red, f_red in raw1]
        print("\n### 1. Factor statistics per layer (A + G, batch 32, float32)\n")
        print(table(["layer", "a_dim", "g_dim", "rows", "expand unfold ms", "expand ms",
                     "expand GF/s", "% peak", "reduce ms", "expand/reduce", "reduce GF/s"],
                    rows1, markdown))
        rows2 = [[name, d, n, f"{t_old * 1e3:.2f}", f"{t_new * 1e3:.2f}",
                  f"{t_old / t_new:.2f}x", f"{ob / 2**20:.1f}", f"{nb / 2**20:.1f}",
                  f"{100 * fa / t_old / pk:.0f}", f"{100 * fa / t_new / pk:.0f}", f"{err:.1e}"]
                 for name, d, n, t_old, t_new, ob, nb, fa, err in raw2]
        print("\n### 2. Conv expand A: F.unfold path vs patch_covariance (float32)\n")
        print(table(["layer", "d", "rows", "unfold ms", "fast ms", "speed-up",
                     "unfold extra MiB", "fast extra MiB", "unfold % peak", "fast % peak",
                     "rel diff fp64"], rows2, markdown))

    return show


# ----------------------------------------------------------------------------- 3


def small_cnn_factor(steps: int) -> Tensor:
    """EMA (decay 0.95) of the A factor (1569x1569) of a small CNN's first Linear layer,
    trained with SGD on the digits data (8x8 upsampled to 28x28)."""
    from sklearn.datasets import load_digits

    torch.manual_seed(0)
    bunch = load_digits()
    images = torch.as_tensor(bunch.images, dtype=torch.float32).unsqueeze(1)
    images = F.interpolate((images - images.mean()) / images.std(), size=28, mode="bilinear")
    labels = torch.as_tensor(bunch.target)
    model = nn.Sequential(
        nn.Conv2d(1, 16, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10),
    )
    fc = model[7]
    curv = curvature_for(fc)
    assert curv is not None
    seen: dict[str, Tensor] = {}
    fc.register_forward_pre_hook(lambda m, i: seen.__setitem__("a", i[0].detach()))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    factor: Tensor | None = None
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        idx = torch.randint(0, len(labels), (64,), generator=gen)
        loss = F.cross_entropy(model(images[idx]), labels[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        factor = update_running_average(factor, curv.a_factor(seen["a"]), 0.95)
    assert factor is not None
    return factor


def synthetic_factor(d: int) -> Tensor:
    gen = torch.Generator().manual_seed(2)
    q: Tensor = torch.linalg.qr(torch.randn(d, d, generator=gen))[0]
    lam = (torch.arange(d, dtype=torch.float32) + 1) ** -2.0
    m = (q * lam) @ q.t()
    return (m + m.t()) / 2


def run_lowrank(peak: Peak, repeat: int, quick: bool) -> Callable[[bool], None]:
    """Measure table 3; returns the printer (called once the peak is final)."""
    factors = [("1569 small-CNN EMA A", small_cnn_factor(30 if quick else 100))]
    if not quick:
        factors.append(("4609 synthetic (i+1)^-2", synthetic_factor(4609)))
    damping = 1e-3  # the timed one
    dampings = (1e-3, 1e-2, 1e-1)
    raw: list[tuple[Any, ...]] = []
    for name, f in factors:
        d = f.shape[0]
        t_exact = best_of(partial(eigh_clamped, f), max(1, repeat // 3))
        peak.measure()
        qa, la = eigh_clamped(f)
        f_norm = float(f.norm())
        lam_desc = la.flip(0)
        g_dim = 128
        gen = torch.Generator().manual_seed(3)
        gf = torch.randn(4 * g_dim, g_dim, generator=gen)
        gfac = gf.t() @ gf / gf.shape[0]
        qg, lg = eigh_clamped(gfac)
        grad = torch.randn(g_dim, d, generator=gen)
        v_exact = {gm: precondition_eigen(grad, qa, la, qg, lg, gm) for gm in dampings}
        gexact = randomized_eigh(gfac, rank=g_dim)  # exact, full rank
        specs: list[dict[str, Any]] = [
            dict(rank=32), dict(rank=64), dict(rank=128), dict(rank=128, remainder="zero"),
            dict(energy=0.99)]
        specs = specs if not quick else specs[1:2]
        lows = [randomized_eigh(f, generator=torch.Generator().manual_seed(4), **sp)
                for sp in specs]
        fns: dict[str, Callable[[], Any]] = {
            "pe": partial(precondition_eigen, grad, qa, la, qg, lg, damping)}
        for i, (sp, lr) in enumerate(zip(specs, lows, strict=True)):
            fns[f"r{i}"] = partial(randomized_eigh, f, generator=torch.Generator(), **sp)
            fns[f"p{i}"] = partial(precondition_lowrank, grad, lr, gexact, damping)
        t = best_interleaved(fns, repeat)
        raw.append((name, "exact eigh", d, t_exact, t_exact, eigh_flops(d),
                    f"{float(lam_desc[0]):.3g}", "0", "1.0000", [0.0] * len(dampings), t["pe"]))
        for i, (sp, lr) in enumerate(zip(specs, lows, strict=True)):
            k = lr.rank
            err_f = float((lr.dense() - f).norm()) / f_norm
            best_f = float(lam_desc[k:].square().sum().sqrt()) / f_norm  # Eckart–Young
            energy = float(lr.lam.sum() / lam_desc.clamp(min=0).sum())
            err_v = [float((precondition_lowrank(grad, lr, gexact, gm) - v_exact[gm]).norm()
                           / v_exact[gm].norm()) for gm in dampings]
            fl = randomized_eigh_flops(d, k) if not lr.exact else eigh_flops(d)
            label = ", ".join(f"{key}={val}" for key, val in sp.items())
            raw.append((name, f"{label} (k={k}{', exact' if lr.exact else ''})", d, t[f"r{i}"],
                        t_exact, fl, f"{float(lr.rho):.2g}",
                        f"{err_f:.3f} (best {best_f:.3f})", f"{energy:.4f}", err_v, t[f"p{i}"]))

    def show(markdown: bool) -> None:
        pk = peak.value
        rows = [[name, method, d, f"{t_dec:.3f}", f"{t_ex / t_dec:.1f}x",
                 f"{fl / t_dec / 1e9:.0f}", f"{100 * fl / t_dec / pk:.0f}", spec, err_f, energy,
                 *(f"{e:.3f}" for e in err_v), f"{t_p * 1e3:.1f}"]
                for name, method, d, t_dec, t_ex, fl, spec, err_f, energy, err_v, t_p in raw]
        print("\n### 3. Low-rank factors vs exact eigh (float32; G 128x128 exact; exact eigh"
              " counted as a nominal 4d³ flops; precond ms at γ=1e-3)\n")
        print(table(["factor", "method", "d", "decomp s", "speed-up", "GF/s", "% peak",
                     "λ_1 / ρ", "|F~-F|/|F|", "energy kept",
                     *(f"V rel err γ={gm:g}" for gm in dampings), "precond ms"],
                    rows, markdown))

    return show


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="few layers, small sizes (CI smoke)")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--matmul", type=int, default=2048, help="size of the reference matmul")
    ap.add_argument("--only", choices=["stats", "lowrank"], default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next((ln.split(":", 1)[1].strip() for ln in fh
                        if ln.startswith("model name")), cpu)
    except OSError:
        pass
    peak = Peak(1024 if args.quick else args.matmul, args.repeat)
    peak.measure()
    printers = []
    if args.only in (None, "stats"):
        with torch.no_grad():
            printers.append(run_statistics(peak, args.repeat, args.quick))
        peak.measure()
    if args.only in (None, "lowrank"):
        printers.append(run_lowrank(peak, args.repeat, args.quick))
        peak.measure()
    try:
        with open("/proc/loadavg") as fh:
            load = " ".join(fh.read().split()[:3])
    except OSError:
        load = "?"
    print(f"machine: {cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads, "
          f"torch {torch.__version__}; load average at the end: {load}")
    print(f"reference fp32 matmul {peak.n}x{peak.n}: {peak.value / 1e9:.0f} GFLOP/s (best of "
          f"{len(peak.samples)} measurements of best-of-{args.repeat}: "
          f"{', '.join(f'{v / 1e9:.0f}' for v in peak.samples)})")
    for show in printers:
        show(args.markdown)


if __name__ == "__main__":
    main()
