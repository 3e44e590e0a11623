"""The step cost model of the keep / offload / recompute planner: pure functions, no torch.

:func:`predict` runs the model of one training step for a given choice per layer, from
measured numbers (:class:`LayerCost` per layer, :class:`StepCost` for the rest of the
step and the machine), and gives a :class:`Prediction` of its time and peak activation
memory; :func:`tier_split` splits the offloaded bytes between the host tier and the SSD;
:func:`write_behind_for` is the write-behind limit that keeps forward's writes inside a
budget. The search over the choices is in _policies/planner.py.

NOTE [ Step cost model ]

A step is forward over the layers ``0..n-1``, then the rest of forward
(``fwd_other_s``: head, loss), then backward: the head's backward
(``bwd_head_s``), the layers' backward in reverse order, then the rest of
backward (``tail_s``: embedding backward), then the rest of the step
(``between_s``: optimizer, data) until the next forward.
Each layer is one of

* ``keep``: its saved bytes stay in memory; costs memory, no time;
* ``offload``: its saved bytes are written as forward produces them and read
  back before its backward; costs the stalls the I/O cannot hide;
* ``recompute``: non-reentrant checkpointing; only its inputs are saved (and
  offloaded like an offloaded layer's bytes); backward runs its forward again
  (``fwd_s`` more) and holds what that recompute creates while its backward runs
  (NOTE [ Recompute working set ]).

Offloaded bytes also cost compute time: ``fwd_s_per_byte`` / ``bwd_s_per_byte``
per byte written / read is added to the layer's forward / backward (the CPU
that I/O takes from compute; measured, see NOTE [ Pure compute times ] in
_policies/profile.py). The disk is one server, first come first served, at ``write_bps`` / ``read_bps``.
Writes of layer ``i`` are queued when its forward ends; forward waits when
more than ``write_behind_bytes`` are queued and not written (ssdtrain's
throttle; :func:`plan` lowers it so that the kept bytes plus the writes in
flight fit the budget, see :func:`write_behind_for`). Reads start when
forward ends, newest layer first; a read starts only while fewer than
``prefetch_bytes`` have been read and not yet used (ssdtrain's prefetch window), and never before its write has ended.
Layer ``i``'s backward starts when layer ``i+1``'s has ended and its read has
completed; the difference is a stall.

With a host tier the bytes that go to RAM are priced at the device <-> host link's
bandwidth instead (NOTE [ Tiers in the step cost model ]).

The model errs on the safe side in two places, both of which keep the predicted
time monotone (non-increasing) in each bandwidth, and the predicted memory's
feasibility too: a record prefetch reaches while its write is still in flight
is served from memory by ssdtrain (no read), but is predicted to be read; and
backward memory counts the whole prefetch window as full.

Memory ("activation bytes held") is the peak of a timeline, NOTE [ Memory
timeline ].

NOTE [ Tiers in the step cost model ]

With a host tier (``StepCost.host_budget_bytes``, NOTE [ Host tier ] in
_store/hosttier.py) priced, that is with both ``host_write_bps`` and ``host_read_bps``
given (``ssdtrain estimate --host-budget`` gives them, ``--host-gbps``), the
offloaded bytes are split the way the tier splits records (:func:`tier_split`). The
tier admits records in save order: the layers' offloaded bytes, first layer first,
then the head's records beyond the kept tail. With an SSD tier it evicts the
earliest admitted ones when the budget is full, so RAM ends up with the *last*
``host_budget_bytes`` of that stream and the SSD with the rest; without one
(``ssd_tier=False``) the records that do not fit stay in device memory, so RAM takes
the *first* ``host_budget_bytes`` and the rest is held like a kept layer (in the
peak, in :func:`write_behind_for`'s bound, never written). The split is by bytes: a
layer may be partly in RAM and partly on the SSD (the tier moves whole records;
records are small beside a layer). The head's records take their place in the
budget (with an SSD tier, the first place in RAM) but, as without a tier, they are
memory only: their copies are not timed.

Every offloaded byte crosses the device <-> host link (PCIe: the SSD's writes are
staged in host memory too), one server per direction, first come first served:
device -> host at ``host_write_bps`` as the layer's forward ends, in save order (a
layer's part bound for the SSD first), host -> device at ``host_read_bps`` in backward
(free when backward begins; the copies to RAM use the other direction), newest first
(a layer's part in RAM first). A layer's part on the SSD also goes on the disk's
timeline, streaming behind its copy: its write ends no earlier than the copy, at
``write_bps`` from when both the disk and the copy have begun; its read's copy back
ends no earlier than the read, at ``host_read_bps``. So a byte in RAM costs the link
only, a byte on the SSD the link and the disk: when the link is at least as fast as
the SSD (each direction) the SSD's part is priced exactly as without a host tier, and
with budget 0 and an SSD tier the predictions are those without one, to the bit
(tests/golden/planner_no_host_tier.json). The throttle counts a layer's write (both
parts, ssdtrain's counts copies to RAM in flight too: ``OUTBOUND``) until both have
ended, and forward waits until the writes that end first bring it under
``write_behind_bytes``; the prefetch window is one for both tiers (ssdtrain's
prefetch walks RAM and SSD records alike); a layer's backward waits for both parts.
With an SSD tier the memory predicted does not depend on the budget, and the
predicted step never grows with the budget nor with either host bandwidth
(tests/test_planner_tiers.py).

NOTE [ Memory timeline ]

The predicted peak is the largest of what is resident at these moments, each
counting what ssdtrain really holds then (``fixed_bytes``, what the rest of the
step keeps whatever the plan, is added to each):

* after layer ``i``'s forward: the kept layers so far, the rolling tail (the
  newest offloaded records, up to ``keep_tail_bytes``, not yet queued), and the
  writes in flight: every byte offloaded so far, up to the write-behind limit
  (the throttle's bound, whatever the disk's speed: the model has bandwidth but
  no latency, and with small records measured in flight more than bandwidth
  alone says, ``test_offload_plan_predicts_at_least_what_it_holds``);
* the end of forward: every kept layer, the kept tail (``keep_tail_bytes``, or
  less when the head's and the layers' offloaded bytes are fewer), and the writes
  in flight, now including the head's records beyond the tail
  (``head_bytes - keep_tail_bytes``), counted the same way;
* the head's backward: every kept layer and the prefetch window; ssdtrain counts
  the kept tail in the window (``_store.end_pass``), so the window holds the
  tail, then the head's records read back, then the layers' first reads, up to
  ``prefetch_bytes`` in all (or the tail alone when it is larger);
* layer ``i``'s backward: the kept layers ``<= i``, the window (the offloaded
  bytes of layers ``<= i`` not yet used, at most ``prefetch_bytes``; the head's
  records and the tail are freed by then), and a recomputed layer's working set
  (NOTE [ Recompute working set ]).

The head's records are memory only: their write and read are not put on the
disk's timeline (the profile's ``bwd_head_s`` includes what the head's reads
cost). Not counted, for any plan: read buffers ssdtrain keeps idle for reuse
after their record died (bounded by ``prefetch_bytes``, dropped when forward
begins) and a record backward is still using after its last unpack; like the
gradient temporaries, they are memory of the step, not saved activations
(``examples/step_worker.py`` measures them in what the process holds besides
the activations). The window may overshoot ``prefetch_bytes`` by less than one
record, and the throttle may let one record more be in flight: both are left to
the caller's reserve; so are forward's writes a disk slower than the profile measured
has not finished when backward begins (the timeline has no latency: they overlap the
head's backward window; ``test_offload_plan_predicts_at_least_what_it_holds`` lets
them end first). The previous model counted the head's records and two
prefetch windows (in use and idle) at every moment, so at micro-batch 16 of
``examples/microbatch_sweep.py`` it predicted 81 MiB for its least-memory plan
while static ssdtrain, which offloads everything, held about 41.

NOTE [ Recompute working set ]

A recomputed layer's backward first runs its forward again: that recompute
creates every tensor the layer saves, of any size (also those below
``min_tensor_bytes``, which ssdtrain never counts in ``saved_bytes``), and the
temporaries of its forward, and checkpoint holds the saved ones until the
layer's backward has used them. What the model charges for it is
``max(saved_bytes, recompute_bytes) + input_bytes``: ``recompute_bytes`` is
the peak of the live bytes that recompute created, measured in the adaptive
policy's recompute-all profile step (``_profile.RecomputeMeter``; 0 when not
measured: ``saved_bytes`` stands in), and the layer's input is held (read
back) while its backward runs. The gradient temporaries of a layer's backward
are not counted, for any choice: they are the step's temporaries, like those
of forward.
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

from .._config import default

__all__ = ["KEEP", "OFFLOAD", "RECOMPUTE", "CHOICES", "LayerCost", "StepCost", "Prediction",
           "predict", "tier_split", "write_behind_for", "throttled_step"]

KEEP = "keep"
OFFLOAD = "offload"
RECOMPUTE = "recompute"
CHOICES = (KEEP, OFFLOAD, RECOMPUTE)


@dataclass(frozen=True)
class LayerCost:
    """What one layer costs, as measured.

    Attributes:
        name: a label for tables (the module's qualified name).
        saved_bytes: bytes of the distinct storages its forward saves that ssdtrain
            would offload (after deduplication).
        input_bytes: bytes of the tensor inputs of the layer (what a checkpoint of
            it saves).
        fwd_s: forward time, in seconds, without I/O stalls.
        bwd_s: backward time, in seconds, without I/O stalls.
        recompute_bytes: peak live bytes the layer's recompute creates in backward
            (NOTE [ Recompute working set ]); 0: not measured. Default 0.
        updates: the buffers (names within the layer) its forward was seen to update
            (running statistics, counters); a recompute runs on copies of them
            (NOTE [ Recompute without a second update ] in _policies/adaptive.py). Default ().
    """

    name: str
    saved_bytes: int
    input_bytes: int
    fwd_s: float
    bwd_s: float
    recompute_bytes: int = 0
    updates: Tuple[str, ...] = ()

    @property
    def recompute_working_bytes(self) -> int:
        """What the layer holds during its backward when recomputed (NOTE [ Recompute
        working set ]): ``max(saved_bytes, recompute_bytes) + input_bytes``."""
        return max(self.saved_bytes, self.recompute_bytes) + self.input_bytes


@dataclass(frozen=True)
class StepCost:
    """The machine and the parts of the step outside the layers.

    Attributes:
        write_bps: write bandwidth of the engine, bytes/s (> 0).
        read_bps: read bandwidth of the engine, bytes/s (> 0).
        fwd_other_s: forward time outside the layers. Default 0.
        bwd_head_s: backward time before the last layer's backward starts. Default 0.
        tail_s: time after the first layer's backward until backward ends (until the
            next forward when ``between_s`` is 0). Default 0.
        prefetch_bytes: the prefetch window. Default: ``OffloadConfig``'s.
        write_behind_bytes: most bytes queued for writing before forward waits.
            Default: ``OffloadConfig``'s.
        fixed_bytes: activation bytes held whatever the plan. Default 0.
        fwd_s_per_byte: compute time forward loses per byte a layer writes (the CPU
            the I/O takes from compute). Default 0.
        bwd_s_per_byte: the same in backward, per byte read back. Default 0.
        head_bytes: bytes ssdtrain would offload that forward saves outside the
            layers (head, loss); held only from the end of forward until the head's
            backward has used them (NOTE [ Memory timeline ]). Default 0.
        keep_tail_bytes: ssdtrain's ``keep_tail_bytes``: the last records of forward
            stay in memory, inside the prefetch window (NOTE [ Memory timeline ]).
            Default 0.
        host_budget_bytes: the host tier's budget (``host_budget_bytes``, NOTE [ Host
            tier ] in _store/hosttier.py): offloaded bytes up to it go to host RAM, the rest
            to the SSD (or, without ``ssd_tier``, stay in device memory). Default 0.
        host_write_bps: device -> host copy bandwidth, bytes/s, or None (not
            measured). ``write_bps``/``read_bps`` are the SSD's.
        host_read_bps: host -> device copy bandwidth, bytes/s, or None.
        ssd_tier: whether an SSD lies beyond the host tier (False: ``host_budget_bytes``
            without a ``spill_dir``; needs both host bandwidths). Default True.
        between_s: time from the end of backward to the next forward (optimizer, data,
            the loop; NOTE [ The end of backward ] in _policies/profile.py). Default 0.

    The host tier is priced (NOTE [ Tiers in the step cost model ]) when both host
    bandwidths are given; with either one None every offloaded byte is priced at
    ``write_bps``/``read_bps``, as without a host tier (with one, an upper bound on the
    I/O time when RAM is the faster tier). The adaptive policy measures no host
    bandwidth, so its predictions do not depend on the host tier.
    """

    write_bps: float
    read_bps: float
    fwd_other_s: float = 0.0
    bwd_head_s: float = 0.0
    tail_s: float = 0.0
    prefetch_bytes: int = default("prefetch_bytes")
    write_behind_bytes: int = default("write_behind_bytes")
    fixed_bytes: int = 0
    fwd_s_per_byte: float = 0.0
    bwd_s_per_byte: float = 0.0
    head_bytes: int = 0
    keep_tail_bytes: int = 0
    host_budget_bytes: int = 0
    host_write_bps: Optional[float] = None
    host_read_bps: Optional[float] = None
    between_s: float = 0.0
    ssd_tier: bool = True

    @property
    def prices_host_tier(self) -> bool:
        """Whether the host tier is priced per tier (NOTE [ Tiers in the step cost
        model ]): both host bandwidths given."""
        return self.host_write_bps is not None and self.host_read_bps is not None

    @property
    def head_written_bytes(self) -> int:
        """The head's bytes written in forward and read back for its backward: what
        does not fit the kept tail (NOTE [ Memory timeline ])."""
        return max(0, self.head_bytes - self.keep_tail_bytes)

    def tail_bytes(self, offloaded_bytes: int) -> int:
        """The kept tail at the end of forward when the layers offload
        ``offloaded_bytes`` (NOTE [ Memory timeline ])."""
        return min(self.keep_tail_bytes, self.head_bytes + offloaded_bytes)


@dataclass(frozen=True)
class Prediction:
    """The cost model's answer for one plan (NOTE [ Step cost model ])."""

    step_s: float
    """Predicted step time."""
    stall_s: float
    """Predicted time backward waits for reads plus forward waits for writes."""
    recompute_s: float
    """Extra forward time spent recomputing in backward."""
    peak_bytes: int
    """Predicted peak activation bytes held (``fixed_bytes`` included)."""
    written_bytes: int
    """Bytes written (and read) per step."""
    kept_bytes: int
    """Bytes of kept layers."""
    backward_end_s: float = 0.0
    """Predicted time from the start of forward to the end of backward: ``step_s``
    less ``StepCost.between_s`` (what a benchmark timing forward and backward sees)."""
    host_bytes: int = 0
    """Bytes the host tier takes per step, the layers' and the head's records beyond
    the kept tail (NOTE [ Tiers in the step cost model ]); 0 when the host tier is not
    priced."""
    ssd_bytes: int = 0
    """Bytes that go to the SSD per step, the head's records beyond the tail included
    (without a priced host tier: every one)."""
    device_bytes: int = 0
    """Bytes beyond the host budget that stay in device memory (no SSD tier), counted
    in ``peak_bytes``."""

