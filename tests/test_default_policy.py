"""The policy ``"auto"`` (ssdtrain/_policies/auto.py, NOTE [ The offload quota ]).

Each step offloads its earliest records up to a byte quota chosen from what earlier steps
measured, keeps the rest, and forward never waits on the disk. Here: the quota logic as
pure functions (bounded, monotone in bandwidth, lowered after a stall), the controller
with a fake clock, the decision given a quota (a prefix, deterministic), gradients under
the default across steps, forward with a hung engine, and the estimate's replay of a
step's quota. No timing is asserted.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import manual_engine
import models
import ssdtrain
from ssdtrain import testing
from helpers import assert_grads_equal, grads
from ssdtrain import estimate as E
from ssdtrain._policies.auto import (BASELINE_STEPS, SIZING_STEPS, AutoQuota, StepSample,
                                     next_scale, probe_bytes, quota_bound, slowed)
from ssdtrain._decision.policy import KEEP_QUOTA, TailWindow
from ssdtrain._decision.records import State

KiB = 1 << 10
WARMUP = SIZING_STEPS + BASELINE_STEPS  # steps before the first quota chosen for time
MiB = 1 << 20
SMALL = dict(min_tensor_bytes="8KiB", keep_tail_bytes=0, policy="auto")

pos = st.floats(1e-3, 1e12, allow_nan=False)
times = st.floats(0.0, 100.0, allow_nan=False)


# ------------------------------------------------------------------ pure functions
@settings(max_examples=200, deadline=None)
@given(saved=st.integers(0, 1 << 40), f=times, t=times, w=pos, r=pos, k=st.floats(1, 1e3),
       m=st.floats(0, 1))
def test_bound_is_within_the_step_and_monotone_in_bandwidth(saved, f, t, w, r, k, m):
    q = quota_bound(saved, f, t, w, r, m)
    assert 0 <= q <= saved
    assert quota_bound(saved, f, t, w * k, r, m) >= q
    assert quota_bound(saved, f, t, w, r * k, m) >= q
    assert quota_bound(saved, f, t + 1.0, w, r, m) >= q      # more time, more bytes


@settings(max_examples=200, deadline=None)
@given(saved=st.integers(1, 1 << 40), f=times, t=times, w=pos, r=pos, k=st.floats(1, 1e3),
       window=st.integers(0, 1 << 40), m=st.floats(0, 1))
def test_bound_with_the_prefetch_window_is_lower_and_monotone(saved, f, t, w, r, k, window, m):
    q = quota_bound(saved, f, t, w, r, m, window_bytes=window)
    assert 0 <= q <= quota_bound(saved, f, t, w, r, m)
    assert quota_bound(saved, f, t, w, r * k, m, window_bytes=window) >= q
    assert quota_bound(saved, f, t, w, r, m, window_bytes=window * 2) >= q


def test_bound_is_the_tighter_of_writes_in_forward_and_reads_in_the_rest():
    # 1 GB/s writes for a 0.1 s forward (100 MB) vs 0.25 GB/s reads for 0.2 s + 3% of 0.3 s.
    q = quota_bound(1 << 40, 0.1, 0.3, 1e9, 0.25e9, 0.03, safety=1.0)
    assert q == int(0.25e9 * (0.2 + 0.03 * 0.3))
    assert quota_bound(1 << 40, 0.1, 0.3, 0.1e9, 1e12, 0.0, safety=1.0) == int(0.1e9 * 0.1)
    assert quota_bound(0, 0.1, 0.3, 1e9, 1e9, 0.03) == 0
    assert quota_bound(1 << 20, 0.1, 0.3, 0.0, 1e9, 0.03) == 0   # no bandwidth known
    # 1000 MB saved, read at 1 GB/s over a 0.5 s backward (half of it in time): the
    # reads wait for the kept bytes to drain to the 100 MB window, Q <= 2 * 50 MB.
    assert quota_bound(10 ** 9, 1.0, 1.5, 1e12, 1e9, 0.0, safety=1.0,
                       window_bytes=10 ** 8) == pytest.approx(10 ** 8, rel=1e-9)


@given(scale=st.floats(1e-6, 1.5), stall=st.floats(0, 10), base=st.floats(1e-3, 10),
       m=st.floats(0, 0.5))
def test_a_step_that_stalls_past_the_margin_lowers_the_scale(scale, stall, base, m):
    s = StepSample(step_s=base, forward_s=base / 3, stall_s=stall, saved_bytes=1,
                   quota=1, offloaded_bytes=1)
    if stall > m * base:
        assert slowed(s, base, m)
        assert next_scale(scale, True) < scale
    assert next_scale(scale, False) >= min(scale, 1.5)


def test_a_slower_step_without_stall_is_slowed_too():
    s = StepSample(step_s=1.05, forward_s=0.3, stall_s=0.0, saved_bytes=1, quota=1)
    assert slowed(s, 1.0, 0.03) and not slowed(s, 1.0, 0.06)


def test_probe_size_is_an_eighth_of_the_step_within_limits():
    assert probe_bytes(0) == 8 * MiB and probe_bytes(1 << 40) == 64 * MiB
    assert probe_bytes(256 * MiB) == 32 * MiB and probe_bytes(256 * MiB + 5) % 4096 == 0


# --------------------------------------------------------------------- controller
@pytest.fixture
def no_controls(monkeypatch):
    """No control steps (NOTE [ The offload quota ], "Judging under noise"), for the tests
    of what the feedback does step after step."""
    import ssdtrain._policies.auto as auto
    monkeypatch.setattr(auto, "CONTROL_FIRST", 1 << 30)
    monkeypatch.setattr(auto, "CONTROL_EVERY", 1 << 30)


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _step(ctl, clock, stats, forward_s, rest_s, saved, stall=0.0):
    """One step of the fake world: begin (the quota), forward, the rest."""
    q = ctl.begin_step()
    clock.now += forward_s
    stats.unique_bytes += saved
    stats.offloaded_bytes += saved if q is None else min(q, saved)
    ctl.end_forward()
    clock.now += rest_s
    stats.stall_seconds += stall
    return q


def test_controller_measures_then_probes_once_then_follows_stalls(no_controls):
    clock, stats, probes = _Clock(), ssdtrain.Stats(), []

    def probe(nbytes):
        probes.append(nbytes)
        return nbytes / 1e9, nbytes / 0.5e9   # 1 GB/s writes, 0.5 GB/s reads

    ctl = AutoQuota(0.03, probe, stats, clock=clock)
    saved = 400 * MiB
    quotas = [_step(ctl, clock, stats, 0.1, 0.2, saved) for _ in range(WARMUP)]
    assert quotas == [None] * SIZING_STEPS + [0] * BASELINE_STEPS and not probes
    assert stats.offload_bound_bytes == 0  # nothing measured yet
    quotas = quotas[SIZING_STEPS:]
    assert "measuring" in stats.offload_quota_reason
    first = _step(ctl, clock, stats, 0.1, 0.2, saved)
    assert probes == [probe_bytes(saved)]
    bound = quota_bound(saved, 0.1, 0.3, 1e9, 0.5e9, 0.03)
    assert first == pytest.approx(0.5 * bound, rel=1e-6) and stats.offload_quota_bytes == first
    assert stats.offload_bound_bytes == pytest.approx(bound, rel=1e-6)  # what it is a share of
    second = _step(ctl, clock, stats, 0.1, 0.2, saved)          # kept within the margin
    assert second > first and "raised" in stats.offload_quota_reason
    third = _step(ctl, clock, stats, 0.1, 0.2, saved, stall=0.05)  # stalls: 17% of 0.3 s
    assert third > second                                        # (chosen before it)
    lowered = _step(ctl, clock, stats, 0.1, 0.2, saved)
    assert lowered < third and "lowered" in stats.offload_quota_reason
    assert len(probes) == 1
    assert all(0 <= q <= saved for q in quotas + [first, second, third, lowered])


@settings(max_examples=100, deadline=None)
@given(between=st.lists(st.floats(0.0, 10.0), min_size=2, max_size=8),
       forward=st.floats(0.01, 1.0), rest=st.floats(0.0, 1.0))
def test_a_steps_time_ends_with_its_backward_not_at_the_next_begin(between, forward, rest):
    """NOTE [ The offload quota ], "A step's time": whatever runs between a step's
    backward end and the next step's begin (an optimizer step, evaluation, logging), of
    any length, is not the step's; a backward end seen before the step's forward ended
    (an earlier micro-batch's) does not end it; a step with no backward end seen runs to
    the next begin."""
    clock, stats = _Clock(), ssdtrain.Stats()
    ctl = AutoQuota(0.03, None, stats, clock=clock)
    for gap in between:
        ctl.begin_step()
        clock.now += forward / 2
        ctl.end_backward()          # before forward's end: not this step's
        clock.now += forward / 2
        ctl.end_forward()
        clock.now += rest
        ctl.end_backward()
        clock.now += gap
    ctl.begin_step()
    assert [s.step_s for s in ctl.samples] == pytest.approx([forward + rest] * len(between))
    clock.now += forward
    ctl.end_forward()
    clock.now += rest + 1.0         # no backward end: to the next begin
    ctl.begin_step()
    assert ctl.samples[-1].step_s == pytest.approx(forward + rest + 1.0)


def test_on_a_device_a_step_runs_to_the_next_begin():
    """On a device (a baseline forward synchronized) the host's backward end is its
    launches' end, not its kernels': the step runs to the next begin, as the baseline's
    synchronized times do."""
    clock, stats = _Clock(), ssdtrain.Stats()
    ctl = AutoQuota(0.03, None, stats, clock=clock, sync=lambda: True)
    for _ in range(WARMUP + 2):
        ctl.begin_step()
        clock.now += 0.1
        ctl.end_forward()
        clock.now += 0.2
        ctl.end_backward()
        clock.now += 0.5
    ctl.begin_step()
    steps = [s.step_s for s in ctl.samples]
    # the sizing step is not synchronized (no device seen yet): to its backward's end
    assert steps == pytest.approx([0.3] * SIZING_STEPS + [0.8] * (BASELINE_STEPS + 2))


def test_a_slow_and_varying_optimizer_step_does_not_read_as_cost():
    """Steps whose compute is the same and whose optimizer step (after backward) takes
    0 to 2 s are never judged slowed: the quota rises to the bound's MAX_SCALE."""
    clock, stats = _Clock(), ssdtrain.Stats()
    ctl = AutoQuota(0.03, lambda n: (n / 1e9, n / 0.5e9), stats, clock=clock)
    saved, reasons = 400 * MiB, []
    for i in range(WARMUP + 8):
        q = ctl.begin_step()
        reasons.append(stats.offload_quota_reason)
        clock.now += 0.1
        stats.unique_bytes += saved
        stats.offloaded_bytes += saved if q is None else min(q, saved)
        ctl.end_forward()
        clock.now += 0.2
        ctl.end_backward()
        clock.now += (0.0, 2.0, 0.7, 1.3)[i % 4]   # the optimizer step, and whatever else
    assert not any("lowered" in r for r in reasons), reasons
    assert ctl.scale == pytest.approx(1.5)


def _noisy_world(seed, noise, cost, steps=120):
    """The controller in a world whose step takes 0.3 s (forward 0.1) times a random
    factor within ``noise`` either way, times ``1 + cost(quota / bound)``; its optimizer
    step (between steps) takes 0 to 1 s. The quotas it chose, and its bound."""
    import random
    rng = random.Random(seed)
    clock, stats = _Clock(), ssdtrain.Stats()
    ctl = AutoQuota(0.03, lambda n: (n / 1e9, n / 0.5e9), stats, clock=clock)
    saved, quotas = 400 * MiB, []
    for _ in range(steps):
        q = ctl.begin_step()
        quotas.append(q)
        share = 0.0 if not q or not ctl.bound else q / ctl.bound
        factor = (1 + rng.uniform(-noise, noise)) * (1 + cost(share))
        clock.now += 0.1 * factor
        stats.unique_bytes += saved
        stats.offloaded_bytes += saved if q is None else min(q, saved)
        ctl.end_forward()
        clock.now += 0.2 * factor
        ctl.end_backward()
        clock.now += rng.uniform(0.0, 1.0)
    return quotas, ctl.bound


@pytest.mark.parametrize("noise, least, share", [(0.0, 0.6, 1.0), (0.02, 0.6, 1.0),
                                                  (0.05, 0.6, 0.985), (0.08, 0.25, 0.98)])
def test_noise_without_cost_is_not_read_as_cost(noise, least, share):
    """NOTE [ The offload quota ], "Judging under noise": step times that move by up to
    ``noise`` either way for reasons of their own, while offloading costs nothing, do
    not drive the quota down. Over 300 seeded worlds (the same every run: a rate, not
    one lucky draw), the quota over the last 40 steps averages at least ``least`` of the
    most the feedback may reach (MAX_SCALE x the bound), control steps included, in at
    least ``share`` of them: all at 2%; at 5%, 298 of 300 measured; at 8% (almost three
    times the margin), 297 of 300 at a quarter. The rule before (a step slowed past the
    median plus the margin plus the slowest's excess over the median) failed 10 of 300
    at 5%, five of them giving up entirely, and a hypothesis search found them; judged
    against the fastest of two early steps (the rule before that), 5% left the quota
    below 15% of the reach in 7 of 10 worlds."""
    reached = 0
    for seed in range(300):
        quotas, bound = _noisy_world(seed, noise, lambda s: 0.0)
        tail = [q or 0 for q in quotas[-40:]]
        reached += sum(tail) / len(tail) >= least * 1.5 * bound
    assert reached >= share * 300, (noise, reached)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 1 << 30))
