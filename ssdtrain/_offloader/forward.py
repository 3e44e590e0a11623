"""Entering and leaving a forward pass: the phases of an Offloader's forward.

NOTE [ Forward phases ]

Opening a pass and intercepting in it change state that lives outside the
Offloader: the store's pass, the layer policy's step, torch's thread-local stack of
saved-tensor hooks and the module-state tracker. A KeyboardInterrupt can land
between any two of those steps, and before the first line of ``__exit__`` (the
interpreter checks for signals on function entry), so a ``with offloader:`` block
can end with its pass still open and its hooks still pushed. Before this was a state
machine, such an interrupt left ``_in_forward`` set forever: every later ``with``
raised "already open" until the process ended.

So the forward is a record like a store record: one :class:`Phase`, changed only by
:meth:`ForwardState.move`, which raises on a move :data:`MOVES` does not list. Every
step is recorded *before* it is taken (``HOOKING`` is set before the hooks are
pushed), and undoing a step is idempotent (the hooks are popped only if ours are on
top; the tracker forgets a user it does not know; ``Store.end_pass`` of no pass does
nothing). Hence:

* A phase ending in ``-ING`` (``OPENING``, ``HOOKING``, ``UNHOOKING``, ``CLOSING``) seen
  by the thread that owns the forward, at the start of its next forward operation,
  is a transition that was cut short: it is finished back to ``IDLE``
  (``Offloader._repair_forward``), and the new one proceeds. A repair cut short is
  repaired again the same way.
* A settled open phase (``OPEN``, ``INTERCEPTING``) entered by a ``with`` statement
  (or an attached module's call) records that call's *site*: the frame's id, code
  and instruction offset (not the frame: it would keep the step's locals alive).
  When the next ``with offloader:`` finds the pass still open but the frame gone, or
  the same frame back at the same ``with`` (a loop's next iteration), that block has
  ended without its ``__exit__``: the pass is stale and is closed (with a warning)
  before the new one opens. A pass opened by ``begin_forward()`` or a bare
  ``__enter__()`` call has no site (it may rightly outlive the frame that opened
  it): only ``end_forward()`` or ``__exit__`` ends it, and a second entry is refused
  as before.
* Another thread never repairs a forward it does not own while the owner lives: it
  is refused ("already open"), as a concurrent forward on one Offloader always was.

Nothing here is on the per-tensor path: these are a few attribute writes per pass.
"""

import enum
import sys
import threading

import torch

from .._errors import SSDTrainError

__all__ = ["Phase", "MOVES", "ForwardState", "with_site", "call_site", "site_ended",
           "hooks_on_stack"]

_push = torch._C._autograd._push_saved_tensors_default_hooks
_pop = torch._C._autograd._pop_saved_tensors_default_hooks
_top = torch._C._autograd._top_saved_tensors_default_hooks


class Phase(enum.Enum):
    """Where an Offloader's forward is (NOTE [ Forward phases ])."""

    IDLE = "idle"                  # no pass open
    OPENING = "opening"            # begin_forward() under way (store pass, layer step)
    OPEN = "open"                  # a pass is open, nothing intercepted
    HOOKING = "hooking"            # pushing our saved-tensor hooks, starting the tracker
    INTERCEPTING = "intercepting"  # our hooks are on top: saved tensors come to the store
    UNHOOKING = "unhooking"        # popping our hooks, stopping the tracker
    CLOSING = "closing"            # end_forward() under way (layer step, store pass)


#: The moves :meth:`ForwardState.move` allows. ``OPENING -> CLOSING`` and ``HOOKING ->
#: UNHOOKING`` are the undo of a step cut short; the rest is the normal cycle.
MOVES = {
    Phase.IDLE: frozenset({Phase.OPENING}),
    Phase.OPENING: frozenset({Phase.OPEN, Phase.CLOSING}),
    Phase.OPEN: frozenset({Phase.HOOKING, Phase.CLOSING}),
    Phase.HOOKING: frozenset({Phase.INTERCEPTING, Phase.UNHOOKING}),
    Phase.INTERCEPTING: frozenset({Phase.UNHOOKING}),
    Phase.UNHOOKING: frozenset({Phase.OPEN}),
    Phase.CLOSING: frozenset({Phase.IDLE}),
}

#: Transitions under way: seen at the start of a forward operation, cut short.
TRANSIENT = frozenset({Phase.OPENING, Phase.HOOKING, Phase.UNHOOKING, Phase.CLOSING})
#: Phases in which our hooks may be on torch's stack (and the tracker counts us).
HOOKED = frozenset({Phase.HOOKING, Phase.INTERCEPTING, Phase.UNHOOKING})


