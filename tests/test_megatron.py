"""The Megatron-core adapter (``ssdtrain.integrations.megatron``) on a real ``GPTModel``.

megatron-core 0.16.1, ``get_gpt_layer_local_spec`` (no TransformerEngine), gloo with
world size 1, on the CPU through ``tests/megatron_shim.py``. The backbone: losses and
every gradient of two SGD steps are ``torch.equal`` to the run without ssdtrain, for
no recompute, selective and full recompute, while the stats show that the configured
layers (and only those) really went through the spill tier. Then: undo restores
megatron-core, other configs are left alone, both factory signatures, errors, the
command line, and the example.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip(
    "megatron.core", reason="megatron-core is not installed: pip install megatron-core==0.16.1")

import megatron_shim  # noqa: E402  (tests/ is on sys.path through conftest.py)
import ssdtrain  # noqa: E402
from ssdtrain.integrations import megatron as ssd_megatron  # noqa: E402

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
    from megatron.core.models.gpt import GPTModel  # noqa: E402
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
    from megatron.core.transformer import transformer_block  # noqa: E402
    from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

# megatron-core's own deprecation notices, not ssdtrain's (ssdtrain logs, never warns).
pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron"),
              pytest.mark.filterwarnings("ignore::UserWarning:megatron")]

REPO_ROOT = Path(__file__).resolve().parent.parent
LAYERS, HIDDEN, HEADS, SEQ, BATCH, VOCAB = 3, 64, 4, 32, 2, 128
HIDDEN_STATE_BYTES = SEQ * BATCH * HIDDEN * 4   # one [s, b, h] fp32 activation: 16 KiB
OFFLOADED = 2                                   # offload_layers in most tests (of LAYERS)
# keep_tail_bytes=0: every record is written, so per-layer unique bytes are exactly the
# bytes offloaded; write_behind_bytes=0: each write completes before forward goes on, so
# backward reads every record back from the disk (a tiny model's backward would otherwise
# often find its records still being written and use them from memory).
# min_tensor_bytes above the 1 KiB bool attention mask, below everything else.
OPTIONS = dict(policy="static", keep_tail_bytes=0, write_behind_bytes=0, min_tensor_bytes=2048)

RECOMPUTE = {
    "none": {},
    "selective": dict(recompute_granularity="selective"),   # recompute_modules=["core_attn"]
    "full-uniform": dict(recompute_granularity="full", recompute_method="uniform",
                         recompute_num_layers=1),
    "full-block": dict(recompute_granularity="full", recompute_method="block",
                       recompute_num_layers=1),
}


@pytest.fixture(scope="module", autouse=True)
def megatron_cpu():
    """Process groups, RNG tracker and memory buffer for the whole module (undone after)."""
    with megatron_shim.megatron_cpu():
        yield


@pytest.fixture(autouse=True)
def no_leftovers():
    """Every test leaves megatron-core as it found it: no config enabled, nothing patched."""
    from megatron.core.extensions import transformer_engine
    factory = transformer_block.get_cpu_offload_context
    te_factory = transformer_engine.get_cpu_offload_context
    init = transformer_block.TransformerBlock.__dict__["__init__"]
    yield
    for session in list(ssd_megatron._SESSIONS.values()):
        session.disable()
    assert transformer_block.get_cpu_offload_context is factory
    assert transformer_engine.get_cpu_offload_context is te_factory
    assert transformer_block.TransformerBlock.__dict__["__init__"] is init


def make_config(**overrides):
    kw = dict(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
              use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
              params_dtype=torch.float32)
    kw.update(overrides)
    return TransformerConfig(**kw)


def build(config, seed=1234):
    megatron_shim.manual_seed(seed)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                    vocab_size=VOCAB, max_sequence_length=SEQ)


def batch():
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    position_ids = torch.arange(SEQ).expand(BATCH, SEQ)
    causal = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).triu(1)  # True = masked out
    return ids, position_ids, causal, labels


def train(model, steps=2):
    """SGD steps; per step the detached loss and every gradient (cloned)."""
    ids, pos, mask, labels = batch()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    history = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = model(ids, pos, mask, labels=labels).mean()
        loss.backward()
        history.append((loss.detach().clone(),
                        {n: p.grad.clone() for n, p in model.named_parameters()}))
        opt.step()
    return history


def assert_same_history(ref, got):
    assert len(ref) == len(got)
    for step, ((ref_loss, ref_grads), (loss, grads)) in enumerate(zip(ref, got)):
        assert torch.equal(loss, ref_loss), f"step {step}: loss {loss} != {ref_loss}"
        assert grads.keys() == ref_grads.keys()
        for name, ref_grad in ref_grads.items():
            assert torch.equal(grads[name], ref_grad), \
                f"step {step}: gradient of {name} differs (max abs diff " \
                f"{(grads[name] - ref_grad).abs().max().item()!r})"


_REFERENCE = {}


def reference(mode):
    if mode not in _REFERENCE:
        _REFERENCE[mode] = train(build(make_config(**RECOMPUTE[mode])))
    return _REFERENCE[mode]


def run_enabled(mode, spill_dir, offload_layers=OFFLOADED, **options):
    """Train with ssdtrain; returns (history, Stats after all I/O, layer stats)."""
    config = make_config(**RECOMPUTE[mode])
    handle = ssd_megatron.enable(config, offload_layers=offload_layers,
                                 spill_dir=str(spill_dir), **{**OPTIONS, **options})
    try:
        history = train(build(config))
        handle.offloader.wait()
        return history, handle.stats(), handle.layer_stats()
    finally:
        ssd_megatron.disable(config)


# ----------------------------------------------------------------------------- canary

def test_canary_megatron_names():
    """Fails loudly when megatron-core renames what the adapter or the shim patch."""
    missing = ssd_megatron.missing_names()
    assert not missing, (
        f"megatron-core {_megatron_version()} lacks {missing}, patched by "
        f"integrations/megatron.py (PATCHED_NAMES): update the adapter for this release")
    missing = megatron_shim.missing_names()
    assert not missing, (
        f"megatron-core {_megatron_version()} lacks {missing}, patched by "
        f"tests/megatron_shim.py (PATCHED_NAMES): update the shim for this release")
    # The mechanism, not only the names: the block asks the factory for its context and
    # enters it around each layer; full recompute goes through _checkpointed_forward.
    init = inspect.getsource(transformer_block.TransformerBlock.__init__)
    forward = inspect.getsource(transformer_block.TransformerBlock.forward)
    recompute = inspect.getsource(transformer_block.TransformerBlock._checkpointed_forward)
    for where, source, needle in [("__init__", init, "get_cpu_offload_context("),
                                  ("forward", forward, "with self.offload_context"),
                                  ("forward", forward, "self._checkpointed_forward("),
                                  ("_checkpointed_forward", recompute, "self._get_layer(")]:
        assert needle in source, (
            f"megatron-core {_megatron_version()}: TransformerBlock.{where} no longer contains "
            f"{needle!r}; the ssdtrain adapter relies on it (see integrations/megatron.py, "
            f"NOTE [ Which TransformerBlock is asking ])")


def _megatron_version():
    try:
        from importlib.metadata import version
        return version("megatron-core")
    except Exception:  # noqa: BLE001 - only for the message
        return "(unknown version)"


# ------------------------------------------------------------------------ equivalence

@pytest.mark.parametrize("mode", list(RECOMPUTE))
def test_equal_to_megatron_without_ssdtrain(mode, spill_dir):
    """Loss and gradients bitwise equal; the first OFFLOADED layers offload, the rest not."""
    history, stats, layers = run_enabled(mode, spill_dir)
    assert_same_history(reference(mode), history)

    assert stats.offloaded_bytes > 0 and stats.records_written > 0
    assert stats.bytes_read == stats.offloaded_bytes, "backward did not read each record back"
    assert sorted(layers) == list(range(LAYERS))
    for i in range(OFFLOADED):
        assert layers[i].passes == 2 and layers[i].unique_bytes > 0, (i, layers[i])
    for i in range(OFFLOADED, LAYERS):
        assert layers[i] == ssd_megatron.LayerStats(), f"layer {i} is beyond offload_layers"
    # keep_tail_bytes=0: every record created inside the offloaded layers was written.
    assert stats.offloaded_bytes == sum(s.unique_bytes for s in layers.values()) \
        == stats.unique_bytes
    assert stats.packed_bytes == sum(s.packed_bytes for s in layers.values())


def test_what_each_recompute_mode_offloads(spill_dir):
    """The composition documented in NOTE [ Composition with Megatron's recompute ]."""
    per_pass = {}
    for mode in RECOMPUTE:
        _, _, layers = run_enabled(mode, spill_dir, offload_layers=LAYERS)
        per_pass[mode] = [layers[i].unique_bytes // layers[i].passes for i in range(LAYERS)]
    full_layer = per_pass["none"][0]
    # No recompute: everything a layer saves, far more than its input.
    assert all(b == full_layer for b in per_pass["none"]) and full_layer > 8 * HIDDEN_STATE_BYTES
    # Selective: all but the core attention's internals, recomputed in backward; in
    # megatron-core 0.16.1 that is the attention probabilities [b, heads, s, s].
    assert all(HIDDEN_STATE_BYTES < b < full_layer for b in per_pass["selective"])
    assert full_layer - per_pass["selective"][0] == BATCH * HEADS * SEQ * SEQ * 4
    # Full, uniform: only each layer's checkpointed input, one [s, b, h] hidden state.
    assert per_pass["full-uniform"] == [HIDDEN_STATE_BYTES] * LAYERS
    # Full, block (recompute_num_layers=1): layer 0 checkpointed, the others run normally.
    assert per_pass["full-block"] == [HIDDEN_STATE_BYTES, full_layer, full_layer]


def test_all_layers_by_default(spill_dir):
    config = make_config()
    handle = ssd_megatron.enable(config, spill_dir=str(spill_dir), **OPTIONS)
    try:
        assert handle.offload_layers is None
        from ssdtrain.integrations.distributed import rank_spill_dir
        assert handle.offloader.config.spill_dir == [rank_spill_dir(str(spill_dir), create=False)]
        history = train(build(config), steps=1)
        layers = handle.layer_stats()
    finally:
        handle.disable()
    assert_same_history(reference("none")[:1], history)
    assert all(layers[i].passes == 1 and layers[i].unique_bytes > 0 for i in range(LAYERS))


def test_zero_layers_offload_nothing(spill_dir):
    config = make_config()
    handle = ssd_megatron.enable(config, offload_layers=0, spill_dir=str(spill_dir), **OPTIONS)
    try:
        history = train(build(config), steps=1)
        assert handle.stats().packed_bytes == 0
        assert all(s == ssd_megatron.LayerStats() for s in handle.layer_stats().values())
    finally:
        handle.disable()
    assert_same_history(reference("none")[:1], history)


def test_no_grad_forward_offloads_nothing(spill_dir):
    config = make_config()
    handle = ssd_megatron.enable(config, spill_dir=str(spill_dir), **OPTIONS)
    try:
        model = build(config)
        ids, pos, mask, labels = batch()
        with torch.no_grad():
            model.eval()
            model(ids, pos, mask, labels=labels)
        stats = handle.stats()
        assert stats.packed_bytes == 0 and not handle.offloader.in_forward
        assert all(s.passes == 0 for s in handle.layer_stats().values())
    finally:
        handle.disable()


def test_failing_layer_ends_the_pass(spill_dir):
    """An exception inside an offloaded layer propagates, the pass is closed, and the
    next step is exact again."""
    config = make_config()
    handle = ssd_megatron.enable(config, offload_layers=OFFLOADED, spill_dir=str(spill_dir),
                                 **OPTIONS)
    try:
        model = build(config)
        mlp = model.decoder.layers[1].mlp

        def broken(*args, **kwargs):
            raise ValueError("boom")

        mlp.forward = broken
        ids, pos, mask, labels = batch()
        with pytest.raises(ValueError, match="boom"):
            model(ids, pos, mask, labels=labels)
        assert not handle.offloader.in_forward
        del mlp.forward
        history = train(model)
    finally:
        handle.disable()
    assert_same_history(reference("none"), history)
    assert handle.offloader.closed


# ------------------------------------------------------------------------------- undo

def test_disable_restores_megatron(spill_dir):
    factory = transformer_block.get_cpu_offload_context
    init = transformer_block.TransformerBlock.__dict__["__init__"]
    config = make_config()
    handle = ssd_megatron.enable(config, offload_layers=OFFLOADED, spill_dir=str(spill_dir),
                                 **OPTIONS)
    assert ssd_megatron.is_enabled(config) and ssd_megatron.offloader(config) is handle.offloader
    assert transformer_block.get_cpu_offload_context is not factory
    assert transformer_block.TransformerBlock.__dict__["__init__"] is not init
    before = build(config)
    assert isinstance(before.decoder.offload_context, ssd_megatron._BlockOffloadContext)
    train(before, steps=1)
    packed = handle.stats().packed_bytes
    assert packed > 0

    ssd_megatron.disable(config)
    assert transformer_block.get_cpu_offload_context is factory
    assert transformer_block.TransformerBlock.__dict__["__init__"] is init
    assert not ssd_megatron.is_enabled(config) and handle.offloader.closed
    with pytest.raises(ssdtrain.SSDTrainError, match="^ssdtrain: .*enable"):
        ssd_megatron.offloader(config)
    ssd_megatron.disable(config)  # a second disable does nothing
    # A model built before: its context is inert, no hook or wrapper is left on it.
    assert not before.decoder._forward_pre_hooks
    assert "_get_layer" not in vars(before.decoder)
    assert "_checkpointed_forward" not in vars(before.decoder)
    # A model built after: exactly what megatron-core builds without ssdtrain.
    after = build(config)
    assert type(after.decoder.offload_context) is type(build(make_config()).decoder.offload_context)
    assert after.decoder.group_prefetch_offload_commit_async is None
    assert_same_history(reference("none"), train(after))
    assert_same_history(reference("none"), train(build(config)))
    assert handle.stats().packed_bytes == packed


def test_other_configs_are_left_alone(spill_dir):
    enabled, other = make_config(), make_config()
    handle = ssd_megatron.enable(enabled, spill_dir=str(spill_dir), **OPTIONS)
    try:
        model = build(other)
        assert not isinstance(model.decoder.offload_context, ssd_megatron._BlockOffloadContext)
        assert model.decoder.group_prefetch_offload_commit_async is None
        assert_same_history(reference("none"), train(model))
        assert handle.stats().packed_bytes == 0
        # Two enabled configs: patches stay until the last one is disabled.
        second = make_config()
        ssd_megatron.enable(second, spill_dir=str(spill_dir), **OPTIONS)
        patched = transformer_block.get_cpu_offload_context
        handle.disable()
        assert transformer_block.get_cpu_offload_context is patched
        assert ssd_megatron.is_enabled(second)
    finally:
        ssd_megatron.disable(enabled)
        ssd_megatron.disable(second)


def test_collected_config_removes_patches(spill_dir):
    factory = transformer_block.get_cpu_offload_context
    config = make_config()
    ssd_megatron.enable(config, spill_dir=str(spill_dir), **OPTIONS)
    assert transformer_block.get_cpu_offload_context is not factory
    del config
    gc.collect()
    assert transformer_block.get_cpu_offload_context is factory
    assert not ssd_megatron._SESSIONS


# --------------------------------------------------------------- factory signatures

def test_factory_accepts_016_and_019_signatures(spill_dir):
    """megatron-core 0.16 passes six values, later releases a seventh
    (``cpu_offloading_retain_pinned_cpu_buffers``). Blocks of other configs get the
    original factory (here a stand-in for TransformerEngine's) called with exactly
    what the block passed; blocks of the enabled config get ssdtrain's context."""
    calls = []

    def te_like_factory(enabled, num_layers, model_layers, activation_offloading,
                        weight_offloading, double_buffering, retain_pinned=False):
        calls.append((enabled, num_layers, model_layers, activation_offloading,
                      weight_offloading, double_buffering, retain_pinned))
        return torch.enable_grad(), None

    saved = transformer_block.get_cpu_offload_context
    transformer_block.get_cpu_offload_context = te_like_factory
    config = make_config()
    try:
        ssd_megatron.enable(config, spill_dir=str(spill_dir), **OPTIONS)
        installed = transformer_block.get_cpu_offload_context
        # 0.16.1's TransformerBlock: six positional values.
        build(make_config())
        assert calls == [(False, 0, LAYERS, True, False, False, False)]
        # A seventh, as later releases pass it: forwarded as given.
        installed(False, 0, LAYERS, True, False, False, True)
        assert calls[-1] == (False, 0, LAYERS, True, False, False, True)
        # An enabled config's block, asked with seven values.
        transformer_block.get_cpu_offload_context = \
            lambda *args: installed(*args, config.cpu_offloading)
        try:
            model = build(config)
        finally:
            transformer_block.get_cpu_offload_context = installed
        assert isinstance(model.decoder.offload_context, ssd_megatron._BlockOffloadContext)
        hidden = torch.ones(2)
        assert model.decoder.group_prefetch_offload_commit_async(hidden) is hidden
        assert len(calls) == 2
        assert_same_history(reference("none"), train(model))
        assert ssd_megatron.offloader(config).stats().packed_bytes > 0
    finally:
        ssd_megatron.disable(config)
        assert transformer_block.get_cpu_offload_context is te_like_factory
        transformer_block.get_cpu_offload_context = saved


# ---------------------------------------------------------------------------- errors

def test_enable_errors(spill_dir):
    with pytest.raises(ssdtrain.ConfigError, match="^ssdtrain: config.cpu_offloading"):
        ssd_megatron.enable(make_config(cpu_offloading=True, cpu_offloading_num_layers=1),
                            spill_dir=str(spill_dir))
    config = make_config()
    for bad in (-1, LAYERS + 1, 1.5, True, "2"):
        with pytest.raises(ssdtrain.ConfigError, match="^ssdtrain: offload_layers"):
            ssd_megatron.enable(config, offload_layers=bad, spill_dir=str(spill_dir))
    with pytest.raises(ssdtrain.ConfigError, match="^ssdtrain: unknown OffloadConfig"):
        ssd_megatron.enable(config, spill_dirr=str(spill_dir))
    with pytest.raises(ssdtrain.ConfigError, match="^ssdtrain: spill_dir"):
        ssd_megatron.enable(config, spill_dir=str(spill_dir / "missing"))
    assert not ssd_megatron.is_enabled(config) and not ssd_megatron._SESSIONS
    ssd_megatron.enable(config, spill_dir=str(spill_dir))
    with pytest.raises(ssdtrain.ConfigError, match="^ssdtrain: .*already has ssdtrain enabled"):
        ssd_megatron.enable(config, spill_dir=str(spill_dir))
    ssd_megatron.disable(config)
    with pytest.raises(ssdtrain.SSDTrainError, match="^ssdtrain: "):
        ssd_megatron.layer_stats(config)


# ---------------------------------------------------------------------- command line

def test_argparse_round_trip(spill_dir, tmp_path):
    """``add_ssdtrain_args`` as Megatron-LM's extra_args_provider, then ``apply_args``."""
    second = tmp_path / "spill2"
    second.mkdir()
    parser = argparse.ArgumentParser()
    assert ssd_megatron.add_ssdtrain_args(parser) is parser
    args = parser.parse_args([
        "--ssdtrain", "--ssdtrain-spill-dir", str(spill_dir), str(second),
        "--ssdtrain-offload-layers", "2", "--ssdtrain-min-tensor-bytes", "2KiB",
        "--ssdtrain-keep-tail-bytes", "0", "--ssdtrain-prefetch-bytes", "1MiB",
        "--ssdtrain-engine", "posix", "--ssdtrain-io-threads", "2",
        "--ssdtrain-direct-io", "off"])
    config = make_config()
    handle = ssd_megatron.apply_args(args, config)
    try:
        assert handle is not None and handle.offload_layers == 2
        cfg = handle.offloader.config
        from ssdtrain.integrations.distributed import rank_spill_dir
        assert cfg.spill_dir == rank_spill_dir([str(spill_dir), str(second)], create=False)
        assert (cfg.min_tensor_bytes, cfg.keep_tail_bytes, cfg.prefetch_bytes) == (2048, 0, 1 << 20)
        assert (cfg.engine, cfg.io_threads, cfg.direct_io) == ("posix", 2, "off")
        assert parser.parse_args(["--no-ssdtrain-verify"]).ssdtrain_verify is False
        more = parser.parse_args(["--ssdtrain-on-spill-error", "keep", "--ssdtrain-max-spill-bytes",
                                  "1GiB", "--ssdtrain-engine", "kvikio"])
        assert (more.ssdtrain_on_spill_error, more.ssdtrain_max_spill_bytes,
                more.ssdtrain_engine) == ("keep", "1GiB", "kvikio")
        assert parser.parse_args(["--ssdtrain-verify"]).ssdtrain_verify is True
        # no --ssdtrain-verify: the default ("auto") decides, as without Megatron
        default = ssdtrain.Offloader(spill_dir=str(tmp_path), engine="posix")
        try:
            assert cfg.verify == default.config.verify
        finally:
            default.close()
        history = train(build(config))
        handle.offloader.wait()
        assert handle.stats().offloaded_bytes > 0
        assert handle.layer_stats()[2].passes == 0
    finally:
        ssd_megatron.disable(config)
    assert_same_history(reference("none"), history)

    # Without --ssdtrain: nothing happens; options alone are a mistake worth an error.
    assert ssd_megatron.apply_args(parser.parse_args([]), make_config()) is None
    with pytest.raises(ssdtrain.ConfigError, match="^ssdtrain: --ssdtrain-offload-layers"):
        ssd_megatron.apply_args(parser.parse_args(["--ssdtrain-offload-layers", "1"]),
                                make_config())


# --------------------------------------------------------------------------- example

def test_example_runs(spill_dir):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [
        p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "tests" / "run_megatron_example.py"), "--ssdtrain",
         "--ssdtrain-spill-dir", str(spill_dir), "--steps", "2", "--compare"],
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "ssdtrain: packed" in out and "offloaded" in out
    assert "bitwise equal to the run without ssdtrain: yes" in out


# -------------------------------------------------------------------------- interrupts

def _adapter_targets(mode, spill_dir):
    """Lines of integrations/megatron.py one training step runs (LineCounter) with the
    runs of each: the sweep's targets (first and last run of each line)."""
    import inject
    files = frozenset({ssd_megatron.__file__, os.path.realpath(ssd_megatron.__file__)})
    config = make_config(**RECOMPUTE[mode])
    handle = ssd_megatron.enable(config, offload_layers=OFFLOADED, spill_dir=str(spill_dir),
                                 **OPTIONS)
    try:
        model = build(config)
        counter = inject.LineCounter(files)
        sys.settrace(counter)
        try:
            train(model, steps=1)
        finally:
            sys.settrace(None)
    finally:
        handle.disable()
    return inject.targets(counter.counts)


def interrupted(step, armed):
    """Run ``step()`` under the trace function ``armed`` (an ``inject.InterruptAt``), as a
    loop that catches Ctrl-C at the step; whether the interrupt fired."""
    sys.settrace(armed)
    try:
        step()
    except KeyboardInterrupt:
        pass
    finally:
        sys.settrace(None)
    return armed.fired


@pytest.mark.parametrize("mode", ["none", "full-block"])
def test_interrupt_at_each_adapter_line(mode, spill_dir):
    """KeyboardInterrupt at each line of the adapter a step runs (the first run of each;
    the last too with SSDTRAIN_TEST_INTERRUPT_FULL=1: block pre-forward hook, per-layer enter and exit, the full-recompute
    wrappers, the layer meter), as a training loop that catches Ctrl-C at the step and
    goes on sees it: the same model's next step is exact, no forward stays open and no
    record is left; after a last interrupted step, disable() closes the offloader
    (NOTE [ Interrupted block forwards ] in integrations/megatron.py)."""
    import inject
    tgts = _adapter_targets(mode, spill_dir)
    if os.environ.get("SSDTRAIN_TEST_INTERRUPT_FULL") != "1":
        tgts = [t for t in tgts if t[2] == 1]  # first runs only: the suite's time
    assert len(tgts) > 20, tgts
    ref_loss, ref_grads = reference(mode)[0]
    config = make_config(**RECOMPUTE[mode])
    # Writes behind forward (not OPTIONS' write_behind_bytes=0): the sweep's time.
    handle = ssd_megatron.enable(config, offload_layers=OFFLOADED, spill_dir=str(spill_dir),
                                 **dict(OPTIONS, write_behind_bytes=1 << 20))
    off = handle.offloader
    ids, pos, mask, labels = batch()
    failures, fired = [], 0
    try:
        model = build(config)  # no optimizer step: every step has the first step's gradients

        def step():
            model.zero_grad(set_to_none=True)
            loss = model(ids, pos, mask, labels=labels).mean()
            loss.backward()
            return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

        for file, line, k, n in tgts:
            where = f"megatron.py:{line} (run {k} of {n})"
            fired += interrupted(step, inject.InterruptAt(file, line, k))
            try:
                assert_same_history([(ref_loss, ref_grads)], [step()])
            except (AssertionError, ssdtrain.SSDTrainError) as e:
                failures.append(f"{where}: the next step: {type(e).__name__}: {e}")
                continue
            if off.in_forward:
                failures.append(f"{where}: a forward pass is still open after the next step")
            model.zero_grad(set_to_none=True)
            off.wait()
            if off.live_records():  # an interrupted checkpoint's graph is in a cycle
                gc.collect()
                off.wait()
            if off.live_records():
                failures.append(f"{where}: {off.live_records()} records left after the next step")
        interrupted(step, inject.InterruptAt(*tgts[len(tgts) // 2][:3]))
    finally:
        handle.disable()
    assert off.closed
    assert fired >= 0.9 * len(tgts), (fired, len(tgts))
    assert not failures, f"{len(failures)} of {len(tgts)} interrupt points failed:\n" + \
        "\n".join(failures[:20])
