"""``stdlib-text``: a byte-level language-modelling corpus shipped with Python itself.

The corpus is the source of the standard library: the top-level ``*.py`` files of
``sysconfig.get_paths()["stdlib"]``, sorted by name (no download; the same bytes on
every machine with the same Python version). The split is by file: every
``EVAL_EVERY``-th file (positions ``EVAL_EVERY-1, 2·EVAL_EVERY-1, …`` of the sorted list)
is evaluation text, the others training text. Each split is the concatenation of its
files' bytes (capped at ``train_bytes`` / ``eval_bytes``), cut into non-overlapping
windows of ``context + 1`` bytes at stride ``context``: sample ``i`` is
``x = text[i·T : i·T + T]``, ``y = text[i·T + 1 : i·T + T + 1]`` (next-token targets).

Inputs and targets are int64 token ids in ``[0, 256)``, shape ``(B, T)``. The model
(``gpt``) outputs ``(B, T, 256)`` logits; the driver flattens positions for the
cross-entropy loss (mean over tokens) and reports perplexity ``exp(loss)``.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

import torch
from torch import Tensor

from kfac_hpc.train.data import BatchDataset, DatasetSplits

__all__ = ["EVAL_EVERY", "VOCAB", "TokenWindows", "corpus_files", "load_stdlib_text"]

VOCAB = 256
"""Byte-level vocabulary."""

EVAL_EVERY = 8
"""Every 8th source file (in sorted order) is evaluation text."""


def corpus_files(root: str | Path | None = None) -> list[Path]:
    """List the corpus: top-level ``*.py`` files of the standard library, sorted by name."""
    base = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in base.glob("*.py") if p.is_file())
    if len(files) < EVAL_EVERY:
        raise ValueError(f"stdlib-text found only {len(files)} .py files in {base}; "
                         f"it needs at least {EVAL_EVERY}")
    return files


def _concat(files: list[Path], limit: int) -> bytes:
    parts: list[bytes] = []
    total = 0
    for f in files:
        if total >= limit:
            break
        data = f.read_bytes()
        parts.append(data)
        total += len(data)
    return b"".join(parts)[:limit]


class TokenWindows(BatchDataset):
    """Non-overlapping windows of a byte string: ``(x, y)`` = ``(text[s:s+T], text[s+1:s+T+1])``."""

    def __init__(self, text: bytes, context: int) -> None:
        """Cut ``text`` into windows.

        Args:
            text: The corpus.
            context: Tokens (bytes) per window.

        Raises:
            ValueError: ``context`` < 1, or the text is too short for one window.
        """
        if context < 1:
            raise ValueError(f"context must be >= 1, got {context}")
        if len(text) < context + 1:
            raise ValueError(f"{len(text)} bytes of text are too few for context {context}")
        self.tokens = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        self.context = context
        self.digest = hashlib.sha256(text).hexdigest()[:16]

    def __len__(self) -> int:
        """Return the number of windows."""
        return (int(self.tokens.numel()) - 1) // self.context

    def get_batch(self, indices: Tensor, epoch: int | None = None) -> tuple[Tensor, Tensor]:
        """Return the windows ``indices`` as inputs and next-token targets.

        Args:
            indices: Window indices.
            epoch: Unused (no augmentation).

        Returns:
            ``(x, y)``, both ``(len(indices), context)`` token ids.
        """
        starts = indices.long().reshape(-1, 1) * self.context
        offsets = torch.arange(self.context + 1).reshape(1, -1)
        windows = self.tokens[starts + offsets].long()
        return windows[:, :-1], windows[:, 1:]


def load_stdlib_text(*, context: int = 64, train_bytes: int = 1 << 20,
                     eval_bytes: int = 1 << 17, root: str | Path | None = None
                     ) -> DatasetSplits:
    """Load the ``stdlib-text`` splits (see the module docstring).

    Args:
        context: Tokens per window.
        train_bytes: Bytes of the training text.
        eval_bytes: Bytes of the test text.
        root: The standard library directory to read (default: this Python's; tests).

    Returns:
        The training and test windows.
    """
    if train_bytes < context + 1 or eval_bytes < context + 1:
        raise ValueError("stdlib-text train_bytes/eval_bytes must exceed the context length")
    files = corpus_files(root)
    train_files = [f for i, f in enumerate(files) if i % EVAL_EVERY != EVAL_EVERY - 1]
    eval_files = [f for i, f in enumerate(files) if i % EVAL_EVERY == EVAL_EVERY - 1]
    train = TokenWindows(_concat(train_files, train_bytes), context)
    test = TokenWindows(_concat(eval_files, eval_bytes), context)
    return DatasetSplits("stdlib-text", train, test, VOCAB, (context,))
