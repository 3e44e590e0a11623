"""Each ordering rule of NOTE [ Device records ] (ssdtrain/_device/transfers.py), on the loopback device.

The loopback device (ssdtrain/testing/loopback.py) runs the store's device path with the
same code as CUDA; its streams run work asynchronously on threads, its copies and
kernels wait injectable delays, its allocator reuses a freed block at once for the
next allocation on the same stream, and fresh device memory reads as NaN. Each test
below sets up the hazard its rule orders against and fails when the rule is broken
(each was checked by breaking the rule on purpose: the docstrings say how).

Bytes that backward gets are read back from the spill file (``keep_tail_bytes=0``,
``wait()`` before backward) unless a test says otherwise, so a write of wrong bytes
shows.
"""

from __future__ import annotations

import gc
import logging
import time

import pytest
import torch

import helpers
from ssdtrain import testing
from loopback_helpers import (LoopbackDevice, SaveForBackward, SlowRead, attach, read_later,
                              write_later)

N = 1 << 16  # floats per tensor: 256 KiB


@pytest.fixture
def dev():
    d = LoopbackDevice()
    yield d
    d.synchronize()
    assert not d.errors, d.errors


def _offloader(make_offloader, dev, **cfg):
    cfg.setdefault("min_tensor_bytes", 0)
    cfg.setdefault("keep_tail_bytes", 0)
    off = make_offloader(**cfg)
    attach(off, dev)
    return off


def _anchor():
    return torch.zeros((), requires_grad=True)


def test_rule1_write_waits_for_a_slow_producer(dev, make_offloader):
    """Rule 1: the copy to staging waits for the event pack took. The producer kernel
    fills ``y`` 0.2 s after pack, on a side stream. Broken (``stage_out`` without
    ``d2h.wait_event(produced)``): the NaNs of fresh memory are written."""
    off = _offloader(make_offloader, dev, prefetch_bytes=0)
    side, sink, anchor = dev.Stream(), [], _anchor()
    with dev.stream(side), off:
        y = dev.alloc((N,))
        write_later(dev, y, 3.0, seconds=0.2)
        out = SaveForBackward.apply(anchor, sink, y)
        off.wait()
    side.synchronize()
    out.backward()
    assert off.stats().bytes_read >= N * 4
    assert torch.equal(sink[0][0], torch.full((N,), 3.0))


def test_rule1_write_waits_for_the_stream_that_produced_it(dev, make_offloader):
    """Rule 1: the event is taken at pack, on the stream current *then*. ``y`` is
    produced slowly on a side stream and kept in the tail; ``z``, packed on the default
    stream, pushes it out, and its write starts on the I/O thread. Broken (an event
    recorded when the write starts, on that thread's current stream): ``y``'s write
    copies the block before the producer wrote it."""
    off = _offloader(make_offloader, dev, keep_tail_bytes=N * 4, prefetch_bytes=0)
    side, sink, anchor = dev.Stream(), [], _anchor()
    with off:
        with dev.stream(side):
            y = dev.alloc((N,))
            write_later(dev, y, 3.0, seconds=0.3)
            out1 = SaveForBackward.apply(anchor, sink, y)   # fits the tail
        z = dev.alloc((N,))
        z.fill_(5.0)                                         # the default stream: the host
        out2 = SaveForBackward.apply(anchor, sink, z)        # y's write starts
        del y, z
        off.wait()
    side.synchronize()
    assert off.stats().records_written == 1  # y; z stays in the kept tail
    (out1 + out2).backward()
    assert off.stats().bytes_read == N * 4
    got = sorted((t[0] for t in sink), key=lambda t: float(t[0]))
    assert torch.equal(got[0], torch.full((N,), 3.0))
    assert torch.equal(got[1], torch.full((N,), 5.0))


