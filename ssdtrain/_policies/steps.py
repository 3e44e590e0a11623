"""Policies as types: what each ``policy`` does at a step's boundaries.

NOTE [ Step policies ]

An :class:`~ssdtrain.Offloader` holds one :class:`StepPolicy`, made from its config
(:func:`step_policy`), and asks it, and nothing else, at each boundary of a step:

* ``begin_step(training)``, before the pass opens: the step's
  :class:`~ssdtrain._decision.policy.StepLimits`, which the store gets with the pass
  (``Store.begin_pass``). ``training`` is whether grad mode is on: a pass without it
  (evaluation) saves nothing for backward and is no step of a policy that measures.
* ``intercepts`` and ``may_cut``, as interception begins: whether the step's saves go
  through the hooks at all, and whether the hooks may come off past the window (NOTE [
  Hooks off past the window ] in _policies/auto.py).
* ``forward_raised(exc)``, when the step's forward raised; ``end_forward()``, when the
  pass closes.

``"static"`` has no limits of its own (its tail window decides) and tells once when the
SSD is the step's bottleneck (``StallWatch``); ``"auto"`` is the quota controller
(``AutoQuota``, NOTE [ The offload quota ]); ``"adaptive"`` has no step limits either:
its plan decides per layer (``LayerPolicy``, through ``Offloader.track``, which any
policy may use). A fourth policy is a fourth class here; the Offloader's interrupt-safe
phase code does not change.
"""

from __future__ import annotations

from .auto import AutoQuota
from .stall import StallWatch
from .._config import MAX_BYTES
from .._decision.policy import NO_LIMITS, StepLimits

__all__ = ["StepPolicy", "StaticSteps", "AutoSteps", "AdaptiveSteps", "step_policy",
           "standing_write_behind"]


class StepPolicy:
    """A policy with no per-step limits of its own (NOTE [ Step policies ]): every
    boundary does nothing, every step intercepts, none is cut."""

    #: the quota controller, for a policy that has one (tools and tests read it)
    controller = None

    @property
    def intercepts(self) -> bool:
        return True

    @property
    def may_cut(self) -> bool:
        return False

    def begin_step(self, training: bool) -> StepLimits:
        return NO_LIMITS

    def forward_raised(self, exc, out_of_memory: bool) -> None:
        pass

    def end_forward(self) -> None:
        pass


class StaticSteps(StepPolicy):
    """``policy="static"``: the tail window decides every record; once, a warning when
    the SSD is the step's bottleneck (:class:`~ssdtrain._policies.stall.StallWatch`)."""

    def __init__(self, stats, warn):
        self._stats = stats
        self.stalls = StallWatch(warn)

    def begin_step(self, training: bool) -> StepLimits:
        self.stalls.begin_step(self._stats)
        return NO_LIMITS


class AdaptiveSteps(StepPolicy):
    """``policy="adaptive"``: no step limits; its plan decides per layer (``_adaptive``)."""


class AutoSteps(StepPolicy):
    """``policy="auto"`` (the default): each training step's quota, memory floor,
    write-behind limit and prefetch window from the quota controller (NOTE [ The offload
    quota ] in _policies/auto.py).

    Args:
        controller: the quota controller, an :class:`~ssdtrain._policies.auto.AutoQuota`.
        settle: settles what ended since backward, before a step's measurements are
            taken (a copy the hooks started is settled by a poll only, NOTE [ Copies
            the hooks start ] in _device/transfers.py, and one still counted in flight would read
            as a lag).
        write_behind_bytes, prefetch_bytes: the config's.
        no_limit: the write-behind limit of a step that does not wait for writes.
    """

    def __init__(self, controller: AutoQuota, settle, write_behind_bytes: int,
                 prefetch_bytes: int, no_limit: int):
        self.controller = controller
        self._settle = settle
        self._write_behind = write_behind_bytes
        self._prefetch = prefetch_bytes
        self._no_limit = no_limit
        self.training = False  # the pass open (or last opened) is a step of the quota

    @property
    def intercepts(self) -> bool:
        return self.controller.intercepts

    @property
    def may_cut(self) -> bool:
        return self.controller.may_cut

    def begin_step(self, training: bool) -> StepLimits:
        # A pass with grad mode off (evaluation) saves nothing for backward: not a step of
        # the quota, whose S and times it would take as a training step's.
        self.training = training
        if not training:
            return NO_LIMITS
        auto = self.controller
        self._settle()
        quota = auto.begin_step()  # may probe the disk, once: before the pass opens
        # The sizing step (no quota), and every step under a memory floor, wait for
        # writes past write_behind_bytes as "static" does (NOTE [ The offload quota ]).
        return StepLimits(quota=quota, floor=0 if quota is None else auto.floor,
                          write_behind=self._write_behind if auto.waits_for_writes
                          else self._no_limit, window=auto.window(self._prefetch))

    def forward_raised(self, exc, out_of_memory: bool) -> None:
        """An out-of-memory error is a measurement (NOTE [ The offload quota ], step 0),
        taken before it propagates, so that the next step offloads enough to fit."""
        if self.training and out_of_memory:
            self.controller.out_of_memory()

    def end_forward(self) -> None:
        self.controller.end_forward()


def standing_write_behind(config):
    """The write-behind limit a store of ``config`` stands by between steps' own limits
    (``Store(write_behind=...)``): none under ``policy="auto"``, whose forward waits for
    writes only where a step's limits say so (NOTE [ The offload quota ] in _policies/auto.py),
    else ``None`` (the config's ``write_behind_bytes``)."""
    return MAX_BYTES if config.policy == "auto" else None


def step_policy(config, store, stats, warn) -> StepPolicy:
    """The :class:`StepPolicy` of ``config.policy`` for an offloader whose store is
    ``store`` (a resolved config; ``warn`` logs a warning)."""
    if config.policy == "static":
        return StaticSteps(stats, warn)
    if config.policy == "adaptive":
        return AdaptiveSteps()
    host = config.host_budget_bytes
    controller = AutoQuota(
        config.max_slowdown,
        (lambda nbytes: store.probe.time_io(nbytes, repeats=2)) if store.spill.files else None,
        stats, window_bytes=config.prefetch_bytes, tail_bytes=config.keep_tail_bytes,
        copy_probe=None if host is None else
        (lambda nbytes: store.probe.time_copies(nbytes, repeats=2)),
        host_bytes=host or 0, sync=store.probe.synchronize_devices, headroom=store.headroom,
        write_behind_bytes=config.write_behind_bytes, warn=warn, outbound=store.outbound_bytes)
    store.on_backward_end = controller.end_backward
    return AutoSteps(controller, store.settle, config.write_behind_bytes,
                     config.prefetch_bytes, MAX_BYTES)
