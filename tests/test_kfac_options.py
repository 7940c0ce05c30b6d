"""One source of truth: the option rules, typed factor keys and message pieces.

The preconditioner, the planner (``KFACOptions.problem``) and the driver's configuration
(``TrainConfig.validate``) must reach the same verdict on every combination of options,
because all three read :mod:`kfac_hpc.kfac.options`.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from kfac_hpc.kfac.exchange import MessageLayout, Part, PieceKey, read_scalars
from kfac_hpc.kfac.options import (
    COMPUTE_METHODS,
    STRATEGIES,
    conflicts,
    default_factor_dtype,
    one_of,
    reduces_factors,
)
from kfac_hpc.kfac.placement import FactorKey
from kfac_hpc.plan.options import KFACOptions
from kfac_hpc.train.config import ConfigError, TrainConfig

COMBINATIONS = list(itertools.product(
    STRATEGIES, (None, 0.5), (False, True), (False, True), ("step", "inverse")))


def _preconditioner_refuses(strategy: str, fraction: float | None, overlap: bool,
                            packing: bool, sync: str) -> bool:
    from kfac_hpc.comm import world
    from kfac_hpc.kfac.preconditioner import KFACPreconditioner

    try:
        pre = KFACPreconditioner(nn.Sequential(nn.Linear(3, 2)), comm=world(),
                                 strategy=strategy, grad_worker_fraction=fraction,
                                 overlap=overlap, symmetric_packing=packing, factor_sync=sync)
    except ValueError as exc:
        # the option rules come first; after them, the fraction's own checks on 1 rank
        return not ("whole number" in str(exc) or "needs grad_worker_fraction" in str(exc))
    pre.close()
    return False


def _flag(option: str, value: str) -> str:
    return f"--kfac-{option.replace('_', '-')} {value}"


@pytest.mark.parametrize("strategy, fraction, overlap, packing, sync", COMBINATIONS)
def test_three_readers_agree(strategy: str, fraction: float | None, overlap: bool,
                             packing: bool, sync: str) -> None:
    rules = conflicts(strategy=strategy, grad_worker_fraction=fraction, overlap=overlap,
                      symmetric_packing=packing, factor_sync=sync)
    planner = KFACOptions(strategy=strategy, grad_worker_fraction=fraction, overlap=overlap,
                          symmetric_packing=packing, factor_sync=sync).problem()
    assert (planner is not None) == bool(rules)
    cfg = TrainConfig(kfac_strategy=strategy, grad_worker_fraction=fraction,
                      kfac_overlap=overlap, kfac_symmetric_packing=packing,
                      kfac_factor_sync=sync)
    try:
        cfg.validate()
        driver_refuses = False
    except ConfigError as exc:
        driver_refuses = True
        for rule in rules:  # every broken rule is named, in command-line spelling
            assert rule.text(_flag) in str(exc)
    assert driver_refuses == bool(rules)
    assert _preconditioner_refuses(strategy, fraction, overlap, packing, sync) == bool(rules)


def test_conflict_text_per_reader() -> None:
    (rule,) = conflicts(strategy="dp-kfac", overlap=True)
    assert rule.option == "overlap"
    assert rule.text() == "does not apply to strategy='dp-kfac', which sends no factors"
    assert rule.text(lambda o, v: f"--kfac-{o} {v}") == (
        "does not apply to --kfac-strategy dp-kfac, which sends no factors")


def test_reduction_schedule() -> None:
    assert not reduces_factors("dp-kfac", "step", factor_step=True, inverse_step=True)
    assert reduces_factors("comm-opt", "step", factor_step=True, inverse_step=False)
    assert not reduces_factors("comm-opt", "inverse", factor_step=True, inverse_step=False)
    assert reduces_factors("mem-opt", "inverse", factor_step=False, inverse_step=True)


def test_defaults_and_names() -> None:
    assert default_factor_dtype(["float32", "bfloat16"]) == "float32"
    assert default_factor_dtype(["float64", "float32"]) == "float64"
    assert one_of("compute_method", "inverse", COMPUTE_METHODS) == "inverse"
    with pytest.raises(ValueError, match="compute_method must be one of"):
        one_of("compute_method", "svd", COMPUTE_METHODS)


def test_factor_key_is_the_name_at_the_boundary() -> None:
    key = FactorKey("block.0/conv", "A")  # a layer name may hold "/"
    assert key.name == "block.0/conv/A"
    assert FactorKey.parse(key.name) == key
    assert key == ("block.0/conv", "A")  # placement's dicts accept the plain tuple too
    with pytest.raises(KeyError, match="not a factor name"):
        FactorKey.parse("fc/B")


def test_message_layout_of_typed_pieces() -> None:
    a, g = FactorKey("fc", "A"), FactorKey("fc", "G")
    layout = MessageLayout.of([
        [(PieceKey(a, Part.FACTOR), 4), (PieceKey(a, Part.COUNT), 1)],
        [(PieceKey(g, Part.FACTOR), 1), (PieceKey(g, Part.COUNT), 1)]])
    values = {PieceKey(a, Part.FACTOR): torch.arange(4.0), PieceKey(a, Part.COUNT): 2.0,
              PieceKey(g, Part.FACTOR): torch.ones(1), PieceKey(g, Part.COUNT): 3.0}
    flat = layout.pack(values, dtype=torch.float64, device=torch.device("cpu"))
    assert layout.counts() == [5, 2] and flat.tolist() == [0, 1, 2, 3, 2, 1, 3]
    first = layout.unpack(flat[:5], 0)
    assert first[PieceKey(a, Part.FACTOR)].tolist() == [0, 1, 2, 3]
    assert read_scalars({**first, **layout.unpack(flat[5:], 1)},
                        [PieceKey(a, Part.COUNT), PieceKey(g, Part.COUNT)]) == [2.0, 3.0]