def test_rule2_disk_write_starts_after_the_copy(make_offloader):
    """Rule 2: the disk write is submitted once the device -> staging copy's event has
    completed. The copy waits 0.2 s. Broken (``after`` submitting at once): the staging
    buffer's old bytes (zeros) are written."""
    dev = LoopbackDevice(d2h_delay=0.2)
    off = _offloader(make_offloader, dev, prefetch_bytes=0)
    sink, anchor = [], _anchor()
    with off:
        y = dev.alloc((N,))
        y.fill_(3.0)
        out = SaveForBackward.apply(anchor, sink, y)
        del y
        off.wait()
    out.backward()
    assert off.stats().bytes_read == N * 4
    assert torch.equal(sink[0][0], torch.full((N,), 3.0))
    assert not dev.errors


def test_rule3_saved_block_is_held_until_the_write_ends(make_offloader):
    """Rule 3: the record holds the saved tensor until its write completed. The user
    drops ``y`` at once and allocates ``z`` of the same size on the same stream, which a
    freed block would be handed to at once; ``z`` is filled before the slow copy runs.
    Broken (the record lets go of the saved tensor once its copy is queued): the copy
    reads ``z``'s bytes."""
    dev = LoopbackDevice(d2h_delay=0.2)
    off = _offloader(make_offloader, dev, prefetch_bytes=0)
    side, sink, anchor = dev.Stream(), [], _anchor()
    with dev.stream(side):
        with off:
            y = dev.alloc((N,))
            write_later(dev, y, 3.0)
            out = SaveForBackward.apply(anchor, sink, y)
            del y
            side.synchronize()       # the producer ran; only the record holds y now
            _until(lambda: dev.copies["d2h"] == 1)  # the I/O thread queued y's slow copy
            gc.collect()
            z = dev.alloc((N,))      # y's block, if the record had let go of it
            write_later(dev, z, 5.0)
            off.wait()
        side.synchronize()
    out.backward()
    assert torch.equal(sink[0][0], torch.full((N,), 3.0))
    assert torch.equal(z, torch.full((N,), 5.0))
    assert not dev.errors


def test_rule4_staging_is_not_reused_before_its_copy_ends(make_offloader):
    """Rule 4: a staging buffer given back is handed out again only after the copy that
    used it last. Backward runs on a side stream (unpack does not wait for the loads on
    the host), each load's copy to the device waits 0.1 s, and the prefetch window of
    one record starts the next read as soon as a record is used: that read wants a
    staging buffer of the same size while the last copy from one is still queued.
    Broken (the pool ignoring the copy's event): the read lands in the staging that
    copy still reads, and the record comes back with the next one's bytes."""
    k = 5
    dev = LoopbackDevice(h2d_delay=0.1)
    off = _offloader(make_offloader, dev, prefetch_bytes=N * 4)
    side, sink, out = dev.Stream(), [], _anchor()
    with dev.stream(side):
        with off:
            for i in range(k):
                t = dev.alloc((N,))
                write_later(dev, t, float(i))
                out = SlowRead.apply(out, dev, sink, t, 0.0)
            del t
            off.wait()
        out.backward()
        side.synchronize()
    assert off.stats().bytes_read == k * N * 4
    assert [float(t[0]) for t in sink] == [float(i) for i in reversed(range(k))]
    for i, t in zip(reversed(range(k)), sink):
        assert torch.equal(t, torch.full((N,), float(i))), i
    assert not dev.errors


