"""Fault injection for the store: a KeyboardInterrupt at a chosen line, and the checks after.

A Ctrl-C (SIGINT) raises KeyboardInterrupt on the training thread between any two
bytecodes, including inside ssdtrain's store while it holds its lock, has submitted
a request but not yet attached its completion callback, or runs a finalizer (where
Python swallows the exception). A training loop that catches KeyboardInterrupt at
the step level and goes on must find the store intact. This module replays one
small scenario under ``sys.settrace`` and raises KeyboardInterrupt at the ``k``-th
execution of one line of the store modules, then checks what a training loop would
rely on::

    sc = inject.Scenario()
    counts = inject.baseline(sc, lambda: inject.make_offloader(d))  # {(file, line): runs}
    for target in inject.targets(counts):                     # [(file, line, k, n)]
        outcome = inject.run_case(sc, inject.make_offloader(d), target)
        assert not outcome.failures, outcome.failures

Only the calling (training) thread is traced: a real SIGINT runs its handler on the
main thread only; engine completions on engine threads are never interrupted.

A broken store can leave its lock held or an engine thread blocked forever, and a
process with such a thread never exits (``concurrent.futures`` joins its workers at
exit). So tests run sweeps in child processes (:func:`sweep_in_children`; the child is
``python inject.py sweep ...``), which report each outcome as a JSON line as they go
and end with ``os._exit``; a case that may have left a thread stuck ends its child, and
the next child resumes after it. Inside a child every wait is bounded, so one broken
case fails alone: the training thread is woken by ``SIGALRM`` (a blocked
``Lock.acquire`` on the main thread is interrupted by signals), ``close()`` runs on a
helper thread joined with a timeout and, if stuck in Python code, is stopped with an
asynchronous exception, and a child stuck anyway dumps its stacks and exits at a
per-case timeout.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import dis
import faulthandler
import functools
import gc
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

import ssdtrain

__all__ = ["STORE_MODULES", "STEP_MODULES", "module_file", "module_files", "where_of",
           "store_files", "Scenario", "LineCounter", "InterruptAt", "Hung",
           "baseline", "targets", "run_case", "Outcome", "Sweep", "sweep", "sigint_loop",
           "sweep_in_children", "poisoned", "watchdog", "bounded_call", "settle_and_check",
           "make_offloader", "run_child", "child_env", "KiB"]

KiB = 1024

# The modules a sweep interrupts are named as modules, not files: each is found where
# Python imports it from (module_file), and one that no longer exists stops the sweep
# with an error instead of silently leaving its lines unswept.
# The store (the runtime under its lock).
STORE_MODULES = ("ssdtrain._store.store", "ssdtrain._store.repair", "ssdtrain._store.engine",
                 "ssdtrain._store.table",
                 "ssdtrain._store.iothread", "ssdtrain._store.events",
                 "ssdtrain._store.writeback", "ssdtrain._store.prefetch",
                 "ssdtrain._store.hosttier", "ssdtrain._store.probe",
                 "ssdtrain._decision.records", "ssdtrain._decision.budget",
                 "ssdtrain.io.readbuf", "ssdtrain.io.spill", "ssdtrain._device.transfers",
                 "ssdtrain._device.staging",
                 # the polled engine's completions run on the training thread (NOTE
                 # [ Polled completions ] in ssdtrain/io/base.py)
                 "ssdtrain.io.native", "ssdtrain.io.base")
# SSDTRAIN_TEST_INJECT_LOOPBACK=1 (inherited by the child processes): every offloader made here
# takes its CPU tensors for device memory of a loopback device (ssdtrain/testing/loopback.py), so
# the sweeps run over the device path (NOTE [ Device records ] in _device/transfers.py).
LOOPBACK_ENV = "SSDTRAIN_TEST_INJECT_LOOPBACK"
# SSDTRAIN_TEST_INJECT_HOST_BUDGET=<bytes> (with the loopback): every offloader made here has
# that host tier (NOTE [ Host tier ] in _store/hosttier.py), so records go to RAM, the
# earliest on to the SSD.
HOST_BUDGET_ENV = "SSDTRAIN_TEST_INJECT_HOST_BUDGET"
# How long a loopback stream's thread lives without work in these processes (maybe_loopback).
LOOPBACK_IDLE_S = 0.02


def host_budget():
    """``{"host_budget_bytes": ...}`` when ``SSDTRAIN_TEST_INJECT_HOST_BUDGET`` is set, else ``{}``."""
    value = os.environ.get(HOST_BUDGET_ENV)
    return {"host_budget_bytes": int(value)} if value else {}


# What a training step passes through above the store (NOTE [ Forward phases ] in
# ssdtrain/_offloader/forward.py): the public API, the forward's phases, attach, the module-state
# tracker, the layer policy and its profiler and planner.
STEP_MODULES = ("ssdtrain.api", "ssdtrain._offloader.forward", "ssdtrain._offloader.attach",
                "ssdtrain._decision.policy", "ssdtrain._policies.steps",
                "ssdtrain._policies.adaptive", "ssdtrain._policies.profile",
                "ssdtrain._policies.layers", "ssdtrain._policies.planner",
                "ssdtrain._policies.costmodel", "ssdtrain._policies.auto",
                "ssdtrain._policies.quota", "ssdtrain._policies.stall")
# The integrations' per-step hooks.
INTEGRATION_MODULES = ("ssdtrain.integrations.deepspeed", "ssdtrain.integrations.megatron")

FILE_SETS = ("store", "step")


def module_file(name: str) -> str:
    """The source file Python imports module ``name`` (``ssdtrain._store.store``) from, found
    without running the module (its parent packages are imported)."""
    import importlib.util
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        raise LookupError(f"no Python source for module {name!r}: a sweep names a module "
                          f"that was moved or renamed; update tests/inject.py")
    return spec.origin


def module_files(names) -> frozenset:
    """``co_filename`` values of the modules ``names`` (an iterable, or a comma-separated
    string): the path as imported, its real path and its absolute path, so a symlinked
    checkout matches too."""
    if isinstance(names, str):
        names = [n for n in names.split(",") if n]
    out = set()
    for name in names:
        path = module_file(name)
        out.update((path, os.path.realpath(path), os.path.abspath(path)))
    return frozenset(out)


def where_of(module: str) -> str:
    """How an :class:`Outcome`'s ``where`` names a line of ``module``:
    ``"ssdtrain/_store/store.py:"`` (its :func:`short` path and the colon before the line)."""
    return short(module_file(module)) + ":"


def store_files() -> frozenset:
    """``co_filename`` values of :data:`STORE_MODULES`."""
    return module_files(STORE_MODULES)


def step_files() -> frozenset:
    """``co_filename`` values of :data:`STEP_MODULES` and the integrations' hook modules
    (wherever ``ssdtrain.integrations`` is imported from)."""
    return module_files(STEP_MODULES + INTEGRATION_MODULES)


def traced_files(which: str) -> frozenset:
    """The files a sweep interrupts: ``"store"`` or ``"step"`` (:data:`FILE_SETS`)."""
    return {"store": store_files, "step": step_files}[which]()


def short(path: str) -> str:
    """``ssdtrain/_store/store.py`` (or ``integrations/megatron.py``) for a full path (messages)."""
    return os.path.basename(os.path.dirname(path)) + "/" + os.path.basename(path)


# ----------------------------------------------------------------------------- tracers

_WITH_EXIT = (("LOAD_CONST", None), ("LOAD_CONST", None), ("LOAD_CONST", None))


def _with_exits(code, _cache={}):
    """Offsets in ``code`` where a ``with`` block's exit starts (``__exit__(None, None,
    None)``). CPython reports a second 'line' event for the ``with`` line there, while
    the lock (or other context) is still held and outside the block's exception
    handler, yet no signal can be delivered there: the interpreter checks for signals
    only on function entry, backward jumps and after calls, and the body's last call
    is still inside the block while the next check comes after ``__exit__`` returned.
    An interrupt injected there would be an artifact of tracing, so these events are
    neither counted nor used. A ``return`` inside the block exits the same way, its
    value first moved under the context's exit (a ``SWAP`` that starts the line:
    ``Store._locked``'s exit, where an injected interrupt left the store lock held)."""
    found = _cache.get(code)
    if found is None:
        ins = list(dis.get_instructions(code))
        found = frozenset(
            ins[i].offset for i in range(len(ins) - 4)
            if ins[i].starts_line is not None
            and any(all((a.opname, a.argval) == want
                        for a, want in zip(ins[j:j + 3], _WITH_EXIT))
                    and ins[j + 3].opname in ("PRECALL", "CALL")
                    for j in ((i, i + 1) if ins[i].opname == "SWAP" else (i,))))
        _cache[code] = found
    return found


