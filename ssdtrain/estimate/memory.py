"""``estimate()``: one replay of the pack decision, then the memory and hardware arithmetic
(docs/estimate.md)."""

from __future__ import annotations

import inspect
import math
import os
from typing import Callable, Dict, Optional

import torch

from .._config import OffloadConfig, budget_bytes, has_ssd_tier, parse_bytes, resolve_budget
from .._errors import ConfigError
from .replay import Measurement, measure
from .format import _b
from .hardware import _SEARCH_LIMIT, DTYPES, Hardware, _static_bytes
from .models import _config_dtype, _factory_builder, _max_positions, hf_factory, load_factory
from .report import Estimate


def estimate(model, *, batch: Optional[int] = None, seq: Optional[int] = None, dtype=None,
             gradient_checkpointing: bool = False, config: Optional[OffloadConfig] = None,
             hardware: Optional[Hardware] = None, layers=None,
             offload_quota: Optional[int] = None, ssd_tier: Optional[bool] = None,
             longest_seq: bool = False, seq_unit: int = 1024,
             progress: Optional[Callable[[str], None]] = None) -> Estimate:
    """Estimate what ssdtrain saves, offloads and keeps for one micro-batch of ``model``.

    Args:
        model: a Hugging Face ``config.json`` path (or directory, or ``PretrainedConfig``),
            a ``"module:function"`` string, or a factory. A factory is called under
            ``torch.device("meta")`` with those of ``batch``, ``seq``, ``dtype`` and
            ``gradient_checkpointing`` its signature takes, and returns ``(model,
            inputs)``: inputs a tuple (positional), a dict (keywords) or one tensor.
        batch: the micro-batch size (``None``: the factory's default; 1 for a config).
        seq: the sequence length (Hugging Face default: ``min(2048, max positions)``).
        dtype: a ``torch.dtype`` or a name in :data:`DTYPES`.
        gradient_checkpointing: enable the model's own activation checkpointing.
        config: the :class:`~ssdtrain.OffloadConfig` whose decisions are replayed
            (default: the defaults; ``spill_dir`` is not used).
        hardware: :class:`Hardware` numbers for bandwidth, micro-batch and endurance.
        layers: a callable ``model -> [(name, module), ...]`` naming the repeated blocks
            (the model is built inside, so modules cannot be passed); default: the
            children of every ``nn.ModuleList`` (``ssdtrain._policies.layers.default_layers``).
        offload_quota: with ``policy="auto"``: a step's offload quota in
            bytes to replay (``Stats.offload_quota_bytes`` of that step); ``None``: no
            quota, which is the most ``"auto"`` offloads (and what ``"static"`` does).
        ssd_tier: with the config's ``host_budget_bytes``: whether an SSD lies beyond the
            host tier (True, ``--host-budget``) or not (False, ``--no-ssd``: what does not
            fit stays in device memory); ``None``: as the config says (a ``spill_dir``,
            which is never opened, or none: no SSD tier, as a real run). The saved tensors
            are replayed as device tensors, as on an accelerator: the host tier takes
            only those (NOTE [ Host tier ]). ``"auto"`` is resolved on *this* machine.
        longest_seq: with ``hardware.device_memory``: also search, per mode, the longest
            sequence (a multiple of ``seq_unit``) whose micro-batch of ``batch`` fits
            (:attr:`Estimate.max_seq`). Each length tried builds and runs the model on
            fake tensors again (seconds each for a large model).
        seq_unit: the granularity of that search, in tokens (default 1024).
        progress: called with a line per length tried by that search (the CLI prints
            them to stderr); None: silent.

    Raises:
        ConfigError: a bad argument (path, dtype, factory string, hardware number).
        EstimateError: the model cannot run on fake tensors (message says why).
    """
    cfg = config if config is not None else OffloadConfig()
    if not isinstance(cfg, OffloadConfig):
        raise ConfigError("ssdtrain estimate: config must be an OffloadConfig.")
    hw = hardware if hardware is not None else Hardware()
    dtype = _dtype(dtype)
    host_budget, ssd = _host_tier_settings(cfg, ssd_tier)
    for name, v in (("batch", batch), ("seq", seq)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ConfigError(f"ssdtrain estimate: {name} must be an int >= 1, got {v!r}.")
    notes = []
    if offload_quota is not None:
        offload_quota = parse_bytes(offload_quota, name="offload_quota")
        if cfg.policy != "auto":
            raise ConfigError(f"ssdtrain estimate: offload_quota is the quota of "
                              f"policy='auto', but the config's policy is {cfg.policy!r}; "
                              f"drop offload_quota or use policy='auto'.")
    if cfg.policy == "adaptive":
        notes.append("policy='adaptive' decides per layer at run time; the estimate replays "
                     "the static rules.")
    elif cfg.policy == "auto" and offload_quota is None:
        notes.append("policy='auto' offloads at most this: each step's offload "
                     "quota is chosen at run time from what earlier steps measured (the first "
                     "steps offload nothing); pass --offload-quota (a step's "
                     "Stats.offload_quota_bytes) to replay one step.")
    label = "factory"
    if isinstance(model, str) and ":" in model and not os.path.exists(model):
        label = model
        factory = load_factory(model)
    elif isinstance(model, (str, os.PathLike)):
        label = os.path.basename(os.fspath(model).rstrip("/")) or os.fspath(model)
        factory = hf_factory(model)
        batch = batch or 1
    elif callable(model):
        label = getattr(model, "__name__", "factory")
        factory = model
    else:
        try:
            factory = hf_factory(model)   # a PretrainedConfig
        except Exception:
            raise ConfigError(f"ssdtrain estimate: model must be a config.json path, "
                              f"'module:function', a factory or a PretrainedConfig; got "
                              f"{type(model).__name__}.") from None
        label = type(model).__name__
        batch = batch or 1
    if batch is None:   # the factory's own default, if it declares one
        try:
            default = inspect.signature(factory).parameters["batch"].default
        except (KeyError, TypeError, ValueError):
            default = None
        if isinstance(default, int) and not isinstance(default, bool) and default >= 1:
            batch = default
    hf_cfg = getattr(factory, "hf_config", None)
    if hf_cfg is not None:
        label = f"{label} [{factory.hf_class.__name__}]"
        if seq is None:
            seq = min(2048, _max_positions(hf_cfg) or 2048)
        mp = _max_positions(hf_cfg)
        if mp is not None and seq > mp:
            notes.append(f"seq {seq} exceeds the config's {mp} positions.")
        if dtype is None:
            dtype = _config_dtype(hf_cfg) or torch.float32
        if getattr(hf_cfg, "num_local_experts", None) or getattr(hf_cfg, "num_experts", None):
            impl = getattr(hf_cfg, "_experts_implementation", None)
            notes.append("mixture of experts: with the grouped_mm experts implementation "
                         "(the transformers default) saved shapes do not depend on the routing "
                         "and the estimate is exact; a per-expert loop ('eager') saves a "
                         "routing-dependent set, bounded in docs/estimate.md"
                         + (f" (configured: {impl})" if impl else "") + ".")

    if longest_seq:
        if isinstance(seq_unit, bool) or not isinstance(seq_unit, int) or seq_unit < 1:
            raise ConfigError(f"ssdtrain estimate: seq_unit must be an int >= 1, got "
                              f"{seq_unit!r}.")
        if hw.device_memory is None:
            raise ConfigError("ssdtrain estimate: the longest sequence that fits needs the "
                              "device's memory (hardware.device_memory, --device-memory).")
        if seq is None:
            raise ConfigError("ssdtrain estimate: the longest sequence is searched from a "
                              "given one: pass seq (--seq).")
    cache: Dict[tuple, Measurement] = {}

    def at(b, gc, flops=False, s=None):
        s = seq if s is None else s
        key = (b, gc, s)
        if key not in cache:
            if s != seq and progress is not None:
                progress(f"ssdtrain estimate: trying seq {s} ({'checkpointed' if gc else 'plain'})")
            build, _ = _factory_builder(factory, batch=b, seq=s, dtype=dtype,
                                        gradient_checkpointing=gc)
            # device_records: the run modelled is an accelerator's (only the host tier
            # tells device records from host ones).
            cache[key] = measure(build, cfg, batch=b, gradient_checkpointing=gc,
                                 count_flops=flops, layers=layers, offload_quota=offload_quota,
                                 device_records=True, ssd_tier=ssd)
        return cache[key]

    _, batch_varies = _factory_builder(factory, batch=batch or 1, seq=seq, dtype=dtype,
                                       gradient_checkpointing=gradient_checkpointing)
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        for name, value in (("seq", seq), ("dtype", dtype)):
            if value is not None and name not in params:
                notes.append(f"the factory takes no '{name}' keyword: {name} {value} is "
                             f"not applied.")
        if longest_seq and "seq" not in params:
            raise ConfigError("ssdtrain estimate: the longest sequence is searched by "
                              "building the model at other lengths, but the factory takes "
                              "no 'seq' keyword; add one (or drop longest_seq, "
                              "--longest-seq).")
    main_m = at(batch, gradient_checkpointing, flops=True)
    est = Estimate(measurement=main_m, config=cfg, hardware=hw, batch=batch, seq=seq,
                   dtype=dtype, model=label, host_budget_bytes=host_budget, ssd_tier=ssd)
    if host_budget is not None:
        if cfg.host_budget_bytes == "auto":
            notes.append(f"host_budget_bytes='auto' is resolved on this machine, in this "
                         f"process's cgroup: {_b(host_budget)}, {resolve_budget('auto')[1]}; "
                         f"give a size for another host's.")
        if ssd:
            notes.append("the bandwidth and endurance figures count only the bytes that "
                         "reach the SSD; the device <-> host copies of the host tier are "
                         "assumed to hide behind compute here (--plan prices them at "
                         "--host-gbps).")
    _hardware_math(est, main_m, hw, gradient_checkpointing)
    if hw.device_memory is not None:
        static = _static_bytes(main_m, hw)

        def mem(b, s=None):
            mb = at(b, gradient_checkpointing, s=s)
            plain = at(b, False, s=s) if gradient_checkpointing else mb
            return _memory(mb, plain, cfg, static)
        est.memory = mem(batch)
        if batch is None or not batch_varies:
            est.max_micro_batch = {k: None for k in ("none", "recompute", "ssdtrain")}
            notes.append("the factory takes no 'batch' keyword, so the largest micro-batch "
                         "cannot be searched; memory is shown for its own batch."
                         if not batch_varies else "pass a batch (--batch) to search the "
                         "largest micro-batch; memory is shown for the factory's batch.")
        else:
            est.max_micro_batch = {k: _largest(lambda b, k=k: mem(b)[k], hw.device_memory,
                                               batch) for k in ("none", "recompute", "ssdtrain")}
        if longest_seq:
            b = batch or 1
            u0 = max(1, seq // seq_unit)
            est.max_seq = {k: seq_unit * _largest(lambda u, k=k: mem(b, u * seq_unit)[k],
                                                   hw.device_memory, u0)
                           for k in ("none", "recompute", "ssdtrain")}
            notes.append(f"the longest sequence assumes the memory of a step grows with its "
                         f"length; searched in steps of {seq_unit} tokens at micro-batch {b}"
                         + ("" if hf_cfg is None or _max_positions(hf_cfg) is None else
                            f" (the config has {_max_positions(hf_cfg)} positions)") + ".")
    est.notes = tuple(notes)
    return est


def _dtype(d):
    if d is None or isinstance(d, torch.dtype):
        return d
    if isinstance(d, str) and d.lower().replace("torch.", "") in DTYPES:
        return DTYPES[d.lower().replace("torch.", "")]
    raise ConfigError(f"ssdtrain estimate: unknown dtype {d!r}; use one of "
                      f"{', '.join(sorted(DTYPES))}.")


def _host_tier_settings(cfg: OffloadConfig, ssd_tier):
    """``(host budget bytes or None, whether there is an SSD tier)`` of an estimate, with
    the refusals ``OffloadConfig.resolve`` makes for a host tier without an SSD."""
    host_budget = budget_bytes(cfg.host_budget_bytes)
    if host_budget is None:
        if ssd_tier is False:
            raise ConfigError("ssdtrain estimate: no SSD tier (ssd_tier=False, --no-ssd) needs "
                              "a host tier to offload to; give host_budget_bytes "
                              "(--host-budget), e.g. --host-budget 64GiB.")
        return None, True
    ssd = has_ssd_tier(cfg) if ssd_tier is None else bool(ssd_tier)
    if not ssd and cfg.max_spill_bytes is not None:
        raise ConfigError("ssdtrain estimate: max_spill_bytes (--max-spill-bytes) is a budget "
                          "for the SSD tier, but a host tier without an SSD (--no-ssd) has "
                          "none; drop one of them.")
    if not ssd and cfg.policy == "adaptive":
        raise ConfigError("ssdtrain estimate: policy='adaptive' plans against an SSD's "
                          "bandwidth; a host tier without an SSD has none.")
    return host_budget, ssd


def _memory(m: Measurement, plain: Measurement, cfg: OffloadConfig, static: int) -> Dict[str, int]:
    """Device bytes at the peak of a step for the three modes (docs/estimate.md).

    ``m``: the model as configured; ``plain``: the same without checkpointing (the size of
    one block's activations while it is recomputed)."""
    layer = plain.max_layer_bytes
    gc_extra = layer if m.gradient_checkpointing else 0
    none = static + m.held_bytes + gc_extra
    recompute = static + plain.outside_held_bytes + plain.inputs_held_bytes + layer
    tail = m.kept_tail_bytes
    writes = min(cfg.write_behind_bytes, m.offloadable_bytes)
    window = min(m.unique_bytes, max(cfg.prefetch_bytes, tail))
    # Records kept past a budget (max_spill_bytes, or host_budget_bytes without an SSD
    # tier) stay in device memory from their decision until backward uses them.
    base = static + m.kept_held_bytes + m.inputs_unseen_bytes + m.over_budget_bytes
    fwd = base + tail + writes
    # In use during backward: the block being differentiated (recomputed, with
    # checkpointing), or the part outside the blocks (head and loss), backward's first.
    in_use = max(gc_extra if m.gradient_checkpointing else m.max_layer_bytes,
                 m.outside_held_bytes)
    bwd = base + window + in_use
    return {"static": static, "none": none, "recompute": recompute, "ssdtrain": max(fwd, bwd)}


def _largest(mem_at: Callable[[int], int], limit: int, b0: int) -> int:
    """Largest micro-batch ``b`` with ``mem_at(b) <= limit`` (0 if none), assuming memory
    grows with ``b``: an affine fit through ``b0`` and ``b0 + 1`` proposes it, and
    direct measurements at the proposal and its neighbour confirm (or a bisection
    between measured bounds corrects) it."""
    m0, m1 = mem_at(b0), mem_at(b0 + 1)
    slope = m1 - m0
    if slope <= 0:
        guess = _SEARCH_LIMIT
    else:
        guess = b0 + math.floor((limit - m0) / slope)
    guess = max(1, min(_SEARCH_LIMIT, guess))
    lo, hi = 0, _SEARCH_LIMIT + 1       # mem(lo) fits (0: trivially), mem(hi) does not
    for b, v in ((b0, m0), (b0 + 1, m1)):
        if v <= limit:
            lo = max(lo, b)
        else:
            hi = min(hi, b)
    for b in (guess, guess + 1):
        if lo < b < hi:
            if mem_at(b) <= limit:
                lo = b
            else:
                hi = b
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if mem_at(mid) <= limit:
            lo = mid
        else:
            hi = mid
    return lo


def _hardware_math(est: Estimate, m: Measurement, hw: Hardware, gc: bool):
    """Compute time, bandwidth for full overlap, write volume and endurance."""
    passes = 3 + (1 if gc else 0)   # forward, backward = 2 forwards, + 1 recompute
    if hw.step_seconds is not None:
        t_f = hw.step_seconds / passes
    elif hw.tflops is not None and m.flops:
        t_f = m.flops / (hw.tflops * 1e12)
    else:
        return
    t_b = t_f * (passes - 1)
    w = est.ssd_bytes   # with a host tier, only what goes past RAM reaches the SSD
    est.times = {"forward": t_f, "backward": t_b}
    est.required_write_gbps = w / t_f / 1e9
    est.required_read_gbps = w / t_b / 1e9
    fwd_io, bwd_io = t_f, t_b
    if hw.ssd_write_gbps is not None:
        have = hw.ssd_write_gbps * hw.ssds
        est.write_ok = have >= est.required_write_gbps
        fwd_io = max(t_f, w / (have * 1e9))
    if hw.ssd_read_gbps is not None:
        have = hw.ssd_read_gbps * hw.ssds
        est.read_ok = have >= est.required_read_gbps
        bwd_io = max(t_b, w / (have * 1e9))
    per_mb = fwd_io + bwd_io
    est.times["micro_batch"] = per_mb
    est.tb_written_per_day = w * (86400.0 / per_mb) / 1e12
    if hw.ssd_tbw is not None:
        per_drive = est.tb_written_per_day / hw.ssds
        est.drive_years = math.inf if per_drive == 0 else hw.ssd_tbw / per_drive / 365.0
