"""Faults of the spill tier (INV-NO-SWALLOW; docs/failure.md): every one gives a clear
ssdtrain error at the latest when the data is needed, or (``on_spill_error="keep"``, a
disk budget with ``on_spill_full="keep"``) keeps the record in memory with exact
gradients; never wrong gradients, never a hang, never a leaked record.

Injected faults come from :mod:`ssdtrain.io.faulty`; real ones from a file size limit
(``RLIMIT_FSIZE``) in a child process, a full file system (a 1 MiB tmpfs, where this
process may mount one) and a spill directory removed mid-run.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import ssdtrain
from ssdtrain import testing
from helpers import assert_same, run_step, save_and_unpack
from models import mlp
from ssdtrain.io import checksum as _checksum
from ssdtrain.io import faulty
from ssdtrain.io.faulty import Fault

# Everything >= 4 KiB is offloaded, nothing is kept back as the tail.
DISK = dict(policy="static", min_tensor_bytes=4096, keep_tail_bytes=0, prefetch_bytes="1MiB")
WRITE_ERRNOS = {"ENOSPC": errno.ENOSPC, "EIO": errno.EIO, "EFBIG": errno.EFBIG,
                "EDQUOT": errno.EDQUOT, "short": errno.EIO}
needs_crc = pytest.mark.skipif(not _checksum.available(), reason="needs ssdtrain._C")


def _no_leak(off):
    """Once the graphs are gone, no record and no disk slot may be left."""
    import gc
    gc.collect()
    off.wait()
    assert off.live_records() == 0
    assert off.spill_bytes_in_use() == 0


# ----------------------------------------------------------------- write faults
@pytest.mark.parametrize("kind", sorted(WRITE_ERRNOS))
@pytest.mark.parametrize("engine", ["posix", "native"])
def test_write_fault_raises_by_default(make_offloader, kind, engine):
    if engine == "native" and not _checksum.available():
        pytest.skip("native engine not built")
    model, inputs = mlp()
    # write_behind_bytes=0: each write ends before forward goes on, so the failure is
    # always seen in forward (a later one reaches backward: see the next test).
    off = make_offloader(engine=engine, write_behind_bytes=0, **DISK)
    inj = faulty.install(off, Fault("write", kind, nth=2))
    with pytest.raises(ssdtrain.SpillIOError) as excinfo:
        run_step(model, inputs, off)
    assert inj.injected == [("write", 2, kind)]
    e = excinfo.value
    assert str(e).startswith("ssdtrain:") and e.errno == WRITE_ERRNOS[kind]
    assert "spill file" in str(e) and e.filename == off.config.spill_dir[0]
    assert all(p.grad is None for p in model.parameters()), "gradients from lost data"
    del e, excinfo  # the traceback holds forward's frames, and so the graph
    _no_leak(off)


def test_write_fault_reaches_backward_when_forward_ended_first(make_offloader):
    """The failed write completes after forward's last pack and after the pending-error
    check at the end of forward: backward must still refuse to use the record."""
    off = make_offloader(**DISK)
    inj = faulty.install(off, Fault("write", "hang"))
    x = torch.randn(256, 256, requires_grad=True)
    with off:
        loss = (x * 2).sin().sum()
    # Now end the hung write with an error, as a device that fails late would.
    (fut, *_), = inj._hung
    fut.set_exception(ssdtrain.SpillIOError("ssdtrain: injected late EIO", errno=5))
    with pytest.raises(ssdtrain.SpillIOError, match="injected late EIO") as excinfo:
        loss.backward()
    assert "needed by SinBackward0" in str(excinfo.value) and "record" in str(excinfo.value)
    assert x.grad is None


@pytest.mark.parametrize("kind", ["ENOSPC", "EIO", "short"])
@pytest.mark.parametrize("times", [1, None])
def test_write_fault_keep_gives_exact_grads(make_offloader, caplog, kind, times):
    model, inputs = mlp()
    ref = run_step(model, inputs)
    off = make_offloader(on_spill_error="keep", **DISK)
    inj = faulty.install(off, Fault("write", kind, nth=2, times=times))
    with caplog.at_level(logging.WARNING, logger="ssdtrain"):
        for _ in range(2):  # settled: records that were written are read back from disk
            assert_same(ref, run_step(model, inputs, off, settle=True))
    off.wait()
    s = off.stats()
    failed = len(inj.injected)
    assert failed >= 1 and s.spill_errors == failed
    assert s.records_written == inj.calls["write"] - failed
    if times is None:
        assert s.records_written == 1
    else:
        assert s.records_read > 0  # the other records did go to disk and back
    warnings = [r for r in caplog.records if "on_spill_error='keep'" in r.getMessage()]
    assert len(warnings) == 1, "the warning is logged once per offloader"
    _no_leak(off)


def test_keep_does_not_cover_read_faults(make_offloader):
    """By the time a read fails, the memory is gone: keep cannot help, backward raises."""
    off = make_offloader(on_spill_error="keep", **DISK)
    faulty.install(off, Fault("read", "EIO"))
    x = torch.randn(256, 256, requires_grad=True)
    with off:
        loss = (x * 2).sin().sum()
        off.wait()
    with pytest.raises(ssdtrain.SpillIOError, match="EIO|Input/output") as excinfo:
        loss.backward()
    assert excinfo.value.errno == errno.EIO
    assert x.grad is None


# ------------------------------------------------------------------ read faults
@pytest.mark.parametrize("kind,error", [("EIO", ssdtrain.SpillIOError),
                                        ("ENOSPC", ssdtrain.SpillIOError),
                                        ("short", ssdtrain.IntegrityError)])
@pytest.mark.parametrize("prefetch_bytes", [0, "1MiB"])
def test_read_fault_raises_naming_record_and_op(make_offloader, kind, error, prefetch_bytes):
    off = make_offloader(min_tensor_bytes=4096, keep_tail_bytes=0, prefetch_bytes=prefetch_bytes)
    inj = faulty.install(off, Fault("read", kind))
    x = torch.randn(256, 256, requires_grad=True)
    with off:
        loss = (x * 2).sin().sum()
        off.wait()
    with pytest.raises(error) as excinfo:
        loss.backward()
    msg = str(excinfo.value)
    assert inj.injected == [("read", 1, kind)]
    assert msg.startswith("ssdtrain:") and "spill file" in msg
    assert "[record <Record failed" in msg and "needed by SinBackward0 in backward" in msg
    assert x.grad is None
    del loss, excinfo
    _no_leak(off)


@needs_crc
@pytest.mark.parametrize("op", ["write", "read"])
def test_silent_corruption_is_caught_by_verify(make_offloader, op):
    off = make_offloader(verify=True, **DISK)
    inj = faulty.install(off, Fault(op, "corrupt"))
    x = torch.randn(256, 256, requires_grad=True)
    with off:
        loss = (x * 2).sin().sum()
        off.wait()
    with pytest.raises(ssdtrain.IntegrityError) as excinfo:
        loss.backward()
    msg = str(excinfo.value)
    assert inj.injected == [(op, 1, "corrupt")]
    assert "CRC32C" in msg and "record <Record" in msg and "needed by SinBackward0" in msg
    assert x.grad is None


def test_silent_corruption_without_verify_gives_wrong_data(make_offloader):
    """The control for the test above: the injected corruption is real."""
    off = make_offloader(verify=False, **DISK)
    faulty.install(off, Fault("read", "corrupt"))
    t = torch.randn(100_000)
    (got,) = save_and_unpack([t], off)
    assert not torch.equal(got, t)


# ------------------------------------------------------------------- hung device
def test_hung_read_times_out_naming_record_and_path(make_offloader):
    off = make_offloader(io_timeout_s=0.3, **DISK)
    faulty.install(off, Fault("read", "hang", times=None))
    x = torch.randn(256, 256, requires_grad=True)
    with off:
        loss = (x * 2).sin().sum()
        off.wait()
    t0 = time.monotonic()
    with pytest.raises(ssdtrain.SpillIOError) as excinfo:
        loss.backward()
    assert time.monotonic() - t0 < 30
    msg = str(excinfo.value)
    assert "did not finish within io_timeout_s=0.3" in msg and "record <Record" in msg
    assert "spill file" in msg and "needed by SinBackward0" in msg
    assert excinfo.value.filename == off.config.spill_dir[0]
    with pytest.raises(ssdtrain.SpillIOError, match="did not finish"):
        off.close()  # the read is still hung: close waits io_timeout_s, then releases
    assert off.closed


def test_hung_write_throttle_times_out(make_offloader):
    off = make_offloader(io_timeout_s=0.3, write_behind_bytes=0, **DISK)
    faulty.install(off, Fault("write", "hang", times=None))
    x = torch.randn(256, 256, requires_grad=True)
    with pytest.raises(ssdtrain.SpillIOError) as excinfo:
        with off:
            (x * 2).sin().sum()
    msg = str(excinfo.value)
    assert "did not finish within io_timeout_s=0.3" in msg and "writing record <Record" in msg
    assert "spill file" in msg
    with pytest.raises(ssdtrain.SpillIOError, match="record <Record.*spill file"):
        off.wait()
    with pytest.raises(ssdtrain.SpillIOError, match="did not finish"):
        off.close()  # waits at most io_timeout_s, then releases everything anyway
    assert off.closed


# ------------------------------------------------------------------ disk budget
@pytest.mark.parametrize("limit", [0, "300KiB", "1MiB"])
def test_budget_keep_bounds_disk_and_grads_exact(make_offloader, caplog, limit):
    model, inputs = mlp()
    ref = run_step(model, inputs)
    off = make_offloader(max_spill_bytes=limit, **DISK)
    limit = off.config.max_spill_bytes
    peak = [0]
    alloc = testing.spill(off).alloc

    def watched(nbytes, misalign):
        slot = alloc(nbytes, misalign)
        peak[0] = max(peak[0], testing.spill(off).used_bytes())
        return slot
    testing.spill(off).alloc = watched
    with caplog.at_level(logging.WARNING, logger="ssdtrain"):
        for _ in range(2):
            assert_same(ref, run_step(model, inputs, off))
    off.wait()  # written bytes are counted when the writes complete
    s = off.stats()
    assert peak[0] <= limit
    assert s.over_budget_bytes > 0
    if limit:
        assert s.offloaded_bytes > 0  # the budget was used, not just refused
    assert any("max_spill_bytes" in r.getMessage() for r in caplog.records)
    _no_leak(off)


def test_budget_raise(make_offloader):
    model, inputs = mlp()
    off = make_offloader(max_spill_bytes="300KiB", on_spill_full="raise", **DISK)
    with pytest.raises(ssdtrain.SpillIOError, match="max_spill_bytes") as excinfo:
        run_step(model, inputs, off)
    assert excinfo.value.errno == errno.ENOSPC
    assert all(p.grad is None for p in model.parameters())
    del excinfo
    _no_leak(off)


def test_no_budget_by_default_goes_beyond(make_offloader):
    """Control for the budget tests: this model does spill more than 300 KiB."""
    model, inputs = mlp()
    off = make_offloader(**DISK)
    with off:
        loss = model(*inputs)
        off.wait()
        assert off.spill_bytes_in_use() > 300 * 1024
    loss.backward()
    assert off.stats().over_budget_bytes == 0


# ------------------------------------------------------------------ real faults
_FSIZE_CHILD = textwrap.dedent("""
    import resource, signal, sys
    sys.path.insert(0, sys.argv[3])
    import torch, ssdtrain
    from helpers import assert_same, run_step
    from models import mlp
    model, inputs = mlp()
    ref = run_step(model, inputs)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)       # EFBIG instead of a signal
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, 256 * 1024))
    off = ssdtrain.Offloader(policy="static", spill_dir=sys.argv[1], engine=sys.argv[4],
                             on_spill_error=sys.argv[2], min_tensor_bytes=4096,
                             keep_tail_bytes=0, write_behind_bytes=0)
    try:
        for _ in range(2):
            assert_same(ref, run_step(model, inputs, off))
    except ssdtrain.SpillIOError as e:
        print("RAISED", e.errno, e)
        assert all(p.grad is None for p in model.parameters())
    else:
        print("EXACT", off.stats().spill_errors, off.stats().records_written)
    off.close()
