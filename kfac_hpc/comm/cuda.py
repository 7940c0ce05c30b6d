"""Which MPI calls may be handed CUDA device memory: detection you can trust.

"CUDA-aware" is not one flag. Whether a library takes device memory depends on the
vendor, on how it was built, on run-time switches, and on the call: Open MPI takes
device memory in blocking collectives but not in non-blocking reductions, and in
non-blocking data movement only through its UCX transport. :func:`detect` gathers the
evidence of the running process and returns a :class:`CudaSupport`: the vendor, the
evidence (what was looked at, what it said), and the set of calls that take device
memory. Every other call on a CUDA tensor is staged through pinned host memory: slower
(a device→host and a host→device copy per call), never wrong. The tables below are
therefore conservative: a call is listed only where the vendor documents it.

Evidence per vendor (the MPI library's own version string names the vendor):

========== ============================================================================
Open MPI   ``MPIX_Query_cuda_support()`` (5.x: built with CUDA *and* supported at run
           time; 4.x: built with CUDA, and the run-time verdict is the library's
           ``opal_cuda_support``, false where ``libcuda.so.1`` could not be loaded);
           UCX's CUDA transport (``libuct_cuda``) loaded; optionally ``ompi_info``
MVAPICH2   ``MV2_USE_CUDA=1`` (device buffers are refused without it)
Cray MPICH ``MPICH_GPU_SUPPORT_ENABLED=1`` and the GPU transport layer
           ``libmpi_gtl_cuda`` linked into the process (``/proc/self/maps``)
Intel MPI  ``I_MPI_OFFLOAD`` >= 1 and ``I_MPI_OFFLOAD_MODE`` not ``level_zero``
MPICH      ``MPIX_Query_cuda_support()`` (MPICH >= 4.0); ``MPIR_CVAR_ENABLE_GPU=0`` off
========== ============================================================================

A call a library takes in device memory is not always faster given device memory. The
routing rules (:data:`ROUTING`) are measured exceptions: calls the library takes but that
kfac_hpc's pinned staging carries faster, staged on purpose (``CudaSupport.routed``)
and said so in the evidence. One rule today: Open MPI without UCX reduces device memory
on the CPU through ``coll cuda`` (synchronous copies to pageable host memory), measured
2-3.5x slower than staging for allreduce at 4-256 MiB, so its blocking reductions are
staged while data movement (CUDA IPC through ``btl smcuda``) stays direct.

``KFAC_HPC_CUDA_AWARE`` overrides the detection: ``0`` stages every call, ``1`` trusts
that the library is CUDA-aware (for a library detection missed): the vendor's table and
the routing rules, as if detected; ``all`` hands device memory to every call, routing
rules included (for a library known to do better than its table, and for measuring
the library's own device path). Every input of :func:`detect` can be injected, so tests
fake each vendor on a CPU machine.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path

CUDA_AWARE_ENV = "KFAC_HPC_CUDA_AWARE"

# The MPI calls the Communicator makes, named after the MPI functions (lower case).
BLOCKING_CALLS = ("allreduce", "reduce", "reduce_scatter", "bcast", "allgather", "allgatherv",
                  "send", "recv")
NONBLOCKING_CALLS = ("iallreduce", "ireduce", "ireduce_scatter", "ibcast", "iallgather",
                     "iallgatherv")
CALLS = BLOCKING_CALLS + NONBLOCKING_CALLS
NONBLOCKING_REDUCTIONS = frozenset({"iallreduce", "ireduce", "ireduce_scatter"})
NONBLOCKING_MOVEMENT = frozenset(NONBLOCKING_CALLS) - NONBLOCKING_REDUCTIONS

OPEN_MPI, MPICH, MVAPICH, CRAY_MPICH, INTEL_MPI, UNKNOWN = (
    "Open MPI", "MPICH", "MVAPICH", "Cray MPICH", "Intel MPI", "unknown")

ALL = frozenset(CALLS)
BLOCKING = frozenset(BLOCKING_CALLS)
# What each library takes in device memory once it is CUDA-aware (documented behaviour).
TABLES: dict[str, frozenset[str]] = {
    # Open MPI docs ("Which MPI APIs work with CUDA-aware?"): blocking calls only;
    # with the UCX PML also Ibcast/Iallgather(v); never the non-blocking reductions.
    OPEN_MPI: BLOCKING,
    # MPICH >= 4 (yaksa GPU engine) and Cray MPICH (GTL): every collective.
    MPICH: ALL,
    CRAY_MPICH: ALL,
    # Documented for point-to-point and blocking collectives; non-blocking ones staged.
    MVAPICH: BLOCKING,
    INTEL_MPI: BLOCKING,
    # A library that says yes to MPIX_Query_cuda_support but that we do not know.
    UNKNOWN: BLOCKING,
}
OPEN_MPI_UCX_EXTRA = NONBLOCKING_MOVEMENT
BLOCKING_REDUCTIONS = frozenset({"allreduce", "reduce", "reduce_scatter"})
REDUCTIONS = BLOCKING_REDUCTIONS | NONBLOCKING_REDUCTIONS
# What the Communicator does to reductions on device memory, whatever the library (see
# kfac_hpc.comm.buffers): stated in the evidence wherever a reduction goes direct.
SIXTEEN_BIT_NOTE = ("reductions of bfloat16/float16 device memory: widened to float32 on the "
                    "device before MPI sees them (no CUDA-aware MPI documents 16-bit float "
                    "arithmetic on device memory)")
OPEN_MPI_REDUCTION_NOTE = ("Open MPI reduces device memory on the CPU: its coll cuda component "
                           "copies allreduce/reduce buffers to host memory (not pinned) and back "
                           "inside the call; reduce_scatter's algorithms reduce host "
                           "temporaries")


@dataclass(frozen=True)
class Routing:
    """A measured exception to a library's table, staged on purpose.

    The calls the library takes in device memory but that kfac_hpc's pinned staging
    carries faster.

    Attributes:
        name: Where it applies, in words (the vendor and transport).
        calls: The calls staged by this rule.
        reason: Why, with the measurement, for the evidence and the log.
    """

    name: str
    calls: frozenset[str]
    reason: str

    def note(self) -> str:
        """Return the evidence line: what is staged by this rule and why."""
        return (f"routing ({self.name}): {', '.join(c for c in CALLS if c in self.calls)} "
                f"staged through pinned host memory on purpose although the library takes "
                f"device memory there: {self.reason}")


OPEN_MPI_COLL_CUDA = "Open MPI without UCX"
# The routing rules, by the name _open_mpi (etc.) returns for the running library.
ROUTING: dict[str, Routing] = {
    OPEN_MPI_COLL_CUDA: Routing(
        OPEN_MPI_COLL_CUDA, BLOCKING_REDUCTIONS,
        "coll cuda reduces on the CPU after synchronous copies to pageable host memory; "
        "measured on an NVIDIA H200, 2 ranks sharing it, Open MPI 4.1.4 (btl smcuda): "
        "allreduce 2-3.5x slower direct than staged at 4-256 MiB, reduce_scatter a wash "
        "(direct 0.95-1.5x staged's speed); data movement stays direct (bcast 13-114x "
        "faster direct at >= 4 MiB)"),
}


class StagingCause(Enum):
    """Why a call stages CUDA tensors through pinned host memory."""

    NOT_AWARE = "the MPI library is not CUDA-aware here"
    FORCED = "staging forced by an override"
    NOT_IN_TABLE = "the library does not take device memory in this call"
    ROUTED = "staged by a routing rule: faster than the library's device path"


@dataclass(frozen=True)
class CudaSupport:
    """What this process's MPI library does with CUDA device memory, and why we think so.

    Attributes:
        vendor: The MPI implementation (:func:`vendor_of`).
        aware: The library takes device memory in at least some calls.
        device_calls: Calls that get device memory; the rest are staged.
        source: ``"detected"``, or the override that decided (``"KFAC_HPC_CUDA_AWARE=1"``,
            ...).
        evidence: What was looked at and what it said, one line each.
        library: The first line of the library's version string.
        routing: The routing rule (:data:`ROUTING`) that stages calls the library takes
            in device memory, its ``calls`` those it stages here (None: no rule applies).
        detected_aware: What the evidence said where an override decided (None: no
            override).
    """

    vendor: str
    aware: bool  # the library takes device memory in at least some calls
    device_calls: frozenset[str]  # calls that get device memory; the rest are staged
    source: str  # "detected", or the override that decided ("KFAC_HPC_CUDA_AWARE=1", ...)
    evidence: tuple[str, ...] = field(default=())
    library: str = ""
    routing: Routing | None = None
    detected_aware: bool | None = None

    def device_ok(self, call: str) -> bool:
        """Say whether ``call`` (e.g. ``"iallreduce"``) may be handed device memory.

        Args:
            call: One of :data:`CALLS`.

        Returns:
            True when the call takes device memory here.

        Raises:
            ValueError: ``call`` is not one of :data:`CALLS`.
        """
        if call not in CALLS:
            raise ValueError(f"unknown MPI call {call!r}; use one of {', '.join(CALLS)}")
        return call in self.device_calls

    @property
    def routed(self) -> frozenset[str]:
        """Calls the library takes in device memory that the routing rule stages on purpose."""
        return self.routing.calls if self.routing is not None else frozenset()

    @property
    def staged_calls(self) -> tuple[str, ...]:
        """The calls that stage CUDA tensors through host memory, in :data:`CALLS` order."""
        return tuple(c for c in CALLS if c not in self.device_calls)

    def table(self) -> dict[str, str]:
        """Return ``{call: "device" | "staged"}`` for every call, in a fixed order."""
        return {c: "device" if c in self.device_calls else "staged" for c in CALLS}

    def why_staged(self, call: str) -> tuple[StagingCause, str]:
        """Say why ``call`` stages CUDA tensors, as a cause and in words.

        Args:
            call: One of :attr:`staged_calls`.

        Returns:
            The cause and a sentence naming it (with the evidence where it helps).

        Raises:
            ValueError: ``call`` takes device memory here, or is not one of :data:`CALLS`.
        """
        if self.device_ok(call):
            raise ValueError(f"{call} takes device memory here: nothing is staged")
        if self.routing is not None and call in self.routing.calls:
            return StagingCause.ROUTED, self.routing.note()
        if self.aware:
            return StagingCause.NOT_IN_TABLE, f"{self.vendor} does not take device memory in {call}"
        if self.source != "detected":
            detected = ("" if self.detected_aware is None else
                        f" (detected: {'CUDA-aware' if self.detected_aware else 'not CUDA-aware'})")
            return StagingCause.FORCED, f"staging forced by {self.source}{detected}"
        return StagingCause.NOT_AWARE, (
            f"the MPI library ({self.vendor}) is not CUDA-aware here: "
            f"{'; '.join(self.evidence[:2]) or 'no evidence of CUDA support'}")

    def calls_staged_for(self, cause: StagingCause) -> tuple[str, ...]:
        """The staged calls whose cause is ``cause``, in :data:`CALLS` order."""
        return tuple(c for c in self.staged_calls if self.why_staged(c)[0] is cause)

    def unrouted(self) -> CudaSupport:
        """Return this support with the routing rules undone.

        Device memory then goes to every call the library takes: its own device path, for
        measuring and testing it.

        Returns:
            A copy whose ``device_calls`` include the routed calls.
        """
        if self.routing is None:
            return self
        calls = self.device_calls | self.routing.calls
        evidence = [e for e in self.evidence if e != self.routing.note()]
        evidence.append(f"routing undone: {', '.join(c for c in CALLS if c in self.routed)} "
                        "given device memory")
        if calls & REDUCTIONS and SIXTEEN_BIT_NOTE not in evidence:
            evidence.append(SIXTEEN_BIT_NOTE)
        return replace(self, device_calls=calls, routing=None, evidence=tuple(evidence))

    def summary(self) -> str:
        """Describe in one line the vendor, the verdict and how it was reached."""
        verdict = ("CUDA-aware for " + ", ".join(c for c in CALLS if c in self.device_calls)
                   if self.aware else "not CUDA-aware (CUDA tensors staged through host memory)")
        return f"{self.vendor}: {verdict} [{self.source}]"

    def as_dict(self) -> dict[str, object]:
        """Return the detection as a JSON-ready dict (vendor, verdict, evidence, table)."""
        return {"vendor": self.vendor, "aware": self.aware, "source": self.source,
                "library": self.library, "evidence": list(self.evidence),
                "table": self.table(), "routed": [c for c in CALLS if c in self.routed]}

    @staticmethod
    def staged(vendor: str = UNKNOWN, source: str = "forced", library: str = "",
               evidence: tuple[str, ...] = ()) -> CudaSupport:
        """Make a support that stages every call (a CPU-only or non-CUDA-aware library).

        Args:
            vendor: The MPI implementation.
            source: What decided.
            library: The library's version line.
            evidence: What was looked at.

        Returns:
            A support with ``aware=False`` and no device calls.
        """
        return CudaSupport(vendor, False, frozenset(), source, evidence, library)


# ------------------------------------------------------------------ inputs
def vendor_of(library_version: str) -> str:
    """Name the MPI implementation from ``MPI_Get_library_version``'s text.

    Args:
        library_version: The library's version string.

    Returns:
        One of the vendor constants; :data:`UNKNOWN` when none matches.
    """
    text = library_version.lower()
    if "cray mpich" in text:
        return CRAY_MPICH
    if "mvapich" in text:
        return MVAPICH
    if "intel(r) mpi" in text or "intel mpi" in text:
        return INTEL_MPI
    if "open mpi" in text:
        return OPEN_MPI
    if "mpich" in text:
        return MPICH
    return UNKNOWN


def read_maps() -> str:
    """Read this process's memory map (the shared libraries it has loaded); '' if unreadable."""
    try:
        return Path("/proc/self/maps").read_text()
    except OSError:
        return ""


