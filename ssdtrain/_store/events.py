"""A store's failure events and its once-only warnings: the object the store and its
paths report a failure to (NOTE [ One event, one error ]), and the helpers that make
the errors it raises (a stored error is never raised itself: ``_copy``).

NOTE [ One event, one error ]

A failure the store finds on its own (a write that failed, a copy to the host tier or
an eviction's write that failed, a record beyond ``max_spill_bytes`` with
``on_spill_full="raise"``) is not raised where it is found (an engine thread, the I/O
thread): it becomes the pending *event* of the step it belongs to, and a step is
never failed by another step's event.

* **Whose it is.** A record's failure belongs to the pass that saved the record last
  (``Record.owner``: the step whose graph holds it). The failures of one pass found
  before its event is raised join that event (``Events.pending[pass]``, a
  :class:`Failure`): one error, which says how many records it touched, not one error
  per record raised by one pack after another (which failed the next steps, each of
  which fit).
* **Where it is raised.** In that pass's forward: its next pack or throttle (which
  aborts the forward), or its end (the ``with`` block's exit, ``end_forward()``); or by
  a backward that needs a failed record (its unpack raises the record's own error,
  ``rec.error``, and reports the event with it). Never by another pass's pack,
  throttle, end of forward or backward: a write decided in step k that fails while
  step k+1 runs (its write still in flight after step k's backward, an eviction of a
  record step k's graph still holds) raises in step k's backward if that needs the
  record, not in step k+1. Raising marks the pass as reported (``_Pass.reported``; in
  its forward also ``aborted``: its graph is garbage).
* **Nobody needs it.** A failure of a record no handle references any more (its graph
  is gone, or backward has used every handle of it) loses nothing that anyone will
  ask for: it is not raised in any step. It is never swallowed either: it is counted
  in ``Stats.unneeded_failures`` and the first is logged as a warning, with its error.
  So is a pending event whose failed records' handles all die before anything raised
  it (the graph dropped without backward): ``Events.sweep``, at each step's start and
  each ``stats()``. A failure of a pass whose error was raised already (its write was
  still in flight) is part of that error: it raises only if backward needs the record
  (``rec.error``), and is logged once.
* **The store's own failure** (an exception escaping a round of the I/O thread) and a
  failure of a record saved outside any pass belong to no step: they are raised by the
  next store operation that can raise (``Events.failure``).

So after its one error the store is clean: once the failed step's graph is gone, the
next step that fits runs as if nothing had happened, and a step that fits never
raises an earlier step's failure. An error backward raises for a record outside the
pending event (a failed read) leaves the event pending. tests/test_one_error.py, and
the soak with injected faults in tests/test_soak.py, which checks that every error is
raised in a step whose own request failed.
"""

import logging

import torch

from .._errors import SpillIOError, SSDTrainError

__all__ = ["Events", "Failure"]

log = logging.getLogger("ssdtrain")


