"""Shared fixtures. Plain helpers (run_step, assert_same...) live in helpers.py."""

from __future__ import annotations

import gc
import os
import sys
import threading
from pathlib import Path

import pytest

# Deterministic cuBLAS for the bitwise CUDA tests (tests/test_device.py); it must be
# set before cuBLAS starts. Harmless without a GPU.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

import ssdtrain  # noqa: E402
from helpers import assert_same, run_step  # noqa: E402,F401  (re-exported for convenience)
import late_io  # noqa: E402

late_io.install()  # SSDTRAIN_TEST_IO_DELAY_MS: every request completes late (late_io.py)


@pytest.fixture
def spill_dir(tmp_path):
    """An empty directory for spill files, removed with the test's tmp_path."""
    d = tmp_path / "spill"
    d.mkdir()
    return d


@pytest.fixture
def make_offloader(spill_dir):
    """``make_offloader(**overrides)``: an Offloader on ``spill_dir``, closed at teardown.

    Its policy is ``"static"`` unless given (the default is ``"auto"``): the tests that
    use it are about the offload machinery (records written, read back, failures),
    which ``"auto"`` uses at its first step, then only within its quota (tested in
    tests/test_default_policy.py and tests/test_policy_tiers.py)."""
    made = []

    def make(**overrides):
        overrides.setdefault("spill_dir", str(spill_dir))
        overrides.setdefault("policy", "static")
        off = ssdtrain.Offloader(ssdtrain.OffloadConfig(**overrides))
        made.append(off)
        return off

    yield make
    for off in made:
        off.close()


@pytest.fixture(autouse=True)
def _settle_background_release():
    """A collected store releases its threads and files on a helper thread; let that
    finish after each test so tests counting fds and threads see only their own."""
    yield
    gc.collect()
    for thread in threading.enumerate():
        if thread.name == "ssdtrain-release":
            thread.join(timeout=30)
    # What survived is long-lived (modules, caches): move it out of the collector's
    # view, so the next collection scans only new objects. With torch, DeepSpeed,
    # Megatron and transformers loaded a full collection takes ~0.25 s, which over
    # two thousand tests was minutes of the suite.
    gc.freeze()


# The files that take longest, longest first (seconds with two workers on this VM's two
# cores, measured with --durations). `make test` runs tests in pytest-xdist workers that
# take the next tests in collection order as they finish (--dist load --maxschedchunk
# 2): a long test collected last would leave one worker running it alone at the end.
# Outside xdist the order does not matter; no test depends on which ran before it.
# (The line sweeps run one part a week: NOTE [ Sweeps take turns by week ] in helpers.py.)
LONGEST_FIRST = ("test_interrupts.py", "test_experiments.py", "test_io_benchmarks.py",
                 "test_pipeline_sweep.py", "test_benchmarks.py", "test_store_model.py",
                 "test_soak.py", "test_gc_injection.py", "test_estimate.py",
                 "test_accel_emulator.py", "test_multirank.py", "test_megatron_pipeline.py",
                 "test_timeouts.py", "test_many_records.py", "test_hosttier.py",
                 "test_loopback_sweeps.py", "test_megatron.py", "test_fsdp2.py",
                 "test_hook_cost.py", "test_deepspeed.py", "test_fork.py", "test_lifecycle.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable
