"""Concurrency (INV-THREADS, docs/ARCHITECTURE.md): several micro-batches in flight in
1F1B order, gradient accumulation over them, backward on another thread, and two
offloaders used by two threads at once. Gradients must equal those of the same schedule
without offloading.
"""

from __future__ import annotations

import threading

import pytest
import torch

from helpers import assert_grads_equal as _assert_grads_equal, grads as _grads
from helpers import variant as _variant
from models import ALL_MODELS

DISK = dict(policy="static", min_tensor_bytes=4096, keep_tail_bytes=0)





def one_f_one_b(n_micro, warmup):
    """The 1F1B order of one pipeline stage: ``warmup`` forwards, then one forward and one
    backward alternately, then the remaining backwards. E.g. 4, 2 gives
    F0 F1 B0 F2 B1 F3 B2 B3."""
    order, f, b = [], 0, 0
    while f < min(warmup, n_micro):
        order.append(("F", f))
        f += 1
    while f < n_micro:
        order += [("B", b), ("F", f)]
        b += 1
        f += 1
    order += [("B", i) for i in range(b, n_micro)]
    return order


def test_one_f_one_b_order():
    assert one_f_one_b(4, 2) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3),
                                 ("B", 2), ("B", 3)]
    assert one_f_one_b(2, 4) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]


def _run_schedule(model, inputs, order, off=None, n_micro=4):
    """Runs ``order`` accumulating gradients (each loss / n_micro); returns the losses.
    With ``off``, also checks that micro-batches really were in flight together."""
    model.zero_grad(set_to_none=True)
    losses, out, most_live = {}, {}, 0
    for what, i in order:
        if what == "F":
            if off is None:
                out[i] = model(*_variant(inputs, i)) / n_micro
            else:
                with off:
                    out[i] = model(*_variant(inputs, i)) / n_micro
                    if i == 0:
                        off.wait()  # micro-batch 0 is read back from disk, not forwarded
                most_live = max(most_live, off.live_records())
        else:
            loss = out.pop(i)
            loss.backward()
            losses[i] = loss.detach()
    return losses, most_live


@pytest.mark.parametrize("name,prefetch_bytes,warmup", [
    ("gpt", 0, 2), ("gpt", "128KiB", 2), ("gpt", "64MiB", 2), ("mlp", "128KiB", 3)])
def test_one_f_one_b_with_accumulation(make_offloader, name, prefetch_bytes, warmup):
    """F0 F1 B0 F2 B1 F3 B2 B3 (warmup 2), one offloader for every micro-batch."""
    order = one_f_one_b(4, warmup)
    model_ref, inputs = ALL_MODELS[name](torch.float32)
    ref_losses, _ = _run_schedule(model_ref, inputs, order)
    model, _ = ALL_MODELS[name](torch.float32)
    off = make_offloader(prefetch_bytes=prefetch_bytes, **DISK)
    # Forward of one micro-batch alone, to compare with the 1F1B peak of live records.
    with off:
        single = model(*_variant(inputs, 0))
    alone = off.live_records()
    single.backward()
    del single
    losses, most_live = _run_schedule(model, inputs, order, off)
    for i in range(4):
        assert torch.equal(losses[i], ref_losses[i]), i
    _assert_grads_equal(_grads(model_ref), _grads(model))
    assert most_live >= warmup * alone, "micro-batches were not in flight together"
    off.wait()
    s = off.stats()
    assert s.records_written > 0 and s.bytes_read > 0
    assert off.live_records() == 0 and off.spill_bytes_in_use() == 0


def test_backward_on_another_thread(make_offloader):
    """Unpack runs on whatever thread runs backward (autograd's device threads on CUDA)."""
    model_ref, inputs = ALL_MODELS["gpt"](torch.float32)
    model_ref(*inputs).backward()
    model, _ = ALL_MODELS["gpt"](torch.float32)
    off = make_offloader(prefetch_bytes="256KiB", **DISK)
    with off:
        loss = model(*inputs)
        off.wait()  # every write done: backward (on the other thread) reads from disk
    errors = []

    def backward():
        try:
            loss.backward()
        except BaseException as e:  # reported by the main thread
            errors.append(e)
    t = threading.Thread(target=backward)
    t.start()
    t.join(timeout=120)
    assert not t.is_alive() and not errors, errors
    _assert_grads_equal(_grads(model_ref), _grads(model))
    assert off.stats().bytes_read > 0


@pytest.fixture
def one_intra_op_thread():
    """Matmul results may depend on how many threads split them; two training threads
    plus the reference must split alike for a bitwise comparison."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("names", [("gpt", "gpt"), ("gpt", "mlp")])
def test_two_offloaders_in_two_threads(make_offloader, one_intra_op_thread, names):
    steps = 3
    refs = []
    for k, name in enumerate(names):
        model, inputs = ALL_MODELS[name](torch.float32)
        per_step = []
        for s in range(steps):
            model.zero_grad(set_to_none=True)
            model(*_variant(inputs, s + k)).backward()
            per_step.append(_grads(model))
        refs.append(per_step)

    offs = [make_offloader(prefetch_bytes=p, **DISK) for p in (0, "256KiB")]
    # Built here: model factories seed the global RNG, which threads would share.
    made = [ALL_MODELS[name](torch.float32) for name in names]
    start = threading.Barrier(2)
    results, errors = [None, None], []

    def train(k):
        try:
            model, inputs = made[k]
            start.wait(timeout=60)
            per_step = []
            for s in range(steps):
                model.zero_grad(set_to_none=True)
                with offs[k]:
                    loss = model(*_variant(inputs, s + k))
                    if s == 0:
                        offs[k].wait()  # the first step is read back from disk
                loss.backward()
                per_step.append(_grads(model))
            results[k] = per_step
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=train, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a training thread hangs"
    assert not errors, errors
    for k in range(2):
        for s in range(steps):
            _assert_grads_equal(refs[k][s], results[k][s])
        offs[k].wait()
        st = offs[k].stats()
        assert st.records_written > 0 and st.bytes_read > 0
        assert offs[k].live_records() == 0 and offs[k].spill_bytes_in_use() == 0


def test_one_offloader_cannot_be_entered_by_two_threads_at_once(make_offloader):
    """What the previous test avoids: one offloader, two concurrent forwards, is refused
    (not silently mixed)."""
    off = make_offloader(**DISK)
    entered, release = threading.Event(), threading.Event()

    def hold():
        with off:
            entered.set()
            release.wait(timeout=60)
    t = threading.Thread(target=hold)
    t.start()
    try:
        assert entered.wait(timeout=60)
        with pytest.raises(Exception, match="already open"):
            with off:
                pass
    finally:
        release.set()
        t.join(timeout=60)
