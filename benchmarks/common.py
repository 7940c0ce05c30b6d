"""Helpers shared by the benchmark scripts: machine, device, tables, JSON, plots.

Scripts in this folder import it as ``from common import ...`` (running
``python benchmarks/X.py`` puts the folder first on ``sys.path``).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

_T = TypeVar("_T")

if TYPE_CHECKING:
    import torch

OUT_DIR = Path(__file__).resolve().parent / "out"
REPO_DIR = Path(__file__).resolve().parent.parent
#: Peer libraries' source trees (never committed: ``/.peers/`` is in ``.git/info/exclude``).
PEERS_DIR = REPO_DIR / ".peers"
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
        **gpu_info(),
        "load_average_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "env": {k: v for k, v in sorted(os.environ.items())  # settings that change timings
                if k.startswith(("OMPI_MCA_", "PRTE_MCA_", "MPICH_", "OMP_", "THP_"))
                and k not in _LAUNCHER_ENV},
    }


def describe(info: dict[str, Any]) -> str:
    """One line from :func:`machine`'s dict."""
    over = ", oversubscribed" if info.get("oversubscribed") else ""
    gpus = info.get("gpus") or []
    gpu = (f"; {len(gpus)} GPU(s) {', '.join(sorted(set(gpus)))} (CUDA {info.get('cuda_runtime')}, "
           f"driver {info.get('cuda_driver')})" if gpus else "")
    return (f"{info['world_size']} ranks ({info['ranks_on_node']} on {info['host']}{over}); "
            f"{info['cores']} cores {info['cpu']}{gpu}; {info['mpi_library']}; "
            f"mpi4py {info['mpi4py']}; torch {info['torch']}; "
            f"load {info.get('load_average_1m')}")


def gpu_info() -> dict[str, Any]:
    """The visible GPUs' names, the CUDA runtime torch was built with, the driver; and the
    fp32 math settings that change GPU timings (TF32, cuDNN autotuning). Empty without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return {}
    driver = None
    try:  # the driver's CUDA version, e.g. 12040 -> "12.4"
        version = ctypes.c_int()
        if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version)) == 0:
            driver = f"{version.value // 1000}.{version.value % 1000 // 10}"
    except (OSError, AttributeError):
        pass
    return {
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "gpu_memory_gib": [round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)
                           for i in range(torch.cuda.device_count())],
        "cuda_runtime": torch.version.cuda,
        "cuda_driver": driver,
        "cudnn": torch.backends.cudnn.version(),
        "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "env_cuda": {k: v for k, v in sorted(os.environ.items())
                     if k.startswith(("CUDA_", "NCCL_", "UCX_", "KFAC_HPC_CUDA"))},
    }


# Node-local rank variables set by launchers, first found wins (read without MPI, so a
# script can pick its GPU before ``from mpi4py import MPI`` starts MPI).
LOCAL_RANK_VARIABLES = ("OMPI_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_RANK",
                        "MPI_LOCALRANKID", "PMI_LOCAL_RANK", "PALS_LOCAL_RANKID",
                        "SLURM_LOCALID")


def local_rank() -> int:
    """This process's rank on its node: a launcher's variable, else (when mpi4py is
    already imported) MPI's shared-memory split of ``COMM_WORLD``, else 0."""
    for name in LOCAL_RANK_VARIABLES:
        value = os.environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    if "mpi4py.MPI" in sys.modules:
        from mpi4py import MPI

        node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED, key=MPI.COMM_WORLD.Get_rank())
        rank = node.Get_rank()
        node.Free()
        return rank
    return 0


class NoGPUError(SystemExit):
    """``--device cuda`` on a machine (or torch build) without a usable CUDA device."""