def _is_signal_point(frame):
    """Whether a 'line' event of ``frame`` is a place a real SIGINT could interrupt (all
    but a ``with`` block's exit: see :func:`_with_exits`)."""
    return frame.f_lasti not in _with_exits(frame.f_code)


class LineCounter:
    """A ``sys.settrace`` function counting ``(file, line)`` executions in ``files`` (the
    'line' events a signal could interrupt: :func:`_is_signal_point`)."""

    def __init__(self, files):
        self.files = files
        self.counts = collections.Counter()

    def __call__(self, frame, event, arg):
        if frame.f_code.co_filename in self.files:
            return self._local
        return None

    def _local(self, frame, event, arg):
        if event == "line" and _is_signal_point(frame):
            self.counts[(frame.f_code.co_filename, frame.f_lineno)] += 1
        return self._local


_LINES = {}


def _code_lines(code):
    lines = _LINES.get(code)
    if lines is None:
        lines = _LINES[code] = frozenset(ln for _, ln in dis.findlinestarts(code) if ln)
    return lines


class InterruptAt:
    """A ``sys.settrace`` function raising KeyboardInterrupt at the ``k``-th 'line' event of
    ``file:line`` (before that line runs), as a SIGINT arriving there would.

    Only frames whose code holds that line get a local tracer, so the rest of the
    program runs at almost full speed. ``fired`` says whether it happened; the
    interpreter removes a trace function that raises, so it fires once.
    """

    def __init__(self, file, line, k):
        self.file, self.line, self.k = file, line, k
        self.seen = 0
        self.fired = False

    def __call__(self, frame, event, arg):
        code = frame.f_code
        if self.fired or code.co_filename != self.file or self.line not in _code_lines(code):
            return None
        return self._local

    def _local(self, frame, event, arg):
        if event == "line" and frame.f_lineno == self.line and not self.fired \
                and _is_signal_point(frame):
            self.seen += 1
            if self.seen == self.k:
                self.fired = True
                raise KeyboardInterrupt(f"injected at {short(self.file)}:{self.line} "
                                        f"(occurrence {self.k})")
        return self._local


# ----------------------------------------------------------------------------- bounds

class Hung(BaseException):
    """Raised on the training thread by :func:`watchdog` when a check ran past its bound
    (a BaseException, so no ``except Exception`` in the code under test swallows it)."""


