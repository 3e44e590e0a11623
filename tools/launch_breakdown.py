#!/usr/bin/env python
"""Where a record's Python work runs in ``benchmarks/launch_loop.py``'s static mode: per
thread, per entry point, per phase of the step. An investigation tool, not a benchmark.

It wraps ssdtrain's private entry points (the I/O thread's round, the native engine's
completion callback, the store's drains, the write and read paths' starts and ends) with
timers that record, per call, the thread, the phase of the step (forward's loop, the
untimed waits, forward's exit, backward) and the call's duration; it counts the wakes
of the I/O thread (kicks that found it idle), its ``time.sleep(0)`` yields, and how often
each thread found the store's lock taken (it then blocks and lets go of the GIL, and
needs it back when the lock is free: one more GIL acquisition). Then it runs the launch
loop's static mode (``launch_loop.py``'s op, pool and launch block) for ``--steps``
steps and prints, per record: each entry point's calls, median µs per call and µs per
record, by thread and phase. Durations include the wrappers (about 1 µs a call) and any
time a wrapped call waited for the GIL or the lock inside; nested entry points are
listed apart (a round contains its ``start_one_locked``), so rows do not add up.

NOTE [ What-if variants ]: ``--what-if`` applies small changes to the data path by
patching (a completion releases its memory itself instead of waking the I/O thread;
pack starts its write itself instead of waking it; the I/O thread's second round of a
wake runs only when a hint says there is work), so that their effect on the loop can be
measured (``--no-instrument``: the timing alone, paired with ``none`` step by step)
before anyone changes ssdtrain.

It reaches into private code (``ssdtrain._store.store``, ``ssdtrain._store.iothread``...), which
benchmarks may not: it lives in tools/ and will need its list of entry points updated
when the data path changes (a name that no longer exists stops it with an error).

Example::

    PYTHONPATH=. .venv/bin/python tools/launch_breakdown.py --size 256KiB --steps 6
    PYTHONPATH=. .venv/bin/python tools/launch_breakdown.py --size 4MiB --reads overlap
    PYTHONPATH=. .venv/bin/python tools/launch_breakdown.py --no-instrument --steps 15 \
        --what-if bury-inline one-round
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import gc
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks"))

import torch  # noqa: E402

import ssdtrain  # noqa: E402
from ssdtrain._store import (iothread as _iothread, prefetch as _prefetch, store as _store,
                             table as _table, writeback as _writeback)
from ssdtrain.io import readbuf as _readbuf  # noqa: E402
from ssdtrain.io import native as _native  # noqa: E402

import launch_loop as LL  # noqa: E402

CALLS = collections.defaultdict(list)   # (thread, phase, entry point) -> [seconds]
ON = [False]
PHASE = ["-"]


def _thread():
    t = threading.current_thread()
    if t.name.startswith("Dummy"):  # a native engine worker running a callback
        return "ssdtrain-io (engine worker)"
    return "training thread" if t is threading.main_thread() else t.name


def _timed(owner, attr, label=None):
    fn = getattr(owner, attr)  # AttributeError: the entry point moved; update this list
    label = label or f"{owner.__name__}.{attr}"

    @functools.wraps(fn)
    def wrapper(*a, **k):
        if not ON[0]:
            return fn(*a, **k)
        phase = PHASE[0]
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            CALLS[(_thread(), phase, label)].append(time.perf_counter() - t0)
    setattr(owner, attr, wrapper)


def _count(label):
    if ON[0]:
        CALLS[(_thread(), PHASE[0], label)].append(0.0)


def instrument():
    """Wrap the entry points (before any Offloader is made: the store binds some)."""
    _timed(_iothread, "_round", "I/O thread: _round (a wake runs two)")
    _timed(_iothread.IOThread, "start_one_locked", "IOThread.start_one_locked")
    _timed(_iothread.IOThread, "reserve_staging", "IOThread.reserve_staging")
    _timed(_iothread.IOThread, "bury", "IOThread.bury (release memory)")
    _timed(_native._Completion, "__call__", "native completion callback (Python)")
    _timed(_store.Store, "_settle_nowait", "Store._settle_nowait")
    _timed(_store.Store, "_settle", "Store._settle")
    _timed(_store.Store, "_drain_locked", "Store._drain_locked")
    _timed(_store.Store, "_after_hook", "Store._after_hook (kick)")
    _timed(_writeback.WritePath, "start_write_locked", "WritePath.start_write_locked")
    _timed(_writeback.WritePath, "submit_write", "WritePath.submit_write")
    _timed(_writeback.WritePath, "write_done_locked", "WritePath.write_done_locked")
    _timed(_prefetch.ReadPath, "pump_locked", "ReadPath.pump_locked")
    _timed(_prefetch.ReadPath, "start_read_locked", "ReadPath.start_read_locked")
    _timed(_prefetch.ReadPath, "_read_buffer_locked", "ReadPath._read_buffer_locked")
    _timed(_readbuf.ReadBuffers, "storage", "ReadBuffers.storage (a read buffer)")
    _timed(_table.RecordTable, "count_ahead", "RecordTable.count_ahead")
    _timed(_prefetch.ReadPath, "submit_read", "ReadPath.submit_read")
    _timed(_prefetch.ReadPath, "read_done_locked", "ReadPath.read_done_locked")
    _timed(_prefetch.ReadPath, "evict_locked", "ReadPath.evict_locked")
    _timed(_native.NativeEngine, "_submit", "NativeEngine._submit (engine call)")
    _timed(_table.RecordTable, "free", "RecordTable.free")
    _timed(_store.Store, "pack", "Store.pack")
    _timed(_store.Store, "unpack", "Store.unpack")

    kick = _iothread.IOThread.kick

    def counted_kick(self):
        if self.running and self.idle:
            _count("kick that wakes the I/O thread")
        return kick(self)
    _iothread.IOThread.kick = counted_kick

    class _Time:
        def __getattr__(self, name):
            return getattr(time, name)

        def sleep(self, s):
            _count("time.sleep(0) between requests (a yield)")
            return time.sleep(s)
    _store.time = _Time()


# What-if variants (NOTE [ What-if variants ]): small changes to the data path, applied
# here by patching, so their effect on the loop can be measured before anyone writes them.
def _bury_inline():
    """A completion that leaves memory in the graveyard releases it itself (its engine
    thread holds the GIL already) instead of waking the I/O thread for it."""
    nothing = _store._nothing

    def _settle_nowait(self):
        lock = self._lock
        while self._inbox and lock.acquire(False):
            try:
                self._guarded_locked(nothing)
            finally:
                lock.release()
        if self._graveyard:
            self._bury()
        if self._inbox or self._write_overdue():
            self._kick()
    _store.Store._settle_nowait = _settle_nowait


def _submit_in_pack():
    """Pack starts the write it made due itself (the engine call keeps the GIL and only
    queues) instead of waking the I/O thread for it."""
    def _after_hook(self, due):
        if self._write_overdue():
            with self._lock:
                self._guarded_locked(self._writes.start_due_locked)
            due = self._read_due()
        if due or self._graveyard:
            self._kick()
    _store.Store._after_hook = _after_hook


def _one_round():
    """The I/O thread runs its second round of a wake only when a hint says there is
    work (the first round's end to its wait), not always."""
    round_ = _iothread._round

    def _work(ref, kicks, io):
        while True:
            item = kicks.get()
            while item is not _iothread._STOP and not kicks.empty():
                item = kicks.get()
            if item is _iothread._STOP:
                return
            store = ref()
            if store is None:
                return
            io.idle = False
            round_(store)
            io.idle = True
            if store._write_overdue() or store._read_due() or store._inbox or store._graveyard:
                round_(store)
            store = None
    _iothread._work = _work


WHAT_IF = {"bury-inline": _bury_inline, "submit-in-pack": _submit_in_pack,
           "one-round": _one_round}


class CountingLock:
    """The store's lock, counting each acquisition that found it taken (the caller then
    blocks, letting go of the GIL)."""

    def __init__(self, lock):
        self._lock = lock

    def acquire(self, blocking=True, timeout=-1):
        if self._lock.acquire(False):
            return True
        if not blocking:
            return False
        _count("store lock found taken (blocked)")
        return self._lock.acquire(blocking, timeout)

    def release(self):
        self._lock.release()

    def locked(self):
        return self._lock.locked()

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()


def _switches():
    """The training thread's voluntary context switches so far (each a wait: for the
    GIL, a lock or I/O)."""
    with open(f"/proc/self/task/{threading.get_native_id()}/status") as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches"):
                return int(line.split()[1])
    return 0


def step(off, pool, Op, state, uid, reads_before):
    """One step of the static mode (``off``) or of none (``off`` None), the phase marked
    for every call recorded: ``(forward s, backward s, the training thread's voluntary
    switches in forward's loop, in backward)``, the untimed waits left out."""
    count = pool.count
    xs = pool.fresh(uid)
    xs.reverse()
    y = torch.zeros((), requires_grad=True)
    gc.collect()
    gc.disable()
    try:
        PHASE[0] = "forward"
        v0 = _switches()
        t0 = time.perf_counter()
        with off if off is not None else contextlib.nullcontext():
            for i in range(count):
                y = Op.apply(y, xs.pop(), uid + i)
            t1 = time.perf_counter()
            v1 = _switches()
            PHASE[0] = "wait"
            if off is not None:
                off.wait()
            PHASE[0] = "forward exit"
            t2 = time.perf_counter()
        t3 = time.perf_counter()
        if reads_before and off is not None:
            PHASE[0] = "wait"
            off.wait()
        PHASE[0] = "backward"
        v4 = _switches()
        t4 = time.perf_counter()
        y.backward()
        t5 = time.perf_counter()
        v5 = _switches()
        PHASE[0] = "wait"
        del y
        if off is not None:
            off.wait()
        PHASE[0] = "-"
    finally:
        gc.enable()
    return (t1 - t0) + (t3 - t2), t5 - t4, v1 - v0, v5 - v4


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=LL.parse_size, default=256 << 10)
    p.add_argument("--count", type=int, default=64, help="saves per step (default 64)")
    p.add_argument("--steps", type=int, default=6, help="measured steps (after one warm-up)")
    p.add_argument("--launch-us", type=float, default=500.0)
    p.add_argument("--gil-held", type=float, default=0.0)
    p.add_argument("--reads", choices=("overlap", "before"), default="before")
    p.add_argument("--engine", choices=("native", "posix"), default="native")
    p.add_argument("--what-if", nargs="+", choices=sorted(WHAT_IF), default=[],
                   help="apply these variants of the data path first (NOTE [ What-if variants ])")
    p.add_argument("--no-instrument", action="store_true",
                   help="time the loop only (the wrappers cost about 1 µs a call; use this "
                        "to compare variants)")
    p.add_argument("--spill-dir", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    for name in args.what_if:
        WHAT_IF[name]()
    if not args.no_instrument:
        instrument()
    spill = args.spill_dir or tempfile.mkdtemp(prefix="ssdtrain-breakdown-")
    try:
        return _run(args, spill)
    finally:
        if args.spill_dir is None:
            shutil.rmtree(spill, ignore_errors=True)


def _run(args, spill):
    n_ops, spin, _ = LL.calibrate(args.launch_us, args.gil_held)
    state = {"launch": LL.Launcher(n_ops, spin), "bad": 0, "checked": 0}
    Op = LL.make_op(state)
    pool = LL.Pool(args.size, args.count)
    extra = {"prefetch_bytes": max(args.count * args.size, 256 << 20)} \
        if args.reads == "before" else {}
    off = ssdtrain.Offloader(spill_dir=spill, policy="static", keep_tail_bytes=0,
                             engine=args.engine, **extra)
    off._store._lock = CountingLock(off._store._lock)
    uid = 1 << 40
    before = None
    added = []
    for s in range(args.steps + 1):
        if s == 1:
            before = off.stats()
        times = {}
        for which in ((None, off) if s % 2 else (off, None)):
            ON[0] = s > 0 and which is not None
            uid += args.count
            times[which is None] = step(which, pool, Op, state, uid, args.reads == "before")
            ON[0] = False
        if s > 0:
            added.append([(a - b) * 1e6 / args.count for a, b in zip(times[False][:2],
                                                                        times[True][:2])]
                         + [x / args.count for x in times[False][2:]])
    st = off.stats().since(before)
    off.close()
    n = args.steps * args.count
    print(f"## launch_breakdown: static, {LL.size_text(args.size)} records, {args.count} saves "
          f"a step, {args.steps} steps, {args.launch_us:g} µs launch blocks (GIL-held "
          f"{args.gil_held:g}), reads {args.reads}, engine {st.engine}")
    print(f"what-if: {', '.join(args.what_if) or 'none'}; added per saved tensor (static minus "
          f"none, median over steps{'' if args.no_instrument else ', instrumented'}): forward "
          f"{statistics.median(a[0] for a in added):.0f} µs, backward "
          f"{statistics.median(a[1] for a in added):.0f} µs; the training thread's voluntary "
          f"switches per saved tensor (waits) in forward's loop "
          f"{statistics.median(a[2] for a in added):.2f}, in backward "
          f"{statistics.median(a[3] for a in added):.2f}")
    print(f"records written {st.records_written}, read {st.records_read}, prefetch hits "
          f"{st.prefetch_hits}, misses {st.prefetch_misses}, markers wrong {state['bad']} of "
          f"{state['checked']}")
    if args.no_instrument:
        print(f"Command: {' '.join([os.path.relpath(sys.executable)] + sys.argv)}")
        return 0
    print()
    print("| thread | phase | entry point | calls/record | µs/call (median) | p90 | max "
          "| µs/record |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    order = {"training thread": 0, "ssdtrain-store": 1, "ssdtrain-io (engine worker)": 2}
    phases = {"forward": 0, "wait": 1, "forward exit": 2, "backward": 3, "-": 4}
    for (th, ph, label), ds in sorted(CALLS.items(), key=lambda kv: (
            order.get(kv[0][0], 9), phases.get(kv[0][1], 9), -sum(kv[1]), -len(kv[1]))):
        timed = any(d > 0 for d in ds)
        q = sorted(ds)
        print(f"| {th} | {ph} | {label} | {len(ds) / n:.2f} | "
              f"{statistics.median(ds) * 1e6:.1f} | {q[int(0.9 * (len(q) - 1))] * 1e6:.0f} "
              f"| {q[-1] * 1e6:.0f} | " if timed else
              f"| {th} | {ph} | {label} | {len(ds) / n:.2f} | - | - | - | ", end="")
        print(f"{sum(ds) / n * 1e6:.1f} |" if timed else "- |")
    print()
    print(f"Command: {' '.join([os.path.relpath(sys.executable)] + sys.argv)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
