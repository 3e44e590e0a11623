"""ReadBuffers (ssdtrain/io/readbuf.py): the bounded pool reads land in.

Pool-level: no Offloader. What is checked is what the store relies on: where a
read lands (the address congruence O_DIRECT needs, alignment for views of any
dtype), that two live storages never share a block (an in-place read of whole
blocks would write another record's bytes), that the number of mappings follows
the bytes in use and not the number of records (one mapping per record passed
``vm.max_map_count`` with tens of thousands of small records), that idle memory
is bounded, and that finalizers running inside a garbage collection or a
KeyboardInterrupt at any line leave the pool consistent and working.
"""

import collections
import ctypes
import gc
import os
import random
import sys
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from ssdtrain.io import readbuf as _readbuf
from ssdtrain.io.readbuf import SLAB_BYTES, SMALL_BYTES, ReadBuffers, unmap_now
from ssdtrain.io.spill import BLOCK, align_down, align_up

_SOURCE = _readbuf.__file__
_MISALIGNS = (0, 1, 2, 7, 15, 16, 17, 31, 4079, 4080, 4081, 4094, 4095)


@pytest.fixture(autouse=True, scope="module")
def _young_gc():
    """Full collections here scan only what these tests made (as after conftest's freeze):
    torch's own objects would make each gc.collect() cost tens of milliseconds."""
    gc.collect()
    gc.freeze()
    yield


# -- helpers -----------------------------------------------------------------------------

def _span(s):
    """The whole blocks storage ``s`` lies in: what an in-place whole-block read may write."""
    p = s.data_ptr()
    return align_down(p), align_up(p + s.nbytes())


def _assert_disjoint(storages):
    spans = sorted(_span(s) for s in storages if s.nbytes())
    for (lo0, hi0), (lo1, hi1) in zip(spans, spans[1:]):
        assert hi0 <= lo1, f"live storages share blocks: [{lo0:#x}, {hi0:#x}), [{lo1:#x}, {hi1:#x})"


def _base(mm):
    return torch.frombuffer(mm, dtype=torch.uint8).data_ptr()  # holds no buffer export


