"""Helpers shared by the benchmark scripts: machine description, tables, JSON, plots.

Scripts in this folder import it as ``from common import ...`` (running
``python benchmarks/X.py`` puts the folder first on ``sys.path``).
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

OUT_DIR = Path(__file__).resolve().parent / "out"
# Set by mpiexec itself on every rank: not a user's setting.
_LAUNCHER_ENV = {"OMPI_MCA_PREFIXES", "OMPI_MCA_initial_wdir", "OMPI_MCA_cpu_type",
                 "OMPI_MCA_num_procs"}


def machine() -> dict[str, Any]:
    """What a measurement ran on. Collective over ``MPI.COMM_WORLD``: call on every rank."""
    import mpi4py
    import numpy
    import torch
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
    local_ranks = node.Get_size()
    node.Free()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        memory_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        memory_gib = None
    return {
        "host": platform.node(),
        "cpu": cpu,
        "cores": cores,
        "memory_gib": memory_gib,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "mpi4py": mpi4py.__version__,
        "mpi_library": MPI.Get_library_version().splitlines()[0].split(",")[0].strip(),
        "world_size": world.Get_size(),
        "ranks_on_node": local_ranks,
        "oversubscribed": cores is not None and local_ranks > cores,
        "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "load_average_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "env": {k: v for k, v in sorted(os.environ.items())  # settings that change timings
                if k.startswith(("OMPI_MCA_", "PRTE_MCA_", "MPICH_", "OMP_", "THP_"))
                and k not in _LAUNCHER_ENV},
    }


def describe(info: dict[str, Any]) -> str:
    """One line from :func:`machine`'s dict."""
    over = ", oversubscribed" if info.get("oversubscribed") else ""
    return (f"{info['world_size']} ranks ({info['ranks_on_node']} on {info['host']}{over}); "
            f"{info['cores']} cores {info['cpu']}; {info['mpi_library']}; "
            f"mpi4py {info['mpi4py']}; torch {info['torch']}; "
            f"load {info.get('load_average_1m')}")


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]],
                 markdown: bool = False) -> str:
    """A right-aligned text table (first column left-aligned), or a Markdown pipe table.

    Floats print with 3 significant digits unless already strings.
    """
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.0f}"
        return str(v)

    text = [[str(h) for h in headers]] + [[cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in text) for i in range(len(headers))]

    def line(r: list[str]) -> str:
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]
        return "| " + " | ".join(cells) + " |" if markdown else "  ".join(cells)

    out = [line(text[0])]
    if markdown:
        out.append("|" + "|".join(["-" * (widths[0] + 2)]
                                  + ["-" * (w + 1) + ":" for w in widths[1:]]) + "|")
    out += [line(r) for r in text[1:]]
    return "\n".join(out)


def write_json(path: str | os.PathLike[str], data: Any) -> Path:
    """Write ``data`` as indented JSON, creating folders; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    return path


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str | os.PathLike[str], dpi: int = 120) -> Path:
    """Save a matplotlib figure (creating folders) and close it; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path
