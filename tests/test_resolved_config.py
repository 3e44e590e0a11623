"""One frozen config, resolved once (NOTE [ One resolved config ] in ARCHITECTURE).

``OffloadConfig`` is frozen; ``resolve()`` is the one step that decides the defaults
and ``"auto"`` values; the store refuses anything else, and the planner's defaults are
the config's own.
"""

import dataclasses
import os

import pytest
import torch
from hypothesis import given, settings, strategies as st

import ssdtrain
from ssdtrain import testing
from ssdtrain import ConfigError, OffloadConfig, ResolvedConfig
from ssdtrain._config import default
from ssdtrain._policies.planner import StepCost

FIELDS = [f.name for f in dataclasses.fields(OffloadConfig)]


def test_config_is_frozen(tmp_path):
    cfg = OffloadConfig(spill_dir=str(tmp_path))
    for name in FIELDS:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(cfg, name, getattr(cfg, name))
    assert cfg.replace(prefetch_bytes="1MiB").prefetch_bytes == 1 << 20
    assert cfg.prefetch_bytes == default("prefetch_bytes")  # the original is unchanged


def test_resolve_decides_every_auto_value(tmp_path):
    cfg = OffloadConfig(spill_dir=str(tmp_path))
    assert cfg.engine == "auto" and cfg.verify == "auto"
    r = cfg.resolve()
    assert isinstance(r, ResolvedConfig) and isinstance(r, OffloadConfig)
    assert r.engine in ("native", "posix", "kvikio") and r.engine_reason
    assert isinstance(r.verify, bool)
    assert r.spill_dir == [str(tmp_path)]
    assert r.resolve() is r
    for name in FIELDS:  # everything not decided is carried over as given
        if name not in ("engine", "verify", "spill_dir"):
            assert getattr(r, name) == getattr(cfg, name), name


def test_resolve_fills_the_default_spill_dir():
    r = OffloadConfig(engine="posix", verify=False).resolve()
    assert len(r.spill_dir) == 1 and os.path.isdir(r.spill_dir[0])
    assert os.path.basename(r.spill_dir[0]) == f"ssdtrain-{os.geteuid()}"


def test_resolve_checks_directories_before_anything_runs(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        OffloadConfig(spill_dir=str(tmp_path / "missing")).resolve()
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match="not a directory"):
        OffloadConfig(spill_dir=str(f)).resolve()


def test_named_engine_and_verify_are_kept(tmp_path):
    r = OffloadConfig(spill_dir=str(tmp_path), engine="posix", verify=False).resolve()
    assert (r.engine, r.verify, r.engine_reason) == ("posix", False, "configured")


def test_offloader_runs_on_the_resolved_config(tmp_path):
    cfg = OffloadConfig(spill_dir=str(tmp_path), engine="posix")
    with ssdtrain.Offloader(cfg) as off:
        pass
    try:
        assert isinstance(off.config, ResolvedConfig)
        assert off.config == cfg.resolve()
        assert cfg.engine == "posix" and cfg.verify == "auto"  # the caller's is untouched
        with pytest.raises(dataclasses.FrozenInstanceError):
            off.config.write_behind_bytes = 0
    finally:
        off.close()


def test_replace_on_a_resolved_config_gives_a_plain_one(tmp_path):
    r = OffloadConfig(spill_dir=str(tmp_path)).resolve()
    c = r.replace(min_tensor_bytes=0)
    assert type(c) is OffloadConfig and c.min_tensor_bytes == 0 and c.engine == r.engine
    with ssdtrain.Offloader(c) as off:  # resolved again
        pass
    off.close()
    assert isinstance(off.config, ResolvedConfig)


def test_a_resolved_config_cannot_hold_auto_values(tmp_path):
    with pytest.raises(ConfigError, match="resolve"):
        ResolvedConfig(spill_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="resolve"):
        ResolvedConfig(spill_dir=str(tmp_path), engine="posix", verify="auto")
    with pytest.raises(ConfigError, match="resolve"):
        ResolvedConfig(engine="posix", verify=True)


def test_the_store_refuses_an_unresolved_config(tmp_path):
    from ssdtrain._store.store import Store
    with pytest.raises(AssertionError, match="ResolvedConfig"):
        Store(OffloadConfig(spill_dir=str(tmp_path)), None, None, None)


def test_planner_defaults_are_the_configs():
    step = StepCost(write_bps=1.0, read_bps=1.0)
    cfg = OffloadConfig()
    assert step.prefetch_bytes == cfg.prefetch_bytes
    assert step.write_behind_bytes == cfg.write_behind_bytes


def test_a_plan_limits_write_behind_without_touching_the_config(tmp_path):
    off = ssdtrain.Offloader(spill_dir=str(tmp_path), engine="posix", policy="static")
    try:
        testing.limit_write_behind(off, 4096)
        assert testing.write_behind(off) == 4096
        assert off.config.write_behind_bytes == default("write_behind_bytes")
        testing.limit_write_behind(off, None)
        assert testing.write_behind(off) == off.config.write_behind_bytes
    finally:
        off.close()
    # policy="auto": forward never waits for a write (NOTE [ The offload quota ]), so
    # the limit in force without a plan is none at all.
    off = ssdtrain.Offloader(spill_dir=str(tmp_path), engine="posix", policy="auto")
    try:
        assert testing.write_behind(off) >= 1 << 62
        testing.limit_write_behind(off, 4096)
        testing.limit_write_behind(off, None)
        assert testing.write_behind(off) >= 1 << 62
    finally:
        off.close()


@settings(max_examples=40, deadline=None)
@given(prefetch=st.integers(0, 1 << 40), tail=st.integers(0, 1 << 40),
       verify=st.sampled_from([True, False, "auto"]),
       engine=st.sampled_from(["auto", "posix", "native"]))
def test_resolve_is_idempotent_and_keeps_what_was_asked(tmp_path_factory, prefetch, tail,
                                                        verify, engine):
    d = str(tmp_path_factory.mktemp("r"))
    cfg = OffloadConfig(spill_dir=d, prefetch_bytes=prefetch, keep_tail_bytes=tail,
                        verify=verify, engine=engine)
    r = cfg.resolve()
    assert r.replace().resolve() == r
    if engine != "auto":
        assert r.engine == engine
    if verify != "auto":
        assert r.verify is verify
    assert (r.prefetch_bytes, r.keep_tail_bytes) == (prefetch, tail)


def test_gradients_unchanged_with_a_resolved_config_given(tmp_path):
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 256)
    x = torch.randn(64, 256)

    def grads(off):
        lin.zero_grad()
        if off is None:
            lin(x).tanh().sum().backward()
        else:
            with off:
                y = lin(x).tanh().sum()
            y.backward()
        return [p.grad.clone() for p in lin.parameters()]

    ref = grads(None)
    r = OffloadConfig(spill_dir=str(tmp_path), min_tensor_bytes=0, keep_tail_bytes=0).resolve()
    off = ssdtrain.Offloader(r)
    try:
        assert off.config is r
        assert all(torch.equal(a, b) for a, b in zip(ref, grads(off)))
    finally:
        off.close()
