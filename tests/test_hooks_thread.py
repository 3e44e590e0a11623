"""Which threads run ssdtrain's Python while steps run (NOTE [ Copies the hooks start ]
in ssdtrain/_device/transfers.py, NOTE [ The data path on the hooks' thread ] in _store/store.py).

On a GPU host the thread that runs the hooks launches every kernel, and any other thread
that runs Python takes the GIL from it. The promise tested here: once the staging pool
holds the buffers a step needs (after the first steps), a step whose device records go
to the host tier runs no ssdtrain Python on any thread but the hooks' own, the copies
to RAM and back included. The loopback device's stream threads (they stand for the
device, and run its "kernels" in Python) are the only other threads allowed.

A profile function (``threading.setprofile``, set before the offloader starts its
threads) records every call into ssdtrain's modules on a thread other than the one
running the steps. The I/O thread may still run a round at a step boundary (woken by
the end of a backward or by ``wait()``: the issue allows Python on another thread
there); what must not run anywhere else is the work done for each record: the
functions in :data:`PER_RECORD`.
"""

from __future__ import annotations

import collections
import os
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ssdtrain
from ssdtrain import testing
from ssdtrain.tools import pin_auto_quota
from loopback_helpers import LoopbackDevice, SaveForBackward, attach

KiB = 1 << 10
PKG = os.path.dirname(os.path.abspath(ssdtrain.__file__)) + os.sep
DEVICE_THREADS = ("loopback-stream",)  # the stand-in device's own threads
BACKWARD_THREAD = "autograd-device"  # backward's hooks, as CUDA runs them (_step)
# What runs once per record on the way to RAM and back: starting a copy, waiting for
# it, settling it, applying its end, loading it back, using it.
PER_RECORD = {"start_write_locked", "start_host_locked", "to_host", "from_host", "after",
              "_synchronize", "_landed", "polled", "set_result", "_finish", "write_done_locked",
              "hosted_locked", "load_locked", "_load_host", "use_locked", "transition", "move",
              "callback", "done"}


class ForeignCalls:
    """Calls into ssdtrain's modules on threads other than the one that made this, while
    ``recording``; installed for threads started after :meth:`install`."""

    def __init__(self):
        self.me = threading.get_ident()
        self.recording = False
        self.calls = collections.Counter()

    def __call__(self, frame, event, arg):
        if event == "call" and self.recording and threading.get_ident() != self.me:
            path = frame.f_code.co_filename
            name = threading.current_thread().name
            if path.startswith(PKG) and not name.startswith(DEVICE_THREADS) \
                    and name != BACKWARD_THREAD:
                self.calls[(threading.get_ident(), name, os.path.basename(path),
                            frame.f_code.co_name)] += 1

    def of(self, off):
        """The calls made on ``off``'s own threads (its I/O thread and its devices' copy
        waiters), by ``(thread name, module, function)``: an earlier offloader's threads
        may still be finishing their release (a hypothesis example before this one)."""
        mine = {testing.io_thread(off).ident}
        for dev in testing.transfers(off):
            mine.update(t.ident for t in dev._waiter._threads)  # noqa: SLF001
        out = collections.Counter()
        for (ident, *key), n in self.calls.items():
            if ident in mine:
                out[tuple(key)] += n
        return out

    def install(self):
        threading.setprofile(self)

    def remove(self):
        threading.setprofile(None)
        self.recording = False


def _per_record(calls):
    """The per-record work among ``calls``, and the I/O thread's wakes (each would give
    it the GIL for a round)."""
    return {k: v for k, v in calls.items() if k[2] in PER_RECORD or k[0].startswith("(wakes")}


def _forward(off, dev, values, sink):
    """A forward under ``off`` saving each of ``values`` (copied into device memory) in
    its own node; returns the graph's output."""
    out = torch.zeros((), requires_grad=True)
    with off:
        for v in values:
            d = dev.alloc(v.shape)
            d.copy_(v)
            out = SaveForBackward.apply(out, sink, d)
            del d
    return out


def _step(off, dev, sizes, values, backward_thread=False):
    """One forward (a chain of device tensors of ``sizes`` bytes, each saved by its own
    node) and backward; checks every tensor backward gets against what was saved.
    ``backward_thread``: backward runs on a thread of its own, as autograd runs a CUDA
    graph's backward on its device thread (the unpack hooks are then not the main
    thread's, and neither are the polls they make)."""
    sink = []
    out = _forward(off, dev, values, sink)
    if backward_thread:
        errors = []

        def run():
            try:
                out.backward()
            except BaseException as e:  # noqa: BLE001 - re-raised on the test's thread
                errors.append(e)
        t = threading.Thread(target=run, name=BACKWARD_THREAD)
        t.start()
        t.join()
        if errors:
            raise errors[0]
    else:
        out.backward()
    got = [s[0] for s in reversed(sink[:len(sizes)])]
    assert all(torch.equal(g, v) for g, v in zip(got, values))
    del out, sink, got
    # The loopback's copies are Python threads that lag behind on a loaded machine; a
    # copy still running at the next step would hold its pinned buffer, and the pool
    # would then need one more (allocated by the I/O thread: milliseconds, never on the
    # hooks' thread). A device keeps up; here wait() lets the copies end first.
    off.wait()