def loaded_libraries(maps: str) -> list[str]:
    """List the shared objects in a ``/proc/<pid>/maps`` text, each once, in order.

    Args:
        maps: The text of a maps file.

    Returns:
        Absolute paths of the ``.so`` files.
    """
    seen: dict[str, None] = {}
    for line in maps.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].startswith("/") and ".so" in parts[5]:
            seen.setdefault(parts[5].strip(), None)
    return list(seen)


_MPI_LIBRARY = re.compile(r"/lib(mpi|mpich|mpi_cray|mpi_intel)(\.so|_[a-z]+\.so|-[^/]*\.so)")
_SONAMES = ("libmpi.so.40", "libmpi.so.12", "libmpi_cray.so.12", "libmpich.so.12", "libmpi.so",
            "libmpich.so")


def query_cuda_support(maps: str | None = None) -> int | None:
    """Call ``MPIX_Query_cuda_support()`` of the loaded MPI library.

    The library is found among the loaded shared objects (``RTLD_NOLOAD``: nothing new is
    loaded). Call after MPI is initialised (importing ``mpi4py.MPI`` does that).

    Args:
        maps: A ``/proc/self/maps`` text (default: read it now).

    Returns:
        What the function returns (1: supported), or None where the library lacks it.
    """
    paths = [p for p in loaded_libraries(read_maps() if maps is None else maps)
             if _MPI_LIBRARY.search(p) and "gtl" not in p]
    for name in [*paths, *_SONAMES]:
        try:
            lib = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        query = getattr(lib, "MPIX_Query_cuda_support", None)
        if query is not None:
            query.restype = ctypes.c_int
            return int(query())
    return None


