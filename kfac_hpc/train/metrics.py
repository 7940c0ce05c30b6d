"""Metrics of a training run: global averages over ranks, JSONL/CSV files on rank 0.

Averages are weighted by sample counts: every rank contributes ``(sum of per-sample
losses, number correct, number of samples)`` and one allreduce gives the global
means, exact even when local batches differ in size (e.g. a short last test batch).

Files written into the run directory by :class:`MetricsWriter` (rank 0 only):

* ``metrics.jsonl``: one JSON object per line, ``"kind": "step"`` or ``"epoch"``
  (the input of ``kfac-hpc plot``);
* ``steps.csv`` / ``epochs.csv``: the same records as tables (columns
  :data:`STEP_FIELDS` / :data:`EPOCH_FIELDS`);
* optionally TensorBoard event files (``tensorboard_dir``; needs the
  ``tensorboard`` package: ``pip install kfac_hpc[tensorboard]``) with the same
  scalars, the JSONL/CSV staying the archive.

Step records carry per-phase times (``time_*``, seconds, one per
:class:`~kfac_hpc.phases.Phase`) and
the bytes the training communicator sent in the step, per traffic tag
(``bytes_factors``, ``bytes_decompositions``, ``bytes_gradients``,
``bytes_agreement``: one per :class:`~kfac_hpc.phases.Traffic`) and in all
(``bytes_step``).
"""

from __future__ import annotations

import csv
import datetime as _dt
import io
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

from kfac_hpc.files import write_text_atomic
from kfac_hpc.phases import PHASES, TRAFFIC_TAGS, PhaseTimer
from kfac_hpc.units import format_bytes

__all__ = [
    "EPOCH_FIELDS",
    "PHASES",
    "STEP_FIELDS",
    "TRAFFIC_TAGS",
    "MetricsWriter",
    "PhaseTimer",
    "ProgressReporter",
    "WeightedMean",
    "drop_records_after",
    "format_bytes",
    "format_table",
    "global_sums",
    "read_jsonl",
    "recorded_means",
    "require_tensorboard",
]

STEP_FIELDS = ("step", "epoch", "lr", "loss", "acc", "samples", "step_time", "samples_per_s",
               "wall_time", *(f"time_{p}" for p in PHASES), "bytes_step",
               *(f"bytes_{t}" for t in TRAFFIC_TAGS))
EPOCH_FIELDS = ("epoch", "step", "lr", "train_loss", "train_acc", "test_loss", "test_acc",
                "epoch_time", "wall_time", "samples_per_s", "bytes_per_step")


def global_sums(comm: Any, values: Sequence[float]) -> list[float]:
    """Sum ``values`` over the ranks of ``comm`` (one float64 allreduce; same result everywhere).

    A NaN or Inf on any rank makes the sum non-finite on every rank, so a check of the
    result is agreed on without another collective.
    """
    t = torch.tensor(list(values), dtype=torch.float64, device="cpu")
    if comm is not None and comm.size > 1:
        comm.allreduce(t, "sum")
    return [float(v) for v in t]


@dataclass
class WeightedMean:
    """Loss and accuracy accumulated per sample: ``loss_sum`` = Σ per-sample losses."""

    loss_sum: float = 0.0
    correct: float = 0.0
    count: float = 0.0

    def add(self, mean_loss: float, correct: float, n: int) -> None:
        """Add a batch of ``n`` samples whose mean loss is ``mean_loss``."""
        self.loss_sum += mean_loss * n
        self.correct += correct
        self.count += n

    def reduced(self, comm: Any) -> WeightedMean:
        """Sum over the ranks of ``comm``."""
        s = global_sums(comm, [self.loss_sum, self.correct, self.count])
        return WeightedMean(*s)

    @property
    def loss(self) -> float:
        """The mean loss per sample (NaN without samples)."""
        return self.loss_sum / self.count if self.count else math.nan

    @property
    def acc(self) -> float:
        """The share of correct predictions (NaN without samples)."""
        return self.correct / self.count if self.count else math.nan


def _clean(value: Any) -> Any:
    """JSON-safe, recursively: NaN/inf -> None (strict JSON has no NaN), tensors -> numbers."""
    if isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


