"""``Stats``: the counters an :class:`~ssdtrain.Offloader` keeps, and their sum up.

A leaf (it imports nothing from ssdtrain): the store fills one in, the estimate fills
one in from its replay, and ``ssdtrain.Stats`` (``api``) is this class.
"""

import dataclasses
from dataclasses import dataclass
from typing import Optional

__all__ = ["Stats"]


@dataclass
class Stats:
    """Cumulative counters of one :class:`Offloader` (a snapshot; see :meth:`Offloader.stats`)."""

    packed_bytes: int = 0
    """Bytes of every saved tensor intercepted, counted per pack (a tensor saved twice counts twice)."""
    unique_bytes: int = 0
    """Bytes of the distinct storage ranges eligible for offload, after dedup."""
    deduplicated_bytes: int = 0
    """Bytes of packs served by an existing record instead of a new one."""
    offloaded_bytes: int = 0
    """Bytes sent to the spill tier (each record once; with a host tier, to RAM or to
    the SSD: ``host_spilled_bytes`` says how many went on to the SSD), counted when pack
    decides it (NOTE [ The pack decision ] in ``_decision/policy.py``): the same in every run of the same
    model, and what ``ssdtrain estimate`` gives. A record that dies before its write
    starts is not written (``records_written`` counts the writes done); one whose write
    fails is counted here too, and raises or is kept (``on_spill_error``)."""
    unwritten_bytes: int = 0
    """Bytes of :attr:`offloaded_bytes` whose record was freed (its graph gone) before
    its write could start: more than ``write_behind_bytes`` were in flight, the disk or
    link fell behind the step (NOTE [ Bounded memory ]). Under ``policy="auto"`` such a
    step lowers the next quota; 0 while the tiers keep up."""
    kept_bytes: int = 0
    """Bytes kept in memory: small tensors, parameters and buffers, other devices and
    kinds, and the tail of forward (``keep_tail_bytes``)."""
    peak_resident_bytes: int = 0
    """Peak bytes of saved storages ssdtrain itself held in memory at once."""
    prefetch_hits: int = 0
    """Unpacks of offloaded records that prefetch had already loaded or started loading."""
    prefetch_misses: int = 0
    """Unpacks that had to start a read themselves."""
    stall_seconds: float = 0.0
    """Time unpack spent waiting for reads."""
    write_stall_seconds: float = 0.0
    """Time pack spent waiting for writes beyond ``write_behind_bytes``."""
    bytes_read: int = 0
    """Bytes read back from the spill tier."""
    forwarded: int = 0
    """Unpacks served from memory with no read: kept tail, writes still in flight, and
    records another handle of the same storage brought back."""
    records_written: int = 0
    """Completed record writes."""
    records_read: int = 0
    """Completed record reads."""
    engine: str = ""
    """The I/O engine in use."""
    spill_errors: int = 0
    """Failed writes whose records stayed in memory (``on_spill_error="keep"``)."""
    unneeded_failures: int = 0
    """Records whose write (or copy to the host tier, or eviction's write) failed when no
    graph needed them any more (the graph gone, or backward done with them): nothing was
    lost, so no step raises these (NOTE [ One event, one error ] in ``_store/events.py``,
    docs/failure.md); each is counted here and the first is logged as a warning."""
    over_budget_bytes: int = 0
    """Bytes kept in memory because writing them would exceed ``max_spill_bytes``, or
    (a host tier without an SSD tier) because host RAM was full (``host_budget_bytes``)."""
    quarantined_bytes: int = 0
    """Deprecated, always 0; to be removed in the next release. It counted the memory and
    disk slots kept for the rest of the process after an interrupt cut a request's
    submission short. Nothing is kept any more: such a request holds its memory and slot
    until it ends, and they are released then (docs/failure.md, NOTE [ Memory owned by
    requests ] in ``_store/store.py``)."""
    staging_bytes: int = 0
    """Pinned host memory held now for device records' copies (in use, and idle for reuse;
    NOTE [ Device records ] in _device/transfers.py)."""
    peak_staging_bytes: int = 0
    """The most pinned host memory held for device records' copies at once."""
    staging_idle_bytes: int = 0
    """The part of ``staging_bytes`` kept idle for reuse: never more than
    ``write_behind_bytes + prefetch_bytes + host_budget_bytes`` (NOTE [ Bounded staging ]
    in ``_device/transfers.py``). After :meth:`Offloader.wait` the rest of ``staging_bytes`` is
    what live records hold (the host tier's pinned copies)."""
    read_buffer_bytes: int = 0
    """Host memory mapped now for host records' reads from the SSD (in use, and idle for
    reuse; NOTE [ Read buffer pool ] in ``io/readbuf.py``). Device records read into
    pinned staging instead (:attr:`staging_bytes`)."""
    read_buffer_idle_bytes: int = 0
    """The part of ``read_buffer_bytes`` kept idle for reuse: at most ``prefetch_bytes``
    plus a slab and one buffer, and while forward runs at most what the last forward's
    end mapped for its first reads (NOTE [ Read buffers across steps ] in
    ``io/readbuf.py``)."""
    bytes_written: int = 0
    """Bytes of completed writes to the SSD tier (from device, host memory or the host
    tier)."""
    host_bytes: int = 0
    """Bytes of device records the host tier holds now (``host_budget_bytes``, NOTE [
    Host tier ] in ``_store/hosttier.py``): in RAM, being copied there, or due to be; never
    more than the budget."""
    peak_host_bytes: int = 0
    """The most bytes the host tier held at once (at most ``host_budget_bytes``)."""
    host_spilled_bytes: int = 0
    """Bytes decided to go past the host tier to the SSD: evicted from RAM (earliest
    saved first), or larger than the whole budget. Decided at pack, like
    ``offloaded_bytes`` (which counts every byte sent to either tier)."""
    host_loaded_bytes: int = 0
    """Bytes loaded back to the device from the host tier (``bytes_read``: from the
    SSD)."""
    offload_quota_bytes: Optional[int] = None
    """With ``policy="auto"``: the most bytes the current step may decide
    to offload, chosen when it began from what earlier steps measured (NOTE [ The offload
    quota ] in ``_policies/auto.py``; 0 in the first steps, which measure). ``None`` with the
    other policies."""
    offload_bound_bytes: Optional[int] = None
    """With ``policy="auto"``: the bytes of a step the tiers can take during forward and
    give back during backward (the *free bound*, NOTE [ The offload quota ], step 3 in
    ``_policies/auto.py``), from the bandwidths and step times measured so far; the quota is a
    share of it. 0 until something is measured; ``None`` with the other policies."""
    offload_quota_reason: str = ""
    """Why :attr:`offload_quota_bytes` is what it is: the measurements it came from and
    whether the last step lowered or raised it."""
    prefetch_window_bytes: int = 0
    """The prefetch window of the latest step: ``prefetch_bytes``, or with
    ``policy="auto"`` more when the step's loads take longer than the part of backward
    that would hide them (NOTE [ Loads in time ] in ``_policies/auto.py``); never more than the
    bytes the step keeps in memory at forward's end."""
    hooks_cut_steps: int = 0
    """With ``policy="auto"``: steps whose saved-tensor hooks came off during forward,
    once the quota was spent and the prefetch window's bytes more were passed
    through: what they saved after that was not intercepted at all, and is not counted
    in the byte counters (NOTE [ Hooks off past the window ] in ``_policies/auto.py``)."""
    quota_kept_bytes: int = 0
    """Bytes kept in memory because the step's offload quota was spent (also counted in
    ``kept_bytes``)."""
    budget_measured_bytes: int = 0
    """With a per-layer plan in force under ``memory_budget_bytes``: the peak of what
    ssdtrain held in the latest step, measured at each tracked layer's boundary (records
    in memory, memory let go of but not yet released, and a recomputed layer's working
    set as profiled: what the budget counts; NOTE [ Measured memory ] in
    ``_policies/adaptive.py``). 0 before such a step."""
    budget_exceeded_bytes: int = 0
    """The most bytes by which a step's measured peak (:attr:`budget_measured_bytes`)
    went over ``memory_budget_bytes``; 0 while every step stayed within it. The first
    overshoot is also logged as a warning, and ``policy="adaptive"`` re-plans for it."""

    # Not running totals: a level now, or a maximum so far. Over an interval
    # (:meth:`since`) they are what they are at its end: a difference of two maxima
    # or two levels means nothing.
    LEVELS = frozenset({"peak_resident_bytes", "staging_bytes", "peak_staging_bytes",
                        "staging_idle_bytes", "read_buffer_bytes", "read_buffer_idle_bytes",
                        "host_bytes", "peak_host_bytes", "offload_quota_bytes",
                        "offload_bound_bytes", "prefetch_window_bytes", "budget_measured_bytes",
                        "budget_exceeded_bytes"})

    def since(self, before: "Stats") -> "Stats":
        """What happened between ``before`` (an earlier snapshot of the same offloader)
        and this one: every counter as the difference; the fields in :attr:`LEVELS`
        (levels and maxima: ``peak_*``, ``host_bytes``, ``budget_*``...) and the strings
        as they are now.

        Example::

            before = off.stats()
            train_step()
            print(off.stats().since(before).offloaded_bytes)   # this step's
        """
        diff = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name not in self.LEVELS and isinstance(v, (int, float)) and \
                    not isinstance(v, bool):
                diff[f.name] = v - getattr(before, f.name)
        return dataclasses.replace(self, **diff)

    def summary(self) -> str:
        """One line for logs."""
        return (f"packed {_mib(self.packed_bytes)}, offloaded {_mib(self.offloaded_bytes)} "
                f"({self.records_written} writes), deduplicated {_mib(self.deduplicated_bytes)}, "
                f"kept {_mib(self.kept_bytes)}, read {_mib(self.bytes_read)}, prefetch "
                f"{self.prefetch_hits} hits / {self.prefetch_misses} misses, stalled "
                f"{self.stall_seconds * 1e3:.1f} ms (writes {self.write_stall_seconds * 1e3:.1f} ms), "
                f"peak resident "
                f"{_mib(self.peak_resident_bytes)}" +
                (f", host RAM peak {_mib(self.peak_host_bytes)} (loaded "
                 f"{_mib(self.host_loaded_bytes)}, on to the SSD {_mib(self.host_spilled_bytes)})"
                 if self.peak_host_bytes else "") + f" [{self.engine}]")


def _mib(n):
    return f"{n / (1 << 20):.1f} MiB"
