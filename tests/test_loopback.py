"""The device path on the loopback device (ssdtrain/testing/loopback.py): whole models, checksums,
pinned staging, host and device records side by side, and random delay schedules.

The ordering rules one by one are in tests/test_loopback_rules.py.
"""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import assert_same, run_step
from loopback_helpers import LoopbackDevice, SaveForBackward, SlowRead, attach, write_later
from models import ALL_MODELS
from ssdtrain.io import checksum as _checksum
from ssdtrain._device.cuda import LEAF as CUDA
from ssdtrain.io import native
from ssdtrain import testing

ENGINES = ["posix"] + (["native"] if native.available() else [])
N = 1 << 16


def _offloader(make_offloader, dev, **cfg):
    off = make_offloader(**cfg)
    attach(off, dev)
    return off


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", sorted(ALL_MODELS))
def test_models_are_bitwise_equal_on_the_device_path(name, engine, make_offloader):
    """Every model, every saved CPU tensor taken for device memory (so every record goes
    through staging, the d2h and h2d streams and the consumer's wait), with checksums
    on where they can be: gradients bitwise equal, with writes in flight at backward
    and with every record read back. Before device records kept their CRC, each read
    back raised ``TypeError`` (a None CRC formatted in the mismatch message), as on the
    first GPU run (docs/results/gpu_check_2026-11-26_first.md)."""
    torch.manual_seed(0)
    model, inputs = ALL_MODELS[name]()
    ref = run_step(model, inputs)
    dev = LoopbackDevice(claim_host_tensors=True, d2h_delay=0.002, h2d_delay=0.002)
    off = _offloader(make_offloader, dev, engine=engine, min_tensor_bytes=4096,
                     keep_tail_bytes=0, verify=_checksum.available())
    for settle in (False, True):
        assert_same(ref, run_step(model, inputs, off, settle=settle))
    off.wait()
    stats = off.stats()
    assert stats.offloaded_bytes > 0 and stats.bytes_read > 0, stats
    assert dev.copies["d2h"] == stats.records_written and dev.copies["h2d"] > 0, dev.copies
    assert off.config.verify == _checksum.available()
    assert not dev.errors


def test_host_and_device_records_side_by_side(make_offloader):
    """Without ``claim_host_tensors`` only the device's own memory takes the device path:
    a CPU tensor saved in the same node is a host record (no staging copy)."""
    dev = LoopbackDevice()
    off = _offloader(make_offloader, dev, min_tensor_bytes=0, keep_tail_bytes=0,
                     prefetch_bytes=0)
    d = dev.alloc((N,))
    d.copy_(torch.arange(N, dtype=torch.float32))
    h = torch.randn(N)
    sink, anchor = [], torch.zeros((), requires_grad=True)
    with off:
        out = SaveForBackward.apply(anchor, sink, d, h)
        off.wait()
    out.backward()
    assert torch.equal(sink[0][0], d) and torch.equal(sink[0][1], h)
    assert dev.copies == {"d2h": 1, "h2d": 1}, dev.copies
    assert off.stats().records_written == 2


def test_cuda_staging_sizes_are_what_the_host_allocator_reserves():
    """torch's caching host allocator rounds a pinned request up to a power of two: the
    pool asks for exactly that and uses all of it (a 128 MiB record takes 128 MiB, not
    the 256 MiB that 128 MiB + 4 KiB took)."""
    mib = 1 << 20
    assert CUDA.pinned_size(128 * mib) == 128 * mib
    assert CUDA.pinned_size(128 * mib + 1) == 256 * mib
    assert CUDA.pinned_size(1) == 1 and CUDA.pinned_size(3 * mib) == 4 * mib


