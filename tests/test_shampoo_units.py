"""Shampoo building blocks: blocking, ownership and wire layout, roots, Kronecker products."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from shared_cases import cuda_fp32_settings_seen

from kfac_hpc.shampoo import (
    Layout,
    RootComputationError,
    block_param,
    inverse_root,
    kronecker,
    merge_dims,
)
from kfac_hpc.shampoo.blocking import MergeOrder, split_dim
from kfac_hpc.shampoo.kronecker import accumulate_factors, gram_operand, mode_matrices, precondition


@pytest.mark.parametrize("shape,max_dim,merged", [
    ((64, 32, 3, 3), 1024, (64, 288)),
    ((3, 4), 1024, (12,)),
    ((3, 4), 4, (3, 4)),
    ((2000, 10), 1024, (2000, 10)),
    ((1, 10, 1), 4, (10,)),
    ((), 8, (1,)),
    ((1, 1), 8, (1,)),
    ((5, 2, 2, 7), 4, (5, 4, 7)),
])
def test_merge_dims(shape: tuple[int, ...], max_dim: int, merged: tuple[int, ...]) -> None:
    assert merge_dims(shape, max_dim) == merged


@pytest.mark.parametrize("shape,max_dim,last,first", [
    ((32, 32, 3, 3), 1024, (32, 288), (1024, 9)),  # a ResNet-20 conv: (out, in·kh·kw)
    ((128, 128, 3, 3), 1024, (128, 128, 9), (128, 384, 3)),
    ((64, 3, 7, 7), 1024, (64, 147), (192, 49)),  # ResNet's stem
    ((32, 3, 64, 64), 8192, (96, 4096), (6144, 64)),
    ((1, 2, 5, 1), 10, (10,), (10,)),
    ((2, 3, 4), 12, (2, 12), (6, 4)),
])
def test_merge_dims_from_the_last_or_the_first_dimension(
        shape: tuple[int, ...], max_dim: int, last: tuple[int, ...],
        first: tuple[int, ...]) -> None:
    """The default merges from the last dimension (as Meta's Distributed Shampoo does)."""
    assert merge_dims(shape, max_dim) == last == merge_dims(shape, max_dim, "last")
    assert merge_dims(shape, max_dim, "first") == first
    assert [b.merged_shape for b in block_param("w", shape, max_dim, "first")][:1] == [first]


def test_merge_dims_refuses_an_unknown_order() -> None:
    with pytest.raises(ValueError, match="merge_from must be one of"):
        merge_dims((4, 4), 8, "middle")  # type: ignore[arg-type]


def test_split_dim() -> None:
    assert split_dim(10, 4) == [4, 4, 2]
    assert split_dim(8, 4) == [4, 4]
    assert split_dim(3, 4) == [3]


@pytest.mark.parametrize("merge_from", ["last", "first"])
@pytest.mark.parametrize("shape,max_dim", [((7, 10), 3), ((4, 5, 6), 4), ((9,), 2),
                                           ((64, 32, 3, 3), 100), ((), 5), ((0, 3), 2)])
def test_blocks_partition_the_parameter(shape: tuple[int, ...], max_dim: int,
                                        merge_from: MergeOrder) -> None:
    blocks = block_param("w", shape, max_dim, merge_from)
    n = math.prod(shape)
    assert sum(b.numel for b in blocks) == n
    if n == 0:
        assert blocks == []
        return
    cover = torch.zeros(blocks[0].merged_shape, dtype=torch.int64)
    for index, b in enumerate(blocks):
        assert b.key == ("w", index)
        assert all(d <= max_dim for d in b.shape)
        cover[b.slices] += 1
    assert bool((cover == 1).all())
    # Row-major tile order: offsets increase lexicographically.
    assert [b.offsets for b in blocks] == sorted(b.offsets for b in blocks)


def _blocks() -> list:
    shapes = {"a": (10, 6), "b": (6,), "c": (3, 3, 3), "d": (2,)}
    return [b for name, s in shapes.items() for b in block_param(name, s, 4)]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 16])
def test_layout_offsets_counts_and_status_words(world_size: int) -> None:
    blocks = _blocks()
    layout = Layout.build(blocks, world_size)
    assert layout == Layout.build(blocks, world_size)  # deterministic
    assert layout.total == sum(b.numel for b in blocks) + world_size
    used = torch.zeros(layout.total, dtype=torch.int64)
    used[list(layout.status_offsets)] += 1
    for i in range(len(blocks)):
        used[layout.span(i)] += 1
        owner = layout.owners[i]
        lo = layout.status_offsets[owner]
        assert lo < layout.offsets[i] and layout.span(i).stop <= lo + layout.counts[owner]
        assert layout.local_span(i).start == layout.offsets[i] - lo
    assert bool((used == 1).all())  # every element belongs to exactly one thing
    if world_size > len(blocks):
        assert any(not layout.owned(r) for r in range(world_size))


