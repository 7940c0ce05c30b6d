"""CUDA-aware MPI detection, per vendor, with faked evidence (runs on any CPU machine).

Every input of :func:`kfac_hpc.comm.cuda.detect` is injected: the library's version
string, ``MPIX_Query_cuda_support()``, ``/proc/self/maps``, the environment and
``ompi_info``. The real process is checked too, for consistency only.
"""

from __future__ import annotations

import logging

import pytest

from kfac_hpc.comm import Communicator, cuda, staging, threads
from kfac_hpc.comm.cuda import (
    ALL,
    BLOCKING,
    BLOCKING_REDUCTIONS,
    CALLS,
    CRAY_MPICH,
    INTEL_MPI,
    MPICH,
    MVAPICH,
    NONBLOCKING_MOVEMENT,
    NONBLOCKING_REDUCTIONS,
    OPEN_MPI,
    UNKNOWN,
    StagingCause,
    detect,
    vendor_of,
)

OPEN_MPI_VERSION = "Open MPI v5.0.3, package: Open MPI hpcx Distribution, ident: 5.0.3"
MPICH_VERSION = "MPICH Version:      4.2.0\nMPICH Release date: Fri Feb  9 2024"
MVAPICH_VERSION = "MVAPICH2-GDR Version      :\t2.3.7\nMVAPICH2 Release date     :\tWed March 02"
CRAY_VERSION = "MPI VERSION    : CRAY MPICH version 8.1.28.2 (ANL base 3.4a2)\nMPI BUILD INFO"
INTEL_VERSION = "Intel(R) MPI Library 2021.12 for Linux* OS\n"


def maps_with(*paths: str) -> str:
    """A /proc/self/maps text that maps each of ``paths``."""
    lines = []
    for i, path in enumerate(paths):
        start = 0x7F0000000000 + i * 0x10000
        lines.append(f"{start:x}-{start + 0x1000:x} r-xp 00000000 08:01 {1000 + i}    {path}")
    lines.append("7ffc00000000-7ffc00021000 rw-p 00000000 00:00 0          [stack]")
    return "\n".join(lines) + "\n"


LIBMPI = "/opt/openmpi/lib/libmpi.so.40.30.5"
UCX = ("/opt/ucx/lib/libucp.so.0.0.0", "/opt/ucx/lib/ucx/libuct_cma.so.0.0.0")
UCX_CUDA = "/opt/ucx/lib/ucx/libuct_cuda.so.0.0.0"
GTL_CUDA = "/opt/cray/pe/mpich/8.1.28/gtl/lib/libmpi_gtl_cuda.so.0"
GTL_HSA = "/opt/cray/pe/mpich/8.1.28/gtl/lib/libmpi_gtl_hsa.so.0"


def fake(library: str, *, env: dict[str, str] | None = None, query: int | None = None,
         maps: str = "", ompi_info: str | None = None,
         override: str | bool | None = None) -> cuda.CudaSupport:
    return detect(override, env=env or {}, library=library, query=lambda: query, maps=maps,
                  ompi_info=ompi_info)


# ------------------------------------------------------------------ vendors
@pytest.mark.parametrize(("text", "vendor"), [
    (OPEN_MPI_VERSION, OPEN_MPI), (MPICH_VERSION, MPICH), (MVAPICH_VERSION, MVAPICH),
    ("MVAPICH Version: 3.0\n", MVAPICH), (CRAY_VERSION, CRAY_MPICH), (INTEL_VERSION, INTEL_MPI),
    ("Some Other MPI 1.0", UNKNOWN), ("", UNKNOWN)])
def test_vendor_from_library_version(text: str, vendor: str) -> None:
    assert vendor_of(text) == vendor


# ------------------------------------------------------------------ Open MPI
def test_open_mpi_without_cuda_stages_everything() -> None:
    support = fake(OPEN_MPI_VERSION, query=0, maps=maps_with(LIBMPI, *UCX))
    assert not support.aware and support.device_calls == frozenset()
    assert support.vendor == OPEN_MPI and support.source == "detected"
    assert "MPIX_Query_cuda_support() = 0" in support.evidence
    assert any("without its CUDA transport" in e for e in support.evidence)
    assert set(support.table().values()) == {"staged"}


