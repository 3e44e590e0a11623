"""How the estimate writes numbers: bytes, markdown tables, JSON without inf or NaN."""

from __future__ import annotations

import math


def _b(n):
    if n is None:
        return "-"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _md(rows, right):
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    out = []
    for k, r in enumerate(rows):
        cells = [str(c).rjust(w) if i in right else str(c).ljust(w)
                 for i, (c, w) in enumerate(zip(r, widths))]
        out.append("| " + " | ".join(cells) + " |")
        if k == 0:
            out.append("| " + " | ".join(("-" * (w - 1) + ":") if i in right else "-" * w
                                         for i, w in enumerate(widths)) + " |")
    return out


# -------------------------------------------------------------------- the estimate


def finite(o):
    """``o`` with every float that is not finite as ``None``: JSON has no inf or NaN
    (``ssdtrain estimate``'s and ``ssdtrain check``'s JSON). The hardware ranges keep the
    estimate's formulas finite; this is the last guard, e.g. a model that writes nothing
    lasts forever: ``drive_years`` is ``None``."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [finite(v) for v in o]
    return o


def _json_default(o):
    if isinstance(o, float) and math.isinf(o):
        return None
    return str(o)
