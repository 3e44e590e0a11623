"""Hugging Face: Trainer + SSDTrainCallback, PEFT LoRA, gradient checkpointing, generate().

Tiny randomly initialized Llama models (no downloads), built by
``examples/hf_finetune.py``, which also runs here once per variant.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
pytest.importorskip("peft", reason="needs the hf extra: pip install -e '.[hf]'")

import models  # noqa: E402,F401  (puts examples/ on sys.path)
import hf_finetune  # noqa: E402
from helpers import EngineCalls  # noqa: E402
from ssdtrain.integrations.hf import SSDTrainCallback  # noqa: E402

import ssdtrain  # noqa: E402
from ssdtrain import testing  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

TINY = ["--steps", "3", "--batch-size", "4", "--seq", "64", "--hidden", "64", "--layers", "2",
        "--vocab", "256", "--min-tensor-bytes", "16KiB", "--repeats", "1"]
DIMS = dict(hidden=64, layers=2, heads=2, vocab=256, seq=64)
HIDDEN_BYTES = 4 * 64 * 64 * 4  # one (batch 4, seq 64, hidden 64) fp32 hidden state


@pytest.mark.parametrize("variant", ["full", "lora"])
def test_trainer_example_is_exact_and_offloads(tmp_path, variant, capsys):
    """Trainer with SSDTrainCallback: losses of every forward and trainable gradients of
    every step bitwise equal to Trainer alone (the example raises SystemExit if not)."""
    argv = TINY + ["--spill-dir", str(tmp_path), "--json", str(tmp_path / "r.json"),
                   "--md", str(tmp_path / "r.md")]
    if variant == "lora":
        argv.append("--lora")
    result = hf_finetune.main(argv)
    assert result["exact"] and result["forwards"] == 3
    assert result["offloaded_mib_per_forward"] > 0 and result["prefetch_misses"] == 0
    assert "bitwise equal | yes" in capsys.readouterr().out
    assert (tmp_path / "r.json").exists() and (tmp_path / "r.md").exists()


def test_callback_with_gradient_accumulation_and_detaches(tmp_path):
    ds = hf_finetune.RandomTokens(12, 64, 256)
    kw = dict(steps=2, batch=2, grad_accum=3)
    ref = hf_finetune.train(hf_finetune.build_model(**DIMS), ds, out_dir=str(tmp_path), **kw)
    model = hf_finetune.build_model(**DIMS)
    cb = SSDTrainCallback(spill_dir=str(tmp_path), policy="static", min_tensor_bytes="16KiB",
                          keep_tail_bytes=0)
    got = hf_finetune.train(model, ds, out_dir=str(tmp_path), callbacks=[cb], **kw)
    assert len(got[1]) == 6
    assert hf_finetune.compare(ref, got) == ""
    assert cb.offloader.closed  # it created the offloader, so it closed it
    assert cb.offloader.stats().offloaded_bytes > 0
    assert not model._forward_pre_hooks and not model._forward_hooks  # detached


def _plain_steps(model, ids, off=None, steps=2):
    out = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        out.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                    if p.requires_grad}))
    return out


def _assert_equal_runs(ref, got):
    for (rl, rg), (gl, gg) in zip(ref, got):
        assert torch.equal(rl, gl)
        assert rg.keys() == gg.keys()
        for name in rg:
            assert torch.equal(rg[name], gg[name]), name


def test_lora_never_writes_parameters(make_offloader):
    model = hf_finetune.build_model(**DIMS, lora=True)
    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))
    ref = _plain_steps(model, ids)
    off = make_offloader(min_tensor_bytes="1KiB", keep_tail_bytes=0)
    calls = EngineCalls(off)
    off.attach(model)
    _assert_equal_runs(ref, _plain_steps(model, ids, off))
    off.wait()
    assert calls.writes
    # frozen base weights are saved by their Linear (for the input gradient) but stay put
    for name, p in model.named_parameters():
        assert not calls.writes_within(p.untyped_storage()), name


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_gradient_checkpointing(make_offloader, reentrant):
    """What reaches ssdtrain under ``gradient_checkpointing_enable()`` (INV-INNERMOST:
    the innermost saved-tensor hooks win).

    Inside every checkpointed decoder layer the checkpoint's own hooks (non-reentrant,
    transformers' default) or no_grad (reentrant) apply, so nothing saved inside a layer
    reaches ssdtrain. The checkpoint keeps each layer's *input* for the recomputation as
    a saved tensor before its hooks are pushed (non-reentrant: ``_CheckpointFrame.
    save_inputs``; reentrant: ``ctx.save_for_backward``), and that goes through ssdtrain:
    exactly one hidden state per layer per step is offloaded, plus what is saved outside
    the layers (final norm, lm_head input, logits for the loss). The recomputation in
    backward runs outside any pass and is never offloaded.
    """
    model = hf_finetune.build_model(**DIMS)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))
    ref = _plain_steps(model, ids)
    off = make_offloader(min_tensor_bytes="16KiB", keep_tail_bytes=0)
    off.attach(model)
    inside, depth = [], [0]

    def enter(m, a):
        depth[0] += 1

    def leave(m, a, o):
        depth[0] -= 1

    handles = []
    for layer in model.model.layers:
        handles += [layer.register_forward_pre_hook(enter),
                    layer.register_forward_hook(leave, always_call=True)]
    def spying(pack):
        def spy(t):
            if depth[0]:
                inside.append(t.numel() * t.element_size())
            return pack(t)
        return spy

    testing.wrap_hooks(off, pack=spying)
    _assert_equal_runs(ref, _plain_steps(model, ids, off))
    for h in handles:
        h.remove()
    off.wait()
    assert off.stats().offloaded_bytes > 0
    assert inside == [HIDDEN_BYTES] * (2 * len(model.model.layers))  # 2 steps


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_gradient_checkpointing_under_the_default_policy(tmp_path, reentrant):
    """Recompute with the inputs offloaded as a user gets it (docs/guide.md): checkpointing
    on, ``attach``, ``policy="auto"`` with a host tier on the loopback device. Past its
    sizing and baseline steps the default offloads a prefix of the steps' saves (the
    earliest layers' inputs first); every step's loss and gradients equal the run
    without ssdtrain."""
    from ssdtrain.tools import LoopbackDevice, attach_loopback
    model = hf_finetune.build_model(**DIMS)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))
    steps = 8
    ref = _plain_steps(model, ids, steps=steps)
    off = ssdtrain.Offloader(ssdtrain.OffloadConfig(
        spill_dir=str(tmp_path), host_budget_bytes="unlimited", policy="auto",
        min_tensor_bytes="16KiB", keep_tail_bytes=0))
    attach_loopback(off, LoopbackDevice(claim_host_tensors=True, capacity=1 << 30))
    off.attach(model)
    try:
        per_step, got = [], []
        for _ in range(steps):
            before = off.stats()
            got += _plain_steps(model, ids, off, steps=1)
            off.wait()
            per_step.append(off.stats().since(before).offloaded_bytes)
        _assert_equal_runs(ref, got)
        assert per_step[0] > 0 and per_step[1] == per_step[2] == 0  # sizing, baseline
        assert any(n > 0 for n in per_step[3:]), per_step
    finally:
        off.close()


def test_generate_eval_and_no_grad_are_untouched(make_offloader):
    model = hf_finetune.build_model(**DIMS)
    off = make_offloader(min_tensor_bytes="1KiB")
    off.attach(model)
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)  # train mode, no_grad
    model.eval()
    model(input_ids=ids, labels=ids).loss.backward()  # eval mode, grad on
    assert off._attachments[0].passes == 0 and off.stats().packed_bytes == 0


def test_callback_rejects_offloader_and_fields(make_offloader):
    with pytest.raises(ssdtrain.ConfigError, match="offloader and config"):
        SSDTrainCallback(make_offloader(), min_tensor_bytes=0)


def test_accelerate_loop(make_offloader):
    """A plain ``accelerate`` loop: ``attach`` on the prepared model, no other change."""
    from accelerate import Accelerator

    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))

    def run(off=None):
        model = hf_finetune.build_model(**DIMS)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        acc = Accelerator(cpu=True)
        model, opt = acc.prepare(model, opt)
        if off is not None:
            off.attach(model)
        out = []
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, labels=ids).loss
            acc.backward(loss)
            out.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
            opt.step()
        return out

    ref = run()
    off = make_offloader(min_tensor_bytes="16KiB", keep_tail_bytes=0)
    _assert_equal_runs(ref, run(off))
    off.wait()
    assert off._attachments[0].passes == 2 and off.stats().offloaded_bytes > 0
