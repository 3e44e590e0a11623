"""Lifetimes: of records, memory, disk slots, files, threads and offloaders.

Covers INV-RETAIN (``retain_graph=True``: a handle is unpacked twice), INV-RELEASE
(a graph dropped without backward frees everything; nothing grows step to step) and
INV-INNERMOST (nested hooks: the innermost wins), all in docs/ARCHITECTURE.md, and
the Offloader's own life: ``with`` exit, ``close()``, re-entry, garbage collection,
exceptions in forward.

Every test compares gradients bitwise with a run without ssdtrain and asserts
on the stats, so none of them would pass with offloading disabled.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch

import ssdtrain
from ssdtrain import testing

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
from helpers import assert_same, run_step  # noqa: E402
from helpers import assert_grads_equal as _assert_grads_equal  # noqa: E402
from helpers import grads as _grads, variant as _variant  # noqa: E402
from models import ALL_MODELS  # noqa: E402  (also puts examples/ on sys.path)
from gpt import GPT, GPTConfig, make_batch  # noqa: E402

MODELS = sorted(ALL_MODELS)
# Small enough that every model's activations qualify; zero tail so that they are written.
DISK = dict(policy="static", min_tensor_bytes=4096, keep_tail_bytes=0, prefetch_bytes=0)





def _assert_nothing_left(off):
    off.wait()
    assert off.live_records() == 0
    assert off.resident_bytes() == 0
    assert off.spill_bytes_in_use() == 0


def _open_fds():
    return len(os.listdir("/proc/self/fd"))


def _fd_target(fd):
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


# ----------------------------------------------------------------- retain_graph (inv. 4)

RETAIN_CONFIGS = {
    "disk": dict(DISK),
    "prefetch": dict(DISK, prefetch_bytes="64MiB"),
    "kept": dict(DISK, keep_tail_bytes="1GiB"),
}


@pytest.mark.parametrize("config", sorted(RETAIN_CONFIGS))
@pytest.mark.parametrize("name", MODELS)
def test_retain_graph_backward_twice(make_offloader, name, config):
    make = ALL_MODELS[name]
    model_ref, inputs = make(torch.float32)
    loss_ref = model_ref(*inputs)
    loss_ref.backward(retain_graph=True)
    first_ref = _grads(model_ref)
    loss_ref.backward()
    second_ref = _grads(model_ref)

    off = make_offloader(**RETAIN_CONFIGS[config])
    model, inputs = make(torch.float32)
    with off:
        loss = model(*inputs)
    off.wait()
    s0 = off.stats()
    assert s0.unique_bytes > 0
    loss.backward(retain_graph=True)
    off.wait()
    s1 = off.stats()
    _assert_grads_equal(first_ref, _grads(model))
    loss.backward()
    off.wait()
    s2 = off.stats()
    assert torch.equal(loss, loss_ref)
    _assert_grads_equal(second_ref, _grads(model))

    if config == "kept":
        assert s0.records_written == 0 and s0.kept_bytes >= s0.unique_bytes
        assert s2.bytes_read == 0 and s2.forwarded > 0
    else:
        # Every record was written; the first backward read each at most once (prefetch
        # may have kept a record whose write was still in flight when forward ended),
        # then dropped it from memory, so the second backward reads every one of them.
        assert s0.records_written > 0 and s0.offloaded_bytes == s0.unique_bytes
        assert s1.bytes_read <= s0.offloaded_bytes
        assert s2.bytes_read - s1.bytes_read == s0.offloaded_bytes, \
            "the second backward must read every record from disk again"
        if config == "disk":
            assert s1.bytes_read == s0.offloaded_bytes
            assert s2.prefetch_misses > s1.prefetch_misses > 0
    del loss
    _assert_nothing_left(off)


# ------------------------------------------------------------- dropped graph (inv. 5)


@pytest.mark.parametrize("prefetch_bytes", [0, "64MiB"], ids=["no_prefetch", "prefetch"])
@pytest.mark.parametrize("keep_tail_bytes", [0, "1GiB"], ids=["written", "kept"])
@pytest.mark.parametrize("settle", [True, False], ids=["settled", "in_flight"])
def test_graph_dropped_without_backward(make_offloader, keep_tail_bytes, prefetch_bytes, settle):
    off = make_offloader(**dict(DISK, keep_tail_bytes=keep_tail_bytes,
                                prefetch_bytes=prefetch_bytes))
    model, inputs = ALL_MODELS["gpt"](torch.float32)
    with off:
        loss = model(*inputs)
    if settle:
        off.wait()
    assert off.live_records() > 0
    del loss  # eval-style: the graph goes without backward
    _assert_nothing_left(off)
    s = off.stats()
    assert s.unique_bytes > 0
    if keep_tail_bytes == 0:
        assert s.records_written > 0 and s.offloaded_bytes > 0
    else:
        assert s.records_written == 0 and s.kept_bytes >= s.unique_bytes

    # The offloader is still good for a real step.
    ref = run_step(*ALL_MODELS["gpt"](torch.float32))
    assert_same(ref, run_step(model, inputs, off))
    _assert_nothing_left(off)


def test_no_grad_forward_packs_nothing(make_offloader):
    off = make_offloader(**DISK)
    model, inputs = ALL_MODELS["gpt"](torch.float32)
    with off, torch.no_grad():
        model(*inputs)
    assert off.stats().packed_bytes == 0
    _assert_nothing_left(off)
    with off:  # the same forward with grad enabled does offload
        loss = model(*inputs)
    off.wait()
    assert off.stats().records_written > 0
    del loss
    _assert_nothing_left(off)


# -------------------------------------------------------------- gradient accumulation


@pytest.mark.parametrize("name", MODELS)
def test_gradient_accumulation(make_offloader, name):
    make = ALL_MODELS[name]
    model_ref, inputs = make(torch.float32)
    losses_ref = []
    for i in range(4):
        loss = model_ref(*_variant(inputs, i)) / 4
        loss.backward()
        losses_ref.append(loss.detach())

    off = make_offloader(**dict(DISK, prefetch_bytes="1MiB"))
    model, inputs = make(torch.float32)
    written = []
    for i in range(4):
        with off:
            loss = model(*_variant(inputs, i)) / 4
            if i % 2:
                off.wait()  # every other step is read back from disk, not forwarded
        loss.backward()
        assert torch.equal(loss.detach(), losses_ref[i])
        off.wait()
        written.append(off.stats().records_written)
        assert off.live_records() == 0
    _assert_grads_equal(_grads(model_ref), _grads(model))
    assert written[0] > 0 and all(b > a for a, b in zip(written, written[1:])), written
    assert off.stats().bytes_read > 0
    _assert_nothing_left(off)


# ------------------------------------------------------------- two offloaders (inv. 6)


def test_nested_offloaders_innermost_wins(make_offloader):
    a = make_offloader(**DISK)
    b = make_offloader(**DISK)
    ref = run_step(*ALL_MODELS["gpt"](torch.float32))
    model, inputs = ALL_MODELS["gpt"](torch.float32)
    model.zero_grad(set_to_none=True)
    with a:
        with b:
            loss = model(*inputs)
            b.wait()  # written before backward, so backward reads them back
    loss.backward()
    got = loss.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters()}
    assert_same(ref, got)
    a.wait(), b.wait()  # writes are counted when they complete
    sa, sb = a.stats(), b.stats()
    assert sb.packed_bytes > 0 and sb.records_written > 0 and sb.bytes_read > 0
    assert sa.packed_bytes == 0 and sa.unique_bytes == 0 and sa.records_written == 0
    del loss
    _assert_nothing_left(a)
    _assert_nothing_left(b)


def test_nested_offloaders_split_forward(make_offloader):
    """Inside ``with a:``, a ``with b:`` block takes the packs; after it, ``a`` takes them again."""
    a = make_offloader(**DISK)
    b = make_offloader(**DISK)
    n = 1 << 16  # 256 KiB fp32 tensors
    x_ref = torch.randn(n, generator=torch.Generator().manual_seed(0)).requires_grad_()
    x = x_ref.detach().clone().requires_grad_()

    def forward(x, inner):
        h1 = (x * 2).sin()              # sin saves x * 2: outer
        with inner:
            h2 = (h1 * 3).cos()         # cos saves h1 * 3: inner
        return (h2 * 4).tanh().sum()    # tanh saves its result: outer again

    loss_ref = forward(x_ref, contextlib.nullcontext())
    loss_ref.backward()
    with a:
        loss = forward(x, b)
    loss.backward()
    assert torch.equal(loss, loss_ref) and torch.equal(x.grad, x_ref.grad)
    a.wait(), b.wait()  # writes are counted when they complete
    sa, sb = a.stats(), b.stats()
    assert sb.unique_bytes == n * 4 and sb.records_written == 1
    assert sa.unique_bytes == 2 * n * 4 and sa.records_written == 2
    del loss
    _assert_nothing_left(a)
    _assert_nothing_left(b)


def test_two_offloaders_alternating(make_offloader):
    offs = [make_offloader(**DISK), make_offloader(**dict(DISK, prefetch_bytes="1MiB"))]
    model_ref, inputs = ALL_MODELS["gpt"](torch.float32)
    model, _ = ALL_MODELS["gpt"](torch.float32)
    for step in range(4):
        batch = _variant(inputs, step)
        off = offs[step % 2]
        before = [o.stats().records_written for o in offs]
        ref = run_step(model_ref, batch)
        assert_same(ref, run_step(model, batch, off, settle=step >= 2))
        off.wait()
        after = [o.stats().records_written for o in offs]
        assert after[step % 2] > before[step % 2]
        assert after[1 - step % 2] == before[1 - step % 2]
    for o in offs:
        assert o.stats().bytes_read > 0
        _assert_nothing_left(o)


# ---------------------------------------------------------- micro-batches in flight


@pytest.mark.parametrize("prefetch_bytes", [0, "256KiB", "64MiB"])
def test_two_microbatches_in_flight(make_offloader, prefetch_bytes):
    """Forward mb1, forward mb2, backward mb2, backward mb1 (pipeline-parallel order)."""
    model_ref, inputs = ALL_MODELS["gpt"](torch.float32)
    mb1, mb2 = _variant(inputs, 1), _variant(inputs, 2)
    l1_ref = model_ref(*mb1)
    l2_ref = model_ref(*mb2)
    l2_ref.backward()
    l1_ref.backward()

    off = make_offloader(**dict(DISK, prefetch_bytes=prefetch_bytes))
    model, _ = ALL_MODELS["gpt"](torch.float32)
    with off:
        l1 = model(*mb1)
        off.wait()  # written before any backward: both backwards read from disk
    with off:
        l2 = model(*mb2)
        off.wait()
    live_both = off.live_records()
    l2.backward()
    del l2
    off.wait()
    live_one = off.live_records()
    assert 0 < live_one < live_both
    l1.backward()
    assert torch.equal(l1, l1_ref)
    _assert_grads_equal(_grads(model_ref), _grads(model))
    s = off.stats()
    assert s.records_written > 0 and s.bytes_read > 0
    del l1
    _assert_nothing_left(off)


# ----------------------------------------------------------- the Offloader's own life


def test_exit_ends_interception_only(make_offloader):
    off = make_offloader(**DISK)
    ref = run_step(*ALL_MODELS["gpt"](torch.float32))
    model, inputs = ALL_MODELS["gpt"](torch.float32)
    with off:
        loss = model(*inputs)
    packed = off.stats().packed_bytes
    assert packed > 0
    # Outside the block nothing is intercepted any more.
    x = torch.randn(1 << 16, requires_grad=True)
    (x * 2).sin().sum().backward()
    assert off.stats().packed_bytes == packed
    # ... but the graph built inside still comes back (from disk: writes done first).
    off.wait()
    loss.backward()
    assert_same(ref, (loss.detach(), _grads(model)))
    assert off.stats().bytes_read > 0
    del loss
    _assert_nothing_left(off)


@pytest.mark.parametrize("keep_tail_bytes", [0, "1GiB"], ids=["written", "kept"])
def test_unpack_after_close_raises(spill_dir, keep_tail_bytes):
    off = ssdtrain.Offloader(spill_dir=str(spill_dir),
                             **dict(DISK, keep_tail_bytes=keep_tail_bytes))
    model, inputs = ALL_MODELS["gpt"](torch.float32)
    with off:
        loss = model(*inputs)
    assert off.stats().unique_bytes > 0
    off.close()
    assert off.closed
    with pytest.raises(ssdtrain.OffloaderClosedError) as excinfo:
        loss.backward()
    err = excinfo.value
    assert isinstance(err, ssdtrain.SSDTrainError) and isinstance(err, RuntimeError)
    msg = str(err)
    assert msg.startswith("ssdtrain:")
    assert "close" in msg  # says what happened and what to do
    del loss, excinfo, err
    off.close()  # idempotent
    off.close()
    assert off.closed


def test_close_returns_the_slots_of_records_graphs_still_hold(spill_dir):
    """close() with a graph alive: its written records' slots go back at once, and stay
    back when the graph dies (a released handle reaches no record after close()). The
    store's invariant check holds on the closed store (its allocator agrees with the
    records left: none). Before, close() dropped each record's slot without returning it
    to the allocator, so spill_bytes_in_use() kept those bytes for good."""
    off = ssdtrain.Offloader(spill_dir=str(spill_dir), **DISK)
    model, inputs = ALL_MODELS["mlp"](torch.float32)
    with off:
        loss = model(*inputs)
    off.wait()
    assert off.stats().records_written > 0 and off.spill_bytes_in_use() > 0
    assert off.live_records() > 0
    off.close()
    assert off.spill_bytes_in_use() == 0
    assert off.live_records() == 0 and off.resident_bytes() == 0
    testing.check_invariants(off)
    del loss
    gc.collect()
    assert off.spill_bytes_in_use() == 0
    testing.check_invariants(off)


def test_a_freed_graph_has_no_live_records_while_its_writes_are_in_flight(spill_dir):
    """live_records() counts the records a graph still references (its docstring), so it
    is 0 as soon as backward has freed the graph, even when every write of the step is
    still in flight (a busy disk, a lagging I/O thread): those records keep their
    memory and slots (resident_bytes, spill_bytes_in_use) until their writes land, and
    then nothing is left. Before, they counted as live until the writes completed, and
    a leak check right after a step failed on a loaded machine (Lightning's test in CI:
    16 live records)."""
    import test_fork  # noqa: F401 - GatedEngine: holds every request until released
    ref = run_step(*ALL_MODELS["mlp"](torch.float32))
    off = ssdtrain.Offloader(spill_dir=str(spill_dir), **DISK)
    gate = test_fork.install_gate(off)
    model, inputs = ALL_MODELS["mlp"](torch.float32)
    try:
        with off:
            loss = model(*inputs)
        assert gate.held and off.live_records() > 0
        loss.backward()  # served from memory: the writes are held
        assert_same(ref, (loss.detach().clone(), {n: p.grad.clone() for n, p in
                                                   model.named_parameters()}))
        del loss
        assert off.live_records() == 0
        assert off.resident_bytes() > 0 and off.spill_bytes_in_use() > 0  # still writing
        testing.check_invariants(off)
    finally:
        gate.release()
    _assert_nothing_left(off)
    testing.check_invariants(off)
    off.close()


def _one_offloaded_step(off):
    ref = run_step(*ALL_MODELS["mlp"](torch.float32))
    model, inputs = ALL_MODELS["mlp"](torch.float32)
    assert_same(ref, run_step(model, inputs, off, settle=True))  # every record read back
    off.wait()
    s = off.stats()
    assert s.records_written > 0 and s.bytes_read > 0


def test_close_is_idempotent_and_reported(spill_dir):
    off = ssdtrain.Offloader(spill_dir=str(spill_dir), **DISK)
    assert not off.closed
    assert "open" in repr(off)
    _one_offloaded_step(off)
    off.close()
    off.close()
    assert off.closed
    assert "closed" in repr(off)


def test_enter_closed_offloader_raises(spill_dir):
    off = ssdtrain.Offloader(spill_dir=str(spill_dir), **DISK)
    _one_offloaded_step(off)
    packed = off.stats().packed_bytes
    off.close()
    with pytest.raises(ssdtrain.SSDTrainError, match="closed"):
        with off:
            pass
    # The failed entry left no hooks behind.
    x = torch.randn(1 << 16, requires_grad=True)
    (x * 2).sin().sum().backward()
    assert off.stats().packed_bytes == packed


def test_enter_twice_raises(make_offloader):
    off = make_offloader(**DISK)
    x = torch.randn(1 << 16, requires_grad=True)
    with off:
        with pytest.raises(ssdtrain.SSDTrainError, match="entered"):
            with off:
                pass
        # The outer block still intercepts.
        y = (x * 2).sin().sum()
    assert off.stats().packed_bytes == (1 << 16) * 4
    y.backward()
    assert torch.equal(x.grad, 2 * (x.detach() * 2).cos())
    off.wait()
    assert off.stats().records_written == 1


def test_close_inside_with_raises(make_offloader):
    off = make_offloader(**DISK)
    x = torch.randn(1 << 16, requires_grad=True)
    with off:
        with pytest.raises(ssdtrain.SSDTrainError, match="exit"):
            off.close()
        y = (x * 2).sin().sum()  # still intercepting
    assert not off.closed
    y.backward()
    off.wait()
    assert off.stats().records_written == 1
    assert torch.equal(x.grad, 2 * (x.detach() * 2).cos())


def test_reenter_after_exit(make_offloader):
    """Entering again for the next step works and reuses the file."""
    off = make_offloader(**DISK)
    model_ref, inputs = ALL_MODELS["mlp"](torch.float32)
    model, _ = ALL_MODELS["mlp"](torch.float32)
    for step in range(3):
        batch = _variant(inputs, step)
        assert_same(run_step(model_ref, batch), run_step(model, batch, off))
    off.wait()  # writes are counted when they complete
    assert off.stats().records_written > 0
    _assert_nothing_left(off)


def test_offload_one_shot(spill_dir):
    ref = run_step(*ALL_MODELS["gpt"](torch.float32))
    model, inputs = ALL_MODELS["gpt"](torch.float32)
    with ssdtrain.offload(spill_dir=str(spill_dir), **DISK) as off:
        assert isinstance(off, ssdtrain.Offloader)
        loss = model(*inputs)
    off.wait()  # written before backward, so backward reads them back
    loss.backward()
    assert_same(ref, (loss.detach(), _grads(model)))
    s = off.stats()
    assert s.records_written > 0 and s.bytes_read > 0
    del loss
    _assert_nothing_left(off)
    off.close()
    assert off.closed


# ------------------------------------------------------------- no growth (inv. 5)


def test_no_growth_over_50_steps(spill_dir):
    cfg = GPTConfig(vocab_size=256, seq_len=32, d_model=64, n_heads=4, n_layers=2)

    def build():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return GPT(cfg).train()

    model_ref, model = build(), build()
    opt_ref = torch.optim.SGD(model_ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)
    off = ssdtrain.Offloader(spill_dir=str(spill_dir), **dict(DISK, prefetch_bytes="1MiB"))
    spill_file = testing.spill(off).files[0]
    spill_fd = spill_file.fd
    spill_target = _fd_target(spill_fd)
    assert spill_target is not None

    threads_before = {t.ident for t in threading.enumerate()}
    sizes, written = [], [0]
    baseline = None
    for step in range(50):
        batch = make_batch(cfg, 2, gen)
        ref = run_step(model_ref, batch)
        model.zero_grad(set_to_none=True)
        with off:
            loss = model(*batch)
            assert os.listdir(spill_dir) == []  # anonymous spill file: nothing visible
        loss.backward()
        got = loss.detach().clone(), _grads(model)
        del loss
        assert_same(ref, got)  # parameters stay identical, so every step is comparable
        opt_ref.step()
        opt.step()

        # A record whose handles died while its write was in flight goes when the
        # write completes: settle before counting.
        off.wait()
        assert off.live_records() == 0, f"step {step}"
        assert off.spill_bytes_in_use() == 0, f"step {step}"
        assert off.resident_bytes() == 0, f"step {step}"
        s = off.stats()
        assert s.records_written > written[-1], f"step {step} wrote nothing"
        written.append(s.records_written)
        sizes.append(os.fstat(spill_fd).st_size)
        # The I/O pool starts its threads lazily, up to io_threads: bounded, not constant.
        if baseline is None:
            baseline = _open_fds()
        assert _open_fds() == baseline, f"step {step}: file descriptors grow"
        extra = [t.name for t in threading.enumerate() if t.ident not in threads_before]
        assert len(extra) <= off.config.io_threads, f"step {step}: threads grow: {extra}"
        assert all(name.startswith("ssdtrain-io") for name in extra), extra
        assert os.listdir(spill_dir) == []

    assert sizes[0] > 0
    # The free list can fragment by a block or two depending on the order writes
    # complete (threads), so the size is not constant; a leak would add a whole
    # step's records (~sizes[0]) every step.
    assert max(sizes) <= sizes[0] + sizes[0] // 4, f"spill file keeps growing: {sizes}"
    assert max(sizes[25:]) <= max(sizes[:25]) + 2 * 4096, f"spill file keeps growing: {sizes}"
    s = off.stats()
    assert s.bytes_read > 0 and s.offloaded_bytes > 0
    off.close()
    assert os.listdir(spill_dir) == []
    assert spill_file.fd == -1
    assert _fd_target(spill_fd) != spill_target, "spill file descriptor still open after close()"


# -------------------------------------------------------- exception inside the block


class _Boom(Exception):
    pass


def test_exception_in_forward_leaves_nothing(make_offloader):
    off = make_offloader(**dict(DISK, prefetch_bytes="1MiB"))
    model, inputs = ALL_MODELS["mlp"](torch.float32)
    fail_at = model.net[6]  # the third Linear: forward has saved several activations by then

    def boom(module, args, output):
        raise _Boom("forward fails midway")

    handle = fail_at.register_forward_hook(boom)

    def failing_step():
        with off:
            model(*inputs)

    try:
        failing_step()
    except _Boom:
        pass
    else:
        pytest.fail("the forward hook did not raise")
    handle.remove()
    off.wait()
    s = off.stats()
    assert s.unique_bytes > 0 and s.records_written > 0  # it did offload before failing
    _assert_nothing_left(off)

    # The offloader is usable for the next step, and the failed one left no trace.
    ref = run_step(*ALL_MODELS["mlp"](torch.float32))
    written = s.records_written
    assert_same(ref, run_step(model, inputs, off))
    assert off.stats().records_written > written
    _assert_nothing_left(off)
    x = torch.randn(1 << 16, requires_grad=True)
    packed = off.stats().packed_bytes
    (x * 2).sin().sum().backward()
    assert off.stats().packed_bytes == packed  # the failed block's hooks were removed


# --------------------------------------------------------------- garbage collection


class _Unraisable:
    """Collects exceptions raised where nobody can catch them (finalizers, __del__)."""

    def __enter__(self):
        self.seen = []
        self._hook, sys.unraisablehook = sys.unraisablehook, self._record
        return self

    def _record(self, unraisable):
        self.seen.append(f"{unraisable.exc_type.__name__}: {unraisable.exc_value} "
                         f"({unraisable.err_msg}: {unraisable.object!r})")

    def __exit__(self, *exc):
        sys.unraisablehook = self._hook
        return False


def _resources():
    gc.collect()
    return _open_fds(), threading.active_count()


def _settled_resources(before, timeout=30.0):
    """Resources once the store's release (on a helper thread: a finalizer must not block
    the thread that dropped the last reference) has finished, or after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        now = _resources()
        if now == before or time.monotonic() > deadline:
            return now
        threading.Event().wait(0.05)