def select_device(name: str) -> torch.device:
    """``cpu``, or ``cuda:<local rank mod visible GPUs>`` made the current CUDA device.

    Raises :class:`NoGPUError` (a ``SystemExit`` with the reason) when ``name`` is
    ``cuda`` and torch sees no GPU. Ranks on a node share its GPUs round-robin.
    """
    import torch

    if name == "cpu":
        return torch.device("cpu")
    if name != "cuda":
        raise ValueError(f"device must be 'cpu' or 'cuda', got {name!r}")
    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            why = f"this torch ({torch.__version__}) is a CPU-only build"
        else:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            why = (f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU"
                   + (f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""))
        raise NoGPUError(f"--device cuda: no CUDA device available: {why}. Run on a GPU "
                         "machine with a CUDA build of torch, or use --device cpu.")
    device = torch.device("cuda", local_rank() % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (CUDA kernels run asynchronously); no-op on CPU."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], _T], device: torch.device) -> tuple[_T, float]:
    """Call ``fn`` once; return its result and the seconds it took, ``device`` synchronised."""
    synchronize(device)
    start = time.perf_counter()
    out = fn()
    synchronize(device)
    return out, time.perf_counter() - start


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


def figure_note(draw: Callable[..., Path], *args: Any) -> str:
    """``"wrote <path>"`` after ``draw(*args)`` draws and saves a figure; where matplotlib
    is not installed (GPU machines often lack it), ``"figure skipped: ..."`` instead, so a
    benchmark's tables and JSON never depend on it."""
    try:
        return f"wrote {draw(*args)}"
    except ImportError as e:
        return f"figure skipped: {e}"


def save_figure(fig: Any, path: str | os.PathLike[str], dpi: int = 120) -> Path:
    """Save a matplotlib figure (creating folders) and close it; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path


def matmul_throughput(dim: int = 2048, runs: int = 3, device: torch.device | None = None,
                      dtype: torch.dtype | None = None, min_seconds: float = 0.5,
                      max_runs: int = 50) -> dict[str, Any]:
    """FLOP/s of a ``dim``x``dim`` by ``dim``x``dim`` matmul (``2·dim³`` flops) on
    ``device`` (default CPU) in ``dtype`` (default float32) at torch's current thread
    count: median of at least ``runs`` synchronised calls after one untimed call, more
    (up to ``max_runs``) until they add up to ``min_seconds``.

    A reference for "how far from the machine": a large GEMM is about the most a core
    (or GPU) sustains on dense arithmetic.
    """
    import statistics
    import time

    import torch

    device = device or torch.device("cpu")
    dtype = dtype or torch.float32
    g = torch.Generator().manual_seed(dim)
    a = torch.randn(dim, dim, generator=g, dtype=dtype).to(device)
    b = torch.randn(dim, dim, generator=g, dtype=dtype).to(device)
    out = torch.empty(dim, dim, dtype=dtype, device=device)
    torch.mm(a, b, out=out)
    synchronize(device)
    times: list[float] = []
    while len(times) < max(1, runs) or (sum(times) < min_seconds and len(times) < max_runs):
        synchronize(device)
        t0 = time.perf_counter()
        torch.mm(a, b, out=out)
        synchronize(device)
        times.append(time.perf_counter() - t0)
    flops = 2 * dim ** 3
    median = statistics.median(times)
    return {"dim": dim, "dtype": str(dtype).removeprefix("torch."), "device": str(device),
            "threads": torch.get_num_threads(), "flops": flops, "median_s": median,
            "samples_s": times, "flops_per_s": flops / median,
            "best_flops_per_s": flops / min(times)}


def mean_std(values: Sequence[float | None]) -> tuple[float, float]:
    """Mean and sample standard deviation of the finite values (NaN where undefined)."""
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return math.nan, math.nan
    m = sum(vals) / len(vals)
    if len(vals) < 2:
        return m, math.nan
    return m, math.sqrt(sum((v - m) ** 2 for v in vals) / (len(vals) - 1))


def peer_source(variable: str, name: str, fallback: str = "") -> str:
    """Default source folder of a peer library (a folder holding its package folder).

    Args:
        variable: environment variable that wins when set (e.g. ``KAISA_SRC``).
        name: sub-folder of :data:`PEERS_DIR` used when it exists (e.g. ``"kaisa"``).
        fallback: used when neither is there (may be empty).

    Returns:
        ``$variable``, else ``<repo>/.peers/<name>`` when that folder exists, else
        ``fallback``.
    """
    if os.environ.get(variable):
        return os.environ[variable]
    local = PEERS_DIR / name
    return str(local) if local.is_dir() else fallback


def import_peer(package: str, src: str, has: str, *, submodule: str | None = None,
                context: Callable[[], contextlib.AbstractContextManager[Any]] =
                contextlib.nullcontext, report: bool = True) -> Any:
    """A peer library's package, from an install or from its source folder.

    Args:
        package: The package name (``"kfac"``, ``"distributed_shampoo"``).
        src: A folder holding the package folder (may be empty).
        has: An attribute an installed package must have to count as the peer (another
            package of the same name does not).
        submodule: Imported too from the source folder (e.g. ``"preconditioner"``).
        context: Entered around the import from the source folder (e.g. a shim for
            metadata a bare source tree lacks).
        report: Print why an import from the source folder failed (on stderr).

    Returns:
        The module, or None when neither imports.
    """
    try:
        module = importlib.import_module(package)
        if hasattr(module, has):
            return module
    except ImportError:
        pass
    if src and os.path.isdir(os.path.join(src, package)):
        sys.path.insert(0, src)
        sys.modules.pop(package, None)
        try:
            with context():
                module = importlib.import_module(package)
                if submodule is not None:
                    importlib.import_module(f"{package}.{submodule}")
            return module
        except Exception as e:  # its imports may need more than torch one day
            if report:
                print(f"importing {package} from {src} failed: {e!r}", file=sys.stderr)
    return None


def peer_version(src: str) -> str | None:
    """The first line of ``<src>/VERSION`` (tag/commit written when the peer's source
    was extracted), or None."""
    try:
        return (Path(src) / "VERSION").read_text().splitlines()[0].strip() or None
    except (OSError, IndexError):
        return None


def imagenet_resnet50(num_classes: int = 1000, image_size: int = 224,
                      implementation: str = "auto") -> tuple[torch.nn.Module, str]:
    """ResNet-50 with the ImageNet stem, and where it came from.

    Args:
        num_classes: size of the last layer.
        image_size: input height/width (only ``kfac_hpc.models`` uses it, to choose its
            stem; torchvision's model always has the ImageNet stem).
        implementation: ``"torchvision"``, ``"kfac_hpc"`` or ``"auto"`` (torchvision's
            ``resnet50()`` when torchvision imports, else ``kfac_hpc.models``).

    Returns:
        The model (random weights, CPU) and a description of its source.

    Raises:
        ImportError: ``implementation="torchvision"`` and torchvision does not import.
    """
    if implementation in ("auto", "torchvision"):
        try:
            import torchvision

            model = torchvision.models.resnet50(weights=None, num_classes=num_classes)
            return model, f"torchvision {torchvision.__version__} resnet50()"
        except Exception as e:  # not installed, or a build that does not match torch
            if implementation == "torchvision":
                raise ImportError(f"torchvision's resnet50 is not available: {e}") from e
    from kfac_hpc.models import build_model

    model = build_model("resnet50", num_classes=num_classes, in_channels=3,
                        image_size=image_size)
    return model, "kfac_hpc.models resnet50"


def cuda_memory(device: torch.device) -> tuple[int, int]:
    """``(memory_allocated, max_memory_allocated)`` on ``device``; ``(0, 0)`` on the CPU."""
    import torch

    if device.type != "cuda":
        return 0, 0
    return torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)


def reset_cuda_peak(device: torch.device) -> None:
    """Synchronise ``device`` and reset its peak-memory counter (no-op on the CPU)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def tensor_bytes(obj: Any) -> int:
    """Bytes of the distinct tensor storages reachable from ``obj`` through dicts,
    lists, tuples and dataclass fields (e.g. an optimizer's ``state``, where Meta's
    Shampoo keeps its factors in dataclasses); a storage shared by views is counted
    once."""
    import dataclasses

    import torch

    seen: set[tuple[str, int]] = set()
    total = 0
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            key = (str(item.device), storage.data_ptr())
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            stack.extend(getattr(item, f.name, None) for f in dataclasses.fields(item))
    return total


_IMPORTED = time.time()


def process_seconds() -> float:
    """Seconds since this process started (Linux: ``/proc/self/stat``, so Python's and
    torch's start-up count too), else since this module was imported."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: ticks after boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - started)
    except (OSError, ValueError, IndexError):
        return time.time() - _IMPORTED
