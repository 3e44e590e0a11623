"""Read once: a record used and dropped in backward is never read again by prefetch.

The prefetch queue of a pass is built when forward ends; a record backward needs
before prefetch reaches it is read on demand (a miss), used and dropped. It must
leave the queue's consideration then: reading it again would cost I/O and take a
slot of the prefetch window for bytes nobody will use.
"""

import pytest
import torch

import ssdtrain


class _Both(torch.autograd.Function):
    """Saves ``a`` then ``b``; backward unpacks ``a`` first (the older one): prefetch,
    which goes newest first, has only ``b`` in flight when ``a`` is needed."""

    @staticmethod
    def forward(ctx, a, b, w):
        ctx.save_for_backward(a, b)
        return (a * w).sum() + (b * w).sum()

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return None, None, g * (a + b)


@pytest.mark.parametrize("engine", ["native", "posix"])
def test_a_record_read_on_demand_is_not_prefetched_again(make_offloader, engine):
    n = 1 << 16  # 256 KiB records
    off = make_offloader(engine=engine, min_tensor_bytes=4096, keep_tail_bytes=0,
                         prefetch_bytes=4 * n)  # room for one record ahead
    a, b = torch.randn(n), torch.randn(n)
    w = torch.randn(n, requires_grad=True)
    ref = (a + b).clone()
    with off:
        loss = _Both.apply(a, b, w)
        off.wait()  # both on disk when forward ends: prefetch reads b (the newest)
    loss.backward()
    off.wait()
    assert torch.equal(w.grad, ref)
    s = off.stats()
    assert s.records_written == 2
    assert s.prefetch_misses == 1, s  # a was needed first: read on demand
    assert s.records_read == 2, f"a record was read more than once: {s}"
    del loss
    assert off.live_records() == 0 and off.resident_bytes() == 0


def test_retain_graph_reads_again_on_demand(make_offloader):
    """The second backward of a retained graph needs every record again: each is read
    once more (on demand), and the gradients are exact."""
    n = 1 << 16
    off = make_offloader(min_tensor_bytes=4096, keep_tail_bytes=0, prefetch_bytes=1 << 30)
    a, b = torch.randn(n), torch.randn(n)
    w = torch.randn(n, requires_grad=True)
    with off:
        loss = _Both.apply(a, b, w)
        off.wait()
    loss.backward(retain_graph=True)
    first = w.grad.clone()
    loss.backward()
    assert torch.equal(w.grad, 2 * first)
    s = off.stats()
    assert s.records_read == 4, s

