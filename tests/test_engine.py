"""The ``posix`` I/O engine (``ssdtrain/io/posix.py``) against plain Python.

What the engine writes is compared with a reference file written by plain Python
(``f.seek(offset); f.write(data)``) and with ``os.pread`` of the spill file, over odd
sizes, unaligned memory addresses, worker counts and chunk sizes, on ``O_DIRECT`` and
buffered files. On ``O_DIRECT`` files the file offset is congruent to the address
modulo 4096 (NOTE [ Zero-copy O_DIRECT from unaligned tensors ]), as ``SpillFile.alloc``
arranges. Error paths are injected (closed file, short file, ``RLIMIT_FSIZE``, a full
device, a failing ``fdatasync``); every future must complete, never hang.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import ssdtrain
from ssdtrain import SpillIOError
from ssdtrain.io.spill import BLOCK, SpillFile, filesystem_type
from ssdtrain.io.posix import PosixEngine, memory_at

KiB, MiB = 1 << 10, 1 << 20
REPO = Path(ssdtrain.__file__).resolve().parent.parent
TIMEOUT = 10  # seconds; a future that takes longer is treated as hung
GUARD = 0xA5  # fill byte around buffers: the engine must not touch memory outside a request

SIZES = [0, 1, 511, 512, 4095, 4096, 4097, MiB + 13]
MISALIGNS = [0, 1, 64, 4095]
WORKERS_CHUNKS = [(1, 4 * KiB), (2, 4 * KiB), (8, 4 * KiB), (1, 16 * MiB), (2, 16 * MiB),
                  (8, 16 * MiB)]


# ------------------------------------------------------------------------------ helpers

class Buffer:
    """``nbytes`` of memory at an address with a chosen remainder modulo ``BLOCK``,
    surrounded by at least one block of guard bytes on each side."""

    def __init__(self, nbytes: int, misalign: int):
        self.nbytes = nbytes
        self.raw = ctypes.create_string_buffer(nbytes + misalign + 4 * BLOCK)
        base = ctypes.addressof(self.raw)
        self.address = -(-base // BLOCK) * BLOCK + BLOCK + misalign
        assert self.address % BLOCK == misalign
        assert self.address + nbytes + BLOCK <= base + len(self.raw)
        ctypes.memset(self.raw, GUARD, len(self.raw))

    def fill(self, data: bytes):
        assert len(data) == self.nbytes
        ctypes.memmove(self.address, data, self.nbytes)

    def data(self) -> bytes:
        return ctypes.string_at(self.address, self.nbytes)

    def guards_intact(self) -> bool:
        base = ctypes.addressof(self.raw)
        before = ctypes.string_at(base, self.address - base)
        after = ctypes.string_at(self.address + self.nbytes,
                                 base + len(self.raw) - self.address - self.nbytes)
        return before.count(GUARD) == len(before) and after.count(GUARD) == len(after)


def _payload(nbytes: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(nbytes)


def _file_bytes(spill: SpillFile, offset: int, nbytes: int) -> bytes:
    """What the spill file holds, read through the page cache (never O_DIRECT)."""
    if not spill.direct:
        return os.pread(spill.fd, nbytes, offset)
    fd = os.open(f"/proc/self/fd/{spill.fd}", os.O_RDONLY)
    try:
        return os.pread(fd, nbytes, offset)
    finally:
        os.close(fd)


def _whole_file(spill: SpillFile) -> bytes:
    return _file_bytes(spill, 0, os.fstat(spill.fd).st_size)


def _fs_kind(path) -> str:
    return filesystem_type(str(path))


@pytest.fixture
def engines():
    made = []

    def make(workers=2, chunk=16 * MiB):
        e = PosixEngine(io_threads=workers, chunk_bytes=chunk)
        made.append(e)
        return e

    yield make
    for e in made:
        e.shutdown()


@pytest.fixture
def spill_files(tmp_path):
    made = []

    def make(direct: bool):
        f = SpillFile(str(tmp_path), "auto" if direct else "off")
        if direct and not f.direct:
            f.close()
            pytest.skip(f"{tmp_path} ({_fs_kind(tmp_path)!r}) does not support O_DIRECT")
        made.append(f)
        return f

    yield make
    for f in made:
        f.close()


MODES = pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])


# --------------------------------------------------------------------------- round trip

def _round_trip(tmp_path, engine, spill, nbytes, misalign, seed):
    data = _payload(nbytes, seed)
    src = Buffer(nbytes, misalign)
    src.fill(data)
    first = spill.alloc(1, 0)  # occupy block 0 so the record sits at a non-zero file offset
    slot = spill.alloc(nbytes, src.address % BLOCK)
    assert first.file is spill  # held: a slot dropped is freed (NOTE [ Slots are leases ])
    assert slot.offset % BLOCK == misalign and slot.offset >= BLOCK

    assert engine.write(spill, slot.offset, src.address, nbytes).result(TIMEOUT) == nbytes
    assert src.data() == data and src.guards_intact(), "write modified its source memory"

    # The reference: the same bytes at the same offset, written by plain Python.
    ref_path = tmp_path / f"reference-{seed}.bin"
    with open(ref_path, "wb") as f:
        f.seek(slot.offset)
        f.write(data)
    reference = ref_path.read_bytes()
    assert _file_bytes(spill, slot.offset, nbytes) == reference[slot.offset:] == data
    if spill.direct:
        # Whole blocks: the file ends at the end of the record's last block.
        assert os.fstat(spill.fd).st_size == -(-(slot.offset + nbytes) // BLOCK) * BLOCK \
            or nbytes == 0
    else:
        assert _whole_file(spill) == reference, "buffered file differs from the reference"

    # Read back into memory with the same misalignment (O_DIRECT needs it) ...
    dst = Buffer(nbytes, slot.offset % BLOCK)
    assert engine.read(spill, slot.offset, dst.address, nbytes).result(TIMEOUT) == nbytes
    assert dst.data() == data
    assert dst.guards_intact(), "read wrote outside its destination"
    if not spill.direct:
        # ... and, where no alignment is needed, with a different one.
        dst2 = Buffer(nbytes, (misalign + 17) % BLOCK)
        assert engine.read(spill, slot.offset, dst2.address, nbytes).result(TIMEOUT) == nbytes
        assert dst2.data() == data and dst2.guards_intact()


@MODES
@pytest.mark.parametrize("workers, chunk", WORKERS_CHUNKS,
                         ids=[f"w{w}-c{c // KiB}K" for w, c in WORKERS_CHUNKS])
@pytest.mark.parametrize("misalign", MISALIGNS)
@pytest.mark.parametrize("nbytes", SIZES)
def test_round_trip(tmp_path, engines, spill_files, direct, workers, chunk, misalign, nbytes):
    _round_trip(tmp_path, engines(workers, chunk), spill_files(direct), nbytes, misalign,
                seed=nbytes * 7 + misalign)


def test_round_trip_64mib_plus_one(tmp_path, engines, spill_files):
    """Once, large: several 16 MiB chunks plus a 1-byte tail, torch's 64-byte misalignment."""
    _round_trip(tmp_path, engines(8, 16 * MiB), spill_files(True), 64 * MiB + 1, 64, seed=64)


