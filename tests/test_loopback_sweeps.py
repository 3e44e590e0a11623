"""The interrupt and garbage-collection sweeps over the device path.

tests/test_interrupts.py raises KeyboardInterrupt at every line of the store modules
(``_device/transfers.py`` included) that its scenario runs on the training thread, and
tests/test_gc_injection.py runs a garbage collection inside every locked region of the
store; here both run with a loopback device attached (ssdtrain/testing/loopback.py,
``SSDTRAIN_TEST_INJECT_LOOPBACK=1`` in their child processes), so every record is a device
record: staged through pinned memory, copied on the loopback's streams, loaded for the
compute stream. The checks are theirs, plus: no device memory left in use, no error
on the device's streams.

The device-line sweep runs in parts that take turns by ISO week (NOTE [ Sweeps take
turns by week ] in tests/helpers.py); ``SSDTRAIN_TEST_ALL_SHARDS=1`` runs every part.
"""

from __future__ import annotations

import pytest

import inject
import test_gc_injection
import test_interrupts
from helpers import part_id, weekly_shard

DEVICE_PARTS = 3


@pytest.fixture(autouse=True)
def _loopback(monkeypatch):
    monkeypatch.setenv(inject.LOOPBACK_ENV, "1")


def _sweep(spill_dir, only="", shard=None):
    extra = ("--only", only) if only else ()
    result, base = inject.sweep_in_children("posix", "first", spill_dir, budget_s=600,
                                            extra=extra, shard=shard)
    print(result.summary())
    assert base is not None, result.stopped
    if result.failing or result.stopped:
        pytest.fail(result.message(), pytrace=False)
    assert len(result.outcomes) == base["targets"] > 0, result.summary()
    assert base["all_targets"] > 20, base  # the whole sweep, all parts
    assert sum(o.fired for o in result.outcomes) >= 0.5 * len(result.outcomes), \
        result.summary()


@pytest.mark.parametrize("part", range(DEVICE_PARTS), ids=lambda p: part_id(p, DEVICE_PARTS))
def test_interrupt_at_each_device_line(spill_dir, part):
    """KeyboardInterrupt at the first run of every line of ``_device/transfers.py`` and
    ``_device/staging.py`` the scenario runs on the training thread (pack's event,
    unpack's wait, staging on a miss), every record a device record (posix engine); a
    third of the lines per part."""
    shard = weekly_shard(DEVICE_PARTS)
    if not shard.runs(part):
        pytest.skip(shard.skip_reason("device-line sweep", part))
    _sweep(spill_dir, only="ssdtrain._device.transfers,ssdtrain._device.staging",
           shard=(part, DEVICE_PARTS))


@pytest.mark.slow
@pytest.mark.skipif(not test_interrupts.FULL, reason="set SSDTRAIN_TEST_INTERRUPT_FULL=1 (every "
                                                     "store line on the device path: minutes)")
def test_interrupt_at_each_store_line_on_the_device_path(spill_dir):
    """KeyboardInterrupt at the first run of every store line, on the device path."""
    _sweep(spill_dir)


def test_gc_inside_every_locked_region_on_the_device_path(spill_dir):
    """Forced collections in every store lock (staging is taken under the store's), read-back
    saved tensors dying in reference cycles: no deadlock, exact, nothing left."""
    r = test_gc_injection._run("locks", spill_dir, threshold="default", steps=20, timeout=90)
    assert any(r["inside_found"].values()), r["inside"]
