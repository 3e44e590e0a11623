"""Per-layer keep / offload / recompute for one Offloader: profile, plan, apply, re-plan.

:class:`LayerPolicy` is what :meth:`Offloader.track` installs. It owns the
:class:`~ssdtrain._policies.profile.LayerProfiler` (module hooks), and with
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
is made again, at most ``_MAX_REPLANS`` times (memory re-plans included, NOTE [
Measured memory ]).

NOTE [ Measured memory ]

The plan's peak is a prediction; the policy never lets it pass unchecked. While
a plan is in force under a budget (``memory_budget_bytes``: ``policy="adaptive"``,
or a plan set with ``set_plan``), every step measures what ssdtrain holds at the
moments the planner's memory timeline counts (NOTE [ Memory timeline ] in
_policies/costmodel.py): when each tracked layer's forward ends, at the end of forward, and
when each tracked layer's backward begins (a hook on the layer's output;
``LayerProfiler.boundary``). What it holds there is the bytes of its records in
memory (``Offloader.resident_bytes()``) plus the host memory the store has let go
of and not yet released (its graveyard, NOTE [ Store lock discipline ] in
_store/store.py), taken before the release below. A recomputed layer's working set is
held by checkpoint, not by ssdtrain: when its backward begins, what the
recompute-all profile step measured for it (``LayerCost.recompute_working_bytes``,
as the planner counts it) is added to what is held after the release. The largest
sample is the step's peak (``Stats.budget_measured_bytes``); at the end of the
step's backward, and again when the next forward begins, it is compared with the
budget:

* over it: ``Stats.budget_exceeded_bytes`` keeps the largest overshoot, and one
  warning per offloader gives the budget, the peak, the overshoot, the plan and its
  prediction, what ssdtrain does about it and what the user can do;
* with ``policy="adaptive"``, when the plan was predicted to fit and the step held
  more than predicted, the model missed bytes (a record the throttle or the
  prefetch window let past its limit, records the model does not place, memory let
  go of late): the difference is counted as held whatever the plan
  (``StepCost.fixed_bytes``, the plan table says so) and the plan is made again, at
  most ``_MAX_REPLANS`` times in all. The margin only grows, so plans do not flip
  back and forth. When no plan fits any more, the plan with the least memory is
  used and that is said as at any plan (``_make_and_apply``).

Not measured: what the budget does not count (docs/planner.md), a recompute's
working set in this step (the profiled one stands in), and moments between the
boundaries (the model's moments are the boundaries too; the prefetch window and the
throttle may pass their limits by a record between them).

Late frees: the store releases a host record's memory on its I/O thread, after the
record is freed. On a loaded machine that thread may not run for a while, and memory
the model counts as free stays allocated: on the accelerator emulator the head's
6 MiB of records stayed alive through the layers' backward, and a plan predicted at
41.0 MiB held 45.1 (docs/accelerator_regime.md). So at each boundary, once measured,
the policy applies the releases autograd has queued (``Store._settle``) and
releases what the I/O thread has not yet (``Store._bury``) on the training thread
(or autograd's): every layer starts with what the model says is held. It costs the
training thread only where the I/O thread lagged (the frees it would have done), and
nothing for device records, which the store frees in place.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging

import torch
from torch.utils.checkpoint import checkpoint

from .._errors import ConfigError, SSDTrainError
from .costmodel import (CHOICES, KEEP, OFFLOAD, RECOMPUTE, LayerCost, StepCost, predict,
                        throttled_step)
from .planner import Plan, plan
from .layers import buffer_slots, buffer_state, updated_buffers
from .profile import LayerProfiler, measure_bandwidth, step_cost

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
        # NOTE [ Measured memory ]
        self.margin = 0             # bytes steps held beyond the predictions: counted as held
        self._checked = None        # (plan, budget) the running step is checked against
        self._held = 0              # the running step's measured peak so far
        self._end_queued = False    # the end-of-backward check is queued
        self._budget_warned = False

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
        self._check_budget()  # the step that ends (NOTE [ Measured memory ])
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
                if not self._check_memory():
                    self._check_stalls()
        prof.open_step(timed=timed, recompute=recompute)
        budget = self.cfg.memory_budget_bytes
        # NOTE [ Measured memory ]: every step a plan runs under a budget is measured.
        checked = (self.plan, budget) if self.plan is not None and budget is not None and \
            not recompute else None
        self._checked, self._held, self._end_queued = checked, 0, False
        prof.boundary = None if checked is None else self._boundary
        if self.plan is not None:
            self._step_plan[id(prof.step)] = self._plan_id
            self._step_plan = {k: v for k, v in self._step_plan.items()
                               if k in {id(s) for s in prof.samples} | {id(prof.step)}}

    def end_forward(self):
        if self.profiler.boundary is not None:
            self._boundary(None, False)
        self.profiler.end_forward()

    # ------------------------------------------------- NOTE [ Measured memory ]
    def _held_now(self):
        """What ssdtrain holds now: its records in memory and what it let go of but has
        not released."""
        return self.store.held_bytes()

    def _boundary(self, i, backward):
        """A layer boundary of a measured step (layer ``i``'s forward ended, or its backward
        begins, or ``i`` None: forward ended): sample what ssdtrain holds, then release what
        the I/O thread has not yet. When layer ``i``'s backward begins the step's check
        is queued for the end of the backward pass, and a recomputed layer's working set
        is added to what is held after the release (NOTE [ Measured memory ])."""
        held = self._held_now()
        if held > self._held:
            self._held = held
        if self._release_dropped() and backward:
            held = self._held_now()
        if backward:
            p = self._checked[0] if self._checked is not None else None
            if p is not None and p.choices[i] == RECOMPUTE:
                held += p.layers[i].recompute_working_bytes
                if held > self._held:
                    self._held = held
        if backward and not self._end_queued:
            try:
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            except RuntimeError:  # not inside a backward the engine runs: begin_step checks
                return
            self._end_queued = True

    def _release_dropped(self):
        """Apply the releases autograd has queued and release the memory the store let go
        of, here, where the I/O thread has not yet (NOTE [ Measured memory ]: late
        frees). Whether there was anything to do."""
        return self.store.release_dropped()

    def _end_of_backward(self):
        self._end_queued = False
        self._check_budget()

    def _check_budget(self):
        """Compare the running step's measured peak with the budget: Stats, and one
        warning per offloader when it is over. Idempotent (the end of backward and the
        next forward's beginning both call it)."""
        if self._checked is None:
            return
        p, budget = self._checked
        held, stats = self._held, self.stats
        stats.budget_measured_bytes = held
        over = held - budget
        if over <= 0:
            return
        stats.budget_exceeded_bytes = max(stats.budget_exceeded_bytes, over)
        if self._budget_warned:
            return
        self._budget_warned = True
        pred = p.prediction.peak_bytes
        if not p.fits:
            then = ("No plan is predicted to fit the budget: this is the plan with the least "
                    "memory.")
        elif self.adaptive and held > pred and self.replans < _MAX_REPLANS:
            then = (f"ssdtrain re-plans with the {_size(held - pred)} the prediction missed "
                    f"counted as held.")
        elif self.adaptive:
            then = "ssdtrain does not re-plan for it (re-plans used up, or none would help)."
        else:
            then = "The plan was set with set_plan() and stays in force."
        log.warning(
            "ssdtrain: memory_budget_bytes=%d (%s) was exceeded: a step held %s of saved "
            "activations at its peak, %s over the budget, under the plan in force (%s; "
            "predicted peak %s). %s Measured at each tracked layer's boundary: records in "
            "memory, memory let go of but not yet released, and a recomputed layer's working "
            "set as profiled; Stats.budget_exceeded_bytes keeps the largest overshoot (warned "
            "once). To stay within the budget: plan against a budget lower by the overshoot "
            "(keep it as a reserve), lower prefetch_bytes or write_behind_bytes (bytes held in "
            "flight), raise the budget if the device has room, or lower the micro-batch.",
            budget, _size(budget), _size(held), _size(over), _choices_label(p.choices),
            _size(pred), then)

    def _check_memory(self):
        """At the beginning of a step: check the step that ended, and re-plan with what it
        held beyond the prediction counted as held (NOTE [ Measured memory ]). Whether it
        re-planned."""
        checked = self._checked
        if checked is None or not self.adaptive or checked[0] is not self.plan:
            return False
        p, budget = checked
        pred = p.prediction.peak_bytes
        if self._held <= budget or not p.fits or self._held <= pred or \
                self.replans >= _MAX_REPLANS:
            return False
        missed = self._held - pred
        self.margin += missed
        self.replans += 1
        self._make_and_apply(f"re-plan {self.replans}: a step held {_size(self._held)}, over "
                             f"the budget of {_size(budget)}; the plan predicted {_size(pred)}: "
                             f"{_size(missed)} more counted as held from now on")
        return True

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
        step = step_cost(parts, w * self.scale, r * self.scale, self.cfg)
        if self.margin:  # NOTE [ Measured memory ]
            step = dataclasses.replace(step, fixed_bytes=step.fixed_bytes + self.margin)
        return layers, step

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
        return self._noted(plan(layers, self.cfg.memory_budget_bytes, step))

    def _noted(self, p):
        """``p`` with a note of the margin its predictions include, if any."""
        if not self.margin:
            return p
        return dataclasses.replace(p, notes=p.notes + (
            f"Every predicted peak includes {_size(self.margin)} that earlier steps "
            f"held beyond their plan's prediction (NOTE [ Measured memory ]).",))

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
        p = self._noted(Plan(tuple(layers), choices, pred, budget, step,
                             budget is None or pred.peak_bytes <= budget, 0, notes))
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
        self._checked = None
        for i in list(self._wrapped):
            self._unwrap(i)
        self.profiler.remove()
        self.plan = self.choices = None
        self.store.limit_write_behind(None)


def _size(n):
    """``n`` bytes for a message: GiB, MiB or KiB to two decimals, else bytes."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _choices_label(choices):
    """``"keep, recompute x3, ..."``: a plan's choices, runs of one choice counted."""
    out = []
    for c, run in itertools.groupby(choices):
        n = len(list(run))
        out.append(c if n == 1 else f"{c} x{n}")
    return ", ".join(out)


class _StateGuard:
    """The buffers of one checkpointed call of a recomputed layer: noted (and cloned)
    around its forward, swapped for copies around its recompute (NOTE [ Recompute
    without a second update ]).

    Args:
        profiler: the :class:`~ssdtrain._policies.profile.LayerProfiler` (``updates`` is read
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
