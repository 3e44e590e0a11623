"""Every policy with every tier layout, over several steps.

The store's tiers (the SSD, the host tier before it, or the host tier alone) and its
policies were tested one axis at a time; ``policy="auto"`` with a host tier and no
``spill_dir`` raised ``IndexError`` at its third step (its bandwidth probe wrote to
"the first spill file", which a host-only store has none of). The sweep below crosses
the axes: each policy x each tier layout x host and (loopback) device tensors, five
steps each (past ``auto``'s baseline and first quotas), gradients bitwise those of no
offloading at every step, the store's invariants after each.

Then the host tier as ``auto`` sees it: its copies are probed (``Probe.time_copies``),
the quota is priced at their bandwidth, and on a device the baseline's forward is timed
with the device waited for (kernels are asynchronous: the host's clock sees launches).
Last, ``policy="static"`` says (once) when a step spends a quarter of its time waiting on
the SSD: there offloading everything costs more than it saves, and nothing said so.
"""

from __future__ import annotations

import logging

import pytest
import torch

import models
import ssdtrain
from ssdtrain import testing
from helpers import assert_same, run_step
from loopback_helpers import LoopbackDevice, SaveForBackward, attach, device_chain
from ssdtrain._policies.auto import BASELINE_STEPS, SIZING_STEPS, AutoQuota, StallWatch

KiB = 1 << 10
MiB = 1 << 20
TIERS = {"ssd": dict(host_budget_bytes=None),
         "host+ssd": dict(host_budget_bytes="64KiB"),
         "host": dict(host_budget_bytes="unlimited", spill_dir=None)}
WARMUP = SIZING_STEPS + BASELINE_STEPS  # steps before the first quota chosen for time
STEPS = WARMUP + 2


