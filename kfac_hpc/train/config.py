"""Configuration of the training driver: one dataclass, validated, from TOML/YAML and flags.

Every option of ``kfac-hpc train`` is a field of :class:`TrainConfig`; its command-line
flag is ``--`` + the field name with ``_`` -> ``-`` (booleans also take ``--no-...``).
Precedence: defaults < config file (``--config run.toml``, or ``.yaml`` when PyYAML is
installed; keys are field names, optionally grouped in tables such as ``[kfac]``) <
flags given on the command line.

:meth:`TrainConfig.validate` needs nothing but the values (no files, no MPI), so every
rank reaches the same verdict before the first collective and all ranks exit together.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kfac_hpc.kfac.options import (
    APPROXIMATIONS,
    COMPUTE_METHODS,
    DEFAULT_BUCKET_CAP_MB,
    DEFAULT_LOW_RANK_MIN_DIM,
    DTYPES,
    FACTOR_SYNCS,
    STRATEGIES,
    conflicts,
)
from kfac_hpc.solves import DEFAULT_HOST_MAX_DIM

__all__ = [
    "DATASETS",
    "KFAC_STRATEGIES",
    "OPTIMIZERS",
    "ConfigError",
    "TrainConfig",
    "field_help",
    "field_types",
    "load_config_file",
    "parse_value",
]

OPTIMIZERS = ("sgd", "adam", "adamw", "shampoo")
PRECONDITIONERS = ("kfac", "none")
KFAC_STRATEGIES = STRATEGIES  # kfac_hpc.kfac.options: the one list (and its rules)
LR_SCHEDULES = ("cosine", "step", "constant")
DATASETS = ("digits", "cifar10", "imagefolder", "synthetic", "stdlib-text")
PATH_DATASETS = ("cifar10", "imagefolder")
DEVICES = ("auto", "cpu", "cuda")
AMP_DTYPES = ("float16", "bfloat16")
PHASE_TIMES = ("auto", "on", "off")
#: ``read_every_steps`` on a GPU when unset: the host queues up to this many steps
#: ahead of the device between reads of their losses (docs/training.md, Output).
GPU_READ_EVERY_STEPS = 50
#: --checkpoint-keep-best: the metrics of an epoch's record it may monitor, and whether
#: a larger value (+1) or a smaller one (-1) is better.
KEEP_BEST_METRICS = {"test_acc": 1, "test_loss": -1, "train_loss": -1}


# preconditioner keyword -> TrainConfig field, where they differ
_KFAC_FIELDS = {"strategy": "kfac_strategy", "overlap": "kfac_overlap",
                "symmetric_packing": "kfac_symmetric_packing", "factor_sync": "kfac_factor_sync",
                "compute_method": "kfac_compute_method", "stats_precision": "kfac_stats_precision",
                "precondition_precision": "kfac_precondition_precision",
                "factor_dtype": "kfac_factor_dtype", "inv_dtype": "kfac_inv_dtype",
                "eigen_refresh": "kfac_eigen_refresh",
                "decomposition_lag": "kfac_decomposition_lag"}


def _kfac_flag(option: str, value: str) -> str:
    """Spell a preconditioner setting as the command line does (``--kfac-strategy dp-kfac``)."""
    return f"--{_KFAC_FIELDS.get(option, option).replace('_', '-')} {value}"


class ConfigError(ValueError):
    """Invalid or inconsistent options: the user's input, reported without a traceback."""


_PLUGIN_FORM = ("a plugin is named pkg.module:factory (an importable module, a colon, "
                "a callable's name), e.g. examples.custom_model:build_model")


def is_plugin(name: str) -> bool:
    """``--model``/``--dataset`` names a user factory (``pkg.module:factory``)."""
    return ":" in name


def plugin_syntax_ok(name: str) -> bool:
    """``pkg.module:attr[.attr]`` with identifiers only (nothing is imported)."""
    module, _, attr = name.partition(":")
    return (all(part.isidentifier() for part in module.split("."))
            and all(part.isidentifier() for part in attr.split(".")))


def _opt(default: Any, help: str, group: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, "group": group}, **kw)


