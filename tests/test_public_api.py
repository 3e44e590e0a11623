"""The public seams adapters, examples and benchmarks use instead of private names:
``Offloader.save``/``restore``, ``keep_in_memory``, ``wrap_engine``, ``records()``,
``active_plan``/``replans``, ``OffloadConfig``'s choice constants and ``ssdtrain.tools``.
"""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

import ssdtrain
from ssdtrain import tools

# Everything >= 4 KiB is offloaded, nothing is kept back as the tail.
DISK = dict(policy="static", min_tensor_bytes=4096, keep_tail_bytes=0, prefetch_bytes="1MiB")


def _activation(n=4096):
    """A non-leaf float tensor of ``4 * n`` bytes (what a forward would save)."""
    return torch.randn(n, requires_grad=True) * 2


def test_save_restore_round_trip_and_release(make_offloader):
    off = make_offloader(**DISK)
    x = _activation().detach()
    with off:
        handle = off.save(x)
    off.wait()
    assert off.stats().offloaded_bytes >= x.nbytes
    assert off.live_records() == 1
    got = off.restore(handle)
    assert torch.equal(got, x) and got.dtype == x.dtype and got.shape == x.shape
    del handle, got
    gc.collect()
    assert off.live_records() == 0  # dropping the handle released the record
    assert off.spill_bytes_in_use() == 0


def test_restore_checks_the_version(make_offloader):
    off = make_offloader(**DISK)
    x = _activation().detach()
    with off:
        handle = off.save(x)
    x.add_(1)
    with pytest.raises(ssdtrain.InplaceModificationError):
        off.restore(handle)


def test_save_keeps_small_tensors_as_they_are(make_offloader):
    off = make_offloader(**DISK)
    small = torch.arange(8.0)
    with off:
        handle = off.save(small)
    assert off.live_records() == 0 and off.stats().kept_bytes == small.nbytes
    assert torch.equal(off.restore(handle), small)


def test_save_on_a_closed_offloader_raises(make_offloader):
    off = make_offloader(**DISK)
    off.close()
    with pytest.raises(ssdtrain.OffloaderClosedError):
        off.save(_activation().detach())


def test_keep_in_memory_is_never_offloaded(make_offloader):
    off = make_offloader(**DISK)
    state = torch.randn(4096)          # model state the offloader cannot see as such
    other = _activation().detach()
    ssdtrain.keep_in_memory(state, None)  # None is ignored
    with off:
        h_state = off.save(state)
        h_other = off.save(other)
    off.wait()
    assert off.live_records() == 1     # only ``other``
    assert off.stats().kept_bytes == state.nbytes
    assert off.restore(h_state) is not None and torch.equal(off.restore(h_state), state)
    assert torch.equal(off.restore(h_other), other)


def test_records_are_read_only_views(make_offloader):
    off = make_offloader(**DISK)
    x = _activation().detach()
    with off:
        handle = off.save(x)
    off.wait()
    (view,) = off.records()
    assert isinstance(view, ssdtrain.RecordView)
    assert view.nbytes == x.nbytes and view.hi - view.lo == view.nbytes
    assert view.state in ("ON_DISK", "LOADED", "WRITING") and view.writes == 1
    assert isinstance(view.key, int) and view.version == x._version
    with pytest.raises(AttributeError):
        view.state = "KEPT"
    with pytest.raises(AttributeError):
        view.other = 1
    assert "RecordView" in repr(view)
    del handle
    gc.collect()
    assert off.records() == []