def _offloaded_bytes(layer, choice):
    if choice == OFFLOAD:
        return layer.saved_bytes
    if choice == RECOMPUTE:
        return layer.input_bytes
    return 0


def tier_split(offloaded: Sequence[int], step: StepCost):
    """Where the offloaded bytes go (NOTE [ Tiers in the step cost model ]): ``(host,
    rest)``, one entry per layer of ``offloaded`` and a last one for the head's records
    beyond the kept tail: the bytes the host tier takes and the rest (to the SSD, or
    kept in device memory without an SSD tier). None when the host tier is not priced
    (``StepCost.prices_host_tier``): every byte goes to the SSD."""
    if not step.prices_host_tier:
        return None
    stream = [int(b) for b in offloaded] + [step.head_written_bytes]
    total = sum(stream)
    budget = max(0, int(step.host_budget_bytes))
    # With an SSD the earliest admitted records are evicted: RAM keeps the last
    # ``budget`` bytes of forward. Without one, the records that do not fit stay on
    # the device: RAM keeps the first ``budget`` bytes.
    lo, hi = (max(0, total - budget), total) if step.ssd_tier else (0, min(budget, total))
    host, rest, pos = [], [], 0
    for b in stream:
        h = max(0, min(pos + b, hi) - max(pos, lo))
        host.append(h)
        rest.append(b - h)
        pos += b
    return host, rest


