"""One failure event, one error (NOTE [ One event, one error ] in ssdtrain/_store/events.py).

A failed write (disk full, EIO) or a record beyond ``max_spill_bytes`` with
``on_spill_full="raise"`` raises one ``SpillIOError``, in the step where it happened (its
forward, its end, or its backward when that needs a lost record), saying how many
records it touched. Then the store is clean: once that step's graph is gone no record,
byte or slot is left, and the next steps, which fit, run and are exact. Before the fix
one error was queued per failed record and raised by later packs one at a time: the
next 4-5 steps failed. A failure belongs to its step: a later step never raises it
(the tests at the end), and one nobody needs is counted, not raised.

Parametrized over the failure kind and over where in the step it is found:

* ``pack``: ``write_behind_bytes=0``, so each write ends before forward goes on; the
  error is raised inside forward.
* ``exit``: the store's I/O thread is paused, so every write starts (and fails, or
  goes over the budget) at the end of forward; the error is raised at the ``with``
  block's exit, once, for all of them.
* ``backward``: the writes hang until forward has ended, then fail; backward raises
  when it needs the first lost record, and the event is reported with it.

The writes failing after the step's graph was dropped without backward (nobody needs
their bytes) are not raised by the next step: ``test_a_failure_nobody_needs_...``.
"""

from __future__ import annotations

import errno
import gc
import re

import pytest
import torch

import ssdtrain
from ssdtrain import testing
from ssdtrain.io import faulty
from ssdtrain.io.faulty import Fault

K = 6          # saved records per step
BIG, SMALL = 64, 4   # rows: 64 KiB records (the failing step), 4 KiB ones (steps that fit)
BUDGET = 2 * (68 << 10)  # fits SMALL steps (K x 8 KiB of slots); 2 of a BIG step's K records
ERRNOS = {"ENOSPC": errno.ENOSPC, "EIO": errno.EIO, "budget": errno.ENOSPC}
CASES = [(kind, where) for kind in ("ENOSPC", "EIO") for where in
         ("pack", "exit", "backward")] + [("budget", "pack"), ("budget", "exit")]
LATER_STEPS = 3


def _forward(x):
    h = x
    for _ in range(K):
        h = (h * 1.25).sin()  # sin saves its input: one record per layer
    return h.sum()


def _reference(rows):
    x = torch.linspace(-1, 1, rows * 256).reshape(rows, 256).requires_grad_()
    _forward(x).backward()
    return x.grad


def _step(off, rows, *, backward=True):
    x = torch.linspace(-1, 1, rows * 256).reshape(rows, 256).requires_grad_()
    with off:
        loss = _forward(x)
    if backward:
        loss.backward()
    return x.grad


def _clean(off):
    gc.collect()
    off.wait()
    assert (off.live_records(), off.resident_bytes(), off.spill_bytes_in_use()) == (0, 0, 0)
    testing.check_invariants(off)


def _fail_hung(inj, err, n=K):
    """Fail the hung writes as a device would, late: each lets go of its owner (its
    memory and slot) first, as an engine does (NOTE [ Requests own their memory ])."""
    hung, inj._hung = inj._hung, []
    assert len(hung) == n, f"expected {n} hung writes, got {len(hung)}"
    while hung:
        fut, file, offset, nbytes, verb, owner = hung.pop(0)
        del owner
        fut.set_exception(ssdtrain.SpillIOError(
            f"ssdtrain: {verb} {nbytes} bytes of {file.name} failed (injected late "
            f"{errno.errorcode[err]})", errno=err, filename=file.directory))


@pytest.mark.parametrize("kind,where", CASES)
def test_one_failure_raises_once_then_later_steps_are_exact(make_offloader, kind, where):
    ref_small = _reference(SMALL)
    cfg = dict(min_tensor_bytes=4096, keep_tail_bytes=0, prefetch_bytes="1MiB", verify=False)
    if where == "pack":
        cfg["write_behind_bytes"] = 0
    if kind == "budget":
        cfg.update(max_spill_bytes=BUDGET, on_spill_full="raise")
    off = make_offloader(**cfg)
    inj = None
    if kind != "budget":
        hang = where == "backward"
        inj = faulty.install(off, Fault("write", "hang" if hang else kind, nth=1, times=None))
    if where == "exit":
        testing.hold_io(off)  # nothing is written before the end of forward

    errors = []
    x = torch.linspace(-1, 1, BIG * 256).reshape(BIG, 256).requires_grad_()
    try:
        with off:
            loss = _forward(x)
        if where == "backward":
            _fail_hung(inj, ERRNOS[kind])
            loss.backward()
    except ssdtrain.SpillIOError as e:
        errors.append(str(e))
        assert e.errno == ERRNOS[kind]
        del e
    loss = None
    if inj is not None:
        inj.faults.clear()  # the disk has room again
    testing.hold_io(off, False)
    assert x.grad is None, "a gradient computed from lost data"

    assert len(errors) == 1, errors
    msg = errors[0]
    touched = re.search(r"this failure touched (\d+) records?", msg)
    assert msg.startswith("ssdtrain:") and touched, msg
    n = int(touched.group(1))
    if where in ("exit", "backward") and kind != "budget":
        assert n == K, msg  # one event: every record that failed
    # The budget is decided at pack (INV-DECIDED), whatever the writes' timing: the first
    # record over it starts the event and the next pack raises it, in forward.
    assert n >= 1
    _clean(off)

    for _ in range(LATER_STEPS):  # each fits: no error about the first step's records
        got = _step(off, SMALL)
        assert torch.equal(got, ref_small)
    _clean(off)
    if kind == "budget":
        assert off.stats().records_written >= LATER_STEPS * K  # the later steps did spill


