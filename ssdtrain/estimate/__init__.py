"""Know before you buy or launch: what ssdtrain would save, offload and keep.

``ssdtrain estimate`` (also ``python -m ssdtrain estimate``) builds the model on the
meta device, runs one forward on fake tensors with ssdtrain's own pack decisions
(``ssdtrain/estimate/replay.py``), and reports per micro-batch and per repeated block the
bytes saved, deduplicated, offloaded and kept; with hardware numbers also the SSD
bandwidth needed to hide the I/O behind compute, the largest micro-batch that fits
device memory with no offload, full recompute and ssdtrain, and the drives' write
volume and endurance; with ``--plan`` the adaptive policy's keep / offload /
recompute plan per block within a memory budget, and its predicted step time and peak
memory beside none, checkpoint-all and offload-all (NOTE [ Plan from the estimate ]);
with ``--host-budget`` the host-RAM tier (NOTE [ Host tier ] in ``_store/hosttier.py``): the
bytes held in RAM, their peak, and those that go on to the SSD (or, with ``--no-ssd``,
stay in device memory), and with ``--plan`` each tier priced at its own bandwidth
(``--host-gbps`` for the device <-> host link).
Nothing is allocated: an 8B-parameter model at sequence 4096 estimates in seconds on a
laptop. Formulas: docs/estimate.md.

Example::

    ssdtrain estimate --hf-config examples/configs/llama-8b.json --seq 4096 \\
        --device-memory 139GiB --tflops 400 --ssd-write-gbps 6 --ssd-read-gbps 7 \\
        --ssds 4 --ssd-tbw 7000

    from ssdtrain.estimate import estimate, Hardware
    est = estimate("examples/configs/llama-8b.json", seq=4096,
                   hardware=Hardware(device_memory="139GiB", tflops=400,
                                     ssd_write_gbps=6, ssds=4))
    print(est.table()); est.to_json()
    print(est.plan().table())   # budget: device memory - weights, gradients, optimizer
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import json
import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

import torch

from .._config import (MAX_BYTES, OffloadConfig, budget_bytes, has_ssd_tier, parse_bytes,
                       resolve_budget)
from .._errors import ConfigError
from .replay import EstimateError, Measurement, measure

__all__ = ["estimate", "Estimate", "Hardware", "EstimateError", "hf_factory", "load_factory",
           "main", "DTYPES", "PlanEstimate", "make_plan", "plan_costs", "predict_choices",
           "compact_plan"]

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}

_SEARCH_LIMIT = 1 << 16   # largest micro-batch the search considers

# The range each hardware number may take: wide enough for any machine there is or will
# be soon, narrow enough that the formulas never overflow, underflow to 0 or give inf or
# NaN (a subnormal step time, 1e300 TFLOP/s). Outside it the number is a typo.
HARDWARE_RANGES = {
    "ssd_write_gbps": (1e-6, 1e6, "GB/s per drive", "7"),
    "ssd_read_gbps": (1e-6, 1e6, "GB/s per drive", "7"),
    "step_seconds": (1e-9, 1e9, "seconds", "0.5"),
    "tflops": (1e-6, 1e9, "TFLOP/s", "400"),
    "ssd_tbw": (1e-6, 1e9, "TB written", "7000"),
    "bytes_per_param": (1e-3, 1e6, "bytes per parameter", "16"),
    "host_gbps": (1e-6, 1e6, "GB/s each way", "25"),
}
MAX_SSDS = 1 << 20
DEFAULT_HOST_GBPS = 25.0
"""The device <-> host copy rate ``--plan`` prices the host tier at when ``--host-gbps``
is not given: about what a PCIe 4.0 x16 link sustains each way (32 GB/s raw)."""


@dataclass
class Hardware:
    """Hardware numbers, all optional; each output needs only some of them.

    Bandwidths are decimal GB/s (1e9 bytes per second) per drive; ``ssd_tbw`` is the
    drive's rated endurance in decimal TB written (1e12 bytes)."""

    device_memory: Optional[int] = None
    """Bytes of accelerator memory one training process may use (``"80GiB"`` accepted)."""
    ssd_write_gbps: Optional[float] = None
    ssd_read_gbps: Optional[float] = None
    """The plan (``Estimate.plan``) takes the write bandwidth when this is not given."""
    step_seconds: Optional[float] = None
    """Compute time of one micro-batch, forward + backward (no I/O)."""
    tflops: Optional[float] = None
    """Sustained TFLOP/s of the device; compute time = the model's FLOPs / this."""
    ssd_tbw: Optional[float] = None
    ssds: int = 1
    """Drives serving this device; ssdtrain stripes over them (``spill_dir`` list)."""
    bytes_per_param: float = 16.0
    """Device bytes per trainable parameter: weights, gradients, optimizer state.
    16 = mixed-precision Adam: 2 (bf16 weights) + 2 (bf16 grads) + 12 (fp32 master,
    m, v). Frozen parameters count their own size only."""
    host_gbps: Optional[float] = None
    """Device <-> host copy rate, decimal GB/s each way, at which the plan prices the
    host tier's bytes (NOTE [ Tiers in the step cost model ] in _policies/planner.py); default
    :data:`DEFAULT_HOST_GBPS`."""

    def __post_init__(self):
        if self.device_memory is not None:
            self.device_memory = parse_bytes(self.device_memory, name="device_memory")
        for name, (lo, hi, unit, example) in HARDWARE_RANGES.items():
            v = getattr(self, name)
            if v is None:
                continue
            flag = "--" + name.replace("_", "-")
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ConfigError(f"ssdtrain estimate: {name} ({flag}) must be a number of "
                                  f"{unit}, got {v!r}.")
            if not (math.isfinite(v) and lo <= v <= hi):
                what = ("is not a finite number" if not math.isfinite(v) else
                        "must be > 0" if v <= 0 else
                        "is too small to be real" if v < lo else "is too large to be real")
                raise ConfigError(f"ssdtrain estimate: {name} ({flag}) {what}: got {v!r}, "
                                  f"expected {unit} between {lo:g} and {hi:g} (e.g. {flag} "
                                  f"{example}).")
        if isinstance(self.ssds, bool) or not isinstance(self.ssds, int) \
                or not 1 <= self.ssds <= MAX_SSDS:
            raise ConfigError(f"ssdtrain estimate: ssds (--ssds) must be a whole number of "
                              f"drives between 1 and {MAX_SSDS}, got {self.ssds!r}.")

    @property
    def given(self) -> bool:
        return any(getattr(self, f.name) is not None for f in dataclasses.fields(self)
                   if f.name not in ("ssds", "bytes_per_param"))