def test_a_real_cost_on_a_quiet_machine_holds_the_quota_back(seed):
    """With 0.5% of noise and a real cost of 10% once a step offloads more than half the
    bound, the quota hovers at that knee instead of climbing to MAX_SCALE, and after a
    slowed step it stays under it for PROBE_HOLD steps before probing above again: at
    most 30% of the judged steps pay the cost (25% measured; probing every other step,
    half of them did), so the average cost (2.5%) is within the 3% margin."""
    quotas, bound = _noisy_world(seed, 0.005, lambda share: 0.10 if share > 0.5 else 0.0)
    judged = [q for q in quotas[WARMUP + 10:] if q]
    over = sum(q > 0.5 * bound for q in judged)
    assert judged and over <= 0.3 * len(judged), (over, len(judged), bound)


def test_controller_leaves_the_last_keep_tail_bytes_of_a_step():
    """On a disk fast enough for everything, the quota stops short of the step's last
    ``keep_tail_bytes`` (under a quota the tail window decides nothing)."""
    clock, stats = _Clock(), ssdtrain.Stats()
    saved, tail = 64 * MiB, 24 * MiB
    ctl = AutoQuota(0.03, lambda n: (n / 1e15, n / 1e15), stats, clock=clock, tail_bytes=tail)
    quotas = [_step(ctl, clock, stats, 0.1, 0.2, saved) for _ in range(WARMUP + 4)]
    assert quotas[-1] == saved - tail
    assert all(q <= saved - tail for q in quotas[SIZING_STEPS:])


