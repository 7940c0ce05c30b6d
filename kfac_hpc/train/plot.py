"""``kfac-hpc plot RUN... --out fig.png``: loss and accuracy curves of several runs.

Each RUN is a ``metrics.jsonl`` written by ``kfac-hpc train`` or its run directory.
Left panel: training loss per step (thin) and test loss per epoch (markers); right
panel: test accuracy per epoch (markers) and training accuracy per epoch (dashed).
The legend label is ``--labels`` if given, else the run's optimizer label from its
``config.json``, else the directory name. Rendering uses matplotlib's Agg backend (no
display needed). Records repeated by a resumed run are de-duplicated (last wins).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_arguments", "load_run", "plot_runs", "run"]

_X_KEYS = {"epoch": "epoch", "step": "step", "time": "wall_time"}
_X_LABELS = {"epoch": "epoch", "step": "step", "time": "wall time (s)"}


class PlotInputError(ValueError):
    """A run file is missing or holds no records."""


def _resolve(path: str | Path) -> Path:
    p = Path(path)
    if p.is_dir():
        p = p / "metrics.jsonl"
    if not p.is_file():
        raise PlotInputError(f"no such metrics file: {p}")
    return p


def _label(path: Path) -> str:
    cfg = path.parent / "config.json"
    if cfg.is_file():
        try:
            run = json.loads(cfg.read_text()).get("run", {})
            label = run.get("label")
            if label:
                return f"{label} ({path.parent.name})"
        except (json.JSONDecodeError, AttributeError):
            pass
    return path.parent.name or path.stem


def _dedupe(records: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    by_key: dict[Any, dict[str, Any]] = {}
    for r in records:
        by_key[r.get(key)] = r
    return sorted(by_key.values(), key=lambda r: (r.get(key) is None, r.get(key) or 0))


def load_run(path: str | Path) -> tuple[Path, list[dict[str, Any]], list[dict[str, Any]]]:
    """``(file, step records, epoch records)`` of one run (de-duplicated, in order)."""
    from kfac_hpc.train.metrics import read_jsonl

    p = _resolve(path)
    records = read_jsonl(p)
    steps = _dedupe([r for r in records if r.get("kind") == "step"], "step")
    epochs = _dedupe([r for r in records if r.get("kind") == "epoch"], "step")
    if not steps and not epochs:
        raise PlotInputError(f"{p} holds no step or epoch records")
    return p, steps, epochs


def _series(records: list[dict[str, Any]], x: str, y: str) -> tuple[list[float], list[float]]:
    pts = [(r[x], r[y]) for r in records if r.get(x) is not None and r.get(y) is not None]
    return [a for a, _ in pts], [b for _, b in pts]


def plot_runs(paths: list[str | Path], out: str | Path, *, labels: list[str] | None = None,
              x: str = "epoch", title: str | None = None, log_loss: bool = False) -> Path:
    """Draw every run onto one figure and save it as ``out`` (PNG); returns the path.

    Raises:
        PlotInputError: Unusable input, or matplotlib is missing (saying how to get it).
    """
    try:
        import matplotlib
    except ImportError:
        raise PlotInputError("plotting needs matplotlib: pip install matplotlib (or "
                             "pip install 'kfac_hpc[train]')") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if labels is not None and len(labels) != len(paths):
        raise PlotInputError(f"--labels gives {len(labels)} names for {len(paths)} runs")
    runs = [load_run(p) for p in paths]
    xkey = _X_KEYS[x]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (path, steps, epochs) in enumerate(runs):
        color = colors[i % len(colors)]
        label = labels[i] if labels else _label(path)
        sx, sy = _series(steps, xkey, "loss")
        if sx:
            ax_loss.plot(sx, sy, color=color, lw=0.8, alpha=0.6, label=f"{label} train")
        ex, ey = _series(epochs, xkey, "test_loss")
        if ex:
            ax_loss.plot(ex, ey, "o--", color=color, ms=3, lw=1, label=f"{label} test")
        ax, ay = _series(epochs, xkey, "test_acc")
        if ax:
            ax_acc.plot(ax, [100 * v for v in ay], "o-", color=color, ms=3, label=f"{label} test")
        tx, ty = _series(epochs, xkey, "train_acc")
        if tx:
            ax_acc.plot(tx, [100 * v for v in ty], ":", color=color, lw=1,
                        label=f"{label} train")
    ax_loss.set_xlabel(_X_LABELS[x])
    ax_loss.set_ylabel("cross-entropy loss")
    if log_loss:
        ax_loss.set_yscale("log")
    ax_acc.set_xlabel(_X_LABELS[x])
    ax_acc.set_ylabel("accuracy (%)")
    for a in (ax_loss, ax_acc):
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``kfac-hpc plot``'s arguments to ``parser``.

    Args:
        parser: The parser.
    """
    parser.add_argument("runs", nargs="+", metavar="RUN",
                        help="metrics.jsonl files or run directories")
    parser.add_argument("--out", "-o", default="curves.png", help="output PNG")
    parser.add_argument("--labels", nargs="+", default=None, help="legend names, one per run")
    parser.add_argument("--x", choices=sorted(_X_KEYS), default="epoch", help="x axis")
    parser.add_argument("--title", default=None, help="figure title")
    parser.add_argument("--log-loss", action="store_true", help="logarithmic loss axis")


def run(args: argparse.Namespace) -> int:
    """Run ``kfac-hpc plot``.

    Args:
        args: The parsed arguments.

    Returns:
        The exit status: 0, or 2 for unusable input.
    """
    try:
        out = plot_runs(args.runs, args.out, labels=args.labels, x=args.x, title=args.title,
                        log_loss=args.log_loss)
    except PlotInputError as exc:
        sys.stderr.write(f"kfac-hpc plot: error: {exc}\n")
        return 2
    print(f"wrote {out}")
    return 0
