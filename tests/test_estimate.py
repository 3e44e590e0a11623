"""``ssdtrain estimate`` (ssdtrain/estimate/__init__.py, ssdtrain/estimate/replay.py, docs/estimate.md).

Accuracy: the estimate runs the forward on fake tensors with ssdtrain's pack decisions
replayed; each accuracy test runs the same model for real on the CPU under a real
``Offloader`` (one forward, ``wait()``, then backward) and checks, exactly:

* ``estimate.packed_bytes == Stats.packed_bytes``
* ``estimate.unique_bytes == Stats.unique_bytes``
* ``estimate.offloadable_bytes == Stats.offloaded_bytes`` (bytes ssdtrain writes)
* ``estimate.kept_bytes == Stats.kept_bytes``
* ``estimate.deduplicated_bytes == Stats.deduplicated_bytes``
* ``kept_tail_bytes == kept tail``, where the kept tail is measured as the bytes of the
  records in state KEPT right after the forward (``off._store.records()``), and
  ``unique_bytes == offloaded_bytes + kept tail`` on both sides (no spill budget, no
  record freed before its write in these models)
* per repeated block: ``layers[i].unique_bytes`` == the bytes ``Offloader.track()``
  attributes to block ``i`` in the real run.
"""

from __future__ import annotations

import copy
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import models
import ssdtrain
from ssdtrain import testing
from ssdtrain import estimate as E
from ssdtrain.estimate.hardware import _SEARCH_LIMIT
from ssdtrain.estimate.memory import _largest
from ssdtrain.estimate.replay import EstimateError
from ssdtrain._policies.profile import default_layers
from ssdtrain._decision.records import State

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning",
                                        "ignore::DeprecationWarning")

ROOT = Path(__file__).resolve().parent.parent
LLAMA_8B = ROOT / "examples" / "configs" / "llama-8b.json"
# Small thresholds for tiny models: most activations are offloaded, some stay in the tail.
SMALL = dict(min_tensor_bytes="8KiB", keep_tail_bytes="32KiB")
HF_SMALL = dict(min_tensor_bytes="8KiB", keep_tail_bytes="1MiB")
FIXED_KEYS = {"unique_bytes", "offloadable_bytes", "kept_bytes", "packed_bytes", "layers"}
HW_KEYS = {"required_write_gbps", "required_read_gbps", "max_micro_batch",
           "tb_written_per_day", "drive_years"}


def _loss(out):
    return out.loss if hasattr(out, "loss") else out


def real_run(model, inputs, overrides, spill_dir):
    """One real step under an Offloader: ``(Stats after the forward's writes, kept tail
    bytes, per-layer unique bytes from track())``."""
    off = ssdtrain.Offloader(ssdtrain.OffloadConfig(spill_dir=str(spill_dir), policy="static",
                                                    **overrides))
    if default_layers(model):
        off.track(model)
    try:
        with off:
            loss = _loss(model(**inputs) if isinstance(inputs, dict) else model(*inputs))
        tail = sum(r.nbytes for r in testing.records(off, State.KEPT))
        off.wait()
        stats = off.stats()
        per = list(off._layers.profiler.step.saved_bytes) if off._layers else []
        loss.backward()
    finally:
        off.close()
    return stats, tail, per


def assert_matches(est, stats, tail, per):
    m = est.measurement
    assert (est.packed_bytes, est.unique_bytes, est.offloadable_bytes, est.kept_bytes,
            m.deduplicated_bytes, m.kept_tail_bytes) == \
        (stats.packed_bytes, stats.unique_bytes, stats.offloaded_bytes, stats.kept_bytes,
         stats.deduplicated_bytes, tail)
    assert m.dropped_bytes == 0 and m.over_budget_bytes == 0
    assert stats.unique_bytes == stats.offloaded_bytes + tail
    assert est.unique_bytes == est.offloadable_bytes + m.kept_tail_bytes
    assert [lb.unique_bytes for lb in est.layers] == per


# ---------------------------------------------------------------- test-suite models
@pytest.mark.parametrize("overrides", [dict(min_tensor_bytes="16KiB", keep_tail_bytes="64KiB"),
                                       {}], ids=["small", "defaults"])
