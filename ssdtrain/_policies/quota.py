"""The offload quota's pure parts (NOTE [ The offload quota ] in _policies/auto.py): what a
step measured (:class:`StepSample`), the bandwidth bound (:func:`quota_bound`, step 3), the
feedback's judgement of a step (:func:`slowed`, :func:`lagged`, :func:`next_scale`, step 4),
the step time steps are judged against (:class:`Baseline`, "Judging under noise") and the
probe's size. None reads a clock, the stats or the store: the controller,
:class:`~ssdtrain._policies.auto.AutoQuota`, runs them step by step.
"""

import collections
import math
import statistics
from dataclasses import dataclass
from typing import Optional, Tuple

__all__ = ["StepSample", "quota_bound", "slowed", "lagged", "next_scale", "probe_bytes",
           "Baseline", "SAFETY", "STEP_UP", "MAX_SCALE", "LAG_SHARE", "BASE_WINDOW",
           "NOISE_MIN"]

MiB = 1 << 20
SAFETY = 0.8           # of the bandwidth bound
STEP_UP = 0.25         # scale added after a step that was not slowed
MAX_SCALE = 1.5        # most of the bound the feedback may reach
MIN_PROBE = 8 * MiB
MAX_PROBE = 64 * MiB
LAG_SHARE = 1 / 4      # of a step's writes not landed by the next step's begin: lagging
BASE_WINDOW = 7        # the last steps that wrote nothing, whose median is the baseline
NOISE_MIN = 5          # steps the baseline needs before its noise is measured


@dataclass(frozen=True)
class StepSample:
    """What one step measured (between two calls of :meth:`AutoQuota.begin_step`)."""

    #: begin of the step to the end of its backward (NOTE [ The offload quota ], "A
    #: step's time"), or to the begin of the next where that end was not seen
    step_s: float
    forward_s: float       #: begin to end of forward (the whole step if it never ended)
    stall_s: float         #: time waiting on I/O: unpack's reads and the write throttle
    saved_bytes: int       #: bytes of new records (what could be offloaded, after dedup)
    quota: Optional[int]   #: the quota the step ran with (None: the sizing step's, none)
    offloaded_bytes: int = 0  #: bytes the step decided to write
    room: Optional[Tuple[int, int]] = None  #: (free, total) memory at forward's end
    #: bytes decided to be written that had not landed when the next step began (in
    #: flight or due), plus those freed unwritten during the step (``unwritten_bytes``)
    lag_bytes: int = 0
    out_of_memory: bool = False  #: its forward raised an out-of-memory error
    intercepted: bool = True     #: its saved tensors were intercepted (timed to backward's end)
    control: bool = False        #: a control step (NOTE [ The offload quota ], "Judging ...")


def quota_bound(saved_bytes: int, forward_s: float, step_s: float, write_bps: float,
                read_bps: float, max_slowdown: float, safety: float = SAFETY,
                window_bytes: Optional[int] = None) -> int:
    """The most bytes a step can offload without waiting on the disk (NOTE [ The offload
    quota ], step 3): never above ``saved_bytes``, never below 0, and monotone
    non-decreasing in each bandwidth and each time. ``window_bytes``: the prefetch
    window (``prefetch_bytes``), which the kept records fill first, so the reads start
    only once backward has used all but that much of them; ``None``: at the end of
    forward."""
    if saved_bytes <= 0 or not (write_bps > 0 and read_bps > 0):
        return 0
    forward_s = max(0.0, forward_s)
    back_s = max(0.0, step_s - forward_s)
    slack_s = max_slowdown * max(0.0, step_s)
    reads = read_bps * (back_s + slack_s)
    if window_bytes is not None:
        # Backward uses the S saved bytes evenly over back_s; the reads of the Q written
        # (used last) start when S - Q - window bytes are used and must end by back_s:
        # Q / R <= back_s * (Q + window) / S + slack, i.e. Q * (1 - R * back_s / S) <=
        # R * back_s * window / S + R * slack (no limit when R * back_s >= S).
        drain = read_bps * back_s / saved_bytes
        if drain < 1.0:
            reads = min(reads, (drain * window_bytes + read_bps * slack_s) / (1.0 - drain))
    q = safety * min(write_bps * forward_s, reads)
    if not math.isfinite(q):
        return int(saved_bytes)
    return int(max(0.0, min(float(saved_bytes), q)))


def slowed(sample: StepSample, base_step_s: float, max_slowdown: float,
           noise_s: Optional[float] = 0.0) -> bool:
    """Whether ``sample`` cost more than the margin over the baseline step time: it
    waited on I/O for longer, or took longer (by more than the margin plus ``noise_s``,
    the baseline's measured noise; None: the time is not compared, only the waits and
    the lag), or its writes lagged (:func:`lagged`)."""
    margin = max_slowdown * base_step_s
    return sample.stall_s > margin or lagged(sample) or (
        noise_s is not None and sample.step_s > base_step_s + margin + noise_s)


class Baseline:
    """The step time steps are judged against (NOTE [ The offload quota ], "Judging
    under noise"): the times of the last ``BASE_WINDOW`` steps that wrote nothing
    (baseline, control, and steps whose quota wrote nothing, timed alike). ``step_s`` is
    their median (the faster of two while there are fewer than three); ``noise_s`` is
    their spread, the slowest's time less the fastest's (a step is slower than
    offloading nothing only past the median by more than the margin and that spread),
    or None while there are fewer than ``NOISE_MIN``: no time comparison can be trusted
    then."""

    def __init__(self):
        self.times = collections.deque(maxlen=BASE_WINDOW)

    def add(self, step_s: float) -> None:
        self.times.append(step_s)

    @property
    def step_s(self) -> float:
        t = self.times
        if not t:
            return math.inf
        return statistics.median(t) if len(t) >= 3 else min(t)

    @property
    def noise_s(self) -> Optional[float]:
        t = self.times
        if len(t) < NOISE_MIN:
            return None
        return max(t) - min(t)


def lagged(sample: StepSample) -> bool:
    """Whether the tiers fell behind ``sample``'s writes: more than ``LAG_SHARE`` of the
    bytes it decided to write had not landed when the next step began (or were freed
    unwritten). Its time may not show it (nothing waits for a write under ``"auto"``),
    but memory does: those records stayed in memory (NOTE [ Bounded memory ] in
    _store/store.py)."""
    return sample.offloaded_bytes > 0 and sample.lag_bytes > LAG_SHARE * sample.offloaded_bytes


def next_scale(scale: float, was_slowed: bool) -> float:
    """Multiplicative decrease after a slowed step, additive increase otherwise."""
    if was_slowed:
        return scale * 0.5
    return min(MAX_SCALE, scale + STEP_UP)


def probe_bytes(saved_bytes: int) -> int:
    """The disk probe's size: an eighth of a step's bytes, 8 to 64 MiB, whole 4 KiB
    blocks."""
    n = min(MAX_PROBE, max(MIN_PROBE, saved_bytes // 8))
    return n - n % 4096
