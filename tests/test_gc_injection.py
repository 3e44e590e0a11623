"""A garbage collection inside any locked region of the store must not deadlock it.

Bug hunted: ``ReadBuffers._give_back`` (the finalizer of a read-back storage) allocated
while holding the pool's non-reentrant lock. An allocation can start a cyclic garbage
collection; one that frees a read-back tensor held in a reference cycle runs that
tensor's finalizer, ``_give_back`` again, on the same thread: it blocks forever on
the lock its own thread holds. A plain training loop whose custom autograd Functions
keep a read-back saved tensor in a cycle (an exception caught in ``backward`` keeps
its frame, and with it the tensors) hung in 2 of 4 runs of ~600 steps with default
GC settings. The same hazard exists for every lock a finalizer may take.

Two tests, each in a child process with a timeout (a deadlock must fail the test,
not hang pytest; the child dumps every thread's stack before it is stopped):

* Forced GC in every locked region: each lock of the store modules reachable from
  the Offloader (``off._store._lock``, a read-buffer pool's lock, ...) is replaced by
  a wrapper that runs ``gc.collect()`` right after acquiring and right before
  releasing, and training steps run whose Functions put their read-back saved
  tensors in cycles. ``gc.callbacks`` count the collections that ran inside a locked
  region and collected something, so the test is not vacuous. Also with
  ``gc.set_threshold(1)``.
* A natural loop: 600 steps of the same model with no wrapper, default GC thresholds
  and low ones. Gradients exact at every step; no live record left after a
  collection (records must not grow step over step).

Run as a script (``python test_gc_injection.py locks|loop ...``) it is that child.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import os
import sys
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import inject
import ssdtrain

KiB = 1024
CONFIG = dict(min_tensor_bytes=1 * KiB, keep_tail_bytes=0, prefetch_bytes=64 * KiB,
              io_timeout_s=5, io_threads=2)
STORE_MODULES = tuple("ssdtrain." + name[:-3] for name in inject.STORE_MODULES)
_LOCK_TYPE = type(threading.Lock())


# ----------------------------------------------------------------------------- the model

class _Probe(Exception):
    """Raised and caught in backward, so that its traceback keeps backward's frame."""


class FrameCycle(torch.autograd.Function):
    """``x @ w`` whose backward catches an exception and stores it on ``ctx``: the
    traceback holds the frame, the frame holds ``ctx`` and the read-back ``x``. The
    graph node, its saved-tensor handles and ``x``'s storage are then freed only by
    the cyclic GC, on whatever thread and in whatever code it happens to run."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        try:
            raise _Probe("kept with its frame")
        except _Probe as e:
            ctx.error = e
        return g @ w.t(), x.t() @ g


def _leave_in_cycle(t):
    holder = [t]
    holder.append(holder)  # garbage once this returns: only the cyclic GC frees ``t``


class HolderCycle(torch.autograd.Function):
    """``(x * x) @ w``, saving ``x`` and ``sq = x * x`` (both offloaded). Backward leaves
    the read-back ``x`` in a reference cycle and drops ``sq`` by reference count as it
    returns: freeing ``sq``'s read buffer runs its finalizer (``_give_back``) while the
    cycle holding ``x``'s read buffer is pending garbage. A collection inside that
    finalizer's locked region then runs ``x``'s finalizer on the same thread."""

    @staticmethod
    def forward(ctx, x, w):
        sq = x * x
        ctx.save_for_backward(x, sq, w)
        return sq @ w

    @staticmethod
    def backward(ctx, g):
        x, sq, w = ctx.saved_tensors
        gx = (g @ w.t()) * 2 * x
        gw = sq.t() @ g
        _leave_in_cycle(x)
        return gx, gw


class CyclicNet(nn.Module):
    """``HolderCycle``, GELU, ``FrameCycle``; MSE loss. Activations 8 KiB (batch 32,
    width 64): every one is offloaded and read back."""

    def __init__(self, d=64):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1234)
            self.w1 = nn.Parameter(torch.randn(d, d) / d)
            self.w2 = nn.Parameter(torch.randn(d, d) / d ** 0.5)

    def forward(self, x, y):
        h = F.gelu(HolderCycle.apply(x, self.w1))
        return F.mse_loss(FrameCycle.apply(h * 1.5, self.w2), y)


def _inputs(n=4, batch=32, d=64):
    g = torch.Generator().manual_seed(4321)
    return [(torch.randn(batch, d, generator=g), torch.randn(batch, d, generator=g))
            for _ in range(n)]


def _step(model, inputs, off):
    model.zero_grad(set_to_none=True)
    with off if off is not None else _null():
        loss = model(*inputs)
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


# ----------------------------------------------------------------------------- GC in locks

class GCLock:
    """A non-reentrant lock (wrapping a real one) that runs ``gc.collect()`` right after
    acquiring and right before releasing: a collection in every locked region, at the
    worst moments. ``depth`` (per thread) says whether this thread is inside one of
    these regions, for :class:`GCInLocks`' count."""

    held = threading.local()

    def __init__(self, name, inner):
        self.name, self._inner = name, inner

    def acquire(self, blocking=True, timeout=-1):
        ok = self._inner.acquire(blocking, timeout)
        if ok:
            stack = GCLock.held.__dict__.setdefault("names", [])
            stack.append(self.name)
            gc.collect()
        return ok

    def release(self):
        gc.collect()
        stack = GCLock.held.__dict__.setdefault("names", [])
        if stack and stack[-1] == self.name:
            stack.pop()
        elif self.name in stack:
            stack.remove(self.name)
        self._inner.release()

    def locked(self):
        return self._inner.locked()

    __enter__ = acquire

    def __exit__(self, *exc):
        self.release()
        return False


