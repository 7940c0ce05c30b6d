"""Your own model, data and loss in ``kfac-hpc train``: ``pkg.module:factory`` strings.

``--model``, ``--dataset`` and ``--loss`` (and the same keys in a TOML config) accept
``pkg.module:factory``: the module is imported (the current directory is searched
after ``sys.path``, as ``python -m`` does), the attribute after the colon (dots for
nested attributes) must be callable. The contracts (also in docs/training.md):

* **model factory** ``f(*, num_classes, in_channels, image_size, input_dim,
  **model_options) -> nn.Module``: it receives the keywords it declares (all of them
  when it takes ``**kwargs``) plus every ``--model-options KEY=VALUE``, converted by
  its annotations (:mod:`kfac_hpc.factory_options`: ``width: int`` refuses ``64.7``,
  ``hidden: Sequence[int]`` takes ``64`` as ``(64,)``). It must build
  the same parameters on every rank from torch's global RNG (the driver seeds it
  first and then broadcasts rank 0's parameters anyway). K-FAC preconditions its
  ``nn.Linear``/``nn.Conv2d`` layers; Shampoo every parameter.
* **data set factory** ``f(*, seed, path, augment, image_size, split_seed) -> ...``
  (the keywords it declares; ``path`` is ``--data-path`` or None) returning a
  :class:`~kfac_hpc.train.data.DatasetSplits`, or a tuple ``(train, test,
  num_classes)`` of map-style ``torch.utils.data.Dataset`` s whose items are
  ``(input tensor, integer class)``. Item ``i`` must be the same on every rank (the
  driver's sampler shards and shuffles; do not shuffle yourself). A
  :class:`~kfac_hpc.train.data.BatchDataset` is served a batch per call.
* **loss** ``f(output, target) -> scalar tensor``: the mean loss of a batch
  (default ``cross_entropy``); accuracy is ``argmax(output, 1) == target``.

A bad string (syntax, a module that does not import, a missing or non-callable
attribute, a factory that raises or returns the wrong type) is a
:class:`~kfac_hpc.train.config.ConfigError`: one message on rank 0, exit status 2
on every rank.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from kfac_hpc.factory_options import coerce_options
from kfac_hpc.train.config import ConfigError, is_plugin, plugin_syntax_ok
from kfac_hpc.train.data import DatasetSplits

__all__ = ["build_plugin_model", "is_plugin", "load_factory", "load_plugin_dataset",
           "resolve_loss"]

_FORM = "expected pkg.module:factory, e.g. examples.custom_model:build_model"


def load_factory(spec: str, flag: str) -> Callable[..., Any]:
    """Import the callable ``pkg.module:attr``; :class:`ConfigError` saying what is wrong."""
    if not plugin_syntax_ok(spec):
        raise ConfigError(f"{flag} {spec!r}: {_FORM}")
    module_name, _, attr = spec.partition(":")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        # first, as `python -m` puts it: a module next to the job script is found before
        # a module of the same name elsewhere on the path (the console script's path has
        # no current directory, and `test:build` would find the standard library's)
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module_name.startswith(exc.name):
            raise ConfigError(f"{flag} {spec!r}: no module named {exc.name!r} (is it on "
                              f"PYTHONPATH or in the current directory {cwd}?)") from None
        raise ConfigError(f"{flag} {spec!r}: importing {module_name!r} failed: "
                          f"{type(exc).__name__}: {exc}") from None
    except Exception as exc:
        raise ConfigError(f"{flag} {spec!r}: importing {module_name!r} failed: "
                          f"{type(exc).__name__}: {exc}") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = sorted(n for n in dir(module) if not n.startswith("_")
                           and callable(getattr(module, n)))
            raise ConfigError(f"{flag} {spec!r}: module {module_name!r} has no attribute "
                              f"{attr!r}; its callables: {', '.join(names) or '(none)'}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{flag} {spec!r}: {attr!r} is a {type(obj).__name__}, not callable")
    return cast(Callable[..., Any], obj)


def _call(fn: Callable[..., Any], spec: str, flag: str, kwargs: dict[str, Any],
          required: dict[str, Any] | None = None) -> Any:
    """Call ``fn`` with the keywords of ``kwargs`` it declares (all with ``**kwargs``).

    ``required`` keywords are always passed. Errors raised by the factory become a
    ConfigError naming it.

    Args:
        fn: The factory.
        spec: Its ``pkg.module:name``.
        flag: The option that named it (for messages).
        kwargs: The keywords it may take.
        required: The keywords it must take.

    Returns:
        What ``fn`` returned.
    """
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = None
    if params is not None and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    kwargs.update(required or {})
    try:
        return fn(**kwargs)
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"{flag} {spec!r}: the factory raised {type(exc).__name__}: "
                          f"{exc}") from None


def build_plugin_model(spec: str, *, num_classes: int, in_channels: int,
                       image_size: int | None, input_dim: int | None,
                       **options: Any) -> nn.Module:
    """Build the model of ``--model pkg.module:factory`` (see the module docstring)."""
    fn = load_factory(spec, "--model")
    common = {"num_classes": num_classes, "in_channels": in_channels,
              "image_size": image_size, "input_dim": input_dim}
    try:
        options = coerce_options(fn, options)
    except ValueError as exc:
        raise ConfigError(f"--model {spec!r}: {exc}") from None
    model = _call(fn, spec, "--model", common, required=dict(options))
    if not isinstance(model, nn.Module):
        raise ConfigError(f"--model {spec!r}: the factory returned a "
                          f"{type(model).__name__}, not a torch.nn.Module")
    return model


def load_plugin_dataset(spec: str, *, seed: int, path: str | None, augment: bool,
                        image_size: int | None, split_seed: int) -> DatasetSplits:
    """Load the data of ``--dataset pkg.module:factory`` (see the module docstring)."""
    fn = load_factory(spec, "--dataset")
    value = _call(fn, spec, "--dataset", {"seed": seed, "path": path, "augment": augment,
                                          "image_size": image_size, "split_seed": split_seed})
    if isinstance(value, DatasetSplits):
        return value
    if not (isinstance(value, tuple) and len(value) == 3):
        raise ConfigError(f"--dataset {spec!r}: the factory returned a {type(value).__name__}; "
                          "return DatasetSplits or a tuple (train, test, num_classes)")
    train, test, num_classes = value
    for name, ds in (("train", train), ("test", test)):
        if not isinstance(ds, torch.utils.data.Dataset) or not hasattr(ds, "__len__"):
            raise ConfigError(f"--dataset {spec!r}: {name} is a {type(ds).__name__}, not a "
                              "map-style torch.utils.data.Dataset with __len__")
        if len(ds) < 1:
            raise ConfigError(f"--dataset {spec!r}: the {name} set is empty")
    if not isinstance(num_classes, int) or num_classes < 1:
        raise ConfigError(f"--dataset {spec!r}: num_classes must be a positive int, got "
                          f"{num_classes!r}")
    x, _ = train[0]
    # one sample's shape as served (the shape-only passes build inputs of it; the model's
    # keyword arguments flatten what is not (C, H, W): DatasetSplits.model_kwargs)
    return DatasetSplits(spec, train, test, num_classes, tuple(torch.as_tensor(x).shape))


def resolve_loss(spec: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``cross_entropy`` or the function of ``--loss pkg.module:fn``."""
    if spec == "cross_entropy":
        return torch.nn.functional.cross_entropy
    return load_factory(spec, "--loss")