def _assert_owned(pool, storages):
    """Every live storage lies in a mapping the pool still holds, on blocks marked in use."""
    slabs = [(_base(slab.mm), slab) for slab in pool._slabs]
    large = {_base(piece.mm): piece for piece in pool._out}
    for s in storages:
        if not s.nbytes():
            continue
        lo, hi = _span(s)
        if lo in large:
            assert hi - lo <= large[lo].size
            continue
        for base, slab in slabs:
            if base <= lo < base + SLAB_BYTES:
                assert hi <= base + SLAB_BYTES
                marks = slab.used[(lo - base) // BLOCK:(hi - base) // BLOCK]
                assert marks == b"\x01" * len(marks), "a live storage's blocks are marked free"
                break
        else:
            raise AssertionError(f"a live storage at {lo:#x} is in no mapping the pool holds")


def _fill(s, byte):
    ctypes.memset(s.data_ptr(), byte, s.nbytes())


def _holds(s, byte):
    return ctypes.string_at(s.data_ptr(), s.nbytes()) == bytes([byte]) * s.nbytes()


def _vma_count():
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


class _Cycle:
    """Holds a view of a storage in a reference cycle: only the cyclic GC frees it."""

    def __init__(self, s):
        self.me = self
        self.view = torch.empty(0, dtype=torch.uint8).set_(s)


def _random_request(rng):
    kind = rng.random()
    if kind < 0.6:
        nbytes = rng.randrange(1, 200)
    elif kind < 0.9:
        nbytes = rng.choice([BLOCK - 1, BLOCK, BLOCK + 1, SMALL_BYTES - BLOCK - 15,
                             SMALL_BYTES - 16, SMALL_BYTES, rng.randrange(1, SMALL_BYTES)])
    else:
        nbytes = rng.randrange(SMALL_BYTES, 3 * SMALL_BYTES)
    return rng.randrange(BLOCK), rng.randrange(16), nbytes


# -- addresses ---------------------------------------------------------------------------

@pytest.mark.parametrize("nbytes", [1, 15, 16, 17, BLOCK - 1, BLOCK, BLOCK + 1,
                                    SMALL_BYTES - BLOCK - 16, SMALL_BYTES - 1, SMALL_BYTES,
                                    SMALL_BYTES + 1, (1 << 20) + 3])
def test_address_congruence_and_alignment(nbytes):
    pool = ReadBuffers(limit=64 << 20)
    live = []
    for misalign in _MISALIGNS:
        for lead in range(16):
            s = pool.storage(misalign, lead, nbytes)
            p = s.data_ptr()
            assert s.nbytes() == lead + nbytes
            assert s.device.type == "cpu"
            assert (p + lead) % BLOCK == misalign, (misalign, lead, p)
            if (misalign - lead) % 16 == 0:
                assert p % 16 == 0, (misalign, lead, p)
                for dtype in (torch.float64, torch.int32, torch.bfloat16):
                    size = torch.tensor([], dtype=dtype).element_size()
                    if lead % size or nbytes < size:
                        continue
                    v = torch.empty(0, dtype=dtype).set_(s, lead // size, (nbytes // size,))
                    v.fill_(3)
                    assert v.data_ptr() == p + lead and bool((v == 3).all())
            live.append(s)
    _assert_disjoint(live)
    _assert_owned(pool, live)
    for i, s in enumerate(live):
        _fill(s, i % 251 + 1)
    assert all(_holds(s, i % 251 + 1) for i, s in enumerate(live))
    pool.check_invariants()


def test_empty_request_and_bad_arguments():
    pool = ReadBuffers(limit=0)
    assert pool.storage(123, 0, 0).nbytes() == 0
    assert pool.mappings() == 0
    for args in [(BLOCK, 0, 1), (-1, 0, 1), (0, 16, 1), (0, -1, 1), (0, 0, -1)]:
        with pytest.raises(ValueError, match="ssdtrain: read buffer request"):
            pool.storage(*args)
    assert pool.mappings() == 0
    pool.check_invariants()


def test_read_into_storage_smoke(tmp_path):
    """preadv into the read target, and a whole-block read done in place as an O_DIRECT
    engine may do it, land the file's bytes and leave neighbouring storages intact."""
    pool = ReadBuffers(limit=1 << 20)
    path = tmp_path / "data"
    payload = bytes(random.Random(0).randrange(256) for _ in range(5 * BLOCK))
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        assert os.pwrite(fd, payload, 0) == len(payload)
        for offset, nbytes, lead in [(100, 5000, 4), (BLOCK, BLOCK, 0), (4095, 2, 15),
                                     (7, 9000, 7)]:
            neighbours = [pool.storage(offset % BLOCK, lead, nbytes) for _ in range(3)]
            s = pool.storage(offset % BLOCK, lead, nbytes)
            neighbours += [pool.storage(offset % BLOCK, lead, nbytes) for _ in range(3)]
            for n in neighbours:
                _fill(n, 0xEE)
            # Plain preadv at the read address.
            target = (ctypes.c_char * nbytes).from_address(s.data_ptr() + lead)
            assert os.preadv(fd, [target], offset) == nbytes
            view = torch.empty(0, dtype=torch.uint8).set_(s, lead, (nbytes,))
            assert bytes(view.tolist()) == payload[offset:offset + nbytes]
            # Whole blocks, in place: the file offset and the address share their misalignment.
            address = s.data_ptr() + lead
            lo, hi = align_down(address), align_up(address + nbytes)
            _fill(s, 0)
            blocks = (ctypes.c_char * (hi - lo)).from_address(lo)
            got = os.preadv(fd, [blocks], align_down(offset))
            assert got >= min(hi - lo, len(payload) - align_down(offset))
            assert bytes(view.tolist()) == payload[offset:offset + nbytes]
            assert all(_holds(n, 0xEE) for n in neighbours)
    finally:
        os.close(fd)


# -- pieces never overlap ------------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_alloc_free_never_overlaps(seed):
    rng = random.Random(seed)
    pool = ReadBuffers(limit=rng.choice([0, 1 << 20, 16 << 20]))
    live, garbage = {}, []
    for step in range(1500):
        op = rng.random()
        if op < 0.55 or not live:
            s = pool.storage(*_random_request(rng))
            _fill(s, step % 251 + 1)
            live[step % 251 + 1 + 256 * step] = s
        elif op < 0.75:
            del live[rng.choice(list(live))]
        elif op < 0.85:  # only the cyclic GC can free this one
            key = rng.choice(list(live))
            garbage.append(_Cycle(live.pop(key)))
            garbage = garbage[-1:] if rng.random() < 0.5 else garbage
        elif op < 0.9:
            gc.collect()
        elif op < 0.97:
            pool.collect()
        else:
            pool.trim()
        pool.check_invariants()
        if step % 25 == 0 or step == 1499:
            storages = list(live.values())
            _assert_disjoint(storages)
            _assert_owned(pool, storages)
            assert all(_holds(s, key % 256) for key, s in live.items())
    del live, garbage, storages, s
    gc.collect()
    pool.trim()
    assert pool.mappings() == 0 and pool.mapped_bytes() == 0


class PoolMachine(RuleBasedStateMachine):
    """Random hand-outs and deaths (by refcount and by the cyclic GC), collects and trims:
    live storages keep their bytes and never share a block; the books stay consistent."""

    def __init__(self):
        super().__init__()
        self.pool = ReadBuffers(limit=2 << 20)
        self.live = []  # (storage, byte it was filled with)
        self.garbage = []
        self.n = 0

    @rule(misalign=st.sampled_from(_MISALIGNS) | st.integers(0, BLOCK - 1),
          lead=st.integers(0, 15),
          nbytes=st.sampled_from([1, 16, BLOCK, BLOCK + 1, SMALL_BYTES - BLOCK, SMALL_BYTES,
                                  SMALL_BYTES + 1]) | st.integers(1, 2 * SMALL_BYTES))
    def take(self, misalign, lead, nbytes):
        s = self.pool.storage(misalign, lead, nbytes)
        assert (s.data_ptr() + lead) % BLOCK == misalign
        self.n += 1
        _fill(s, self.n % 255 + 1)
        self.live.append((s, self.n % 255 + 1))

    @rule(data=st.data())
    def drop(self, data):
        if self.live:
            del self.live[data.draw(st.integers(0, len(self.live) - 1))]

    @rule(data=st.data())
    def drop_into_cycle(self, data):
        if self.live:
            s, _ = self.live.pop(data.draw(st.integers(0, len(self.live) - 1)))
            self.garbage.append(_Cycle(s))
            del s
            self.garbage.clear()

    @rule()
    def collect_garbage(self):
        gc.collect()

    @rule()
    def collect(self):
        self.pool.collect()

    @rule()
    def trim(self):
        self.pool.trim()
        assert self.pool.idle_bytes() == 0

    @rule(on=st.booleans())
    def watch(self, on):
        self.pool.watching = on

    @rule()
    def trim_unused(self):
        self.pool.collect()
        before = self.pool.idle_bytes()
        self.pool.trim_unused()
        assert self.pool.idle_bytes() <= before

    @invariant()
    def consistent(self):
        self.pool.check_invariants()
        storages = [s for s, _ in self.live]
        _assert_disjoint(storages)
        _assert_owned(self.pool, storages)
        assert all(_holds(s, b) for s, b in self.live)

    def teardown(self):
        self.live.clear()
        gc.collect()
        self.pool.trim()
        assert self.pool.mappings() == 0


PoolMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
test_pool_machine = PoolMachine.TestCase


# -- bounded mappings and idle memory --------------------------------------------------------

def test_100k_tiny_storages_use_few_mappings():
    """100,000 small records alive at once take slabs, not 100,000 mappings (one mapping
    per record passed vm.max_map_count = 65,530); freed, then taken again, likewise."""
    rng = random.Random(3)
    pool = ReadBuffers(limit=8 << 20)
    vmas = _vma_count()

    def take(count):
        return [pool.storage(rng.randrange(BLOCK), rng.randrange(16), rng.randrange(1, 64))
                for _ in range(count)]

    def bound(storages):  # slabs for the blocks in use, nearly full, plus the spare
        blocks = sum((hi - lo) // BLOCK for lo, hi in map(_span, storages))
        return blocks // (SLAB_BYTES // BLOCK // 2) + 2

    live = take(100_000)
    assert pool.mappings() <= bound(live) < 250
    assert _vma_count() - vmas < 2_000  # slabs, plus what Python and torch allocated
    _assert_disjoint(live[::97])
    # Free a random half (leaving holes in every slab) and take 50,000 more: the holes
    # are reused, the mappings stay bounded by the bytes in use.
    rng.shuffle(live)
    del live[50_000:]
    live += take(50_000)
    assert pool.mappings() <= bound(live) + 2
    pool.check_invariants()
    del live
    pool.collect()
    assert pool.idle_bytes() <= 8 << 20 or pool.mappings() == 1
    live = take(100_000)  # and again, from the pool
    assert pool.mappings() <= bound(live)
    del live
    pool.trim()
    assert pool.mappings() == 0 and pool.mapped_bytes() == 0
    pool.check_invariants()


@pytest.mark.parametrize("limit", [0, 3 << 20, 40 << 20])
def test_idle_memory_bounded_by_limit(limit):
    rng = random.Random(limit)
    pool = ReadBuffers(limit=limit)
    live = [pool.storage(*_random_request(rng)) for _ in range(3000)]
    live += [pool.storage(0, 0, (1 << 20) + rng.randrange(3) * BLOCK) for _ in range(30)]
    in_use = pool.mapped_bytes()
    spare = SLAB_BYTES + max(p.size for p in pool._out)  # a slab and one large mapping
    rng.shuffle(live)
    while live:
        del live[-50:]
        pool.collect()
        assert pool.idle_bytes() <= limit + spare
        assert pool.mapped_bytes() <= in_use + limit + spare
    assert pool.mapped_bytes() == pool.idle_bytes()  # nothing in use: only idle memory left
    pool.trim()
    assert pool.mapped_bytes() == 0 and pool.mappings() == 0
    pool.check_invariants()


def test_trim_keeps_what_is_in_use():
    pool = ReadBuffers(limit=64 << 20)
    small, large = pool.storage(9, 1, 100), pool.storage(0, 0, 1 << 20)
    spare = [pool.storage(0, 0, SMALL_BYTES) for _ in range(40)]  # a second slab
    gone = pool.storage(0, 0, 2 << 20)
    _fill(small, 7)
    _fill(large, 8)
    del spare, gone
    pool.trim()
    assert pool.mappings() == 2 and pool.idle_bytes() == 0
    assert pool.mapped_bytes() == SLAB_BYTES + (1 << 20)
    assert _holds(small, 7) and _holds(large, 8)
    _assert_owned(pool, [small, large])
    pool.check_invariants()


def test_reuse_instead_of_fresh_mappings():
    """Memory whose storage died serves the next read: a large mapping by exact size, the
    blocks of a slab for small ones (fresh pages would cost page faults)."""
    pool = ReadBuffers(limit=16 << 20)
    a = pool.storage(100, 4, 1 << 20)
    address = a.data_ptr()
    del a
    b = pool.storage(100, 4, 1 << 20)
    assert b.data_ptr() == address and pool.mappings() == 1
    del b
    c = pool.storage(0, 0, 2 << 20)  # another size: a mapping of its own
    assert c.data_ptr() != address and pool.mappings() == 2
    del c
    pool.trim()
    for i in range(2000):
        s = pool.storage(i % BLOCK, i % 16, 1 + i % 30000)
        del s
    assert pool.mappings() == 1  # one slab served them all
    pool.check_invariants()


class _Unmaps(list):
    """An ``unmap=`` that records what leaves the pool, then unmaps it."""

    def __call__(self, mm):
        self.append(len(mm))
        unmap_now(mm)


def _piece(i, n):
    """The bytes the pool cuts for ``_step``'s ``i``-th read of ``n`` bytes."""
    misalign, lead = i % BLOCK, i % 16
    return align_up((misalign - lead) % BLOCK + lead + n)


def _step(pool, sizes):
    """One backward's reads: take a storage of each size (in flight together), let all die.
    Returns how many mappings of their own it took, by size."""
    pool.watching = True  # the store watches forward's first read-ahead; all of it here
    live = [pool.storage(i % BLOCK, i % 16, n) for i, n in enumerate(sizes)]
    pool.watching = False
    del live
    pool.collect()
    return collections.Counter(_piece(i, n) for i, n in enumerate(sizes)
                               if _piece(i, n) > SMALL_BYTES)


def test_steps_that_repeat_their_reads_map_and_unmap_nothing_after_the_first():
    """NOTE [ Read buffers across steps ]: the start of each forward (trim_unused) keeps what
    the last step read into, so a steady run neither unmaps nor maps a buffer again."""
    unmaps = _Unmaps()
    pool = ReadBuffers(limit=64 << 20, unmap=unmaps)
    sizes = [4 << 20] * 3 + [1 << 20, 300_000] + [5000, 70_000, 100] * 20
    _step(pool, sizes)
    mapped, addresses = pool.mapped_bytes(), pool.mappings()
    for _ in range(5):
        pool.trim_unused()
        _step(pool, sizes)
        assert unmaps == [] and pool.mapped_bytes() == mapped and pool.mappings() == addresses
    pool.check_invariants()


def test_trim_unused_unmaps_what_the_last_step_did_not_read_into():
    unmaps = _Unmaps()
    pool = ReadBuffers(limit=64 << 20, unmap=unmaps)
    first = _step(pool, [4 << 20, 4 << 20, 2 << 20, 5000])
    assert sum(first.values()) == 3
    pool.trim_unused()
    assert unmaps == []
    assert _step(pool, [4 << 20, 5000]) == {4 << 20: 1}  # one 4 MiB read, no 2 MiB one
    pool.trim_unused()
    assert sorted(unmaps) == sorted(set(first) - {4 << 20})  # the slab stays: in use once
    assert pool.idle_bytes() == (4 << 20) + SLAB_BYTES
    pool.trim_unused()                           # a step that read nothing
    assert pool.idle_bytes() == 0 and pool.mappings() == 0
    pool.check_invariants()


def test_trim_unused_unmaps_what_was_handed_out_unwatched():
    """Reads later in backward (not watched) map what backward's freed memory makes room
    for; the next forward's start unmaps them, so they never add to forward's peak."""
    pool = ReadBuffers(limit=64 << 20)
    _step(pool, [4 << 20])                                       # forward's end: watched
    later = [pool.storage(0, 0, 4 << 20), pool.storage(0, 0, 2 << 20)]
    del later
    pool.trim_unused()
    assert pool.mappings() == 1 and pool.idle_bytes() == 4 << 20  # the watched one
    pool.trim_unused()                                           # nothing watched since
    assert pool.mappings() == 0
    pool.check_invariants()


@given(st.lists(st.lists(st.sampled_from([100, 5000, SMALL_BYTES, 1 << 20, 3 << 20]), max_size=12),
                min_size=1, max_size=6),
       st.sampled_from([0, 2 << 20, 64 << 20]))
@settings(max_examples=60, deadline=None)
def test_trim_unused_keeps_at_most_what_the_last_step_read_into(steps, limit):
    """Whatever the steps read, what trim_unused keeps idle is no more, of each size, than
    the last step handed out, and within ``limit`` plus a slab; repeating a step after
    it maps nothing new when the limit held all of it."""
    pool = ReadBuffers(limit=limit)
    for sizes in steps:
        large = _step(pool, sizes)
        pool.trim_unused()
        assert pool.idle_bytes() <= limit + SLAB_BYTES + max(large, default=0)
        for size, group in pool._large.items():
            assert len(group) <= large[size], (size, len(group), large)
        if sum(large.values()) == len(sizes):
            assert pool._empty == 0  # the step used no slab: none kept
        pool.check_invariants()
    pool.trim_unused()
    assert pool.mappings() == 0


def test_storages_outlive_the_pool():
    pool = ReadBuffers(limit=1 << 20)
    live = [pool.storage(3, 3, 5000), pool.storage(0, 0, 1 << 20)]
    for i, s in enumerate(live):
        _fill(s, i + 1)
    del pool
    gc.collect()
    assert _holds(live[0], 1) and _holds(live[1], 2)  # still mapped: their views export it
    live.clear()
    gc.collect()


# -- finalizers inside a garbage collection ---------------------------------------------------

class _RecordingQueue(collections.deque):
    """The give-back queue, counting pieces given back while a pool method was running."""

    reentrant = 0

    def append(self, piece):
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code.co_filename == _SOURCE:
                type(self).reentrant += 1
                break
            frame = frame.f_back
        super().append(piece)


def test_finalizers_run_inside_pool_methods_under_gc():
    """With a collection at nearly every allocation, storages held in reference cycles
    die inside storage(), collect() and trim(), whose allocations start the collections:
    their finalizers run re-entrantly. They only enqueue, so nothing deadlocks (a
    give-back taking a lock would: the earlier design did) and the books stay whole."""
    errors = []

    def exercise():
        try:
            rng = random.Random(11)
            pool = ReadBuffers(limit=1 << 20)
            pool._queue = _RecordingQueue()
            live = []
            for i in range(1500):
                live.append(_Cycle(pool.storage(*_random_request(rng))))
                _fill(live[-1].view.untyped_storage(), i % 255 + 1)
                live[-1].byte = i % 255 + 1
                if len(live) > 12:
                    del live[rng.randrange(len(live))]  # garbage until a collection
                if i % 100 == 0:
                    pool.collect()
                if i % 300 == 0:
                    pool.trim()
                if i % 50 == 0:
                    pool.check_invariants()
                    _assert_disjoint([c.view.untyped_storage() for c in live])
                    assert all(_holds(c.view.untyped_storage(), c.byte) for c in live)
            del live
            gc.collect()
            pool.trim()
            assert pool.mappings() == 0
        except BaseException as e:  # noqa: BLE001  (reported on the test's thread)
            errors.append(e)

    _RecordingQueue.reentrant = 0
    gc.collect()
    gc.freeze()  # what exists now is never scanned: each collection sees only new objects
    threshold = gc.get_threshold()
    gc.set_threshold(1, 2, 2)
    try:
        worker = threading.Thread(target=exercise, daemon=True)
        worker.start()
        worker.join(timeout=120)
    finally:
        gc.set_threshold(*threshold)
    assert not worker.is_alive(), "the pool deadlocked under a finalizer run by the GC"
    if errors:
        raise errors[0]
    assert _RecordingQueue.reentrant > 0, "no finalizer ran inside a pool method: test is void"


# -- a KeyboardInterrupt at every line -------------------------------------------------------

_LIMIT = 600_000  # keeps one 300 kB buffer idle, not a 2 MiB one, nor a second empty slab


def _scenario(pool, held):
    """Takes every path of the pool that a read can: new slab, more of a slab, a new, a
    reused and an unmapped large mapping, slabs emptied and dropped, the queue drained by
    storage(), collect() and trim(), the introspection, a bad request."""
    assert pool.storage(123, 0, 0).nbytes() == 0
    try:
        pool.storage(BLOCK, 0, 1)
    except ValueError:
        pass
    held.append(pool.storage(5, 3, 100))         # a new slab
    held.append(pool.storage(4095, 15, 9000))    # more of it
    held.append(pool.storage(0, 0, 300_000))
    held.pop()
    pool.collect()                               # kept idle
    pool.check_invariants()
    pool.trim()                                  # the idle one unmapped
    held.append(pool.storage(0, 0, 300_000))
    held.pop()                                   # kept idle
    held.append(pool.storage(0, 0, 300_000))     # reused
    held.append(pool.storage(17, 1, 2 << 20))
    held.pop()                                   # over the limit: unmapped
    pieces = [pool.storage(0, 0, SMALL_BYTES) for _ in range(2 * SLAB_BYTES // SMALL_BYTES)]
    del pieces                                   # two slabs empty: one is dropped
    pool.collect()
    held.append(pool.storage(100, 4, 5000))
    held.pop(0)
    held.append(pool.storage(1, 1, 1))           # drains the queue first
    pool.check_invariants()
    pool.mapped_bytes(), pool.mappings(), pool.idle_bytes()
    held.append(pool.storage(2, 2, SMALL_BYTES))
    held.pop()
    pool.watching = True
    held.append(pool.storage(0, 0, 300_000))
    held.append(pool.storage(0, 0, 5000))
    pool.watching = False
    held.pop(); held.pop()
    pool.trim_unused()                           # what was watched stays mapped
    pool.trim_unused()                           # a step with no reads: all unmapped
    pool.trim()


def _lines_run():
    lines = set()

    def local(frame, event, arg):
        if event == "line":
            lines.add(frame.f_lineno)
        return local

    pool = ReadBuffers(limit=_LIMIT)  # an interrupted __init__ leaves no pool to check
    sys.settrace(lambda frame, event, arg: local if frame.f_code.co_filename == _SOURCE else None)
    try:
        _scenario(pool, [])
    finally:
        sys.settrace(None)
    return sorted(lines)


def _interrupted_at(line, pool, held):
    """Run the scenario, raising KeyboardInterrupt the first time ``line`` of io/readbuf.py runs."""
    fired = []

    def local(frame, event, arg):
        if event == "line" and frame.f_lineno == line and not fired:
            fired.append(line)
            raise KeyboardInterrupt
        return local

    sys.settrace(lambda frame, event, arg: local if frame.f_code.co_filename == _SOURCE else None)
    try:
        _scenario(pool, held)
    except KeyboardInterrupt:
        pass
    finally:
        sys.settrace(None)
    return bool(fired)


def test_keyboard_interrupt_at_every_line():
    lines = _lines_run()
    assert len(lines) > 60  # the scenario reaches the pool's paths
    rng = random.Random(5)
    for line in lines:
        pool, held = ReadBuffers(limit=_LIMIT), []
        assert _interrupted_at(line, pool, held), f"line {line} did not run"
        gc.collect()  # the interrupted frames and what they held are gone
        where = f"after a KeyboardInterrupt at io/readbuf.py:{line}"
        try:
            pool.check_invariants()
            _assert_disjoint(held)
            _assert_owned(pool, held)
        except AssertionError as e:
            raise AssertionError(f"{where}: {e}") from None
        # The pool keeps working: what it hands out now never touches what lives.
        live = [(s, i % 200 + 1) for i, s in enumerate(held)]
        for s, b in live:
            _fill(s, b)
        for i in range(40):
            s = pool.storage(*_random_request(rng))
            _fill(s, 201 + i % 50)
            live.append((s, 201 + i % 50))
            if rng.random() < 0.3:
                del live[rng.randrange(len(live))]
        s = None
        pool.check_invariants()
        storages = [s for s, _ in live]
        assert all(_holds(s, b) for s, b in live), where
        _assert_disjoint(storages)
        _assert_owned(pool, storages)
        # Nothing leaked: once every storage is gone the pool unmaps everything.
        del live, storages
        held.clear()
        gc.collect()
        pool.trim()
        assert pool.mappings() == 0 and pool.mapped_bytes() == 0, where
        pool.check_invariants()