def test_offloader_released_when_collected(spill_dir):
    before = _resources()
    off = ssdtrain.Offloader(spill_dir=str(spill_dir), engine="posix", **DISK)
    spill_fd = testing.spill(off).files[0].fd
    spill_target = _fd_target(spill_fd)
    assert spill_target is not None
    ref = run_step(*ALL_MODELS["mlp"](torch.float32))
    model, inputs = ALL_MODELS["mlp"](torch.float32)
    assert_same(ref, run_step(model, inputs, off))
    off.wait()
    assert off.stats().records_written > 0
    assert _open_fds() > before[0] and threading.active_count() > before[1]
    offloader_alive, store_alive = weakref.ref(off), testing.store_alive(off)

    with _Unraisable() as unraisable:
        del off
        # Release runs on a helper thread (a finalizer must not block the thread that
        # dropped the last reference), so give it a moment.
        after = _settled_resources(before)
    assert offloader_alive() is None and not store_alive()
    assert after == before, "(open fds, threads) not back to where they were"
    assert _fd_target(spill_fd) != spill_target
    assert os.listdir(spill_dir) == []
    assert unraisable.seen == []


def test_a_dropped_store_takes_its_paths_without_the_collector(spill_dir):
    """A store nobody references goes at once, by reference counting, and its parts
    with it: the write path, the host tier and the read path hold the record table
    (the records, and the memory of the tensors they hold), so no cycle among them may
    wait for the garbage collector (NOTE [ The store's paths ] in ssdtrain/_store/store.py).
    A strong ``WritePath.tier`` (the tier holds the write path) kept both alive."""
    off = ssdtrain.Offloader(spill_dir=str(spill_dir), engine="posix", **DISK)
    model, inputs = ALL_MODELS["mlp"](torch.float32)
    run_step(model, inputs, off)
    store = off._store  # the store's own parts are what this test watches go
    alive = [weakref.ref(x) for x in (store, store._writes, store._tier, store._reads,
                                      store._slot, store._repair)]
    del store
    gc.disable()
    try:
        del off
        assert [r() is None for r in alive] == [True] * 6
    finally:
        gc.enable()


