"""Offloader.track / plan / the adaptive policy: layers, profiling, plans applied exactly."""

from __future__ import annotations

import concurrent.futures
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import ssdtrain
from ssdtrain import testing
from helpers import assert_same, run_step
from ssdtrain._policies.planner import KEEP, OFFLOAD, RECOMPUTE
from ssdtrain._policies.profile import default_layers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from gpt import GPT, GPTConfig, make_batch  # noqa: E402

KiB = 1 << 10
MiB = 1 << 20
SMALL = dict(min_tensor_bytes=1 * KiB, keep_tail_bytes=0, prefetch_bytes=4 * MiB)


def _gpt(n_layers=3, seed=0):
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=256, seq_len=32, d_model=64, n_heads=4, n_layers=n_layers)
    model = GPT(cfg)
    batch = make_batch(cfg, 2, torch.Generator().manual_seed(seed))
    return model, batch


def _force(off, choices):
    """Put a plan with these choices in force (bypassing the search)."""
    p = off.set_plan(choices)
    assert p.choices == tuple(choices) and "no prediction" in str(p)


def _count_calls(modules):
    """Forward calls per module, counted when they begin (a checkpoint's recomputation
    stops early, once the last tensor backward needs is recomputed)."""
    counts = [0] * len(modules)
    for i, m in enumerate(modules):
        m.register_forward_pre_hook(lambda mod, a, i=i: counts.__setitem__(i, counts[i] + 1))
    return counts


def test_default_layers_are_the_blocks():
    model, _ = _gpt(3)
    names = [n for n, _ in default_layers(model)]
    assert names == ["blocks.0", "blocks.1", "blocks.2"]
    nested = torch.nn.Module()
    nested.stages = torch.nn.ModuleList([torch.nn.ModuleList([torch.nn.Linear(2, 2)] * 1),
                                         torch.nn.Linear(2, 2)])
    assert [n for n, _ in default_layers(nested)] == ["stages.0.0", "stages.1"]


def test_static_tracking_attributes_bytes_and_changes_nothing(make_offloader):
    model, batch = _gpt(3)
    ref = run_step(model, batch)
    off = make_offloader(**SMALL).track(model)
    with pytest.raises(ssdtrain.SSDTrainError, match="profile"):
        off.plan()
    for _ in range(3):
        before = off.stats().unique_bytes
        assert_same(ref, run_step(model, batch, off))
        step = off._layers.profiler.step
        # Every new record is attributed: to a layer or to "outside the layers".
        assert sum(step.saved_bytes) + step.untracked_bytes == off.stats().unique_bytes - before
        assert all(b > 0 for b in step.saved_bytes) and step.untracked_bytes > 0
    with off:  # begins step 4: steps 1-3 are complete
        pass
    p = off.plan()
    assert [layer.name for layer in p.layers] == ["blocks.0", "blocks.1", "blocks.2"]
    for layer in p.layers:
        assert layer.saved_bytes > 0 and layer.input_bytes == 2 * 32 * 64 * 4
        assert layer.fwd_s > 0 and layer.bwd_s > 0
    assert off._layers.plan is None  # static: a report, nothing applied
    assert "| blocks.0 |" in str(p)


PLANS = [
    (KEEP, KEEP, KEEP),
    (OFFLOAD, OFFLOAD, OFFLOAD),
    (RECOMPUTE, RECOMPUTE, RECOMPUTE),
    (RECOMPUTE, OFFLOAD, KEEP),
    (KEEP, RECOMPUTE, OFFLOAD),
]


@pytest.mark.parametrize("choices,engine", [(p, "auto") for p in PLANS] + [(PLANS[3], "posix")],
                         ids=["-".join(c[0] for c in p) for p in PLANS] + ["r-o-k-posix"])
def test_plans_applied_give_equal_gradients(make_offloader, choices, engine):
    model, batch = _gpt(3)
    ref = run_step(model, batch)
    calls = _count_calls([b.mlp for b in model.blocks])
    off = make_offloader(engine=engine, **SMALL).track(model)
    _force(off, choices)
    for settle in (False, True):
        calls[:] = [0, 0, 0]
        written = off.stats().offloaded_bytes
        assert_same(ref, run_step(model, batch, off, settle=settle))
        # Recompute layers ran their forward twice (forward and backward), others once.
        assert calls == [2 if c == RECOMPUTE else 1 for c in choices]
        s = off._layers.profiler.step
        for i, c in enumerate(choices):
            if c == RECOMPUTE:  # only the checkpoint's saved input reaches ssdtrain
                assert s.saved_bytes[i] == 2 * 32 * 64 * 4
            else:
                assert s.saved_bytes[i] > 2 * 32 * 64 * 4
        off.wait()
        expected = sum(s.saved_bytes[i] for i, c in enumerate(choices) if c != KEEP)
        assert off.stats().offloaded_bytes - written == expected + s.untracked_bytes
    assert off.live_records() == 0