# ------------------------------------------------------------------------ factories
def load_factory(spec: str) -> Callable:
    """``"package.module:function"`` -> the function (``ConfigError`` if it is not one)."""
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise ConfigError(f"ssdtrain estimate: --factory must be 'module:function' (e.g. "
                          f"'mypkg.models:make'), got {spec!r}.")
    mod_name, fn_name = spec.split(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(mod_name)
    except Exception as e:   # ImportError, or the module's own error at import
        raise ConfigError(f"ssdtrain estimate: cannot import module {mod_name!r} of --factory "
                          f"{spec!r}: {type(e).__name__}: {e}") from None
    fn = module
    for part in fn_name.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise ConfigError(f"ssdtrain estimate: module {mod_name!r} has no attribute "
                              f"{fn_name!r} (from --factory {spec!r}).")
    if not callable(fn):
        raise ConfigError(f"ssdtrain estimate: {spec!r} is not callable.")
    return fn


def _load_hf_config(path):
    try:
        import transformers
    except ImportError:
        raise ConfigError("ssdtrain estimate: --hf-config needs transformers "
                          "(pip install 'ssdtrain[hf]').") from None
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"ssdtrain estimate: --hf-config {path!r}: no such file (give a "
                          f"Hugging Face config.json, or the directory holding one).")
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"ssdtrain estimate: --hf-config {path!r} is not readable JSON: "
                          f"{e}") from None
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise ConfigError(f"ssdtrain estimate: --hf-config {path!r} has no 'model_type'; it "
                          f"does not look like a Hugging Face config.json.")
    try:
        return transformers.AutoConfig.for_model(**raw)
    except Exception as e:
        raise ConfigError(f"ssdtrain estimate: --hf-config {path!r}: transformers "
                          f"{transformers.__version__} cannot build a config from it: "
                          f"{type(e).__name__}: {e}") from None


def _hf_class(cfg):
    import transformers
    for name in getattr(cfg, "architectures", None) or ():
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    for auto in ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModelForMaskedLM",
                 "AutoModel"):
        mapping = getattr(transformers, auto)._model_mapping
        try:
            return mapping[type(cfg)]
        except KeyError:
            continue
    raise ConfigError(f"ssdtrain estimate: transformers has no model class for "
                      f"{type(cfg).__name__}.")


# Names that mark a model input or a sub-config as another modality than text.
_MODALITIES = (("vision", ("pixel", "image", "vision", "visual", "video", "backbone")),
               ("audio", ("audio", "speech", "acoustic", "input_features", "input_values",
                          "spectrogram", "wave")))


def non_text_inputs(cls, cfg=None):
    """``None`` for a text model (its main input is ``input_ids`` and no sub-config is
    another modality's), else ``(kind, inputs)``: ``"vision"``, ``"audio"`` or
    ``"multimodal"``, and what ``--hf-config`` cannot make (it builds ``input_ids`` and
    ``labels`` only): the forward's inputs of the other modalities, else the sub-configs
    that describe them."""
    main = getattr(cls, "main_input_name", "input_ids")
    subs = list(getattr(cfg if cfg is not None else getattr(cls, "config_class", None),
                        "sub_configs", None) or ())
    try:
        params = list(inspect.signature(cls.forward).parameters)
    except (TypeError, ValueError):
        params = []

    def kind_of(name):
        for kind, marks in _MODALITIES:
            if any(m in name for m in marks):
                return kind
        return None
    inputs = [p for p in params if kind_of(p) is not None and p != "self"
              and not p.endswith(("_layer", "_strategy", "_layers"))]   # options, not inputs
    subs = [n for n in subs if kind_of(n) is not None]
    kinds = {kind_of(n) for n in subs + inputs}
    if main != "input_ids":
        kinds.add(kind_of(main) or "non-text")
    if not kinds:
        return None
    if not inputs:
        inputs = [f"the inputs its {n} describes" for n in subs]
    if main != "input_ids" and main not in inputs:
        inputs.insert(0, main)
    kind = "multimodal" if main == "input_ids" or len(kinds) > 1 else kinds.pop()
    return kind, inputs


def _config_dtype(cfg):
    d = getattr(cfg, "dtype", None)
    if d is None:   # older transformers; newer ones warn on reading torch_dtype
        d = vars(cfg).get("torch_dtype")
    if isinstance(d, str):
        d = DTYPES.get(d)
    return d if isinstance(d, torch.dtype) else None


def hf_factory(config) -> Callable:
    """A factory for a Hugging Face config (a ``config.json`` path or a ``PretrainedConfig``).

    ``factory(batch=1, seq=None, dtype=None, gradient_checkpointing=False)`` returns
    ``(model, inputs)``: the class named in ``architectures`` (else the causal-LM,
    seq2seq-LM, masked-LM or base auto class) built with ``from_config`` in train mode,
    and keyword inputs ``input_ids`` (random ids, ``batch x seq``), ``labels`` (the same
    ids; one class per row for sequence classification) and ``use_cache=False``. It
    builds on whatever device is current: the estimate calls it under
    ``torch.device("meta")``, a test calls it as is for the real run it compares with.
    """
    cfg = config if not isinstance(config, (str, os.PathLike)) else _load_hf_config(config)
    cls = _hf_class(cfg)
    other = non_text_inputs(cls, cfg)
    if other is not None:
        kind, inputs = other
        raise ConfigError(
            f"ssdtrain estimate: {type(cfg).__name__} ({getattr(cfg, 'model_type', '?')!r}) is "
            f"{'an' if kind[0] in 'aeiou' else 'a'} {kind} model: {cls.__name__} needs "
            + (", ".join(inputs) if inputs else "inputs other than token ids")
            + " as well as or instead of input_ids, and a config alone builds token ids and "
            f"labels only. Estimate it with --factory module:function returning (model, "
            f"inputs) with those inputs (docs/estimate.md, 'Models that are not text').")

    def make(batch: int = 1, seq: Optional[int] = None, dtype=None,
             gradient_checkpointing: bool = False):
        dtype = dtype or _config_dtype(cfg) or torch.float32
        seq = seq or min(2048, _max_positions(cfg) or 2048)
        model = cls._from_config(cfg, dtype=dtype)
        model.train()
        if gradient_checkpointing:
            _enable_gc(model)
        vocab = getattr(cfg, "vocab_size", None) or 2
        ids = torch.randint(0, vocab, (batch, seq))
        inputs: Dict[str, Any] = {"input_ids": ids}
        name = cls.__name__
        if name.endswith("ForSequenceClassification"):
            inputs["labels"] = torch.randint(0, max(1, getattr(cfg, "num_labels", 2)), (batch,))
        elif any(name.endswith(s) for s in ("ForCausalLM", "LMHeadModel", "ForMaskedLM",
                                            "ForConditionalGeneration")):
            inputs["labels"] = ids
        params = inspect.signature(model.forward).parameters
        if "use_cache" in params:
            inputs["use_cache"] = False
        return model, inputs

    make.hf_config = cfg
    make.hf_class = cls
    return make