class _Tiny(torch.nn.Module):
    """Five saved activations of 32 KiB each and a LayerNorm: steps of milliseconds."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.GELU(),
                                       torch.nn.LayerNorm(128), torch.nn.Linear(128, 128),
                                       torch.nn.GELU(), torch.nn.Linear(128, 1))

    def forward(self, x):
        return self.net(x).square().mean()


def _tiny():
    torch.manual_seed(0)
    return _Tiny(), (torch.randn(64, 128),)


def _make(make_offloader, policy, tier, device, dev=None):
    off = make_offloader(**TIERS[tier], policy=policy, min_tensor_bytes=4096,
                         keep_tail_bytes=0)
    if device == "loopback":
        attach(off, dev or LoopbackDevice(claim_host_tensors=True))
    return off


@pytest.mark.parametrize("device", ["cpu", "loopback"])
@pytest.mark.parametrize("tier", sorted(TIERS))
@pytest.mark.parametrize("policy", ["static", "auto"])
def test_every_policy_with_every_tier_is_exact_over_steps(policy, tier, device,
                                                          make_offloader):
    model, inputs = _tiny()
    ref = run_step(model, inputs)
    off = _make(make_offloader, policy, tier, device)
    try:
        for _ in range(STEPS):
            assert_same(ref, run_step(model, inputs, off))
            testing.check_invariants(off)
        st = off.stats()
        if tier == "host":
            assert st.bytes_written == 0  # no SSD tier: nothing touches a disk
        if policy == "auto":
            assert st.offload_quota_reason  # it says why, whatever it chose
        if not (tier == "host" and device == "cpu"):  # (auto: its sizing step at least)
            assert st.offloaded_bytes > 0
    finally:
        off.close()


def test_auto_with_the_host_tier_alone_prices_its_copies(make_offloader):
    """No SSD tier: the quota comes from the copies' probe (fast here), records go to RAM
    and come back from there; before the fix the probe raised IndexError."""
    torch.manual_seed(0)
    model, inputs = models.mlp()
    ref = run_step(model, inputs)
    dev = LoopbackDevice(claim_host_tensors=True)
    off = _make(make_offloader, "auto", "host", "loopback", dev)
    probed = []
    real = testing.probe(off).time_copies

    def probe(nbytes, repeats):
        probed.append(nbytes)
        return real(nbytes, repeats)
    testing.probe(off).time_copies = probe
    try:
        for _ in range(WARMUP):
            assert_same(ref, run_step(model, inputs, off))
        copies = dict(dev.copies)
        ctl = off._auto
        ctl._copy_probe = lambda n: (n / 1e12, n / 1e12) if testing.probe(off).time_copies(n, 2) \
            else None  # probed for real, priced as a fast link so the quota is > 0
        loaded = 0
        for _ in range(3):
            before = off.stats()
            assert_same(ref, run_step(model, inputs, off))
            loaded += off.stats().host_loaded_bytes - before.host_loaded_bytes
        st = off.stats()
        assert probed and ctl.copy_write_bps is not None and ctl.write_bps is None
        # the probe copied out and back on the device (as many as its repeats, at least)
        assert dev.copies["d2h"] - copies.get("d2h", 0) >= 2
        assert "host tier: copies" in st.offload_quota_reason and "SSD" not in \
            st.offload_quota_reason
        assert loaded > 0 and st.bytes_written == 0
    finally:
        off.close()


def test_auto_with_no_tier_for_host_tensors_says_so():
    """Host tensors and a host tier alone: nothing can be offloaded (the host tier takes
    device tensors only); the quota is 0 and its reason says why."""
    torch.manual_seed(0)
    model, inputs = models.mlp()
    ref = run_step(model, inputs)
    off = ssdtrain.Offloader(ssdtrain.OffloadConfig(policy="auto", spill_dir=None,
                                                    host_budget_bytes="unlimited",
                                                    min_tensor_bytes=4096, keep_tail_bytes=0))
    try:
        for _ in range(STEPS):
            assert_same(ref, run_step(model, inputs, off))
        st = off.stats()
        assert st.offload_quota_bytes == 0 and st.offloaded_bytes == 0
        assert "nowhere to offload to" in st.offload_quota_reason
    finally:
        off.close()


def test_time_copies_goes_out_and_back_on_the_copy_streams(make_offloader):
    dev = LoopbackDevice(claim_host_tensors=True)
    off = _make(make_offloader, "static", "host", "loopback", dev)
    try:
        assert testing.probe(off).time_copies(MiB, 2) is None  # no device tensor seen yet
        model, inputs = models.mlp()
        run_step(model, inputs, off)
        before = dict(dev.copies)
        out_s, in_s = testing.probe(off).time_copies(MiB, 3)
        assert dev.copies["d2h"] - before.get("d2h", 0) == 3
        assert dev.copies["h2d"] - before.get("h2d", 0) == 3
        assert 0 < out_s < float("inf") and 0 < in_s < float("inf")
        assert not dev.errors
    finally:
        off.close()
    # no host tier: no probe
    plain = make_offloader(min_tensor_bytes=4096)
    attach(plain, LoopbackDevice(claim_host_tensors=True))
    run_step(*models.mlp(), plain)
    assert testing.probe(plain).time_copies(MiB, 2) is None


class _Stats:
    stall_seconds = write_stall_seconds = 0.0
    unique_bytes = offloaded_bytes = unwritten_bytes = 0
    offload_quota_bytes = 0
    offload_quota_reason = ""


def test_baseline_forward_is_timed_with_the_device_waited_for():
    """On a device, forward's end on the host's clock is when its kernels were launched:
    the baseline steps wait for the device at their begin and at forward's end (and only
    they: the others keep the host running ahead), and only their forward counts, as a
    share of the step."""
    now = [0.0]
    syncs = []
    stats = _Stats()
    ctl = AutoQuota(0.03, lambda n: (n / 1e9, n / 1e9), stats, clock=lambda: now[0],
                    sync=lambda: syncs.append(now[0]) or True)

    def step(forward_s, step_s, saved=64 * MiB):
        ctl.begin_step()
        now[0] += forward_s
        stats.unique_bytes += saved
        ctl.end_forward()
        now[0] += step_s - forward_s

    step(0.500, 1.000)   # the sizing step (offloads everything): no baseline
    assert syncs == []
    step(0.050, 0.200)   # baseline 1 (warm-up)
    step(0.030, 0.100)   # baseline 2: forward 30% of the step
    assert len(syncs) == 4
    step(0.001, 0.100)   # launches only: not counted
    step(0.001, 0.080)   # a faster step, which wrote nothing: in the baseline's median
    assert len(syncs) == 4
    ctl.begin_step()
    # the median of the steps that wrote nothing: 0.2, 0.1, 0.1, 0.08
    assert ctl.base_step_s == pytest.approx(0.100)
    assert ctl.base_forward_s == pytest.approx(0.100 * 0.25)  # least share: 0.05/0.2

    # No device seen (sync says so): forward on the host's clock, every step counts.
    host = AutoQuota(0.03, lambda n: (n / 1e9, n / 1e9), _Stats(), clock=lambda: now[0],
                     sync=lambda: False)
    for f in (0.001, 0.05, 0.03, 0.01):  # (the sizing step's forward does not count)
        host.begin_step()
        now[0] += f
        host.end_forward()
        now[0] += 0.1
    host.begin_step()
    assert host.base_forward_s == pytest.approx(0.01)


def test_host_tier_bound_is_the_copies_within_ram_plus_the_disk_beyond():
    """The bound over tiers: copies' bound, but no more than the host budget plus the
    SSD's bound (what overflows RAM is written on to the disk in the same step)."""
    now = [0.0]
    stats = _Stats()

    def run(copy_gbps, disk_gbps, host_bytes, has_disk=True):
        ctl = AutoQuota(0.0, (lambda n: (n / (disk_gbps * 1e9),) * 2) if has_disk else None,
                        stats, clock=lambda: now[0],
                        copy_probe=lambda n: (n / (copy_gbps * 1e9),) * 2,
                        host_bytes=host_bytes)
        for _ in range(WARMUP):
            ctl.begin_step()
            now[0] += 0.1
            stats.unique_bytes += 1 << 40
            ctl.end_forward()
            now[0] += 0.2
        ctl.begin_step()
        return ctl.bound

    from ssdtrain._policies.auto import quota_bound
    copies = quota_bound(1 << 40, 0.1, 0.3, 10e9, 10e9, 0.0)
    disk = quota_bound(1 << 40, 0.1, 0.3, 1e9, 1e9, 0.0)
    assert run(10, 1, 1 << 50) == pytest.approx(copies, rel=1e-6)  # RAM holds it all
    assert run(10, 1, 100 * MiB) == pytest.approx(100 * MiB + disk, rel=1e-6)
    assert run(10, 1, 100 * MiB, has_disk=False) == 100 * MiB


