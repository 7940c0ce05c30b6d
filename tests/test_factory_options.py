"""``--model-options KEY=VALUE`` converted by the factory's annotations (every documented rule).

:func:`kfac_hpc.factory_options.coerce_options` is what stands between text from the
command line or a config table and a model factory; each rule of its module docstring
is checked here, with the error a wrong value gets.
"""

from __future__ import annotations

import typing
from collections.abc import MutableSequence, Sequence
from typing import Any, Literal

import pytest

from kfac_hpc.factory_options import coerce_options, describe_type


def factory(depth: int = 2, width: float = 1.0, bias: bool = True, name: str = "net",
            hidden: Sequence[int] = (64,), sizes: list[int] | None = None,
            pair: tuple[int, float] = (1, 1.0), kind: Literal["a", "b"] = "a",
            scale: float | None = None, growable: MutableSequence[int] | None = None,
            anything: Any = None, untyped=None, other: complex = 0j, **extra: Any) -> None:
    """A factory with one parameter of every annotation kind the module converts."""


def coerce(**options: Any) -> dict[str, Any]:
    return coerce_options(factory, options, flag="--model-options")


def test_ints_take_ints_and_their_text_and_refuse_floats() -> None:
    assert coerce(depth=3) == {"depth": 3}
    assert coerce(depth=" 4 ") == {"depth": 4}
    for bad, got in ((64.0, "float 64.0 (a float is not an int)"),
                     (64.7, "float 64.7 (a float is not an int)"),
                     ("six", 'the text "six"'), (True, "bool True"), (None, "NoneType None")):
        with pytest.raises(ValueError) as info:
            coerce(depth=bad)
        assert str(info.value).startswith("--model-options depth=")
        assert str(info.value).endswith(f"expected int, got {got}")


def test_floats_take_ints_floats_and_their_text() -> None:
    assert coerce(width=2) == {"width": 2.0} and type(coerce(width=2)["width"]) is float
    assert coerce(width=0.5) == {"width": 0.5}
    assert coerce(width="1e-3") == {"width": 1e-3}
    with pytest.raises(ValueError, match=r'width="wide": expected float, got the text "wide"'):
        coerce(width="wide")
    with pytest.raises(ValueError, match="expected float, got bool False"):
        coerce(width=False)


def test_bools_and_strings_take_only_their_own_type() -> None:
    assert coerce(bias=False) == {"bias": False}
    with pytest.raises(ValueError, match='bias="true": expected bool, got the text "true"'):
        coerce(bias="true")
    with pytest.raises(ValueError, match="expected bool, got int 1"):
        coerce(bias=1)
    assert coerce(name="resnet") == {"name": "resnet"}
    with pytest.raises(ValueError, match="name=5: expected str, got int 5"):
        coerce(name=5)


def test_a_scalar_where_a_sequence_is_expected_is_one_item_and_text_is_not_split() -> None:
    assert coerce(hidden=64) == {"hidden": (64,)}
    assert coerce(hidden="64") == {"hidden": (64,)}
    assert coerce(hidden=[256, "128"]) == {"hidden": (256, 128)}
    assert coerce(sizes=[1, 2]) == {"sizes": [1, 2]}  # a list stays a list
    assert coerce(sizes=None) == {"sizes": None}
    assert coerce(growable=(3,)) == {"growable": [3]}  # mutable: a list
    with pytest.raises(ValueError) as info:
        coerce(hidden=[256, 1.5])
    assert str(info.value) == ("--model-options hidden=[256, 1.5]: expected int or a list of "
                               "int (e.g. [256,128]), got float 1.5 (a float is not an int) "
                               "in list [256, 1.5]")
    with pytest.raises(ValueError, match=r"got float 1.5 \(a float is not an int\)$"):
        coerce(hidden=1.5)  # one item: no "in ..."


def test_fixed_tuples_take_one_value_per_position() -> None:
    assert coerce(pair=["2", 3]) == {"pair": (2, 3.0)}
    with pytest.raises(ValueError, match=r"expected a list of int, float, got 3 value\(s\) "
                                         r"list \[1, 2, 3\]"):
        coerce(pair=[1, 2, 3])


def test_optional_and_literal_annotations() -> None:
    assert coerce(scale=None) == {"scale": None}
    assert coerce(scale="2") == {"scale": 2.0}
    with pytest.raises(ValueError, match='expected float or null, got the text "big"'):
        coerce(scale="big")
    assert coerce(kind="b") == {"kind": "b"}
    with pytest.raises(ValueError, match=r"kind=\"c\": expected one of 'a', 'b', got the text"):
        coerce(kind="c")


def test_unannotated_unknown_and_undeclared_options_pass_as_they_are() -> None:
    marker = object()
    assert coerce(anything=marker)["anything"] is marker
    assert coerce(untyped="3") == {"untyped": "3"}
    assert coerce(other="1+2j") == {"other": "1+2j"}  # a type the module does not know
    assert coerce(not_a_parameter=1.5) == {"not_a_parameter": 1.5}  # into **extra


def test_the_options_given_are_not_modified() -> None:
    given = {"hidden": [1, 2], "depth": "3"}
    out = coerce(**given)
    assert given == {"hidden": [1, 2], "depth": "3"} and out == {"hidden": (1, 2), "depth": 3}


def test_factories_whose_annotations_do_not_resolve_get_the_values_as_they_are() -> None:
    def broken(depth: UndefinedName = 2) -> None:  # type: ignore[name-defined]  # noqa: F821
        """Its annotation names a type that does not exist."""

    assert coerce_options(broken, {"depth": "7"}, flag="--model-options") == {"depth": "7"}


def test_types_are_described_in_words() -> None:
    assert describe_type(int) == "int"
    assert describe_type(type(None)) == "null"
    assert describe_type(int | None) == "int or null"
    assert describe_type(typing.Optional[float]) == "float or null"  # noqa: UP045
    assert describe_type(Literal["x", 2]) == "one of 'x', 2"
    assert describe_type(Sequence[int]) == "int or a list of int (e.g. [256,128])"
    assert describe_type(tuple[int, ...]) == "int or a list of int (e.g. [256,128])"
    assert describe_type(tuple[int, str]) == "a list of int, str"
    assert describe_type(list) == "list"
