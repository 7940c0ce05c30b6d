"""Model and optimizer state keyed by names (never by positions or ranks).

* The model is unwrapped from DDP / DataParallel, so a checkpoint written with a
  wrapper loads without one and vice versa; its ``state_dict()`` keys are the names.
* A *torch-layout* optimizer (one that keeps ``torch.optim.Optimizer.state_dict``)
  is stored with its parameter indices replaced by the model's parameter names, so
  it survives a change of parameter order or of parameter groups' positions.
* Any other optimizer (e.g. ``kfac_hpc.shampoo.DistributedShampoo``) is *generic*:
  its ``state_dict()`` is stored as it is and handed back to its ``load_state_dict()``.
  A generic optimizer whose state is spread over the ranks implements
  :class:`~kfac_hpc.checkpoint.contracts.ShardedState`: a load then reads each part of
  the state on the rank that owns it now (never the whole state on every rank) and
  keeps only this rank's part for a rollback.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from kfac_hpc.checkpoint.contracts import CheckpointOptimizer, ShardedState

__all__ = [
    "GENERIC_LAYOUT",
    "TORCH_LAYOUT",
    "ShardedState",
    "group_param_names",
    "optimizer_layout",
    "torch_layout",
    "torch_state_by_name",
    "torch_state_from_names",
    "unwrap",
]

TORCH_LAYOUT = "torch"
GENERIC_LAYOUT = "generic"


def unwrap(model: nn.Module) -> nn.Module:
    """Return the module inside a DDP / DataParallel wrapper.

    Args:
        model: A model, wrapped or not.

    Returns:
        The innermost wrapped module (the model itself when it is not wrapped).
    """
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    while isinstance(model, DistributedDataParallel | DataParallel):
        model = model.module
    return model


def torch_layout(optimizer: CheckpointOptimizer) -> torch.optim.Optimizer | None:
    """Return ``optimizer`` if it keeps torch's ``state_dict`` layout, else None.

    Args:
        optimizer: Any optimizer handed to ``save``/``load``.

    Returns:
        The optimizer, typed as a ``torch.optim.Optimizer``, when it is one whose
        ``state_dict`` and ``load_state_dict`` are torch's own; None otherwise.
    """
    if isinstance(optimizer, torch.optim.Optimizer) and (
            type(optimizer).state_dict is torch.optim.Optimizer.state_dict
            and type(optimizer).load_state_dict is torch.optim.Optimizer.load_state_dict):
        return optimizer
    return None


def optimizer_layout(optimizer: CheckpointOptimizer) -> str:
    """Return how ``optimizer``'s state is stored.

    Args:
        optimizer: Any optimizer handed to ``save``/``load``.

    Returns:
        ``"torch"`` for optimizers that keep torch's state_dict layout (see
        :func:`torch_layout`), else ``"generic"``.
    """
    return TORCH_LAYOUT if torch_layout(optimizer) is not None else GENERIC_LAYOUT


def _names_by_id(model: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in unwrap(model).named_parameters()}


def group_param_names(optimizer: torch.optim.Optimizer, model: nn.Module) -> list[list[str | None]]:
    """Name every parameter of every group of ``optimizer`` by the model.

    Args:
        optimizer: A torch optimizer.
        model: The model whose parameters it updates (wrapped or not).

    Returns:
        Per group, the model's name of each parameter (None for one the model lacks).
    """
    names = _names_by_id(model)
    return [[names.get(id(p)) for p in group["params"]] for group in optimizer.param_groups]


def torch_state_by_name(optimizer: torch.optim.Optimizer, model: nn.Module,
                        sd: Mapping[str, Any]) -> dict[str, Any]:
    """Key a torch optimizer's ``state_dict`` by parameter name.

    Args:
        optimizer: The optimizer.
        model: The model whose parameters it updates.
        sd: ``optimizer.state_dict()``.

    Returns:
        ``sd`` with parameter indices replaced by the model's parameter names.

    Raises:
        ValueError: The optimizer holds a parameter that is not the model's.
    """
    index_to_name: dict[int, str] = {}
    for g, (saved, names) in enumerate(zip(sd["param_groups"],
                                           group_param_names(optimizer, model))):
        for index, name in zip(saved["params"], names):
            if name is None:
                raise ValueError(f"optimizer parameter group {g} holds a parameter (index "
                                 f"{index}) that is not a parameter of the model")
            index_to_name[int(index)] = name
    state = {index_to_name[int(i)]: s for i, s in sd["state"].items()}
    groups = [{**saved, "params": [index_to_name[int(i)] for i in saved["params"]]}
              for saved in sd["param_groups"]]
    return {"state": state, "param_groups": groups}


def torch_state_from_names(optimizer: torch.optim.Optimizer, model: nn.Module,
                           saved: Mapping[str, Any], skip: set[str],
                           strict: bool) -> tuple[dict[str, Any], list[str]]:
    """Invert :func:`torch_state_by_name` against the live optimizer.

    Parameter groups are matched by position and must hold the same names (in any
    order); with ``strict=False`` a group that differs keeps its live hyper-parameters
    and every parameter present in both keeps its saved state (except names in
    ``skip``).

    Args:
        optimizer: The live optimizer.
        model: The model whose parameters it updates.
        saved: A state dict keyed by names, as :func:`torch_state_by_name` made it.
        skip: Parameter names whose saved state is left out.
        strict: Return nothing to load when a problem is found.

    Returns:
        The ``state_dict`` to load (indices as keys) and the problems found.
    """
    live = optimizer.state_dict()
    live_names = group_param_names(optimizer, model)
    problems: list[str] = []
    saved_groups = list(saved["param_groups"])
    if len(saved_groups) != len(live["param_groups"]):
        problems.append(f"optimizer: {len(saved_groups)} parameter group(s) in the file, "
                        f"{len(live['param_groups'])} in the optimizer")
    groups = []
    name_to_index: dict[str, int] = {}
    for g, (group, names) in enumerate(zip(live["param_groups"], live_names)):
        for index, name in zip(group["params"], names):
            if name is not None:
                name_to_index[name] = int(index)
        # State is keyed by name, so only the set of names matters, not their order.
        match = g < len(saved_groups) and set(saved_groups[g]["params"]) == set(names) \
            and None not in names
        if g < len(saved_groups) and not match:
            have, want = set(saved_groups[g]["params"]), {n for n in names if n is not None}
            problems.append(f"optimizer: parameter group {g} differs (missing "
                            f"{sorted(want - have)}, unexpected {sorted(have - want)})")
        base = saved_groups[g] if match else group
        groups.append({**base, "params": list(group["params"])})
    state: dict[int, Any] = {}
    for name, value in saved["state"].items():
        if name in skip:
            continue
        if name not in name_to_index:
            problems.append(f"optimizer: state for {name!r}, which the optimizer does not hold")
            continue
        state[name_to_index[name]] = value
    if strict and problems:
        return {}, problems
    return {"state": state, "param_groups": groups}, problems
