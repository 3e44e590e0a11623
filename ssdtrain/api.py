"""The public surface: :class:`Offloader`, :func:`offload` and :class:`Stats`."""

import dataclasses
import logging
import threading
import weakref

import torch

from ._config import MAX_BYTES, OffloadConfig
from ._device.transfers import GDS_PROBE_MEMORY
from ._errors import ConfigError, OffloaderClosedError, SSDTrainError
from ._offloader.forward import ForwardState, Phase, hooks_on_stack, site_ended, with_site
from ._decision.policy import TRACKER
from .io.spill import SpillSet
from ._stats import Stats, _mib
from ._policies.steps import standing_write_behind, step_policy
from ._store.store import Store
from .io import make_engine

__all__ = ["Offloader", "offload", "Stats", "RecordView", "SavedHandle", "keep_in_memory"]

log = logging.getLogger("ssdtrain")


def _host_tier_label(budget):
    if budget is None:
        return ""
    return "+host tier " + ("unlimited" if budget >= MAX_BYTES else f"{_mib(budget)}")



class Offloader:
    """Offloads the tensors autograd saves inside ``with offloader:`` to the spill tier.

    Inside the ``with`` block every tensor autograd saves for backward is
    intercepted (``torch.autograd.graph.saved_tensors_hooks``): large activations
    are written once per storage, asynchronously, to ``spill_dir`` and their memory
    is released when the write completes; backward gets them back, prefetched in
    reverse order of saving. Gradients are bitwise identical to a run without it.

    Leaving the ``with`` block ends interception only; backward keeps working until
    :meth:`close`. The offloader can be entered again for the next step (files and
    disk slots are reused). Without :meth:`close`, its threads and files are released
    once the offloader and every graph built under it are garbage, or at exit.

    :attr:`config` is the :class:`ResolvedConfig` it runs with
    (:meth:`OffloadConfig.resolve`): spill directories, engine and ``verify`` decided.

    Args:
        config: the settings; ``None`` reads ``SSDTRAIN_*`` environment variables
            (:meth:`OffloadConfig.from_env`).
        **overrides: :class:`OffloadConfig` fields that replace ``config``'s.

    Raises:
        ConfigError: a field is invalid, or ``spill_dir`` is missing, not a
            directory or not writable.

    Example::

        off = ssdtrain.Offloader(ssdtrain.OffloadConfig(spill_dir="/nvme/ssdtrain"))
        for batch in data:
            with off:
                loss = model(batch)
            loss.backward()
        print(off.stats().summary())
        off.close()
    """

    def __init__(self, config: OffloadConfig = None, **overrides):
        if config is None:
            config = OffloadConfig.from_env(**overrides)
        elif not isinstance(config, OffloadConfig):
            raise ConfigError(f"ssdtrain: config must be an OffloadConfig, got "
                              f"{type(config).__name__}; pass fields as keywords instead.")
        elif overrides:
            config = config.replace(**overrides)
        config = config.resolve()  # NOTE [ One resolved config ]
        self.config = config
        self._stats = Stats()
        spill = SpillSet(config.spill_dir, config.direct_io)
        try:
            engine = make_engine(config.engine, io_threads=config.io_threads,
                                 io_chunk_bytes=config.io_chunk_bytes,
                                 directories=[f.directory for f in spill.files],
                                 verify=config.verify, gds_memory=GDS_PROBE_MEMORY,
                                 polled=True)  # NOTE [ Polled completions ] in io/base.py
        except BaseException:
            spill.close()
            raise
        backend = getattr(engine, "backend", None)
        self._stats.engine = engine.name + (f"({backend})" if backend else "") + \
            ("+no SSD tier" if not spill.files else
             "+O_DIRECT" if all(f.direct for f in spill.files) else "+buffered") + \
            ("+crc32c" if config.verify else "") + \
            _host_tier_label(config.host_budget_bytes)
        log.info("ssdtrain: engine %s (%s), %d I/O threads, spill_dir %s", self._stats.engine,
                 config.engine_reason, config.io_threads, config.spill_dir)
        if config.host_budget_bytes is not None:  # NOTE [ Memory limits ] in _limits.py
            log.info("ssdtrain: host tier budget %s: %s", _mib(config.host_budget_bytes),
                     config.host_budget_reason)
        self._store = Store(config, spill, engine, self._stats,
                            write_behind=standing_write_behind(config))
        self._forward = ForwardState()  # NOTE [ Forward phases ] (in _offloader/forward.py)
        self._layers = None   # _adaptive.LayerPolicy, set by track()
        # What the policy does at each step's boundaries (NOTE [ Step policies ] in _policies/steps.py)
        self._steps = step_policy(config, self._store, self._stats, log.warning)
        self._auto = self._steps.controller  # _auto.AutoQuota under policy "auto", else None

    # ---------------------------------------------------------------- context
    def __enter__(self):
        site = with_site()
        self._open_forward(site)
        try:
            self._hook_on(site)
        except BaseException:
            self._repair_forward()
            raise
        return self

    def __exit__(self, exc_type, exc, tb):
        fwd = self._forward
        if fwd.phase is Phase.IDLE:
            return False
        _explain(exc)
        self._forward_raised(exc)
        self._settle_forward()
        if fwd.phase is Phase.INTERCEPTING:
            self._hook_off()
        if fwd.phase is Phase.OPEN:
            self._close_forward(raise_pending=exc_type is None)
        return False

    def begin_forward(self) -> None:
        """Open a forward pass without intercepting yet (see :meth:`intercept`).

        ``with offloader:`` is ``begin_forward()``, interception, ``end_forward()``.
        Integrations that enter a context per layer (Megatron's ``TransformerBlock``)
        open the pass once, intercept around the layers that should offload, and end
        it after the last of them, so prefetch for backward starts there.

        Raises:
            SSDTrainError: a forward pass is already open.
            OffloaderClosedError: the offloader is closed.
        """
        self._open_forward(None)

    def _open_forward(self, site):
        """IDLE -> OPEN: the store's pass and the layer policy's step. ``site``: the
        ``with`` statement (or attached call) that opens it, or ``None``
        (NOTE [ Forward phases ])."""
        fwd = self._forward
        self._recover_forward(site, site)
        if fwd.phase is not Phase.IDLE:
            raise SSDTrainError(
                f"ssdtrain: a forward pass of this Offloader is already open (entered on thread "
                f"{fwd.thread_name}); it cannot be entered twice at once. End it first (exit "
                f"the `with` block or call end_forward()), or use one Offloader per concurrent "
                f"forward. (A pass opened by a `with` block whose exit an interrupt cut short, "
                f"in a frame that is still running, is ended by offloader.__exit__(None, None, "
                f"None).)")
        self._store._check_open()
        if self._layers is None and self.config.policy == "adaptive":
            raise SSDTrainError("ssdtrain: policy='adaptive' plans per layer and needs the "
                                "layers: call offloader.track(model) before the first forward "
                                "(or use policy='static').")
        # The step's limits (NOTE [ Step policies ]). A pass with grad mode off
        # (evaluation) saves nothing for backward: no step of a policy that measures
        # (attach() opens no pass for such a call at all).
        limits = self._steps.begin_step(torch.is_grad_enabled())
        fwd.move(Phase.OPENING)
        fwd.site = site
        self._store.begin_pass(limits)
        if self._layers is not None:
            self._layers.begin_step()
        fwd.move(Phase.OPEN)

    def _forward_raised(self, exc) -> None:
        """A forward of this offloader raised ``exc`` (``with``, ``intercept()``, an
        attached module's call): the step policy sees it (under policy ``"auto"`` an
        out-of-memory error is a measurement, NOTE [ The offload quota ], step 0, taken
        before it propagates, so that the next step offloads enough to fit)."""
        self._steps.forward_raised(exc, _out_of_memory(exc))

    def _recover_forward(self, site=None, hook_site=None) -> None:
        """Before a forward operation (NOTE [ Forward phases ]): finish a transition an
        interrupt cut short, end interception whose ``with`` block ended without its exit
        (seen from a new entry at ``hook_site``), close a pass whose ``with`` block or
        attached call did (seen from ``site``). A forward another live thread owns is
        left alone."""
        fwd = self._forward
        if fwd.phase is Phase.IDLE or not fwd.owned_here():
            return
        self._settle_forward()
        if fwd.phase is Phase.INTERCEPTING and site_ended(fwd.hook_site, hook_site):
            log.warning("ssdtrain: the previous `with offloader:` (or intercept()) block ended "
                        "without leaving interception (an interrupt in its exit?); leaving it "
                        "now.")
            self._hook_off()
        if fwd.phase is Phase.OPEN and site_ended(fwd.site, site):
            log.warning("ssdtrain: the previous `with offloader:` block (or attached forward) "
                        "ended without ending its pass (an interrupt in its exit?); ending it "
                        "now.")
            self._close_forward(raise_pending=False)

    def abort_forward(self) -> None:
        """End this thread's open forward pass, whatever an interrupt left half done,
        without raising a pending write error (the next store operation raises it).

        For code that opens passes with :meth:`begin_forward` and :meth:`intercept`
        itself: a ``KeyboardInterrupt`` between those calls can leave the pass open (or
        intercepting) with no ``with`` block to close it, and the next
        :meth:`begin_forward` would raise "already open". Call it where the step is
        retried (the Megatron adapter does at each block forward after an interrupted
        one). Does nothing when no pass is open, or when another live thread owns it.
        Interrupting it is safe: it is finished by the next call (NOTE [ Forward
        phases ]).

        Example::

            try:
                off.begin_forward()
                ...
                off.end_forward()
            except KeyboardInterrupt:
                off.abort_forward()
        """
        fwd = self._forward
        if fwd.phase is Phase.IDLE or not fwd.owned_here():
            return
        self._settle_forward()
        if fwd.phase is Phase.INTERCEPTING:
            self._hook_off()
        if fwd.phase is Phase.OPEN:
            self._close_forward(raise_pending=False)

    def _settle_forward(self) -> None:
        """Finish a transition cut short (NOTE [ Forward phases ]): a hooking or unhooking
        ends with the hooks off (OPEN), an opening or closing with the pass closed (IDLE).
        Each undo is idempotent, so a settle cut short is settled again."""
        fwd = self._forward
        if fwd.phase in (Phase.HOOKING, Phase.UNHOOKING):
            if fwd.phase is Phase.HOOKING:
                fwd.move(Phase.UNHOOKING)
            self._unhook()
            fwd.move(Phase.OPEN)
        elif fwd.phase in (Phase.OPENING, Phase.CLOSING):
            if fwd.phase is Phase.OPENING:
                fwd.move(Phase.CLOSING)
            self._close_step()
            fwd.move(Phase.IDLE)

    def _repair_forward(self) -> None:
        """Back to IDLE from any phase, undoing what may have been done. A write error
        pending in the store stays for the next store operation."""
        fwd = self._forward
        self._settle_forward()
        if fwd.phase is Phase.INTERCEPTING:
            self._hook_off()
        if fwd.phase is Phase.OPEN:
            self._close_forward(raise_pending=False)

    def end_forward(self) -> None:
        """End the pass opened by :meth:`begin_forward`.

        The last ``keep_tail_bytes`` of records stay in memory and prefetch for
        backward starts. A write that failed during forward is raised here.

        Raises:
            SSDTrainError: no forward pass is open, or interception is still on.
            SpillIOError: a write failed.
        """
        self._recover_forward()
        phase = self._forward.phase
        if phase is Phase.INTERCEPTING:
            raise SSDTrainError("ssdtrain: end_forward() called while intercepting; leave the "
                                "`with offloader.intercept():` block first.")
        if phase is not Phase.OPEN:
            raise SSDTrainError("ssdtrain: end_forward() called with no open forward pass; "
                                "call begin_forward() first.")
        self._close_forward(raise_pending=True)

    def _close_forward(self, raise_pending):
        """OPEN -> IDLE (NOTE [ Forward phases ]); then the write error pending, if asked."""
        self._forward.move(Phase.CLOSING)
        self._close_step()
        self._forward.move(Phase.IDLE)
        if raise_pending:
            self._store.raise_pending_error()

    def _close_step(self):
        self._steps.end_forward()
        if self._layers is not None:
            self._layers.end_forward()
        self._store.end_pass()

    @property
    def in_forward(self) -> bool:
        """Whether a forward pass is open (between begin and end)."""
        return self._forward.phase is not Phase.IDLE

    @property
    def _hooks(self):
        """The (pack, unpack) pair this offloader has pushed, or ``None``."""
        return self._forward.hooks

    def intercept(self):
        """Intercept saved tensors inside an open forward pass (one layer, say).

        Tensors saved in the block belong to the pass opened by :meth:`begin_forward`;
        between blocks nothing is intercepted. Entering it again for the next layer is
        the intended use.

        Raises:
            SSDTrainError: no forward pass is open, or interception is already on.

        Example::

            off.begin_forward()
            for i, layer in enumerate(layers):
                with off.intercept() if i < 4 else contextlib.nullcontext():
                    x = layer(x)
            off.end_forward()
            loss(x).backward()
        """
        return _Intercept(self)

    def _hook_on(self, site=None):
        """OPEN -> INTERCEPTING: our hooks pushed, the tracker started. ``site``: the
        ``with`` statement that intercepts, or ``None`` (NOTE [ Forward phases ])."""
        fwd = self._forward
        if fwd.phase is not Phase.OPEN:
            if fwd.phase is Phase.INTERCEPTING:
                raise SSDTrainError(
                    f"ssdtrain: this Offloader is already intercepting (entered on thread "
                    f"{fwd.thread_name}); it cannot be entered twice at once. Use one Offloader "
                    f"per concurrent forward, or exit it first.")
            raise SSDTrainError("ssdtrain: intercept() needs an open forward pass; call "
                                "begin_forward() first (or use `with offloader:`).")
        fwd.move(Phase.HOOKING)
        fwd.hook_site = site
        steps = self._steps
        # A step of policy "auto" with nothing to offload intercepts nothing, and starts
        # no module tracker (NOTE [ The offload quota ], step 5), unless our hooks would
        # shadow another pair. (TRACKER.stop ignores a user it did not start.)
        below = hooks_on_stack()
        if steps.intercepts or self._layers is not None or below:
            TRACKER.start(fwd)
            # NOTE [ Hooks off past the window ] in _policies/auto.py: armed only where popping
            # ours mid-forward exposes no other pair, and no plan needs every record.
            store = self._store
            if steps.may_cut and self._layers is None and not below:
                store.on_cut = self._cut
                store.cut_after = max(1, store.window)
            # Read on each entry: tests replace the store's hooks to spy on them.
            fwd.push_hooks(store.pack, store.unpack)
        fwd.move(Phase.INTERCEPTING)

    def _cut(self):
        """The store's pack, past the quota and the prefetch window: our hooks come off
        for the rest of this forward (NOTE [ Hooks off past the window ] in _policies/auto.py).
        Only on the thread that intercepts, while ours are on top of its stack."""
        fwd, auto = self._forward, self._auto
        if fwd.phase is not Phase.INTERCEPTING or fwd.thread != threading.get_ident():
            return
        # Marked before the pop: an interrupt between them leaves a step marked cut whose
        # hooks stayed on (its S is not taken: the last full count stands), never a cut
        # step whose partial count would be taken for S.
        auto.cut = True
        if fwd.pop_if_top():
            TRACKER.stop(fwd)
            self._stats.hooks_cut_steps += 1
        else:
            auto.cut = False

    def _hook_off(self):
        """INTERCEPTING -> OPEN."""
        self._forward.move(Phase.UNHOOKING)
        self._unhook()
        self._forward.move(Phase.OPEN)

    def _unhook(self):
        self._store.cut_after = None
        fwd = self._forward
        if not fwd.pop_hooks():
            log.warning("ssdtrain: leaving interception, another saved_tensors_hooks context "
                        "entered inside it was still on top (not exited); ssdtrain's hooks "
                        "could not be removed from under it.")
        TRACKER.stop(fwd)

    # ------------------------------------------------------------------ info
    def stats(self) -> Stats:
        """A snapshot of the cumulative :class:`Stats`."""
        self._store.snapshot()  # settles releases that arrived while the store was busy
        return dataclasses.replace(self._stats)

    def live_records(self) -> int:
        """Records still referenced by a graph (0 once every graph is freed)."""
        return self._store.snapshot()[0]

    def resident_bytes(self) -> int:
        """Bytes of saved storages ssdtrain holds in memory right now (including those of
        records whose graph is gone while their write is still in flight; :meth:`wait`
        settles them)."""
        return self._store.snapshot()[1]

    def spill_bytes_in_use(self) -> int:
        """Bytes of spill-file slots currently allocated (as :meth:`resident_bytes`, a
        freed record's slot goes when its write has landed)."""
        return self._store.snapshot()[2]

    @property
    def closed(self) -> bool:
        return self._store.closed

    def records(self) -> list:
        """The records the store holds right now, as read-only :class:`RecordView` objects.

        A debug and introspection view for benchmarks and tools: the list is taken
        under the store's lock; each view reads its record's current values (``state``
        and ``writes`` change as I/O proceeds) and cannot change it. Records freed
        since are not listed; a view of one keeps its last values.

        Returns:
            A new list, one :class:`RecordView` per record (saved storage range).

        Example::

            with off:
                loss = model(batch)
            print(sum(r.nbytes for r in off.records()), "bytes saved in", len(off.records()))
        """
        self._store.snapshot()  # settles releases that arrived while the store was busy
        return [RecordView(r) for r in self._store.records()]

    @property
    def active_plan(self):
        """The per-layer plan in force (``policy="adaptive"`` or :meth:`set_plan`), or
        ``None``: no :meth:`track`, or no plan made yet. Unlike :meth:`plan` it never
        makes one."""
        return None if self._layers is None else self._layers.plan

    @property
    def replans(self) -> int:
        """How many times the adaptive policy re-planned since :meth:`track` (0 untracked)."""
        return 0 if self._layers is None else self._layers.replans

    # ------------------------------------------------------------ own saves
    def save(self, tensor: torch.Tensor):
        """Save ``tensor`` as autograd's pack hook would: the seam for code that keeps
        tensors for backward itself (DeepSpeed's checkpoint inputs, say).

        The tensor goes through the same path as the tensors autograd saves inside
        ``with offloader:`` (deduplication, the tail kept in memory, the write to the
        spill tier); small tensors, parameters and kinds ssdtrain does not offload are
        kept as they are. The returned handle holds the record: dropping the last
        reference to it releases the record (its memory and disk slot) as freeing a
        graph does. Call it inside a forward pass, where the tensors it saves belong
        to that step.

        Args:
            tensor: the tensor to save (not modified; modifying it in place before
                :meth:`restore` makes :meth:`restore` raise).

        Returns:
            An opaque :class:`SavedHandle` for this offloader's :meth:`restore`.

        Raises:
            OffloaderClosedError: the offloader is closed.
            SSDTrainError: ``tensor`` is not a ``torch.Tensor``, or an earlier
                asynchronous write failed (``on_spill_error="raise"``).

        Example::

            with off:
                handle = off.save(x)
            ...
            x_again = off.restore(handle)   # bit-identical to x
        """
        if not isinstance(tensor, torch.Tensor):
            raise SSDTrainError(f"ssdtrain: save() takes a torch.Tensor, got "
                                f"{type(tensor).__name__}; pass the tensor to keep for backward.")
        self._store._check_open()  # small tensors never reach the store's own check
        return SavedHandle(self, self._store.pack(tensor))

    def restore(self, handle) -> torch.Tensor:
        """The tensor saved by :meth:`save`, as autograd's unpack hook gives it back.

        Reads the bytes back if they were spilled (a prefetch hit, normally), verifies
        them when ``verify`` is on, and checks the version counter as unpacking a saved
        tensor does. The record stays alive while ``handle`` is referenced.

        Args:
            handle: what :meth:`save` returned.

        Returns:
            A tensor equal (bitwise) to the one saved, with its shape, strides and dtype.

        Raises:
            InplaceModificationError: the saved tensor was modified in place after
                :meth:`save`.
            OffloaderClosedError: the offloader was closed.
            SSDTrainError: ``handle`` is not what this offloader's :meth:`save`
                returned (another type, or a handle of another Offloader).
            IntegrityError, SpillIOError: reading the bytes back failed.
        """
        if type(handle) is not SavedHandle:
            hint = " (pass the handle save() returned, not the tensor)" \
                if isinstance(handle, torch.Tensor) else ""
            raise SSDTrainError(f"ssdtrain: restore() takes the handle save() returned, got "
                                f"{type(handle).__name__}{hint}.")
        if handle._owner() is not self:
            other = handle._owner()
            raise SSDTrainError(
                f"ssdtrain: restore() got a handle saved by another Offloader "
                f"({'one since collected' if other is None else repr(other)}), not by this one "
                f"({self!r}); restore it with the Offloader whose save() returned it.")
        if self.closed:
            raise OffloaderClosedError(
                "ssdtrain: restore() on a closed Offloader; restore saved tensors before "
                "close() (or keep the Offloader open while they are needed).")
        return self._store.unpack(handle._saved)

    # ------------------------------------------------------------ engine hook
    def wrap_engine(self, fn):
        """Replace the I/O engine with ``fn(engine)``: the hook for fault injection and
        I/O tracing (``ssdtrain.io.faulty.install`` uses it).

        ``fn`` gets the engine in use and returns the one to use from now on, normally
        a wrapper that delegates to it (same methods and attributes, see
        ``ssdtrain/io/base.py``: an ``EngineWrapper`` subclass; every request comes with
        ``owner=``, which a wrapper passes on, and holds while it holds the request: NOTE
        [ Requests own their memory ]). It first waits for the I/O in flight (as
        :meth:`wait`), which therefore finishes on the old engine. Call it between
        steps.

        Args:
            fn: ``engine -> engine``.

        Returns:
            The new engine.

        Raises:
            SSDTrainError: called inside a forward pass, or ``fn`` returned ``None``.
            OffloaderClosedError: the offloader is closed.

        Example::

            calls = off.wrap_engine(lambda engine: CountingEngine(engine))
        """
        self._recover_forward()
        if self.in_forward:
            raise SSDTrainError("ssdtrain: wrap_engine() called inside a forward pass; call it "
                                "between steps.")
        self._store._check_open()
        return self._store.replace_engine(fn)

    # -------------------------------------------------------------- lifetime
    def wait(self) -> None:
        """Block until every write and read in flight has completed."""
        self._store.flush()

    def close(self) -> None:
        """Wait for I/O in flight, then release memory, spill files and threads.

        Idempotent. After it, unpacking a tensor saved under this offloader raises
        :class:`~ssdtrain.OffloaderClosedError`.
        """
        self._recover_forward()
        if self.in_forward:
            raise SSDTrainError("ssdtrain: close() called inside a forward pass (`with offloader:` "
                                "or begin_forward()); exit the block (or call end_forward()) first.")
        self.untrack()
        self._store.close()

    def __repr__(self):
        state = "closed" if self.closed else "open"
        return f"<ssdtrain.Offloader {state} engine={self._stats.engine} " \
               f"spill_dir={self.config.spill_dir}>"

    # ---------------------------------------------------------------- attach
    _attachments = ()  # Attachment objects (ssdtrain/_offloader/attach.py), one per attached module

    def attach(self, model: torch.nn.Module) -> torch.nn.Module:
        """Offload every training forward of ``model`` without touching the training loop.

        Registers a forward pre-hook and an always-called forward hook on ``model``:
        each outermost call in train mode with grad enabled runs as one pass, as if
        wrapped in ``with offloader:``. Calls in eval mode, under ``torch.no_grad()`` or
        ``torch.inference_mode()`` (so ``generate()``), nested calls, and calls inside
        an open pass or another saved-tensor hooks context run untouched. A forward that
        raises still ends its pass. Gradient accumulation works (each forward is a pass).

        Args:
            model: the top module the trainer calls (a ``PreTrainedModel``, a
                ``PeftModel``, an ``FSDPModule``, a ``torch.compile`` result...).

        Returns:
            ``model`` itself, so ``Trainer(model=off.attach(model))`` reads in one line.

        Raises:
            SSDTrainError: ``model`` is not an ``nn.Module`` or is already attached to
                this offloader.
            OffloaderClosedError: the offloader is closed.

        Example::

            off = ssdtrain.Offloader(spill_dir="/nvme/ssdtrain")
            off.attach(model)
            for batch in data:            # or trainer.train()
                model(batch).backward()
            off.detach()
        """
        from ._offloader.attach import Attachment
        if not isinstance(model, torch.nn.Module):
            raise SSDTrainError(f"ssdtrain: attach() needs a torch.nn.Module, got "
                                f"{type(model).__name__}; pass the model the trainer calls.")
        if self.closed:
            from ._errors import OffloaderClosedError
            raise OffloaderClosedError("ssdtrain: attach() on a closed Offloader; create a new one.")
        if any(a.module is model for a in self._attachments):
            raise SSDTrainError(f"ssdtrain: this {type(model).__name__} is already attached to "
                                f"this Offloader; attach it once (detach() first to re-attach).")
        self._attachments = [*self._attachments, Attachment(self, model)]
        return model

    def detach(self, model: torch.nn.Module = None) -> None:
        """Remove the hooks :meth:`attach` registered (on ``model``, or on every module).

        A pass left open by a forward interrupted with a ``BaseException`` (e.g.
        ``KeyboardInterrupt``, which skips forward hooks) is closed first. Detaching a
        module that is not attached does nothing. The offloader stays usable; tensors
        saved before keep working in backward until :meth:`close`.

        Args:
            model: the module to detach; ``None`` (default) detaches every module.
        """
        keep = []
        for a in self._attachments:
            if model is None or a.module is model or a.module is None:
                a.remove()
            else:
                keep.append(a)
        self._attachments = keep


    # ------------------------------------------------------- layers and plans
    def track(self, model: torch.nn.Module, layers=None) -> "Offloader":
        """Know the layers of ``model``: attribute saved bytes to them, profile, plan.

        Forward hooks on each layer module keep track of the running layer; the
        first ``profile_steps`` steps (a step is one ``with offloader:`` forward and
        everything until the next) measure per layer the bytes saved (after
        deduplication), the forward and the backward time (stalls excluded). With
        ``policy="adaptive"`` the engine's bandwidth is then probed once and a plan
        (per layer: keep, offload or recompute) is made and applied from the next
        forward on; see :meth:`plan` and docs/planner.md. With ``policy="static"``
        nothing changes but what :meth:`plan` can report. Calling it again replaces
        the previous tracking.

        Args:
            model: the model whose forward runs under this offloader.
            layers: the layer modules, in forward order, or ``(name, module)`` pairs.
                Default ``None``: every child of every ``nn.ModuleList`` in ``model``
                (a transformer's blocks).

        Returns:
            This offloader, so ``off = ssdtrain.Offloader(...).track(model)`` works.

        Raises:
            ConfigError: no layers were given or found, or a module is listed twice.
            SSDTrainError: called inside a forward pass, or on a closed offloader.
        """
        from ._policies.adaptive import LayerPolicy
        from ._policies.profile import default_layers
        self._recover_forward()
        if self.in_forward:
            raise SSDTrainError("ssdtrain: track() called inside a forward pass; call it "
                                "before `with offloader:` (or between steps).")
        self._store._check_open()
        if layers is None:
            named = default_layers(model)
        else:
            names = {id(m): n for n, m in model.named_modules()}
            named = []
            for item in layers:
                if isinstance(item, tuple):
                    named.append(item)
                else:
                    named.append((names.get(id(item), type(item).__name__), item))
        if not named:
            raise ConfigError(f"ssdtrain: track() found no layers in {type(model).__name__}: it "
                              f"looks for the children of nn.ModuleList containers; pass "
                              f"layers=[...] (the repeated blocks, in forward order).")
        for name, m in named:
            if not isinstance(m, torch.nn.Module):
                raise ConfigError(f"ssdtrain: track(layers=...) takes nn.Module layers, got "
                                  f"{type(m).__name__} for {name!r}.")
        self.untrack()
        try:
            policy = LayerPolicy(self._store, self.config, self._stats, named)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self._layers = policy
        self._store.layers = policy
        return self

    def untrack(self) -> None:
        """Remove what :meth:`track` installed (hooks, recompute wrappers); idempotent.

        Raises:
            SSDTrainError: called inside a forward pass.
        """
        if self._layers is None:
            return
        self._recover_forward()
        if self.in_forward:
            raise SSDTrainError("ssdtrain: untrack() called inside a forward pass; call it "
                                "between steps.")
        policy, self._layers = self._layers, None
        self._store.layers = None
        policy.remove()

    def plan(self):
        """The per-layer plan: the one in force (``policy="adaptive"``), else a fresh one.

        ``str(plan)`` is a markdown table (layer, choice, saved bytes, input bytes,
        forward and backward time) with the predicted step time, stalls and peak
        activation memory; it is also logged (``logging.getLogger("ssdtrain")``, INFO)
        whenever a plan is put in force. With ``policy="static"`` the plan is only a
        report of what ``"adaptive"`` would do (under ``memory_budget_bytes``, or
        without a limit when it is ``None``); the engine's bandwidth is probed on the
        first call.

        Returns:
            A ``ssdtrain._policies.planner.Plan``: ``choices`` (one of ``"keep"``, ``"offload"``,
            ``"recompute"`` per layer), ``layers`` (the measured costs),
            ``prediction`` (``step_s``, ``stall_s``, ``peak_bytes``...), ``fits``.

        Raises:
            SSDTrainError: :meth:`track` was not called, or the first ``profile_steps``
                steps have not all completed yet.
        """
        self._store._check_open()
        if self._layers is None:
            raise SSDTrainError("ssdtrain: plan() needs the layers: call offloader.track(model) "
                                "first, then run profile_steps training steps.")
        if self._layers.plan is not None:
            return self._layers.plan
        return self._layers.make_plan()

    def set_plan(self, choices):
        """Put a per-layer plan of your own in force from the next forward on.

        With ``policy="static"`` it stays in force until :meth:`untrack`; with
        ``"adaptive"`` it replaces the planner's choice until the next re-plan.

        Args:
            choices: one of ``"keep"``, ``"offload"``, ``"recompute"`` per tracked
                layer, in forward order (or a plan returned by :meth:`plan`).

        Returns:
            The plan, with its prediction when the profile is complete (else a
            prediction of zero costs and a note that says so).

        Raises:
            SSDTrainError: :meth:`track` was not called, called inside a forward pass,
                or the number of choices differs from the number of tracked layers.
            ConfigError: an unknown choice.
        """
        self._store._check_open()
        if self._layers is None:
            raise SSDTrainError("ssdtrain: set_plan() needs the layers: call "
                                "offloader.track(model) first.")
        self._recover_forward()
        if self.in_forward:
            raise SSDTrainError("ssdtrain: set_plan() called inside a forward pass; call it "
                                "between steps.")
        return self._layers.set_choices(getattr(choices, "choices", choices))