class Events:
    """The pending failure events of one store and the warnings it has logged (NOTE [ One
    event, one error ]). Every method runs under the store lock; ``failure`` and
    ``pending`` are read without it by pack (attribute reads while nothing failed).

    Args:
        stats: the store's ``Stats`` (``unneeded_failures``).
    """

    __slots__ = ("failure", "pending", "warned", "stats")

    def __init__(self, stats):
        self.failure = None   # the store's own pending event (a Failure), or None
        self.pending = {}     # pass -> its pending event (a Failure)
        self.warned = set()   # warnings already logged (once per store)
        self.stats = stats

    def report(self, rec, exc, lost):
        """A failure of record ``rec`` (``None``: of the store itself), ``lost`` whether
        its bytes are gone: it joins the pending event of ``rec``'s pass, or starts one;
        counted as unneeded if no handle references ``rec``; part of the error raised
        already if ``rec``'s pass has been reported. Idempotent per record."""
        step = None if rec is None else rec.owner
        if step is not None and step.reported and (step.aborted or not rec.tokens):
            self.warn_once("reported", "%s [a record of a step whose error was already "
                           "raised: raised again only if backward needs it; further ones are "
                           "not logged]", exc)
            return
        if lost and not rec.tokens:  # (a record being packed has none yet: not lost)
            self._unneeded(exc, 1)
            return
        if step is None:  # the store's own, or a record of no pass: the next operation
            event = self.failure
            if event is None:
                event = self.failure = Failure(exc)
        else:
            event = self.pending.get(step)
            if event is None:
                event = self.pending[step] = Failure(exc)
        if event.error is exc or rec is None:  # a failure of the store itself: never silent
            log.error("%s", exc)
        if rec is not None:
            event.records[rec] = lost

    def raise_pending(self, rec, current, ended):
        """Raise what is pending for the caller, if anything (NOTE [ One event, one
        error ]): with ``rec`` (backward needs it), ``rec``'s own error, which reports
        its pass's event too if ``rec`` is one of its records; else the store's own
        event, else the event of ``current`` (the forward running, which the raise
        aborts) or, outside a forward, of ``ended`` (the pass whose forward ended last).
        An event raised is forgotten (raised once); its pass counts as reported."""
        if rec is not None:
            note = ""
            step = rec.owner
            event = self.failure if step is None else self.pending.get(step)
            if event is not None and rec in event.records:  # reported now
                note = event.note()
                if step is None:
                    self.failure = None
                else:
                    del self.pending[step]
                    step.reported = True
            raise _in_context(rec.error, rec, note)
        step = current if current is not None else ended
        event = self.failure
        if event is not None:
            self.failure = None
        elif step is not None and step in self.pending:
            event = self.pending.pop(step)
        else:
            return
        if step is not None:
            step.reported = True
            if step is current:  # the raise aborts the forward running
                step.aborted = True
        raise _copy(event.error, event.note())

    def sweep(self):
        """Forget the pending events whose failed records no handle references any more
        (their graphs died before anything needed them): unneeded, counted and logged
        (NOTE [ One event, one error ]). Cheap while nothing is pending."""
        for step, event in list(self.pending.items()):
            if not any(r.tokens for r in event.records):
                del self.pending[step]
                self._unneeded(event.error, len(event.records))

    def _unneeded(self, exc, n):
        self.stats.unneeded_failures += n
        self.warn_once("unneeded", "%s [no graph needs the record any more (its graph is gone, "
                       "or backward has used it): nothing was lost, so no step raises it; "
                       "such failures are counted in Stats.unneeded_failures and not logged "
                       "again]", exc)

    def warn_once(self, what, msg, *args):
        """Log ``msg % args`` as a warning the first time ``what`` happens in this store."""
        if what not in self.warned:
            self.warned.add(what)
            log.warning(msg, *args)


class Failure:
    """A pending failure event (NOTE [ One event, one error ]): the first error, and the
    records it touched (``record -> whether its bytes are lost``)."""

    __slots__ = ("error", "records")

    def __init__(self, error):
        self.error = error
        self.records = {}

    def note(self):
        """What the error adds: how many records the event touched, and what became of
        them."""
        n = len(self.records)
        if not n:
            return ""
        lost = sum(self.records.values())
        fate = "their data is lost" if lost == n else \
            "kept in memory" if not lost else f"{lost} lost, {n - lost} kept in memory"
        return (f" [this failure touched {n} record{'s' if n > 1 else ''} of the step "
                f"({fate}); it is raised once: once this step's graph is gone, later steps "
                f"that fit run normally]")


def _without_frames(exc):
    """``exc`` with no traceback. An error raised while a request completed inline (on the
    training thread, in pack) has frames that link back to forward's, which hold the
    graph, whose handles hold the record that keeps the error: a leak."""
    if exc is not None:
        exc.__traceback__ = None
        exc.__context__ = None
    return exc


def _needed_by():
    """`` (needed by <Node>)`` naming the autograd node running backward, if any."""
    node = torch._C._current_autograd_node()
    return "" if node is None else f" (needed by {node.name()} in backward)"


def timeout_error(rec, what, tail, timeout_s):
    """The ``SpillIOError`` for a request of ``rec`` past ``io_timeout_s``
    (``timeout_s``): ``"ssdtrain: {what} record ... did not finish within ...{tail}"``."""
    slot = rec.slot
    where = "?" if slot is None else f"{slot.file.name} at offset {slot.offset}"
    return SpillIOError(f"ssdtrain: {what} record {rec!r} ({where}) did not finish within "
                        f"io_timeout_s={timeout_s} s{tail}",
                        filename=None if slot is None else slot.file.directory)


def _in_context(err, rec, note=""):
    """``err`` again, its message naming the record and the backward op that needed it."""
    return _copy(err, f" [record {rec!r}{_needed_by()}]{note}")


def _copy(err, note=""):
    """A new exception like ``err`` (message + ``note``) to raise in its place.

    The error kept on a record (and in the pending list) is never raised itself: a raised
    exception's traceback holds the frames of forward or backward, and through them the
    graph whose handles keep that very record alive (a cycle through the store, which
    ``gc`` cannot break while the store lives)."""
    if not isinstance(err, SSDTrainError):  # never raise the stored object (see above)
        new = SSDTrainError(f"ssdtrain: {type(err).__name__}: {err}{note}")
        new.__cause__ = err
        return new
    if isinstance(err, SpillIOError):
        return SpillIOError(str(err) + note, errno=err.errno, filename=err.filename)
    try:
        return type(err)(str(err) + note)
    except TypeError:
        return err
