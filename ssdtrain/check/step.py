"""One training step of a check: forward, the loss, backward, and everything it gives
to compare (the loss, gradients, buffers, module tensors, RNG states)."""

from __future__ import annotations

import contextlib
import random
import struct
import sys
import time
from typing import Dict

import torch

from .._device.cuda import rng_state as _rng_state
from .._device.cuda import synchronize as _sync
from .._errors import ConfigError


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
