"""No memory or disk slot is reused while a request can still touch it, whatever an
interrupt cuts short (NOTE [ Memory owned by requests ] in ssdtrain/_store/store.py, INV-OWNED).

The three fixes to the bandwidth probe before the leases were one class of bug: a
request made while the caller's own references to its buffer and slot were the only
ones, and an interrupt (or a timeout) between "buffer/slot allocated" and "future
stored" let the caller free what the request still used, or keep it forever. Every
place a request is made is searched for that class here: records' writes, reads,
copies to RAM, evictions' writes, the bandwidth probe's write and read. For each line of
the functions between the allocation and the future (the store's and the spill
file's), a KeyboardInterrupt is raised at the first run of that line on the training
thread, the step is dropped, and two more steps run while the requests cut loose are
still in flight.

The engine is a :class:`Witness`: every request lands ``DELAY_S`` after it was made, on
a thread of its own, and touches its memory only then, as a slow device would. When it
is made, its memory is filled (a read's destination, with a canary) or checksummed (a
write's source); when it lands, the witness checks that nobody else wrote that memory
meanwhile (a buffer freed and handed to another record, or unmapped: read through the
kernel, an unmapped page is EFAULT, not a crash), and that the request's blocks are
still those of one live slot and of no other (the spill file's leases: NOTE [ Slots are
leases ] in ssdtrain/io/spill.py). Then: the later steps' gradients are exact, and once
every request has landed nothing is left (no live record, no resident byte, no spill
slot, ``Stats.quarantined_bytes`` 0: nothing is kept for the rest of the process).

Interrupts only reach the training thread, so the store's I/O thread is paused: the end
of forward starts the writes and the first reads there, and unpack the rest.
"""

from __future__ import annotations

import ctypes
import errno
import os
import tempfile
import threading
import time
import zlib
from concurrent.futures import Future

import pytest

import inject
from ssdtrain.io.spill import BLOCK
from ssdtrain import testing
from ssdtrain.io.base import EngineWrapper
from ssdtrain.io.posix import memory_at

DELAY_S = 0.03
CANARY = 0xC3
KiB = 1024


def _read_memory(address, nbytes, scratch_fd):
    """The bytes at ``address``, read through the kernel (``pwrite`` of the range into a
    scratch file): memory unmapped meanwhile is EFAULT (None here), never a SIGSEGV."""
    try:
        os.pwrite(scratch_fd, memory_at(address, nbytes), 0)
    except OSError as e:
        if e.errno == errno.EFAULT:
            return None
        raise
    return os.pread(scratch_fd, nbytes, 0)


