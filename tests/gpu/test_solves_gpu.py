"""Small eigendecompositions on the host beside the device's, on a real device.

The batches are produced by kernels still in flight when ``eigh_batches`` is called (on
the default and on a side stream), so a copy to the host that did not wait for them
would decompose stale memory; the results must come back to the device and equal the
host's ``eigh`` of the same values.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import Tensor

from kfac_hpc import solves
from kfac_hpc.solves import SolvePlacement

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-only check")

SIZES = (8, 40, 512, 600)  # three on the host (<= 512), one on the device


def _batches(device: torch.device, dtype: torch.dtype) -> list[Tensor]:
    """SPD batches made by GEMMs that are still running when this returns."""
    g = torch.Generator().manual_seed(5)
    out = []
    for n in SIZES:
        x = torch.randn(2, 8 * n, n, generator=g, dtype=dtype).to(device)
        out.append(x.mT @ x / (8 * n) + torch.eye(n, dtype=dtype, device=device))
    return out


def _check(batches: list[Tensor], results: list[solves.EighResult], tol: float) -> None:
    for batch, result in zip(batches, results):
        assert not isinstance(result, Exception), result
        evals, evecs = result
        assert evals.device == batch.device and evecs.device == batch.device
        reference = torch.linalg.eigvalsh(batch.cpu())
        torch.testing.assert_close(evals.cpu(), reference, rtol=tol, atol=tol)
        rebuilt = (evecs * evals.unsqueeze(-2)) @ evecs.mT
        torch.testing.assert_close(rebuilt, batch, rtol=tol, atol=tol * float(evals.max()))


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
def test_results_equal_the_host_eigh(device: torch.device, dtype: torch.dtype,
                                     tol: float) -> None:
    batches = _batches(device, dtype)
    _check(batches, solves.eigh_batches(batches, SolvePlacement(512)), tol)


@needs_cuda
def test_a_side_stream_is_waited_for_and_the_worker_used(device: torch.device,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    threads: list[str] = []
    solve = solves._solve_on_host

    def recording(*args: Any) -> tuple[Tensor, ...]:  # whatever the worker's signature
        threads.append(threading.current_thread().name)
        return solve(*args)

    monkeypatch.setattr(solves, "_solve_on_host", recording)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        batches = _batches(device, torch.float64)
        results = solves.eigh_batches(batches, SolvePlacement(512))
        kept = [(r[0].clone(), r[1].clone()) for r in results if not isinstance(r, Exception)]
    torch.cuda.current_stream(device).wait_stream(side)
    assert len(threads) == 3 and all(t.startswith("kfac-hpc-host-solves") for t in threads)
    assert len(kept) == len(SIZES)
    _check(batches, list(kept), 1e-10)


@needs_cuda
def test_float32_factors_of_jacobis_range_are_decomposed_in_float64(device: torch.device
                                                                   ) -> None:
    """A 256-row float32 factor: the float64 decomposition, cast back, and closer to the
    exact one than cuSOLVER's float32 Jacobi result."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 1024, 256, generator=g).to(device)
    batch = x.mT @ x / 1024
    values, vectors = solves.symmetric_eigh(batch)
    want_values, want_vectors = torch.linalg.eigh(batch.double())
    assert values.dtype == vectors.dtype == torch.float32
    assert torch.equal(values, want_values.float()) and torch.equal(vectors, want_vectors.float())
    # the nearest float32 to each float64 eigenvalue: no float32 solver can be closer
    jacobi_values, _ = torch.linalg.eigh(batch)
    assert ((values.double() - want_values).abs().max()
            <= (jacobi_values.double() - want_values).abs().max())


@needs_cuda
def test_batches_spread_over_streams_equal_one_stream(device: torch.device) -> None:
    """Batches still being computed on a side stream, spread over 3 streams: the same
    bits and layout as on the calling stream, and the caller's stream waits for them."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        batches = _batches(device, torch.float32)
        one = solves.eigh_batches(batches, SolvePlacement(0, 1))
        spread = solves.eigh_batches(batches, SolvePlacement(0, 3))
        pairs = [(a[0] - b[0], a[1] - b[1]) for a, b in zip(one, spread)
                 if not isinstance(a, Exception) and not isinstance(b, Exception)]
        strides = [(a[1].stride(), b[1].stride()) for a, b in zip(one, spread)
                   if not isinstance(a, Exception) and not isinstance(b, Exception)]
    torch.cuda.current_stream(device).wait_stream(side)
    assert len(pairs) == len(SIZES)
    for dvalues, dvectors in pairs:
        assert not dvalues.any() and not dvectors.any()
    assert all(a == b for a, b in strides), strides


@needs_cuda
def test_a_fresh_process_spreads_its_first_decompositions_over_streams() -> None:
    """The first linear algebra of a process, on 4 lanes at once: torch loads its CUDA
    linear algebra on the first call, and lanes making that call together can fail ("lazy
    wrapper should be called at most once", a race: without ``solves.load_cuda_linalg``
    this may pass by luck) unless it was loaded before them; every batch solved, the bits
    of one stream."""
    import os
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import torch
        from kfac_hpc import solves
        from kfac_hpc.solves import SolvePlacement
        g = torch.Generator().manual_seed(0)
        batches = []
        for n in (40, 300, 600):
            x = torch.randn(8, 4 * n, n, generator=g).cuda()
            batches.append(x.mT @ x / (4 * n) + torch.eye(n, device="cuda"))
        spread = solves.eigh_batches(batches, SolvePlacement(0, 4))
        failed = [repr(r) for r in spread if isinstance(r, Exception)]
        assert not failed, failed
        one = solves.eigh_batches(batches, SolvePlacement(0, 1))
        assert all(torch.equal(a[k], b[k]) for a, b in zip(one, spread) for k in (0, 1))
        print("ok")
        """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=dict(os.environ), timeout=300, check=False)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-2000:]


@needs_cuda
def test_repeated_solves_are_bitwise_equal_under_deterministic_algorithms() -> None:
    """Under ``torch.use_deterministic_algorithms(True)`` with the cuBLAS workspace setting
    it asks for, 8 streams asked for: ten repeats of the same solves equal the first bit for
    bit (on an H200, spread over 8 streams, 11 to 19 of 19 repeats differed)."""
    import os
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import torch
        from kfac_hpc import solves
        from kfac_hpc.solves import SolvePlacement
        torch.use_deterministic_algorithms(True, warn_only=True)
        g = torch.Generator().manual_seed(0)
        batches = []
        for n, count in ((576, 3), (288, 6), (144, 8), (65, 4)):
            rows = torch.randn(count, max(n // 8, 1), n, generator=g, dtype=torch.float64)
            spd = rows.mT @ rows + 1e-3 * torch.eye(n, dtype=torch.float64)
            batches.append(spd.cuda())
        first = solves.eigh_batches(batches, SolvePlacement(0, 8))
        differ = 0
        for _ in range(10):
            again = solves.eigh_batches(batches, SolvePlacement(0, 8))
            differ += any(not torch.equal(a[k], b[k]) for a, b in zip(first, again)
                          for k in (0, 1))
        print(f"differ {differ}")
        """)
    env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}  # read when CUDA starts
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=300, check=False)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == "differ 0", p.stdout
