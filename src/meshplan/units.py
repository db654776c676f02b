"""Human formatting of SI quantities. Everything inside meshplan is SI (s, bytes, FLOPs, bytes/s)."""

from __future__ import annotations

GIB = 1024**3


def fmt_bytes(n_bytes: float) -> str:
    """Binary units for memory (GiB), as people read HBM sizes."""
    for unit, scale in (("TiB", 1024**4), ("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n_bytes) >= scale:
            return f"{n_bytes / scale:.2f} {unit}"
    return f"{n_bytes:.0f} B"


def fmt_time(t_s: float) -> str:
    if t_s >= 86400 * 2:
        return f"{t_s / 86400:.1f} d"
    if t_s >= 1:
        return f"{t_s:.3f} s"
    if t_s >= 1e-3:
        return f"{t_s * 1e3:.3f} ms"
    return f"{t_s * 1e6:.2f} µs"


def fmt_flops(flops: float) -> str:
    for unit, scale in (("EFLOP", 1e18), ("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9)):
        if abs(flops) >= scale:
            return f"{flops / scale:.3g} {unit}"
    return f"{flops:.3g} FLOP"


def fmt_rate(per_s: float, unit: str) -> str:
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(per_s) >= scale:
            return f"{per_s / scale:.3g} {prefix}{unit}/s"
    return f"{per_s:.3g} {unit}/s"


def fmt_count(n: float) -> str:
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{suffix}"
    return f"{n:.0f}"