def test_controller_gives_up_below_a_sixteenth_and_tries_again_later(no_controls):
    """A quota below MIN_SHARE of a step is raised to it while the bound allows; once two
    steps in a row at that share are slowed (one may be noise), nothing is offloaded
    (nothing judged) for RETRY_STEPS steps, then the share is tried again. A disk whose
    bound is below it: always 0."""
    from ssdtrain._policies.auto import MIN_SHARE, RETRY_STEPS
    saved = 160 * MiB
    floor = int(MIN_SHARE * saved)
    # bound = 0.8 x write x forward = 1.5 x floor: the first quota (0.5 x bound) is raised
    clock, stats = _Clock(), ssdtrain.Stats()
    w = 1.5 * floor / 0.8 / 0.1
    ctl = AutoQuota(0.03, lambda n: (n / w, n / 1e15), stats, clock=clock)
    for _ in range(WARMUP):
        _step(ctl, clock, stats, 0.1, 0.2, saved)
    assert _step(ctl, clock, stats, 0.1, 0.2, saved, stall=0.05) == floor   # slowed
    assert _step(ctl, clock, stats, 0.1, 0.2, saved, stall=0.05) == floor   # again: once
    assert _step(ctl, clock, stats, 0.1, 0.2, saved) == 0                   # given up
    assert "slowed a step" in stats.offload_quota_reason
    quotas = [_step(ctl, clock, stats, 0.1, 0.2, saved) for _ in range(RETRY_STEPS)]
    assert quotas[:-1] == [0] * (RETRY_STEPS - 1) and quotas[-1] == floor   # tried again
    # a disk whose bound is below the share: never
    clock, stats = _Clock(), ssdtrain.Stats()
    w = 0.5 * floor / 0.8 / 0.1
    ctl = AutoQuota(0.03, lambda n: (n / w, n / 1e15), stats, clock=clock)
    quotas = [_step(ctl, clock, stats, 0.1, 0.2, saved) for _ in range(WARMUP + 5)]
    assert quotas[SIZING_STEPS:] == [0] * (len(quotas) - SIZING_STEPS)
    assert "1/16" in stats.offload_quota_reason


