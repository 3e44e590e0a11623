"""Per-layer keep / offload / recompute for one Offloader: profile, plan, apply, re-plan.

:class:`LayerPolicy` is what :meth:`Offloader.track` installs. It owns the
:class:`~ssdtrain._profile.LayerProfiler` (module hooks), and with
``policy="adaptive"`` it plans once the first ``profile_steps`` steps are
measured, applies the plan from the next forward on, and re-plans when a step
stalls on I/O (NOTE [ Re-planning ]). The store asks it, per new record, what
to do with the bytes of the running layer (:meth:`LayerPolicy.choice`).

NOTE [ Applying a plan ]

* ``keep``: the layer's records are created KEPT: never written, served from
  memory in backward (deduplication and version checks as usual).
* ``offload``: the layer's records go through the ``keep_tail_bytes`` window as
  under the static rules (the planner's memory timeline counts that rolling tail,
  NOTE [ Memory timeline ]), so the all-offload plan runs exactly like the static
  policy but for the write-behind limit: forward waits for writes once more than
  the plan's ``write_behind_bytes`` are in flight, so that forward's memory stays
  within the budget even when the disk is slower than predicted. (Writing them at
  once, as an earlier version did, wrote and read back the tail static keeps:
  more I/O than static for the same choices.)
* ``recompute``: the layer's ``forward`` is replaced, on the instance, by one
  that runs the original through ``torch.utils.checkpoint(use_reentrant=False)``
  while the offloader's forward is open. Checkpointing installs its own
  saved-tensor hooks inside the layer, and the innermost hooks win (NOTE [
  Innermost hooks win ] in docs/ARCHITECTURE.md): nothing the layer saves reaches
  ssdtrain, and backward
  recomputes it. What does reach ssdtrain is the layer's *inputs*, which
  checkpoint saves (``save_inputs``) outside its own hooks: they are offloaded
  like an offloaded layer's bytes. Tests check both (tests/test_track.py).
  A layer whose forward updates buffers is recomputed without a second update
  (NOTE [ Recompute without a second update ]).

NOTE [ Recompute without a second update ]

A recomputed layer's forward runs twice: in forward, and again in backward.
What it does besides computing its outputs would then happen twice: BatchNorm
and InstanceNorm (``track_running_stats``) update ``running_mean``,
``running_var`` and ``num_batches_tracked`` again, a module counting its calls
counts two. Gradients would still be equal; the trained model would not. So
the checkpoint of a recomputed layer gets a ``context_fn`` (:class:`_StateGuard`):

* around the forward it notes every buffer of the layer (the tensor and its
  version counter) and clones those the layer is known to update
  (``LayerProfiler.updates``, learned from earlier forwards; every buffer until
  one forward of the layer has been seen); after it, the buffers it updated are
  those known to be, and those replaced, with another version counter, or
  (while nothing is known, when every buffer was cloned) with another value:
  batch norm's kernels update the running statistics without bumping their
  version counter, and a comparison of a known one would wait for the device
  every step. They are learned, and the clones of the others dropped;
* around the recompute, each updated buffer's entry in its module's
  ``_buffers`` is replaced by a fresh copy of its value *before* the forward,
  and the real tensor is put back afterwards (also when the recompute stops
  early or raises). The recompute computes from what the forward saw, and its
  update goes to the copy: the real buffers keep exactly the forward's one
  update, their version counters untouched. A second backward over the same
  graph (``retain_graph=True``) recomputes from a fresh copy again.

Randomness is the checkpoint's: ``preserve_rng_state`` replays the forward's
CPU and device RNG states in the recompute and restores the current ones after
it, so dropout draws the same masks and the RNG stream moves as without
ssdtrain. A buffer a layer updates only on some calls, first updated on a call
whose forward did not clone it, is recomputed from a copy of its current
value (no second update either; a layer whose training output reads such a
buffer would recompute other values) and cloned from then on; if such a late
update leaves the version counter as it was (a kernel like batch norm's), it is
not seen at all. State that is not
a buffer (a Python attribute) is not seen. The plan table names the layers that
update buffers and what their choice does about it (``LayerCost.updates``).
``tests/test_recompute_state.py`` compares the whole ``state_dict``, the RNG
state and eval outputs with a run without ssdtrain over BatchNorm1d/2d/3d,
SyncBatchNorm on one rank, InstanceNorm with running statistics and a counter,
under every kind of plan.

Records outside every tracked layer (embedding, head, loss) follow the static
rules (the ``keep_tail_bytes`` window, then offload).

NOTE [ Re-planning ]

The plan predicts each step's stalls. When a step with the plan applied
stalled for more than ``replan_stall_fraction`` of its duration and more than
predicted, the disk is slower than the probe said (other I/O, CPU contention):
both bandwidths are scaled by ``io / (io + excess)`` (``io``: the predicted I/O
time of the step, ``excess``: stall seen minus stall predicted) and the plan
is made again, at most ``_MAX_REPLANS`` times.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch.utils.checkpoint import checkpoint

from ._errors import ConfigError, SSDTrainError
from ._planner import (CHOICES, KEEP, OFFLOAD, RECOMPUTE, LayerCost, Plan, StepCost, plan,
                       predict, throttled_step)
from ._profile import (LayerProfiler, buffer_slots, buffer_state, measure_bandwidth, step_cost,
                       updated_buffers)

__all__ = ["LayerPolicy"]

log = logging.getLogger("ssdtrain")

_MISSING = object()
_MAX_REPLANS = 8


class LayerPolicy:
    """Layer scopes of one offloader and, with ``policy="adaptive"``, the plan in force.

    Args:
        store: the offloader's store (its engine and spill files are probed).
        cfg: the :class:`~ssdtrain.OffloadConfig`.
        stats: the offloader's :class:`~ssdtrain.Stats`.
        layers: ``(name, module)`` pairs in forward order.
    """

    def __init__(self, store, cfg, stats, layers):
        self.store, self.cfg, self.stats = store, cfg, stats
        self.profiler = LayerProfiler(layers, stats, cfg.profile_steps)
        self.adaptive = cfg.policy == "adaptive"
        self.plan = None            # the plan in force (adaptive), or None
        self.choices = None
        self.bandwidth = None       # measured (write, read) bytes/s, probed once
        self.scale = 1.0            # correction of the bandwidths from observed stalls
        self.replans = 0
        self.history = []           # (reason, Plan) of every plan put in force
        self._wrapped = {}          # layer index -> the instance `forward` it replaced
        self._plan_id = 0
        self._rc_tries = 0
        self._step_plan = {}        # id(StepSample) -> plan id in force during it
        self._warned = set()        # reasons already warned about (once each)
        self.last_incomplete = None  # why the latest timed step was not a complete profile

    # ------------------------------------------------------------- store side
    def choice(self):
        """What the store does with a new record: ``"keep"``, ``"offload"`` or ``None``
        (the static rules: outside every layer, or no plan in force)."""
        if self.choices is None:
            return None
        i = self.profiler.current_index()
        if i is None:
            return None
        return KEEP if self.choices[i] == KEEP else OFFLOAD  # recompute: only its inputs come

    def attribute(self, nbytes):
        self.profiler.attribute(nbytes)

    # ----------------------------------------------------------- step events
    def begin_step(self):
        prof = self.profiler
        closed = prof.close_step()
        if closed is not None and closed.timed and not closed.complete:
            self._incomplete(closed)
        timed, recompute = not prof.ready(), False
        if self.adaptive:
            if self.plan is None and prof.ready():
                if not prof.profiled_rc and self._rc_tries < 2:
                    # One step with every layer recomputed (NOTE [ Pure compute times ]).
                    self._set_wrappers((RECOMPUTE,) * len(prof.modules))
                    self.choices = (RECOMPUTE,) * len(prof.modules)
                    self._rc_tries += 1
                    timed = recompute = True
                else:
                    self._make_and_apply("profiled")
            elif self.plan is not None:
                self._check_stalls()
        prof.open_step(timed=timed, recompute=recompute)
        if self.plan is not None:
            self._step_plan[id(prof.step)] = self._plan_id
            self._step_plan = {k: v for k, v in self._step_plan.items()
                               if k in {id(s) for s in prof.samples} | {id(prof.step)}}

    def end_forward(self):
        self.profiler.end_forward()

    def _incomplete(self, sample):
        """A timed step closed without a complete profile: say why, once per reason."""
        prof = self.profiler
        reason = sample.missing(prof.names)
        self.last_incomplete = reason
        if not self.adaptive or reason in self._warned:
            return
        self._warned.add(reason)
        if "did not run" in reason:
            fix = ("track only layers every training forward runs, with grad enabled: "
                   "track(model, layers=[...])")
        elif "no tracked layer" in reason:
            fix = ("run training forwards (grad enabled, a loss that depends on the tracked "
                   "layers), or track the layers that train")
        else:
            fix = ("run each forward's backward before the next forward begins (one "
                   "`with offloader:` forward, then loss.backward(), per step), or track "
                   "only layers whose outputs reach the loss")
        kind = "recompute-all profile step" if sample.recompute else "profiled step"
        log.warning("ssdtrain: policy='adaptive': a %s is incomplete: %s. No plan is made "
                    "until %d complete profiled step(s) are seen (%d so far), so "
                    "memory_budget_bytes=%s is not applied until then. Fix: %s.",
                    kind, reason, self.cfg.profile_steps, len(prof.timed_samples()),
                    self.cfg.memory_budget_bytes, fix)

    # ------------------------------------------------------------------ plans
    def _step_cost(self):
        layers, parts = self.profiler.costs()
        if self.bandwidth is None:
            self.bandwidth = measure_bandwidth(self.store)
            log.info("ssdtrain: engine bandwidth %.2f GB/s write, %.2f GB/s read (probe)",
                     self.bandwidth[0] / 1e9, self.bandwidth[1] / 1e9)
        w, r = self.bandwidth
        return layers, step_cost(parts, w * self.scale, r * self.scale, self.cfg)

    def make_plan(self):
        """A plan from the profile and the budget (``None`` budget: no limit); not applied.

        Raises:
            SSDTrainError: the profile is not complete yet.
        """
        if not self.profiler.ready():
            raise SSDTrainError(
                f"ssdtrain: no plan yet: the first {self.cfg.profile_steps} step(s) after "
                f"track() are profiled, and a step is complete when the next forward begins "
                f"({len(self.profiler.timed_samples())} complete so far"
                + ("" if self.last_incomplete is None else
                   f"; the latest profiled step was incomplete: {self.last_incomplete}")
                + "). Run more steps, then call plan() again.")
        layers, step = self._step_cost()
        return plan(layers, self.cfg.memory_budget_bytes, step)

    def set_choices(self, choices):
        """Apply ``choices`` (one per layer) as a plan, predicted when the profile is ready."""
        choices = tuple(choices)
        bad = [c for c in choices if c not in CHOICES]
        if bad:
            raise ConfigError(f"ssdtrain: plan choices must be among {CHOICES}, got {bad[0]!r}.")
        if len(choices) != len(self.profiler.modules):
            raise SSDTrainError(f"ssdtrain: {len(choices)} plan choices for "
                                f"{len(self.profiler.modules)} tracked layers "
                                f"({', '.join(self.profiler.names)}).")
        budget = self.cfg.memory_budget_bytes
        if self.profiler.ready():
            layers, step = self._step_cost()
            notes = ("Set by set_plan().",)
        else:
            layers = tuple(LayerCost(n, 0, 0, 0.0, 0.0, updates=tuple(u or ()))
                           for n, u in zip(self.profiler.names, self.profiler.updates))
            step = StepCost(write_bps=1.0, read_bps=1.0, prefetch_bytes=self.cfg.prefetch_bytes,
                            write_behind_bytes=self.cfg.write_behind_bytes)
            budget = None
            notes = ("Set by set_plan() before the profile was complete: no prediction.",)
        step = throttled_step(layers, choices, step, budget)
        pred = predict(layers, choices, step)
        p = Plan(tuple(layers), choices, pred, budget, step,
                 budget is None or pred.peak_bytes <= budget, 0, notes)
        self.apply(p)
        self.history.append(("set_plan", p))
        if not p.fits:
            log.warning("ssdtrain: the plan set by set_plan() is predicted to hold %d bytes of "
                        "activations, over memory_budget_bytes=%d; it is applied as given. "
                        "Offload or recompute more layers, or raise the budget.",
                        p.prediction.peak_bytes, budget)
        return p

    def _make_and_apply(self, reason):
        p = self.make_plan()
        self.apply(p)
        self.history.append((reason, p))
        log.info("ssdtrain: plan (%s):\n%s", reason, p.table())
        if not p.fits:
            log.warning("ssdtrain: no plan keeps activations within memory_budget_bytes=%d "
                        "(least possible: %d predicted); using the plan with the least memory. "
                        "Raise the budget or lower the micro-batch.",
                        self.cfg.memory_budget_bytes, p.prediction.peak_bytes)

    def _check_stalls(self):
        samples = self.profiler.samples
        if not samples or self.replans >= _MAX_REPLANS:
            return
        last = samples[-1]
        if self._step_plan.get(id(last)) != self._plan_id or not last.period:
            return
        pred = self.plan.prediction
        excess = last.stall_s - pred.stall_s
        if last.stall_s <= self.cfg.replan_stall_fraction * last.period or excess <= 0:
            return
        step = self.plan.step
        io = pred.written_bytes / step.write_bps + pred.written_bytes / step.read_bps
        if io <= 0:
            return
        self.scale *= io / (io + excess)
        self.replans += 1
        self._make_and_apply(f"re-plan {self.replans}: step stalled {last.stall_s * 1e3:.0f} ms "
                             f"of {last.period * 1e3:.0f} ms, {pred.stall_s * 1e3:.0f} ms "
                             f"predicted; disk bandwidths scaled by {self.scale:.3f}")

    def apply(self, p):
        """Put plan ``p`` in force from the next forward on (NOTE [ Applying a plan ])."""
        if len(p.choices) != len(self.profiler.modules):
            raise SSDTrainError(f"ssdtrain: a plan for {len(p.choices)} layers cannot apply to "
                                f"{len(self.profiler.modules)} tracked layers.")
        self._set_wrappers(p.choices)
        self.plan, self.choices = p, tuple(p.choices)
        self.store.limit_write_behind(p.write_behind_bytes)
        self._plan_id += 1

    def _set_wrappers(self, choices):
        for i, c in enumerate(choices):
            if c == RECOMPUTE and i not in self._wrapped:
                self._wrap(i)
            elif c != RECOMPUTE and i in self._wrapped:
                self._unwrap(i)

    def _wrap(self, i):
        module = self.profiler.modules[i]
        previous = module.__dict__.get("forward", _MISSING)
        inner = module.forward
        profiler = self.profiler

        def forward(*args, **kwargs):
            if profiler.active and torch.is_grad_enabled():
                guard = _StateGuard(profiler, i, module)  # NOTE [ Recompute without a second update ]
                measure = profiler.recompute_context(i)  # NOTE [ Measuring a recompute ]
                return checkpoint(inner, *args, use_reentrant=False,
                                  context_fn=lambda: guard.contexts(measure), **kwargs)
            return inner(*args, **kwargs)

        forward.__ssdtrain_recompute__ = True
        # Recorded before installed, removed after restored: an interrupt between the two
        # leaves a record that remove() undoes, never a wrapper it does not know about.
        self._wrapped[i] = previous
        module.forward = forward

    def _unwrap(self, i):
        module = self.profiler.modules[i]
        previous = self._wrapped[i]
        if previous is _MISSING:
            module.__dict__.pop("forward", None)
        else:
            module.forward = previous
        del self._wrapped[i]

    def remove(self):
        """Undo everything: module hooks, recompute wrappers."""
        for i in list(self._wrapped):
            self._unwrap(i)
        self.profiler.remove()
        self.plan = self.choices = None
        self.store.limit_write_behind(None)


class _StateGuard:
    """The buffers of one checkpointed call of a recomputed layer: noted (and cloned)
    around its forward, swapped for copies around its recompute (NOTE [ Recompute
    without a second update ]).

    Args:
        profiler: the :class:`~ssdtrain._profile.LayerProfiler` (``updates`` is read
            and learned).
        index: the layer's index.
        module: the layer module.
    """

    def __init__(self, profiler, index, module):
        self.profiler, self.index, self.module = profiler, index, module
        self.before = {}    # qualified name -> clone of the value before forward
        self.updated = []   # (qualified name, owner module, local name) forward updated

    def contexts(self, measure=None):
        """``(forward context, recompute context)`` for checkpoint's ``context_fn``;
        ``measure``: the profiler's ``context_fn`` (NOTE [ Measuring a recompute ]) or None."""
        fwd, rc = (contextlib.nullcontext(), contextlib.nullcontext()) if measure is None \
            else measure()
        return self._forward(fwd), self._recompute(rc)

    @contextlib.contextmanager
    def _forward(self, inner):
        known = self.profiler.updates[self.index]
        state = buffer_state(self.module, clone=True if known is None else known.__contains__)
        self.before = {q: c for q, _, _, _, _, c in state if c is not None}
        try:
            with inner:
                yield
        finally:
            names = updated_buffers(state, known or ())
            self.profiler.note_updates(self.index, names)
            updated = set(names)
            self.updated = [slot for slot in buffer_slots(self.module) if slot[0] in updated]
            self.before = {q: c for q, c in self.before.items() if q in updated}

    def _recompute(self, inner):
        return _Swapped(self, inner)


class _Swapped:
    """The recompute context of a :class:`_StateGuard`; entered once per recompute
    (checkpoint enters the same object again when a second backward recomputes)."""

    def __init__(self, guard, inner):
        self.guard, self.inner = guard, inner
        self.swapped = []

    def __enter__(self):
        copies = {}
        swapped = self.swapped = []
        try:
            for q, owner, name in self.guard.updated:
                real = owner._buffers[name]
                # Forward's starting value, or (not cloned: see the NOTE) the current one.
                source = self.guard.before.get(q, real)
                copy = copies.get(id(source))
                if copy is None:
                    copy = copies[id(source)] = source.detach().clone()
                swapped.append((owner, name, real))
                owner._buffers[name] = copy
            self.inner.__enter__()
        except BaseException:
            self._restore()
            raise
        return self

    def __exit__(self, *exc):
        try:
            return self.inner.__exit__(*exc)
        finally:
            self._restore()

    def _restore(self):
        swapped, self.swapped = self.swapped, []
        for owner, name, real in reversed(swapped):
            owner._buffers[name] = real
