"""A store's failure events and its once-only warnings: the object the store and its
paths report a failure to (NOTE [ One event, one error ]), and the helpers that make
the errors it raises (a stored error is never raised itself: ``_copy``).

NOTE [ One event, one error ]

A failure the store finds on its own (a write that failed, a record beyond
``max_spill_bytes`` with ``on_spill_full="raise"``, a failed round of the I/O thread) is
not raised where it is found (an engine thread, the I/O thread): it becomes the pending
*event* (``Events.failure``, a :class:`Failure`), raised by the next store operation that
can raise (a pack, the throttle, the end of forward, an unpack of a record it lost).
Further failures found before that join the same event: one error, which says how many
records the event touched, not one error per record raised by one pack after another
(which failed the next steps, each of which fit). Raising it marks the step it is raised
in as reported (``_Pass.reported``: the forward running, which it aborts, the one that
just ended, or the one a record of the event belongs to, when backward needed that
record). A record of a reported step that fails later (its write was still in flight)
is part of the event already raised when its step was aborted or no graph holds it any
more: it raises only if backward needs its data (``rec.error``), never again at a later
step's pack. So after the one error the store is clean: once the failed step's graph
is gone, the next step that fits runs as if nothing had happened. A later failure of a
record a live graph holds is a new event; so is one of another step. An error backward
raises for a record outside the pending event (a failed read) leaves the event pending.
"""

import logging

import torch

from ._errors import SpillIOError, SSDTrainError

__all__ = ["Events", "Failure"]

log = logging.getLogger("ssdtrain")


class Events:
    """The pending failure event of one store and the warnings it has logged (NOTE [ One
    event, one error ]). Every method runs under the store lock; ``failure`` is read
    without it by pack (one attribute read while nothing failed)."""

    __slots__ = ("failure", "warned")

    def __init__(self):
        self.failure = None   # the pending event (a Failure), or None
        self.warned = set()   # warnings already logged (once per store)

    def report(self, rec, exc, lost):
        """A failure of record ``rec`` (``None``: of the store itself), ``lost`` whether
        its bytes are gone: it joins the pending event, or starts one, unless ``rec``
        belongs to a step whose error has been raised (then only backward raises it, if it
        needs the record). Idempotent per record."""
        step = None if rec is None else rec.owner
        if step is not None and step.reported and (step.aborted or not rec.tokens):
            self.warn_once("reported", "%s [a record of a step whose error was already "
                           "raised: raised again only if backward needs it; further ones are "
                           "not logged]", exc)
            return
        event = self.failure
        if event is None:
            event = self.failure = Failure(exc)
        if event.error is exc or rec is None:  # a failure of the store itself: never silent
            log.error("%s", exc)
        if rec is not None:
            event.records[rec] = lost

    def raise_pending(self, rec, current, ended):
        """Raise the pending event, if any (it is then forgotten: raised once), or, with
        ``rec`` (backward needs it), ``rec``'s own error, which reports the event too if
        ``rec`` is one of its records. The step it is raised in counts as reported (NOTE [
        One event, one error ]): ``rec``'s, else ``current`` (the forward running, which
        the raise aborts), else ``ended`` (the pass whose forward ended last)."""
        event = self.failure
        if rec is None and event is None:
            return
        note = ""
        if event is not None and (rec is None or rec in event.records):  # raised now
            self.failure = None
            note = event.note()
            if rec is not None:  # backward needed a record of the event
                step = rec.owner
            elif current is not None:  # the forward running: the raise aborts it
                step = current
                step.aborted = True
            else:  # the end of forward
                step = ended
            if step is not None:
                step.reported = True
        if rec is not None:
            raise _in_context(rec.error, rec, note)
        raise _copy(event.error, note)

    def warn_once(self, what, msg, *args):
        """Log ``msg % args`` as a warning the first time ``what`` happens in this store."""
        if what not in self.warned:
            self.warned.add(what)
            log.warning(msg, *args)


class Failure:
    """The pending failure event of a store (NOTE [ One event, one error ]): the first
    error, and the records it touched (``record -> whether its bytes are lost``)."""

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