def read_opal_cuda_support(maps: str) -> bool | None:
    """Read Open MPI 4's run-time CUDA switch, ``opal_cuda_support`` of ``libopen-pal``.

    Open MPI 4's ``MPIX_Query_cuda_support()`` says only how the library was built; this
    variable is what ``MPI_Init`` made of it: false where ``libcuda.so.1`` could not be
    loaded (no GPU driver) or ``OMPI_MCA_opal_cuda_support=0``. Only the libraries mapped
    in ``maps`` are looked at (``RTLD_NOLOAD``: nothing new is loaded).

    Args:
        maps: a ``/proc/self/maps`` text.

    Returns:
        The variable's value, or None where no ``libopen-pal`` is loaded or it lacks it.
    """
    for path in loaded_libraries(maps):
        if re.search(r"/libopen-pal\.so", path):
            try:
                lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD)
                return bool(ctypes.c_bool.in_dll(lib, "opal_cuda_support").value)
            except (OSError, ValueError):
                return None
    return None


def open_mpi_major(library_version: str) -> int | None:
    """Return the major version in Open MPI's ``MPI_Get_library_version`` text.

    Args:
        library_version: the text, e.g. ``"Open MPI v4.1.4, package: ..."``.

    Returns:
        The major version (4 there), or None where the text names no Open MPI version.
    """
    match = re.search(r"open mpi v(\d+)\.", library_version, re.IGNORECASE)
    return int(match.group(1)) if match else None