MOVEMENT = BLOCKING - BLOCKING_REDUCTIONS  # bcast, allgather(v), send, recv


def test_open_mpi_cuda_aware_ob1_takes_blocking_calls_only() -> None:
    """Without UCX, Open MPI takes device memory in the blocking calls; the routing rule
    stages its blocking reductions (coll cuda reduces on the CPU, measured slower) and
    leaves the data movement direct."""
    support = fake(OPEN_MPI_VERSION, query=1, maps=maps_with(LIBMPI))
    assert support.aware and support.device_calls == MOVEMENT
    assert support.routed == BLOCKING_REDUCTIONS == {"allreduce", "reduce", "reduce_scatter"}
    for call in NONBLOCKING_REDUCTIONS | NONBLOCKING_MOVEMENT | BLOCKING_REDUCTIONS:
        assert not support.device_ok(call), call
    assert support.device_ok("bcast") and support.device_ok("allgatherv")
    assert support.device_ok("send") and support.device_ok("recv")
    # the library's own table, routing undone (what tests and benchmarks measure)
    unrouted = support.unrouted()
    assert unrouted.device_calls == BLOCKING and unrouted.routed == frozenset()
    assert unrouted.device_ok("allreduce") and unrouted.device_ok("reduce_scatter")
    assert cuda.SIXTEEN_BIT_NOTE in unrouted.evidence
    assert not any(e.startswith("routing (") for e in unrouted.evidence)


def test_the_evidence_says_what_happens_to_device_reductions() -> None:
    """Where a reduction goes direct, the evidence (``kfac-hpc info``) says 16-bit floats
    are widened on the device first; for Open MPI, that the library reduces on the CPU."""
    ucx = maps_with(LIBMPI, *UCX, UCX_CUDA)
    for support in (fake(OPEN_MPI_VERSION, query=1, maps=ucx), fake(MPICH_VERSION, query=1),
                    fake(MVAPICH_VERSION, env={"MV2_USE_CUDA": "1"}),
                    fake(MPICH_VERSION, query=0, override="all"),
                    fake(OPEN_MPI_VERSION, query=1, override="all")):
        assert support.aware and cuda.SIXTEEN_BIT_NOTE in support.evidence, support.summary()
    assert cuda.OPEN_MPI_REDUCTION_NOTE in fake(OPEN_MPI_VERSION, query=1, maps=ucx).evidence
    assert cuda.OPEN_MPI_REDUCTION_NOTE not in fake(MPICH_VERSION, query=1).evidence
    # without UCX no reduction gets device memory (routing): no widening note, but the
    # reason, and the rule with its measurement
    routed = fake(OPEN_MPI_VERSION, query=1)
    assert cuda.SIXTEEN_BIT_NOTE not in routed.evidence
    assert cuda.OPEN_MPI_REDUCTION_NOTE in routed.evidence
    rule = cuda.ROUTING[cuda.OPEN_MPI_COLL_CUDA]
    assert rule.note() in routed.evidence
    assert rule.note().startswith("routing (Open MPI without UCX): allreduce, reduce, "
                                  "reduce_scatter staged through pinned host memory on purpose")
    assert "2-3.5x slower direct" in rule.note() and "NVIDIA H200" in rule.note()
    for support in (fake(OPEN_MPI_VERSION, query=0), fake(MPICH_VERSION, query=1, override=False)):
        assert not support.aware
        assert cuda.SIXTEEN_BIT_NOTE not in support.evidence
        assert cuda.OPEN_MPI_REDUCTION_NOTE not in support.evidence


def test_open_mpi_with_ucx_cuda_adds_nonblocking_movement_never_reductions() -> None:
    support = fake(OPEN_MPI_VERSION, query=1, maps=maps_with(LIBMPI, *UCX, UCX_CUDA))
    assert support.device_calls == BLOCKING | NONBLOCKING_MOVEMENT
    assert support.device_ok("ibcast") and support.device_ok("iallgatherv")
    assert not support.device_ok("iallreduce") and not support.device_ok("ireduce_scatter")
    assert any("libuct_cuda" in e for e in support.evidence)