def test_ownership_balances_cost() -> None:
    blocks = _blocks()
    loads = Layout.build(blocks, 2).load()
    total = sum(b.cost for b in blocks)
    assert max(loads) <= total / 2 + max(b.cost for b in blocks)
    owners = Layout.build(blocks, 4).owners
    assert len(set(owners)) == 4


# ------------------------------------------------------------------ roots
def _spd(n: int, rank: int, seed: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, rank, generator=g, dtype=dtype)
    return x @ x.T


@pytest.mark.parametrize("p", [2, 4, 6])
def test_inverse_root_against_matrix_power(p: int) -> None:
    """``root^p (A + εI) = I`` checked with integer matrix powers (no eigendecomposition)."""
    a, eps = _spd(5, 3, seed=p), 1e-2  # rank-deficient: ε matters
    root = inverse_root(a, p, eps)
    eye = torch.eye(5, dtype=torch.float64)
    product = torch.linalg.matrix_power(root, p) @ (a + eps * eye)
    torch.testing.assert_close(product, eye, rtol=0, atol=1e-9)
    torch.testing.assert_close(root, root.T, rtol=0, atol=1e-12)


def test_inverse_root_keeps_dtype_and_retries_in_float64(monkeypatch: pytest.MonkeyPatch) -> None:
    a = _spd(4, 4, seed=0, dtype=torch.float32)
    real = torch.linalg.eigh
    seen: list[torch.dtype] = []

    def eigh(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(m.dtype)
        if m.dtype == torch.float32:
            raise torch.linalg.LinAlgError("injected")
        return real(m)

    monkeypatch.setattr(torch.linalg, "eigh", eigh)
    root = inverse_root(a, 2, 1e-6)
    assert seen == [torch.float32, torch.float64] and root.dtype == torch.float32
    torch.testing.assert_close(root @ root @ (a + 1e-6 * torch.eye(4)), torch.eye(4),
                               rtol=0, atol=1e-4)


def test_inverse_root_raises_when_both_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    def nan_eigh(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.full(m.shape[:1], math.nan, dtype=m.dtype), m
    monkeypatch.setattr(torch.linalg, "eigh", nan_eigh)
    with pytest.raises(RootComputationError, match="float64"):
        inverse_root(_spd(3, 3, seed=1), 2, 1e-6)
    with pytest.raises(ValueError, match="square"):
        inverse_root(torch.zeros(2, 3), 2, 1e-6)


def test_roots_from_eigenpairs_run_at_full_precision_whatever_the_user_set(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The root products ``Q diag(s) Qᵀ`` of one matrix and of a batch (the eigen path)
    run at float32's full precision while the user's cuBLAS setting is TF32."""
    import kfac_hpc.shampoo.roots as roots

    a = _spd(4, 4, seed=0, dtype=torch.float32)
    request = roots.RootRequest(torch.stack([a, 2 * a]), 1.0, 2.0, 1e-6)
    seen = cuda_fp32_settings_seen(
        monkeypatch, roots, "user_setting_matmul",
        lambda: (inverse_root(a, 2, 1e-6), roots.inverse_roots([request])))
    assert len(seen) == 2 and set(seen) == {"ieee"}


# --------------------------------------------------------------- kronecker
@pytest.mark.parametrize("shape", [(5,), (3, 4), (2, 3, 4)])
def test_factors_and_preconditioning_against_kron(shape: tuple[int, ...]) -> None:
    """Batched: every block of a batch of 3 against its own explicit sums and kron."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn((3, *shape), generator=g, dtype=torch.float64)
    factors = [torch.zeros(3, d, d, dtype=torch.float64) for d in shape]
    accumulate_factors(factors, x, 1.0)
    roots = [torch.randn(3, d, d, generator=g, dtype=torch.float64) for d in shape]
    out = precondition(x, roots)
    for n in range(3):
        for i, f in enumerate(factors):
            expected = torch.zeros(shape[i], shape[i], dtype=torch.float64)
            for a, b in itertools.product(range(shape[i]), repeat=2):
                expected[a, b] = (x[n].select(i, a) * x[n].select(i, b)).sum()
            torch.testing.assert_close(f[n], expected, rtol=1e-12, atol=1e-12)
        # Non-symmetric roots make the multiplication side visible.
        kron = roots[0][n]
        for r in roots[1:]:
            kron = torch.kron(kron, r[n])
        torch.testing.assert_close(out[n], (kron @ x[n].reshape(-1)).reshape(shape),
                                   rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", [(5,), (3, 4), (2, 3, 4)])
def test_gram_operands_are_row_major_on_cuda(shape: tuple[int, ...]) -> None:
    """On CUDA every ``X_(i)`` reaches the GEMM row-major (a block's last mode is a
    transposed view otherwise); elsewhere the view stays; the values are the same."""
    x = torch.randn(3, *shape, dtype=torch.float64)
    views = [mode_matrices(x, i) for i in range(len(shape))]
    if len(shape) >= 2:
        assert not views[-1].is_contiguous()  # what the rule is for
    for i, view in enumerate(views):
        on_cuda = gram_operand(x, i, "cuda")
        assert on_cuda.is_contiguous() and torch.equal(on_cuda, view)
        on_cpu = gram_operand(x, i, "cpu")
        assert on_cpu.stride() == view.stride() and torch.equal(on_cpu, view)


@pytest.mark.parametrize("shape", [(3, 4), (2, 3, 4), (6, 5)])
def test_factors_equal_in_either_gram_layout(shape: tuple[int, ...],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The row-major operands (CUDA's) give the factors of the views (the CPU's), up to
    the summation order of one GEMM (float64: ~1e-16 relative)."""
    x = torch.randn(4, *shape, dtype=torch.float64)
    start = [torch.randn(4, d, d, dtype=torch.float64) for d in shape]
    views = [f.clone() for f in start]
    accumulate_factors(views, x, 0.9)
    monkeypatch.setattr(kronecker, "ROW_MAJOR_GRAM_DEVICES", frozenset({"cpu"}))
    rows = [f.clone() for f in start]
    accumulate_factors(rows, x, 0.9)
    for a, b in zip(views, rows):
        torch.testing.assert_close(a, b, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("beta2", [0.9, 1.0, 0.0])
@pytest.mark.parametrize(("n", "shape", "columns"), [(3, (8, 3), 4), (3, (2, 12, 3), 4),
                                                     (1, (9, 3), 4), (2, (8, 2), 2)])
def test_split_gram_products_equal_one_product(n: int, shape: tuple[int, ...], columns: int,
                                               beta2: float,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A last mode of few rows and a long contraction summed over chunks of columns (the
    GPU's rule, forced on the CPU with chunks of 2 or 4 columns; a remainder for one
    block) gives the factors of one product, up to the summation order (float64: ~1e-16
    relative); the other modes keep one product; ``beta2=0`` replaces the old factor
    (NaN included), as the product's ``beta=0`` does."""
    x = torch.randn(n, *shape, dtype=torch.float64)
    start = [torch.randn(n, d, d, dtype=torch.float64) for d in shape]
    if beta2 == 0.0:
        start[-1][0, 0, 0] = math.nan
    whole = [f.clone() for f in start]
    accumulate_factors(whole, x, beta2)
    monkeypatch.setattr(kronecker, "SPLIT_GRAM_DEVICES", frozenset({"cpu"}))
    monkeypatch.setattr(kronecker, "SPLIT_COLUMNS", columns)
    monkeypatch.setattr(kronecker, "SPLIT_MIN_CHUNKS", 2)
    split = [mode_matrices(x, i) for i in range(len(shape))]
    assert [kronecker.splits_gram(v) for v in split] == [False] * (len(shape) - 1) + [True]
    chunked = [f.clone() for f in start]
    accumulate_factors(chunked, x, beta2)
    for a, b in zip(whole, chunked):
        assert bool(torch.isfinite(b).all()) == bool(torch.isfinite(a).all())
        torch.testing.assert_close(a, b, rtol=1e-14, atol=1e-14, equal_nan=True)


def test_the_split_takes_few_rows_long_contractions_on_the_gpu_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The rule's bounds: at most 16 rows, at least 16 chunks of 4096 columns, a last mode
    (a transposed row-major view) whose chunks are views (a whole number of them, or one
    block), on CUDA."""
    def view(n_rows: int, columns: int, last: bool = True, n: int = 2) -> torch.Tensor:
        x = torch.empty(n, columns, n_rows, device="meta") if last else \
            torch.empty(n, n_rows, columns, device="meta")
        return mode_matrices(x, 1) if last else mode_matrices(x, 0)

    assert frozenset({"cuda"}) == kronecker.SPLIT_GRAM_DEVICES
    assert not kronecker.splits_gram(view(9, 65536))  # meta: not a GPU
    monkeypatch.setattr(kronecker, "SPLIT_GRAM_DEVICES", frozenset({"meta"}))
    assert kronecker.splits_gram(view(9, 65536)) and kronecker.splits_gram(view(16, 65536))
    assert not kronecker.splits_gram(view(17, 65536))
    assert not kronecker.splits_gram(view(9, 65535, n=1))
    assert not kronecker.splits_gram(view(9, 65536, last=False))
    assert not kronecker.splits_gram(view(9, 65536 + 100))  # a remainder, two blocks
    assert kronecker.splits_gram(view(9, 65536 + 100, n=1))


def test_running_average_of_factors() -> None:
    """``F ← β·F + (1-β)·X Xᵀ`` for β < 1, in place."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 4, generator=g, dtype=torch.float64)
    start = [torch.randn(2, d, d, generator=g, dtype=torch.float64) for d in (3, 4)]
    factors = [f.clone() for f in start]
    accumulate_factors(factors, x, 0.9)
    torch.testing.assert_close(factors[0], 0.9 * start[0] + 0.1 * x @ x.mT, rtol=1e-14, atol=0)
    torch.testing.assert_close(factors[1], 0.9 * start[1] + 0.1 * x.mT @ x, rtol=1e-14, atol=0)