@MODES
@pytest.mark.parametrize("workers, chunk", [(2, 4 * KiB), (8, 16 * MiB)])
def test_many_adjacent_records_concurrently(engines, spill_files, direct, workers, chunk):
    """Records in neighbouring slots, written and read all at once, do not clobber each
    other: on O_DIRECT files each slot owns its partial edge blocks."""
    rng = random.Random(1234)
    engine, spill = engines(workers, chunk), spill_files(direct)
    records = []
    for i in range(48):
        nbytes = rng.choice([1, 100, 4095, 4096, 4097, 9000, 70_000])
        src = Buffer(nbytes, rng.choice([0, 1, 64, 2048, 4095]))
        data = _payload(nbytes, i)
        src.fill(data)
        slot = spill.alloc(nbytes, src.address % BLOCK)
        records.append((slot, src, data))
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


def test_buffered_accepts_any_offset(engines, spill_files):
    engine, spill = engines(2, 4 * KiB), spill_files(False)
    src = Buffer(10_000, 0)
    data = _payload(10_000, 5)
    src.fill(data)
    engine.write(spill, 4096 + 3, src.address, 10_000).result(TIMEOUT)
    assert os.pread(spill.fd, 10_000, 4096 + 3) == data
    dst = Buffer(10_000, 100)
    engine.read(spill, 4096 + 3, dst.address, 10_000).result(TIMEOUT)
    assert dst.data() == data and dst.guards_intact()


