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
from ssdtrain import testing
from helpers import assert_same, run_step
from ssdtrain._policies import profile as _profile
from ssdtrain._policies.planner import KEEP, OFFLOAD, RECOMPUTE, predict

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
    assert testing.write_behind(off) == p.write_behind_bytes
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
    """No plan fits: said when the plan is made, and again (with the numbers) when a step
    under it is measured over the budget (NOTE [ Measured memory ]); Stats has both."""
    from ssdtrain._policies.adaptive import _size
    model, x = MLP(), _x()
    off = _adaptive(make_offloader, model, budget=1)
    caplog.set_level(logging.WARNING, logger="ssdtrain")
    for _ in range(3):  # 2 profiled, 1 recompute-all: no plan, nothing measured
        run_step(model, (x,), off)
    assert off.stats().budget_measured_bytes == 0 and not _warnings(caplog)
    run_step(model, (x,), off)  # planned at its beginning, measured to its backward's end
    assert not off.active_plan.fits
    warned = _warnings(caplog)
    assert len(warned) == 2 and "memory_budget_bytes=1" in warned[0] and "Raise" in warned[0]
    st = off.stats()
    assert st.budget_measured_bytes > 0
    assert st.budget_exceeded_bytes == st.budget_measured_bytes - 1
    assert "memory_budget_bytes=1 (1 B) was exceeded" in warned[1]
    assert f"held {_size(st.budget_measured_bytes)}" in warned[1]
    assert f"{_size(st.budget_exceeded_bytes)} over the budget" in warned[1]
    assert "No plan is predicted to fit" in warned[1] and "To stay within the budget" in warned[1]
    assert off.replans == 0  # nothing to re-plan for: the prediction said so
    run_step(model, (x,), off)
    assert len(_warnings(caplog)) == 2  # once per offloader
    assert off.stats().budget_exceeded_bytes == st.budget_exceeded_bytes
    off.set_plan([OFFLOAD] * 3)  # set by hand, over the budget: said too
    warned = _warnings(caplog)
    assert len(warned) == 3 and "set_plan()" in warned[2] and "over memory_budget_bytes=1" \
        in warned[2]


def test_budget_met_is_measured_and_silent(make_offloader, caplog):
    """A budget the plan fits: every step under it is measured (Stats), within the
    budget and the prediction; nothing is said, nothing re-planned.

    Each step's I/O is settled before the next begins: the prediction takes the disk
    to be as fast as the bandwidth set below, and on a slower one an earlier step's
    writes still in flight (the recompute-all step's inputs) are held, and measured,
    in the next (SSDTRAIN_TEST_IO_DELAY_MS)."""
    model, x = MLP(), _x()
    ref = run_step(model, (x,))
    off = _adaptive(make_offloader, model, budget=1 * MiB)
    caplog.set_level(logging.WARNING, logger="ssdtrain")
    for _ in range(6):
        assert_same(ref, run_step(model, (x,), off))
        off.wait()
    p = off.active_plan
    st = off.stats()
    assert p.fits and 0 < st.budget_measured_bytes <= p.prediction.peak_bytes <= 1 * MiB
    assert st.budget_exceeded_bytes == 0 and off.replans == 0
    assert not _warnings(caplog)


def _late_frees(off):
    """The store's I/O thread never wakes: the memory the store lets go of stays
    allocated until something releases it (on a loaded machine the thread may not run
    for a while; here, deterministically, never)."""
    testing.wrap_io(off, wake=lambda kick: lambda: None)


def _planned(make_offloader, choices, budget, policy):
    """An MLP, an offloader tracking it after its profile steps, and ``choices`` set as
    its plan (predicted under ``budget``)."""
    model = MLP()
    off = make_offloader(policy=policy, memory_budget_bytes=budget, profile_steps=1, **SMALL)
    off.track(model)._layers.bandwidth = (1e9, 1e9)
    for _ in range(2 if policy == "static" else 3):  # profiled (+ recompute-all, + planned)
        run_step(model, (_x(),), off)
    return model, off, off.set_plan(choices)