def _check_step(step):
    if not (step.write_bps > 0 and step.read_bps > 0):
        raise ValueError(f"ssdtrain: bandwidths must be > 0, got write {step.write_bps} and "
                         f"read {step.read_bps} bytes/s.")
    if step.prices_host_tier and not (step.host_write_bps > 0 and step.host_read_bps > 0):
        raise ValueError(f"ssdtrain: host tier bandwidths must be > 0, got device -> host "
                         f"{step.host_write_bps} and host -> device {step.host_read_bps} "
                         f"bytes/s.")
    if not step.ssd_tier and not step.prices_host_tier:
        raise ValueError("ssdtrain: a step without an SSD tier (ssd_tier=False) offloads to "
                         "the host tier alone; give host_write_bps and host_read_bps.")


def predict(layers: Sequence[LayerCost], choices: Sequence[str], step: StepCost) -> Prediction:
    """Predict one step's time and peak activation memory for ``choices``.

    Args:
        layers: the layers in forward order.
        choices: one of ``"keep"``, ``"offload"``, ``"recompute"`` per layer.
        step: the machine and the rest of the step.

    Returns:
        The :class:`Prediction` (NOTE [ Step cost model ]).

    Raises:
        ValueError: lengths differ, an unknown choice, a bandwidth that is not > 0, or
            no SSD tier without host bandwidths.
    """
    n = len(layers)
    if len(choices) != n:
        raise ValueError(f"ssdtrain: {len(choices)} choices for {n} layers.")
    for c in choices:
        if c not in CHOICES:
            raise ValueError(f"ssdtrain: unknown plan choice {c!r}; expected one of {CHOICES}.")
    _check_step(step)
    W, R = float(step.write_bps), float(step.read_bps)
    o = [_offloaded_bytes(layer, c) for layer, c in zip(layers, choices)]
    kept = [layer.saved_bytes if c == KEEP else 0 for layer, c in zip(layers, choices)]
    # NOTE [ Tiers in the step cost model ]: per layer, bytes to RAM (h), to the SSD
    # (s), kept on the device beyond the host budget (dev); off = h + s leave it.
    split = tier_split(o, step)
    if split is None:
        h, s, dev = [0] * n, o, [0] * n
        head_host, head_ssd, head_dev = 0, step.head_written_bytes, 0
        HW = HR = 1.0
    else:
        h, rest = split[0][:n], split[1][:n]
        s, dev = (rest, [0] * n) if step.ssd_tier else ([0] * n, rest)
        head_host = split[0][n]
        head_ssd, head_dev = (split[1][n], 0) if step.ssd_tier else (0, split[1][n])
        HW, HR = float(step.host_write_bps), float(step.host_read_bps)
    off = [a + b for a, b in zip(h, s)] if split is not None else o
    held = [a + b for a, b in zip(kept, dev)]
    head_off = step.head_written_bytes - head_dev

    # Forward: compute, and the disk (and the device -> host link) writing behind it.
    t = 0.0
    disk = 0.0
    link = 0.0
    stall = 0.0
    queue = []          # (write end time, bytes) not yet known to be written
    wdone = [0.0] * n
    hdone = [0.0] * n
    kept_so_far = 0
    fwd_peak = 0
    written_so_far = 0
    tail = step.tail_bytes(sum(o))
    for i, layer in enumerate(layers):
        t += layer.fwd_s + off[i] * step.fwd_s_per_byte
        if split is None:
            if o[i]:
                disk = max(disk, t) + o[i] / W
                wdone[i] = disk
                queue.append((disk, o[i]))
        elif off[i]:
            # Every byte crosses the device -> host link, in save order (the part that
            # goes on to the SSD first); the SSD's write streams behind its copy.
            start = max(link, t)
            if s[i]:
                link = start + s[i] / HW
                disk = max(max(disk, start) + s[i] / W, link)
                wdone[i] = disk
                start = link
            if h[i]:
                link = start + h[i] / HW
                hdone[i] = link
            # One write of the layer's bytes for the throttle, as without a host tier.
            queue.append((max(wdone[i], hdone[i]), off[i]))
        kept_so_far += held[i]
        written_so_far += off[i]
        # Forward waits while more than write_behind_bytes are queued (ssdtrain's
        # throttle, which counts the copies to RAM too): until the earliest writes end.
        queue = [(end, b) for end, b in queue if end > t]
        if split is not None:   # two servers: ends out of queueing order
            queue.sort(key=lambda e: e[0])
        backlog = sum(b for _, b in queue)
        # The rolling tail (the newest offloaded records, not yet queued for writing)
        # and the writes in flight: every one so far, as far as memory is concerned,
        # up to the throttle's limit (NOTE [ Memory timeline ]).
        fwd_peak = max(fwd_peak, kept_so_far + min(step.keep_tail_bytes, written_so_far) +
                       min(written_so_far, step.write_behind_bytes))
        while backlog > step.write_behind_bytes and queue:
            end, b = queue.pop(0)
            stall += end - t
            t = end
            backlog -= b
    # The end of forward: every kept layer, the kept tail, and the writes in flight:
    # the head's records beyond the tail, and those in flight when the last layer's
    # forward ended (nothing is retired during the head's forward: NOTE [ Memory
    # timeline ]); the head's records kept beyond the host budget.
    fwd_peak = max(fwd_peak, kept_so_far + tail + head_dev +
                   min(written_so_far + head_off, step.write_behind_bytes))
    t += step.fwd_other_s
    t_fwd = t

    # Backward: the head, then the layers in reverse; reads newest first, from the SSD
    # and (the host -> device direction, free when backward begins) from RAM.
    t = t_fwd + step.bwd_head_s
    disk = max(disk, t_fwd)
    link = t_fwd
    bstart = [None] * n
    rdone = [0.0] * n
    recompute = 0.0
    below = [0] * n  # offloaded bytes of layers <= i (for the window bound on memory)
    acc = 0
    for i in range(n):
        acc += off[i]
        below[i] = acc
    kept_below = [0] * n
    acc = 0
    for i in range(n):
        acc += held[i]
        kept_below[i] = acc
    # The head's backward: the kept layers, and the prefetch window, which holds the
    # kept tail first, then the head's records read back and the layers' first reads.
    window = max(step.prefetch_bytes, tail)
    bwd_peak = kept_so_far + head_dev + tail + min(max(0, step.prefetch_bytes - tail),
                                                   head_off + sum(off))
    begun = _Begun()  # the offloaded layers whose backward began, in time order
    for i in range(n - 1, -1, -1):
        layer = layers[i]
        if split is None:
            if o[i]:
                # The window: reads started and not yet used (layers j > i not yet begun).
                start = max(begun.read_start(disk, step.prefetch_bytes), wdone[i])
                disk = start + o[i] / R
                rdone[i] = disk
        else:
            # The host -> device link carries every byte back, newest first: the part
            # in RAM, then the part read from the SSD, streaming behind its read.
            if h[i]:
                start = max(begun.read_start(link, step.prefetch_bytes), hdone[i])
                link = start + h[i] / HR
                rdone[i] = link
            if s[i]:
                start = max(begun.read_start(disk, step.prefetch_bytes), wdone[i])
                disk = start + s[i] / R
                link = max(max(link, start) + s[i] / HR, disk)
                rdone[i] = link
        begin = max(t, rdone[i]) if off[i] else t
        stall += begin - t
        bstart[i] = begin
        if off[i]:
            begun.add(begin, off[i])
        extra = layer.fwd_s if choices[i] == RECOMPUTE else 0.0
        recompute += extra
        t = begin + layer.bwd_s + extra + off[i] * step.bwd_s_per_byte
        # The kept layers not yet consumed, the prefetch window (this layer's
        # offloaded bytes and the next ones', NOTE [ Memory timeline ]), and a
        # recomputed layer's working set (NOTE [ Recompute working set ]).
        in_use = kept_below[i] + min(window, below[i]) + \
            (layer.recompute_working_bytes if choices[i] == RECOMPUTE else 0)
        bwd_peak = max(bwd_peak, in_use)
    t += step.tail_s
    return Prediction(step_s=t + step.between_s, stall_s=stall, recompute_s=recompute,
                      peak_bytes=int(max(fwd_peak, bwd_peak) + step.fixed_bytes),
                      written_bytes=int(sum(off)), kept_bytes=int(sum(kept)), backward_end_s=t,
                      host_bytes=int(sum(h) + head_host), ssd_bytes=int(sum(s) + head_ssd),
                      device_bytes=int(sum(dev) + head_dev))


