"""One pack decision, two callers (NOTE [ The pack decision ] in ssdtrain/_decision/policy.py).

What happens to a saved tensor (kept and why, new record or dedup, tail or written) is
decided at pack by ``pass_reason``, ``find_record`` and a ``TailWindow``, from the
sequence of saves and releases and the configuration alone. The store and ``ssdtrain
estimate`` call the same three, so:

* a run whose I/O thread lags (held back for a while) writes exactly what a run whose
  thread keeps up writes; ten runs with ten different lags offload identical bytes,
  equal to the estimate;
* the estimate equals the real run's ``Stats`` (packed, unique, offloaded, kept bytes)
  on every text-model architecture of the installed transformers that builds from a
  tiny config (``tests/hf_tiny.py``: a generated list, not a picked one).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import warnings

import pytest
import torch

import hf_tiny
import ssdtrain
from ssdtrain import testing
from helpers import weekly_shard
from ssdtrain import estimate as E
from ssdtrain.estimate.models import _factory_builder
from ssdtrain.estimate.replay import EstimateError, measure
from ssdtrain._decision.policy import (KEEP_BUDGET, PASS_KIND, PASS_LEAF, PASS_SMALL,
                                       PASS_STATE, TailWindow, pass_reason, slot_bound)
from ssdtrain._decision.records import State, find_record

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning",
                                        "ignore::DeprecationWarning")

BYTES = ("packed_bytes", "unique_bytes", "offloaded_bytes", "kept_bytes")
WAIT_S = 20.0


# ----------------------------------------------------------------- the pure pieces
class _R:
    """A record as the decision sees it."""

    def __init__(self, nbytes, **kw):
        self.nbytes, self.reserved = nbytes, 0
        for k, v in kw.items():
            setattr(self, k, v)

    def __repr__(self):
        return f"_R({self.nbytes})"


def test_tail_window_decides_oldest_first_and_a_record_that_left_stays_out():
    w = TailWindow(keep_tail_bytes=10)
    a, b, c, d = _R(6), _R(4), _R(4), _R(3)
    w.add(a)
    w.add(b)
    assert not w.over() and w.overflow() == []
    w.touch(a)                      # used again: the newest
    w.add(c)                        # 14 > 10: b, the oldest use, leaves
    assert w.overflow() == [(b, None)] and list(w.records) == [a, c]
    w.touch(b)                      # b left the window: a save of it does not bring it back
    assert list(w.records) == [a, c] and w.nbytes == 10
    assert w.discard(c) and not w.discard(b)   # c freed in the window: dropped
    w.add(d)
    assert w.close() == [a, d] and w.nbytes == 0 and not w.records


def test_tail_window_spill_budget_reserves_the_worst_slot():
    limit = 3 * 4096
    w = TailWindow(keep_tail_bytes=0, max_spill_bytes=limit)
    recs = [_R(4096), _R(1), _R(4096)]
    assert [slot_bound(r.nbytes) for r in recs] == [8192, 4096, 8192]
    out = []
    for r in recs:
        w.add(r)
        out += w.overflow()
    assert out == [(recs[0], None), (recs[1], None), (recs[2], KEEP_BUDGET)]
    assert w.reserved == 12288 == limit
    w.release(recs[0])
    assert w.reserved == 4096 and recs[0].reserved == 0
    w.release(recs[0])              # idempotent
    assert w.reserved == 4096
    w.add(recs[2])
    assert w.overflow(outside=4096) == [(recs[2], KEEP_BUDGET)]  # a probe's slot counts
    w.add(recs[2])
    assert w.overflow() == [(recs[2], None)] and w.reserved == limit
    w.add(r := _R(1))
    assert w.overflow() == [(r, KEEP_BUDGET)]


def test_keep_reason_names_why_a_tensor_stays():
    never = lambda key: False  # noqa: E731
    x = torch.randn(64, 64, requires_grad=True)
    y = x * 2
    assert pass_reason(y, 16384, 1 << 20, never)[0] == PASS_SMALL
    assert pass_reason(x, 16384, 1, never)[0] == PASS_LEAF
    assert pass_reason(y.to_sparse(), 16384, 1, never)[0] == PASS_KIND
    assert pass_reason(y, 16384, 1, lambda key: True)[0] == PASS_STATE
    reason, storage, key = pass_reason(y, 16384, 1, never)
    assert reason is None and storage.nbytes() == 16384 and key == storage._cdata


def test_find_record_is_dedup_by_version_extent_address_size_and_state():
    r = _R(100, version=0, lo=0, hi=100, ptr=7, span=100, state=State.PENDING)
    assert find_record([r], 0, (10, 20), 7, 100) is r
    assert find_record([r], 1, (10, 20), 7, 100) is None     # written in place since
    assert find_record([r], 0, (90, 110), 7, 100) is None    # outside the record
    assert find_record([r], 0, (10, 20), 8, 100) is None     # set_ / resize_ since
    assert find_record(None, 0, (10, 20), 7, 100) is None
    r.state = State.FAILED
    assert find_record([r], 0, (10, 20), 7, 100) is None


# ------------------------------------------------------------ the store's decision
@contextlib.contextmanager
def lagging(off, packs):
    """The store's I/O thread, woken in the block, starts its round only after ``packs``
    more packs (or when the block is left): it lags by that much, as a busy machine's
    would."""
    seen, go = [0], threading.Event()

    def late(real_round):
        def round_():
            go.wait(WAIT_S)
            real_round()
        return round_

    def counting(real_pack):
        def pack(t):
            seen[0] += 1
            if seen[0] >= packs:
                go.set()
            return real_pack(t)
        return pack
    real_round, _ = testing.wrap_io(off, round=late)
    real_pack, _ = testing.wrap_hooks(off, pack=counting)
    if packs <= 0:
        go.set()
    try:
        yield
    finally:
        go.set()
        testing.wrap_io(off, round=lambda _: real_round)
        testing.wrap_hooks(off, pack=lambda _: real_pack)


def resaves(batch=1):
    """(model, inputs): a 2 MiB activation saved, pushed out of a 1 MiB tail window by
    three 1 MiB ones, then saved again (dedup)."""
    class M(torch.nn.Module):
        def forward(self, x):
            a = torch.cat([x, x]) * 2          # 2 MiB
            b = a.sin()[:256].exp()            # saves a, then b (1 MiB)
            d = b.exp().exp()                  # 1 MiB each
            return d.sum() + a.cos().sum()     # saves a again
    return M(), (torch.randn(256 * batch, 1024, requires_grad=True),)


SETTINGS = dict(keep_tail_bytes="1MiB", min_tensor_bytes="4KiB")


def _step(off, model, inputs, lag):
    before = off.stats()
    with lagging(off, lag):
        with off:
            out = model(*inputs) if isinstance(inputs, tuple) else model(**inputs)
            loss = out if isinstance(out, torch.Tensor) else \
                out.loss if getattr(out, "loss", None) is not None else out[0].float().sum()
    off.wait()
    after = off.stats()
    loss.backward()
    return tuple(getattr(after, k) - getattr(before, k) for k in BYTES)


def test_what_is_written_does_not_depend_on_the_io_thread(make_offloader):
    """Before: a record re-saved while its write had not started yet was put back at the
    tail's end and kept, so a lagging I/O thread wrote 5 MiB where a prompt one wrote 4."""
    est = measure(lambda: resaves(), ssdtrain.OffloadConfig(**SETTINGS))
    want = (est.packed_bytes, est.unique_bytes, est.offloadable_bytes, est.kept_bytes)
    for lag in (0, 100):
        off = make_offloader(**SETTINGS)
        assert _step(off, *resaves(), lag) == want, f"lag {lag}"
        testing.check_invariants(off)
    assert want[2] == 4 << 20


