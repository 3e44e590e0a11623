"""What a check compares: the reference steps folded into values and envelopes, and a
step with ssdtrain held against them (NOTE [ Reference spread ]).

:class:`Mismatch` and :class:`Varying` are what a comparison finds; the functions here
are pure (tensors in, numbers out).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Tuple

import torch

# NOTE [ Reference spread ]
# A model whose steps differ by themselves (a kernel with no deterministic variant,
# atomics in a reduction) cannot be compared bitwise; the step with ssdtrain is then
# one more sample of the model's own noise, and the question is whether it could be.
# With n reference samples of a tensor, the chance that one more sample from the same
# distribution falls outside their range is 2/(n+1): 2/3 with two references, 2/9 with
# eight. (The rule before, "no farther from the first reference than the second is",
# failed half the time per tensor: a correct model with +-5e-7 noise was blamed on
# ssdtrain in 16 of 20 seeds.) A range alone never separates noise from a fault; a
# margin does:
#
# * every reference step starts from the same state, and the references are folded
#   one step at a time into, per tensor, either its value (while every step agreed
#   bitwise) or its elementwise envelope [lo, hi] (NaN widens an element to anything);
#   the spread is the envelope's widest element, which equals the largest distance
#   (max abs difference) between two reference steps;
# * a tensor every reference agreed on is compared bitwise, whatever the others do;
# * a tensor that varied is a mismatch when the step with ssdtrain lies outside the
#   envelope by more than MARGIN x the spread.
#
# Costs and odds: a deterministic model that ssdtrain gets right costs three steps
# (two references, one with ssdtrain), as before. Anything else (references that
# differ, or a step with ssdtrain that differs from them) runs references until there
# are REFERENCE_STEPS = 8: nine steps in all. With 8 references and a margin of 4, the
# chance of a false mismatch per tensor, simulated over 200000 trials for a scalar (the
# worst case: the max abs difference of a tensor of many elements is concentrated near
# its mean), is 5e-6 for Gaussian noise, none seen for uniform noise, 9e-4 for
# Student-t noise with 3 degrees of freedom (heavier-tailed than a reduction order
# gives); a fault within 4x the model's own noise is NONDETERMINISTIC, never EXACT. A
# tensor that takes another value now and then (a flip of the model's own) is
# mistaken for a fault when every reference agrees and the step with ssdtrain does
# not: at most (8/9)^8/9 = 4.3% of the time with 8 references, at the worst flip rate,
# against 4/27 = 15% with 2. tests/test_check_contract.py checks these rules on seeded
# samples.
REFERENCE_STEPS = 8
MARGIN = 4.0


@dataclasses.dataclass
class Mismatch:
    """One tensor that differs: ``kind`` is ``loss``, ``gradient``, ``buffer``,
    ``attribute`` (a tensor a module holds as a plain attribute) or ``rng``."""

    kind: str
    name: str
    max_abs_diff: float
    detail: str = ""

    def __str__(self):
        what = f"{self.kind} {self.name}" if self.name else self.kind
        detail = f" ({self.detail})" if self.detail else ""
        return f"{what}: max abs diff {self.max_abs_diff:.6g}{detail}"


@dataclasses.dataclass
class Varying:
    """A tensor the reference steps did not agree on: ``spread`` is the largest distance
    (max abs difference) between two of them; ``outside`` how far the step with ssdtrain
    lay outside their elementwise envelope (0: inside; ``inf``: shape, dtype or
    presence varied)."""

    kind: str
    name: str
    spread: float
    outside: float



def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bytes (NaN equals the same NaN; 0.0 is not -0.0)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                       b.contiguous().reshape(-1).view(torch.uint8))


def _distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max abs difference (NaN against the same position's NaN: 0; against a number:
    inf; shape or dtype differ: inf)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return math.inf
    if a.numel() == 0:
        return 0.0
    a, b = _real(a), _real(b)
    d = (a - b).abs()
    d = torch.where(torch.isnan(a) & torch.isnan(b), torch.zeros_like(d), d)
    d = torch.where(a == b, torch.zeros_like(d), d)  # inf == inf
    return float(torch.nan_to_num(d, nan=math.inf).max().item())


def _real(t: torch.Tensor) -> torch.Tensor:
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.double()


def _bounds(t: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """One sample as an envelope ``(lo, hi)``, in its own dtype (min and max round
    nothing; complex as its real view, bool as uint8); a NaN element: ``(-inf, inf)``."""
    x = torch.view_as_real(t) if t.is_complex() else t
    if x.dtype == torch.bool:
        x = x.to(torch.uint8)
    if not x.is_floating_point():
        return x, x
    nan = torch.isnan(x)
    return x.masked_fill(nan, -math.inf), x.masked_fill(nan, math.inf)


def _spread(lo: torch.Tensor, hi: torch.Tensor) -> float:
    """The envelope's widest element: the largest distance between two samples."""
    if lo.numel() == 0:
        return 0.0
    lo, hi = lo.double(), hi.double()
    width = torch.where(hi == lo, torch.zeros_like(hi), hi - lo)
    return float(width.max().item())