class _Begun:
    """The offloaded layers whose backward has begun, as ``(begin time, bytes)`` in the
    order they began (backward runs the layers in reverse, each after the last: times
    never decrease), with running byte sums, so that :meth:`read_start` costs O(layers)
    where a scan of every candidate time cost O(layers^2) (the plan search predicts
    thousands of plans: 15-20 s at 32 blocks)."""

    __slots__ = ("times", "cum")

    def __init__(self):
        self.times = []
        self.cum = [0]  # cum[k]: bytes of the first k layers

    def add(self, begin, nbytes):
        self.times.append(begin)
        self.cum.append(self.cum[-1] + nbytes)

    def read_start(self, disk, prefetch_bytes):
        """When the next read may start: the earliest time ``tau`` among ``disk`` (the disk
        is free) and the later begin times at which fewer than ``prefetch_bytes`` are
        read ahead of use (bytes of layers beginning after ``tau``); the latest
        candidate when there is none."""
        times, cum = self.times, self.cum
        total = cum[-1]
        k = bisect.bisect_right(times, disk)  # layers begun by the time the disk is free
        if total - cum[k] < prefetch_bytes:
            return disk
        while k < len(times):
            tau = times[k]
            k = bisect.bisect_right(times, tau, k)  # every layer beginning at tau
            if total - cum[k] < prefetch_bytes:
                return tau
        return times[-1] if times and times[-1] > disk else disk

