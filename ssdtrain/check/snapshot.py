"""The state a step can change, taken before a check and put back after each step
(NOTE [ What a check restores ])."""

from __future__ import annotations

import random
import sys
from typing import Dict

import torch

from .._device.cuda import rng_state as _rng_state, set_rng_state as _set_rng_state


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
