"""The backbone (INV-EXACT, docs/ARCHITECTURE.md): with offloading, the loss and every gradient are
bitwise equal (``torch.equal``) to a run without it.

Every model of ``tests/models.py`` in fp32, bf16 and fp16, under several offloader
settings, two steps with the same offloader (the second reuses its disk slots). Each
case also checks, through the stats, that the setting really did what it is named
for, so the test fails if offloading were a no-op.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from helpers import assert_same, run_step
from ssdtrain import testing
from models import ALL_MODELS

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
KiB = 1 << 10

# name -> (OffloadConfig overrides, what the stats must show)
SETTINGS = {
    # (a) every record written (no tail kept), prefetch on.
    "written-prefetch": dict(min_tensor_bytes=4096, keep_tail_bytes=0),
    # (b) no prefetch: every unpack of a record on disk is a synchronous read (a miss).
    "written-noprefetch": dict(min_tensor_bytes=4096, keep_tail_bytes=0, prefetch_bytes=0),
    # (c) defaults (256 MiB tail kept in memory, prefetch) except the size threshold:
    #     these models are far smaller than the tail, so nothing is written.
    "defaults-tailkept": dict(min_tensor_bytes=4096),
    # (d) buffered I/O + fdatasync + DONTNEED instead of O_DIRECT.
    "buffered": dict(min_tensor_bytes=4096, keep_tail_bytes=0, direct_io="off"),
    # (e) one I/O thread, requests cut in 4 KiB pieces.
    "tiny-chunks": dict(min_tensor_bytes=4096, keep_tail_bytes=0, io_threads=1,
                        io_chunk_bytes=4096),
    # (f) a mix: 64 KiB threshold (smaller activations kept), a 256 KiB tail kept,
    #     the rest written.
    "mixed-tail": dict(min_tensor_bytes=64 * KiB, keep_tail_bytes=256 * KiB),
    # (g) the pure-Python reference engine (the others use engine="auto": native where built).
    "posix-written-prefetch": dict(min_tensor_bytes=4096, keep_tail_bytes=0, engine="posix"),
    "posix-written-noprefetch": dict(min_tensor_bytes=4096, keep_tail_bytes=0, prefetch_bytes=0,
                                     engine="posix"),
}
WRITES = {"written-prefetch", "written-noprefetch", "buffered", "tiny-chunks", "mixed-tail",
          "posix-written-prefetch", "posix-written-noprefetch"}
PREFETCH = WRITES - {"written-noprefetch", "posix-written-noprefetch"}

_REFERENCE = {}


def reference(name, dtype):
    """Loss and gradients of one step without ssdtrain (computed once per process)."""
    if (name, dtype) not in _REFERENCE:
        model, inputs = ALL_MODELS[name](dtype)
        _REFERENCE[name, dtype] = run_step(model, inputs)
    return _REFERENCE[name, dtype]


def _delta(after, before):
    return {f: getattr(after, f) - getattr(before, f)
            for f in ("offloaded_bytes", "records_written", "bytes_read", "records_read",
                      "prefetch_hits", "prefetch_misses", "forwarded", "kept_bytes",
                      "packed_bytes")}


def _assert_idle(off):
    """Every graph is gone: nothing may stay live, resident or allocated on disk."""
    off.wait()
    assert off.live_records() == 0
    assert off.resident_bytes() == 0
    assert off.spill_bytes_in_use() == 0


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("name", sorted(ALL_MODELS))
def test_grads_bitwise_equal(name, dtype, setting, make_offloader):
    """Two steps under one offloader, each equal to the reference.

    Step 1 leaves the ``with`` block with writes possibly in flight (prefetch pins
    them); step 2 waits for every write first, so prefetch (or, without it, each
    unpack) must read every record back from disk.
    """
    ref = reference(name, dtype)
    model, inputs = ALL_MODELS[name](dtype)
    off = make_offloader(**SETTINGS[setting])

    assert_same(ref, run_step(model, inputs, off))
    _assert_idle(off)
    s1 = off.stats()
    assert_same(ref, run_step(model, inputs, off, settle=True))
    _assert_idle(off)
    s2 = off.stats()
    step2 = _delta(s2, s1)

    # Interception happened in both steps.
    assert s1.packed_bytes > 0 and step2["packed_bytes"] == s1.packed_bytes
    assert s2.unique_bytes > 0
    if setting in WRITES:
        assert s1.records_written > 0 and s1.offloaded_bytes > 0
        assert step2["records_written"] == s1.records_written
        assert step2["offloaded_bytes"] == s1.offloaded_bytes
        # Step 2 wrote everything before forward ended: every record came back by a read.
        assert step2["bytes_read"] > 0 and step2["records_read"] > 0
        assert step2["bytes_read"] <= step2["offloaded_bytes"]
    else:  # the whole forward fits in the kept tail
        assert s2.offloaded_bytes == 0 and s2.records_written == 0 and s2.bytes_read == 0
        assert s2.kept_bytes > 0
        assert s2.forwarded > 0  # every unpack served from ssdtrain's in-memory records
    if setting in ("written-noprefetch", "posix-written-noprefetch"):
        assert s2.prefetch_hits == 0
        assert step2["prefetch_misses"] > 0
        assert step2["prefetch_misses"] == step2["records_read"]
    if setting in PREFETCH:
        assert step2["prefetch_hits"] > 0
        assert s2.prefetch_misses == 0
        # prefetch reads every record that was on disk when forward ended
        assert step2["records_read"] == step2["records_written"]
        assert step2["bytes_read"] == step2["offloaded_bytes"]
    if setting == "buffered":
        assert "+buffered" in s2.engine
    if setting == "mixed-tail":
        assert s2.kept_bytes > 0  # small tensors and the tail


def test_backward_inside_with(make_offloader):
    """``loss.backward()`` while the offloader still intercepts: equal grads.

    Forward ends with every write completed, so no prefetch has started (it starts at
    ``with`` exit) and every unpack reads its record synchronously.
    """
    ref = reference("gpt", torch.float32)
    model, inputs = ALL_MODELS["gpt"](torch.float32)
    off = make_offloader(min_tensor_bytes=4096, keep_tail_bytes=0)
    assert_same(ref, run_step(model, inputs, off, settle=True, backward_inside=True))
    s = off.stats()
    assert s.records_written > 0
    assert s.bytes_read > 0 and s.prefetch_misses > 0 and s.prefetch_hits == 0
    _assert_idle(off)
    # and once more, without waiting for the writes (forwarding of records in flight)
    assert_same(ref, run_step(model, inputs, off, backward_inside=True))
    _assert_idle(off)


# --------------------------------------------------------------------- checkpointing
# Shapes are chosen so each tensor says where it came from: width 512 before the
# checkpointed region, 768 inside it, 384 at its output, 256 after.
class _Sandwich(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(256, 512)
        self.inner1 = nn.Linear(512, 768)
        self.inner2 = nn.Linear(768, 384)
        self.post = nn.Linear(384, 256)
        self.use_reentrant = None  # None: no checkpoint
        self.region_inputs = []

    def region(self, h):
        self.region_inputs.append(h)
        return torch.tanh(self.inner2(F.gelu(self.inner1(h))))

    def forward(self, x, y):
        h = F.gelu(self.pre(x))
        if self.use_reentrant is None:
            r = self.region(h)
        else:
            r = checkpoint(self.region, h, use_reentrant=self.use_reentrant)
        return F.mse_loss(self.post(r), y)


def _sandwich():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = _Sandwich()
    g = torch.Generator().manual_seed(1)
    return model, (torch.randn(64, 256, generator=g), torch.randn(64, 256, generator=g))


def _record_packs(off):
    """Wraps the store's pack hook; returns the list of (shape, storage ptr) it saw."""
    seen = []

    def recording(pack):
        def hook(t):
            seen.append((tuple(t.shape), t.untyped_storage().data_ptr()))
            return pack(t)
        return hook

    testing.wrap_hooks(off, pack=recording)  # the Offloader pushes the hooks on each entry
    return seen


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_checkpoint_inside_offload(use_reentrant, make_offloader):
    """``torch.utils.checkpoint`` around part of a model inside ``with offloader:``.

    Only the innermost ``saved_tensors_hooks`` applies (INV-INNERMOST):

    - ``use_reentrant=False`` installs checkpoint's own hooks around the region, so
      ssdtrain never sees the tensors saved *inside* it (they are dropped and
      recomputed in backward, which runs outside the ``with`` block). The region's
      input is saved by checkpoint itself (``_make_saved_tensor`` /
      ``_NoopSaveInputs``) outside its own hooks, so ssdtrain does see that one.
    - ``use_reentrant=True`` runs the region under ``no_grad`` and saves its inputs
      with ``ctx.save_for_backward``: ssdtrain intercepts that and offloads the
      region's input; nothing inside the region is saved at all.

    Either way the tensors outside the region are offloaded as usual, and the grads
    equal a run with neither checkpoint nor ssdtrain.
    """
    model, inputs = _sandwich()
    ref = run_step(model, inputs)
    ref_packs = []  # what plain saved-tensor hooks see without checkpoint
    with torch.autograd.graph.saved_tensors_hooks(
            lambda t: ref_packs.append(tuple(t.shape)) or t, lambda t: t):
        model(*inputs)
    assert (64, 768) in ref_packs  # the region does save 768-wide activations

    model.use_reentrant = use_reentrant
    off = make_offloader(min_tensor_bytes=4096, keep_tail_bytes=0)
    packs = _record_packs(off)
    model.region_inputs.clear()
    got = run_step(model, inputs, off, settle=True)
    assert_same(ref, got)

    shapes = [s for s, _ in packs]
    assert (64, 768) not in shapes, "a tensor from inside the checkpointed region was packed"
    # the region's input (first forward call only; backward may recompute it)
    region_input_ptr = model.region_inputs[0].untyped_storage().data_ptr()
    assert any(ptr == region_input_ptr for _, ptr in packs), \
        "checkpoint's saved region input did not reach ssdtrain"
    # outside the region: pre's input/gelu input (512) and post's input (384)
    assert (64, 384) in shapes and (64, 512) in shapes
    s = off.stats()
    assert s.records_written > 0 and s.bytes_read > 0
    _assert_idle(off)
