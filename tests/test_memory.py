"""Memory really drops: what offloading is for.

Two views of it:

- ssdtrain's own accounting: ``Stats.peak_resident_bytes`` (saved storages held
  in memory at once) stays far below the bytes of activations saved, when the
  tail and the prefetch window are small;
- the operating system's: the peak RSS of one training step, measured in fresh
  subprocesses (one step each, because VmHWM cannot be reset), is clearly lower
  with ssdtrain, and the gradients are bitwise the same.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from ssdtrain import testing

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
from helpers import assert_same, run_step  # noqa: E402
from models import ALL_MODELS  # noqa: E402,F401  (puts examples/ on sys.path)
from gpt import GPT, GPTConfig, make_batch  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20


# ------------------------------------------------------------------ resident bytes

_GPT = GPTConfig(vocab_size=512, seq_len=128, d_model=256, n_heads=4, n_layers=4)


def _gpt():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = GPT(_GPT).train()
    return model, make_batch(_GPT, 4, torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def gpt_ref():
    """Loss and gradients of one step of ``_gpt()`` without ssdtrain."""
    return run_step(*_gpt())


@pytest.mark.parametrize("prefetch_bytes", [0, "1MiB", "4MiB"])
def test_peak_resident_far_below_activations(make_offloader, gpt_ref, prefetch_bytes):
    """keep_tail_bytes=0, a small write-behind and prefetch window: at most a fraction of
    the activations is ever held in memory at once (~35 MiB of them, the largest record
    2 MiB), however slow the disk (write_behind_bytes makes forward wait for it)."""
    off = make_offloader(min_tensor_bytes="64KiB", keep_tail_bytes=0,
                         prefetch_bytes=prefetch_bytes, write_behind_bytes="4MiB")
    model, inputs = _gpt()
    assert_same(gpt_ref, run_step(model, inputs, off))
    off.wait()
    s = off.stats()
    assert s.unique_bytes >= 16 * MiB
    assert s.offloaded_bytes == s.unique_bytes  # no tail: every record was written
    assert s.bytes_read > 0
    assert 0 < s.peak_resident_bytes < 0.5 * s.unique_bytes, s.summary()
    assert off.resident_bytes() == 0


def test_peak_resident_counts_what_is_kept(make_offloader, gpt_ref):
    """The measure itself: with a tail larger than forward nothing is written, and the peak
    is every activation (so the test above would fail if offloading did nothing)."""
    off = make_offloader(min_tensor_bytes="64KiB", keep_tail_bytes="1GiB", prefetch_bytes=0)
    model, inputs = _gpt()
    assert_same(gpt_ref, run_step(model, inputs, off))
    off.wait()
    s = off.stats()
    assert s.records_written == 0 and s.bytes_read == 0
    assert s.peak_resident_bytes == s.unique_bytes >= 16 * MiB


# ----------------------------------------------------------------------- peak RSS

# One training step of a deep MLP whose saved activations total ~200 MiB (12 layers x
# (Linear input + GELU input) x 4096 x 512 fp32 = 24 x 8 MiB). Parameters are ~12 MiB.
_CHILD = textwrap.dedent(r'''
    import json, sys
    import torch
    from torch import nn
    import ssdtrain

    mode, spill_dir, grads_path = sys.argv[1:4]
    torch.set_num_threads(1)

    def status(key):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024  # kB
        raise KeyError(key)

    D, LAYERS, BATCH = 512, 12, 4096
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Sequential(*[m for _ in range(LAYERS) for m in (nn.Linear(D, D), nn.GELU())])
    x = torch.randn(BATCH, D, generator=torch.Generator().manual_seed(1))

    off = None
    if mode == "ssdtrain":
        off = ssdtrain.Offloader(ssdtrain.OffloadConfig(
            policy="static", spill_dir=spill_dir, min_tensor_bytes="64KiB", keep_tail_bytes="8MiB",
            prefetch_bytes="16MiB"))

    def step(inp):
        model.zero_grad(set_to_none=True)
        if off is None:
            loss = model(inp).square().mean()
        else:
            with off:
                loss = model(inp).square().mean()
        loss.backward()
        if off is not None:
            off.wait()
        return loss.detach()

    # Warm-up at 1/64 of the size: lazy initialisation and the I/O threads, without
    # raising the high-water mark the real step is measured against.
    step(x[:BATCH // 64])
    rss_before, hwm_before = status("VmRSS"), status("VmHWM")
    loss = step(x)
    hwm_after = status("VmHWM")

    result = dict(rss_before=rss_before, hwm_before=hwm_before, hwm_after=hwm_after)
    torch.save({"loss": loss, **{n: p.grad for n, p in model.named_parameters()}}, grads_path)
    if off is not None:
        s = off.stats()
        result.update(unique_bytes=s.unique_bytes, offloaded_bytes=s.offloaded_bytes,
                      bytes_read=s.bytes_read, records_written=s.records_written,
                      peak_resident_bytes=s.peak_resident_bytes, engine=s.engine)
        off.close()
    print("RESULT " + json.dumps(result))
''')


def _child_env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SSDTRAIN_")}
    env.update(
        PYTHONPATH=os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH")
                                                  else [])),
        OMP_NUM_THREADS="1",
        # Every allocation >= 64 KiB gets its own mmap and goes back to the OS when freed,
        # so RSS follows what is live instead of what malloc keeps cached.
        MALLOC_MMAP_THRESHOLD_="65536",
        PYTHONWARNINGS="ignore",
    )
    return env


def _result(proc):
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{out}\n{err}"
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, out
    return json.loads(lines[0][len("RESULT "):])


def test_peak_rss_drops(tmp_path):
    spill_dir = tmp_path / "spill"
    spill_dir.mkdir()
    script = tmp_path / "one_step.py"
    script.write_text(_CHILD)
    paths = {mode: tmp_path / f"{mode}.pt" for mode in ("plain", "ssdtrain")}
    # The two runs are independent processes: run them side by side (one thread each).
    procs = {mode: subprocess.Popen([sys.executable, str(script), mode, str(spill_dir), str(path)],
                                    env=_child_env(), cwd=str(tmp_path), text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for mode, path in paths.items()}
    plain, ssd = (_result(procs[m]) for m in ("plain", "ssdtrain"))

    # Without offloading the step sets a new high-water mark, so its peak is exact:
    # VmHWM after the step minus VmRSS just before it.
    assert plain["hwm_after"] > plain["hwm_before"]
    plain_peak = plain["hwm_after"] - plain["rss_before"]
    # With ssdtrain the same difference is an upper bound of the step's peak (it also
    # counts any earlier high-water mark above VmRSS), so the comparison is conservative.
    ssd_peak = ssd["hwm_after"] - ssd["rss_before"]
    activations = ssd["unique_bytes"]
    assert activations >= 150 * MiB
    assert plain_peak >= 0.8 * activations, (plain_peak, activations)
    assert ssd["offloaded_bytes"] >= 0.9 * activations and ssd["bytes_read"] > 0, ssd
    assert ssd["records_written"] > 0
    assert ssd_peak < 0.7 * plain_peak, \
        f"peak RSS of the step: {ssd_peak / MiB:.0f} MiB with ssdtrain vs " \
        f"{plain_peak / MiB:.0f} MiB without ({ssd})"

    ref = torch.load(paths["plain"])
    got = torch.load(paths["ssdtrain"])
    assert ref.keys() == got.keys() and len(ref) == 25
    for name in ref:
        assert torch.equal(got[name], ref[name]), f"{name} differs with ssdtrain"
    assert os.listdir(spill_dir) == []


# ------------------------------------------------------------------ write-behind bound

class _SlowWrites:
    """Delays every write's completion by ``delay`` seconds: a disk slower than forward."""

    def __init__(self, offloader, delay):
        engine = testing.engine(offloader)
        self._write, self.delay = engine.write, delay
        engine.write = self.write

    def write(self, file, offset, address, nbytes, **kw):
        import concurrent.futures
        import threading
        import time
        inner = self._write(file, offset, address, nbytes, **kw)
        outer = concurrent.futures.Future()

        def settle():
            time.sleep(self.delay)
            try:
                outer.set_result(inner.result())
            except Exception as e:  # pass the engine's error on unchanged
                outer.set_exception(e)
        threading.Thread(target=settle, daemon=True).start()
        return outer


