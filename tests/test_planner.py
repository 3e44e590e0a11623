"""The planner's math (ssdtrain._policies.planner): pure functions, property-tested."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ssdtrain._policies.planner import (CHOICES, KEEP, OFFLOAD, RECOMPUTE, LayerCost, StepCost,
                                        group_layers, plan, plan_family, predict, rok_plans,
                                        throttled_step, two_part_plans)

MiB = 1 << 20

layer_st = st.builds(
    LayerCost,
    name=st.just("layer"),
    saved_bytes=st.integers(0, 512 * MiB),
    input_bytes=st.integers(0, 64 * MiB),
    fwd_s=st.floats(0.0, 2.0, allow_nan=False),
    bwd_s=st.floats(0.0, 4.0, allow_nan=False),
    recompute_bytes=st.integers(0, 640 * MiB),
)
layers_st = st.lists(layer_st, min_size=0, max_size=5)
bw_st = st.floats(1e6, 1e11, allow_nan=False)
step_st = st.builds(
    StepCost,
    write_bps=bw_st,
    read_bps=bw_st,
    fwd_other_s=st.floats(0.0, 1.0),
    bwd_head_s=st.floats(0.0, 1.0),
    tail_s=st.floats(0.0, 1.0),
    between_s=st.floats(0.0, 1.0),
    prefetch_bytes=st.integers(1, 1024 * MiB),
    write_behind_bytes=st.integers(0, 2048 * MiB),
    fixed_bytes=st.integers(0, 64 * MiB),
)
budget_st = st.one_of(st.none(), st.integers(0, 4096 * MiB))
SETTINGS = settings(max_examples=60, deadline=None)


def _with_bw(step, write=None, read=None):
    fields = dict(step.__dict__)
    if write is not None:
        fields["write_bps"] = write
    if read is not None:
        fields["read_bps"] = read
    return StepCost(**fields)


@SETTINGS
@given(layers_st, budget_st, step_st)
def test_budget_respected(layers, budget, step):
    p = plan(layers, budget, step)
    assert len(p.choices) == len(layers)
    assert p.prediction == predict(layers, p.choices, p.step)
    assert p.step.write_behind_bytes <= step.write_behind_bytes
    if p.fits:
        assert budget is None or p.prediction.peak_bytes <= budget
    else:
        # No plan fits: then truly none does, and the least-memory one is returned.
        for choices in itertools.product(CHOICES, repeat=len(layers)):
            assert predict(layers, choices, step).peak_bytes > budget
            assert predict(layers, choices, step).peak_bytes >= p.prediction.peak_bytes


@SETTINGS
@given(layers_st, budget_st, step_st, st.floats(1.0, 100.0), st.sampled_from(["write", "read",
                                                                               "both"]))
def test_predicted_time_monotone_in_bandwidth(layers, budget, step, factor, which):
    faster = _with_bw(step,
                      write=step.write_bps * factor if which in ("write", "both") else None,
                      read=step.read_bps * factor if which in ("read", "both") else None)
    slow, fast = plan(layers, budget, step), plan(layers, budget, faster)
    if slow.fits:
        assert fast.fits
        assert fast.prediction.step_s <= slow.prediction.step_s + 1e-9
    # Each plan alone is monotone too.
    for choices in (slow.choices, fast.choices):
        assert predict(layers, choices, faster).step_s <= \
            predict(layers, choices, step).step_s + 1e-9


@SETTINGS
@given(layers_st, step_st, st.integers(0, 4096 * MiB), st.integers(0, 4096 * MiB))
def test_predicted_time_monotone_in_budget(layers, step, a, b):
    small, big = plan(layers, min(a, b), step), plan(layers, max(a, b), step)
    if small.fits:
        assert big.fits and big.prediction.step_s <= small.prediction.step_s + 1e-9


@SETTINGS
@given(st.lists(layer_st, min_size=1, max_size=4), budget_st, step_st)
def test_plan_is_the_best_of_all_plans(layers, budget, step):
    """With 3**n <= max_plans the search is exhaustive over every per-layer choice."""
    p = plan(layers, budget, step)
    for choices in itertools.product(CHOICES, repeat=len(layers)):
        pred = predict(layers, choices, step)
        if budget is None or pred.peak_bytes <= budget:
            assert p.fits and p.prediction.step_s <= pred.step_s + 1e-9


def _layers(n, saved=100 * MiB, inp=8 * MiB, f=0.1, b=0.2):
    return [LayerCost(f"blocks.{i}", saved, inp, f, b) for i in range(n)]


def test_predict_keep_all_and_recompute_all():
    layers = _layers(4)
    step = StepCost(write_bps=1e9, read_bps=1e9, fwd_other_s=0.05, bwd_head_s=0.07, tail_s=0.11)
    keep = predict(layers, [KEEP] * 4, step)
    assert keep.stall_s == 0 and keep.written_bytes == 0 and keep.recompute_s == 0
    assert keep.step_s == pytest.approx(4 * 0.1 + 0.05 + 0.07 + 4 * 0.2 + 0.11)
    assert keep.peak_bytes == 400 * MiB
    rec = predict(layers, [RECOMPUTE] * 4, step)
    assert rec.recompute_s == pytest.approx(0.4)
    assert rec.written_bytes == 4 * 8 * MiB
    # Backward holds one recomputed layer at a time (its saved bytes and its input,
    # NOTE [ Recompute working set ]), plus the (small) prefetch window.
    assert rec.peak_bytes == 100 * MiB + 8 * MiB + 4 * 8 * MiB
    # A measured recompute larger than the saved bytes (small tensors, temporaries) counts.
    bigger = [dataclasses.replace(layer, recompute_bytes=130 * MiB) for layer in layers]
    assert predict(bigger, [RECOMPUTE] * 4, step).peak_bytes == 130 * MiB + 8 * MiB + 4 * 8 * MiB
    assert predict(bigger, [KEEP] * 4, step) == keep


def test_slow_read_stalls_offload():
    layers = _layers(2, saved=100 * MiB, b=0.01)
    step = StepCost(write_bps=1e12, read_bps=100 * MiB)  # 1 s per layer to read back
    off = predict(layers, [OFFLOAD, OFFLOAD], step)
    # Reads start at the end of forward; layer 1 waits ~1 s, layer 0 another ~1 s.
    assert off.stall_s == pytest.approx(2.0 - 0.01, rel=1e-3)


def test_prefetch_window_delays_reads():
    layers = _layers(3, saved=100 * MiB, f=0.0, b=0.1)
    # Each read takes 0.5 s; the head's backward (2 s) leaves time to read all three.
    narrow = StepCost(write_bps=1e12, read_bps=200 * MiB, prefetch_bytes=1, bwd_head_s=2.0)
    wide = StepCost(write_bps=1e12, read_bps=200 * MiB, prefetch_bytes=1 << 40, bwd_head_s=2.0)
    assert predict(layers, [OFFLOAD] * 3, wide).stall_s == pytest.approx(0, abs=1e-9)
    # A one-byte window reads one layer ahead only: layers 1 and 0 each wait 0.4 s.
    assert predict(layers, [OFFLOAD] * 3, narrow).stall_s == pytest.approx(0.8)


def test_write_behind_throttles_forward():
    layers = _layers(3, saved=100 * MiB, f=0.01, b=0.0)
    step = StepCost(write_bps=100 * MiB, read_bps=1e12, write_behind_bytes=0)
    p = predict(layers, [OFFLOAD] * 3, step)
    assert p.stall_s >= 2.9  # forward waits for each 1 s write


def test_plan_choices_follow_the_disk():
    layers = _layers(6, saved=200 * MiB, inp=10 * MiB, f=0.1, b=0.2)
    budget = 500 * MiB
    fast = plan(layers, budget, StepCost(write_bps=20e9, read_bps=20e9, prefetch_bytes=200 * MiB))
    slow = plan(layers, budget, StepCost(write_bps=20e6, read_bps=20e6, prefetch_bytes=200 * MiB))
    assert fast.fits and slow.fits
    assert fast.counts()[RECOMPUTE] == 0 and fast.counts()[OFFLOAD] >= 4
    assert slow.counts()[RECOMPUTE] >= 4  # reading 200 MiB at 20 MB/s costs 10 s, recompute 0.1
    # No budget: keeping everything is fastest.
    free = plan(layers, None, StepCost(write_bps=1e9, read_bps=1e9))
    assert free.choices == (KEEP,) * 6
    assert "| blocks.0 | keep |" in free.table() and "predicted step" in str(free)


def test_no_plan_fits_returns_least_memory():
    layers = _layers(3)
    p = plan(layers, 1, StepCost(write_bps=1e9, read_bps=1e9, prefetch_bytes=64 * MiB))
    assert not p.fits and "NO plan fits" in p.table()
    least = min(predict(layers, c, p.step).peak_bytes
                for c in itertools.product(CHOICES, repeat=3))
    assert p.prediction.peak_bytes == least


def test_allowed_restricts_the_search():
    layers = _layers(4)
    step = StepCost(write_bps=1e6, read_bps=1e6)
    p = plan(layers, 50 * MiB, step, allowed=(KEEP, OFFLOAD))
    assert RECOMPUTE not in p.choices
    with pytest.raises(ValueError, match="allowed"):
        plan(layers, None, step, allowed=("swap",))
    with pytest.raises(ValueError, match="unknown plan choice"):
        predict(layers, ["swap"] * 4, step)
    with pytest.raises(ValueError, match="bandwidths"):
        predict(layers, [KEEP] * 4, StepCost(write_bps=0, read_bps=1))


@given(st.integers(0, 40), st.integers(1, 100000), st.sampled_from([2, 3]))
def test_group_layers(n, max_plans, k):
    groups = group_layers(n, max_plans, k)
    assert [i for g in groups for i in g] == list(range(n))
    if n:
        assert k ** len(groups) <= max(max_plans, k)
        sizes = [len(g) for g in groups]
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
        if k ** n <= max_plans:
            assert len(groups) == n


def test_grouped_search_size():
    layers = _layers(12)
    p = plan(layers, 600 * MiB, StepCost(write_bps=1e9, read_bps=1e9), max_plans=729)
    family = list(plan_family(12, 729))
    assert len(family) == len(set(family)) == p.plans_searched
    # 3**6 group plans, and the two-part plans that split a group (odd k): 9 ordered
    # pairs of different choices, 6 odd k each.
    assert p.plans_searched == 729 + 6 * 6 and "groups" in p.table()


def _static_mixes(n):
    """The accelerator emulator's static plans: keep-all, offload-all, checkpoint (every
    layer recomputed), and ok<k>, rk<k>, ro<k> (benchmarks/accel_emulator.py plan_for)."""
    out = [(KEEP,) * n, (OFFLOAD,) * n, (RECOMPUTE,) * n]
    for k in range(1, n):
        for first, rest in ((OFFLOAD, KEEP), (RECOMPUTE, KEEP), (RECOMPUTE, OFFLOAD)):
            out.append((first,) * k + (rest,) * (n - k))
    return out


@pytest.mark.parametrize("n,max_plans", [(1, 6561), (5, 9), (8, 6561), (12, 729), (40, 6561),
                                         (7, 1)])
def test_plan_family_contains_the_static_mixes(n, max_plans):
    family = set(plan_family(n, max_plans))
    assert set(two_part_plans(n)) <= family
    assert set(_static_mixes(n)) <= family
    two = two_part_plans(n)
    assert len(two) == len(set(two)) == (1 if n == 0 else 3 + 6 * (n - 1) + (0 if n < 2 else 0))


def test_plan_beats_a_static_mix_that_splits_a_group():
    """Five layers in two groups ([0, 1, 2], [3, 4]): the budget fits four kept layers and
    one recomputed. The groups alone can only recompute three (or two); the two-part
    plan rk1 (recompute layer 0, keep the rest) is in the family, and chosen."""
    layers = _layers(5, saved=100 * MiB, inp=1 * MiB, f=0.1, b=0.2)
    step = StepCost(write_bps=1e6, read_bps=1e6)   # offloading is hopeless
    budget = 450 * MiB                             # four kept layers, not five
    rk1 = (RECOMPUTE,) + (KEEP,) * 4
    assert predict(layers, rk1, throttled_step(layers, rk1, step, budget)).peak_bytes <= budget
    p = plan(layers, budget, step, max_plans=9)
    assert p.choices == rk1
    assert p.prediction.recompute_s == pytest.approx(0.1)


@settings(max_examples=40, deadline=None)
@given(st.lists(layer_st, min_size=1, max_size=9), budget_st, step_st,
       st.sampled_from([1, 3, 9, 27]))
def test_plan_no_slower_than_any_static_mix_that_fits(layers, budget, step, max_plans):
    """Grouped or not, the chosen plan is predicted no slower than keep-all, offload-all,
    recompute-all and every static mix whose predicted peak fits the budget."""
    p = plan(layers, budget, step, max_plans=max_plans)
    for choices in _static_mixes(len(layers)):
        pred = predict(layers, choices, throttled_step(layers, choices, step, budget))
        if budget is None or pred.peak_bytes <= budget:
            assert p.fits and p.prediction.step_s <= pred.step_s + 1e-9


def test_backward_end_is_the_step_less_between():
    """between_s (end of backward to the next forward) is in step_s, not backward_end_s,
    and changes no choice."""
    layers = _layers(4)
    base = StepCost(write_bps=1e9, read_bps=1e8, tail_s=0.05)
    later = dataclasses.replace(base, between_s=0.5)
    for choices in rok_plans(4):
        a, b = predict(layers, choices, base), predict(layers, choices, later)
        assert a.backward_end_s == a.step_s == b.backward_end_s
        assert b.step_s == pytest.approx(a.step_s + 0.5)
    assert plan(layers, 250 * MiB, base).choices == plan(layers, 250 * MiB, later).choices


def test_rok_plans():
    plans = rok_plans(3)
    assert plans[0] == (KEEP,) * 3 and plans[-1] == (RECOMPUTE,) * 3
    assert (OFFLOAD,) * 3 in plans and len(plans) == 7 and len(set(plans)) == 7


def test_budget_lowers_write_behind():
    """With a budget, forward may hold only what the kept layers leave of it in flight."""
    layers = _layers(3, saved=100 * MiB, f=0.01, b=0.0)
    step = StepCost(write_bps=100 * MiB, read_bps=1e12, fixed_bytes=10 * MiB,
                    prefetch_bytes=50 * MiB)
    free = predict(layers, [OFFLOAD] * 3, step)
    assert free.peak_bytes >= 200 * MiB  # the disk lags: writes pile up in memory
    p = plan(layers, 150 * MiB, step, allowed=(KEEP, OFFLOAD))
    assert p.fits and p.choices == (OFFLOAD,) * 3
    assert p.write_behind_bytes == 140 * MiB
    assert p.prediction.peak_bytes <= 150 * MiB and p.prediction.stall_s >= free.stall_s


@SETTINGS
@given(layers_st, step_st, st.data())
def test_recomputed_layer_working_set_is_in_the_peak(layers, step, data):
    """NOTE [ Recompute working set ]: while a recomputed layer's backward runs, the
    predicted memory holds what its recompute creates (measured, or its saved bytes)
    and its input."""
    choices = data.draw(st.lists(st.sampled_from(CHOICES), min_size=len(layers),
                                 max_size=len(layers)))
    pred = predict(layers, choices, step)
    for layer, c in zip(layers, choices):
        if c == RECOMPUTE:
            assert pred.peak_bytes >= step.fixed_bytes + layer.input_bytes + \
                max(layer.saved_bytes, layer.recompute_bytes)


@SETTINGS
@given(st.lists(layer_st, min_size=1, max_size=5), step_st, st.data(),
       st.integers(1, 256 * MiB))
def test_larger_recompute_never_predicts_less_memory(layers, step, data, extra):
    choices = data.draw(st.lists(st.sampled_from(CHOICES), min_size=len(layers),
                                 max_size=len(layers)))
    j = data.draw(st.integers(0, len(layers) - 1))
    more = list(layers)
    more[j] = dataclasses.replace(layers[j], recompute_bytes=layers[j].recompute_bytes + extra)
    a, b = predict(layers, choices, step), predict(more, choices, step)
    assert b.step_s == a.step_s and b.written_bytes == a.written_bytes
    assert b.peak_bytes >= a.peak_bytes
    if choices[j] != RECOMPUTE:
        assert b.peak_bytes == a.peak_bytes
    else:
        assert b.peak_bytes >= step.fixed_bytes + more[j].recompute_working_bytes


# NOTE [ Memory timeline ]
step_head_st = st.builds(
    StepCost,
    write_bps=bw_st,
    read_bps=bw_st,
    prefetch_bytes=st.integers(1, 1024 * MiB),
    write_behind_bytes=st.integers(0, 2048 * MiB),
    fixed_bytes=st.integers(0, 64 * MiB),
    head_bytes=st.integers(0, 512 * MiB),
    keep_tail_bytes=st.integers(0, 256 * MiB),
)


@SETTINGS
@given(layers_st, budget_st, step_head_st)
def test_budget_respected_with_head(layers, budget, step):
    p = plan(layers, budget, step)
    assert p.prediction == predict(layers, p.choices, p.step)
    if p.fits:
        assert budget is None or p.prediction.peak_bytes <= budget
    else:
        for choices in itertools.product(CHOICES, repeat=len(layers)):
            assert predict(layers, choices, throttled_step(layers, choices, step, budget)) \
                .peak_bytes > budget


@SETTINGS
@given(layers_st, step_head_st, st.data(), st.integers(1, 256 * MiB))
def test_more_head_bytes_never_predict_less_memory(layers, step, data, extra):
    choices = data.draw(st.lists(st.sampled_from(CHOICES), min_size=len(layers),
                                 max_size=len(layers)))
    more = dataclasses.replace(step, head_bytes=step.head_bytes + extra)
    a, b = predict(layers, choices, step), predict(layers, choices, more)
    assert b.peak_bytes >= a.peak_bytes
    assert b.step_s == a.step_s  # memory only
    # The head's records are held at the end of forward (kept tail, writes in flight).
    assert b.peak_bytes >= step.fixed_bytes + min(more.head_bytes, step.keep_tail_bytes +
                                                  step.write_behind_bytes)


@SETTINGS
@given(layers_st, step_head_st, st.data(), st.integers(1, 256 * MiB))
def test_larger_window_never_predicts_less_memory(layers, step, data, extra):
    choices = data.draw(st.lists(st.sampled_from(CHOICES), min_size=len(layers),
                                 max_size=len(layers)))
    more = dataclasses.replace(step, prefetch_bytes=step.prefetch_bytes + extra)
    assert predict(layers, choices, more).peak_bytes >= predict(layers, choices, step).peak_bytes


def test_head_records_held_only_until_the_heads_backward():
    """Offload everything, fast disk: the head's records and the kept tail share the
    prefetch window in the head's backward and are gone for the layers' backward, so
    the peak is one window, not the head's records plus two windows."""
    layers = _layers(4, saved=100 * MiB, f=0.1, b=0.2)
    step = StepCost(write_bps=1e13, read_bps=1e13, prefetch_bytes=50 * MiB,
                    write_behind_bytes=20 * MiB, head_bytes=40 * MiB,
                    keep_tail_bytes=10 * MiB)
    off = predict(layers, [OFFLOAD] * 4, step)
    assert off.peak_bytes == 50 * MiB
    # A head larger than the window, no throttle: the writes in flight at the end of
    # forward (every layer's, as far as memory is concerned, and the head's beyond the
    # tail) are the peak, and a budget throttles them.
    big = dataclasses.replace(step, head_bytes=300 * MiB, write_behind_bytes=1 << 30)
    assert predict(layers, [OFFLOAD] * 4, big).peak_bytes == 10 * MiB + 400 * MiB + 290 * MiB
    p = plan(layers, 120 * MiB, big, allowed=(OFFLOAD,))
    assert p.fits and p.write_behind_bytes == 110 * MiB and p.prediction.peak_bytes == 120 * MiB
    # Keep everything: the layers, then the kept tail and the head's writes at the
    # end of forward, and in the head's backward the window on top of every layer.
    keep = predict(layers, [KEEP] * 4, step)
    assert keep.peak_bytes == 400 * MiB + 10 * MiB + 30 * MiB
    # The kept tail of a plan that offloads nothing holds only the head's records.
    small = dataclasses.replace(step, head_bytes=4 * MiB)
    assert predict(layers, [KEEP] * 4, small).peak_bytes == 400 * MiB + 4 * MiB


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(1, 8)), max_size=12),
       st.integers(0, 25), st.integers(0, 30))
def test_read_start_is_the_scan_it_replaces(begun, disk, prefetch):
    """predict()'s read window (_Begun.read_start, O(layers) per read) gives the time the
    scan over every candidate time gave (O(layers^2) per read), ties included."""
    from ssdtrain._policies.costmodel import _Begun
    times, acc = [], 0
    for dt, _ in begun:  # begin times never decrease
        acc += dt
        times.append(acc)
    sizes = [b for _, b in begun]
    candidates = sorted({disk} | {t for t in times if t > disk})
    want = candidates[-1]
    for tau in candidates:
        if sum(b for t, b in zip(times, sizes) if t > tau) < prefetch:
            want = tau
            break
    b = _Begun()
    for t, n in zip(times, sizes):
        b.add(t, n)
    assert b.read_start(disk, prefetch) == want