def test_staging_is_pooled_accounted_and_exact(make_offloader):
    """Pinned staging is taken in the sizes the allocator reserves (page-rounded on the
    loopback device: 1 MiB records take 1 MiB, not 1 MiB + 4 KiB), reused from step to
    step (no pinned allocation after the first step), and counted in
    ``Stats.staging_bytes`` and ``peak_staging_bytes``."""
    dev = LoopbackDevice()
    sizes = []
    real = dev.pinned
    dev.pinned = lambda n: sizes.append(n) or real(n)
    k, n = 4, 1 << 18                 # 1 MiB each
    off = _offloader(make_offloader, dev, min_tensor_bytes=0, keep_tail_bytes=0,
                     prefetch_bytes=k * n * 4, write_behind_bytes=k * n * 4)
    for step in range(3):
        sink, out = [], torch.zeros((), requires_grad=True)
        with off:
            for i in range(k):
                t = dev.alloc((n,))
                t.fill_(float(step * k + i))
                out = SaveForBackward.apply(out, sink, t)
            del t
            off.wait()
        out.backward()
        assert [float(s[0][0]) for s in sink] == [float(step * k + i)
                                                  for i in reversed(range(k))]
        if step == 0:
            first = len(sizes)
    assert sizes and set(sizes) == {n * 4}, sizes
    assert len(sizes) == first, f"pinned allocations after the first step: {sizes[first:]}"
    stats = off.stats()
    assert stats.staging_bytes == len(sizes) * n * 4 == stats.peak_staging_bytes, stats
    assert dev.pinned_bytes == stats.staging_bytes
    off.close()
    assert off.stats().staging_bytes == 0


_POOL_OPS = st.lists(st.one_of(
    st.tuples(st.just("take"), st.integers(1, 3 << 20), st.sampled_from([0, 512, 4000])),
    st.tuples(st.just("reserve"), st.integers(1, 3 << 20), st.sampled_from([0, 512, 4000])),
    st.tuples(st.just("drop"), st.integers(0, 7), st.just(0)),
    st.tuples(st.just("trim"), st.booleans(), st.just(0))), max_size=40)


@settings(max_examples=60, deadline=None)
@given(ops=_POOL_OPS, limit=st.sampled_from([0, 1 << 20, 4 << 20, 16 << 20]),
       skew=st.sampled_from([0, 1024]))
def test_staging_pool_never_keeps_more_than_its_idle_limit(ops, limit, skew):
    """NOTE [ Bounded staging ]: over any sequence of takes (at a read's offset too),
    reservations ahead, leases dropped and trims, with buffers of many size classes
    (page-rounded; a small buffer packed into a page is asked one page larger): the
    idle bytes, counted as reserved, never exceed the limit; ``Stats.staging_bytes`` is
    every pinned byte the device handed out and ``staging_idle_bytes`` the pool's idle
    part; and a reservation is in the class its take asks for (the take allocates
    nothing). Before the fix a reservation entered the idle set whatever the limit."""
    import ssdtrain
    from ssdtrain._device.staging import StagingPool
    dev = LoopbackDevice(pinned_skew=skew)
    stats = ssdtrain.Stats()
    pool = StagingPool(dev, stats, limit)
    leases = []
    for op, n, offset in ops:
        if op == "take":
            leases.append(pool.take(n, offset=offset))
        elif op == "reserve":
            pool.reserve(n, offset=offset)
            allocs = dev.pinned_bytes
            leases.append(pool.take(n, offset=offset))
            if pool.size_for(n + offset) <= limit // 2:  # room for it, skew included
                assert dev.pinned_bytes == allocs, "the reservation was in another class"
        elif op == "drop" and leases:
            leases.pop(n % len(leases))
        else:
            pool.trim(sync=n)
        assert pool.idle_bytes() <= limit, (pool.idle_bytes(), limit)
        assert stats.staging_idle_bytes == pool.idle_bytes()
        assert stats.staging_bytes == pool.held == dev.pinned_bytes
    leases.clear()
    pool.trim(sync=True)
    assert stats.staging_bytes == stats.staging_idle_bytes <= limit
    pool.release()
    assert stats.staging_bytes == stats.staging_idle_bytes == dev.pinned_bytes == 0


class _OwnedLock:
    """The store's lock, remembering which thread holds it (a ``threading.Lock`` does
    not say)."""

    def __init__(self, inner):
        self.inner, self.owner = inner, None

    def acquire(self, blocking=True, timeout=-1):
        if self.inner.acquire(blocking, timeout):
            self.owner = threading.get_ident()
            return True
        return False

    def release(self):
        self.owner = None
        self.inner.release()

    def locked(self):
        return self.inner.locked()

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


def _until(cond, timeout=30.0):
    """Wait (polling) until ``cond()``; the caller's asserts say what did not happen."""
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.005)