class _Counting:
    """An engine wrapper that counts writes and delegates everything."""

    def __init__(self, engine):
        self.inner, self.writes = engine, 0

    def write(self, *args, **kwargs):
        self.writes += 1
        return self.inner.write(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_wrap_engine_injects_a_wrapper(make_offloader):
    off = make_offloader(**DISK)
    seen = []
    wrapper = off.wrap_engine(lambda engine: seen.append(engine) or _Counting(engine))
    assert isinstance(wrapper, _Counting) and wrapper.inner is seen[0]
    x = _activation().detach()
    with off:
        handle = off.save(x)
    off.wait()
    assert wrapper.writes >= 1
    assert torch.equal(off.restore(handle), x)


def test_wrap_engine_refuses_inside_a_forward_and_none(make_offloader):
    off = make_offloader(**DISK)
    with off:
        with pytest.raises(ssdtrain.SSDTrainError, match="inside a forward"):
            off.wrap_engine(_Counting)
    with pytest.raises(ssdtrain.SSDTrainError, match="returned None"):
        off.wrap_engine(lambda engine: None)
    off.close()
    with pytest.raises(ssdtrain.OffloaderClosedError):
        off.wrap_engine(_Counting)


def test_plan_properties_without_tracking(make_offloader):
    off = make_offloader(**DISK)
    assert off.active_plan is None and off.replans == 0


def test_config_choice_constants():
    cfg = ssdtrain.OffloadConfig()
    assert cfg.engine in ssdtrain.OffloadConfig.ENGINES
    assert cfg.on_spill_error in ssdtrain.OffloadConfig.SPILL_ERROR_ACTIONS
    assert cfg.on_spill_full in ssdtrain.OffloadConfig.SPILL_FULL_ACTIONS
    assert cfg.direct_io in ssdtrain.OffloadConfig.DIRECT_IO_MODES
    assert cfg.policy in ssdtrain.OffloadConfig.POLICIES
    names = {f.name for f in dataclasses.fields(ssdtrain.OffloadConfig)}
    assert not names & {"ENGINES", "SPILL_ERROR_ACTIONS", "POLICIES"}  # not fields
    with pytest.raises(ssdtrain.ConfigError):
        ssdtrain.OffloadConfig(engine="not-" + ssdtrain.OffloadConfig.ENGINES[0])


def test_tools_surface(tmp_path):
    assert tools.BLOCK == 4096
    assert isinstance(tools.filesystem_type(str(tmp_path)), str)
    assert tools.rok_plans(2)[0] and all(len(p) == 2 for p in tools.rok_plans(2))
    spill = tools.SpillSet([str(tmp_path)], "auto")
    try:
        assert len(spill.files) == 1 and isinstance(spill.files[0], tools.SpillFile)
    finally:
        spill.close()
    assert tools.ReadBuffers is not None
    if tools.crc32c_available():
        buf = torch.ones(64, dtype=torch.uint8)
        assert tools.crc32c(buf.data_ptr(), 64) == tools.crc32c(buf.data_ptr(), 64)
        ok, why = tools.uring_probe()
        assert isinstance(ok, bool) and isinstance(why, str)
    else:
        with pytest.raises(ssdtrain.ConfigError):
            tools.crc32c(0, 0)


def test_save_and_restore_validate_input_and_owner(make_offloader, tmp_path):
    """Wrong types and another offloader's handles get ssdtrain errors
    saying what was expected (they raised AttributeError, or corrupted both books)."""
    off = make_offloader(**DISK)
    other = ssdtrain.Offloader(spill_dir=str(tmp_path), **DISK)
    x = _activation().detach()
    with off:
        handle = off.save(x)
    for bad in (None, 3, "x", [x]):
        with pytest.raises(ssdtrain.SSDTrainError, match="save\\(\\) takes a torch.Tensor"):
            off.save(bad)
    with pytest.raises(ssdtrain.SSDTrainError, match="not the tensor"):
        off.restore(x)
    with pytest.raises(ssdtrain.SSDTrainError, match="takes the handle save\\(\\) returned"):
        off.restore(None)
    with pytest.raises(ssdtrain.SSDTrainError, match="another Offloader"):
        other.restore(handle)
    off.wait()
    # Neither offloader's books moved.
    assert off.live_records() == 1 and off.resident_bytes() >= 0
    assert other.live_records() == 0 and other.resident_bytes() == 0
    assert torch.equal(off.restore(handle), x)
    other.close()
    with off:
        small = off.save(torch.arange(8.0))
    off.close()
    with pytest.raises(ssdtrain.OffloaderClosedError):
        off.save(torch.arange(8.0))   # kept tensors too: the offloader is closed
    with pytest.raises(ssdtrain.OffloaderClosedError):
        off.restore(small)
    for call in (lambda: off.set_plan(["keep"]), off.plan):
        with pytest.raises(ssdtrain.OffloaderClosedError):
            call()


def test_stats_since_differences_counters_and_keeps_levels(make_offloader):
    """Stats.since: a step's counters are differences, levels and maxima are what they
    are after it. LEVELS names only fields, every peak_* among them (a new maximum
    field not listed would be differenced: meaningless)."""
    import dataclasses
    names = {f.name for f in dataclasses.fields(ssdtrain.Stats)}
    assert ssdtrain.Stats.LEVELS <= names
    assert {n for n in names if n.startswith(("peak_", "budget_"))} <= ssdtrain.Stats.LEVELS
    off = make_offloader(min_tensor_bytes=0, keep_tail_bytes=0)
    x = torch.randn(256, 256, requires_grad=True)
    steps = []
    for _ in range(2):
        before = off.stats()
        with off:
            loss = x.sin().sin().sum()
        loss.backward()
        off.wait()
        steps.append(off.stats().since(before))
    total = off.stats()
    assert steps[0].offloaded_bytes == steps[1].offloaded_bytes > 0  # each step's own
    assert steps[0].offloaded_bytes + steps[1].offloaded_bytes == total.offloaded_bytes
    assert steps[1].peak_resident_bytes == total.peak_resident_bytes > 0  # not 0
    assert steps[1].engine == total.engine


@pytest.mark.parametrize("cls", ["Stats", "OffloadConfig"])
def test_every_field_has_its_own_docstring(cls):
    """Each field of the public dataclasses is followed by its own docstring (a field
    inserted between another and its docstring leaves that one documenting the wrong
    field, or none)."""
    import ast
    import inspect
    obj = getattr(ssdtrain, cls)
    body = ast.parse(inspect.getsource(obj)).body[0].body
    missing = []
    for i, node in enumerate(body):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            nxt = body[i + 1] if i + 1 < len(body) else None
            if not (isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                missing.append(node.target.id)
    assert not missing, f"{cls} fields without their own docstring: {missing}"