def test_graph_outlives_its_offloader(spill_dir):
    """Dropping the Offloader object (not closing it) leaves graphs built under it usable;
    threads and files go when the last such graph goes."""
    before = _resources()
    ref = run_step(*ALL_MODELS["mlp"](torch.float32))
    model, inputs = ALL_MODELS["mlp"](torch.float32)
    off = ssdtrain.Offloader(spill_dir=str(spill_dir), engine="posix", **DISK)
    with off:
        loss = model(*inputs)
    off.wait()
    assert off.stats().records_written > 0
    store_alive = testing.store_alive(off)
    with _Unraisable() as unraisable:
        del off
        gc.collect()
        assert store_alive(), "the graph's handles must keep the store alive"
        loss.backward()
        assert_same(ref, (loss.detach().clone(), {n: p.grad.clone() for n, p in
                                                   model.named_parameters()}))
        del loss
        after = _settled_resources(before)
    assert not store_alive()
    assert after == before
    assert unraisable.seen == []


def test_collected_with_writes_in_flight(spill_dir):
    """The offloader and its graph are dropped while writes are still running (built on
    purpose: the engine's writes wait on an event). Everything must still be released,
    and no error may be raised on an I/O thread."""
    before = _resources()
    off = ssdtrain.Offloader(spill_dir=str(spill_dir), engine="posix", **DISK)
    engine = testing.engine(off)
    engine = getattr(engine, "inner", engine)  # the posix engine under tests/late_io.py's
    write_piece = engine._write_piece
    gate = threading.Event()
    started = threading.Event()

    def gated(*args):
        started.set()
        if not gate.wait(timeout=60):
            raise OSError(110, "test gate never opened")
        return write_piece(*args)

    engine._write_piece = gated
    store_alive = testing.store_alive(off)
    with _Unraisable() as unraisable:
        model, inputs = ALL_MODELS["mlp"](torch.float32)
        with off:
            loss = model(*inputs)
        assert started.wait(timeout=60)
        del off, loss
        gc.collect()
        gate.set()
        for _ in range(600):  # the writes finish on the I/O threads; nothing to wait() on
            if not store_alive():
                break
            threading.Event().wait(0.05)
        assert not store_alive(), "the store outlives its last write"
        for _ in range(600):
            if _resources() == before:
                break
            threading.Event().wait(0.05)
    assert unraisable.seen == [], "\n".join(unraisable.seen)
    assert _resources() == before
    assert os.listdir(spill_dir) == []


