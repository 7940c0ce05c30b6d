"""``kfac-hpc train`` (also ``python -m kfac_hpc.train``): the reference training job.

Run it on N ranks with ``launch/local -n 4 kfac-hpc train`` (or ``srun``/``mpiexec``).
Flags override a ``--config`` file, which overrides the defaults (see
:mod:`kfac_hpc.train.config`). Exit status: 0 on success, 2 for bad input (one message
on rank 0, every rank exits 2 together), 3 when training diverged (the loss, the
parameters or K-FAC/Shampoo statistics became NaN/Inf: one message on rank 0 naming
the step, the last finite checkpoint and the newest one taken before the loss left
its running range, every rank exits 3 together), 1 when a
checkpoint cannot be written (disk full, ...: one message, every rank exits 1), 4 when
a rank made no progress for ``--hang-timeout-minutes`` (the watchdog prints that rank's
stacks and aborts the job), 75 after a preemption checkpoint, or on a preemption signal
that arrives before anything can be checkpointed (the first seconds: see
:class:`StartupSignals`), 130 after Ctrl-C (SIGINT: every rank checkpoints at the next
step and rank 0 names the file); any other error aborts all ranks with the failing
rank's traceback.

Usage errors found before MPI starts (a bad flag or value, a broken config file) are
agreed over MPI before any rank exits (:func:`agree_on_usage`): a launcher kills the
other ranks as soon as one exits with an error, so a rank that exits first must not
take rank 0's message with it.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import typing
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from kfac_hpc.signals import REQUEUE_EXIT_CODE, parse_signal

if TYPE_CHECKING:  # imports torch: not before the start-up signal handlers are in place
    from kfac_hpc.train.config import TrainConfig

__all__ = ["INTERRUPT_EXIT_CODE", "REQUEUE_EXIT_CODE", "StartupSignals", "add_arguments",
           "agree_on_usage", "env_rank", "env_size", "main", "run", "select_device_before_mpi"]

INTERRUPT_EXIT_CODE = 130  # 128 + SIGINT, what a shell reports for a Ctrl-C'd command
#: Seconds a rank other than 0 waits before exiting on a signal during start-up, so that
#: rank 0 (signalled alike) reports it before the launcher ends the job.
STARTUP_EXIT_GRACE_S = 2.0

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
_SIZE_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE", "FLUX_JOB_SIZE",
                   "SLURM_NTASKS")


def env_rank() -> int:
    """Return this process's rank from the launcher's environment (0 if not launched by one).

    Used before MPI is initialised, so that argument errors print once.
    """
    for name in _RANK_VARIABLES:
        value = os.environ.get(name)
        if value is not None and value.strip().isdigit():
            return int(value)
    return 0


def env_size() -> int:
    """Return the number of ranks from the launcher's environment (1 if not launched by one)."""
    for name in _SIZE_VARIABLES:
        value = os.environ.get(name)
        if value is not None and value.strip().isdigit():
            return max(1, int(value))
    return 1


def agree_on_usage(problem: str | None) -> int:
    """Agree on the usage errors every rank found before MPI started.

    The answer is 0 when none did, else 2 once rank 0 has printed and flushed them
    (collective when launched on several ranks; every rank of the job must call it once,
    with or without a problem).

    Why not simply exit: ``mpiexec`` (and ``srun --kill-on-bad-exit``) kills every rank
    as soon as one exits with an error status, so a rank other than 0 that finds the same
    error a little sooner took rank 0 (and the message, printed on rank 0 only) with it.
    Here nobody exits before rank 0 has written the message; a problem that only some
    ranks found (a file missing on one node) is printed too, naming those ranks.

    Args:
        problem: this rank's complete message line(s), or None.

    Returns:
        The exit status: 0 (no rank found a problem) or 2.
    """
    if env_size() <= 1:
        if problem is not None and env_rank() == 0:
            sys.stderr.write(problem.rstrip("\n") + "\n")
            sys.stderr.flush()
        return 0 if problem is None else 2
    try:
        from mpi4py import MPI  # starts MPI: the device is chosen before (select_device)

        comm = MPI.COMM_WORLD
        problems: list[str | None] = comm.allgather(problem)
    except Exception as exc:  # no MPI to agree with: say it here (rank 0), as before
        if problem is None:
            raise
        if env_rank() == 0:
            sys.stderr.write(f"{problem.rstrip()}\n(MPI did not start: {exc})\n")
            sys.stderr.flush()
        return 2
    if all(p is None for p in problems):
        return 0
    if comm.Get_rank() == 0:
        texts: dict[str, list[int]] = {}
        for rank, text in enumerate(problems):
            if text is not None:
                texts.setdefault(text.rstrip("\n"), []).append(rank)
        for text, ranks in texts.items():
            where = "" if 0 in ranks else f" [on rank(s) {', '.join(map(str, ranks))}]"
            sys.stderr.write(f"{text}{where}\n")
        sys.stderr.flush()
    comm.Barrier()  # nobody exits (and gets the job killed) before rank 0 has printed
    return 2