@pytest.mark.parametrize("op", ["write", "read"])
def test_direct_non_congruent_offset_raises(engines, spill_files, op):
    engine, spill = engines(), spill_files(True)
    buf = Buffer(8192, 64)
    slot = spill.alloc(8192, 64)
    with pytest.raises(AssertionError, match="please report"):
        getattr(engine, op)(spill, slot.offset + 1, buf.address, 8192)
    with pytest.raises(AssertionError, match="please report"):
        getattr(engine, op)(spill, slot.offset - 64, buf.address, 8192)
    assert buf.guards_intact()


def test_memory_at_is_a_writable_view():
    raw = ctypes.create_string_buffer(b"abcdef")
    view = memory_at(ctypes.addressof(raw) + 1, 3)
    assert bytes(view) == b"bcd" and view.format == "B" and not view.readonly
    view[0] = ord("X")
    assert raw.value == b"aXcdef"


# ------------------------------------------------------------------------------- errors

@MODES
@pytest.mark.parametrize("op", ["write", "read"])
@pytest.mark.parametrize("nbytes", [100, 64 * KiB])
def test_closed_file_fails_with_ebadf(engines, spill_files, tmp_path, direct, op, nbytes):
    engine, spill = engines(2, 4 * KiB), spill_files(direct)
    buf = Buffer(nbytes, 64)
    slot = spill.alloc(nbytes, 64)
    spill.close()
    future = getattr(engine, op)(spill, slot.offset, buf.address, nbytes)
    with pytest.raises(SpillIOError) as excinfo:
        future.result(timeout=TIMEOUT)
    err = excinfo.value
    assert err.errno == errno.EBADF == 9
    assert err.filename == str(tmp_path)
    assert str(err).startswith("ssdtrain:") and "errno 9" in str(err)
    assert isinstance(err, OSError) and isinstance(err, ssdtrain.SSDTrainError)
    assert buf.guards_intact()


@MODES
@pytest.mark.parametrize("written", [0, 5000])
def test_short_read_reports_truncation(engines, spill_files, direct, written):
    engine, spill = engines(2, 4 * KiB), spill_files(direct)
    if written:
        src = Buffer(written, 64)
        src.fill(_payload(written, 1))
        engine.write(spill, 64, src.address, written).result(TIMEOUT)
    nbytes = 3 * BLOCK + written  # reaches past the end of the file
    dst = Buffer(nbytes, 64)
    with pytest.raises(ssdtrain.IntegrityError, match="truncated") as excinfo:
        engine.read(spill, 64, dst.address, nbytes).result(timeout=TIMEOUT)
    assert str(excinfo.value).startswith("ssdtrain:") and spill.name in str(excinfo.value)
    assert dst.guards_intact()


@MODES
def test_device_full_fails_with_enospc(engines, spill_files, direct):
    """Fault injection: the spill file's descriptor is replaced by /dev/full."""
    engine, spill = engines(2, 4 * KiB), spill_files(direct)
    full = os.open("/dev/full", os.O_RDWR)
    try:
        os.dup2(full, spill.fd)
    finally:
        os.close(full)
    buf = Buffer(20_000, 64)
    slot = spill.alloc(20_000, 64)
    with pytest.raises(SpillIOError) as excinfo:
        engine.write(spill, slot.offset, buf.address, 20_000).result(timeout=TIMEOUT)
    assert excinfo.value.errno == errno.ENOSPC


def test_range_sync_failure_is_a_spill_io_error(engines, spill_files):
    """Fault injection: pwrite succeeds, the step that writes the record's pages out of
    the page cache fails (here: /dev/null, where sync_file_range fails with ESPIPE).
    The caller must still get a SpillIOError with errno, as for any other I/O failure,
    not a bare OSError."""
    engine, spill = engines(2, 4 * KiB), spill_files(False)
    null = os.open("/dev/null", os.O_RDWR)
    try:
        os.dup2(null, spill.fd)
    finally:
        os.close(null)
    buf = Buffer(10_000, 0)
    future = engine.write(spill, 0, buf.address, 10_000)
    exc = future.exception(timeout=TIMEOUT)
    assert isinstance(exc, SpillIOError), f"got {type(exc).__name__}: {exc}"
    assert exc.errno == errno.ESPIPE and "sync_file_range" in str(exc), exc