def test_keep_layers_hold_their_bytes_in_memory(make_offloader):
    model, batch = _gpt(2)
    off = make_offloader(**SMALL).track(model)
    _force(off, (KEEP, OFFLOAD))
    with off:
        loss = model(*batch)
        off.wait()
        resident = off.resident_bytes()
    s = off._layers.profiler.step
    # Offloaded records left memory once written; the kept layer's did not.
    assert resident == s.saved_bytes[0]
    loss.backward()
    assert off.resident_bytes() == 0


def test_untrack_restores_the_model(make_offloader):
    model, batch = _gpt(2)
    ref = run_step(model, batch)
    off = make_offloader(**SMALL).track(model)
    _force(off, (RECOMPUTE, RECOMPUTE))
    assert all("forward" in b.__dict__ for b in model.blocks)
    off.untrack()
    assert all("forward" not in b.__dict__ for b in model.blocks)
    assert all(not b._forward_hooks and not b._forward_pre_hooks for b in model.blocks)
    calls = _count_calls([b.mlp for b in model.blocks])
    assert_same(ref, run_step(model, batch, off))
    assert calls == [1, 1]
    off.track(model)
    off.close()  # close untracks too
    assert all(not b._forward_hooks for b in model.blocks)


def test_adaptive_plans_after_profiling_and_stays_exact(make_offloader):
    model, batch = _gpt(3)
    ref = run_step(model, batch)
    budget = 2 * MiB
    off = make_offloader(policy="adaptive", memory_budget_bytes=budget, profile_steps=2,
                         **SMALL).track(model)
    for step in range(5):
        assert_same(ref, run_step(model, batch, off))
        # Steps 1-2 are profiled under the static rules, step 3 with every layer
        # recomputed; step 4 begins with the plan.
        assert (off._layers.plan is not None) == (step >= 3)
        assert off._layers.profiler.step.recompute == (step == 2)
    p = off.plan()
    assert p is off._layers.plan and p.fits and p.prediction.peak_bytes <= budget
    assert testing.write_behind(off) == p.write_behind_bytes <= budget
    assert off._layers.history[0][0] == "profiled"
    # The recompute-all step gave compute-only times, never above the offloaded ones,
    # and a non-negative CPU cost per offloaded byte.
    prof = off._layers.profiler
    layers, parts = prof.costs()
    assert len(prof.profiled_rc) == 1 and prof.profiled_rc[0].recompute
    assert parts["fwd_s_per_byte"] >= 0 and parts["bwd_s_per_byte"] >= 0
    for i, layer in enumerate(layers):
        assert 0 <= layer.fwd_s <= min(s.fwd_s[i] for s in prof.profiled)


def test_adaptive_budget_decides(make_offloader):
    """A budget that holds everything keeps everything; one that holds nothing does not."""
    model, batch = _gpt(3)
    plans = {}
    for budget in (1 << 40, 1):
        off = make_offloader(policy="adaptive", memory_budget_bytes=budget, profile_steps=1,
                             **SMALL).track(model)
        for _ in range(3):
            run_step(model, batch, off)
        plans[budget] = off.plan()
        off.close()
    assert plans[1 << 40].choices == (KEEP,) * 3 and plans[1 << 40].fits
    assert not plans[1].fits and plans[1].choices != (KEEP,) * 3
    assert plans[1].prediction.peak_bytes < plans[1 << 40].prediction.peak_bytes


def test_replan_when_stalls_exceed_the_threshold(make_offloader):
    model, batch = _gpt(3)
    ref = run_step(model, batch)
    # A budget that holds no layer, only the prefetch window.
    off = make_offloader(policy="adaptive", memory_budget_bytes=400 * KiB, profile_steps=1,
                         replan_stall_fraction=0.3, min_tensor_bytes=1 * KiB, keep_tail_bytes=0,
                         prefetch_bytes=256 * KiB).track(model)
    for _ in range(3):  # profiled, recompute-all, planned
        run_step(model, batch, off)
    off.set_plan([OFFLOAD] * 3)
    t0 = time.perf_counter()
    run_step(model, batch, off, settle=True)
    step_s = time.perf_counter() - t0  # on a loaded machine: seconds, not milliseconds
    replans = off._layers.replans
    # From now on every read completes late (the disk is slower than the probe said):
    # backward waits for them, longer than a step takes on this machine right now, so
    # the stalls are well above the threshold however busy the machine is.
    delay = max(0.2, 2 * step_s)
    engine = testing.engine(off)
    read = engine.read

    def slow_read(*args, **kwargs):
        late = concurrent.futures.Future()

        def finish(fut):
            def settle():
                if fut.exception() is not None:
                    late.set_exception(fut.exception())
                else:
                    late.set_result(fut.result())
            threading.Timer(delay, settle).start()
        read(*args, **kwargs).add_done_callback(finish)
        return late
    engine.read = slow_read
    for _ in range(3):
        assert_same(ref, run_step(model, batch, off, settle=True))
    seen = [(round(s.stall_s, 3), round(s.period, 3)) for s in off._layers.profiler.samples]
    assert off._layers.replans > replans and off._layers.scale < 1, seen
    assert off._layers.history[-1][0].startswith("re-plan")


