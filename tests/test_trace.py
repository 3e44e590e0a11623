"""ssdtrain's ranges in a profiler trace (NOTE [ Profiler ranges ] in ssdtrain/_device/trace.py).

A small offloaded step under ``torch.profiler`` exports a Chrome trace; the ranges are
in it, each on the thread that did the work: pack and unpack on the training thread,
writes and reads the store's I/O thread started on that thread's id. The step is
paced (forward waits for the I/O thread after each save, backward after each use) so that
the I/O thread, not the end of forward or a lagging window, starts the writes and the
reads: which thread starts a request otherwise depends on timing. With no profiler
running, the store opens no range at all.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import ssdtrain
from ssdtrain import testing
from ssdtrain._device import trace as _trace

N = 8                 # ops, one saved record each
NUMEL = 64 * 1024     # 256 KiB of float32 per record
RECORD = NUMEL * 4


def _until(cond, what):
    deadline = time.monotonic() + 10.0
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.001)


class _Paced(torch.autograd.Function):
    """Saves a copy of its input (packed as forward returns); backward, after its
    unpack, waits until the I/O thread has filled the prefetch window again."""

    @staticmethod
    def forward(ctx, x, off):
        ctx.off = off
        ctx.save_for_backward(x * 1.0)
        return x + 1.0

    @staticmethod
    def backward(ctx, grad):
        (saved,) = ctx.saved_tensors
        off = ctx.off
        _until(lambda: not testing.prefetch(off).due, "the I/O thread to fill the prefetch window")
        return grad * saved, None


def _step(off):
    x = torch.full((NUMEL,), 0.5, requires_grad=True)
    with off:
        y = x
        for _ in range(N):
            y = _Paced.apply(y, off)
            # The I/O thread started the write and it ended: backward reads every record
            # (a write still in flight when forward ends is served from memory).
            _until(lambda: testing.outbound(off)[:2] == (0, 0), "the write")
        loss = y.sum()
    loss.backward()
    off.wait()
    return x.grad


def _offloader(spill_dir):
    # Every record written at once (keep_tail_bytes=0), a window of 4 records: backward
    # uses one, the I/O thread reads the next (never below a quarter of the window).
    # "static": every step writes and reads (the default's second step measures).
    return ssdtrain.Offloader(ssdtrain.OffloadConfig(
        spill_dir=str(spill_dir), policy="static", keep_tail_bytes=0, min_tensor_bytes=RECORD,
        prefetch_bytes=4 * RECORD, engine="posix"))


def _ranges(path):
    """``{name: [(tid, ts, dur)]}`` of ssdtrain's ranges in the Chrome trace at ``path``."""
    out = {}
    for e in json.loads(Path(path).read_text())["traceEvents"]:
        name = str(e.get("name"))
        if e.get("ph") == "X" and name.startswith("ssdtrain::"):
            out.setdefault(name, []).append((e["tid"], e["ts"], e["dur"]))
    return out


def _profiled_step(spill_dir, tmp_path, all_threads):
    kw = {}
    if all_threads:
        kw["experimental_config"] = torch.profiler._ExperimentalConfig(profile_all_threads=True)
    off = _offloader(spill_dir)
    try:
        with profile(activities=[ProfilerActivity.CPU], **kw) as prof:
            _step(off)
        io_tid = testing.io_thread(off).native_id
        stats = off.stats()
    finally:
        off.close()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    return _ranges(path), io_tid, stats


def test_ranges_in_the_trace_on_the_threads_that_did_the_work(spill_dir, tmp_path):
    ranges, io_tid, stats = _profiled_step(spill_dir, tmp_path, all_threads=True)
    main = threading.get_native_id()
    assert stats.records_written == N and stats.records_read == N, stats

    def tids(name):
        return {tid for tid, _, _ in ranges.get(name, [])}

    assert len(ranges.get(_trace.PACK, [])) == N and tids(_trace.PACK) == {main}
    assert len(ranges.get(_trace.UNPACK, [])) == N and tids(_trace.UNPACK) == {main}
    assert tids(_trace.END_FORWARD) == {main} and tids(_trace.FLUSH) == {main}
    # Every write was started by the I/O thread (forward waited for it); the reads
    # after the first window's (the end of forward's, on the training thread) too.
    assert len(ranges[_trace.WRITE]) == N and tids(_trace.WRITE) == {io_tid} != {main}
    reads_on_io = [r for r in ranges[_trace.READ] if r[0] == io_tid]
    assert len(ranges[_trace.READ]) == N and len(reads_on_io) >= N - 4, ranges[_trace.READ]
    # A wait for a read lies inside the unpack that waited.
    for tid, ts, dur in ranges.get(_trace.WAIT_READ, []):
        assert any(t == tid and s <= ts and ts + dur <= s + d
                   for t, s, d in ranges[_trace.UNPACK]), (ts, dur)


def test_the_io_threads_ranges_need_a_profiler_of_every_thread(spill_dir, tmp_path):
    """torch.profiler records the threads it was enabled on (and autograd's, which
    inherit it): without ``profile_all_threads`` the I/O thread's ranges are missing,
    the training thread's are there (as docs/guide.md says)."""
    ranges, io_tid, _ = _profiled_step(spill_dir, tmp_path, all_threads=False)
    assert len(ranges.get(_trace.PACK, [])) == N
    assert len(ranges.get(_trace.UNPACK, [])) == N
    assert all(tid != io_tid for rs in ranges.values() for tid, _, _ in rs)


def test_no_range_is_opened_without_a_profiler(spill_dir, monkeypatch):
    opened = []
    real = _trace.begin

    def counting(name, args):
        opened.append(name)
        return real(name, args)
    monkeypatch.setattr(_trace, "begin", counting)
    off = _offloader(spill_dir)
    try:
        ref = _step(off)
        assert opened == []
        assert not torch.autograd.profiler._is_profiler_enabled
        # The same step under the lightest profiler opens them (the count works).
        with torch.autograd.profiler.profile():
            got = _step(off)
        assert torch.equal(got, ref)
        assert {_trace.PACK, _trace.UNPACK, _trace.WRITE, _trace.READ} <= set(opened)
    finally:
        off.close()


def test_nvtx_ranges_where_cuda_is_in_use(spill_dir, monkeypatch):
    """Where CUDA is initialized, every range is an NVTX range too (Nsight Systems), on
    the thread that opened it, each push popped by that thread. Here torch.cuda's NVTX
    calls are stand-ins that record (name, thread); the GPU runs (tests/test_device.py)
    use the real ones."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda.nvtx, "range_push",
                        lambda name: calls.append((name, threading.get_native_id())))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop",
                        lambda: calls.append((None, threading.get_native_id())))
    off = _offloader(spill_dir)
    try:
        with torch.autograd.profiler.profile():  # emit_nvtx() on a GPU: the same flag
            _step(off)
        io_tid = testing.io_thread(off).native_id
    finally:
        off.close()
    main = threading.get_native_id()
    depth = {}
    for name, tid in calls:  # balanced, per thread
        depth[tid] = depth.get(tid, 0) + (1 if name else -1)
        assert depth[tid] >= 0
    assert set(depth.values()) == {0}
    pushed = {}
    for name, tid in calls:
        if name:
            pushed.setdefault(name, set()).add(tid)
    assert pushed[_trace.PACK] == {main} and pushed[_trace.UNPACK] == {main}
    assert pushed[_trace.WRITE] == {io_tid}
    assert sum(name == _trace.PACK for name, _ in calls) == N
