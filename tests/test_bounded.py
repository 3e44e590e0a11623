"""What ssdtrain holds is bounded whatever the disk does (INV-BOUNDED, NOTE [ Bounded
memory ] in ssdtrain/_store/store.py), and an out-of-memory forward is a measurement of the
default policy (NOTE [ The offload quota ], step 0, in ssdtrain/_policies/auto.py).

The disk here is a :class:`LaggingDisk`: its writes land only when the test says so
(or, for the throttled policies, when a thread of its own lets them, at a pace the test
draws), its reads go straight through. Between steps every graph is gone, so whatever
ssdtrain still holds in memory is held for a write that has not landed: at most
``write_behind_bytes`` plus one record, at every step, under every policy.
"""

from __future__ import annotations

import collections
import logging
import random
import threading
import time
from concurrent.futures import Future

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ssdtrain
from ssdtrain import testing
from helpers import SaveForBackward
from loopback_helpers import LoopbackDevice, attach, device_chain
from ssdtrain._policies.auto import BASELINE_STEPS, SIZING_STEPS
from ssdtrain.io.base import EngineWrapper

KiB = 1 << 10
WARMUP = SIZING_STEPS + BASELINE_STEPS


def FAST(n):
    """A disk probe of 1 TB/s: the quota is as high as the steps allow."""
    return n / 1e12, n / 1e12


def SLOW(n):
    """A disk probe of 1 kB/s: quota 0, and the hooks off after the baseline."""
    return n / 1e3, n / 1e3


class LaggingDisk(EngineWrapper):
    """Writes wait in a queue until :meth:`land` performs them (on the inner engine, on
    the calling thread); reads go straight through. With ``pace`` a thread of its own
    lands one write every ``pace()`` seconds (a disk of its own speed)."""

    def __init__(self, inner, pace=None):
        super().__init__(inner)
        self.queue = collections.deque()
        self.lock = threading.Lock()
        self.landed = 0
        self._stop = threading.Event()
        self._thread = None
        if pace is not None:
            self._thread = threading.Thread(target=self._run, args=(pace,), daemon=True)
            self._thread.start()

    def write(self, file, offset, address, nbytes, **kw):
        fut = Future()
        fut.set_running_or_notify_cancel()
        with self.lock:
            self.queue.append((fut, file, offset, address, nbytes, kw))
        return fut

    def pending(self):
        with self.lock:
            return len(self.queue)

    def land(self, k=None):
        """Perform the ``k`` oldest queued writes (all with None)."""
        n = 0
        while k is None or n < k:
            with self.lock:
                if not self.queue:
                    return
                fut, file, offset, address, nbytes, kw = self.queue.popleft()
            try:  # the request's owner goes with it to the inner engine, which lets go
                result = self.inner.write(file, offset, address, nbytes, **kw).result()
            except BaseException as e:  # noqa: BLE001 - handed to the store as the disk's
                kw = None
                fut.set_exception(e)
            else:
                kw = None
                fut.set_result(result)
            self.landed += 1
            n += 1

    def _run(self, pace):
        while not self._stop.is_set():
            time.sleep(pace())
            self.land(1)

    def shutdown(self):
        self._stop.set()
        self.land()
        self.inner.shutdown()


