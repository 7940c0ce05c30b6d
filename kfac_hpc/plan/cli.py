"""``kfac-hpc plan``: predicted iteration time, bytes and memory per rank, per strategy.

    kfac-hpc plan --model resnet50 --ranks 64 128 --profile a100-ib200
    kfac-hpc plan --model resnet50 --ranks 64 --batch 32 --profile spd-kfac-2080ti-ib100 \
        --compute-method inverse --baselines --breakdown

Prints, per world size, every candidate configuration (strategy x options) fastest
first, marking with ``*`` the fastest whose peak memory per rank fits the budget
(``--memory-budget``, default: the profile's memory per rank). Runs on one process;
no MPI job needed. (The CLI, like ``kfac-hpc train``, sits on top of the package and
takes its models from the training driver's zoo; the library part of the planner does
not import ``kfac_hpc.train``.)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from torch import nn

from kfac_hpc.files import write_text_atomic
from kfac_hpc.kfac.options import DEFAULT_LOW_RANK_MIN_DIM, DTYPES, STRATEGIES
from kfac_hpc.plan.choose import baselines, plan
from kfac_hpc.plan.model_shapes import model_spec
from kfac_hpc.plan.options import KFACOptions
from kfac_hpc.plan.profile import bundled_profiles, load_profile
from kfac_hpc.plan.timing import PHASES, Estimate, estimate, estimate_sgd
from kfac_hpc.units import parse_bytes

__all__ = ["add_arguments", "builtin_model", "run"]


def _bounded(kind: type, low: float, what: str) -> Any:
    """An argparse type: a ``kind`` number of at least ``low`` (else exit 2 saying so)."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not value >= low:  # NaN too
            raise argparse.ArgumentTypeError(f"{text!r}: must be {what}")
        return value

    return parse


_positive_int = _bounded(int, 1, "an integer >= 1")
_count = _bounded(int, 0, "an integer >= 0")
_positive_float = _bounded(float, 1e-300, "a number > 0")


#: builtin model -> (build_model keyword arguments, per-sample input shape)
_BUILTIN: dict[str, tuple[dict[str, object], tuple[int, ...]]] = {
    "resnet50": ({"num_classes": 1000, "in_channels": 3, "image_size": 224}, (3, 224, 224)),
    "resnet20": ({"num_classes": 10, "in_channels": 3, "image_size": 32}, (3, 32, 32)),
    "resnet32": ({"num_classes": 10, "in_channels": 3, "image_size": 32}, (3, 32, 32)),
    "resnet56": ({"num_classes": 10, "in_channels": 3, "image_size": 32}, (3, 32, 32)),
    "mlp": ({"num_classes": 10, "input_dim": 64, "hidden": (256, 128)}, (64,)),
}