def write_behind_for(layers: Sequence[LayerCost], choices: Sequence[str], step: StepCost,
                     budget_bytes: Optional[int]) -> int:
    """The write-behind limit that keeps forward's writes in flight inside the budget.

    Forward holds the kept layers' bytes, the kept tail and the writes in flight;
    ssdtrain's throttle makes forward wait once more than this many bytes are in
    flight: ``budget - fixed_bytes - kept bytes - tail`` (kept bytes: also those kept
    beyond the host budget without an SSD tier), capped at
    ``step.write_behind_bytes`` and at least 0 (NOTE [ Memory timeline ]). (The
    throttle acts per record, so one record may overshoot.)
    """
    if budget_bytes is None:
        return step.write_behind_bytes
    kept = sum(layer.saved_bytes for layer, c in zip(layers, choices) if c == KEEP)
    o = [_offloaded_bytes(layer, c) for layer, c in zip(layers, choices)]
    tail = step.tail_bytes(sum(o))
    split = tier_split(o, step)
    if split is not None and not step.ssd_tier:   # kept on the device beyond the host budget
        kept += sum(split[1])
    return max(0, min(step.write_behind_bytes, budget_bytes - step.fixed_bytes - kept - tail))


def throttled_step(layers, choices, step, budget_bytes):
    """``step`` with the write-behind limit of :func:`write_behind_for`."""
    wb = write_behind_for(layers, choices, step, budget_bytes)
    if wb == step.write_behind_bytes:
        return step
    return dataclasses.replace(step, write_behind_bytes=wb)
