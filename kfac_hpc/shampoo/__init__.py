"""Distributed Shampoo: blocked Kronecker-factored preconditioning over MPI.

``DistributedShampoo`` is a ``torch.optim.Optimizer``. Each parameter is viewed with
small dimensions merged and tiled into blocks of at most ``max_preconditioner_dim``
per side (:mod:`.blocking`); a block of order k keeps k factors and is preconditioned
by ``(F_i + εI)^(-1/2k)`` along each dimension (:mod:`.kronecker`, :mod:`.roots`),
rescaled per block to a grafting method's step (:mod:`.grafting`). The per-block
algorithm is in :mod:`.block_update`.

Distribution (:mod:`.ownership`): blocks are assigned to ranks by LPT on the cost
``sum(d_i**3)``, from shapes alone. A block's state lives only on its owner, which
computes the block's final direction; one ``allgatherv`` per step (in
``communication_dtype``) gives every rank every direction, and every rank applies
them. Every rank joins that collective every step, with or without gradients and
with or without blocks. On one rank there is no collective: the directions are
applied where they were computed.

Where state lives (decided, measured): only on the block's owner. The alternative,
every rank keeping every block's factors, costs the full state on each rank and
redundant factor updates (two matrix products per factor per step on every rank)
for the sole benefit of a communication-free ``state_dict()``. Measured with
``benchmarks/shampoo_step.py`` (fp32, Adam grafting, ``max_preconditioner_dim=1024``;
MiB per rank, max over ranks, including the two gather buffers)::

    model (params)        all blocks   1 rank   2 ranks   4 ranks   torch Adam
    MLP 64-256-128-10 (51k)     2.3      2.3       1.5       1.2        0.39
    ResNet-20 (272k)           27.0     27.0      15.7       8.4        2.08

(ResNet-20's 3x3 convolutions merge into ``(c_out, 9·c_in)`` blocks, up to 64x576, so
its 576² factors hold more than the parameters; merged from the first dimension, the
earlier rule, its blocks were up to 1024x9 and the state 91.7 MiB. One rank has no
gather buffers.) The price is that ``state_dict()`` is
collective: it gathers every block's state onto every rank (an ``allgather_object``
of metadata plus one ``allgatherv`` of raw bytes; CPU tensors, so a checkpoint briefly
holds the whole state on every rank), keyed by ``(parameter name, block index)`` with
no trace of the world size; ``load_state_dict()`` then needs no communication on any
number of ranks: each rank keeps the blocks it owns. Use
:meth:`DistributedShampoo.memory_bytes` to see what a rank holds.

Roots (:mod:`.root_methods`): ``root_method=EigenRoots()`` (the default) computes every
root by a batched ``eigh`` per factor size; ``SubspaceRoots()`` keeps the factors'
eigenbases and refreshes them by one subspace-iteration step (GEMMs and a QR), with a
fresh ``eigh`` every ``fresh_every``-th computation and for bases that drift;
``NewtonRoots()`` by the coupled inverse Newton iteration, GEMMs only, batched per size
(:mod:`.newton`), with the eigen path for the matrices it does not converge on.

Failures (:mod:`.errors`): non-finite statistics, repeated root failures, non-finite
updates and exceptions on an owner are reported through a status word in the gather,
so every rank raises together and none is left waiting in a collective.

Devices: every tensor the optimizer keeps (factors, roots, grafting and momentum
state, gather buffers, failure flags) lives on its parameters' device (one device
per optimizer, e.g. this rank's GPU); ``state_dict()`` returns CPU tensors and
``load_state_dict()`` moves them to the parameters' device. Per-block failure flags
stay on the device and are combined into the status word, so a step reads device
memory on the host once (the status words); a root recomputation adds one read for
all roots, and its eigensolver synchronises once per distinct factor size (with
``NewtonRoots``: one read per ``check_every`` iterations, for all sizes at once).

Kernels (GPU launches): blocks of one parameter group, shape and dtype are stacked
(:mod:`.stacks`), so a step is one batched GEMM per kind of block and factor plus a
few ``torch._foreach_*`` calls per parameter group, whatever the number of blocks
(:mod:`.block_update`). On one rank nothing is gathered (:mod:`.exchange`).
"""

from kfac_hpc.shampoo.blocking import BlockSpec, block_param, merge_dims
from kfac_hpc.shampoo.errors import ShampooNumericalError
from kfac_hpc.shampoo.grafting import GRAFTING_KINDS
from kfac_hpc.shampoo.optimizer import STATE_DICT_FORMAT, STATE_DICT_VERSION, DistributedShampoo
from kfac_hpc.shampoo.ownership import Layout, assign_owners
from kfac_hpc.shampoo.root_methods import (
    EigenRoots,
    NewtonRoots,
    RootMethod,
    SubspaceRoots,
    root_method_from,
)
from kfac_hpc.shampoo.roots import RootComputationError, inverse_root

__all__ = [
    "GRAFTING_KINDS",
    "STATE_DICT_FORMAT",
    "STATE_DICT_VERSION",
    "BlockSpec",
    "DistributedShampoo",
    "EigenRoots",
    "Layout",
    "NewtonRoots",
    "RootComputationError",
    "RootMethod",
    "ShampooNumericalError",
    "SubspaceRoots",
    "assign_owners",
    "block_param",
    "inverse_root",
    "merge_dims",
    "root_method_from",
]