class MetricsWriter:
    """Writes step and epoch records on the rank with ``enabled=True`` (rank 0).

    Files are line-buffered and flushed per record, so a killed job keeps every
    record written so far. On other ranks every method is a no-op.
    """

    def __init__(self, out_dir: str | Path | None, *, enabled: bool = True,
                 append: bool = False, resumed_at: int | None = None,
                 resumed_epochs: int | None = None,
                 tensorboard_dir: str | Path | None = None) -> None:
        """Open the files lazily, at their first record.

        Args:
            out_dir: The run directory (None: write nothing).
            enabled: Write on this rank (rank 0).
            append: Append to the files of an earlier run (a resumed run).
            resumed_at: With ``append``, the step the run resumes from: the records of
                later steps (written after that checkpoint by the run that was cut
                short) are dropped first, so each step has one record.
            resumed_epochs: With ``resumed_at``, the epoch records the checkpoint holds:
                later ones are dropped too.
            tensorboard_dir: Also write TensorBoard event files there (resumed: the events
                of steps after ``resumed_at`` are purged, as the records are).
        """
        self.enabled = enabled and out_dir is not None
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self._files: dict[str, IO[str]] = {}
        self._csv: dict[str, csv.DictWriter[str]] = {}
        self._mode = "a" if append else "w"
        self._tb: Any = None
        if self.enabled and self.out_dir is not None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            if append and resumed_at is not None:
                drop_records_after(self.out_dir, resumed_at, resumed_epochs)
        if enabled and tensorboard_dir is not None:
            purge = resumed_at + 1 if append and resumed_at is not None else None
            self._tb = require_tensorboard()(log_dir=str(tensorboard_dir), purge_step=purge)

    def _scalars(self, prefix: str, record: Mapping[str, Any]) -> None:
        if self._tb is None or record.get("step") is None:
            return
        step = int(record["step"])
        for key, value in record.items():
            if (key != "step" and isinstance(value, (int, float))
                    and not isinstance(value, bool) and math.isfinite(value)):
                group = key.split("_")[0] if key.startswith(("time_", "bytes_")) else prefix
                self._tb.add_scalar(f"{group}/{key}", value, step)

    def _open(self, name: str) -> IO[str]:
        assert self.out_dir is not None
        if name not in self._files:
            self._files[name] = open(self.out_dir / name, self._mode, buffering=1,  # noqa: SIM115
                                     encoding="utf-8", newline="")
        return self._files[name]

    def _table(self, name: str, fields: Sequence[str]) -> csv.DictWriter[str]:
        if name not in self._csv:
            path = self.out_dir / name if self.out_dir else None
            fresh = (self._mode == "w" or path is None or not path.exists()
                     or not path.stat().st_size)
            writer = csv.DictWriter(self._open(name), fieldnames=list(fields),
                                    extrasaction="ignore")
            if fresh:
                writer.writeheader()
            self._csv[name] = writer
        return self._csv[name]

    def _write(self, kind: str, record: Mapping[str, Any], table: str,
               fields: Sequence[str]) -> None:
        if not self.enabled:
            return
        clean = {k: _clean(v) for k, v in record.items()}
        self._open("metrics.jsonl").write(json.dumps({"kind": kind, **clean}) + "\n")
        self._table(table, fields).writerow(clean)

    def step(self, record: Mapping[str, Any]) -> None:
        """One optimizer step's global metrics (see :data:`STEP_FIELDS`)."""
        self._write("step", record, "steps.csv", STEP_FIELDS)
        self._scalars("train", record)

    def epoch(self, record: Mapping[str, Any]) -> None:
        """One epoch's global metrics (see :data:`EPOCH_FIELDS`)."""
        self._write("epoch", record, "epochs.csv", EPOCH_FIELDS)
        self._scalars("epoch", record)
        if self._tb is not None:
            self._tb.flush()

    def write_json(self, name: str, obj: Any) -> None:
        """Write ``obj`` as strict JSON (NaN -> null) to ``out_dir/name``, atomically."""
        if self.enabled and self.out_dir is not None:
            text = json.dumps(_clean(obj), indent=2, sort_keys=False, default=str,
                              allow_nan=False)
            write_text_atomic(self.out_dir / name, text + "\n")

    def close(self) -> None:
        """Close the files and the TensorBoard writer."""
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        for f in self._files.values():
            f.close()
        self._files.clear()
        self._csv.clear()

    def __enter__(self) -> MetricsWriter:
        """Use as a context manager that closes the files.

        Returns:
            This writer.
        """
        return self

    def __exit__(self, *exc: object) -> None:
        """Close the files."""
        self.close()


def recorded_means(record: Mapping[str, Any]) -> tuple[WeightedMean, WeightedMean | None]:
    """The training and (if there was one) evaluation means of an epoch record.

    Args:
        record: An epoch record (``train_loss``, ``train_acc``, ``test_loss``,
            ``test_acc``).

    Returns:
        ``(train, evaluation)``, each as a mean over one unit of weight.
    """
    def mean(loss: Any, acc: Any) -> WeightedMean | None:
        if not isinstance(loss, (int, float)) or not math.isfinite(loss):
            return None
        return WeightedMean(float(loss), float(acc) if isinstance(acc, (int, float)) else 0.0,
                            1.0)

    train = mean(record.get("train_loss"), record.get("train_acc"))
    return (train or WeightedMean()), mean(record.get("test_loss"), record.get("test_acc"))