def library_version() -> str:
    """Return ``MPI_Get_library_version()`` without trailing NUL characters (starts MPI)."""
    from mpi4py import MPI

    return str(MPI.Get_library_version()).replace("\x00", "")


def find_ompi_info(maps: str) -> str | None:
    """Find ``ompi_info`` next to the loaded ``libmpi`` (``<prefix>/bin``), else on PATH.

    Args:
        maps: A ``/proc/self/maps`` text.

    Returns:
        The executable's path, or None when there is none.
    """
    for path in loaded_libraries(maps):
        if re.search(r"/libmpi\.so", path):
            candidate = Path(path).parent.parent / "bin" / "ompi_info"
            if candidate.exists():
                return str(candidate)
    return shutil.which("ompi_info")


def run_ompi_info(executable: str) -> str:
    """Run ``ompi_info --parsable --all`` (for ``kfac-hpc info``; never in a training run).

    Args:
        executable: The path of ``ompi_info``.

    Returns:
        Its standard output (30 s at most).
    """
    proc = subprocess.run([executable, "--parsable", "--all"], capture_output=True, text=True,
                          timeout=30, check=False)
    return proc.stdout


# ---------------------------------------------------------------- decision
def _truthy(value: str | None) -> bool:
    return value is not None and value.strip().lower() in ("1", "true", "yes", "on", "enabled")


