"""Seeds of the data layer's random streams: every draw is a pure function of integers.

Each stream (sample order, augmentation, synthetic data, resized crops) mixes its own
identifier into the seed, so that independent streams never coincide; the identifiers
are all here to keep them distinct.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = [
    "STREAM_AUGMENT",
    "STREAM_LOADER",
    "STREAM_ORDER",
    "STREAM_RESIZED_CROP",
    "STREAM_SYNTHETIC",
    "generator",
]

# Stream identifiers mixed into seeds so that independent random streams never coincide.
STREAM_ORDER = 1
STREAM_AUGMENT = 2
STREAM_SYNTHETIC = 3
STREAM_RESIZED_CROP = 4
#: The seed a ``DataLoader`` iterator draws for its workers (never the global generator)
STREAM_LOADER = 5


def _mix_seed(*parts: int) -> int:
    """Mix integer parts into a 63-bit seed (SeedSequence hashing; negative parts allowed)."""
    entropy = [int(p) % (1 << 64) for p in parts]
    return int(np.random.SeedSequence(entropy).generate_state(1, dtype=np.uint64)[0] >> 1)


def generator(*parts: int) -> torch.Generator:
    """Return a CPU generator whose seed mixes the integer ``parts`` (SeedSequence hashing)."""
    return torch.Generator().manual_seed(_mix_seed(*parts))
