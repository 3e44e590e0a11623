"""DeepSpeed adapter: a ``"ssdtrain"`` section in the DeepSpeed config switches offloading on.

:func:`initialize` is a drop-in for :func:`deepspeed.initialize`: same arguments,
same ``(engine, optimizer, dataloader, lr_scheduler)`` tuple. It takes the
``"ssdtrain"`` section out of the config before DeepSpeed sees it, and makes the
engine run every forward (with gradients enabled) under an
:class:`ssdtrain.Offloader`; ``engine.backward(loss)`` and ``engine.step()`` are
DeepSpeed's own. Each rank spills into its own subdirectory of ``spill_dir``
(see :mod:`ssdtrain.integrations.distributed`).

Example::

    ds_config = {
        "train_batch_size": 32,
        "zero_optimization": {"stage": 2},
        "ssdtrain": {"spill_dir": "/nvme/ssdtrain", "prefetch_bytes": "1GiB"},
    }
    engine, optimizer, _, _ = ssdtrain.integrations.deepspeed.initialize(
        model=model, optimizer=optimizer, config=ds_config)
    for batch in data:
        loss = engine(batch)          # saved activations go to the SSD
        engine.backward(loss)         # and come back, prefetched
        engine.step()
    print(engine.ssdtrain.stats().summary())
    engine.destroy()                  # also closes the offloader

Keys of the section: every :class:`ssdtrain.OffloadConfig` field (``spill_dir``,
``min_tensor_bytes``, ``prefetch_bytes``, ``keep_tail_bytes``, ...; ``SSDTRAIN_*``
environment variables fill the ones left out), plus ``"enabled"`` (default true;
false leaves DeepSpeed exactly as without the section) and ``"checkpoint_inputs"``
(default true; see NOTE [ DeepSpeed activation checkpointing ]).

ZeRO stage 3 gathers each module's parameters in its own forward pre-hook, after
ssdtrain's global hook has looked at them; the adapter adds a hook behind
DeepSpeed's that marks the gathered storages as parameters, so gathered weights
(and their transposes) are never offloaded.
"""

import base64
import contextlib
import dataclasses
import inspect
import logging
import os
import tempfile
import threading
import weakref

import torch

import deepspeed
from deepspeed.runtime.activation_checkpointing import checkpointing as _ds_checkpointing

import ssdtrain

from .distributed import rank_spill_dir

__all__ = ["SECTION", "initialize", "checkpoint", "non_reentrant_checkpoint"]

log = logging.getLogger("ssdtrain")

SECTION = "ssdtrain"
"""The key of ssdtrain's section in the DeepSpeed config."""

_ADAPTER_KEYS = ("enabled", "checkpoint_inputs")

# NOTE [ DeepSpeed activation checkpointing ]
#
# Neither of DeepSpeed's checkpoints lets saved-tensor hooks see what it keeps:
# `checkpoint` (reentrant, an autograd Function) stashes the region's inputs as
# `ctx.deepspeed_saved_tensors`, a plain attribute; `non_reentrant_checkpoint`
# keeps them in a closure and installs its own saved-tensor hooks for the region,
# whose tensors are recomputed in backward. Inside a region nothing is saved, so
# nothing is offloaded; the inputs are what stays in memory, one per checkpointed
# layer -- the activations DeepSpeed users asked to move to NVMe (DeepSpeed #1201).
#
# Inside an engine forward, the adapter's `checkpoint` / `non_reentrant_checkpoint`
# (installed as `deepspeed.checkpointing.checkpoint` / `.non_reentrant_checkpoint`
# when `checkpoint_inputs` is on; they call DeepSpeed's own) hand DeepSpeed a stand-in
# for each floating-point input: a view of it (`x.view_as(x)`, so gradients flow to
# `x`) that DeepSpeed stashes. Once the region's forward has run, the stand-in's bytes
# are packed by the offloader like any saved tensor (deduplicated, written, prefetched
# for backward in reverse order), its `.data` is emptied, and `saved_data` is set to a
# restorer. DeepSpeed's backward of both checkpoints already restores stashed inputs
# with `t.data = t.saved_data.to(t.device)` (the protocol of its own
# `cpu_checkpointing`), which unpacks the record just before recomputing the region.
# The caller's tensor is never touched (only the stand-in is emptied); leaves that
# require grad (parameters), non-float tensors, and inputs marked `no_checkpointing`
# stay as they are. With DeepSpeed's `partition_activations` or `cpu_checkpointing`
# on, DeepSpeed itself replaces the inputs, and the adapter leaves them alone.


