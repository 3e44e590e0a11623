"""The ``native`` I/O engine (``ssdtrain/io/native.py`` over ``csrc/``) against the posix
reference engine and plain Python.

Parity: what the native engine writes is compared byte for byte with a reference file
written by plain Python and with what the posix engine writes for the same request;
each engine reads back what the other wrote. Odd sizes, unaligned addresses, worker
counts and chunk sizes, ``O_DIRECT`` and buffered files, and both submission back ends
(io_uring, and the thread pool forced with ``backend="threads"``). Faults: closed file,
reading past the end, a full device, a failing ``fdatasync``, ``RLIMIT_FSIZE`` (in a
subprocess); each must fail its future with a ``SpillIOError`` carrying errno, never hang.
Shutdown with requests in flight and callbacks pending must not deadlock (subprocesses
with a timeout). CRC32C against RFC 3720 vectors and a pure-Python reference.
"""

from __future__ import annotations

import ctypes
import errno
import os
import random
import subprocess
import sys
import textwrap
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ssdtrain import ConfigError, IntegrityError, SpillIOError
from ssdtrain.io.spill import BLOCK, SpillFile
from ssdtrain.io import native
from ssdtrain.io.posix import PosixEngine

if not native.available():
    pytest.skip(f"native engine not built: {native.unavailable_reason()}",
                allow_module_level=True)

from ssdtrain import _C  # noqa: E402
from ssdtrain.io.native import NativeEngine  # noqa: E402
# The posix engine's test helpers and fixtures: the same buffers with guard bytes,
# the same spill-file fixture (skips O_DIRECT where the file system refuses it).
from test_engine import (  # noqa: E402,F401  (spill_files is a fixture)
    REPO, TIMEOUT, Buffer, _file_bytes, _fs_kind, _payload, _whole_file, spill_files)

KiB, MiB = 1 << 10, 1 << 20
URING_OK, URING_WHY = _C.uring_probe()

SIZES = [0, 1, 511, 512, 4095, 4096, 4097, 65_537, MiB + 13]
MISALIGNS = [0, 1, 64, 4095]
WORKERS_CHUNKS = [(1, 4 * KiB), (3, 8 * KiB), (8, 4 * KiB), (2, 16 * MiB), (8, 16 * MiB)]

BACKENDS = pytest.mark.parametrize("backend", [
    pytest.param("uring", marks=pytest.mark.skipif(
        not URING_OK, reason=f"io_uring unusable here: {URING_WHY}")),
    "threads",
])
MODES = pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])


@pytest.fixture
def engines():
    made = []

    def make(kind="native", workers=2, chunk=16 * MiB, backend="auto"):
        if kind == "posix":
            e = PosixEngine(io_threads=workers, chunk_bytes=chunk)
        else:
            e = NativeEngine(io_threads=workers, chunk_bytes=chunk, backend=backend)
        made.append(e)
        return e

    yield make
    for e in made:
        e.shutdown()


# --------------------------------------------------------------------------- construction

def test_backend_is_reported():
    forced = NativeEngine(io_threads=1, backend="threads")
    auto = NativeEngine(io_threads=1)
    try:
        assert forced.backend == "threads" and forced.name == "native"
        # NOTE [ Which native back end auto picks ] (ssdtrain/io/native.py): the pool.
        assert auto.backend == "threads"
    finally:
        forced.shutdown()
        auto.shutdown()


def _thread_names():
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return names


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux's /proc")
@pytest.mark.parametrize("backend", ["threads", "auto"])
def test_worker_threads_are_named_for_tools(engines, backend):
    """The engine's workers carry the OS name "ssdtrain-io" (top, perf, py-spy, and
    step_overhead's I/O CPU column find them by it), and go with the engine."""
    before = _thread_names().count("ssdtrain-io")
    e = engines(workers=3, backend=backend)
    assert _thread_names().count("ssdtrain-io") == before + 3
    e.shutdown()
    assert _thread_names().count("ssdtrain-io") == before