def test_open_mpi_ucx_tls_without_cuda_drops_the_ucx_calls() -> None:
    support = fake(OPEN_MPI_VERSION, query=1, env={"UCX_TLS": "rc,sm,self"},
                   maps=maps_with(LIBMPI, *UCX, UCX_CUDA))
    assert support.device_calls == MOVEMENT and support.routed == BLOCKING_REDUCTIONS
    assert any("excludes the CUDA transports" in e for e in support.evidence)
    assert cuda.ucx_tls_allows_cuda("rc,cuda_copy,cuda_ipc")
    assert cuda.ucx_tls_allows_cuda("all") and cuda.ucx_tls_allows_cuda("^ib")
    assert not cuda.ucx_tls_allows_cuda("^cuda_copy,ib")


def test_open_mpi_runtime_switch_and_ompi_info_overrule_the_query() -> None:
    off = fake(OPEN_MPI_VERSION, query=1, env={"OMPI_MCA_opal_cuda_support": "0"})
    assert not off.aware
    info = ("mca:opal:base:param:opal_built_with_cuda_support:value:false\n"
            "options:mpi_ext:affinity, cuda, ftmpi\n")
    built_without = fake(OPEN_MPI_VERSION, query=1, ompi_info=info)
    assert not built_without.aware
    assert "ompi_info: opal_built_with_cuda_support = false" in built_without.evidence
    assert "ompi_info: MPI extensions: affinity, cuda, ftmpi" in built_without.evidence


def test_open_mpi_without_the_query_symbol_is_not_aware() -> None:
    support = fake(OPEN_MPI_VERSION, query=None)
    assert not support.aware
    assert any("not exported" in e for e in support.evidence)


OPEN_MPI_4_VERSION = "Open MPI v4.1.4, package: Open MPI root@build Distribution, ident: 4.1.4"
LIBOPEN_PAL = "/opt/openmpi/lib/libopen-pal.so.40.30.2"
LIBCUDA = "/usr/lib/x86_64-linux-gnu/libcuda.so.580.65.06"


def test_open_mpi_4_built_with_cuda_but_off_at_run_time_is_not_aware() -> None:
    """Open MPI 4 answers the query at build time: MPI_Init's verdict decides."""
    support = detect(env={}, library=OPEN_MPI_4_VERSION, query=lambda: 1,
                     maps=maps_with(LIBMPI, LIBOPEN_PAL), opal_cuda=False)
    assert not support.aware and support.device_calls == frozenset()
    assert support.evidence[0].startswith("MPIX_Query_cuda_support() = 1 (Open MPI 4: built")
    assert "opal_cuda_support (run time) = false; libcuda.so not loaded in this process" \
        in support.evidence
    assert any(e.startswith("built with CUDA support, but not usable in this process")
               for e in support.evidence)


def test_open_mpi_4_with_cuda_on_at_run_time_takes_blocking_calls() -> None:
    support = detect(env={}, library=OPEN_MPI_4_VERSION, query=lambda: 1,
                     maps=maps_with(LIBMPI, LIBOPEN_PAL, LIBCUDA), opal_cuda=True)
    assert support.aware and support.device_calls == MOVEMENT  # reductions: routing
    assert support.routed == BLOCKING_REDUCTIONS
    assert "opal_cuda_support (run time) = true; libcuda.so loaded in this process" \
        in support.evidence
    unknown = detect(env={}, library=OPEN_MPI_4_VERSION, query=lambda: 1, maps="",
                     opal_cuda=lambda: None)  # a build whose libopen-pal lacks the variable
    assert unknown.aware and not any("run time) =" in e for e in unknown.evidence)


def test_open_mpi_5_query_is_the_run_time_verdict() -> None:
    """Open MPI 5's query already answers for the run time: opal_cuda_support is not read."""
    support = detect(env={}, library=OPEN_MPI_VERSION, query=lambda: 1, maps="",
                     opal_cuda=False)
    assert support.aware and support.evidence[0] == "MPIX_Query_cuda_support() = 1"
    assert cuda.open_mpi_major(OPEN_MPI_VERSION) == 5
    assert cuda.open_mpi_major(OPEN_MPI_4_VERSION) == 4
    assert cuda.open_mpi_major(MPICH_VERSION) is None


