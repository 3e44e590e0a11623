"""The static policy's watch: :class:`StallWatch` tells once when the SSD is the step's
bottleneck under ``policy="static"``."""

import time
from typing import Callable

__all__ = ["StallWatch", "STALL_SHARE", "STALL_MIN_S"]

STALL_SHARE = 0.25     # of a step spent waiting on the SSD: it is the bottleneck
STALL_MIN_S = 0.01     # ... and at least this long (timer noise on tiny steps)


class StallWatch:
    """Tells once when the SSD is the step's bottleneck under ``policy="static"``.

    The static policy offloads every eligible tensor and makes forward wait when writes
    fall behind (``write_behind_bytes``); where activations come faster than the disk
    takes them (a GPU, NOTE [ The offload quota ]) a step can take many times its time
    without ssdtrain, and nothing said so. Between steps (``begin_step``, as the quota
    controller) it compares the step's I/O waits (``Stats.stall_seconds`` +
    ``write_stall_seconds``) with its time, begin to next begin; past ``STALL_SHARE``
    it calls ``warn`` once with what it saw and what to do.
    """

    def __init__(self, warn: Callable[[str], None], clock: Callable[[], float] = time.perf_counter):
        self._warn = warn
        self._clock = clock
        self.told = False
        self._begin = None   # (clock, stall reads, stall writes, bytes written) at begin

    def begin_step(self, stats) -> None:
        if self.told:
            return
        now = (self._clock(), stats.stall_seconds, stats.write_stall_seconds,
               stats.bytes_written)
        before, self._begin = self._begin, now
        if before is None:
            return
        step_s = now[0] - before[0]
        reads, writes = now[1] - before[1], now[2] - before[2]
        stall = reads + writes
        if step_s <= 0 or stall < STALL_MIN_S or stall < STALL_SHARE * step_s:
            return
        self.told = True
        gb = (now[3] - before[3]) / 1e9
        self._warn(
            f"ssdtrain: the last step spent {stall:.2f} s of its {step_s:.2f} s waiting on the "
            f"SSD (forward for writes {writes:.2f} s, backward for reads {reads:.2f} s) while "
            f"{gb:.2f} GB were written: the disk cannot take this step's activations in time "
            f"(policy='static' offloads every eligible tensor), so offloading costs more time "
            f"than it is worth. policy='auto' offloads only what the disk absorbs in time; "
            f"host_budget_bytes puts host RAM before the SSD; policy='adaptive' with "
            f"memory_budget_bytes recomputes where that is cheaper; a faster spill_dir, or one "
            f"per drive, raises the bandwidth. (Said once per Offloader; Stats.stall_seconds "
            f"and write_stall_seconds count every step.)")
