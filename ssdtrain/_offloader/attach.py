"""Run an :class:`~ssdtrain.Offloader` around every training forward of a module.

:meth:`Offloader.attach` registers a forward pre-hook and an always-called forward
hook on the top module. The pre-hook opens a pass (``begin_forward``) and starts
interception; the forward hook stops interception and ends the pass. Loops that a
framework owns (Hugging Face ``Trainer``, Lightning, accelerate) then offload with
no change to the loop.

# NOTE [ Which calls of an attached module offload ]

Only a *training* forward of the *outermost* call opens a pass. A call is a no-op
(the module runs as if nothing were attached) when:

* the module is in eval mode (``model.eval()``), or grad mode is off
  (``torch.no_grad()``, ``torch.inference_mode()``): nothing is saved for backward,
  and Hugging Face ``generate()`` runs under ``no_grad``;
* the call is nested in a call of the same module that already opened a pass
  (re-entrant forwards), or in a pass opened some other way (``with offloader:``,
  ``begin_forward()``, or another attached module on the same offloader): the
  enclosing pass owns the tensors;
* another saved-tensor hooks context encloses the call (``save_on_cpu``, a
  checkpoint around the whole model): pushing ours on top would take the tensors
  away from it (NOTE [ Innermost hooks win ] in docs/ARCHITECTURE.md), so we step aside.

A forward that raises still ends its pass: the forward hook is registered with
``always_call=True``, which torch runs when ``forward`` raises an ``Exception``.
It does not for a ``BaseException`` such as ``KeyboardInterrupt``; the pass left
open then is detected at the next call of the module (the frame of the call that
opened it is no longer on the stack) and closed with a warning, and
:meth:`Offloader.detach` closes it too.
"""

# NOTE [ Attach and torch.compile ]
#
# A compiled forward runs as one autograd Function (AOTAutograd's CompiledFunction)
# whose save_for_backward goes through the saved-tensor hooks active when it *runs*,
# so a pass around a compiled call offloads what the compiled graph saves (which the
# partitioner chooses: it may recompute cheap ops instead). The hooks that open and
# end the pass, though, must run eagerly: when they sit on a module that Dynamo
# traces (attach(model) then torch.compile(model), or model.compile()), Dynamo would
# try to trace begin_forward and fail on the first builtin it cannot (fullgraph=True
# raises, the default mode graph-breaks noisily). They are wrapped in
# torch.compiler.disable, which Dynamo runs as-is. Checked on torch 2.13 with
# fullgraph=True in all three placements (tests/test_compile.py). The price: importing
# torch._dynamo (~2 s) the first time attach() is called, never at `import ssdtrain`.

import logging
import sys
import threading
import weakref

import torch

from .._errors import SSDTrainError
from .forward import Phase, call_site, site_ended
from .._decision.policy import TRACKER

__all__ = ["Attachment", "skip_reason"]

log = logging.getLogger("ssdtrain")

_CALL_IMPL = getattr(torch.nn.Module, "_call_impl", None)
_CALL_IMPL_CODE = getattr(_CALL_IMPL, "__code__", None)
_top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def skip_reason(module: torch.nn.Module, offloader) -> str:
    """Why a call of ``module`` must not open a pass of ``offloader`` ('' if it should).

    See NOTE [ Which calls of an attached module offload ].
    """
    if not module.training:
        return "the module is in eval mode"
    if not torch.is_grad_enabled():
        return "grad mode is off"
    if torch.is_inference_mode_enabled():
        return "inference mode is on"
    if offloader.in_forward:
        return "a pass of this offloader is already open"
    if _top_hooks is not None and _top_hooks(False) is not None:
        return "another saved_tensors_hooks context encloses the call"
    return ""


def _call_frame():
    """The frame of the ``Module._call_impl`` that is running the hook (None if not found).

    It lives exactly as long as the module call, so a later call can tell whether the
    call that opened a pass is still running (nested) or is gone (interrupted).
    """
    if _CALL_IMPL_CODE is None:
        return None
    f = sys._getframe(2)
    for _ in range(16):  # the hook runs in _call_impl, a closure in it, and wrappers
        if f is None:
            return None
        if f.f_code is _CALL_IMPL_CODE:
            return f
        f = f.f_back
    return None