def test_opal_cuda_support_is_read_from_the_mapped_libopen_pal_only() -> None:
    assert cuda.read_opal_cuda_support(maps_with(LIBMPI, "/usr/lib/libc.so.6")) is None
    assert cuda.read_opal_cuda_support(maps_with(LIBOPEN_PAL)) is None  # not loaded here


# ------------------------------------------------------------- other vendors
def test_mvapich_needs_mv2_use_cuda() -> None:
    off = fake(MVAPICH_VERSION)
    assert not off.aware and any("MV2_USE_CUDA unset" in e for e in off.evidence)
    on = fake(MVAPICH_VERSION, env={"MV2_USE_CUDA": "1"})
    assert on.aware and on.device_calls == BLOCKING


def test_cray_needs_the_switch_and_the_cuda_gtl_linked() -> None:
    both = fake(CRAY_VERSION, env={"MPICH_GPU_SUPPORT_ENABLED": "1"}, maps=maps_with(GTL_CUDA))
    assert both.aware and both.device_calls == ALL
    no_gtl = fake(CRAY_VERSION, env={"MPICH_GPU_SUPPORT_ENABLED": "1"})
    assert not no_gtl.aware
    assert any("libmpi_gtl_cuda is not linked" in e for e in no_gtl.evidence)
    amd_gtl = fake(CRAY_VERSION, env={"MPICH_GPU_SUPPORT_ENABLED": "1"}, maps=maps_with(GTL_HSA))
    assert not amd_gtl.aware
    no_switch = fake(CRAY_VERSION, maps=maps_with(GTL_CUDA))
    assert not no_switch.aware


def test_intel_mpi_needs_offload_and_not_level_zero() -> None:
    assert not fake(INTEL_VERSION).aware
    on = fake(INTEL_VERSION, env={"I_MPI_OFFLOAD": "1"})
    assert on.aware and on.device_calls == BLOCKING
    assert fake(INTEL_VERSION, env={"I_MPI_OFFLOAD": "2"}).aware  # older "enabled" value
    level_zero = fake(INTEL_VERSION, env={"I_MPI_OFFLOAD": "1", "I_MPI_OFFLOAD_MODE": "level_zero"})
    assert not level_zero.aware


def test_mpich_query_and_gpu_switch() -> None:
    on = fake(MPICH_VERSION, query=1)
    assert on.aware and on.device_calls == ALL
    assert not fake(MPICH_VERSION, query=0).aware
    assert not fake(MPICH_VERSION, query=1, env={"MPIR_CVAR_ENABLE_GPU": "0"}).aware


def test_unknown_library_trusts_only_blocking_calls() -> None:
    support = fake("Weird MPI 9", query=1)
    assert support.vendor == UNKNOWN and support.device_calls == BLOCKING
    assert not fake("Weird MPI 9", query=None).aware


# ----------------------------------------------------------------- override
@pytest.mark.parametrize("value", ["0", "false", "OFF"])
def test_env_override_off(value: str) -> None:
    support = fake(MPICH_VERSION, query=1, env={cuda.CUDA_AWARE_ENV: value})
    assert not support.aware and support.device_calls == frozenset()
    assert support.source == f"{cuda.CUDA_AWARE_ENV}={value}"
    assert any("detected: aware" in e for e in support.evidence)


def test_env_override_on_uses_the_vendor_table() -> None:
    """``1``: as if detected, the vendor's table with its routing rules."""
    support = fake(OPEN_MPI_VERSION, query=0, env={cuda.CUDA_AWARE_ENV: "1"})
    assert support.aware and support.unrouted().device_calls == BLOCKING  # no i-reductions
    assert support.device_calls == MOVEMENT and support.routed == BLOCKING_REDUCTIONS
    with_ucx = fake(OPEN_MPI_VERSION, query=0, env={cuda.CUDA_AWARE_ENV: "1"},
                    maps=maps_with(LIBMPI, *UCX, UCX_CUDA))
    assert with_ucx.device_calls == BLOCKING | NONBLOCKING_MOVEMENT and not with_ucx.routed


