"""Planner units: α–β formulas, profiles, layer shapes, cost terms, CLI (serial)."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from kfac_hpc.cli import main
from kfac_hpc.kfac.layers import curvature_for
from kfac_hpc.plan import (
    ComputeRates,
    Distribution,
    KFACOptions,
    Profile,
    baselines,
    bundled_profiles,
    candidates,
    estimate,
    estimate_sgd,
    load_profile,
    model_spec,
)
from kfac_hpc.plan.calibrate import PROBES, fit_alpha_beta, recorded_device
from kfac_hpc.plan.choose import hybrid_fractions
from kfac_hpc.plan.cli import builtin_model
from kfac_hpc.plan.collectives import (
    COLLECTIVES,
    LinkCost,
    coefficients,
    collective_time,
    wire_bytes,
)
from kfac_hpc.units import parse_bytes


# ------------------------------------------------------------------ collectives
def test_formulas() -> None:
    a, b, n = 1e-5, 1e-9, 1e6
    assert collective_time("allreduce", n, 1, a, b) == 0.0
    assert collective_time("allreduce", n, 4, a, b, "ring") == pytest.approx(
        6 * a + 1.5 * n * b)
    assert collective_time("reduce_scatter", n, 8, a, b, "ring") == pytest.approx(
        7 * a + 7 / 8 * n * b)
    assert collective_time("broadcast", n, 8, a, b, "tree") == pytest.approx(3 * (a + n * b))
    assert collective_time("allgather", n, 8, a, b, "tree") == pytest.approx(3 * a + 7 / 8 * n * b)
    # auto takes the cheapest: tree for tiny messages, ring/rabenseifner for large ones
    assert coefficients("allreduce", 64, "auto", 8, a, b)[0] in ("tree", "rabenseifner")
    assert coefficients("broadcast", 64, "auto", 1e9, a, b)[0] == "ring"
    assert wire_bytes("allreduce", n, 4) == pytest.approx(1.5 * n)
    with pytest.raises(ValueError):
        collective_time("alltoall", n, 4, a, b)


def test_fit_recovers_alpha_beta() -> None:
    alpha, beta, p = 2e-5, 5e-10, 4
    _, c = coefficients("allreduce", p, "ring")
    samples = [(n, c.latency * alpha + c.bandwidth * n * beta) for n in (8, 1e4, 1e6, 1e7)]
    link = fit_alpha_beta("allreduce", p, samples)
    assert link.alpha == pytest.approx(alpha, rel=1e-6)
    assert link.beta == pytest.approx(beta, rel=1e-6)


# ------------------------------------------------------------------ profiles
def test_bundled_profiles_load_and_round_trip(tmp_path: Path) -> None:
    names = bundled_profiles()
    assert {"a100-ib200", "spd-kfac-2080ti-ib100"} <= set(names)
    for name in names:
        prof = load_profile(name)
        assert prof.source == "assumed" and prof.assumptions
        path = prof.save(tmp_path / f"{name}.json")
        assert load_profile(path) == prof
    with pytest.raises(FileNotFoundError, match="bundled"):
        load_profile("no-such-profile")


def test_profile_by_ranks_and_interpolation() -> None:
    base = load_profile("a100-ib200")
    prof = replace(base, by_ranks={2: {"compute": {"gemm_flops": 1.0}},
                                   8: {"network": {"allreduce": {"alpha": 1, "beta": 2}}}})
    assert prof.at(1).compute.gemm_flops == 1.0  # below every entry: the smallest
    assert prof.at(4).compute.gemm_flops == 1.0
    assert prof.at(16).link("allreduce").alpha == 1 and prof.at(16).compute.gemm_flops == \
        base.compute.gemm_flops
    c = base.compute
    sizes = [16, 64, 100, 1000, 3000, 8192]
    times = [c.decomposition_s(n, "eigen") for n in sizes]
    assert times == sorted(times)
    assert c.decomposition_s(8192, "eigen") == pytest.approx(c.eigh[-1][1] * 8)
    assert c.decomposition_s(1024, "inverse") == pytest.approx(dict(c.inverse)[1024])


# ------------------------------------------------------------------ layer shapes
def test_model_spec_matches_the_preconditioner() -> None:
    from mpi4py import MPI

    from kfac_hpc import KFACPreconditioner
    from kfac_hpc.comm import Communicator

    model, shape = builtin_model("resnet20")
    spec = model_spec(model, input_shape=shape, skip_layers=("fc",))
    pre = KFACPreconditioner(model, comm=Communicator(MPI.COMM_SELF), skip_layers=("fc",))
    assert [s.name for s in spec.layers] == list(pre.layers)
    assert [(s.a_dim, s.g_dim) for s in spec.layers] == [(c.a_dim, c.g_dim)
                                                         for c in pre.layers.values()]
    # rows per sample = rows of ā per example in a real forward pass
    x = torch.randn(2, *shape)
    seen: dict[str, int] = {}
    hooks = [m.register_forward_hook(
        lambda mod, inp, out, n=n: seen.__setitem__(n, curvature_for(mod).a_rows(inp[0])
                                                    .shape[0] // 2))
        for n, m in model.named_modules() if n in pre.layers]
    model(x)
    for h in hooks:
        h.remove()
    assert {s.name: s.rows_per_sample for s in spec.layers} == seen
    assert spec.param_tensors == len(list(model.parameters()))


def test_resnet50_shapes() -> None:
    model, shape = builtin_model("resnet50")
    spec = model_spec(model, input_shape=shape)
    assert len(spec.layers) == 54 and spec.param_numel == 25_557_032
    assert spec.layers[0].rows_per_sample == 112 * 112 and spec.layers[-1].a_dim == 2049
    assert max(s.a_dim for s in spec.layers) == 4608


# ------------------------------------------------------------------ cost
def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(30, 50), nn.ReLU(), nn.Linear(50, 20), nn.ReLU(),
                         nn.Linear(20, 4))


def test_invalid_options_are_rejected() -> None:
    spec = model_spec(_net())
    for bad in (KFACOptions(strategy="dp-kfac", overlap=True),
                KFACOptions(overlap=True, factor_sync="inverse"),
                KFACOptions(strategy="nope")):
        with pytest.raises(ValueError):
            Distribution(spec, bad, 4)
    with pytest.raises(ValueError, match="whole number"):
        Distribution(spec, KFACOptions(strategy="hybrid-opt", grad_worker_fraction=0.3), 4)


def test_traffic_by_hand() -> None:
    spec = model_spec(_net())  # A: 31, 51, 21; G: 50, 20, 4
    d = Distribution(spec, KFACOptions(local_decomposition_threshold=0), 4)
    t = d.step_traffic(0, 0)
    factor_elems = sum(n * n + 1 for n in (31, 50, 51, 20, 21, 4))
    assert t.bytes["factors"] == 4 * factor_elems and t.calls["factors"] == 1
    assert t.bytes["gradients"] == 0
    mem = Distribution(spec, KFACOptions(strategy="mem-opt"), 4)
    grads = sum(g * a + 1 for a, g in ((31, 50), (51, 20), (21, 4)))
    assert mem.step_traffic(1, 2).bytes["gradients"] == 4 * grads
    assert mem.step_traffic(1, 2).bytes["decompositions"] == 0
    packed = Distribution(spec, KFACOptions(symmetric_packing=True,
                                            local_decomposition_threshold=0), 4)
    assert packed.step_traffic(0, 0).bytes["factors"] == 4 * sum(
        n * (n + 1) // 2 + 1 for n in (31, 50, 51, 20, 21, 4))
    assert Distribution(spec, KFACOptions(), 1).step_traffic(0, 0).total == 0
    sched = Distribution(spec, KFACOptions(factor_update_steps=2, inv_update_steps=4), 4)
    mean = sched.mean_traffic(0)
    assert mean["factors"] == pytest.approx(
        sched.step_traffic(2, 0).bytes["factors"] / 2)


def test_estimates_move_the_right_way() -> None:
    model, shape = builtin_model("resnet50")
    spec = model_spec(model, input_shape=shape)
    prof = load_profile("a100-ib200")
    base = estimate(spec, KFACOptions(), 64, 32, prof)
    packed = estimate(spec, KFACOptions(symmetric_packing=True), 64, 32, prof)
    assert packed.bytes_per_step["factors"] < 0.51 * base.bytes_per_step["factors"]
    assert packed.total_s < base.total_s
    dp = estimate(spec, KFACOptions(strategy="dp-kfac"), 64, 32, prof)
    assert dp.bytes_per_step["factors"] == 0 and dp.memory_state < base.memory_state
    rare = estimate(spec, KFACOptions(inv_update_steps=100), 64, 32, prof)
    assert rare.time["decomposition"] == pytest.approx(base.time["decomposition"] / 100)
    sgd = sum(estimate_sgd(spec, 64, 32, prof).values())
    assert sgd < base.total_s
    assert math.isclose(sum(base.time.values()), base.total_s)


def test_decompositions_run_together_take_their_sum_over_the_concurrency() -> None:
    """A profile whose rank decomposes 2.5x faster together (a GPU's streams) prices
    each rank's decompositions at their sum over 2.5; old profiles read 1; below 1 is
    refused."""
    model, shape = builtin_model("resnet50")
    spec = model_spec(model, input_shape=shape)
    prof = load_profile("a100-ib200")
    assert prof.compute.decomposition_concurrency == 1.0
    together = replace(prof, compute=replace(prof.compute, decomposition_concurrency=2.5))
    for world in (1, 8):
        one = estimate(spec, KFACOptions(), world, 32, prof).time["decomposition"]
        spread = estimate(spec, KFACOptions(), world, 32, together).time["decomposition"]
        assert spread == pytest.approx(one / 2.5)
    data = prof.compute.to_json()
    assert data["decomposition_concurrency"] == 1.0
    del data["decomposition_concurrency"]  # a profile written before the field
    assert ComputeRates.from_json(data) == prof.compute
    with pytest.raises(ValueError, match="decomposition_concurrency must be >= 1"):
        replace(prof.compute, decomposition_concurrency=0.5)


def test_published_shape_ordering() -> None:
    """SPD-KFAC's cluster (assumed profile), ResNet-50, 64 ranks, inverses every step."""
    model, shape = builtin_model("resnet50")
    spec = model_spec(model, input_shape=shape)
    prof = load_profile("spd-kfac-2080ti-ib100")
    t = {k: estimate(spec, o, 64, 32, prof) for k, o in
         baselines(KFACOptions(compute_method="inverse")).items()}
    assert t["D-KFAC"].total_s > t["SPD-KFAC"].total_s
    assert t["D-KFAC"].total_s > t["MPD-KFAC"].total_s
    assert t["DP-KFAC"].kfac_bytes < t["MPD-KFAC"].kfac_bytes < t["D-KFAC"].kfac_bytes


def test_candidates() -> None:
    assert hybrid_fractions(8) == [0.25, 0.5]
    assert hybrid_fractions(1024, limit=4) == [2 / 1024, 16 / 1024, 64 / 1024, 512 / 1024]
    cands = candidates(8, KFACOptions(inv_update_steps=10))
    assert len(cands) == len(set(cands))
    assert {c.strategy for c in cands} == {"comm-opt", "mem-opt", "hybrid-opt", "dp-kfac"}
    assert all(c.problem() is None for c in cands)
    assert any(c.factor_sync == "inverse" for c in cands)


# ------------------------------------------------------------------ CLI
def test_parse_bytes() -> None:
    assert parse_bytes("16GiB") == 16 * 2**30 and parse_bytes("1e9") == 10**9
    assert parse_bytes("512 MB") == 512 * 10**6


def test_plan_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "mlp", "--ranks", "4", "8", "--batch", "16",
                 "--baselines", "--breakdown", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "== 8 ranks ==" in text and "* " in text and "[S-SGD]" in text
    data = json.loads(out.read_text())
    assert [w["world"] for w in data["worlds"]] == [4, 8]
    assert main(["plan", "--model", "mlp", "--profile", "nope"]) == 2
    assert main(["plan", "--model", "nope"]) == 2


@pytest.mark.parametrize("bad", [["--ranks", "0"], ["--factor-update-steps", "0"],
                                 ["--bucket-cap-mb", "0"], ["--factor-dtype", "bogus"],
                                 ["--local-thresholds", "-5"], ["--batch", "-1"],
                                 ["--top", "-1"], ["--low-rank", "0"]])
def test_plan_cli_bad_options_exit_2(bad: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """Each is one usage message and exit 2 (a traceback, or a silent plan, before)."""
    with pytest.raises(SystemExit) as stop:
        main(["plan", "--model", "mlp", "--ranks", "4", *bad])
    assert stop.value.code == 2
    assert bad[0] in capsys.readouterr().err


def test_plan_cli_plans_the_other_worlds_and_always_shows_the_pick(
        capsys: pytest.CaptureFixture[str]) -> None:
    """hybrid-opt alone has no candidate on a prime world: said, and the next world is
    planned; ``--top`` never hides the chosen row."""
    assert main(["plan", "--model", "mlp", "--ranks", "3", "8",
                 "--strategies", "hybrid-opt"]) == 0
    text = capsys.readouterr().out
    assert "== 3 ranks ==  no configuration to plan" in text and "== 8 ranks ==" in text
    assert main(["plan", "--model", "resnet50", "--ranks", "64", "--factor-update-steps",
                 "10", "--inv-update-steps", "100", "--memory-budget", "1300MiB",
                 "--top", "3"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines()
            if line.startswith(("* ", "  ")) and "iter s" not in line]
    assert len(rows) == 4 and sum(r.startswith("* ") for r in rows) == 1


def test_calibrate_cli_world_of_one(tmp_path: Path) -> None:
    """Without a GPU, the default device (auto) measures the CPU: its probes' sizes, no
    memory budget, the device named in the description."""
    out = tmp_path / "p.json"
    assert main(["calibrate", "--quick", "--out", str(out)]) == 0
    prof = load_profile(out)
    assert isinstance(prof, Profile) and prof.source == "calibrated" and 1 in prof.by_ranks
    assert prof.compute.gemm_flops > 0 and len(prof.compute.eigh) == 3
    if not torch.cuda.is_available():
        assert [n for n, _ in prof.compute.eigh] == list(PROBES["cpu"].quick_decompositions)
        assert prof.description.endswith("(CPU)") and prof.memory_per_rank_bytes is None
        assert prof.measured_on == "CPU"
        assert prof.compute.decomposition_concurrency == 1.0  # one after another on a CPU
    # one rank measures no network: the bundled default's, recorded as an assumption,
    # never costs of zero (communication planned as free at every world size)
    assert "network" not in prof.by_ranks[1]
    assert prof.at(64).network == load_profile("a100-ib200").network
    assert any("network is not measured" in a for a in prof.assumptions)


def test_a_one_rank_entry_brings_no_network(caplog: pytest.LogCaptureFixture) -> None:
    """Files of an older calibrate hold a 1-rank network of zero costs: never applied;
    a profile whose collectives all cost nothing warns when planning several ranks."""
    measured = {k: LinkCost(2e-6, 1e-10, "ring") for k in COLLECTIVES}
    free = {k: LinkCost(0.0, 0.0, "ring") for k in COLLECTIVES}
    prof = Profile(name="merged", network=measured, compute=load_profile("a100-ib200").compute,
                   by_ranks={1: {"network": free}, 8: {"network": measured}})
    assert prof.at(4).network == measured and prof.at(1).network == measured
    zero = replace(prof, network=free, by_ranks={})
    with caplog.at_level(logging.WARNING, logger="kfac_hpc"):
        zero.at(1)
        assert not caplog.records
        zero.at(16)
    assert any("every collective costs nothing" in r.getMessage() for r in caplog.records)


def test_calibrate_merges_measurements_of_one_device_only(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--merge`` into a profile measured on another device exits 2 naming both, before
    measuring, and leaves the file as it was; a profile of the same device, or one that
    does not record its device, takes the entry."""
    out = tmp_path / "p.json"
    gpu = Profile(name="gpu", network={k: LinkCost(1e-6, 1e-10, "ring") for k in COLLECTIVES},
                  compute=load_profile("a100-ib200").compute, source="calibrated",
                  measured_on="GPU NVIDIA H200")
    gpu.save(out)
    before = out.read_text()
    assert main(["calibrate", "--quick", "--merge", "--device", "cpu", "--out", str(out)]) == 2
    text = capsys.readouterr().out
    assert "measured on GPU NVIDIA H200" in text and "on CPU" in text
    assert "gemm" not in text and out.read_text() == before
    # calibrated before devices were recorded: then calibrate measured only the CPU
    replace(gpu, measured_on="", memory_per_rank_bytes=2**30).save(out)
    assert recorded_device(load_profile(out)) == "CPU"
    assert recorded_device(replace(gpu, measured_on="", source="assumed")) == ""
    assert main(["calibrate", "--quick", "--merge", "--device", "cpu", "--out", str(out)]) == 0
    merged = load_profile(out)
    assert merged.measured_on == "CPU" and 1 in merged.by_ranks and merged.name == "gpu"
    assert merged.memory_per_rank_bytes == 2**30  # a CPU run adds no memory share


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_calibrate_on_cuda_without_a_gpu_says_so(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.json"
    assert main(["calibrate", "--quick", "--device", "cuda", "--out", str(out)]) == 2
    text = capsys.readouterr().out
    assert "no CUDA device visible to every rank" in text and "--device cpu" in text
    assert not out.exists()


def test_calibrate_clocks_wait_for_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU every clock read of a probe follows a device synchronisation (queued
    kernels count, not just their launches): here a stand-in device whose 'kernels'
    finish only when synchronised."""
    from mpi4py import MPI

    from kfac_hpc.plan import calibrate

    pending: list[float] = []  # seconds of work queued on the stand-in device
    clock = [0.0]

    def sync() -> None:
        clock[0] += sum(pending)
        pending.clear()

    monkeypatch.setattr(calibrate, "synchronizer", lambda device: sync)
    monkeypatch.setattr(calibrate, "_clock", lambda: clock[0])
    seconds = calibrate._slowest(MPI.COMM_SELF, lambda: pending.append(0.25), repeat=3,
                                 device=torch.device("cuda"))
    assert seconds == pytest.approx(0.25)
