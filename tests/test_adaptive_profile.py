"""No silent policy: the adaptive profile completes for layers whose
input needs no grad, says why when it cannot complete or a budget cannot be met, and
times compute, not kernel launches, on asynchronous devices."""

from __future__ import annotations

import logging
import types

import pytest
import torch
from torch import nn

import ssdtrain
from helpers import assert_same, run_step
from ssdtrain import _profile
from ssdtrain._planner import KEEP, OFFLOAD, predict

KiB = 1 << 10
MiB = 1 << 20
SMALL = dict(min_tensor_bytes=1 * KiB, keep_tail_bytes=0, prefetch_bytes=4 * MiB)
D = 64


@pytest.fixture(autouse=True)
def _one_compute_thread():
    """Tiny ops: intra-op threads only wait for each other on a shared 2-core box."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class MLP(nn.Module):
    """Tracked blocks fed the raw batch (nothing before them requires grad)."""

    def __init__(self, n=3, frozen_first=False, extra=False):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(D, D), nn.ReLU())
                                     for _ in range(n)])
        if frozen_first:
            self.blocks[0].requires_grad_(False)
        self.unused = nn.Linear(D, D) if extra else None  # tracked, never called

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x.square().mean()


def _x():
    return torch.randn(32, D, generator=torch.Generator().manual_seed(0))


def _adaptive(make_offloader, model, budget=1 << 40, layers=None, **kw):
    off = make_offloader(policy="adaptive", memory_budget_bytes=budget, profile_steps=2,
                         **dict(SMALL, **kw)).track(model, layers=layers)
    off._layers.bandwidth = (1e9, 1e9)  # as if probed (the probe is not under test here)
    return off


def _trained(result):
    """A ``run_step`` result without the frozen parameters (their gradient is None)."""
    loss, grads = result
    return loss, {k: g for k, g in grads.items() if g is not None}


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and r.name == "ssdtrain"]


@pytest.mark.parametrize("frozen_first", [False, True], ids=["raw-input", "frozen-first"])
def test_adaptive_plans_when_the_first_layer_gets_the_raw_input(make_offloader, caplog,
                                                                frozen_first):
    """The first block's input does not require grad (and with frozen_first, neither
    does its output): the profile still completes, the plan is made at the beginning of
    step profile_steps + 2 and its budget applies, silently only because all is well."""
    model, x = MLP(frozen_first=frozen_first), _x()
    ref = run_step(model, (x,))
    off = _adaptive(make_offloader, model, budget=256 * KiB)
    caplog.set_level(logging.WARNING, logger="ssdtrain")
    for step in range(4):
        assert_same(_trained(ref), _trained(run_step(model, (x,), off)))
        assert (off.active_plan is not None) == (step >= 3), step
    assert not _warnings(caplog)
    p = off.active_plan
    assert off._store.write_behind == p.write_behind_bytes
    # The first block's backward was timed (its end from its parameters' gradients),
    # or it has none; the others' as before.
    for s in off._layers.profiler.profiled:
        assert s.has_bwd == [not frozen_first, True, True]
        assert (s.bwd_s[0] == 0) if frozen_first else (s.bwd_s[0] > 0), s.bwd_s
        assert all(t > 0 for t in s.bwd_s[1:]), s.bwd_s


@pytest.mark.parametrize("case", ["layer-not-called", "no-backward", "nothing-trains"])
def test_adaptive_says_why_it_cannot_plan(make_offloader, caplog, case):
    """A profile that cannot complete is reported, with the reason and the fix, by
    the beginning of step profile_steps + 2 (here: at the beginning of step 2), once."""
    model, x = MLP(extra=case == "layer-not-called"), _x()
    layers = None
    if case == "layer-not-called":
        layers = [*model.blocks, model.unused]
    if case == "nothing-trains":
        model.blocks.requires_grad_(False)
        model.head = nn.Parameter(torch.ones(()))
    off = _adaptive(make_offloader, model, layers=layers)
    caplog.set_level(logging.WARNING, logger="ssdtrain")
    expected = {"layer-not-called": ("did not run", "track(model, layers=[...])"),
                "no-backward": ("was not seen before the next forward", "loss.backward()"),
                "nothing-trains": ("no tracked layer's output requires grad",
                                   "track the layers that train")}[case]
    for step in range(6):
        with off:
            loss = model(x) * (model.head if case == "nothing-trains" else 1)
        if step == 1:  # the beginning of step 2 closed step 1
            warned = _warnings(caplog)
            assert len(warned) == 1, warned
            assert expected[0] in warned[0] and expected[1] in warned[0], warned[0]
            assert "memory_budget_bytes" in warned[0] and "not applied" in warned[0]
        if case != "no-backward":
            loss.backward()
    assert off.active_plan is None
    assert len(_warnings(caplog)) == 1  # once per reason, not every step
    with pytest.raises(ssdtrain.SSDTrainError, match=expected[0]):
        off.plan()


def test_budget_that_cannot_be_met_is_said(make_offloader, caplog):
    model, x = MLP(), _x()
    off = _adaptive(make_offloader, model, budget=1)
    caplog.set_level(logging.WARNING, logger="ssdtrain")
    for _ in range(4):  # 2 profiled, 1 recompute-all, planned at the beginning of step 4
        run_step(model, (x,), off)
    assert not off.active_plan.fits
    warned = _warnings(caplog)
    assert len(warned) == 1 and "memory_budget_bytes=1" in warned[0] and "Raise" in warned[0]
    off.set_plan([OFFLOAD] * 3)  # set by hand, over the budget: said too
    warned = _warnings(caplog)
    assert len(warned) == 2 and "set_plan()" in warned[1] and "over memory_budget_bytes=1" \
        in warned[1]


class _Launch(torch.autograd.Function):
    """Pretends to launch asynchronous kernels: forward queues 0.25 s of device work,
    backward 0.5 s; only a synchronize lets the fake clock see them run."""

    @staticmethod
    def forward(ctx, x, device):
        ctx.device = device
        device.pending += 0.25
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        ctx.device.pending += 0.5
        return grad * 2, None


class _FakeDevice:
    def __init__(self):
        self.clock = 0.0
        self.pending = 0.0
        self.syncs = 0

    def perf_counter(self):
        return self.clock

    def synchronize(self, device=None):
        self.syncs += 1
        self.clock += self.pending
        self.pending = 0.0


class _AsyncBlock(nn.Module):
    def __init__(self, device):
        super().__init__()
        self.w = nn.Parameter(torch.ones(D))
        self.device = device

    def forward(self, x):
        return _Launch.apply(x * self.w, self.device)


def test_profile_times_device_work_not_launches(make_offloader, monkeypatch):
    """NOTE [ Timing asynchronous devices ]: on timed steps every timestamp follows a
    synchronize of the layers' devices, so a layer's times are its kernels' run time
    (here a fake device and clock: exactly 0.25 s forward, 0.5 s backward per layer;
    with perf_counter alone they read 0). Steps that are not timed never synchronize."""
    dev = _FakeDevice()
    monkeypatch.setattr(_profile, "time", types.SimpleNamespace(perf_counter=dev.perf_counter))
    monkeypatch.setattr(torch.cpu, "synchronize", dev.synchronize)
    model = nn.Module()
    model.blocks = nn.ModuleList([_AsyncBlock(dev) for _ in range(3)])
    x = torch.randn(4, D)
    # Nothing is offloaded (all below min_tensor_bytes): no stall is subtracted.
    off = make_offloader(profile_steps=2, min_tensor_bytes=1 << 30).track(model)

    def step():
        with off:
            y = x
            for b in model.blocks:
                y = b(y)
            loss = y.sum()
        loss.backward()

    for _ in range(3):  # steps 1-2 timed; step 3 begins them complete
        step()
    layers, _ = off._layers.profiler.costs()
    assert [layer.fwd_s for layer in layers] == [0.25] * 3
    assert [layer.bwd_s for layer in layers] == [0.5] * 3
    before = dev.syncs
    assert before > 0
    step()
    step()
    assert dev.syncs == before  # untimed steps: no synchronize


class _Embed(torch.autograd.Function):
    """The embedding before the tracked blocks: 0.125 s of device work in backward, after
    the first block's backward has ended (the rest of backward, ``tail_s``)."""

    @staticmethod
    def forward(ctx, x, device):
        ctx.device = device
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        ctx.device.pending += 0.125
        return grad, None


