"""ssdtrain for Megatron-core: the per-layer offload context of ``TransformerBlock``.

``TransformerBlock`` asks a factory, ``get_cpu_offload_context``, for the context it
enters around every layer (TransformerEngine provides one for its host-RAM offload;
without TransformerEngine the name is ``None`` and the context a ``nullcontext``).
:func:`enable` puts ssdtrain behind that name for one ``TransformerConfig``: every
``TransformerBlock`` built from that config afterwards offloads the activations of
its first ``offload_layers`` layers to the spill tier; blocks built from other
configs get exactly what they got before. TransformerEngine is not needed.

Example::

    from ssdtrain.integrations import megatron as ssd_megatron

    config = TransformerConfig(num_layers=24, hidden_size=2048, ...)
    ssd_megatron.enable(config, spill_dir="/nvme/ssdtrain", offload_layers=20)
    model = GPTModel(config=config, ...)          # built after enable()
    for batch in data:
        loss = model(...).mean()                  # layers 0..19 offload
        loss.backward()                           # prefetched back for backward
    print(ssd_megatron.offloader(config).stats().summary())
    ssd_megatron.disable(config)                  # closes the Offloader, undoes the patches

One :class:`~ssdtrain.Offloader` serves the config (all its blocks). In each forward
of a block, the pass opens (``begin_forward``) when its first layer starts,
``intercept()`` is on around each of the first ``offload_layers`` layers, and the pass
ends (``end_forward``) when the last of them returns: prefetch for backward starts
there, and the later layers, whose activations backward needs first, keep theirs in
memory. Forwards run without grad (evaluation) offload nothing.

``config.cpu_offloading`` stays ``False``: in megatron-core that flag means
TransformerEngine's host-RAM offload, and it switches on TE-only code paths (and a
validation that rejects it together with recompute). A config that already has
``cpu_offloading=True`` is rejected by :func:`enable`.

# NOTE [ Composition with Megatron's recompute ]

What ssdtrain offloads, per ``recompute_granularity`` (``offload_layers`` = N):

* ``None``: everything the first N layers save for backward (layer-norm inputs,
  QKV, attention scores and probabilities, MLP activations...), except parameters
  and tensors below ``min_tensor_bytes``.
* ``"selective"`` (``recompute_modules=["core_attn"]``, the default): the same, except
  the core attention's internals (scores, softmax, dropout mask), which Megatron
  recomputes in backward; the core attention's *inputs* (query, key, value), saved
  by Megatron's reentrant ``CheckpointFunction`` inside the offloaded layers, are
  offloaded. The recomputation runs in backward, outside interception, so its
  tensors stay in memory for the moment they are used. (``"layernorm"`` and
  ``"moe_act"`` use ``CheckpointWithoutOutput``, which in megatron-core 0.16.1 needs
  TransformerEngine.)
* ``"full"``: the layers run inside checkpoints under ``no_grad`` and save nothing;
  what is saved is each checkpointed chunk's *inputs* (the hidden states entering
  it, plus the small attention mask): ssdtrain offloads those, an SSD tier for
  activation checkpoints. A chunk is offloaded when all its layers are among the
  first N (``recompute_method="uniform"``: make N a multiple of
  ``recompute_num_layers``); its bytes are counted under the chunk's last layer in
  :func:`layer_stats`. With ``recompute_method="block"``, the layers past
  ``recompute_num_layers`` run normally and, if among the first N, offload
  everything they save.

In every combination losses and gradients are bitwise equal to the run without
ssdtrain (tests/test_megatron.py checks each).

# NOTE [ Which TransformerBlock is asking ]

The factory gets configuration values, not the config or the block. So
:func:`enable` also wraps ``TransformerBlock.__init__``: while a block's
constructor runs, the block is on a thread-local stack, and the factory looks up
its ``config``. Both names are restored when the last enabled config is disabled.
The factory takes ``*args, **kwargs``: megatron-core 0.16 passes six positional
values (enabled, num_layers, model_layers, activation_offloading,
weight_offloading, double_buffering) and later releases a seventh
(``cpu_offloading_retain_pinned_cpu_buffers``); blocks of configs that ssdtrain
does not handle get the original factory called with exactly what was passed.
The same factory is installed in ``megatron.core.extensions.transformer_engine``
too, for releases whose block imports it from there at construction time.

Limits: the block's layer loop must enter ``offload_context`` (megatron-core's
``TransformerBlock`` does); layers count per block (per pipeline stage or model
chunk: the first N layers *that block* runs); one forward of the config's blocks
at a time (a second block forward starting while one is open raises
:class:`~ssdtrain.SSDTrainError`); CUDA graphs bypass the hooks.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import logging
import tempfile
import threading
import weakref
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Dict, Optional

import torch

from ssdtrain import ConfigError, OffloadConfig, Offloader, SSDTrainError, Stats

from .distributed import rank_spill_dir

__all__ = ["enable", "disable", "is_enabled", "offloader", "layer_stats", "LayerStats",
           "MegatronOffload", "add_ssdtrain_args", "apply_args", "options_from_args",
           "missing_names", "PATCHED_NAMES"]

log = logging.getLogger("ssdtrain")

_BLOCK_MODULE = "megatron.core.transformer.transformer_block"
_TE_MODULE = "megatron.core.extensions.transformer_engine"

PATCHED_NAMES = (
    (_BLOCK_MODULE, "get_cpu_offload_context"),
    (_BLOCK_MODULE, "TransformerBlock"),
    (_BLOCK_MODULE + ".TransformerBlock", "__init__"),
    (_BLOCK_MODULE + ".TransformerBlock", "_checkpointed_forward"),
    (_BLOCK_MODULE + ".TransformerBlock", "_get_layer"),
)
"""``(module or class, attribute)`` pairs the adapter patches or wraps (the last two
per block instance). :func:`missing_names` checks they exist."""


def missing_names():
    """The entries of :data:`PATCHED_NAMES` that this megatron-core lacks (empty if none).

    Returns:
        A list of dotted names (a module that cannot be imported is listed by its name).
    """
    missing = []
    for owner, attr in PATCHED_NAMES:
        obj = _resolve(owner)
        if obj is None:
            missing.append(owner)
        elif not hasattr(obj, attr):
            missing.append(f"{owner}.{attr}")
    return list(dict.fromkeys(missing))


def _resolve(dotted):
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name, None)
            if obj is None:
                return None
        return obj
    return None


@dataclass
class LayerStats:
    """What one transformer layer handed to ssdtrain, summed over forward passes.

    Counted while the layer runs under interception (synchronously, at pack time);
    layers that are not offloaded stay at zero, and so do the layers of a step of
    ``policy="auto"`` after its hooks came off past its quota and prefetch window
    (``Stats.hooks_cut_steps``; NOTE [ Hooks off past the window ] in ``_policies/auto.py``).
    """

    passes: int = 0
    """Forward passes in which this layer ran under ``intercept()`` (a step of
    ``policy="auto"`` with nothing to offload pushes no hooks: it counts here, and the
    byte counts below do not move)."""
    packed_bytes: int = 0
    """Bytes of every saved tensor intercepted (a tensor saved twice counts twice)."""
    unique_bytes: int = 0
    """Bytes of the new records this layer created: written to the spill tier, except
    those still in the kept tail (``keep_tail_bytes``) when the pass ended and, under
    ``policy="auto"`` (the default), those kept once the step's offload quota was spent
    (``Stats.quota_kept_bytes``). With ``policy="static"`` and ``keep_tail_bytes=0``
    this is exactly the bytes the layer offloaded."""
    deduplicated_bytes: int = 0
    """Bytes of saves served by a record that already existed (same storage)."""
    kept_bytes: int = 0
    """Bytes kept in memory at pack time: parameters, small tensors, other kinds."""


_COUNTERS = ("packed_bytes", "unique_bytes", "deduplicated_bytes", "kept_bytes")


class MegatronOffload:
    """The ssdtrain set-up of one ``TransformerConfig`` (returned by :func:`enable`).

    Attributes:
        config: the ``TransformerConfig`` (held weakly; ``None`` once collected).
        offloader: the one :class:`~ssdtrain.Offloader` of this config's blocks.
        offload_layers: how many layers per block offload (``None``: all).
        enabled: ``False`` once disabled (its blocks' contexts are then no-ops).
    """

    def __init__(self, config, offloader, offload_layers):
        self._config_ref = weakref.ref(config)
        self.offloader = offloader
        self.offload_layers = offload_layers
        self._layers: Dict[int, LayerStats] = {}
        self._contexts = weakref.WeakSet()
        self.enabled = True

    @property
    def config(self):
        return self._config_ref()

    def stats(self) -> Stats:
        """The offloader's cumulative :class:`~ssdtrain.Stats`."""
        return self.offloader.stats()

    def layer_stats(self) -> Dict[int, LayerStats]:
        """Per-layer counts, keyed by the layer's 0-based index in the model
        (Megatron's ``layer_number - 1``); every layer of every block built so far has
        an entry. A copy."""
        return {i: dataclasses.replace(s) for i, s in sorted(self._layers.items())}

    def disable(self) -> None:
        """Same as :func:`disable` on this config."""
        _disable(self)

    def __repr__(self):
        state = "enabled" if self.enabled else "disabled"
        return f"<ssdtrain MegatronOffload {state} offload_layers={self.offload_layers} " \
               f"{self.offloader!r}>"

    # ------------------------------------------------------------ internals
    def _n_offloaded(self, n_layers):
        n = n_layers if self.offload_layers is None else min(self.offload_layers, n_layers)
        return n if self.enabled else 0

    def _entry(self, index):
        stats = self._layers.get(index)
        if stats is None:
            stats = self._layers[index] = LayerStats()
        return stats


class _LayerMeter:
    """Attributes the offloader's pack-time counters to the layer running now."""

    def __init__(self, session):
        self.session = session
        self.index = None
        self.start = None

    def begin(self, index):
        self.end()
        stats = self.session.offloader.stats()
        self.start = [getattr(stats, f) for f in _COUNTERS]
        self.index = index  # set last: an interrupt before leaves nothing to end
        self.session._entry(index).passes += 1

    def end(self):
        index, start = self.index, self.start
        if index is None:
            return
        self.index = None  # cleared first: an interrupt below never ends a layer twice
        stats = self.session.offloader.stats()
        entry = self.session._entry(index)
        for field, before in zip(_COUNTERS, start):
            setattr(entry, field, getattr(entry, field) + getattr(stats, field) - before)


class _BlockOffloadContext:
    """What a ``TransformerBlock`` built from an enabled config enters around each layer.

    One per block. The block's forward pre-hook (:meth:`_block_pre_forward`) starts
    the layer count; each entry is the next layer.
    """

    # Megatron's linear layers read ``config._cpu_offloading_context.inside_context`` to
    # tag tensors for TransformerEngine's offload; with cpu_offloading False the block
    # never stores this context there, and the tag would mean nothing to ssdtrain.
    inside_context = False

    def __init__(self, session, block):
        self.session = session
        self._block = weakref.ref(block)
        self._next = 0          # index (in the block) of the layer entered next
        self._n = 0             # layers offloaded in this forward
        self._open = False      # this block's forward pass is open on the offloader
        self._intercept = None  # the active off.intercept() context manager
        self._meter = _LayerMeter(session)
        self._last = False      # the layer entered last is the last one offloaded
        self._full = False      # inside _checkpointed_forward (full recompute)
        self._hook = block.register_forward_pre_hook(self._block_pre_forward)

    # ----------------------------------------------------------- per forward
    def _block_pre_forward(self, block, args):
        if self._open or self._intercept is not None:
            self._abandon()  # the previous forward ended without ending its pass
        self._next = 0
        for layer in block.layers:
            self.session._entry(_layer_index(layer, block))

    def __enter__(self):
        block = self._block()
        i = self._next
        # The count wraps after the last layer too, for callers of block.forward()
        # that bypass the pre-hook.
        self._next = (i + 1) % len(block.layers)
        if i == 0:
            self._n = self.session._n_offloaded(len(block.layers)) \
                if torch.is_grad_enabled() else 0
        if i < self._n:
            if i == 0:
                self._begin()
            self._meter.begin(_layer_index(block.layers[i], block))
            self._start_intercept()
            self._last = i == self._n - 1
        return self

    def __exit__(self, exc_type, exc, tb):
        if self._intercept is not None:
            self._stop_intercept(exc_type, exc, tb)
            self._meter.end()
            if exc is not None or self._last:
                self._close(exc)
        if exc is not None:
            self._next = 0
        return False

    # ------------------------------------------------------- full recompute
    def checkpointed_forward(self, original, *args, **kwargs):
        """Wraps ``block._checkpointed_forward``: the pass spans the checkpoints of
        the first ``offload_layers`` layers (NOTE [ Composition with Megatron's recompute ])."""
        block = self._block()
        n = self.session._n_offloaded(len(block.layers)) if torch.is_grad_enabled() else 0
        if n == 0 or self._open:
            return original(*args, **kwargs)
        self._n = n
        self._begin()
        exc = None
        try:
            self._start_intercept()
            self._full = True
            return original(*args, **kwargs)
        except BaseException as e:
            exc = e
            raise
        finally:
            self._full = False
            if self._intercept is not None:
                self._stop_intercept(type(exc) if exc else None, exc,
                                     exc.__traceback__ if exc else None)
            self._meter.end()
            if self._open:
                self._close(exc)

    def get_layer(self, original, index):
        """Wraps ``block._get_layer``: under full recompute, each call in forward
        starts the next layer; the first one past ``offload_layers`` ends the pass."""
        layer = original(index)
        if self._full and self._intercept is not None:
            if index < self._n:
                self._meter.begin(_layer_index(layer, self._block()))
            else:
                self._stop_intercept(None, None, None)
                self._meter.end()
                self._close(None)
        return layer

    # ------------------------------------------------------------- helpers
    # NOTE [ Interrupted block forwards ]
    # A KeyboardInterrupt (or any error) can end a block's forward between any two
    # lines here, also inside ``__enter__``, after which the layer's ``with`` calls no
    # ``__exit__``. Each step is therefore recorded *before* it is taken (``_open``
    # before ``begin_forward()``, ``_intercept`` before the intercept is entered), and
    # the next block forward (or ``disable``) that finds either set ends whatever
    # the offloader has open with ``Offloader.abort_forward``, whose undos are
    # idempotent (NOTE [ Forward phases ] in ssdtrain/_offloader/forward.py). Without it, a
    # pass opened by ``begin_forward()`` (no ``with`` site) stays open for good, and
    # every later forward raises "already open".
    def _begin(self):
        self._open = True
        self.session.offloader.begin_forward()

    def _start_intercept(self):
        self._intercept = cm = self.session.offloader.intercept()
        cm.__enter__()

    def _abandon(self):
        """End what an interrupted forward left open (NOTE [ Interrupted block forwards ])."""
        self._intercept = None
        self._full = False
        self._meter.end()
        self._open = False
        self.session.offloader.abort_forward()

    def _stop_intercept(self, exc_type, exc, tb):
        # Cleared after the exit (an exit of an intercept already left does nothing).
        self._intercept.__exit__(exc_type, exc, tb)
        self._intercept = None

    def _close(self, exc):
        # ``_open`` is cleared only once the pass is ended (an interrupt before leaves
        # it set for the next forward's _abandon); a write error end_forward() raises
        # comes after the pass is closed.
        if exc is None:
            self.session.offloader.end_forward()
            self._open = False
            return
        # The forward already failed: end the pass, but let the original error win.
        try:
            self.session.offloader.end_forward()
        except SSDTrainError as e:
            if hasattr(exc, "add_note"):
                exc.add_note(f"ssdtrain: ending the forward pass also raised: {e}")
            else:
                log.error("ssdtrain: ending the forward pass also raised: %s", e)
        self.session.offloader.abort_forward()  # what an interrupt left open, if any
        self._open = False

    def _detach(self):
        """Turn into a no-op (the config was disabled): end a pass an interrupted forward
        left open, remove hook and wrappers."""
        if self._open or self._intercept is not None:
            self._abandon()
        self._hook.remove()
        block = self._block()
        if block is not None:
            for name in ("_checkpointed_forward", "_get_layer"):
                block.__dict__.pop(name, None)


def _layer_index(layer, block):
    number = getattr(layer, "layer_number", None)
    if isinstance(number, int):
        return number - 1
    return list(block.layers).index(layer)


def _commit(hidden_states):
    """``group_prefetch_offload_commit_async``: the identity. ssdtrain starts writes as
    tensors are saved and prefetch when the pass ends; there is nothing to commit
    between layers (and the block calls it only when ``cpu_offloading`` is on)."""
    return hidden_states


# ---------------------------------------------------------------------------------
# Registry and patches
# ---------------------------------------------------------------------------------

_LOCK = threading.RLock()
_SESSIONS: Dict[int, MegatronOffload] = {}   # id(config) -> session (config held weakly)
_FINALIZERS: Dict[int, weakref.finalize] = {}
_PATCHES = []                                 # [(owner, attr, original)] while installed
_BUILDING = threading.local()                 # .blocks: TransformerBlocks being constructed


def _session_for(config) -> Optional[MegatronOffload]:
    session = _SESSIONS.get(id(config))
    if session is not None and session.config is config:
        return session
    return None


def _offload_context_factory(original, *args, **kwargs):
    """The ``get_cpu_offload_context`` installed by :func:`enable` (NOTE [ Which
    TransformerBlock is asking ])."""
    stack = getattr(_BUILDING, "blocks", None)
    block = stack[-1] if stack else None
    session = None if block is None else _session_for(getattr(block, "config", None))
    if session is None or not session.enabled:
        if original is not None:
            return original(*args, **kwargs)
        # What TransformerBlock does when the name is None (no TransformerEngine).
        enabled = args[0] if args else kwargs.get("enabled", False)
        assert enabled is False, "CPU Offloading is enabled when TE is not present"
        return nullcontext(), None
    context = _BlockOffloadContext(session, block)
    session._contexts.add(context)
    # Full recompute bypasses the per-layer context: wrap the two methods it uses on
    # this instance only (removed again by disable()).
    block._checkpointed_forward = functools.partial(
        context.checkpointed_forward, block._checkpointed_forward)
    block._get_layer = functools.partial(context.get_layer, block._get_layer)
    return context, _commit


def _wrap_block_init(original_init):
    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        stack = getattr(_BUILDING, "blocks", None)
        if stack is None:
            stack = _BUILDING.blocks = []
        stack.append(self)
        try:
            original_init(self, *args, **kwargs)
        finally:
            stack.pop()
    __init__._ssdtrain_original = original_init
    return __init__


def _install_patches():
    missing = missing_names()
    if missing:
        raise SSDTrainError(
            "ssdtrain: megatron-core does not have " + ", ".join(missing) + ", which the "
            "Megatron adapter patches (ssdtrain.integrations.megatron.PATCHED_NAMES); this "
            "megatron-core release is not supported yet, please report it with its version.")
    block_mod = importlib.import_module(_BLOCK_MODULE)
    cls = block_mod.TransformerBlock
    owners = [block_mod]
    try:
        te_mod = importlib.import_module(_TE_MODULE)
    except ImportError:
        te_mod = None
    if te_mod is not None and hasattr(te_mod, "get_cpu_offload_context"):
        owners.append(te_mod)
    for owner in owners:
        original = owner.get_cpu_offload_context
        _PATCHES.append((owner, "get_cpu_offload_context", original))
        owner.get_cpu_offload_context = functools.partial(_offload_context_factory, original)
    _PATCHES.append((cls, "__init__", cls.__dict__.get("__init__", _ABSENT)))
    cls.__init__ = _wrap_block_init(cls.__init__)


_ABSENT = object()


def _remove_patches():
    while _PATCHES:
        owner, attr, original = _PATCHES.pop()
        if original is _ABSENT:
            delattr(owner, attr)
        else:
            setattr(owner, attr, original)


def _forget(key):
    """The config was garbage-collected without disable()."""
    with _LOCK:
        session = _SESSIONS.pop(key, None)
        _FINALIZERS.pop(key, None)
        if session is not None:
            session.enabled = False
        if not _SESSIONS:
            _remove_patches()


# ---------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------

def enable(config, *, offload_layers: Optional[int] = None,
           offload_config: Optional[OffloadConfig] = None, **ssdtrain_options) -> MegatronOffload:
    """Offload the activations of ``TransformerBlock`` layers built from ``config``.

    Blocks (``GPTModel``'s decoder, ...) built from ``config`` *after* this call
    enter an ssdtrain context around each layer; the first ``offload_layers`` layers
    of every forward offload what they save. ``config`` itself is not modified.

    Args:
        config: the megatron-core ``TransformerConfig`` the model will be built from.
        offload_layers: layers per block that offload, counted from the first.
            Default ``None``: all (the last activations of forward stay in memory
            anyway, up to ``keep_tail_bytes``). ``0`` builds the set-up but offloads
            nothing.
        offload_config: an :class:`~ssdtrain.OffloadConfig`; default ``None`` reads
            ``SSDTRAIN_*`` environment variables (:meth:`OffloadConfig.from_env`).
        **ssdtrain_options: :class:`~ssdtrain.OffloadConfig` fields
            (``spill_dir=...``, ``keep_tail_bytes=...``) overriding ``offload_config``.
            Each rank spills into its own private subdirectory of ``spill_dir``
            (:func:`ssdtrain.integrations.distributed.rank_spill_dir`).

    Returns:
        The :class:`MegatronOffload` of ``config`` (also reachable via
        :func:`offloader` and :func:`layer_stats`).

    Raises:
        ConfigError: ``config`` is already enabled, has ``cpu_offloading=True``
            (TransformerEngine's offload), or ``offload_layers`` is not an int in
            ``[0, config.num_layers]``; or an ssdtrain option is invalid.
        SSDTrainError: this megatron-core lacks a name the adapter patches.
    """
    if getattr(config, "cpu_offloading", False):
        raise ConfigError(
            "ssdtrain: config.cpu_offloading is True (TransformerEngine's host-RAM offload); "
            "ssdtrain replaces it rather than stacking on it. Set cpu_offloading=False and "
            "pass the number of layers as enable(config, offload_layers=N).")
    num_layers = getattr(config, "num_layers", None)
    if offload_layers is not None:
        if isinstance(offload_layers, bool) or not isinstance(offload_layers, int) \
                or offload_layers < 0 \
                or (isinstance(num_layers, int) and offload_layers > num_layers):
            raise ConfigError(
                f"ssdtrain: offload_layers must be an int in [0, config.num_layers="
                f"{num_layers}] or None (all layers), got {offload_layers!r}.")
    with _LOCK:
        if _session_for(config) is not None:
            raise ConfigError("ssdtrain: this TransformerConfig already has ssdtrain enabled; "
                              "call disable(config) first to change its options.")
        if offload_config is None:
            offload_config = OffloadConfig.from_env(**ssdtrain_options)
        elif ssdtrain_options:
            offload_config = offload_config.replace(**ssdtrain_options)
        # Each rank spills into its own private subdirectory (host, rank, local rank).
        base = offload_config.spill_dir or [tempfile.gettempdir()]
        off = Offloader(offload_config.replace(spill_dir=rank_spill_dir(base)))
        session = MegatronOffload(config, off, offload_layers)
        key = id(config)
        first = not _SESSIONS
        # Registered before the patches go in: a config collected meanwhile (its
        # finalizer runs _forget) then sees this one and leaves the patches alone.
        _SESSIONS[key] = session
        try:
            if first:
                _install_patches()
        except BaseException:  # only _install_patches can raise here (first is True)
            del _SESSIONS[key]
            _remove_patches()
            off.close()
            raise
        _FINALIZERS[key] = weakref.finalize(config, _forget, key)
    log.info("ssdtrain: Megatron offload enabled for %s layers per block (%s)",
             "all" if offload_layers is None else offload_layers, off)
    return session


def disable(config) -> None:
    """Undo :func:`enable` for ``config``: close its Offloader, make its blocks'
    contexts no-ops, and restore every patched name once no config is enabled.

    Call it after the last backward: tensors saved by a forward that has not been
    backpropagated are released with the Offloader (their backward would raise
    :class:`~ssdtrain.OffloaderClosedError`). Does nothing if ``config`` is not enabled.
    """
    session = _session_for(config)
    if session is not None:
        _disable(session)


def _disable(session):
    with _LOCK:
        config = session.config
        if not session.enabled:
            return
        session.enabled = False
        for context in list(session._contexts):
            context._detach()
        key = None if config is None else id(config)
        if key is not None and _SESSIONS.get(key) is session:
            del _SESSIONS[key]
            _FINALIZERS.pop(key).detach()
        if not _SESSIONS:
            _remove_patches()
    session.offloader.close()


def is_enabled(config) -> bool:
    """Whether :func:`enable` is in effect for ``config``."""
    return _session_for(config) is not None


def _require(config) -> MegatronOffload:
    session = _session_for(config)
    if session is None:
        raise SSDTrainError("ssdtrain: this TransformerConfig does not have ssdtrain enabled; "
                            "call ssdtrain.integrations.megatron.enable(config, ...) before "
                            "building the model.")
    return session


def offloader(config) -> Offloader:
    """The :class:`~ssdtrain.Offloader` of an enabled ``config`` (``.stats()`` for counters).

    Raises:
        SSDTrainError: ``config`` is not enabled.
    """
    return _require(config).offloader


def layer_stats(config) -> Dict[int, LayerStats]:
    """Per-layer :class:`LayerStats` of an enabled ``config`` (see
    :meth:`MegatronOffload.layer_stats`).

    Raises:
        SSDTrainError: ``config`` is not enabled.
    """
    return _require(config).layer_stats()


# ---------------------------------------------------------------------------------
# Megatron-LM command line
# ---------------------------------------------------------------------------------

# --ssdtrain-X option -> OffloadConfig field
_ARG_FIELDS = {
    "ssdtrain_spill_dir": "spill_dir",
    "ssdtrain_min_tensor_bytes": "min_tensor_bytes",
    "ssdtrain_prefetch_bytes": "prefetch_bytes",
    "ssdtrain_keep_tail_bytes": "keep_tail_bytes",
    "ssdtrain_write_behind_bytes": "write_behind_bytes",
    "ssdtrain_engine": "engine",
    "ssdtrain_io_threads": "io_threads",
    "ssdtrain_direct_io": "direct_io",
    "ssdtrain_verify": "verify",
    "ssdtrain_on_spill_error": "on_spill_error",
    "ssdtrain_max_spill_bytes": "max_spill_bytes",
}


def add_ssdtrain_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``--ssdtrain*`` options; usable as Megatron-LM's ``extra_args_provider``.

    Options left out keep :class:`~ssdtrain.OffloadConfig`'s defaults (or the
    ``SSDTRAIN_*`` environment variables). Byte sizes accept ``"512MiB"``.

    Returns:
        ``parser``.
    """
    g = parser.add_argument_group("ssdtrain", "activation offloading to SSD (ssdtrain)")
    g.add_argument("--ssdtrain", action="store_true",
                   help="Offload activations of transformer layers to SSD with ssdtrain.")
    g.add_argument("--ssdtrain-spill-dir", nargs="+", default=None, metavar="DIR",
                   help="Directories for spill files, one per NVMe device (default: "
                        "$SSDTRAIN_SPILL_DIR, else the temp dir).")
    g.add_argument("--ssdtrain-offload-layers", type=int, default=None, metavar="N",
                   help="Offload the first N layers of each transformer block (default: all).")
    g.add_argument("--ssdtrain-min-tensor-bytes", default=None, metavar="BYTES",
                   help="Smaller saved tensors stay in memory (default 256KiB).")
    g.add_argument("--ssdtrain-prefetch-bytes", default=None, metavar="BYTES",
                   help="Activation bytes held ahead of backward (default 256MiB).")
    g.add_argument("--ssdtrain-keep-tail-bytes", default=None, metavar="BYTES",
                   help="Last bytes of forward kept in memory (default 128MiB).")
    g.add_argument("--ssdtrain-write-behind-bytes", default=None, metavar="BYTES",
                   help="Most bytes of writes in flight (default 1GiB).")
    g.add_argument("--ssdtrain-engine", default=None, choices=OffloadConfig.ENGINES,
                   help="I/O engine (default auto).")
    g.add_argument("--ssdtrain-io-threads", type=int, default=None, metavar="N",
                   help="I/O worker threads (default 4).")
    g.add_argument("--ssdtrain-direct-io", default=None, choices=("auto", "on", "off"),
                   help="O_DIRECT use (default auto).")
    g.add_argument("--ssdtrain-verify", action=argparse.BooleanOptionalAction, default=None,
                   help="CRC32C-check every record read back (default: on where the native "
                        "engine is built, see OffloadConfig.verify).")
    g.add_argument("--ssdtrain-on-spill-error", default=None, choices=OffloadConfig.SPILL_ERROR_ACTIONS,
                   help="A failed write: raise (default) or keep the tensor in memory.")
    g.add_argument("--ssdtrain-max-spill-bytes", default=None, metavar="BYTES",
                   help="Disk budget over all spill directories (default: none).")
    return parser


def options_from_args(args) -> dict:
    """The :class:`~ssdtrain.OffloadConfig` fields given on the command line."""
    return {field: getattr(args, name) for name, field in _ARG_FIELDS.items()
            if getattr(args, name, None) is not None}


def apply_args(args, config) -> Optional[MegatronOffload]:
    """Apply parsed ``--ssdtrain*`` options to ``config``: :func:`enable` it if
    ``--ssdtrain`` was given. Call it in the model provider, after building the
    ``TransformerConfig`` and before building the model.

    Returns:
        The :class:`MegatronOffload`, or ``None`` without ``--ssdtrain``.

    Raises:
        ConfigError: ``--ssdtrain-*`` options were given without ``--ssdtrain``, or a
            value is invalid.
    """
    options = options_from_args(args)
    layers = getattr(args, "ssdtrain_offload_layers", None)
    if not getattr(args, "ssdtrain", False):
        given = sorted("--" + n.replace("_", "-") for n in _ARG_FIELDS
                       if getattr(args, n, None) is not None)
        if layers is not None:
            given.append("--ssdtrain-offload-layers")
        if given:
            raise ConfigError(f"ssdtrain: {', '.join(given)} given without --ssdtrain; add "
                              f"--ssdtrain to offload, or drop them.")
        return None
    return enable(config, offload_layers=layers, **options)

