"""Who computes what: placement costs, DP-KFAC balancing and the rows-per-sample probe."""

from __future__ import annotations

import torch
from torch import nn

from kfac_hpc.kfac.layers import register_layers
from kfac_hpc.kfac.placement import (
    DECOMPOSITION_FLOPS_PER_N3,
    LayerShape,
    place,
    work_per_step,
)
from kfac_hpc.kfac.shapes import rows_per_sample
from kfac_hpc.models import build_model


def test_work_per_step_formula() -> None:
    layer = LayerShape("l", a_dim=10, g_dim=4, rows=100)
    stats = 2.0 * 100 * (10**2 + 4**2)
    eig = DECOMPOSITION_FLOPS_PER_N3["eigen"] * (10**3 + 4**3)
    assert work_per_step(layer) == stats + eig
    assert work_per_step(layer, factor_update_steps=5, inv_update_steps=10) == (
        stats / 5 + eig / 10)
    inv = DECOMPOSITION_FLOPS_PER_N3["inverse"] * (10**3 + 4**3)
    assert work_per_step(layer, compute_method="inverse") == stats + inv
    assert work_per_step(LayerShape("l", 10, 4)) == eig  # rows unknown: decompositions only


def _resnet20_shapes(batch: int) -> list[LayerShape]:
    torch.manual_seed(0)
    model = build_model("resnet20", num_classes=10, in_channels=3, image_size=32)
    layers, _ = register_layers(model, ())
    rows = rows_per_sample(model, [c.module for c in layers.values()], (3, 32, 32))
    return [LayerShape(n, c.a_dim, c.g_dim, batch * rows[id(c.module)])
            for n, c in layers.items()]


def _imbalance(shapes: list[LayerShape], groups: dict[str, int], ranks: int) -> float:
    loads = [0.0] * ranks
    for s in shapes:
        loads[groups[s.name]] += work_per_step(s, inv_update_steps=10)
    return max(loads) / (sum(loads) / ranks)


def test_dp_kfac_layer_cost_balances_statistics() -> None:
    """ResNet-20 at 32x32: by decomposition cost alone the busiest DP-KFAC owner does
    1.4x the mean work (statistics dominate); balancing the owner's whole work fixes it."""
    shapes = _resnet20_shapes(batch=32)
    for ranks in (2, 4):
        cubic = place(shapes, ranks, 1)
        balanced = place(shapes, ranks, 1,
                         layer_cost=lambda s: work_per_step(s, inv_update_steps=10))
        assert _imbalance(shapes, cubic.layer_group, ranks) > 1.3
        assert _imbalance(shapes, balanced.layer_group, ranks) < 1.05
        # one owner per layer, both factors on it (DP-KFAC's grid: g = 1)
        assert all(balanced.factor_owner[(s.name, "A")] == balanced.factor_owner[(s.name, "G")]
                   == balanced.layer_group[s.name] for s in shapes)


class _Probed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, stride=2, padding=1)            # 9x9 -> 5x5
        self.dilated = nn.Conv2d(4, 4, 3, dilation=2, padding="same")  # 5x5 -> 5x5
        self.mix = nn.Linear(25, 5)                                    # on (4, 25): 4 rows
        self.seq = nn.Linear(5, 6)                                     # on (4, 5): 4 rows
        self.unused = nn.Linear(2, 2)
        self.register_buffer("scale", torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.dilated(self.conv(x)).flatten(2) * self.scale
        return self.seq(self.mix(h))


def test_rows_per_sample_probe() -> None:
    torch.manual_seed(0)
    model = _Probed()
    before = [p.detach().clone() for p in model.parameters()]
    m = model
    rows = rows_per_sample(model, [m.conv, m.dilated, m.mix, m.seq, m.unused], (3, 9, 9))
    assert rows == {id(m.conv): 25, id(m.dilated): 25, id(m.mix): 4, id(m.seq): 4}
    # the model itself is untouched: same device, same values
    assert all(p.device.type == "cpu" and torch.equal(p, b)
               for p, b in zip(model.parameters(), before))
    assert model.scale.device.type == "cpu"


def test_low_rank_factors_are_placed_by_their_real_cost() -> None:
    """A factor that gets a randomized rank-64 decomposition weighs its flops, not d³:
    the 2049-wide factor no longer fills a rank on its own."""
    from kfac_hpc.assignment import cubic_cost
    from kfac_hpc.kfac.placement import FactorKey, decomposition_cost, place
    from kfac_hpc.kfac.shapes import randomized_eigh_flops

    layers = [LayerShape("big", 2049, 10), *(LayerShape(f"m{i}", 600, 10) for i in range(4))]
    cost = decomposition_cost(64, 1024)
    assert cost(600) == cubic_cost(600)  # below low_rank_min_dim: full eigh
    assert cost(2049) == randomized_eigh_flops(2049, 64) / 13.0 < cubic_cost(2049) / 20
    assert decomposition_cost(None, 1024) is cubic_cost

    def a_factors_with_big(p: object) -> int:
        owners = p.factor_owner  # type: ignore[attr-defined]
        big = owners[FactorKey("big", "A")]
        return sum(1 for layer in layers if owners[FactorKey(layer.name, "A")] == big)

    assert a_factors_with_big(place(layers, 2, 2)) == 1  # 2049³ outweighs 4 x 600³
    assert a_factors_with_big(place(layers, 2, 2, cost=cost)) >= 2
    dense = work_per_step(LayerShape("big", 2049, 10, rows=32), inv_update_steps=10)
    low = work_per_step(LayerShape("big", 2049, 10, rows=32), inv_update_steps=10, cost=cost)
    assert low < dense / 10