@contextlib.contextmanager
def watchdog(seconds: float, what: str):
    """Raise :class:`Hung` in the main thread if the block runs longer than ``seconds``.

    Uses ``SIGALRM``: its handler runs on the main thread at the next bytecode, and a
    main thread blocked in ``Lock.acquire`` (a deadlock on the store's lock) is woken.
    The alarm repeats every 2 s until the block is left: code under test that catches
    the first :class:`Hung` (a repair on ``BaseException``) and blocks again gets
    another. Code stuck in C without checking signals cannot be interrupted this way.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(signum, frame):
        raise Hung(f"{what} did not finish within {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds, 2.0)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


class _Abandoned(BaseException):
    """Raised asynchronously in a helper thread that ran past its bound, to stop it."""


def _async_raise(thread, exc_type):
    return ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident),
                                                      ctypes.py_object(exc_type))


def _store_stack(thread):
    """The innermost frames of ``thread`` (``file:line in func``), for messages."""
    frame = sys._current_frames().get(thread.ident)
    if frame is None:
        return "?"
    entries = traceback.extract_stack(frame)[-4:]
    return " <- ".join(f"{os.path.basename(e.filename)}:{e.lineno} in {e.name}"
                       for e in reversed(entries))


def bounded_call(fn, timeout: float, what: str):
    """Run ``fn()`` on a helper thread; ``None`` if it returned within ``timeout``, else a
    message saying what went wrong (raised, or still running and where).

    A thread still running after ``timeout`` is sent an asynchronous exception (which
    stops a Python-level spin or wait loop); one stuck in native code is left behind
    as a daemon.
    """
    errors = []

    def run():
        try:
            fn()
        except _Abandoned:
            pass
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            errors.append(e)

    thread = threading.Thread(target=run, name=f"inject-{what}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        where = _store_stack(thread)
        _async_raise(thread, _Abandoned)
        thread.join(5)
        left = (" (still running 5 s after being told to stop, blocked in a wait: left "
                "running)") if thread.is_alive() else ""
        return f"{what} did not return within {timeout} s; it was at {where}{left}"
    if errors:
        e = errors[0]
        return f"{what} raised {type(e).__name__}: {e}"
    return None


# ----------------------------------------------------------------------------- scenario

class _SaveViews(torch.autograd.Function):
    """``_SaveViews.apply(x[:k], x, x[:m])`` is ``x*x`` plus ``x[:m]**2/2`` on the first ``m``
    rows and ``x[:k]**2/2`` on the first ``k``. It saves its three inputs in that order: the
    small window (its own record: under half of the storage, saved first), ``x`` (the
    whole storage: a second record on it) and the large view (over half of the storage:
    deduplicated into ``x``'s record). The views are made outside ``forward`` so that they
    have a ``grad_fn`` (views made inside look like leaves and stay in memory). Every
    saved byte enters the gradient, so a wrong byte read back shows up in it."""

    @staticmethod
    def forward(ctx, small, x, big):
        ctx.save_for_backward(small, x, big)
        y = x * x
        y[:big.shape[0]] += big * big / 2
        y[:small.shape[0]] += small * small / 2
        return y

    @staticmethod
    def backward(ctx, g):
        small, x, big = ctx.saved_tensors
        return g[:small.shape[0]] * small, 2 * g * x, g[:big.shape[0]] * big


class TinyNet(nn.Module):
    """Residual Linear/GELU/Linear blocks and :class:`_SaveViews`; MSE loss. With batch 32
    and width 64 every activation is 8-16 KiB: above ``min_tensor_bytes=1024``."""

    def __init__(self, d=64, hidden=128, depth=3):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d))
            for _ in range(depth))

    def forward(self, x, y):
        h = x
        for block in self.blocks:
            h = h + block(h)
        n = h.shape[0]
        h = _SaveViews.apply(h[:n // 4], h, h[:3 * n // 4])
        return F.mse_loss(h, y)


class Scenario:
    """A few training steps of :class:`TinyNet` (each: forward under the offloader,
    ``backward(retain_graph=True)``, ``backward()`` again), with reference gradients from
    the same steps without ssdtrain.

    With :data:`CONFIG` (``keep_tail_bytes=0``, a 32 KiB prefetch window and write-behind
    limit) every eligible record is written; backward uses some prefetched, some read
    on a miss, the second backward reads every record again, and two packs share a
    record (dedup).
    """

    CONFIG = dict(policy="static",
                  min_tensor_bytes=1 * KiB, keep_tail_bytes=0, prefetch_bytes=32 * KiB,
                  write_behind_bytes=32 * KiB, io_timeout_s=5, io_threads=2)

    #: How a step runs its forward under the offloader:
    #: ``with``: ``with off:`` around the model call;
    #: ``attach``: ``off.attach(model)`` once, then plain model calls;
    #: ``adaptive``: ``with off:`` with ``off.track(model)`` and ``policy="adaptive"``
    #: (``profile_steps=1``: step 0 profiles, step 1 recomputes every layer, step 2
    #: plans, probing the engine's bandwidth);
    #: ``deepspeed``: the DeepSpeed adapter's engine-forward wrapper
    #: (``integrations/deepspeed.py``, ``_EngineForward``) around the model.
    #: ``auto``: ``with off:`` under ``policy="auto"`` with a fixed offload quota of
    #: :data:`AUTO_QUOTA` (half of a step's records are written, the rest passed through:
    #: NOTE [ The pack decision ] in _decision/policy.py), no baseline steps or disk probe.
    #: ``default``: ``with off:`` under the default policy, ``"auto"``, its controller as
    #: is (NOTE [ The offload quota ] in _policies/auto.py: the sizing step, the baseline steps,
    #: the disk probe, quotas) on a fake clock (:meth:`_tick`, so that every run takes the
    #: same decisions: a long forward, any disk keeps up), the memory read for real.
    #: ``cut``: ``with off:`` under ``policy="auto"`` with the quota pinned to
    #: :data:`AUTO_QUOTA` (``tools.pin_auto_quota``) and a 16 KiB prefetch window: from
    #: the second step on, the hooks come off once 16 KiB were passed through after the
    #: quota (NOTE [ Hooks off past the window ] in _policies/auto.py).
    MODES = ("with", "attach", "adaptive", "deepspeed", "auto", "default", "cut")
    MODE_CONFIG = {"adaptive": dict(policy="adaptive", profile_steps=1, memory_budget_bytes=96 * KiB),
                   "auto": dict(policy="auto"), "default": dict(policy="auto"),
                   "cut": dict(policy="auto", prefetch_bytes=16 * KiB)}
    AUTO_QUOTA = 72 * KiB  # of the 146 KiB of records a step saves

    def __init__(self, n_steps=8, batch=32, d=64, mode="with"):
        if mode not in self.MODES:
            raise ValueError(f"mode must be one of {self.MODES}, got {mode!r}")
        self.mode = mode
        # Steps armed with the interrupt (and traced by the baseline): enough to reach
        # every step kind of the mode (adaptive: profile, recompute-all, plan).
        self.armed_steps = 3 if mode in ("adaptive", "cut") else 5 if mode == "default" else 2
        self._now = 0.0
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1234)
            self.model = TinyNet(d=d)
        g = torch.Generator().manual_seed(4321)
        self.inputs = [(torch.randn(batch, d, generator=g), torch.randn(batch, d, generator=g))
                       for _ in range(n_steps)]
        if mode == "adaptive":
            # The first layer's input requires grad: its backward is timed, so the profile
            # completes and a plan is made within the armed steps.
            for x, _ in self.inputs:
                x.requires_grad_(True)
        self._forward = None
        self.reference = [self.step(i, None) for i in range(n_steps)]

    def config(self):
        """:data:`CONFIG` with this mode's fields."""
        return dict(self.CONFIG, **self.MODE_CONFIG.get(self.mode, {}))

    def prepare(self, off):
        """Set ``off`` up for this mode's steps (not armed: a step is what is swept)."""
        if self.mode == "attach":
            off.attach(self.model)
        elif self.mode == "adaptive":
            from ssdtrain._policies import adaptive as _adaptive
            # The bandwidth probe, 1 MiB instead of 64: its code runs (and is swept) in
            # every case, at a size that keeps a case short.
            probe = _adaptive.measure_bandwidth
            self._probe = getattr(probe, "func", probe)
            _adaptive.measure_bandwidth = functools.partial(self._probe, nbytes=1 << 20)
            off.track(self.model)
        elif self.mode == "deepspeed":
            from ssdtrain.integrations import deepspeed as ds_adapter
            self._forward = ds_adapter._EngineForward(self.model, off, False)
        elif self.mode == "auto":
            off._auto.begin_step = lambda: self.AUTO_QUOTA
        elif self.mode == "default":
            from ssdtrain import tools
            tools.set_auto_clock(off, self._tick)
        elif self.mode == "cut":
            from ssdtrain import tools
            tools.pin_auto_quota(off, self.AUTO_QUOTA)

    def _tick(self):
        """The default mode's clock: one second further at each reading."""
        self._now += 1.0
        return self._now

    def finish(self, off):
        """Undo :meth:`prepare` (before ``close()``, which untracks)."""
        if self.mode == "attach":
            off.detach(self.model)
        elif self.mode == "adaptive":
            from ssdtrain._policies import adaptive as _adaptive
            _adaptive.measure_bandwidth = self._probe
        self._forward = None

    def step(self, i, off):
        """Step ``i`` (inputs ``i``) under ``off`` (or none); returns the gradients.
        Nothing of the step's graph outlives it."""
        model = self.model
        model.zero_grad(set_to_none=True)
        if off is None or self.mode == "attach":
            loss = model(*self.inputs[i])
        elif self.mode == "deepspeed":
            loss = self._forward(*self.inputs[i])
        else:
            with off:
                loss = model(*self.inputs[i])
        loss.backward(retain_graph=True)
        loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    def compare(self, i, grads):
        """``None`` if ``grads`` equal step ``i``'s reference bitwise, else what differs."""
        for name, ref in self.reference[i].items():
            got = grads.get(name)
            if got is None or not torch.equal(got, ref):
                diff = "missing" if got is None else \
                    f"max abs diff {(got.double() - ref.double()).abs().max().item():.3g}"
                return f"gradient of {name} in step {i} differs from the reference ({diff})"
        return None


def make_offloader(spill_dir, sc=None, **overrides):
    """A fresh Offloader with :data:`Scenario.CONFIG` (``sc.config()`` if given, and
    ``overrides``) on ``spill_dir``. Not the ``make_offloader`` fixture: that closes at
    teardown, unbounded, and a store broken by an interrupt may never close."""
    cfg = dict(Scenario.CONFIG if sc is None else sc.config(), spill_dir=str(spill_dir),
               **host_budget())
    cfg.update(overrides)
    return maybe_loopback(ssdtrain.Offloader(ssdtrain.OffloadConfig(**cfg)))


def maybe_loopback(off):
    """``off``, with a loopback device attached when ``SSDTRAIN_TEST_INJECT_LOOPBACK=1``: every
    CPU tensor it saves takes the device path, its copies a little late."""
    if os.environ.get(LOOPBACK_ENV) == "1":
        from ssdtrain.testing import loopback as _loopback
        # A loopback stream's thread ends after _IDLE_S (0.5 s) without work, and every
        # case waits until the threads are back to what the process held before its
        # offloader (check_released): half a second a case, most of a device-path
        # sweep's time. Here they end 20 ms after their last work, and must still end.
        _loopback._IDLE_S = min(_loopback._IDLE_S, LOOPBACK_IDLE_S)
        _loopback.attach(off, _loopback.LoopbackDevice(claim_host_tensors=True,
                                                       d2h_delay=0.001, h2d_delay=0.001))
    return off


def baseline(sc: Scenario, make_off, *, runs=3, n_steps=None, files=None):
    """``{(file, line): times run}`` in ``files`` (default: the store modules) on this
    thread while ``n_steps`` (default ``sc.armed_steps``) steps run under a fresh
    Offloader from ``make_off()`` (closed after), ``runs`` times.

    How often a line runs depends on when engine threads complete requests (a read
    that ends before backward needs it is no miss), so each line gets the fewest runs
    seen in any replay where it ran: its last run is then likely reached again."""
    merged = {}
    n_steps = sc.armed_steps if n_steps is None else n_steps
    for _ in range(runs):
        counter = LineCounter(store_files() if files is None else files)
        off = make_off()
        sc.prepare(off)
        sys.settrace(counter)
        try:
            for i in range(n_steps):
                sc.step(i, off)
        finally:
            sys.settrace(None)
        gc.collect()
        sc.finish(off)
        off.close()
        for key, n in counter.counts.items():
            merged[key] = min(n, merged.get(key, n))
    return merged


def targets(counts, full=False):
    """``[(file, line, k, n)]``: interrupt the ``k``-th of the ``n`` runs of each line.

    Every line at its first run; lines run more than once also at their last run,
    and (``full``) at the middle one. Deterministic order: the files taken in turn
    (round robin, each in line order), so a sweep cut short after a few failures
    has still visited every module."""
    per_file = collections.defaultdict(list)
    for (file, line), n in sorted(counts.items()):
        ks = {1, n}
        if full:
            ks.add((n + 1) // 2)
        per_file[file] += [(file, line, k, n) for k in sorted(ks)]
    queues = [per_file[f] for f in sorted(per_file)]
    out = []
    for i in range(max(map(len, queues), default=0)):
        out += [q[i] for q in queues if i < len(q)]
    return out


# ----------------------------------------------------------------------------- checks

@dataclass
class Outcome:
    """What one injected run did and which checks failed."""

    where: str
    fired: bool = False
    surfaced: str = ""          # "step 1" (caught by the loop), "swallowed" (in a finalizer)
    failures: list = field(default_factory=list)  # "check: detail"


def settle_and_check(off, failures, *, settle_s=1.0, device_memory=True):
    """After every graph is dropped: wait (polling, at most ``settle_s``) for requests still
    in flight to end, then require no live record, no resident byte, no spill slot in
    use (a request cut loose from its record by an interrupt holds its slot until it
    ends, then lets go of it: NOTE [ Memory owned by requests ] in ssdtrain/_store/store.py;
    nothing is kept for good), and ``check_invariants()`` where the store has it. Appends
    to ``failures``. With a loopback device attached (``SSDTRAIN_TEST_INJECT_LOOPBACK``):
    no error on its streams and, with ``device_memory``, none of its memory in use."""
    gc.collect()
    deadline = time.monotonic() + settle_s
    while True:
        live, resident, spill = off.live_records(), off.resident_bytes(), off.spill_bytes_in_use()
        clean = live == 0 and resident == 0 and spill == 0
        if clean or time.monotonic() > deadline:
            break
        time.sleep(0.01)
        gc.collect()
    if live:
        failures.append(f"live_records: {live} records still live after every graph was dropped "
                        f"(expected 0)")
    if resident:
        failures.append(f"resident_bytes: {resident} bytes still resident after every graph was "
                        f"dropped (expected 0)")
    if spill:
        failures.append(f"spill_bytes_in_use: {spill} bytes of spill slots in use after every "
                        f"graph was dropped and the requests ended (expected 0)")
    quarantined = getattr(off.stats(), "quarantined_bytes", 0) or 0
    if quarantined:
        failures.append(f"Stats.quarantined_bytes: {quarantined} (expected 0: nothing is kept "
                        f"for good)")
    dev = getattr(off._store, "loopback", None)
    if dev is not None:  # the device path: its memory back, no error on its streams
        deadline = time.monotonic() + settle_s
        while device_memory and dev.in_use() and time.monotonic() < deadline:
            time.sleep(0.01)
            gc.collect()
        if dev.in_use() and device_memory:
            failures.append(f"loopback: {dev.in_use()} bytes of device memory still in use "
                            f"after every graph was dropped (expected 0)")
        if dev.errors:
            failures.append(f"loopback: work on its streams raised {dev.errors[:3]!r}")
    check = getattr(off._store, "check_invariants", None)
    if check is not None:
        try:
            check()
        except AssertionError as e:
            failures.append(f"check_invariants: {e}")


class _Unraisable:
    """Collects exceptions Python could not raise (finalizers, ``__del__``): an interrupt
    delivered there is swallowed and only reported through ``sys.unraisablehook``."""

    def __init__(self):
        self.seen = []

    def __enter__(self):
        self._old = sys.unraisablehook
        sys.unraisablehook = self._hook
        return self

    def _hook(self, unraisable):
        self.seen.append((unraisable.exc_type, unraisable.exc_value, unraisable.object))

    def __exit__(self, *exc):
        sys.unraisablehook = self._old
        return False


def run_case(sc: Scenario, off, target=None, *, armed_steps=None, after_steps=2,
             step_bound_s=15.0, close_bound_s=None, released=None):
    """Run ``armed_steps`` (default ``sc.armed_steps``) steps with KeyboardInterrupt
    injected at ``target`` (``(file, line, k, n)``, or ``None`` for no injection),
    catching it at the step level and dropping that step, then ``after_steps`` more;
    check gradients, leftovers, invariants and a bounded ``close()``; then that nothing
    is left behind (:func:`check_released`: hooks, the tracker, and, given
    ``released``, a :func:`resources` snapshot taken with no offloader open, that file
    descriptors and threads are back to it). Returns an :class:`Outcome`.

    ``close_bound_s`` defaults to ``io_timeout_s + 5``.
    """
    if armed_steps is None:
        armed_steps = sc.armed_steps
    if target is None:
        where, injector = "no injection", None
    else:
        file, line, k, n = target
        where = f"{short(file)}:{line} (occurrence {k} of {n})"
        injector = InterruptAt(file, line, k)
    outcome = Outcome(where)
    fails = outcome.failures
    if close_bound_s is None:
        close_bound_s = off.config.io_timeout_s + 5
    with _Unraisable() as unraisable:
        try:
            with watchdog(step_bound_s, "the steps and checks"):
                sc.prepare(off)
                grads = None
                for i in range(armed_steps + after_steps):
                    try:
                        if injector is not None and i < armed_steps:
                            sys.settrace(injector)
                        try:
                            grads = sc.step(i, off)
                        finally:
                            sys.settrace(None)
                    except KeyboardInterrupt:
                        outcome.surfaced = f"step {i}"
                        continue  # the loop drops that step (its graph went with the frames)
                    except Exception as e:  # noqa: BLE001
                        fails.append(f"step {i}: raised {type(e).__name__}: {e}")
                        continue
                    wrong = sc.compare(i, grads)
                    if wrong:
                        fails.append(f"step {i}: {wrong}")
                del grads
                settle_and_check(off, fails)
                sc.finish(off)
        except Hung as e:
            fails.append(f"hang on the training thread: {e} (a deadlock on the store's lock or "
                         f"a spin)")
        gc.collect()
    if injector is not None:
        outcome.fired = injector.fired
        if injector.fired and not outcome.surfaced:
            kinds = [f"{t.__name__} in {o!r}" for t, _, o in unraisable.seen
                     if t is KeyboardInterrupt]
            outcome.surfaced = f"swallowed ({kinds[0]})" if kinds else \
                "absorbed (neither raised to the step loop nor reported as unraisable)"
    err = bounded_call(off.close, close_bound_s, "close()")
    if err:
        fails.append(f"close: {err}")
    elif not poisoned(outcome):
        check_released(sc, released, fails)
    return outcome


def resources():
    """``(open file descriptors, names of live threads)`` of this process."""
    return (len(os.listdir("/proc/self/fd")),
            sorted(t.name for t in threading.enumerate()))


def check_released(sc, base, failures, *, settle_s=5.0):
    """After ``close()``: no saved-tensor hooks left on this thread's stack, the
    module-state tracker stopped, no hook or recompute wrapper left on ``sc.model``, and
    (given ``base``, a :func:`resources` snapshot) file descriptors and threads back to
    ``base`` (polling ``settle_s`` for threads that end after close returned)."""
    from ssdtrain._decision.policy import TRACKER

    if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        failures.append("leak: saved-tensor hooks left on the training thread's stack")
        while torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
            torch._C._autograd._pop_saved_tensors_default_hooks()  # isolate the next case
    users = TRACKER._users  # a set of users (a count in earlier versions)
    users = users if isinstance(users, int) else len(users)
    registered = TRACKER._registered() if hasattr(TRACKER, "_registered") else \
        TRACKER._hook is not None
    if users or registered:
        failures.append(f"leak: the module-state tracker still runs ({users} users, hook "
                        f"registered: {registered})")
    for name, m in sc.model.named_modules():
        if m._forward_pre_hooks or m._forward_hooks or "forward" in m.__dict__:
            failures.append(f"leak: module {name or 'model'} still has ssdtrain hooks or a "
                            f"recompute wrapper")
            for m in sc.model.modules():  # isolate the next case (the model is shared)
                m._forward_pre_hooks.clear()
                m._forward_hooks.clear()
                m.__dict__.pop("forward", None)
            break
    if base is None:
        return
    deadline = time.monotonic() + settle_s
    while True:
        fds, threads = resources()
        extra = sorted((collections.Counter(threads) - collections.Counter(base[1])).elements())
        if (fds <= base[0] and not extra) or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    if fds > base[0]:
        failures.append(f"leak: {fds - base[0]} more file descriptors open than before the "
                        f"offloader ({fds} vs {base[0]})")
    if extra:
        failures.append(f"leak: threads still running after close(): {extra}")


# ----------------------------------------------------------------------------- sweeps

@dataclass
class Sweep:
    """The outcomes of injecting at many targets with one engine."""

    engine: str
    outcomes: list = field(default_factory=list)
    stopped: str = ""           # why the sweep ended early, if it did

    @classmethod
    def from_records(cls, engine, records):
        """The sweep a child process reported (its ``outcome`` JSON lines)."""
        result = cls(engine)
        for r in records:
            if r["kind"] == "outcome":
                result.outcomes.append(Outcome(**{k: v for k, v in r.items() if k != "kind"}))
            elif r["kind"] == "done":
                result.stopped = r["stopped"]
        return result

    @property
    def failing(self):
        return [o for o in self.outcomes if o.failures]

    def summary(self) -> str:
        """Counts (fired, where the interrupt surfaced) and the failing lines."""
        fired = [o for o in self.outcomes if o.fired]
        caught = sum(o.surfaced.startswith("step") for o in fired)
        swallowed = sum(o.surfaced.startswith("swallowed") for o in fired)  # by a finalizer
        lines = sorted({o.where.split(" ")[0] for o in self.failing})
        text = (f"[{self.engine}] {len(self.outcomes)} targets: {len(fired)} fired "
                f"({caught} caught by the step loop, {swallowed} swallowed in a finalizer, "
                f"{len(fired) - caught - swallowed} absorbed elsewhere), "
                f"{len(self.outcomes) - len(fired)} not reached (timing); "
                f"{len(self.failing)} failed"
                + (f" at {len(lines)} lines: {', '.join(lines)}" if lines else ""))
        return text + (f"; {self.stopped}" if self.stopped else "")

    def message(self, limit=40) -> str:
        """One line per failing target and check, for the assertion."""
        rows = [f"{o.where} [{self.engine}], interrupt {o.surfaced or 'not fired'}: {f}"
                for o in self.failing for f in o.failures]
        more = f"\n... and {len(rows) - limit} more" if len(rows) > limit else ""
        return self.summary() + "\n" + "\n".join(rows[:limit]) + more


def sweep(sc: Scenario, spill_dir, engine, tgts, *, max_failing=10, report=None,
          **run_kw) -> Sweep:
    """:func:`run_case` at each of ``tgts`` with a fresh Offloader (``engine``) each time.
    Stops after ``max_failing`` failing targets: a broken store can cost a bounded wait
    per target, and the first failures say enough. ``report(outcome)`` is called after
    each target."""
    result = Sweep(engine)
    for i, target in enumerate(tgts):
        outcome = run_case(sc, make_offloader(spill_dir, engine=engine), target, **run_kw)
        result.outcomes.append(outcome)
        if report is not None:
            report(outcome)
        if len(result.failing) >= max_failing and i + 1 < len(tgts):
            result.stopped = (f"stopped after {max_failing} failing targets, "
                              f"{len(tgts) - i - 1} not run")
            break
    return result


# ----------------------------------------------------------------------------- real SIGINT

def sigint_loop(sc: Scenario, off, seconds, *, seed=0, interval_s=(0.001, 0.025),
                after_steps=2, close_bound_s=None):
    """Train for ``seconds`` while a helper thread sends SIGINT to this process at random
    intervals (``interval_s``, from a seeded RNG); each KeyboardInterrupt is caught at
    the step level and that step dropped. Then ``after_steps`` clean steps, the checks
    of :func:`settle_and_check` and a bounded ``close()``. Must run on the main thread.

    The SIGINT handler raises KeyboardInterrupt (as the default one does) only while a
    step runs, and disarms itself when it does, so the loop's own bookkeeping between
    steps is never interrupted; a signal arriving between steps is counted and ignored.

    Returns ``(failures, info)``: info counts steps, interrupts caught, signals sent and
    the most live records seen between steps.
    """
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("sigint_loop must run on the main thread (signal handlers do)")
    info = dict(steps=0, completed=0, interrupted=0, sent=0, ignored=0, max_live=0,
                swallowed=0)
    fails = []
    armed = [False]

    def on_sigint(signum, frame):
        if armed[0]:
            armed[0] = False
            raise KeyboardInterrupt("SIGINT")
        info["ignored"] += 1

    stop = threading.Event()
    rng = random.Random(seed)
    pid = os.getpid()

    def sender():
        while not stop.wait(rng.uniform(*interval_s)):
            os.kill(pid, signal.SIGINT)
            info["sent"] += 1

    if close_bound_s is None:
        close_bound_s = off.config.io_timeout_s + 5
    n = len(sc.inputs)
    old = signal.signal(signal.SIGINT, on_sigint)
    thread = threading.Thread(target=sender, name="inject-sigint", daemon=True)
    with _Unraisable() as unraisable:
        try:
            with watchdog(seconds + 20, "the SIGINT loop and checks"):
                thread.start()
                end = time.monotonic() + seconds
                i = 0
                while time.monotonic() < end:
                    try:
                        armed[0] = True
                        grads = sc.step(i % n, off)
                        armed[0] = False
                    except KeyboardInterrupt:
                        info["interrupted"] += 1
                    except Exception as e:  # noqa: BLE001
                        armed[0] = False
                        fails.append(f"step {i}: raised {type(e).__name__}: {e}")
                    else:
                        info["completed"] += 1
                        wrong = sc.compare(i % n, grads)
                        if wrong:
                            fails.append(f"step {i}: {wrong}")
                    grads = None
                    i += 1
                    if i % 16 == 0:
                        info["max_live"] = max(info["max_live"], off.live_records())
                    if len(fails) > 10:
                        break
                info["steps"] = i
                stop.set()
                thread.join()
                time.sleep(0.05)  # let a SIGINT still pending reach the (disarmed) handler
                signal.signal(signal.SIGINT, old)
                for j in range(after_steps):
                    try:
                        wrong = sc.compare(j, sc.step(j, off))
                    except Exception as e:  # noqa: BLE001
                        wrong = f"raised {type(e).__name__}: {e}"
                    if wrong:
                        fails.append(f"clean step {j} after the SIGINTs: {wrong}")
                settle_and_check(off, fails)
        except Hung as e:
            fails.append(f"hang on the training thread: {e} (a deadlock on the store's lock or "
                         f"a spin)")
        finally:
            stop.set()
            armed[0] = False
            if thread.is_alive():
                thread.join()
            signal.signal(signal.SIGINT, old)
        info["swallowed"] = sum(t is KeyboardInterrupt for t, _, _ in unraisable.seen)
    err = bounded_call(off.close, close_bound_s, "close()")
    if err:
        fails.append(f"close: {err}")
    return fails, info


# ----------------------------------------------------------------------------- child process

def child_env():
    """The environment of a child process: imports this checkout's ``ssdtrain`` (and these
    helpers) whatever the current directory."""
    env = dict(os.environ)
    paths = [os.path.dirname(os.path.dirname(os.path.abspath(ssdtrain.__file__))),
             os.path.dirname(os.path.abspath(__file__))]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def run_child(script_args, timeout):
    """Run ``python <script> *args --out FILE`` (``script_args[0]`` is the script) with a
    timeout; returns ``(records, rc, stderr_tail)``: ``records`` are the JSON lines it
    wrote to FILE (all of them, even if it was killed), ``rc`` is ``None`` on a timeout.
    """
    with tempfile.TemporaryDirectory(prefix="ssdtrain-inject-") as tmp:
        out = os.path.join(tmp, "out.jsonl")
        err_path = os.path.join(tmp, "stderr")
        with open(err_path, "wb") as err:
            proc = subprocess.Popen([sys.executable, *script_args, "--out", out],
                                    stdout=err, stderr=subprocess.STDOUT, env=child_env())
            try:
                rc = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                rc = None
        records = []
        if os.path.exists(out):
            with open(out) as f:
                for line in f:
                    if line.strip():
                        records.append(json.loads(line))
        with open(err_path, "rb") as f:
            tail = f.read()[-6000:].decode(errors="replace")
    return records, rc, tail


class _Writer:
    def __init__(self, path):
        self.f = open(path, "a")

    def __call__(self, kind, **data):
        self.f.write(json.dumps(dict(data, kind=kind)) + "\n")
        self.f.flush()


# Failures after which a case may have left a thread blocked or the old store's lock
# held: later cases in the same process would not be independent of it.
_POISON = ("hang on the training thread", "close: close() did not return")


def poisoned(outcome) -> bool:
    """Whether ``outcome``'s case may have left a thread stuck (see :func:`sweep_in_children`)."""
    return any(f.startswith(p) for f in outcome.failures for p in _POISON)


def _digest(files=None):
    """``{module: sha1}`` of the traced modules (default: the store's): a sweep's targets
    are line numbers, valid only while the files stay as they were when the baseline ran."""
    import hashlib

    out = {}
    for path in sorted({os.path.abspath(p) for p in (files or store_files())}):
        with open(path, "rb") as f:
            out[short(path)] = hashlib.sha1(f.read()).hexdigest()
    return out


def _describe(target):
    file, line, k, n = target
    return f"{short(file)}:{line} (occurrence {k} of {n})"


def sweep_in_children(engine, select, spill_dir, *, budget_s, max_failing=10,
                      case_timeout_s=60.0, extra=(), shard=None):
    """:func:`sweep` at the targets ``select`` picks (``first``, ``last`` or ``full``: see
    :func:`targets`), in child processes; with ``shard=(index, count)`` only that part of
    them (:func:`shard_of`; NOTE [ Sweeps take turns by week ] in tests/helpers.py).
    Returns ``(Sweep, baseline)``: ``baseline`` is the first child's report (``lines``
    traced, ``targets`` run, ``all_targets`` before the shard was taken, ``files``), or
    ``None``.

    A child runs the targets in order until the end, or until a case that may have left
    a thread stuck (:func:`poisoned`): the next child resumes after it, on the same
    targets (the first child writes them to a file). A child stuck beyond
    ``case_timeout_s`` in one case dumps its threads' stacks and exits (faulthandler);
    that case fails with the dump, and the next child resumes after it. Stops after
    ``max_failing`` failing targets or ``budget_s`` seconds, saying so in ``stopped``.
    """
    result, base = Sweep(engine), None
    if shard is not None:
        extra = (*extra, "--shard", f"{shard[0]}/{shard[1]}")
    deadline = time.monotonic() + budget_s
    with tempfile.TemporaryDirectory(prefix="ssdtrain-sweep-") as tmp:
        tfile, start = os.path.join(tmp, "targets.json"), 0
        while True:
            remaining = deadline - time.monotonic()
            if remaining < 10:
                result.stopped = f"time budget of {budget_s} s spent"
                break
            records, rc, tail = run_child(
                [__file__, "sweep", "--engine", engine, "--select", select, "--spill",
                 str(spill_dir), "--targets-file", tfile, "--start", str(start),
                 "--max-failing", str(max_failing - len(result.failing)),
                 "--case-timeout-s", str(case_timeout_s), *extra], remaining)
            ran, finished = 0, False
            for r in records:
                kind = r.pop("kind")
                if kind == "baseline" and base is None:
                    base = r
                elif kind == "outcome":
                    result.outcomes.append(Outcome(**r))
                    ran += 1
                elif kind == "done":
                    finished, result.stopped = True, r["stopped"]
            if finished:
                break
            start += ran
            if not os.path.exists(tfile):
                result.stopped = f"the sweep process ended before its baseline (exit {rc}):\n{tail}"
                break
            with open(tfile) as f:
                tgts = [tuple(t) for t in json.load(f)["targets"]]
            if not (ran and poisoned(result.outcomes[-1])) and start < len(tgts):
                # The child hung (killed by its faulthandler timer or our timeout) or died
                # inside the case at ``start``, before reporting it.
                how = "was stopped by its timeout" if rc is None else f"ended with exit {rc}"
                result.outcomes.append(Outcome(
                    _describe(tgts[start]), surfaced="unknown",
                    failures=[f"the sweep process hung or died in this case: it {how}; its "
                              f"last output:\n{tail}"]))
                start += 1
            if start >= len(tgts):
                break
            if len(result.failing) >= max_failing:
                result.stopped = (f"stopped after {max_failing} failing targets, "
                                  f"{len(tgts) - start} not run")
                break
    return result, base


def shard_of(tgts, index, count):
    """Part ``index`` of ``count`` of the target list ``tgts`` (in its order): the ``j``-th
    target of each file when ``j % count == index``. So every part takes about a
    ``count``-th of each file's lines (every module is visited by every part that has
    any of its lines), and the parts together are ``tgts``."""
    if not 0 <= index < count:
        raise ValueError(f"shard {index}/{count}: the part must be in 0..{count - 1}")
    seen = collections.Counter()
    out = []
    for t in tgts:
        if seen[t[0]] % count == index:
            out.append(t)
        seen[t[0]] += 1
    return out


def _shard_arg(text):
    index, _, count = text.partition("/")
    return int(index), int(count)


def _function_lines(name):
    """``(path, lines)`` of ``module:qualified.name`` (a function or method)."""
    import functools as _ft
    import importlib
    import inspect
    mod, qual = name.split(":")
    module = importlib.import_module(mod)
    fn = _ft.reduce(getattr, qual.split("."), module)
    src, first = inspect.getsourcelines(fn)
    return os.path.abspath(inspect.getsourcefile(fn)), range(first, first + len(src))


def _main(argv=None):
    """``sweep --engine E --select first|last|full --spill DIR --out F --targets-file T
    [--start I] [--max-failing N] [--shard I/N]`` or ``sigint --engine E --seconds S
    --seed N --spill DIR --out F``: the child processes of :func:`sweep_in_children` and of
    the SIGINT test."""
    import argparse

    parser = argparse.ArgumentParser(description=_main.__doc__)
    parser.add_argument("mode", choices=("sweep", "sigint"))
    parser.add_argument("--engine", default="posix")
    parser.add_argument("--select", choices=("first", "last", "full"), default="first")
    parser.add_argument("--scenario", choices=Scenario.MODES, default="with",
                        help="how a step enters the offloader (Scenario.MODES)")
    parser.add_argument("--files", choices=FILE_SETS, default="store",
                        help="which modules are interrupted: the store's, or the step's "
                             "above it (STEP_MODULES and the integrations' hooks)")
    parser.add_argument("--skip-function", default="",
                        help="comma-separated module:function names whose lines are not "
                             "interrupted (known, tracked elsewhere)")
    parser.add_argument("--only-function", default="",
                        help="comma-separated module:qualified.name of functions: interrupt "
                             "only their lines")
    parser.add_argument("--only", default="",
                        help="comma-separated module names (ssdtrain._store.hosttier): interrupt only "
                             "lines of these (the baseline still traces every module of --files)")
    parser.add_argument("--shard", type=_shard_arg, default=None, metavar="I/N",
                        help="run only part I (0-based) of N of the selected targets: target "
                             "j when j %% N == I (the sweeps' weekly turns)")
    parser.add_argument("--spill", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--targets-file", default=None,
                        help="targets to run (JSON); written from a baseline if absent")
    parser.add_argument("--start", type=int, default=0, help="index of the first target")
    parser.add_argument("--max-failing", type=int, default=10)
    parser.add_argument("--case-timeout-s", type=float, default=60.0,
                        help="dump every thread's stack and exit if one case runs this long")
    parser.add_argument("--seconds", type=float, default=1.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step-bound-s", type=float, default=15.0,
                        help="bound of one case's steps and checks (diagnostics: lower)")
    parser.add_argument("--close-bound-s", type=float, default=None,
                        help="bound of close(); default io_timeout_s + 5 (diagnostics: lower)")
    parser.add_argument("--hang-s", type=float, default=600.0,
                        help="dump every thread's stack and exit after this long (setup, "
                             "baseline, the SIGINT mode)")
    args = parser.parse_args(argv)
    faulthandler.dump_traceback_later(args.hang_s, exit=True)
    write = _Writer(args.out)
    torch.set_num_threads(1)
    sc = Scenario(mode=args.scenario)
    files = traced_files(args.files)
    gc.collect()
    gc.freeze()  # the full collections of each case must not rescan torch's objects
    if args.mode == "sweep":
        tfile = args.targets_file
        if tfile and os.path.exists(tfile):
            with open(tfile) as f:
                saved = json.load(f)
            tgts = [tuple(t) for t in saved["targets"]]
            if saved["digest"] != _digest(files):
                write("done", stopped="the store modules changed while the sweep ran (their "
                                      "line numbers are its targets): run it again")
                os._exit(0)
        else:
            counts = baseline(sc, lambda: make_offloader(args.spill, sc, engine=args.engine),
                              files=files)
            if args.only:
                keep = module_files(args.only)
                counts = {k: n for k, n in counts.items() if k[0] in keep}
            for name in filter(None, args.skip_function.split(",")):
                import importlib
                import inspect
                mod, func = name.split(":")
                src, first = inspect.getsourcelines(getattr(importlib.import_module(mod), func))
                path = os.path.abspath(inspect.getsourcefile(importlib.import_module(mod)))
                skip = range(first, first + len(src))
                counts = {k: n for k, n in counts.items()
                          if not (os.path.abspath(k[0]) == path and k[1] in skip)}
            if args.only_function:
                counts = {k: n for k, n in counts.items()
                          if any(os.path.abspath(k[0]) == path and k[1] in lines
                                 for path, lines in map(_function_lines,
                                                        args.only_function.split(",")))}
            tgts = targets(counts, full=args.select == "full")
            if args.select != "full":
                tgts = [t for t in tgts if t[2] == (1 if args.select == "first" else t[3])]
            if args.only:
                keep = module_files(args.only)
                tgts = [t for t in tgts if t[0] in keep]
            every = len(tgts)
            if args.shard:  # NOTE [ Sweeps take turns by week ] (tests/helpers.py)
                tgts = shard_of(tgts, *args.shard)
            if tfile:
                with open(tfile + ".tmp", "w") as f:
                    json.dump(dict(digest=_digest(files), targets=tgts), f)
                os.replace(tfile + ".tmp", tfile)
            write("baseline", lines=len(counts), targets=len(tgts), all_targets=every,
                  files=sorted({short(f) for f, _ in counts}))
        failing, stopped = 0, ""
        # What this process holds with no offloader open (after the baseline's, or one
        # case's, offloaders were closed): every case must give back what it took.
        if args.start:  # a resumed child ran no baseline: one plain case first
            run_case(sc, make_offloader(args.spill, sc, engine=args.engine), None)
        gc.collect()
        released = resources()
        for i in range(args.start, len(tgts)):
            faulthandler.dump_traceback_later(args.case_timeout_s, exit=True)
            outcome = run_case(sc, make_offloader(args.spill, sc, engine=args.engine), tgts[i],
                               step_bound_s=args.step_bound_s, close_bound_s=args.close_bound_s,
                               released=released)
            write("outcome", **dataclasses.asdict(outcome))
            failing += bool(outcome.failures)
            if poisoned(outcome):
                write("restart")
                break
            if failing >= args.max_failing and i + 1 < len(tgts):
                stopped = (f"stopped after {failing} more failing targets, {len(tgts) - i - 1} "
                           f"not run")
                write("done", stopped=stopped)
                break
        else:
            write("done", stopped="")
        faulthandler.cancel_dump_traceback_later()
    else:
        fails, info = sigint_loop(sc, make_offloader(args.spill, sc, engine=args.engine),
                                  args.seconds, seed=args.seed)
        write("sigint", failures=fails, info=info)
        write("done", stopped="")
    sys.stdout.flush()
    sys.stderr.flush()
    # Not a normal exit: a store broken by an interrupt may have left an engine thread
    # blocked forever, and interpreter shutdown would wait for it.
    os._exit(0)


if __name__ == "__main__":
    _main()