def test_env_override_all_and_argument_beats_env() -> None:
    support = fake(OPEN_MPI_VERSION, query=0, env={cuda.CUDA_AWARE_ENV: "all"})
    assert support.device_calls == ALL
    argument = fake(OPEN_MPI_VERSION, query=1, env={cuda.CUDA_AWARE_ENV: "all"}, override=False)
    assert not argument.aware and argument.source == "Communicator(cuda_aware=False)"
    assert argument.detected_aware is True and argument.routed == frozenset()


@pytest.mark.parametrize("override", ["all", "0", "1", None])
def test_the_routing_rule_follows_the_override(override: str | None) -> None:
    """``all`` hands device memory to every call, routed ones too; ``0`` stages everything
    (nothing routed: staging is forced); ``1`` and detection route."""
    support = fake(OPEN_MPI_VERSION, query=1, maps=maps_with(LIBMPI), override=override)
    routed = any(e.startswith("routing (") for e in support.evidence)
    if override == "all":
        assert support.device_calls == ALL and not support.routed and not routed
    elif override == "0":
        assert support.device_calls == frozenset() and not support.routed and not routed
    else:
        assert support.device_calls == MOVEMENT and support.routed == BLOCKING_REDUCTIONS
        assert routed and support.as_dict()["routed"] == ["allreduce", "reduce",
                                                           "reduce_scatter"]


@pytest.mark.parametrize(("name", "support", "expected"), [
    ("Open MPI + UCX", fake(OPEN_MPI_VERSION, query=1, maps=maps_with(LIBMPI, *UCX, UCX_CUDA)),
     BLOCKING | NONBLOCKING_MOVEMENT),
    ("MPICH", fake(MPICH_VERSION, query=1), ALL),
    ("Cray MPICH (GTL)", fake(CRAY_VERSION, env={"MPICH_GPU_SUPPORT_ENABLED": "1"},
                              maps=maps_with(GTL_CUDA)), ALL),
    ("MVAPICH2-GDR", fake(MVAPICH_VERSION, env={"MV2_USE_CUDA": "1"}), BLOCKING),
    ("Intel MPI", fake(INTEL_VERSION, env={"I_MPI_OFFLOAD": "1"}), BLOCKING),
    ("unknown", fake("Weird MPI 9", query=1), BLOCKING),
    ("MPICH, KFAC_HPC_CUDA_AWARE=1", fake(MPICH_VERSION, query=0, override="1"), ALL),
])
def test_other_libraries_keep_their_routing(name: str, support: cuda.CudaSupport,
                                            expected: frozenset[str]) -> None:
    """The routing rule is Open MPI's without UCX only: every other library's reductions
    take device memory where its table says so."""
    assert support.device_calls == expected, name
    assert support.routing is None and support.routed == frozenset(), name
    assert support.unrouted() is support
    assert not any(e.startswith("routing (") for e in support.evidence), name
    assert support.device_ok("allreduce") and support.device_ok("bcast"), name


