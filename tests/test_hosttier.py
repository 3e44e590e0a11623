"""The host-RAM tier (NOTE [ Host tier ] in ssdtrain/_store/hosttier.py) on the loopback device.

Device records are the loopback device's memory (ssdtrain/testing/loopback.py), so every
record here takes the device path: copied to pinned host memory, kept there while
``host_budget_bytes`` allows, the earliest saved written on to the SSD, loaded back by
a host -> device copy. Each test fails with the tier off (``host_budget_bytes=None``):
the assertion that would fail is named in its docstring.
"""

from __future__ import annotations

import logging
import os
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ssdtrain
from ssdtrain import testing
from helpers import assert_same, gated, part_id, run_step, weekly_shard
from loopback_helpers import LoopbackDevice, SaveForBackward, UnpackCheck, attach
from models import ALL_MODELS
from ssdtrain import ConfigError
from ssdtrain._config import MAX_BYTES
from ssdtrain._decision.budget import HostBudget

KiB = 1 << 10
N = 64 * KiB  # bytes of each saved device tensor in the chains below


def _offloader(make_offloader, dev=None, **cfg):
    cfg.setdefault("min_tensor_bytes", 4096)
    cfg.setdefault("keep_tail_bytes", 0)
    off = make_offloader(**cfg)
    attach(off, dev if dev is not None else LoopbackDevice())
    return off


