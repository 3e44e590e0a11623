"""The ``kvikio`` engine: GPUDirect Storage through NVIDIA's kvikio (cuFile).

Device records go straight between GPU memory and the spill file (no pinned
staging, no host copy); host records go through kvikio's host path. kvikio
imports on machines where cuFile cannot do any I/O (no GPU driver, no
``nvidia-fs``, a file system GDS does not support) and then falls back to
"compatibility mode" (POSIX I/O through its own bounce buffers), which is slower
than the native engine with pinned staging. So :func:`probe` does a real small
write and read of device memory in the spill directory, with compatibility mode
refused, and ``engine="auto"`` picks kvikio only where that probe passed. The
device memory it tests with is handed in (``ssdtrain._device.transfers.GDS_PROBE_MEMORY``):
nothing here touches CUDA through torch.

Install with ``pip install ssdtrain[gds-cu12]`` or ``[gds-cu13]`` (the extra matching
torch's CUDA major version). Never needed in CI.
"""

from __future__ import annotations

import errno as _errno
import importlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from .._errors import ConfigError
from .base import Capabilities, Engine, io_error, start_pool

__all__ = ["KvikioEngine", "probe"]

_probed = {}            # directory -> "" (works) or the reason it does not
_probe_lock = threading.Lock()
_PROBE_BYTES = 1 << 20


class _DeviceBuffer:
    """A CUDA address as an object kvikio accepts (``__cuda_array_interface__``)."""

    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, address: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (address, False), "version": 3,
                                         "strides": None}


def _host_buffer(address: int, nbytes: int):
    import ctypes
    return (ctypes.c_char * nbytes).from_address(address)


def _mode_is_on(mode) -> bool:
    """A compatibility-mode setting: a bool in old kvikio, a ``CompatMode`` enum later
    (``ON``, ``OFF``, ``AUTO``; ``AUTO`` is decided per file, see :func:`_probe`)."""
    name = getattr(mode, "name", None)
    if isinstance(name, str):
        return name.upper() == "ON"
    return bool(mode)


def _file_compat_reason(f) -> str:
    """The per-file verdict of kvikio versions that decide compatibility mode at open."""
    check = getattr(f, "is_compat_mode_preferred", None)
    try:
        on = bool(check()) if callable(check) else False
    except Exception as e:  # noqa: BLE001
        return f"kvikio cannot report the file's compatibility mode ({e!r})"
    return ("kvikio opened the test file in compatibility mode (cuFile cannot serve this "
            "file system: POSIX I/O through host bounce buffers)") if on else ""


def _compat_mode_reason(kvikio) -> str:
    """Why kvikio would not use cuFile here ("" when it would), across kvikio versions."""
    defaults = getattr(kvikio, "defaults", None)
    try:
        if hasattr(defaults, "is_compat_mode_preferred"):       # kvikio >= 24.12
            on = defaults.is_compat_mode_preferred()
        elif hasattr(defaults, "compat_mode"):                  # older releases
            on = _mode_is_on(defaults.compat_mode())
        else:
            return ""
    except Exception as e:  # noqa: BLE001 - any failure means "not usable"
        return f"kvikio cannot report its compatibility mode ({e!r})"
    if on:
        return ("kvikio runs in compatibility mode (cuFile or the nvidia-fs driver is "
                "unavailable: POSIX I/O through host bounce buffers, slower than the native "
                "engine)")
    return _cufile_compat_reason(kvikio)