def test_pinned_staging_is_allocated_outside_the_store_lock(make_offloader):
    """The store's I/O thread reserves staging before it takes the store lock (a pinned
    allocation costs milliseconds on a GPU host): no pinned allocation on that thread
    runs while it holds the lock."""
    dev = LoopbackDevice()
    calls = []
    real = dev.pinned
    off = _offloader(make_offloader, dev, min_tensor_bytes=0, keep_tail_bytes=0,
                     prefetch_bytes=0)
    store = off._store  # the store's lock itself is watched (who holds it, when)
    lock = store._lock = _OwnedLock(store._lock)

    def pinned(n):
        calls.append((threading.current_thread().name, lock.owner == threading.get_ident()))
        return real(n)
    dev.pinned = pinned
    sink, out = [], torch.zeros((), requires_grad=True)
    with off:
        for i in range(4):
            t = dev.alloc((N * (i + 1),))    # four sizes: four allocations
            t.fill_(float(i))
            out = SaveForBackward.apply(out, sink, t)
            _until(lambda: all(r.state != "PENDING" for r in off.records()))  # the I/O
        del t                                                # thread started the write
        off.wait()
    out.backward()
    on_io = [mine for name, mine in calls if name == "ssdtrain-store"]
    assert on_io, f"no staging allocated on the I/O thread: {calls}"
    assert not any(on_io), f"pinned allocations under the store lock: {calls}"


# --------------------------------------------------------------- delay schedules

def _schedule(delays):
    """A callable returning ``delays`` in turn, cyclically (thread-safe enough: a lost
    update only repeats a delay)."""
    state = {"i": 0}

    def next_delay():
        i = state["i"]
        state["i"] = i + 1
        return delays[i % len(delays)]
    return next_delay


_DELAYS = st.lists(st.sampled_from([0.0, 0.0, 0.001, 0.005, 0.02]), min_size=1, max_size=6)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(producer=_DELAYS, consumer=_DELAYS, d2h=_DELAYS, h2d=_DELAYS,
       k=st.integers(1, 6), tail=st.integers(0, 2), window=st.integers(0, 3),
       side_backward=st.booleans(), settle=st.booleans())
def test_delay_schedules_exact_no_leak_no_hang(spill_dir, producer, consumer, d2h, h2d, k, tail,
                                               window, side_backward, settle):
    """Random delays for the producer kernels, the device -> host copies, the host ->
    device copies and the consumer kernels, with random tail, prefetch window and
    streams: every record comes back exact, nothing is left (no live record, no device
    memory in use, no staging in use), and nothing hangs (every wait is bounded)."""
    import ssdtrain
    n = 1 << 12
    dev = LoopbackDevice(d2h_delay=_schedule(d2h), h2d_delay=_schedule(h2d))
    off = ssdtrain.Offloader(ssdtrain.OffloadConfig(
        policy="static", spill_dir=str(spill_dir), min_tensor_bytes=0, keep_tail_bytes=tail * n * 4,
        prefetch_bytes=window * n * 4, io_timeout_s=20))
    attach(off, dev)
    try:
        prod, cons = _schedule(producer), _schedule(consumer)
        fwd, bwd = dev.Stream(), dev.Stream() if side_backward else None
        sink, out = [], torch.zeros((), requires_grad=True)
        with dev.stream(fwd):
            with off:
                for i in range(k):
                    t = dev.alloc((n,))
                    write_later(dev, t, float(i), seconds=prod())
                    out = SlowRead.apply(out, dev, sink, t, cons())
                del t
                if settle:
                    off.wait()
        with dev.stream(bwd or fwd):
            out.backward()
        dev.synchronize()
        assert [float(t[0]) for t in sink] == [float(i) for i in reversed(range(k))]
        for i, t in zip(reversed(range(k)), sink):
            assert torch.equal(t, torch.full((n,), float(i))), i
        del out, sink
        off.wait()
        gc.collect()
        assert off.live_records() == 0
        deadline = time.monotonic() + 10
        pool = testing.transfers(off, dev).pool
        while (dev.in_use() or pool.busy()) and time.monotonic() < deadline:
            dev.synchronize()
            time.sleep(0.005)
        assert dev.in_use() == 0, "device memory left in use"
        assert pool.busy() == 0
        assert not dev.errors, dev.errors
    finally:
        off.close()