def test_rule4_a_copy_to_ram_reusing_a_busy_buffer_waits_for_its_last_copy(make_offloader):
    """Rule 4, ordered reuse (NOTE [ Copies the hooks start ]): a copy to the host tier
    may take a buffer whose last copy is still queued, its stream waiting for that copy
    first. Step 1's records come back from RAM late (each load's copy to the device
    waits 0.3 s), its backward runs on a side stream and returns at once, and its graph
    is dropped: the buffers go back to the pool with their loads still queued. Step 2,
    on another stream (nothing orders its kernels after step 1's), copies new values
    into them. Broken (``to_host`` without ``d2h.wait_event`` on the buffer's last
    copy): step 1's late loads read step 2's bytes."""
    k = 4
    dev = LoopbackDevice()
    off = _offloader(make_offloader, dev, host_budget_bytes="unlimited",
                     prefetch_bytes=N * 4 * k)

    def step(base, stream):
        sink, out = [], _anchor()
        with dev.stream(stream):
            with off:
                for i in range(k):
                    t = dev.alloc((N,))
                    write_later(dev, t, float(base + i))
                    out = SlowRead.apply(out, dev, sink, t, 0.0)
                del t
                off.wait()  # in RAM before forward ends: backward loads each one back
            out.backward()
        return sink

    side, other = dev.Stream(), dev.Stream()
    for _ in range(2):  # the pool holds its buffers: the packs start the copies
        step(0, side)
        side.synchronize()
        off.wait()
    pool_ = testing.transfers(off)[0].pool
    dev.h2d_delay = 0.3
    first = step(100, side)    # loads queued, 0.3 s each; the graph is gone
    dev.h2d_delay = 0.0
    testing.check_invariants(off)  # settles: the records are freed, their buffers busy
    with pool_._lock:          # and no buffer is idle: step 2 takes the busy ones
        drop = []
        while pool_._lru:
            pool_._evict_locked(drop)
    del drop
    assert pool_.busy() >= 2 and pool_.idle_bytes() == 0
    second = step(200, other)  # copies to RAM into those buffers, after the loads
    side.synchronize()
    other.synchronize()
    off.wait()
    assert [float(t[0]) for t in first] == [100.0 + i for i in reversed(range(k))]
    for i, t in zip(reversed(range(k)), first):
        assert torch.equal(t, torch.full((N,), 100.0 + i)), i
    assert [float(t[0]) for t in second] == [200.0 + i for i in reversed(range(k))]
    assert off.stats().bytes_written == 0 and off.stats().host_loaded_bytes > 0
    assert not dev.errors


def test_rule5_loads_wait_for_the_compute_stream_that_reuses_their_block(make_offloader):
    """Rule 5: a load is allocated on the compute stream, which may hand it a block that
    its queued kernels still read; the copy waits for that stream first. Forward and
    backward run on a side stream whose backward kernels read each load 50 ms late,
    after the host has released it, and the next load (a window of one record) gets
    its block. Broken (no ``h2d.wait_stream(compute)``): a late read sees the next
    record's bytes (or the NaNs of its allocation)."""
    k = 6
    dev = LoopbackDevice()
    off = _offloader(make_offloader, dev, prefetch_bytes=N * 4)
    side, sink, out = dev.Stream(), [], _anchor()
    with dev.stream(side):
        with off:
            for i in range(k):
                t = dev.alloc((N,))
                write_later(dev, t, float(i))
                out = SlowRead.apply(out, dev, sink, t, 0.05)
            del t
            off.wait()
        out.backward()
        side.synchronize()
    assert off.stats().bytes_read == k * N * 4
    assert [float(t[0]) for t in sink] == [float(i) for i in reversed(range(k))]
    for i, t in zip(reversed(range(k)), sink):
        assert torch.equal(t, torch.full((N,), float(i))), i
    assert not dev.errors


