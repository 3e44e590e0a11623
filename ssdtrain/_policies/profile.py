"""Layer scopes and profiling: which layer is running, what it saves, how long it takes.

:class:`LayerProfiler` puts a forward pre-hook and a forward hook on each layer
module. They maintain the *current layer* (the store attributes each new record
to it), and, on profiled steps only, time each layer's forward and register two
tensor hooks per layer that time its backward (NOTE [ Timing backward with
tensor hooks ]). :func:`measure_bandwidth` times a write and a read of the
engine in use. Nothing here decides anything; ``_policies/adaptive.py`` does. Which
modules are the layers, and a layer's buffers, are in ``_policies/layers.py``.

NOTE [ Timing backward with tensor hooks ]

A hook on a layer's output fires when the gradient of that output is complete:
the layer's backward is about to start. A hook on its input fires when the
gradient of the input is complete: every use of the input inside the layer has
been differentiated, so the layer's backward has ended (for a chain of blocks
the two are the same instant seen from both sides). When no tensor input of
the layer requires grad (the first layer fed the raw batch), there is no input
gradient to wait for: the layer's backward has ended when the last of its
parameters' gradients has been accumulated, which a
``register_post_accumulate_grad_hook`` on each of its parameters sees (the
latest one wins). A layer whose output needs no grad has no backward (0 s).
The time between them is
the layer's backward, I/O stalls included; the stalls ssdtrain counted in
between (``Stats.stall_seconds``) are subtracted, so what remains is compute.
Forward time is measured the same way around the module call, minus the time
pack waited for writes (``Stats.write_stall_seconds``). Tensor hooks that
return ``None`` change no gradient. They are registered only on profiled
steps; other steps pay for the two module hooks per layer and nothing else.

A timed step that does not see every layer's forward and backward before the
next forward begins is incomplete; :meth:`StepSample.missing` says why, and
the adaptive policy warns with the reason and the fix (it cannot plan
without ``profile_steps`` complete steps).

NOTE [ The end of backward ]

The first layer-backward hook of a timed step also queues an autograd engine
callback (``queue_callback``), which runs when that backward pass ends. The
time from the end of the first layer's backward to there (embedding backward,
the rest of the graph) is ``tail_s``; the time from there to the next forward
(optimizer, data, whatever the loop does between steps) is ``between_s``. Both
are the same whatever the plan, so they change no choice; apart, the
prediction says when backward ends (``Prediction.backward_end_s``), which is
what a benchmark timing ``forward`` and ``backward`` measures, while
``step_s`` is the period from forward to forward. (Without the callback, when
backward was not run by the engine, ``between_s`` is 0 and ``tail_s`` is all
of it, as before.)

NOTE [ Timing asynchronous devices ]

On an accelerator, a layer's call returns when its kernels are launched, not
when they have run, so ``time.perf_counter`` around it measures launch time.
On timed steps only, every timestamp is taken after synchronizing the devices
the tracked layers' tensors live on (:meth:`LayerProfiler._now`;
``torch.get_device_module(type).synchronize``: ``torch.cuda.synchronize`` on
CUDA, a no-op ``torch.cpu.synchronize`` on the CPU, so the same code runs
everywhere), so each interval is the compute the layer's kernels took. This
drains the device's queue at every layer boundary of the profiled steps (a few
launch latencies per layer); steps that are not timed take no timestamp and
never synchronize.

NOTE [ Pure compute times ]

Profiled steps run under the static rules, so their layer times include what
offloading costs the CPU (the I/O threads share the cores; on a CPU-only
machine, with few cores, that is most of the cost of offloading): they are
not the times of a layer that is kept. With ``policy="adaptive"`` one more
step is profiled with every layer recomputed: nothing but the layers' inputs
is written, so its forward times are compute only, and its backward times
are compute plus one recomputed forward, which is subtracted. (A layer's
compute time is the smaller of that and its offloaded time: one disturbed
step must not make compute look slower than compute beside I/O.) The difference
between the two profiles, per byte written, is the CPU time offloading costs
per byte (forward and backward apart): the planner charges it to offloaded
bytes (``StepCost.fwd_s_per_byte`` / ``bwd_s_per_byte``). Without that step
(``policy="static"``), layer times are the offloaded ones and the per-byte
costs are 0.

NOTE [ Measuring a recompute ]

In the recompute-all step, every layer's checkpoint gets a ``context_fn``
whose recompute context is a :class:`RecomputeMeter`: a dispatch mode that
sees every operator the recompute runs, adds the bytes of each new output
storage to a live count, and takes them off when the storage dies (a
``weakref.finalize`` on the storage object, which PyTorch preserves as long as
its ``StorageImpl`` lives). The peak of that count is the layer's
``recompute_bytes`` (NOTE [ Recompute working set ] in _policies/costmodel.py): the
tensors checkpoint holds for the layer's backward, of any size, plus the
temporaries of its forward at the worst moment. Only that one step pays for
the mode (a Python call per operator of the recompute); it changes no value.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import List, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .costmodel import LayerCost, StepCost
from .layers import (_first_grad_tensor, _tensors, buffer_state, buffer_slots, default_layers,
                     updated_buffers)

__all__ = ["default_layers", "LayerProfiler", "StepSample", "RecomputeMeter",
           "measure_bandwidth", "buffer_slots", "updated_buffers"]

log = logging.getLogger("ssdtrain")


@dataclass
class StepSample:
    """What one step measured (times are ``time.perf_counter`` seconds)."""

    n: int
    timed: bool
    recompute: bool = False             # every layer recomputed (the pure-compute profile)
    begin: float = 0.0
    fwd_end: Optional[float] = None
    wstall_begin: float = 0.0           # write stall counter at the beginning
    fwd_stall_end: float = 0.0          # write stall counter at the end of forward
    stall_at_fwd_end: float = 0.0       # read stall counter at the end of forward
    saved_bytes: List[int] = field(default_factory=list)
    untracked_bytes: int = 0
    input_bytes: List[int] = field(default_factory=list)
    fwd_s: List[float] = field(default_factory=list)
    bwd_s: List[float] = field(default_factory=list)
    recompute_bytes: List[int] = field(default_factory=list)  # NOTE [ Measuring a recompute ]
    bwd_begin: List[Optional[float]] = field(default_factory=list)
    bwd_end: List[Optional[float]] = field(default_factory=list)
    head_stall: float = 0.0
    bwd_done: Optional[float] = None    # the backward pass ended (NOTE [ The end of backward ])
    called: List[bool] = field(default_factory=list)    # the layer ran with grad enabled
    has_bwd: List[bool] = field(default_factory=list)   # its output requires grad
    grad_in: List[bool] = field(default_factory=list)   # a tensor input requires grad
    period: Optional[float] = None      # begin to the next step's begin
    stall_s: float = 0.0                # read + write stalls over the whole period
    _fwd_t0: List[float] = field(default_factory=list)
    _wstall0: List[float] = field(default_factory=list)
    _rstall0: List[float] = field(default_factory=list)
    _stall_begin: float = 0.0
    _bwd_seen: bool = False
    _handles: list = field(default_factory=list)        # (layer, parameter hook) of this step

    def __post_init__(self):
        n = self.n
        self.saved_bytes = [0] * n
        self.input_bytes = [0] * n
        self.fwd_s = [0.0] * n
        self.bwd_s = [0.0] * n
        self.recompute_bytes = [0] * n
        self.bwd_begin = [None] * n
        self.bwd_end = [None] * n
        self._fwd_t0 = [0.0] * n
        self._wstall0 = [0.0] * n
        self._rstall0 = [0.0] * n
        self.called = [False] * n
        self.has_bwd = [False] * n
        self.grad_in = [False] * n

    @property
    def complete(self) -> bool:
        """Timed, and every layer's forward, every backward and the step's period were seen."""
        return self.period is not None and self.missing() is None

    def missing(self, names=None) -> Optional[str]:
        """Why this timed step is not a complete profile (``None``: it is, so far).

        Args:
            names: the layers' names, for the message. Default: their indices.
        """
        names = names or [str(i) for i in range(self.n)]

        def which(idx):
            return ", ".join(names[i] for i in idx)

        if not self.timed:
            return "it was not timed"
        if self.fwd_end is None:
            return "its forward pass did not end"
        absent = [i for i in range(self.n) if not self.called[i]]
        if absent:
            return f"tracked layer(s) {which(absent)} did not run (with grad enabled) in its forward"
        if self.n and not any(self.has_bwd):
            return "no tracked layer's output requires grad, so there was no backward to time"
        unseen = [i for i in range(self.n) if self.has_bwd[i] and
                  (self.bwd_begin[i] is None or self.bwd_end[i] is None)]
        if unseen:
            return (f"the backward of tracked layer(s) {which(unseen)} was not seen before the "
                    f"next forward began")
        return None

    def drop_hooks(self):
        for _, h in self._handles:
            h.remove()
        self._handles = []


class RecomputeMeter(TorchDispatchMode):
    """Peak live bytes of the storages created while this mode is active, into
    ``sample.recompute_bytes[index]`` (NOTE [ Measuring a recompute ]).

    Args:
        sample: the :class:`StepSample` to record into.
        index: the layer's index.
    """

    def __init__(self, sample, index):
        super().__init__()
        self.sample, self.index = sample, index
        self._lock = threading.Lock()
        self._live = 0
        self._seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in _tensors(out):
            storage = t.untyped_storage()
            nbytes = storage.nbytes()
            key = (storage.data_ptr(), str(storage.device))
            if nbytes == 0 or key in self._seen:
                continue
            with self._lock:
                self._seen.add(key)
                self._live += nbytes
                if self._live > self.sample.recompute_bytes[self.index]:
                    self.sample.recompute_bytes[self.index] = self._live
            weakref.finalize(storage, self._dead, key, nbytes)
        return out

    def _dead(self, key, nbytes):
        with self._lock:
            self._seen.discard(key)
            self._live -= nbytes


class LayerProfiler:
    """The current layer, per-layer saved bytes every step, and times on profiled steps.

    Args:
        layers: ``(name, module)`` pairs in forward order.
        stats: the offloader's :class:`~ssdtrain.Stats` (stall counters are read).
        profile_steps: how many steps, from the first, are timed.
    """

    def __init__(self, layers, stats, profile_steps):
        self.names = [name for name, _ in layers]
        self.modules = [m for _, m in layers]
        self.stats = stats
        self.profile_steps = profile_steps
        self.active = False          # inside a forward pass of the offloader
        self.current = None          # index of the layer whose forward runs
        self._stack = []
        self.samples: List[StepSample] = []   # finished steps, oldest first (bounded)
        self.profiled: List[StepSample] = []  # the latest complete timed steps
        self.profiled_rc: List[StepSample] = []  # the latest complete recompute-all step
        self.step: Optional[StepSample] = None
        self.timed_steps = 0
        self._owner = None
        self._handles = []
        self._sync = {}              # device -> its synchronize (NOTE [ Timing asynchronous devices ])
        self.updates = [None] * len(self.modules)  # buffers each forward updates; None: not seen
        # Called at each layer boundary of every step while set (NOTE [ Measured memory ]
        # in _policies/adaptive.py): ``boundary(i, False)`` when layer ``i``'s forward ends,
        # ``boundary(i, True)`` when layer ``i``'s backward begins.
        self.boundary = None
        self._boundary_hooks = [self._on_boundary(i) for i in range(len(self.modules))]
        self._buffers0 = {}          # layer -> buffer_state() when its timed forward began
        seen = set()
        for i, m in enumerate(self.modules):
            if id(m) in seen:
                raise ValueError(f"ssdtrain: layer {self.names[i]} is listed twice; give each "
                                 f"layer module once.")
            seen.add(id(m))
            self._handles.append(m.register_forward_pre_hook(self._hook_pre(i)))
            self._handles.append(m.register_forward_hook(self._hook_post(i)))

    def remove(self):
        """Remove the module hooks."""
        self.boundary = None
        for h in self._handles:
            h.remove()
        self._handles = []
        if self.step is not None:
            self.step.drop_hooks()
        self.active = False

    # ------------------------------------------------------------- helpers
    def _now(self):
        """``time.perf_counter()`` once the devices in use have finished their queued
        work (NOTE [ Timing asynchronous devices ]); for timed steps only."""
        for sync in self._sync.values():
            sync()
        return time.perf_counter()

    def _note_devices(self, obj):
        for t in _tensors(obj):
            d = t.device
            if d in self._sync:
                continue
            try:
                mod = torch.get_device_module(d.type)
            except (AttributeError, RuntimeError, ValueError):
                mod = None
            if mod is None or not hasattr(mod, "synchronize"):
                self._sync[d] = lambda: None  # meta and such: nothing runs asynchronously
            else:
                self._sync[d] = lambda mod=mod, d=d: mod.synchronize(d)

    def note_updates(self, i, names):
        """Layer ``i``'s forward updated these buffers (NOTE [ Recompute without a second
        update ] in _policies/adaptive.py): remember them, in first-seen order."""
        known = self.updates[i]
        if known is None:
            self.updates[i] = list(names)
        else:
            known.extend(n for n in names if n not in known)

    # ----------------------------------------------------------------- steps
    def close_step(self):
        """A forward pass begins: the previous step ends here.

        Returns:
            The :class:`StepSample` closed (``None``: there was none).
        """
        prev, self.step = self.step, None
        now = self._now() if prev is not None and prev.timed else time.perf_counter()
        if prev is not None:
            prev.drop_hooks()
            prev.period = now - prev.begin
            prev.stall_s = (self.stats.stall_seconds + self.stats.write_stall_seconds) - \
                prev._stall_begin
            self.samples.append(prev)
            del self.samples[:-8]
            if prev.complete and prev.recompute:
                self.profiled_rc.append(prev)
                del self.profiled_rc[:-1]
            elif prev.complete:
                self.profiled.append(prev)
                del self.profiled[:-self.profile_steps]
        return prev

    def open_step(self, timed: bool, recompute: bool = False):
        """Open the new step; ``timed``: measure its layers' times; ``recompute``: every
        layer is recomputed in it (NOTE [ Pure compute times ])."""
        self.timed_steps += bool(timed)
        self.step = StepSample(len(self.modules), timed, recompute,
                               begin=self._now() if timed else time.perf_counter(),
                               wstall_begin=self.stats.write_stall_seconds)
        self.step._stall_begin = self.stats.stall_seconds + self.stats.write_stall_seconds
        self.current, self._stack = None, []
        self._owner = threading.get_ident()
        self.active = True

    def begin_step(self):
        """``close_step()`` then ``open_step()``, timed until the profile is complete."""
        self.close_step()
        self.open_step(timed=not self.ready())

    def end_forward(self):
        s = self.step
        self.active = False
        self.current, self._stack = None, []
        if s is not None:
            s.fwd_end = self._now() if s.timed else time.perf_counter()
            s.fwd_stall_end = self.stats.write_stall_seconds
            s.stall_at_fwd_end = self.stats.stall_seconds

    def attribute(self, nbytes):
        """A new record of ``nbytes`` was created: count it for the current layer."""
        s = self.step
        if s is None:
            return
        if self.current is None:
            s.untracked_bytes += nbytes
        else:
            s.saved_bytes[self.current] += nbytes

    def recompute_context(self, i):
        """A ``context_fn`` for the checkpoint of layer ``i`` that measures its recompute
        (NOTE [ Measuring a recompute ]), or ``None`` outside the recompute-all step."""
        s = self.step
        if s is None or not (s.timed and s.recompute):
            return None
        return lambda: (contextlib.nullcontext(), RecomputeMeter(s, i))

    def current_index(self):
        """The running layer, or ``None`` (outside any layer, or on another thread)."""
        if not self.active or threading.get_ident() != self._owner:
            return None
        return self.current

    # ----------------------------------------------------------------- hooks
    def _hook_pre(self, i):
        def pre(module, args):
            if not self.active or threading.get_ident() != self._owner:
                return None
            self._stack.append(self.current)
            self.current = i
            s = self.step
            if s is not None and s.timed and torch.is_grad_enabled():
                s.called[i] = True
                self._note_devices(args)
                s.input_bytes[i] = max(s.input_bytes[i], sum(
                    t.numel() * t.element_size() for t in _tensors(args)))
                s._wstall0[i] = self.stats.write_stall_seconds
                x = _first_grad_tensor(args)
                if x is not None:
                    s.grad_in[i] = True
                    x.register_hook(self._on_bwd_end(s, i))
                elif not s.grad_in[i] and not any(h[0] == i for h in s._handles):
                    # NOTE [ Timing backward with tensor hooks ]: no input gradient;
                    # the end is the last of the layer's parameter gradients.
                    for p in module.parameters():
                        if p.requires_grad and p.is_leaf:
                            s._handles.append((i, p.register_post_accumulate_grad_hook(
                                self._on_param_grad(s, i))))
                # Copies (to compare values) only until the layer's updates are known.
                self._buffers0[i] = buffer_state(module, clone=self.updates[i] is None)
                s._fwd_t0[i] = self._now()
            return None
        return pre

    def _hook_post(self, i):
        def post(module, args, output):
            if not self.active or threading.get_ident() != self._owner:
                return None
            self.current = self._stack.pop() if self._stack else None
            boundary = self.boundary
            if boundary is not None and torch.is_grad_enabled():
                boundary(i, False)
                y = _first_grad_tensor(output)
                if y is not None:
                    y.register_hook(self._boundary_hooks[i])
            s = self.step
            if s is not None and s.timed and torch.is_grad_enabled():
                s.fwd_s[i] += self._now() - s._fwd_t0[i] - \
                    (self.stats.write_stall_seconds - s._wstall0[i])
                state, self._buffers0[i] = self._buffers0.get(i), None
                if state:
                    self.note_updates(i, updated_buffers(state))
                y = _first_grad_tensor(output)
                if y is not None:
                    s.has_bwd[i] = True
                    y.register_hook(self._on_bwd_begin(s, i))
            return None
        return post

    def _on_boundary(self, i):
        def hook(grad):  # layer i's backward begins: its output's gradient is complete
            boundary = self.boundary
            if boundary is not None:
                boundary(i, True)
            return None
        return hook

    def _on_bwd_begin(self, s, i):
        def hook(grad):
            if s.bwd_begin[i] is None:
                s.bwd_begin[i] = self._now()
                s._rstall0[i] = self.stats.stall_seconds
                if not s._bwd_seen:  # the first layer backward reaches: the head ends
                    s._bwd_seen = True
                    s.head_stall = self.stats.stall_seconds - s.stall_at_fwd_end
                    self._on_backward_done(s)
            return None
        return hook

    def _on_backward_done(self, s):
        """Note when the running backward pass ends (NOTE [ The end of backward ])."""
        def done():
            s.bwd_done = self._now()
        try:
            torch.autograd.Variable._execution_engine.queue_callback(done)
        except RuntimeError:  # not inside a backward pass the engine runs: no end to note
            pass

    def _on_bwd_end(self, s, i):
        def hook(grad):
            if s.bwd_end[i] is None and s.bwd_begin[i] is not None:
                s.bwd_end[i] = self._now()
                s.bwd_s[i] = s.bwd_end[i] - s.bwd_begin[i] - \
                    (self.stats.stall_seconds - s._rstall0[i])
            return None
        return hook

    def _on_param_grad(self, s, i):
        def hook(param):
            # Each of the layer's parameter gradients moves the end; the last one wins.
            if s.bwd_begin[i] is not None and not s.grad_in[i]:
                s.bwd_end[i] = self._now()
                s.bwd_s[i] = s.bwd_end[i] - s.bwd_begin[i] - \
                    (self.stats.stall_seconds - s._rstall0[i])
        return hook

    # ---------------------------------------------------------------- results
    def timed_samples(self):
        return list(self.profiled)

    def restart(self):
        """Forget the timed steps: the next ``profile_steps`` steps are timed again."""
        self.profiled = []
        self.profiled_rc = []

    def ready(self) -> bool:
        """Whether ``profile_steps`` timed steps have completed (a step is complete once
        its backward has passed every layer and the next forward has begun)."""
        return len(self.timed_samples()) >= self.profile_steps

    def costs(self):
        """``(layers, step_parts)`` from the timed steps: per layer the smallest time seen
        (the first step pays one-time costs) and the largest byte counts.

        ``step_parts`` is a dict with ``fwd_other_s``, ``bwd_head_s``, ``tail_s``,
        ``between_s`` (NOTE [ The end of backward ]), ``fwd_s_per_byte``,
        ``bwd_s_per_byte`` and ``untracked_bytes``.

        Raises:
            ValueError: no timed step has completed.
        """
        samples = self.timed_samples()
        if not samples:
            raise ValueError("no timed step has completed")
        layers = []
        saved = [max(s.saved_bytes[i] for s in samples) for i in range(len(self.names))]
        f_off = [max(0.0, min(s.fwd_s[i] for s in samples)) for i in range(len(self.names))]
        b_off = [max(0.0, min(s.bwd_s[i] for s in samples)) for i in range(len(self.names))]
        fwd_per_byte = bwd_per_byte = 0.0
        f, b = f_off, b_off
        rc_bytes = [max((s.recompute_bytes[i] for s in self.profiled_rc), default=0)
                    for i in range(len(self.names))]
        if self.profiled_rc:  # NOTE [ Pure compute times ]
            rc = self.profiled_rc
            f_rc = [max(0.0, min(s.fwd_s[i] for s in rc)) for i in range(len(self.names))]
            b_rc = [max(0.0, min(s.bwd_s[i] for s in rc) - f_rc[i])
                    for i in range(len(self.names))]
            # Compute alone is never slower than compute beside I/O: where the one
            # recompute-all step was disturbed, the offloaded profile bounds it.
            f = [min(x, y) for x, y in zip(f_rc, f_off)]
            b = [min(x, y) for x, y in zip(b_rc, b_off)]
            total = sum(saved)
            if total > 0:
                fwd_per_byte = max(0.0, sum(f_off) - sum(f)) / total
                bwd_per_byte = max(0.0, sum(b_off) - sum(b)) / total
        for i, name in enumerate(self.names):
            layers.append(LayerCost(
                name=name, saved_bytes=saved[i],
                input_bytes=max(s.input_bytes[i] for s in samples),
                fwd_s=f[i], bwd_s=b[i], recompute_bytes=rc_bytes[i],
                updates=tuple(self.updates[i] or ())))
        fwd_other, head, tail, between = [], [], [], []
        for s in samples:
            fwd_total = s.fwd_end - s.begin - (s.fwd_stall_end - s.wstall_begin)
            fwd_other.append(fwd_total - sum(s.fwd_s))
            # Layers whose output needs no grad have no backward (NOTE [ Timing backward
            # with tensor hooks ]): the head ends where the first layer backward begins,
            # the rest of the step starts where the last one ends.
            head.append(min(b for b in s.bwd_begin if b is not None) - s.fwd_end - s.head_stall)
            # NOTE [ The end of backward ]: the rest of backward, then what the loop does
            # until the next forward (unknown end: all of it is the rest of backward).
            last = max(e for e in s.bwd_end if e is not None)
            end = s.bwd_done if s.bwd_done is not None and s.bwd_done >= last else None
            tail.append((end if end is not None else s.begin + s.period) - last)
            between.append(0.0 if end is None else s.begin + s.period - end)
        parts = dict(fwd_other_s=max(0.0, min(fwd_other)), bwd_head_s=max(0.0, min(head)),
                     tail_s=max(0.0, min(tail)), between_s=max(0.0, min(between)),
                     fwd_s_per_byte=fwd_per_byte,
                     bwd_s_per_byte=bwd_per_byte,
                     untracked_bytes=max(s.untracked_bytes for s in samples))
        return layers, parts


def measure_bandwidth(store, nbytes=64 << 20, repeats=2):
    """Time writes and reads of ``nbytes`` through the store's engine and spill file.

    One slot of the first spill file, written from and read into a page-aligned
    buffer, ``repeats`` times; the best of each is kept (the others met noise). The
    store's probe makes the requests (``Probe.time_io`` in _store/probe.py): they own their
    buffer and slot, so a request still running after ``io_timeout_s`` never writes into
    freed memory or a reused slot (NOTE [ Memory owned by requests ] in _store/store.py).

    Returns:
        ``(write_bytes_per_s, read_bytes_per_s)``.

    Raises:
        SpillIOError: a request failed or did not end within ``io_timeout_s``.
    """
    write_s, read_s = store.probe.time_io(nbytes, repeats)
    return nbytes / max(write_s, 1e-9), nbytes / max(read_s, 1e-9)


def step_cost(parts, write_bps, read_bps, cfg) -> StepCost:
    """The :class:`StepCost` of a profile (``LayerProfiler.costs()[1]``) on this machine."""
    # Outside the layers (head, loss): held only from the end of forward until the
    # head's backward, the kept tail and the rest read back through the prefetch
    # window (NOTE [ Memory timeline ] in _policies/costmodel.py).
    untracked = parts["untracked_bytes"]
    fixed = 0
    return StepCost(write_bps=write_bps, read_bps=read_bps, fwd_other_s=parts["fwd_other_s"],
                    bwd_head_s=parts["bwd_head_s"], tail_s=parts["tail_s"],
                    between_s=parts.get("between_s", 0.0),
                    prefetch_bytes=cfg.prefetch_bytes,
                    write_behind_bytes=cfg.write_behind_bytes, fixed_bytes=fixed,
                    fwd_s_per_byte=parts.get("fwd_s_per_byte", 0.0),
                    bwd_s_per_byte=parts.get("bwd_s_per_byte", 0.0),
                    head_bytes=untracked, keep_tail_bytes=cfg.keep_tail_bytes,
                    host_budget_bytes=cfg.host_budget_bytes or 0)
