"""``ssdtrain estimate``: what ssdtrain would save, offload and keep, from the model alone.

The model is built on the meta device and its forward runs on fake tensors
(``FakeTensorMode``): shapes, dtypes, strides, storages and version counters are
real, data is not, and nothing is allocated. The saved-tensor hooks installed for
the forward make the pack decision on them by calling the very functions
``Store.pack`` calls (NOTE [ The pack decision ] in ``_decision/policy.py``): ``pass_reason``
(size threshold, kind, leaves, parameters and buffers by storage), ``find_record``
(dedup), ``record_range``, and a ``TailWindow`` (``keep_tail_bytes``, the spill
budget). The decision depends on the sequence of saves and releases and on the
configuration only, never on I/O timing, so the estimate's bytes are the real run's
exactly. docs/estimate.md has the formulas.

This module holds that replay, :func:`measure` and its :class:`Measurement`; the fake
tensors are made and run in estimate/fake.py (NOTE [ Why fake tensors and not plain
meta tensors ], NOTE [ Eager, not tracing ]), the FLOP count in estimate/flops.py.

NOTE [ Data-dependent shapes ]
An operator whose output shape depends on values (``nonzero``, ``torch.where`` with
one argument, ``masked_select``, ``unique``; a mixture-of-experts layer that loops over
the experts its tokens were routed to) cannot run on fake tensors: it raises, and the
estimate says which operator. Hugging Face MoE layers default to the ``grouped_mm``
experts implementation, whose shapes do not depend on the routing (every token's
top-k rows are sorted by expert and multiplied in one grouped matmul), so their
estimate is exact for every routing; docs/estimate.md bounds the per-expert loop.
"""

from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .._config import OffloadConfig, budget_bytes, has_ssd_tier
from .._identity import StorageWeakRef, byte_extent, record_range, storage_key
from .._decision.budget import HostBudget
from .._decision.policy import (KEEP_BUDGET, KEEP_QUOTA, TRACKER, PassedRanges, TailWindow,
                                is_offloadable_kind, pass_reason)
from .._policies.layers import _tensors, default_layers
from .._policies.profile import LayerProfiler
from .._decision.records import State, find_record
from .._stats import Stats
from .fake import _call, _eager_hints, _quiet_fake_tensor_log, fakeify
from .flops import _count_flops

__all__ = ["Measurement", "LayerBytes", "measure", "fakeify", "EstimateError"]


class EstimateError(Exception):
    """The model could not be estimated (the message says why and what to do)."""


# --------------------------------------------------------------------------- kinds
_KIND_CACHE: Dict[tuple, bool] = {}


def offloadable_kind(t: torch.Tensor) -> bool:
    """:func:`ssdtrain._decision.policy.is_offloadable_kind` of the plain tensor a fake one stands for.

    ``is_offloadable_kind`` refuses every tensor subclass, ``FakeTensor`` included; a
    fake tensor stands for a plain tensor of its device, dtype, layout and conj/neg
    bits. The rule itself is applied, unchanged, to an empty real tensor with those
    properties (cached per combination)."""
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
    if not isinstance(t, FakeTensor):
        return is_offloadable_kind(t)
    dev = t.device.type
    key = (t.dtype, dev, t.layout, t.is_conj(), t.is_neg(), t.is_quantized)
    ok = _KIND_CACHE.get(key)
    if ok is None:
        if t.is_quantized or t.layout != torch.strided:
            ok = False
        else:
            with unset_fake_temporarily():
                # "cuda" and "cpu" are treated alike by the rule; this machine may have no GPU.
                stand = torch.empty((1,), dtype=t.dtype,
                                    device="cpu" if dev in ("cpu", "cuda") else "meta")
                if t.is_conj():
                    stand = stand.conj()
                if t.is_neg():
                    stand = stand._neg_view()
                ok = is_offloadable_kind(stand)
        _KIND_CACHE[key] = ok
    return ok


