"""The default policy, ``"auto"``: offload what the disk can absorb in time, keep the rest.

This module holds its quota controller, :class:`AutoQuota`, and the NOTEs below; the
quota's pure arithmetic is in _policies/quota.py, the static policy's
:class:`StallWatch` in _policies/stall.py (both names imported here too).

NOTE [ The offload quota ]

With ``policy="auto"`` (the default) each step (a forward pass and everything until the
next one begins) runs with an offload *quota*: a byte count fixed when the step begins.
A pass opened with grad mode off (evaluation under ``torch.no_grad()`` or
``torch.inference_mode()``) saves nothing for backward and is no step: it neither ends
the running step nor begins one (its S of 0 and its forward-only time would set the
next quota to 0 and the baseline step time below any training step's). Its records are
decided as the static policy decides them (NOTE [ The pack decision ] in
``_decision/policy.py``), except that once the bytes decided to be written would exceed the quota,
every later record of the step is kept in memory (``KEEP_QUOTA``; a new storage is then
kept without becoming a record at all, counted as one: NOTE [ The pack decision ], so a
step past its quota costs little more than one without ssdtrain). So the earliest
records are the ones written: backward needs them last, so their reads have the most
time. Within a step the decision is a pure function of the saves, the configuration
and the quota; the quota changes only between steps, from what earlier steps measured.
Unless memory needs it (step 0 below), the store never makes forward wait for a write
under ``"auto"`` (the ``write_behind_bytes`` throttle is off): a write the disk has not
finished leaves its record in memory, which is what keeping it would have cost, and
shows up as a measurement instead.

How the quota is chosen (:class:`AutoQuota`, pure parts :func:`quota_bound`,
:func:`slowed`, :func:`next_scale`):

0. *Fit first.* The first step (``SIZING_STEPS``) has no quota: it offloads every
   eligible tensor and waits for writes as ``"static"`` does, so a model that fits
   with ssdtrain fits from its first step. At the end of every forward the memory the
   saved tensors live in is read (:meth:`Store.headroom`: the device's free memory,
   the caching allocator's unused blocks included, or the host's available memory
   within the process's own cgroup, NOTE [ Memory limits ] in _limits.py, plus the
   bytes whose write or copy out is decided but not ended, which leave
   memory without the floor's help; :meth:`Probe.headroom` in _store/probe.py): a step
   that offloaded ``o`` bytes and left ``free`` of ``total`` could have kept
   ``free - MEMORY_RESERVE * total`` (10%) more, so every later step offloads at least
   ``o + MEMORY_RESERVE * total - free``, and where that is above 0
   ``write_behind_bytes`` more (the throttle, on again under a floor, lets that much
   be in flight, in memory still): the *memory floor*. The store writes a step's
   records until the floor is reached, the one that crosses it included
   (``TailWindow.begin_step``'s ``at_least``): the quota's rule alone, the records that
   fit, could leave every step one record short of it. It only rises (memory
   taken later, an optimizer's state at its first step, stays taken). While it is
   above 0, forward waits for writes past ``write_behind_bytes`` again (the floor's
   bytes must leave memory, not only be decided: :attr:`AutoQuota.waits_for_writes`),
   and a quota the bandwidth bound below would put lower is raised to it, the reason
   saying that the step may then take longer than the margin (and, the first time, a
   warning logged: the policy cannot keep the margin, and says so).
   *Out of memory is a measurement too.* A forward that raises an out-of-memory error
   (``torch.OutOfMemoryError``, CUDA's or the loopback device's; the CPU allocator's
   refusal; ``MemoryError``), seen by ``with offloader:``, ``intercept()`` or an
   attached module's call before the error propagates
   (``Offloader._forward_raised``), makes the next step size again
   (:meth:`AutoQuota.out_of_memory`): it offloads every eligible tensor, as the first
   step did, and its forward's end raises the floor. Neither step counts toward the
   phases below, is judged, or is a baseline; a log line says what happened each time
   (and, when the step that ran out was itself a sizing step, that even offloading
   everything does not fit). The failing step's own forward end, which saw no free
   memory, raised the floor already, but from the bytes it had offloaded when it
   failed: not enough (the next step would run out too).
1. *Baseline.* The next ``BASELINE_STEPS`` steps offload nothing (quota 0, or the
   floor) and
   measure the forward time ``F``, the step time ``T`` (see "A step's time" below) and the
   bytes the step saves that could be offloaded (``S``, after dedup). ``F`` is the
   fastest forward seen since, in every step (one-time costs of the first steps do not
   count); ``T`` is the median of recent steps that wrote nothing ("Judging under
   noise" below). On a device (kernels are asynchronous: the host's clock sees
   their launches) the baseline steps begin and end their forward with a wait for the
   device (:meth:`Probe.synchronize_devices`): ``F`` is the least share of a step
   such a forward took, times ``T`` (the step time, begin to next begin, is the
   device's in a steady state; a forward not waited for measured kernel launches).
2. *Tiers.* Once, after the baseline, :meth:`Probe.time_io` writes and reads a probe of
   ``S / 8`` bytes (between 8 and 64 MiB), best of two: write bandwidth ``W``, read
   bandwidth ``R`` (one request at a time: a low estimate). This happens in the
   offloader's ``__enter__``, before the step's clock starts. With a host tier
   (``host_budget_bytes``), :meth:`Probe.time_copies` times as many bytes copied device
   -> pinned and back on the copy streams, once a device tensor has been saved (host
   records never enter the host tier); without a ``spill_dir`` it is the only tier.
3. *Bound.* Writes of the quota must end within forward (else their memory is not
   freed when forward's peak comes), ``Q <= W * F``; the reads must end by the end of
   backward, ``Q <= R * (T - F + m * T)`` with ``m = max_slowdown``, and they start
   only once backward has used all but ``prefetch_bytes`` of the kept records: the
   records kept for want of quota fill the prefetch window as the kept tail does (else
   the reads would bring the written bytes back while the kept ones are still held,
   and the step's peak would be no lower), which with backward using the step's
   bytes evenly gives ``Q * (1 - R * B / S) <= R * B * prefetch_bytes / S + R * m * T``
   (``B = T - F``; no limit when ``R * B >= S``); and ``Q <= S``. The bound is
   ``SAFETY`` (0.8) times the least of these (:func:`quota_bound`). With a host tier,
   the same bound with the copies' bandwidths, but no more than the host budget plus
   the SSD's bound (0 without a ``spill_dir``): what overflows RAM goes on to the disk.
4. *Feedback.* The quota is ``scale * bound``, ``scale`` starting at
   ``START_SCALE`` (0.5). A step is *slowed* when it waited on I/O (read stalls and
   write waits) for more than ``m * T`` or took more than ``(1 + m) * T`` plus the
   baseline's noise (CPU or memory contention from the I/O shows only there; see
   "Judging under noise" below), or when its writes *lagged*
   (:func:`lagged`: more than ``LAG_SHARE``, a quarter, of the bytes it decided to
   write were still in flight or due when the next step began, or were freed
   unwritten, ``Stats.unwritten_bytes``: nothing waits for a write, so a disk that
   slowed down after the probe shows in memory, not in time; the first such step is
   said once, a warning): ``scale`` halves. A step that
   wrote nothing is not judged (its time owes nothing to the disk). Otherwise it
   grows by ``STEP_UP`` (0.25) up to ``MAX_SCALE`` (1.5: the probe's bandwidth is a low
   estimate, and the feedback is what holds the margin), but for ``PROBE_HOLD`` (8)
   judged steps after a slowed one no higher than 0.9 of the scale that slowed it:
   climbing straight back would pay the cost every other step (half the judged steps
   over a cost knee, against a quarter with the hold, in the simulated world of
   tests/test_default_policy.py). A quota below ``MIN_SHARE``
   (1/16) of ``S`` is not worth what it costs (each write takes CPU and the GIL from the
   step, and saves almost nothing): it is raised to that share while the bound allows,
   and once two steps in a row at that share were slowed (one may be noise) it is 0
   (nothing written, nothing judged) for ``RETRY_STEPS`` (100) steps, then tried again. It is never more than ``S``
   less ``keep_tail_bytes``: under a quota the tail window keeps nothing (each record is
   decided as it is saved, ``TailWindow.begin_step``), so the quota keeps the step's end.
5. *Hooks off.* A step at quota 0 with no floor, once the tiers are measured, does not
   intercept its saved tensors at all (:attr:`AutoQuota.intercepts`;
   ``Offloader._hook_on`` pushes no hooks, unless another pair of saved-tensor hooks is
   on the thread's stack, which ours would have shadowed): passing them through would
   cost the hooks' Python per saved tensor (pack and unpack) and buy nothing. Such a
   step counts nothing in :class:`~ssdtrain.Stats`, so its ``S`` is the last
   intercepted step's, and every ``RETRY_STEPS``-th such step intercepts again to count
   it. Its forward's end still reads the memory (step 0), so a step that stops fitting
   raises the floor, and the next step intercepts.

*Judging under noise.* Step times move for reasons of their own (a shared machine, data
of varying length), often by more than the margin. So a step is compared with steps
that wrote nothing, timed alike, and recent (:class:`Baseline`): the baseline steps,
*control steps* and steps whose quota wrote nothing. A control step offloads only the
floor (0 without one) and is not judged; one runs after every ``CONTROL_FIRST`` (2)
judged steps until the baseline holds ``BASE_WINDOW`` (7) steps, then after every
``CONTROL_EVERY`` (16): about 6% of the steps (they keep in memory what the quota
would have written). ``T``
is the median of the last ``BASE_WINDOW`` of them (the faster of two before there are
three), so one slow or fast step moves it not at all, where the fastest step seen
would have been a lucky one. A step's time reads as slowed only past the median plus
the margin plus the spread of those steps, ``(1 + m) * T + (slowest - fastest)``, and
not at all before there are ``NOISE_MIN`` (5) of them (the waits on I/O and the lag
still judge it). On a quiet machine the spread is 0 and the margin is exact; where the
noise is larger than the margin, a cost smaller than the noise cannot be told from it
by time. The spread, not the slowest step's excess over the median: seven steps rarely
catch the top of the noise, and the window changes slowly (a control step every 16),
so an unlucky window read the top of the noise as cost step after step (in the
simulated world below, 10 of 300 worlds at 5% noise, five of them giving up
entirely). Measured with a simulated world (tests/test_default_policy.py, 300 seeded
worlds each): with step times moving by up to 5% either way and offloading free, the
quota averages at least 0.6 of the most the feedback reaches in 298 of 300, and at 8%
at least a quarter in 297; the fastest of two early steps left it below 0.15 in most
worlds at 5%.

*A step's time* is from its forward's begin to the end of the last backward that used
what it intercepted (the store's end-of-backward callback, :meth:`AutoQuota.end_backward`;
every intercepting step queues it, tensors passed through included), so the optimizer
step, evaluation, logging and data loading between steps do not count, and with
gradient accumulation each micro-batch is timed alone (the last one's optimizer step is
not its). Where no backward end was seen (a step that intercepted nothing, step 5) or on
a device (the host's clock sees a backward's launches, not its kernels) it runs to the
next step's begin. Under pipeline schedules that interleave micro-batches (1F1B) the
backward that ends after a step's forward may be an earlier micro-batch's; the step is
then timed to it, the same way in the baseline and in the steps judged.

So ``"auto"`` first makes the steps fit (as ``"static"`` would: its first step is
``"static"``'s), and within that never makes a step slower than ``1 + max_slowdown``
times its time at the floor (without ssdtrain, where the floor is 0). The sizing step
costs what a ``"static"`` step costs, once. A step whose
time varies for reasons of its own (data of varying length) reads as slowed now and
then, which only lowers the quota. ``Stats.offload_quota_bytes`` and
``Stats.offload_quota_reason`` show the quota in force and why.

NOTE [ Hooks off past the window ]

The quota is a prefix of the step's saves. Once it is spent, every later save is
passed through (NOTE [ The pack decision ] in _decision/policy.py), and each still costs the
training thread autograd's call into our pack hook, the pass-through's bookkeeping, and
in backward the unpack hook: on an H200 at 1/16 of a ~1B GPT's bytes, 470 of its 481
saved tensors, and forward became launch-bound (docs/results/gpu_trace_2026-11-28.md).
What those passes still buy is the prefetch window's accounting: passed bytes fill the
window from forward's end, so that loads start when backward has used all but the
window's bytes of them (``RecordTable.count_passed``; the window is ``prefetch_bytes``
or the step's lead, NOTE [ Loads in time ]). Only the first window's bytes passed after
the quota matter to that: backward uses the later ones first, while the window is full
anyway.

So once the running pass has passed through the window's bytes after its quota was
spent (``Store.cut_after``), the pack hook that crossed it takes our hooks off this
thread's stack for the rest of the forward (``Offloader._cut``: ``ForwardState.
pop_if_top``, then the module-state tracker stops). Autograd saves what follows itself,
as without ssdtrain: no hook call, no record, no count, its own version checks, and
loads start at the same point of backward as before. Popping inside a pack is safe:
autograd holds its own references to the pair whose pack it is calling. Armed only
where it changes nothing else:

* ``policy="auto"`` with a quota (not the sizing step, whose ``"static"`` rules need
  every record) and no per-layer plan (``track``, whose bookkeeping needs records);
* nothing under our hooks on the stack when they were pushed: popping ours would hand
  the rest of the forward to that pair (a ``save_on_cpu`` around the step), which ours
  shadowed;
* only on the thread that intercepts and only while ours are on top (a spy wrapped
  around the store's hooks, or another pair pushed inside, stays untouched);
* once a step before counted all it saved: a cut step counts only what it intercepted
  (``Stats`` says how many steps were cut, ``hooks_cut_steps``), so its ``S`` is the
  last full step's, and after ``RECOUNT_STEPS`` (16) cut steps in a row one runs with
  the hooks to its end to count ``S`` again.

A storage offloaded before the cut and saved again after it stays alive through the
later save until backward uses it, as it would without ssdtrain: its record is still
written and read, and only the bytes the quota meant to free at that boundary stay.

NOTE [ Loads in time ]

The quota's records are the step's earliest, so backward needs them last, and the
prefetch window starts their loads once backward has used all but the window's bytes
of what the step kept (NOTE [ Prefetch window ] in _store/prefetch.py). With a window of
``prefetch_bytes`` (256 MiB) that is too late when the loads take longer than backward
needs to use those bytes: on an H200 at 1/16 of a ~1B GPT's 10 GiB, the 630 MiB came
back from pinned RAM in the last 11 ms of backward and backward idled 5.9 ms waiting
for them; at 1/4, 29.9 ms (docs/results/gpu_trace_2026-11-28.md).

So under ``"auto"`` each step's window (:meth:`AutoQuota.window`, ``StepLimits.window``,
``Stats.prefetch_window_bytes``) leads the loads by the time they take. With ``Q`` the
quota, ``S`` the step's saved bytes, ``B`` backward's time (the baseline's step less its
forward) and ``L`` the loads' time (``Q`` from RAM at the measured copy rate up to the
host budget, the rest from the SSD at its read rate), backward uses ``S / B`` bytes a
second; while it uses the quota's own ``Q`` bytes the loads have ``Q / (S / B)`` of
their ``L``, so the rest must come before: the window is the bytes backward uses in
``LEAD_MARGIN`` (1.5) times ``L - Q B / S``, at least ``prefetch_bytes``, at most
``S - Q``. That bound keeps the step's peak: the window counts the kept bytes backward
has not used plus the loads ahead of use, so memory during backward never holds more
than the ``S - Q`` bytes forward's end held (a step's gradients grow meanwhile, as
without ssdtrain; loads that finish earlier in backward overlap a little more of that
growth). Where nothing is measured (the sizing and baseline steps, no quota) or the
loads keep up, the window is ``prefetch_bytes``. The hooks come off past the same
window (NOTE [ Hooks off past the window ]), so its bytes are still seen. A larger
window on the SSD tier maps more read buffers (idle ones are still kept within
``prefetch_bytes``). ``tools.set_load_lead(off, False)`` keeps ``prefetch_bytes``, for
measurements.

The bound (NOTE [ The offload quota ], step 3) counts on the same lead: with the
window at its cap, loads start as backward does, and they keep up exactly when
``Q / R <= B`` (``R`` the read rate), which is the bound's read term without a window
(``quota_bound(window_bytes=None)``); with a fixed window of ``prefetch_bytes`` the
quota had to leave time for loads that start late, and on the H200 the bound the copies
allowed was far below what they could carry.
"""

