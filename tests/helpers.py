"""Helpers shared by the test files: one training step, exact comparison, saving by hand.

Imported as a plain module (``from helpers import run_step``); conftest.py puts this
directory on ``sys.path``.
"""

from __future__ import annotations

import contextlib
import threading

import torch

__all__ = ["run_step", "assert_same", "SaveForBackward", "save_and_unpack", "EngineCalls"]


def run_step(model, inputs, offloader=None, *, settle=False, backward_inside=False):
    """One step: zero grads, forward (under ``offloader`` when given), backward.

    Args:
        model: the module; its forward returns a scalar loss.
        inputs: positional arguments of ``model``.
        offloader: an :class:`ssdtrain.Offloader`, or ``None`` for the reference run.
        settle: call ``offloader.wait()`` before leaving the ``with`` block, so every
            write has completed when forward ends (prefetch then has to read, not
            forward, each record). Default False: writes may still be in flight.
        backward_inside: call ``backward()`` inside the ``with`` block. Default False.

    Returns:
        ``(loss, grads)``: the detached loss and ``{name: grad}``, both cloned.
    """
    model.zero_grad(set_to_none=True)
    ctx = offloader if offloader is not None else contextlib.nullcontext()
    with ctx:
        loss = model(*inputs)
        if settle and offloader is not None:
            offloader.wait()
        if backward_inside:
            loss.backward()
    if not backward_inside:
        loss.backward()
    grads = {name: (None if p.grad is None else p.grad.clone())
             for name, p in model.named_parameters()}
    return loss.detach().clone(), grads


def assert_same(ref, got):
    """``ref`` and ``got`` are ``run_step`` results that must be bitwise equal."""
    ref_loss, ref_grads = ref
    loss, grads = got
    assert loss.dtype == ref_loss.dtype
    assert torch.equal(loss, ref_loss), f"loss {loss.item()!r} != reference {ref_loss.item()!r}"
    assert grads.keys() == ref_grads.keys()
    for name, ref_grad in ref_grads.items():
        assert ref_grad is not None, f"reference gradient of {name} is None"
        grad = grads[name]
        assert grad is not None, f"gradient of {name} is None"
        assert grad.dtype == ref_grad.dtype and grad.shape == ref_grad.shape, name
        if not torch.equal(grad, ref_grad):
            diff = (grad.double() - ref_grad.double()).abs().max().item()
            raise AssertionError(f"gradient of {name} differs from the reference "
                                 f"(max abs diff {diff!r})")


class SaveForBackward(torch.autograd.Function):
    """Saves arbitrary tensors (any dtype, any view) with ``ctx.save_for_backward``.

    ``SaveForBackward.apply(anchor, sink, *tensors)`` returns ``anchor * 1``; the
    backward appends what ``ctx.saved_tensors`` gave back to the list ``sink``
    (the unpacked tensors themselves, so their geometry can be checked). ``anchor``
    must require grad so that there is a graph at all.
    """

    @staticmethod
    def forward(ctx, anchor, sink, *tensors):
        ctx.sink = sink
        ctx.save_for_backward(*tensors)
        return anchor * 1

    @staticmethod
    def backward(ctx, grad):
        ctx.sink.append(list(ctx.saved_tensors))
        return (grad, None) + (None,) * len(ctx.needs_input_grad[2:])


def save_and_unpack(tensors, offloader, *, settle=True):
    """Save ``tensors`` under ``offloader`` in one node, run backward, return the unpacked ones.

    With ``settle`` (default True) every write has completed before the ``with``
    block ends.
    """
    anchor = torch.zeros((), requires_grad=True)
    sink = []
    with offloader:
        out = SaveForBackward.apply(anchor, sink, *tensors)
        if settle:
            offloader.wait()
    out.backward()
    assert len(sink) == 1
    return sink[0]


class EngineCalls:
    """Counts the requests an offloader's engine receives (one call per record I/O).

    Wraps ``engine.write`` and ``engine.read`` on the instance; ``writes`` and
    ``reads`` list ``(address, nbytes)`` per call.
    """

    def __init__(self, offloader):
        self.engine = offloader._store.engine
        self.writes = []
        self.reads = []
        self._lock = threading.Lock()
        self._write, self._read = self.engine.write, self.engine.read
        self.engine.write = self._wrap(self._write, self.writes)
        self.engine.read = self._wrap(self._read, self.reads)

    def _wrap(self, fn, calls):
        def counted(file, offset, address, nbytes, **kw):  # kw: crc=True (Engine.checksums)
            with self._lock:
                calls.append((address, nbytes))
            return fn(file, offset, address, nbytes, **kw)
        return counted

    def writes_within(self, storage: torch.UntypedStorage):
        """The write calls whose source bytes lie inside ``storage``."""
        lo, hi = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
        return [(a, n) for a, n in self.writes if lo <= a and a + n <= hi]


def grads(model):
    """``{name: grad}`` of ``model``'s parameters, cloned."""
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def assert_grads_equal(ref, got):
    """Every gradient of ``got`` is ``torch.equal`` to ``ref``'s (same names)."""
    assert ref.keys() == got.keys()
    for name, g in ref.items():
        assert torch.equal(got[name], g), f"gradient of {name} differs from the reference"


def variant(inputs, i):
    """Micro-batch ``i``: floating inputs scaled, integer ones (tokens, labels) rolled."""
    return tuple(t * (1 + i / 8) if t.is_floating_point() else torch.roll(t, i, dims=-1)
                 for t in inputs)
