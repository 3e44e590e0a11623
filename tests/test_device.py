"""The GPU data path (``ssdtrain/_device.py``, NOTE [ Device records ]).

These tests need a CUDA device and are skipped without one (CI has none). They
check INV-OWNED and INV-EXACT (docs/ARCHITECTURE.md) where they can actually break:

* bitwise gradients of CUDA models, with every record written and read back, over
  every engine usable on the machine (staged through pinned memory, or GPUDirect
  Storage where kvikio's probe passes);
* forward never synchronizes with the device (``set_sync_debug_mode("error")``);
* a slow producer kernel (``torch.cuda._sleep``) still running when pack is called:
  the write must wait for it, not copy garbage; and a slow consumer: a loaded block
  must not be handed out again while backward still reads it.
"""

from __future__ import annotations

import pytest
import torch

from helpers import SaveForBackward, assert_same, run_step, save_and_unpack
from models import ALL_MODELS

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA device (the GPU data path cannot run on this machine)"),
]


@pytest.fixture(autouse=True)
def _deterministic():
    """Bitwise comparisons need deterministic kernels (CUBLAS_WORKSPACE_CONFIG is set in
    conftest.py, before cuBLAS starts)."""
    saved = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
             torch.backends.cudnn.benchmark)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    yield
    torch.use_deterministic_algorithms(saved[0])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[1:]


def _engines(directory):
    from ssdtrain._device import GDS_PROBE_MEMORY
    from ssdtrain.io import gds, native
    names = ["posix"] + (["native"] if native.available() else [])
    if not gds.probe(str(directory), GDS_PROBE_MEMORY):
        names.append("kvikio")
    return names


def _cuda(model_and_inputs):
    model, inputs = model_and_inputs
    return model.cuda(), tuple(x.cuda() if isinstance(x, torch.Tensor) else x for x in inputs)


@pytest.fixture(params=["posix", "native", "kvikio"])
def engine(request, spill_dir):
    if request.param not in _engines(spill_dir):
        pytest.skip(f"engine {request.param!r} is not usable on this machine")
    return request.param


@pytest.mark.parametrize("name", sorted(ALL_MODELS))
def test_cuda_gradients_are_bitwise_equal(name, engine, make_offloader):
    torch.manual_seed(0)
    model, inputs = _cuda(ALL_MODELS[name]())
    ref = run_step(model, inputs)
    if not _same(ref, run_step(model, inputs)):
        pytest.skip(f"{name}: two runs without ssdtrain differ on this GPU (a kernel without "
                    f"a deterministic variant), so bitwise equality cannot be asked for")
    off = make_offloader(engine=engine, min_tensor_bytes=4096, keep_tail_bytes=0)
    for settle in (False, True):  # writes in flight at backward; every record read back
        got = run_step(model, inputs, off, settle=settle)
        assert_same(ref, got)
    off.wait()
    stats = off.stats()
    assert stats.offloaded_bytes > 0 and stats.bytes_read > 0, stats
    assert stats.engine.startswith(engine)


def _same(a, b):
    try:
        assert_same(a, b)
    except AssertionError:
        return False
    return True


