"""Fine-tune a small Llama with transformers.Trainer, with and without ssdtrain.

The model is a randomly initialized ``LlamaForCausalLM`` built from a
``LlamaConfig`` (no download) and trained on random tokens: the point is the
mechanics, not the loss. The two runs (``Trainer`` alone, then ``Trainer`` with
``SSDTrainCallback``) use the same seed; the script checks that their losses and
trainable-parameter gradients are bitwise equal at every step, and prints the
step time, the bytes written to the spill tier, and how much of the offload-eligible
activations ssdtrain still held in memory when each forward ended (writes lag
forward when the disk is slower than compute: ``write_behind_bytes`` bounds that).

    python examples/hf_finetune.py                 # full fine-tune
    python examples/hf_finetune.py --lora          # LoRA through peft
    python examples/hf_finetune.py --json out.json --md out.md

Needs ``pip install ssdtrain[hf]`` (transformers, peft, accelerate).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time

import torch
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

import ssdtrain
from ssdtrain.integrations.hf import SSDTrainCallback

MiB = 1 << 20


def build_model(hidden=256, layers=4, heads=8, vocab=2048, seq=256, lora=False, seed=0):
    """A randomly initialized Llama (``lora``: wrapped by ``peft`` with LoRA adapters)."""
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 4 // 1,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=max(1, heads // 2), max_position_embeddings=seq,
                      attn_implementation="eager")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
        if lora:
            from peft import LoraConfig, get_peft_model
            model = get_peft_model(model, LoraConfig(
                r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    return model.train()


class RandomTokens(Dataset):
    """``n`` sequences of ``seq`` random token ids; labels are the inputs (causal LM)."""

    def __init__(self, n, seq, vocab, seed=1):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Recorder(TrainerCallback):
    """Per optimizer step: wall time, and (``keep_grads``) the trainable gradients."""

    def __init__(self, keep_grads=True):
        self.keep_grads = keep_grads
        self.times, self.grads, self.resident, self._t0 = [], [], [], None

    def on_step_begin(self, args, state, control, **kwargs):
        self._t0 = time.perf_counter()

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self.keep_grads:
            self.grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()
                               if p.requires_grad})

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self._t0)


def train(model, dataset, *, steps, batch, out_dir, callbacks=(), grad_accum=1, offloader=None):
    """Run ``Trainer`` for ``steps`` optimizer steps; returns (Recorder, per-forward losses).

    With ``offloader``, ``Recorder.resident`` gets the bytes of saved activations ssdtrain
    still held in memory as each forward ended (the hook runs just before the pass ends).
    """
    losses = []
    rec = Recorder()

    def on_forward(m, a, out):
        if m.training and torch.is_grad_enabled():
            losses.append(out.loss.detach().clone())
            if offloader is not None:
                rec.resident.append(offloader.resident_bytes())

    handle = model.register_forward_hook(on_forward)
    args = TrainingArguments(
        output_dir=out_dir, max_steps=steps, per_device_train_batch_size=batch,
        gradient_accumulation_steps=grad_accum, learning_rate=1e-3, use_cpu=True,
        report_to=[], save_strategy="no", logging_steps=1, seed=0, data_seed=0,
        dataloader_num_workers=0, disable_tqdm=not sys.stderr.isatty())
    trainer = Trainer(model=model, args=args, train_dataset=dataset,
                      callbacks=[rec, *callbacks])
    try:
        trainer.train()
    finally:
        handle.remove()
    return rec, losses


def compare(ref, got):
    """Whether two (Recorder, losses) results are bitwise equal; names the first difference."""
    (ref_rec, ref_losses), (rec, losses) = ref, got
    if len(ref_losses) != len(losses):
        return f"{len(losses)} forwards vs {len(ref_losses)}"
    for i, (a, b) in enumerate(zip(ref_losses, losses)):
        if not torch.equal(a, b):
            return f"loss of forward {i}: {b.item()!r} vs {a.item()!r}"
    for step, (ga, gb) in enumerate(zip(ref_rec.grads, rec.grads)):
        for name, g in ga.items():
            if not torch.equal(g, gb[name]):
                return f"gradient of {name} at step {step}"
    return ""


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lora", action="store_true", help="LoRA adapters through peft")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=2,
                   help="alternating runs without and with ssdtrain (times: median of all)")
    p.add_argument("--spill-dir", default=None, help="default: a temporary directory")
    p.add_argument("--min-tensor-bytes", default="64KiB")
    p.add_argument("--keep-tail-bytes", default="0")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--md", default=None, help="write a markdown table here")
    args = p.parse_args(argv)
    logging.getLogger("transformers").setLevel(logging.ERROR)

    dims = dict(hidden=args.hidden, layers=args.layers, heads=max(1, args.hidden // 32),
                vocab=args.vocab, seq=args.seq, lora=args.lora)
    n = args.steps * args.batch_size * args.grad_accum
    dataset = RandomTokens(n, args.seq, args.vocab)
    spill_dir = args.spill_dir or tempfile.mkdtemp(prefix="ssdtrain-hf-")
    kw = dict(steps=args.steps, batch=args.batch_size, grad_accum=args.grad_accum)
    # Runs alternate (without, with, without, with...) so drift hits both alike.
    ref_times, got_times, mismatch = [], [], ""
    with tempfile.TemporaryDirectory() as out:
        for _ in range(args.repeats):
            ref = train(build_model(**dims), dataset, out_dir=out, **kw)
            # policy="static": every step offloads, so every step checks the offload path
            off = ssdtrain.Offloader(spill_dir=spill_dir, policy="static",
                                     min_tensor_bytes=args.min_tensor_bytes,
                                     keep_tail_bytes=args.keep_tail_bytes)
            got = train(build_model(**dims), dataset, out_dir=out, offloader=off,
                        callbacks=[SSDTrainCallback(off, log_stats=True)], **kw)
            off.wait()
            stats = off.stats()
            off.close()
            mismatch = mismatch or compare(ref, got)
            # the first step of a run pays one-time costs (allocation, warm-up)
            ref_times += ref[0].times[1:] or ref[0].times
            got_times += got[0].times[1:] or got[0].times
    if args.spill_dir is None:
        os.rmdir(spill_dir)
    forwards = len(got[1])
    med = statistics.median
    result = {
        "model": ("LoRA " if args.lora else "") + f"Llama h{args.hidden} L{args.layers} "
                 f"seq{args.seq} batch{args.batch_size}",
        "steps": args.steps, "forwards": forwards, "exact": not mismatch,
        "repeats": args.repeats,
        "step_s_without": med(ref_times), "step_s_with": med(got_times),
        "saved_mib_per_forward": stats.packed_bytes / MiB / forwards,
        "offloaded_mib_per_forward": stats.offloaded_bytes / MiB / forwards,
        "eligible_mib_per_forward": stats.unique_bytes / MiB / forwards,
        "resident_mib_at_end_of_forward": med(got[0].resident) / MiB,
        "kept_mib_per_forward": stats.kept_bytes / MiB / forwards,
        "peak_resident_mib": stats.peak_resident_bytes / MiB,
        "prefetch_misses": stats.prefetch_misses,
        "engine": stats.engine,
        "final_loss": got[1][-1].item(),
    }
    rows = [("model", result["model"]),
            ("losses and gradients bitwise equal", "yes" if not mismatch else f"NO: {mismatch}"),
            ("step time without / with ssdtrain (median, s)",
             f"{result['step_s_without']:.3f} / {result['step_s_with']:.3f}"),
            ("saved for backward per forward (MiB)", f"{result['saved_mib_per_forward']:.1f}"),
            ("written to the spill tier per forward (MiB)",
             f"{result['offloaded_mib_per_forward']:.1f}"),
            ("offload-eligible activations per forward (MiB; all in memory without ssdtrain)",
             f"{result['eligible_mib_per_forward']:.1f}"),
            ("of which still in memory when forward ended (MiB, median)",
             f"{result['resident_mib_at_end_of_forward']:.1f}"),
            ("kept in memory per forward (MiB)", f"{result['kept_mib_per_forward']:.1f}"),
            ("peak bytes ssdtrain held (MiB)", f"{result['peak_resident_mib']:.1f}"),
            ("prefetch misses", str(result["prefetch_misses"])),
            ("engine", result["engine"])]
    md = "| | |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows) + "\n"
    print(md, end="")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if args.md:
        with open(args.md, "w") as f:
            f.write(md)
    if mismatch:
        raise SystemExit(f"ssdtrain: results differ from the run without offloading: {mismatch}")
    return result


if __name__ == "__main__":
    main()
