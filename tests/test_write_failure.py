"""A failed write is never swallowed (INV-NO-SWALLOW, docs/ARCHITECTURE.md).

The engine's ``write`` is replaced by one whose future fails, as a full or failing
device would. The error must reach the user at the next pack, at the exit of the
``with`` block, and when backward needs the record; gradients are never computed
from missing data.
"""

from concurrent.futures import Future

import pytest
import torch

import ssdtrain
from ssdtrain import testing

N = 256  # 256 x 256 fp32 = 256 KiB per saved tensor


def _failing_offloader(spill_dir):
    off = ssdtrain.Offloader(ssdtrain.OffloadConfig(policy="static", spill_dir=str(spill_dir),
                                                    min_tensor_bytes=4096, keep_tail_bytes=0))
    calls = []

    def write(file, offset, address, nbytes, **kw):
        calls.append(nbytes)
        fut = Future()
        fut.set_exception(ssdtrain.SpillIOError("ssdtrain: injected write failure (EIO)",
                                                errno=5, filename=str(spill_dir)))
        return fut

    testing.engine(off).write = write
    return off, calls


def test_failed_write_raises_at_next_pack(spill_dir):
    off, calls = _failing_offloader(spill_dir)
    x = torch.randn(N, N, requires_grad=True)
    try:
        with pytest.raises(ssdtrain.SpillIOError, match="injected") as excinfo:
            with off:
                y = (x * 2).sin()    # saves x*2: its write fails
                (y * 3).cos()        # the next pack reports it
        assert excinfo.value.errno == 5
        assert calls, "the write was never attempted: the test proved nothing"
    finally:
        off.close()


def test_failed_write_raises_at_exit_and_at_unpack(spill_dir):
    off, calls = _failing_offloader(spill_dir)
    x = torch.randn(N, N, requires_grad=True)
    try:
        with pytest.raises(ssdtrain.SpillIOError, match="injected"):
            with off:
                loss = (x * 2).sin().sum()  # one offloadable save, then the block ends
        assert calls
        with pytest.raises(ssdtrain.SpillIOError, match="injected"):
            loss.backward()
        assert x.grad is None  # no gradient computed from lost data
    finally:
        off.close()
