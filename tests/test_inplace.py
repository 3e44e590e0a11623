"""INV-INPLACE (docs/ARCHITECTURE.md): in-place modification of a saved tensor is
still detected.

With saved-tensor hooks installed, autograd stops checking saved tensors'
version counters (``y = x*2; z = y.sin(); y.add_(1)`` then backward raises
without hooks and silently succeeds with them). ssdtrain checks instead and
raises :class:`ssdtrain.InplaceModificationError`, a ``RuntimeError`` carrying
autograd's own "modified by an inplace operation" message, whatever state the
record is in when the modification happens:

- kept in memory (the tail of forward, never written),
- written to the spill file (and its memory released),
- with the write still in flight (built on purpose: the engine's write is held
  on an event until the in-place op has run).

Legal in-place ops (on a fresh tensor, before anything saved it) must not
raise, and must give the same gradients as a run without ssdtrain.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import torch

import ssdtrain
from ssdtrain import testing

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
from models import inplace_views  # noqa: E402

AUTOGRAD_MESSAGE = "modified by an inplace operation"
N = 256  # (N, N) fp32 = 256 KiB, far above min_tensor_bytes below
MIN_TENSOR_BYTES = 4096


def _offloader(spill_dir, **overrides):
    cfg = dict(spill_dir=str(spill_dir), policy="static", min_tensor_bytes=MIN_TENSOR_BYTES,
               keep_tail_bytes=0, prefetch_bytes=0)
    cfg.update(overrides)
    return ssdtrain.Offloader(**cfg)


def _records(off):
    return testing.records(off)


def _states(off):
    return sorted(r.state.value for r in _records(off))


class _GatedWrites:
    """Holds every engine write until :meth:`open` (a race built on purpose).

    The posix engine looks ``_write_piece`` up on the instance at each request,
    so shadowing it there delays the pwrite itself, with the record in state
    WRITING and its bytes still in memory.
    """

    def __init__(self, off):
        engine = testing.engine(off)
        self._engine = getattr(engine, "inner", engine)  # under tests/late_io.py's wrapper
        self._orig = self._engine._write_piece
        self._gate = threading.Event()
        self.started = threading.Event()

        def gated(*args):
            self.started.set()
            if not self._gate.wait(timeout=60):
                raise OSError(110, "test gate never opened")
            return self._orig(*args)

        self._engine._write_piece = gated

    def open(self):
        self._gate.set()

    def restore(self):
        self._gate.set()
        self._engine.__dict__.pop("_write_piece", None)


# --------------------------------------------------------------------------- baseline


def test_autograd_raises_without_hooks():
    """The behaviour ssdtrain must reproduce."""
    x = torch.randn(N, N, requires_grad=True)
    y = x * 2
    z = y.sin()
    y.add_(1)
    with pytest.raises(RuntimeError, match=AUTOGRAD_MESSAGE):
        z.sum().backward()


def test_plain_hooks_do_not_check():
    """Why ssdtrain has to check: identity hooks silently lose autograd's check (torch 2.x)."""
    x = torch.randn(N, N, requires_grad=True)
    y = x * 2
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        z = y.sin()
    y.add_(1)
    z.sum().backward()  # no error: the check ssdtrain restores
    assert x.grad is not None


# ------------------------------------------------------------------- illegal in-place


def _assert_inplace_error(excinfo):
    err = excinfo.value
    assert isinstance(err, ssdtrain.InplaceModificationError)
    assert isinstance(err, ssdtrain.SSDTrainError)
    assert isinstance(err, RuntimeError)
    msg = str(err)
    assert AUTOGRAD_MESSAGE in msg
    assert msg.startswith("ssdtrain:")
    assert "version" in msg  # expected vs observed


def test_inplace_on_kept_record_raises(spill_dir):
    """The record is in the tail (never written) when forward ends: KEPT in memory."""
    off = _offloader(spill_dir, keep_tail_bytes="1GiB")
    try:
        x = torch.randn(N, N, requires_grad=True)
        with off:
            y = x * 2
            z = y.sin()
        off.wait()
        assert _states(off) == ["kept"]
        s = off.stats()
        assert s.unique_bytes == N * N * 4 and s.kept_bytes == N * N * 4
        assert s.records_written == 0
        y.add_(1)
        with pytest.raises(RuntimeError) as excinfo:
            z.sum().backward()
        _assert_inplace_error(excinfo)
    finally:
        off.close()


