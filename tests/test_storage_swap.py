"""A saved tensor's storage resized or swapped after saving (bug 7).

Autograd's version counter sees in-place writes, not these: ``resize_`` of the
storage and ``t.data = other`` bump no version. ssdtrain holds its own alias of the
saved bytes (and, once written, a copy on disk), so after such a change it would
silently give back the bytes as they were at save time, or worse: a write still in
flight reads memory that ``resize_`` has freed, and a kept view rebuilt over a storage
resized to 0 bytes makes ``Tensor.set_`` grow it again, uninitialised.

What plain torch (no offloading) does, checked by ``test_plain_torch_reference``:

=================== ===================================================================
change after save   torch's backward
=================== ===================================================================
``resize_(0)``      reads the freed memory (the saved tensor's storage is 0 bytes: a
                    kernel reading it crashes or reads garbage): undefined behaviour
``resize_(larger)`` the bytes are copied to the new allocation: same values, same
                    gradients as without the change
``t.data = other``  uses the *new* values (autograd saves an input or a leaf as ``t`` itself)
``base.data = o``   the saved view keeps the old storage: same gradients as without it
=================== ===================================================================

So ssdtrain must raise a clear :class:`ssdtrain.SSDTrainError` (it cannot reproduce
undefined behaviour) for ``resize_(0)``, whatever the record's state: kept in memory, written to disk, with its write still in
flight, or a small tensor passed through in memory (``PassThrough``). For ``resize_(larger)``
and the base swap, gradients equal to torch's are right, and a clear error is
acceptable (conservative); anything else is silently wrong. After ``t.data = other``
on a saved leaf (``x`` here: a view of a tensor that needs no grad), torch's new
values are right (ssdtrain returns the live tensor, as autograd does: DeepSpeed
ZeRO-3 relies on it for parameters) and so is a clear error; the old values are not. A write in flight whose
source memory moved (``resize_`` to any size) read freed memory: that must raise.
And a write that fails, with ``EFAULT`` or any errno, must surface as an error.
"""

from __future__ import annotations

import errno
import threading
from concurrent.futures import Future

import pytest
import torch

import ssdtrain
from ssdtrain import testing
from ssdtrain.io.base import io_error

# 64 KiB of float32: below glibc's mmap threshold, so memory freed by resize_ stays
# mapped (a write in flight reading it reads stale bytes rather than faulting).
N = 1 << 14


class UseSaved(torch.autograd.Function):
    """``UseSaved.apply(w, x)`` is ``(w * x).sum()``, saving ``x`` itself (as ``mul``
    does); its backward refuses a saved tensor whose storage is too small to hold it
    (reading it would read freed or re-grown, uninitialised memory) with an
    AssertionError, so such a case fails the test instead of crashing it."""

    @staticmethod
    def forward(ctx, w, x):
        ctx.save_for_backward(x)
        return (w * x).sum()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        need = (x.storage_offset() + x.numel()) * x.element_size()
        have = x.untyped_storage().nbytes()
        assert have >= need, (f"backward got a saved tensor needing {need} bytes over a storage "
                              f"of {have}: it would read freed memory")
        return grad * x, None