@pytest.mark.parametrize("kwargs", [dict(backend="spdk"), dict(io_threads=0),
                                    dict(chunk_bytes=1000), dict(chunk_bytes=0),
                                    dict(watch_us=-1), dict(watch_us=100_001),
                                    dict(watch_us=1.5), dict(watch_us=True)])
def test_bad_arguments_are_config_errors(kwargs):
    with pytest.raises(ConfigError, match="^ssdtrain:"):
        NativeEngine(**kwargs)


# ------------------------------------------------------------------ waking workers

def _one_at_a_time(engine, spill, n, gap_s, nbytes=4 * KiB):
    """``n`` writes, each waited for, ``gap_s`` apart: as a training step's saves come."""
    buf = Buffer(nbytes, 0)
    buf.fill(bytes(range(256)) * (nbytes // 256))
    for i in range(n):
        assert engine.write(spill, i * nbytes, buf.address, nbytes,
                            owner=buf).result(timeout=TIMEOUT) == nbytes
        time.sleep(gap_s)


@pytest.mark.parametrize("watch_us", [0, 100])
def test_a_steady_stream_of_submits_wakes_no_worker(spill_files, watch_us):
    """NOTE [ Waking workers ]: submits that come within the linger of the last piece
    find the watch and make no futex call on the submitting thread (the first one may:
    every worker waited then). Without a watch every submit finds the workers asleep and
    wakes one: the count tells the two apart, so this fails with the watch turned off.
    A loaded machine only adds wakes (a submitting thread or a watch descheduled past the
    linger: 17 of 40 once, in a full suite on 2 cores), so the least of three runs is
    what is compared."""
    n, counts = 40, []
    spill = spill_files(False)
    for _ in range(3):
        engine = NativeEngine(io_threads=2, watch_us=watch_us)
        try:
            _one_at_a_time(engine, spill, n, 0.0003)
            counts.append(engine.wakes())
        finally:
            engine.shutdown()
        if watch_us and counts[-1] <= n // 4:
            break
    if watch_us:
        assert min(counts) <= n // 4, counts  # 1 on a quiet machine
    else:
        assert min(counts) >= n // 2, counts


@settings(max_examples=25, deadline=None)
@given(workers=st.integers(1, 4), watch_us=st.sampled_from([0, 1, 100, 3000]),
       plan=st.lists(st.tuples(st.integers(1, 6), st.sampled_from([0, 5e-5, 1e-3, 3e-3])),
                     min_size=1, max_size=8))
def test_no_request_is_left_queued_with_every_worker_asleep(tmp_path_factory, workers,
                                                            watch_us, plan):
    """Bursts of requests (several pieces each) with gaps shorter and longer than the
    watch's period and its linger: every request ends, with its bytes, well within the
    timeout. A piece left in the queue while every worker waited on `work` (a lost
    wake) would hang here until the timeout."""
    spill = SpillFile(str(tmp_path_factory.mktemp("wake")), "off")
    engine = NativeEngine(io_threads=workers, chunk_bytes=4 * KiB, watch_us=watch_us)
    try:
        offset = 0
        for burst, gap in plan:
            bufs = [Buffer(12 * KiB, 0) for _ in range(burst)]  # three pieces each
            futs = []
            for i, b in enumerate(bufs):
                b.fill(bytes([(offset // KiB + i) % 251]) * b.nbytes)
                futs.append(engine.write(spill, offset + i * b.nbytes, b.address, b.nbytes,
                                         owner=b))
            for f in futs:
                assert f.result(timeout=TIMEOUT) == 12 * KiB
            time.sleep(gap)
            offset += burst * 12 * KiB
        back = Buffer(offset, 0)
        assert engine.read(spill, 0, back.address, offset, owner=back).result(
            timeout=TIMEOUT) == offset
        got = ctypes.string_at(back.address, offset)
        want = b"".join(bytes([(o // KiB + i) % 251]) * 12 * KiB
                        for o, (burst, _) in zip(_starts(plan), plan) for i in range(burst))
        assert got == want
    finally:
        engine.shutdown()
        spill.close()


def _starts(plan):
    """The first offset of each burst of ``plan``."""
    starts, offset = [], 0
    for burst, _ in plan:
        starts.append(offset)
        offset += burst * 12 * KiB
    return starts


def test_shutdown_is_idempotent_and_refuses_new_requests(spill_files):
    engine, spill = NativeEngine(io_threads=2), spill_files(False)
    engine.shutdown()
    engine.shutdown()
    buf = Buffer(100, 0)
    with pytest.raises(RuntimeError, match="shut down"):
        engine.write(spill, 0, buf.address, 100)


# ------------------------------------------------------------------------------- parity

def _parity(tmp_path, engines, spill_files, *, direct, nbytes, misalign, workers, chunk,
            backend, seed):
    data = _payload(nbytes, seed)
    src = Buffer(nbytes, misalign)
    src.fill(data)
    nat, pos = engines("native", workers, chunk, backend), engines("posix", workers, chunk)
    nat_file, pos_file = spill_files(direct), spill_files(direct)
    # Occupy block 0 so the record sits at a non-zero file offset; held, since a slot
    # dropped is freed (NOTE [ Slots are leases ]).
    firsts = [f.alloc(1, 0) for f in (nat_file, pos_file)]
    slot = nat_file.alloc(nbytes, misalign)
    pos_slot = pos_file.alloc(nbytes, misalign)
    assert pos_slot.offset == slot.offset >= BLOCK and len(firsts) == 2

    assert nat.write(nat_file, slot.offset, src.address, nbytes).result(TIMEOUT) == nbytes
    assert pos.write(pos_file, slot.offset, src.address, nbytes).result(TIMEOUT) == nbytes
    assert src.data() == data and src.guards_intact(), "write modified its source memory"

    ref_path = tmp_path / f"reference-{seed}.bin"
    with open(ref_path, "wb") as f:
        f.seek(slot.offset)
        f.write(data)
    reference = ref_path.read_bytes()
    assert _file_bytes(nat_file, slot.offset, nbytes) == reference[slot.offset:] == data
    if direct:
        # Whole blocks, as the posix engine writes them: same file size, same record bytes.
        assert os.fstat(nat_file.fd).st_size == os.fstat(pos_file.fd).st_size
    else:
        assert _whole_file(nat_file) == reference == _whole_file(pos_file)

    # Each engine reads what the other wrote, into memory with the record's misalignment.
    for engine, f in ((nat, nat_file), (nat, pos_file), (pos, nat_file)):
        dst = Buffer(nbytes, slot.offset % BLOCK)
        assert engine.read(f, slot.offset, dst.address, nbytes).result(TIMEOUT) == nbytes
        assert dst.data() == data, f"{engine.name} reading {f is nat_file and 'native' or 'posix'}"
        assert dst.guards_intact(), "read wrote outside its destination"
    if not direct:
        dst = Buffer(nbytes, (misalign + 17) % BLOCK)
        assert nat.read(nat_file, slot.offset, dst.address, nbytes).result(TIMEOUT) == nbytes
        assert dst.data() == data and dst.guards_intact()


@BACKENDS
@MODES
@pytest.mark.parametrize("workers, chunk", WORKERS_CHUNKS,
                         ids=[f"w{w}-c{c // KiB}K" for w, c in WORKERS_CHUNKS])
@pytest.mark.parametrize("misalign", MISALIGNS)
@pytest.mark.parametrize("nbytes", SIZES)
def test_parity_with_posix_and_plain_python(tmp_path, engines, spill_files, backend, direct,
                                            workers, chunk, misalign, nbytes):
    _parity(tmp_path, engines, spill_files, direct=direct, nbytes=nbytes, misalign=misalign,
            workers=workers, chunk=chunk, backend=backend, seed=nbytes * 7 + misalign)


def test_parity_64mib_plus_one(tmp_path, engines, spill_files):
    """Once, large: four 16 MiB chunks plus a 1-byte tail at torch's 64-byte misalignment."""
    _parity(tmp_path, engines, spill_files, direct=True, nbytes=64 * MiB + 1, misalign=64,
            workers=8, chunk=16 * MiB, backend="auto", seed=64)


@BACKENDS
@MODES
@pytest.mark.parametrize("workers, chunk", [(2, 4 * KiB), (8, 16 * MiB)])
def test_many_adjacent_records_concurrently(engines, spill_files, backend, direct, workers,
                                            chunk):
    """Neighbouring slots written and read all at once do not clobber each other (each
    O_DIRECT slot owns its edge blocks; each worker has its own bounce blocks)."""
    rng = random.Random(4321)
    engine, spill = engines("native", workers, chunk, backend), spill_files(direct)
    records = []
    for i in range(64):
        nbytes = rng.choice([1, 100, 4095, 4096, 4097, 9000, 70_000, 300_001])
        src = Buffer(nbytes, rng.choice([0, 1, 64, 2048, 4095]))
        data = _payload(nbytes, i)
        src.fill(data)
        records.append((spill.alloc(nbytes, src.address % BLOCK), src, data))
    futures = [engine.write(spill, s.offset, b.address, s.nbytes) for s, b, _ in records]
    assert [f.result(TIMEOUT) for f in futures] == [s.nbytes for s, _, _ in records]
    for slot, _, data in records:
        assert _file_bytes(spill, slot.offset, slot.nbytes) == data
    dsts = [Buffer(s.nbytes, s.offset % BLOCK) for s, _, _ in records]
    futures = [engine.read(spill, s.offset, d.address, s.nbytes)
               for (s, _, _), d in zip(records, dsts)]
    assert [f.result(TIMEOUT) for f in futures] == [s.nbytes for s, _, _ in records]
    for (_, _, data), dst in zip(records, dsts):
        assert dst.data() == data and dst.guards_intact()


@pytest.mark.parametrize("op", ["write", "read"])
def test_direct_non_congruent_offset_raises(engines, spill_files, op):
    engine, spill = engines(), spill_files(True)
    buf = Buffer(8192, 64)
    slot = spill.alloc(8192, 64)
    with pytest.raises(AssertionError, match="please report"):
        getattr(engine, op)(spill, slot.offset + 1, buf.address, 8192)
    assert buf.guards_intact()


# ------------------------------------------------------------------------------- errors

def _check_spill_io_error(err, expected_errno, spill):
    assert isinstance(err, SpillIOError), f"got {type(err).__name__}: {err}"
    assert err.errno == expected_errno
    assert err.filename == spill.directory
    message = str(err)
    assert message.startswith("ssdtrain:") and f"errno {expected_errno}" in message
    assert "Check free space" in message, "the message must say what to do"


@BACKENDS
@MODES
@pytest.mark.parametrize("op", ["write", "read"])
@pytest.mark.parametrize("nbytes", [100, 64 * KiB])
def test_closed_file_fails_with_ebadf(engines, spill_files, backend, direct, op, nbytes):
    engine, spill = engines("native", 2, 4 * KiB, backend), spill_files(direct)
    buf = Buffer(nbytes, 64)
    slot = spill.alloc(nbytes, 64)
    spill.close()
    future = getattr(engine, op)(spill, slot.offset, buf.address, nbytes)
    _check_spill_io_error(future.exception(timeout=TIMEOUT), errno.EBADF, spill)
    assert buf.guards_intact()


@BACKENDS
@MODES
@pytest.mark.parametrize("written", [0, 5000])
def test_short_read_past_eof_reports_truncation(engines, spill_files, backend, direct, written):
    engine, spill = engines("native", 2, 4 * KiB, backend), spill_files(direct)
    if written:
        src = Buffer(written, 64)
        src.fill(_payload(written, 1))
        engine.write(spill, 64, src.address, written).result(TIMEOUT)
    nbytes = 3 * BLOCK + written  # reaches past the end of the file
    dst = Buffer(nbytes, 64)
    err = engine.read(spill, 64, dst.address, nbytes).exception(timeout=TIMEOUT)
    assert isinstance(err, IntegrityError), f"got {type(err).__name__}: {err}"
    assert str(err).startswith("ssdtrain:") and "truncated" in str(err)
    assert spill.name in str(err)
    assert dst.guards_intact()


@BACKENDS
@MODES
def test_device_full_fails_with_enospc(engines, spill_files, backend, direct):
    engine, spill = engines("native", 2, 4 * KiB, backend), spill_files(direct)
    full = os.open("/dev/full", os.O_RDWR)
    try:
        os.dup2(full, spill.fd)
    finally:
        os.close(full)
    buf = Buffer(20_000, 64)
    slot = spill.alloc(20_000, 64)
    err = engine.write(spill, slot.offset, buf.address, 20_000).exception(timeout=TIMEOUT)
    _check_spill_io_error(err, errno.ENOSPC, spill)


@BACKENDS
def test_range_sync_failure_is_a_spill_io_error(engines, spill_files, backend):
    """Buffered mode: the write succeeds, sync_file_range of the record's blocks fails
    (/dev/null: ESPIPE); the future fails with a SpillIOError naming the call."""
    engine, spill = engines("native", 2, 4 * KiB, backend), spill_files(False)
    null = os.open("/dev/null", os.O_RDWR)
    try:
        os.dup2(null, spill.fd)
    finally:
        os.close(null)
    buf = Buffer(10_000, 0)
    err = engine.write(spill, 0, buf.address, 10_000).exception(timeout=TIMEOUT)
    _check_spill_io_error(err, errno.ESPIPE, spill)
    assert "sync_file_range" in str(err)


@BACKENDS
@pytest.mark.parametrize("misalign", [0, 64])
def test_buffered_records_round_trip_and_leave_the_page_cache(engines, spill_files, backend,
                                                              misalign):
    """Buffered mode with per-record range syncs: neighbouring records written at once
    (each synced and dropped on its own blocks only) read back exactly, and none of
    their pages stays in the page cache once its write completed.

    The file is extended to its final size first, as slots reused in steady state are:
    a write that extends the file re-dirties the page holding the old end of file (the
    kernel zeroes its tail), which may be the previous record's last page, after that
    record's sync (with fdatasync per record as well); that page then stays cached."""
    from test_engine import _resident_pages
    engine, spill = engines("native", 3, 64 * KiB, backend), spill_files(False)
    sizes = [1, 4095, 4097, 65_537, 3 * MiB + 5, 200_000]
    srcs, slots, datas = [], [], []
    for i, n in enumerate(sizes):
        data = _payload(n, 40 + i)
        src = Buffer(n, misalign)
        src.fill(data)
        srcs.append(src), datas.append(data), slots.append(spill.alloc(n, misalign))
    os.ftruncate(spill.fd, max(s.offset + n for s, n in zip(slots, sizes)) + BLOCK)
    futures = [engine.write(spill, s.offset, b.address, n)
               for s, b, n in zip(slots, srcs, sizes)]
    assert [f.result(TIMEOUT) for f in futures] == sizes
    end = max(s.offset + n for s, n in zip(slots, sizes))
    resident, total = _resident_pages(spill.fd, end)
    assert resident == 0, f"{resident} of {total} pages of spilled data still in the page cache"
    for s, n, data in zip(slots, sizes, datas):
        assert _file_bytes(spill, s.offset, n) == data
        dst = Buffer(n, misalign)
        assert engine.read(spill, s.offset, dst.address, n).result(TIMEOUT) == n
        assert dst.data() == data and dst.guards_intact()


# The spill and I/O layers are torch-free: children load them without
# ssdtrain/__init__.py (which imports torch) to start fast.
_CHILD_PRELUDE = textwrap.dedent(r"""
    import ctypes, os, sys, types
    pkg = types.ModuleType("ssdtrain")
    pkg.__path__ = [sys.argv[2]]
    sys.modules["ssdtrain"] = pkg
    from ssdtrain._errors import SpillIOError
    from ssdtrain.io.spill import BLOCK, SpillFile
    from ssdtrain.io.native import NativeEngine
    directory, backend = sys.argv[1], sys.argv[3]
""")

_FSIZE_CHILD = _CHILD_PRELUDE + textwrap.dedent(r"""
    import resource, signal
    n = 4 << 20
    raw = ctypes.create_string_buffer(n + 2 * BLOCK)
    address = -(-ctypes.addressof(raw) // BLOCK) * BLOCK + 64
    engine = NativeEngine(io_threads=2, chunk_bytes=1 << 20, backend=backend)
    files = [SpillFile(directory, "auto"), SpillFile(directory, "off")]
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    for f in files:
        slot = f.alloc(n, address % BLOCK)
        try:
            result = engine.write(f, slot.offset, address, n).result(timeout=30)
        except SpillIOError as e:
            print("SPILLIOERROR", "direct" if f.direct else "buffered", e.errno, flush=True)
        except BaseException as e:
            print("OTHER", type(e).__name__, e, flush=True)
        else:
            print("NOERROR", result, flush=True)
    engine.shutdown()
    for f in files:
        f.close()
""")


def _run_child(code, tmp_path, backend, timeout=60):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SSDTRAIN_")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    try:
        return subprocess.run([sys.executable, "-c", code, str(tmp_path), str(REPO / "ssdtrain"),
                               backend], env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"child hung for {timeout} s (deadlock?); stdout: {e.stdout!r}")


@BACKENDS
def test_write_past_rlimit_fsize_fails_with_efbig(tmp_path, backend):
    r = _run_child(_FSIZE_CHILD, tmp_path, backend)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-2000:])
    lines = r.stdout.splitlines()
    assert f"SPILLIOERROR buffered {errno.EFBIG}" in lines, r.stdout
    if _fs_kind(tmp_path) in ("ext4", "xfs", "btrfs"):
        assert f"SPILLIOERROR direct {errno.EFBIG}" in lines, r.stdout
    assert errno.EFBIG == 27


# ----------------------------------------------------------------------------- shutdown

_SHUTDOWN_CHILD = _CHILD_PRELUDE + textwrap.dedent(r"""
    import gc, threading, time
    scenario = sys.argv[4]
    n, count = 256 << 10, 64
    raw = ctypes.create_string_buffer(n + 2 * BLOCK)
    address = -(-ctypes.addressof(raw) // BLOCK) * BLOCK
    f = SpillFile(directory, "off")
    engine = NativeEngine(io_threads=2, chunk_bytes=64 << 10, backend=backend)
    slots = [f.alloc(n, 0) for _ in range(count)]
    called = []

    def slow_callback(future):  # runs on a worker, holding the GIL, while others queue
        time.sleep(0.002)
        called.append(future.result())

    futures = []
    for i, s in enumerate(slots):
        fut = engine.write(f, s.offset, address, n)
        fut.add_done_callback(slow_callback)
        futures.append(fut)
    if scenario == "shutdown":
        engine.shutdown()  # main thread holds the GIL until the call releases it
        assert all(x.done() for x in futures), "shutdown returned before the queue drained"
        assert len(called) == count, len(called)
    elif scenario == "collect":
        del engine  # the destructor runs with the GIL held, workers still need it
        gc.collect()
        assert all(x.done() for x in futures)
    elif scenario == "drop_in_callback":
        # The last reference to the engine dies inside a callback, on a worker thread:
        # its destructor then runs there and must neither join itself nor deadlock.
        holder, dropped = [engine], threading.Event()
        del engine

        def drop(err, message):
            holder.clear()
            dropped.set()

        holder[0]._engine.submit_write(f.fd, False, slots[0].offset, address, n, f.name, drop)
        assert dropped.wait(30)
        for x in futures:
            x.result(timeout=30)
    elif scenario == "exit":
        pass  # interpreter exit with requests in flight and no shutdown()
    print("OK", scenario, flush=True)
""")


@BACKENDS
@pytest.mark.parametrize("scenario", ["shutdown", "collect", "drop_in_callback", "exit"])
def test_shutdown_with_requests_in_flight_does_not_deadlock(tmp_path, backend, scenario):
    """Workers need the GIL to run callbacks; the thread that stops the engine must not
    hold it while it waits for them (NOTE [ Completions, the GIL and shutdown ])."""
    code = _SHUTDOWN_CHILD.replace("scenario = sys.argv[4]", f"scenario = {scenario!r}")
    r = _run_child(code, tmp_path, backend)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-3000:])
    assert f"OK {scenario}" in r.stdout.splitlines()
    assert "Traceback" not in r.stderr, r.stderr[-3000:]


def test_callback_errors_do_not_kill_workers(engines, spill_files, monkeypatch):
    """A Python exception raised in a completion is reported as unraisable; the worker
    survives and the engine keeps serving."""
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    engine, spill = engines("native", 1, 4 * KiB), spill_files(False)
    buf = Buffer(10, 0)
    raw = _C.Engine(1, 4096, "threads")
    seen = []

    def bad(err, message):
        seen.append(err)
        raise ValueError("boom")

    try:
        raw.submit_write(spill.fd, False, 0, buf.address, 10, spill.name, bad)
    finally:
        raw.shutdown()
    assert seen == [0]
    assert [type(u.exc_value) for u in unraisable] == [ValueError]
    assert engine.write(spill, 0, buf.address, 10).result(TIMEOUT) == 10


# -------------------------------------------------------------------------------- CRC32C

def _crc32c_reference(data: bytes, crc: int = 0) -> int:
    """Bit-by-bit CRC32C (reflected Castagnoli polynomial 0x82F63B78)."""
    crc ^= 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
    return crc ^ 0xFFFFFFFF


def _crc_of(fn, data: bytes, misalign: int = 0, seed: int = 0) -> int:
    buf = Buffer(len(data), misalign)
    buf.fill(data)
    return fn(buf.address, len(data), seed)


CRCS = pytest.mark.parametrize("fn", [_C.crc32c, _C.crc32c_table], ids=["auto", "table"])


@CRCS
@pytest.mark.parametrize("data, expected", [
    (b"123456789", 0xE3069283),
    (b"", 0),
    (bytes(32), 0x8A9136AA),  # RFC 3720 B.4
    (b"\xff" * 32, 0x62A8AB43),
    (bytes(range(32)), 0x46DD794E),
    (bytes(range(31, -1, -1)), 0x113FDB5C),
], ids=["check", "empty", "zeros", "ones", "incrementing", "decrementing"])
def test_crc32c_known_vectors(fn, data, expected):
    assert _crc_of(fn, data) == expected
    assert _crc32c_reference(data) == expected


@CRCS
def test_crc32c_matches_reference_on_random_data(fn):
    rng = random.Random(32)
    for size in [1, 7, 8, 9, 15, 63, 64, 65, 1000, 4097, 20_000]:
        data = rng.randbytes(size)
        for misalign in (0, 1, 3, 7):
            assert _crc_of(fn, data, misalign) == _crc32c_reference(data), (size, misalign)


@CRCS
def test_crc32c_seed_extends(fn):
    data = random.Random(5).randbytes(10_000)
    for cut in (0, 1, 4095, 9999, 10_000):
        first = _crc_of(fn, data[:cut])
        assert _crc_of(fn, data[cut:], seed=first) == _crc_of(fn, data), cut


def test_crc32c_hardware_and_table_agree_on_large_buffers():
    data = random.Random(9).randbytes(3 * MiB + 5)
    buf = Buffer(len(data), 64)
    buf.fill(data)
    assert _C.crc32c(buf.address, len(data)) == _C.crc32c_table(buf.address, len(data))
    assert isinstance(_C.crc32c_hardware, bool)


LANE = 8192  # csrc/engine/crc32c.cpp, NOTE [ Three CRC streams ]


@settings(max_examples=60, deadline=None)
@given(blocks=st.integers(0, 5), extra=st.integers(-9, 9), misalign=st.integers(0, 7),
       seed=st.integers(0, 2**32 - 1), data_seed=st.integers(0, 2**32 - 1))
def test_crc32c_three_streams_agree_with_the_table(blocks, extra, misalign, seed, data_seed):
    """The hardware CRC runs three interleaved streams over whole groups of 3 x 8 KiB
    and joins them; lengths around those group boundaries, any start alignment and any
    seed give the table method's result."""
    size = max(0, blocks * 3 * LANE + extra)
    data = random.Random(data_seed).randbytes(size)
    assert _crc_of(_C.crc32c, data, misalign, seed) == _crc_of(_C.crc32c_table, data, misalign,
                                                               seed)
