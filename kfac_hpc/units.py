"""Human-readable sizes: the one byte formatter of logs, summaries and error messages."""

from __future__ import annotations

__all__ = ["format_bytes"]


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