def test_controller_does_not_judge_a_step_that_wrote_nothing():
    clock, stats = _Clock(), ssdtrain.Stats()
    ctl = AutoQuota(0.03, lambda n: (n / 1e9, n / 1e9), stats, clock=clock)
    for _ in range(WARMUP + 1):
        _step(ctl, clock, stats, 0.1, 0.2, 64 * MiB)
    q = ctl.begin_step()            # stats.offloaded_bytes stays: nothing written
    scale = ctl.scale
    clock.now += 1.0                # ten times slower, but nothing written: noise
    stats.unique_bytes += 64 * MiB
    ctl.end_forward()
    ctl.begin_step()
    assert q > 0 and ctl.scale == scale


def test_steps_with_nothing_to_offload_intercept_nothing_and_count_again_in_turn():
    """NOTE [ The offload quota ], step 5: a disk too slow for 1/16 of a step gives quota
    0; once the tiers are measured such a step intercepts nothing (its counters do not
    move: the last intercepted step's S stands for it), every RETRY_STEPS-th one does to
    count S again, and a step whose forward left memory short raises the floor, so the
    next intercepts."""
    from ssdtrain._policies.auto import RETRY_STEPS
    saved = 160 * MiB
    clock, stats = _Clock(), ssdtrain.Stats()
    room = [(1 << 40, 1 << 40)]
    ctl = AutoQuota(0.03, lambda n: (n / 1e6, n / 1e6), stats, clock=clock,
                    headroom=lambda: room[0])
    seen = []
    for _ in range(WARMUP + 2 * RETRY_STEPS + 1):
        q = ctl.begin_step()
        seen.append((q, ctl.intercepts))
        clock.now += 0.1
        if ctl.intercepts:                   # nothing is counted without the hooks
            stats.unique_bytes += saved
            stats.offloaded_bytes += saved if q is None else min(q, saved)
        ctl.end_forward()
        clock.now += 0.2
    assert all(i for _, i in seen[:WARMUP])              # sizing, baseline
    assert [q for q, _ in seen[SIZING_STEPS:]] == [0] * (len(seen) - SIZING_STEPS)
    counted = [k for k, (_, i) in enumerate(seen) if i and k > WARMUP]
    assert counted == [WARMUP + RETRY_STEPS - 1, WARMUP + 2 * RETRY_STEPS - 1], counted
    assert all(sample.saved_bytes == saved for sample in ctl.samples[SIZING_STEPS:])
    assert "not intercepted" in stats.offload_quota_reason
    room[0] = (0, 1 << 40)                  # this step's forward left no memory free
    ctl.begin_step()
    clock.now += 0.1
    ctl.end_forward()
    q = ctl.begin_step()
    assert ctl.floor > 0 and q >= ctl.floor and ctl.intercepts


