"""Errors name the real cause when a thread, a file descriptor or memory cannot be had:
a :class:`ssdtrain.ResourceError` saying what ran out, what was
needed (with this process's limits) and what to do, never a bare ``RuntimeError`` or a
misleading one (before: the native engine said its ``'auto'`` back end could not start
and advised ``backend='auto'``; the posix engine and the store raised
``RuntimeError: can't start new thread``; a spill file that could not be opened for
``EMFILE`` was "not writable"; a read buffer without memory was a bare ``OSError``).

Injected: ``threading.Thread.start`` raising as CPython does, ``os.open`` raising
``EMFILE``, a read buffer's ``ENOMEM``. Real: a child process whose address space is
capped (``RLIMIT_AS``) so that no thread stack fits, which fails ``pthread_create`` in
the native engine and ``Thread.start`` in Python (root ignores ``RLIMIT_NPROC``).
"""

from __future__ import annotations

import errno
import gc
import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import ssdtrain
from ssdtrain import _errors
from ssdtrain.io import native
from ssdtrain.io.posix import PosixEngine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_THREAD = RuntimeError("can't start new thread")  # CPython's own message


def _refuse_threads(monkeypatch, prefix):
    """``Thread.start`` fails, as at a thread limit, for threads named ``prefix...``."""
    real = threading.Thread.start

    def start(self):
        if self.name.startswith(prefix):
            raise RuntimeError("can't start new thread")
        return real(self)
    monkeypatch.setattr(threading.Thread, "start", start)


def _open_fds():
    return len(os.listdir("/proc/self/fd"))


def _assert_says_thread(e, needed):
    msg = str(e)
    assert isinstance(e, ssdtrain.ResourceError) and e.resource == "thread", msg
    assert e.errno == errno.EAGAIN
    assert msg.startswith("ssdtrain:") and "refused a new thread" in msg
    assert f"needed {needed} thread" in msg and "ulimit -u" in msg and "io_threads" in msg
    assert "back end" not in msg and "backend=" not in msg


# --------------------------------------------------------------------- threads
def test_no_thread_for_the_store_says_so_and_leaks_nothing(monkeypatch, spill_dir):
    _refuse_threads(monkeypatch, "ssdtrain-store")
    gc.collect()
    fds = _open_fds()
    with pytest.raises(ssdtrain.ResourceError) as excinfo:
        ssdtrain.Offloader(spill_dir=str(spill_dir), engine="posix")
    _assert_says_thread(excinfo.value, 1)
    assert "store's I/O thread" in str(excinfo.value)
    del excinfo
    gc.collect()
    assert _open_fds() == fds, "the spill files of the store that never ran stayed open"
    assert not [t for t in threading.enumerate() if t.name.startswith("ssdtrain-io")]


def test_no_thread_for_the_posix_engine_says_so(monkeypatch):
    started = []
    real = threading.Thread.start

    def start(self):  # the third worker cannot start
        if self.name.startswith("ssdtrain-io"):
            if len(started) == 2:
                raise RuntimeError("can't start new thread")
            started.append(self)
        return real(self)
    monkeypatch.setattr(threading.Thread, "start", start)
    with pytest.raises(ssdtrain.ResourceError) as excinfo:
        PosixEngine(io_threads=4)
    _assert_says_thread(excinfo.value, 4)
    assert "posix engine" in str(excinfo.value)
    for t in started:  # the ones that did start were ended, not left waiting
        t.join(timeout=10)
        assert not t.is_alive()


@pytest.mark.parametrize("cause,backend,kind", [
    (OSError(errno.EAGAIN, "starting I/O worker thread 2 of 4: Resource temporarily "
                           "unavailable"), "auto", ssdtrain.ResourceError),
    (OSError(errno.EAGAIN, "starting I/O worker thread 1 of 4"), "uring", ssdtrain.ResourceError),
    (MemoryError(), "threads", ssdtrain.ResourceError),
    (RuntimeError("io_uring is not usable here: io_uring_setup failed"), "uring",
     ssdtrain.ConfigError),
    (ValueError("threads must be in [1, 1024], got 0"), "auto", ssdtrain.ConfigError),
    (RuntimeError("something else"), "auto", ssdtrain.SSDTrainError),
])
def test_the_native_engines_start_errors_name_their_cause(cause, backend, kind):
    """``ssdtrain.io.native.start_error``: what ``_C.Engine(...)`` raised, mapped. A thread
    that cannot start comes from C++ as ``OSError(EAGAIN)`` (``std::system_error``,
    translated in csrc/binding.cpp); only io_uring refused with ``backend="uring"`` is a
    back-end problem."""
    err = native.start_error(cause, backend, 4)
    assert type(err) is kind, err
    msg = str(err)
    assert msg.startswith("ssdtrain:")
    if isinstance(cause, OSError):
        _assert_says_thread(err, 4)
    if isinstance(cause, MemoryError):
        assert err.resource == "memory" and "Free memory" in msg
    if kind is not ssdtrain.ConfigError or "io_uring" not in str(cause):
        assert "backend=" not in msg


