"""Helpers for the tests of the device path on the loopback device (ssdtrain/testing/loopback.py).

Kernels here act as GPU kernels do: they read or write device memory by address when
they run, and hold no reference to it, so a block freed and reused meanwhile is read
or overwritten as it is then (the hazards NOTE [ Device records ] orders against).
"""

from __future__ import annotations

import collections
import ctypes
import os
import sys
import weakref

import torch

from ssdtrain import testing
from ssdtrain.testing.loopback import LoopbackDevice, attach

if os.path.dirname(os.path.abspath(__file__)) not in sys.path:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import helpers  # noqa: E402

__all__ = ["LoopbackDevice", "attach", "loopback_offloader", "write_later", "read_later",
           "SaveForBackward", "SlowRead", "device_chain", "UnpackCheck"]


def loopback_offloader(make_offloader, dev=None, **cfg):
    """An offloader (the ``make_offloader`` fixture) with a loopback device attached."""
    off = make_offloader(**cfg)
    attach(off, dev if dev is not None else LoopbackDevice())
    return off


def write_later(dev, t, value, seconds=0.0):
    """A kernel on the current stream that fills device tensor ``t`` with ``value`` after
    ``seconds`` (a slow producer). Holds no reference to ``t``."""
    src = torch.full_like(t, value, device="cpu")  # host memory: the kernel's "constant"
    ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
    dev.kernel(lambda: ctypes.memmove(ptr, src.data_ptr(), nbytes), seconds=seconds)


def read_later(dev, t, sink, seconds=0.0):
    """A kernel on the current stream that copies device tensor ``t`` into a new host
    tensor appended to ``sink`` after ``seconds`` (a slow consumer). Holds no reference
    to ``t``: it reads whatever is at its address when it runs."""
    ptr, nbytes, like = t.data_ptr(), t.numel() * t.element_size(), torch.empty_like(t)

    def run():
        ctypes.memmove(like.data_ptr(), ptr, nbytes)
        sink.append(like)
    dev.kernel(run, seconds=seconds)


class SaveForBackward(helpers.SaveForBackward):
    """``helpers.SaveForBackward`` whose backward appends clones of what it got back to
    ``sink`` (host ops: on the loopback's default stream they run once the loads have
    landed; the loaded blocks themselves go back to the device afterwards)."""

    @staticmethod
    def backward(ctx, grad):
        ctx.sink.append([t.clone() for t in ctx.saved_tensors])
        return (grad, None) + (None,) * len(ctx.needs_input_grad[2:])


class SlowRead(torch.autograd.Function):
    """``apply(anchor, dev, sink, t, seconds)``: saves ``t``; backward queues a kernel on
    the current stream that reads it after ``seconds`` (:func:`read_later`) and returns
    at once, as backward on a GPU does."""

    @staticmethod
    def forward(ctx, anchor, dev, sink, t, seconds):
        ctx.dev, ctx.sink, ctx.seconds = dev, sink, seconds
        ctx.save_for_backward(t)
        return anchor * 1

    @staticmethod
    def backward(ctx, grad):
        (t,) = ctx.saved_tensors
        read_later(ctx.dev, t, ctx.sink, ctx.seconds)
        return grad, None, None, None, None


def device_chain(off, dev, k, n, at_forward_end=None):
    """A step under ``off``: a forward saving ``k`` device tensors of ``n`` bytes, each in
    its own node, so the activations live in the device's memory; backward checks that
    each came back with its own value. ``at_forward_end()``, if given, runs between
    forward and backward."""
    sink = []
    anchor = torch.zeros((), requires_grad=True)
    with off:
        out = anchor
        for i in range(k):
            d = dev.alloc((n // 4,))
            d.copy_(torch.full((n // 4,), float(i)))
            out = SaveForBackward.apply(out, sink, d)
            del d
    if at_forward_end is not None:
        at_forward_end()
    out.backward()
    assert [float(s[0][0]) for s in sink] == [float(i) for i in reversed(range(k))]


class UnpackCheck:
    """Checks every tensor an offloader's unpack hands to backward against the tensor
    that was saved: the same bytes (a clone taken at pack) and the same address modulo
    ``ALIGN`` (512: rule 6 of NOTE [ Device records ] in ssdtrain/_device/transfers.py), whatever
    path the record took (read from the SSD, loaded from the host tier, claimed while
    its copy or write ran, never moved). A gradient that differs from the reference
    while this check finds nothing was computed from the right bytes at the right
    alignment: the difference is not in what ssdtrain handed back.

    Installed on the offloader's hooks (``testing.wrap_hooks``: ``with offloader:`` pushes
    them as they are then), before the ``with`` block; holds no handle
    (a weak dictionary), so records are released as without it. ``paths`` counts the
    record states unpack served from; ``problems`` lists what differed.
    """

    ALIGN = 512

    def __init__(self, offloader):
        self._saved = weakref.WeakKeyDictionary()  # handle -> (clone, address % ALIGN)
        self.paths = collections.Counter()
        self.problems = []
        self._pack, self._unpack = testing.wrap_hooks(offloader, pack=lambda _: self.pack,
                                                      unpack=lambda _: self.unpack)

    def pack(self, t):
        handle = self._pack(t)
        if getattr(handle, "record", None) is not None:  # kept tensors are t itself
            self._saved[handle] = (t.detach().clone(), t.data_ptr() % self.ALIGN)
        return handle

    def unpack(self, handle):
        rec = getattr(handle, "record", None)
        state = None if rec is None else rec.state.value  # before unpack moves it
        t = self._unpack(handle)
        saved = None if rec is None else self._saved.get(handle)
        if saved is not None:
            self.paths[state] += 1
            want, misalign = saved
            if t.data_ptr() % self.ALIGN != misalign:
                self.problems.append(f"{list(t.shape)} {t.dtype} unpacked from {state} at "
                                     f"{t.data_ptr() % self.ALIGN} modulo {self.ALIGN}, "
                                     f"saved at {misalign}")
            if not torch.equal(t, want):
                self.problems.append(f"{list(t.shape)} {t.dtype} unpacked from {state}: "
                                     f"{int((t != want).sum())} of {t.numel()} elements differ "
                                     f"from the saved tensor")
        return t