# ------------------------------------------------------------------------ results
@dataclass
class LayerBytes:
    """Bytes of one repeated block (a child of an ``nn.ModuleList``) per micro-batch."""

    name: str
    packed_bytes: int = 0
    """Bytes of every tensor saved inside the block, per pack."""
    unique_bytes: int = 0
    """Bytes of the records first created inside the block (after dedup)."""
    offloadable_bytes: int = 0
    """Bytes of those records ssdtrain writes (not kept in the tail)."""
    kept_bytes: int = 0
    """Bytes kept in memory: per pack (small, parameters, other kinds) plus tail records."""
    activation_bytes: int = 0
    """Bytes of the storages first saved inside the block that autograd holds at the end of
    forward (what the block costs without offload), the block's input excluded."""
    input_bytes: int = 0
    """Bytes of the distinct storages of the block's tensor inputs (positional and keyword)."""

    def to_json(self):
        return dataclasses.asdict(self)


@dataclass
class Measurement:
    """What one fake forward saw (per micro-batch of ``batch``)."""

    batch: Optional[int]
    gradient_checkpointing: bool
    packed_bytes: int = 0
    unique_bytes: int = 0
    deduplicated_bytes: int = 0
    offloadable_bytes: int = 0
    kept_bytes: int = 0
    kept_tail_bytes: int = 0
    over_budget_bytes: int = 0
    quota_kept_bytes: int = 0      # kept because the replayed offload quota was spent
    dropped_bytes: int = 0
    # the host tier (NOTE [ Host tier ] in _store/hosttier.py), as Stats counts it
    host_bytes: int = 0            # in the host budget at the end of forward
    peak_host_bytes: int = 0
    host_spilled_bytes: int = 0    # went past RAM to the SSD
    layers: List[LayerBytes] = field(default_factory=list)
    outside: LayerBytes = field(default_factory=lambda: LayerBytes("(outside layers)"))
    # memory terms (bytes held at the end of forward), see docs/estimate.md
    held_bytes: int = 0            # every storage autograd holds (no offload)
    outside_held_bytes: int = 0    # storages first saved outside the blocks
    inputs_held_bytes: int = 0     # union of the blocks' input storages
    inputs_unseen_bytes: int = 0   # block inputs no hook saw, held by checkpointing (if on)
    kept_held_bytes: int = 0       # storages a kept handle holds (ssdtrain keeps them)
    max_layer_bytes: int = 0       # largest block's activation_bytes
    params: int = 0
    trainable_params: int = 0
    param_bytes: int = 0
    frozen_param_bytes: int = 0
    kept_state_bytes: int = 0      # per-pack kept bytes of parameters, buffers, leaves
    buffer_bytes: int = 0
    flops: Optional[float] = None  # forward FLOPs (FlopCounterMode), None if not counted
    layer_flops: Optional[List[float]] = None   # forward FLOPs per block (same count)
    model_name: str = ""

# --------------------------------------------------------------------- the replay
class _Storage:
    """A storage some pack saw: its bytes, the block that saved it first, live handles."""
    __slots__ = ("nbytes", "layer", "live", "kept_live", "ref")

    def __init__(self, nbytes, layer, ref):
        self.nbytes, self.layer, self.ref = nbytes, layer, ref
        self.live = 0        # live handles of any kind
        self.kept_live = 0   # live handles on the "keep in memory" path


