"""The GPU data path (``ssdtrain/_device.py``, NOTE [ Device records ]).

These tests need a CUDA device and are skipped without one (CI has none). They
check DESIGN invariant 3 where it can actually break:

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


def _engines(directory):
    from ssdtrain.io import gds, native
    names = ["posix"] + (["native"] if native.available() else [])
    if not gds.probe(str(directory)):
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
    off = make_offloader(engine=engine, min_tensor_bytes=4096, keep_tail_bytes=0)
    for settle in (False, True):  # writes in flight at backward; every record read back
        got = run_step(model, inputs, off, settle=settle)
        assert_same(ref, got)
    off.wait()
    stats = off.stats()
    assert stats.offloaded_bytes > 0 and stats.bytes_read > 0, stats
    assert stats.engine.startswith(engine)


def test_forward_never_synchronizes(engine, make_offloader):
    """Pack only enqueues work and hands the write to a thread: no host sync in forward."""
    model, inputs = _cuda(ALL_MODELS["gpt"]())
    off = make_offloader(engine=engine, min_tensor_bytes=4096, keep_tail_bytes=0)
    run_step(model, inputs, off)  # warm up allocators and streams outside the check
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with off:
            loss = model(*inputs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    loss.backward()
    off.wait()
    assert off.stats().offloaded_bytes > 0


def test_write_waits_for_a_slow_producer(engine, make_offloader):
    """The saved tensor is produced by a kernel queued behind a long sleep: the write
    must order after it (an event), never copy the block before the kernel wrote it."""
    off = make_offloader(engine=engine, min_tensor_bytes=0, keep_tail_bytes=0)
    x = torch.randn(1 << 20, device="cuda")
    anchor, sink = torch.zeros((), requires_grad=True), []
    with off:
        torch.cuda._sleep(200_000_000)         # ~0.1 s or more of GPU time
        y = x * 3                               # queued behind the sleep
        out = SaveForBackward.apply(anchor, sink, y)
        del y                                   # only the record holds the block now
    off.wait()                                  # the write is done (it waited for y)
    assert off.stats().offloaded_bytes >= x.numel() * 4
    out.backward()
    assert torch.equal(sink[0][0], x * 3)


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
