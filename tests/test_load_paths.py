"""Every path a device record takes back to backward, forced one at a time, on the
loopback device (ssdtrain/testing/loopback.py): the tensor backward gets has the saved bytes at
the saved address modulo 512 (rule 6 of NOTE [ Device records ] in ssdtrain/_device/transfers.py),
and every model's gradients are bitwise equal to a run without offloading (INV-EXACT).

The paths (the record's state when backward reaches it):

* ``ssd``: ON_DISK, read into pinned staging and copied to device memory;
* ``host``: HOSTED, copied back from the host tier's pinned RAM (NOTE [ Host tier ] in
  ssdtrain/_store/hosttier.py);
* ``spilling``: SPILLING, evicted from RAM and its write to the SSD still running:
  claimed, loaded from its RAM copy when the write ends;
* ``hosting``: HOSTING, its copy to RAM still running: claimed, served from the device
  memory it was saved in;
* ``writing``: WRITING, its write to the SSD still running: claimed, likewise.

Which path a record takes depends on timing in a real run; here each is forced by a gate
(the engine's writes complete, or the loopback's device -> host copies start, only when
the test opens it) and checked by the record states before backward and the byte
counters after it. A record loaded from RAM or the SSD lands in memory other than the
saved tensor's; a break of rule 6 on the loads from RAM (``load_locked`` placing the copy
at another misalignment) is caught only here: CPU matmuls give the same bits at any
alignment, so the model tests alone would not see it (kernels on a GPU may not).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from ssdtrain import testing

from helpers import SaveForBackward, assert_same, gated, run_step
from loopback_helpers import LoopbackDevice, UnpackCheck, attach
from models import ALL_MODELS

KiB = 1 << 10
N = 16 * KiB                 # bytes of each slice saved in the chain test
PATHS = ["ssd", "host", "spilling", "hosting", "writing"]
_LOTS = 1 << 40              # write_behind_bytes / host_budget_bytes that never bind
# The states a path leaves the records in before backward, and the one that marks the
# path (prefetch, on for the ``spilling`` path, may have loaded records in RAM: LOADED).
_BEFORE = {"ssd": {"on_disk"}, "host": {"hosted"}, "spilling": {"spilling", "hosted", "loaded"},
           "hosting": {"hosting"}, "writing": {"writing"}}
_MARK = {"ssd": "on_disk", "host": "hosted", "spilling": "spilling", "hosting": "hosting",
         "writing": "writing"}


class _Gates:
    """What holds a path's records where backward is to find them: the engine's writes
    complete only once ``open()`` is called (``spilling``, ``writing``), or the
    device's copies to host memory run only then (``hosting``)."""

    def __init__(self):
        self._event = threading.Event()

    def open(self):
        self._event.set()

    def hold_copies(self, off, dev):
        """The first work on the device's offload stream (made now, as the first record
        would make it) waits for the gate: every device -> host copy queued after it
        waits too, as behind a slow kernel."""
        d2h = testing.transfers(off, dev).d2h
        with dev.stream(d2h):
            dev.kernel(lambda: self._event.wait(60))

    def hold_writes(self, off, monkeypatch):
        engine = testing.engine(off)
        real = engine.write
        monkeypatch.setattr(engine, "write", gated(real, self._event))


def _offloader(make_offloader, monkeypatch, path, budget, *, claim=False):
    """An offloader on a new loopback device, configured and gated for ``path``; the
    host tier's budget is ``budget`` bytes on the ``spilling`` path."""
    gates = _Gates()
    dev = LoopbackDevice(claim_host_tensors=claim)
    host_budget = {"ssd": None, "host": _LOTS, "spilling": budget, "hosting": _LOTS,
                   "writing": None}[path]
    off = make_offloader(min_tensor_bytes=4096, keep_tail_bytes=0,
                         prefetch_bytes=_LOTS if path == "spilling" else 0,
                         write_behind_bytes=_LOTS, host_budget_bytes=host_budget,
                         verify=False)
    attach(off, dev)
    if path in ("spilling", "writing"):
        gates.hold_writes(off, monkeypatch)
    elif path == "hosting":
        gates.hold_copies(off, dev)
    return off, dev, gates


def _states(off):
    return [r.state.value for r in testing.records(off)]


def _wait_for(off, done):
    """Poll the records' states until ``done(states)`` (30 s at most); the states."""
    deadline = time.monotonic() + 30
    states = _states(off)
    while not done(states) and time.monotonic() < deadline:
        time.sleep(0.002)
        states = _states(off)
    return states


def _settled(states):
    """No record still waiting for its copy or write to start, or copying to RAM."""
    return not {"pending", "hosting"} & set(states)


def _pack_after_copies(off):
    """Each save waits until the records before it have left PENDING and HOSTING, so
    that a record evicted by a later save is always in RAM by then (SPILLING), never
    still on the device (which would be written from there: WRITING)."""
    def settling(pack):
        def settled_pack(t):
            _wait_for(off, _settled)
            return pack(t)
        return settled_pack
    testing.wrap_hooks(off, pack=settling)


def _backward(off, out, path, gates):
    """``out.backward()`` with the gate opened after it, or, on the ``spilling`` path,
    during it: once prefetch (at the first unpack) has claimed every SPILLING record,
    whose held writes backward then waits for (not before: a write that ended first
    would leave its record on the SSD, read back from there)."""
    if path == "spilling":
        def open_when_claimed():
            _wait_for_records(off, lambda recs: not any(
                r.state.value == "spilling" and not r.claimed for r in recs))
            gates.open()
        threading.Thread(target=open_when_claimed, daemon=True).start()
    try:
        out.backward()
    finally:
        gates.open()