def test_a_step_with_nothing_to_offload_runs_without_hooks_and_exact(spill_dir):
    """On a disk too slow to be worth it, the steps after the baseline push no hooks:
    pack never runs, Stats do not move, gradients equal a run without ssdtrain; under
    another pair of saved-tensor hooks (which ours would shadow) ours are pushed still."""
    model, inputs = models.gpt()
    ref_model, _ = models.gpt()
    ref_model.load_state_dict(model.state_dict())
    off = ssdtrain.Offloader(spill_dir=str(spill_dir), **SMALL)
    off._auto._probe = lambda n: (n / 1e3, n / 1e3)   # 1 kB/s: quota 0
    packs = []

    def counting(real):
        def pack(t):
            packs.append(1)
            return real(t)
        return pack
    testing.wrap_hooks(off, pack=counting)
    # whether the module tracker (a global forward pre-hook) ran in the step's forward
    from ssdtrain._decision.policy import TRACKER
    real_pre, fwd_tracked, tracked = TRACKER._pre_forward, [False], []

    def pre_forward(*args):
        fwd_tracked[0] = True
        return real_pre(*args)
    TRACKER._pre_forward = pre_forward
    per_step = []
    try:
        for step in range(WARMUP + 3):
            for m in (model, ref_model):
                m.zero_grad(set_to_none=True)
            del packs[:]
            fwd_tracked[0] = False
            before = off.stats().packed_bytes
            if step == WARMUP + 2:      # another pair on the stack: ours shadow it
                with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                    with off:
                        loss = model(*inputs)
            else:
                with off:
                    loss = model(*inputs)
            loss.backward()
            ref_model(*inputs).backward()
            assert_grads_equal(grads(ref_model), grads(model))
            per_step.append((len(packs), off.stats().packed_bytes - before,
                             off._auto.intercepts))
            tracked.append(fwd_tracked[0])
    finally:
        del TRACKER._pre_forward
        off.close()
    assert tracked == [True] * WARMUP + [False, False, True], tracked
    assert all(n > 0 and b > 0 for n, b, _ in per_step[:WARMUP]), per_step
    assert per_step[WARMUP:WARMUP + 2] == [(0, 0, False)] * 2, per_step
    assert per_step[WARMUP + 2][0] > 0 and not per_step[WARMUP + 2][2], per_step


# ------------------------------------------------------------- decision given Q
class _R:
    def __init__(self, nbytes):
        self.nbytes, self.reserved = nbytes, 0


@given(sizes=st.lists(st.integers(1, 1000), max_size=40), quota=st.integers(0, 20000),
       tail=st.integers(0, 3000), at_least=st.integers(1, 20000))
def test_a_memory_floor_writes_a_prefix_of_at_least_the_floor(sizes, quota, tail, at_least):
    """With a floor (``at_least``, the quota raised to it as AutoQuota does): still a
    prefix, decided at each save; at least the floor written (or everything), and past
    it no more than the quota allows, or the one record that crossed the floor."""
    quota = max(quota, at_least)
    w = TailWindow(tail)
    w.begin_step(quota, at_least)
    decided = []
    for n in sizes:
        w.add(_R(n))
        out = w.overflow()
        assert len(out) == 1
        decided += out
    written = [r.nbytes for r, why in decided if why is None]
    assert written == [r.nbytes for r, _ in decided[:len(written)]]   # a prefix
    assert sum(written) >= at_least or len(written) == len(sizes)
    assert sum(written) <= quota or sum(written[:-1]) < at_least
    assert len(written) == len(sizes) or sum(written) + sizes[len(written)] > quota
    w.begin_step(quota)             # the next step without one: the quota's rule alone
    assert w.at_least == 0


@given(sizes=st.lists(st.integers(1, 1000), max_size=40), quota=st.integers(0, 20000),
       tail=st.integers(0, 3000))
def test_quota_decides_a_prefix_of_the_step_records(sizes, quota, tail):
    """Under a quota each record is decided at its save (the tail window holds none):
    the longest prefix that fits is written, every later record kept, and once one is
    kept the window says so (``spent``) before the next save."""
    w = TailWindow(tail)
    w.begin_step(quota)
    decided = []
    for n in sizes:
        w.add(_R(n))
        out = w.overflow()
        assert len(out) == 1           # decided at its own save
        decided += out
        assert w.spent == any(why == KEEP_QUOTA for _, why in decided)
    assert w.close() == []             # no kept tail: the quota keeps the step's end
    written = [r.nbytes for r, why in decided if why is None]
    kept = [i for i, (_, why) in enumerate(decided) if why == KEEP_QUOTA]
    assert sum(written) <= quota
    assert written == [r.nbytes for r, _ in decided[:len(written)]]   # a prefix
    assert kept == list(range(len(written), len(decided)))
    assert len(written) == len(sizes) or sum(written) + sizes[len(written)] > quota
    assert w.written == sum(written)
    w.begin_step(quota)             # a new step: its own quota
    assert w.written == 0 and (w.spent == (quota <= 0))
    w.begin_step(None)              # no quota: the tail window is back
    assert w.keep_bytes == tail