def drop_records_after(out_dir: Path, step: int, epochs: int | None = None) -> None:
    """Drop the step and epoch records of steps after ``step`` from a run's files.

    ``steps.csv``, ``epochs.csv`` and ``metrics.jsonl`` are each rewritten atomically
    (records without a readable step are kept; a truncated last line is dropped).
    With ``epochs``, epoch records beyond the first ``epochs`` go too: a checkpoint
    written at an epoch's last step, before that epoch's record, resumes to record it
    again.

    Args:
        out_dir: The run directory.
        step: The last step whose records stay.
        epochs: The epoch records the checkpoint resumed from holds (None: any).
    """
    def later(value: Any) -> bool:
        try:
            return int(float(value)) > step
        except (TypeError, ValueError):
            return False

    def extra_epoch(seen: list[int]) -> bool:  # counts the epoch records kept so far
        seen[0] += 1
        return epochs is not None and seen[0] > epochs

    for name in ("steps.csv", "epochs.csv"):
        path = out_dir / name
        if not path.is_file():
            continue
        with open(path, encoding="utf-8", newline="") as f:
            rows = list(csv.reader(f))
        if not rows or "step" not in rows[0]:
            continue
        at = rows[0].index("step")
        seen = [0]
        kept = [rows[0], *(r for r in rows[1:] if len(r) == len(rows[0])
                           and not later(r[at])
                           and not (name == "epochs.csv" and extra_epoch(seen)))]
        if len(kept) != len(rows):
            out = io.StringIO()
            csv.writer(out, lineterminator="\r\n").writerows(kept)
            write_text_atomic(path, out.getvalue())
    path = out_dir / "metrics.jsonl"
    if path.is_file():
        lines = path.read_text(encoding="utf-8").splitlines()
        kept_lines = []
        seen = [0]
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line cut short by the crash
            if not isinstance(record, dict) or not (
                    later(record.get("step"))
                    or (record.get("kind") == "epoch" and extra_epoch(seen))):
                kept_lines.append(line)
        if kept_lines != lines:
            write_text_atomic(path, "".join(f"{line}\n" for line in kept_lines))


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Read the records of a ``metrics.jsonl`` file (blank and truncated last lines are skipped)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut short by a killed job
    return out


def format_table(rows: Sequence[tuple[str, str]], title: str | None = None) -> str:
    """Format a two-column plain-text table (name, value) with a rule above and below."""
    width = max([len(k) for k, _ in rows] + [0])
    vwidth = max([len(v) for _, v in rows] + [0])
    rule = "-" * (width + vwidth + 3)
    lines = [rule]
    if title:
        lines += [title, rule]
    lines += [f"{k:<{width}} | {v}" for k, v in rows]
    lines.append(rule)
    return "\n".join(lines)


def require_tensorboard() -> Any:
    """``torch.utils.tensorboard.SummaryWriter``; ImportError saying how to get it."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise ImportError(
            "--tensorboard needs the tensorboard package (torch.utils.tensorboard writes "
            "its event files): pip install 'kfac_hpc[tensorboard]' (or pip install "
            f"tensorboard), or leave out --tensorboard ({exc})") from None
    return SummaryWriter


def _clock(seconds: float) -> str:
    return str(_dt.timedelta(seconds=round(max(0.0, seconds))))


class ProgressReporter:
    """Plain progress lines for batch output (``.out`` files, no terminal).

    A line every ``every_steps`` steps, and also whenever ``every_minutes`` have
    passed since the last one (0 disables the time trigger): step and share of the
    run, epoch, loss, throughput since the previous line, elapsed time and ETA
    (remaining steps at the mean step time of this run so far).
    """

    def __init__(self, *, total_steps: int, start_step: int, epochs: int,
                 every_steps: int, every_minutes: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """Start counting now.

        Args:
            total_steps: Steps of the whole run.
            start_step: The step training starts at.
            epochs: Epochs of the whole run.
            every_steps: A line every this many steps.
            every_minutes: And whenever this many minutes have passed (0: never).
            clock: Seconds, monotonic (tests pass their own).
        """
        self.total_steps, self.epochs = total_steps, epochs
        self.every_steps, self.every_s = every_steps, 60.0 * every_minutes
        self.clock = clock
        self.t0 = self.t_last = clock()
        self.start_step = self.last_step = start_step
        self.samples = 0

    def update(self, step: int, epoch: float, loss: float, samples: int) -> str | None:
        """Account one step; the line to print, or None."""
        self.samples += samples
        now = self.clock()
        due = (step % self.every_steps == 0 or step >= self.total_steps
               or (self.every_s > 0 and now - self.t_last >= self.every_s))
        if not due:
            return None
        rate = self.samples / max(now - self.t_last, 1e-9)
        done = step - self.start_step
        eta = (now - self.t0) / done * (self.total_steps - step) if done > 0 else math.nan
        self.t_last, self.last_step, self.samples = now, step, 0
        return (f"step {step}/{self.total_steps} ({100 * step / max(self.total_steps, 1):.1f}%)"
                f"  epoch {epoch:.2f}/{self.epochs}  loss {loss:.4f}  {rate:,.0f} samples/s"
                f"  elapsed {_clock(now - self.t0)}"
                f"  ETA {_clock(eta) if math.isfinite(eta) else '?'}")
