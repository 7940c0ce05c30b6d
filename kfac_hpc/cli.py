"""The ``kfac-hpc`` command: one entry point, one module per subcommand.

Each subcommand module provides ``add_arguments(parser)`` and ``run(args) -> int``.
Modules are imported only when their subcommand runs, so ``kfac-hpc --help`` is fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "info": ("kfac_hpc.runtime.info",
             "versions, MPI library, which MPI calls take CUDA memory (and the evidence), "
             "ranks and devices"),
    "selfcheck": ("kfac_hpc.comm.selfcheck",
                  "check every collective on the current ranks (--device cuda: on GPU "
                  "tensors) and time them"),
    "train": ("kfac_hpc.train.cli", "train a model with K-FAC/Shampoo/SGD/Adam over MPI ranks"),
    "plot": ("kfac_hpc.train.plot", "loss/accuracy curves of runs (metrics.jsonl) as a PNG"),
    "ckpt": ("kfac_hpc.checkpoint.cli", "inspect or verify HDF5 checkpoints (exit 0 ok, 1 bad)"),
    "plan": ("kfac_hpc.plan.cli",
             "predict iteration time, bytes and memory per rank of every K-FAC strategy"),
    "calibrate": ("kfac_hpc.plan.calibrate",
                  "measure MPI and compute speed of these ranks into a planner profile"),
}


def build_parser(names: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """Build the ``kfac-hpc`` parser.

    Args:
        names: Subcommands whose options are added (their modules are imported); None:
            all of them.

    Returns:
        The parser, with every subcommand listed.
    """
    parser = argparse.ArgumentParser(
        prog="kfac-hpc",
        description="Distributed K-FAC and Shampoo for PyTorch over MPI.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if names is None or name in names:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kfac-hpc`` command.

    For ``train``, preemption signals are caught from the start (before torch and MPI
    load).

    Args:
        argv: The arguments (default ``sys.argv[1:]``).

    Returns:
        The exit status: the subcommand's, or 2 without one.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    if command == "train":  # a job: catch preemption signals before torch and MPI load
        from kfac_hpc.train import cli as train_cli

        train_cli.install_startup_signals(argv)
        try:
            return _main(argv, command)
        finally:
            train_cli.uninstall_startup_signals()
    return _main(argv, command)


def _main(argv: list[str], command: str | None) -> int:
    parser = build_parser([command] if command in SUBCOMMANDS else [])
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