class GCInLocks:
    """Installs :class:`GCLock` for every lock of the store modules reachable from an
    Offloader, and counts (``gc.callbacks``) the collections that ran inside them.

    Locks are found on the store and on the objects it holds (depth 2) whose class
    comes from a store module; a ``threading.Condition`` over a replaced lock is
    rebuilt over the wrapper, so waiting and notifying still use the one lock.
    """

    def __init__(self, off):
        self.locks = {}
        self.inside = {}          # lock name -> collections run while it was held
        self.inside_found = {}    # lock name -> of those, collections that freed objects
        self._current = threading.local()
        self._wrap(off._store, "Store", depth=2)
        gc.callbacks.append(self._on_gc)

    def _wrap(self, obj, label, depth):
        attrs = getattr(obj, "__dict__", None)
        if attrs is None:
            return
        replaced = {}
        for name, value in list(attrs.items()):
            if type(value) is _LOCK_TYPE:
                lock = GCLock(f"{label}.{name}", value)
                setattr(obj, name, lock)
                replaced[id(value)] = lock
                self.locks[lock.name] = lock
        for name, value in list(attrs.items()):
            if isinstance(value, threading.Condition) and id(value._lock) in replaced:
                setattr(obj, name, threading.Condition(replaced[id(value._lock)]))
        if depth > 1:
            for name, value in list(attrs.items()):
                if type(value).__module__ in STORE_MODULES and not isinstance(value, type):
                    self._wrap(value, f"{label}.{name}", depth - 1)

    def _on_gc(self, phase, info):
        names = GCLock.held.__dict__.get("names") or []
        if phase == "start":
            self._current.names = list(names)
        elif phase == "stop":
            for name in getattr(self._current, "names", ()):
                self.inside[name] = self.inside.get(name, 0) + 1
                if info.get("collected", 0):
                    self.inside_found[name] = self.inside_found.get(name, 0) + 1

    def remove(self):
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)


# ----------------------------------------------------------------------------- child