_FSIZE_CHILD = textwrap.dedent(r"""
    import ctypes, os, resource, signal, sys, types
    # The spill and I/O layers are torch-free: load them without ssdtrain/__init__.py
    # (which imports torch) to keep this child fast.
    pkg = types.ModuleType("ssdtrain")
    pkg.__path__ = [sys.argv[2]]
    sys.modules["ssdtrain"] = pkg
    from ssdtrain._errors import SpillIOError
    from ssdtrain.io.spill import BLOCK, SpillFile
    from ssdtrain.io.posix import PosixEngine

    directory = sys.argv[1]
    n = 4 << 20
    raw = ctypes.create_string_buffer(n + 2 * BLOCK)
    address = -(-ctypes.addressof(raw) // BLOCK) * BLOCK + 64
    engine = PosixEngine(io_threads=2, chunk_bytes=1 << 20)
    files = [SpillFile(directory, "auto"), SpillFile(directory, "off")]
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    for f in files:
        slot = f.alloc(n, address % BLOCK)
        try:
            f_result = engine.write(f, slot.offset, address, n).result(timeout=30)
        except SpillIOError as e:
            print("SPILLIOERROR", "direct" if f.direct else "buffered", e.errno, flush=True)
        except BaseException as e:
            print("OTHER", type(e).__name__, e, flush=True)
        else:
            print("NOERROR", f_result, flush=True)
    engine.shutdown()
    for f in files:
        f.close()
""")


def test_write_past_rlimit_fsize_fails_with_efbig(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SSDTRAIN_")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", _FSIZE_CHILD, str(tmp_path),
                        str(REPO / "ssdtrain")], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-2000:])
    lines = r.stdout.splitlines()
    expected_direct = "direct" if _fs_kind(tmp_path) in ("ext4", "xfs", "btrfs") else None
    assert f"SPILLIOERROR buffered {errno.EFBIG}" in lines, r.stdout
    if expected_direct:
        assert f"SPILLIOERROR direct {errno.EFBIG}" in lines, r.stdout
    assert errno.EFBIG == 27


# --------------------------------------------------------------------------- page cache

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
_MAP_FAILED = ctypes.c_void_p(-1).value


def _resident_pages(fd: int, length: int) -> tuple[int, int]:
    """(resident, total) page-cache pages of the file's first ``length`` bytes (mincore)."""
    addr = _libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr in (None, _MAP_FAILED):
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    try:
        npages = -(-length // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * npages)()
        if _libc.mincore(addr, length, vec) != 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))
        return sum(v & 1 for v in vec), npages
    finally:
        _libc.munmap(addr, length)


@pytest.mark.parametrize("direct, misalign", [(True, 64), (False, 0), (False, 64)],
                         ids=["direct-64", "buffered-0", "buffered-64"])
def test_written_data_leaves_the_page_cache(tmp_path, engines, spill_files, direct, misalign):
    """After a write completes, none of the record's pages stay in the page cache.

    Misalignment 64 is what torch CPU tensors have: the record then starts and ends
    inside a page, and those pages (the slot owns them) must go too."""
    n = 64 * MiB
    data = _payload(n, 99)
    src = Buffer(n, misalign)
    src.fill(data)

    # Control: the same write with plain pwrite stays in the page cache, so mincore
    # really sees resident pages here (otherwise the check below would prove nothing).
    with open(tmp_path / "control.bin", "w+b") as f:
        os.pwrite(f.fileno(), data, 0)
        resident, total = _resident_pages(f.fileno(), n)
    if resident < total // 2:
        pytest.skip(f"page cache check unreliable here: only {resident}/{total} pages of a "
                    f"fresh plain write are resident (memory pressure?)")
    os.unlink(tmp_path / "control.bin")

    engine, spill = engines(2, 16 * MiB), spill_files(direct)
    slot = spill.alloc(n, misalign)
    assert engine.write(spill, slot.offset, src.address, n).result(timeout=60) == n
    resident, total = _resident_pages(spill.fd, slot.offset + n)
    assert resident == 0, f"{resident} of {total} pages of spilled data still in the page cache"
    dst = Buffer(n, misalign)
    engine.read(spill, slot.offset, dst.address, n).result(timeout=60)
    assert dst.data() == data
