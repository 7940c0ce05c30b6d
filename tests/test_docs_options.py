"""The guides name every option: each ``kfac-hpc train`` flag in docs/training.md, each
flag of the other subcommands in the README or docs/, each argument of
``KFACPreconditioner`` and ``DistributedShampoo`` in the README's tables."""

from __future__ import annotations

import argparse
import inspect
import re
from pathlib import Path

import pytest

import kfac_hpc
from kfac_hpc.cli import SUBCOMMANDS, build_parser
from kfac_hpc.train.cli import add_arguments

ROOT = Path(__file__).resolve().parent.parent


def test_every_train_flag_is_in_the_training_guide() -> None:
    """docs/training.md names every ``kfac-hpc train`` flag (a boolean's ``--no-`` form
    as ``--[no-]flag`` or either form), so a new option cannot go undocumented."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    guide = (ROOT / "docs" / "training.md").read_text()
    named = set(re.findall(r"--(?:\[no-\])?([a-z0-9][a-z0-9-]*)", guide))
    named |= {f"no-{n}" for n in named} | {n.removeprefix("no-") for n in named}
    flags = {o.removeprefix("--") for a in parser._actions for o in a.option_strings
             if o.startswith("--") and o != "--help"}
    missing = sorted(flags - named)
    assert not missing, f"flags missing from docs/training.md: {missing}"


@pytest.mark.parametrize("cls", ["KFACPreconditioner", "DistributedShampoo"])
def test_every_constructor_argument_is_in_the_readme(cls: str) -> None:
    """The README's option tables name every argument of the two constructors (with its
    default), so a new option cannot go undocumented."""
    readme = (ROOT / "README.md").read_text()
    params = [p for p in inspect.signature(getattr(kfac_hpc, cls).__init__).parameters
              if p not in ("self", "model")]
    missing = [p for p in params if f"`{p}`" not in readme]
    assert not missing, f"{cls} arguments missing from the README: {missing}"


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings
            if o.startswith("--") and o != "--help"}


@pytest.mark.parametrize("command", [c for c in SUBCOMMANDS if c != "train"])
def test_every_subcommand_flag_is_in_the_docs(command: str) -> None:
    """Each flag of the other ``kfac-hpc`` subcommands appears in the README or docs/."""
    sub = next(a for a in build_parser([command])._actions
               if isinstance(a, argparse._SubParsersAction))
    text = (ROOT / "README.md").read_text() + "".join(
        p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    missing = sorted(f for f in _flags(sub.choices[command])
                     if not re.search(re.escape(f) + r"(?![a-z0-9-])", text))
    assert not missing, f"kfac-hpc {command} flags missing from the docs: {missing}"