def _child(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("locks", "loop"))
    parser.add_argument("--engine", default="posix")
    parser.add_argument("--threshold", default="default")  # "default" or "a,b,c"
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--spill", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--hang-s", type=float, default=60)
    args = parser.parse_args(argv)
    faulthandler.dump_traceback_later(args.hang_s, exit=True)
    out = open(args.out, "a")

    def write(kind, **data):
        out.write(json.dumps(dict(data, kind=kind)) + "\n")
        out.flush()

    torch.set_num_threads(1)
    model, batches = CyclicNet(), _inputs()
    reference = [_step(model, b, None) for b in batches]
    gc.collect()
    gc.freeze()  # keep each forced collection cheap: only new objects are scanned
    off = ssdtrain.Offloader(ssdtrain.OffloadConfig(spill_dir=args.spill, engine=args.engine,
                                                    **CONFIG))
    counter = GCInLocks(off) if args.mode == "locks" else None
    if args.threshold != "default":
        gc.set_threshold(*(int(v) for v in args.threshold.split(",")))
    wrong, max_live, t0 = [], 0, time.monotonic()
    for i in range(args.steps):
        grads = _step(model, batches[i % len(batches)], off)
        for p, g, r in zip(("w1", "w2"), grads, reference[i % len(batches)]):
            if not torch.equal(g, r) and len(wrong) < 5:
                wrong.append(f"step {i}: gradient of {p} differs from the reference "
                             f"(max abs diff {(g - r).abs().max().item():.3g})")
        if (i + 1) % 50 == 0:
            write("progress", steps=i + 1, seconds=round(time.monotonic() - t0, 2))
        if (i + 1) % 100 == 0:
            gc.collect()
            max_live = max(max_live, off.live_records())
    gc.set_threshold(700, 10, 10)
    gc.collect()
    stats = off.stats()
    result = dict(steps=args.steps, wrong=wrong, max_live_after_gc=max_live,
                  live=off.live_records(), resident=off.resident_bytes(),
                  spill=off.spill_bytes_in_use(),
                  quarantined=getattr(stats, "quarantined_bytes", 0) or 0,
                  records_read=stats.records_read, prefetch_hits=stats.prefetch_hits,
                  seconds=round(time.monotonic() - t0, 2))
    if counter is not None:
        counter.remove()
        result.update(locks=sorted(counter.locks), inside=counter.inside,
                      inside_found=counter.inside_found)
    check = getattr(off._store, "check_invariants", None)
    if check is not None:
        try:
            check()
        except AssertionError as e:
            result["invariants"] = str(e)
    result["close"] = inject.bounded_call(off.close, CONFIG["io_timeout_s"] + 5, "close()")
    write("result", **result)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # a broken store may have left a thread blocked: do not wait for it


# ----------------------------------------------------------------------------- tests

def _run(mode, spill_dir, *, engine="posix", threshold="default", steps, timeout):
    records, rc, tail = inject.run_child(
        [os.path.abspath(__file__), mode, "--engine", engine, "--threshold", threshold,
         "--steps", str(steps), "--spill", str(spill_dir), "--hang-s", str(timeout - 10)],
        timeout)
    progress = [r["steps"] for r in records if r["kind"] == "progress"]
    result = [r for r in records if r["kind"] == "result"]
    where = f"[{mode}, engine {engine}, gc threshold {threshold}]"
    if not result:
        pytest.fail(f"{where} the child did not finish: exit {rc} "
                    f"({'timed out' if rc is None else 'ended'}; last progress: "
                    f"{progress[-1] if progress else 0} of {steps} steps). A deadlock: see "
                    f"the stacks below.\n{tail}", pytrace=False)
    r = result[0]
    print(where, {k: v for k, v in r.items() if k != "wrong"})
    problems = list(r["wrong"])
    if r["live"] or r["resident"] or r["spill"] > r["quarantined"]:
        problems.append(f"after the last step and gc.collect(): {r['live']} live records, "
                        f"{r['resident']} resident bytes, {r['spill']} spill bytes in use "
                        f"(quarantined {r['quarantined']}); expected none")
    if r["max_live_after_gc"]:
        problems.append(f"{r['max_live_after_gc']} records live after gc.collect() between "
                        f"steps (every graph was gone): records leak step over step")
    if r.get("invariants"):
        problems.append(f"check_invariants: {r['invariants']}")
    if r["close"]:
        problems.append(f"close: {r['close']}")
    assert not problems, where + "\n" + "\n".join(problems)
    assert r["records_read"] > 0, f"{where} nothing was read back: the test is vacuous"
    return r


@pytest.mark.parametrize("threshold", ["default", "1,1,1"])
def test_gc_inside_every_locked_region(spill_dir, threshold):
    """Forced ``gc.collect()`` after each acquire and before each release of every store
    lock, while read-back saved tensors die in reference cycles: no deadlock, exact
    gradients, nothing left; collections really ran inside locked regions and freed
    objects there."""
    r = _run("locks", spill_dir, threshold=threshold, steps=60, timeout=90)
    assert r["locks"], "no lock of the store modules was found to wrap"
    assert any(r["inside_found"].values()), \
        f"no collection inside a locked region freed anything: {r['inside']} (vacuous)"


@pytest.mark.parametrize("threshold", ["default", "10,2,2"])
def test_natural_loop_with_cyclic_saved_tensors(spill_dir, threshold):
    """600 steps of a loop whose Functions leave read-back saved tensors in reference
    cycles, with default GC thresholds and low ones, no forced collection: no
    deadlock, exact gradients, no records left after a collection."""
    _run("loop", spill_dir, threshold=threshold, steps=600, timeout=120)


if __name__ == "__main__":
    _child(sys.argv[1:])
