#!/usr/bin/env python
"""What ssdtrain costs a training thread that launches kernels: added µs per saved tensor.

On a GPU host the training thread's one job is to launch kernels ahead of the GPU; a
microsecond it loses to ssdtrain may be a microsecond the GPU sits idle. Pack and unpack
are cheap (``hook_cost.py``), but ssdtrain's other threads (the store's I/O thread, the
engine's completion callbacks) run Python too, and each time the training thread lets go
of the GIL (every torch op does, as a CUDA launch does) one of them may take it, and the
training thread waits until it is given back. This benchmark measures that as a new user
would: the same launch-like loop with and without ssdtrain, timed on the training thread.

The loop (NOTE [ Launch-like loop ]): a chain of ``--count`` custom autograd Functions
per step, each running a *launch block* (``--launch-us`` of tiny torch ops on a 4-element
tensor, each releasing and retaking the GIL, as a kernel launch does; optionally with
``--gil-held`` of the block spent in pure-Python busy work that holds the GIL, as
``accel_emulator.py``'s launch spin does) and then saving one fresh tensor of the record
size. Backward unpacks each saved tensor, checks its first and last 8 bytes (a marker
unique to the step and the op; ssdtrain's CRC32C checks the rest), and runs the same
launch block. The number of ops (and busy iterations) per block is calibrated once, at
the start, and is then the same for every mode: a mode that takes longer lost the time.

Saved tensors are "fresh" as on an accelerator's caching allocator: each op saves a new
storage (``torch.frombuffer`` over pre-faulted memory of a pool reused across steps), so
no page faults or fills of the record's bytes run in the step, and freeing it costs
nothing (NOTE [ Fresh tensors ]).

Modes, interleaved in one process (the order rotates each round; ``--rounds`` measured
rounds after ``--warmup`` rounds):

* ``none``: no hooks: the reference.
* ``identity``: ``saved_tensors_hooks`` that return their argument (the floor of having
  hooks at all).
* ``handoff``: hooks that return their argument and wake a Python thread that does
  nothing (a ``SimpleQueue.put``, as ssdtrain's hooks wake its I/O thread): the price of
  one foreign GIL acquisition per pack and per unpack on this machine, the yardstick for
  the rest.
* ``static``: ``policy="static"``, ``keep_tail_bytes=0`` (every record is written as soon
  as it is saved), ssdtrain's defaults otherwise (``prefetch_bytes``: at least the step's
  bytes under ``--reads before``, or ``--prefetch-records`` records), ``--engine``.
  Every record is written and read back (NOTE [ Read back ]): the second table shows
  ``records_written`` and ``records_read`` per step, each equal to the saves per step,
  and the prefetch hits and misses.
* ``callbacks``: ``static`` with the engine swapped (``wrap_engine``) for a native engine
  whose workers settle each future as its request ends: the data path before NOTE
  [ Polled completions ] (ssdtrain/io/base.py), measured beside the new one.
* ``default``: ``Offloader(spill_dir=..., engine=...)`` and nothing else
  (``policy="auto"``), as a user gets it; its steps are timed by a clock that runs only
  during its own steps (``tools.set_auto_clock``). What it offloads per step is in the
  second table (on a machine where the disk cannot keep up with the loop, little or
  nothing).

NOTE [ Read back ]: a record whose write is still in flight when forward ends is not
read back (prefetch claims it and keeps its bytes). So that every record is read, the
static mode's forward waits for its writes (``Offloader.wait()``) after its last save
and before leaving ``with offloader:``; that wait is not timed (the loop before it and
the exit after it are). The exit then starts the first prefetch window's reads, as it
does in any run whose writes kept up. With ``--reads before`` (the default) the window
holds the whole step and an untimed wait lets every read land before backward: backward
then finds every record in memory (a prefetch hit), at every record size, and what the
reads cost the training thread falls in that wait (the second table's CPU columns show
it). With ``--reads overlap`` (``prefetch_bytes`` as configured) backward follows at
once, and the reads beyond the first window run during it, as prefetch does: their
completions land in backward's time, and where the disk is slower than the loop
(records of MiBs against 0.5 ms blocks here) backward waits for them, shown apart as
the stall. Every ssdtrain step ends with
an untimed ``wait()`` too, so that no mode's I/O runs into another's step. Under
``--reads overlap`` and the writes' wait, the completions of writes the disk had not
finished by the loop's end land in the untimed wait as well: the per-thread CPU
columns say how much of each thread's work per record fell outside the timed parts.

Per (record size, ``--gil-held``, mode): the added µs per saved tensor in forward and in
backward (the mode's time minus ``none``'s in the same round, divided by the saves per
step; median and [min, max] over rounds), the part of it inside pack / unpack
(``ssdtrain.tools.HookTimer``: mean per call) and in entering and leaving ``with
offloader:``, the rest ("elsewhere": waiting for the GIL or a core, or running slower),
backward's stall on reads (``Stats.stall_seconds``) and the added time net of it; the
training thread's added off-CPU time (wall minus its own CPU time, ``time.thread_time``:
the time it waited); its voluntary context switches per saved tensor (each a wait: for
the GIL, a lock or a read; ``/proc/self/task/*/status``); and the CPU time of
ssdtrain's threads per saved tensor in forward, in the untimed wait and forward's exit,
and in backward (``/proc/self/task/*/schedstat``, by thread name: ``ssdtrain-store``,
the store's I/O thread; ``ssdtrain-io``, the native engine's workers, whose CPU includes
the system calls and CRC32C they run without the GIL). Every raw number per step is in
the JSON (``--json``).

This is a benchmark, not a test: nothing here asserts a timing. The targets (at most
20 µs per saved tensor added to forward and to backward, static, every record written
and read back) are printed with whether they were met. Run it on a quiet machine: the
JSON records the load average and, per step, the share of the CPUs other processes took.

Example::

    PYTHONPATH=. .venv/bin/python benchmarks/launch_loop.py --gil-held 0 0.5   # ~2 min here
    PYTHONPATH=. .venv/bin/python benchmarks/launch_loop.py --tiny          # seconds (the tests)
    PYTHONPATH=. .venv/bin/python benchmarks/launch_loop.py --sizes 256KiB --modes none static \\
        --gil-held 0 0.5 --engine posix --rounds 15
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import gc
import os
import platform
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for _common, however run
from _common import (command_line, finish, md_table, median, mount_of, progress,  # noqa: E402
                     work_dir)
from hook_cost import parse_size, size_text  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_JSON = os.path.join(REPO_ROOT, "benchmarks", "results", "launch_loop.json")
KiB, MiB = 1 << 10, 1 << 20
MODES = ("none", "identity", "handoff", "static", "callbacks", "default")
SIZES = (256 * KiB, 4 * MiB, 64 * MiB)
TINY_SIZES = (256 * KiB, 1 * MiB)
TARGET_US = 20.0  # added per saved tensor, forward and backward (static)

_INT64 = ctypes.c_int64


# NOTE [ Launch-like loop ]
# A launch block is ``n_ops`` in-place adds on a 4-element tensor (each a torch op: the
# Python binding lets go of the GIL around the kernel and takes it back, as a CUDA
# launch's does), each followed by ``spin`` iterations of an empty Python loop (the GIL
# held throughout, as Python-side framework code around a launch holds it). Both counts
# are calibrated once (``calibrate``) and then fixed: the work is the same in every mode,
# so whatever a mode adds to the loop's wall time is time the thread lost.
class Launcher:
    """One launch block: ``n_ops`` tiny torch ops, each followed by ``spin`` busy
    iterations."""

    def __init__(self, n_ops, spin):
        import torch
        self.n_ops, self.spin = n_ops, spin
        self.scratch = torch.zeros(4)

    def __call__(self):
        s, spin = self.scratch, self.spin
        if spin:
            for _ in range(self.n_ops):
                s.add_(1.0)
                for _ in range(spin):
                    pass
        else:
            for _ in range(self.n_ops):
                s.add_(1.0)


def calibrate(launch_us, gil_held, samples=7):
    """``(n_ops, spin, detail)`` for a block of ``launch_us`` of which ``gil_held`` is pure
    Python busy work: the medians of ``samples`` timings of each part, on this thread."""
    import torch
    s = torch.zeros(4)
    per_op, per_it = [], []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(2000):
            s.add_(1.0)
        per_op.append((time.perf_counter() - t0) / 2000)
        t0 = time.perf_counter()
        for _ in range(200000):
            pass
        per_it.append((time.perf_counter() - t0) / 200000)
    op_s, it_s = statistics.median(per_op), statistics.median(per_it)
    block = launch_us * 1e-6
    n_ops = max(1, round((1.0 - gil_held) * block / op_s))
    spin = max(0, round(gil_held * block / (n_ops * it_s))) if gil_held > 0 else 0
    return n_ops, spin, {"op_us": op_s * 1e6, "busy_iteration_ns": it_s * 1e9,
                         "n_ops": n_ops, "spin_per_op": spin,
                         "predicted_block_us": (n_ops * op_s + n_ops * spin * it_s) * 1e6}


def make_op(state):
    """The op of the loop: ``Op.apply(y, x, uid)`` launches, saves ``x``, returns a copy of
    ``y``; its backward unpacks ``x``, checks its markers (``uid``) and launches."""
    import torch

    class Op(torch.autograd.Function):
        @staticmethod
        def forward(ctx, y, x, uid):
            state["launch"]()
            ctx.save_for_backward(x)
            ctx.uid = uid
            return y.clone()

        @staticmethod
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            p, n = x.data_ptr(), x.numel() * x.element_size()
            if _INT64.from_address(p).value != ctx.uid or \
                    _INT64.from_address(p + n - 8).value != ctx.uid:
                state["bad"] += 1
            state["checked"] += 1
            state["launch"]()
            return grad, None, None

    return Op


# NOTE [ Fresh tensors ]
# Each op saves a new storage (its own StorageImpl, so ssdtrain makes a record of it and
# never deduplicates it into another) over memory of a pool made once per record size and
# pre-faulted: as device memory comes from a caching allocator, the step neither faults
# pages in nor frees them (freeing 64 MiB of host memory costs milliseconds of kernel time
# in munmap, which a GPU's saved tensors never cost). The pool is reused across steps; each
# ssdtrain step ends with Offloader.wait(), so no request still reads it when the next
# step writes its markers.
class Pool:
    def __init__(self, size, count):
        import torch
        self.size, self.count = size, count
        self.base = torch.empty(size * count, dtype=torch.uint8)
        self.base.fill_(1)  # fault every page in now
        self.addrs = [self.base.data_ptr() + i * size for i in range(count)]
        self.kind = ctypes.c_char * size

    def fresh(self, uid0):
        """``count`` new storages over the pool, the k-th marked with ``uid0 + k`` in its
        first and last 8 bytes."""
        import torch
        out = []
        for k, addr in enumerate(self.addrs):
            _INT64.from_address(addr).value = uid0 + k
            _INT64.from_address(addr + self.size - 8).value = uid0 + k
            out.append(torch.frombuffer(self.kind.from_address(addr), dtype=torch.uint8))
        return out


# ------------------------------------------------------------------ threads and CPU
def thread_cpu_ns():
    """``{tid: (name, on-CPU ns, voluntary switches, involuntary switches)}`` for every
    thread of this process (``schedstat``: ns; ``status``: context switches; a thread
    that waits for the GIL, a lock or I/O switches voluntarily)."""
    out = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
            vol = invol = 0
            with open(f"/proc/self/task/{tid}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches"):
                        vol = int(line.split()[1])
                    elif line.startswith("nonvoluntary_ctxt_switches"):
                        invol = int(line.split()[1])
        except (OSError, ValueError, IndexError):
            continue
        out[int(tid)] = (name, ns, vol, invol)
    return out


GROUPS = ("main", "ssdtrain-store", "ssdtrain-io", "ssdtrain-other", "other")


def cpu_by_group(before, after, main_tid):
    """Per thread group between two :func:`thread_cpu_ns` snapshots: CPU seconds, and
    voluntary / involuntary context switches (``{group}_vcs``, ``{group}_ics``). Groups:
    ``main`` (the training thread), ``ssdtrain-store`` (the store's I/O thread),
    ``ssdtrain-io`` (the native engine's workers), other ``ssdtrain-*`` threads, and
    ``other`` (torch's pool and the rest)."""
    groups = {}
    for g in GROUPS:
        groups[g] = 0.0
        groups[f"{g}_vcs"] = groups[f"{g}_ics"] = 0
    for tid, (name, ns, vol, invol) in after.items():
        _, ns0, vol0, invol0 = before.get(tid, (name, 0, 0, 0))
        if tid == main_tid:
            g = "main"
        elif name in ("ssdtrain-store", "ssdtrain-io"):
            g = name
        elif name.startswith("ssdtrain"):
            g = "ssdtrain-other"
        else:
            g = "other"
        groups[g] += (ns - ns0) / 1e9
        groups[f"{g}_vcs"] += vol - vol0
        groups[f"{g}_ics"] += invol - invol0
    return groups


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def machine_busy_s():
    """CPU seconds the whole machine spent busy so far (``/proc/stat``; 0.0 if unknown)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / _CLK_TCK


def own_cpu_s():
    t = os.times()
    return t.user + t.system


# ------------------------------------------------------------------------- a mode
class StepClock:
    """A clock that runs only during one mode's own steps (``tools.set_auto_clock``:
    ``policy="auto"`` measures a step from one forward to the next, and here the other
    modes' steps come between)."""

    def __init__(self):
        self.total, self.since = 0.0, None

    def resume(self):
        self.since = time.perf_counter()

    def pause(self):
        if self.since is not None:
            self.total += time.perf_counter() - self.since
            self.since = None

    def __call__(self):
        return self.total + (time.perf_counter() - self.since if self.since is not None else 0.0)


class Handoff:
    """The ``handoff`` mode's hooks: each pack and unpack wakes a Python thread (a
    ``SimpleQueue.put``, as ssdtrain's hooks wake its I/O thread) that does nothing but
    wait for the next wake: what one foreign GIL acquisition per saved tensor costs the
    loop on this machine, with no work done while it holds the GIL."""

    def __init__(self):
        import queue
        import threading
        self.kicks = queue.SimpleQueue()
        self.wakes = 0
        self.thread = threading.Thread(target=self._work, name="handoff", daemon=True)
        self.thread.start()

    def _work(self):
        get = self.kicks.get
        while get() is not None:
            self.wakes += 1

    def pack(self, t):
        self.kicks.put(True)
        return t

    def unpack(self, t):
        self.kicks.put(True)
        return t

    def close(self):
        self.kicks.put(None)
        self.thread.join()


def make_mode(mode, size, count, args, spill_dir):
    """``{"mode", "off", "clock", "handoff"}``: the offloader (None but for static and
    default), the handoff mode's thread."""
    import ssdtrain
    from ssdtrain import tools
    off = clock = None
    if mode == "handoff":
        return {"mode": mode, "off": None, "clock": None, "handoff": Handoff(),
                "reads_before": False}
    if mode in ("static", "callbacks"):
        extra = {}
        if args.prefetch_records is not None:
            extra["prefetch_bytes"] = args.prefetch_records * size
        elif args.reads == "before":  # the window holds the step: every read before backward
            extra["prefetch_bytes"] = max(count * size, ssdtrain.OffloadConfig().prefetch_bytes)
        off = ssdtrain.Offloader(spill_dir=spill_dir, policy="static", keep_tail_bytes=0,
                                 engine=args.engine, **extra)
        if mode == "callbacks":
            off.wrap_engine(functools.partial(callback_engine, off.config))
    elif mode == "default":
        off = ssdtrain.Offloader(spill_dir=spill_dir, engine=args.engine)
        if off.config.policy == "auto":
            clock = StepClock()
            tools.set_auto_clock(off, clock)
    return {"mode": mode, "off": off, "clock": clock, "handoff": None,
            "reads_before": mode in ("static", "callbacks") and args.reads == "before"}


def callback_engine(config, engine):
    """The ``callbacks`` mode's engine, in place of ``engine`` (shut down): the same one,
    but each request's future settled by a worker as the request ends, as before NOTE
    [ Polled completions ] (ssdtrain/io/base.py); the posix engine is always so."""
    from ssdtrain.io.native import NativeEngine
    if engine.poller is None:
        return engine
    engine.shutdown()
    return NativeEngine(io_threads=config.io_threads, chunk_bytes=config.io_chunk_bytes)


def _identity(t):
    return t


def one_step(m, pool, Op, state, uid0):
    """One step of mode ``m``: forward (timed), the wait for ssdtrain's I/O (untimed),
    backward (timed), the wait again. Every number of the step."""
    import torch
    import ssdtrain
    from ssdtrain import tools
    mode, off, clock = m["mode"], m["off"], m["clock"]
    count = pool.count
    xs = pool.fresh(uid0)
    xs.reverse()  # popped in save order
    state["bad"] = state["checked"] = 0
    wakes0 = m["handoff"].wakes if m["handoff"] is not None else 0
    gc.collect()
    gc.disable()  # a collection inside a timed window would land on one mode only
    main = threading_native_id()
    busy0, own0 = machine_busy_s(), own_cpu_s()
    before = off.stats() if off is not None else None
    if clock is not None:
        clock.resume()
    timer = None
    wait_inside = mode in ("static", "callbacks")  # every write lands before forward's end
    try:
        cpu0 = thread_cpu_ns()
        y = torch.zeros((), requires_grad=True)
        stack = contextlib.ExitStack()
        t0, c0 = time.perf_counter(), time.thread_time()
        with stack:
            if off is not None:
                stack.enter_context(off)
            elif mode == "identity":
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(_identity, _identity))
            elif mode == "handoff":
                h = m["handoff"]
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(h.pack, h.unpack))
            if mode != "none":
                timer = tools.HookTimer()
                try:
                    stack.enter_context(timer.wrap())
                except ssdtrain.SSDTrainError:  # a step of policy="auto" that pushes no hooks
                    timer = None
            ta = time.perf_counter()
            for i in range(count):
                y = Op.apply(y, xs.pop(), uid0 + i)
            tb, cb = time.perf_counter(), time.thread_time()
            cpu1 = thread_cpu_ns()
            mid = off.stats() if off is not None else None
            if wait_inside:
                off.wait()  # untimed
            tw, cw = time.perf_counter(), time.thread_time()
        t1, c1 = time.perf_counter(), time.thread_time()
        if m["reads_before"]:
            off.wait()  # untimed: the prefetch reads forward's exit started land now
        t1w = time.perf_counter()
        cpu2 = thread_cpu_ns()
        t2, c2 = time.perf_counter(), time.thread_time()
        y.backward()
        t3, c3 = time.perf_counter(), time.thread_time()
        cpu3 = thread_cpu_ns()
        del y
        if off is not None:
            off.wait()
        t4 = time.perf_counter()
        cpu4 = thread_cpu_ns()
    finally:
        if clock is not None:
            clock.pause()
        gc.enable()
    busy, own = machine_busy_s() - busy0, own_cpu_s() - own0
    wall = t4 - t0
    step = {
        "forward_s": (tb - t0) + (t1 - tw), "forward_cpu_s": (cb - c0) + (c1 - cw),
        "enter_s": ta - t0, "loop_s": tb - ta, "exit_s": t1 - tw,
        "wait_s": tw - tb, "wait_after_s": t1w - t1,
        "backward_s": t3 - t2, "backward_cpu_s": c3 - c2,
        "final_wait_s": t4 - t3,
        "bad_markers": state["bad"], "checked_markers": state["checked"],
        "cpu_forward": cpu_by_group(cpu0, cpu1, main),
        "cpu_wait": cpu_by_group(cpu1, cpu2, main),
        "cpu_backward": cpu_by_group(cpu2, cpu3, main),
        "cpu_final_wait": cpu_by_group(cpu3, cpu4, main),
        "other_cpu_share": min(1.0, max(0.0, busy - own) / (wall * (os.cpu_count() or 1)))
        if wall > 0 else 0.0,
    }
    if m["handoff"] is not None:
        step["handoff_wakes"] = m["handoff"].wakes - wakes0
    if timer is not None:
        step["pack_ns"] = list(timer.pack_ns)
        step["unpack_ns"] = list(timer.unpack_ns)
    if off is not None:
        after = off.stats()
        keep = ("records_written", "records_read", "prefetch_hits", "prefetch_misses",
                "forwarded", "bytes_written", "bytes_read", "offloaded_bytes", "kept_bytes",
                "stall_seconds", "write_stall_seconds", "unwritten_bytes")
        d = after.since(before)
        step["stats"] = {k: getattr(d, k) for k in keep}
        step["stats"]["records_written_in_loop"] = mid.records_written - before.records_written
        step["stats"]["offload_quota_bytes"] = after.offload_quota_bytes
        step["stats"]["engine"] = after.engine
    return step


def threading_native_id():
    import threading
    return threading.get_native_id()


# --------------------------------------------------------------------------- summary
def _spread(xs):
    return {"median": median(xs), "min": min(xs) if xs else float("nan"),
            "max": max(xs) if xs else float("nan")}


def summarize(runs, modes, count):
    """Per mode: added µs per saved tensor (paired with ``none`` in the same round)."""
    ref = runs["none"]
    out = {}
    for mode in modes:
        steps = runs[mode]
        s = {"forward_us_per_save": _spread([x["forward_s"] * 1e6 / count for x in steps]),
             "backward_us_per_save": _spread([x["backward_s"] * 1e6 / count for x in steps]),
             "bad_markers": sum(x["bad_markers"] for x in steps),
             "other_cpu_share": median([x["other_cpu_share"] for x in steps])}
        if mode != "none":
            fa = [(x["forward_s"] - r["forward_s"]) * 1e6 / count for x, r in zip(steps, ref)]
            ba = [(x["backward_s"] - r["backward_s"]) * 1e6 / count for x, r in zip(steps, ref)]
            off_f = [((x["forward_s"] - x["forward_cpu_s"]) - (r["forward_s"] - r["forward_cpu_s"]))
                     * 1e6 / count for x, r in zip(steps, ref)]
            off_b = [((x["backward_s"] - x["backward_cpu_s"]) -
                      (r["backward_s"] - r["backward_cpu_s"])) * 1e6 / count
                     for x, r in zip(steps, ref)]
            pack = [sum(x.get("pack_ns", [])) / 1e3 / count for x in steps]
            edge = [((x["enter_s"] + x["exit_s"]) - (r["enter_s"] + r["exit_s"])) * 1e6 / count
                    for x, r in zip(steps, ref)]
            unpack = [sum(x.get("unpack_ns", [])) / 1e3 / count for x in steps]
            stall = [x.get("stats", {}).get("stall_seconds", 0.0) * 1e6 / count for x in steps]
            net = [b - st for b, st in zip(ba, stall)]
            s.update(forward_added_us=_spread(fa), backward_added_us=_spread(ba),
                     forward_added_off_cpu_us=_spread(off_f),
                     backward_added_off_cpu_us=_spread(off_b),
                     pack_us_per_save=median(pack), unpack_us_per_save=median(unpack),
                     pack_us_median_call=median([median([n / 1e3 for n in x["pack_ns"]])
                                                 for x in steps if x.get("pack_ns")]),
                     unpack_us_median_call=median([median([n / 1e3 for n in x["unpack_ns"]])
                                                   for x in steps if x.get("unpack_ns")]),
                     enter_exit_added_us=median(edge),
                     forward_elsewhere_us=median(fa) - median(pack) - median(edge),
                     backward_elsewhere_us=median(ba) - median(unpack),
                     stall_us_per_save=median(stall),
                     backward_added_net_of_stall_us=_spread(net))
        for phase in ("forward", "wait", "backward", "final_wait"):
            for group in GROUPS:
                s[f"cpu_{phase}_{group}_us_per_save"] = median(
                    [x[f"cpu_{phase}"][group] * 1e6 / count for x in steps])
                for kind in ("vcs", "ics"):
                    s[f"{kind}_{phase}_{group}_per_save"] = median(
                        [x[f"cpu_{phase}"][f"{group}_{kind}"] / count for x in steps])
        if steps and "stats" in steps[0]:
            s["stats_per_step"] = {k: median([x["stats"][k] for x in steps])
                                   for k in steps[0]["stats"]
                                   if k not in ("engine", "offload_quota_bytes")}
            s["offload_quota_bytes"] = [x["stats"]["offload_quota_bytes"] for x in steps]
            s["engine"] = steps[0]["stats"]["engine"]
        out[mode] = s
    return out


def measure(args, spill_dir, write, update):
    """Every (size, gil_held): calibrate, build the modes, run warm-up and measured rounds
    interleaved. Returns the list of result blocks."""
    import torch
    state = {"launch": None, "bad": 0, "checked": 0}
    Op = make_op(state)
    blocks = []
    for size in args.sizes:
        count = args.count or max(2, min(64, int(args.step_mib * MiB) // size))
        pool = Pool(size, count)
        for held in args.gil_held:
            n_ops, spin, cal = calibrate(args.launch_us, held)
            state["launch"] = Launcher(n_ops, spin)
            modes = [make_mode(m, size, count, args, spill_dir) for m in args.modes]
            runs = {m["mode"]: [] for m in modes}
            uid = 1 << 40
            try:
                for r in range(args.warmup + args.rounds):
                    k = r % len(modes)
                    for m in modes[k:] + modes[:k]:
                        uid += count
                        step = one_step(m, pool, Op, state, uid)
                        step["round"] = r
                        if r >= args.warmup:
                            runs[m["mode"]].append(step)
                    update()
                    write(f"{size_text(size)} gil_held {held:g}: round {r + 1}/"
                          f"{args.warmup + args.rounds}" + (" (warm-up)" if r < args.warmup
                                                           else ""))
            finally:
                configs = {}
                for m in modes:
                    if m["handoff"] is not None:
                        m["handoff"].close()
                    if m["off"] is not None:
                        configs[m["mode"]] = {
                            "policy": m["off"].config.policy,
                            "engine": m["off"].config.engine,
                            "keep_tail_bytes": m["off"].config.keep_tail_bytes,
                            "prefetch_bytes": m["off"].config.prefetch_bytes,
                            "write_behind_bytes": m["off"].config.write_behind_bytes,
                            "min_tensor_bytes": m["off"].config.min_tensor_bytes,
                            "verify": m["off"].config.verify}
                        m["off"].close()
            blocks.append({"size": size, "count": count, "gil_held": held, "calibration": cal,
                           "configs": configs, "runs": runs,
                           "summary": summarize(runs, args.modes, count)})
        del pool
        gc.collect()
    return blocks


# ---------------------------------------------------------------------------- output
def _fmt(s, digits=0):
    if s is None:
        return "-"
    if isinstance(s, dict):
        return (f"{s['median']:.{digits}f} [{s['min']:.{digits}f}, {s['max']:.{digits}f}]")
    return f"{s:.{digits}f}"


def render(blocks, modes):
    rows = []
    for b in blocks:
        for mode in modes:
            s = b["summary"][mode]
            head = [size_text(b["size"]), f"{b['gil_held']:g}", mode]
            if mode == "none":
                rows.append(head + [f"({s['forward_us_per_save']['median']:.0f} µs/save)"]
                            + ["-"] * 4
                            + [f"({s['backward_us_per_save']['median']:.0f} µs/save)"]
                            + ["-"] * 4)
                continue
            rows.append(head + [
                _fmt(s["forward_added_us"]), f"{s['pack_us_per_save']:.1f}",
                f"{s['enter_exit_added_us']:.0f}", f"{s['forward_elsewhere_us']:.0f}",
                _fmt(s["forward_added_off_cpu_us"]["median"]), _fmt(s["backward_added_us"]),
                f"{s['unpack_us_per_save']:.1f}", f"{s['stall_us_per_save']:.0f}",
                _fmt(s["backward_added_net_of_stall_us"]),
                _fmt(s["backward_added_off_cpu_us"]["median"])])
    return md_table(["size>", "GIL-held>", "mode", "fwd added µs/save [min, max]>", "in pack>",
                     "in enter+exit>", "elsewhere>", "off-CPU>", "bwd added µs/save [min, max]>",
                     "in unpack>", "stall on reads>", "net of stall>", "off-CPU>"], rows)


def render_io(blocks):
    rows = []
    for b in blocks:
        for mode, s in b["summary"].items():
            st = s.get("stats_per_step")

            def cpu(group):
                return " / ".join(f"{s[f'cpu_{p}_{group}_us_per_save']:.0f}"
                                  for p in ("forward", "wait", "backward"))

            def switches(phase):
                return (f"{s[f'vcs_{phase}_main_per_save']:.2f} / "
                        f"{s[f'ics_{phase}_main_per_save']:.2f}")
            if st is None:
                io = ["-"] * 4
            else:
                io = [f"{st['records_written']:.0f} ({st['records_written_in_loop']:.0f})",
                      f"{st['records_read']:.0f}",
                      f"{st['prefetch_hits']:.0f} / {st['prefetch_misses']:.0f}",
                      f"{st['forwarded']:.0f}"]
            rows.append([size_text(b["size"]), f"{b['gil_held']:g}", mode, b["count"]] + io +
                        [cpu("ssdtrain-store"), cpu("ssdtrain-io"), switches("forward"),
                         switches("backward"), s["bad_markers"]])
    return md_table(["size>", "GIL-held>", "mode", "saves/step>", "written/step (in the loop)>",
                     "read/step>", "prefetch hits / misses>", "forwarded>",
                     "store thread CPU µs/save (fwd / wait / bwd)>",
                     "io workers CPU µs/save (fwd / wait / bwd)>",
                     "training thread switches/save, fwd (vol / invol)>",
                     "bwd (vol / invol)>", "markers wrong>"], rows)


def targets(blocks):
    out = []
    for b in blocks:
        s = b["summary"].get("static")
        if s is None:
            continue
        st = s.get("stats_per_step", {})
        every = st.get("records_written") == b["count"] and st.get("records_read") == b["count"]
        for phase in ("forward", "backward"):
            v = s[f"{phase}_added_us"]["median"]
            out.append({"name": f"static, {size_text(b['size'])}, GIL-held {b['gil_held']:g}: "
                                f"{phase} added <= {TARGET_US:g} µs per saved tensor"
                                + ("" if every else " (NOT every record written and read)"),
                        "value": round(v, 1), "met": bool(v <= TARGET_US and every)})
    return out


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", type=parse_size,
                   help="record sizes (default 256KiB 4MiB 64MiB)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                   help="modes to run (none always runs: it is the reference)")
    p.add_argument("--launch-us", type=float, default=500.0,
                   help="the launch block between saves (and per unpack), µs (default 500)")
    p.add_argument("--gil-held", nargs="+", type=float, default=[0.0],
                   help="share(s) of each launch block spent in pure-Python busy work that "
                        "holds the GIL (0..0.95; default 0; e.g. 0 0.5)")
    p.add_argument("--count", type=int, default=None,
                   help="saves per step (default: 64, fewer where 64 records exceed --step-mib)")
    p.add_argument("--step-mib", type=float, default=768,
                   help="most bytes of records per step when --count is not given (default 768: "
                        "below write_behind_bytes, so static's forward never waits for the disk)")
    p.add_argument("--rounds", type=int, default=7, help="measured rounds (default 7)")
    p.add_argument("--warmup", type=int, default=3,
                   help="unmeasured rounds first (default 3: policy='auto' sizes the step, "
                        "then runs two baseline steps)")
    p.add_argument("--prefetch-records", type=int, default=None,
                   help="static's prefetch_bytes in records (default: ssdtrain's default "
                        "prefetch_bytes). Every record is read back either way: the writes "
                        "land before forward ends (NOTE [ Read back ])")
    p.add_argument("--reads", choices=("before", "overlap"), default="before",
                   help="static's reads: 'before' (default): prefetch_bytes holds the step and "
                        "an untimed wait lets every read land before backward, which finds "
                        "every record in memory; 'overlap': forward's exit starts the first "
                        "prefetch window and the rest are read during backward, as prefetch "
                        "does (backward then waits where the disk is slower than the loop)")
    p.add_argument("--engine", choices=("native", "posix", "auto"), default="native",
                   help="OffloadConfig.engine for the ssdtrain modes (default native)")
    p.add_argument("--switch-interval-us", type=float, default=None,
                   help="sys.setswitchinterval for the run, µs (default: Python's, 5000)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: the launch thread's ops are tiny)")
    p.add_argument("--tiny", action="store_true",
                   help="a seconds-long run (the tests): 256 KiB and 1 MiB, 8 saves, 100 µs "
                        "blocks, GIL-held 0 and 0.5, 1 warm-up and 2 measured rounds")
    p.add_argument("--spill-dir", help="where records go (default: a fresh temporary "
                                       "directory, removed at the end)")
    p.add_argument("--json", default=DEFAULT_JSON,
                   help="where to write every number (default benchmarks/results/launch_loop.json)")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    given = set(a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:]))
    if args.tiny:
        args.sizes = args.sizes or list(TINY_SIZES)
        args.count = args.count or 8
        if "--launch-us" not in given:
            args.launch_us = 100.0
        if "--gil-held" not in given:
            args.gil_held = [0.0, 0.5]
        if "--rounds" not in given:
            args.rounds = 2
        if "--warmup" not in given:
            args.warmup = 1
    args.sizes = args.sizes or list(SIZES)
    if "none" not in args.modes:
        args.modes = ["none"] + list(args.modes)
    args.modes = [m for m in MODES if m in args.modes]
    if args.rounds < 1 or args.warmup < 0 or (args.count is not None and args.count < 2):
        raise SystemExit("launch_loop: --rounds >= 1, --warmup >= 0 and --count >= 2 please")
    if any(not 0.0 <= h <= 0.95 for h in args.gil_held):
        raise SystemExit("launch_loop: --gil-held takes shares in [0, 0.95]")
    import torch
    torch.set_num_threads(args.threads)
    if args.switch_interval_us is not None:
        sys.setswitchinterval(args.switch_interval_us * 1e-6)
    spill_dir, own = work_dir(args.spill_dir, "ssdtrain-launch-", "launch_loop", "--spill-dir")
    command = command_line()
    device, mount, fstype = mount_of(spill_dir)
    machine = {"cpu_count": os.cpu_count(), "python": platform.python_version(),
               "platform": platform.platform(), "torch": torch.__version__,
               "torch_threads": torch.get_num_threads(), "spill_dir": spill_dir,
               "spill_fs": fstype, "spill_device": device, "loadavg_start": os.getloadavg(),
               "switch_interval_s": sys.getswitchinterval()}
    update, write, close = progress(len(args.sizes) * len(args.gil_held) *
                                    (args.warmup + args.rounds), use_tqdm=False)
    t0 = time.perf_counter()
    try:
        blocks = measure(args, spill_dir, write, update)
    finally:
        close()
        if own:
            shutil.rmtree(spill_dir, ignore_errors=True)
    machine["loadavg_end"] = os.getloadavg()
    machine["run_s"] = time.perf_counter() - t0
    tg = targets(blocks)
    engine = next((s.get("engine") for b in blocks for s in b["summary"].values()
                   if s.get("engine")), args.engine)
    print(f"## launch_loop: added time per saved tensor on the training thread "
          f"({args.launch_us:g} µs launch blocks, engine {engine}, static reads {args.reads}, "
          f"{args.rounds} rounds)")
    print()
    print(render(blocks, args.modes))
    print()
    print("added = the mode's time minus none's in the same round, per saved tensor (median "
          "[min, max] over rounds; none's own time in parentheses); in pack / in unpack = time "
          "inside the hooks per saved tensor (HookTimer, mean); in enter+exit = added time of "
          "entering and leaving `with offloader:` per saved tensor; elsewhere = forward added "
          "minus both; off-CPU = added wall time minus the training thread's added CPU time "
          "(time it waited: for the GIL, a core, or a read); stall on reads = "
          "Stats.stall_seconds per saved tensor; net of stall = backward added minus it.")
    if True:
        print()
        print("### What ssdtrain did per step, and the threads (medians over rounds)")
        print()
        print(render_io(blocks))
        print()
        print("written (in the loop) = records whose write had landed when forward's loop "
              "ended; CPU of ssdtrain's threads per saved tensor in forward's loop, in the "
              "untimed waits (static: for the writes, and with --reads before for the reads) "
              "and forward's exit, and in backward "
              "(/proc/self/task/*/schedstat); training thread switches = its voluntary "
              "(it blocked: on the GIL, a lock or a read) and involuntary (preempted) context "
              "switches per saved tensor (/proc/self/task/*/status).")
    bad = sum(s["bad_markers"] for b in blocks for s in b["summary"].values())
    print()
    print(f"Machine: {machine['cpu_count']} CPUs, torch {machine['torch']} with "
          f"{machine['torch_threads']} threads, spill_dir on {fstype or '?'} ({device or '?'}), "
          f"load average {machine['loadavg_start'][0]:.2f} at start, "
          f"{machine['loadavg_end'][0]:.2f} at end, switch interval "
          f"{machine['switch_interval_s'] * 1e6:.0f} µs; median share of the CPUs other "
          f"processes took per step: "
          f"{median([s['other_cpu_share'] for b in blocks for s in b['summary'].values()]):.0%}")
    print(f"Command: {command}")
    if tg:
        print()
        print("Targets (reported, not asserted):")
        for t in tg:
            print(f"- {t['name']}: {t['value']} -> {'met' if t['met'] else 'NOT met'}")
    failed = [f"markers wrong in {bad} unpacks"] if bad else []
    return finish("launch_loop", args.json,
                  {"command": command, "machine": machine,
                   "settings": {"sizes": args.sizes, "modes": args.modes,
                                "launch_us": args.launch_us, "gil_held": args.gil_held,
                                "rounds": args.rounds, "warmup": args.warmup,
                                "prefetch_records": args.prefetch_records,
                                "engine": args.engine, "step_mib": args.step_mib,
                                "reads": args.reads,
                                "count": args.count, "threads": args.threads},
                   "blocks": blocks, "targets": tg}, failed)


if __name__ == "__main__":
    sys.exit(main())