class _Intercept:
    """The context manager :meth:`Offloader.intercept` returns (a class, not a generator:
    its ``__enter__`` sees the ``with`` statement that calls it, NOTE [ Forward phases ])."""

    __slots__ = ("_offloader",)

    def __init__(self, offloader):
        self._offloader = offloader

    def __enter__(self):
        off, site = self._offloader, with_site()
        off._recover_forward(None, site)
        off._hook_on(site)
        return off

    def __exit__(self, exc_type, exc, tb):
        off = self._offloader
        fwd = off._forward
        if exc is not None:
            _explain(exc)
            off._forward_raised(exc)
        if fwd.phase in (Phase.HOOKING, Phase.UNHOOKING):
            off._settle_forward()
        elif fwd.phase is Phase.INTERCEPTING:
            off._hook_off()
        return False


def _out_of_memory(exc) -> bool:
    """Whether ``exc`` says that memory ran out: torch's ``OutOfMemoryError`` (CUDA's, the
    loopback device's), the CPU allocator's refusal, Python's ``MemoryError``."""
    return isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc))


def _explain(exc):
    """Add a note to torch's refusal of saved-tensor hooks under torch.func transforms."""
    if isinstance(exc, RuntimeError) and "support saved tensor hooks" in str(exc) \
            and hasattr(exc, "add_note"):
        exc.add_note("ssdtrain: torch.func transforms (grad, vjp, jacrev, hessian) cannot run "
                     "with saved-tensor hooks, which ssdtrain installs inside `with offloader:`; "
                     "call them outside the block (or outside offloader.intercept()).")