class ForwardState:
    """The forward of one Offloader: its :class:`Phase`, owner thread and site."""

    __slots__ = ("phase", "thread", "thread_name", "site", "hook_site", "hooks", "__weakref__")

    def __init__(self):
        self.phase = Phase.IDLE
        self.thread = None       # ident of the thread that opened the pass
        self.thread_name = None  # its name, for messages
        self.site = None         # with_site()/call_site() of the pass's entry, or None
        self.hook_site = None    # the same for the interception's entry
        self.hooks = None        # the (pack, unpack) pair pushed (or about to be)

    def move(self, to: Phase) -> None:
        """The one way the phase changes; raises on a move :data:`MOVES` does not list."""
        if to not in MOVES[self.phase]:
            raise SSDTrainError(f"ssdtrain: forward phase {self.phase.value} -> {to.value} is "
                                f"not a legal move (NOTE [ Forward phases ]); please report "
                                f"this bug.")
        if to is Phase.OPENING:
            self.thread = threading.get_ident()
            self.thread_name = threading.current_thread().name
        elif to is Phase.IDLE:
            self.thread = self.thread_name = self.site = self.hook_site = None
        elif to is Phase.OPEN:
            self.hook_site = None
        self.phase = to

    def owned_here(self) -> bool:
        """Whether this thread may repair it: it opened the pass, or that thread is gone."""
        if self.thread is None or self.thread == threading.get_ident():
            return True
        return not any(t.ident == self.thread for t in threading.enumerate())

    def push_hooks(self, pack, unpack) -> None:
        """Record, then push, our saved-tensor hooks (phase ``HOOKING``)."""
        self.hooks = (pack, unpack)
        _push(pack, unpack)

    def pop_hooks(self) -> bool:
        """Pop our hooks if they are on top of this thread's stack; forget them either
        way. Idempotent. Returns False when ours were recorded but another pair was on
        top (a ``saved_tensors_hooks`` entered inside the block and never left): that
        pair is left alone, and ours with it."""
        pair, ok = self.hooks, True
        if pair is not None:
            top = _top(False)
            if top is not None and top[0] is pair[0] and top[1] is pair[1]:
                _pop()
            elif top is not None:
                ok = False
        self.hooks = None
        return ok


    def pop_if_top(self) -> bool:
        """Pop our hooks, and forget them, only if they are on top of this thread's
        stack; whether they were (NOTE [ Hooks off past the window ] in _policies/auto.py)."""
        pair = self.hooks
        top = _top(False)
        if pair is None or top is None or top[0] is not pair[0] or top[1] is not pair[1]:
            return False
        _pop()
        self.hooks = None
        return True


def hooks_on_stack() -> bool:
    """Whether a pair of saved-tensor hooks is on this thread's stack."""
    return _top(False) is not None


_BEFORE_WITH = {op for name, op in __import__("dis").opmap.items()
                if name in ("BEFORE_WITH", "SETUP_WITH", "BEFORE_ASYNC_WITH")}
_SUSPENDABLE = 0x20 | 0x80 | 0x200  # CO_GENERATOR | CO_COROUTINE | CO_ASYNC_GENERATOR


def with_site(depth: int = 2):
    """The site of the ``with`` statement that is calling ``__enter__`` ``depth`` frames up,
    or ``None`` when the caller is not a ``with`` statement (a bare ``__enter__()`` call,
    ``ExitStack.enter_context``) or is a generator (it may be suspended inside the block)."""
    f = sys._getframe(depth)
    code = f.f_code
    if code.co_flags & _SUSPENDABLE or code.co_code[f.f_lasti] not in _BEFORE_WITH:
        return None
    return (id(f), code, f.f_lasti)


def call_site(frame):
    """The site of ``frame`` (a module call that opens a pass), or ``None``."""
    if frame is None or frame.f_code.co_flags & _SUSPENDABLE:
        return None
    return (id(frame), frame.f_code, frame.f_lasti)


def site_ended(site, entering) -> bool:
    """Whether the block entered at ``site`` has ended, seen from a new entry at
    ``entering`` (a site on the current stack, or ``None``): no frame on this thread's
    stack is the site's frame, or the new entry is that same frame at the same
    instruction (a frame cannot enter a ``with`` again before leaving it). Frames are
    matched by id and code: a new frame of the same code at the dead frame's address
    entering at the same place is the same loop's next iteration."""
    if site is None:
        return False
    fid, code, lasti = site
    if entering is not None and entering == site:
        return True
    f = sys._getframe(1)
    while f is not None:
        if id(f) == fid and f.f_code is code:
            return False
        f = f.f_back
    return True
