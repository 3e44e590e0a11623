"""verify=True: every record's CRC32C is taken when its write ends and checked when it is
read back; corrupted or truncated spill data raises IntegrityError, never wrong grads."""

from __future__ import annotations

import os

import pytest
import torch

import ssdtrain
from ssdtrain import testing
from helpers import SaveForBackward, assert_same, run_step
from models import gpt
from ssdtrain.io import checksum as _checksum

pytestmark = pytest.mark.skipif(not _checksum.available(),
                                reason="verify=True needs ssdtrain._C (pip install -e .)")

DISK = dict(policy="static", min_tensor_bytes=1, keep_tail_bytes=0, prefetch_bytes=0)


@pytest.mark.parametrize("engine", ["native", "posix"])
@pytest.mark.parametrize("direct_io", ["auto", "off"])
def test_verified_step_is_exact(make_offloader, engine, direct_io):
    model, inputs = gpt(torch.float32)
    ref = run_step(model, inputs)
    off = make_offloader(engine=engine, direct_io=direct_io, verify=True, min_tensor_bytes="16KiB",
                         keep_tail_bytes=0, prefetch_bytes="1MiB")
    for settle in (False, True):  # the settled step reads every record back (checked)
        assert_same(ref, run_step(model, inputs, off, settle=settle))
    off.wait()
    s = off.stats()
    assert s.records_read > 0 and s.offloaded_bytes > 0
    assert s.engine.endswith("+crc32c")


def _save_one(off, t):
    """Saves ``t`` under ``off`` (written and settled), returns (output, sink, record)."""
    anchor = torch.zeros((), requires_grad=True)
    sink = []
    with off:
        out = SaveForBackward.apply(anchor, sink, t)
        off.wait()
    (rec,) = testing.records(off)
    assert rec.state.value == "on_disk"
    assert (rec.crc is not None) == off.config.verify
    return out, sink, rec


def _overwrite(rec, data: bytes, at: int = 0):
    """Writes ``data`` into the record's slot, through a second, buffered descriptor of the
    anonymous spill file (O_DIRECT reads see it: the kernel writes dirty pages back first)."""
    fd = os.open(f"/proc/self/fd/{rec.slot.file.fd}", os.O_RDWR)
    try:
        assert os.pwrite(fd, data, rec.slot.offset + at) == len(data)
        os.fsync(fd)
    finally:
        os.close(fd)


@pytest.mark.parametrize("engine", ["native", "posix"])
@pytest.mark.parametrize("where", ["first byte", "middle", "last byte"])
def test_corrupted_spill_data_raises_integrity_error(make_offloader, engine, where):
    off = make_offloader(engine=engine, verify=True, **DISK)
    t = torch.arange(100_000, dtype=torch.float32)
    out, sink, rec = _save_one(off, t)
    at = {"first byte": 0, "middle": rec.nbytes // 2, "last byte": rec.nbytes - 1}[where]
    original = os.pread(os.open(f"/proc/self/fd/{rec.slot.file.fd}", os.O_RDONLY), 1,
                        rec.slot.offset + at)
    _overwrite(rec, bytes([original[0] ^ 0x01]), at)
    with pytest.raises(ssdtrain.IntegrityError) as excinfo:
        out.backward()
    msg = str(excinfo.value)
    assert msg.startswith("ssdtrain:") and "CRC32C" in msg and rec.slot.file.name in msg
    assert sink == []  # backward never saw the data


def test_without_verify_the_same_corruption_goes_unseen(make_offloader):
    """What verify buys: the same bit flip without it reaches backward as wrong data."""
    off = make_offloader(verify=False, **DISK)
    t = torch.arange(100_000, dtype=torch.float32)
    out, sink, rec = _save_one(off, t.clone())
    _overwrite(rec, b"\xff\xff\xff\xff", 0)
    out.backward()
    assert not torch.equal(sink[0][0], t)


@pytest.mark.parametrize("engine", ["native", "posix"])
def test_truncated_spill_file_raises_integrity_error(make_offloader, engine):
    off = make_offloader(engine=engine, verify=True, **DISK)
    out, sink, rec = _save_one(off, torch.randn(50_000))
    os.ftruncate(rec.slot.file.fd, rec.slot.offset + rec.nbytes // 2)
    with pytest.raises(ssdtrain.IntegrityError, match="truncated"):
        out.backward()


def test_truncation_is_an_integrity_error_even_without_verify(make_offloader):
    off = make_offloader(verify=False, **DISK)
    out, sink, rec = _save_one(off, torch.randn(50_000))
    os.ftruncate(rec.slot.file.fd, rec.slot.offset)
    with pytest.raises(ssdtrain.IntegrityError, match="truncated"):
        out.backward()


def test_crc_is_of_the_written_bytes(make_offloader):
    off = make_offloader(verify=True, **DISK)
    t = torch.randn(70_001)
    out, sink, rec = _save_one(off, t)
    assert rec.crc == _checksum.crc32c(t.data_ptr(), t.numel() * 4)
    out.backward()
    assert torch.equal(sink[0][0], t)


def test_verify_needs_the_native_module(monkeypatch, spill_dir):
    monkeypatch.setattr(_checksum, "_C", None)
    with pytest.raises(ssdtrain.ConfigError, match="verify"):
        ssdtrain.Offloader(spill_dir=str(spill_dir), verify=True)


def test_the_native_engine_takes_checksums_on_its_workers(make_offloader, monkeypatch):
    """With the native engine no CRC is taken in Python (the training thread or a
    completion holding the GIL): its workers take them, and they are the same CRCs."""
    real = _checksum.crc32c
    calls = []
    monkeypatch.setattr(_checksum, "crc32c", lambda *a: calls.append(a) or real(*a))
    off = make_offloader(engine="native", verify=True, **DISK)
    t = torch.randn(300_001)
    out, sink, rec = _save_one(off, t)
    assert rec.crc == real(t.data_ptr(), t.numel() * 4)
    out.backward()
    assert torch.equal(sink[0][0], t)
    assert off.stats().records_read == 1 and calls == []


@pytest.mark.parametrize("direct", [True, False])
def test_native_requests_return_the_crc_of_their_bytes(tmp_path, direct):
    """``crc=True`` over requests split into many pieces (chunk 4 KiB, 4 workers): the
    CRC is of the whole request, written and read."""
    from ssdtrain.io.native import NativeEngine
    from ssdtrain.tools import SpillSet

    spill = SpillSet([str(tmp_path)], "auto" if direct else "off")
    engine = NativeEngine(io_threads=4, chunk_bytes=4096)
    try:
        for n in (1, 4095, 4096, 40_000, 1 << 20):
            src = torch.randint(0, 256, (n,), dtype=torch.uint8)
            slot = spill.alloc(n, src.data_ptr() % 4096)
            assert engine.write(slot.file, slot.offset, src.data_ptr(), n, crc=True).result() \
                == real_crc(src)
            dst = torch.zeros(n + 4096, dtype=torch.uint8)
            view = dst[(slot.offset - dst.data_ptr()) % 4096:][:n]
            assert engine.read(slot.file, slot.offset, view.data_ptr(), n, crc=True).result() \
                == real_crc(src)
            assert torch.equal(view, src)
            assert engine.write(slot.file, slot.offset, src.data_ptr(), n).result() == n
            del slot  # its blocks go back (NOTE [ Slots are leases ])
    finally:
        engine.shutdown()
        spill.close()


def real_crc(t):
    return _checksum.crc32c(t.data_ptr(), t.numel() * t.element_size())