def test_why_staged_names_the_real_cause() -> None:
    ob1 = fake(OPEN_MPI_VERSION, query=1, maps=maps_with(LIBMPI))
    cause, why = ob1.why_staged("allreduce")
    assert cause is StagingCause.ROUTED
    assert why == cuda.ROUTING[cuda.OPEN_MPI_COLL_CUDA].note() and "not CUDA-aware" not in why
    cause, why = ob1.why_staged("iallreduce")
    assert cause is StagingCause.NOT_IN_TABLE
    assert why == "Open MPI does not take device memory in iallreduce"
    assert ob1.calls_staged_for(StagingCause.ROUTED) == ("allreduce", "reduce", "reduce_scatter")
    assert ob1.calls_staged_for(StagingCause.NOT_IN_TABLE) == (
        "iallreduce", "ireduce", "ireduce_scatter", "ibcast", "iallgather", "iallgatherv")
    with pytest.raises(ValueError, match="bcast takes device memory here"):
        ob1.why_staged("bcast")

    forced = fake(OPEN_MPI_VERSION, query=1, env={cuda.CUDA_AWARE_ENV: "0"})
    cause, why = forced.why_staged("allreduce")
    assert cause is StagingCause.FORCED
    assert why == "staging forced by KFAC_HPC_CUDA_AWARE=0 (detected: CUDA-aware)"
    argument = fake(MPICH_VERSION, query=0, override=False)
    assert argument.why_staged("bcast") == (
        StagingCause.FORCED, "staging forced by Communicator(cuda_aware=False) "
                             "(detected: not CUDA-aware)")
    selfcheck = cuda.CudaSupport.staged(OPEN_MPI, "selfcheck")
    assert selfcheck.why_staged("send") == (StagingCause.FORCED, "staging forced by selfcheck")

    not_aware = fake(OPEN_MPI_VERSION, query=0)
    cause, why = not_aware.why_staged("allreduce")
    assert cause is StagingCause.NOT_AWARE
    assert why.startswith("the MPI library (Open MPI) is not CUDA-aware here: "
                          "MPIX_Query_cuda_support() = 0")
    assert not_aware.calls_staged_for(StagingCause.NOT_AWARE) == CALLS


def test_bad_override_names_the_choices() -> None:
    with pytest.raises(ValueError, match=r"KFAC_HPC_CUDA_AWARE='maybe': use 0 .* 1 .* or all"):
        fake(MPICH_VERSION, env={cuda.CUDA_AWARE_ENV: "maybe"})


def test_table_summary_and_unknown_call() -> None:
    support = fake(OPEN_MPI_VERSION, query=1)
    table = support.table()
    assert list(table) == list(CALLS)
    assert table["bcast"] == "device" and table["iallreduce"] == "staged"
    assert table["allreduce"] == "staged"  # routing
    assert "iallreduce" in support.staged_calls and "allreduce" in support.staged_calls
    assert support.summary().startswith("Open MPI: CUDA-aware for bcast, allgather")
    assert support.as_dict()["table"] == table
    with pytest.raises(ValueError, match="unknown MPI call 'alltoall'"):
        support.device_ok("alltoall")


# ----------------------------------------------------------------- plumbing
def test_maps_parsing_and_ompi_info_location(tmp_path) -> None:
    prefix = tmp_path / "mpi"
    (prefix / "lib").mkdir(parents=True)
    (prefix / "bin").mkdir()
    (prefix / "bin" / "ompi_info").write_text("#!/bin/sh\n")
    libmpi = str(prefix / "lib" / "libmpi.so.40")
    text = maps_with(libmpi, libmpi, "/usr/lib/libc.so.6")
    assert cuda.loaded_libraries(text) == [libmpi, "/usr/lib/libc.so.6"]
    assert cuda.find_ompi_info(text) == str(prefix / "bin" / "ompi_info")


@pytest.mark.mpi(min_size=1)
def test_this_process_is_consistent() -> None:
    """The real library: the query agrees with the verdict unless an override decided."""
    support = detect(env={})
    query = cuda.query_cuda_support()
    assert support.vendor == vendor_of(cuda.library_version())
    major = cuda.open_mpi_major(cuda.library_version())
    if support.vendor == OPEN_MPI and major is not None and major < 5:
        runtime = cuda.read_opal_cuda_support(cuda.read_maps())
        assert support.aware == (query == 1 and runtime is not False)
    elif support.vendor in (OPEN_MPI, MPICH):
        assert support.aware == (query == 1)
    assert Communicator(cuda_aware=False).cuda.device_calls == frozenset()
    assert Communicator(cuda_aware="all").cuda.device_calls == ALL


@pytest.mark.mpi(min_size=1)
def test_this_open_mpi_4_built_with_cuda_says_so_without_a_gpu() -> None:
    """An Open MPI 4 built with CUDA (tools/build-cuda-aware-mpi.sh), run where no GPU
    driver is: built with CUDA, off at run time, every call staged."""
    import torch

    major = cuda.open_mpi_major(cuda.library_version())
    if major is None or major >= 5 or cuda.query_cuda_support() != 1:
        pytest.skip(f"not an Open MPI 4 built with CUDA: {cuda.library_version().splitlines()[0]}")
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: CUDA support is on at run time (the GPU suite checks it)")
    support = detect(env={})
    assert cuda.read_opal_cuda_support(cuda.read_maps()) is False
    assert not support.aware and support.device_calls == frozenset()
    assert any(e.startswith("built with CUDA support, but not usable in this process")
               for e in support.evidence)