def _config_value(path: str, key: str) -> Any:
    """``key`` of a TOML config file (None: absent, or not a TOML file this can read).

    At the top or in a table one level deep, as
    :func:`~kfac_hpc.train.config.load_config_file` flattens them.
    """
    import tomllib

    if not path.lower().endswith(".toml"):
        return None
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except (OSError, ValueError):
        return None
    tables = [data, *(v for v in data.values() if isinstance(v, dict))]
    for table in tables:
        for name in (key, key.replace("_", "-")):
            if name in table:
                return table[name]
    return None


class StartupSignals:
    """Signal handlers for the first seconds of a job, before its preemption guard exists.

    Installed on the first line of the entry point (before torch and mpi4py are imported,
    which alone take seconds): a preemption signal (``USR1``, ``TERM`` and those named by
    ``--preempt-signals``) makes the rank exit :data:`REQUEUE_EXIT_CODE` at once, as
    nothing can be checkpointed yet and the batch script should requeue the job rather
    than count a crash; ``SIGINT`` makes it exit :data:`INTERRUPT_EXIT_CODE`. Rank 0
    says so on stderr. Once the training loop's
    :class:`~kfac_hpc.runtime.preemption.PreemptionGuard` is installed it takes over
    (:meth:`hand_over`); :meth:`uninstall` restores what was there before.
    """

    def __init__(self, signals: Iterable[str | int] = ("USR1", "TERM")) -> None:
        """Choose the signals; nothing is installed before :meth:`install`.

        Args:
            signals: The preemption signals (names or numbers); ``SIGINT`` is always
                handled. Unknown names are skipped (the config's validation reports them).
        """
        self.signals: list[signal.Signals] = [signal.SIGINT]
        for name in signals:
            try:
                sig = parse_signal(name)
            except ValueError:
                continue  # reported by the config's validation
            if sig not in self.signals:
                self.signals.append(sig)
        self._previous: dict[signal.Signals, Any] = {}

    @classmethod
    def from_argv(cls, argv: Sequence[str]) -> StartupSignals:
        """The signals the run will handle, as named by ``argv``.

        ``--preempt-signals`` in ``argv``, else the ``preempt_signals`` of its ``--config``
        file, else ``USR1`` and ``TERM``. Read without the config's machinery (no torch
        yet); what cannot be read here is left to the config's validation. ``none`` (or
        nothing) handles none of them.
        """
        given: Any = None
        config: str | None = None
        for i, arg in enumerate(argv):
            if arg in ("--preempt-signals", "--config") and i + 1 < len(argv):
                value: str | None = argv[i + 1]
            elif arg.startswith(("--preempt-signals=", "--config=")):
                value = arg.split("=", 1)[1]
            else:
                continue
            if arg.startswith("--config"):
                config = value
            else:
                given = value
        if given is None and config is not None:
            given = _config_value(config, "preempt_signals")
        if given is None:
            return cls(["USR1", "TERM"])
        items = given.split(",") if isinstance(given, str) else given
        if not isinstance(items, list | tuple):
            return cls(["USR1", "TERM"])
        names = [str(v).strip() for v in items if str(v).strip()]
        return cls([n for n in names if n.lower() != "none"])

    def install(self) -> StartupSignals:
        """Install the handlers (main thread only; elsewhere nothing is done)."""
        try:
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        except ValueError:  # not the main thread: leave the signals alone
            self.uninstall()
        return self

    def hand_over(self, taken: Iterable[signal.Signals]) -> None:
        """Hand the signals over to the caller's handlers.

        The previous handlers of the signals that the caller's handlers (just installed
        for ``taken``) do not cover are restored; the others are forgotten.

        Args:
            taken: The signals the caller now handles.
        """
        taken = set(taken)
        for sig in list(self._previous):
            if sig in taken:
                del self._previous[sig]
        self.uninstall()

    def uninstall(self) -> None:
        """Put back the previous handlers of the signals still handled here."""
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGINT:
            status, what = INTERRUPT_EXIT_CODE, "interrupted"
        else:
            status, what = REQUEUE_EXIT_CODE, "preempted"
        if env_rank() == 0:
            try:
                sys.stderr.write(f"kfac-hpc train: {what} ({name}) while starting, before "
                                 f"anything could be checkpointed; exit status {status}"
                                 + (" asks for a requeue" if status == REQUEUE_EXIT_CODE
                                    else "") + "\n")
                sys.stderr.flush()
            except (OSError, ValueError):
                pass
        else:
            # the launcher ends the job when the first rank exits: the other ranks give
            # rank 0, which got the same signal, time to say why before they go
            time.sleep(STARTUP_EXIT_GRACE_S)
        os._exit(status)  # from any point of the start-up: imports, MPI_Init, parsing