def test_adaptive_needs_track_and_budget(make_offloader, spill_dir):
    with pytest.raises(ssdtrain.ConfigError, match="memory_budget_bytes"):
        ssdtrain.OffloadConfig(policy="adaptive")
    off = make_offloader(policy="adaptive", memory_budget_bytes="1MiB")
    with pytest.raises(ssdtrain.SSDTrainError, match="track"):
        with off:
            pass
    with pytest.raises(ssdtrain.SSDTrainError, match="track"):
        off.plan()
    with pytest.raises(ssdtrain.ConfigError, match="no layers"):
        off.track(torch.nn.Linear(2, 2))
    model, _ = _gpt(1)
    with pytest.raises(ssdtrain.ConfigError, match="twice"):
        off.track(model, layers=[model.blocks[0], model.blocks[0]])
    off.track(model, layers=[model.blocks[0]])
    assert off._layers.profiler.names == ["blocks.0"]
    off.begin_forward()
    with pytest.raises(ssdtrain.SSDTrainError, match="inside a forward"):
        off.track(model)
    off.end_forward()


@pytest.mark.parametrize("field,value,match", [
    ("policy", "greedy", "policy"),
    ("profile_steps", 0, "profile_steps"),
    ("profile_steps", True, "profile_steps"),
    ("replan_stall_fraction", 0, "replan_stall_fraction"),
    ("replan_stall_fraction", "x", "replan_stall_fraction"),
    ("memory_budget_bytes", -1, "memory_budget_bytes"),
    ("memory_budget_bytes", "lots", "memory_budget_bytes"),
])
def test_invalid_planner_fields(field, value, match):
    with pytest.raises(ssdtrain.ConfigError, match=match):
        ssdtrain.OffloadConfig(**{field: value})


def test_planner_fields_from_env():
    cfg = ssdtrain.OffloadConfig.from_env({
        "SSDTRAIN_POLICY": "adaptive", "SSDTRAIN_MEMORY_BUDGET_BYTES": "3GiB",
        "SSDTRAIN_PROFILE_STEPS": "3", "SSDTRAIN_REPLAN_STALL_FRACTION": "0.1"})
    assert (cfg.policy, cfg.memory_budget_bytes, cfg.profile_steps,
            cfg.replan_stall_fraction) == ("adaptive", 3 << 30, 3, 0.1)
    with pytest.raises(ssdtrain.ConfigError, match="SSDTRAIN_PROFILE_STEPS"):
        ssdtrain.OffloadConfig.from_env({"SSDTRAIN_PROFILE_STEPS": "two"})
    with pytest.raises(ssdtrain.ConfigError, match="SSDTRAIN_REPLAN_STALL_FRACTION"):
        ssdtrain.OffloadConfig.from_env({"SSDTRAIN_REPLAN_STALL_FRACTION": "x"})


def test_set_plan_after_profiling_predicts(make_offloader):
    model, batch = _gpt(2)
    ref = run_step(model, batch)
    off = make_offloader(profile_steps=1, **SMALL).track(model)
    with pytest.raises(ssdtrain.ConfigError, match="choices"):
        off.set_plan(["swap", "keep"])
    with pytest.raises(ssdtrain.SSDTrainError, match="2 tracked layers"):
        off.set_plan(["keep"])
    run_step(model, batch, off)
    with off:
        pass
    p = off.set_plan([RECOMPUTE, KEEP])
    assert p.prediction.step_s > 0 and p.prediction.recompute_s == p.layers[0].fwd_s
    assert off.plan() is p
    assert_same(ref, run_step(model, batch, off))


class _ManySmallSaves(torch.nn.Module):
    """Eight ``sin`` and ``mul`` whose saved tensors are each below ``min_tensor_bytes``:
    ssdtrain counts none of them, a recompute recreates all of them."""

    def __init__(self, d):
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(0.5, 1.5, d))

    def forward(self, x):
        for _ in range(8):
            x = torch.sin(x) * self.w
        return x