def test_forward_never_synchronizes(engine, make_offloader):
    """Pack only enqueues work and hands the write to a thread: no host sync in forward.

    ``set_sync_debug_mode`` catches synchronizing copies and allocations but not
    ``Event.synchronize``/``Stream.synchronize``; so forward also runs behind a long
    GPU sleep, and the sleep must still be running when forward has returned.
    """
    model, inputs = _cuda(ALL_MODELS["gpt"]())
    off = make_offloader(engine=engine, min_tensor_bytes=4096, keep_tail_bytes=0)
    run_step(model, inputs, off)  # warm up allocators and streams outside the check
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)           # about a second of GPU time
    asleep = torch.cuda.Event()
    asleep.record()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with off:
            loss = model(*inputs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not asleep.query(), "forward waited for the GPU (a host synchronization)"
    loss.backward()
    off.wait()
    assert off.stats().offloaded_bytes > 0


def test_write_waits_for_a_slow_producer(engine, make_offloader):
    """The saved tensor is produced by a kernel queued behind a long sleep: the write
    must order after it (an event), never copy the block before the kernel wrote it.
    The bytes backward gets are read back from the disk (no prefetch window: nothing
    is kept in memory), so a write of garbage shows."""
    n = 1 << 20
    off = make_offloader(engine=engine, min_tensor_bytes=0, keep_tail_bytes=0,
                         prefetch_bytes=0)
    x = torch.randn(n, device="cuda")
    anchor, sink = torch.zeros((), requires_grad=True), []
    with off:
        torch.cuda._sleep(200_000_000)         # ~0.1 s or more of GPU time
        y = x * 3                               # queued behind the sleep
        out = SaveForBackward.apply(anchor, sink, y)
        del y                                   # only the record holds the block now
    off.wait()                                  # the write is done (it waited for y)
    assert off.stats().offloaded_bytes >= n * 4
    out.backward()
    torch.cuda.synchronize()
    assert off.stats().bytes_read >= n * 4, off.stats()
    assert torch.equal(sink[0][0], x * 3)


def test_write_waits_for_the_stream_that_produced_it(engine, make_offloader):
    """A record kept in the tail is written later, from another pack on another stream:
    the write must wait for the stream that produced the tensor (an event taken when
    the record was packed), not for the stream current when the write starts."""
    n = 1 << 20
    off = make_offloader(engine=engine, min_tensor_bytes=0, keep_tail_bytes=n * 4,
                         prefetch_bytes=0)
    x = torch.randn(n, device="cuda")
    anchor, sink = torch.zeros((), requires_grad=True), []
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with off:
        with torch.cuda.stream(side):
            torch.cuda._sleep(500_000_000)     # the producer is slow, on its own stream
            y = x * 3
            out1 = SaveForBackward.apply(anchor, sink, y)  # fits the tail: not written yet
        z = x * 5                               # current stream, not behind the sleep
        out2 = SaveForBackward.apply(anchor, sink, z)      # pushes y out: y's write starts
        del y, z
    off.wait()
    torch.cuda.synchronize()
    (out1 + out2).backward()
    torch.cuda.synchronize()
    assert off.stats().bytes_read >= 2 * n * 4, off.stats()
    got = sorted((t[0] for t in sink), key=lambda t: float(t[0] / x[0]))
    assert torch.equal(got[0], x * 3) and torch.equal(got[1], x * 5)


class _SlowClone(torch.autograd.Function):
    """Saves ``t``; backward sleeps on the GPU, then clones what it got back."""

    @staticmethod
    def forward(ctx, anchor, sink, t):
        ctx.sink = sink
        ctx.save_for_backward(t)
        return anchor * 1

    @staticmethod
    def backward(ctx, grad):
        (t,) = ctx.saved_tensors
        torch.cuda._sleep(100_000_000)
        ctx.sink.append(t.clone())             # queued behind the sleep
        return grad, None, None


def test_loaded_block_outlives_a_slow_consumer(engine, make_offloader):
    """Backward reads each loaded record only after a GPU sleep, while the CPU side has
    already moved on: the record's memory is released, and prefetch (a window of one
    record) allocates the next load of the same size on its own stream. Without
    record_stream the allocator would hand it the block the sleeping clone is about to
    read, and the clone would copy the wrong record."""
    n, k = 1 << 20, 8
    off = make_offloader(engine=engine, min_tensor_bytes=0, keep_tail_bytes=0,
                         prefetch_bytes=n * 4)
    anchor, sink = torch.zeros((), requires_grad=True), []
    out = anchor
    with off:
        for i in range(k):
            out = _SlowClone.apply(out, sink, torch.full((n,), float(i), device="cuda"))
        off.wait()
    out.backward()
    torch.cuda.synchronize()
    assert off.stats().bytes_read >= k * n * 4, off.stats()
    assert [float(t[0]) for t in sink] == [float(i) for i in reversed(range(k))]
    for i, t in zip(reversed(range(k)), sink):
        assert torch.equal(t, torch.full_like(t, float(i))), i


def test_loaded_block_is_not_reused_while_backward_reads_it(engine, make_offloader):
    """Backward's stream is slowed down while it reads loaded records; prefetch keeps
    allocating on its own stream. record_stream must keep those blocks from reuse."""
    torch.manual_seed(0)
    model, inputs = _cuda(ALL_MODELS["mlp"]())
    ref = run_step(model, inputs)
    off = make_offloader(engine=engine, min_tensor_bytes=0, keep_tail_bytes=0,
                         prefetch_bytes=1 << 30)

    def slow(grad):
        torch.cuda._sleep(50_000_000)
        return grad

    handles = [p.register_hook(slow) for p in model.parameters()]
    try:
        got = run_step(model, inputs, off, settle=True)
    finally:
        for h in handles:
            h.remove()
    assert_same(ref, got)
    assert off.stats().bytes_read > 0


def test_cuda_record_uses_the_device_path(make_offloader):
    """A CUDA tensor is offloaded (not passed through in memory) and comes back on the
    same device with the same bits."""
    off = make_offloader(min_tensor_bytes=0, keep_tail_bytes=0)
    t = torch.randn(4096, device="cuda")
    (back,) = save_and_unpack([t], off)
    stats = off.stats()
    assert stats.offloaded_bytes >= t.numel() * 4 and stats.bytes_read >= t.numel() * 4, stats
    assert back.device == t.device and torch.equal(back, t)