def _rank0_only(parser: argparse.ArgumentParser) -> None:
    """Make ``parser`` print usage errors and help on rank 0 only.

    It exits 2 on every rank after rank 0 printed (:func:`agree_on_usage`), and rejects
    unknown flags itself rather than leaving them to the parent parser.

    Args:
        parser: The parser, changed in place.
    """
    quiet = env_rank() != 0

    def error(message: str) -> typing.NoReturn:
        sys.exit(agree_on_usage(f"{parser.prog}: error: {message} (see {parser.prog} --help)"))

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
    from kfac_hpc.train.config import field_help, field_types, is_flag

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
        if is_flag(tp):  # --x / --no-x; unset: the default (None: the option's own rule)
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
    """Build the :class:`TrainConfig` of parsed ``args`` (file values, then given flags)."""
    from kfac_hpc.train.config import TrainConfig, field_help

    overrides = {name: getattr(args, name) for name, *_ in field_help()
                 if getattr(args, name, None) is not None}
    return TrainConfig.from_sources(getattr(args, "config", None), overrides)


def run(args: argparse.Namespace) -> int:
    """Entry point of the subcommand: returns the exit status (same on every rank)."""
    from kfac_hpc.train.config import ConfigError

    problem: str | None = None
    try:
        cfg = config_from_args(args)
        # First: mpi4py starts MPI on import, and validate() may import it already
        # (--preempt-signals are checked by the MPI-aware preemption module).
        select_device_before_mpi(cfg.device)
        cfg.validate()  # every rank reaches the same verdict, no collective
    except ValueError as exc:  # ConfigError, or a malformed launcher variable
        problem = f"kfac-hpc train: error: {exc}"
    status = agree_on_usage(problem)  # every rank, before any rank may exit
    if status:
        return status

    from kfac_hpc.comm import install_abort_on_error, world
    from kfac_hpc.runtime.preemption import PreemptionGuard

    install_abort_on_error()
    comm = world()
    margin = cfg.time_limit_margin_minutes
    guard = PreemptionGuard(comm, signals=cfg.preempt_signals,
                            time_margin_s=None if margin is None else 60 * margin).install()
    interrupt = PreemptionGuard(comm, signals=[] if signal.SIGINT in guard.signals
                                else ["INT"]).install()
    _hand_over_startup_signals([*guard.signals, *interrupt.signals])

    from kfac_hpc.checkpoint import CheckpointError
    from kfac_hpc.train.loop import TrainingDiverged, train
    from kfac_hpc.train.result import StopReason

    def should_stop() -> bool:
        return guard.local_reason() is not None or bool(interrupt.received)

    try:
        result = train(cfg, comm, should_stop=should_stop)
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
        # a late second signal (SLURM may repeat it, a user presses Ctrl-C again) must
        # not kill a rank that has checkpointed and is about to exit
        guard.ignore_from_now_on()
        interrupt.ignore_from_now_on()
    if result.stopped == StopReason.STOP_REQUESTED:
        # Ctrl-C on any rank wins over a preemption: the user asked to stop, not requeue
        # (unless --preempt-signals names INT: then it is a preemption signal)
        interrupted = comm.any(bool(interrupt.received))
        return _report_stop(cfg, comm.rank, result.steps, guard.local_reason(), interrupted)
    return 0 if result.ranks_agree else 1


