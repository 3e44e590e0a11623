"""The kvikio engine's own logic (``ssdtrain/io/gds.py``) without a GPU.

kvikio cannot do I/O here, so a stand-in ``kvikio`` module (plain ``os.pwrite`` /
``os.preadv`` behind kvikio's ``CuFile``/``IOFuture`` interface, host memory only)
is installed and the probe's verdict set by hand. That exercises what ssdtrain
itself does with kvikio: reopening anonymous spill files through ``/proc/self/fd``,
futures, errors and short reads. The GPUDirect path proper runs in
tests/test_device.py wherever CUDA and cuFile exist.
"""

from __future__ import annotations

import errno
import os
import sys
import types

import pytest
import torch

import ssdtrain
from helpers import assert_same, run_step, save_and_unpack
from models import ALL_MODELS
from ssdtrain._device.transfers import GDS_PROBE_MEMORY
from ssdtrain.io import gds


class _Future:
    def __init__(self, fn):
        self._fn = fn

    def get(self):
        return self._fn()


class _CuFile:
    """kvikio.CuFile over a plain fd (host buffers only)."""

    opened = []
    fail_next = None     # an OSError to raise from the next call
    short_reads = False

    def __init__(self, path, flags="r"):
        assert path.startswith("/proc/self/fd/") and flags == "r+", (path, flags)
        self.fd = os.open(path, os.O_RDWR)
        _CuFile.opened.append(self)

    def pwrite(self, buf, size, file_offset=0):
        return _Future(lambda: self._io(os.pwrite, buf, size, file_offset))

    def pread(self, buf, size, file_offset=0):
        def read(fd, view, off):
            n = os.preadv(fd, [view], off)
            return n // 2 if _CuFile.short_reads else n
        return _Future(lambda: self._io(read, buf, size, file_offset))

    def _io(self, fn, buf, size, offset):
        if _CuFile.fail_next is not None:
            err, _CuFile.fail_next = _CuFile.fail_next, None
            raise err
        return fn(self.fd, memoryview(buf).cast("B")[:size], offset)

    def close(self):
        os.close(self.fd)
        self.fd = -1


@pytest.fixture
def fake_kvikio(monkeypatch, spill_dir):
    module = types.ModuleType("kvikio")
    module.CuFile = _CuFile
    monkeypatch.setitem(sys.modules, "kvikio", module)
    monkeypatch.setitem(gds._probed, str(spill_dir), "")  # as if the real test I/O passed
    monkeypatch.setattr(_CuFile, "opened", [])
    monkeypatch.setattr(_CuFile, "fail_next", None)
    monkeypatch.setattr(_CuFile, "short_reads", False)
    return module


@pytest.mark.parametrize("name", ["gpt", "inplace_views"])
def test_models_through_kvikio_are_bitwise_equal(name, fake_kvikio, make_offloader):
    model, inputs = ALL_MODELS[name]()
    ref = run_step(model, inputs)
    off = make_offloader(engine="kvikio", min_tensor_bytes=4096, keep_tail_bytes=0)
    for settle in (False, True):
        assert_same(ref, run_step(model, inputs, off, settle=settle))
    stats = off.stats()
    assert stats.engine.startswith("kvikio") and stats.offloaded_bytes > 0, stats
    assert stats.bytes_read > 0, stats
    assert len(_CuFile.opened) == 1                   # one CuFile per spill file, reused
    off.close()
    assert _CuFile.opened[0].fd == -1                 # closed with the engine


def test_auto_picks_kvikio_where_the_probe_passed(fake_kvikio, make_offloader, monkeypatch):
    from ssdtrain import io as ssd_io
    monkeypatch.setattr(ssd_io, "_logged_auto", True)
    off = make_offloader(engine="auto")
    assert off.stats().engine.startswith("kvikio")
    off = make_offloader(engine="auto", verify=True)  # checksums need host copies
    assert not off.stats().engine.startswith("kvikio")


def test_kvikio_error_is_a_spill_io_error(fake_kvikio, make_offloader, spill_dir):
    off = make_offloader(engine="kvikio", min_tensor_bytes=0, keep_tail_bytes=0)
    _CuFile.fail_next = OSError(errno.EIO, "Input/output error")
    with pytest.raises(ssdtrain.SpillIOError) as excinfo:
        save_and_unpack([torch.randn(4096)], off)
    assert excinfo.value.errno == errno.EIO
    assert "writing" in str(excinfo.value) and str(spill_dir) in str(excinfo.value)


def test_kvikio_short_read_is_an_integrity_error(fake_kvikio, make_offloader):
    off = make_offloader(engine="kvikio", min_tensor_bytes=0, keep_tail_bytes=0,
                         prefetch_bytes=0)
    _CuFile.short_reads = True
    with pytest.raises(ssdtrain.IntegrityError, match="past the end"):
        save_and_unpack([torch.randn(4096)], off)


