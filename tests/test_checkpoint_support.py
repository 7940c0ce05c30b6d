"""Shared pieces of the checkpoint tests (and a few tests of the pieces themselves).

``FakeKFAC`` follows the K-FAC preconditioner contract that ``kfac_hpc.checkpoint``
codes against (``comm``, ``factor_keys``, ``factor_owner``, ``factor_shape``,
``state_dict``, ``load_state_dict``, ``describe``). Its factor values after ``n``
updates are a pure function of ``(key, n)`` (:func:`expected_factor`), so a test on
any number of ranks knows what every factor must hold after a load.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kfac_hpc.assignment import cubic_cost, lpt_assign

DECAY = 0.9


def batch_factor(key: str, n: int, dim: int) -> torch.Tensor:
    """The fake "batch statistic" of factor ``key`` at its ``n``-th update (SPD)."""
    g = torch.Generator().manual_seed(zlib.crc32(key.encode()) * 1000 + n)
    x = torch.randn(dim + 2, dim, generator=g, dtype=torch.float64)
    return (x.T @ x / (dim + 2)).to(torch.float32)


def expected_factor(key: str, updates: int, dim: int) -> torch.Tensor | None:
    """The running average after ``updates`` updates (None before the first)."""
    value = None
    for n in range(updates):
        b = batch_factor(key, n, dim)
        value = b if value is None else DECAY * value + (1 - DECAY) * b
    return value


def layer_dims(model: nn.Module) -> dict[str, tuple[int, int]]:
    """(A dim, G dim) of every Linear/Conv2d layer, model order."""
    dims = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            dims[name] = (m.in_features + (m.bias is not None), m.out_features)
        elif isinstance(m, nn.Conv2d):
            k = m.kernel_size[0] * m.kernel_size[1]
            dims[name] = (m.in_channels * k + (m.bias is not None), m.out_channels)
    return dims


class FakeKFAC:
    """A stand-in for ``KFACPreconditioner`` with the same state contract.

    ``strategy``: ``"comm-opt"``/``"mem-opt"`` spread factors by LPT over all ranks;
    ``"dp-kfac"`` gives both factors of a layer to one rank (layer-wise LPT).
    """

    def __init__(self, model: nn.Module, comm: Any, strategy: str = "mem-opt",
                 dims: Mapping[str, tuple[int, int]] | None = None) -> None:
        self.comm = comm
        self.strategy = strategy
        self.dims = dict(dims) if dims is not None else layer_dims(model)
        self._shape = {f"{n}/{f}": d for n, (a, g) in self.dims.items()
                       for f, d in (("A", a), ("G", g))}
        if strategy == "dp-kfac":
            by_layer = lpt_assign([(n, cubic_cost(a) + cubic_cost(g))
                                   for n, (a, g) in self.dims.items()], comm.size)
            self._owner = {k: by_layer[k.rsplit("/", 1)[0]] for k in self._shape}
        else:
            self._owner = lpt_assign([(k, cubic_cost(d)) for k, d in self._shape.items()],
                                     comm.size)
        self.steps = 0
        self.factors: dict[str, torch.Tensor | None] = {k: None for k in self.owned()}
        self.updates = dict.fromkeys(self.owned(), 0)
        self.eigen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.loaded_eigenbases: dict[str, Any] = {}

    def owned(self) -> list[str]:
        return [k for k in self._shape if self._owner[k] == self.comm.rank]

    # ---- the contract
    def factor_keys(self) -> list[str]:
        return list(self._shape)

    def factor_owner(self, key: str) -> int:
        return self._owner[key]

    def factor_shape(self, key: str) -> tuple[int, int]:
        return (self._shape[key], self._shape[key])

    def state_dict(self, eigenbases: bool = False) -> dict[str, Any]:
        sd: dict[str, Any] = {
            "step": self.steps,
            "factors": {k: v for k, v in self.factors.items() if v is not None},
            "factor_updates": dict(self.updates),
            "config": {"strategy": self.strategy, "damping": 0.001, "factor_decay": DECAY,
                       "world_size": self.comm.size},
        }
        if eigenbases:
            sd["eigenbases"] = {k: {"eigenvalues": lam, "eigenvectors": q}
                                for k, (lam, q) in self.eigen.items()}
        return sd

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        missing = [k for k in self.owned() if k not in state["factor_updates"]
                   or (state["factor_updates"][k] > 0 and k not in state["factors"])]
        if missing:
            raise KeyError(f"factor state missing for {missing}")
        for k in self.owned():
            value = state["factors"].get(k)
            self.factors[k] = None if value is None else value.clone()
            self.updates[k] = int(state["factor_updates"][k])
        self.steps = int(state["step"])
        self.loaded_eigenbases = dict(state.get("eigenbases", {}))
        self._decompose()

    def describe(self) -> str:
        return "\n".join(f"{k}: {self._shape[k]} on rank {self._owner[k]}" for k in self._shape)

    # ---- "training"
    def update(self) -> None:
        for k in self.owned():
            b = batch_factor(k, self.updates[k], self._shape[k])
            f = self.factors[k]
            self.factors[k] = b if f is None else DECAY * f + (1 - DECAY) * b
            self.updates[k] += 1
        self.steps += 1
        self._decompose()

    def _decompose(self) -> None:
        self.eigen = {k: torch.linalg.eigh(f.double()) for k, f in self.factors.items()
                      if f is not None}

    def check(self, updates: int) -> None:
        """Assert that every owned factor holds the value after ``updates`` updates."""
        for k in self.owned():
            want = expected_factor(k, updates, self._shape[k])
            got = self.factors[k]
            assert self.updates[k] == updates, (k, self.updates[k], updates)
            if want is None:
                assert got is None, k
            else:
                assert got is not None and torch.equal(got, want), k


# ----------------------------------------------------------------- models and training
class Net(nn.Module):
    """Conv + BatchNorm + Dropout + Linear: buffers and RNG use in the forward pass."""

    def __init__(self, hidden: int = 16, classes: int = 3, *, batchnorm: bool = True,
                 dropout: float = 0.3) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.bn: nn.Module = nn.BatchNorm2d(4) if batchnorm else nn.Identity()
        self.drop: nn.Module = nn.Dropout(dropout) if dropout else nn.Identity()
        self.fc1 = nn.Linear(4 * 4 * 4, hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.conv(x)))
        x = self.drop(x.flatten(1))
        return self.fc2(torch.relu(self.fc1(x)))


def global_batch(step: int, size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch (independent of every RNG the checkpoint restores)."""
    g = torch.Generator().manual_seed(10_000 + step)
    return torch.randn(size, 2, 4, 4, generator=g), torch.randint(0, 3, (size,), generator=g)


