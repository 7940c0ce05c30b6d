"""``kfac-hpc train`` (also ``python -m kfac_hpc.train``): the reference training job.

Run it on N ranks with ``launch/local -n 4 kfac-hpc train`` (or ``srun``/``mpiexec``).
Flags override a ``--config`` file, which overrides the defaults (see
:mod:`kfac_hpc.train.config`). Exit status: 0 on success, 2 for bad input (one message
on rank 0, every rank exits 2 together), 3 when training diverged (the loss, the
parameters or K-FAC/Shampoo statistics became NaN/Inf: one message on rank 0 naming
the step and the last good checkpoint, every rank exits 3 together), 1 when a
checkpoint cannot be written (disk full, ...: one message, every rank exits 1), 4 when
a rank made no progress for ``--hang-timeout-minutes`` (the watchdog prints that rank's
stacks and aborts the job), 75 after a preemption checkpoint; any other error aborts
all ranks with the failing rank's traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import typing
from collections.abc import Sequence
from typing import Any

__all__ = ["add_arguments", "env_rank", "main", "run", "select_device_before_mpi"]

_GROUP_TITLES = {
    "data": "data",
    "model": "model",
    "run": "run length and batches",
    "optimizer": "optimizer",
    "schedule": "learning-rate schedule",
    "kfac": "K-FAC preconditioner",
    "distributed": "distribution and device",
    "output": "output",
    "checkpoint": "checkpoints (need kfac_hpc.checkpoint)",
}

_RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID",
                   "MV2_COMM_WORLD_RANK", "MPI_RANK")


def env_rank() -> int:
    """This process's rank from the launcher's environment (0 if not launched by one).

    Used before MPI is initialised, so that argument errors print once.
    """
    for name in _RANK_VARIABLES:
        value = os.environ.get(name)
        if value is not None and value.strip().isdigit():
            return int(value)
    return 0


def _rank0_only(parser: argparse.ArgumentParser) -> None:
    """Make ``parser`` print usage errors and help on rank 0 only (exit 2 on every rank),
    and reject unknown flags itself rather than leaving them to the parent parser."""
    quiet = env_rank() != 0

    def error(message: str) -> typing.NoReturn:
        if not quiet:
            sys.stderr.write(f"{parser.prog}: error: {message} (see {parser.prog} --help)\n")
        sys.exit(2)

    original_parse_known = parser.parse_known_args
    original_help = parser.print_help

    def parse_known_args(args: Sequence[str] | None = None, namespace: Any = None) -> Any:
        ns, extras = original_parse_known(args, namespace)
        if extras:
            error(f"unrecognized arguments: {' '.join(extras)}")
        return ns, extras

    def print_help(file: Any = None) -> None:
        if not quiet:
            original_help(file)

    parser.error = error  # type: ignore[method-assign]
    parser.parse_known_args = parse_known_args  # type: ignore[method-assign,assignment]
    parser.print_help = print_help  # type: ignore[method-assign]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per :class:`~kfac_hpc.train.config.TrainConfig` field, plus ``--config``.

    Values stay strings here and are converted and validated by the config, so a bad
    value is reported like any other bad input (once, exit 2).
    """
    from kfac_hpc.train.config import field_help, field_types

    _rank0_only(parser)
    parser.description = (
        "Train a model with K-FAC/Shampoo/SGD/Adam over MPI ranks "
        "(e.g. `launch/local -n 4 kfac-hpc train`). Defaults: digits, mlp, K-FAC "
        "(comm-opt) on SGD; flags override --config FILE (TOML, or YAML with PyYAML).")
    parser.add_argument("--config", metavar="FILE", default=None,
                        help="TOML/YAML file of options (keys = flag names)")
    hints = field_types()
    groups: dict[str, Any] = {}
    for name, group, help_text, default in field_help():
        g = groups.get(group)
        if g is None:
            g = groups[group] = parser.add_argument_group(_GROUP_TITLES.get(group, group))
        flag = "--" + name.replace("_", "-")
        tp = hints[name]
        if default is None and "default" in help_text:
            text = help_text  # the help states a default that depends on other options
        else:
            text = f"{help_text} (default: {_show_default(default)})"
        if tp is bool:
            g.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction,
                           default=None, help=text)
        elif typing.get_origin(tp) is dict:
            g.add_argument(flag, dest=name, action="append", metavar="KEY=VALUE", default=None,
                           help=f"{help_text} (repeatable)")
        else:
            g.add_argument(flag, dest=name, metavar=_metavar(name, tp), default=None, help=text)
    parser.set_defaults(_train_parser=parser)


