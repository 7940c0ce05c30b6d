"""The ``DistributedShampoo.state_dict()`` layout, as a type.

:meth:`DistributedShampoo.state_dict <kfac_hpc.shampoo.optimizer.DistributedShampoo.state_dict>`
(and its ``checkpoint_state_dict`` and ``local_state_dict`` variants) return a
:class:`ShampooStateDict`. Everything is keyed by parameter name and block index; the
world size appears nowhere, so the dict loads on any number of ranks.
``load_state_dict`` takes torch's ``dict[str, Any]`` (an optimizer's contract) and
checks it against this layout before it changes anything.
"""

from __future__ import annotations

from typing import Any, TypedDict

from kfac_hpc.shampoo.block_update import BlockState

__all__ = ["BlockShapes", "ShampooStateDict"]


class BlockShapes(TypedDict):
    """How one parameter is split into blocks.

    Attributes:
        shape: The parameter's shape.
        merged_shape: Its shape after merging small dimensions (empty: no blocks).
        block_shapes: The shape of every block, in block-index order.
    """

    shape: list[int]
    merged_shape: list[int]
    block_shapes: list[list[int]]


class ShampooStateDict(TypedDict):
    """A ``DistributedShampoo`` state dict.

    Attributes:
        format: ``"kfac_hpc.shampoo"`` (:data:`~kfac_hpc.shampoo.optimizer.STATE_DICT_FORMAT`).
        format_version: The layout's version
            (:data:`~kfac_hpc.shampoo.optimizer.STATE_DICT_VERSION`).
        steps: Optimizer steps taken.
        state: ``{param_name: {block_index: block state}}``; a block state holds
            ``step`` and ``root_failures`` (ints) and tensors (``factor_<i>``,
            ``root_<i>``, ``basis_<i>`` under ``SubspaceRoots``, ``second_moment``,
            ``filtered_grad``, ``momentum_buffer``).
            Blocks that never took a step have no entry.
        blocks: Every parameter's block split, by parameter name.
        param_groups: Every group's hyper-parameters, with ``"params"`` the names of
            its parameters (torch's layout of groups).
    """

    format: str
    format_version: int
    steps: int
    state: dict[str, dict[int, BlockState]]
    blocks: dict[str, BlockShapes]
    param_groups: list[dict[str, Any]]