def test_inplace_on_kept_record_raises_after_tensor_dropped(spill_dir):
    """A kept record holds an alias sharing the version counter: the user's name can go."""
    off = _offloader(spill_dir, keep_tail_bytes="1GiB")
    try:
        x = torch.randn(N, N, requires_grad=True)
        with off:
            y = x * 2
            z = y.sin()
        alias = y.view(-1)
        del y
        alias.add_(1)
        assert _states(off) == ["kept"]
        with pytest.raises(RuntimeError) as excinfo:
            z.sum().backward()
        _assert_inplace_error(excinfo)
    finally:
        off.close()


@pytest.mark.parametrize("prefetch_bytes", [0, "64MiB"], ids=["miss", "prefetched"])
def test_inplace_on_written_record_raises(spill_dir, prefetch_bytes):
    """keep_tail_bytes=0: the record is on disk and its memory released before the in-place op."""
    off = _offloader(spill_dir, prefetch_bytes=prefetch_bytes)
    try:
        x = torch.randn(N, N, requires_grad=True)
        with off:
            y = x * 2
            z = y.sin()
        off.wait()
        s = off.stats()
        assert s.records_written == 1 and s.offloaded_bytes == N * N * 4
        y.add_(1)
        with pytest.raises(RuntimeError) as excinfo:
            z.sum().backward()
        _assert_inplace_error(excinfo)
    finally:
        off.close()


def test_inplace_on_saved_output_raises(spill_dir):
    """``exp`` saves its *result*: modifying the output in place is caught too."""
    off = _offloader(spill_dir)
    try:
        x = torch.randn(N, N, requires_grad=True)
        with off:
            z = (x * 2).exp()
            loss = z.sum()
        off.wait()
        assert off.stats().records_written == 1
        z.mul_(2)
        with pytest.raises(RuntimeError) as excinfo:
            loss.backward()
        _assert_inplace_error(excinfo)
    finally:
        off.close()


def test_inplace_through_other_view_raises(spill_dir):
    """Views share the version counter: ``y.view(-1)[:10].add_(1)`` modifies ``y``."""
    off = _offloader(spill_dir)
    try:
        x = torch.randn(N, N, requires_grad=True)
        with off:
            y = x * 2
            z = y.sin()
        off.wait()
        assert off.stats().records_written == 1
        y.view(-1)[:10].add_(1)
        with pytest.raises(RuntimeError) as excinfo:
            z.sum().backward()
        _assert_inplace_error(excinfo)
    finally:
        off.close()