# ------------------------------------------------- a write that ends during unpack


def test_write_ending_during_unpack_keeps_the_data(spill_dir, monkeypatch):
    """Backward unpacks a record whose write is still in flight (its bytes are still in
    memory) and the write completes at that very moment: unpack must use the bytes it
    found, not look again after the write dropped them (a race seen once in CI as
    "has no data after its read"). Writes are held here and completed exactly between
    unpack's two locked sections."""
    from concurrent.futures import Future

    from ssdtrain._store.store import Store

    off = ssdtrain.Offloader(policy="static", spill_dir=str(spill_dir), min_tensor_bytes=4096,
                             keep_tail_bytes=0, prefetch_bytes=0)
    engine = testing.engine(off)
    real_write, held, in_backward = engine.write, [], [False]

    def write(*args, **kwargs):
        fut = Future()
        held.append((fut, args, kwargs))
        return fut

    def finish():
        while held:
            fut, args, kwargs = held.pop(0)
            exc = real_write(*args, **kwargs).exception()
            fut.set_exception(exc) if exc is not None else fut.set_result(args[-1])

    settle = Store._settle  # runs right after each locked section of unpack

    def settle_then_finish(self):
        settle(self)
        if in_backward[0]:
            finish()

    monkeypatch.setattr(engine, "write", write)
    monkeypatch.setattr(Store, "_settle", settle_then_finish)
    x = torch.randn(256, 256, requires_grad=True)
    (x * 2).sin().sum().backward()
    ref = x.grad.clone()
    x.grad = None
    with off:
        loss = (x * 2).sin().sum()
    assert held, "the write should still be in flight when backward starts"
    in_backward[0] = True
    loss.backward()
    assert torch.equal(x.grad, ref)
    off.wait()
    assert off.stats().offloaded_bytes > 0
    off.close()