def _max_positions(cfg):
    for name in ("max_position_embeddings", "n_positions", "n_ctx"):
        v = getattr(cfg, name, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def _enable_gc(model):
    for name in ("activation_checkpointing_enable", "gradient_checkpointing_enable"):
        fn = getattr(model, name, None)
        if fn is not None:
            fn()
            return
    raise ConfigError(f"ssdtrain estimate: --gradient-checkpointing: {type(model).__name__} has "
                      f"no gradient_checkpointing_enable(); make the factory apply checkpointing "
                      f"(it may take a gradient_checkpointing keyword).")


def _factory_builder(factory, *, batch, seq, dtype, gradient_checkpointing):
    """``build()`` for :func:`ssdtrain.estimate.replay.measure`: the factory called with the
    keywords it accepts; checkpointing applied here if the factory does not take it."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    kw = {}
    for name, value in (("batch", batch), ("seq", seq), ("dtype", dtype),
                        ("gradient_checkpointing", gradient_checkpointing)):
        if value is not None and (name in params or var_kw):
            kw[name] = value
    takes_gc = "gradient_checkpointing" in kw

    def build():
        out = factory(**kw)
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise EstimateError(f"ssdtrain estimate: the factory must return (model, inputs), "
                                f"got {type(out).__name__}.")
        model, inputs = out
        if isinstance(model, torch.nn.Module):
            model.train()
            if gradient_checkpointing and not takes_gc:
                _enable_gc(model)
        return model, inputs
    return build, ("batch" in kw)


# ---------------------------------------------------------------------- the result
@dataclass
class Estimate:
    """The result of :func:`estimate`: per micro-batch bytes, per layer, and hardware math."""

    measurement: Measurement
    config: OffloadConfig
    hardware: Hardware
    batch: Optional[int]
    seq: Optional[int]
    dtype: Optional[torch.dtype]
    model: str
    times: Optional[Dict[str, float]] = None
    required_write_gbps: Optional[float] = None
    required_read_gbps: Optional[float] = None
    write_ok: Optional[bool] = None
    read_ok: Optional[bool] = None
    max_micro_batch: Optional[Dict[str, Optional[int]]] = None
    memory: Optional[Dict[str, int]] = None
    max_seq: Optional[Dict[str, Optional[int]]] = None
    """With ``longest_seq``: per mode (``none``, ``recompute``, ``ssdtrain``) the longest
    sequence, a multiple of ``seq_unit``, whose micro-batch fits ``device_memory``."""
    tb_written_per_day: Optional[float] = None
    drive_years: Optional[float] = None
    notes: tuple = ()
    host_budget_bytes: Optional[int] = None
    """The host tier's budget in bytes (``"auto"``/``"unlimited"`` resolved), or None."""
    ssd_tier: bool = True
    """Whether an SSD tier takes what is offloaded beyond the host tier (or everything,
    without one); False: a host tier alone, what does not fit stays in device memory."""

    # the fixed keys
    @property
    def unique_bytes(self):
        return self.measurement.unique_bytes

    @property
    def offloadable_bytes(self):
        return self.measurement.offloadable_bytes

    @property
    def kept_bytes(self):
        return self.measurement.kept_bytes

    @property
    def packed_bytes(self):
        return self.measurement.packed_bytes

    @property
    def layers(self):
        return self.measurement.layers

    @property
    def ssd_bytes(self) -> int:
        """Bytes written to the SSD per micro-batch: everything offloaded without a host
        tier; with one, what goes past RAM (``host_spilled_bytes``); 0 without an SSD."""
        m = self.measurement
        if not self.ssd_tier:
            return 0
        return m.offloadable_bytes if self.host_budget_bytes is None else m.host_spilled_bytes

    def host_tier(self) -> Optional[dict]:
        """The host tier per micro-batch (``--json``'s ``host_tier``), or None without one:
        ``budget_bytes``; ``ssd_tier``; ``host_bytes`` (in RAM when forward ends: what
        backward loads from RAM); ``peak_host_bytes`` (the most in RAM at once, at most the
        budget); ``ssd_bytes`` (went past RAM to the SSD); ``device_bytes`` (kept in device
        memory beyond the budget, only without an SSD tier). As ``Stats.host_bytes``,
        ``peak_host_bytes``, ``host_spilled_bytes``, ``over_budget_bytes`` count them."""
        if self.host_budget_bytes is None:
            return None
        m = self.measurement
        return {"budget_bytes": self.host_budget_bytes, "ssd_tier": self.ssd_tier,
                "host_bytes": m.host_bytes, "peak_host_bytes": m.peak_host_bytes,
                "ssd_bytes": m.host_spilled_bytes,
                "device_bytes": 0 if self.ssd_tier else m.over_budget_bytes}

    def to_json(self) -> dict:
        """The ``--json`` object. Fixed keys: ``unique_bytes``, ``offloadable_bytes``,
        ``kept_bytes``, ``packed_bytes``, ``layers`` (``name``, ``unique_bytes``,
        ``offloadable_bytes``, and more per layer); with hardware, those of
        ``required_write_gbps``, ``required_read_gbps``, ``max_micro_batch`` (``none``,
        ``recompute``, ``ssdtrain``), ``tb_written_per_day``, ``drive_years`` that the
        numbers given allow. Other keys add detail (docs/estimate.md)."""
        m = self.measurement
        out = {
            "unique_bytes": m.unique_bytes,
            "offloadable_bytes": m.offloadable_bytes,
            "kept_bytes": m.kept_bytes,
            "packed_bytes": m.packed_bytes,
            "layers": [lb.to_json() for lb in m.layers],
            "outside_layers": m.outside.to_json(),
            "kept_tail_bytes": m.kept_tail_bytes,
            "deduplicated_bytes": m.deduplicated_bytes,
            "over_budget_bytes": m.over_budget_bytes,
            "model": self.model,
            "parameters": m.params,
            "trainable_parameters": m.trainable_params,
            "batch": self.batch,
            "seq": self.seq,
            "dtype": None if self.dtype is None else str(self.dtype).replace("torch.", ""),
            "gradient_checkpointing": m.gradient_checkpointing,
            "forward_flops": m.flops,
            "layer_forward_flops": m.layer_flops,
            "settings": {"min_tensor_bytes": self.config.min_tensor_bytes,
                         "keep_tail_bytes": self.config.keep_tail_bytes,
                         "prefetch_bytes": self.config.prefetch_bytes,
                         "write_behind_bytes": self.config.write_behind_bytes,
                         "max_spill_bytes": self.config.max_spill_bytes,
                         "host_budget_bytes": self.host_budget_bytes},
        }
        if self.host_budget_bytes is not None:
            out["host_tier"] = self.host_tier()
        if self.hardware.given:
            out["hardware"] = {k: v for k, v in dataclasses.asdict(self.hardware).items()
                               if v is not None}
        if self.required_write_gbps is not None:
            out["required_write_gbps"] = self.required_write_gbps
            out["required_read_gbps"] = self.required_read_gbps
            out["seconds"] = self.times
            if self.write_ok is not None:
                out["write_ok"] = self.write_ok
            if self.read_ok is not None:
                out["read_ok"] = self.read_ok
        if self.max_micro_batch is not None:
            out["max_micro_batch"] = dict(self.max_micro_batch)
            out["memory_bytes"] = dict(self.memory)
        if self.max_seq is not None:
            out["max_seq"] = dict(self.max_seq)
        if self.tb_written_per_day is not None:
            out["tb_written_per_day"] = self.tb_written_per_day
        if self.drive_years is not None:   # inf (nothing written) is null: JSON has no inf
            out["drive_years"] = self.drive_years
        if self.notes:
            out["notes"] = list(self.notes)
        return _finite(out)

    def table(self) -> str:
        """A readable report (markdown tables)."""
        m = self.measurement
        dt = "" if self.dtype is None else str(self.dtype).replace("torch.", "") + ", "
        shape = ", ".join(x for x in (
            None if self.batch is None else f"micro-batch {self.batch}",
            None if self.seq is None else f"seq {self.seq}") if x)
        name = self.model if m.model_name in self.model else f"{self.model} ({m.model_name})"
        lines = [f"ssdtrain estimate: {name}, {m.params / 1e9:.2f} B "
                 f"parameters, {dt}{shape}"
                 + (", gradient checkpointing" if m.gradient_checkpointing else ""),
                 f"settings: min_tensor_bytes {_b(self.config.min_tensor_bytes)}, "
                 f"keep_tail_bytes {_b(self.config.keep_tail_bytes)}, prefetch_bytes "
                 f"{_b(self.config.prefetch_bytes)}", ""]
        rows = [("layer", "saved (per pack)", "unique", "offloaded", "kept", "held w/o offload")]
        for first, last, lb in _runs(m.layers):   # identical consecutive blocks: one row
            name = lb.name if first == last else \
                f"{m.layers[first].name} .. {m.layers[last].name} (each)"
            rows.append((name, _b(lb.packed_bytes), _b(lb.unique_bytes),
                         _b(lb.offloadable_bytes), _b(lb.kept_bytes), _b(lb.activation_bytes)))
        o = m.outside
        rows.append(("(outside layers)", _b(o.packed_bytes), _b(o.unique_bytes),
                     _b(o.offloadable_bytes), _b(o.kept_bytes), _b(m.outside_held_bytes)))
        rows.append(("**total per micro-batch**", _b(m.packed_bytes), _b(m.unique_bytes),
                     _b(m.offloadable_bytes), _b(m.kept_bytes), _b(m.held_bytes)))
        lines += _md(rows, right=range(1, 6))
        lines.append("")
        per_pack = m.kept_bytes - m.kept_tail_bytes - m.over_budget_bytes
        over = "host_budget_bytes" if not self.ssd_tier else "max_spill_bytes"
        lines.append(f"kept = {_b(per_pack)} per pack ({_b(m.kept_state_bytes)} of them "
                     f"parameters, {_b(per_pack - m.kept_state_bytes)} small or other kinds) + "
                     f"{_b(m.kept_tail_bytes)} tail"
                     + (f" + {_b(m.over_budget_bytes)} over {over}"
                        if m.over_budget_bytes else "")
                     + f"; deduplicated {_b(m.deduplicated_bytes)}"
                     + ("" if m.flops is None else
                        f"; forward {m.flops / 1e12:.3g} TFLOP per micro-batch"))
        tier = self.host_tier()
        if tier is not None:
            budget = "unlimited" if tier["budget_bytes"] >= MAX_BYTES else \
                _b(tier["budget_bytes"])
            lines.append("")
            lines += _md([("host tier (host_budget_bytes " + budget + ", "
                           + ("SSD beyond" if self.ssd_tier else "no SSD tier") + ")", ""),
                          ("in host RAM when forward ends", _b(tier["host_bytes"])),
                          ("peak in host RAM", _b(tier["peak_host_bytes"])),
                          ("on to the SSD (beyond the budget)" if self.ssd_tier else
                           "kept in device memory (beyond the budget)",
                           _b(tier["ssd_bytes"] if self.ssd_tier else tier["device_bytes"]))],
                         right=(1,))
        hw = []
        if self.required_write_gbps is not None:
            t = self.times
            hw.append(("compute per micro-batch", f"{t['forward']:.3f} s forward + "
                       f"{t['backward']:.3f} s backward"))
            hw.append(("SSD write needed (full overlap)", _gbps(self.required_write_gbps,
                                                                 self._provided("w"),
                                                                 self.write_ok)))
            hw.append(("SSD read needed (full overlap)", _gbps(self.required_read_gbps,
                                                                self._provided("r"),
                                                                self.read_ok)))
        if self.max_micro_batch is not None:
            mm = self.max_micro_batch
            mem = self.memory
            b = self.batch
            for mode, label in (("none", "no offload"), ("recompute", "full recompute"),
                                ("ssdtrain", "ssdtrain")):
                v = mm.get(mode)
                hw.append((f"largest micro-batch, {label}",
                           ("?" if v is None else str(v)) +
                           (f" ({_b(mem[mode])} at "
                            f"{'its batch' if b is None else f'micro-batch {b}'})"
                            if mode in mem else "")))
        if self.max_seq is not None:
            for mode, label in (("none", "no offload"), ("recompute", "full recompute"),
                                ("ssdtrain", "ssdtrain")):
                v = self.max_seq.get(mode)
                hw.append((f"longest sequence at micro-batch {self.batch}, {label}",
                           "?" if v is None else f"{v} tokens"))
        if self.tb_written_per_day is not None:
            hw.append(("written per day (all drives)", f"{self.tb_written_per_day:.1f} TB"))
        if self.drive_years is not None:
            hw.append((f"years to rated endurance ({self.hardware.ssd_tbw:g} TBW x "
                       f"{self.hardware.ssds})", f"{self.drive_years:.2f}"))
        if hw:
            lines.append("")
            lines += _md([("hardware", "")] + hw, right=())
        for n in self.notes:
            lines.append("")
            lines.append(f"note: {n}")
        return "\n".join(lines)

    def plan(self, memory_budget=None, *, max_plans: int = 6561) -> "PlanEstimate":
        """The per-block keep / offload / recompute plan for this estimate and its
        predicted step time and peak activation memory beside none, checkpoint-all and
        offload-all (:func:`make_plan`; ``ssdtrain estimate --plan``)."""
        return make_plan(self, memory_budget, max_plans=max_plans)

    def _provided(self, which):
        h = self.hardware
        v = h.ssd_write_gbps if which == "w" else h.ssd_read_gbps
        return None if v is None else v * h.ssds


def _runs(layers):
    """``(first, last, LayerBytes)`` for each run of consecutive blocks with equal bytes."""
    out = []
    for i, lb in enumerate(layers):
        key = dataclasses.astuple(lb)[1:]
        if out and out[-1][3] == key:
            out[-1][1] = i
        else:
            out.append([i, i, lb, key])
    return [(a, b, lb) for a, b, lb, _ in out]


def _gbps(need, have, ok):
    s = f"{need:.2f} GB/s"
    if have is not None:
        s += f" (have {have:.2f} GB/s: {'yes' if ok else 'NO'})"
    return s


def _b(n):
    if n is None:
        return "-"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _md(rows, right):
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    out = []
    for k, r in enumerate(rows):
        cells = [str(c).rjust(w) if i in right else str(c).ljust(w)
                 for i, (c, w) in enumerate(zip(r, widths))]
        out.append("| " + " | ".join(cells) + " |")
        if k == 0:
            out.append("| " + " | ".join(("-" * (w - 1) + ":") if i in right else "-" * w
                                         for i, w in enumerate(widths)) + " |")
    return out


# -------------------------------------------------------------------- the estimate
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
            children of every ``nn.ModuleList`` (``ssdtrain._policies.profile.default_layers``).
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


def _static_bytes(m: Measurement, hw: Hardware) -> int:
    """Weights, gradients and optimizer state: trainable x bytes_per_param + frozen + buffers."""
    return int(m.trainable_params * hw.bytes_per_param + m.frozen_param_bytes + m.buffer_bytes)


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


# ------------------------------------------------------------------------ the plan
# NOTE [ Plan from the estimate ]
# ``ssdtrain estimate --plan`` runs the adaptive policy's planner (_planner.plan and
# _planner.predict, the same functions, no copy) on costs built from the estimate
# instead of a profile:
#
# * per block: ``saved_bytes`` = its unique bytes (the records first created in it,
#   what ssdtrain would write if it offloads the block), ``input_bytes`` = its input
#   storages, ``recompute_bytes`` = its activation bytes (what a recompute creates and
#   holds, small tensors included); forward time = its forward FLOPs / TFLOP/s (or its
#   share of the forward FLOPs x --step-seconds / 3), backward 2x, a recompute the
#   forward again;
# * the rest: outside the blocks, forward time from the FLOPs outside them, backward
#   2x (all of it before the blocks' backward: the head's, the embedding's is small);
#   ``head_bytes`` = the unique bytes outside the blocks (before and after them: the
#   embedding's records are normally small token ids); ``fixed_bytes`` = the storages
#   kept per pack (small tensors, other kinds), held in every plan; no time after the
#   last backward (no optimizer, data or launch overhead: fold those into
#   --step-seconds); no CPU cost per byte of I/O (``fwd_s_per_byte`` 0: it is a
#   property of the host that only a run measures);
# * the disk: ``ssds x --ssd-write-gbps``, ``ssds x --ssd-read-gbps`` (default: the
#   write bandwidth); ssdtrain's prefetch window, write-behind limit and tail from the
#   settings;
# * with --host-budget, the host tier: its budget, whether an SSD lies beyond it
#   (--no-ssd: none, and no SSD bandwidth is needed), and the device <-> host copy
#   rate, --host-gbps each way (default DEFAULT_HOST_GBPS, a PCIe 4.0 x16 link): the
#   planner prices the bytes that fit the budget at the link's rate and the rest at
#   the SSD's, or holds them in device memory without an SSD (NOTE [ Tiers in the step
#   cost model ] in _policies/planner.py). Without --host-budget the planner prices every byte
#   at the SSD's bandwidth, as it always has.
#
# The budget for activations: --memory-budget, else --device-memory minus what the
# estimate puts on the device besides activations (weights, gradients, optimizer state:
# trainable x bytes_per_param, frozen parameters, buffers), else none. The three
# references are predicted with the same StepCost, at the configured settings as a
# static configuration runs them (no budget throttle): keep-all is
# "none" (no block offloaded or recomputed, so no layer I/O; its memory has the head's
# records as no offload holds them), recompute-all is ssdtrain's (its inputs offloaded,
# as ``set_plan`` with "recompute" does), offload-all is every block offloaded. The
# search predicts each plan with the write-behind limit lowered to fit the budget
# (``_planner.write_behind_for``; the adaptive policy runs it so); the table says when
# the plan needs that limit (``OffloadConfig(write_behind_bytes=...)`` with
# ``set_plan``). The uniform plans are in every search's family and a lower limit
# never slows a plan whose unthrottled peak fits (its writes in flight never reach
# the lower limit), so the plan's predicted step is never slower than a reference
# that fits the budget.
PLAN_LETTERS = {"keep": "K", "offload": "O", "recompute": "R"}
REFERENCES = (("none", "keep"), ("checkpoint_all", "recompute"), ("offload_all", "offload"))


def compact_plan(choices) -> str:
    """Run-length form of a plan: ``("offload", "offload", "keep")`` -> ``"O x2, K x1"``."""
    runs = []
    for c in choices:
        letter = PLAN_LETTERS[c]
        if runs and runs[-1][0] == letter:
            runs[-1][1] += 1
        else:
            runs.append([letter, 1])
    return ", ".join(f"{letter} x{n}" for letter, n in runs) or "(no blocks)"


@dataclass
class PlanEstimate:
    """What :meth:`Estimate.plan` predicts: the planner's choice per block, and the same
    cost model's step time and peak activation memory for it and the three references
    (NOTE [ Plan from the estimate ] in ``ssdtrain/estimate/__init__.py``)."""

    plan: Any
    """The planner's plan (``choices``, ``prediction``, ``fits``, ``table()``)."""
    references: Dict[str, Any]
    """``"none"``, ``"checkpoint_all"``, ``"offload_all"`` -> their predictions."""
    budget_bytes: Optional[int]
    budget_from: str
    """Where the budget came from (``--memory-budget``, device memory, or none)."""
    configured_write_behind_bytes: int = 0
    """The configured ``write_behind_bytes`` (the plan may need less:
    ``plan.write_behind_bytes``)."""

    @property
    def host_tier(self) -> bool:
        """Whether the plan prices a host tier (``--host-budget``)."""
        return self.plan.step.prices_host_tier

    @property
    def fits(self) -> bool:
        """Whether the plan's predicted peak fits the budget (always True without one)."""
        return bool(self.plan.fits)

    def reference_fits(self, name) -> bool:
        p = self.references[name]
        return self.budget_bytes is None or p.peak_bytes <= self.budget_bytes

    def _rows(self):
        n = len(self.plan.choices)
        yield "plan", self.plan.choices, self.plan.prediction, self.fits
        for name, choice in REFERENCES:
            yield name, (choice,) * n, self.references[name], self.reference_fits(name)

    def to_json(self) -> dict:
        """The ``"plan"`` object of ``--json`` (every number finite)."""
        def pred(p, choices, fits):
            out = {"layers": compact_plan(choices), "step_s": p.step_s, "stall_s": p.stall_s,
                   "recompute_s": p.recompute_s, "peak_bytes": p.peak_bytes,
                   "written_bytes": p.written_bytes, "kept_bytes": p.kept_bytes, "fits": fits}
            if self.host_tier:
                out.update(host_bytes=p.host_bytes, ssd_bytes=p.ssd_bytes,
                           device_bytes=p.device_bytes)
            return out
        s = self.plan.step
        rows = {name: pred(p, c, f) for name, c, p, f in self._rows()}
        out = {"choices": list(self.plan.choices),
               "names": [layer.name for layer in self.plan.layers],
               "compact": compact_plan(self.plan.choices), "fits": self.fits,
               "budget_bytes": self.budget_bytes, "budget_from": self.budget_from,
               "predicted": rows.pop("plan"), "references": rows,
               "plans_searched": self.plan.plans_searched,
               "write_bps": s.write_bps if s.ssd_tier else None,
               "read_bps": s.read_bps if s.ssd_tier else None,
               "write_behind_bytes": s.write_behind_bytes,
               "host_tier": None if not self.host_tier else {
                   "budget_bytes": s.host_budget_bytes, "ssd_tier": s.ssd_tier,
                   "write_bps": s.host_write_bps, "read_bps": s.host_read_bps}}
        return _finite(out)

    def table(self) -> str:
        """The plan and the references, one row each (markdown)."""
        none = self.references["none"].step_s
        budget = "no budget" if self.budget_bytes is None else \
            f"budget {_b(self.budget_bytes)} ({self.budget_from})"
        labels = {"plan": "**plan**", "none": "none (keep all)",
                  "checkpoint_all": "checkpoint-all (recompute all)",
                  "offload_all": "offload-all"}
        s = self.plan.step
        tiers = ()
        if self.host_tier:   # NOTE [ Tiers in the step cost model ]
            tiers = (("to host RAM", "host_bytes"),
                     ("to SSD", "ssd_bytes") if s.ssd_tier else
                     ("kept on device (over host budget)", "device_bytes"))
        rows = [("", "blocks", "step (ms)", "vs none", "stalls (ms)", "recompute (ms)",
                 "peak activations", "fits", "written per step")
                + tuple(label for label, _ in tiers)]
        for name, choices, p, fits in self._rows():
            rows.append((labels[name], compact_plan(choices), f"{p.step_s * 1e3:.1f}",
                         f"{p.step_s / none:.2f}x" if none > 0 else "-",
                         f"{p.stall_s * 1e3:.1f}", f"{p.recompute_s * 1e3:.1f}",
                         _b(p.peak_bytes), "yes" if fits else "NO", _b(p.written_bytes))
                        + tuple(_b(getattr(p, key)) for _, key in tiers))
        disk = f"disk {s.write_bps / 1e9:.2f} GB/s write, {s.read_bps / 1e9:.2f} GB/s read"
        if self.host_tier:
            budget_h = "unlimited" if s.host_budget_bytes >= MAX_BYTES else \
                _b(s.host_budget_bytes)
            disk = (f"host tier {budget_h} at {s.host_write_bps / 1e9:.2f} GB/s to host, "
                    f"{s.host_read_bps / 1e9:.2f} GB/s back, then "
                    + (disk if s.ssd_tier else "no SSD (the rest stays on the device)"))
        lines = [f"plan ({budget}; {disk}; {self.plan.plans_searched} plans "
                 f"searched): " + "".join(PLAN_LETTERS[c] for c in self.plan.choices)
                 + " (K keep, O offload, R recompute, first block first)", ""]
        lines += _md(rows, right=range(2, 9 + len(tiers)))
        wb = self.plan.write_behind_bytes
        if self.plan.prediction.written_bytes > wb and wb < self.configured_write_behind_bytes:
            lines.append("")
            lines.append(f"the plan keeps its writes in flight within the budget with "
                         f"write_behind_bytes {_b(wb)} (configured "
                         f"{_b(self.configured_write_behind_bytes)}): run it with "
                         f"OffloadConfig(write_behind_bytes={wb}) and set_plan, or "
                         f"policy='adaptive' with memory_budget_bytes.")
        if not self.fits:
            lines.append("")
            lines.append(f"NO plan fits the budget: the plan shown needs the least memory "
                         f"of those searched, {_b(self.plan.prediction.peak_bytes)}.")
        lines.extend(self.plan.notes)
        return "\n".join(lines)


def _check_plan_inputs(hw: Hardware, gradient_checkpointing: bool, ssd_tier: bool = True):
    """``ConfigError`` unless ``hw`` has what a plan needs (checked before the model runs;
    without an SSD tier no SSD bandwidth)."""
    missing = [flag for flag, ok in (("--tflops or --step-seconds",
                                      hw.tflops is not None or hw.step_seconds is not None),
                                     ("--ssd-write-gbps",
                                      hw.ssd_write_gbps is not None or not ssd_tier))
               if not ok]
    if missing:
        raise ConfigError(f"ssdtrain estimate: --plan needs {' and '.join(missing)} (the "
                          f"compute time and the disk's speed; --ssd-read-gbps defaults to the "
                          f"write bandwidth), e.g. --tflops 400 --ssd-write-gbps 7.")
    if gradient_checkpointing:
        raise ConfigError("ssdtrain estimate: --plan chooses per block between keeping, "
                          "offloading and recomputing; estimate the model without "
                          "--gradient-checkpointing (the plan's 'recompute' is checkpointing).")


def _parse_budget(memory_budget) -> int:
    b = parse_bytes(memory_budget, name="memory_budget (--memory-budget)")
    if b <= 0:
        raise ConfigError("ssdtrain estimate: memory_budget (--memory-budget) must be > 0 "
                          "bytes of activations, e.g. --memory-budget 40GiB.")
    return b


def plan_costs(est: "Estimate"):
    """``(layers, step)``: the planner's :class:`~ssdtrain._policies.planner.LayerCost` per block and
    :class:`~ssdtrain._policies.planner.StepCost` built from ``est`` (NOTE [ Plan from the estimate ]).

    Raises:
        ConfigError: a number the plan needs was not given, or the model was estimated
            with its own checkpointing.
        EstimateError: the model has no repeated blocks, or no FLOPs to time them by.
    """
    from .._policies.planner import LayerCost, StepCost
    m, hw, cfg = est.measurement, est.hardware, est.config
    _check_plan_inputs(hw, m.gradient_checkpointing, est.ssd_tier)
    if not m.layers:
        raise EstimateError(f"ssdtrain estimate: --plan plans per repeated block, and "
                            f"{m.model_name or 'the model'} has none (no nn.ModuleList); "
                            f"pass layers= to estimate() to name them.")
    total = m.flops or 0.0
    layer_flops = list(m.layer_flops or [0.0] * len(m.layers))
    if hw.tflops is not None:
        if total <= 0:
            raise EstimateError("ssdtrain estimate: the model's forward counts no FLOPs, so "
                                "--tflops cannot time it; give --step-seconds.")
        per_flop = 1.0 / (hw.tflops * 1e12)
    elif total > 0:
        per_flop = hw.step_seconds / 3.0 / total
    else:   # no FLOPs counted: the step split evenly over the blocks
        layer_flops, total = [1.0] * len(m.layers), float(len(m.layers))
        per_flop = hw.step_seconds / 3.0 / total
    outside_s = max(0.0, total - sum(layer_flops)) * per_flop
    layers = [LayerCost(name=lb.name, saved_bytes=lb.unique_bytes, input_bytes=lb.input_bytes,
                        fwd_s=f * per_flop, bwd_s=2.0 * f * per_flop,
                        recompute_bytes=lb.activation_bytes)
              for lb, f in zip(m.layers, layer_flops)]
    host = None if est.host_budget_bytes is None else \
        (hw.host_gbps if hw.host_gbps is not None else DEFAULT_HOST_GBPS) * 1e9
    if hw.ssd_write_gbps is not None:
        write = hw.ssd_write_gbps * hw.ssds * 1e9
        read = (hw.ssd_read_gbps if hw.ssd_read_gbps is not None else hw.ssd_write_gbps) \
            * hw.ssds * 1e9
    else:   # no SSD tier (--no-ssd): nothing is priced at the SSD's bandwidth
        write = read = host
    step = StepCost(write_bps=write, read_bps=read, fwd_other_s=outside_s,
                    bwd_head_s=2.0 * outside_s, tail_s=0.0, prefetch_bytes=cfg.prefetch_bytes,
                    write_behind_bytes=cfg.write_behind_bytes, fixed_bytes=m.kept_held_bytes,
                    head_bytes=m.outside.unique_bytes, keep_tail_bytes=cfg.keep_tail_bytes,
                    host_budget_bytes=est.host_budget_bytes or 0, host_write_bps=host,
                    host_read_bps=host, ssd_tier=est.ssd_tier)
    return layers, step


def plan_budget(est: "Estimate", memory_budget=None):
    """``(budget bytes or None, where it came from)`` (NOTE [ Plan from the estimate ])."""
    if memory_budget is not None:
        return _parse_budget(memory_budget), "--memory-budget"
    if est.hardware.device_memory is not None:
        static = _static_bytes(est.measurement, est.hardware)
        return max(0, est.hardware.device_memory - static), \
            f"device memory - {_b(static)} weights, gradients, optimizer state"
    return None, "none given"


def predict_choices(est: "Estimate", choices):
    """The cost model's prediction for a plan of your own: one of ``"keep"``,
    ``"offload"``, ``"recompute"`` per block, first block first (``plan.choices`` of
    ``--json``), at the configured settings, as ``set_plan`` runs it.

    Returns:
        The planner's ``Prediction`` (``step_s``, ``stall_s``, ``recompute_s``,
        ``peak_bytes``, ``written_bytes``, ``kept_bytes``; with a host tier where the
        bytes go: ``host_bytes``, ``ssd_bytes``, ``device_bytes``).

    Raises:
        ConfigError, EstimateError: as :func:`plan_costs`.
        ValueError: a wrong number of choices or an unknown choice.
    """
    from .._policies.planner import predict
    layers, step = plan_costs(est)
    return predict(layers, tuple(choices), step)


def make_plan(est: "Estimate", memory_budget=None, *, max_plans: int = 6561) -> PlanEstimate:
    """The planner's plan for ``est`` and the predictions beside it (``--plan``).

    Args:
        est: an :class:`Estimate` with ``--tflops`` or ``--step-seconds`` and
            ``--ssd-write-gbps`` (``--ssd-read-gbps`` defaults to it).
        memory_budget: activation bytes allowed (``"40GiB"`` accepted); default: device
            memory minus weights, gradients and optimizer state, else no budget.
        max_plans: most plans the search predicts (NOTE [ Plan search ] in _policies/planner.py).

    Raises:
        ConfigError, EstimateError: as :func:`plan_costs`; a bad ``memory_budget``.
    """
    from .._policies.planner import plan as search, predict
    budget, source = plan_budget(est, memory_budget)
    layers, step = plan_costs(est)
    best = search(layers, budget, step, max_plans=max_plans)
    refs = {}
    for name, choice in REFERENCES:
        choices = (choice,) * len(layers)
        s = step
        if name == "none":   # no offload: the head's records stay in memory too
            s = dataclasses.replace(step, head_bytes=0, keep_tail_bytes=0,
                                    fixed_bytes=step.fixed_bytes + step.head_bytes)
        refs[name] = predict(layers, choices, s)
    return PlanEstimate(plan=best, references=refs, budget_bytes=budget, budget_from=source,
                        configured_write_behind_bytes=step.write_behind_bytes)


# ---------------------------------------------------------------------------- CLI
class _Parser(argparse.ArgumentParser):
    def error(self, message):   # argparse style: usage, message, exit code 2
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parser(prog="ssdtrain estimate"):
    p = _Parser(prog=prog, description="Estimate what ssdtrain saves, offloads and keeps per "
                "micro-batch, from the model alone (meta device, fake tensors: nothing is "
                "allocated). Byte sizes take units (256KiB, 80GiB, 1.5GB); GB/s and TB are "
                "decimal.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf-config", metavar="PATH",
                     help="a Hugging Face config.json (or its directory); built with "
                          "from_config on the meta device, nothing downloaded")
    src.add_argument("--factory", metavar="MODULE:FUNCTION",
                     help="a function returning (model, inputs); called under "
                          "torch.device('meta') with those of batch, seq, dtype, "
                          "gradient_checkpointing it accepts")
    p.add_argument("--batch", type=int, help="micro-batch size (default 1 for --hf-config)")
    p.add_argument("--seq", type=int, help="sequence length (default min(2048, max positions))")
    p.add_argument("--dtype", help=f"one of {', '.join(sorted(DTYPES))} (default: the config's "
                                   f"dtype, else float32)")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="enable the model's activation checkpointing (non-reentrant)")
    g = p.add_argument_group("ssdtrain settings (OffloadConfig fields)")
    g.add_argument("--min-tensor-bytes", help="default 256KiB")
    g.add_argument("--keep-tail-bytes", help="default 128MiB")
    g.add_argument("--prefetch-bytes", help="default 256MiB (memory model only)")
    g.add_argument("--write-behind-bytes", help="default 1GiB (memory model only)")
    g.add_argument("--max-spill-bytes", help="disk budget (default none)")
    g.add_argument("--offload-quota", help="replay one step's offload quota of the default "
                   "policy (Stats.offload_quota_bytes; default: none, the most it offloads)")
    g.add_argument("--host-budget", metavar="SIZE|auto|unlimited",
                   help="host_budget_bytes: the host-RAM tier before the SSD (64GiB; 'auto': "
                        "half of this machine's memory limit; 'unlimited'). Reports the bytes "
                        "held in RAM, their peak and those going on to the SSD (default: no "
                        "host tier)")
    g.add_argument("--no-ssd", action="store_true",
                   help="with --host-budget: no SSD tier (no spill_dir); what does not fit "
                        "in the budget stays in device memory")
    h = p.add_argument_group("hardware (all optional)")
    h.add_argument("--device-memory", help="accelerator memory for one process, e.g. 80GiB")
    h.add_argument("--ssd-write-gbps", type=float, help="per drive, GB/s")
    h.add_argument("--ssd-read-gbps", type=float, help="per drive, GB/s")
    t = h.add_mutually_exclusive_group()
    t.add_argument("--step-seconds", type=float,
                   help="compute time of one micro-batch (forward + backward)")
    t.add_argument("--tflops", type=float,
                   help="sustained TFLOP/s; compute time from the model's FLOPs")
    h.add_argument("--ssd-tbw", type=float, help="drive endurance, TB written")
    h.add_argument("--ssds", type=int, default=1, help="drives for this device (default 1)")
    h.add_argument("--host-gbps", type=float,
                   help=f"with --plan and --host-budget: device <-> host copy rate, GB/s each "
                        f"way, at which the plan prices the bytes in host RAM (default "
                        f"{DEFAULT_HOST_GBPS:g}: a PCIe 4.0 x16 link)")
    h.add_argument("--bytes-per-param", type=float, default=16.0,
                   help="device bytes per trainable parameter for weights, gradients and "
                        "optimizer state (default 16: mixed-precision Adam)")
    pl = p.add_argument_group("plan (docs/estimate.md, 'Plan before launch')")
    pl.add_argument("--plan", action="store_true",
                    help="choose keep / offload / recompute per block with the adaptive "
                         "policy's planner and print its predicted step time and peak "
                         "activation memory beside none, checkpoint-all and offload-all; "
                         "needs --tflops or --step-seconds and --ssd-write-gbps (read "
                         "defaults to write; not with --no-ssd); with --host-budget the "
                         "bytes that fit in host RAM are priced at --host-gbps; exit "
                         "status 3 when no plan fits the budget")
    pl.add_argument("--memory-budget",
                    help="activation bytes the plan may hold, e.g. 40GiB (default: "
                         "--device-memory minus weights, gradients and optimizer state, "
                         "else none)")
    h.add_argument("--longest-seq", action="store_true",
                   help="with --device-memory: also search the longest sequence whose "
                        "micro-batch fits, with no offload, full recompute and ssdtrain "
                        "(from --seq, in steps of --seq-unit; the model runs on fake tensors "
                        "once per length tried, a line each on stderr)")
    h.add_argument("--seq-unit", type=int, default=1024,
                   help="granularity of --longest-seq in tokens (default 1024)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--traceback", action="store_true",
                   help="on an error, show Python's full traceback instead of one line")
    return p