def test_rule5_loads_are_allocated_for_the_compute_stream(dev, make_offloader):
    """Rule 5: loads come from the compute stream's pool, so that stream reuses their
    memory once backward is done with it. After a backward that loaded ``k`` records,
    every free block of their size is in the compute stream's pool, and ``k``
    allocations of that size on that stream take new memory only for what the pool
    lacks. Broken (loads allocated on the prefetch stream, which nothing else allocates
    on): their blocks sit in that stream's pool, and reserved memory grows by the loads
    (on a GPU, by the prefetch window every step).

    How many blocks the step reserved depends on timing: backward may free a load
    before the next read allocates, which then reuses its block (a loaded machine does
    this), so the test counts the pool rather than assuming ``k`` blocks."""
    k = 4
    off = _offloader(make_offloader, dev, prefetch_bytes=k * N * 4)
    sink, out = [], _anchor()
    with off:
        for i in range(k):
            t = dev.alloc((N,))
            t.fill_(float(i))
            out = SaveForBackward.apply(out, sink, t)
        del t
        off.wait()
    out.backward()
    del out, sink
    gc.collect()
    assert off.stats().bytes_read == k * N * 4
    loads = [s for s, n in dev.allocations[k:] if n == N * 4]
    assert len(loads) == k and all(s is dev.default_stream for s in loads), loads
    # A freed load is reusable once the prefetch stream ran what was queued on it when
    # it was freed (record_stream); under load that stream's thread may not have yet.
    dev.synchronize()
    pools = dev.free_blocks()
    size = min((sz for (_, sz) in pools if sz >= N * 4), default=None)
    stranded = {stream: n for (stream, sz), n in pools.items()
                if sz == size and stream is not dev.default_stream}
    assert not stranded, f"load blocks freed into another stream's pool: {stranded}"
    free = pools.get((dev.default_stream, size), 0)
    assert free >= 1, pools  # the last load, at least, is free once backward is done
    reserved = dev.reserved
    again = [dev.alloc((N,)) for _ in range(k)]
    assert dev.reserved - reserved == max(0, k - free) * size, \
        "the loads' blocks were not reused by the compute stream"
    del again


def test_rule5_a_dropped_load_is_not_reused_before_its_copy_ends(make_offloader):
    """Rule 5: the load's block is marked used by the prefetch stream (record_stream), so
    a record dropped while its copy is still queued does not give the block to the
    next allocation on the compute stream. The graph is dropped without backward while
    every load's copy waits 0.3 s; the caller then allocates and fills tensors of the
    same size. Broken (no ``record_stream(dst, h2d)``): the late copies overwrite them."""
    k = 4
    dev = LoopbackDevice(h2d_delay=0.3)
    off = _offloader(make_offloader, dev, prefetch_bytes=k * N * 4)
    side, sink, out = dev.Stream(), [], _anchor()
    with dev.stream(side):
        with off:
            for i in range(k):
                t = dev.alloc((N,))
                write_later(dev, t, float(i))
                out = SaveForBackward.apply(out, sink, t)
            del t
            off.wait()
        side.synchronize()
        off.wait()                         # every read ended; the copies are queued
        assert dev.copies["h2d"] == k
        del out                            # the graph goes: the loads are freed
        gc.collect()
        assert off.live_records() == 0
        mine = [dev.alloc((N,)) for _ in range(k)]
        for t in mine:
            write_later(dev, t, -1.0)
        dev.synchronize()
    for t in mine:
        assert torch.equal(t, torch.full((N,), -1.0))
    assert not dev.errors