@pytest.mark.parametrize("name", sorted(models.ALL_MODELS))
def test_matches_real_run_on_test_models(name, overrides, spill_dir):
    make = models.ALL_MODELS[name]
    est = E.estimate(make, config=ssdtrain.OffloadConfig(**overrides))
    model, inputs = make(torch.float32)
    assert_matches(est, *real_run(model, inputs, overrides, spill_dir))
    assert est.unique_bytes > 0


def test_matches_real_run_bf16_and_spill_budget(spill_dir):
    """bf16, and max_spill_bytes=0: every eligible record is kept over the budget."""
    est = E.estimate(models.gpt, dtype=torch.bfloat16, config=ssdtrain.OffloadConfig(**SMALL))
    assert_matches(est, *real_run(*models.gpt(torch.bfloat16), SMALL, spill_dir))
    budget = dict(SMALL, max_spill_bytes=0)
    est = E.estimate(models.gpt, config=ssdtrain.OffloadConfig(**budget))
    stats, _, _ = real_run(*models.gpt(torch.float32), budget, spill_dir)
    assert est.offloadable_bytes == stats.offloaded_bytes == 0
    assert est.kept_bytes == stats.kept_bytes and est.unique_bytes == stats.unique_bytes
    assert est.measurement.over_budget_bytes == stats.over_budget_bytes > 0


# ------------------------------------------------------------- Hugging Face models
def _hf_configs():
    tf = pytest.importorskip("transformers")
    common = dict(num_hidden_layers=2, num_attention_heads=4, vocab_size=256)
    llama_like = dict(common, hidden_size=64, intermediate_size=128, num_key_value_heads=2)
    return {
        "llama": tf.LlamaConfig(**llama_like, architectures=["LlamaForCausalLM"]),
        "gpt2": tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=128,
                              bos_token_id=0, eos_token_id=0, architectures=["GPT2LMHeadModel"]),
        "bert": tf.BertConfig(**common, hidden_size=64, intermediate_size=128,
                              architectures=["BertForMaskedLM"]),
        "t5": tf.T5Config(d_model=64, d_ff=128, d_kv=16, num_layers=2, num_heads=4,
                          vocab_size=256, decoder_start_token_id=0, pad_token_id=0,
                          architectures=["T5ForConditionalGeneration"]),
        "mixtral": tf.MixtralConfig(**llama_like, num_local_experts=4, num_experts_per_tok=2,
                                    architectures=["MixtralForCausalLM"]),
        "qwen2_moe": tf.Qwen2MoeConfig(**llama_like, moe_intermediate_size=64,
                                       shared_expert_intermediate_size=128, num_experts=4,
                                       num_experts_per_tok=2,
                                       architectures=["Qwen2MoeForCausalLM"]),
    }


def _write_config(cfg, path):
    path.write_text(cfg.to_json_string())
    return path


HF_SHAPE = dict(batch=4, seq=64, dtype=torch.float32)