def initialize(*args, **kwargs):
    """:func:`deepspeed.initialize` with an ssdtrain section in the config.

    Takes exactly the arguments of :func:`deepspeed.initialize` (``args``, ``model``,
    ``optimizer``, ``model_parameters``, ``config``, ...) and returns its tuple
    ``(engine, optimizer, training_dataloader, lr_scheduler)``. The config (a dict,
    a path to a JSON/HJSON file, a base64 string, or ``args.deepspeed_config``) may
    hold an ``"ssdtrain"`` section; it is removed before DeepSpeed reads the config
    (the caller's dict and file are left unchanged). With the section enabled:

    * ``engine.ssdtrain`` is the :class:`ssdtrain.Offloader` (``None`` without the
      section or with ``"enabled": false``): ``engine.ssdtrain.stats()``,
      ``engine.ssdtrain.wait()``, ``engine.ssdtrain.close()``.
    * every ``engine(...)`` with gradients enabled runs under it; backward needs no
      change.
    * its ``spill_dir`` is this rank's subdirectory of the configured one
      (:func:`ssdtrain.integrations.distributed.rank_spill_dir`).
    * ``engine.destroy()`` (also run when the engine is garbage collected) closes it.

    Raises:
        ssdtrain.ConfigError: the section is not a dict, has an unknown key (the
            message lists the valid ones), or a value is invalid; or the model is a
            ``PipelineModule`` (pipeline engines are not supported yet).
    """
    bound = inspect.signature(deepspeed.initialize).bind(*args, **kwargs)
    params = bound.arguments
    source, original = _config_source(params)
    loaded = _load_config(original)
    if loaded is None or SECTION not in loaded:
        engine_tuple = deepspeed.initialize(*bound.args, **bound.kwargs)
        engine_tuple[0].ssdtrain = None
        return engine_tuple

    section = _parse_section(loaded[SECTION])
    ds_config = {k: v for k, v in loaded.items() if k != SECTION}
    if section.config is not None:
        pipeline = getattr(deepspeed, "PipelineModule", None)
        if pipeline is not None and isinstance(params.get("model"), pipeline):
            raise ssdtrain.ConfigError(
                "ssdtrain: the DeepSpeed adapter does not support pipeline parallelism "
                "(a PipelineModule) yet; remove the \"ssdtrain\" section (or set "
                "\"enabled\": false) for this model.")

    with _config_swapped(params, source, ds_config):
        engine_tuple = deepspeed.initialize(*bound.args, **bound.kwargs)
    engine = engine_tuple[0]
    if section.config is None:
        engine.ssdtrain = None
        return engine_tuple
    try:
        base = section.config.spill_dir or [tempfile.gettempdir()]
        config = section.config.replace(spill_dir=rank_spill_dir(base))
        offloader = ssdtrain.Offloader(config)
    except BaseException:
        with contextlib.suppress(Exception):
            engine.destroy()
        raise
    _attach(engine, offloader, section.checkpoint_inputs)
    log.info("ssdtrain: DeepSpeed engine (ZeRO stage %s) offloads to %s",
             engine.zero_optimization_stage(), ", ".join(config.spill_dir))
    return engine_tuple


def checkpoint(function, *args, **kwargs):
    """:func:`deepspeed.checkpointing.checkpoint` whose stashed inputs go to the SSD.

    Inside the forward of an engine made by :func:`initialize` (with
    ``checkpoint_inputs`` on, the default), the region's floating-point inputs are
    offloaded and restored just before the region is recomputed in backward; see
    NOTE [ DeepSpeed activation checkpointing ]. Anywhere else it is DeepSpeed's
    ``checkpoint``. With ``checkpoint_inputs`` on, :func:`initialize` also installs it
    as ``deepspeed.checkpointing.checkpoint``.
    """
    return _checkpoint_spilling_inputs(_DS_CHECKPOINT, function, args, kwargs)


def non_reentrant_checkpoint(function, *args):
    """:func:`deepspeed.checkpointing.non_reentrant_checkpoint` whose stashed inputs go to the SSD.

    Same behaviour as :func:`checkpoint`, for DeepSpeed's non-reentrant variant.
    """
    return _checkpoint_spilling_inputs(_DS_NON_REENTRANT, function, args, {})


# ------------------------------------------------------------------------- config

@dataclasses.dataclass(frozen=True)
class _Section:
    config: "ssdtrain.OffloadConfig | None"  # None: disabled
    checkpoint_inputs: bool


