"""Counterexamples hunted in the default policy, ``"auto"`` (NOTE [ The offload quota ]
in ssdtrain/_policies/auto.py), and regression tests of what held up: exactness across its step
transitions, passes that are not training steps, and the memory floor once the hooks
are off (step 5)."""

from __future__ import annotations

import torch

import models
import ssdtrain
from ssdtrain import testing
from helpers import assert_grads_equal, grads
from loopback_helpers import LoopbackDevice, attach, device_chain
from ssdtrain._policies.auto import BASELINE_STEPS, SIZING_STEPS

KiB = 1 << 10
WARMUP = SIZING_STEPS + BASELINE_STEPS
SMALL = dict(min_tensor_bytes="8KiB", keep_tail_bytes=0)


def FAST(n):
    """A disk probe of 1 TB/s: a quota > 0."""
    return n / 1e12, n / 1e12


def SLOW(n):
    """A disk probe of 1 kB/s: quota 0, and the hooks off after the baseline."""
    return n / 1e3, n / 1e3


def test_evaluation_passes_under_no_grad_are_not_steps_of_the_quota(spill_dir):
    """A ``with off:`` forward under ``torch.no_grad()`` (evaluation through the same
    code path as training) saves nothing. Counted as a step of ``"auto"``, its S of 0
    set the next training step's quota to 0, and its short time became the baseline
    step time against which every writing step then read as slowed: on a disk fast
    enough for everything, with an evaluation pass after each training step, no
    training step offloaded anything. Such a pass is not a step (attach() already opens
    none for it): the training steps get their quota, gradients stay exact."""
    model, inputs = models.gpt()
    ref_model, _ = models.gpt()
    ref_model.load_state_dict(model.state_dict())
    off = ssdtrain.Offloader(spill_dir=str(spill_dir), **SMALL)
    assert off.config.policy == "auto"
    off._auto._probe = FAST
    written = []
    try:
        for step in range(WARMUP + 2):
            for m in (model, ref_model):
                m.zero_grad(set_to_none=True)
            before = off.stats().offloaded_bytes
            with off:
                loss = model(*inputs)
            loss.backward()
            ref_model(*inputs).backward()
            assert_grads_equal(grads(ref_model), grads(model))
            written.append(off.stats().offloaded_bytes - before)
            model.eval()
            with torch.no_grad(), off:       # evaluation, as a user's loop may do it
                model(*inputs)
            model.train()
    finally:
        off.close()
    assert written[0] > 0 and written[SIZING_STEPS:WARMUP] == [0] * BASELINE_STEPS, written
    assert all(w > 0 for w in written[WARMUP:]), written