# ----------------------------------------------------------- warning, threads
@pytest.mark.mpi(min_size=1)
def test_staging_warning_names_the_cost_once(caplog: pytest.LogCaptureFixture) -> None:
    from mpi4py import MPI

    staging.reset_warning()
    with caplog.at_level(logging.DEBUG, logger="kfac_hpc.comm"):
        staging.warn_staging_once("iallreduce", 4096, "Open MPI is not CUDA-aware here",
                                  ("iallreduce", "ireduce_scatter"))
        staging.warn_staging_once("allreduce", 8, "again", ("allreduce",))
    records = [r for r in caplog.records if r.name == "kfac_hpc.comm"]
    assert len(records) == 1
    text = records[0].getMessage()
    assert "staged through pinned host memory for iallreduce, ireduce_scatter" in text
    assert "device-to-host and a host-to-device copy" in text and "KFAC_HPC_CUDA_AWARE=1" in text
    expected = logging.WARNING if MPI.COMM_WORLD.Get_rank() == 0 else logging.DEBUG
    assert records[0].levelno == expected
    staging.reset_warning()
    # a CUDA-aware library whose table leaves out some calls: no "use a CUDA-aware MPI"
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="kfac_hpc.comm"):
        staging.warn_staging_once("iallreduce", 64, "Open MPI does not take device memory in "
                                  "iallreduce", ("iallreduce",), staging.PER_CALL_ADVICE)
    text = "".join(r.getMessage() for r in caplog.records if r.name == "kfac_hpc.comm")
    assert "per-call table" in text and "KFAC_HPC_CUDA_AWARE=all" in text
    assert "Use a CUDA-aware MPI" not in text
    staging.reset_warning()


def test_info_names_the_routed_calls() -> None:
    from kfac_hpc.runtime.info import format_table

    def lines(support: cuda.CudaSupport) -> list[str]:
        detection = support.as_dict() | {"override": "KFAC_HPC_CUDA_AWARE=0|1|all"}
        return format_table({"mpi_library": support.library,
                             "cuda_detection": detection}).splitlines()

    ob1 = lines(fake(OPEN_MPI_4_VERSION, query=1, maps=maps_with(LIBMPI)))
    assert "  device memory to MPI: bcast, allgather, allgatherv, send, recv" in ob1
    assert ("  of which staged by routing, faster than the library's device path: "
            "allreduce, reduce, reduce_scatter") in ob1
    assert any(line.startswith("  evidence: routing (Open MPI without UCX)") for line in ob1)
    ucx = lines(fake(OPEN_MPI_4_VERSION, query=1, maps=maps_with(LIBMPI, *UCX, UCX_CUDA)))
    assert not any("staged by routing" in line for line in ucx)


def test_hook_thread_level_is_checked() -> None:
    from mpi4py import MPI

    threads.require_hook_level(MPI.THREAD_SERIALIZED)
    threads.require_hook_level(MPI.THREAD_MULTIPLE)
    with pytest.raises(threads.ThreadLevelError,
                       match=r"provides only MPI_THREAD_FUNNELED.*at least MPI_THREAD_SERIALIZED"):
        threads.require_hook_level(MPI.THREAD_FUNNELED)


@pytest.mark.mpi(min_size=1)
def test_info_shows_the_evidence_and_the_table() -> None:
    from kfac_hpc.runtime.info import collect, format_table

    info = collect(run_ompi_info=False)
    detection = info["cuda_detection"]
    assert info["cuda_aware_mpi"] == detection["aware"]
    assert list(detection["table"]) == list(CALLS) and detection["evidence"]
    text = format_table(info)
    assert "CUDA-aware MPI detection:" in text and "  evidence: " in text
    assert "  staged through pinned host memory: " in text
    assert f"{cuda.CUDA_AWARE_ENV}=0|1|all" in text