def _fixed_quota(off, quota):
    """The controller as is, with ``quota`` in force from now on (no measuring)."""
    off._auto.begin_step = lambda: quota


def _written_seqs(off):
    return sorted((r.seq, r.nbytes) for r in testing.records(off, State.WRITING, State.ON_DISK))


def test_decision_given_a_quota_is_the_same_in_every_run(spill_dir, tmp_path):
    runs = []
    for i in range(2):
        d = tmp_path / f"s{i}"
        d.mkdir()
        off = ssdtrain.Offloader(spill_dir=str(d), **SMALL)
        try:
            model, inputs = models.mlp()
            with off:  # measure the whole step's bytes once
                model(*inputs).backward()
            before = off.stats()
            unique = before.unique_bytes
            _fixed_quota(off, unique // 3)
            with off:
                loss = model(*inputs)
            off.wait()
            after = off.stats()
            # what the quota kept fills the prefetch window, as the kept tail does
            assert testing.prefetch(off).ahead >= \
                after.quota_kept_bytes - before.quota_kept_bytes > 0
            runs.append((_written_seqs(off), after.offloaded_bytes - before.offloaded_bytes,
                         after.quota_kept_bytes - before.quota_kept_bytes))
            loss.backward()
        finally:
            off.close()
    assert runs[0] == runs[1]
    (seqs, offloaded, quota_kept) = runs[0]
    assert 0 < offloaded <= unique // 3 and quota_kept > 0
    assert offloaded + quota_kept == unique


# --------------------------------------------------------------------- the default
def test_default_policy_is_auto_and_max_slowdown_is_validated():
    cfg = ssdtrain.OffloadConfig()
    # "auto" fits first (its first step is "static"'s, then the memory floor), so it is
    # the default; "static" is named where every step must offload.
    assert cfg.policy == "auto" and cfg.max_slowdown == 0.03
    assert ssdtrain.OffloadConfig(max_slowdown=0).max_slowdown == 0.0
    for bad in (-0.01, float("nan"), float("inf"), 11, "3%", True):
        with pytest.raises(ssdtrain.ConfigError, match="max_slowdown"):
            ssdtrain.OffloadConfig(max_slowdown=bad)
    assert ssdtrain.OffloadConfig.from_env({"SSDTRAIN_MAX_SLOWDOWN": "0.1"}).max_slowdown == 0.1


def test_default_gradients_are_exact_across_steps(spill_dir):
    """The sizing step (everything eligible offloaded), baseline steps (nothing), then a
    quota: every step's gradients equal a run without ssdtrain, and some step really
    wrote part of its records."""
    model, inputs = models.gpt()
    ref_model, _ = models.gpt()
    ref_model.load_state_dict(model.state_dict())
    off = ssdtrain.Offloader(spill_dir=str(spill_dir), **SMALL)
    off._auto._probe = lambda n: (n / 1e12, n / 1e12)   # a fast disk: a quota > 0
    per_step = []
    try:
        for step in range(WARMUP + 3):
            for m in (model, ref_model):
                m.zero_grad(set_to_none=True)
            before = off.stats()
            with off:
                loss = model(*inputs)
            loss.backward()
            ref_model(*inputs).backward()
            assert_grads_equal(grads(ref_model), grads(model))
            after = off.stats()
            per_step.append((after.offload_quota_bytes,
                             after.offloaded_bytes - before.offloaded_bytes,
                             after.unique_bytes - before.unique_bytes))
    finally:
        off.close()
    sizing, baseline = per_step[:SIZING_STEPS], per_step[SIZING_STEPS:WARMUP]
    assert all(q is None and 0 < w for q, w, _ in sizing)
    assert [q for q, _, _ in baseline] == [0] * BASELINE_STEPS
    assert all(w == 0 for _, w, _ in baseline)
    q, written, unique = per_step[WARMUP]
    assert 0 < written <= q < unique          # part of the step, within its quota
    assert all(w <= q for q, w, _ in per_step[SIZING_STEPS:])


def test_forward_never_waits_on_the_disk_in_the_default(spill_dir):
    """A hung engine (requests run only when told) and write_behind_bytes=0: the static
    policy's forward would wait for the first write; the default's goes on, the records
    being written stay in memory and backward uses them from there."""
    model, inputs = models.mlp()
    ref_model, _ = models.mlp()
    ref_model.load_state_dict(model.state_dict())
    off = ssdtrain.Offloader(spill_dir=str(spill_dir), engine="posix", write_behind_bytes=0,
                             io_timeout_s=30, **SMALL)
    engine = manual_engine.install(off)
    try:
        _fixed_quota(off, 0)                 # (no sizing step: its writes would wait)
        with off:
            model(*inputs).backward()
        _fixed_quota(off, 1 << 40)           # offload everything eligible
        with off:
            loss = model(*inputs)
        assert off.stats().offloaded_bytes > 0
        assert engine.pending() and off.stats().write_stall_seconds == 0.0
        model.zero_grad(set_to_none=True)
        loss.backward()
        ref_model(*inputs).backward()
        assert_grads_equal(grads(ref_model), grads(model))
        engine.complete_all()
    finally:
        engine.complete_all()
        off.close()


def test_estimate_replays_a_step_quota(spill_dir):
    make = models.gpt
    off = ssdtrain.Offloader(spill_dir=str(spill_dir), **SMALL)
    off._auto._probe = lambda n: (n / 1e12, n / 1e12)
    try:
        for _ in range(WARMUP + 1):
            model, inputs = make()
            before = off.stats()
            with off:
                loss = model(*inputs)
            off.wait()
            after = off.stats()
            loss.backward()
    finally:
        off.close()
    quota = after.offload_quota_bytes
    est = E.estimate(make, config=ssdtrain.OffloadConfig(**SMALL), offload_quota=quota)
    m = est.measurement
    assert quota > 0
    assert est.offloadable_bytes == after.offloaded_bytes - before.offloaded_bytes > 0
    assert m.quota_kept_bytes == after.quota_kept_bytes - before.quota_kept_bytes > 0
    assert est.kept_bytes == after.kept_bytes - before.kept_bytes
    plain = E.estimate(make, config=ssdtrain.OffloadConfig(**SMALL))
    assert plain.offloadable_bytes == est.unique_bytes    # no quota: the static rules
    assert any("policy='auto'" in n for n in plain.notes)
    with pytest.raises(ssdtrain.ConfigError, match="offload_quota"):
        E.estimate(make, config=ssdtrain.OffloadConfig(**dict(SMALL, policy="static")),
                   offload_quota=quota)


# ------------------------------------------------- past the quota: no records
def test_a_spent_quota_keeps_tensors_without_records_counted_as_records(spill_dir):
    """Once the quota is spent, a new storage is passed through in memory without a
    record (NOTE [ The pack decision ] in _decision/policy.py): with quota 0 a step leaves no
    record at all, yet counts what it saved as the static policy's records (the quota's
    measurements read them), and its gradients are exact."""
    model, inputs = models.gpt()
    ref_model, _ = models.gpt()
    ref_model.load_state_dict(model.state_dict())
    (spill_dir / "static").mkdir()
    (spill_dir / "auto").mkdir()
    static = ssdtrain.Offloader(spill_dir=str(spill_dir / "static"),
                                **dict(SMALL, policy="static"))
    off = ssdtrain.Offloader(spill_dir=str(spill_dir / "auto"), **SMALL)
    try:
        with static:
            ref_model(*inputs).backward()
        _fixed_quota(off, 0)
        with off:
            loss = model(*inputs)
        assert testing.records(off) == []                      # no record
        s, a = static.stats(), off.stats()
        assert a.unique_bytes == s.unique_bytes > 0            # counted as records
        assert a.quota_kept_bytes == a.unique_bytes and a.offloaded_bytes == 0
        assert a.deduplicated_bytes == s.deduplicated_bytes
        # backward uses them first: they fill the prefetch window as kept records do
        assert testing.prefetch(off).ahead == a.unique_bytes
        loss.backward()
        assert_grads_equal(grads(ref_model), grads(model))
        testing.check_invariants(off)
        assert testing.prefetch(off).ahead == 0                # used: out of the window
    finally:
        static.close()
        off.close()


def test_passed_bytes_leave_the_window_when_their_graph_dies(spill_dir):
    """A graph freed without backward: the bytes it passed through leave the prefetch
    window (else later steps' reads would wait for room that never comes)."""
    model, inputs = models.mlp()
    off = ssdtrain.Offloader(spill_dir=str(spill_dir), **SMALL)
    try:
        _fixed_quota(off, 0)
        with off:
            loss = model(*inputs)
        window = testing.prefetch(off)
        assert window.ahead > 0 and window.passed == 1
        del loss
        testing.check_invariants(off)                          # drains the release
        window = testing.prefetch(off)
        assert window.ahead == 0 and not window.passed
        with off:                                              # and the next step's are counted
            loss = model(*inputs)
        assert testing.prefetch(off).ahead > 0
        loss.backward()
        testing.check_invariants(off)
        window = testing.prefetch(off)
        assert window.ahead == 0 and not window.passed
    finally:
        off.close()


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_the_default_times_forward_to_backward_end_in_every_kind_of_step(spill_dir,
                                                                        micro_batches):
    """Through the hooks: the sizing step (records), the baseline (tensors passed
    through: ``QuotaPassThrough``, ``PassThrough``) and the steps after it are each timed from their
    forward's begin to their backward's end; the optimizer step after the last
    micro-batch (gradient accumulation: each micro-batch is a step) is in none of them.
    A step that intercepted nothing (hooks off) runs to the next begin."""
    from ssdtrain import tools
    model, inputs = models.mlp()
    clock = _Clock()
    off = ssdtrain.Offloader(spill_dir=str(spill_dir), **SMALL)
    intercepted = []
    try:
        tools.set_auto_clock(off, clock)
        for step in range(WARMUP + 4):
            for _ in range(micro_batches):
                with off:
                    intercepted.append(off._auto.intercepts)
                    loss = model(*inputs)
                    clock.now += 0.1
                clock.now += 0.2
                loss.backward()
            clock.now += 5.0 + step          # the optimizer step, slower each time
        with off:
            pass
        got = [s.step_s for s in off._auto.samples]
        assert len(got) == len(intercepted)
        for i, (t, hooked) in enumerate(zip(got, intercepted)):
            last = i % micro_batches == micro_batches - 1
            if hooked or not last:
                assert t == pytest.approx(0.3), (i, got, intercepted)
            else:  # no backward end seen: to the next begin, the optimizer step included
                assert t > 5.0, (i, got, intercepted)
        assert intercepted[:WARMUP * micro_batches] == [True] * (WARMUP * micro_batches)
    finally:
        off.close()


class _SaveFresh(torch.autograd.Function):
    """Saves one fresh tensor of its own: no parameter, nothing below the size floor."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x * 2)
        return x + 1

    @staticmethod
    def backward(ctx, grad):
        (saved,) = ctx.saved_tensors
        return grad + 0 * saved


def test_a_step_that_only_passed_tensors_through_is_timed_to_its_backward_end(spill_dir):
    """A baseline step at quota 0 whose every saved tensor passed through as its quota's
    (``QuotaPassThrough``, no record, no ``PassThrough``) is timed to its backward's end
    too, like the steps it is compared with."""
    from ssdtrain import tools
    clock = _Clock()
    off = ssdtrain.Offloader(spill_dir=str(spill_dir), **SMALL)
    try:
        tools.set_auto_clock(off, clock)
        for _ in range(WARMUP):
            x = torch.randn(64, 1024, requires_grad=True)
            with off:
                y = x
                for _ in range(4):
                    y = _SaveFresh.apply(y)
                clock.now += 0.1
            clock.now += 0.2
            y.sum().backward()
            clock.now += 5.0
        with off:
            pass
        assert [s.quota for s in off._auto.samples][SIZING_STEPS:] == [0] * BASELINE_STEPS
        assert off.stats().quota_kept_bytes > 0 and off.stats().kept_bytes == \
            off.stats().quota_kept_bytes
        assert [s.step_s for s in off._auto.samples] == pytest.approx([0.3] * WARMUP)
    finally:
        off.close()


def test_set_auto_clock_times_the_steps_with_the_given_clock(spill_dir):
    """ssdtrain.tools.set_auto_clock: the controller measures steps on the clock given
    (a harness that interleaves offloaders), and only policy='auto' takes one."""
    from ssdtrain import tools
    model, inputs = models.mlp()
    clock = _Clock()
    off = ssdtrain.Offloader(spill_dir=str(spill_dir), **SMALL)
    static = ssdtrain.Offloader(spill_dir=str(spill_dir), **dict(SMALL, policy="static"))
    try:
        tools.set_auto_clock(off, clock)
        for _ in range(2):
            with off:
                loss = model(*inputs)
            clock.now += 0.5
            loss.backward()
        with off:
            pass
        assert [s.step_s for s in off._auto.samples] == [0.5, 0.5]
        with pytest.raises(ssdtrain.ConfigError, match="policy='auto'"):
            tools.set_auto_clock(static, clock)
    finally:
        off.close()
        static.close()


def test_pin_auto_quota_fixes_the_quota_from_the_next_step_and_refuses_bad_input(spill_dir):
    """``ssdtrain.tools.pin_auto_quota`` (tools/gpu_trace.py measures one quota with it):
    from the next step on, each step's quota is the pinned bytes, whatever the steps
    measure, and what is written stays within it, the earliest records first; ``None``
    lets the policy choose again. Refused: a static offloader, negative, fractional or
    boolean bytes."""
    from ssdtrain.tools import pin_auto_quota
    static = ssdtrain.Offloader(spill_dir=str(spill_dir), policy="static")
    try:
        with pytest.raises(ssdtrain.ConfigError, match="policy='auto'"):
            pin_auto_quota(static, 1 << 20)
    finally:
        static.close()
    model, inputs = models.mlp()
    ref_model, _ = models.mlp()
    ref_model.load_state_dict(model.state_dict())
    off = ssdtrain.Offloader(spill_dir=str(spill_dir), **SMALL)
    try:
        for bad in (-1, 1.5, True, "1MiB"):
            with pytest.raises(ssdtrain.ConfigError, match="pin_auto_quota"):
                pin_auto_quota(off, bad)
        quota = 64 << 10
        pin_auto_quota(off, quota)
        for _ in range(3):
            before = off.stats()
            model.zero_grad(set_to_none=True)
            with off:
                loss = model(*inputs)
            off.wait()
            st_ = off.stats()
            assert st_.offload_quota_bytes == quota and "pinned" in st_.offload_quota_reason
            assert 0 < st_.offloaded_bytes - before.offloaded_bytes <= quota
            loss.backward()
        ref_model(*inputs).backward()
        assert_grads_equal(grads(ref_model), grads(model))
        pin_auto_quota(off, None)
        with off:
            model(*inputs).backward()
        assert "pinned" not in off.stats().offload_quota_reason
    finally:
        off.close()