class Attachment:
    """The forward hooks that run one offloader around one module's training forwards.

    Args:
        offloader: the :class:`~ssdtrain.Offloader`.
        module: the top module; its outermost training calls each become one pass.
    """

    def __init__(self, offloader, module: torch.nn.Module):
        self._offloader = offloader
        self._module = weakref.ref(module)
        self._depth = 0          # calls of the module inside the open pass (0: none open)
        self._thread = None      # ident of the thread that opened it
        self._site = None        # call_site() of the call that opened it (NOTE [ Forward phases ])
        self._exc = None         # the exception being handled when it opened (not ours)
        self.passes = 0          # passes opened (for tests and logs)
        # prepend=False: framework pre-hooks registered before us (FSDP2's unshard) run
        # first, so the parameters recorded below are the ones forward will use.
        # See NOTE [ Attach and torch.compile ].
        disable = torch.compiler.disable
        self._handles = [
            module.register_forward_pre_hook(disable(self._pre_forward)),
            module.register_forward_hook(disable(self._post_forward), always_call=True),
        ]

    @property
    def module(self):
        return self._module()

    @property
    def open(self) -> bool:
        """Whether a pass opened by this attachment is open."""
        return self._depth > 0

    # --------------------------------------------------------------- hooks
    def _pre_forward(self, module, args):
        site = call_site(_call_frame())
        if self._depth:
            if self._thread != threading.get_ident():
                raise SSDTrainError(
                    f"ssdtrain: {type(module).__name__} was called on another thread while its "
                    f"attached offloader is in a forward pass opened on thread {self._thread}; "
                    f"one Offloader serves one forward at a time. Attach a separate Offloader "
                    f"per concurrently running replica.")
            if self._site is None or not site_ended(self._site, site):
                self._depth += 1  # a nested call: the outer pass owns its tensors
                return
            log.warning("ssdtrain: the previous forward of %s did not finish (interrupted by a "
                        "BaseException such as KeyboardInterrupt?); closing its pass.",
                        type(module).__name__)
            self.close_pass(failed=True)
        off = self._offloader
        # A pass an interrupt left behind (in these hooks, or a `with` around an earlier
        # call) is repaired first, else it would look like an enclosing one.
        off._recover_forward(site, site)
        if skip_reason(module, off):
            return
        # The bookkeeping comes first: an interrupt after it leaves a pass this
        # attachment knows it may own (close_pass and the next call repair it).
        self._thread = threading.get_ident()
        self._site = site
        self._exc = sys.exc_info()[1]
        self._depth = 1
        try:
            off._open_forward(site)
            off._hook_on(site)
        except BaseException:
            self._depth = 0
            self._site = self._exc = None
            off._repair_forward()
            raise
        self.passes += 1
        # Parameters and buffers stay in memory (see _policy). The tracker records those
        # of modules as they run; this also covers weights the top module uses directly
        # (tied heads, functional calls), whose own pre-hook ran before interception.
        for p in module.parameters():
            TRACKER.add(p)
        for b in module.buffers():
            TRACKER.add(b)

    def _post_forward(self, module, args, output):
        if not self._depth or self._thread != threading.get_ident():
            return None  # no pass open, or a call on another thread that was refused
        self._depth -= 1
        if self._depth:
            return None
        exc = sys.exc_info()[1]
        failed = exc is not None and exc is not self._exc
        if failed:  # an out-of-memory error is a measurement (Offloader._forward_raised)
            self._offloader._forward_raised(exc)
        self.close_pass(failed=failed)
        return None

    # ------------------------------------------------------------- lifetime
    def close_pass(self, failed: bool) -> None:
        """End the pass this attachment opened (no-op when none is open).

        Args:
            failed: the forward raised; a pending write error is then left for the
                next pack or unpack instead of replacing the forward's exception.
        """
        if not self._depth and self._site is None:
            return
        site = self._site
        self._depth = 0
        self._site = self._exc = None
        off = self._offloader
        fwd = off._forward
        if fwd.phase is Phase.IDLE or not fwd.owned_here():
            return
        off._settle_forward()  # a transition cut short is never a live one here
        if site is not None and fwd.site != site:
            return  # not this attachment's pass
        if fwd.phase is Phase.INTERCEPTING:
            off._hook_off()
        if fwd.phase is Phase.OPEN:
            off._close_forward(raise_pending=not failed)

    def remove(self) -> None:
        """Remove the hooks; a pass still open is closed first."""
        try:
            self.close_pass(failed=True)
        finally:
            for h in self._handles:
                h.remove()
            self._handles = []