import math
import time
from typing import Callable, Optional, Tuple

from .quota import (BASE_WINDOW, LAG_SHARE, MAX_SCALE, NOISE_MIN, SAFETY, STEP_UP, Baseline,
                    MiB, StepSample, lagged, next_scale, probe_bytes, quota_bound, slowed)
from .stall import StallWatch  # the static policy's (tests import it from here)

__all__ = ["AutoQuota", "StallWatch", "StepSample", "quota_bound", "slowed", "lagged",
           "next_scale", "probe_bytes", "SIZING_STEPS", "BASELINE_STEPS", "MEMORY_RESERVE", "SAFETY",
           "START_SCALE", "STEP_UP", "MAX_SCALE", "MIN_SHARE", "RETRY_STEPS", "LAG_SHARE",
           "CONTROL_EVERY", "CONTROL_FIRST", "BASE_WINDOW", "NOISE_MIN", "PROBE_HOLD",
           "Baseline"]

# The controller's own settings; the pure parts' (SAFETY, STEP_UP, MAX_SCALE, LAG_SHARE,
# BASE_WINDOW, NOISE_MIN) are in quota.py.
SIZING_STEPS = 1       # steps that first offload every eligible tensor (as "static")
BASELINE_STEPS = 2     # steps then measured without offloading (or at the memory floor)
MEMORY_RESERVE = 0.1   # of the memory's total: left free at forward's end by the floor
START_SCALE = 0.5      # the first quota's share of the bound
RECOUNT_STEPS = 16     # steps cut in a row before one counts all it saves again
LEAD_MARGIN = 1.5      # the lead loads get over their time (NOTE [ Loads in time ])
MIN_SHARE = 1 / 16     # a quota below this share of a step's bytes is not worth its cost
RETRY_STEPS = 100      # steps at quota 0 (below MIN_SHARE) before trying MIN_SHARE again
CONTROL_EVERY = 16     # judged steps between two control steps (at the floor, or 0)...
CONTROL_FIRST = 2      # ... while the baseline holds fewer than BASE_WINDOW steps
PROBE_HOLD = 8         # judged steps the scale stays under 0.9 x one that slowed a step