def _falsy(value: str | None) -> bool:
    return value is not None and value.strip().lower() in ("0", "false", "no", "off", "disabled")


def parse_override(value: str | bool | None) -> str | None:
    """Read an override value as ``None`` (detect), ``"0"``, ``"1"`` or ``"all"``.

    Args:
        value: A bool, a text such as ``"1"``, ``"off"`` or ``"all"``, or None.

    Returns:
        The normalised override.

    Raises:
        ValueError: The text is none of the accepted values; names them.
    """
    if value is None:
        return None
    if isinstance(value, bool):
        return "1" if value else "0"
    text = value.strip().lower()
    if text in ("1", "true", "yes", "on"):
        return "1"
    if text in ("0", "false", "no", "off"):
        return "0"
    if text == "all":
        return "all"
    raise ValueError(f"{CUDA_AWARE_ENV}={value!r}: use 0 (stage every CUDA tensor), 1 (trust "
                     "the MPI vendor's table of CUDA-aware calls, routing rules included) or "
                     "all (device memory to every call); unset it to detect")


def ucx_tls_allows_cuda(tls: str) -> bool:
    """Say whether a ``UCX_TLS`` value keeps the CUDA transports (``^a,b`` excludes a and b)."""
    text = tls.strip().lower()
    if text.startswith("^"):
        return not ({"cuda", "cuda_copy"} & {t.strip() for t in text[1:].split(",")})
    tokens = {t.strip() for t in text.split(",")}
    return "all" in tokens or any("cuda" in t for t in tokens)


def _ucx_cuda(libraries: list[str], env: Mapping[str, str]) -> tuple[bool, list[str]]:
    """Say whether UCX's CUDA transport is in use (Open MPI's path for non-blocking movement)."""
    cuda_tl = [p for p in libraries if re.search(r"/libuct_cuda[^/]*\.so", p)]
    notes = []
    if cuda_tl:
        notes.append(f"UCX CUDA transport loaded: {Path(cuda_tl[0]).name}")
    elif any(re.search(r"/libucp\.so", p) for p in libraries):
        notes.append("UCX loaded without its CUDA transport (no libuct_cuda*.so)")
    tls = env.get("UCX_TLS")
    if tls is not None and not ucx_tls_allows_cuda(tls):
        notes.append(f"UCX_TLS={tls} excludes the CUDA transports")
        return False, notes
    return bool(cuda_tl), notes