""")


@pytest.mark.parametrize("engine", ["posix", "native"])
@pytest.mark.parametrize("on_spill_error", ["raise", "keep"])
def test_file_size_limit(spill_dir, on_spill_error, engine):
    """A real EFBIG from the kernel (RLIMIT_FSIZE, as a quota would give EDQUOT)."""
    if engine == "native" and not _checksum.available():
        pytest.skip("native engine not built")
    tests = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, "-c", _FSIZE_CHILD, str(spill_dir), on_spill_error,
                        tests, engine], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout.strip().splitlines()[-1]
    if on_spill_error == "raise":
        assert out.startswith(f"RAISED {errno.EFBIG} ssdtrain:"), out
    else:
        word, errors, written = out.split()
        assert word == "EXACT" and int(errors) > 0 and int(written) > 0, out


@pytest.fixture
def tiny_fs(tmp_path):
    """A 1 MiB tmpfs (where this process may mount one): a device that really fills up."""
    point = tmp_path / "tiny"
    point.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(point)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}); run as root to test a "
                    f"really full device")
    try:
        yield point
    finally:
        subprocess.run(["umount", "-l", str(point)], check=False)


@pytest.mark.parametrize("on_spill_error", ["raise", "keep"])
def test_full_device(tiny_fs, on_spill_error, caplog):
    model, inputs = mlp()
    ref = run_step(model, inputs)
    off = ssdtrain.Offloader(spill_dir=str(tiny_fs), on_spill_error=on_spill_error,
                             write_behind_bytes=0, **DISK)
    try:
        if on_spill_error == "raise":
            with pytest.raises(ssdtrain.SpillIOError) as excinfo:
                run_step(model, inputs, off)
            assert excinfo.value.errno == errno.ENOSPC, excinfo.value
            assert all(p.grad is None for p in model.parameters())
            del excinfo
        else:
            for _ in range(2):
                assert_same(ref, run_step(model, inputs, off))
            off.wait()
            s = off.stats()
            assert s.spill_errors > 0 and s.records_written > 0
        _no_leak(off)
    finally:
        off.close()
    assert os.listdir(tiny_fs) == []


def test_spill_dir_removed_mid_run(tmp_path):
    """Spill files are anonymous: removing the directory mid-run changes nothing for the
    running offloader; a new offloader on the missing directory is refused clearly."""
    d = tmp_path / "spill"
    d.mkdir()
    model, inputs = mlp()
    ref = run_step(model, inputs)
    off = ssdtrain.Offloader(spill_dir=str(d), **DISK)
    try:
        assert_same(ref, run_step(model, inputs, off))
        shutil.rmtree(d)
        for _ in range(2):  # settle: every record is read back from the disk
            assert_same(ref, run_step(model, inputs, off, settle=True))
        assert off.stats().records_read > 0
    finally:
        off.close()
    with pytest.raises(ssdtrain.ConfigError, match="does not exist"):
        ssdtrain.Offloader(spill_dir=str(d))


# ------------------------------------------------------------- the injector itself
def test_fault_validation():
    with pytest.raises(ValueError):
        Fault("erase", "EIO")
    with pytest.raises(ValueError):
        Fault("write", "EPERM")
    with pytest.raises(ValueError):
        Fault("write", "EIO", nth=0)
    f = Fault("read", "EIO", nth=3, times=2)
    assert [n for n in range(1, 7) if f.hits("read", n)] == [3, 4]
    assert not f.hits("write", 3)
    assert [n for n in range(1, 6) if Fault("write", "EIO", 2, None).hits("write", n)] == \
        [2, 3, 4, 5]


# ---------------------------------------------------------- verify on by default
@needs_crc
@pytest.mark.parametrize("engine", ["native", "posix"])
def test_verify_is_on_by_default(make_offloader, engine):
    """verify="auto" resolves to on for the host-memory engines, and catches corruption
    without being asked to (benchmarks/verify_overhead.py: ~1-2% of step time)."""
    off = make_offloader(engine=engine, **DISK)
    assert off.config.verify is True and off.stats().engine.endswith("+crc32c")
    faulty.install(off, Fault("read", "corrupt"))
    x = torch.randn(256, 256, requires_grad=True)
    with off:
        loss = (x * 2).sin().sum()
        off.wait()
    with pytest.raises(ssdtrain.IntegrityError, match="CRC32C"):
        loss.backward()


def test_verify_auto_is_off_without_the_native_module(make_offloader, monkeypatch):
    monkeypatch.setattr(_checksum, "_C", None)
    off = make_offloader(engine="posix", **DISK)
    assert off.config.verify is False and not off.stats().engine.endswith("+crc32c")
    with pytest.raises(ssdtrain.ConfigError, match="verify"):
        make_offloader(engine="posix", verify=True)