class AutoQuota:
    """The quota controller of ``policy="auto"`` (NOTE [ The offload quota ]).

    Args:
        max_slowdown: the margin (``OffloadConfig.max_slowdown``).
        probe: ``nbytes -> (write_s, read_s)``, the store's SSD probe; None: no SSD tier.
        stats: the offloader's :class:`~ssdtrain.Stats` (read for stalls and saved bytes,
            written for the quota in force).
        clock: seconds, monotonic (tests pass their own).
        window_bytes: the prefetch window (``prefetch_bytes``), see :func:`quota_bound`.
        tail_bytes: ``keep_tail_bytes``: the quota never takes a step's last ones.
        copy_probe: ``nbytes -> (d2h_s, h2d_s)`` or None (no device seen yet), the host
            tier's probe (:meth:`Probe.time_copies`); None: no host tier.
        host_bytes: the host tier's budget (``host_budget_bytes``).
        sync: waits for the devices' queued work; whether there was a device (the
            baseline steps' forward is timed with it, step 1).
        write_behind_bytes: the write throttle's limit, in force under a floor.
        headroom: ``() -> (free, total)`` bytes of the memory the saved tensors live in
            (:meth:`Store.headroom`), read at each forward's end: the memory
            floor.
        warn: called once (a message) the first time the memory floor is above what the
            tiers absorb in time, so steps may be slower than ``max_slowdown`` allows, and
            once the first time the tiers fall behind a step's writes (:func:`lagged`):
            the policy cannot do what was asked, and says so (None: nobody is told).
        outbound: ``() -> bytes`` decided to be written whose write has not ended (in
            flight or due; the store's, read without its lock), read when a step begins:
            a step's lag (None: not measured).
    """

    def __init__(self, max_slowdown: float,
                 probe: Optional[Callable[[int], Tuple[float, float]]], stats,
                 clock: Callable[[], float] = time.perf_counter,
                 window_bytes: Optional[int] = None, tail_bytes: int = 0,
                 copy_probe: Optional[Callable[[int], Optional[Tuple[float, float]]]] = None,
                 host_bytes: int = 0, sync: Optional[Callable[[], bool]] = None,
                 headroom: Optional[Callable[[], Optional[Tuple[int, int]]]] = None,
                 write_behind_bytes: int = 0, warn: Optional[Callable[[str], None]] = None,
                 outbound: Optional[Callable[[], int]] = None):
        self.max_slowdown = max_slowdown
        self.window_bytes = window_bytes
        self.tail_bytes = tail_bytes
        self._probe = probe
        self._copy_probe = copy_probe
        self.host_bytes = host_bytes
        self._stats = stats
        self._clock = clock
        self._sync = sync
        self._headroom = headroom
        self.write_behind_bytes = write_behind_bytes
        self._warn = warn
        self._outbound = outbound
        self.told_floor = False           # warned that the floor is above the time bound
        self.told_lag = False             # warned that the tiers fell behind the writes
        self._oom = False                 # the running step's forward ran out of memory
        self._resize = False              # ... so the next step sizes again
        self.pinned = None                # a quota fixed by ssdtrain.tools.pin_auto_quota
        self._counted = 0                 # steps that count toward sizing and baseline
        self._room = None                 # headroom at the running step's forward end
        self.floor = 0                    # the least quota that fits (the memory floor)
        self._floor_text = ""
        self._synced = False              # the running step's forward end was synchronized
        self._device_timed = False        # some forward was timed on a device: only such count
        self._forward_share = 1.0         # least share of a step its timed forward took
        self.samples = []                 # StepSample of every step measured
        self.write_bps: Optional[float] = None       # the SSD tier (probe)
        self.read_bps: Optional[float] = None
        self.copy_write_bps: Optional[float] = None  # the host tier (copy_probe)
        self.copy_read_bps: Optional[float] = None
        self.base_forward_s = math.inf
        self.base_step_s = math.inf
        self.scale = START_SCALE
        self.bound = 0
        self.quota = 0
        self.reason = ""
        self._slowed = None               # whether the last step measured was slowed
        self.baseline = Baseline()        # NOTE [ The offload quota ], "Judging under noise"
        self._judged = 0                  # steps judged since the last control step
        self._ceiling = math.inf          # the scale's cap after a slowed step, for ...
        self._hold = 0                    # ... this many more judged steps
        self._control = False             # the running step is a control step
        self._control_next = False        # ... the one being chosen
        self._idle = 0                    # steps in a row with the quota below MIN_SHARE
        self._given_up = False            # a quota of MIN_SHARE slowed a step: 0 for a while
        self._slowed_at_least = 0         # steps in a row at MIN_SHARE that were slowed
        self.intercepts = True            # the running step's saved tensors are intercepted
        self.cut = False                  # ... until its hooks came off (Offloader._cut)
        self._cut_steps = 0               # steps cut since the last that counted all
        self.cuts = True                  # tools.set_hooks_cut: whether steps may be cut
        self.leads = True                 # tools.set_load_lead: whether loads may lead
        self._saved = 0                   # S of the last step that intercepted
        self._begin = None                # the running step: clock at begin, at end of forward
        self._end = None
        self._back_end = None             # ... and at the last backward end after that
        self._counters = None             # (stall, saved, offloaded, unwritten) at its begin

    def _read_counters(self):
        s = self._stats
        return (s.stall_seconds + s.write_stall_seconds, s.unique_bytes, s.offloaded_bytes,
                s.unwritten_bytes)

    def end_forward(self) -> None:
        """Forward of the running step ended (the first end counts)."""
        if self._begin is not None and self._end is None:
            if self._sync is not None and self._in_baseline():
                self._synced = self._sync()   # the kernels' end, not their launch
            self._end = self._clock()
            if self._headroom is not None:
                self._room = self._headroom()

    def end_backward(self) -> None:
        """A backward that used the running step's saved tensors ended (the store's
        end-of-backward callback): once the step's forward has ended, the step's time
        ends here, not when the next step begins (NOTE [ The offload quota ], "A step's
        time"). The last such end before the next step counts."""
        if self._end is not None:
            self._back_end = self._clock()

    def begin_step(self) -> Optional[int]:
        """A step begins: measure the one before, choose this one's quota and return it
        (None: the sizing step's, no quota)."""
        now = self._clock()
        if self._begin is not None:
            stall, saved, offloaded, unwritten = self._read_counters()
            end = self._end if self._end is not None else now
            # Its backward's end, on a host; the next begin where none was seen (a step
            # that intercepted nothing) or on a device, whose host clock sees launches.
            on_device = self._device_timed or self._synced
            stop = now if self._back_end is None or on_device else self._back_end
            if self.intercepts and not self.cut:  # a cut step counted a part
                self._saved = saved - self._counters[1]
            if self.intercepts:
                self._cut_steps = self._cut_steps + 1 if self.cut else 0
            lag = unwritten - self._counters[3]
            if self._outbound is not None:
                lag += self._outbound()
            self._observe(StepSample(step_s=stop - self._begin, forward_s=end - self._begin,
                                     stall_s=stall - self._counters[0],
                                     saved_bytes=self._saved, quota=self.quota,
                                     offloaded_bytes=offloaded - self._counters[2],
                                     room=self._room, lag_bytes=lag,
                                     out_of_memory=self._oom, intercepted=self.intercepts,
                                     control=self._control))
        self._control_next = False
        self.cut = False
        self.quota, self.reason = self._choose()
        self._control = self._control_next
        self.intercepts = self._intercepts()
        if not self.intercepts:
            self.reason += ("; this step's saved tensors are not intercepted (nothing to "
                            "offload: the hooks would only cost time)")
        self._stats.offload_quota_bytes = self.quota
        self._stats.offload_bound_bytes = None if self.quota is None else int(self.bound)
        self._stats.offload_quota_reason = self.reason
        if self._sync is not None and self._in_baseline():
            self._sync()             # a baseline step begins once the device is idle
        self._end = self._back_end = None
        self._synced = False
        self._room = None
        self._oom = False
        counters = self._read_counters()
        begin = self._clock()  # after the probe: it is not the step's time
        # The running step's begin and its counters in one line of stores, no call
        # (NOTE [ Interrupt-safe allocation ] in io/spill.py): an interrupt in this method
        # leaves the step before running (a sample of two steps, once), never one
        # without the other.
        self._begin, self._counters = begin, counters
        return self.quota

    def out_of_memory(self) -> None:
        """The running step's forward raised an out-of-memory error (the offloader calls
        this before the error propagates): the step is no measurement of time, and the
        next one sizes again (NOTE [ The offload quota ], step 0), offloading every
        eligible tensor, as the first step did; its forward's end sets the memory floor
        anew. Said each time (a log line): the step the user sees fail is explained."""
        self._oom, self._resize = True, True
        if self._warn is not None:
            self._warn(
                "ssdtrain: the forward ran out of memory " +
                ("while offloading every eligible tensor (the sizing step, as policy='static' "
                 "does): the step does not fit even so; a smaller micro-batch, "
                 "keep_tail_bytes=0, host_budget_bytes or policy='adaptive' with "
                 "memory_budget_bytes (recompute) are the ways on." if self.quota is None else
                 f"with policy='auto''s quota of {self.quota / MiB:.1f} MiB (what the step "
                 f"offloads at most{'' if self.intercepts else '; this step intercepted nothing'}"
                 f"); the next step "
                 f"offloads every eligible tensor, as the first step did, and measures the "
                 f"memory floor again (NOTE [ The offload quota ])."))

    @property
    def waits_for_writes(self) -> bool:
        """Whether the running step must make forward wait for writes past
        ``write_behind_bytes``, as ``"static"`` does: the sizing step, and every step once
        memory sets a floor (the floor's bytes must leave memory to fit, not only be
        decided)."""
        return self.quota is None or self.floor > 0

    def window(self, prefetch_bytes: int) -> int:
        """The running step's prefetch window (NOTE [ Loads in time ]): ``prefetch_bytes``,
        or the bytes backward uses while the step's loads take longer than backward's part
        that needs them, with a margin, up to the bytes it keeps at forward's end."""
        q, s = self.quota or 0, self._saved
        back = self.base_step_s - self.base_forward_s
        w = prefetch_bytes
        if self.leads and 0 < q < s and math.isfinite(back) and back > 0:
            host = min(q, self.host_bytes) if self.copy_read_bps else 0
            disk = q - host
            if disk and not self.read_bps:
                disk = 0  # nothing measured for the disk: what the host tier gives
            load_s = host / self.copy_read_bps if host else 0.0
            load_s += disk / self.read_bps if disk else 0.0
            rate = s / back                      # saved bytes backward uses per second
            lead_s = load_s - q / rate           # loads' time past the records' own part
            if lead_s > 0:
                w = max(w, min(s - q, int(LEAD_MARGIN * lead_s * rate)))
        self._stats.prefetch_window_bytes = w
        return w

    @property
    def may_cut(self) -> bool:
        """Whether the running step's hooks may come off once its quota is spent (NOTE [
        Hooks off past the window ]): it has a quota, a step before counted all it saved,
        and fewer than ``RECOUNT_STEPS`` steps in a row were cut since."""
        return self.cuts and self.quota is not None and self._saved > 0 and \
            self._cut_steps < RECOUNT_STEPS

    def _intercepts(self) -> bool:
        """Whether the beginning step needs the hooks (NOTE [ The offload quota ], step 5):
        not at quota 0 with no floor once the tiers are measured, except every
        ``RETRY_STEPS``-th such step, which counts the bytes a step saves again."""
        return not (self.quota == 0 and self.floor == 0
                    and self._counted >= SIZING_STEPS + BASELINE_STEPS
                    and (self.write_bps is not None or self.copy_write_bps is not None)
                    and self._idle % RETRY_STEPS != 0)

    def _in_baseline(self) -> bool:
        """Whether the running (or beginning) step is a baseline step."""
        return SIZING_STEPS <= self._counted < SIZING_STEPS + BASELINE_STEPS

    def _observe(self, sample: StepSample) -> None:
        n = self._counted
        measured = n >= SIZING_STEPS + BASELINE_STEPS
        self.samples.append(sample)
        self._raise_floor(sample)
        if sample.out_of_memory or (sample.quota is None and n >= SIZING_STEPS):
            # A step that ran out of memory, or the one sized again after it (step 0):
            # neither counts toward the phases, nor is judged, nor is a baseline.
            if not sample.out_of_memory:
                self._resize = False
            self._slowed = None
            return
        self._counted = n + 1
        if n < SIZING_STEPS:  # it offloaded everything: its times are no baseline
            self._slowed = None
            return
        # Only a step that wrote something is judged: one whose records all stayed in
        # memory (the kept tail took them) was not slowed by ssdtrain's I/O. A control
        # step is not judged: it measures the baseline.
        if measured and sample.offloaded_bytes > 0 and not sample.control:
            self._judged += 1
            self._slowed = slowed(sample, self.base_step_s, self.max_slowdown,
                                  self.baseline.noise_s)
            was = self.scale
            self.scale = next_scale(was, self._slowed)
            # After a slowed step the scale climbs back to just under the one that slowed
            # it, and stays there for PROBE_HOLD judged steps before it probes above:
            # probing every other step would pay the cost every other step.
            if self._slowed:
                self._ceiling, self._hold = 0.9 * was, PROBE_HOLD
            elif self._hold > 0:
                self._hold -= 1
                if self._hold == 0:
                    self._ceiling = math.inf
            self.scale = min(self.scale, self._ceiling)
            if lagged(sample) and not self.told_lag:
                self.told_lag = True
                if self._warn is not None:
                    self._warn(
                        f"ssdtrain: policy='auto' decided to write "
                        f"{sample.offloaded_bytes / MiB:.1f} MiB in a step and "
                        f"{sample.lag_bytes / MiB:.1f} MiB of its writes had not landed when "
                        f"the next step began: the tiers took less than they measured (a disk "
                        f"or link slowed down, or shared). Records whose writes wait stay in "
                        f"memory, at most write_behind_bytes in flight, and the quota is "
                        f"lowered until the writes keep up. (Said once per Offloader; "
                        f"Stats.unwritten_bytes counts writes dropped because their graph "
                        f"was freed first, Stats.offload_quota_reason each step's reason.)")
        else:
            self._slowed = None
        # The baseline: steps that wrote nothing, timed as the judged ones are (NOTE
        # [ The offload quota ], "Judging under noise").
        if not measured or sample.control or (sample.offloaded_bytes == 0 and
                                              sample.intercepted):
            self.baseline.add(sample.step_s)
            self.base_step_s = self.baseline.step_s
        # On a device, only a forward whose end was synchronized (a baseline step's)
        # measured the kernels, the others their launches: forward's least share of such
        # a step, of the baseline step time.
        if self._synced:
            self._device_timed = True
            self._forward_share = min(self._forward_share,
                                      sample.forward_s / max(sample.step_s, 1e-9))
        if self._device_timed:
            self.base_forward_s = self.base_step_s * self._forward_share
        else:
            self.base_forward_s = min(self.base_forward_s, sample.forward_s)

    def _raise_floor(self, sample: StepSample) -> None:
        """The memory floor (NOTE [ The offload quota ], step 0): a step that offloaded
        ``o`` bytes and left ``free`` of ``total`` at its forward's end could have kept
        ``free - MEMORY_RESERVE * total`` more; the next steps offload at least the rest,
        and ``write_behind_bytes`` besides: under a floor the throttle is on again, and
        lets that much be in flight, still in memory. It only rises (memory taken later,
        an optimizer's state, stays taken)."""
        if sample.room is None:
            return
        free, total = sample.room
        need = int(sample.offloaded_bytes + MEMORY_RESERVE * total - free)
        if need > 0:
            need += self.write_behind_bytes
        if need > self.floor:
            self.floor = need
            self._floor_text = (
                f"at least {need / MiB:.1f} MiB, the memory floor: a forward that offloaded "
                f"{sample.offloaded_bytes / MiB:.1f} MiB left {free / MiB:.1f} MiB of "
                f"{total / MiB:.1f} MiB free, and keeping more would leave less than "
                f"{MEMORY_RESERVE:.0%}")

    def _choose(self):
        n = self._counted
        if self.pinned is not None:
            if n >= SIZING_STEPS and self.samples:  # the tiers' rates, as the default's
                last = self.samples[-1].saved_bytes  # own steps have them: the load lead
                self._measure(probe_bytes(last))     # and the bound (NOTE [ Loads in time ])
                self.bound = self._bound(last)
            return self.pinned, (f"{self.pinned / MiB:.1f} MiB: pinned by "
                                 f"ssdtrain.tools.pin_auto_quota")
        if self._resize:
            return None, ("sizing again: the last step ran out of memory in forward, so this "
                          "one offloads every eligible tensor, as policy='static' does, and "
                          "measures the memory floor again")
        if n < SIZING_STEPS:
            return None, ("sizing: the first step offloads every eligible tensor, as "
                          "policy='static' does, to learn how much must leave memory for the "
                          "steps to fit (the memory floor)")
        if n < SIZING_STEPS + BASELINE_STEPS:
            k = n - SIZING_STEPS + 1
            if self.floor > 0:
                return self.floor, (f"measuring: step {k} of {BASELINE_STEPS} of the baseline "
                                    f"offloads the least that fits: {self._floor_text}")
            return 0, (f"measuring: step {k} of {BASELINE_STEPS} runs without offloading "
                       f"(the baseline)")
        quota, why = self._choose_for_time()
        if self.floor > quota and self.floor <= self.bound:
            return self.floor, f"{self._floor_text}; above the quota for time alone ({why})"
        if self.floor > quota:
            why = (f"{self._floor_text}; above what the tiers absorb in time ({why}), so the "
                   f"step may take longer than the margin")
            if self._warn is not None and not self.told_floor:
                self.told_floor = True
                self._warn(
                    f"ssdtrain: policy='auto' offloads {self.floor / MiB:.1f} MiB a step so "
                    f"that the step fits in memory, more than the tiers take and give back in "
                    f"time ({self.bound / MiB:.1f} MiB), so steps may take more than "
                    f"max_slowdown={self.max_slowdown:.0%} longer than without offloading. "
                    f"host_budget_bytes puts host RAM before the SSD; a faster spill_dir, or "
                    f"one per drive, raises the bandwidth; policy='adaptive' with "
                    f"memory_budget_bytes recomputes where that is cheaper; a smaller "
                    f"micro-batch needs less. (Said once per Offloader; "
                    f"Stats.offload_quota_reason has each step's reason: {why}.)")
            return self.floor, why
        if self.floor > 0:
            why = f"{why}; at or above the memory floor ({self._floor_text})"
        return quota, why

    def _choose_for_time(self):
        last = self.samples[-1]
        every = CONTROL_EVERY if len(self.baseline.times) >= BASE_WINDOW else CONTROL_FIRST
        if self._judged >= every:  # NOTE [ The offload quota ], "Judging under noise"
            self._judged, self._control_next = 0, True
            return 0, (f"0: a control step after {every} steps judged: its time refreshes "
                       f"the baseline they are judged against ({self._baseline_text()}; "
                       f"{self._tiers_text()})")
        self._measure(probe_bytes(last.saved_bytes))
        self.bound = self._bound(last.saved_bytes)
        if self.write_bps is None and self.copy_write_bps is None:
            self._idle += 1
            return 0, ("0: nowhere to offload to: no SSD tier (spill_dir), and the host tier "
                       "takes device tensors only (none saved yet)")
        # Never the last keep_tail_bytes of a step: backward needs them first (under a
        # quota the tail window decides nothing, TailWindow.begin_step).
        quota = int(max(0, min(self.bound * self.scale, last.saved_bytes - self.tail_bytes)))
        floor = MIN_SHARE * last.saved_bytes
        cap = max(0, last.saved_bytes - self.tail_bytes)
        if quota < floor and self.bound >= floor and cap >= floor:
            if self._slowed is True and last.quota is not None and last.quota <= floor:
                # The least worth having slowed the step: twice in a row (once may be
                # noise, NOTE [ "Judging under noise" ]); a larger quota that slowed one
                # says nothing of the least: it is tried.
                self._slowed_at_least += 1
                self._given_up = self._slowed_at_least >= 2
            elif self._slowed is False:
                self._slowed_at_least = 0
            elif self._given_up and self._idle >= RETRY_STEPS:
                self._given_up, self._slowed_at_least = False, 0  # a while at 0: try again
            if not self._given_up:     # the least worth having; the feedback goes on
                self.scale = floor / self.bound
                quota = int(floor)
        if quota < floor and cap < floor:
            self._idle += 1
            return 0, (f"0: the step's {last.saved_bytes / MiB:.1f} MiB leave less than "
                       f"1/{round(1 / MIN_SHARE)} of them beyond the last keep_tail_bytes="
                       f"{self.tail_bytes / MiB:.1f} MiB, which stay in memory")
        if quota < floor:
            self._idle += 1
            return 0, (f"0: {self.scale:.2f} x the bound {self.bound / MiB:.1f} MiB is below "
                       f"1/{round(1 / MIN_SHARE)} of the step's {last.saved_bytes / MiB:.1f} MiB "
                       f"({self._tiers_text()}, forward {self.base_forward_s * 1e3:.0f} ms, "
                       f"step {self.base_step_s * 1e3:.0f} ms): too little to be worth its cost"
                       + (f"; a quota of that share slowed a step: tried again in "
                          f"{max(0, RETRY_STEPS - self._idle + 1)} steps" if self._given_up
                          else ""))
        self._idle = 0
        why = (f"{self.scale:.2f} x the bound {self.bound / MiB:.1f} MiB (0.8 x the least of "
               f"write x forward {self.base_forward_s * 1e3:.0f} ms, read x rest of step "
               f"{(self.base_step_s - self.base_forward_s) * 1e3:.0f} ms + "
               f"{self.max_slowdown:.0%}; {self._tiers_text()}; saved "
               f"{last.saved_bytes / MiB:.1f} MiB)")
        was = self._slowed
        if was is True and lagged(last):
            why += (f"; lowered: {last.lag_bytes / MiB:.1f} MiB of the last step's "
                    f"{last.offloaded_bytes / MiB:.1f} MiB of writes had not landed when this "
                    f"step began (the tiers fell behind)")
        elif was is True:
            why += (f"; lowered: the last step took {last.step_s * 1e3:.0f} ms and waited "
                    f"{last.stall_s * 1e3:.0f} ms on I/O, over the baseline "
                    f"({self._baseline_text()}) + {self.max_slowdown:.0%}")
        elif was is False:
            why += "; raised: the last step kept within the margin"
        return quota, why

    # ------------------------------------------------------------------ tiers
    def _measure(self, nbytes: int) -> None:
        """Probe each tier once: the SSD after the baseline, the host tier once a device
        tensor has been seen (its probe returns None until then)."""
        if self._probe is not None and self.write_bps is None:
            write_s, read_s = self._probe(nbytes)
            w, r = nbytes / max(write_s, 1e-9), nbytes / max(read_s, 1e-9)
            # Both in one line of stores: an interrupt between them left one None for good.
            self.write_bps, self.read_bps = w, r
        if self._copy_probe is not None and self.copy_write_bps is None:
            copies = self._copy_probe(nbytes)
            if copies is not None:
                w, r = nbytes / max(copies[0], 1e-9), nbytes / max(copies[1], 1e-9)
                self.copy_write_bps, self.copy_read_bps = w, r

    def _bound(self, saved: int) -> int:
        """The step's bound over the tiers (NOTE [ The offload quota ], step 3): the SSD's
        alone; with a host tier, the copies' bound, of which no more than the host budget
        plus the SSD's bound (what overflows RAM must also reach the disk in time)."""
        def bound(w, r):
            return quota_bound(saved, self.base_forward_s, self.base_step_s, w, r,
                               self.max_slowdown,
                               # Loads that lead (NOTE [ Loads in time ]) start as backward
                               # does: the window then limits nothing the bound counts.
                               window_bytes=None if self.leads else self.window_bytes)
        disk = 0 if self.write_bps is None else bound(self.write_bps, self.read_bps)
        if self.copy_write_bps is None:
            return disk
        return min(bound(self.copy_write_bps, self.copy_read_bps), self.host_bytes + disk)

    def _baseline_text(self) -> str:
        noise = self.baseline.noise_s
        return (f"the median of the last {len(self.baseline.times)} steps that wrote "
                f"nothing, {self.base_step_s * 1e3:.0f} ms" +
                ("" if noise is None else f", noise {noise * 1e3:.0f} ms"))

    def _tiers_text(self) -> str:
        parts = []
        if self.copy_write_bps is not None:
            parts.append(f"host tier: copies {self.copy_write_bps / 1e9:.2f} GB/s out, "
                         f"{self.copy_read_bps / 1e9:.2f} GB/s in, budget " +
                         ("unlimited" if self.host_bytes >= 1 << 62 else
                          f"{self.host_bytes / MiB:.0f} MiB"))
        if self.write_bps is not None:
            parts.append(f"SSD: write {self.write_bps / 1e9:.2f} GB/s, read "
                         f"{self.read_bps / 1e9:.2f} GB/s")
        return "; ".join(parts)