def _report_stop(cfg: TrainConfig, rank: int, step: int, reason: str | None,
                 interrupted: bool) -> int:
    """Rank 0 says why the run stopped and what was saved; returns the exit status."""
    status = INTERRUPT_EXIT_CODE if interrupted else REQUEUE_EXIT_CODE
    why = "interrupted (signal SIGINT)" if interrupted else (
        f"stopped ({reason or 'another rank was signalled'})")
    if not cfg.checkpoint_dir:
        if rank == 0:
            print(f"kfac-hpc train: {why} at step {step} without --checkpoint-dir: nothing "
                  "was saved", file=sys.stderr, flush=True)
        return INTERRUPT_EXIT_CODE if interrupted else 1
    if rank == 0:
        saved = cfg.checkpoint_dir
        try:
            name = (Path(cfg.checkpoint_dir) / "latest").read_text().strip()
            if name:
                saved = str(Path(cfg.checkpoint_dir) / name)
        except OSError:
            pass
        then = ("exit status 75 asks for a requeue" if status == REQUEUE_EXIT_CODE
                else f"exit status {status}; run the same command again to resume")
        print(f"kfac-hpc train: {why} at step {step}; checkpoint saved: {saved}; {then}",
              file=sys.stderr if interrupted else sys.stdout, flush=True)
    return status


def select_device_before_mpi(device: str) -> None:
    """Make this rank's GPU current before anything imports mpi4py.

    See :func:`kfac_hpc.runtime.select_device`; ``--device cuda`` without a GPU is left
    to ``validate()``, which reports it with the other problems.

    Args:
        device: ``--device`` (``cpu``, ``cuda`` or ``auto``).
    """
    from kfac_hpc.runtime.device import select_device

    select_device("cpu" if device == "cpu" else "auto")


def _usage_error(message: str, rank: int) -> int:
    if rank == 0:
        sys.stderr.write(f"kfac-hpc train: error: {message}\n")
        sys.stderr.flush()
    return 2


_startup: StartupSignals | None = None


def install_startup_signals(argv: Sequence[str] | None = None) -> StartupSignals:
    """Install :class:`StartupSignals` for this process's job (from its ``argv``).

    The training loop's guard takes over in :func:`run`. Call it first thing.

    Args:
        argv: The command line's arguments (default: ``sys.argv[1:]``).

    Returns:
        The installed handlers.
    """
    global _startup
    if _startup is None:
        _startup = StartupSignals.from_argv(sys.argv[1:] if argv is None else argv).install()
    return _startup


def uninstall_startup_signals() -> None:
    """Undo :func:`install_startup_signals` (where nothing took over yet)."""
    global _startup
    if _startup is not None:
        _startup.uninstall()
        _startup = None


def _hand_over_startup_signals(taken: Iterable[signal.Signals]) -> None:
    global _startup
    if _startup is not None:
        _startup.hand_over(taken)
        _startup = None


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kfac_hpc.train [flags]``."""
    install_startup_signals(argv)
    try:
        parser = argparse.ArgumentParser(prog="python -m kfac_hpc.train")
        add_arguments(parser)
        args = parser.parse_args(argv)
        return run(args)
    finally:
        uninstall_startup_signals()