@pytest.mark.parametrize("gc", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert", "t5", "mixtral", "qwen2_moe"])
def test_matches_real_run_on_hf_models(arch, gc, tmp_path, spill_dir):
    """Built from a config.json (the --hf-config path), with and without the model's own
    activation checkpointing; MoE layers use transformers' default grouped_mm experts."""
    path = _write_config(_hf_configs()[arch], tmp_path / "config.json")
    est = E.estimate(str(path), **HF_SHAPE, gradient_checkpointing=gc,
                     config=ssdtrain.OffloadConfig(**HF_SMALL))
    torch.manual_seed(0)
    model, inputs = E.hf_factory(str(path))(**HF_SHAPE, gradient_checkpointing=gc)
    assert_matches(est, *real_run(model, inputs, HF_SMALL, spill_dir))
    assert est.measurement.kept_tail_bytes > 0 and len(est.layers) >= 2
    assert est.offloadable_bytes > 0 or gc
    if gc:   # checkpointing hides the blocks' activations from ssdtrain's hooks
        plain = E.estimate(str(path), **HF_SHAPE, config=ssdtrain.OffloadConfig(**HF_SMALL))
        assert est.packed_bytes < plain.packed_bytes


def test_moe_grouped_mm_is_routing_independent_and_eager_is_bounded(spill_dir):
    """grouped_mm (the transformers default): two routings (other weights and tokens) save
    exactly the estimated bytes. The per-expert loop ('eager') has data-dependent shapes:
    the estimate refuses it with a clear error, and the bound docs/estimate.md states
    holds on real runs: with min_tensor_bytes=1 its unique bytes U1 do not depend on the
    routing, and with a threshold m they lie in [U1 - experts x layers x K x m, U1]
    (K = 12: the non-parameter tensors one expert saves here)."""
    cfg = _hf_configs()["mixtral"]
    est = E.estimate(E.hf_factory(copy.deepcopy(cfg)), **HF_SHAPE,
                     config=ssdtrain.OffloadConfig(**HF_SMALL))
    for seed in (0, 1):
        torch.manual_seed(seed)
        model, inputs = E.hf_factory(copy.deepcopy(cfg))(**HF_SHAPE)
        assert_matches(est, *real_run(model, inputs, HF_SMALL, spill_dir))

    def eager(**kw):
        model, inputs = E.hf_factory(copy.deepcopy(cfg))(**kw)
        model.set_experts_implementation("eager")
        return model, inputs
    with pytest.raises(EstimateError, match="data-dependent"):
        E.estimate(eager, **HF_SHAPE)
    u1, um = set(), []
    m = 16 << 10
    for seed in (0, 1):
        for mtb, out in ((1, None), (m, um)):
            torch.manual_seed(seed)
            stats, _, _ = real_run(*eager(**HF_SHAPE), dict(min_tensor_bytes=mtb,
                                                            keep_tail_bytes=0), spill_dir)
            (u1.add(stats.unique_bytes) if out is None else out.append(stats.unique_bytes))
    assert len(u1) == 1
    (u1,) = u1
    bound = cfg.num_local_experts * cfg.num_hidden_layers * 12 * m
    assert all(u1 - bound <= u <= u1 for u in um)


def test_held_bytes_match_a_real_run_without_offload():
    """``held_bytes`` (what 'no offload' keeps at the end of forward, parameters and
    buffers excluded) equals the bytes of the distinct storages a real forward's saved
    tensors hold; with checkpointing, the blocks' inputs (the checkpoints hold them)."""
    cfg = _hf_configs()["llama"]
    for gc in (False, True):
        est = E.estimate(E.hf_factory(cfg), **HF_SHAPE, gradient_checkpointing=gc)
        model, inputs = E.hf_factory(cfg)(**HF_SHAPE, gradient_checkpointing=gc)
        state = {t.untyped_storage().data_ptr() for t in list(model.parameters()) +
                 list(model.buffers())}
        held = {}

        def note(t):
            s = t.untyped_storage()
            if s.data_ptr() not in state:
                held[s.data_ptr()] = s.nbytes()

        def pack(t):
            if not (t.requires_grad and t.grad_fn is None):
                note(t)
            return t

        def block_input(module, args, kwargs):
            todo = list(args) + list(kwargs.values())
            while todo:
                a = todo.pop()
                if isinstance(a, torch.Tensor):
                    note(a)
                elif isinstance(a, (tuple, list)):   # position_embeddings=(cos, sin)
                    todo.extend(a)
        hooks = [m.register_forward_pre_hook(block_input, with_kwargs=True)
                 for _, m in default_layers(model)] if gc else []
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(**inputs)
        for h in hooks:
            h.remove()
        assert est.measurement.held_bytes == sum(held.values()) > 0
        del out


def test_forward_flops_match_a_real_count():
    """The fake forward's FLOPs equal ``FlopCounterMode`` on the real forward (with the
    grouped-matmul formula the estimate adds, which MoE experts need)."""
    from torch.utils.flop_counter import FlopCounterMode
    from ssdtrain.estimate.flops import _extra_flop_formulas
    configs = _hf_configs()
    for arch in ("llama", "mixtral"):
        est = E.estimate(E.hf_factory(configs[arch]), **HF_SHAPE)
        model, inputs = E.hf_factory(configs[arch])(**HF_SHAPE)
        counter = FlopCounterMode(display=False, custom_mapping=_extra_flop_formulas())
        with counter:
            model(**inputs)
        assert est.measurement.flops == counter.get_total_flops() > 0


# ----------------------------------------------------------- micro-batch and hardware
def test_largest_micro_batch_search():
    assert _largest(lambda b: 100 * b + (50 if b > 7 else 0), 760, 1) == 7
    assert _largest(lambda b: b * b, 1000, 1) == 31          # not affine: bisection
    assert _largest(lambda b: 10 + b, 5, 1) == 0               # nothing fits
    assert _largest(lambda b: 10, 50, 3) == _SEARCH_LIMIT    # does not grow


def test_max_micro_batch_is_the_largest_that_fits():
    """Each mode's answer b: memory(b) <= device memory < memory(b + 1), each measured
    directly at that batch."""
    cfg = _hf_configs()["llama"]
    limit = 24 << 20
    hw = E.Hardware(device_memory=limit)
    kw = dict(seq=64, dtype=torch.float32, config=ssdtrain.OffloadConfig(**SMALL), hardware=hw)
    est = E.estimate(E.hf_factory(cfg), batch=2, **kw)
    assert est.memory["static"] == est.measurement.trainable_params * 16 + \
        est.measurement.buffer_bytes
    for mode, b in est.max_micro_batch.items():
        assert b >= 1, mode
        assert E.estimate(E.hf_factory(cfg), batch=b, **kw).memory[mode] <= limit
        assert E.estimate(E.hf_factory(cfg), batch=b + 1, **kw).memory[mode] > limit
    assert est.max_micro_batch["recompute"] > est.max_micro_batch["none"]


def test_longest_sequence_is_the_longest_that_fits():
    """Each mode's answer s (a multiple of the unit): memory at s fits the device, at
    s + unit it does not, each measured directly at that length; offloading reaches at
    least as far as keeping everything; what the search tried was said."""
    cfg = _hf_configs()["llama"]
    limit = 24 << 20
    hw = E.Hardware(device_memory=limit)
    kw = dict(batch=1, dtype=torch.float32, config=ssdtrain.OffloadConfig(**SMALL),
              hardware=hw, gradient_checkpointing=True)
    said = []
    est = E.estimate(E.hf_factory(cfg), seq=64, longest_seq=True, seq_unit=32,
                     progress=said.append, **kw)
    for mode, s in est.max_seq.items():
        assert s >= 32 and s % 32 == 0, (mode, s)
        assert E.estimate(E.hf_factory(cfg), seq=s, **kw).memory[mode] <= limit, mode
        assert E.estimate(E.hf_factory(cfg), seq=s + 32, **kw).memory[mode] > limit, mode
    assert est.max_seq["ssdtrain"] >= est.max_seq["none"]
    assert said and all("trying seq" in line for line in said)
    assert est.to_json()["max_seq"] == est.max_seq
    assert "longest sequence at micro-batch 1, ssdtrain" in est.table()


def test_longest_sequence_refuses_what_it_cannot_search():
    cfg = ssdtrain.OffloadConfig(**SMALL)
    with pytest.raises(ssdtrain.ConfigError, match="device's memory"):
        E.estimate(models.gpt, config=cfg, longest_seq=True, seq=64)
    with pytest.raises(ssdtrain.ConfigError, match="seq_unit"):
        E.estimate(models.gpt, config=cfg, hardware=E.Hardware(device_memory=1 << 30),
                   longest_seq=True, seq=64, seq_unit=0)
    assert E.main(["--factory", "models:gpt", "--longest-seq"]) == 2

    def fixed(batch=1):  # builds one length only: nothing to search
        return models.gpt()
    with pytest.raises(ssdtrain.ConfigError, match="no 'seq' keyword"):
        E.estimate(fixed, config=cfg, hardware=E.Hardware(device_memory=1 << 30),
                   longest_seq=True, seq=64)


def test_hardware_formulas():
    cfg = ssdtrain.OffloadConfig(**SMALL)
    hw = E.Hardware(step_seconds=3.0, ssd_write_gbps=1e-4, ssd_read_gbps=1.0, ssds=2,
                    ssd_tbw=100.0)
    est = E.estimate(models.gpt, config=cfg, hardware=hw)
    w = est.offloadable_bytes
    assert est.required_write_gbps == pytest.approx(w / 1.0 / 1e9)     # forward = step / 3
    assert est.required_read_gbps == pytest.approx(w / 2.0 / 1e9)      # backward = 2 step / 3
    assert est.write_ok is False and est.read_ok is True
    per_mb = max(1.0, w / (2 * 1e-4 * 1e9)) + 2.0                       # writes are the bound
    assert est.tb_written_per_day == pytest.approx(w * 86400 / per_mb / 1e12)
    assert est.drive_years == pytest.approx(100.0 / (est.tb_written_per_day / 2) / 365)
    gc = E.estimate(models.gpt, config=cfg, hardware=E.Hardware(tflops=2.0))
    flops = gc.measurement.flops
    assert flops > 0 and gc.times["forward"] == pytest.approx(flops / 2e12)
    assert gc.times["backward"] == pytest.approx(2 * flops / 2e12)
    assert gc.max_micro_batch is None and gc.drive_years is None


# ------------------------------------------------------------------------------ CLI
def test_cli_json_keys(capsys):
    argv = ["--factory", "models:gpt", "--min-tensor-bytes", "16KiB", "--json"]
    assert E.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert FIXED_KEYS <= out.keys() and not HW_KEYS & out.keys()
    assert {"name", "unique_bytes", "offloadable_bytes"} <= out["layers"][0].keys()
    assert E.main(argv + ["--device-memory", "1GiB", "--step-seconds", "0.5", "--ssd-tbw",
                          "600", "--ssd-write-gbps", "3", "--ssd-read-gbps", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert FIXED_KEYS | HW_KEYS <= out.keys()
    assert out["max_micro_batch"].keys() == {"none", "recompute", "ssdtrain"}
    assert E.main(["--factory", "models:gpt", "--min-tensor-bytes", "16KiB"]) == 0
    assert "| **total per micro-batch**" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["--hf-config", "/nonexistent/config.json"], "no such file"),
    (["--factory", "models:gpt", "--dtype", "fp8"], "unknown dtype"),
    (["--factory", "no-colon"], "module:function"),
    (["--factory", "no_such_module_xyz:make"], "cannot import"),
    (["--factory", "models:no_such_function"], "no attribute"),
    (["--factory", "models:gpt", "--device-memory", "lots"], "device_memory"),
    (["--factory", "models:gpt", "--batch", "0"], "batch"),
    (["--factory", "models:gpt", "--min-tensor-bytes", "-1"], "min_tensor_bytes"),
    (["--factory", "models:gpt", "--host-budget", "lots"],
     "host_budget_bytes must be a byte count"),
    (["--factory", "models:gpt", "--host-budget=-1GiB"], "host_budget_bytes must be"),
    (["--factory", "models:gpt", "--no-ssd"], "--no-ssd leaves only the host tier"),
    (["--factory", "models:gpt", "--host-budget", "1GiB", "--no-ssd", "--max-spill-bytes",
      "1GiB"], "max_spill_bytes (--max-spill-bytes) is a budget for the SSD tier"),
    (["--factory", "models:gpt", "--host-gbps", "25", "--plan", "--step-seconds", "1",
      "--ssd-write-gbps", "1"], "--host-gbps is the host tier's copy rate"),
    (["--factory", "models:gpt", "--host-budget", "1GiB", "--host-gbps", "0", "--plan",
      "--step-seconds", "1", "--ssd-write-gbps", "1"], "host_gbps (--host-gbps) must be > 0"),
])
def test_cli_errors_exit_2_without_traceback(argv, message, capsys):
    assert E.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "usage:" in err and "Traceback" not in err