# ------------------------------------------------ the static policy says when it loses
class _Io:
    stall_seconds = write_stall_seconds = 0.0
    bytes_written = 0


def test_stall_watch_tells_once_when_waiting_on_the_ssd_is_a_quarter_of_a_step():
    now, told, io = [0.0], [], _Io()
    watch = StallWatch(told.append, clock=lambda: now[0])

    def step(seconds, reads, writes, written=10**9):
        watch.begin_step(io)
        now[0] += seconds
        io.stall_seconds += reads
        io.write_stall_seconds += writes
        io.bytes_written += written

    step(1.0, 0.1, 0.1)          # 20%: not the bottleneck
    step(1.0, 0.0, 0.0)
    watch.begin_step(io)
    assert told == []
    step(2.0, 0.2, 0.4)          # 30% (the step before was measured from this begin)
    watch.begin_step(io)
    assert len(told) == 1 and "0.60 s of its 2.00 s" in told[0]
    assert "writes 0.40 s" in told[0] and "reads 0.20 s" in told[0]
    assert "policy='auto'" in told[0] and "host_budget_bytes" in told[0]
    step(2.0, 1.0, 1.0)          # once per offloader
    watch.begin_step(io)
    assert len(told) == 1


def test_a_static_offloader_on_a_slow_disk_warns_and_an_auto_one_does_not(make_offloader,
                                                                            caplog):
    """Every request completes 50 ms late and ``write_behind_bytes`` is 0, so forward waits
    on each write: the static policy's step is mostly waiting, and it says so once."""
    import late_io
    model, inputs = _tiny()
    for policy in ("static", "auto"):
        caplog.clear()
        off = make_offloader(policy=policy, min_tensor_bytes=4096, keep_tail_bytes=0,
                             write_behind_bytes=0)
        off.wrap_engine(lambda engine: late_io.LateEngine(engine, 0.05))
        with caplog.at_level(logging.WARNING, logger="ssdtrain"):
            for _ in range(3):
                run_step(model, inputs, off)
        said = [r.getMessage() for r in caplog.records if "waiting on the SSD" in r.getMessage()]
        assert len(said) == (1 if policy == "static" else 0), (policy, said)
        off.close()


