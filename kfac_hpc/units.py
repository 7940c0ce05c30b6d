"""Human-readable sizes: the one byte formatter and the one byte parser.

:func:`format_bytes` writes sizes in logs, summaries and error messages;
:func:`parse_bytes` reads them from command lines.
"""

from __future__ import annotations

import argparse
import re

__all__ = ["format_bytes", "parse_bytes"]

# K, M, G, T and the IEC names are binary; KB, MB, GB, TB decimal (as disks are sold)
_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 10**3, "KIB": 2**10, "M": 2**20, "MB": 10**6,
          "MIB": 2**20, "G": 2**30, "GB": 10**9, "GIB": 2**30, "T": 2**40, "TB": 10**12,
          "TIB": 2**40}


def format_bytes(n: float, digits: int = 1) -> str:
    """Format a byte count in binary units up to TiB: ``1536`` -> ``"1.5 KiB"``.

    Args:
        n: Bytes.
        digits: Digits after the decimal point (whole bytes have none).

    Returns:
        The text.
    """
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.{digits}f} {unit}"
        n /= 1024
    return f"{n:.{digits}f} TiB"


def parse_bytes(text: str) -> int:
    """Read a byte count: ``"8"``, ``"4K"``, ``"64KiB"``, ``"512 MB"``, ``"16GiB"``, ``"1e9"``.

    ``K``, ``M``, ``G``, ``T`` and ``KiB`` ... ``TiB`` are binary, ``KB`` ... ``TB``
    decimal; case is ignored.

    Args:
        text: The size.

    Returns:
        Bytes (rounded down to a whole byte).

    Raises:
        argparse.ArgumentTypeError: The text is not a size (the message shows examples).
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if m is None or m.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"not a size: {text!r} (e.g. 8, 4K, 64KiB, 512MB, 16GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])