class _SmallSavesNet(torch.nn.Module):
    def __init__(self, d, n):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(d))  # the first block's input needs grad
        self.blocks = torch.nn.ModuleList([_ManySmallSaves(d) for _ in range(n)])

    def forward(self, x):
        x = x * self.scale
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def _saved_bytes_any_size(module, x):
    """Bytes of the distinct non-parameter storages ``module``'s forward saves for
    backward, of any size: what a checkpoint's recompute recreates and holds."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x.detach().requires_grad_())
    return sum(seen.values())


def test_recompute_plan_predicts_what_the_recompute_holds(make_offloader):
    """NOTE [ Recompute working set ]: the predicted peak of a recompute plan covers the
    bytes a recomputed layer's backward holds, measured independently here (its saved
    tensors, of any size, and its input), though ssdtrain's saved bytes count none of
    them (each is below min_tensor_bytes)."""
    torch.manual_seed(0)
    d, n = 512, 3
    model = _SmallSavesNet(d, n)
    x = torch.randn(16, d)  # 32 KiB per tensor, below min_tensor_bytes
    ref = run_step(model, (x,))
    off = make_offloader(policy="adaptive", memory_budget_bytes=1 << 40, profile_steps=1,
                         min_tensor_bytes=64 * KiB, keep_tail_bytes=0,
                         prefetch_bytes=4 * MiB).track(model)
    for _ in range(2):  # the static profile step, then the recompute-all step
        assert_same(ref, run_step(model, (x,), off))
    with off:
        pass
    p = off.set_plan([RECOMPUTE] * n)
    assert_same(ref, run_step(model, (x,), off))
    truth = _saved_bytes_any_size(model.blocks[0], x)
    assert truth >= 16 * 32 * KiB  # sin's input and mul's input, 8 times
    for layer in p.layers:
        assert layer.saved_bytes == 0 and layer.input_bytes == x.numel() * x.element_size()
        assert layer.recompute_bytes >= truth
        assert p.prediction.peak_bytes >= p.step.fixed_bytes + truth + layer.input_bytes


@pytest.mark.parametrize("budget", [1 << 40, 640 * KiB])
@pytest.mark.parametrize("keep_tail", [0, 256 * KiB])
def test_offload_plan_predicts_at_least_what_it_holds(make_offloader, keep_tail, budget):
    """NOTE [ Memory timeline ]: an offload-everything plan's predicted peak covers
    ssdtrain's own count of what it holds (``peak_resident_bytes``) in a step run
    under the plan, and stays close to it (within a prefetch window and the head's
    records), where the previous model counted the head's records and two windows
    at every moment. Under a budget the write-behind throttle may let one record
    more through (NOTE [ Memory timeline ]): the largest record, the logits, is the
    slack."""
    model, batch = _gpt(3)
    ref = run_step(model, batch)
    cfg = dict(SMALL, keep_tail_bytes=keep_tail, prefetch_bytes=256 * KiB)
    off = make_offloader(policy="adaptive", memory_budget_bytes=budget, profile_steps=1,
                         **cfg).track(model)
    for _ in range(2):  # the static profile step, then the recompute-all step
        assert_same(ref, run_step(model, batch, off))
    p = off.set_plan([OFFLOAD] * 3)
    off._stats.peak_resident_bytes = 0  # measure the planned step alone
    # Forward's writes end before backward begins (settle): the model has bandwidth but
    # no latency, so writes a loaded disk has not finished when backward starts are
    # not on its timeline (NOTE [ Memory timeline ]); with them this test failed now and
    # then under a loaded 2-core CI (measured 754 KiB against 640 + 64 predicted).
    assert_same(ref, run_step(model, batch, off, settle=True))
    off.wait()
    measured = off.stats().peak_resident_bytes
    step = p.step
    assert step.head_bytes > 0 and step.keep_tail_bytes == keep_tail
    assert measured > 0
    logits = batch[0].numel() * model.cfg.vocab_size * 4
    slack = logits if budget < 1 << 40 else 0
    assert p.prediction.peak_bytes + slack >= measured, (p.prediction.peak_bytes, measured)
    if budget < 1 << 40:
        # Without a budget forward counts every write as in flight (the model has no
        # latency); under one the throttle bounds them, and the prediction is close
        # (within one record more: on a loaded machine the measured step may hold the
        # record the throttle lets through at another moment than the peak).
        assert p.prediction.peak_bytes <= min(budget, measured + step.prefetch_bytes +
                                              step.head_bytes + slack)