class _Rec:
    """What the pack decision reads of a ``_records.Record``: range, version, storage
    size, state (PENDING in the tail window -> ON_DISK (decided: written) | KEPT ->
    FREED), reserved spill bytes."""
    __slots__ = ("key", "lo", "hi", "nbytes", "version", "ptr", "span", "layer", "fate",
                 "live", "reserved", "device", "tier")

    @property
    def state(self):
        """What the replay decided for it, read by the shared ``find_record``. Named
        ``fate`` where it is written: only the store's ``transition()`` writes a
        ``state`` (tests/test_contracts.py)."""
        return self.fate

    def __init__(self, key, lo, hi, version, span, layer):
        self.key, self.lo, self.hi, self.nbytes = key, lo, hi, hi - lo
        self.version, self.span, self.layer = version, span, layer
        self.ptr = _NO_ADDRESS
        self.fate = State.PENDING
        self.live = 0
        self.reserved = 0
        self.device = False     # a device record (the host tier takes only those)
        self.tier = 0           # its place in the host budget (HostBudget)


# A fake storage has no address; the store compares a storage's data pointer with its
# record's only to see a resize_() or set_ between two saves, which no model does.
_NO_ADDRESS = 0


class _Handle:
    """What the pack hook returns; its death is the graph releasing the saved tensor.

    It holds no reference to the tensor (the store's ``Handle`` holds a weak one): a
    tensor saved by the node that made it (``exp`` saves its output) would hold its node,
    which holds this handle, a cycle only the garbage collector frees, so the release
    would come late (or never, before forward ends) where the real run's comes at once."""
    __slots__ = ("sim", "st", "rec", "kept")

    def __init__(self, sim, st, rec, kept):
        self.sim, self.st, self.rec, self.kept = sim, st, rec, kept

    def __del__(self):
        sim = self.sim
        if sim is not None:
            sim._inbox.append((self.st, self.rec, self.kept))  # applied at the next pack