def _cufile_compat_reason(kvikio) -> str:
    """cuFile's own compatibility mode: kvikio hands every request to cuFile, but cuFile,
    finding no GPUDirect Storage support (no nvidia-fs driver, or a file system it cannot
    serve), does POSIX I/O through its own host bounce buffers ("allow_compat_mode" in
    cufile.json). kvikio's compatibility setting does not show this; cuFile's
    ``is_gds_available`` does (kvikio >= 25.02; older releases cannot tell)."""
    driver = getattr(kvikio, "cufile_driver", None)
    if driver is None:  # a submodule: not imported by `import kvikio` (seen on an H200)
        try:
            driver = importlib.import_module(f"{kvikio.__name__}.cufile_driver")
        except Exception:  # noqa: BLE001 - a kvikio without it cannot tell
            return ""
    get = getattr(driver, "get", None)
    if not callable(get):
        return ""
    try:
        available = get("is_gds_available")
    except Exception as e:  # noqa: BLE001 - a driver that cannot answer is not usable
        return f"cuFile cannot report whether GPUDirect Storage is available ({e!r})"
    if available:
        return ""
    return ("cuFile runs in its compatibility mode (is_gds_available is false: no nvidia-fs "
            "driver or no GPUDirect-capable storage): POSIX I/O through host bounce buffers, "
            "not GPUDirect DMA")


def probe(directory: str, memory) -> str:
    """``""`` if GPUDirect Storage works in ``directory``, else why not (cached per directory).

    Works means: kvikio imports, a CUDA device is present, kvikio is not in
    compatibility mode, and a 1 MiB write of device memory to a file in
    ``directory`` reads back bit-exact.

    Args:
        memory: the device memory to test with: ``memory.missing()`` says why there
            is no device (``""`` if there is one) and ``memory.buffers(nbytes)`` gives
            ``(source address, destination address, same)``, ``same()`` telling whether
            the destination equals the source (``ssdtrain._device.transfers.GDS_PROBE_MEMORY``).
            ``None``: no device memory, nothing is tested (and nothing cached).
    """
    if memory is None:
        return "no device memory was given to test GPUDirect Storage with"
    with _probe_lock:
        if directory not in _probed:
            _probed[directory] = _probe(directory, memory)
        return _probed[directory]


def _cuda_major() -> str:
    """torch's CUDA major version ("12", "13"...), or "NN" where torch has no CUDA."""
    import torch
    return (torch.version.cuda or "NN").split(".")[0]