# ------------------------------------------------ the memory floor: fit first, then time
def test_auto_offloads_at_least_what_must_leave_memory_to_fit(make_offloader):
    """A device of 12 N bytes, a forward that saves 16 tensors of N bytes. Without the
    floor the baseline steps (quota 0) keep all 16 N and the device runs out of memory
    (``torch.OutOfMemoryError`` from its allocator); with it, the sizing step offloads
    everything, learns how much must leave (16 N + 10% of 12 N - the memory free at its
    forward's end, plus the N the throttle lets be in flight) and every later step
    offloads at least that much, waiting for the writes as "static" does, within the
    device's capacity."""
    n, k = 64 * KiB, 16
    dev = LoopbackDevice(capacity=12 * n)
    off = make_offloader(policy="auto", min_tensor_bytes=4096, keep_tail_bytes=0,
                         write_behind_bytes=n, prefetch_bytes=2 * n)
    attach(off, dev)
    quotas = []
    for _ in range(WARMUP + 3):
        device_chain(off, dev, k, n)
        testing.check_invariants(off)
        quotas.append(off.stats().offload_quota_bytes)
    ctl = off._auto
    assert quotas[0] is None and 0 < ctl.floor < k * n
    seen = [(s.quota, s.offloaded_bytes, s.room) for s in ctl.samples]
    assert all(q >= ctl.floor for q in quotas[SIZING_STEPS:]), (ctl.floor, quotas, seen)
    assert "memory floor" in off.stats().offload_quota_reason
    assert dev.peak_allocated <= dev.capacity and not dev.errors


def test_memory_floor_rises_with_the_memory_taken_and_never_falls():
    """(free, total) at each forward's end, total 1000 and a 10% reserve: the sizing step
    offloaded 400 and left 900 free, the baseline steps keep everything (500 free: fits);
    then something else takes memory (an optimizer's state at its first step: 50 free)
    and the floor rises to what must leave (100 - 50) and the 20 the write throttle lets
    be in flight; memory freed later does not lower it."""
    now, stats = [0.0], _Stats()
    rooms = iter([(900, 1000), (500, 1000), (50, 1000), (950, 1000), (950, 1000)])
    ctl = AutoQuota(0.03, lambda n: (n / 1e9, n / 1e9), stats, clock=lambda: now[0],
                    headroom=lambda: next(rooms), write_behind_bytes=20)
    floors, quotas = [], []
    for _ in range(5):
        q = ctl.begin_step()
        quotas.append(q)
        stats.unique_bytes += 400
        stats.offloaded_bytes += 400 if q is None else min(q, 400)
        ctl.end_forward()
        now[0] += 0.1
        floors.append(ctl.floor)
    ctl.begin_step()
    assert floors == [0, 0, 0, 70, 70]  # (each step observed at the next begin)
    assert quotas[:3] == [None, 0, 0] and quotas[3] >= 70 and ctl.quota >= 70
    assert ctl.floor == 70 and ctl.waits_for_writes


def test_gpu_smoke_auto_mode_is_auto_with_both_tiers_and_run_only_when_named(spill_dir):
    """benchmarks/gpu_smoke.py's ``ssdtrain-auto``: policy "auto", the host tier's default
    budget and the SSD beyond; not among the default modes (its quota needs warm-up)."""
    import os
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.join(root, "benchmarks"))
    import gpu_smoke
    assert "ssdtrain-auto" in gpu_smoke.MODES and "ssdtrain-auto" not in gpu_smoke.DEFAULT_MODES
    cfg = {"offload": {}, "spill_dir": str(spill_dir), "cpu_dry_run": False}
    off = gpu_smoke._offloader(ssdtrain, "ssdtrain-auto", cfg, None)
    try:
        c = off.config
        assert c.policy == "auto" and c.spill_dir == [str(spill_dir)]
        assert c.host_budget_bytes is not None and c.host_budget_bytes > 0
    finally:
        off.close()