def test_a_step_that_stops_fitting_after_the_hooks_went_off_raises_the_floor(make_offloader):
    """NOTE [ The offload quota ], step 5: 16 N saved on a device of 24 N fit (8 N free,
    above the 10% reserve), and on a slow disk the steps after the baseline push no
    hooks. Then 7 N of the device are taken (an optimizer's state): the next forward,
    not intercepted, leaves N free; its end still reads the memory, so the floor rises
    and the step after intercepts and offloads it (the records that fit in it), within the
    capacity."""
    n, k = 64 * KiB, 16
    dev = LoopbackDevice(capacity=24 * n)
    off = make_offloader(policy="auto", min_tensor_bytes=4096, keep_tail_bytes=0,
                         write_behind_bytes=n, prefetch_bytes=2 * n)
    attach(off, dev)
    off._auto._probe = SLOW
    seen = []
    for _ in range(WARMUP + 1):
        device_chain(off, dev, k, n)
        seen.append((off._auto.intercepts, off._auto.floor))
    assert seen[-1] == (False, 0), seen
    state = dev.alloc((7 * n // 4,))     # taken for good
    for _ in range(3):
        before = off.stats().offloaded_bytes
        device_chain(off, dev, k, n)
        testing.check_invariants(off)
        seen.append((off._auto.intercepts, off._auto.floor, off.stats().offloaded_bytes - before))
    assert seen[WARMUP + 1][:2] == (False, 0), seen   # the step that stopped fitting
    floor = off._auto.floor
    # (the quota writes the records that fit in it: up to one record short of it)
    assert floor > 0 and all(i and w > floor - n for i, _, w in seen[WARMUP + 2:]), seen
    assert dev.peak_allocated <= dev.capacity and not dev.errors
    del state


def test_steps_under_a_memory_floor_offload_at_least_the_floor(make_offloader):
    """The guide and NOTE [ The offload quota ], step 0: once the memory floor is set,
    "every later step offloads at least" it, so forward's end leaves 10% of the memory
    free. The floor is passed on as the step's quota, and a quota writes only the
    records that fit in it: with records of N bytes and a floor of 1.4 N (16 N saved on
    a device of 24 N of which 7 N are taken, write_behind_bytes=0) each step writes
    1 N, forward's end leaves 2 N free, below the 2.4 N reserve, and the floor, computed
    again from that step, stays 1.4 N: the shortfall is never made up."""
    n, k = 64 * KiB, 16
    dev = LoopbackDevice(capacity=24 * n)
    off = make_offloader(policy="auto", min_tensor_bytes=4096, keep_tail_bytes=0,
                         write_behind_bytes=0, prefetch_bytes=2 * n)
    attach(off, dev)
    off._auto._probe = SLOW
    state = dev.alloc((7 * n // 4,))     # taken for good (an optimizer's state)
    for _ in range(WARMUP + 3):
        device_chain(off, dev, k, n)
    ctl = off._auto
    assert ctl.floor > 0
    for sample in ctl.samples[SIZING_STEPS:]:   # each under the floor
        free, total = sample.room
        assert sample.offloaded_bytes >= ctl.floor, (sample, ctl.floor)
        assert free >= 0.1 * total, (sample, ctl.floor)
    assert dev.peak_allocated <= dev.capacity and not dev.errors
    del state


def test_hook_timer_on_a_step_without_hooks_says_why(spill_dir):
    """``tools.HookTimer``'s own example, ``with off, timer.wrap():``, under the default
    policy on a disk with nothing worth offloading: from the step the hooks go off it
    raised "enter it inside `with offloader:`", which the caller had done. The message
    says that a step of policy='auto' with nothing to offload pushes no hooks."""
    import pytest

    from ssdtrain import tools
    model, inputs = models.mlp()
    off = ssdtrain.Offloader(spill_dir=str(spill_dir), **SMALL)
    off._auto._probe = SLOW
    try:
        for _ in range(WARMUP):
            timer = tools.HookTimer()
            with off, timer.wrap():
                loss = model(*inputs)
            loss.backward()
            assert timer.pack_ns
        with pytest.raises(ssdtrain.SSDTrainError, match="policy='auto'.*pushes no hooks"):
            with off, tools.HookTimer().wrap():
                model(*inputs)
    finally:
        off.close()


class _BNDrop(torch.nn.Module):
    """Linear, BatchNorm (running statistics), Dropout (the RNG), Linear: every kind of
    state a training step changes besides the parameters."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.BatchNorm1d(256),
                                       torch.nn.GELU(), torch.nn.Dropout(0.25),
                                       torch.nn.Linear(256, 64))

    def forward(self, x):
        return self.net(x).square().mean()


def test_the_default_trains_the_same_model_over_its_step_kinds(spill_dir):
    """Exact means the trained model: under the default, over its sizing, baseline and
    quota steps (a fast disk) or its hooks-off steps (a slow one), each step's loss, the
    parameters after the optimizer's step (SGD with momentum), BatchNorm's buffers and
    the RNG state equal a run without ssdtrain, bitwise; and the run really offloaded."""
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(128, 64, generator=g) for _ in range(WARMUP + 3)]

    def train(off=None):
        torch.manual_seed(11)
        model = _BNDrop()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        seen = []
        for x in xs:
            opt.zero_grad(set_to_none=True)
            if off is None:
                loss = model(x)
            else:
                with off:
                    loss = model(x)
            loss.backward()
            opt.step()
            seen.append((loss.detach().clone(), torch.get_rng_state(),
                         {k: v.detach().clone() for k, v in model.state_dict().items()},
                         None if off is None else off._auto.intercepts))
        return seen

    ref = train()
    for probe in (FAST, SLOW):
        off = ssdtrain.Offloader(spill_dir=str(spill_dir), **SMALL)
        off._auto._probe = probe
        try:
            got = train(off)
            offloaded = off.stats().offloaded_bytes
        finally:
            off.close()
        assert offloaded > 0
        for i, ((l0, r0, s0, _), (l1, r1, s1, _)) in enumerate(zip(ref, got)):
            assert torch.equal(l0, l1), (probe.__name__, i, "loss")
            assert torch.equal(r0, r1), (probe.__name__, i, "RNG state")
            assert s0.keys() == s1.keys()
            for k in s0:
                assert torch.equal(s0[k], s1[k]), (probe.__name__, i, k)
        hooks = [h for *_, h in got]
        assert all(hooks[:WARMUP]), hooks
        assert not any(hooks[WARMUP:]) if probe is SLOW else all(hooks), (probe.__name__, hooks)
