"""Offloader.attach / detach: forward hooks that run every training forward as one pass.

See NOTE [ Which calls of an attached module offload ] in ssdtrain/_offloader/attach.py.
"""

from __future__ import annotations

import gc
import logging
import threading

import pytest
import torch
from torch import nn

import ssdtrain
from helpers import assert_same, run_step
from models import mlp

SMALL = dict(min_tensor_bytes="64KiB", keep_tail_bytes=0)


def _offloaded_steps(model, inputs, off, steps=3):
    """``steps`` plain steps (no ``with``): the attachment must do the offloading."""
    return [run_step(model, inputs) for _ in range(steps)]


def test_attached_training_steps_are_exact_and_offload(make_offloader):
    model, inputs = mlp()
    ref = run_step(model, inputs)
    off = make_offloader(**SMALL)
    assert off.attach(model) is model
    for got in _offloaded_steps(model, inputs, off):
        assert_same(ref, got)
    off.wait()
    s = off.stats()
    assert off._attachments[0].passes == 3
    assert s.offloaded_bytes > 0 and s.records_written > 0
    assert s.prefetch_misses == 0
    assert not off.in_forward
    assert off.live_records() == 0


def test_detach_stops_offloading(make_offloader):
    model, inputs = mlp()
    off = make_offloader(**SMALL)
    off.attach(model)
    run_step(model, inputs)
    packed = off.stats().packed_bytes
    assert packed > 0
    off.detach()
    ref = run_step(model, inputs)
    assert off.stats().packed_bytes == packed
    assert not model._forward_pre_hooks and not model._forward_hooks
    off.attach(model)  # can be attached again
    assert_same(ref, run_step(model, inputs))
    assert off.stats().packed_bytes == 2 * packed


@pytest.mark.parametrize("context", ["eval", "no_grad", "inference_mode"])
def test_no_pass_without_training_forward(make_offloader, context):
    model, inputs = mlp()
    off = make_offloader(**SMALL)
    off.attach(model)
    if context == "eval":
        model.eval()
        with torch.enable_grad():  # eval alone decides it, even with grad on
            model(*inputs)
    elif context == "no_grad":
        with torch.no_grad():
            model(*inputs)
    else:
        with torch.inference_mode():
            model(*inputs)
    assert off._attachments[0].passes == 0
    assert off.stats().packed_bytes == 0
    model.train()
    run_step(model, inputs)
    assert off._attachments[0].passes == 1 and off.stats().packed_bytes > 0