# ------------------------------------------------------------------ interpreter exit

_EXIT_SCRIPT = r"""
import sys, torch, ssdtrain
from gpt import GPT, GPTConfig, make_batch
spill, mode = sys.argv[1], sys.argv[2]
cfg = GPTConfig(vocab_size=256, seq_len=32, d_model=64, n_heads=4, n_layers=2)
model = GPT(cfg).train()
gen = torch.Generator().manual_seed(0)
off = ssdtrain.Offloader(policy="static", spill_dir=spill, min_tensor_bytes=4096, keep_tail_bytes=0)
keep = []
for step in range(3):
    with off:
        loss = model(*make_batch(cfg, 2, gen))
    if mode == "graph-alive" and step == 2:
        keep.append(loss)  # a graph (and so the store) still alive at exit, writes in flight
    else:
        loss.backward()
if mode == "dropped":
    del off  # the store goes with the last graph: released by the collector
print("ok", flush=True)
"""


@pytest.mark.parametrize("mode", ["open", "graph-alive", "dropped"])
def test_interpreter_exit_without_close(spill_dir, mode):
    """A script that never calls close() exits cleanly (exit code 0): resources are
    released at exit in the exiting thread. A release thread started at that point
    was ended by finalization inside the native engine's join (std::terminate)."""
    import subprocess
    examples = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([examples, *sys.path]))
    r = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, str(spill_dir), mode],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stdout, r.stderr)
    assert "terminate" not in r.stderr, r.stderr
    assert os.listdir(spill_dir) == []