class _Replay:
    """The saved-tensor hooks: the pack decision on fake tensors (NOTE [ The pack
    decision ] in _decision/policy.py), by the functions ``Store.pack`` calls, plus the
    estimate's own bookkeeping (per layer bytes, storages held for the memory terms)."""

    def __init__(self, cfg: OffloadConfig, profiler: Optional[LayerProfiler], m: Measurement,
                 device_records: bool = False, quota: Optional[int] = None,
                 ssd_tier: Optional[bool] = None):
        self.cfg = cfg
        # NOTE [ Host tier ] in _store/hosttier.py: the same HostBudget as HostTier.admit_locked.
        budget = budget_bytes(cfg.host_budget_bytes)
        ssd = has_ssd_tier(cfg) if ssd_tier is None else ssd_tier
        self.host = None if budget is None else HostBudget(budget, ssd, m)
        self.device_records = device_records
        self.min_bytes = max(1, cfg.min_tensor_bytes)
        self.prof = profiler
        self.m = m     # the Measurement being filled
        self.registry: Dict[int, List[_Rec]] = {}
        self.storages: Dict[int, _Storage] = {}
        self.window = TailWindow(cfg.keep_tail_bytes, cfg.max_spill_bytes)
        self.window.begin_step(quota)  # Store._begin_pass_locked (NOTE [ The offload quota ])
        self.passed = PassedRanges()   # past the quota (NOTE [ The pack decision ])
        self._inbox = collections.deque()

    def _layer(self):
        return None if self.prof is None else self.prof.current_index()

    def _lb(self, i):
        return self.m.outside if i is None else self.m.layers[i]

    def pack(self, t):
        self._drain()
        m = self.m
        nbytes = t.numel() * t.element_size()
        layer = self._layer()
        lb = self._lb(layer)
        m.packed_bytes += nbytes
        lb.packed_bytes += nbytes
        leaf = t.requires_grad and t.grad_fn is None
        try:
            storage = t.untyped_storage()
            key = storage_key(storage)
        except (RuntimeError, NotImplementedError, TypeError):
            storage = key = None
        state = leaf or (key is not None and TRACKER.contains(key))
        st = None
        if key is not None and not state:   # an activation: it costs memory without offload
            st = self.storages.get(key)
            if st is None:
                st = self.storages[key] = _Storage(storage.nbytes(), layer,
                                                   StorageWeakRef(storage))
            st.live += 1
        # The pack decision, by the functions Store.pack calls (NOTE [ The pack decision ]).
        reason, storage, key = pass_reason(t, nbytes, self.min_bytes, TRACKER.contains,
                                           offloadable_kind)
        if reason is not None:   # kept in memory, counted per pack
            m.kept_bytes += nbytes
            lb.kept_bytes += nbytes
            if state:
                m.kept_state_bytes += nbytes
            if st is not None:
                st.kept_live += 1
            return _Handle(self, st, None, True)
        version = t._version
        extent = byte_extent(t)
        span = storage.nbytes()
        if self.window.spent and not self.registry.get(key):  # Store._pass_spent
            added = self.passed.add(key, version, extent, _NO_ADDRESS, span)
            if added:
                m.unique_bytes += added
                lb.unique_bytes += added
                m.quota_kept_bytes += added
                m.kept_bytes += added
                lb.kept_bytes += added
            else:
                m.deduplicated_bytes += nbytes
            return _Handle(self, st, None, False)  # held as a kept record's bytes are
        rec = find_record(self.registry.get(key), version, extent, _NO_ADDRESS, span)
        if rec is None:
            lo, hi = record_range(extent, span)
            rec = _Rec(key, lo, hi, version, span, layer)
            rec.device = self.device_records
            self.registry.setdefault(key, []).append(rec)
            m.unique_bytes += rec.nbytes
            lb.unique_bytes += rec.nbytes
            window = self.window
            window.add(rec)
            if window.nbytes > window.keep_bytes:
                self._decide()
        else:
            m.deduplicated_bytes += nbytes
            self.window.touch(rec)
        rec.live += 1
        return _Handle(self, st, rec, False)

    def unpack(self, h):   # never called: the estimate runs no backward
        raise EstimateError("ssdtrain estimate: the estimate runs forward only; please "
                            "report this bug.")

    def _decide(self):
        """WritePath.decide_locked: the window's oldest records leave it, decided."""
        m = self.m
        host = self.host
        for rec, reason in self.window.overflow():
            lb = self._lb(rec.layer)
            if reason is None and host is not None and not self._admit(rec):
                rec.fate = State.KEPT  # HostTier.keep_host_record_locked / admit_locked
                m.kept_bytes += rec.nbytes
                lb.kept_bytes += rec.nbytes
                continue
            if reason == KEEP_BUDGET or reason == KEEP_QUOTA:
                rec.fate = State.KEPT
                m.kept_bytes += rec.nbytes
                if reason == KEEP_BUDGET:
                    m.over_budget_bytes += rec.nbytes
                else:
                    m.quota_kept_bytes += rec.nbytes
                lb.kept_bytes += rec.nbytes
            else:   # written (Stats.offloaded_bytes counts it however soon it dies)
                rec.fate = State.ON_DISK
                m.offloadable_bytes += rec.nbytes
                lb.offloadable_bytes += rec.nbytes

    def _admit(self, rec):
        """WritePath.decide_locked with a host tier: whether ``rec`` leaves memory (to RAM
        or to the SSD); what is kept beyond the budget is counted here."""
        host, m = self.host, self.m
        if not rec.device:  # host memory: written with an SSD tier, else kept
            return host.evicts
        admitted, evicted = host.admit(rec)
        m.host_spilled_bytes += sum(r.nbytes for r in evicted)
        if admitted:
            return True
        if host.evicts:
            m.host_spilled_bytes += rec.nbytes
            return True
        m.over_budget_bytes += rec.nbytes
        return False

    def _drain(self):
        """Handles the graph released (Repair.released_locked / RecordTable.free)."""
        inbox = self._inbox
        while inbox:
            st, rec, kept = inbox.popleft()
            if st is not None:
                st.live -= 1
                if kept:
                    st.kept_live -= 1
            if rec is not None:
                rec.live -= 1
                if rec.live == 0 and rec.fate is not State.FREED:
                    if self.window.discard(rec):   # freed before a decision: never written
                        self.m.dropped_bytes += rec.nbytes
                    self.window.release(rec)
                    if self.host is not None:
                        self.host.release(rec)
                    rec.fate = State.FREED
                    group = self.registry.get(rec.key)
                    if group is not None and rec in group:
                        group.remove(rec)

    def end_pass(self):
        """Store._end_pass_locked: the records still in the tail are kept."""
        self._drain()
        for rec in self.window.close():
            rec.fate = State.KEPT
            self.m.kept_bytes += rec.nbytes
            self.m.kept_tail_bytes += rec.nbytes
            self._lb(rec.layer).kept_bytes += rec.nbytes


