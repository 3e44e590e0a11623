"""begin_forward / intercept / end_forward: one forward pass, interception per layer.

This is the shape of per-layer offload contexts (Megatron's TransformerBlock enters
one around each layer): only the layers inside ``intercept()`` are offloaded, the
pass ends once, and backward is exact.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import ssdtrain
from helpers import assert_same

WIDTH, ROWS = 256, 512  # one saved activation: 512 KiB in fp32


class Stack(nn.Module):
    def __init__(self, depth=6):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(depth))

    def forward(self, x, off=None, offload=()):
        if off is not None:
            off.begin_forward()
        for i, layer in enumerate(self.layers):
            scope = off.intercept() if off is not None and i in offload \
                else contextlib.nullcontext()
            with scope:
                x = layer(x)
        if off is not None:
            off.end_forward()
        return x.square().mean()


def _step(model, x, off=None, offload=()):
    model.zero_grad(set_to_none=True)
    loss = model(x, off, offload)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture
def model_and_input():
    torch.manual_seed(1)
    return Stack(), torch.randn(ROWS, WIDTH)


def test_only_intercepted_layers_offload(make_offloader, model_and_input):
    model, x = model_and_input
    ref = _step(model, x)
    for offload, expect_layers in (({0, 1, 2}, 3), ({1, 4}, 2), (set(), 0)):
        off = make_offloader(min_tensor_bytes="64KiB", keep_tail_bytes=0)
        assert_same(ref, _step(model, x, off, offload))
        off.wait()
        s = off.stats()
        # Each layer saves its Linear input and its GELU input (512 KiB each).
        assert s.unique_bytes == expect_layers * 2 * ROWS * WIDTH * 4
        assert s.offloaded_bytes == s.unique_bytes
        assert s.prefetch_misses == 0
        assert off.live_records() == 0


def test_steps_repeat_and_slots_are_reused(make_offloader, model_and_input):
    model, x = model_and_input
    ref = _step(model, x)
    off = make_offloader(min_tensor_bytes="64KiB", keep_tail_bytes=0)
    for _ in range(3):
        assert_same(ref, _step(model, x, off, {0, 2, 3}))
    off.wait()
    assert off.stats().records_written == 3 * 3 * 2
    assert off.live_records() == 0


def test_misuse_is_refused_with_clear_errors(make_offloader):
    off = make_offloader()
    with pytest.raises(ssdtrain.SSDTrainError, match="needs an open forward pass"):
        with off.intercept():
            pass
    with pytest.raises(ssdtrain.SSDTrainError, match="no open forward pass"):
        off.end_forward()
    off.begin_forward()
    assert off.in_forward
    with pytest.raises(ssdtrain.SSDTrainError, match="already open"):
        off.begin_forward()
    with pytest.raises(ssdtrain.SSDTrainError, match="already open"):
        off.__enter__()
    with off.intercept():
        with pytest.raises(ssdtrain.SSDTrainError, match="while intercepting"):
            off.end_forward()
        with pytest.raises(ssdtrain.SSDTrainError, match="already intercepting"):
            with off.intercept():
                pass
    with pytest.raises(ssdtrain.SSDTrainError, match="inside a forward pass"):
        off.close()
    off.end_forward()
    assert not off.in_forward
    with off:  # the plain form still works after the explicit one
        assert off.in_forward


def test_an_exception_inside_intercept_turns_interception_off(make_offloader):
    off = make_offloader(min_tensor_bytes=1, keep_tail_bytes=0)
    x = torch.randn(64, 64, requires_grad=True)
    off.begin_forward()
    with pytest.raises(ZeroDivisionError):
        with off.intercept():
            raise ZeroDivisionError
    y = x.sin()  # not intercepted any more: saved as usual
    off.end_forward()
    y.sum().backward()
    assert off.stats().packed_bytes == 0
    assert torch.equal(x.grad, x.detach().cos())