def test_invariants_hold_while_a_bandwidth_probe_is_in_flight(make_offloader):
    """``policy="auto"`` and the adaptive profile probe the SSD through a slot of their
    own; ``check_invariants`` counted only records' and quarantined slots, so a check
    while the probe's request ran reported a spill block mismatch."""
    import threading

    import manual_engine
    off = make_offloader(engine="posix", io_timeout_s=30)
    engine = manual_engine.install(off)
    done = []
    t = threading.Thread(target=lambda: done.append(testing.probe(off).time_io(MiB, repeats=1)))
    t.start()
    try:
        for _ in range(500):
            if engine.pending():
                break
            t.join(0.01)
        assert engine.pending()
        testing.check_invariants(off)
    finally:
        for _ in range(3000):  # the write, then the read it submits
            engine.complete_all()
            t.join(0.01)
            if not t.is_alive():
                break
    assert done and not t.is_alive()
    testing.check_invariants(off)


def test_writes_a_slow_disk_has_not_finished_do_not_raise_the_floor(make_offloader):
    """A device of 24 N: keeping all 16 N saved leaves 8 N free, above the 10% reserve,
    so nothing must leave memory. Every write completes 0.3 s late, so at the sizing
    step's forward end (no throttle within 1 GiB) all 16 N are still in device memory,
    and 8 N are free: counting them as memory taken set a floor of 10.4 N, and every
    later step offloaded it with forward waiting on the disk. Bytes whose write is
    decided count as free (they leave without the floor's help): the floor stays 0."""
    import late_io
    n, k = 64 * KiB, 16
    dev = LoopbackDevice(capacity=24 * n)
    off = make_offloader(policy="auto", min_tensor_bytes=4096, keep_tail_bytes=0,
                         prefetch_bytes=2 * n)
    attach(off, dev)
    off.wrap_engine(lambda engine: late_io.LateEngine(engine, 0.3))
    quotas = []
    for _ in range(WARMUP):
        device_chain(off, dev, k, n)
        off.wait()  # the late writes hold their tensors; not into the next step
        quotas.append(off.stats().offload_quota_bytes)
    st = off.stats()
    assert quotas[0] is None and quotas[SIZING_STEPS:] == [0] * BASELINE_STEPS
    assert off._auto.floor == 0 and not off._auto.waits_for_writes
    assert st.offloaded_bytes == k * n                 # the sizing step wrote every one
    assert dev.peak_allocated <= dev.capacity and not dev.errors


def test_a_floor_above_what_the_tiers_absorb_in_time_is_said_once():
    """A policy that cannot do what was asked says so: memory needs 600 of the 1000 MiB
    a step saves to leave (each MiB offloaded beyond 500 is a MiB free, of 1000), a disk
    of 1 MB/s absorbs next to nothing in a 0.1 s step, so the quota is the floor, beyond
    the margin: one warning with the numbers, however many steps; where the floor is
    within the bound (a fast disk), none."""
    M = 1 << 20

    def run(disk_bps):
        now, stats, told, step = [0.0], _Stats(), [], [0]
        ctl = AutoQuota(0.03, lambda n: (n / disk_bps, n / disk_bps), stats,
                        clock=lambda: now[0],
                        headroom=lambda: (max(0, step[0] - 500 * M), 1000 * M),
                        warn=told.append)
        quotas = []
        for _ in range(8):
            q = ctl.begin_step()
            quotas.append(q)
            step[0] = 500 * M if q is None else min(q, 1000 * M)
            stats.unique_bytes += 1000 * M
            stats.offloaded_bytes += step[0]
            now[0] += 0.04   # forward
            ctl.end_forward()
            now[0] += 0.06   # backward
        return ctl, quotas, told
    ctl, quotas, told = run(1e6)
    assert ctl.floor == 600 * M and all(q >= 600 * M for q in quotas[1:]), (ctl.floor, quotas)
    assert len(told) == 1, told
    assert told[0].startswith("ssdtrain: policy='auto' offloads 600.0 MiB a step"), told
    assert "max_slowdown=3%" in told[0] and "host_budget_bytes" in told[0]
    assert "memory floor" in told[0] and "may take longer than the margin" in told[0]
    _, quotas, told = run(1e15)
    assert all(q >= 600 * M for q in quotas[1:]) and told == [], (quotas, told)