def builtin_model(name: str) -> tuple[nn.Module, tuple[int, ...]]:
    """Build a model of the training driver's zoo with its usual sizes, and its input shape.

    ``resnet50``: ImageNet (1000 classes, 3x224x224); CIFAR ResNets: 10 classes, 3x32x32;
    ``mlp``: 64 inputs, hidden (256, 128), 10 classes (the benchmarks' MLP).

    Args:
        name: The model's name.

    Returns:
        The model and one sample's shape.

    Raises:
        ValueError: The planner has no defaults for ``name``; names those it has.
    """
    from kfac_hpc.models import build_model

    if name not in _BUILTIN:
        raise ValueError(f"no planner defaults for model {name!r}; "
                         f"known: {', '.join(sorted(_BUILTIN))}")
    kwargs, shape = _BUILTIN[name]
    return build_model(name, **kwargs), shape  # type: ignore[arg-type]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``kfac-hpc plan`` options to ``parser``.

    Args:
        parser: The subcommand's parser.
    """
    parser.add_argument("--model", default="resnet50",
                        help="model of the training driver's zoo: resnet50 (ImageNet), "
                             "resnet20/32/56 (CIFAR), mlp (default resnet50)")
    parser.add_argument("--ranks", type=_positive_int, nargs="+", default=[64, 128],
                        help="world sizes to plan for (default 64 128)")
    parser.add_argument("--batch", type=_positive_int, default=32,
                        help="batch per rank (default 32)")
    parser.add_argument("--profile", default=None,
                        help=f"profile JSON or bundled name ({', '.join(bundled_profiles())}); "
                             "default $KFAC_HPC_PLAN_PROFILE or a100-ib200")
    parser.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    parser.add_argument("--compute-method", choices=("eigen", "inverse"), default="eigen")
    parser.add_argument("--factor-update-steps", type=_positive_int, default=1)
    parser.add_argument("--inv-update-steps", type=_positive_int, default=1)
    parser.add_argument("--local-thresholds", type=_count, nargs="+", default=[16],
                        help="local_decomposition_threshold values to try (default 16)")
    parser.add_argument("--bucket-cap-mb", type=_positive_float, default=25.0)
    parser.add_argument("--factor-dtype", choices=DTYPES, default="float32")
    parser.add_argument("--low-rank", type=_positive_int, default=None, metavar="K",
                        help="price low-rank decompositions of rank K for factors with at "
                             "least --low-rank-min-dim rows (default: full eigh)")
    parser.add_argument("--low-rank-min-dim", type=_positive_int,
                        default=DEFAULT_LOW_RANK_MIN_DIM)
    parser.add_argument("--no-options", action="store_true",
                        help="strategies only: no packing/overlap/factor_sync variants")
    parser.add_argument("--memory-budget", type=parse_bytes, default=None,
                        help="peak bytes per rank allowed (default: the profile's memory)")
    parser.add_argument("--no-budget", action="store_true", help="ignore memory")
    parser.add_argument("--baselines", action="store_true",
                        help="add D-KFAC, MPD-KFAC, SPD-KFAC, DP-KFAC and S-SGD as modelled")
    parser.add_argument("--breakdown", action="store_true",
                        help="print the time per phase of the chosen configuration")
    parser.add_argument("--top", type=_count, default=0,
                        help="rows per world size (0: all; the chosen row is always shown)")
    parser.add_argument("--json", type=Path, default=None, help="also write the plan as JSON")


def _mb(n: float) -> str:
    return f"{n / 2**20:.1f}"


def _row(label: str, e: Estimate, best_s: float, mark: str, fits: bool) -> list[str]:
    b = e.bytes_per_step
    return [mark + label, f"{e.total_s:.4f}", f"{e.total_s / best_s:.2f}",
            _mb(b["factors"]), _mb(b["decompositions"]), _mb(b["gradients"]),
            _mb(e.memory_state), _mb(e.memory_peak), "yes" if fits else "NO"]


HEADERS = ["configuration", "iter s", "x best", "factor MB", "decomp MB", "grad MB",
           "state MB", "peak MB", "fits"]


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [HEADERS, *rows]) for i in range(len(HEADERS))]

    def line(r: list[str]) -> str:
        return "  ".join([r[0].ljust(widths[0]), *(c.rjust(w) for c, w in zip(r[1:],
                                                                               widths[1:]))])

    return "\n".join([line(HEADERS), *(line(r) for r in rows)])


def run(args: argparse.Namespace) -> int:
    """Run ``kfac-hpc plan``: print the estimated configurations per world size and the pick.

    Args:
        args: The parsed options.

    Returns:
        The exit status: 0, or 2 for a bad profile, model or option.
    """
    try:
        profile = load_profile(args.profile)
        model, shape = builtin_model(args.model)
    except (ValueError, FileNotFoundError) as err:
        print(f"kfac-hpc plan: {err}", file=sys.stderr)
        return 2
    spec = model_spec(model, input_shape=shape, name=args.model)
    base = KFACOptions(compute_method=args.compute_method,
                       factor_update_steps=args.factor_update_steps,
                       inv_update_steps=args.inv_update_steps,
                       local_decomposition_threshold=args.local_thresholds[0],
                       bucket_cap_mb=args.bucket_cap_mb, factor_dtype=args.factor_dtype,
                       low_rank=args.low_rank, low_rank_min_dim=args.low_rank_min_dim)
    problem = base.problem()
    if problem is not None:
        print(f"kfac-hpc plan: {problem}", file=sys.stderr)
        return 2
    budget = None if args.no_budget else (args.memory_budget or profile.memory_per_rank_bytes)
    print(f"# kfac-hpc plan: {args.model} ({len(spec.layers)} K-FAC layers, "
          f"{spec.param_numel / 1e6:.1f} M parameters), batch {args.batch}/rank; profile "
          f"{profile.name} ({profile.source})")
    print(f"# factors every {args.factor_update_steps} step(s), inverses every "
          f"{args.inv_update_steps}; {args.compute_method}; memory budget "
          f"{'none' if budget is None else f'{budget / 2**30:.1f} GiB'} per rank "
          f"(peak = K-FAC state + transient buffers + weights/grads/momentum)")
    out: dict[str, Any] = {"model": args.model, "batch": args.batch,
                           "profile": profile.name, "worlds": []}
    for world in args.ranks:
        try:
            choice, = plan(spec, [world], args.batch, profile, base,
                           strategies=args.strategies, vary_options=not args.no_options,
                           local_thresholds=args.local_thresholds[1:], budget=budget)
        except ValueError as err:  # no candidate here: hybrid-opt alone on a prime world
            print(f"\n== {world} ranks ==  no configuration to plan ({err}; hybrid-opt "
                  "needs a world size with a divisor other than 1 and itself)")
            continue
        best_s = choice.estimates[0].total_s
        shown = list(choice.estimates[:args.top] if args.top else choice.estimates)
        if not any(e is choice.best for e in shown):  # the pick, always
            shown = [*shown, choice.best]
        rows = [_row(e.options.label(), e, best_s, "* " if e is choice.best else "  ",
                     choice.fits(e))
                for e in shown]
        extra: dict[str, Any] = {}
        if args.baselines:
            for name, opts in baselines(base).items():
                b = estimate(spec, opts, world, args.batch, profile)
                extra[name] = b.to_json()
                rows.append(_row(f"[{name}] {opts.label()}", b, best_s, "  ", choice.fits(b)))
            sgd = estimate_sgd(spec, world, args.batch, profile)
            extra["S-SGD"] = sgd
            rows.append(["  [S-SGD] no K-FAC", f"{sum(sgd.values()):.4f}",
                         f"{sum(sgd.values()) / best_s:.2f}", "0.0", "0.0", "0.0", "0.0",
                         _mb(spec.weight_bytes + 2 * spec.trained_bytes), "-"])
        print(f"\n== {world} ranks ==" + ("" if choice.fits_budget else
                                           "  (nothing fits the budget: smallest marked)"))
        print(_table(rows))
        if args.breakdown:
            t = choice.best.time
            print("  chosen, s/iteration: " + ", ".join(f"{p} {t[p]:.4f}" for p in PHASES
                                                        if t[p] > 0))
        out["worlds"].append({"world": world, "best": choice.best.options.label(),
                              "estimates": [e.to_json() for e in choice.estimates],
                              "baselines": extra})
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(args.json, json.dumps(out, indent=1) + "\n")
        print(f"\nwrote {args.json}")
    return 0