def _run_cli(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "ssdtrain", *args], capture_output=True,
                          text=True, cwd=str(ROOT), env=env, timeout=300)


def test_module_entry_point_bad_config_exits_2():
    r = _run_cli("estimate", "--hf-config", "/nonexistent.json")
    assert r.returncode == 2 and "no such file" in r.stderr and "Traceback" not in r.stderr
    r = _run_cli("frobnicate")
    assert r.returncode == 2 and "unknown command" in r.stderr


def test_llama_8b_at_seq_4096_runs_on_the_meta_device():
    """The estimate example of docs/guide.md: an 8B config at sequence 4096 needs no real memory (the child's
    peak RSS stays well under the 15 GiB of bf16 weights alone, let alone activations)."""
    pytest.importorskip("transformers")
    r = _run_cli("estimate", "--hf-config", str(LLAMA_8B), "--seq", "4096", "--json")
    assert r.returncode == 0, r.stderr
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    out = json.loads(r.stdout)
    assert 8.0e9 < out["parameters"] < 8.1e9 and len(out["layers"]) == 32
    assert out["unique_bytes"] > 20 << 30
    assert len({lb["unique_bytes"] for lb in out["layers"][1:]}) == 1   # identical blocks
    assert peak_kib < 2 * 1024 * 1024   # KiB (the largest child so far): under 2 GiB