class Witness(EngineWrapper):
    """Wraps ``inner``; each request lands ``delay_s`` after it was made (on its own
    thread: the inner engine runs it then), and is checked at landing: its memory
    unchanged since it was made (a write's source, a read's canary), its blocks one live
    slot of the spill file and no other's. ``violations`` lists what was amiss. It holds
    the request's ``owner`` until it lands, as an engine does (NOTE [ Requests own their
    memory ] in ssdtrain/io/base.py)."""

    def __init__(self, inner, delay_s=DELAY_S):
        super().__init__(inner)
        self.delay_s = delay_s
        self.violations = []
        self.made = {"write": 0, "read": 0}
        self._threads = []
        self._lock = threading.Lock()
        self._scratch = tempfile.TemporaryFile()

    def write(self, file, offset, address, nbytes, **kw):
        return self._request("write", file, offset, address, nbytes, kw)

    def read(self, file, offset, address, nbytes, **kw):
        return self._request("read", file, offset, address, nbytes, kw)

    def _request(self, op, file, offset, address, nbytes, kw):
        if op == "read":  # the destination's bytes are the engine's from now on
            ctypes.memset(address, CANARY, nbytes)
            expected = bytes([CANARY]) * nbytes
        else:
            with self._lock:  # one scratch file
                expected = _read_memory(address, nbytes, self._scratch.fileno())
        fut = Future()
        fut.set_running_or_notify_cancel()
        held = [kw]
        t = threading.Thread(target=self._land, name="witness",
                             args=(op, file, offset, address, nbytes, held, expected, fut),
                             daemon=True)
        with self._lock:
            self.made[op] += 1
            self._threads.append(t)
            t.start()
        return fut

    def _land(self, op, file, offset, address, nbytes, held, expected, fut):
        time.sleep(self.delay_s)
        what = f"a {op} of {nbytes} B at offset {offset} of {file.name}"
        with self._lock:
            got = _read_memory(address, nbytes, self._scratch.fileno())
        if got is None:
            self._violation(f"{what}: its memory was unmapped before it landed")
        elif got != expected:
            changed = sum(a != b for a, b in zip(got, expected))
            self._violation(f"{what}: {changed} bytes of its memory were written by someone "
                            f"else before it landed (freed and reused)")
        problem = _slot_problem(file, offset, nbytes)
        if problem:
            self._violation(f"{what}: {problem}")
        kw = held.pop()
        do = self.inner.write if op == "write" else self.inner.read
        try:
            value = do(file, offset, address, nbytes, **kw).result()
        except BaseException as e:  # noqa: BLE001 - the store sees the outcome
            kw = None
            fut.set_exception(e)
        else:
            kw = None
            fut.set_result(value)

    def _violation(self, msg):
        with self._lock:
            self.violations.append(msg)

    def join(self):
        """Wait until every request made so far has landed."""
        while True:
            with self._lock:
                threads = [t for t in self._threads if t.is_alive()]
            if not threads:
                return
            for t in threads:
                t.join(10)


def _slot_problem(file, offset, nbytes):
    """Why ``[offset, offset + nbytes)`` of ``file`` is not the blocks of exactly one live
    slot (NOTE [ Slots are leases ]); "" when it is."""
    registry = getattr(file, "leases", None)
    if registry is None:  # a spill file without leases: nothing to check
        return ""
    lo, hi = offset // BLOCK, -(-(offset + max(nbytes, 1)) // BLOCK)
    leases = [lease for lease in list(registry.values())
              if lease.block < hi and lo < lease.block + lease.nblocks and lease() is not None]
    if not leases:
        return "its blocks are no live slot's any more (freed while it ran)"
    if len(leases) > 1:
        return f"its blocks are shared by {len(leases)} live slots (handed out twice)"
    lease = leases[0]
    if not (lease.block <= lo and hi <= lease.block + lease.nblocks):
        return "its blocks straddle another slot"
    return ""


class _Sites(inject.Scenario):
    """The sweep scenario with the I/O thread paused (the training thread makes the
    requests) and, for the probe's sites, a bandwidth probe before the first step's
    forward (as ``policy="auto"`` makes one between steps)."""

    def __init__(self, probe=False, **kw):
        self.probe = probe
        super().__init__(**kw)

    def prepare(self, off):
        super().prepare(off)
        testing.hold_io(off)

    def step(self, i, off):
        if off is not None and self.probe and i == 0:
            testing.probe(off).time_io(64 * KiB, repeats=1)
        return super().step(i, off)