def main(argv=None, prog="ssdtrain estimate") -> int:
    """The ``ssdtrain estimate`` command; returns the exit code (2: bad arguments)."""
    p = _parser(prog)
    a = p.parse_args(argv)
    try:
        overrides = {k: getattr(a, k) for k in ("min_tensor_bytes", "keep_tail_bytes",
                                                "prefetch_bytes", "write_behind_bytes",
                                                "max_spill_bytes")
                     if getattr(a, k) is not None}
        if a.host_budget is not None:
            word = a.host_budget.strip().lower()
            overrides["host_budget_bytes"] = word if word in ("auto", "unlimited") else \
                a.host_budget
        elif a.no_ssd:
            raise ConfigError("ssdtrain estimate: --no-ssd leaves only the host tier, which "
                              "needs --host-budget (e.g. --host-budget 64GiB).")
        try:
            cfg = OffloadConfig(**overrides)
        except ConfigError as e:
            if "host_budget_bytes" in str(e):   # name the flag the user typed
                raise ConfigError(f"{e} (--host-budget also takes 'auto' or "
                                  f"'unlimited')") from None
            raise
        ssd_tier = False if a.no_ssd else True
        hw = Hardware(device_memory=a.device_memory, ssd_write_gbps=a.ssd_write_gbps,
                      ssd_read_gbps=a.ssd_read_gbps, step_seconds=a.step_seconds,
                      tflops=a.tflops, ssd_tbw=a.ssd_tbw, ssds=a.ssds,
                      bytes_per_param=a.bytes_per_param, host_gbps=a.host_gbps)
        if a.host_gbps is not None and (a.host_budget is None or not a.plan):
            raise ConfigError("ssdtrain estimate: --host-gbps is the host tier's copy rate "
                              "that --plan prices it at; add --plan and --host-budget (e.g. "
                              "--host-budget 64GiB), or drop --host-gbps.")
        dtype = _dtype(a.dtype)
        if a.factory is not None:
            model = a.factory
            load_factory(model)   # a bad string or module is a usage error (exit 2)
        else:
            model = a.hf_config
            if not os.path.exists(model):
                raise ConfigError(f"ssdtrain estimate: --hf-config {model!r}: no such file "
                                  f"(give a Hugging Face config.json, or its directory).")
        planned = None
        if a.memory_budget is not None and not a.plan:
            raise ConfigError("ssdtrain estimate: --memory-budget is the plan's budget; add "
                              "--plan.")
        if a.plan:   # refused before the model runs
            _check_plan_inputs(hw, a.gradient_checkpointing, ssd_tier)
            if a.memory_budget is not None:
                _parse_budget(a.memory_budget)
        if a.longest_seq and hw.device_memory is None:
            raise ConfigError("ssdtrain estimate: --longest-seq needs --device-memory (e.g. "
                              "--device-memory 80GiB).")
        est = estimate(model, batch=a.batch, seq=a.seq, dtype=dtype,
                       gradient_checkpointing=a.gradient_checkpointing, config=cfg, hardware=hw,
                       offload_quota=a.offload_quota, ssd_tier=ssd_tier,
                       longest_seq=a.longest_seq, seq_unit=a.seq_unit,
                       progress=lambda line: print(line, file=sys.stderr, flush=True))
        if a.plan:
            planned = est.plan(a.memory_budget)
    except ConfigError as e:
        if a.traceback:
            raise
        p.print_usage(sys.stderr)
        print(f"{p.prog}: error: {_strip(e)}", file=sys.stderr)
        return 2
    except EstimateError as e:
        if a.traceback:
            raise
        print(f"{p.prog}: error: {_strip(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if a.traceback:
            raise
        print(f"{p.prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:   # the model's own code failed on fake tensors
        if a.traceback:
            raise
        print(f"{p.prog}: error: building or running the model on fake tensors failed: "
              f"{type(e).__name__}: {e} (--traceback shows where)", file=sys.stderr)
        return 1
    if a.json:
        out = est.to_json()
        if planned is not None:
            out["plan"] = planned.to_json()
        print(json.dumps(out, indent=2, default=_json_default, allow_nan=False))
    else:
        print(est.table())
        if planned is not None:
            print()
            print(planned.table())
    if planned is not None and not planned.fits:
        p_ = planned.plan.prediction
        print(f"{p.prog}: no plan fits the budget of {_b(planned.budget_bytes)} "
              f"({planned.budget_from}): the least memory predicted is {_b(p_.peak_bytes)} "
              f"({compact_plan(planned.plan.choices)}); give more memory, a smaller "
              f"micro-batch or sequence, or a larger --memory-budget.", file=sys.stderr)
        return 3
    return 0


def _strip(e):
    s = str(e)
    for prefix in ("ssdtrain estimate: ", "ssdtrain: "):
        if s.startswith(prefix):
            return s[len(prefix):]
    return s


def _finite(o):
    """``o`` with every float that is not finite as ``None``: JSON has no inf or NaN.
    (The hardware ranges keep the formulas finite; this is the last guard, e.g. a model
    that writes nothing lasts forever: ``drive_years`` is ``None``.)"""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o


def _json_default(o):
    if isinstance(o, float) and math.isinf(o):
        return None
    return str(o)


if __name__ == "__main__":   # pragma: no cover
    sys.exit(main())