def _open_mpi(query: int | None, libraries: list[str], env: Mapping[str, str],
              ompi_info: str | None, major: int | None,
              runtime: bool | None) -> tuple[bool, frozenset[str], list[str], str | None]:
    notes = [f"MPIX_Query_cuda_support() = {query}" if query is not None
             else "MPIX_Query_cuda_support not exported (CUDA extension disabled)"]
    aware = query == 1
    if major is not None and major < 5 and query is not None:
        # Open MPI 4 answers the query at build time; MPI_Init's verdict is opal_cuda_support.
        notes[0] += f" (Open MPI {major}: built with CUDA support or not; not the run time)"
        loaded = any(re.search(r"/libcuda\.so", p) for p in libraries)
        if runtime is not None:
            notes.append(f"opal_cuda_support (run time) = {str(runtime).lower()}; "
                         f"libcuda.so {'loaded' if loaded else 'not loaded'} in this process")
        if aware and runtime is False:
            notes.append("built with CUDA support, but not usable in this process: Open MPI "
                         "could not load libcuda.so.1 (no GPU driver here) or "
                         "OMPI_MCA_opal_cuda_support=0")
            aware = False
    if ompi_info:
        for key in ("opal_built_with_cuda_support", "mpi_built_with_cuda_support",
                    "opal_cuda_support"):
            match = re.search(rf":{key}:value:(\w+)", ompi_info)
            if match:
                notes.append(f"ompi_info: {key} = {match.group(1)}" + (
                    " (the setting; MPI_Init turns it off where libcuda cannot be loaded)"
                    if key == "opal_cuda_support" else ""))
        if re.search(r":(opal|mpi)_built_with_cuda_support:value:false", ompi_info):
            aware = False
        match = re.search(r"^options:mpi_ext:(.*)$", ompi_info, re.MULTILINE)
        if match:
            notes.append(f"ompi_info: MPI extensions: {match.group(1).strip()}")
    if any(_falsy(env.get(f"OMPI_MCA_{k}_cuda_support")) for k in ("opal", "mpi")):
        notes.append("OMPI_MCA_opal_cuda_support/mpi_cuda_support switches CUDA support off")
        aware = False
    ucx, ucx_notes = _ucx_cuda(libraries, env)
    notes += ucx_notes
    calls = TABLES[OPEN_MPI] | (OPEN_MPI_UCX_EXTRA if ucx else frozenset())
    if aware:
        notes.append("Open MPI: non-blocking reductions never take device memory" +
                     ("" if ucx else "; non-blocking movement only through UCX"))
        notes.append(OPEN_MPI_REDUCTION_NOTE)
    # without UCX (ob1, btl smcuda, coll cuda) reductions are faster staged: ROUTING
    return aware, calls, notes, (None if ucx else OPEN_MPI_COLL_CUDA)


def _mvapich(env: Mapping[str, str]) -> tuple[bool, list[str]]:
    value = env.get("MV2_USE_CUDA")
    if _truthy(value):
        return True, ["MV2_USE_CUDA=1"]
    return False, [f"MV2_USE_CUDA={value!r}: MVAPICH2 takes device buffers only with "
                   "MV2_USE_CUDA=1" if value is not None else
                   "MV2_USE_CUDA unset: MVAPICH2 takes device buffers only with MV2_USE_CUDA=1"]


def _cray(env: Mapping[str, str], libraries: list[str]) -> tuple[bool, list[str]]:
    enabled = _truthy(env.get("MPICH_GPU_SUPPORT_ENABLED"))
    gtl = [p for p in libraries if re.search(r"/libmpi_gtl_[^/]*\.so", p)]
    gtl_cuda = [p for p in gtl if "gtl_cuda" in p]
    notes = [f"MPICH_GPU_SUPPORT_ENABLED={env.get('MPICH_GPU_SUPPORT_ENABLED')!r}",
             f"GTL linked: {', '.join(Path(p).name for p in gtl)}" if gtl else
             "no GPU transport layer (libmpi_gtl_*) linked into this process"]
    if enabled and not gtl_cuda:
        notes.append("GPU support requested but libmpi_gtl_cuda is not linked: build with the "
                     "craype-accel-nvidia* module loaded (or LD_PRELOAD libmpi_gtl_cuda.so)")
    return enabled and bool(gtl_cuda), notes


def _intel(env: Mapping[str, str]) -> tuple[bool, list[str]]:
    value, mode = env.get("I_MPI_OFFLOAD"), env.get("I_MPI_OFFLOAD_MODE", "auto")
    notes = [f"I_MPI_OFFLOAD={value!r}", f"I_MPI_OFFLOAD_MODE={mode}"]
    try:
        level = int(value) if value is not None else 0
    except ValueError:
        level = 1 if _truthy(value) else 0
    if mode.strip().lower() == "level_zero":
        notes.append("offload mode level_zero: Intel GPUs only, not CUDA")
        return False, notes
    if level < 1:
        notes.append("Intel MPI takes device buffers only with I_MPI_OFFLOAD=1")
    return level >= 1, notes