def _outside(t: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> float:
    """How far ``t`` lies outside the envelope at its worst element (0: inside)."""
    x = _real(t)
    if x.shape != lo.shape:
        return math.inf
    if x.numel() == 0:
        return 0.0
    lo, hi = lo.double(), hi.double()
    zero = torch.zeros_like(x)
    d = torch.maximum(torch.where(x > hi, x - hi, zero), torch.where(x < lo, lo - x, zero))
    open_ = (lo == -math.inf) & (hi == math.inf)
    d = torch.where(torch.isnan(x), torch.where(open_, zero, torch.full_like(x, math.inf)), d)
    return float(d.max().item())


class _Reference:
    """The reference steps, folded one at a time (NOTE [ Reference spread ]): per tensor
    its value while every step agreed bitwise, else its envelope ``(lo, hi)`` (``None``
    when its shape or dtype varied)."""

    def __init__(self):
        self.steps = 0
        self.order: List[tuple] = []
        self.seen: Dict[tuple, int] = {}
        self.value: Dict[tuple, torch.Tensor] = {}
        self.envelope: Dict[tuple, Optional[Tuple[torch.Tensor, torch.Tensor]]] = {}
        self.dtype: Dict[tuple, Tuple[torch.Size, torch.dtype]] = {}

    def add(self, sample: Dict[tuple, torch.Tensor]) -> None:
        for key, t in sample.items():
            if key not in self.seen:
                self.order.append(key)
                self.seen[key] = 0
                self.value[key] = t
                self.dtype[key] = (t.shape, t.dtype)
            elif key in self.value:
                if not _bitwise_equal(self.value[key], t):
                    first = self.value.pop(key)
                    self.envelope[key] = self._fold(_bounds(first), first, t)
            elif self.envelope[key] is not None:
                self.envelope[key] = self._fold(self.envelope[key], t, t)
            self.seen[key] += 1
        self.steps += 1

    def _fold(self, bounds, first, t):
        if (t.shape, t.dtype) != (first.shape, first.dtype):
            return None
        lo, hi = bounds
        tlo, thi = _bounds(t)
        return torch.minimum(lo, tlo), torch.maximum(hi, thi)

    @property
    def deterministic(self) -> bool:
        return not self.envelope and all(n == self.steps for n in self.seen.values())

    def agrees(self, got: Dict[tuple, torch.Tensor]) -> bool:
        """Every reference step and ``got`` are bitwise equal (the common, cheap case)."""
        return self.deterministic and got.keys() == self.value.keys() and \
            all(_bitwise_equal(self.value[k], got[k]) for k in self.value)

    def compare(self, got: Dict[tuple, torch.Tensor]) -> Tuple[List[Mismatch], List[Varying]]:
        mismatches, varying = [], []
        n = self.steps
        for key in self.order:
            kind, name = key
            if self.seen[key] < n:  # the model itself gives it in some steps only
                varying.append(Varying(kind, name, math.inf, 0.0 if key in got else math.inf))
                continue
            if key not in got:
                mismatches.append(Mismatch(kind, name, math.inf, "missing with ssdtrain"))
                continue
            if key in self.value:
                if not _bitwise_equal(self.value[key], got[key]):
                    shape, dtype = self.dtype[key]
                    detail = (f"the {n} steps without ssdtrain agreed bitwise" if
                              (got[key].shape, got[key].dtype) == (shape, dtype) else
                              f"{tuple(got[key].shape)} {got[key].dtype} with ssdtrain, "
                              f"{tuple(shape)} {dtype} without")
                    mismatches.append(Mismatch(kind, name, _distance(self.value[key], got[key]),
                                               detail))
                continue
            env = self.envelope[key]
            if env is None:  # its shape or dtype varied without ssdtrain
                varying.append(Varying(kind, name, math.inf, 0.0))
                continue
            lo, hi = env
            spread = _spread(lo, hi)
            outside = _outside(got[key], lo, hi) if got[key].dtype == self.dtype[key][1] \
                else math.inf
            varying.append(Varying(kind, name, spread, outside))
            if outside > MARGIN * spread:
                mismatches.append(Mismatch(
                    kind, name, outside,
                    f"outside what {n} steps without ssdtrain gave by {outside:.6g}, more than "
                    f"{MARGIN:g}x their spread {spread:.6g}"))
        for key in got:
            if key not in self.seen:
                mismatches.append(Mismatch(key[0], key[1], math.inf, "only with ssdtrain"))
        return mismatches, varying
