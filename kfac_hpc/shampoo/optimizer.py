"""``DistributedShampoo``: the optimizer, its block distribution and its state dict.

Where state lives: each block's state (factors, roots, grafting moment, filtered
gradient, momentum) exists only on the block's owner, stacked by kind of block
(:mod:`.stacks`). Per step the owner computes its blocks' final directions, batched
(:mod:`.block_update`), and the exchange (:mod:`.exchange`) hands every rank every
direction: one ``allgatherv`` on several ranks, nothing at all on one rank (the
directions are applied where they are). Parameters are replicated and every rank
applies ``p ← p − lr·d`` with the same values, so they stay bitwise identical across
ranks.
``state_dict()`` is collective: it gathers all blocks' state onto every rank (CPU
tensors), keyed by ``(parameter name, block index)``; ``load_state_dict()`` is
local: each rank keeps the blocks it owns under the current world size.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any, cast

import torch
from torch import Tensor
from torch.optim.optimizer import StateDict

from kfac_hpc import step_graph
from kfac_hpc.comm import Communicator, replicas, world
from kfac_hpc.phases import Phase, PhaseTimer, timed
from kfac_hpc.shampoo import blocking
from kfac_hpc.shampoo import hyperparameters as hyper
from kfac_hpc.shampoo.block_update import (
    BiasCorrections,
    BlockHyper,
    BlockState,
    RunStep,
    advance,
    bias_corrections,
    directions,
    install_roots,
    is_preconditioned,
    root_requests,
    start_runs,
    update_statistics,
)
from kfac_hpc.shampoo.blocking import BlockSpec, MergeOrder
from kfac_hpc.shampoo.errors import (
    STATUS_EXCEPTION,
    STATUS_NONFINITE_STATISTICS,
    STATUS_NONFINITE_UPDATE,
    STATUS_ROOT_FAILURES,
    ShampooNumericalError,
    describe_status,
    nonfinite_marks,
)
from kfac_hpc.shampoo.exchange import make_exchange
from kfac_hpc.shampoo.ownership import Layout
from kfac_hpc.shampoo.root_methods import (
    DEFAULT_ROOT_METHOD,
    EigenRoots,
    NewtonRoots,
    RootMethod,
    SubspaceRoots,
)
from kfac_hpc.shampoo.roots import inverse_roots
from kfac_hpc.shampoo.stacks import BlockStack, Run, runs_of
from kfac_hpc.shampoo.state import BlockShapes, ShampooStateDict
from kfac_hpc.shampoo.state_io import describe_block_states, gather_block_states
from kfac_hpc.solves import DEFAULT_HOST_MAX_DIM, SolvePlacement
from kfac_hpc.step_graph import StepGraph

__all__ = ["STATE_DICT_FORMAT", "STATE_DICT_VERSION", "DistributedShampoo"]

STATE_DICT_FORMAT = "kfac_hpc.shampoo"
STATE_DICT_VERSION = 1
_FACTOR_KEYS = ("factor_", "root_", "basis_")
_INT_KEYS = ("step", "root_failures")


class DistributedShampoo(torch.optim.Optimizer):
    """Blocked Shampoo with grafting, distributed over MPI ranks by block.

    ``step()`` expects ``.grad`` already averaged over ranks and identical on every rank;
    a parameter whose ``.grad`` is ``None`` is skipped (no state change, no update). Every
    rank must call ``step()`` and ``state_dict()`` (collectives), also ranks that own no
    block.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        epsilon: float = 1e-12,
        momentum: float = 0.0,
        nesterov: bool = False,
        weight_decay: float = 0.0,
        decoupled_weight_decay: bool = True,
        max_preconditioner_dim: int = 1024,
        merge_dims_from: MergeOrder = "last",
        precondition_frequency: int = 1,
        start_preconditioning_step: int = 1,
        grafting: str | None = "adam",
        grafting_epsilon: float = 1e-8,
        grafting_beta2: float = 0.999,
        use_bias_correction: bool = True,
        precondition_vectors: bool = True,
        statistics_frequency: int = 1,
        stats_precision: str = "full",
        precondition_precision: str = "full",
        comm: Communicator | None = None,
        factor_dtype: torch.dtype = torch.float32,
        communication_dtype: torch.dtype = torch.float32,
        max_consecutive_root_failures: int = 5,
        check_replicas: bool = True,
        host_decomposition_max_dim: int = DEFAULT_HOST_MAX_DIM,
        decomposition_streams: int | None = None,
        root_method: RootMethod = DEFAULT_ROOT_METHOD,
        cuda_graphs: bool | None = None,
    ) -> None:
        """Split the parameters into blocks and assign every block an owner rank.

        Collective: ranks agree on the parameters and settings (``check_replicas``).

        Args:
            params: ``model.named_parameters()`` (names become the state keys), an iterable
                of tensors (named ``"param_<i>"`` by their position over all groups, in
                order), or parameter groups (dicts) of either kind.
            lr: Learning rate.
            betas: ``(β1, β2)``: β1 filters the gradient (0: off), β2 is the factors'
                running-average coefficient (1: plain sum, as in AdaGrad-style Shampoo).
            epsilon: Added to the factors' eigenvalues before the root.
            momentum: Heavy-ball momentum on the final direction (0: off).
            nesterov: Nesterov momentum instead of heavy-ball.
            weight_decay: Decay coefficient (0: off).
            decoupled_weight_decay: Add the decay to the direction after preconditioning
                (AdamW-style); False adds it to the gradient (L2).
            max_preconditioner_dim: Largest block side; read when a group is added.
            merge_dims_from: Where a parameter's small dimensions start to merge
                (:mod:`~kfac_hpc.shampoo.blocking`): ``"last"`` (the default: a conv
                weight ``(out, in, kh, kw)`` becomes ``(out, in·kh·kw)`` where that fits)
                or ``"first"`` (``(32, 32, 3, 3)`` becomes ``(1024, 9)``: the rule of
                state dicts saved before this option, which need it to be loaded). Read
                when a group is added.
            precondition_frequency: Steps between root recomputations.
            start_preconditioning_step: First step (1-based) that uses Shampoo's direction;
                earlier steps use the grafting direction alone.
            grafting: ``"sgd"``, ``"adagrad"``, ``"rmsprop"``, ``"adam"`` or ``None``.
            grafting_epsilon: The grafting method's ε.
            grafting_beta2: The grafting method's second-moment β.
            use_bias_correction: Adam-style bias correction of β1, β2 and Adam grafting.
            precondition_vectors: Precondition blocks of order 1 (biases, normalisation
                scales, any parameter that merges to one dimension) with a ``d x d``
                factor. False: they take the grafting direction alone and keep no factors
                or roots (ResNet-50 at max dim 1024: 107 of its 161 parameters, 115 of
                its 250 factors, 49 % of a root step's ``sum(d**3)``). A group option
                (``load_state_dict`` restores the saved groups' value, as for the
                others, and keeps the owners of the construction); a vector's factors,
                roots and bases are dropped at its first step left to grafting, and
                start from zero when it is preconditioned again (the bias correction
                still counts all of its steps). Set by hand on a group later, the owners
                stay balanced as before (results are the same either way).
            statistics_frequency: Steps between factor updates (``s``): the factors are
                updated at steps 1, 1 + s, 1 + 2s, … and their bias correction counts
                those updates; the steps between skip the factor GEMMs (the plain step's
                largest cost) and still check their gradient for NaN/Inf. A group
                option. The running average then spans ``s / (1 − β2)`` steps: ``β2 =
                b^s`` keeps the horizon of ``b`` at every step. Keep ``s`` at most
                ``precondition_frequency``: root steps between two factor updates
                recompute the same roots (a larger value warns).
            stats_precision: Operand precision of the factor products ``X_(i) X_(i)ᵀ``:
                ``"full"`` (the default: the dtype's own, at the user's TF32 setting) or
                ``"tf32"`` (float32 operands rounded to TF32, accumulated in float32:
                tensor cores on CUDA, set for these products only; elsewhere rounded
                explicitly). A group option; float64 factors are multiplied in full.
                What it costs in accuracy and gains on a GPU: benchmarks/RESULTS.md.
            precondition_precision: The same for the preconditioning products
                ``R_1 X R_2ᵀ``.
            comm: The :class:`~kfac_hpc.comm.Communicator` (default: the world).
            factor_dtype: Dtype of factors and roots (float32 or float64).
            communication_dtype: Dtype of the gathered directions (float16, bfloat16,
                float32, float64); every rank, the owner included, applies the rounded
                values, so parameters stay identical across ranks.
            max_consecutive_root_failures: A block whose roots fail this many times in a row
                raises :class:`~kfac_hpc.shampoo.errors.ShampooNumericalError`.
            check_replicas: Check, collectively, that every rank holds the same parameters
                (names, shapes, values) and settings; one ``ValueError`` on every rank
                otherwise (different models would gather mismatched directions).
            host_decomposition_max_dim: At a root step, factors up to this size on a CUDA
                device are decomposed on the host while the device decomposes the larger
                ones (0, the default: all on the device, faster on an H200;
                ``kfac_hpc.solves``; the CPU is unaffected).
            decomposition_streams: At a root step on CUDA, the device's decompositions
                of more than 32 rows are spread over this many streams and worker threads
                (None, the default: 8, measured fastest on an H200, or the cores this
                process may run on when fewer; 1: the calling thread's stream; the same
                results; ``kfac_hpc.solves``).
            root_method: How the inverse roots are computed:
                :class:`~kfac_hpc.shampoo.root_methods.EigenRoots` (the default: batched
                ``eigh`` per size), :class:`~kfac_hpc.shampoo.root_methods.SubspaceRoots`
                (eigenbases kept, state ``basis_<i>``, and refreshed by one
                subspace-iteration step, a fresh ``eigh`` every ``fresh_every``-th
                computation) or :class:`~kfac_hpc.shampoo.root_methods.NewtonRoots` (the
                coupled Newton iteration, GEMMs only, batched per size; matrices it does
                not converge on take the eigen path). Configuration, not state: it is not
                saved in the state dict, so a run may resume with any (the others drop
                bases at a block's next root computation; ``SubspaceRoots`` computes a
                block without them fresh).
            cuda_graphs: On CUDA, the block work of the steps that compute no root
                (factors, grafting, preconditioning, directions and their flags) is
                captured as a CUDA graph and replayed while the runs of blocks, the
                hyper-parameters and the gradients present stay the same (the same
                results; :mod:`kfac_hpc.step_graph`). Root steps run eagerly. None
                (default): on the device types of ``kfac_hpc.step_graph.DEFAULT_DEVICES``
                (CUDA), unless the gradient buffers would take more than its
                ``DEFAULT_BUFFER_SHARE`` of the device's memory.

        Raises:
            ValueError: A hyper-parameter is out of range, a parameter name repeats, a
                parameter has an unsupported dtype or another device, or the ranks differ.
        """
        defaults = dict(
            lr=lr, betas=betas, epsilon=epsilon, momentum=momentum, nesterov=nesterov,
            weight_decay=weight_decay, decoupled_weight_decay=decoupled_weight_decay,
            max_preconditioner_dim=max_preconditioner_dim, merge_dims_from=merge_dims_from,
            precondition_frequency=precondition_frequency,
            start_preconditioning_step=start_preconditioning_step, grafting=grafting,
            grafting_epsilon=grafting_epsilon, grafting_beta2=grafting_beta2,
            use_bias_correction=use_bias_correction, precondition_vectors=precondition_vectors,
            statistics_frequency=statistics_frequency, stats_precision=stats_precision,
            precondition_precision=precondition_precision,
        )
        hyper.validate_group(defaults)
        if comm is not None and not isinstance(comm, Communicator):
            raise ValueError(f"DistributedShampoo: invalid comm={comm!r}; allowed: a "
                             "kfac_hpc.comm.Communicator or None (the world)")
        self.factor_dtype = hyper.validate_dtype("factor_dtype", factor_dtype, hyper.FACTOR_DTYPES)
        self.communication_dtype = hyper.validate_dtype(
            "communication_dtype", communication_dtype, hyper.COMMUNICATION_DTYPES)
        self.max_consecutive_root_failures = hyper.validate_int(
            "max_consecutive_root_failures", max_consecutive_root_failures, 1)
        self.solve_placement = SolvePlacement.of(
            hyper.validate_int("host_decomposition_max_dim", host_decomposition_max_dim, 0),
            None if decomposition_streams is None
            else hyper.validate_int("decomposition_streams", decomposition_streams, 1))
        if not isinstance(root_method, EigenRoots | SubspaceRoots | NewtonRoots):
            raise ValueError(
                f"DistributedShampoo: invalid root_method={root_method!r}; allowed: "
                "EigenRoots(), SubspaceRoots(...) or NewtonRoots(...) from kfac_hpc.shampoo "
                "(kfac_hpc.shampoo.root_method_from turns a name such as 'newton' into one)")
        self.root_method: RootMethod = root_method
        self.comm: Communicator = comm if comm is not None else world()
        if cuda_graphs is not None and not isinstance(cuda_graphs, bool):
            raise ValueError(f"DistributedShampoo: invalid cuda_graphs={cuda_graphs!r}; "
                             "allowed: True, False or None (the device's default)")
        #: the captured block work (``cuda_graphs``), made once the device is known
        self.step_graph: StepGraph | None = None
        self._graph_inputs: tuple[Hashable, Tensor, dict[int, BiasCorrections]] | None = None
        self._layout: Layout | None = None
        # per group, (max_preconditioner_dim, merge_dims_from) as the group was added:
        # its blocks, whatever is set on the group later
        self._blocking: list[tuple[int, MergeOrder]] = []
        self._generation = 0  # counts rebuilds of the blocks and installs of their state
        self._steps = 0
        #: times the phases its methods declare (kfac_hpc.phases), when given one
        self.phase_timer: PhaseTimer | None = None
        super().__init__(params, defaults)
        if check_replicas:  # different models would gather mismatched directions
            self._check_replicas()
        self._build()
        if step_graph.wanted(cuda_graphs, self._device):
            # its work updates the optimizer state: a capture must not run it first
            self.step_graph = StepGraph(  # raises off CUDA
                self._device, warm_up=False,
                max_buffer_bytes=step_graph.buffer_budget(cuda_graphs, self._device))

    # ------------------------------------------------------------ structure
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group.

        After construction this is collective (all ranks must call it): block ownership is
        recomputed and the existing state moves to its new owners.

        Args:
            param_group: A dict with ``"params"`` (named or plain tensors) and any
                hyper-parameters that differ from the defaults.

        Raises:
            ValueError: A hyper-parameter is out of range or a parameter is unsupported.
        """
        if getattr(self, "_layout", None) is None:  # during __init__
            super().add_param_group(param_group)
            hyper.validate_group(self.param_groups[-1])
            self._blocking.append(_blocking_of(self.param_groups[-1]))
            return
        saved = self._gather_states()
        super().add_param_group(param_group)
        try:
            hyper.validate_group(self.param_groups[-1])
            self._blocking.append(_blocking_of(self.param_groups[-1]))
            self._build()
        except Exception:
            self.param_groups.pop()
            del self._blocking[len(self.param_groups):]
            self._build()
            self._install_states(saved)
            raise
        self._install_states(saved)

    def _check_replicas(self) -> None:
        """Every rank holds the same parameters and settings (collective; one clear error)."""
        names = [n for group in self._param_names() for n in group]
        params = [p for group in self.param_groups for p in group["params"]]
        groups = [{k: v for k, v in g.items() if k not in ("params", "param_names")}
                  for g in self.param_groups]
        replicas.check_replicas(zip(names, params), self.comm, settings={
            "param_groups": groups, "factor_dtype": self.factor_dtype,
            "communication_dtype": self.communication_dtype, "root_method": self.root_method})

    def _param_names(self) -> list[list[str]]:
        """Names of every group's parameters ("param_<i>" for unnamed ones)."""
        names: list[list[str]] = []
        position = 0
        for group in self.param_groups:
            given = group.get("param_names")
            group_names = []
            for j, _ in enumerate(group["params"]):
                group_names.append(str(given[j]) if given is not None else f"param_{position}")
                position += 1
            names.append(group_names)
        return names

    def _build(self) -> None:
        """Blocks, owners and the gather buffers (pure function of names, shapes, world size)."""
        self._generation += 1
        blocks: list[BlockSpec] = []
        block_param: list[Tensor] = []
        self._name_of: dict[Tensor, str] = {}
        self._param_by_name: dict[str, Tensor] = {}
        self._blocks_of: dict[Tensor, list[int]] = {}
        # per parameter: its blocks as views of it, kept while its storage stays the same
        self._views_of: dict[Tensor, tuple[tuple[int, tuple[int, ...]], list[Tensor]]] = {}
        self._group_of_block: list[int] = []
        device: torch.device | None = None
        for gi, (group, names) in enumerate(zip(self.param_groups, self._param_names())):
            for p, name in zip(group["params"], names):
                if name in self._param_by_name:
                    raise ValueError(f"DistributedShampoo: parameter name {name!r} appears twice; "
                                     "names must be unique (they key the state)")
                if p.is_sparse or p.is_complex() or not p.is_floating_point():
                    raise ValueError(f"DistributedShampoo: parameter {name!r} has unsupported "
                                     f"type {p.dtype}{' (sparse)' if p.is_sparse else ''}; "
                                     "allowed: dense real floating-point tensors")
                if device is None:
                    device = p.device
                elif p.device != device:
                    raise ValueError(f"DistributedShampoo: parameter {name!r} is on {p.device} "
                                     f"but others are on {device}; use one device per rank")
                self._name_of[p] = name
                self._param_by_name[name] = p
                self._blocks_of[p] = []
                max_dim, merge_from = self._blocking[gi]
                for spec in blocking.block_param(name, tuple(p.shape), max_dim, merge_from):
                    self._blocks_of[p].append(len(blocks))
                    blocks.append(spec)
                    block_param.append(p)
                    self._group_of_block.append(gi)
        self._block_param = block_param
        self._whole = [len(self._blocks_of[p]) == 1 for p in block_param]  # block = parameter
        self._merged = [spec.merged_shape if spec.merged_shape != tuple(p.shape) else None
                        for spec, p in zip(blocks, block_param)]  # None: no reshape needed
        kinds = [(gi, spec.shape, p.dtype)
                 for gi, spec, p in zip(self._group_of_block, blocks, block_param)]
        # a vector left to grafting costs its elements, not a root (ownership balance)
        vectors = [group["precondition_vectors"] for group in self.param_groups]
        costs = [spec.cost if is_preconditioned(spec.order, vectors[gi]) else float(spec.numel)
                 for gi, spec in zip(self._group_of_block, blocks)]
        layout = self._layout = Layout.build(blocks, self.comm.size, kinds, costs)
        self._owned = layout.owned(self.comm.rank)
        self._owner_of = {b.key: r for b, r in zip(layout.blocks, layout.owners)}
        self._device = device if device is not None else torch.device("cpu")
        self._stacks = _stacks(layout, self._owned, kinds)
        self._exchange = make_exchange(layout, self.communication_dtype, self.comm, self._device)
        self.state = defaultdict(dict)

    @property
    def layout(self) -> Layout:
        """Blocks, owners and gather offsets."""
        assert self._layout is not None
        return self._layout

    def block_owners(self) -> dict[tuple[str, int], int]:
        """Return the owner rank of every block, keyed ``(parameter name, block index)``."""
        return {b.key: r for b, r in zip(self.layout.blocks, self.layout.owners)}

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Take one optimisation step (collective: every rank must call it).

        Args:
            closure: Re-evaluates the model and returns the loss (run with gradients
                enabled).

        Returns:
            The closure's loss, or None without a closure.

        Raises:
            ValueError: A parameter has a sparse gradient.
            ShampooNumericalError: On every rank, when a block's statistics, roots or update
                became unusable on any rank; nothing is applied then.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._steps += 1
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.grad.is_sparse:
                    raise ValueError(f"DistributedShampoo: parameter {self._name_of[p]!r} has a "
                                     "sparse gradient; Shampoo needs dense gradients")
        hypers = [BlockHyper.from_group(g, self.max_consecutive_root_failures)
                  for g in self.param_groups]
        self._exchange.begin()
        error: BaseException | None = None
        status: Tensor | int
        try:
            with torch.autocast(device_type=self._device.type, enabled=False):  # exact dtypes
                status = self._update_owned_blocks(hypers)
        except Exception as exc:  # report, join the collective, then re-raise
            error, status = exc, STATUS_EXCEPTION
        statuses = self._exchange.exchange(status)
        if error is not None:
            raise error
        # The step's one host read (a device sync): the status words. It stays because a
        # failed step must raise in that step, on every rank, with nothing applied, and
        # whether to apply is decided on the host. With several ranks the gather has
        # synchronised already; on one rank every kernel of the step but the final
        # update is queued by then.
        if statuses is not None and bool((statuses != 0).any()):
            self._raise_failure(statuses)
        self._apply()
        return loss

    @timed(Phase.SHAMPOO_BLOCKS)
    def _update_owned_blocks(self, hypers: list[BlockHyper]) -> Tensor | int:
        """Compute this rank's block directions, hand them to the exchange; return its status.

        The status is a 0-d tensor on the parameters' device (or a host int with no block
        to update): every block's failure flags are combined on the device and read once,
        after the exchange, by every rank alike — no host synchronisation per block.
        """
        runs = self._plan(hypers)
        corrections = {gi: bias_corrections(group_runs, hypers[gi])
                       for gi, group_runs in runs.items()}
        if self.step_graph is not None:
            status = self._replayed(runs, hypers, corrections)
            if status is not None:
                return status
        return self._block_work(runs, hypers, corrections)

    def _plan(self, hypers: list[BlockHyper]) -> dict[int, list[Run]]:
        """This step's runs (blocks with gradients, by stack) by parameter group, advanced."""
        runs: dict[int, list[Run]] = {}
        for stack in self._stacks:
            found = self._runs(stack, hypers[stack.group])
            if found:
                runs.setdefault(stack.group, []).extend(found)
        for group_runs in runs.values():
            advance(group_runs)
        return runs

    def _block_work(self, runs: dict[int, list[Run]], hypers: list[BlockHyper],
                    corrections: dict[int, BiasCorrections]) -> Tensor | int:
        """The tensor work of :meth:`_update_owned_blocks` for the planned runs; the status.

        Starts from an empty exchange (each run of a captured work, and an eager run
        after a failed capture, as the step's first).
        """
        self._exchange.begin()
        steps = self._start_runs(runs, hypers)
        for gi, group_steps in steps.items():
            update_statistics(group_steps, hypers[gi], corrections[gi])
        host_status = self._update_roots(steps, hypers)
        stat_marks: list[Tensor] = []
        update_marks: list[Tensor] = []
        for gi, group_steps in steps.items():
            for st, direction in zip(group_steps, directions(group_steps, hypers[gi],
                                                             corrections[gi])):
                stats, update = self._hand_over(st, direction)
                stat_marks.append(stats)
                update_marks.append(update)
        if not stat_marks:
            return host_status
        bad_stats, bad_updates = _cat(stat_marks).ne(0), _cat(update_marks).ne(0)  # NaN ≠ 0
        return (bad_stats.any().to(torch.int64) * STATUS_NONFINITE_STATISTICS
                + (bad_updates & bad_stats.logical_not()).any().to(torch.int64)
                * STATUS_NONFINITE_UPDATE + host_status)

    def _replayed(self, runs: dict[int, list[Run]], hypers: list[BlockHyper],
                  numbers: dict[int, BiasCorrections]) -> Tensor | None:
        """The block work from the step graph (its status), or None: run it eagerly.

        Steps that compute roots run eagerly, and so do blocks of half-precision
        parameters: a bias correction as a number divides them in float32, as a float64
        tensor it may be cast to their dtype first (equal on the CPU, not shown on CUDA).
        The key: the state's generation, the
        parameters' storage, the hyper-parameters, the runs (stack, position, size,
        whether they update factors and precondition yet) and the dtypes of their
        gradients; the bias corrections of the runs' steps (``numbers``) are the
        numbers the graph reads.
        """
        graph = self.step_graph
        assert graph is not None
        if graph.disabled is not None or not runs:
            return None
        if any(run.roots for group_runs in runs.values() for run in group_runs):
            graph.skip()
            return None
        params = list(dict.fromkeys(self._block_param[i] for group_runs in runs.values()
                                    for run in group_runs for i in run.members))
        if any(p.dtype not in _GRAPHED_DTYPES for p in params):
            return None
        # the parameters' storage too: the work reads their blocks (weight decay)
        key = (self._generation, tuple(p.data_ptr() for p in params), tuple(hypers),
               tuple((gi, tuple((id(run.stack), run.start, run.size,
                                 hypers[gi].updates_factors(run.step),
                                 run.step >= hypers[gi].start_preconditioning_step)
                                for run in group_runs)) for gi, group_runs in runs.items()),
               tuple(p.grad.dtype for p in params if p.grad is not None))
        values = [v for gi in numbers for v in numbers[gi].values()]
        if self._graph_inputs is None or self._graph_inputs[0] != key:
            self._graph_inputs = (key, *_correction_tensors(numbers, self._device))
        _, vector, tensors = self._graph_inputs

        def work() -> tuple[Tensor | int, object]:
            return self._block_work(runs, hypers, tensors), self._exchange.kept()

        if not graph.run(key, params, work, lambda: vector.copy_(
                torch.tensor(values, dtype=torch.float64), non_blocking=True)):
            return None
        status, kept = cast(tuple[Tensor, object], graph.output)
        self._exchange.restore(kept)
        return status

    def _start_runs(self, runs: dict[int, list[Run]], hypers: list[BlockHyper]
                    ) -> dict[int, list[RunStep]]:
        """The runs' step records: their gradients stacked, by parameter group."""
        steps: dict[int, list[RunStep]] = {}
        for gi, group_runs in runs.items():
            hp = hypers[gi]
            grads = [[self._view(self._grad(i), i) for i in run.members] for run in group_runs]
            params = [[self._param_view(i) for i in run.members]
                      if hp.weight_decay != 0.0 else [] for run in group_runs]
            steps[gi] = start_runs(group_runs, grads, params, hp, self.factor_dtype)
        return steps

    def _grad(self, i: int) -> Tensor:
        grad = self._block_param[i].grad
        assert grad is not None
        return grad

    def _runs(self, stack: BlockStack, hp: BlockHyper) -> list[Run]:
        """The stack's runs this step; creates the state of blocks stepping for the first time."""
        states: list[BlockState | None] = []
        keys: list[tuple[int, bool] | None] = []
        for i in stack.members:
            p, index = self._block_param[i], self.layout.blocks[i].index
            if p.grad is None:
                states.append(None)
                keys.append(None)
                continue
            state = self.state[p].get(index)
            if state is None:
                state = self.state[p][index] = {"step": 0, "root_failures": 0}
            t = state["step"] + 1
            states.append(state)
            keys.append((t, hp.preconditions(len(stack.shape))
                         and hp.recomputes_roots(t, "root_0" in state)))
        return runs_of(stack, states, keys)

    def _param_view(self, i: int) -> Tensor:
        """Block ``i``'s view of its parameter (:meth:`_param_views`)."""
        p = self._block_param[i]
        views = self._param_views(p)
        return self._view(p, i) if views is None else views[self._blocks_of[p].index(i)]

    def _param_views(self, p: Tensor) -> list[Tensor] | None:
        """``p``'s blocks as views of it, made once and kept while its storage stays the same.

        Made in ``step()``, under ``no_grad``: they carry no autograd history. None where
        ``p`` is not contiguous (its reshape would be a copy).
        """
        if not p.is_contiguous():
            return None
        key = (p.data_ptr(), tuple(p.shape))
        kept = self._views_of.get(p)
        if kept is None or kept[0] != key:
            kept = self._views_of[p] = (key, [self._view(p, i) for i in self._blocks_of[p]])
        return kept[1]

    def _view(self, tensor: Tensor, i: int) -> Tensor:
        """Block ``i``'s view of ``tensor`` (its parameter's shape)."""
        shape = self._merged[i]
        merged = tensor if shape is None else tensor.reshape(shape)
        return merged if self._whole[i] else merged[self.layout.blocks[i].slices]

    def _update_roots(self, steps: dict[int, list[RunStep]], hypers: list[BlockHyper]) -> int:
        """Recompute the roots of the runs due, all at once; the host-known status bits."""
        due = [(st, hypers[gi]) for gi, group_steps in steps.items() for st in group_steps
               if st.run.roots]
        if not due:
            return 0
        requests = [root_requests(st, hp, self.root_method) for st, hp in due]
        results = inverse_roots([r for per_run in requests for r in per_run],
                                placement=self.solve_placement, method=self.root_method)
        status, at = 0, 0
        for (st, hp), per_run in zip(due, requests):
            install_roots(st, results[at:at + len(per_run)], hp, self.root_method)
            at += len(per_run)
            if st.root_failures:
                status |= STATUS_ROOT_FAILURES
        return status

    def _hand_over(self, st: RunStep, direction: Tensor) -> tuple[Tensor, Tensor]:
        """Give a run's directions to the exchange; return their finiteness marks.

        Per block, whether its statistics and its direction (as it travels) are finite
        (marks: 0 if so, else NaN).
        """
        exchange = self._exchange
        sent = exchange.put(st.run, direction)
        update_marks = nonfinite_marks(sent)
        assert st.stat_marks is not None
        stat_marks = st.stat_marks
        for j in st.root_failures:  # the block fails as a whole; its flags do not count
            stat_marks[j] = 0.0
            update_marks[j] = 0.0
            exchange.fail_block(st.run.members[j])
        exchange.fail_rows(st.run, stat_marks, update_marks)
        return stat_marks, update_marks

    def _raise_failure(self, statuses: Tensor) -> None:
        values = [int(v) for v in statuses.tolist()]
        mask = 0
        for value in values:
            mask |= value
        stepped = {i for group in self.param_groups for p in group["params"]
                   if p.grad is not None for i in self._blocks_of[p]}
        failed_ranks = [r for r, v in enumerate(values) if v != 0]
        affected = [self.layout.blocks[i].key
                    for i in self._exchange.failed_blocks(failed_ranks, stepped)]
        where = ", ".join(f"parameter {n!r} block {b}" for n, b in affected[:10])
        if len(affected) > 10:
            where += f" and {len(affected) - 10} more blocks"
        failed = [r for r, v in enumerate(values) if v & STATUS_EXCEPTION]
        if failed:
            where += ("; " if where else "") + f"rank(s) {failed} raised an exception"
        raise ShampooNumericalError(
            f"DistributedShampoo step {self._steps}: {describe_status(mask)} in {where}. "
            "Parameters were not updated; check the loss and gradients (lower lr, clip "
            "gradients, raise epsilon) and restore a checkpoint.", affected, mask)

    @timed(Phase.SHAMPOO_APPLY)
    def _apply(self) -> None:
        """Apply ``p ← p − lr·d`` for every parameter with a gradient.

        One ``_foreach_add_`` per parameter group over every block's update.
        """
        for group in self.param_groups:
            targets: list[Tensor] = []
            updates: list[Tensor] = []
            for p in group["params"]:
                if p.grad is not None and self._blocks_of[p]:
                    self._collect_update(p, targets, updates)
            _foreach_add_(targets, updates, -group["lr"])

    def _collect_update(self, p: Tensor, targets: list[Tensor], updates: list[Tensor]) -> None:
        """Append ``p``'s parts and their updates.

        Per block, or assembled whole where ``p`` is not contiguous and has several blocks.
        """
        indices = self._blocks_of[p]
        parts = [self._exchange.update(i, p.dtype) for i in indices]
        if len(indices) == 1:
            targets.append(p)
            updates.append(parts[0] if self._merged[indices[0]] is None else
                           parts[0].reshape(p.shape))
            return
        views = self._param_views(p)
        if views is not None:
            targets.extend(views)
            updates.extend(parts)
            return
        specs = [self.layout.blocks[i] for i in indices]
        whole = torch.empty(specs[0].merged_shape, dtype=p.dtype, device=p.device)
        for spec, part in zip(specs, parts):
            whole[spec.slices].copy_(part)
        targets.append(p)
        updates.append(whole.view(p.shape))

    # ------------------------------------------------------------ state dict
    def _local_states(self) -> list[tuple[tuple[str, int], BlockState]]:
        out = []
        for i in self._owned:
            spec = self.layout.blocks[i]
            state = self.state.get(self._block_param[i], {}).get(spec.index)
            if state is not None:
                out.append((spec.key, state))
        return out

    def local_state_dict(self) -> ShampooStateDict:
        """Return a :meth:`state_dict` holding only this rank's blocks (local, no collective).

        The tensors are copies on their devices. :meth:`load_state_dict` of it on the same
        number of ranks restores this rank (checkpoint loads keep it for a rollback).
        """
        return self._assemble_state_dict(lambda: {
            key: {k: v.detach().clone() if isinstance(v, Tensor) else v
                  for k, v in state.items()}
            for key, state in self._local_states()})

    def checkpoint_load_rank(self, key_path: tuple[Any, ...]) -> int | None:
        """Return the rank that owns, in this optimizer's layout, the block saved at ``key_path``.

        A checkpoint load reads each block's state on its owner only, for any number of
        ranks at save time.

        Args:
            key_path: ``("state", param_name, block_index)``.

        Returns:
            The owner's rank, or None for any other path.
        """
        if len(key_path) != 3 or key_path[0] != "state":
            return None
        try:
            return self._owner_of.get((str(key_path[1]), _block_index(key_path[2])))
        except ValueError:
            return None

    def _gather_states(self) -> dict[tuple[str, int], BlockState]:
        """Every block's state on every rank (collective)."""
        return gather_block_states(self.comm, self._local_states())

    def _install_states(self, states: dict[tuple[str, int], BlockState]) -> None:
        """Keep (copies of) the states of the blocks this rank owns now."""
        self._generation += 1
        self.state = defaultdict(dict)
        for i in self._owned:
            spec, p = self.layout.blocks[i], self._block_param[i]
            saved = states.get(spec.key)
            if saved is None:
                continue
            state: BlockState = {}
            for key, value in saved.items():
                if isinstance(value, Tensor):
                    dtype = self.factor_dtype if key.startswith(_FACTOR_KEYS) else p.dtype
                    value = value.to(device=p.device, dtype=dtype, copy=True)
                state[key] = value
            self.state[p][spec.index] = state

    # torch types state_dict() as dict[str, Any]; this is that dict with its keys named
    # (a TypedDict, which mypy does not count as a dict[str, Any])
    def state_dict(self) -> ShampooStateDict:  # type: ignore[override]
        """Return the whole optimizer state, keyed by parameter name and block index.

        Collective (every rank must call it); every rank returns the same dict::

            {"format": "kfac_hpc.shampoo", "format_version": 1, "steps": int,
             "state": {param_name: {block_index: {"step": int, "root_failures": int,
                       "factor_<i>": T, "root_<i>": T, "basis_<i>": T,
                       "second_moment": T, "filtered_grad": T, "momentum_buffer": T}}},
             "blocks": {param_name: {"shape": [...], "merged_shape": [...],
                        "block_shapes": [[...], ...]}},
             "param_groups": [{hyper-parameters..., "params": [param_name, ...]}]}

        Tensors are CPU copies; blocks that never took a step have no entry. The world size
        appears nowhere: the dict loads on any number of ranks.

        Returns:
            The state dict.
        """
        return self._assemble_state_dict(self._gather_states)

    def checkpoint_state_dict(self) -> ShampooStateDict:
        """Return a :meth:`state_dict` for streaming checkpoint writers (collective, metadata only).

        The same dict on every rank, except that each rank holds only the tensors of the
        blocks it owns (its live tensors, not copies); the others are
        :class:`~kfac_hpc.shampoo.state_io.RemoteTensor` placeholders naming the owner, shape
        and dtype. A writer receives them from their owners one at a time, so no rank
        materialises the whole state; the file is that of :meth:`state_dict`.

        Returns:
            The state dict with placeholders.
        """
        return self._assemble_state_dict(
            lambda: describe_block_states(self.comm, self._local_states()))

    def _assemble_state_dict(self, collect: Callable[[], dict[tuple[str, int], BlockState]]
                             ) -> ShampooStateDict:
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        gathered = collect()
        state: dict[str, dict[int, BlockState]] = {}
        blocks: dict[str, BlockShapes] = {}
        for spec in self.layout.blocks:
            if spec.key in gathered:
                state.setdefault(spec.param_name, {})[spec.index] = gathered[spec.key]
        for group, names in zip(self.param_groups, self._param_names()):
            for p, name in zip(group["params"], names):
                specs = [self.layout.blocks[i] for i in self._blocks_of[p]]
                blocks[name] = {"shape": list(p.shape),
                                "merged_shape": list(specs[0].merged_shape) if specs else [],
                                "block_shapes": [list(s.shape) for s in specs]}
        groups = []
        for group, names in zip(self.param_groups, self._param_names()):
            packed = {k: v for k, v in group.items() if k not in ("params", "param_names")}
            packed["params"] = list(names)
            groups.append(packed)
        result: ShampooStateDict = {
            "format": STATE_DICT_FORMAT, "format_version": STATE_DICT_VERSION,
            "steps": self._steps, "state": state, "blocks": blocks, "param_groups": groups,
        }
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            # torch's hooks take and return its untyped StateDict (a hook may change it)
            changed = post_hook(self, cast("StateDict", result))
            if changed is not None:
                result = cast("ShampooStateDict", changed)
        return result

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict` saved on any number of ranks (local, no collective).

        Checks that the format, the parameter names per group and the block shapes match
        this optimizer; restores the groups' hyper-parameters and the state of the blocks
        this rank owns.

        Args:
            state_dict: What :meth:`state_dict` (or a checkpoint reader) returned.

        Raises:
            ValueError: The dict is not a Shampoo state dict of this version, or does not
                match this optimizer's parameters or blocks; names the difference.
        """
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            changed = pre_hook(self, state_dict)
            if changed is not None:
                state_dict = changed
        self._check_state_dict(state_dict)
        # the owners stay those of this optimizer's construction, whatever the saved
        # groups' precondition_vectors (which balances them): a checkpoint load hands each
        # rank the blocks it owns now (checkpoint_load_rank), so new owners would lack
        # their state; only the balance differs, not the results
        restored_groups = []
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            restored = dict(group)
            restored.update({k: v for k, v in saved.items() if k not in ("params", "param_names")})
            if isinstance(restored.get("betas"), list):
                restored["betas"] = tuple(restored["betas"])
            hyper.validate_group(restored)  # every group before any changes
            restored_groups.append(restored)
        for group, restored in zip(self.param_groups, restored_groups):
            group.update(restored)
        self._install_states(_normalise_states(state_dict["state"]))
        self._steps = int(state_dict.get("steps", 0))
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _check_state_dict(self, sd: dict[str, Any]) -> None:
        def bad(why: str) -> ValueError:
            return ValueError(f"DistributedShampoo.load_state_dict: {why}")

        if not isinstance(sd, dict) or sd.get("format") != STATE_DICT_FORMAT:
            raise bad(f"not a DistributedShampoo state dict (format {sd.get('format')!r}, "
                      f"expected {STATE_DICT_FORMAT!r})" if isinstance(sd, dict) else
                      f"expected a dict, got {type(sd).__name__}")
        if sd.get("format_version") != STATE_DICT_VERSION:
            raise bad(f"format_version {sd.get('format_version')!r} is not supported "
                      f"(this version reads {STATE_DICT_VERSION})")
        groups = sd["param_groups"]
        if len(groups) != len(self.param_groups):
            raise bad(f"it has {len(groups)} parameter groups, this optimizer has "
                      f"{len(self.param_groups)}")
        for gi, (saved, names) in enumerate(zip(groups, self._param_names())):
            if list(saved["params"]) != names:
                missing = sorted(set(names) - set(saved["params"]))
                extra = sorted(set(saved["params"]) - set(names))
                raise bad(f"parameter group {gi} differs: missing {missing}, unexpected {extra}"
                          + (" (same names, different order)" if not missing and not extra else ""))
        current = {b.key: b for b in self.layout.blocks}
        states = _normalise_states(sd["state"])
        for saved, names in zip(groups, self._param_names()):
            for name in names:
                info = sd.get("blocks", {}).get(name)
                if info is not None:
                    self._check_blocks(name, info, saved, bad)
        for (name, index), block_state in states.items():
            spec = current.get((name, index))
            if spec is None:
                raise bad(f"state for unknown block ({name!r}, {index})")
            for i, d in enumerate(spec.shape):
                factor = block_state.get(f"factor_{i}")
                if factor is None and spec.order == 1:
                    continue  # saved with precondition_vectors=False: starts from zero
                if factor is None or tuple(factor.shape) != (d, d):
                    raise bad(f"block ({name!r}, {index}) factor_{i} should be {d}x{d}, got "
                              f"{None if factor is None else tuple(factor.shape)}")

    def _check_blocks(self, name: str, info: BlockShapes, saved_group: dict[str, Any],
                      bad: Callable[[str], ValueError]) -> None:
        """Check that parameter ``name`` was split as it is here (merged view and blocks).

        A state dict without ``merge_dims_from`` in its groups was saved when dimensions
        merged from the first one; the message names the setting that would fit.
        """
        p = self._param(name)
        specs = [self.layout.blocks[i] for i in self._blocks_of[p]]
        mine = [list(spec.shape) for spec in specs]
        merged = list(specs[0].merged_shape) if specs else []
        theirs = [list(s) for s in info["block_shapes"]]
        if theirs == mine and list(info.get("merged_shape", merged)) == merged:
            return
        max_dim = saved_group.get("max_preconditioner_dim", 1024)
        saved_order = saved_group.get("merge_dims_from", "first")  # none saved: "first"
        orders = [saved_order, *(o for o in blocking.MERGE_ORDERS if o != saved_order)]
        fits = [order for order in orders
                if [list(b.shape) for b in blocking.block_param(
                    name, tuple(p.shape), max_dim, order)] == theirs]
        hint = " (different shape, max_preconditioner_dim or merge_dims_from)"
        if fits:
            settings = {"max_preconditioner_dim": max_dim, "merge_dims_from": fits[0]}
            hint = ("; it was saved with " + ", ".join(f"{k}={v!r}" for k, v in settings.items())
                    + ": build DistributedShampoo with those to load it (kfac-hpc train: "
                    "--shampoo-options " + ",".join(f"{k}={v}" for k, v in settings.items())
                    + ")")
        raise bad(f"parameter {name!r} was split into blocks {info['block_shapes']} (merged "
                  f"shape {info.get('merged_shape')}) but is split into {mine} here (merged "
                  f"shape {merged}){hint}")

    def _param(self, name: str) -> Tensor:
        if name not in self._param_by_name:
            raise ValueError(f"DistributedShampoo.load_state_dict: unknown parameter {name!r}")
        return self._param_by_name[name]

    # ---------------------------------------------------------- inspection
    def memory_bytes(self) -> dict[str, int]:
        """Count the bytes this rank holds, by kind.

        Returns:
            Bytes of ``factors``, ``roots``, ``bases`` (the eigenbases ``SubspaceRoots``
            keeps), ``grafting``, ``filtered_grad``, ``momentum``, ``buffers`` (the two
            gather buffers), ``directions`` (on one rank, the last step's directions,
            kept until the next step in place of the buffers), and with ``cuda_graphs``
            ``graph buffers`` (the step graph's copies of the gradients; its pool's
            intermediates are not counted).
        """
        kinds = {"factors": 0, "roots": 0, "bases": 0, "grafting": 0, "filtered_grad": 0,
                 "momentum": 0}
        names = {"factor_": "factors", "root_": "roots", "basis_": "bases",
                 "second_moment": "grafting",
                 "filtered_grad": "filtered_grad", "momentum_buffer": "momentum"}
        for per_param in self.state.values():
            for block_state in per_param.values():
                for key, value in block_state.items():
                    if isinstance(value, Tensor):
                        kind = next(v for k, v in names.items() if key.startswith(k))
                        kinds[kind] += value.numel() * value.element_size()
        kinds["buffers"] = sum(self._exchange.tensors().get(name, torch.empty(0)).nbytes
                               for name in ("send buffer", "receive buffer"))
        kinds["directions"] = self._exchange.held_directions_bytes()
        if self.step_graph is not None:
            kinds["graph buffers"] = self.step_graph.buffer_bytes()
        return kinds


def _stacks(layout: Layout, owned: list[int], kinds: list[Any]) -> list[BlockStack]:
    """The owned blocks grouped by kind, each stack in send-buffer order."""
    members: dict[Any, list[int]] = {}
    for i in sorted(owned, key=lambda i: layout.offsets[i]):
        members.setdefault(kinds[i], []).append(i)
    return [BlockStack(kind[0], kind[1], kind[2], indices) for kind, indices in members.items()]


def _foreach_add_(targets: list[Tensor], updates: list[Tensor], alpha: float) -> None:
    """Apply ``t ← t + alpha·u`` for every pair, contiguous pairs and the rest in two calls.

    One fused call for the contiguous pairs (a GPU falls back to a kernel per tensor for
    a whole list holding one strided tensor), one for the rest (blocks that are column
    slices of their parameter).
    """
    dense = [t.is_contiguous() and u.is_contiguous() for t, u in zip(targets, updates)]
    for keep in (True, False):
        pairs = [(t, u) for t, u, d in zip(targets, updates, dense) if d == keep]
        if pairs:
            torch._foreach_add_([t for t, _ in pairs], [u for _, u in pairs], alpha=alpha)


def _cat(tensors: list[Tensor]) -> Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def _block_index(key: Any) -> int:
    """A block index from ``3``, ``"3"`` or ``"block_3"`` (keys after a file round trip)."""
    text = str(key)
    return int(text.removeprefix("block_"))


def _blocking_of(group: Mapping[str, Any]) -> tuple[int, MergeOrder]:
    """What splits a group's parameters into blocks, read once, as the group is added."""
    return int(group["max_preconditioner_dim"]), group["merge_dims_from"]


def _normalise_states(state: dict[str, Any]) -> dict[tuple[str, int], BlockState]:
    """Turn ``{name: {index: block_state}}`` into ``{(name, index): block_state}``.

    Tensors (numpy arrays accepted) and Python ints for the counters.
    """
    out: dict[tuple[str, int], BlockState] = {}
    for name, per_block in state.items():
        for index, block_state in per_block.items():
            block: BlockState = {}
            for key, value in block_state.items():
                if key in _INT_KEYS:
                    value = int(value)
                elif not isinstance(value, Tensor):  # numpy: moved to the device on install
                    value = torch.as_tensor(value, device="cpu")
                block[key] = value
            out[(str(name), _block_index(index))] = block
    return out


#: Parameter dtypes whose captured bias corrections divide as the numbers do (a float64
#: divisor is cast to the operand's dtype either way).
_GRAPHED_DTYPES = (torch.float32, torch.float64)


def _correction_tensors(numbers: dict[int, BiasCorrections], device: torch.device
                        ) -> tuple[Tensor, dict[int, BiasCorrections]]:
    """A float64 device vector for every bias correction, and the corrections as its entries.

    Args:
        numbers: Per parameter group, its runs' corrections as numbers.
        device: Where the vector lives.

    Returns:
        The vector (filled before each run of a captured step) and, per group, the
        corrections as 0-dim views of it, in the order of :meth:`BiasCorrections.values`.
    """
    count = sum(len(c.values()) for c in numbers.values())
    vector = torch.zeros(count, dtype=torch.float64, device=device)
    entries = iter(vector.unbind(0)) if count else iter(())
    out: dict[int, BiasCorrections] = {}
    for gi, c in numbers.items():
        parts = [None if part is None else [next(entries) for _ in part]
                 for part in (c.filtered, c.grafting)]
        out[gi] = BiasCorrections(parts[0], parts[1])
    return vector, out
