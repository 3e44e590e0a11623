"""Per-layer keep / offload / recompute planning: pure functions, no torch.

:func:`predict` runs the cost model of one training step for a given choice per
layer; :func:`plan` searches the choices for the shortest predicted step whose
predicted activation memory fits a budget. Both take measured numbers
(:class:`LayerCost` per layer, :class:`StepCost` for the rest of the step and
the machine) and are deterministic, so tests call them directly.

The cost model (:func:`predict` and its NOTEs) is in _policies/costmodel.py; this
module holds the search (:func:`plan`, the family of plans it predicts) and
:class:`Plan`, and imports the cost model's names too.

NOTE [ Plan search ]

The search is exhaustive over a fixed family of plans (:func:`plan_family`): with
``n`` layers and at most ``max_plans`` plans, the layers are split into ``g``
consecutive groups (``3**g <= max_plans``; groups of one layer when ``3**n``
fits, the later layers, which backward needs first, in the smaller groups),
every layer of a group gets the group's choice, and every combination is
predicted. When the groups are larger than one layer, that misses most of the
simple plans a user would try by hand, so the family also has every two-part
plan (:func:`two_part_plans`: the first ``k`` layers one choice, the rest
another, for every ``k``; at most ``9 * (n + 1)`` more plans): keep-all,
offload-all, recompute-all (checkpointing every layer) and the static mixes
(offload or recompute the first ``k`` layers, keep or offload the rest). The
chosen plan is therefore never predicted slower than any of them that fits. The family
depends only on ``n`` and ``max_plans``, not on the costs, so the chosen
plan's predicted time is the exact minimum over it: more bandwidth never
predicts a slower plan, and a bigger budget never either. Ties go to the plan
with fewer recomputed layers, then fewer offloaded ones (I/O the model thinks
hidden still costs CPU and memory bandwidth), then less memory, then the one
keeping later layers.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

from .costmodel import (CHOICES, KEEP, OFFLOAD, RECOMPUTE, LayerCost, Prediction, StepCost,
                        predict, throttled_step, tier_split, write_behind_for)

__all__ = ["KEEP", "OFFLOAD", "RECOMPUTE", "CHOICES", "LayerCost", "StepCost", "Prediction",
           "Plan", "predict", "plan", "tier_split", "group_layers", "rok_plans", "plan_family",
           "two_part_plans", "write_behind_for", "throttled_step"]

MiB = 1 << 20


@dataclass(frozen=True)
class Plan:
    """A choice per layer with its prediction; ``str(plan)`` is a readable table."""

    layers: Tuple[LayerCost, ...]
    choices: Tuple[str, ...]
    prediction: Prediction
    budget_bytes: Optional[int]
    step: StepCost
    fits: bool = True
    """Whether the predicted peak fits the budget (False: no plan fits; this is the
    plan with the least memory)."""
    plans_searched: int = 0
    notes: Tuple[str, ...] = field(default_factory=tuple)

    @property
    def write_behind_bytes(self) -> int:
        """The write-behind limit the plan runs with (:func:`write_behind_for`)."""
        return self.step.write_behind_bytes

    def choice(self, name: str) -> str:
        """The choice for the layer called ``name``."""
        for layer, c in zip(self.layers, self.choices):
            if layer.name == name:
                return c
        raise KeyError(name)

    def counts(self) -> dict:
        """``{choice: number of layers}``."""
        return {c: self.choices.count(c) for c in CHOICES}

    def table(self) -> str:
        """A markdown table: one row per layer, then the totals and the prediction."""
        p, s = self.prediction, self.step
        rows = ["| layer | choice | saved (MiB) | input (MiB) | recompute (MiB) | fwd (ms) "
                "| bwd (ms) |",
                "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
        for layer, c in zip(self.layers, self.choices):
            rows.append(f"| {layer.name} | {c} | {layer.saved_bytes / MiB:.1f} | "
                        f"{layer.input_bytes / MiB:.1f} | "
                        f"{layer.recompute_working_bytes / MiB:.1f} | "
                        f"{layer.fwd_s * 1e3:.1f} | {layer.bwd_s * 1e3:.1f} |")
        budget = "none" if self.budget_bytes is None else f"{self.budget_bytes / MiB:.1f} MiB"
        counts = ", ".join(f"{n} {c}" for c, n in self.counts().items())
        rows.append("")
        rows.append(f"{counts}; predicted step {p.step_s * 1e3:.1f} ms (stalls "
                    f"{p.stall_s * 1e3:.1f} ms, recompute {p.recompute_s * 1e3:.1f} ms), peak "
                    f"activations {p.peak_bytes / MiB:.1f} MiB of budget {budget}"
                    + ("" if self.fits else " (NO plan fits: least-memory plan shown)")
                    + f"; disk {s.write_bps / 1e9:.2f} GB/s write, {s.read_bps / 1e9:.2f} GB/s "
                    f"read; {p.written_bytes / MiB:.1f} MiB written per step; "
                    + _tier_text(p, s)
                    + f"{self.plans_searched} plans searched.")
        rows.extend(self.notes)
        rows.extend(_state_notes(self.layers, self.choices))
        return "\n".join(rows)

    def __str__(self):
        return self.table()


def _tier_text(p, s):
    """Where the plan's bytes go, with a priced host tier (NOTE [ Tiers in the step cost
    model ]); empty without one."""
    if not s.prices_host_tier:
        return ""
    rest = (f"{p.ssd_bytes / MiB:.1f} MiB to the SSD" if s.ssd_tier else
            f"{p.device_bytes / MiB:.1f} MiB kept on the device (no SSD tier)")
    return (f"host tier {s.host_budget_bytes / MiB:.1f} MiB at "
            f"{s.host_write_bps / 1e9:.2f}/{s.host_read_bps / 1e9:.2f} GB/s to/from host: "
            f"{p.host_bytes / MiB:.1f} MiB to RAM, {rest}; ")


def _state_notes(layers, choices):
    """One line per layer whose forward updates buffers: what its choice does about it."""
    out = []
    for layer, c in zip(layers, choices):
        if not layer.updates:
            continue
        what = (f"recomputed on copies of them, so they are updated once per step as "
                f"without ssdtrain (NOTE [ Recompute without a second update ])"
                if c == RECOMPUTE else "not recomputed: updated once per step")
        out.append(f"{layer.name} updates buffers in forward ({', '.join(layer.updates)}): "
                   f"{what}.")
    return out

def group_layers(n: int, max_plans: int, k: int = 3) -> List[List[int]]:
    """Split layer indices ``0..n-1`` into consecutive groups, ``k**len(groups) <= max_plans``.

    Groups differ in size by at most one; the larger groups come first (the later
    layers, which backward needs first, get the finer choice). With ``k**n <=
    max_plans`` every layer is its own group.
    """
    if n == 0:
        return []
    g = 1
    while g < n and k ** (g + 1) <= max_plans:
        g += 1
    size, extra = divmod(n, g)
    groups, start = [], 0
    for j in range(g):
        m = size + (1 if j < extra else 0)
        groups.append(list(range(start, start + m)))
        start += m
    return groups


def _sort_key(pred, choices):
    # Among equal predictions, keep the layers backward needs first (the cost model
    # does not credit what ssdtrain forwards from memory, so this is the safe side).
    return (round(pred.step_s, 12), choices.count(RECOMPUTE), choices.count(OFFLOAD),
            pred.peak_bytes, -sum(i for i, c in enumerate(choices) if c == KEEP), choices)


def plan(layers: Sequence[LayerCost], budget_bytes: Optional[int], step: StepCost, *,
         max_plans: int = 6561, allowed: Sequence[str] = CHOICES) -> Plan:
    """The plan with the shortest predicted step whose predicted peak fits ``budget_bytes``.

    Args:
        layers: the layers in forward order (:class:`LayerCost`).
        budget_bytes: most activation bytes allowed in memory; ``None``: no limit.
        step: the machine and the rest of the step (:class:`StepCost`).
        max_plans: most plans predicted (NOTE [ Plan search ]). Default 6561 (3**8).
        allowed: the choices the search may use. Default all three.

    Returns:
        The best :class:`Plan`. When no plan fits, the plan with the least predicted
        memory, with ``fits=False``.

    Raises:
        ValueError: ``allowed`` is empty or names an unknown choice, or a bandwidth
            is not > 0.
    """
    allowed = tuple(dict.fromkeys(allowed))
    if not allowed or any(c not in CHOICES for c in allowed):
        raise ValueError(f"ssdtrain: allowed must be a non-empty subset of {CHOICES}, got "
                         f"{allowed!r}.")
    layers = tuple(layers)
    n = len(layers)
    groups = group_layers(n, max_plans, len(allowed))
    best = best_fit = None
    searched = 0
    for choices in plan_family(n, max_plans, allowed):
        pred = predict(layers, choices, throttled_step(layers, choices, step, budget_bytes))
        searched += 1
        key = _sort_key(pred, choices)
        if budget_bytes is None or pred.peak_bytes <= budget_bytes:
            if best_fit is None or key < best_fit[0]:
                best_fit = (key, choices, pred)
        least = (pred.peak_bytes,) + key
        if best is None or least < best[0]:
            best = (least, choices, pred)
    notes = []
    if n and len(groups) < n:
        notes.append(f"Layers planned in {len(groups)} groups of consecutive layers "
                     f"({len(allowed) ** len(groups)} plans of at most {max_plans}), and "
                     f"every two-part plan (the first k layers one choice, the rest another).")
    fits, (_, choices, pred) = best_fit is not None, best_fit or best
    return Plan(layers, choices, pred, budget_bytes,
                throttled_step(layers, choices, step, budget_bytes), fits, searched, tuple(notes))


def plan_family(n: int, max_plans: int = 6561, allowed: Sequence[str] = CHOICES):
    """The plans :func:`plan` predicts, in order (NOTE [ Plan search ]): every
    combination of one choice per group of :func:`group_layers`, then the two-part
    plans not among them (:func:`two_part_plans`). Depends only on the arguments."""
    allowed = tuple(dict.fromkeys(allowed))
    groups = group_layers(n, max_plans, len(allowed))
    seen = set()
    for combo in itertools.product(allowed, repeat=len(groups)):
        choices = [None] * n
        for g, c in zip(groups, combo):
            for i in g:
                choices[i] = c
        choices = tuple(choices)
        seen.add(choices)
        yield choices
    for choices in two_part_plans(n, allowed):
        if choices not in seen:
            seen.add(choices)
            yield choices


def two_part_plans(n: int, allowed: Sequence[str] = CHOICES) -> List[Tuple[str, ...]]:
    """The plans of two parts: the first ``k`` layers get one choice, the rest another
    (``0 <= k <= n``, every ordered pair of ``allowed``): keep-all, offload-all,
    recompute-all (checkpointing every layer), and the static mixes (offload or
    recompute the first ``k`` layers, keep or offload the rest), without duplicates."""
    allowed = tuple(dict.fromkeys(allowed))
    out, seen = [], set()
    for first in allowed:
        for rest in allowed:
            for k in range(n + 1):
                choices = tuple([first] * k + [rest] * (n - k))
                if choices not in seen:
                    seen.add(choices)
                    out.append(choices)
    return out

def rok_plans(n: int) -> List[Tuple[str, ...]]:
    """The recompute-offload-keep family: from keep-all to recompute-all, ``2n + 1`` plans.

    First the number of offloaded layers grows from the first layer on (keep-all,
    then layer 0 offloaded, ... offload-all), then the number of recomputed layers
    grows the same way (offload-all ... recompute-all). Layers consumed first in
    backward (the last ones) are the last to leave memory and the last to be
    recomputed.
    """
    out = [tuple([KEEP] * n)]
    for k in range(1, n + 1):
        out.append(tuple([OFFLOAD] * k + [KEEP] * (n - k)))
    for k in range(1, n + 1):
        out.append(tuple([RECOMPUTE] * k + [OFFLOAD] * (n - k)))
    return out