def test_probe_reports_why_without_kvikio_or_cuda(tmp_path, monkeypatch):
    memory = GDS_PROBE_MEMORY
    monkeypatch.setitem(sys.modules, "kvikio", None)  # import fails
    why = gds._probe(str(tmp_path), memory)
    assert f"pip install ssdtrain[gds-cu{(torch.version.cuda or 'NN').split('.')[0]}]" in why
    monkeypatch.setitem(sys.modules, "kvikio", types.ModuleType("kvikio"))
    if not torch.cuda.is_available():
        assert gds._probe(str(tmp_path), memory) == "no CUDA device is available"


def test_probe_without_device_memory_tests_nothing(tmp_path, fake_kvikio):
    """io/ never touches CUDA itself: with no device memory handed in, kvikio is not
    usable, and that verdict is not cached for the directory."""
    assert gds.probe(str(tmp_path), None) != ""
    assert str(tmp_path) not in gds._probed


def test_probe_uses_the_memory_it_is_given(tmp_path, fake_kvikio, monkeypatch):
    """The probe's test I/O goes through the addresses the memory hands out (host memory
    here, through the stand-in kvikio) and compares with its ``same``."""
    import ctypes

    class HostMemory:
        compared = 0

        def missing(self):
            return ""

        def buffers(self, nbytes):
            src = (ctypes.c_char * nbytes).from_buffer_copy(os.urandom(nbytes))
            dst = (ctypes.c_char * nbytes)()

            def same():
                HostMemory.compared += 1
                return bytes(src) == bytes(dst)
            return ctypes.addressof(src), ctypes.addressof(dst), same

    # The stand-in CuFile takes kvikio's w+ and any path; device buffers are host here.
    monkeypatch.setattr(_CuFile, "__init__", lambda self, path, flags="r": setattr(
        self, "fd", os.open(path, os.O_RDWR | os.O_CREAT, 0o600)))
    monkeypatch.setattr(gds, "_DeviceBuffer", gds._host_buffer)
    directory = tmp_path / "probed"
    directory.mkdir()
    assert gds._probe(str(directory), HostMemory()) == ""
    assert HostMemory.compared == 1
    assert os.listdir(directory) == []                # the test file is gone


def test_compat_mode_as_bool_or_enum():
    """kvikio reports its compatibility mode as a bool (old) or a CompatMode enum whose
    AUTO member is truthy: only ON means "no cuFile"; AUTO is settled per file."""
    import enum

    class CompatMode(enum.Enum):
        OFF, ON, AUTO = 0, 1, 2

    def kvikio_with(value):
        module = types.ModuleType("kvikio")
        module.defaults = types.SimpleNamespace(compat_mode=lambda: value)
        return module

    assert gds._compat_mode_reason(kvikio_with(True)).startswith("kvikio runs in compat")
    assert gds._compat_mode_reason(kvikio_with(False)) == ""
    assert gds._compat_mode_reason(kvikio_with(CompatMode.ON)).startswith("kvikio runs")
    assert gds._compat_mode_reason(kvikio_with(CompatMode.AUTO)) == ""
    assert gds._compat_mode_reason(kvikio_with(CompatMode.OFF)) == ""

    preferred = types.ModuleType("kvikio")
    preferred.defaults = types.SimpleNamespace(is_compat_mode_preferred=lambda: True)
    assert gds._compat_mode_reason(preferred) != ""

    class File:
        def __init__(self, on):
            self.is_compat_mode_preferred = lambda: on

    # cuFile's own compatibility mode: kvikio is not in compat mode, cuFile has no GDS.
    for gds_available, verdict in ((False, "cuFile runs in its compatibility mode"),
                                   (True, "")):
        module = kvikio_with(False)
        module.cufile_driver = types.SimpleNamespace(
            get=lambda key, v=gds_available: {"is_gds_available": v}[key])
        assert gds._compat_mode_reason(module).startswith(verdict)

    assert "compatibility mode" in gds._file_compat_reason(File(True))
    assert gds._file_compat_reason(File(False)) == ""
    assert gds._file_compat_reason(object()) == ""  # kvikio versions without the check


def test_cufile_driver_is_imported_when_kvikio_did_not(monkeypatch):
    """``import kvikio`` does not import ``kvikio.cufile_driver`` (seen on an H200): the
    check imports the submodule itself instead of concluding nothing."""
    module = types.ModuleType("kvikio")
    module.defaults = types.SimpleNamespace(compat_mode=lambda: False)
    driver = types.ModuleType("kvikio.cufile_driver")
    driver.get = lambda key: {"is_gds_available": False}[key]
    monkeypatch.setitem(sys.modules, "kvikio", module)
    monkeypatch.setitem(sys.modules, "kvikio.cufile_driver", driver)
    assert gds._compat_mode_reason(module).startswith("cuFile runs in its compatibility mode")