def _parse_section(section) -> _Section:
    if not isinstance(section, dict):
        raise ssdtrain.ConfigError(
            f"ssdtrain: the \"{SECTION}\" section of the DeepSpeed config must be a dict of "
            f"settings, got {type(section).__name__} {section!r}; e.g. "
            f"{{\"spill_dir\": \"/nvme/ssdtrain\"}}.")
    fields = [f.name for f in dataclasses.fields(ssdtrain.OffloadConfig)]
    valid = list(_ADAPTER_KEYS) + fields
    for key in section:
        if key not in valid:
            raise ssdtrain.ConfigError(
                f"ssdtrain: unknown key {key!r} in the \"{SECTION}\" section of the DeepSpeed "
                f"config; valid keys are {', '.join(valid)}.")
    flags = {}
    for key in _ADAPTER_KEYS:
        value = section.get(key, True)
        if not isinstance(value, bool):
            raise ssdtrain.ConfigError(
                f"ssdtrain: \"{SECTION}.{key}\" in the DeepSpeed config must be true or false, "
                f"got {value!r}.")
        flags[key] = value
    if not flags["enabled"]:
        return _Section(None, flags["checkpoint_inputs"])
    overrides = {k: v for k, v in section.items() if k in fields}
    config = ssdtrain.OffloadConfig.from_env(**overrides)  # validates, naming the field
    for d in config.spill_dir or ():
        if not os.path.isdir(d):
            raise ssdtrain.ConfigError(
                f"ssdtrain: spill_dir {d!r} (\"{SECTION}.spill_dir\" in the DeepSpeed config or "
                f"SSDTRAIN_SPILL_DIR) does not exist or is not a directory; create it first.")
    return _Section(config, flags["checkpoint_inputs"])


def _config_source(params):
    """Where deepspeed.initialize will read its config from: ``(name, value)``.

    The order is DeepSpeed's: ``config``, else ``config_params``, else
    ``args.deepspeed_config``, else the deprecated ``args.deepscale_config``.
    """
    if params.get("config") is not None:
        return "config", params["config"]
    if params.get("config_params") is not None:
        return "config_params", params["config_params"]
    ds_args = params.get("args")
    for attr in ("deepspeed_config", "deepscale_config"):
        if getattr(ds_args, attr, None) is not None:
            return "args." + attr, getattr(ds_args, attr)
    return None, None


def _load_config(config):
    """The config as a dict, read the way DeepSpeed reads it; None if it cannot be read
    here (DeepSpeed then reports the problem itself)."""
    if config is None:
        return None
    if isinstance(config, dict):
        return config
    if not isinstance(config, (str, os.PathLike)):
        return None
    import hjson  # a DeepSpeed dependency; DeepSpeed reads its config files with it
    from deepspeed.runtime.config_utils import dict_raise_error_on_duplicate_keys
    path = os.fspath(config)
    try:
        if os.path.exists(path):
            with open(path) as f:
                loaded = hjson.load(f, object_pairs_hook=dict_raise_error_on_duplicate_keys)
        else:
            loaded = hjson.loads(base64.urlsafe_b64decode(path).decode("utf-8"),
                                 object_pairs_hook=dict_raise_error_on_duplicate_keys)
    except (OSError, ValueError, UnicodeDecodeError):
        return None  # DeepSpeed reads it again and reports the problem in its own words
    return loaded if isinstance(loaded, dict) else None


@contextlib.contextmanager
def _config_swapped(params, source, ds_config):
    """Point deepspeed.initialize's arguments at ``ds_config`` (no ssdtrain section)."""
    if source is None or not source.startswith("args."):
        params["config" if source is None else source] = ds_config
        yield
        return
    # The config came from args.deepspeed_config: DeepSpeed refuses both that and a
    # config argument, so clear the attribute for the call and restore it after (the
    # engine only reads args during initialize; it sets args.local_rank, on the
    # caller's own args as usual).
    attr = source[len("args."):]
    ds_args = params["args"]
    saved = getattr(ds_args, attr)
    setattr(ds_args, attr, None)
    params["config"] = ds_config
    try:
        yield
    finally:
        setattr(ds_args, attr, saved)


# ------------------------------------------------------------------------- engine

class _Active(threading.local):
    """The offloader whose engine forward runs on this thread (innermost last)."""

    def __init__(self):
        self.stack = []


_ACTIVE = _Active()


class _EngineForward:
    """Replaces ``engine.forward``: runs DeepSpeed's forward inside the offloader."""

    def __init__(self, forward, offloader, checkpoint_inputs):
        self.forward = forward
        self.offloader = offloader
        self.checkpoint_inputs = checkpoint_inputs

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled():  # nothing is saved for backward
            return self.forward(*args, **kwargs)
        _ACTIVE.stack.append(self)
        try:
            with self.offloader:
                return self.forward(*args, **kwargs)
        finally:
            _ACTIVE.stack.pop()


