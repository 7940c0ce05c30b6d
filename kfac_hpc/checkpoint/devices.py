"""Where loaded state goes: the one placement rule of :func:`kfac_hpc.checkpoint.load`.

Files hold host bytes; a GPU run that resumes must keep running on its GPU. So:

* model entries are copied into the live entries they replace (their device and
  dtype; the dtype is converted beforehand, the copy crosses to the device);
* K-FAC state (factors, decompositions, any other tensors the preconditioner's
  ``state_dict()`` holds) goes to :func:`model_device`, the device of the model's
  parameters;
* optimizer state follows its parameter: a torch optimizer's per-parameter state goes
  to that parameter's device, except what torch itself keeps on the host (``step``
  of optimizers that are neither ``fused`` nor ``capturable``); a generic optimizer's
  ``state[<parameter name>]`` goes to that parameter's device, anything else to
  :func:`model_device`.

Optimizer and K-FAC tensors are moved here, before anything is applied, so an
out-of-memory error on the device stops the load while nothing has changed yet.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from kfac_hpc.checkpoint.state import unwrap

__all__ = ["model_device", "place_generic_optimizer", "place_torch_optimizer", "to_device"]


def model_device(model: nn.Module) -> torch.device:
    """Return the device of the model's parameters.

    Args:
        model: The model (wrapped or not).

    Returns:
        Its parameters' device (its buffers' without parameters; else the CPU).
    """
    net = unwrap(model)
    for t in (*net.parameters(), *net.buffers()):
        return t.device
    return torch.device("cpu")


def to_device(obj: Any, device: torch.device) -> Any:
    """Move every tensor in nested dicts, lists and tuples to ``device``.

    Args:
        obj: A tensor, or nested containers of them and other values.
        device: The target device.

    Returns:
        ``obj`` with containers rebuilt and tensors moved (dtypes kept); everything
        else as it is.
    """
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_device(v, device) for v in obj]
    if isinstance(obj, tuple):
        return tuple(to_device(v, device) for v in obj)
    return obj


def place_torch_optimizer(optimizer: torch.optim.Optimizer,
                          sd: Mapping[str, Any]) -> dict[str, Any]:
    """Place a torch optimizer's ``state_dict`` on its parameters' devices.

    Args:
        optimizer: The live optimizer.
        sd: A ``state_dict`` for it (indices as keys).

    Returns:
        ``sd`` with each parameter's state on that parameter's device (``step`` as
        torch keeps it; see the module docstring).
    """
    params: dict[int, tuple[torch.Tensor, bool]] = {}
    index = 0
    for group in optimizer.param_groups:
        on_device = bool(group.get("fused") or group.get("capturable"))
        for p in group["params"]:
            params[index] = (p, on_device)
            index += 1
    state: dict[Any, Any] = {}
    for i, value in sd["state"].items():
        p, on_device = params.get(int(i), (None, False))
        if p is None or not isinstance(value, dict):
            state[i] = value
            continue
        state[i] = {k: v if (k == "step" and not on_device) else to_device(v, p.device)
                    for k, v in value.items()}
    return {**sd, "state": state}


def place_generic_optimizer(model: nn.Module, saved: Any) -> Any:
    """Place a generic optimizer's ``state_dict`` on the model's devices.

    Args:
        model: The model whose parameters the optimizer updates.
        saved: The decoded state dict.

    Returns:
        ``saved`` with ``state[<parameter name>]`` on that parameter's device and every
        other tensor on :func:`model_device`.
    """
    device = model_device(model)
    if not isinstance(saved, dict):
        return to_device(saved, device)
    devices = {n: p.device for n, p in unwrap(model).named_parameters()}
    out = {k: to_device(v, device) for k, v in saved.items() if k != "state"}
    if "state" in saved:
        state = saved["state"]
        out["state"] = ({name: to_device(v, devices.get(name, device)) for name, v in state.items()}
                        if isinstance(state, dict) else to_device(state, device))
    return {k: out[k] for k in saved}  # the saved order