def _run(spill_dir, sizes, *, quota=None, warmup=5, steps=3, backward_thread=False):
    """Steps on a loopback device with the host tier (RAM only unless ``spill_dir``);
    returns the foreign calls made during the last ``steps`` and the offloader's stats."""
    foreign = ForeignCalls()
    foreign.install()
    try:
        off = ssdtrain.Offloader(ssdtrain.OffloadConfig(
            policy="static" if quota is None else "auto", spill_dir=spill_dir,
            host_budget_bytes="unlimited", keep_tail_bytes=0, min_tensor_bytes=4 * KiB))
        try:
            if quota is not None:
                pin_auto_quota(off, quota)
            dev = LoopbackDevice()
            attach(off, dev)
            wakes = []

            def counting(kick):
                def counted_kick():  # a wake of the I/O thread, from any thread
                    if foreign.recording:
                        wakes.append(threading.current_thread().name)
                    kick()
                return counted_kick
            testing.wrap_io(off, wake=counting)
            values = [torch.arange(n // 4, dtype=torch.float32) + 1000 * i
                      for i, n in enumerate(sizes)]
            for i in range(warmup + steps):
                foreign.recording = i >= warmup
                _step(off, dev, sizes, values, backward_thread)
            foreign.recording = False
            calls = foreign.of(off)
            if wakes:
                calls[("(wakes of the I/O thread)", "", ", ".join(sorted(set(wakes))))] = \
                    len(wakes)
            return calls, off.stats()
        finally:
            off.close()
    finally:
        foreign.remove()


@pytest.mark.parametrize("backward_thread", [False, True], ids=["main", "device-thread"])
def test_steps_to_the_host_tier_run_no_python_off_the_hooks_thread(backward_thread):
    """Every record to RAM and back (``policy="static"``, no SSD tier): after warm-up, no
    ssdtrain Python on another thread. Before the hooks started these copies themselves,
    the I/O thread and the copy waiter ran some 30 calls per record here. Nor is the I/O
    thread woken. With backward on a thread of its own (as on CUDA), a completion its
    polls settle wakes no one: before, such a callback took any thread but the main one
    for an engine's, and woke the I/O thread per record (0 to 36 wakes in 3 steps of 12
    records, in 5 runs)."""
    sizes = [64 * KiB] * 12
    calls, stats = _run(None, sizes, backward_thread=backward_thread)
    # Every record went to RAM (those backward reached before their copy ended were
    # served from device memory, the rest loaded back from RAM).
    assert stats.offloaded_bytes == 8 * sum(sizes) and stats.bytes_written == 0
    assert stats.host_loaded_bytes > 0
    assert not _per_record(calls), sorted(_per_record(calls).items())


@settings(max_examples=12, deadline=None)
@given(sizes=st.lists(st.sampled_from([8 * KiB, 64 * KiB, 256 * KiB, 1024 * KiB]),
                      min_size=1, max_size=10),
       share=st.sampled_from([0, 1, 2, 4]))
def test_the_default_within_its_quota_runs_no_python_off_the_hooks_thread(sizes, share):
    """The default policy with its quota pinned at a share (0, 1/4, 1/2, all) of a step's
    bytes, over chains of mixed sizes (size classes of the staging pool): the records
    within the quota go to RAM and back, the rest are passed through, and no ssdtrain
    Python runs off the hooks' thread after warm-up; every tensor comes back exact."""
    quota = sum(sizes) * share // 4
    calls, stats = _run(None, sizes, quota=quota, warmup=3, steps=2)
    assert not _per_record(calls), sorted(_per_record(calls).items())
    if sizes[0] <= quota:  # the earliest record fits: the steps offloaded (not vacuous)
        assert stats.offloaded_bytes > 0 and stats.bytes_written == 0
    if quota >= max(sizes):
        assert stats.host_loaded_bytes > 0


@pytest.mark.parametrize("slow", [1, 4])
def test_copies_the_hooks_start_end_under_wait_and_close(slow):
    """``wait()`` settles the copies the hooks started (it polls them: nothing else
    would while no hook runs), and ``close()`` right after forward leaves none behind."""
    sizes = [64 * KiB] * 6
    off = ssdtrain.Offloader(ssdtrain.OffloadConfig(
        policy="static", spill_dir=None, host_budget_bytes="unlimited", keep_tail_bytes=0,
        min_tensor_bytes=4 * KiB))
    dev = LoopbackDevice(d2h_delay=0.002 * slow)  # copies still running at wait()
    attach(off, dev)
    values = [torch.full((n // 4,), float(i)) for i, n in enumerate(sizes)]
    for _ in range(3):  # the pool holds buffers: the hooks start the copies
        _step(off, dev, sizes, values)
    sink = []
    out = _forward(off, dev, values, sink)
    transfers = testing.transfers(off)
    off.wait()
    assert all(not t.landing for t in transfers)
    # Every copy to RAM ended (the first ones prefetch loaded back already).
    assert {r.state for r in off.records()} <= {"HOSTED", "LOADED"}
    out.backward()
    assert all(torch.equal(s[0], v) for s, v in zip(reversed(sink), values))
    out = _forward(off, dev, values, [])
    del out
    off.close()
    assert all(not t.landing for t in transfers)