def _show_default(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value) or "none"
    return "none" if value is None else str(value)


def _metavar(name: str, tp: Any) -> str:
    if typing.get_origin(tp) is tuple:
        return "A,B,..."
    text = str(tp)
    if "int" in text:
        return "N"
    if "float" in text:
        return "X"
    return name.split("_")[-1].upper()


def config_from_args(args: argparse.Namespace) -> Any:
    """The :class:`TrainConfig` of parsed ``args`` (file values, then given flags)."""
    from kfac_hpc.train.config import TrainConfig, field_help

    overrides = {name: getattr(args, name) for name, *_ in field_help()
                 if getattr(args, name, None) is not None}
    return TrainConfig.from_sources(getattr(args, "config", None), overrides)


def run(args: argparse.Namespace) -> int:
    """Entry point of the subcommand: returns the exit status (same on every rank)."""
    from kfac_hpc.train.config import ConfigError

    rank = env_rank()
    try:
        cfg = config_from_args(args)
        # First: mpi4py starts MPI on import, and validate() may import it already
        # (--preempt-signals are checked by the MPI-aware preemption module).
        select_device_before_mpi(cfg.device)
        cfg.validate()  # every rank reaches the same verdict, no collective
    except ValueError as exc:  # ConfigError, or a malformed launcher variable
        return _usage_error(str(exc), rank)

    from kfac_hpc.comm import install_abort_on_error, world

    install_abort_on_error()
    comm = world()
    from kfac_hpc.checkpoint import CheckpointError
    from kfac_hpc.runtime.preemption import REQUEUE_EXIT_CODE, PreemptionGuard
    from kfac_hpc.train.loop import TrainingDiverged, train

    margin = cfg.time_limit_margin_minutes
    guard = PreemptionGuard(comm, signals=cfg.preempt_signals,
                            time_margin_s=None if margin is None else 60 * margin).install()
    try:
        result = train(cfg, comm, should_stop=lambda: guard.local_reason() is not None)
    except ConfigError as exc:  # raised alike on every rank by the setup agreement
        return _usage_error(str(exc), comm.rank)
    except TrainingDiverged as exc:  # raised alike on every rank, at the same step
        if comm.rank == 0:
            print(f"kfac-hpc train: {exc}", file=sys.stderr, flush=True)
        return exc.exit_status
    except CheckpointError as exc:  # a save failed (disk full, ...): alike on every rank
        if comm.rank == 0:
            print(f"kfac-hpc train: error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        # a late second signal (SLURM may repeat it) must not kill a rank that has
        # checkpointed and is about to exit 75
        guard.ignore_from_now_on()
    if result.stopped == "stop_requested":
        reason = guard.local_reason() or "another rank was signalled"
        if not cfg.checkpoint_dir:
            if comm.rank == 0:
                print(f"kfac-hpc train: stopped ({reason}) without --checkpoint-dir: "
                      "nothing was saved", file=sys.stderr, flush=True)
            return 1
        if comm.rank == 0:
            print(f"kfac-hpc train: stopped ({reason}); checkpoint saved in "
                  f"{cfg.checkpoint_dir}; exit status {REQUEUE_EXIT_CODE} asks for a requeue",
                  flush=True)
        return REQUEUE_EXIT_CODE
    return 0 if result.ranks_agree else 1


def select_device_before_mpi(device: str) -> None:
    """Make this rank's GPU current before anything imports mpi4py (see
    :func:`kfac_hpc.runtime.select_device`); ``--device cuda`` without a GPU is left to
    ``validate()``, which reports it with the other problems."""
    from kfac_hpc.runtime.device import select_device

    select_device("cpu" if device == "cpu" else "auto")


def _usage_error(message: str, rank: int) -> int:
    if rank == 0:
        sys.stderr.write(f"kfac-hpc train: error: {message}\n")
        sys.stderr.flush()
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kfac_hpc.train [flags]``."""
    parser = argparse.ArgumentParser(prog="python -m kfac_hpc.train")
    add_arguments(parser)
    args = parser.parse_args(argv)
    return run(args)