# Where requests are made: each function's lines are interrupted. "host": host records;
# "device": a loopback device's records (staged writes and reads, the waiter thread's
# submission); "tier": with a host tier too (copies to RAM, evictions' writes);
# "probe": the bandwidth probe.
SITES = {
    "host": ("ssdtrain._store.writeback:WritePath.start_write_locked",
             "ssdtrain._store.writeback:WritePath.submit_write",
             "ssdtrain._store.prefetch:ReadPath.start_read_locked",
             "ssdtrain._store.prefetch:ReadPath.submit_read",
             "ssdtrain._store.prefetch:ReadPath._read_buffer_locked",
             "ssdtrain.io.spill:SpillSet.alloc", "ssdtrain.io.spill:SpillFile.alloc"),
    "device": ("ssdtrain._store.writeback:WritePath.start_write_locked",
               "ssdtrain._store.prefetch:ReadPath.start_read_locked",
               "ssdtrain._store.prefetch:ReadPath.submit_read",
               "ssdtrain._store.prefetch:ReadPath._read_buffer_locked",
               "ssdtrain._device.transfers:DeviceTransfers.after",
               "ssdtrain._device.transfers:DeviceTransfers.read_buffer"),
    "tier": ("ssdtrain._store.hosttier:HostTier.start_host_locked",
             "ssdtrain._store.hosttier:HostTier.start_spill_locked",
             "ssdtrain._device.transfers:DeviceTransfers.after",
             "ssdtrain._device.transfers:DeviceTransfers.to_host"),
    "probe": ("ssdtrain._store.probe:Probe.time_io", "ssdtrain._store.probe:Probe._slot_locked",
              "ssdtrain._store.probe:Probe.submit", "ssdtrain.io.spill:SpillSet.let_go",
              "ssdtrain.io.spill:SpillFile.alloc"),
}


def _offloader(spill_dir, sc, site):
    from ssdtrain.testing import loopback as _loopback
    extra = dict(verify=True)  # the posix engine: the CRC chained behind each request
    if site == "tier":
        extra["host_budget_bytes"] = 48 * KiB
    off = inject.make_offloader(spill_dir, sc, engine="posix", **extra)
    if site in ("device", "tier"):
        _loopback._IDLE_S = min(_loopback._IDLE_S, inject.LOOPBACK_IDLE_S)
        _loopback.attach(off, _loopback.LoopbackDevice(claim_host_tensors=True,
                                                       d2h_delay=0.002, h2d_delay=0.002))
    witness = off.wrap_engine(Witness)
    return off, witness


def _targets(spill_dir, sc, site):
    """``[(file, line, 1, n)]``: the first run of each line of the site's functions that
    one step runs on the training thread."""
    import os as _os
    lines = [inject._function_lines(name) for name in SITES[site]]
    files = frozenset(p for p, _ in lines) | frozenset(_os.path.realpath(p) for p, _ in lines)
    counts = inject.baseline(sc, lambda: _offloader(spill_dir, sc, site)[0], runs=1,
                             n_steps=1, files=files)
    keep = {k: n for k, n in counts.items()
            if any(_os.path.abspath(k[0]) == p and k[1] in rng for p, rng in lines)}
    return [(f, line, 1, n) for (f, line), n in sorted(keep.items())]


@pytest.mark.parametrize("site", sorted(SITES))
def test_no_request_sees_its_memory_or_slot_reused_after_an_interrupt(spill_dir, site):
    """For each line between a request's allocations and its future reaching the store
    (the site's functions), an interrupt there, then two more steps while the request
    cut loose is in flight: the witness finds its memory and slot untouched by anyone
    else when it lands, the later steps are exact, and once everything has landed
    nothing is left (no slot, record or byte kept for good)."""
    sc = _Sites(probe=site == "probe", n_steps=3)
    targets = _targets(spill_dir, sc, site)
    assert len(targets) >= 8, targets
    bad, fired, made = [], 0, 0
    for target in targets:
        off, witness = _offloader(spill_dir, sc, site)
        outcome = inject.run_case(sc, off, target, armed_steps=1, after_steps=2,
                                  close_bound_s=30)
        witness.join()
        fired += outcome.fired
        made += sum(witness.made.values())
        where = f"{inject.short(target[0])}:{target[1]}"
        bad += [f"{where}: {v}" for v in witness.violations]
        bad += [f"{where}: {f}" for f in outcome.failures]
    assert not bad, f"[{site}] {len(bad)} problems:\n" + "\n".join(bad[:40])
    assert fired >= 0.5 * len(targets), (fired, len(targets))
    assert made > 0