class Recursive(nn.Module):
    """Calls itself (re-entrant forward) ``depth`` times; every call saves an activation."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(256, 256)
        self.inner_calls = 0

    def forward(self, x, depth=2):
        self.inner_calls += 1
        x = torch.tanh(self.lin(x))
        if depth:
            x = torch.sigmoid(self(x, depth - 1))  # saved after the inner call returned
        return x if depth < 2 else x.square().mean()


def test_only_the_outermost_call_opens_a_pass(make_offloader):
    model = Recursive()
    x = torch.randn(512, 256)
    ref = run_step(model, (x,))
    off = make_offloader(**SMALL)
    off.attach(model)
    seen = []
    begin = off._open_forward  # what begin_forward() and the attach hook call

    def counting_begin(site):
        seen.append(off.in_forward)
        begin(site)

    off._open_forward = counting_begin
    model.inner_calls = 0
    assert_same(ref, run_step(model, (x,)))
    assert model.inner_calls == 3
    assert seen == [False]  # one pass, opened by the outermost call
    off.wait()
    s = off.stats()
    # Every activation of the three calls belongs to that pass, including the sigmoid
    # outputs saved after the inner calls returned (their hooks did not end it): the
    # input, three tanh and two sigmoid outputs, 512 KiB each (the rest are dedups).
    assert s.unique_bytes == 6 * 512 * 256 * 4
    assert s.offloaded_bytes > 0


def test_inside_an_open_pass_the_call_is_a_no_op(make_offloader):
    model, inputs = mlp()
    ref = run_step(model, inputs)
    off = make_offloader(**SMALL)
    off.attach(model)
    assert_same(ref, run_step(model, inputs, off))  # `with off:` around the call
    assert off._attachments[0].passes == 0
    off.wait()  # offloaded_bytes counts writes when they complete
    assert off.stats().offloaded_bytes > 0


def test_an_enclosing_saved_tensors_hooks_context_keeps_the_tensors(make_offloader):
    model, inputs = mlp()
    off = make_offloader(**SMALL)
    off.attach(model)
    packed = []

    def pack(t):
        packed.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(*inputs)
    loss.backward()
    assert packed  # the enclosing hooks got every saved tensor
    assert off._attachments[0].passes == 0 and off.stats().packed_bytes == 0


class Failing(nn.Module):
    def __init__(self, exc=None):
        super().__init__()
        self.lin = nn.Linear(256, 256)
        self.exc = exc

    def forward(self, x):
        y = torch.tanh(self.lin(x))
        if self.exc is not None:
            raise self.exc("boom")  # a new exception each call: no traceback kept alive
        return y.square().mean()


def test_an_exception_in_forward_ends_the_pass(make_offloader):
    model = Failing(ValueError)
    x = torch.randn(512, 256)
    off = make_offloader(**SMALL)
    off.attach(model)
    with pytest.raises(ValueError, match="boom"):
        model(x)
    assert not off.in_forward and off._hooks is None
    # nothing outside forward is intercepted any more
    before = off.stats().packed_bytes
    (torch.randn(512, 256, requires_grad=True) * 2).sin().sum().backward()
    assert off.stats().packed_bytes == before
    gc.collect()
    off.wait()  # a record whose handles died while its write was in flight goes when it ends
    assert off.live_records() == 0  # the dropped graph released its records
    model.exc = None
    model.zero_grad()
    ref = run_step(model, (x,))
    off.detach()
    assert_same(ref, run_step(model, (x,)))


def test_an_interrupted_forward_is_closed_at_the_next_call(make_offloader, caplog):
    model = Failing(KeyboardInterrupt)  # a BaseException: torch skips always_call hooks
    x = torch.randn(512, 256)
    off = make_offloader(**SMALL)
    off.attach(model)
    with pytest.raises(KeyboardInterrupt):
        model(x)
    assert off.in_forward  # left open: no hook ran
    model.exc = None
    with caplog.at_level(logging.WARNING, logger="ssdtrain"):
        loss = model(x)
    assert "did not finish" in caplog.text
    assert not off.in_forward and off._hooks is None
    loss.backward()
    assert off._attachments[0].passes == 2
    # detach() closes a pass left open the same way
    model.exc = KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        model(x)
    assert off.in_forward
    off.detach()
    assert not off.in_forward and off._hooks is None
    off.close()


def test_gradient_accumulation(make_offloader):
    model, (x, y) = mlp()
    micro = [(x[i::4], y[i::4]) for i in range(4)]

    def accumulate():
        model.zero_grad(set_to_none=True)
        losses = []
        for xb, yb in micro:  # every forward's graph alive until its backward
            loss = model(xb, yb) / len(micro)
            loss.backward()
            losses.append(loss.detach())
        return losses, {n: p.grad.clone() for n, p in model.named_parameters()}

    def accumulate_all_then_backward():
        model.zero_grad(set_to_none=True)
        losses = [model(xb, yb) / len(micro) for xb, yb in micro]  # four graphs at once
        sum(losses).backward()
        return [l.detach() for l in losses], {n: p.grad.clone() for n, p in model.named_parameters()}

    ref1, ref2 = accumulate(), accumulate_all_then_backward()
    off = make_offloader(min_tensor_bytes="16KiB", keep_tail_bytes=0)
    off.attach(model)
    for ref, got in ((ref1, accumulate()), (ref2, accumulate_all_then_backward())):
        assert all(torch.equal(a, b) for a, b in zip(ref[0], got[0]))
        for name, g in ref[1].items():
            assert torch.equal(g, got[1][name]), name
    off.wait()
    assert off._attachments[0].passes == 8
    assert off.stats().offloaded_bytes > 0 and off.stats().prefetch_misses == 0
    assert off.live_records() == 0


def test_attach_errors(make_offloader):
    model, inputs = mlp()
    off = make_offloader(**SMALL)
    with pytest.raises(ssdtrain.SSDTrainError, match="nn.Module"):
        off.attach(lambda x: x)
    off.attach(model)
    with pytest.raises(ssdtrain.SSDTrainError, match="already attached"):
        off.attach(model)
    off.close()
    with pytest.raises(ssdtrain.OffloaderClosedError):
        model(*inputs)  # never silently trains without the offloader it was given
    with pytest.raises(ssdtrain.OffloaderClosedError):
        off.attach(mlp()[0])
    off.detach()
    model(*inputs).backward()  # detached: runs untouched


def test_a_second_thread_is_refused_while_a_pass_is_open(make_offloader):
    gate, done = threading.Event(), threading.Event()

    class Waits(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            if threading.current_thread() is threading.main_thread():
                gate.set()
                assert done.wait(30)
            return self.lin(x).sum()

    model = Waits()
    off = make_offloader(**SMALL)
    off.attach(model)
    errors = []

    def other():
        assert gate.wait(30)
        try:
            model(torch.randn(2, 8))
        except ssdtrain.SSDTrainError as e:
            errors.append(e)
        finally:
            done.set()

    t = threading.Thread(target=other)
    t.start()
    model(torch.randn(2, 8)).backward()
    t.join(30)
    assert len(errors) == 1 and "another thread" in str(errors[0])
    assert not off.in_forward