def _chain(off, dev, sizes, *, retain=False):
    """Save one device tensor of each size (bytes, multiples of 4) in its own node, in
    order, drop every other reference, run backward; returns (the tensors backward got,
    the values saved)."""
    sink, values = [], []
    anchor = torch.zeros((), requires_grad=True)
    with off:
        out = anchor
        for i, n in enumerate(sizes):
            d = dev.alloc((n // 4,))
            d.copy_(torch.arange(n // 4, dtype=torch.float32) + 1000 * i)
            values.append(d.clone())
            out = SaveForBackward.apply(out, sink, d)
            del d
        off.wait()  # every copy landed: prefetch then loads from RAM, none is pinned
    out.backward(retain_graph=retain)
    if retain:
        out.backward()
    got = [s[0] for s in reversed(sink[:len(sizes)])]
    assert all(torch.equal(g, v) for g, v in zip(got, values))
    return got, values


def _states(off):
    """The records' states, earliest saved first."""
    return [r.state for r in testing.records(off)]


# ------------------------------------------------------------------ the targets
def _step(model, inputs, off):
    """``run_step`` with a look at the records between forward (its writes done) and
    backward: ``((loss, grads), [(nbytes, state)] earliest saved first)``."""
    model.zero_grad(set_to_none=True)
    with off:
        loss = model(*inputs)
    off.wait()
    recs = [(r.nbytes, r.state.value) for r in testing.records(off)]
    loss.backward()
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    return (loss.detach().clone(), grads), recs


@pytest.mark.parametrize("name", sorted(ALL_MODELS))
def test_half_budget_writes_half_and_peaks_as_ssd_only(name, make_offloader):
    """Target 1: with a host budget of half the activations, peak device memory is that
    of the SSD-only run (``peak_resident_bytes``: the device records ssdtrain holds;
    ``write_behind_bytes=0`` and ``prefetch_bytes=0`` make it exact in both), the SSD
    gets about half the bytes (within one record of half), RAM the rest, and gradients
    are bitwise equal (which records: the chain tests below). Tier off: ``bytes_written`` is
    every offloaded byte. Every tensor backward gets is checked against the saved one
    (``UnpackCheck``), so a mismatch says whether a record came back wrong or the
    gradients were computed from the right bytes (tests/test_load_paths.py)."""
    torch.manual_seed(0)
    model, inputs = ALL_MODELS[name]()
    ref = run_step(model, inputs)
    cfg = dict(write_behind_bytes=0, prefetch_bytes=0)
    ssd = _offloader(make_offloader, LoopbackDevice(claim_host_tensors=True), **cfg)
    check = UnpackCheck(ssd)
    got, recs = _step(model, inputs, ssd)
    assert not check.problems, check.problems
    assert_same(ref, got)
    base = ssd.stats()
    total = base.offloaded_bytes
    assert base.bytes_written == total > 0 and {s for _, s in recs} == {"on_disk"}

    off = _offloader(make_offloader, LoopbackDevice(claim_host_tensors=True),
                     host_budget_bytes=total // 2, **cfg)
    check = UnpackCheck(off)
    got, recs = _step(model, inputs, off)
    assert not check.problems, check.problems
    assert_same(ref, got)
    st_ = off.stats()
    assert st_.offloaded_bytes == total
    assert st_.peak_resident_bytes == base.peak_resident_bytes
    assert {s for _, s in recs} == {"on_disk", "hosted"}
    largest = max(n for n, _ in recs)
    assert abs(st_.bytes_written - total / 2) <= largest, (st_.bytes_written, total)
    assert st_.bytes_written == sum(n for n, s in recs if s == "on_disk")
    assert st_.host_spilled_bytes == st_.bytes_written
    assert 0 < st_.peak_host_bytes <= total // 2


def test_half_budget_on_equal_records_writes_exactly_the_earliest_half(make_offloader):
    """Eight equal device records, budget four of them: the first four go to the SSD
    (earliest saved first), the last four stay in RAM; device memory peaks at one
    record as SSD-only; backward reads four from the SSD and loads four from RAM.
    Tier off: eight records are written."""
    dev = LoopbackDevice()
    off = _offloader(make_offloader, dev, host_budget_bytes=4 * N, write_behind_bytes=0,
                     prefetch_bytes=0)
    sink, anchor = [], torch.zeros((), requires_grad=True)
    values = []
    with off:
        out = anchor
        for i in range(8):
            d = dev.alloc((N // 4,))
            d.fill_(float(i))
            values.append(d.clone())
            out = SaveForBackward.apply(out, sink, d)
            del d
    off.wait()
    assert [s.value for s in _states(off)] == ["on_disk"] * 4 + ["hosted"] * 4
    testing.check_invariants(off)
    assert dev.in_use() == 0  # every saved block left device memory
    out.backward()
    assert all(torch.equal(s[0], v) for s, v in zip(reversed(sink), values))
    st_ = off.stats()
    assert (st_.bytes_written, st_.bytes_read, st_.host_loaded_bytes) == (4 * N, 4 * N, 4 * N)
    assert st_.peak_resident_bytes == N and st_.peak_host_bytes == 4 * N
    assert off.live_records() == 0 and off.stats().host_bytes == 0


def test_unlimited_budget_without_spill_dir_touches_no_disk(make_offloader, tmp_path,
                                                            monkeypatch):
    """Target 2: ``host_budget_bytes="unlimited"`` and no ``spill_dir``: no spill
    directory is made (the default one would be under the temporary directory, which
    stays empty), no spill file is opened, the engine gets no request, and gradients are
    exact. Tier off: the default spill directory is created and written to."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    torch.manual_seed(0)
    model, inputs = ALL_MODELS[sorted(ALL_MODELS)[0]]()
    ref = run_step(model, inputs)
    off = _offloader(make_offloader, LoopbackDevice(claim_host_tensors=True),
                     spill_dir=None, host_budget_bytes="unlimited")
    calls = []
    engine = testing.engine(off)
    for op in ("write", "read"):
        real = getattr(engine, op)
        monkeypatch.setattr(engine, op, lambda *a, _r=real, _op=op, **k: calls.append(_op)
                            or _r(*a, **k))
    for settle in (False, True):
        assert_same(ref, run_step(model, inputs, off, settle=settle))
    off.wait()
    st_ = off.stats()
    assert off.config.spill_dir == [] and off.config.host_budget_bytes == MAX_BYTES
    assert testing.spill(off).files == []
    assert st_.offloaded_bytes > 0 and st_.host_loaded_bytes > 0
    assert (calls, st_.records_written, st_.bytes_read, os.listdir(tmp)) == ([], 0, 0, [])
    assert "no SSD tier" in st_.engine


# ------------------------------------------------------------- behaviour
def test_dedup_holds_one_copy_in_ram_and_loads_it_from_ram(make_offloader):
    """One device tensor saved by two nodes is one record: one copy in RAM, loaded once
    for both unpacks, and again (from RAM, not the SSD) by a second backward with
    ``retain_graph``. Tier off: ``peak_host_bytes`` and ``host_loaded_bytes`` are 0."""
    dev = LoopbackDevice()
    off = _offloader(make_offloader, dev, host_budget_bytes=N, prefetch_bytes=0)
    d = dev.alloc((N // 4,))
    d.copy_(torch.arange(N // 4, dtype=torch.float32))
    expect = d.clone()
    sink, anchor = [], torch.zeros((), requires_grad=True)
    with off:
        out = SaveForBackward.apply(SaveForBackward.apply(anchor, sink, d), sink, d)
    del d
    off.wait()
    assert [s.value for s in _states(off)] == ["hosted"]
    out.backward(retain_graph=True)
    out.backward()
    assert len(sink) == 4 and all(torch.equal(s[0], expect) for s in sink)
    st_ = off.stats()
    assert st_.deduplicated_bytes == N and st_.peak_host_bytes == N
    assert st_.host_loaded_bytes == 2 * N  # once per backward, for both handles
    assert st_.bytes_written == st_.bytes_read == 0
    assert dev.copies["d2h"] == 1 and dev.copies["h2d"] == 2


def test_loads_come_from_ram_and_prefetch_them(make_offloader):
    """With the whole chain in RAM, backward reads nothing from the SSD: every record is
    loaded from RAM by prefetch (hits, no miss) in reverse order of saving. Tier off:
    ``bytes_read`` is every byte."""
    dev = LoopbackDevice()
    off = _offloader(make_offloader, dev, host_budget_bytes=8 * N, prefetch_bytes=2 * N)
    _chain(off, dev, [N] * 6)
    st_ = off.stats()
    assert (st_.bytes_read, st_.bytes_written, st_.host_loaded_bytes) == (0, 0, 6 * N)
    assert st_.prefetch_hits == 6 and st_.prefetch_misses == 0
    assert off.live_records() == 0 and st_.host_bytes == 0


def _evicted_while_written(make_offloader, monkeypatch, prefetch_bytes):
    """Budget one record of two: saving the second evicts the first (in RAM by then),
    whose write to the SSD is held (a gate) until backward runs. Returns (the offloader,
    the graph's output, the tensors backward gets, the values saved, the gate) once the
    first is SPILLING and the second in RAM (HOSTED; LOADED where prefetch loaded it)."""
    import threading
    import time
    dev = LoopbackDevice()
    off = _offloader(make_offloader, dev, host_budget_bytes=N, prefetch_bytes=prefetch_bytes,
                     verify=False)
    engine = testing.engine(off)
    real, gate = engine.write, threading.Event()
    monkeypatch.setattr(engine, "write", gated(real, gate))
    sink, anchor, values = [], torch.zeros((), requires_grad=True), []
    with off:
        out = anchor
        for i in range(2):
            d = dev.alloc((N // 4,))
            d.fill_(float(i + 1))
            values.append(d.clone())
            out = SaveForBackward.apply(out, sink, d)
            del d
            if i == 0:
                off.wait()  # the first is in RAM (HOSTED) when the second evicts it
    want = ["spilling", "loaded" if prefetch_bytes else "hosted"]
    deadline = time.monotonic() + 10
    while [s.value for s in _states(off)] != want and time.monotonic() < deadline:
        time.sleep(0.005)
    assert [s.value for s in _states(off)] == want
    return off, out, sink, values, gate


def test_backward_loads_a_record_whose_eviction_write_is_still_running_from_ram(
        make_offloader, monkeypatch):
    """No prefetch: backward needs the evicted record while its write runs. Unpack
    claims it and waits for the write; then it is loaded from its pinned copy, still in
    RAM, not read back from the SSD (exact; no SSD read, two loads from RAM). Before
    the claim it was read back (``bytes_read == N``). Tier off: no record is ever
    SPILLING."""
    import threading
    off, out, sink, values, gate = _evicted_while_written(make_offloader, monkeypatch, 0)
    threading.Timer(0.2, gate.set).start()  # the write ends while backward waits for it
    out.backward()
    assert all(torch.equal(s[0], v) for s, v in zip(reversed(sink), values))
    st_ = off.stats()
    assert (st_.bytes_written, st_.bytes_read, st_.host_loaded_bytes) == (N, 0, 2 * N)
    assert st_.prefetch_misses == 2 and st_.prefetch_hits == 0
    assert st_.stall_seconds > 0 and off.live_records() == 0
    testing.check_invariants(off)


def test_prefetch_of_a_record_whose_eviction_write_is_still_running_uses_its_ram_copy(
        make_offloader, monkeypatch):
    """Prefetch reaches the evicted record while its write runs (held until backward
    needs it): it claims it, and when the write ends the record is loaded from its
    pinned copy, still in RAM, never read back from the SSD; both records are prefetch
    hits, and what backward gets is exact. After use the record is on the SSD only (it
    left the budget when it was evicted), so a second backward (``retain_graph``) reads
    it back from there. Before the fix prefetch skipped a SPILLING record and backward
    read it back from the SSD (``bytes_read == N`` after the first backward, a miss)."""
    import threading
    off, out, sink, values, gate = _evicted_while_written(make_offloader, monkeypatch, 2 * N)
    threading.Timer(0.2, gate.set).start()  # the write ends while backward waits for it
    out.backward(retain_graph=True)
    assert all(torch.equal(s[0], v) for s, v in zip(reversed(sink), values))
    st_ = off.stats()
    # The evicted record's load from RAM is N; the second record was loaded from RAM
    # too (N more), or, still being copied there when prefetch reached it, kept on the
    # device (claimed): which of the two depends on when its copy ended.
    loaded = st_.host_loaded_bytes
    assert (st_.bytes_written, st_.bytes_read) == (N, 0) and loaded in (N, 2 * N)
    assert st_.prefetch_hits == 2 and st_.prefetch_misses == 0
    testing.check_invariants(off)
    assert [s.value for s in _states(off)] == ["on_disk", "hosted"]
    sink.clear()
    out.backward()  # the evicted record comes back from the SSD now, the other from RAM
    assert all(torch.equal(s[0], v) for s, v in zip(reversed(sink), values))
    st_ = off.stats()
    assert (st_.bytes_read, st_.host_loaded_bytes) == (N, loaded + N)
    del out
    assert off.live_records() == 0
    testing.check_invariants(off)


def test_no_ssd_tier_keeps_what_does_not_fit_on_the_device(make_offloader, caplog):
    """No ``spill_dir`` and a budget of two records out of five: the first two saved go
    to RAM, the rest stay in device memory (``over_budget_bytes``, one warning);
    gradients exact. Tier off: everything is written to the default spill directory."""
    dev = LoopbackDevice()
    off = _offloader(make_offloader, dev, spill_dir=None, host_budget_bytes=2 * N,
                     prefetch_bytes=0)
    sink, anchor, values = [], torch.zeros((), requires_grad=True), []
    with caplog.at_level(logging.WARNING, logger="ssdtrain"), off:
        out = anchor
        for i in range(5):
            d = dev.alloc((N // 4,))
            d.fill_(float(i))
            values.append(d.clone())
            out = SaveForBackward.apply(out, sink, d)
            del d
    off.wait()
    assert [s.value for s in _states(off)] == ["hosted"] * 2 + ["kept"] * 3
    assert sum("host_budget_bytes" in r.message for r in caplog.records) == 1
    out.backward()
    assert all(torch.equal(s[0], v) for s, v in zip(reversed(sink), values))
    st_ = off.stats()
    assert st_.over_budget_bytes == 3 * N and st_.records_written == 0


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(sizes=st.lists(st.integers(1, 24).map(lambda k: 4 * KiB * k), min_size=1, max_size=10),
       budget=st.integers(0, 160).map(lambda k: 1 * KiB * k),
       ssd=st.booleans())
def test_budget_is_never_exceeded_and_ram_holds_the_latest(sizes, budget, ssd, spill_dir):
    """Any sizes, any budget, with or without an SSD tier: the host tier never holds
    more than the budget (``peak_host_bytes``, and ``check_invariants`` at the end of
    forward); with an SSD the records in RAM are the longest run of latest-saved records
    that fits (among those no larger than the budget), the rest on the SSD; without one
    the earliest that fit are in RAM and the rest stay on the device; exact. Tier off:
    nothing is ever HOSTED."""
    dev = LoopbackDevice()
    off = ssdtrain.Offloader(ssdtrain.OffloadConfig(
        spill_dir=str(spill_dir) if ssd else None, host_budget_bytes=budget,
        min_tensor_bytes=4096, keep_tail_bytes=0, prefetch_bytes=0))
    attach(off, dev)
    try:
        sink, anchor, values = [], torch.zeros((), requires_grad=True), []
        with off:
            out = anchor
            for i, n in enumerate(sizes):
                d = dev.alloc((n // 4,))
                d.fill_(float(i))
                values.append(d.clone())
                out = SaveForBackward.apply(out, sink, d)
                del d
        off.wait()
        testing.check_invariants(off)
        states = [s.value for s in _states(off)]
        hosted = [n for n, s in zip(sizes, states) if s == "hosted"]
        assert sum(hosted) <= budget
        if ssd:
            assert set(states) <= {"hosted", "on_disk"}
            fits = [i for i, n in enumerate(sizes) if n <= budget]
            held, total = [], 0
            for i in reversed(fits):  # the longest fitting run of the latest
                if total + sizes[i] > budget:
                    break
                held.append(i)
                total += sizes[i]
            assert [i for i, s in enumerate(states) if s == "hosted"] == sorted(held)
        else:
            assert set(states) <= {"hosted", "kept"}
            total, want = 0, []
            for n in sizes:
                ok = total + n <= budget
                total += n if ok else 0
                want.append("hosted" if ok else "kept")
            assert states == want
        out.backward()
        assert all(torch.equal(s[0], v) for s, v in zip(reversed(sink), values))
        st_ = off.stats()
        assert st_.peak_host_bytes <= budget and st_.host_bytes == 0
        assert off.live_records() == 0
    finally:
        off.close()


def test_host_tensors_are_not_moved_to_the_host_tier(make_offloader, caplog):
    """CPU tensors (no device) are in host RAM already: with an SSD tier they are
    written as before, with none they stay in memory with one warning that says to give
    a ``spill_dir``. Tier off (``host_budget_bytes`` ignored): without ``spill_dir`` they
    are written to the default directory."""
    h = torch.randn(N // 4)
    anchor = torch.zeros((), requires_grad=True)
    for spill in (True, False):
        kw = {} if spill else {"spill_dir": None}
        off = make_offloader(host_budget_bytes=4 * N, min_tensor_bytes=4096, keep_tail_bytes=0,
                             **kw)
        sink = []
        with caplog.at_level(logging.WARNING, logger="ssdtrain"), off:
            out = SaveForBackward.apply(anchor, sink, h * 2)
        off.wait()
        out.backward()
        assert torch.equal(sink[0][0], h * 2)
        st_ = off.stats()
        assert st_.peak_host_bytes == 0
        if spill:
            assert st_.bytes_written == N
        else:
            assert st_.bytes_written == 0 and st_.kept_bytes >= N
            assert any("CPU tensor stays in memory" in r.message for r in caplog.records)


def test_close_with_records_in_every_tier_leaves_nothing(make_offloader):
    """close() while a graph holds records in RAM and on the SSD: the pinned buffers go
    back to the pool and are let go of, the slots back to the allocator, no device
    memory is left. Tier off: nothing is ever in RAM (``host_bytes`` is 0 before)."""
    dev = LoopbackDevice()
    off = _offloader(make_offloader, dev, host_budget_bytes=2 * N, prefetch_bytes=0)
    sink, anchor = [], torch.zeros((), requires_grad=True)
    with off:
        out = anchor
        for i in range(4):
            d = dev.alloc((N // 4,))
            d.fill_(float(i))
            out = SaveForBackward.apply(out, sink, d)
            del d
    off.wait()
    assert off.stats().host_bytes == 2 * N
    assert sorted(s.value for s in _states(off)) == ["hosted"] * 2 + ["on_disk"] * 2
    off.close()
    st_ = off.stats() if not off.closed else off._stats
    assert st_.host_bytes == 0 and off.spill_bytes_in_use() == 0
    assert st_.staging_bytes == 0
    del out, sink
    assert dev.in_use() == 0


# ---------------------------------------------------------------- pure pieces
def test_host_budget_evicts_the_earliest_admitted():
    """``HostBudget`` alone: FIFO eviction, a record larger than the budget is not
    admitted, releases make room, and without an SSD tier nothing is evicted."""
    class R:
        def __init__(self, n):
            self.nbytes, self.tier = n, 0

    class S:
        host_bytes = peak_host_bytes = 0
    a, b, c, big = R(4), R(4), R(4), R(20)
    h = HostBudget(10, True, S)
    assert h.admit(a) == (True, []) and h.admit(b) == (True, [])
    assert h.admit(c) == (True, [a]) and a.tier == 0 and h.nbytes == 8
    assert h.admit(big) == (False, []) and h.nbytes == 8
    h.release(b)
    assert h.nbytes == 4 and S.peak_host_bytes == 10 - 2
    n = HostBudget(10, False, S)
    assert n.admit(R(6)) == (True, []) and n.admit(R(6)) == (False, [])


def test_config_resolves_and_refuses(tmp_path):
    """``"auto"`` resolves to a byte count; without ``spill_dir`` there is no SSD tier
    (and the options that need one are refused, saying what to do); a bad value names
    the field."""
    cfg = ssdtrain.OffloadConfig(host_budget_bytes="auto", spill_dir=str(tmp_path)).resolve()
    assert isinstance(cfg.host_budget_bytes, int) and cfg.host_budget_bytes > 0
    assert cfg.spill_dir == [str(tmp_path)]
    cfg = ssdtrain.OffloadConfig(host_budget_bytes="1GiB").resolve()
    assert cfg.spill_dir == [] and cfg.host_budget_bytes == 1 << 30
    with pytest.raises(ConfigError, match="host_budget_bytes"):
        ssdtrain.OffloadConfig(host_budget_bytes="lots")
    with pytest.raises(ConfigError, match="give a spill_dir"):
        ssdtrain.OffloadConfig(host_budget_bytes="1GiB", max_spill_bytes="1GiB").resolve()
    with pytest.raises(ConfigError, match="Give a spill_dir"):
        ssdtrain.OffloadConfig(host_budget_bytes="1GiB", policy="adaptive",
                               memory_budget_bytes="1GiB").resolve()
    env = ssdtrain.OffloadConfig.from_env({"SSDTRAIN_HOST_BUDGET_BYTES": "auto"})
    assert env.host_budget_bytes == "auto"


# ------------------------------------------------------- interrupts and collections
def _host_tier_children(monkeypatch, budget=24 * KiB):
    """The sweeps' child processes run with a loopback device and a host tier of
    ``budget`` bytes: their records go to RAM, the earliest of each step on to the SSD."""
    import inject
    monkeypatch.setenv(inject.LOOPBACK_ENV, "1")
    monkeypatch.setenv(inject.HOST_BUDGET_ENV, str(budget))
    return inject


HOST_TIER_PARTS = 3


@pytest.mark.parametrize("part", range(HOST_TIER_PARTS),
                         ids=lambda p: part_id(p, HOST_TIER_PARTS))
def test_interrupt_at_each_host_tier_line(spill_dir, monkeypatch, part):
    """KeyboardInterrupt at the first run of every line of ``_store/hosttier.py`` and
    ``_decision/budget.py`` (its admission and eviction bookkeeping) the
    interrupt scenario runs on the training thread with a host tier (admission and
    eviction at pack, the copies to RAM the end of forward and the throttle start,
    loads from RAM at unpack; ``to_host``/``from_host`` in ``_device/transfers.py`` are swept by
    tests/test_loopback_sweeps.py, ``stage_out``/``stage_in`` run them),
    with the scenario's checks (exact gradients, nothing left, invariants) and no device
    memory left. Tier off: no line of ``_store/hosttier.py`` runs (nor of ``_decision/budget.py``), so
    none is a target.
    A third of the lines per part, the parts in turn by ISO week (NOTE [ Sweeps take
    turns by week ] in tests/helpers.py; every part: SSDTRAIN_TEST_ALL_SHARDS=1)."""
    shard = weekly_shard(HOST_TIER_PARTS)
    if not shard.runs(part):
        pytest.skip(shard.skip_reason("host-tier sweep", part))
    inject = _host_tier_children(monkeypatch)
    result, base = inject.sweep_in_children("posix", "first", spill_dir, budget_s=400,
                                            extra=("--only", "ssdtrain._store.hosttier,ssdtrain._decision.budget"),
                                            shard=(part, HOST_TIER_PARTS))
    print(result.summary())
    assert base is not None, result.stopped
    if result.failing or result.stopped:
        pytest.fail(result.message(), pytrace=False)
    assert len(result.outcomes) == base["targets"] > 0, result.summary()
    assert base["all_targets"] >= 10, base  # the whole sweep, all parts
    assert all(o.where.startswith((inject.where_of("ssdtrain._store.hosttier"),
                                   inject.where_of("ssdtrain._decision.budget")))
               for o in result.outcomes), result.summary()
    assert sum(o.fired for o in result.outcomes) >= 0.5 * len(result.outcomes), \
        result.summary()


@pytest.mark.parametrize("only", ["ssdtrain._device.transfers", "ssdtrain._store.hosttier"])
def test_interrupt_at_each_line_of_the_copies_the_hooks_start(spill_dir, monkeypatch, only):
    """The sweep above with the native engine (polled: NOTE [ The data path on the hooks'
    thread ] in _store/store.py), whose hooks start the copies to RAM themselves and settle
    them by polling their events (NOTE [ Copies the hooks start ] in _device/transfers.py): a
    KeyboardInterrupt at the first run of every line of ``only`` on the training thread
    (the pool's ordered reuse, the copy's start, the poll that settles it, the loads),
    with the scenario's checks. Tier off, or the posix engine: no copy is started by a
    hook, and the line of ``DeviceTransfers.poll`` that settles one is no target (it is
    asserted among them)."""
    inject = _host_tier_children(monkeypatch, 1 << 20)  # every record fits in RAM
    result, base = inject.sweep_in_children("native", "first", spill_dir, budget_s=400,
                                            extra=("--only", only))
    print(result.summary())
    assert base is not None, result.stopped
    if result.failing or result.stopped:
        pytest.fail(result.message(), pytrace=False)
    assert len(result.outcomes) == base["targets"] > 0, result.summary()
    assert all(o.where.startswith(inject.where_of(only)) for o in result.outcomes), \
        result.summary()
    if only == "ssdtrain._device.transfers":  # the poll that settles a copy the hooks started is a target
        import inspect
        from ssdtrain._device.transfers import DeviceTransfers
        lines, first = inspect.getsourcelines(DeviceTransfers.poll)
        settle = first + next(i for i, line in enumerate(lines) if "fut.set_result" in line)
        assert any(o.where.startswith(f"{inject.where_of(only)}{settle} ")
                   for o in result.outcomes), \
            result.summary()
    assert sum(o.fired for o in result.outcomes) >= 0.5 * len(result.outcomes), \
        result.summary()


@pytest.mark.parametrize("engine", ["posix", "native"])
def test_gc_inside_every_locked_region_with_a_host_tier(spill_dir, monkeypatch, engine):
    """Forced collections in every store lock with records in RAM and on the SSD (pinned
    buffers are taken under the store's lock when the I/O thread's reservation missed;
    with the native engine the hooks start the copies to RAM and the locked regions
    poll them, so collections run inside those polls and their callbacks too): no
    deadlock, exact, nothing left. Tier off: ``peak_host`` is 0."""
    _host_tier_children(monkeypatch, 96 * KiB)  # room for records to land before use
    import test_gc_injection
    r = test_gc_injection._run("locks", spill_dir, engine=engine, threshold="default",
                               steps=12, timeout=90)
    assert any(r["inside_found"].values()), r["inside"]
    assert r["peak_host"] > 0 and r["records_read"] > 0, r  # both tiers were used


# ------------------------------------------------------------------- the estimate
@pytest.mark.parametrize("ssd", [True, False])
def test_the_estimate_replays_the_host_tier(ssd, make_offloader, spill_dir):
    """``ssdtrain estimate``'s replay (``measure(..., device_records=True)``) makes the
    host tier's decisions with the same ``HostBudget``: what went past RAM to the SSD,
    the peak in RAM, what was kept beyond the budget and what left memory equal the real
    run's on the loopback device, with and without an SSD tier. Tier off: the real run's
    ``host_spilled_bytes`` and ``peak_host_bytes`` are 0, the estimate's are not."""
    from test_decision import SETTINGS, resaves
    from ssdtrain.estimate.replay import measure
    cfg = dict(SETTINGS, keep_tail_bytes=0, host_budget_bytes="2MiB",
               spill_dir=str(spill_dir) if ssd else None)
    est = measure(resaves, ssdtrain.OffloadConfig(**cfg), device_records=True)
    off = make_offloader(**cfg)
    attach(off, LoopbackDevice(claim_host_tensors=True))
    model, inputs = resaves()
    with off:
        loss = model(*inputs)
    off.wait()
    got = off.stats()
    loss.backward()
    keys = ("offloaded_bytes", "kept_bytes", "over_budget_bytes", "host_spilled_bytes",
            "peak_host_bytes")
    want = (est.offloadable_bytes, est.kept_bytes, est.over_budget_bytes,
            est.host_spilled_bytes, est.peak_host_bytes)
    assert tuple(getattr(got, k) for k in keys) == want
    assert est.peak_host_bytes == 2 << 20 and (est.host_spilled_bytes > 0) == ssd