def test_real_thread_exhaustion_in_a_child(tmp_path):
    """A child whose address space leaves no room for a thread stack (RLIMIT_AS): every
    place that starts threads reports a ResourceError about threads."""
    spill = tmp_path / "spill"
    spill.mkdir()
    code = textwrap.dedent(f"""
        import json, resource
        import ssdtrain
        from ssdtrain.io import native
        from ssdtrain.io.posix import PosixEngine
        def vm():
            for line in open("/proc/self/status"):
                if line.startswith("VmSize"):
                    return int(line.split()[1]) * 1024
        makers = {{"posix": lambda: PosixEngine(io_threads=4),
                   "offloader": lambda: ssdtrain.Offloader(spill_dir={str(spill)!r},
                                                           engine="posix", io_threads=1)}}
        if native.available():
            makers["native"] = lambda: native.NativeEngine(io_threads=4)
        resource.setrlimit(resource.RLIMIT_AS, (vm() + (4 << 20), resource.RLIM_INFINITY))
        out = {{}}
        for name, make in makers.items():
            try:
                make()
                out[name] = ["made", ""]
            except BaseException as e:
                out[name] = [type(e).__name__, str(e), getattr(e, "resource", None)]
        print("RESULT " + json.dumps(out))
    """)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("LD_PRELOAD", None)  # AddressSanitizer reserves more address space than this
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, proc.stdout + proc.stderr
    out = json.loads(line[0][len("RESULT "):])
    assert set(out) >= {"posix", "offloader"}
    for name, (kind, msg, *res) in out.items():
        assert kind == "ResourceError" and res == ["thread"], (name, kind, msg)
        assert "refused a new thread" in msg and "address space MiB" in msg, (name, msg)
        assert "backend=" not in msg, (name, msg)


# ------------------------------------------------------------- file descriptors
def test_too_many_open_files_is_not_an_unwritable_directory(monkeypatch, spill_dir):
    from ssdtrain.io import spill as _spill
    real = os.open

    def refuse(path, flags, *args, **kw):
        if flags & getattr(os, "O_TMPFILE", 0) == getattr(os, "O_TMPFILE", -1) or \
                flags & os.O_CREAT:
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return real(path, flags, *args, **kw)
    monkeypatch.setattr(_spill.os, "open", refuse)
    with pytest.raises(ssdtrain.ResourceError) as excinfo:
        ssdtrain.Offloader(spill_dir=str(spill_dir))
    e = excinfo.value
    msg = str(e)
    assert e.resource == "file descriptor" and e.errno == errno.EMFILE
    assert "too many files open" in msg and "ulimit -n" in msg and "not writable" not in msg
    assert str(spill_dir) in msg


# ---------------------------------------------------------------------- memory
def test_no_memory_for_a_read_buffer_says_so(make_offloader):
    """A record read on demand (no prefetch) whose buffer cannot be mapped: backward
    raises a ResourceError about memory; with memory back, the next step is exact."""
    off = make_offloader(min_tensor_bytes=4096, keep_tail_bytes=0, prefetch_bytes=0)
    store = off._store  # the failure is injected into the store's read buffers
    real = store._buffers.storage
    failing = [True]

    def storage(*args):
        if failing[0]:
            raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))
        return real(*args)
    store._buffers.storage = storage

    def step():
        x = torch.linspace(-1, 1, 256 * 256).reshape(256, 256).requires_grad_()
        with off:
            loss = (x * 2).sin().sum()
            off.wait()
        loss.backward()
        return x.grad

    with pytest.raises(ssdtrain.ResourceError) as excinfo:
        step()
    e = excinfo.value
    assert e.resource == "memory" and e.errno == errno.ENOMEM
    assert "no read buffer for record" in str(e) and "262144 bytes" in str(e)
    assert "prefetch_bytes" in str(e) and "vm.max_map_count" in str(e)
    del e, excinfo
    failing[0] = False
    x = torch.linspace(-1, 1, 256 * 256).reshape(256, 256).requires_grad_()
    (x * 2).sin().sum().backward()
    assert torch.equal(step(), x.grad)
    gc.collect()
    assert off.live_records() == 0
    store.check_invariants()


# ------------------------------------------------------------ the mapping itself
@pytest.mark.parametrize("cause,kw,resource", [
    (RuntimeError("can't start new thread"), {}, "thread"),
    (OSError(errno.EAGAIN, "x"), {"thread": True}, "thread"),
    (OSError(errno.EAGAIN, "x"), {}, None),                     # not a thread start
    (OSError(errno.EMFILE, "Too many open files"), {}, "file descriptor"),
    (OSError(errno.ENFILE, "Too many open files in system"), {}, "file descriptor"),
    (OSError(errno.ENOMEM, "Cannot allocate memory"), {"nbytes": 4096}, "memory"),
    (MemoryError(), {}, "memory"),
    (OSError(errno.EIO, "Input/output error"), {}, None),
    (RuntimeError("other"), {}, None),
])
def test_resource_error_recognizes_what_ran_out(cause, kw, resource):
    err = _errors.resource_error("doing something", cause, **kw)
    if resource is None:
        assert err is None
        return
    msg = str(err)
    assert isinstance(err, ssdtrain.ResourceError) and isinstance(err, OSError)
    assert err.resource == resource and msg.startswith("ssdtrain: doing something: ")
    assert type(cause).__name__ in msg  # the cause, as the system gave it
    assert "limit" in msg or "Free memory" in msg  # what was expected and what to do