@pytest.mark.parametrize("offset", [1, 16, 64, 100, 127])
def test_rule6_loads_keep_the_saved_address_modulo_512(dev, make_offloader, offset):
    """Rule 6: a record covering a slice of its storage comes back at the same address
    modulo 512 as it was saved at (not the staging buffer's). Broken (the misalignment
    of the staging used): every slice comes back 512-aligned."""
    off = _offloader(make_offloader, dev, prefetch_bytes=0)
    base = dev.alloc((4 * N,))
    base.copy_(torch.arange(4 * N, dtype=torch.float32))
    t = base[offset:offset + N // 2]        # under half the storage: a record of its own
    (back,) = helpers.save_and_unpack([t], off)  # the unpacked tensor itself
    assert back.data_ptr() % 512 == t.data_ptr() % 512, (back.data_ptr() % 512, offset * 4)
    assert torch.equal(back, t)
    assert off.stats().bytes_read == t.numel() * 4


def test_rule7_loads_are_consumed_after_they_land(make_offloader):
    """Rule 7: unpack makes the consumer stream wait for the load's copy. Backward's
    host ops (the default stream) read each load at once while its copy waits 0.1 s.
    Broken (no ``wait_event(ready)``): backward reads the NaNs of fresh memory."""
    dev = LoopbackDevice(h2d_delay=0.1)
    off = _offloader(make_offloader, dev, prefetch_bytes=0)
    t = dev.alloc((N,))
    t.copy_(torch.arange(N, dtype=torch.float32))
    (back,) = _save_and_unpack(off, [t])
    assert off.stats().bytes_read == N * 4
    assert torch.equal(back, t)
    assert not dev.errors


def test_rule7_another_consumer_stream_keeps_the_block_from_reuse(make_offloader):
    """Rule 7: a consumer other than the stream the load was allocated on marks the block
    used (record_stream). Forward runs on stream A, backward on stream B, whose kernels
    read each load 0.1 s late; once backward returned, the caller allocates and fills
    tensors of the same size on A. Broken (no ``record_stream`` for the consumer): A
    reuses the loads' blocks at once and B's late reads see the caller's bytes."""
    k = 4
    dev = LoopbackDevice()
    off = _offloader(make_offloader, dev, prefetch_bytes=k * N * 4)
    a, b, sink, out = dev.Stream(), dev.Stream(), [], _anchor()
    with dev.stream(a):
        with off:
            for i in range(k):
                t = dev.alloc((N,))
                write_later(dev, t, float(i))
                out = SlowRead.apply(out, dev, sink, t, 0.1)
            del t
            off.wait()
        a.synchronize()
        off.wait()              # every load was read and its copy queued (allocated on a)
        assert [s for s, n in dev.allocations[k:]] == [a] * k
    with dev.stream(b):
        out.backward()
    del out
    gc.collect()
    with dev.stream(a):
        mine = [dev.alloc((N,)) for _ in range(k)]
        for t in mine:
            write_later(dev, t, -1.0)
    dev.synchronize()
    assert [float(t[0]) for t in sink] == [float(i) for i in reversed(range(k))]
    for i, t in zip(reversed(range(k)), sink):
        assert torch.equal(t, torch.full((N,), float(i))), i
    assert not dev.errors


def test_rule8_pack_inside_a_graph_capture_keeps_the_tensor(dev, make_offloader):
    """Rule 8: a tensor saved while its stream captures a graph stays in memory: no event
    recorded, nothing staged. Broken (no capture check in pack): recording the
    producer's event on the capturing stream raises."""
    off = _offloader(make_offloader, dev)
    side, sink, anchor = dev.Stream(), [], _anchor()
    with dev.stream(side):
        y = dev.alloc((N,))
        write_later(dev, y, 3.0)
        side.synchronize()
        with dev.capture(side), off:
            out = SaveForBackward.apply(anchor, sink, y)
    off.wait()
    out.backward()
    stats = off.stats()
    assert stats.offloaded_bytes == 0 and stats.kept_bytes >= N * 4, stats
    assert dev.copies["d2h"] == 0
    assert torch.equal(sink[0][0], torch.full((N,), 3.0))


def test_a_resized_storage_is_checked_before_staging(make_offloader, caplog):
    """A storage resized after pack fails its record before anything is staged (and is
    not logged as 'could not be staged'). Broken (the check after ``stage_out``): the
    staging view of the resized storage raises, and the record is kept with that
    warning."""
    dev = LoopbackDevice(claim_host_tensors=True)
    off = _offloader(make_offloader, dev, keep_tail_bytes=N * 4, prefetch_bytes=0)
    sink, anchor = [], _anchor()
    with caplog.at_level(logging.WARNING, logger="ssdtrain"), off:
        y = torch.randn(N)
        out1 = SaveForBackward.apply(anchor, sink, y)
        y.untyped_storage().resize_(0)
        out2 = SaveForBackward.apply(anchor, sink, torch.randn(N))  # y's write is due
        off.wait()
    assert not [r for r in caplog.records if "could not be staged" in r.getMessage()], \
        caplog.text
    assert dev.copies["d2h"] == 0
    stats = off.stats()
    assert stats.kept_bytes == N * 4 and stats.records_written == 0, stats  # z: the tail
    with pytest.raises(Exception, match="resized"):
        (out1 + out2).backward()


def _until(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def _save_and_unpack(off, tensors):
    sink, anchor = [], _anchor()
    with off:
        out = SaveForBackward.apply(anchor, sink, *tensors)
        off.wait()
    out.backward()
    return sink[0]