def _wait_for_records(off, done):
    deadline = time.monotonic() + 30
    while not done(testing.records(off)) and time.monotonic() < deadline:
        time.sleep(0.002)


@pytest.mark.parametrize("offset", [4, 68, 260])  # bytes into the storage: odd modulo 16, 512
@pytest.mark.parametrize("path", PATHS)
def test_every_load_path_keeps_the_saved_address_modulo_512(make_offloader, monkeypatch,
                                                            path, offset):
    """Two slices, each under half its own storage (a record of its own, starting
    ``offset`` bytes in), saved and forced down ``path``: backward gets each at the
    saved address modulo 512, with the saved values; the byte counters say which path
    it took. Broken (a load placed at the staging's misalignment, or ``load_locked``
    not passing the record's): the slices come back 512-aligned."""
    off, dev, gates = _offloader(make_offloader, monkeypatch, path, budget=N)
    try:
        sink, anchor, saved = [], torch.zeros((), requires_grad=True), []
        with off:
            out = anchor
            for i in range(2):
                base = dev.alloc((4 * N // 4,))
                base.copy_(torch.arange(N, dtype=torch.float32) + 1000 * i)
                t = base[offset // 4:offset // 4 + N // 4]
                saved.append((t.data_ptr() % 512, t.clone()))
                out = SaveForBackward.apply(out, sink, t)
                del base, t
                if path == "spilling" and i == 0:
                    off.wait()  # in RAM (HOSTED) when the second save evicts it
            if path == "spilling":  # the second in RAM too before prefetch starts
                _wait_for(off, lambda s: s == ["spilling", "hosted"])
        if path in ("ssd", "host"):
            off.wait()
        states = _wait_for(off, lambda s: len(s) == 2 and set(s) <= _BEFORE[path] and
                           s[0] == _MARK[path])
        assert len(states) == 2 and set(states) <= _BEFORE[path], states
        assert states[0] == _MARK[path], states
        _backward(off, out, path, gates)
    finally:
        gates.open()
    off.wait()
    got = [s[0] for s in reversed(sink)]
    assert [t.data_ptr() % 512 for t in got] == [m for m, _ in saved], (path, offset)
    assert all(torch.equal(t, v) for t, (_, v) in zip(got, saved))
    st_ = off.stats()
    assert (st_.bytes_read, st_.host_loaded_bytes) == {
        "ssd": (2 * N, 0), "host": (0, 2 * N), "spilling": (0, 2 * N),
        "hosting": (0, 0), "writing": (0, 0)}[path]
    assert not dev.errors


@pytest.mark.parametrize("name", sorted(ALL_MODELS))
@pytest.mark.parametrize("path", PATHS)
def test_every_load_path_is_exact_on_every_model(make_offloader, monkeypatch, path, name):
    """Each model on the loopback device (every saved CPU tensor a device record), with
    every record forced down ``path``: each tensor backward gets has the saved bytes at
    the saved address modulo 512 (``UnpackCheck``), and loss and gradients are bitwise
    equal to the run without offloading. On the ``spilling`` path the budget is the
    largest record and each save waits for the copies before it: every record is
    admitted to RAM, then evicted by a later one while its write is held."""
    torch.manual_seed(0)
    model, inputs = ALL_MODELS[name]()
    ref = run_step(model, inputs)
    budget = None
    if path == "spilling":  # the largest record (a first run's: the same records)
        probe = make_offloader(min_tensor_bytes=4096, keep_tail_bytes=0)
        attach(probe, LoopbackDevice(claim_host_tensors=True))
        with probe:
            loss = model(*inputs)
        budget = max(r.nbytes for r in probe.records())
        del loss
        probe.close()
    off, dev, gates = _offloader(make_offloader, monkeypatch, path, budget, claim=True)
    try:
        if path == "spilling":
            _pack_after_copies(off)
        check = UnpackCheck(off)
        model.zero_grad(set_to_none=True)
        with off:
            loss = model(*inputs)
        if path in ("ssd", "host"):
            off.wait()
        moving = {"pending"} if path == "hosting" else {"pending", "hosting"}
        states = set(_wait_for(off, lambda s: s and not moving & set(s)))
        assert states <= _BEFORE[path] and _MARK[path] in states, states
        _backward(off, loss, path, gates)
    finally:
        gates.open()
    off.wait()
    got = (loss.detach().clone(),
           {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()})
    assert not check.problems, check.problems
    st_ = off.stats()
    assert _took(path, st_, check.paths), (st_, check.paths)
    assert_same(ref, got, lambda: run_step(model, inputs))
    assert not dev.errors


def _took(path, st_, paths):
    """Whether the byte counters and the states unpack served from (``UnpackCheck.paths``)
    say the records took ``path``: read from the SSD; loaded from RAM and nothing read;
    evicted, written, and still loaded from RAM; or served from device memory while
    their copy or write ran."""
    read, loaded = st_.bytes_read, st_.host_loaded_bytes
    return {"ssd": read > 0 and loaded == 0 and "on_disk" in paths,
            "host": read == 0 and loaded > 0,
            "spilling": read == 0 and st_.host_spilled_bytes > 0 and st_.bytes_written > 0
            and loaded > 0,
            "hosting": read == loaded == 0 and "hosting" in paths,
            "writing": read == loaded == 0 and "writing" in paths}[path]