@dataclass
class TrainConfig:
    """Every option of the training driver (defaults: the one-minute digits demo)."""

    # -- data
    dataset: str = _opt("digits", f"data set: {' | '.join(DATASETS)} | pkg.module:factory "
                        "(your own; see docs/training.md)", "data")
    data_path: str | None = _opt(None, "directory of cifar10 (binary) or imagefolder", "data")
    augment: bool = _opt(False, "random crop + flip of the training images", "data")
    split_seed: int = _opt(0, "seed of the digits train/test split", "data")
    image_size: int | None = _opt(None, "imagefolder image size (default 224)", "data")
    synthetic_shape: tuple[int, ...] = _opt(
        (3, 32, 32), "synthetic input shape: C,H,W or FEATURES", "data")
    synthetic_classes: int = _opt(10, "synthetic number of classes", "data")
    synthetic_train_size: int = _opt(2048, "synthetic training samples", "data")
    synthetic_test_size: int = _opt(512, "synthetic test samples", "data")
    loader_threads: int = _opt(4, "image decoding threads per rank (imagefolder)", "data")
    loader_workers: int = _opt(0, "DataLoader worker processes per rank (0: load in the "
                               "training process; the sbatch jobs use SLURM_CPUS_PER_TASK-1)",
                               "data")
    prefetch_factor: int = _opt(2, "batches each loader worker prepares ahead", "data")
    # -- model
    model: str = _opt("mlp", "model: mlp | resnet20 | resnet32 | resnet56 | resnet50 | gpt | "
                      "pkg.module:factory (your own; see docs/training.md)", "model")
    model_options: dict[str, Any] = field(default_factory=dict, metadata={
        "help": "model options as KEY=VALUE (JSON values), e.g. hidden=[256,128]",
        "group": "model"})
    loss: str = _opt("cross_entropy", "loss: cross_entropy | pkg.module:fn (fn(output, "
                     "target) -> mean loss; see docs/training.md)", "model")
    # -- run length and batches
    epochs: int = _opt(20, "training epochs", "run")
    max_steps: int | None = _opt(None, "stop after this many optimizer steps (the learning-"
                                 "rate schedule ends there too)", "run")
    batch_size: int = _opt(32, "samples per rank per optimizer step", "run")
    eval_batch_size: int = _opt(512, "samples per rank per evaluation batch", "run")
    accumulation_steps: int = _opt(
        1, "micro-batches per step (each batch is split into this many)", "run")
    target_accuracy: float | None = _opt(
        None, "stop after the first evaluation with test accuracy >= this (0-1)", "run")
    seed: int = _opt(0, "seed of initialisation, data order and augmentation", "run")
    eval_every_epochs: int = _opt(1, "evaluate on the test set every N epochs", "run")
    # -- optimizer
    optimizer: str = _opt("sgd", f"base optimizer: {' | '.join(OPTIMIZERS)}", "optimizer")
    lr: float | None = _opt(None, "peak learning rate after warm-up (default: 0.1 for sgd, "
                            "0.001 for adam, adamw, shampoo)", "optimizer")
    momentum: float = _opt(0.9, "SGD momentum (Shampoo: --shampoo-options momentum=X)",
                           "optimizer")
    nesterov: bool = _opt(False, "Nesterov momentum (sgd)", "optimizer")
    weight_decay: float = _opt(5e-4, "weight decay (decoupled for adamw)", "optimizer")
    betas: tuple[float, ...] = _opt((0.9, 0.999), "Adam(W) betas B1,B2", "optimizer")
    eps: float = _opt(1e-8, "Adam(W) epsilon", "optimizer")
    shampoo_options: dict[str, Any] = field(default_factory=dict, metadata={
        "help": "extra DistributedShampoo keyword arguments as KEY=VALUE; root_method=eigen "
                "(default) | newton | 'newton(max_iterations=N,tolerance=T,check_every=K)'",
        "group": "optimizer"})
    # -- learning-rate schedule (a pure function of the step)
    lr_schedule: str = _opt("cosine", f"after warm-up: {' | '.join(LR_SCHEDULES)}", "schedule")
    warmup_epochs: float = _opt(1.0, "linear warm-up length in epochs", "schedule")
    lr_milestones: tuple[float, ...] = _opt(
        (), "step schedule: epochs at which the lr is multiplied by lr-gamma", "schedule")
    lr_gamma: float = _opt(0.1, "step schedule factor", "schedule")
    min_lr: float = _opt(0.0, "cosine schedule: final learning rate", "schedule")
    # -- preconditioner
    preconditioner: str = _opt("kfac", "kfac (on top of the optimizer) | none", "kfac")
    kfac_strategy: str = _opt("comm-opt", f"{' | '.join(KFAC_STRATEGIES)}", "kfac")
    grad_worker_fraction: float | None = _opt(
        None, "hybrid-opt: fraction of ranks that are gradient workers (0-1]", "kfac")
    kfac_compute_method: str = _opt("eigen", "eigen | inverse", "kfac")
    kfac_approx: str = _opt("expand", "expand | reduce: K-FAC for layers with positions "
                            "(convolutions, sequences)", "kfac")
    low_rank: int | None = _opt(None, "keep the N leading eigenpairs (randomized, plus one "
                                "remainder eigenvalue) of factors with >= --low-rank-min-dim "
                                "rows; none: full eigendecompositions", "kfac")
    low_rank_energy: float | None = _opt(
        None, "with --low-rank N: keep the fewest pairs holding this fraction of a factor's "
        "trace (0-1], at most N", "kfac")
    low_rank_min_dim: int = _opt(DEFAULT_LOW_RANK_MIN_DIM,
                                 "with --low-rank: smallest factor dimension made low rank",
                                 "kfac")
    low_rank_remainder: str = _opt("mean", "with --low-rank: mean (the rest of the spectrum "
                                   "keeps its mean eigenvalue) | zero (left to the damping)",
                                   "kfac")
    damping: float | None = _opt(None, "K-FAC damping (default: 0.1 for mlp, 0.003 for the "
                                 "resnets)", "kfac")
    factor_decay: float = _opt(0.95, "running-average decay of the factors", "kfac")
    kl_clip: float | None = _opt(0.001, "KL clipping (none disables it)", "kfac")
    factor_update_steps: int | None = _opt(
        None, "update factors every N steps (default: 10 for resnet50, as KAISA's ImageNet "
        "examples; 1 otherwise)", "kfac")
    inv_update_steps: int | None = _opt(
        None, "recompute eigenbases/inverses every N steps (default: 100 for resnet50, as "
        "KAISA's ImageNet examples; 10 otherwise)", "kfac")
    skip_layers: tuple[str, ...] = _opt((), "layer names/types K-FAC leaves alone", "kfac")
    kfac_factor_sync: str = _opt(
        "step", "step (reduce factors every factor update) | inverse (at inverse updates "
        "only; same math)", "kfac")
    kfac_overlap: bool = _opt(False, "start factor reductions from the backward hooks "
                              "(SPD-KFAC)", "kfac")
    kfac_symmetric_packing: bool = _opt(False, "send factors as upper triangles", "kfac")
    kfac_bucket_cap_mb: float = _opt(DEFAULT_BUCKET_CAP_MB,
                                     "fusion bucket size of factor messages (MB)", "kfac")
    kfac_factor_dtype: str = _opt("auto", "auto (the weights' dtype, at least float32) | "
                                  "float32 | float64", "kfac")
    kfac_inv_dtype: str = _opt("float32", "float32 | float64", "kfac")
    kfac_decomposition_lag: int = _opt(
        0, "steps an inverse update may take in the background (a worker thread, a side "
        "CUDA stream) before its decompositions replace the old ones; 0: in the step",
        "kfac")
    kfac_eigen_refresh: str = _opt(
        "eigh", "eigh | subspace: renew eigenbases by a full eigendecomposition, or by one "
        "subspace-iteration step (two GEMMs and a QR) from the previous basis", "kfac")
    kfac_cuda_graphs: bool | None = _opt(
        None, "on CUDA, capture K-FAC's preconditioning, KL clip and gradient writes as a "
        "CUDA graph between inverse updates and replay it (the same results, fewer "
        "launches; default: the library's, on the device types of "
        "kfac_hpc.step_graph.DEFAULT_DEVICES: CUDA)", "kfac")
    kfac_stats_precision: str = _opt(
        "auto", "auto | full | tf32 | bf16: operands of the factor statistics' GEMMs (auto: "
        "tf32 for float32 factors on CUDA, full elsewhere)", "kfac")
    kfac_precondition_precision: str = _opt(
        "auto", "auto | full | tf32 | bf16: operands of the preconditioning GEMMs (auto: "
        "tf32 for float32 decompositions on CUDA, full elsewhere)", "kfac")
    # -- distribution and device
    ddp: bool = _opt(False, "average gradients with torch DDP (gloo/nccl) instead of MPI",
                     "distributed")
    grad_bucket_mb: float = _opt(25.0, "bucket size of the MPI gradient averager (MB)",
                                 "distributed")
    device: str = _opt("auto", "auto (cuda:<local rank> if available) | cpu | cuda",
                       "distributed")
    amp: bool = _opt(False, "mixed precision (CUDA only)", "distributed")
    amp_dtype: str = _opt("float16", "float16 (with a GradScaler) | bfloat16", "distributed")
    threads: int | None = _opt(None, "torch CPU threads per rank (default: cores / local ranks)",
                               "distributed")
    deterministic: bool = _opt(
        False, "cuDNN's deterministic convolution algorithms for the run "
        "(torch.backends.cudnn.deterministic; a slower backward): on a GPU, two runs of a "
        "convolutional model's configuration, and a run resumed from a checkpoint, give the "
        "same bits (cuDNN's defaults may accumulate weight gradients with atomics); other "
        "kernels, e.g. attention's backward, are not affected", "distributed")
    host_decomposition_max_dim: int = _opt(
        DEFAULT_HOST_MAX_DIM, "eigendecompositions (K-FAC's inverse updates, Shampoo's roots) "
        "of matrices up to this size on a CUDA device run on the host CPU while the device "
        "solves the larger ones; 0: all on the device", "distributed")
    decomposition_streams: int | None = _opt(
        None, "on CUDA, spread the device's decompositions (K-FAC's inverse updates, "
        "Shampoo's roots) of more than 32 rows over N streams and worker threads (the same "
        "results; default 8, or the cores this rank may run on when fewer)",
        "distributed")
    # -- output
    out: str | None = _opt(None, "output directory (default runs/<timestamp>)", "output")
    progress: bool = _opt(True, "progress bar on rank 0 on a terminal, progress lines "
                          "otherwise (--progress-every-*)", "output")
    log_every_steps: int = _opt(1, "write a step record every N steps", "output")
    read_every_steps: int | None = _opt(
        None, "read the steps' losses from the device every N steps (a GPU sync each; the "
        "records of the steps in between are written then); default --log-every-steps on "
        f"a CPU device, at least {GPU_READ_EVERY_STEPS} on a GPU", "output")
    phase_times: str = _opt(
        "auto", "per-phase times in the step records: on | off | auto (on for a CPU "
        "device; off on a GPU, where timing synchronises the device around every phase)",
        "output")
    tensorboard: str | None = _opt(None, "also write TensorBoard event files to this "
                                   "directory (rank 0; needs the tensorboard package)", "output")
    progress_every_steps: int = _opt(
        100, "when stdout is not a terminal: a progress line every N steps", "output")
    progress_every_minutes: float = _opt(
        5.0, "... and at least every M minutes (0: only every N steps)", "output")
    # -- checkpoints
    checkpoint_dir: str | None = _opt(None, "directory of HDF5 checkpoints", "checkpoint")
    checkpoint_every_steps: int | None = _opt(None, "checkpoint every N steps", "checkpoint")
    checkpoint_every_minutes: float | None = _opt(None, "checkpoint every M minutes",
                                                  "checkpoint")
    checkpoint_keep: int = _opt(3, "keep the last N checkpoints", "checkpoint")
    checkpoint_keep_every_epochs: int | None = _opt(
        None, "also keep one checkpoint per N epochs (the first at or after the end of "
        "every N-th epoch): milestones that the rotation of --checkpoint-keep never "
        "deletes", "checkpoint")
    checkpoint_keep_best: str | None = _opt(
        None, "also keep the checkpoint of the best epoch by this metric: test_acc "
        "(highest), test_loss or train_loss (lowest); written at the end of every epoch "
        "that improves it, never deleted by the rotation of --checkpoint-keep",
        "checkpoint")
    checkpoint_background: bool = _opt(
        True, "write periodic checkpoints in the background (training stalls only for a "
        "snapshot to host memory; KFAC_HPC_CHECKPOINT_BACKGROUND=0 also turns it off)",
        "checkpoint")
    resume: str = _opt("auto", "auto (latest in --checkpoint-dir) | never | PATH", "checkpoint")
    preempt_signals: tuple[str, ...] = _opt(
        ("USR1", "TERM"), "signals that checkpoint and exit with the requeue status 75 "
        "(none: no preemption handling; the signals keep their default action)",
        "checkpoint")
    time_limit_margin_minutes: float | None = _opt(
        None, "checkpoint and exit 75 when SLURM's remaining wall time "
        "(SLURM_JOB_END_TIME) is below this", "checkpoint")
    hang_timeout_minutes: float | None = _opt(
        30.0, "end the job (exit 4, every rank) when a rank makes no progress for this "
        "long: a hung collective (none: wait forever)", "checkpoint")

    # ------------------------------------------------------------------ building
    @classmethod
    def from_sources(cls, file: str | os.PathLike[str] | None = None,
                     overrides: Mapping[str, Any] | None = None) -> TrainConfig:
        """Defaults, then ``file``'s values, then ``overrides`` (field name -> value).

        Values are coerced to the field types (lists -> tuples, "none" -> None where
        allowed); unknown keys and ill-typed values raise :class:`ConfigError`.
        """
        values: dict[str, Any] = {}
        if file is not None:
            values.update(load_config_file(file))
        values.update(overrides or {})
        return cls.from_dict(values)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], *, source: str = "config") -> TrainConfig:
        """Build from ``{field: value}``; :class:`ConfigError` on unknown keys or bad types."""
        hints = field_types()
        errors: list[str] = []
        kwargs: dict[str, Any] = {}
        for key, value in values.items():
            name = key.replace("-", "_")
            if name not in hints:
                errors.append(f"unknown option {key!r} in {source}"
                              + _suggest(name, list(hints)))
                continue
            try:
                kwargs[name] = coerce(hints[name], value)
            except (TypeError, ValueError) as exc:
                errors.append(f"{_flag(name)}: {exc}")
        if errors:
            raise ConfigError("\n".join(errors))
        return cls(**kwargs)

    def replace(self, **changes: Any) -> TrainConfig:
        """Return a copy with some fields changed (coerced like :meth:`from_dict`)."""
        hints = field_types()
        return dataclasses.replace(self, **{k: coerce(hints[k], v) for k, v in changes.items()})

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready values (tuples become lists)."""
        data: dict[str, Any] = json.loads(json.dumps(dataclasses.asdict(self)))
        return data

    # ---------------------------------------------------------------- validation
    def problems(self) -> list[str]:
        """Every invalid or inconsistent option, as user-facing sentences (empty if fine)."""
        from kfac_hpc.models import model_names

        p: list[str] = []

        def need(ok: bool, name: str, msg: str) -> None:
            if not ok:
                p.append(f"{_flag(name)}: {msg}")

        def choice(name: str, valid: tuple[str, ...] | list[str]) -> None:
            value = getattr(self, name)
            need(value in valid, name, f"unknown value {value!r}; valid: {', '.join(valid)}"
                 + _suggest(value, list(valid)))

        # data
        if is_plugin(self.dataset):
            need(plugin_syntax_ok(self.dataset), "dataset", _PLUGIN_FORM)
        else:
            choice("dataset", DATASETS)
        if is_plugin(self.dataset):
            pass  # a plugin data set gets --data-path (or None) as its path argument
        elif self.dataset in PATH_DATASETS:
            need(self.data_path is not None, "data_path",
                 f"the {self.dataset!r} data set needs --data-path DIR")
        elif self.data_path is not None:
            need(False, "data_path", f"is only used by {' and '.join(PATH_DATASETS)}; the "
                 f"{self.dataset!r} data set takes no path (remove --data-path)")
        need(not (self.augment and self.dataset == "stdlib-text"), "augment",
             "the 'stdlib-text' data set has no augmentation; leave --augment off")
        need(self.image_size is None or self.image_size >= 1, "image_size", "must be >= 1")
        need(len(self.synthetic_shape) in (1, 3) and all(d >= 1 for d in self.synthetic_shape),
             "synthetic_shape", f"must be C,H,W or FEATURES with positive sizes, got "
             f"{self.synthetic_shape}")
        need(self.synthetic_classes >= 2, "synthetic_classes", "must be >= 2")
        need(self.synthetic_train_size >= 1 and self.synthetic_test_size >= 1,
             "synthetic_train_size", "synthetic train/test sizes must be >= 1")
        need(self.loader_threads >= 1, "loader_threads", "must be >= 1")
        need(self.loader_workers >= 0, "loader_workers", "must be >= 0")
        need(self.prefetch_factor >= 1, "prefetch_factor", "must be >= 1")
        # model
        if is_plugin(self.model):
            need(plugin_syntax_ok(self.model), "model", _PLUGIN_FORM)
        else:
            choice("model", model_names())
        if self.loss != "cross_entropy":
            need(is_plugin(self.loss) and plugin_syntax_ok(self.loss), "loss",
                 f"cross_entropy or {_PLUGIN_FORM}")
        # run
        need(self.epochs >= 1, "epochs", f"must be >= 1, got {self.epochs}")
        need(self.max_steps is None or self.max_steps >= 1, "max_steps", "must be >= 1")
        need(self.batch_size >= 1, "batch_size", f"must be >= 1, got {self.batch_size}")
        need(self.eval_batch_size >= 1, "eval_batch_size", "must be >= 1")
        need(self.accumulation_steps >= 1, "accumulation_steps", "must be >= 1")
        if self.batch_size >= 1 and self.accumulation_steps >= 1:
            need(self.batch_size % self.accumulation_steps == 0, "accumulation_steps",
                 f"must divide --batch-size {self.batch_size} (each per-rank batch is split "
                 "into this many micro-batches)")
        need(self.target_accuracy is None or 0.0 < self.target_accuracy <= 1.0,
             "target_accuracy", "must be a fraction in (0, 1], e.g. 0.95")
        need(self.eval_every_epochs >= 1, "eval_every_epochs", "must be >= 1")
        # optimizer
        choice("optimizer", OPTIMIZERS)
        need(self.lr is None or self.lr > 0, "lr", f"must be > 0, got {self.lr}")
        need(0.0 <= self.momentum < 1.0, "momentum", "must be in [0, 1)")
        if self.nesterov:
            need(self.optimizer == "sgd", "nesterov", "only applies to --optimizer sgd")
            need(self.momentum > 0, "nesterov", "needs --momentum > 0")
        need(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        need(len(self.betas) == 2 and all(0.0 <= b < 1.0 for b in self.betas), "betas",
             f"must be two values in [0, 1), got {self.betas}")
        need(self.eps > 0, "eps", "must be > 0")
        if self.shampoo_options:
            need(self.optimizer == "shampoo", "shampoo_options",
                 "only applies to --optimizer shampoo")
            if "root_method" in self.shampoo_options:
                from kfac_hpc.shampoo.root_methods import root_method_from

                try:
                    root_method_from(self.shampoo_options["root_method"])
                except ValueError as exc:
                    need(False, "shampoo_options", str(exc))
        # schedule
        choice("lr_schedule", LR_SCHEDULES)
        need(self.warmup_epochs >= 0, "warmup_epochs", "must be >= 0")
        need(0 <= self.min_lr <= self.base_lr, "min_lr", "must be in [0, --lr]")
        need(0 < self.lr_gamma <= 1, "lr_gamma", "must be in (0, 1]")
        need(all(m > 0 for m in self.lr_milestones), "lr_milestones", "must be > 0 (epochs)")
        if self.lr_schedule == "step":
            need(bool(self.lr_milestones), "lr_milestones",
                 "--lr-schedule step needs --lr-milestones E1,E2,...")
        elif self.lr_milestones:
            need(False, "lr_milestones", "only apply to --lr-schedule step")
        # preconditioner
        choice("preconditioner", PRECONDITIONERS)
        if self.preconditioner == "kfac":
            need(self.optimizer != "shampoo", "preconditioner",
                 "K-FAC on top of Shampoo is not supported (both precondition the "
                 "gradient); use --preconditioner none with --optimizer shampoo")
            choice("kfac_strategy", KFAC_STRATEGIES)
            choice("kfac_compute_method", COMPUTE_METHODS)
            choice("kfac_approx", APPROXIMATIONS)
            if self.grad_worker_fraction is not None:
                need(0 < self.grad_worker_fraction <= 1, "grad_worker_fraction",
                     "must be in (0, 1]")
            need(self.damping is None or self.damping > 0, "damping", "must be > 0")
            need(0 <= self.factor_decay < 1, "factor_decay", "must be in [0, 1)")
            need(self.kl_clip is None or self.kl_clip > 0, "kl_clip",
                 "must be > 0 (or none to disable)")
            need(self.factor_update_steps is None or self.factor_update_steps >= 1,
                 "factor_update_steps", "must be >= 1")
            need(self.inv_update_steps is None or self.inv_update_steps >= 1,
                 "inv_update_steps", "must be >= 1")
            choice("kfac_factor_sync", FACTOR_SYNCS)
            choice("kfac_factor_dtype", ("auto", *DTYPES))
            choice("kfac_inv_dtype", DTYPES)
            need(self.kfac_bucket_cap_mb > 0, "kfac_bucket_cap_mb", "must be > 0")
            for conflict in conflicts(  # the preconditioner's own rules
                    strategy=self.kfac_strategy, grad_worker_fraction=self.grad_worker_fraction,
                    overlap=self.kfac_overlap, symmetric_packing=self.kfac_symmetric_packing,
                    factor_sync=self.kfac_factor_sync, compute_method=self.kfac_compute_method,
                    low_rank=self.low_rank, low_rank_energy=self.low_rank_energy,
                    low_rank_min_dim=self.low_rank_min_dim,
                    low_rank_remainder=self.low_rank_remainder,
                    stats_precision=self.kfac_stats_precision,
                    precondition_precision=self.kfac_precondition_precision,
                    factor_dtype=None if self.kfac_factor_dtype == "auto"
                    else self.kfac_factor_dtype, inv_dtype=self.kfac_inv_dtype,
                    eigen_refresh=self.kfac_eigen_refresh,
                    decomposition_lag=self.kfac_decomposition_lag):
                need(False, _KFAC_FIELDS.get(conflict.option, conflict.option),
                     conflict.text(_kfac_flag))
        # distributed / device
        choice("device", DEVICES)
        choice("amp_dtype", AMP_DTYPES)
        choice("phase_times", PHASE_TIMES)
        need(self.threads is None or self.threads >= 1, "threads", "must be >= 1")
        need(self.decomposition_streams is None or self.decomposition_streams >= 1,
             "decomposition_streams", "must be >= 1")
        need(self.host_decomposition_max_dim >= 0, "host_decomposition_max_dim",
             "must be >= 0 (0: every decomposition on the device)")
        need(self.grad_bucket_mb > 0, "grad_bucket_mb", "must be > 0")
        # output
        need(self.log_every_steps >= 1, "log_every_steps", "must be >= 1")
        need(self.read_every_steps is None or self.read_every_steps >= 1, "read_every_steps",
             "must be >= 1 (or unset: --log-every-steps on a CPU device, at least "
             f"{GPU_READ_EVERY_STEPS} on a GPU)")
        need(self.progress_every_steps >= 1, "progress_every_steps", "must be >= 1")
        need(self.progress_every_minutes >= 0, "progress_every_minutes", "must be >= 0")
        # checkpoints
        for name in ("checkpoint_every_steps", "checkpoint_every_minutes"):
            value = getattr(self, name)
            if value is not None:
                need(value > 0, name, "must be > 0")
                need(self.checkpoint_dir is not None, name, "needs --checkpoint-dir")
        need(self.checkpoint_keep >= 1, "checkpoint_keep", "must be >= 1")
        if self.checkpoint_keep_every_epochs is not None:
            need(self.checkpoint_keep_every_epochs >= 1, "checkpoint_keep_every_epochs",
                 "must be >= 1")
        if self.checkpoint_keep_best not in (None, *KEEP_BEST_METRICS):
            choice("checkpoint_keep_best", list(KEEP_BEST_METRICS))
        elif self.checkpoint_keep_best is not None:
            need(self.checkpoint_dir is not None, "checkpoint_keep_best",
                 "needs --checkpoint-dir")
        need(bool(self.resume), "resume", "must be auto, never or a checkpoint path")
        for sig in self.preempt_signals:
            try:
                from kfac_hpc.signals import parse_signal

                parse_signal(sig)
            except ValueError as exc:
                need(False, "preempt_signals", str(exc))
        need(self.time_limit_margin_minutes is None or self.time_limit_margin_minutes > 0,
             "time_limit_margin_minutes", "must be > 0")
        need(self.hang_timeout_minutes is None or self.hang_timeout_minutes > 0,
             "hang_timeout_minutes", "must be > 0 (none: no watchdog)")
        return p

    def validate(self, *, cuda_available: bool | None = None) -> None:
        """Raise :class:`ConfigError` listing every problem; pure (no files, no MPI).

        ``cuda_available`` (default: ask torch) decides ``--amp``/``--device cuda``.
        """
        problems = self.problems()
        if cuda_available is None:
            import torch

            cuda_available = torch.cuda.is_available()
        if self.device == "cuda" and not cuda_available:
            problems.append("--device cuda: no CUDA device is available on this node")
        if self.amp and (self.device == "cpu" or not cuda_available):
            problems.append("--amp: mixed precision needs a CUDA device (none available here, "
                            "or --device cpu); run without --amp")
        if self.uses_kfac and self.kfac_cuda_graphs and (self.device == "cpu"
                                                          or not cuda_available):
            problems.append("--kfac-cuda-graphs: CUDA graphs need a CUDA device (none "
                            "available here, or --device cpu); run without it")
        if problems:
            raise ConfigError("invalid configuration:\n" + "\n".join(f"  {m}" for m in problems))

    # ------------------------------------------------------------------ helpers
    @property
    def uses_kfac(self) -> bool:
        """Whether the run preconditions with K-FAC (``--preconditioner kfac``)."""
        return self.preconditioner == "kfac"

    @property
    def base_lr(self) -> float:
        """``lr``, or the optimizer's default when unset."""
        if self.lr is not None:
            return self.lr
        return 0.1 if self.optimizer == "sgd" else 1e-3

    @property
    def base_damping(self) -> float:
        """``damping``, or the model's default when unset.

        The MLP needs more damping: its standardised inputs make the A factor nearly
        singular.
        """
        if self.damping is not None:
            return self.damping
        return 0.1 if self.model == "mlp" else 0.003

    @property
    def base_update_steps(self) -> tuple[int, int]:
        """``(factor_update_steps, inv_update_steps)``, each the model's default when unset.

        ResNet-50 takes (10, 100), the schedule of KAISA's ImageNet examples: on one H200
        its inverse update (108 eigendecompositions, up to 4608 rows) cost 0.9 s, so
        (1, 10) ran at 6.5x SGD's iteration time and (10, 100) at 1.9x
        (benchmarks/RESULTS.md, GPU). Every other model takes (1, 10), the schedule of
        KAISA's CIFAR-10 examples, which the small runs here train with.
        """
        factor, inverse = (10, 100) if self.model == "resnet50" else (1, 10)
        return (factor if self.factor_update_steps is None else self.factor_update_steps,
                inverse if self.inv_update_steps is None else self.inv_update_steps)

    def resolved(self) -> TrainConfig:
        """Return a copy with the defaults that depend on other options filled in."""
        factor, inverse = self.base_update_steps
        return dataclasses.replace(self, lr=self.base_lr, damping=self.base_damping,
                                   factor_update_steps=factor, inv_update_steps=inverse)

    def describe_optimizer(self) -> str:
        """Short label such as ``kfac(comm-opt)+sgd`` (used in tables and plot legends)."""
        base = self.optimizer + ("-nesterov" if self.nesterov else "")
        return f"kfac({self.kfac_strategy})+{base}" if self.uses_kfac else base