# ---------------------------------------------------------- the CLI and user errors
_FAILS_ON_FAKE = '''
import torch


class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) + torch.ones(3, 5)   # a shape error in the user's model


def make(batch=2):
    return M(), (torch.randn(batch, 8),)
'''


def test_cli_model_failing_on_fake_tensors_prints_one_line(tmp_path):
    """torch logs a 20-line traceback of the failing operator before it raises; the CLI
    prints one line (exit 1), and the traceback only with --traceback."""
    (tmp_path / "userfac.py").write_text(_FAILS_ON_FAKE)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "ssdtrain", "estimate", "--factory", "userfac:make"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=str(tmp_path), env=env,
                       timeout=300)
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "broadcast" in lines[0] and "--traceback" in lines[0], r.stderr
    r = subprocess.run(cmd + ["--traceback"], capture_output=True, text=True,
                       cwd=str(tmp_path), env=env, timeout=300)
    assert r.returncode != 0 and "Traceback (most recent call last)" in r.stderr
    assert "userfac.py" in r.stderr   # where: the user's forward


@pytest.mark.parametrize("flag,value,what", [
    ("--tflops", "1e300", "too large"), ("--step-seconds", "1e-320", "too small"),
    ("--tflops", "nan", "not a finite"), ("--step-seconds", "inf", "not a finite"),
    ("--ssd-write-gbps", "0", "> 0"), ("--ssd-read-gbps", "-3", "> 0"),
    ("--ssd-tbw", "1e400", "not a finite"), ("--bytes-per-param", "1e-320", "too small"),
    ("--ssds", "0", "between 1 and"), ("--ssds", "1000000000", "between 1 and"),
])
def test_cli_rejects_hardware_numbers_that_make_no_sense(flag, value, what, capsys):
    """Before: --tflops 1e300 raised ZeroDivisionError, --step-seconds 1e-320 gave NaN."""
    assert E.main(["--factory", "models:gpt", flag, value, "--json"]) == 2
    err = capsys.readouterr().err
    assert flag in err and what in err and "Traceback" not in err, err
    assert "usage:" in err