def test_a_slow_disk_does_not_change_what_fits_under_max_spill_bytes(make_offloader):
    """Each step fits max_spill_bytes alone. Before, on a disk slower than backward, the
    next step began while the last step's writes (of records its graph had already
    freed) still held their reservations: its packs decided against them, and with
    on_spill_full="raise" a step that fits failed ("would take the spill files beyond
    max_spill_bytes"; keep would have kept what a prompt disk writes). The step now
    waits for those writes, so every step writes the same bytes as the first."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import late_io
    model, inputs = resaves()
    settings = dict(keep_tail_bytes=0, min_tensor_bytes="4KiB", max_spill_bytes="6MiB",
                    on_spill_full="raise", write_behind_bytes="64MiB")
    off = make_offloader(**settings)
    off.wrap_engine(lambda engine: late_io.LateEngine(engine, 0.3))  # each request 0.3 s late
    written = []
    for _ in range(3):
        before = off.stats().offloaded_bytes
        with off:
            loss = model(*inputs)
        loss.backward()  # served from memory: the writes are still in flight
        del loss
        written.append(off.stats().offloaded_bytes - before)
    assert written == [written[0]] * 3 and written[0] >= 4 << 20, written
    off.wait()
    testing.check_invariants(off)


def dropped_in_forward():
    """(model, inputs): ``exp`` saves its own output, which forward then drops: the real
    run frees that record at once, in the tail window (never written)."""
    class M(torch.nn.Module):
        def forward(self, x):
            a = x * 2
            a.exp()                            # saved by its own node, dropped
            return (a.sin().sin().sin()).sum()
    return M(), (torch.randn(256, 1024, requires_grad=True),)


def test_a_record_dropped_in_forward_is_dropped_in_the_estimate_too(make_offloader):
    """Before: the estimate's handle held the tensor, so a tensor saved by the node that
    made it formed a cycle (tensor -> node -> handle -> tensor) that lived past the
    forward; the estimate wrote what the real run dropped."""
    est = measure(dropped_in_forward, ssdtrain.OffloadConfig(**SETTINGS))
    want = (est.packed_bytes, est.unique_bytes, est.offloadable_bytes, est.kept_bytes)
    assert _step(make_offloader(**SETTINGS), *dropped_in_forward(), 0) == want
    assert est.dropped_bytes == 1 << 20


def test_counting_flops_does_not_change_the_bytes(spill_dir):
    """Before: the bytes came from the forward run under FlopCounterMode, which changes
    which tensors live how long: on MRA (batch 2, seq 16) a record the real run frees in
    the tail window lived on and was counted as written (8 KiB too many)."""
    pytest.importorskip("transformers")
    fac = E.hf_factory(hf_tiny.tiny_config("mra", "MraForMaskedLM"))
    shape = dict(batch=2, seq=16, dtype=torch.float32)
    settings = dict(min_tensor_bytes="1KiB", keep_tail_bytes="8KiB")
    est = E.estimate(fac, **shape, config=ssdtrain.OffloadConfig(**settings))
    off = ssdtrain.Offloader(ssdtrain.OffloadConfig(spill_dir=str(spill_dir), policy="static",
                                                    **settings))
    try:
        torch.manual_seed(0)
        real = _step(off, *fac(**shape), 0)
    finally:
        off.close()
    assert (est.packed_bytes, est.unique_bytes, est.offloadable_bytes, est.kept_bytes) == real
    assert est.measurement.flops > 0 and est.measurement.dropped_bytes > 0


@pytest.mark.parametrize("which", ["resaves", "llama"])
def test_ten_runs_offload_identical_bytes_equal_to_the_estimate(which, make_offloader):
    """Ten real runs, the I/O thread lagging by a different number of packs in each
    (0 to 45), offload identical bytes: the estimate's. The tiny llama re-saves the
    rotary cos/sin in every layer, long after they left the tail window."""
    if which == "resaves":
        build, settings = resaves, SETTINGS
    else:
        pytest.importorskip("transformers")
        cfg = hf_tiny.tiny_config("llama", "LlamaForCausalLM")
        fac = E.hf_factory(cfg)

        def build():
            return fac(batch=2, seq=16, dtype=torch.float32)
        settings = dict(min_tensor_bytes="1KiB", keep_tail_bytes="8KiB")
    est = measure(build, ssdtrain.OffloadConfig(**settings))
    want = (est.packed_bytes, est.unique_bytes, est.offloadable_bytes, est.kept_bytes)
    runs = []
    for lag in range(0, 50, 5):
        torch.manual_seed(0)
        runs.append(_step(make_offloader(**settings), *build(), lag))
    assert runs == [want] * 10, runs
    assert want[2] > 0


# --------------------------------------------- every text architecture, exactly
def _architectures():
    try:
        return list(hf_tiny.architectures().items())
    except ImportError:
        return []


ARCHS = _architectures()
# The suite's time: a default run checks every third architecture of the generated list,
# a different third each ISO week (so three weeks of CI cover them all; NOTE [ Sweeps
# take turns by week ] in tests/helpers.py); set SSDTRAIN_TEST_ALL_ARCHS=1 (or
# SSDTRAIN_TEST_ALL_SHARDS=1) to check every one (about 2 minutes here).
ARCH_SHARD = weekly_shard(3, "SSDTRAIN_TEST_ALL_ARCHS")
HF_SETTINGS = dict(min_tensor_bytes="1KiB", keep_tail_bytes="8KiB")
SHAPE = dict(batch=1, seq=8, dtype=torch.float32)
MAX_PARAMS = 4_000_000


@pytest.fixture(scope="module")
def shared_offloader(tmp_path_factory):
    """One offloader for the whole list (its Stats are compared step by step), and one
    compute thread: the models are tiny, and a second thread only waits for the first
    on a loaded machine."""
    d = tmp_path_factory.mktemp("spill")
    off = ssdtrain.Offloader(ssdtrain.OffloadConfig(spill_dir=str(d), policy="static",
                                                    **HF_SETTINGS))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield off
    finally:
        torch.set_num_threads(threads)
        off.close()


@pytest.mark.skipif(not ARCHS, reason="transformers is not installed")
@pytest.mark.parametrize("model_type,class_name", ARCHS, ids=[a for a, _ in ARCHS])
def test_estimate_is_exact_on_every_text_architecture(model_type, class_name,
                                                      shared_offloader):
    """``estimate == Stats`` for packed, unique, offloaded and kept bytes. Skipped, with
    the reason: an architecture that is not text, one whose config refuses the tiny sizes
    or whose model does not run at them on this CPU, and one the estimate refuses
    (data-dependent shapes, docs/estimate.md)."""
    part = ARCHS.index((model_type, class_name)) % ARCH_SHARD.count
    if not ARCH_SHARD.runs(part):
        pytest.skip(ARCH_SHARD.skip_reason("every third architecture", part))
    try:
        cfg = hf_tiny.tiny_config(model_type, class_name)
    except hf_tiny.NotText as e:
        pytest.skip(f"not a text model: {e}")
    except Exception as e:  # noqa: BLE001 - the config's own validation
        pytest.skip(f"no tiny config: {type(e).__name__}: {str(e)[:200]}")
    fac = E.hf_factory(cfg)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            params = sum(p.numel() for p in fac(**SHAPE)[0].parameters())
        except Exception as e:  # noqa: BLE001 - the model's own constructor
            pytest.skip(f"does not build at the tiny size: {type(e).__name__}: {str(e)[:200]}")
    if params > MAX_PARAMS:  # a size the generic rule does not know (a sub-config's)
        pytest.skip(f"not tiny: {params / 1e6:.0f} M parameters after the generic shrink")
    off = shared_offloader
    with warnings.catch_warnings(), _quiet():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        try:
            real = _step(off, *fac(**SHAPE), 0)
        except Exception as e:  # noqa: BLE001 - the model's own code at this size
            pytest.skip(f"does not run at the tiny size: {type(e).__name__}: {str(e)[:200]}")
        build, _ = _factory_builder(fac, gradient_checkpointing=False, **SHAPE)
        try:
            m = measure(build, ssdtrain.OffloadConfig(**HF_SETTINGS))
        except EstimateError as e:
            pytest.skip(f"the estimate refuses it: {str(e)[:200]}")
    assert (m.packed_bytes, m.unique_bytes, m.offloadable_bytes, m.kept_bytes) == real
    assert real[1] > 0


@contextlib.contextmanager
def _quiet():
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
