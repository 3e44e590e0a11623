"""``ssdtrain check``: is ssdtrain exact on *my* model? One training step, with and without.

The bug users of activation offloading hit most is silent gradient corruption (a
stream race, a view rebuilt at the wrong offset, a stale buffer): nothing raises and
the loss still goes down. ssdtrain is exact by design (INV-EXACT, docs/ARCHITECTURE.md);
this tool lets a user see it on their own model, with their own inputs, on their own
machine::

    ssdtrain check --hf-config path/to/config.json --seq 512
    ssdtrain check --factory mypkg.models:make --device cuda

or, for a model and batch in hand::

    from ssdtrain.check import check_model
    result = check_model(model, batch)          # batch: a tensor, tuple or dict
    print(result.report()); assert result.exact

How it decides (NOTE [ Reference spread ]): two reference steps without ssdtrain and
one step with ssdtrain forcing every eligible saved tensor through the spill tier, each
from the same state (NOTE [ What a check restores ]); the loss, every gradient, every
buffer, every tensor a module holds and the RNG states after the step are compared
bitwise. Only when that does not come out exact are more reference steps run, to tell
the model's own run-to-run noise from ssdtrain.

Verdicts and the command's exit status: ``EXACT`` 0; ``MISMATCH`` 1 (or ``FAILED`` 1:
the step with ssdtrain raised where the steps without it ran); 2 a usage error, or the
factory or the model failed by itself (an exception, ``sys.exit``); ``NONDETERMINISTIC``
3 (the model varies from step to step without ssdtrain, and the step with ssdtrain is
within that variation); 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import json
import math
import os
import random
import shutil
import struct
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ._config import OffloadConfig
from ._device.cuda import (default_device, rng_state as _rng_state,
                           set_rng_state as _set_rng_state)
from ._device.cuda import synchronize as _sync
from ._errors import ConfigError

__all__ = ["check_model", "CheckResult", "Mismatch", "Varying", "main",
           "REFERENCE_STEPS", "MARGIN"]

EXIT_EXACT, EXIT_MISMATCH, EXIT_USAGE, EXIT_NONDETERMINISTIC = 0, 1, 2, 3
EXIT_INTERRUPTED = 130  # 128 + SIGINT, the shell's convention

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


@dataclasses.dataclass
class CheckResult:
    """What :func:`check_model` found. ``exact`` is the verdict; ``verdict`` names it."""

    exact: bool
    deterministic: bool
    compared: str
    tensors_compared: int
    mismatches: List[Mismatch]
    error: Optional[str]
    stats: Dict[str, Any]
    reference_seconds: float
    ssdtrain_seconds: float
    device: str
    references: int = 2
    varying: List[Varying] = dataclasses.field(default_factory=list)
    kinds: Dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def verdict(self) -> str:
        """``"exact"``, ``"failed"`` (the step with ssdtrain raised), ``"mismatch"`` or
        ``"nondeterministic"``."""
        if self.exact:
            return "exact"
        if self.error is not None:
            return "failed"
        if self.mismatches:
            return "mismatch"
        return "nondeterministic"

    @property
    def exit_status(self) -> int:
        return {"exact": EXIT_EXACT, "failed": EXIT_MISMATCH, "mismatch": EXIT_MISMATCH,
                "nondeterministic": EXIT_NONDETERMINISTIC}[self.verdict]

    def report(self) -> str:
        mib = lambda n: f"{n / (1 << 20):.2f} MiB"  # noqa: E731
        s = self.stats
        lines = []
        verdict = self.verdict
        if verdict == "failed":
            lines.append(f"FAILED: the step with ssdtrain raised, where {self.references} "
                         f"steps without it ran: {self.error}")
        elif verdict == "exact":
            words = {"gradient": "gradient", "buffer": "buffer", "attribute": "tensor attribute",
                     "rng": "RNG state"}
            counted = "".join(f", {n} {words[kind]}{'s' if n != 1 else ''}"
                              for kind, n in self.kinds.items() if kind in words and n)
            lines.append(f"EXACT: the loss{counted} are bitwise equal to the step without "
                         f"ssdtrain ({self.references} steps without it agreed).")
        elif verdict == "nondeterministic":
            worst = max(self.varying, key=lambda v: v.spread)
            lines.append(
                f"NONDETERMINISTIC: without ssdtrain the model itself varies: "
                f"{len(self.varying)} of {self.tensors_compared} tensors differ between "
                f"{self.references} identical steps (widest: {worst.kind} {worst.name}, spread "
                f"{worst.spread:.6g}). With ssdtrain every tensor they agreed on is bitwise "
                f"equal and the others lie within {MARGIN:g}x their spread, so nothing points "
                f"at ssdtrain; exactness cannot be shown bitwise on a model that is not "
                f"deterministic.")
        else:
            first = self.mismatches[0]
            lines.append(f"MISMATCH ({self.compared}): {len(self.mismatches)} of "
                         f"{self.tensors_compared} tensors differ; first: {first}")
            worst = max(self.mismatches, key=lambda m: m.max_abs_diff)
            if worst is not first:
                lines.append(f"  largest: {worst}")
        if not self.deterministic:
            lines.append("note: without ssdtrain the model gave different results in identical "
                         "steps (a kernel with no deterministic variant? noise the model draws "
                         "from a source check does not restore?); on CUDA try "
                         "torch.use_deterministic_algorithms(True).")
        if s:
            lines.append(
                f"offloaded {mib(s['offloaded_bytes'])} of {mib(s['unique_bytes'])} saved "
                f"({s['records_written']} writes), read back {mib(s['bytes_read'])} "
                f"({s['records_read']} reads), kept in memory {mib(s['kept_bytes'])}; engine "
                f"{s['engine']}")
            held = s.get("resident_at_backward_bytes")
            if held is not None:
                lines.append(
                    f"memory: when backward started ssdtrain held {mib(held)} of the "
                    f"{mib(s['unique_bytes'])} saved (without it: all of them; saves "
                    f"{mib(max(0, s['unique_bytes'] - held))})")
        if self.reference_seconds > 0 and self.ssdtrain_seconds > 0:
            lines.append(f"step time with ssdtrain {self.ssdtrain_seconds:.3f} s vs "
                         f"{self.reference_seconds:.3f} s without "
                         f"({self.ssdtrain_seconds / self.reference_seconds:.2f}x; every write "
                         f"waited for before backward, so slower than in training)")
        return "\n".join(lines)

    def to_json(self) -> dict:
        """The result as a JSON-ready dict (every field, ``verdict``, ``exit_status``;
        an infinite difference is ``null``)."""
        d = dataclasses.asdict(self)
        d["verdict"] = self.verdict
        d["exit_status"] = self.exit_status
        return json.loads(json.dumps(_finite(d), default=str, allow_nan=False))


def _finite(o):
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o


# ------------------------------------------------------------- what a check restores
# NOTE [ What a check restores ]
# Every step of a check (each reference, the step with ssdtrain) starts from the state
# the model was found in, and the model is left in it: a forward that updates state
# (BatchNorm's running statistics, an exponential moving average in a non-persistent
# buffer, a counter, a mode switch) is then deterministic across the steps, and exact.
# _Snapshot takes, on entry:
#
# * of every submodule: each attribute's binding (``__dict__``: attributes a step adds
#   are removed, rebound ones put back, so ``training`` and Python counters too) and the
#   contents of its ``_parameters``, ``_buffers`` (persistent or not), ``_modules`` and
#   non-persistent set;
# * the values of every leaf tensor among parameters, buffers, tensor attributes and
#   the inputs, copied back in place (objects keep their identity: an optimizer's
#   references stay valid), their ``requires_grad`` and ``.grad`` (object and values);
# * the RNG states: torch's CPU generator, the model device's CUDA generator, Python's
#   ``random``, numpy's global generator (when numpy is imported) and every
#   ``torch.Generator`` a module holds as an attribute.
#
# Not restored: mutable Python objects changed in place (a list a forward appends to,
# a config object), generators and files outside the model, hooks a forward
# registers. Noise drawn from such a source makes the model NONDETERMINISTIC.
class _Snapshot:
    """Everything a step can change, taken on entry; :meth:`restore` puts it back."""

    def __init__(self, model: torch.nn.Module, inputs, device: torch.device):
        self.device = device
        self.modules = []
        leaves: Dict[int, torch.Tensor] = {}  # holds each tensor: no id is reused meanwhile
        for module in model.modules():
            d = module.__dict__
            self.modules.append((module, dict(d), dict(module._parameters),
                                 dict(module._buffers), dict(module._modules),
                                 set(getattr(module, "_non_persistent_buffers_set", ()))))
            for t in (*module._parameters.values(), *module._buffers.values(), *d.values()):
                if isinstance(t, torch.Tensor) and t.is_leaf:
                    leaves.setdefault(id(t), t)
        for t in _tensors_in(inputs):
            if t.is_leaf:
                leaves.setdefault(id(t), t)
        self.tensors = []
        for t in leaves.values():
            grad = t.grad
            self.tensors.append((t, t.detach().clone(), t.requires_grad, grad,
                                 None if grad is None else grad.detach().clone()))
        self.generators = [(g, g.get_state()) for g in _module_generators(model)]
        self.rng = _rng_state(device)
        self.py_random = random.getstate()
        np = sys.modules.get("numpy")
        self.np_random = np.random.get_state() if np is not None else None

    def restore(self) -> None:
        for module, d, params, buffers, children, non_persistent in self.modules:
            now = module.__dict__
            for k in [k for k in now if k not in d]:
                del now[k]
            for k, v in d.items():
                if now.get(k, _MISSING) is not v:
                    now[k] = v
            _refill(module._parameters, params)
            _refill(module._buffers, buffers)
            _refill(module._modules, children)
            if hasattr(module, "_non_persistent_buffers_set") and \
                    module._non_persistent_buffers_set != non_persistent:
                module._non_persistent_buffers_set.clear()
                module._non_persistent_buffers_set.update(non_persistent)
        with torch.no_grad():
            for t, value, requires_grad, grad, grad_value in self.tensors:
                _put(t, value)
                if t.requires_grad != requires_grad:
                    t.requires_grad_(requires_grad)
                if t.grad is not grad:
                    t.grad = grad
                if grad is not None:
                    _put(grad, grad_value)
        for g, state in self.generators:
            g.set_state(state)
        _set_rng_state(self.rng, self.device)
        random.setstate(self.py_random)
        if self.np_random is not None:
            sys.modules["numpy"].random.set_state(self.np_random)


_MISSING = object()


def _refill(d: dict, saved: dict) -> None:
    """``d`` holds what ``saved`` does, in the same order, with the same objects."""
    if len(d) != len(saved) or any(ka != kb or va is not vb for (ka, va), (kb, vb)
                                   in zip(d.items(), saved.items())):
        d.clear()
        d.update(saved)


def _put(t: torch.Tensor, value: torch.Tensor) -> None:
    if t.shape == value.shape and t.dtype == value.dtype and t.device == value.device:
        t.copy_(value)
    else:  # resized or retyped in place: the object keeps its identity
        t.data = value.clone()


def _tensors_in(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors_in(v)
    elif isinstance(x, (tuple, list)):
        for v in x:
            yield from _tensors_in(v)


def _module_generators(model):
    seen = {}
    for module in model.modules():
        for v in module.__dict__.values():
            if isinstance(v, torch.Generator):
                seen.setdefault(id(v), v)
    return list(seen.values())


# ------------------------------------------------------------------------ one step
def _loss_of(out, loss_fn):
    if loss_fn is not None:
        loss = loss_fn(out)
    else:
        loss = out if isinstance(out, torch.Tensor) else getattr(out, "loss", None)
        if loss is None and isinstance(out, dict):
            loss = out.get("loss")
    if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
        what = (f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor)
                else type(out).__name__)
        raise ConfigError(f"ssdtrain check: the model's loss is {what}, not a scalar: expected "
                          f"forward to return a 0-dim tensor, or an output with a .loss "
                          f"(Hugging Face models given labels). Reduce it in forward (e.g. "
                          f".mean()), or in Python pass loss_fn= (output -> scalar loss).")
    if not loss.requires_grad:
        raise ConfigError("ssdtrain check: the model's loss does not require grad, so there is "
                          "no backward to check: expected a loss computed from parameters "
                          "that require grad (is the model frozen, or forward run under "
                          "torch.no_grad()?).")
    return loss


def _call(model, inputs):
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def _rng_tensors(device, generators) -> Dict[str, torch.Tensor]:
    """Every random-number state a step may draw from, as tensors to compare."""
    out = {key: value.clone() for key, value in _rng_state(device).items()}
    version, words, gauss = random.getstate()
    out["python"] = torch.tensor([version, *words, _float_bits(gauss)], dtype=torch.int64)
    np = sys.modules.get("numpy")
    if np is not None:
        _, keys, pos, has_gauss, cached = np.random.get_state()
        out["numpy"] = torch.tensor([*keys.tolist(), pos, has_gauss, _float_bits(cached)],
                                    dtype=torch.int64)
    for name, g in generators:
        out[name] = g.get_state()
    return out


def _float_bits(x) -> int:
    return -1 if x is None else struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _step(model, inputs, loss_fn, device, offloader=None):
    """One forward+backward: ``({(kind, name): tensor}`` of everything compared,
    seconds, bytes of saved tensors ssdtrain held in memory when backward started)."""
    model.zero_grad(set_to_none=True)
    _sync(device)
    t0 = time.perf_counter()
    resident = None
    with offloader if offloader is not None else contextlib.nullcontext():
        loss = _loss_of(_call(model, inputs), loss_fn)
        if offloader is not None:
            offloader.wait()  # every write ends before backward: backward reads from disk
            resident = offloader.resident_bytes()
    loss.backward()
    _sync(device)
    seconds = time.perf_counter() - t0
    out = {("loss", ""): loss.detach().clone()}
    for name, p in model.named_parameters():
        if p.grad is not None:
            out[("gradient", name)] = p.grad.detach().clone()
    for name, b in model.named_buffers():
        out[("buffer", name)] = b.detach().clone()
    generators = []
    for prefix, module in model.named_modules():
        for attr, v in module.__dict__.items():
            name = f"{prefix}.{attr}" if prefix else attr
            if isinstance(v, torch.Tensor):
                out[("attribute", name)] = v.detach().clone()
            elif isinstance(v, torch.Generator):
                generators.append((name, v))
    for key, value in _rng_tensors(device, generators).items():
        out[("rng", key)] = value
    return out, seconds, resident


# -------------------------------------------------------------- comparing (pure parts)
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


# ------------------------------------------------------------------------ the check
def _forcing_offloader(spill_dir: Optional[str], overrides: dict):
    """The default offloader of a check: every eligible tensor through the spill tier
    (the static policy, ``min_tensor_bytes=0``, ``keep_tail_bytes=0``), on ``spill_dir``
    or a temporary folder: ``(offloader, the folder to remove or None)``."""
    import ssdtrain

    own_dir = None
    if spill_dir is None:
        spill_dir = own_dir = tempfile.mkdtemp(prefix="ssdtrain-check-")
    fields = dict(policy="static", min_tensor_bytes=0, keep_tail_bytes=0)
    fields.update(overrides)
    try:
        return ssdtrain.Offloader(OffloadConfig(spill_dir=spill_dir, **fields)), own_dir
    except BaseException:
        if own_dir is not None:
            shutil.rmtree(own_dir, ignore_errors=True)
        raise


def check_model(model: torch.nn.Module, inputs, *, loss_fn: Optional[Callable] = None,
                offloader=None, spill_dir: Optional[str] = None, **overrides) -> CheckResult:
    """Run one training step of ``model`` on ``inputs`` without ssdtrain and with it.

    Two reference steps without ssdtrain and one with it, each from the state the model
    was found in; when they are not all bitwise equal, reference steps until there are
    :data:`REFERENCE_STEPS` (8), to tell the model's own noise from ssdtrain's
    (NOTE [ Reference spread ], docs/check.md).

    Args:
        model: the module, on the device to check (its mode is kept: call ``train()``
            first for a training step).
        inputs: what ``model`` is called with: a tuple or list (positional), a dict
            (keywords), anything else (one argument).
        loss_fn: ``output -> scalar loss``; default: the output itself when it is a
            0-dim tensor, or its ``.loss`` (Hugging Face models given ``labels``).
        offloader: an :class:`~ssdtrain.Offloader` to check (its configuration as is;
            the caller owns it). Default: a fresh one on ``spill_dir`` that forces every
            eligible tensor to the spill tier (``min_tensor_bytes=0``,
            ``keep_tail_bytes=0``), closed at the end.
        spill_dir: for the default offloader; default a temporary folder.
        **overrides: more :class:`~ssdtrain.OffloadConfig` fields for the default offloader.

    Returns:
        A :class:`CheckResult`: ``verdict`` is ``"exact"``, ``"mismatch"``, ``"failed"``
        (the step with ssdtrain raised an exception the steps without it did not) or
        ``"nondeterministic"``. The model is left as it was found (NOTE [ What a check
        restores ]), whatever happens.

    Raises:
        ConfigError: ``model`` is not a module, has no parameter that requires grad or
            lazy parameters not yet materialized, the loss is not a scalar that requires
            grad, or the offloader's configuration is refused.
        Exception: whatever the model raises in a step without ssdtrain, as it is.
    """
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"ssdtrain check: the model must be a torch.nn.Module, got "
                          f"{type(model).__name__}.")
    if offloader is not None and (spill_dir is not None or overrides):
        raise ConfigError("ssdtrain check: got an offloader and config fields; configure the "
                          "offloader you pass, or pass only the fields.")
    params = list(model.parameters())
    if any(torch.nn.parameter.is_lazy(t) for t in (*params, *model.buffers())):
        raise ConfigError("ssdtrain check: the model has lazy parameters not yet materialized "
                          "(torch.nn.Lazy* modules); run one forward on the inputs before "
                          "checking it.")
    if not any(p.requires_grad for p in params):
        raise ConfigError(f"ssdtrain check: {type(model).__name__} has no parameter that "
                          f"requires grad ({len(params)} parameters), so a training step has "
                          f"no backward to check; give a model with trainable parameters.")
    device = params[0].device
    snapshot = _Snapshot(model, inputs, device)
    own_dir = own_off = None
    reference = _Reference()
    t_ref = t_off = 0.0
    resident, error, got, stats = None, None, {}, {}

    def reference_step():
        nonlocal t_ref
        snapshot.restore()
        sample, seconds, _ = _step(model, inputs, loss_fn, device)
        reference.add(sample)
        if reference.steps == 2:  # the first warms up kernels and caches
            t_ref = seconds

    try:
        if offloader is None:
            offloader, own_dir = _forcing_offloader(spill_dir, overrides)
            own_off = offloader
        reference_step()
        reference_step()
        before = offloader.stats()
        snapshot.restore()
        try:
            got, t_off, resident = _step(model, inputs, loss_fn, device, offloader)
        except Exception as e:  # the same step ran without ssdtrain: this one is ssdtrain's
            error = f"{type(e).__name__}: {e}"
        try:
            offloader.wait()
        except Exception as e:
            error = error or f"{type(e).__name__}: {e}"
        stats = dataclasses.asdict(offloader.stats().since(before))
        stats["resident_at_backward_bytes"] = resident
        if error is None and not reference.agrees(got):
            while reference.steps < REFERENCE_STEPS:
                reference_step()
    finally:
        snapshot.restore()
        if own_off is not None:
            own_off.close()
        if own_dir is not None:
            shutil.rmtree(own_dir, ignore_errors=True)

    mismatches, varying = [], []
    if error is None:
        mismatches, varying = reference.compare(got)
        order = {"loss": 0, "gradient": 1, "buffer": 2, "attribute": 3, "rng": 4}
        position = {k: i for i, k in enumerate(reference.order)}
        mismatches.sort(key=lambda m: (order[m.kind], position.get((m.kind, m.name), 0)))
    deterministic = reference.deterministic
    exact = error is None and deterministic and not mismatches
    return CheckResult(
        exact=exact, deterministic=deterministic,
        compared="bitwise" if deterministic else
        f"bitwise where {reference.steps} steps without ssdtrain agree, else within "
        f"{MARGIN:g}x their spread",
        tensors_compared=len(reference.order), mismatches=mismatches, error=error,
        stats=stats, reference_seconds=t_ref, ssdtrain_seconds=t_off, device=str(device),
        references=reference.steps, varying=varying,
        kinds={kind: sum(1 for k, _ in reference.order if k == kind) for kind in
               ("loss", "gradient", "buffer", "attribute", "rng")})


# ------------------------------------------------------------------------ the command
class _UsageError(Exception):
    """A bad command line (argparse's ``error``, which would exit, raises this)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise _UsageError(message)


def _parser(prog):
    p = _Parser(
        prog=prog, description="Run one training step of a model without ssdtrain and with "
        "ssdtrain forcing every eligible saved tensor through the spill tier, and compare "
        "loss, gradients, buffers, module tensors and RNG states bitwise. Exit 0 exact, 1 "
        "mismatch (or the step with ssdtrain failed), 2 usage error or the factory/model "
        "failed by itself, 3 nondeterministic (the model varies by itself), 130 interrupted. "
        "What the factory and the model print goes to stderr.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf-config", metavar="PATH",
                     help="a Hugging Face config.json (or its folder): the model is built from it "
                          "with random weights (nothing downloaded)")
    src.add_argument("--factory", metavar="MODULE:FUNCTION",
                     help="a function returning (model, inputs), called with the keywords it "
                          "accepts of batch, seq, dtype (as in ssdtrain estimate)")
    p.add_argument("--batch", type=int, help="micro-batch size (default: the factory's, 1 for "
                                             "a config)")
    p.add_argument("--seq", type=int, help="sequence length (default: the factory's; 128 for "
                                           "a config)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="parameter dtype (default: the factory's, float32 for a config)")
    p.add_argument("--device", help="cpu or cuda[:N] (default: cuda when available, else cpu)")
    p.add_argument("--spill-dir", help="where spill files go (default: a temporary folder)")
    p.add_argument("--engine", help="OffloadConfig.engine (default auto)")
    p.add_argument("--json", action="store_true",
                   help="print the result as one JSON document on stdout (also on errors)")
    p.add_argument("--traceback", action="store_true",
                   help="also print the traceback when the factory or the model fails")
    return p


def _to(x, device):
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, dict):
        return {k: _to(v, device) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(_to(v, device) for v in x)
    return x


def _flush_c_stdio() -> None:
    """Flush C's stdio buffers (a C extension's printf), so they land where fd 1 points
    now."""
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError, TypeError):  # no C library to ask: nothing buffered
        pass


class _StdoutToStderr:
    """While the factory and the model run, what they write to stdout goes to stderr:
    ``sys.stdout`` at the Python level and file descriptor 1 for C extensions, so stdout
    carries only the verdict (or the JSON document)."""

    def __enter__(self):
        self._flush()
        self._stdout = sys.stdout
        self._fd = None
        try:
            self._fd = os.dup(1)
            os.dup2(2, 1)
        except OSError:  # fd 1 or 2 closed: nothing to redirect at that level
            if self._fd is not None:
                os.close(self._fd)
            self._fd = None
        sys.stdout = sys.stderr
        return self

    def __exit__(self, *exc):
        self._flush()
        for stream in (self._stdout, sys.__stdout__):  # written to by a reference kept
            with contextlib.suppress(Exception):
                stream.flush()
        sys.stdout = self._stdout
        if self._fd is not None:
            os.dup2(self._fd, 1)
            os.close(self._fd)
        return False

    @staticmethod
    def _flush():
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        _flush_c_stdio()


@dataclasses.dataclass
class _Failure(Exception):
    """The command cannot give a verdict: ``cause`` is ``usage``, ``factory``, ``model``,
    ``interrupted`` or ``ssdtrain`` (check itself); ``message`` says what happened and
    what to do."""

    status: int
    cause: str
    message: str
    trace: str = ""


def _described(e: BaseException) -> str:
    if isinstance(e, SystemExit):
        return f"called sys.exit({e.code!r})"
    text = str(e)
    return f"raised {type(e).__name__}" + (f": {text}" if text else "")


def _message(e: ConfigError) -> str:
    s = str(e)
    for prefix in ("ssdtrain check: ", "ssdtrain estimate: ", "ssdtrain: "):
        s = s.removeprefix(prefix)
    return s


def _users_code(cause: str, what: str, where: str, todo: str):
    """A :class:`_Failure` (exit 2) for the user's code that failed by itself: anything
    raised but ``KeyboardInterrupt``, ``sys.exit`` with any code (0 included)."""
    e = sys.exc_info()[1]
    return _Failure(EXIT_USAGE, cause, f"{what} {_described(e)}{where}. {todo}",
                    traceback.format_exc())


def _device(a) -> torch.device:
    try:
        device = torch.device(a.device) if a.device else default_device()
    except (RuntimeError, ValueError) as e:
        raise _Failure(EXIT_USAGE, "usage", f"--device {a.device!r} is not a device; expected "
                       f"cpu or cuda[:N].") from None
    if device.type == "cuda" and default_device().type != "cuda":
        raise _Failure(EXIT_USAGE, "usage", f"--device {a.device}: torch {torch.__version__} "
                       f"sees no CUDA device here; use --device cpu.")
    if device.type not in ("cpu", "cuda"):
        raise _Failure(EXIT_USAGE, "usage", f"--device {a.device}: ssdtrain check runs on cpu "
                       f"or cuda[:N], not {device.type}.")
    return device


def _factory(a):
    """``build()`` for the factory or config the command names."""
    from .estimate.models import _factory_builder, hf_factory, load_factory

    try:
        if a.factory is not None:
            factory = load_factory(a.factory)
        else:
            factory = hf_factory(a.hf_config)
    except ConfigError as e:
        raise _Failure(EXIT_USAGE, "usage", _message(e)) from None
    except KeyboardInterrupt:
        raise
    except BaseException:  # importing the factory's module ran the user's code
        raise _users_code("factory", f"importing the module of --factory {a.factory}", "",
                          "Fix the module (--traceback shows where); ssdtrain had not run "
                          "yet.") from None
    seq = a.seq if a.seq is not None or a.factory is not None else 128
    build, _ = _factory_builder(factory, batch=a.batch, seq=seq,
                                dtype=getattr(torch, a.dtype) if a.dtype else None,
                                gradient_checkpointing=None)
    return build


def _build(a, build, device):
    """The factory's ``(model, inputs)`` on ``device``, or a :class:`_Failure` naming
    the factory."""
    from .estimate.replay import EstimateError

    what = f"the factory {a.factory}" if a.factory is not None else \
        f"building the model of --hf-config {a.hf_config}"
    try:
        torch.manual_seed(0)
        model, inputs = build()
    except (ConfigError, EstimateError) as e:  # not (model, inputs), or a config refused
        raise _Failure(EXIT_USAGE, "factory",
                       f"{what} {_message(e).removeprefix('the factory ')}") from None
    except KeyboardInterrupt:
        raise
    except BaseException:
        raise _users_code("factory", what, ", where (model, inputs) was expected",
                          "Fix the factory (--traceback shows where); ssdtrain had not run "
                          "yet.") from None
    if not isinstance(model, torch.nn.Module):
        raise _Failure(EXIT_USAGE, "factory",
                       f"{what} returned ({type(model).__name__}, ...): expected (model, "
                       f"inputs) with model a torch.nn.Module.")
    try:
        return model.to(device), _to(inputs, device)
    except KeyboardInterrupt:
        raise
    except BaseException:
        raise _users_code("factory", f"moving the model and inputs of {what} to {device}", "",
                          "Check --device, and that the inputs are tensors, or tuples, lists "
                          "or dicts of them.") from None


def _run(a) -> Tuple[str, CheckResult]:
    for name in ("batch", "seq"):
        v = getattr(a, name)
        if v is not None and v < 1:
            raise _Failure(EXIT_USAGE, "usage", f"--{name} must be >= 1, got {v}.")
    device = _device(a)
    if device.type == "cuda":  # deterministic kernels where they exist, before cuBLAS starts
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    try:  # before the user's code runs: a refused --engine or --spill-dir fails fast
        offloader, own_dir = _forcing_offloader(a.spill_dir,
                                                {"engine": a.engine} if a.engine else {})
    except (ConfigError, TypeError, ValueError) as e:
        raise _Failure(EXIT_USAGE, "usage", f"{_message(e)} (the offloader of --engine, "
                       f"--spill-dir)") from None
    try:
        model, inputs = _build(a, _factory(a), device)
        try:
            return type(model).__name__, check_model(model, inputs, offloader=offloader)
        except ConfigError as e:
            raise _Failure(EXIT_USAGE, "model", _message(e)) from None
        except KeyboardInterrupt:
            raise
        except Exception:
            raise _users_code("model", "the model", " in a step without ssdtrain",
                              "It fails by itself, so there is nothing to compare: fix the "
                              "model or its inputs (--traceback shows where).") from None
        except BaseException:
            raise _users_code("model", "the model", " during the check",
                              "A model must return from forward and backward to be checked "
                              "(--traceback shows where).") from None
    finally:
        offloader.close()
        if own_dir is not None:
            shutil.rmtree(own_dir, ignore_errors=True)


def main(argv=None, prog="ssdtrain check") -> int:
    """The ``ssdtrain check`` command; returns the exit status, 0 only when exact.

    What the factory and the model print goes to stderr; stdout carries only the
    report, or with ``--json`` only one JSON document, on success and failure alike.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    out = sys.stdout
    want_json = "--json" in argv
    p = _parser(prog)
    a = None
    try:
        try:
            a = p.parse_args(argv)
        except _UsageError as e:
            raise _Failure(EXIT_USAGE, "usage", str(e)) from None
        except SystemExit as e:  # --help printed: argparse's own exit
            return e.code if isinstance(e.code, int) else EXIT_USAGE
        with _StdoutToStderr():
            name, result = _run(a)
    except _Failure as f:
        return _fail(f, p, out, want_json, a is not None and a.traceback)
    except KeyboardInterrupt:
        return _fail(_Failure(EXIT_INTERRUPTED, "interrupted",
                              "interrupted (KeyboardInterrupt): no verdict. The model was left "
                              "as it was found."), p, out, want_json, False)
    except Exception as e:  # check's own code, outside the user's and the step with ssdtrain
        return _fail(_Failure(EXIT_MISMATCH, "ssdtrain",
                              f"ssdtrain check itself failed: {type(e).__name__}: {e}. Please "
                              f"report it, with the output of --traceback.",
                              traceback.format_exc()), p, out, want_json,
                     a is not None and a.traceback)
    if want_json:
        print(json.dumps(result.to_json(), indent=2, allow_nan=False), file=out)
    else:
        print(f"ssdtrain check: {name} on {result.device}", file=out)
        print(result.report(), file=out)
    out.flush()
    return result.exit_status


def _fail(f: _Failure, p, out, want_json: bool, show_trace: bool) -> int:
    if f.cause == "usage":
        p.print_usage(sys.stderr)
    if show_trace and f.trace:
        sys.stderr.write(f.trace)
    print(f"{p.prog}: error: {f.message}", file=sys.stderr)
    sys.stderr.flush()
    if want_json:
        doc = {"verdict": "interrupted" if f.status == EXIT_INTERRUPTED else "error",
               "exact": False, "exit_status": f.status, "cause": f.cause, "error": f.message}
        print(json.dumps(doc, indent=2), file=out)
        out.flush()
    return f.status