class _InputProbe:
    """Forward pre-hooks (with keyword arguments) on the blocks: their input storages."""

    def __init__(self, layers):
        self.inputs: Dict[int, Tuple[int, int]] = {}   # key -> (nbytes, first layer)
        self.per_layer = [dict() for _ in layers]
        self._refs = []
        self.handles = [m.register_forward_pre_hook(self._hook(i), with_kwargs=True)
                        for i, (_, m) in enumerate(layers)]

    def _hook(self, i):
        def pre(module, args, kwargs):
            if not torch.is_grad_enabled():
                return None
            for t in _tensors((args, kwargs)):
                if t.requires_grad and t.grad_fn is None:
                    continue   # a parameter passed in
                try:
                    s = t.untyped_storage()
                except (RuntimeError, NotImplementedError, TypeError):
                    continue
                key = storage_key(s)
                if TRACKER.contains(key):
                    continue
                self._refs.append(StorageWeakRef(s))
                self.per_layer[i][key] = s.nbytes()
                self.inputs.setdefault(key, (s.nbytes(), i))
            return None
        return pre

    def remove(self):
        for h in self.handles:
            h.remove()

def measure(build: Callable[[], Tuple[torch.nn.Module, Any]], cfg: OffloadConfig, *,
            batch: Optional[int] = None, gradient_checkpointing: bool = False,
            count_flops: bool = False, layers=None, device: str = "cpu",
            device_records: Optional[bool] = None,
            offload_quota: Optional[int] = None,
            ssd_tier: Optional[bool] = None) -> Measurement:
    """Build the model on the meta device, run one forward on fake tensors with the
    replayed pack hooks, and return what it saved.

    Args:
        build: called under ``torch.device("meta")``; returns ``(model, inputs)`` where
            ``inputs`` is a tuple (positional), a dict (keywords) or one tensor.
        cfg: the ssdtrain settings whose pack decisions are replayed.
        batch: recorded in the result only.
        gradient_checkpointing: recorded in the result only (``build`` applies it).
        count_flops: count the forward's FLOPs with ``FlopCounterMode``, in a forward of
            its own (the counter changes tensor lifetimes, so never in the measured one).
        layers: a callable ``model -> [(name, module), ...]`` naming the repeated blocks;
            default :func:`ssdtrain._policies.layers.default_layers` (children of ModuleLists).
        device: the device the fake tensors claim (kernel choice follows it).
        device_records: whether the saved tensors are device records (the host tier,
            ``host_budget_bytes``, takes only those); default: ``device == "cuda"``.
        offload_quota: the step's offload quota to replay (``Stats.offload_quota_bytes``
            of a step under ``policy="auto"``, NOTE [ The offload quota ] in _policies/auto.py);
            ``None``: no quota, the static rules (what ``"auto"`` offloads at most).
        ssd_tier: with ``host_budget_bytes``, whether an SSD tier lies beyond the host
            tier (records beyond the budget go on to it) or not (they stay in device
            memory); ``None``: as ``cfg`` says (``_config.has_ssd_tier``: a
            ``spill_dir``, or no host tier). The estimate never opens a spill directory.

    Raises:
        EstimateError: the forward has data-dependent shapes, or failed on fake tensors.
    """
    from torch._subclasses.fake_tensor import (DataDependentOutputException,
                                               DynamicOutputShapeException, FakeTensorMode)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with torch.device("meta"):
        model, inputs = build()
    if not isinstance(model, torch.nn.Module):
        raise EstimateError(f"ssdtrain estimate: the factory must return (model, inputs) with "
                            f"model an nn.Module, got {type(model).__name__}.")
    inputs = fakeify(model, inputs, mode, device)
    named = list((layers or default_layers)(model))
    m = Measurement(batch=batch, gradient_checkpointing=gradient_checkpointing,
                    layers=[LayerBytes(n) for n, _ in named],
                    model_name=type(model).__name__)
    for p in model.parameters():   # each shared parameter once
        m.params += p.numel()
        m.param_bytes += p.numel() * p.element_size()
        if p.requires_grad:
            m.trainable_params += p.numel()
        else:
            m.frozen_param_bytes += p.numel() * p.element_size()
    m.buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    prof = LayerProfiler(named, Stats(), 1) if named else None
    probe = _InputProbe(named)
    sim = _Replay(cfg, prof, m, device == "cuda" if device_records is None else device_records,
                  offload_quota, ssd_tier)
    out = None
    try:
        if prof is not None:
            prof.open_step(timed=False)
        with mode, _eager_hints(), _quiet_fake_tensor_log():
            TRACKER.start(sim)  # the replay is a user of the tracker while it intercepts
            try:
                with torch.autograd.graph.saved_tensors_hooks(sim.pack, sim.unpack):
                    out = _call(model, inputs)
            finally:
                TRACKER.stop(sim)
        if prof is not None:
            prof.end_forward()
        sim.end_pass()
        _memory_terms(m, sim, probe)
    except (DynamicOutputShapeException, DataDependentOutputException) as e:
        raise EstimateError(
            f"ssdtrain estimate: the forward of {type(model).__name__} has data-dependent "
            f"shapes ({e}); fake tensors carry no values, so it cannot be estimated as is. A "
            f"mixture-of-experts layer that loops over the experts its tokens were routed to "
            f"does this: use a routing-independent implementation (Hugging Face: "
            f"experts_implementation='grouped_mm'; see docs/estimate.md for the bound).") from None
    finally:
        if prof is not None:
            prof.remove()
        probe.remove()
        del out
        sim._inbox.clear()
    if count_flops:
        m.flops, m.layer_flops = _count_flops(build, device, layers)
    return m

