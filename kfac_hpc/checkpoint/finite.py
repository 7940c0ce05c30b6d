"""NaN and Inf in checkpoint state: ``save`` and ``load`` refuse it, ``verify`` reports it.

A run that diverged must not replace good checkpoints with useless ones, so the
training state (``/model``, ``/optimizer``, ``/kfac``) has to be finite. ``extra``
(``/train``) and RNG states are not checked: metrics may legitimately be NaN.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kfac_hpc.checkpoint.layout import KFAC, MODEL, OPTIMIZER, storage_to_tensor

__all__ = ["CHECKED", "all_finite", "checked", "nonfinite_count"]

CHECKED = (MODEL, OPTIMIZER, KFAC)


def checked(path: str) -> bool:
    """Say whether the dataset at ``path`` must be finite.

    Args:
        path: A dataset path in a checkpoint file.

    Returns:
        True for model, optimizer and K-FAC datasets.
    """
    return path.startswith(tuple(f"/{s}/" for s in CHECKED))


def all_finite(value: Any) -> bool:
    """Say whether ``value`` holds no NaN or Inf.

    Args:
        value: A tensor, an array or anything else (always finite).

    Returns:
        False for a floating (or complex) tensor or array holding NaN or Inf.
    """
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "fc" or value.size == 0:
            return True
        with np.errstate(over="ignore", invalid="ignore"):
            total = value.sum()
        return bool(np.isfinite(total)) or bool(np.isfinite(value).all())
    if not isinstance(value, torch.Tensor):
        return True
    if not (value.is_floating_point() or value.is_complex()) or value.numel() == 0:
        return True
    t = value.detach()
    if t.element_size() == 1:  # float8: reductions are not implemented for every kind
        t = t.float()
    # A finite sum means no NaN and no Inf (both propagate), in one fast pass without a
    # temporary; only an overflowing sum of finite values needs the element-wise check.
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def nonfinite_count(arr: np.ndarray, torch_dtype: str | None) -> int:
    """Count the NaN/Inf elements of a dataset as stored.

    Args:
        arr: The dataset's data.
        torch_dtype: Its ``torch_dtype`` attribute, if any.

    Returns:
        How many elements are NaN or Inf.
    """
    value: Any = arr if torch_dtype is None else storage_to_tensor(arr, torch_dtype)
    if all_finite(value):
        return 0
    if isinstance(value, np.ndarray):
        return int(value.size - np.count_nonzero(np.isfinite(value)))
    t = value.float() if value.element_size() == 1 else value
    return int((~torch.isfinite(t)).sum())