# --------------------------------------------------------------------- internals


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _suggest(word: str, options: list[str]) -> str:
    import difflib

    close = difflib.get_close_matches(str(word), options, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


_HINTS: dict[str, Any] | None = None


def field_types() -> dict[str, Any]:
    """Field name -> resolved type annotation of :class:`TrainConfig`."""
    global _HINTS
    if _HINTS is None:
        _HINTS = typing.get_type_hints(TrainConfig)
    return _HINTS


def field_help() -> list[tuple[str, str, str, Any]]:
    """``(name, group, help, default)`` of every field, in declaration order."""
    out = []
    for f in dataclasses.fields(TrainConfig):
        default = f.default
        if default is dataclasses.MISSING and f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        out.append((f.name, f.metadata["group"], f.metadata["help"], default))
    return out


def _optional_inner(tp: Any) -> tuple[Any, bool]:
    """``X | None`` -> (X, True); anything else -> (tp, False)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def is_flag(tp: Any) -> bool:
    """Whether an option of type ``tp`` is an on/off flag.

    ``bool``, or ``bool | None`` where None leaves the choice to the option's own rule.
    """
    return tp is bool or _optional_inner(tp) == (bool, True)


_NONE_WORDS = ("none", "null", "off")


def coerce(tp: Any, value: Any) -> Any:
    """Convert ``value`` (from TOML/YAML/JSON or a command-line string) to type ``tp``."""
    inner, optional = _optional_inner(tp)
    # an optional flag reads "off" as False, never as None (the option's own rule)
    none_words = ("none", "null") if inner is bool else _NONE_WORDS
    if value is None or (optional and isinstance(value, str) and value.lower() in none_words):
        if optional:
            return None
        raise ValueError("a value is required (none is not allowed)")
    origin = typing.get_origin(inner)
    if inner is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "on", "1"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "no", "off", "0"):
            return False
        raise ValueError(f"expected true/false, got {value!r}")
    if inner is int:
        if isinstance(value, bool):
            raise ValueError(f"expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise ValueError(f"expected an integer, got {value!r}")
    if inner is float:
        if isinstance(value, bool):
            raise ValueError(f"expected a number, got {value!r}")
        try:
            out = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"expected a number, got {value!r}") from None
        if not math.isfinite(out):
            raise ValueError(f"expected a finite number, got {value!r}")
        return out
    if inner is str:
        if isinstance(value, os.PathLike):
            return os.fspath(value)
        if not isinstance(value, str):
            raise ValueError(f"expected a string, got {value!r}")
        return value
    if origin is tuple:
        item = typing.get_args(inner)[0]
        if isinstance(value, str):
            value = [v for v in (s.strip() for s in value.split(",")) if v]
            if [v.lower() for v in value] == ["none"]:  # none: the empty list
                value = []
        if not isinstance(value, list | tuple):
            raise ValueError(f"expected a list, got {value!r}")
        return tuple(coerce(item, v) for v in value)
    if origin is dict:
        if isinstance(value, str):
            value = parse_key_values([value])
        if isinstance(value, list | tuple):  # ["k=v", ...] from repeated flags
            value = parse_key_values([str(v) for v in value])
        if not isinstance(value, Mapping):
            raise ValueError(f"expected KEY=VALUE pairs or a table, got {value!r}")
        return {str(k).replace("-", "_"): v for k, v in value.items()}
    raise TypeError(f"unsupported option type {tp!r}")


def parse_value(text: str) -> Any:
    """JSON if it parses (numbers, lists, true/false/null), else the string itself."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_key_values(items: list[str]) -> dict[str, Any]:
    """``["a=1", "b=[2,3]"]`` -> ``{"a": 1, "b": [2, 3]}``; ``ValueError`` without ``=``."""
    out: dict[str, Any] = {}
    for item in items:
        for part in _split_top_level(item):
            if "=" not in part:
                raise ValueError(f"expected KEY=VALUE, got {part!r}")
            key, _, text = part.partition("=")
            out[key.strip().replace("-", "_")] = parse_value(text.strip())
    return out


def _split_top_level(text: str) -> list[str]:
    """Split ``a=1,b=[2,3]`` at commas outside brackets."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch in "[{("
        depth -= ch in "]})"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [p for p in (s.strip() for s in parts) if p]


def load_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a TOML (``.toml``) or YAML (``.yaml``/``.yml``, needs PyYAML) config file.

    Tables/mappings one level deep are flattened (``[kfac] damping = 0.01`` ->
    ``damping``), so files may group options; keys use ``_`` or ``-``. Errors
    (missing file, syntax, non-table top level) raise :class:`ConfigError`.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config: no such file: {p}")
    suffix = p.suffix.lower()
    loader: Callable[[bytes], Any]
    if suffix == ".toml":
        import tomllib

        def loader(b: bytes) -> Any:
            return tomllib.loads(b.decode("utf-8"))
    elif suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ConfigError(f"--config {p}: YAML needs PyYAML (pip install pyyaml); "
                              "or write the file as TOML") from None

        def loader(b: bytes) -> Any:
            return yaml.safe_load(b)
    else:
        raise ConfigError(f"--config {p}: unknown format {suffix!r}; use .toml or .yaml")
    try:
        data = loader(p.read_bytes())
    except Exception as exc:  # syntax errors of either parser
        raise ConfigError(f"--config {p}: cannot parse: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {p}: the top level must be a table/mapping of options")
    hints = field_types()
    flat: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if isinstance(value, dict) and name not in hints:  # a group such as [kfac]
            for k, v in value.items():
                flat[str(k).replace("-", "_")] = v
        else:
            flat[name] = value
    return flat