def _finite_json(text):
    def bad(name):
        raise AssertionError(f"--json printed {name}")
    return json.loads(text, parse_constant=bad)


@pytest.mark.parametrize("hw", [
    ["--tflops", "1e9", "--ssd-write-gbps", "1e-6", "--ssd-read-gbps", "1e6"],
    ["--step-seconds", "1e-9", "--ssd-tbw", "1e-6", "--ssds", "1048576"],
    ["--step-seconds", "1e9", "--ssd-tbw", "1e9", "--bytes-per-param", "1e6",
     "--device-memory", "1GiB"],
], ids=["fast-device", "fast-step", "slow-step"])
def test_cli_json_is_finite_at_the_edges_of_the_ranges(hw, capsys):
    for extra in ([], ["--min-tensor-bytes", "1GiB"]):   # the second writes nothing
        assert E.main(["--factory", "models:gpt", "--json"] + hw + extra) == 0
        out = _finite_json(capsys.readouterr().out)
        if "--ssd-tbw" in hw and extra:
            assert out["drive_years"] is None   # nothing written: lasts forever


_HOST_ARGV = ["--factory", "models:gpt", "--min-tensor-bytes", "16KiB", "--keep-tail-bytes", "0",
              "--step-seconds", "0.5", "--ssd-write-gbps", "1", "--ssd-tbw", "600",
              "--device-memory", "1GiB"]