def test_failures_after_the_error_was_raised_do_not_raise_again(make_offloader):
    """Writes of the failed step still in flight when its error is raised fail later:
    they are part of the event already reported, never a later step's error."""
    off = make_offloader(min_tensor_bytes=4096, keep_tail_bytes=0, prefetch_bytes="1MiB")
    inj = faulty.install(off, Fault("write", "hang", nth=2, times=None),
                         Fault("write", "EIO", nth=1))
    testing.hold_io(off)  # every write starts at the end of forward: the first fails
    x = torch.linspace(-1, 1, BIG * 256).reshape(BIG, 256).requires_grad_()
    with pytest.raises(ssdtrain.SpillIOError, match="touched 1 record"):
        with off:
            loss = _forward(x)  # the graph lives until the error
    # The later writes of that step hang; they fail now, after its error was raised.
    loss = None  # noqa: F841
    gc.collect()
    testing.hold_io(off, False)
    inj.faults.clear()
    _fail_hung(inj, errno.EIO, K - 1)
    _clean(off)
    ref = _reference(SMALL)
    for _ in range(LATER_STEPS):
        assert torch.equal(_step(off, SMALL), ref)
    _clean(off)


# ------------------------------------------------- a failure belongs to its step
@pytest.mark.parametrize("kind", ["ENOSPC", "EIO"])
@pytest.mark.parametrize("when", ["dropped", "after_backward"])
def test_a_failure_nobody_needs_is_counted_not_raised_by_a_later_step(make_offloader, caplog,
                                                                      kind, when):
    """The step's writes fail once no graph needs their records: ``dropped``, the graph
    was dropped without backward; ``after_backward``, backward used every record (served
    from memory, the writes still in flight) and ended. Nothing was lost, so no later
    step raises it (before the fix the next step's first pack did: a healthy step failed
    with an earlier step's error); it is counted in ``Stats.unneeded_failures`` (one per
    record) and logged once as a warning, never swallowed."""
    ref = _reference(SMALL)
    off = make_offloader(min_tensor_bytes=4096, keep_tail_bytes=0, prefetch_bytes="1MiB")
    inj = faulty.install(off, Fault("write", "hang", nth=1, times=None))
    x = torch.linspace(-1, 1, BIG * 256).reshape(BIG, 256).requires_grad_()
    with off:
        loss = _forward(x)
    if when == "after_backward":
        loss.backward()
        assert torch.equal(x.grad, _reference(BIG))  # served from memory: exact
    loss = None
    gc.collect()
    inj.faults.clear()
    _fail_hung(inj, ERRNOS[kind])
    for _ in range(LATER_STEPS):  # healthy steps: none raises the first step's failure
        assert torch.equal(_step(off, SMALL), ref)
    _clean(off)
    assert off.stats().unneeded_failures == K
    warned = [r for r in caplog.records if "unneeded_failures" in r.getMessage()]
    assert len(warned) == 1 and errno.errorcode[ERRNOS[kind]] in warned[0].getMessage(), warned


@pytest.mark.parametrize("kind", ["ENOSPC", "EIO"])
def test_a_later_step_never_raises_an_earlier_steps_failure(make_offloader, kind):
    """Two graphs alive at once (gradient accumulation, 1F1B): the first step's writes fail
    while the second step's forward runs. The second step saves, ends its forward and
    runs backward without an error (exact); the first step's backward, which needs the
    lost records, raises it, once, saying it touched all of them. Before the fix the
    second step's pack raised the first step's error."""
    off = make_offloader(min_tensor_bytes=4096, keep_tail_bytes=0, prefetch_bytes="1MiB")
    inj = faulty.install(off, Fault("write", "hang", nth=1, times=K))
    x = torch.linspace(-1, 1, BIG * 256).reshape(BIG, 256).requires_grad_()
    with off:
        first = _forward(x)
    assert len(inj._hung) == K
    y = torch.linspace(-1, 1, SMALL * 256).reshape(SMALL, 256).requires_grad_()
    with off:
        h = y
        for i in range(K):
            h = (h * 1.25).sin()
            if i == K // 2:
                _fail_hung(inj, ERRNOS[kind])  # in the middle of the second forward
        second = h.sum()
    second.backward()
    assert torch.equal(y.grad, _reference(SMALL))
    with pytest.raises(ssdtrain.SpillIOError, match=f"touched {K} records") as excinfo:
        first.backward()
    assert excinfo.value.errno == ERRNOS[kind]
    del excinfo
    assert x.grad is None
    first = second = None
    _clean(off)
    assert off.stats().unneeded_failures == 0  # raised, not unneeded
    for _ in range(LATER_STEPS):
        assert torch.equal(_step(off, SMALL), _reference(SMALL))
