"""Options for a factory (``--model-options KEY=VALUE``), converted by its annotations.

Values come from the command line (JSON if they parse, else the text) or a config
file, so a value may not have the type the factory declares. :func:`coerce_options`
converts each option the factory annotates:

* a scalar where a sequence is expected becomes a one-element tuple (``hidden=64``
  gives ``(64,)``); a string is never split into characters (``hidden="64"`` gives
  ``(64,)``, not ``(6, 4)``);
* ``int`` takes an int or the text of one; a float (``64.7``, also ``64.0``) is an
  error; ``float`` takes an int, a float or the text of one; ``bool`` takes true/false
  only; ``str`` takes text only; ``X | None`` also takes null; ``Literal[...]`` one of
  its values;
* options without an annotation (or ``Any``, or a type not listed here) are passed as
  they are.

A value that does not fit is a :class:`ValueError` naming the option, the expected
type and the value (the training driver reports it as a usage error, exit status 2).
"""

from __future__ import annotations

import collections.abc
import inspect
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["coerce_options", "describe_type"]


class _Mismatch(Exception):
    """A value that does not fit an annotation (turned into a ValueError by the caller)."""


def coerce_options(fn: Callable[..., Any], options: Mapping[str, Any],
                   flag: str = "--model-options") -> dict[str, Any]:
    """Convert ``options`` to the types ``fn``'s parameters declare.

    Args:
        fn: The factory whose keyword parameters receive ``options``.
        options: Option names and values (from ``KEY=VALUE`` text or a config table).
        flag: How the user gave the options, for messages.

    Returns:
        A new dict: annotated options converted, the others as they were.

    Raises:
        ValueError: A value does not fit its annotation; the message names the option,
            the expected type and the value.
    """
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # unresolvable annotations: pass the values as they are
        hints = {}
    try:
        declared: set[str] | None = set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        declared = None
    out: dict[str, Any] = {}
    for key, value in options.items():
        hint = hints.get(key)
        if hint is None or (declared is not None and key not in declared):
            out[key] = value
            continue
        try:
            out[key] = _coerce(value, hint)
        except _Mismatch as exc:
            raise ValueError(f"{flag} {key}={_show(value)}: expected {describe_type(hint)}, "
                             f"got {exc}") from None
    return out


def describe_type(hint: Any) -> str:
    """Describe an annotation in words, e.g. ``int or a sequence of int`` for ``Sequence[int]``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is type(None):
        return "null"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe_type(a) for a in args)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if _is_sequence(origin):
        if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
            return "a list of " + ", ".join(describe_type(a) for a in args)
        item = describe_type(args[0]) if args else "values"
        return f"{item} or a list of {item} (e.g. [256,128])"
    if isinstance(hint, type):
        return hint.__name__
    return str(hint)


def _show(value: Any) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)


def _got(value: Any) -> str:
    if isinstance(value, str):
        return f'the text "{value}"'
    return f"{type(value).__name__} {value!r}"


def _is_sequence(origin: Any) -> bool:
    return origin in (list, tuple, collections.abc.Sequence, collections.abc.MutableSequence)


def _coerce(value: Any, hint: Any) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if hint is type(None):
        if value is None:
            return None
        raise _Mismatch(_got(value))
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arm in args:
            if arm is type(None):
                continue
            try:
                return _coerce(value, arm)
            except _Mismatch:
                pass
        raise _Mismatch(_got(value))
    if origin is typing.Literal:
        if value in args:
            return value
        raise _Mismatch(_got(value))
    if _is_sequence(origin):
        return _sequence(value, origin, args)
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch(_got(value))
    if hint is int:
        return _int(value)
    if hint is float:
        return _float(value)
    if hint is str:
        if isinstance(value, str):
            return value
        raise _Mismatch(_got(value))
    return value  # a type this module does not know: the factory checks it


def _int(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    if isinstance(value, float):
        raise _Mismatch(f"{_got(value)} (a float is not an int)")
    raise _Mismatch(_got(value))


def _float(value: Any) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            pass
    raise _Mismatch(_got(value))


def _sequence(value: Any, origin: Any, args: tuple[Any, ...]) -> Any:
    items = list(value) if isinstance(value, (list, tuple)) else [value]  # text: one item
    if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
        if len(items) != len(args):
            raise _Mismatch(f"{len(items)} value(s) {_got(value)}")
        return tuple(_coerce(v, a) for v, a in zip(items, args))
    item = args[0] if args else Any
    try:
        done = [_coerce(v, item) for v in items]
    except _Mismatch as exc:
        raise _Mismatch(str(exc) if len(items) == 1 else f"{exc} in {_got(value)}") from None
    return done if origin in (list, collections.abc.MutableSequence) else tuple(done)