def _tensors():
    """``(base, x, other)``: ``x`` is a view of ``base`` (no grad), ``other`` same shape."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(N + 16, generator=g)
    return base, base[16:], torch.randn(N + 16, generator=g)


def _modify(change, base, x, other):
    if change == "resize0":
        x.untyped_storage().resize_(0)
    elif change == "resize_larger":
        x.untyped_storage().resize_(8 * base.untyped_storage().nbytes())
    elif change == "data_swap":
        x.data = other[16:]
    elif change == "base_swap":
        base.data = other
    else:
        raise ValueError(change)


CHANGES = ["resize0", "resize_larger", "data_swap", "base_swap"]


# ---------------------------------------------------------------- plain torch

@pytest.mark.parametrize("change", CHANGES)
def test_plain_torch_reference(change):
    """What torch does without ssdtrain (the table in the module docstring)."""
    base, x, other = _tensors()
    old, new = x.clone(), other[16:].clone()
    w = torch.zeros(N, requires_grad=True)
    loss = UseSaved.apply(w, x)
    _modify(change, base, x, other)
    if change == "resize0":
        with pytest.raises(AssertionError, match="freed memory"):
            loss.backward()
        return
    loss.backward()
    if change == "data_swap":
        assert torch.equal(w.grad, new), "torch no longer uses the new values after .data ="
    else:
        assert torch.equal(w.grad, old)


# ---------------------------------------------------------------- under ssdtrain

class GatedWrites:
    """Wraps the offloader's engine (as ``ssdtrain.io.faulty.install`` does): each write
    is held back until :meth:`release`, then submitted to the real engine with the
    address the store gave, so the store sees it in flight meanwhile. ``fail`` makes
    each released write fail with that errno instead, as the device would."""

    def __init__(self, offloader, fail=None):
        self.fail = fail
        self.writes = 0
        self._gate = threading.Event()
        self._threads = []

        def wrap(engine):
            self.inner = engine
            return self
        offloader.wrap_engine(wrap)

    def __getattr__(self, name):  # name, device_memory, read, shutdown...
        return getattr(self.inner, name)

    def write(self, file, offset, address, nbytes, **kw):
        self.writes += 1
        outer = Future()
        outer.set_running_or_notify_cancel()

        def submit():
            self._gate.wait(60)
            if self.fail is not None:
                outer.set_exception(io_error("writing", file, offset, nbytes, self.fail,
                                             f"{errno.errorcode[self.fail]} (injected)"))
                return
            try:
                inner = self.inner.write(file, offset, address, nbytes, **kw)
            except BaseException as e:  # noqa: BLE001 - handed to the store, as engines do
                outer.set_exception(e)
                return
            inner.add_done_callback(lambda f: outer.set_exception(f.exception())
                                    if f.exception() is not None
                                    else outer.set_result(f.result()))

        t = threading.Thread(target=submit, name="test-gated-write", daemon=True)
        t.start()
        self._threads.append(t)
        return outer

    def release(self):
        """Let the held writes go ahead; returns once each has been submitted. Idempotent."""
        self._gate.set()
        for t in self._threads:
            t.join(60)


# How the saved tensor's record stands when the change is made.
RECORDS = {
    "kept": dict(keep_tail_bytes="1GiB"),           # in memory, never written
    "written": dict(keep_tail_bytes=0),             # written (wait() in forward), on disk
    "in_flight": dict(keep_tail_bytes=0),           # its write held back until after it
    "small": dict(min_tensor_bytes="1GiB"),         # below min_tensor_bytes: PassThrough, no record
}


def _expect(change, record):
    """``"raise"``: only a clear SSDTrainError is right. ``"same-or-raise"``: torch's
    gradients (unchanged by the change) or a clear error. ``"new-or-raise"``: torch's
    gradients from the new values, or a clear error."""
    if change == "resize0":
        return "raise"
    if change == "data_swap":
        return "new-or-raise"
    if change == "resize_larger" and record == "in_flight":
        return "raise"  # the write read the memory resize_ freed
    return "same-or-raise"


@pytest.mark.parametrize("engine", ["native", "posix"])
@pytest.mark.parametrize("record", list(RECORDS))
@pytest.mark.parametrize("change", CHANGES)
def test_storage_changed_after_save(make_offloader, request, change, record, engine):
    if record == "small" and engine == "posix":
        pytest.skip("a PassThrough tensor does no I/O: the engine does not matter")
    base, x, other = _tensors()
    old, new = x.clone(), other[16:].clone()
    w = torch.zeros(N, requires_grad=True)
    cfg = dict(min_tensor_bytes=4096, engine=engine)
    cfg.update(RECORDS[record])
    off = make_offloader(**cfg)
    gate = GatedWrites(off) if record == "in_flight" else None
    if gate is not None:
        request.addfinalizer(gate.release)  # before the offloader closes, if the test fails
    with off:
        loss = UseSaved.apply(w, x)
        if record == "written":
            off.wait()
    s = off.stats()
    if record == "small":
        assert s.unique_bytes == 0, "x was offloaded, not passed through as PassThrough"
    elif record == "kept":
        assert s.records_written == 0 and s.unique_bytes >= x.numel() * 4
    elif record == "written":
        assert s.records_written == 1
    else:
        assert gate.writes == 1 and s.records_written == 0, "the write was not held back"
    _modify(change, base, x, other)
    if gate is not None:
        gate.release()  # the write goes ahead after the change
        off.wait()
    expect = _expect(change, record)
    try:
        loss.backward()
    except ssdtrain.SSDTrainError:
        return  # a clear error: right in every case
    assert expect != "raise", (f"{change} after save ({record} record): backward returned "
                               f"gradients instead of raising an SSDTrainError")
    want = new if expect == "new-or-raise" else old
    assert torch.equal(w.grad, want), (f"{change} after save ({record} record): gradients "
                                       f"differ from torch's, silently")


@pytest.mark.parametrize("engine", ["native", "posix"])
@pytest.mark.parametrize("err", [errno.EFAULT, errno.EIO, errno.ENOSPC])
def test_failed_write_completing_after_forward_raises_at_backward(make_offloader, request,
                                                                  engine, err):
    """A write that fails after forward ended (nothing was packed after it to report it
    to) must still surface: backward raises, no gradient is computed."""
    base, x, other = _tensors()
    w = torch.zeros(N, requires_grad=True)
    off = make_offloader(min_tensor_bytes=4096, keep_tail_bytes=0, engine=engine)
    gate = GatedWrites(off, fail=err)
    request.addfinalizer(gate.release)
    with off:
        loss = UseSaved.apply(w, x)
    assert gate.writes == 1
    gate.release()
    off.wait()
    with pytest.raises(ssdtrain.SpillIOError) as excinfo:
        loss.backward()
    assert excinfo.value.errno == err
    assert w.grad is None