def test_headroom_counts_a_write_that_ends_during_the_reading_once(make_offloader):
    """Store.headroom reads the device's free memory and the bytes still leaving it as
    one snapshot: a device record's write that ends just after the device was read (its
    record held the memory until then, NOTE [ Device records ] rule 3) is free, not
    counted as neither (two separate reads: the floor rose by a record, spuriously)."""
    import time
    import manual_engine
    n = 64 * KiB
    dev = LoopbackDevice(capacity=8 * n)
    off = make_offloader(min_tensor_bytes=4096, keep_tail_bytes=0, engine="posix",
                         io_timeout_s=30)
    attach(off, dev)
    engine = manual_engine.install(off)
    sink, anchor = [], torch.zeros((), requires_grad=True)
    try:
        with off:
            d = dev.alloc((n // 4,))
            d.copy_(torch.full((n // 4,), 3.0))
            out = SaveForBackward.apply(anchor, sink, d)
            del d
        deadline = time.monotonic() + 30
        while not engine.pending() and time.monotonic() < deadline:
            time.sleep(0.005)   # the write is submitted once the copy to staging ended
        assert engine.pending()
        probe = testing.probe(off)
        real = probe.headroom

        def read_then_complete():
            room = real()
            engine.complete_all()  # the write ends right after the device was read
            return room
        probe.headroom = read_then_complete
        free, total = testing.headroom(off)
        assert total == 8 * n and free == 8 * n, (free / n, total / n)
        del probe.headroom
        out.backward()
        assert float(sink[0][0][0]) == 3.0
    finally:
        engine.complete_all()


def test_a_probe_request_whose_submission_was_cut_short_keeps_its_slot_and_buffer(
        make_offloader):
    """An interrupt after the engine took a probe request but before its future reached
    the probe (in the engine call's return): the request owns its buffer and slot (NOTE
    [ Memory owned by requests ]), so the slot is never handed to a record and the
    buffer stays mapped while the request can still touch them, and once it has ended
    both go back: nothing is kept for the rest of the process, no pass reclaims or
    quarantines anything. (Before the leases, the probe's ``finally`` freed the slot and
    unmapped the buffer at once: the write in flight failed with EFAULT; then the slot
    and buffer were quarantined for good.)"""
    import gc
    import weakref

    import manual_engine
    off = make_offloader(engine="posix")
    probe = testing.probe(off)
    engine = manual_engine.install(off)
    real, got = engine.write, []

    def write(*args, **kw):
        got.append(real(*args, **kw))  # the engine has it, with its owner
        raise KeyboardInterrupt
    engine.write = write
    try:
        with pytest.raises(KeyboardInterrupt):
            probe.time_io(1 << 20, repeats=1)
    finally:
        del engine.write
    gc.collect()                          # the interrupt's frames are gone
    (req,) = engine.pending()
    view, buf, slot = req.kw["owner"]     # held by the request alone
    assert not buf.closed and view.numel() == 1 << 20 and slot.file.holds(slot)
    ref = weakref.ref(buf)
    del view, buf
    model, inputs = models.mlp()
    run_step(model, inputs, off)          # records' slots: never the probe's blocks
    for rec in testing.records(off):
        assert rec.slot is None or rec.slot.block + rec.slot.nblocks <= slot.block or \
            slot.block + slot.nblocks <= rec.slot.block, "the probe's slot handed to a record"
    assert testing.spill(off).outside_bytes() >= 1 << 20  # counts against max_spill_bytes
    testing.check_invariants(off)
    del slot
    engine.complete_all()                 # the request ends: its buffer and slot go
    assert got[0].exception(timeout=30) is None  # it landed, from a live buffer
    assert ref() is None
    assert testing.spill(off).outside_bytes() == 0
    assert off.stats().quarantined_bytes == 0
    off.wait()
    assert off.spill_bytes_in_use() == 0
    testing.check_invariants(off)