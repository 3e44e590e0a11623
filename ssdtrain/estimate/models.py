"""Models to estimate: ``--factory``, Hugging Face configs, and the builder that makes one on
the meta device at a batch and sequence length."""

from __future__ import annotations

import importlib
import inspect
import json
import os
import sys
from typing import Any, Callable, Dict, Optional

import torch

from .._errors import ConfigError
from .replay import EstimateError
from .hardware import DTYPES


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