def test_cli_host_budget_shows_the_tier_in_text_and_json(capsys):
    """``--host-budget``: the tier's bytes in RAM when forward ends, their peak, and what
    goes on to the SSD (``--no-ssd``: stays in device memory), in the text and in finite
    JSON; the SSD figures count only what reaches the SSD, and device memory counts what
    stays there. Fails without the option (argparse exits), and without the estimate
    replaying device records (the host tier takes none: every host number is 0)."""
    assert E.main(_HOST_ARGV + ["--json"]) == 0
    plain = _finite_json(capsys.readouterr().out)
    assert "host_tier" not in plain and plain["settings"]["host_budget_bytes"] is None

    assert E.main(_HOST_ARGV + ["--host-budget", "1MiB", "--json"]) == 0
    out = _finite_json(capsys.readouterr().out)
    tier = out["host_tier"]
    assert tier["budget_bytes"] == 1 << 20 == out["settings"]["host_budget_bytes"]
    assert tier["ssd_tier"] is True and tier["device_bytes"] == 0
    assert 0 < tier["host_bytes"] <= tier["peak_host_bytes"] <= 1 << 20
    assert 0 < tier["ssd_bytes"] < out["offloadable_bytes"] == plain["offloadable_bytes"]
    t_fwd = 0.5 / 3
    assert out["required_write_gbps"] == pytest.approx(tier["ssd_bytes"] / t_fwd / 1e9)
    assert out["required_write_gbps"] < plain["required_write_gbps"]
    assert out["memory_bytes"] == plain["memory_bytes"]   # RAM and SSD: off the device

    assert E.main(_HOST_ARGV + ["--host-budget", "1MiB", "--no-ssd", "--json"]) == 0
    ram = _finite_json(capsys.readouterr().out)
    tier = ram["host_tier"]
    assert tier["ssd_tier"] is False and tier["ssd_bytes"] == 0
    assert 0 < tier["peak_host_bytes"] <= 1 << 20
    assert tier["device_bytes"] == ram["over_budget_bytes"] > 0
    assert ram["required_write_gbps"] == 0 and ram["drive_years"] is None   # null, not inf
    assert ram["memory_bytes"]["ssdtrain"] == \
        plain["memory_bytes"]["ssdtrain"] + tier["device_bytes"]

    assert E.main(_HOST_ARGV + ["--host-budget", "unlimited", "--no-ssd", "--json"]) == 0
    tier = _finite_json(capsys.readouterr().out)["host_tier"]
    assert tier["budget_bytes"] == (1 << 63) - 1 and tier["device_bytes"] == 0
    assert 0 < tier["peak_host_bytes"] <= plain["offloadable_bytes"]

    assert E.main(_HOST_ARGV + ["--host-budget", "1MiB"]) == 0
    text = capsys.readouterr().out
    assert "| host tier (host_budget_bytes 1.00 MiB, SSD beyond)" in text
    for row in ("in host RAM when forward ends", "peak in host RAM",
                "on to the SSD (beyond the budget)"):
        assert f"| {row} " in text, row
    assert "count only the bytes that reach the SSD" in text
    assert E.main(_HOST_ARGV + ["--host-budget", "1MiB", "--no-ssd"]) == 0
    text = capsys.readouterr().out
    assert "no SSD tier)" in text and "| kept in device memory (beyond the budget) " in text
    assert "over host_budget_bytes" in text


@pytest.mark.parametrize("name,kind,needs", [
    ("ViTConfig", "vision", "pixel_values"),
    ("Wav2Vec2Config", "audio", "input_values"),
    ("WhisperConfig:WhisperForConditionalGeneration", "audio", "input_features"),
    ("LlavaConfig", "multimodal", "pixel_values"),
])
def test_cli_says_which_inputs_a_config_that_is_not_text_needs(name, kind, needs, tmp_path,
                                                                capsys):
    """Before: "'NoneType' object has no attribute 'dtype'" (a vision model given token
    ids). Now: exit 2, the kind of model and the inputs it needs, and what to do."""
    tf = pytest.importorskip("transformers")
    cls_name, _, arch = name.partition(":")
    cfg = getattr(tf, cls_name)()
    if arch:
        cfg.architectures = [arch]
    path = _write_config(cfg, tmp_path / "config.json")
    assert E.main(["--hf-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"a {kind} model" in err or f"an {kind} model" in err, err
    assert needs in err and "--factory" in err and "Traceback" not in err


def test_cli_traceback_flag_keeps_the_traceback_for_user_errors():
    with pytest.raises(ssdtrain.ConfigError, match="tflops"):
        E.main(["--factory", "models:gpt", "--tflops", "1e300", "--traceback"])