def _probe(directory: str, memory) -> str:
    try:
        import kvikio
    except ImportError as e:
        return (f"kvikio is not installed ({e}); `pip install ssdtrain[gds-cu{_cuda_major()}]` "
                f"(the extra matching torch's CUDA version)")
    reason = memory.missing() or _compat_mode_reason(kvikio)
    if reason:
        return reason
    path = os.path.join(directory, f".ssdtrain-gds-probe-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        src, dst, same = memory.buffers(_PROBE_BYTES)
        f = kvikio.CuFile(path, "w+")
        try:
            reason = _file_compat_reason(f)
            if reason:
                return reason
            wrote = f.pwrite(_DeviceBuffer(src, _PROBE_BYTES), _PROBE_BYTES, 0).get()
            read = f.pread(_DeviceBuffer(dst, _PROBE_BYTES), _PROBE_BYTES, 0).get()
        finally:
            f.close()
        if wrote != _PROBE_BYTES or read != _PROBE_BYTES or not same():
            return (f"a GPUDirect Storage test I/O in {directory} returned wrong data "
                    f"(wrote {wrote}, read {read} of {_PROBE_BYTES} bytes)")
    except Exception as e:  # noqa: BLE001 - every failure is a reason not to use it
        return f"a GPUDirect Storage test I/O in {directory} failed: {e!r}"
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    return ""


class KvikioEngine(Engine):
    """Engine over kvikio's ``CuFile``: device memory to NVMe without host staging.

    Each spill file is opened a second time through kvikio (``/proc/self/fd/N``,
    so the anonymous file needs no name). Requests run on ``io_threads`` waiter
    threads that block in kvikio (which splits them over its own thread pool)
    with the GIL released.

    kvikio's own settings apply and are left to the user: its thread pool has
    ``KVIKIO_NTHREADS`` threads (1 by default: set it to 4-8 for NVMe arrays), and
    requests below ``KVIKIO_GDS_THRESHOLD`` go through POSIX I/O. kvikio
    synchronizes with the current CUDA stream before large device requests; the
    requests run on ssdtrain's own threads, so forward does not wait for that.

    Args:
        io_threads: requests in flight at once. Default 4.
        directories: the spill directories; each must pass :func:`probe`.
        memory: the device memory :func:`probe` tests with.

    Raises:
        ConfigError: kvikio or cuFile does not work in one of ``directories``.
    """

    name = "kvikio"
    capabilities = Capabilities(device_memory=True)  # NOTE [ Engine capabilities ] in base.py

    def __init__(self, *, io_threads: int = 4, directories=(), memory=None):
        for d in directories:
            reason = probe(d, memory)
            if reason:
                raise ConfigError(f"ssdtrain: engine='kvikio' cannot be used for spill_dir {d!r}: "
                                  f"{reason}. Use engine='auto' (it picks the native engine "
                                  f"here) or engine='native'.")
        import kvikio
        self._kvikio = kvikio
        self._files = {}   # SpillFile -> CuFile
        self._lock = threading.Lock()
        self._pool = start_pool(io_threads, "ssdtrain-gds", "kvikio engine")  # or ResourceError

    def write(self, file, offset, address, nbytes, device=False, *, owner=None):
        # The work item queued holds ``owner`` (NOTE [ Requests own their memory ] in
        # base.py): in a list that _run empties before the pool settles the future.
        return self._pool.submit(self._run, "writing", file, offset, address, nbytes, device,
                                 [owner])

    def read(self, file, offset, address, nbytes, device=False, *, owner=None):
        return self._pool.submit(self._run, "reading", file, offset, address, nbytes, device,
                                 [owner])

    def shutdown(self):
        self._pool.shutdown(wait=True)
        with self._lock:
            files, self._files = self._files, {}
        for f in files.values():
            f.close()

    def abandon(self):
        """In a forked child: no CUDA call may run here, and the pool's threads (and
        kvikio's) do not exist. The kvikio file handles are leaked, never closed (closing
        one deregisters it with cuFile: a CUDA call); the pool is replaced by one that is
        already shut down, so ``shutdown()`` returns at once and ``write``/``read`` raise
        ``RuntimeError`` instead of starting threads that would call kvikio. Requests
        queued before the fork never complete."""
        if getattr(self, "_pool", None) is None:  # __init__ did not finish: nothing to forget
            return
        import ctypes
        files = self._files
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(files))  # deliberately never freed
        self._files = {}
        self._lock = threading.Lock()  # another thread may have held the old one at the fork
        pool = ThreadPoolExecutor(1, thread_name_prefix="ssdtrain-gds-abandoned")
        pool.shutdown(wait=False)      # no thread was ever started: returns at once
        self._pool = pool

    def _cufile(self, file):
        with self._lock:
            f = self._files.get(file)
            if f is None:
                if file.fd < 0:
                    raise OSError(_errno.EBADF, "the spill file is closed")
                f = self._files[file] = self._kvikio.CuFile(f"/proc/self/fd/{file.fd}", "r+")
            return f

    def _run(self, verb, file, offset, address, nbytes, device, owner):
        """One request on a pool thread; ``owner`` (a list holding the request's owner)
        is emptied once kvikio is done with the memory, before the pool settles the
        future (NOTE [ Requests own their memory ] in base.py)."""
        try:
            buf = _DeviceBuffer(address, nbytes) if device else _host_buffer(address, nbytes)
            try:
                f = self._cufile(file)
                op = f.pwrite if verb == "writing" else f.pread
                done = op(buf, nbytes, offset).get()
            except OSError as e:
                raise io_error(verb, file, offset, nbytes, e.errno or _errno.EIO,
                               str(e)) from None
            except (RuntimeError, ValueError) as e:  # kvikio reports cuFile errors this way
                raise io_error(verb, file, offset, nbytes, _errno.EIO, f"kvikio: {e}") from None
        finally:
            owner.clear()
        if done != nbytes:
            err = _errno.ENODATA if verb == "reading" else _errno.ENOSPC
            raise io_error(verb, file, offset, nbytes, err,
                           f"kvikio moved {done} of {nbytes} bytes")
        return nbytes