def test_profile_splits_the_rest_of_backward_from_what_follows_it(make_offloader, monkeypatch):
    """NOTE [ The end of backward ]: the time from the first layer's backward end to the
    end of backward (the embedding's backward, 0.125 s here) is ``tail_s``; what the
    loop does after backward until the next forward (1 s of fake optimizer here) is
    ``between_s``: it is in the predicted step (``step_s``), not in
    ``backward_end_s``. Before the split, the 1 s was in ``tail_s``."""
    dev = _FakeDevice()
    monkeypatch.setattr(_profile, "time", types.SimpleNamespace(perf_counter=dev.perf_counter))
    monkeypatch.setattr(torch.cpu, "synchronize", dev.synchronize)
    model = nn.Module()
    model.blocks = nn.ModuleList([_AsyncBlock(dev) for _ in range(3)])
    src = nn.Parameter(torch.randn(4, D))
    off = make_offloader(profile_steps=2, min_tensor_bytes=1 << 30).track(model)

    def step():
        with off:
            y = _Embed.apply(src, dev)
            for b in model.blocks:
                y = b(y)
            loss = y.sum()
        loss.backward()
        dev.clock += 1.0  # the optimizer, the next batch: between backward and forward

    for _ in range(3):  # steps 1-2 timed; step 3 begins them complete
        step()
    layers, parts = off._layers.profiler.costs()
    assert parts["tail_s"] == pytest.approx(0.125) and parts["between_s"] == pytest.approx(1.0)
    cost = _profile.step_cost(parts, 1e9, 1e9, off.config)
    pred = predict(layers, [KEEP] * 3, cost)
    assert pred.backward_end_s == pytest.approx(3 * 0.25 + 3 * 0.5 + 0.125)
    assert pred.step_s == pytest.approx(pred.backward_end_s + 1.0)