def step(off, sizes, anchor=None):
    """One training step under ``off``: forward saves one fresh tensor of each size in
    ``sizes`` (bytes), backward checks each came back with its own value."""
    anchor = torch.zeros((), requires_grad=True) if anchor is None else anchor
    sink = []
    with off:
        out = anchor
        for i, n in enumerate(sizes):
            out = SaveForBackward.apply(out, sink, torch.full((n // 4,), float(i)))
    out.backward()
    got = [float(s[0][0]) for s in sink]
    assert got == [float(i) for i in reversed(range(len(sizes)))], got


def unreferenced_bytes(off):
    """Bytes of records no graph references that ssdtrain still holds in memory (each
    only until its request ends)."""
    return sum(r.nbytes for r in off.records()
               if not r.live and r.state in ("PENDING", "WRITING", "KEPT", "LOADING", "LOADED",
                                             "HOSTING"))


def install_lagging_disk(off, pace=None):
    disks = []
    off.wrap_engine(lambda e: disks.append(LaggingDisk(e, pace)) or disks[-1])
    return disks[0]


def test_a_disk_that_falls_behind_the_default_holds_at_most_write_behind_bytes(
        make_offloader, caplog):
    """The issue's case: a step saves 32 records, the quota (a fast probe) takes 31 of
    them, and the disk then lands one write per step. Before, every decided write was
    submitted at once (the throttle is off under "auto"), so the bytes held for writes
    that had not landed grew by about 30 records a step with every graph gone, and the
    quota stayed. Now at most ``write_behind_bytes`` (plus one record) are in flight, a
    due record whose graph dies first is freed unwritten (``Stats.unwritten_bytes``),
    the quota comes down, and the policy says so once."""
    n, k = 64 * KiB, 32
    wb = 4 * n
    off = make_offloader(policy="auto", min_tensor_bytes=4096, keep_tail_bytes=0,
                         write_behind_bytes=wb, prefetch_bytes=4 * n, max_slowdown=10)
    off._auto._probe = FAST
    for _ in range(WARMUP):
        step(off, [n] * k)
    disk = install_lagging_disk(off)
    held, quotas = [], []
    caplog.set_level(logging.WARNING, logger="ssdtrain")
    try:
        for _ in range(12):
            step(off, [n] * k)
            disk.land(1)
            assert off.live_records() == 0
            held.append(unreferenced_bytes(off))
            quotas.append(off.stats().offload_quota_bytes)
            testing.check_invariants(off)
    finally:
        disk.land()
    assert max(held) <= wb + n, held
    assert off.stats().unwritten_bytes > 0
    assert quotas[0] >= k // 4 * n and min(quotas) < quotas[0] / 4, quotas
    told = [r for r in caplog.records if "had not landed" in r.getMessage()]
    assert len(told) == 1, [r.getMessage() for r in caplog.records]


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(policy=st.sampled_from(["auto", "static"]),
       steps=st.lists(st.tuples(st.lists(st.integers(1, 24), min_size=1, max_size=12),
                                st.integers(0, 6)), min_size=3, max_size=10),
       wb_records=st.integers(0, 6),
       seed=st.integers(0, 2 ** 16))
def test_what_is_held_for_writes_is_bounded_whatever_the_disk_does(
        spill_dir, policy, steps, wb_records, seed):
    """A search over step shapes (records of 4-96 KiB), write-behind limits and disk
    speeds: after every step (every graph gone) the bytes ssdtrain holds for writes that
    have not landed are at most ``write_behind_bytes`` plus one record, and every step
    gets its own values back. "auto" runs on a disk the test lands ``m`` writes of per
    step (0 included: a stalled disk; nothing waits for a write there), "static" on a
    disk of its own pace, which its throttle waits for."""
    unit = 4 * KiB
    wb = wb_records * 16 * unit
    # max_slowdown=10: no step of this machine's is slow enough to lower the quota; only
    # the writes' lag may.
    off = ssdtrain.Offloader(spill_dir=str(spill_dir), policy=policy, min_tensor_bytes=4096,
                             keep_tail_bytes=0, write_behind_bytes=wb, max_slowdown=10,
                             prefetch_bytes=64 * unit, io_timeout_s=60)
    rng = random.Random(seed)
    try:
        if policy == "auto":
            off._auto._probe = FAST
            for _ in range(WARMUP):
                step(off, [24 * unit] * 12)
            disk = install_lagging_disk(off)
        else:
            disk = install_lagging_disk(off, pace=lambda: rng.choice([0.0, 0.0005, 0.002]))
        biggest = 0
        for sizes, landed in steps:
            sizes = [s * unit for s in sizes]
            biggest = max(biggest, *sizes)
            step(off, sizes)
            if policy == "auto":
                disk.land(landed)
            held = unreferenced_bytes(off)
            assert held <= wb + biggest, (held, wb, biggest)
        disk.land()
        off.wait()
        assert unreferenced_bytes(off) == 0 and off.resident_bytes() == 0
        testing.check_invariants(off)
    finally:
        off.close()


def test_a_step_whose_forward_runs_out_of_memory_makes_the_next_one_fit(make_offloader,
                                                                        caplog):
    """The issue's case: steps of 16 records fit a device of 24, the disk is slow, so
    after the baseline nothing is offloaded (the hooks are off). Then a step saves 30
    records: out of memory. Before, the floor came only from that step's forward end (it
    left nothing free, having offloaded nothing), which was not enough: the next step
    ran out of memory too. Now the error is a measurement taken before it propagates:
    the next step sizes again (offloads every eligible tensor, as the first step did),
    fits, and sets the floor, under which the steps after it fit too."""
    n = 64 * KiB
    dev = LoopbackDevice(capacity=24 * n)
    off = make_offloader(policy="auto", min_tensor_bytes=4096, keep_tail_bytes=0,
                         write_behind_bytes=n, prefetch_bytes=2 * n)
    attach(off, dev)
    off._auto._probe = SLOW
    for _ in range(WARMUP + 1):
        device_chain(off, dev, 16, n)
    assert not off._auto.intercepts
    caplog.set_level(logging.WARNING, logger="ssdtrain")
    with pytest.raises(torch.OutOfMemoryError):
        device_chain(off, dev, 30, n)
    told = [r.getMessage() for r in caplog.records if "ran out of memory" in r.getMessage()]
    assert len(told) == 1 and "next step offloads every eligible tensor" in told[0], told
    for _ in range(4):
        device_chain(off, dev, 30, n)           # fits: sized again, then under the floor
        testing.check_invariants(off)
    assert off._auto.floor > 0
    oom, resized = off._auto.samples[-4:-2]
    assert oom.out_of_memory and resized.quota is None, (oom, resized)  # sized again


@pytest.mark.parametrize("how", ["with", "attach", "intercept"])
def test_out_of_memory_is_measured_however_the_forward_is_entered(make_offloader, how):
    """``with off:``, an attached module's call and ``off.intercept()`` (the Megatron
    adapter's) each see the forward's out-of-memory error before it propagates; an
    error of another kind, or one in an evaluation pass under ``no_grad``, is no
    measurement."""
    off = make_offloader(policy="auto", min_tensor_bytes=4096, keep_tail_bytes=0)
    off._auto._probe = SLOW
    x = torch.randn(64, 64, requires_grad=True)

    def forward(fail):
        y = torch.tanh(x @ x)
        if fail is not None:
            raise fail
        return y.sum()

    class Net(torch.nn.Module):
        def forward(self, fail):
            return forward(fail)

    net = Net()
    if how == "attach":
        off.attach(net)

    def run(fail=None):
        if how == "with":
            with off:
                return forward(fail)
        if how == "attach":
            return net(fail)
        off.begin_forward()
        try:
            with off.intercept():
                return forward(fail)
        finally:
            off.abort_forward()

    for _ in range(WARMUP + 1):
        run().backward()
    with pytest.raises(ValueError):
        run(ValueError("not memory"))
    with torch.no_grad(), pytest.raises(torch.OutOfMemoryError):
        if how == "with":  # (an attached module opens no pass under no_grad)
            run(torch.OutOfMemoryError("evaluation"))
        else:
            raise torch.OutOfMemoryError("evaluation")
    run().backward()
    assert off.stats().offload_quota_bytes == 0       # neither was a measurement
    with pytest.raises(torch.OutOfMemoryError):
        run(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    run().backward()
    stats = off.stats()
    assert stats.offload_quota_bytes is None and "sizing again" in stats.offload_quota_reason
    assert stats.offloaded_bytes > 0
    run().backward()                                  # sized once, then the quota again
    assert off.stats().offload_quota_bytes is not None


@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(steps=st.lists(st.lists(st.integers(4, 16), min_size=1, max_size=3),
                      min_size=2, max_size=6),
       link_s=st.sampled_from([0.0, 0.002]), pace=st.sampled_from([0.0005, 0.004]),
       seed=st.integers(0, 2 ** 16))
def test_the_host_tier_holds_its_budget_plus_write_behind_whatever_link_and_disk_do(
        spill_dir, steps, link_s, pace, seed):
    """The host tier over a slow link (device -> pinned copies that take ``link_s``
    each) with an SSD beyond it of its own pace, under the default policy with both tiers
    priced fast, steps of 1-3 micro-batches (gradient accumulation: the graphs of the
    earlier ones stay alive). Records evicted from RAM hold their pinned copy until
    their write ends: before, copies and writes were all started at once (in flight
    without limit), and evicted records waited for the SSD without limit, so pinned
    memory grew with the backlog. At every micro-batch's forward end and every step's
    end: the host budget holds, what is in flight (copies and writes) and what waits for
    the SSD are each at most ``write_behind_bytes`` plus one record, records no graph
    references are held only for a request in flight, and every micro-batch gets its
    own values back."""
    n = 64 * KiB
    wb, budget = n, 8 * n
    rng = random.Random(seed)
    dev = LoopbackDevice(d2h_delay=link_s)
    off = ssdtrain.Offloader(spill_dir=str(spill_dir), policy="auto", min_tensor_bytes=4096,
                             keep_tail_bytes=0, write_behind_bytes=wb, max_slowdown=10,
                             prefetch_bytes=4 * n, host_budget_bytes=budget, io_timeout_s=60)
    attach(off, dev)
    try:
        off._auto._probe = FAST
        off._auto._copy_probe = FAST
        for _ in range(WARMUP):
            device_chain(off, dev, 16, n)
        disk = install_lagging_disk(off, pace=lambda: rng.uniform(0, pace))
        def check():
            stats = off.stats()
            assert stats.host_bytes <= budget and stats.peak_host_bytes <= budget
            out = testing.outbound(off)
            assert out.writing <= wb + n, out.writing
            assert out.spilling <= wb + n, out.spilling  # evicted, write not started
            assert unreferenced_bytes(off) <= wb + n

        for micro in steps:
            outs, sinks = [], []
            for i, k in enumerate(micro):
                if i:
                    off.wait()  # the earlier micro-batch's copies all landed in RAM
                sink, anchor = [], torch.zeros((), requires_grad=True)
                with off:
                    out = anchor
                    for j in range(k):
                        d = dev.alloc((n // 4,))
                        d.copy_(torch.full((n // 4,), float(j)))
                        out = SaveForBackward.apply(out, sink, d)
                        del d
                check()
                outs.append(out)
                sinks.append((sink, k))
            for out in outs:
                out.backward()
            for sink, k in sinks:
                assert [float(s[0][0]) for s in sink] == [float(j) for j in reversed(range(k))]
            del outs, sinks
            check()
        disk.land()
        off.wait()
        assert unreferenced_bytes(off) == 0
        testing.check_invariants(off)
    finally:
        off.close()


# -- read buffers held through forward ------------------------------------------------------

class _Probe(torch.autograd.Function):
    """Reads ``look()`` inside forward, after every save before it: what the store holds
    while forward runs."""

    @staticmethod
    def forward(ctx, a, look, seen):
        seen.append(look())
        return a * 1

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


@given(steps=st.lists(st.lists(st.sampled_from([5000, 100_000, 1 << 20, 3 << 20, 100]),
                                min_size=1, max_size=6), min_size=2, max_size=5),
       tail=st.sampled_from([0, 1 << 20, 8 << 20]),
       prefetch=st.sampled_from([0, 1 << 20, 4 << 20]),
       engine=st.sampled_from(["native", "posix"]))
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_forward_holds_no_more_read_buffers_than_the_last_forwards_end_took(
        spill_dir, steps, tail, prefetch, engine):
    """NOTE [ Read buffers across steps ] in io/readbuf.py: while a forward runs, the read
    buffers ssdtrain keeps mapped are at most what the previous forward's end took for
    its first reads (none when it read nothing there: a kept tail that fills the window,
    a step of small tensors), whatever the steps save and read (``Stats.read_buffer_bytes``
    and ``read_buffer_idle_bytes`` tell). Keeping every buffer
    the last backward used instead raised forward's peak by up to ``prefetch_bytes``
    and got the default killed in a tight cgroup (tests/test_limits.py). Gradients stay
    exact."""
    off = ssdtrain.Offloader(spill_dir=str(spill_dir), policy="static", engine=engine,
                             keep_tail_bytes=tail, prefetch_bytes=prefetch,
                             min_tensor_bytes=4096)
    def mapped():
        return off.stats().read_buffer_bytes
    try:
        taken_at_end = 0  # what the previous forward's end had mapped for reads
        for sizes in steps:
            g = torch.Generator().manual_seed(len(sizes))
            xs = [torch.rand(max(1, n // 4), generator=g) for n in sizes]
            a, sink, seen = torch.ones((), requires_grad=True), [], []
            with off:
                y = a
                for x in xs:
                    y = SaveForBackward.apply(y, sink, x.clone())
                y = _Probe.apply(y, mapped, seen)
            assert seen[0] <= taken_at_end, (seen[0], taken_at_end, sizes)
            now = off.stats()
            taken_at_end = now.read_buffer_bytes - now.read_buffer_idle_bytes
            y.backward()
            got = [t[0] for t in reversed(sink)]
            assert all(torch.equal(u, x) for u, x in zip(got, xs))
            del y, sink, got
    finally:
        off.close()