def _memory_terms(m: Measurement, sim: _Replay, probe: _InputProbe):
    """Bytes held at the end of forward, for the micro-batch search (docs/estimate.md)."""
    inputs = probe.inputs
    live = {k: st for k, st in sim.storages.items() if st.live > 0}
    m.inputs_held_bytes = sum(n for n, _ in inputs.values())
    # A block input no pack saw is held by the checkpoint around the block (non-reentrant
    # checkpointing keeps its inputs itself); without checkpointing nothing holds it.
    if m.gradient_checkpointing:
        m.inputs_unseen_bytes = sum(n for k, (n, _) in inputs.items() if k not in live)
    m.held_bytes = sum(st.nbytes for st in live.values()) + m.inputs_unseen_bytes
    m.outside_held_bytes = sum(st.nbytes for k, st in live.items()
                               if st.layer is None and k not in inputs)
    m.outside.activation_bytes = m.outside_held_bytes
    m.kept_held_bytes = sum(st.nbytes for st in live.values() if st.kept_live > 0)
    for k, st in live.items():
        if st.layer is not None and k not in inputs:
            m.layers[st.layer].activation_bytes += st.nbytes
    for i, d in enumerate(probe.per_layer):
        m.layers[i].input_bytes = sum(d.values())
    m.max_layer_bytes = max((lb.activation_bytes for lb in m.layers), default=0)