def _mpich(query: int | None, env: Mapping[str, str]) -> tuple[bool, list[str]]:
    notes = [f"MPIX_Query_cuda_support() = {query}" if query is not None
             else "MPIX_Query_cuda_support not exported (MPICH < 4.0 or built without GPU)"]
    if _falsy(env.get("MPIR_CVAR_ENABLE_GPU")):
        notes.append("MPIR_CVAR_ENABLE_GPU=0 switches GPU support off")
        return False, notes
    return query == 1, notes


def detect(override: str | bool | None = None, *,
           env: Mapping[str, str] | None = None,
           library: str | Callable[[], str] = library_version,
           query: int | Callable[[], int | None] | None = None,
           maps: str | Callable[[], str] = read_maps,
           ompi_info: str | Callable[[], str | None] | None = None,
           opal_cuda: bool | Callable[[], bool | None] | None = None) -> CudaSupport:
    """Find out what the MPI library of this process does with CUDA device memory.

    ``override`` comes first, then the environment variable ``KFAC_HPC_CUDA_AWARE``, then
    the evidence. Every input can be injected (a value, or a function producing it), so
    tests fake each vendor on a CPU machine.

    Args:
        override: ``Communicator(cuda_aware=...)``: a bool, ``"0"``, ``"1"``, ``"all"``,
            or None to go on to the environment.
        env: The environment (default ``os.environ``).
        library: ``MPI_Get_library_version``'s text.
        query: ``MPIX_Query_cuda_support()`` (default via ctypes); a function returning
            None fakes a library without it.
        maps: ``/proc/self/maps``.
        ompi_info: ``ompi_info --parsable --all`` output; not run unless given (it forks).
        opal_cuda: Open MPI 4's run-time ``opal_cuda_support`` (default via ctypes, read
            from the ``libopen-pal`` of ``maps``); a function returning None fakes a
            library without it.

    Returns:
        The vendor, the verdict, the calls that take device memory and the evidence.

    Raises:
        ValueError: The override or ``KFAC_HPC_CUDA_AWARE`` has a value not understood.
    """
    env = os.environ if env is None else env
    library_text = library() if callable(library) else library
    maps_text = maps() if callable(maps) else maps
    libraries = loaded_libraries(maps_text)
    vendor = vendor_of(library_text)
    first_line = library_text.strip().splitlines()[0].strip() if library_text.strip() else ""
    query_value = query() if callable(query) else (
        query if query is not None else query_cuda_support(maps_text))
    info_text = ompi_info() if callable(ompi_info) else ompi_info

    routing: str | None = None
    if vendor == OPEN_MPI:
        runtime = opal_cuda() if callable(opal_cuda) else (
            opal_cuda if opal_cuda is not None else read_opal_cuda_support(maps_text))
        aware, calls, notes, routing = _open_mpi(query_value, libraries, env, info_text,
                                                 open_mpi_major(library_text), runtime)
    else:
        calls = TABLES[vendor]
        if vendor == MVAPICH:
            aware, notes = _mvapich(env)
        elif vendor == CRAY_MPICH:
            aware, notes = _cray(env, libraries)
        elif vendor == INTEL_MPI:
            aware, notes = _intel(env)
        elif vendor == MPICH:
            aware, notes = _mpich(query_value, env)
        else:
            aware = query_value == 1
            notes = [f"unrecognised MPI library; MPIX_Query_cuda_support() = {query_value}"]

    forced = parse_override(override)
    source = f"Communicator(cuda_aware={override!r})" if forced is not None else "detected"
    if forced is None:
        forced = parse_override(env.get(CUDA_AWARE_ENV))
        if forced is not None:
            source = f"{CUDA_AWARE_ENV}={env[CUDA_AWARE_ENV]}"
    detected_aware = None
    if forced is not None:
        detected_aware = aware
        notes.append(f"override {source} (detected: {'aware' if aware else 'not aware'})")
        if forced == "0":
            aware = False
        elif forced == "1":
            aware = True
        else:
            aware, calls, routing = True, ALL, None
    rule = None
    if not aware:
        calls = frozenset()
    elif routing is not None and calls & ROUTING[routing].calls:
        rule = replace(ROUTING[routing], calls=calls & ROUTING[routing].calls)
        calls = calls - rule.calls
        notes.append(rule.note())
    if aware and calls & REDUCTIONS:
        notes.append(SIXTEEN_BIT_NOTE)
    return CudaSupport(vendor, aware and bool(calls), frozenset(calls), source, tuple(notes),
                       first_line, rule, detected_aware)