@pytest.mark.parametrize("limit_mib", [0, 2, 6])
def test_write_behind_bounds_memory_when_the_disk_is_slow(make_offloader, gpt_ref, limit_mib):
    """With writes slower than forward, resident bytes never exceed write_behind_bytes plus
    one record (2 MiB here) plus the prefetch window; forward waited for the disk."""
    off = make_offloader(min_tensor_bytes="64KiB", keep_tail_bytes=0, prefetch_bytes="1MiB",
                         write_behind_bytes=f"{limit_mib}MiB")
    # Each write takes 0.2 s; forward saves its >= 16 MiB within far less, so even the
    # 6 MiB bound is reached while writes are in flight and pack must wait.
    _SlowWrites(off, delay=0.2)
    model, inputs = _gpt()
    assert_same(gpt_ref, run_step(model, inputs, off))
    off.wait()
    s = off.stats()
    assert s.offloaded_bytes == s.unique_bytes >= 16 * MiB
    assert s.write_stall_seconds > 0
    assert s.peak_resident_bytes <= (limit_mib + 2 + 1) * MiB, s.summary()


def test_without_a_bound_slow_writes_pile_up(make_offloader, gpt_ref):
    """The measure above is not vacuous: with a large write_behind_bytes the same slow
    disk leaves most activations in memory at once, and forward never waits."""
    off = make_offloader(min_tensor_bytes="64KiB", keep_tail_bytes=0, prefetch_bytes="1MiB",
                         write_behind_bytes="1GiB")
    _SlowWrites(off, delay=0.5)
    model, inputs = _gpt()
    assert_same(gpt_ref, run_step(model, inputs, off))
    off.wait()
    s = off.stats()
    assert s.write_stall_seconds == 0
    assert s.peak_resident_bytes > 9 * MiB, s.summary()