@pytest.mark.parametrize("keep_tail_bytes", [0, "1GiB"], ids=["written", "kept"])
def test_inplace_on_saved_temporary_view_raises(spill_dir, keep_tail_bytes):
    """The saved tensor is a temporary view (``y[:128]``, as ``q.transpose(1, 2)`` in attention):
    autograd raises when its base is modified afterwards, so ssdtrain must too.

    Fails for the written record in the first core version (see the test report):
    the view object dies right after ``sin`` saved it, and once the write has
    completed the record keeps no alias of the version counter, so nothing is left
    to compare against.
    """
    x = torch.randn(N, N, requires_grad=True)
    y = x * 2
    z = y[: N // 2].sin()
    y.add_(1)
    with pytest.raises(RuntimeError, match=AUTOGRAD_MESSAGE):
        z.sum().backward()  # autograd's own behaviour, no hooks

    off = _offloader(spill_dir, keep_tail_bytes=keep_tail_bytes)
    try:
        x = torch.randn(N, N, requires_grad=True)
        with off:
            y = x * 2
            z = y[: N // 2].sin()
        off.wait()
        assert off.stats().unique_bytes > 0
        y.add_(1)
        with pytest.raises(RuntimeError) as excinfo:
            z.sum().backward()
        _assert_inplace_error(excinfo)
    finally:
        off.close()


def test_inplace_while_write_in_flight_raises(spill_dir):
    """The in-place op lands while the write is still running; caught when the write completes."""
    off = _offloader(spill_dir, engine="posix")  # the gate hooks the posix engine's writes
    gate = _GatedWrites(off)
    try:
        x = torch.randn(N, N, requires_grad=True)
        with off:
            y = x * 2
            z = y.sin()
        assert gate.started.wait(timeout=60)
        assert _states(off) == ["writing"]
        y.add_(1)  # the engine may be copying these very bytes
        gate.open()
        off.wait()
        with pytest.raises(RuntimeError) as excinfo:
            z.sum().backward()
        _assert_inplace_error(excinfo)
    finally:
        gate.restore()
        off.close()


def test_inplace_then_backward_during_write_raises(spill_dir):
    """Backward reaches the record while its write is still held: served from memory, and
    still caught."""
    off = _offloader(spill_dir, engine="posix")  # the gate hooks the posix engine's writes
    gate = _GatedWrites(off)
    try:
        x = torch.randn(N, N, requires_grad=True)
        with off:
            y = x * 2
            z = y.sin()
        assert gate.started.wait(timeout=60)
        y.add_(1)
        assert _states(off) == ["writing"]
        with pytest.raises(RuntimeError) as excinfo:
            z.sum().backward()
        _assert_inplace_error(excinfo)
    finally:
        gate.restore()
        off.close()


def test_inplace_error_frees_the_graph(spill_dir):
    """After the error, dropping the graph releases the record, memory and disk slot."""
    off = _offloader(spill_dir)
    try:
        x = torch.randn(N, N, requires_grad=True)
        with off:
            y = x * 2
            z = y.sin()
        off.wait()
        assert off.stats().records_written == 1
        y.add_(1)
        loss = z.sum()
        with pytest.raises(ssdtrain.InplaceModificationError):
            loss.backward()
        del loss, z
        off.wait()
        assert off.live_records() == 0
        assert off.resident_bytes() == 0
        assert off.spill_bytes_in_use() == 0
    finally:
        off.close()


# --------------------------------------------------------------------- legal in-place


def _legal_relu(x):
    h = x * 2          # MulBackward with a Python scalar saves nothing
    h.relu_()          # fresh tensor: nothing saved it yet; relu_ saves its result
    z = h.sin()        # saves h at the version relu_ left it
    w = torch.tanh(z)  # saves its result
    return (w * z).sum()


def _legal_buffer(x):
    h = torch.mm(x, x)  # saves x (a leaf: kept) for mm
    buf = torch.zeros_like(h)
    buf.add_(h)        # in-place into a fresh buffer before anyone saved it
    buf.mul_(0.5)
    s = buf.sigmoid()  # saves its result
    return (s * buf).sum()  # saves s and buf


def _legal_after_use(x):
    h = x * 3
    z = h.cos()       # saves h
    out = z.sum()
    g = torch.zeros(N, N)
    g.copy_(h.detach())  # a copy, not h itself
    g.add_(1)           # in-place on the copy: legal
    return out + (g * 0).sum()


@pytest.mark.parametrize("fn", [_legal_relu, _legal_buffer, _legal_after_use],
                         ids=["relu_", "buffer", "copy"])
@pytest.mark.parametrize("keep_tail_bytes", [0, "1GiB"], ids=["written", "kept"])
def test_legal_inplace_matches_no_offload(spill_dir, fn, keep_tail_bytes):
    base = torch.randn(N, N, generator=torch.Generator().manual_seed(0))

    x_ref = base.clone().requires_grad_()
    loss_ref = fn(x_ref)
    loss_ref.backward()

    off = _offloader(spill_dir, keep_tail_bytes=keep_tail_bytes)
    try:
        x = base.clone().requires_grad_()
        with off:
            loss = fn(x)
        off.wait()
        loss.backward()
        s = off.stats()
        assert torch.equal(loss, loss_ref)
        assert torch.equal(x.grad, x_ref.grad)
        assert s.unique_bytes >= N * N * 4
        if keep_tail_bytes == 0:
            assert s.records_written > 0 and s.offloaded_bytes > 0 and s.bytes_read > 0
        else:
            assert s.records_written == 0 and s.kept_bytes >= N * N * 4
        del loss
        off.wait()
        assert off.live_records() == 0
    finally:
        off.close()


def test_inplace_model_matches_no_offload(spill_dir):
    """``tests/models.py``'s ``inplace_views`` model (relu_, add_ into a fresh buffer) is legal."""
    model_ref, inputs = inplace_views(torch.float32)
    loss_ref = model_ref(*inputs)
    loss_ref.backward()

    model, inputs = inplace_views(torch.float32)
    off = _offloader(spill_dir)
    try:
        with off:
            loss = model(*inputs)
        loss.backward()
        off.wait()  # writes are counted when they complete
        assert torch.equal(loss, loss_ref)
        ref = dict(model_ref.named_parameters())
        for name, p in model.named_parameters():
            assert torch.equal(p.grad, ref[name].grad), name
        s = off.stats()
        assert s.records_written > 0 and s.offloaded_bytes > 0
    finally:
        off.close()
