"""The planner's cost model with a host-RAM tier (NOTE [ Tiers in the step cost model ]
in ssdtrain/_policies/costmodel.py): bytes that fit the host budget are priced at the device <->
host link's bandwidth, the rest at the SSD's (or kept in device memory without an SSD
tier), split the way NOTE [ Host tier ] in _store/hosttier.py splits records. Timings are
never asserted: every number here is the model's."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ssdtrain._policies.planner import (CHOICES, KEEP, OFFLOAD, RECOMPUTE, LayerCost, StepCost,
                                        plan, predict, tier_split)

MiB = 1 << 20
GOLDEN = Path(__file__).resolve().parent / "golden" / "planner_no_host_tier.json"
SETTINGS = settings(max_examples=80, deadline=None)


def _layers(n, saved=100 * MiB, inp=1 * MiB, f=0.0, b=0.0):
    return [LayerCost(f"blocks.{i}", saved, inp, f, b) for i in range(n)]


def _host(step, budget, gbps=25.0, ssd_tier=True):
    return dataclasses.replace(step, host_budget_bytes=budget, host_write_bps=gbps * 1e9,
                               host_read_bps=gbps * 1e9, ssd_tier=ssd_tier)


# ------------------------------------------------------------ where the bytes go
def test_split_follows_the_tier():
    """With an SSD the tier evicts its earliest records, so RAM ends with the last
    budget bytes of forward (the head's records beyond the tail last of all); without
    one the records that do not fit stay on the device, so RAM has the first ones."""
    step = StepCost(write_bps=1e9, read_bps=1e9, head_bytes=30 * MiB, keep_tail_bytes=10 * MiB)
    o = [100 * MiB, 100 * MiB, 100 * MiB]
    host, rest = tier_split(o, _host(step, 170 * MiB))
    assert host == [0, 50 * MiB, 100 * MiB, 20 * MiB]   # last entry: the head's 20 MiB
    assert rest == [100 * MiB, 50 * MiB, 0, 0]
    host, rest = tier_split(o, _host(step, 170 * MiB, ssd_tier=False))
    assert host == [100 * MiB, 70 * MiB, 0, 0]
    assert rest == [0, 30 * MiB, 100 * MiB, 20 * MiB]
    assert tier_split(o, dataclasses.replace(step, host_budget_bytes=170 * MiB)) is None


def test_budget_covering_everything_prices_the_host_copies():
    """Offload-all with a host budget covering every byte and a slow SSD: the step is
    the copies to RAM and back (no compute, no write-behind: each copy waited for),
    where before the host tier was priced it was the SSD's write and read."""
    layers = _layers(2)
    slow_ssd = StepCost(write_bps=1e6, read_bps=1e6, write_behind_bytes=0,
                        prefetch_bytes=1 << 30)
    tiered = _host(slow_ssd, 200 * MiB, gbps=1.0)
    p = predict(layers, [OFFLOAD] * 2, tiered)
    assert p.step_s == pytest.approx(2 * 200 * MiB / 1e9)
    assert (p.host_bytes, p.ssd_bytes, p.device_bytes) == (200 * MiB, 0, 0)
    assert p.written_bytes == 200 * MiB
    ssd = predict(layers, [OFFLOAD] * 2, slow_ssd)
    assert ssd.step_s == pytest.approx(2 * 200 * MiB / 1e6)
    assert (ssd.host_bytes, ssd.ssd_bytes) == (0, 200 * MiB)
    # Half the budget: the first layer's bytes go to the SSD, the second's to RAM.
    half = predict(layers, [OFFLOAD] * 2, _host(slow_ssd, 100 * MiB, gbps=1.0))
    assert (half.host_bytes, half.ssd_bytes) == (100 * MiB, 100 * MiB)
    assert p.step_s < half.step_s < ssd.step_s
    # The memory predicted does not depend on where the bytes went.
    assert p.peak_bytes == half.peak_bytes == ssd.peak_bytes


def test_planner_offloads_to_ram_where_the_ssd_made_it_recompute():
    """A budget that keeps one layer of four, an SSD too slow to hide: the planner
    recomputes. With a host tier taking every byte at 25 GB/s the copies hide behind
    compute and it offloads instead (faster than recomputing)."""
    layers = _layers(4, saved=100 * MiB, inp=1 * MiB, f=0.1, b=0.2)
    step = StepCost(write_bps=1e7, read_bps=1e7, prefetch_bytes=40 * MiB,
                    write_behind_bytes=256 * MiB)
    budget = 150 * MiB
    before = plan(layers, budget, step)
    assert before.fits and OFFLOAD not in before.choices and RECOMPUTE in before.choices
    after = plan(layers, budget, _host(step, 1 << 40))
    assert after.fits and RECOMPUTE not in after.choices and OFFLOAD in after.choices
    assert after.prediction.step_s < before.prediction.step_s
    assert after.prediction.ssd_bytes == 0 and after.prediction.host_bytes > 0
    assert "host tier" not in before.table()
    assert f"{after.prediction.host_bytes / MiB:.1f} MiB to RAM, 0.0 MiB to the SSD" in \
        after.table()


def test_without_ssd_bytes_beyond_the_budget_stay_on_the_device():
    """No SSD tier: what does not fit the budget is held like a kept layer (in the peak,
    not written, no I/O time); budget 0 is keep-all's memory and time."""
    layers = _layers(4, saved=100 * MiB, f=0.1, b=0.2)
    step = StepCost(write_bps=1e9, read_bps=1e9, prefetch_bytes=50 * MiB,
                    write_behind_bytes=20 * MiB)
    keep = predict(layers, [KEEP] * 4, step)
    none = predict(layers, [OFFLOAD] * 4, _host(step, 0, ssd_tier=False))
    assert (none.peak_bytes, none.step_s, none.written_bytes) == (keep.peak_bytes, keep.step_s, 0)
    assert none.device_bytes == 400 * MiB
    some = predict(layers, [OFFLOAD] * 4, _host(step, 250 * MiB, ssd_tier=False))
    assert (some.host_bytes, some.device_bytes, some.ssd_bytes) == (250 * MiB, 150 * MiB, 0)
    # Layers 2 and 3 (150 MiB) stay, and layer 1's 50 MiB in RAM come back through the
    # window with them.
    assert some.peak_bytes == 150 * MiB + 50 * MiB
    every = predict(layers, [OFFLOAD] * 4, _host(step, 1 << 40, ssd_tier=False))
    assert every.device_bytes == 0 and every.peak_bytes == 50 * MiB
    # The budget's throttle leaves room for what stays on the device.
    p = plan(layers, 210 * MiB, _host(step, 250 * MiB, ssd_tier=False), allowed=(OFFLOAD,))
    assert p.fits and p.prediction.peak_bytes <= 210 * MiB


def test_no_ssd_needs_host_bandwidths():
    layers = _layers(1)
    step = StepCost(write_bps=1e9, read_bps=1e9, ssd_tier=False, host_budget_bytes=MiB)
    with pytest.raises(ValueError, match="host_write_bps and host_read_bps"):
        predict(layers, [OFFLOAD], step)
    with pytest.raises(ValueError, match="host tier bandwidths must be > 0"):
        predict(layers, [OFFLOAD], _host(step, MiB, gbps=0.0))


# ---------------------------------------------------------- no host tier: as before
def _golden():
    return json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("host", [
    {},                                                                  # no host fields
    dict(host_budget_bytes=0, host_write_bps=25e9, host_read_bps=25e9),  # budget 0
    dict(host_budget_bytes=1 << 40),                                     # not priced
], ids=["no-host-tier", "budget-0", "no-host-bandwidth"])
def test_without_a_priced_host_tier_predictions_are_the_old_ones(host):
    """The predictions of the code before the host tier was priced (every plan of three
    layers on eight configurations, and the plan under a budget; recorded in
    tests/golden/planner_no_host_tier.json from commit 53ce136), to the bit: with
    budget 0, an SSD tier and a link faster than the SSD (25 GB/s here, the SSDs of the
    file 0.1-7 GB/s), or no host bandwidth (the adaptive policy's case), the tier
    changes nothing."""
    letters = {c[0]: c for c in CHOICES}
    for row in _golden():
        layers = [LayerCost(*fields) for fields in row["layers"]]
        step = StepCost(**row["step"], **host)
        for key, want in row["predictions"].items():
            p = predict(layers, tuple(letters[k] for k in key), step)
            assert [p.step_s, p.stall_s, p.recompute_s, p.peak_bytes, p.written_bytes,
                    p.kept_bytes, p.backward_end_s] == want, key
        best = plan(layers, row["plan_budget"], step)
        assert "".join(c[0] for c in best.choices) == row["plan"]
        assert best.prediction.step_s == row["plan_step_s"]


# ------------------------------------------------------------------ properties
from test_planner import bw_st, layers_st  # noqa: E402 (the planner's strategies)

step_st = st.builds(
    StepCost,
    write_bps=bw_st,
    read_bps=bw_st,
    fwd_other_s=st.floats(0.0, 1.0),
    bwd_head_s=st.floats(0.0, 1.0),
    tail_s=st.floats(0.0, 1.0),
    prefetch_bytes=st.integers(1, 1024 * MiB),
    write_behind_bytes=st.integers(0, 2048 * MiB),
    fixed_bytes=st.integers(0, 64 * MiB),
    head_bytes=st.integers(0, 256 * MiB),
    keep_tail_bytes=st.integers(0, 128 * MiB),
    host_write_bps=bw_st,
    host_read_bps=bw_st,
    fwd_s_per_byte=st.sampled_from([0.0, 1e-11]),
    bwd_s_per_byte=st.sampled_from([0.0, 1e-11]),
)
budget_st = st.integers(0, 3 * 1024 * MiB)
choices_st = st.data()


def _choices(data, n):
    return data.draw(st.lists(st.sampled_from(CHOICES), min_size=n, max_size=n))


@SETTINGS
@given(layers_st, step_st, choices_st, budget_st, budget_st)
def test_step_non_increasing_in_host_budget(layers, step, data, a, b):
    """With an SSD tier a larger host budget never predicts a slower step, nor different
    memory, whatever the bandwidths (every byte crosses the link either way; a byte in
    RAM skips the SSD); the plan's step too."""
    small = dataclasses.replace(step, host_budget_bytes=min(a, b))
    big = dataclasses.replace(step, host_budget_bytes=max(a, b))
    choices = _choices(data, len(layers))
    p, q = predict(layers, choices, small), predict(layers, choices, big)
    assert q.step_s <= p.step_s + 1e-9
    assert q.peak_bytes == p.peak_bytes
    assert q.host_bytes >= p.host_bytes and q.ssd_bytes <= p.ssd_bytes
    assert p.host_bytes + p.ssd_bytes == q.host_bytes + q.ssd_bytes
    budget = data.draw(st.one_of(st.none(), st.integers(0, 4096 * MiB)))
    ps, qs = plan(layers, budget, small, max_plans=81), plan(layers, budget, big, max_plans=81)
    if ps.fits:
        assert qs.fits and qs.prediction.step_s <= ps.prediction.step_s + 1e-9


@SETTINGS
@given(layers_st, step_st, choices_st, budget_st, st.floats(1.0, 100.0),
       st.sampled_from(["write", "read", "both"]), st.booleans())
def test_step_non_increasing_in_host_bandwidth(layers, step, data, budget, factor, which,
                                               ssd_tier):
    """A faster device <-> host link never predicts a slower step, with or without an
    SSD tier, whatever the budget."""
    step = dataclasses.replace(step, host_budget_bytes=budget, ssd_tier=ssd_tier)
    faster = dataclasses.replace(
        step,
        host_write_bps=step.host_write_bps * (factor if which in ("write", "both") else 1),
        host_read_bps=step.host_read_bps * (factor if which in ("read", "both") else 1))
    choices = _choices(data, len(layers))
    p, q = predict(layers, choices, step), predict(layers, choices, faster)
    assert q.step_s <= p.step_s + 1e-9
    assert q.peak_bytes == p.peak_bytes


@SETTINGS
@given(layers_st, step_st, choices_st, budget_st, st.booleans())
def test_every_offloaded_byte_goes_to_one_tier(layers, step, data, budget, ssd_tier):
    step = dataclasses.replace(step, host_budget_bytes=budget, ssd_tier=ssd_tier)
    choices = _choices(data, len(layers))
    p = predict(layers, choices, step)
    base = predict(layers, choices, dataclasses.replace(step, host_write_bps=None, ssd_tier=True))
    assert p.host_bytes + p.ssd_bytes + p.device_bytes == base.ssd_bytes
    assert p.host_bytes <= budget
    assert p.written_bytes + p.device_bytes >= base.written_bytes
    if not ssd_tier:
        assert p.ssd_bytes == 0
    else:
        assert p.device_bytes == 0


@SETTINGS
@given(layers_st, step_st, budget_st, st.one_of(st.none(), st.integers(0, 4096 * MiB)))
def test_plan_fits_without_ssd(layers, step, host_budget, budget):
    """Without an SSD tier the plan's peak (what stays on the device included) fits the
    budget, or no plan does."""
    step = dataclasses.replace(step, host_budget_bytes=host_budget, ssd_tier=False)
    p = plan(layers, budget, step, max_plans=81)
    assert p.prediction == predict(layers, p.choices, p.step)
    if p.fits:
        assert budget is None or p.prediction.peak_bytes <= budget
    elif len(layers) <= 3:
        for choices in itertools.product(CHOICES, repeat=len(layers)):
            assert predict(layers, choices, step).peak_bytes > budget