class _GatheredParams:
    """ZeRO-3: marks the storages of the parameters a module's DeepSpeed pre-hook gathered.

    ssdtrain recognises parameters by storage, recorded by a global module pre-hook;
    global hooks run before a module's own, i.e. before ZeRO-3 has gathered the
    module's parameters into new storage. This hook is registered after DeepSpeed's
    (module hooks run in registration order), so it sees the gathered storages.
    """

    def __init__(self, module, offloader):
        self._offloader = weakref.ref(offloader)
        self._handles = [m.register_forward_pre_hook(self._pre_forward)
                         for m in module.modules()]

    def _pre_forward(self, module, args):
        off = self._offloader()
        if off is None or not off.in_forward:
            return
        ssdtrain.keep_in_memory(*module.parameters(recurse=False))
        external = getattr(module, "_external_params", None)  # register_external_parameter
        if external:
            ssdtrain.keep_in_memory(*external.values())

    def remove(self):
        for h in self._handles:
            h.remove()
        self._handles = []


def _attach(engine, offloader, checkpoint_inputs):
    engine.ssdtrain = offloader
    engine.forward = _EngineForward(engine.forward, offloader, checkpoint_inputs)
    gathered = None
    if engine.zero_optimization_partition_weights():
        gathered = _GatheredParams(engine.module, offloader)
    if checkpoint_inputs:
        _install_checkpoint_wrappers()
    ds_destroy = engine.destroy

    def destroy():
        try:
            ds_destroy()
        finally:
            if gathered is not None:
                gathered.remove()
            offloader.close()

    destroy.__doc__ = ds_destroy.__doc__
    engine.destroy = destroy


# ------------------------------------------------------------------ checkpointing

_DS_CHECKPOINT = getattr(_ds_checkpointing.checkpoint, "__ssdtrain_wraps__",
                         _ds_checkpointing.checkpoint)
_DS_NON_REENTRANT = getattr(_ds_checkpointing.non_reentrant_checkpoint, "__ssdtrain_wraps__",
                            _ds_checkpointing.non_reentrant_checkpoint)
checkpoint.__ssdtrain_wraps__ = _DS_CHECKPOINT
non_reentrant_checkpoint.__ssdtrain_wraps__ = _DS_NON_REENTRANT


def _install_checkpoint_wrappers():
    """Make ``deepspeed.checkpointing.checkpoint`` / ``.non_reentrant_checkpoint`` ours.

    They behave exactly as DeepSpeed's outside an ssdtrain engine forward, so this
    stays installed. Code that bound DeepSpeed's functions to its own names before
    :func:`initialize` ran keeps DeepSpeed's: use this module's instead.
    """
    _ds_checkpointing.checkpoint = checkpoint
    _ds_checkpointing.non_reentrant_checkpoint = non_reentrant_checkpoint


def _checkpoint_spilling_inputs(ds_function, function, args, kwargs):
    active = _ACTIVE.stack[-1] if _ACTIVE.stack else None
    if active is None or not active.checkpoint_inputs or not torch.is_grad_enabled() \
            or _ds_checkpointing.PARTITION_ACTIVATIONS or _ds_checkpointing.CPU_CHECKPOINT:
        return ds_function(function, *args, **kwargs)
    stand_ins = []

    def stand_in(value):
        if not _is_spillable_input(value):
            return value
        s = value.view_as(value)  # a new tensor object on the same bytes; grads flow to value
        stand_ins.append(s)
        return s

    args = tuple(stand_in(a) for a in args)
    kwargs = {k: stand_in(v) for k, v in kwargs.items()}
    out = ds_function(function, *args, **kwargs)
    offloader = active.offloader
    for s in stand_ins:
        handle = offloader.save(s.detach())
        s.data = torch.empty(0, dtype=s.dtype, device=s.device)
        s.saved_data = _SpilledInput(offloader, handle)
    return out


def _is_spillable_input(value):
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel() > 0 \
        and not (value.requires_grad and value.grad_fn is None) \
        and not getattr(value, "no_checkpointing", False)


class _SpilledInput:
    """``saved_data`` of a stand-in: DeepSpeed's backward calls ``.to(device)`` once,
    which unpacks the record (a prefetch hit, normally) and lets it go."""

    __slots__ = ("_offloader", "_handle")

    def __init__(self, offloader, handle):
        self._offloader = offloader
        self._handle = handle

    def to(self, *args, **kwargs):
        handle, self._handle = self._handle, None
        if handle is None:
            raise ssdtrain.SSDTrainError(
                "ssdtrain: a DeepSpeed checkpoint input was restored twice; DeepSpeed's backward "
                "restores each once. Please report this with your DeepSpeed version.")
        return self._offloader.restore(handle).to(*args, **kwargs)
