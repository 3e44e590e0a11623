"""Soak (INV-RELEASE, INV-EXACT in docs/ARCHITECTURE.md): 500 training steps of a
small GPT under one offloader.

Normal steps, graphs dropped without backward, and ``retain_graph`` double backwards
are mixed. Nothing may grow: open file descriptors, threads, RSS, spill bytes in use,
the spill file; every record and handle of a step is gone (weak references, after
``gc``) once its graph is; the final parameters equal those of the same 500 steps
without ssdtrain (every gradient of every step was exact).

Marked ``slow``; ``make soak`` runs it, ``SOAK_STEPS`` changes the count.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import threading
import weakref
from pathlib import Path

import pytest
import torch

import ssdtrain
from ssdtrain._store import Handle, Record
from ssdtrain.tools import BLOCK

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from gpt import GPT, GPTConfig, make_batch  # noqa: E402

STEPS = int(os.environ.get("SOAK_STEPS", "500"))
CFG = GPTConfig(vocab_size=256, seq_len=64, d_model=64, n_heads=4, n_layers=2)


def _rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _fds():
    return len(os.listdir("/proc/self/fd"))


def _build():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return GPT(CFG).train()


def _train(model, steps, off=None, check=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(0)
    for step in range(steps):
        batch = make_batch(CFG, 2, gen)
        model.zero_grad(set_to_none=True)
        with off if off is not None else _null():
            loss = model(*batch)
            records = [] if off is None else [weakref.ref(r) for group in
                                              off._store._table.registry.values() for r in group]
        if step % 10 == 9:  # a graph dropped without backward (eval, an exception...)
            del loss
        else:
            if step % 7 == 3:  # retain_graph: every record read twice
                loss.backward(retain_graph=True)
            loss.backward()
            del loss
            opt.step()
        if check is not None:
            check(step, records)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.slow
def test_soak(tmp_path):
    model_ref = _build()
    _train(model_ref, STEPS)

    spill = tmp_path / "spill"
    spill.mkdir()
    off = ssdtrain.Offloader(policy="static", spill_dir=str(spill), min_tensor_bytes=4096,
                             keep_tail_bytes="64KiB", prefetch_bytes="256KiB")
    spill_fd = off._store.spill.files[0].fd
    seen = {"fds": [], "threads": [], "rss": [], "size": [], "records": [], "dead": 0,
            "previous": []}

    def check(step, records):
        off.wait()
        if step % 25 == 0:
            gc.collect()  # nothing here needs the cycle collector; run it now and then
        assert off.live_records() == 0, f"step {step}: records left"
        assert off.spill_bytes_in_use() == 0 and off.resident_bytes() == 0, f"step {step}"
        # A dropped graph's records are freed at once, but the prefetch queue of its pass
        # may name them until the next pass is prefetched: check one step later.
        alive = [r() for r in seen["previous"] if r() is not None]
        assert not alive, f"step {step}: {len(alive)} records of step {step - 1} survive"
        seen["dead"] += len(seen["previous"])
        seen["previous"] = records
        seen["fds"].append(_fds())
        seen["threads"].append(threading.active_count())
        seen["rss"].append(_rss())
        seen["size"].append(os.fstat(spill_fd).st_size)
        seen["records"].append(len(records))
        if step % 100 == 99:
            objs = gc.get_objects()
            assert not [o for o in objs if type(o) is Handle], f"step {step}: handles survive"
            assert len([o for o in objs if type(o) is Record]) <= len(records), \
                f"step {step}: records of earlier steps survive"

    model = _build()
    _train(model, STEPS, off, check)
    s = off.stats()
    off.close()

    for p_ref, p in zip(model_ref.parameters(), model.parameters()):
        assert torch.equal(p_ref, p), "parameters differ from training without ssdtrain"
    assert s.records_written > STEPS and s.bytes_read > 0 and seen["dead"] > STEPS
    warm = min(20, STEPS // 5)
    assert max(seen["fds"][warm:]) == seen["fds"][warm], f"fds grow: {seen['fds'][-5:]}"
    assert max(seen["threads"][warm:]) <= seen["threads"][warm] + 0, "threads grow"
    # A record's slot starts at its tensor's address modulo 4 KiB, so it needs one
    # block more or less depending on where the CPU allocator put the tensor, which
    # differs between steps (memory is released by the store's I/O thread, in its own
    # time): the file may take one block per record of a step beyond its warm size,
    # never more. A leak of slots fails spill_bytes_in_use() == 0 above, at once.
    slack = max(seen["records"]) * BLOCK
    assert max(seen["size"][warm:]) <= seen["size"][warm] + slack, \
        f"spill file grows: {sorted(set(seen['size']))} (slack {slack} bytes)"
    # RSS: allocator noise is allowed, a leak of a step's activations (~1 MiB) per
    # step is not: the last fifth may not sit more than 16 MiB above the second.
    fifth = max(1, STEPS // 5)
    early = statistics.median(seen["rss"][fifth:2 * fifth])
    late = statistics.median(seen["rss"][-fifth:])
    assert late - early < 16 << 20, f"RSS grew by {(late - early) / 2**20:.1f} MiB"
    assert os.listdir(spill) == []