def train_steps(model: nn.Module, optimizer: Any, comm: Any, start: int, stop: int,
                preconditioner: Any = None, batch: int = 8, augment: bool = True) -> None:
    """Data-parallel steps ``start..stop-1``: each rank takes its slice of the global batch,
    gradients are averaged with the Communicator; dropout and a random augmentation
    draw from torch's global RNG (so an exact resume needs the RNG state).
    ``augment=False`` with a model without dropout and batch norm gives the same
    arithmetic up to float rounding on any number of ranks."""
    model.train()
    local = batch // comm.size
    for step in range(start, stop):
        x, y = global_batch(step, batch)
        x = x[comm.rank * local:(comm.rank + 1) * local]
        y = y[comm.rank * local:(comm.rank + 1) * local]
        if augment:
            x = x + 0.01 * torch.randn_like(x)  # "augmentation"
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        for p in model.parameters():
            if p.grad is not None and comm.size > 1:
                comm.allreduce(p.grad, "avg")
        if preconditioner is not None:
            preconditioner.step()
        optimizer.step()


def make_optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    if kind == "adam":
        return torch.optim.Adam(model.parameters(), lr=1e-2)
    raise ValueError(kind)


def params_equal(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


def weights_equal(a: nn.Module, b: nn.Module) -> bool:
    """Parameters only: BatchNorm running statistics differ across data-parallel ranks
    unless synchronised, and a checkpoint holds rank 0's."""
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return list(pa) == list(pb) and all(torch.equal(pa[k], pb[k]) for k in pa)


def optimizer_states_equal(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    if sa["param_groups"] != sb["param_groups"] or set(sa["state"]) != set(sb["state"]):
        return False
    for i, s in sa["state"].items():
        t = sb["state"][i]
        if set(s) != set(t):
            return False
        for k, v in s.items():
            w = t[k]
            if isinstance(v, torch.Tensor):
                if not (isinstance(w, torch.Tensor) and v.dtype == w.dtype and torch.equal(v, w)):
                    return False
            elif v != w:
                return False
    return True


# ----------------------------------------------------------------- tests of the pieces
def test_fake_kfac_owners_cover_every_factor_once() -> None:
    class One:
        rank, size = 0, 1

    class Four:
        def __init__(self, rank: int) -> None:
            self.rank, self.size = rank, 4

    model = Net()
    assert FakeKFAC(model, One()).owned() == FakeKFAC(model, One()).factor_keys()
    for strategy in ("mem-opt", "dp-kfac"):
        owned = [k for r in range(4) for k in FakeKFAC(model, Four(r), strategy).owned()]
        assert sorted(owned) == sorted(FakeKFAC(model, One()).factor_keys())
    dp = FakeKFAC(model, Four(0), "dp-kfac")
    for k in dp.factor_keys():
        layer = k.rsplit("/", 1)[0]
        assert dp.factor_owner(f"{layer}/A") == dp.factor_owner(f"{layer}/G")


def test_fake_kfac_running_average_matches_expected() -> None:
    class One:
        rank, size = 0, 1

    pre = FakeKFAC(Net(), One())
    for _ in range(3):
        pre.update()
    pre.check(3)


def flip_byte(path: Path, dataset: str, offset_in_data: int = 0) -> None:
    """Damage a checkpoint on disk: flip one bit in ``dataset``'s stored bytes."""
    import h5py

    with h5py.File(path, "r") as f:
        d = f[dataset]
        where = d.id.get_chunk_info(0).byte_offset if d.chunks else d.id.get_offset()
        assert where is not None
    with open(path, "r+b") as fh:
        fh.seek(where + offset_in_data)
        b = fh.read(1)
        fh.seek(where + offset_in_data)
        fh.write(bytes([b[0] ^ 0x10]))


def flip_bit(data: bytes, bit: int) -> bytes:
    """``data`` with bit number ``bit`` (0 = the first byte's lowest bit) flipped."""
    out = bytearray(data)
    out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


def spread_bits(nbytes: int, count: int) -> list[int]:
    """``count`` bit positions spread over a file of ``nbytes`` bytes (deterministic:
    evenly spaced, each at another bit of its byte)."""
    return [(i * nbytes // count) * 8 + i % 8 for i in range(count)]


def raw_read_raises(path: Path) -> bool:
    """Whether reading ``path`` the plain h5py way raises what ``verify`` did not catch
    before it caught everything: anything but a CheckpointError from the header checks
    (after the file opened), anything but ``OSError``/``KeyError``/``ValueError`` from a
    dataset read. Such bytes made ``verify``, ``latest(valid=True)`` and resume crash."""
    import h5py

    from kfac_hpc.checkpoint import CheckpointError
    from kfac_hpc.checkpoint.verify import read_header

    try:
        f = h5py.File(path, "r", locking=False)
    except OSError:
        return False
    with f:
        try:
            info, _ = read_header(f, str(path))
        except CheckpointError:
            return False
        except Exception:
            return True
        for p in info.manifest:
            try:
                if p in f:
                    f[p][()]
            except (OSError, KeyError, ValueError):
                pass
            except Exception:
                return True
    return False


def structural_flip(path: Path, tries: int = 400) -> int:
    """Flip one bit of ``path`` (in place) that makes plain h5py reading raise
    (:func:`raw_read_raises`); returns the bit. Searches :func:`spread_bits` in order."""
    data = path.read_bytes()
    for bit in spread_bits(len(data), tries):
        path.write_bytes(flip_bit(data, bit))
        if raw_read_raises(path):
            return bit
    path.write_bytes(data)
    raise AssertionError(f"no bit of {path} among {tries} makes h5py raise")