def _tight(make_offloader, choices, policy):
    """``_planned`` under a budget of exactly the plan's predicted peak."""
    _, probe, p = _planned(make_offloader, choices, 1 << 40, policy)
    probe.close()
    model, off, q = _planned(make_offloader, choices, p.prediction.peak_bytes, policy)
    assert q.fits and q.prediction.peak_bytes == p.prediction.peak_bytes
    return model, off, q


@pytest.mark.parametrize("release", [True, False], ids=["released", "not-released"])
def test_memory_let_go_late_is_released_at_layer_boundaries(make_offloader, caplog,
                                                            monkeypatch, release):
    """NOTE [ Measured memory ], late frees: the kept layers' records, let go of in their
    backward, stay allocated when the I/O thread lags, through the recomputed first
    layer's backward, which the plan predicted to hold only its own working set (on the
    accelerator emulator: 45.1 MiB held for 41.0 predicted). The policy releases them at
    each layer boundary: a budget equal to the prediction is met exactly. Without that
    release (``not-released``) the step is measured over the budget and it is said."""
    choices = [RECOMPUTE, KEEP, KEEP]
    model, off, p = _tight(make_offloader, choices, "static")
    budget = p.prediction.peak_bytes
    x = _x()
    ref = run_step(model, (x,))
    # The earlier steps' writes land first: else the first step measured holds them too
    # while they are in flight (a slow disk), and more than the second.
    off.wait()
    _late_frees(off)
    if not release:
        monkeypatch.setattr(off._layers, "_release_dropped", lambda: False)
    caplog.set_level(logging.WARNING, logger="ssdtrain")
    measured = []  # each step's peak: how late the frees land (the I/O thread's lag) varies
    for _ in range(2):
        assert_same(ref, run_step(model, (x,), off))
        measured.append(off.stats().budget_measured_bytes)
    st = off.stats()
    if release:
        assert st.budget_measured_bytes == budget and st.budget_exceeded_bytes == 0
        assert not _warnings(caplog)
    else:
        # The kept layers' records on top of the recomputed layer's working set.
        late = sum(layer.saved_bytes for layer, c in zip(p.layers, choices) if c == KEEP)
        assert min(measured) >= budget + late // 2, (measured, budget, late)
        assert st.budget_exceeded_bytes == max(measured) - budget, (st, measured)
        warned = _warnings(caplog)
        assert len(warned) == 1 and "was exceeded" in warned[0] and "set_plan()" in warned[0]


def test_adaptive_replans_for_what_a_step_held_beyond_the_prediction(make_offloader, caplog,
                                                                      monkeypatch):
    """NOTE [ Measured memory ]: a plan predicted to fit held more (memory let go of late,
    never released here): said once, and the plan is made again with the difference
    counted as held (``StepCost.fixed_bytes``, a note in the table), so that every
    prediction from then on includes it."""
    model, off, p = _tight(make_offloader, [RECOMPUTE, KEEP, KEEP], "adaptive")
    x = _x()
    ref = run_step(model, (x,))
    _late_frees(off)
    monkeypatch.setattr(off._layers, "_release_dropped", lambda: False)
    caplog.set_level(logging.WARNING, logger="ssdtrain")
    assert_same(ref, run_step(model, (x,), off))
    held = off.stats().budget_measured_bytes
    assert held > p.prediction.peak_bytes and off.replans == 0
    warned = _warnings(caplog)
    assert len(warned) == 1 and "ssdtrain re-plans with the" in warned[0]
    assert_same(ref, run_step(model, (x,), off))  # begins with the re-plan
    assert off.replans == 1 and off._layers.history[-1][0].startswith("re-plan 1")
    margin = off._layers.margin
    assert margin == held - p.prediction.peak_bytes
    q = off.active_plan
    assert q.step.fixed_bytes == margin and q.prediction.peak_bytes >= margin
    assert "earlier steps held beyond their plan's prediction" in str(q)
    assert len(_warnings(caplog)) <= 2  # the overshoot once; "no plan fits" if none does


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