class SavedHandle:
    """What :meth:`Offloader.save` returns: opaque, for the same offloader's
    :meth:`~Offloader.restore`. It holds the saved tensor's record (dropping the last
    reference releases it) and a weak reference to its offloader, so a handle given
    to another offloader is refused instead of corrupting both offloaders' counts."""

    __slots__ = ("_owner", "_saved", "__weakref__")

    def __init__(self, owner, saved):
        self._owner = weakref.ref(owner)
        self._saved = saved  # the store's Handle or PassThrough

    def __repr__(self):
        return f"<ssdtrain.SavedHandle {type(self._saved).__name__}>"


class RecordView:
    """A read-only view of one record (a saved storage range), from
    :meth:`Offloader.records`. Values are read when asked for."""

    __slots__ = ("_record",)

    def __init__(self, record):
        self._record = record

    state = property(lambda self: self._record.state.name,
                     doc="The record state's name (``PENDING``, ``WRITING``, ``ON_DISK``...; "
                         "docs/ARCHITECTURE.md, \"Record states\").")
    nbytes = property(lambda self: self._record.nbytes, doc="Bytes of the range.")
    lo = property(lambda self: self._record.lo, doc="Start of the range in its storage (bytes).")
    hi = property(lambda self: self._record.hi, doc="End of the range in its storage (bytes).")
    key = property(lambda self: self._record.key, doc="The storage's identity key.")
    version = property(lambda self: self._record.version,
                       doc="The storage's version counter when it was saved.")
    writes = property(lambda self: self._record.writes,
                      doc="How many times its bytes were written to the spill tier.")
    live = property(lambda self: bool(self._record.tokens),
                    doc="Whether a graph still references it (:meth:`Offloader.live_records` "
                        "counts these); one that is not is held only until its request ends.")

    def __repr__(self):
        return f"<ssdtrain.RecordView {self.state} {self.nbytes} B [{self.lo}, {self.hi})>"


def keep_in_memory(*tensors: torch.Tensor) -> None:
    """Mark the storages of ``tensors`` as model state: no offloader ever offloads them.

    ssdtrain already recognises the parameters and buffers of modules that run; this
    is for model state it cannot see, such as parameters gathered into new storage
    by a hook that runs after its own (ZeRO-3). The mark is weak: it lasts as long
    as the storage does. ``None`` and tensors without storage are ignored.

    Args:
        *tensors: the tensors whose storages hold model state.

    Example::

        def pre_forward(module, args):
            ssdtrain.keep_in_memory(*module.parameters(recurse=False))
    """
    for t in tensors:
        TRACKER.add(t)


def offload(config: OffloadConfig = None, **overrides) -> Offloader:
    """A new :class:`Offloader`; the one-shot form of ``Offloader(config, **overrides)``.

    Example::

        with ssdtrain.offload(spill_dir="/nvme/ssdtrain") as off:
            loss = model(batch)
        loss.backward()
        off.close()
    """
    return Offloader(config, **overrides)
