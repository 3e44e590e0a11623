#!/usr/bin/env python
"""What the default policy (``policy="auto"``) offloads, step by step, as a new user runs it.

Two scenarios, each with only ``spill_dir`` set (the default everything else), one
process per run:

* ``gpt2``: Hugging Face GPT-2, 4 layers, d 384, 6 heads, seq 384, batch 4, vocab 8192,
  AdamW (``transformers`` needed): forward under ``with offloader:``, backward, the
  optimizer step.
* ``accum``: an 8-layer MLP (d 1024, batch 512, GELU) with ``--micro-batches`` forward and
  backward passes per optimizer step and ``--optimizer-s`` of other work between
  optimizer steps (a sleep: the optimizer, logging, data loading), ``keep_tail_bytes=0``.

Per step (a forward and its backward; each micro-batch is one): the share of the bytes it
saved that it decided to write (``Stats.offloaded_bytes`` / ``Stats.unique_bytes``,
deltas; ``nan`` where nothing was intercepted: the policy had turned the hooks off; a
step whose hooks came off past its quota, ``Stats.hooks_cut_steps``, is divided by the
last full step's count), and
the policy's reason (``Stats.offload_quota_reason``). The summary: the mean share over
the steps after ``--warmup``, counting a step without hooks as 0, and how many reasons
said "lowered". Timings are not the point (this machine's step times move by more than
the policy's margin); what the policy decided under that noise is.

To compare with another checkout of ssdtrain, run the same command with
``PYTHONPATH=<that checkout>``: ssdtrain is imported from there (the JSON records which).

Example::

    .venv/bin/python benchmarks/default_policy_check.py --scenario gpt2 --steps 24
    .venv/bin/python benchmarks/default_policy_check.py --scenario accum --steps 40 \\
        --micro-batches 4 --optimizer-s 0.1
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for _common, however run
import _common  # noqa: E402  (puts this checkout's ssdtrain first unless PYTHONPATH says)

import torch  # noqa: E402

import ssdtrain  # noqa: E402


def gpt2_step_fn(seed):
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError as e:
        raise SystemExit(f"default_policy_check: --scenario gpt2 needs transformers ({e})")
    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=4, n_embd=384, n_head=6, n_positions=384, vocab_size=8192)
    model = GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 8192, (4, 384))

    def micro_batch(off):
        with off:
            loss = model(ids, labels=ids).loss
        loss.backward()

    def optimizer_step():
        opt.step()
        opt.zero_grad(set_to_none=True)
    return micro_batch, optimizer_step


def accum_step_fn(seed, optimizer_s):
    torch.manual_seed(seed)
    d = 1024
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.GELU())
                                  for _ in range(8)])
    x = torch.randn(512, d)

    def micro_batch(off):
        with off:
            loss = model(x).square().mean()
        loss.backward()

    def optimizer_step():
        time.sleep(optimizer_s)
        model.zero_grad(set_to_none=True)
    return micro_batch, optimizer_step


def run(args, spill_dir):
    if args.scenario == "gpt2":
        micro_batch, optimizer_step = gpt2_step_fn(args.seed)
        off = ssdtrain.Offloader(spill_dir=spill_dir)
    else:
        micro_batch, optimizer_step = accum_step_fn(args.seed, args.optimizer_s)
        off = ssdtrain.Offloader(spill_dir=spill_dir, keep_tail_bytes=0)
    rows = []
    full = None  # the bytes the last step that ran its hooks to the end saved
    try:
        for step in range(args.steps):
            for _ in range(args.micro_batches):
                before = off.stats()
                micro_batch(off)
                after = off.stats()
                saved = after.unique_bytes - before.unique_bytes
                if after.hooks_cut_steps > before.hooks_cut_steps:
                    saved = full  # a cut step counted only what it intercepted
                elif saved:
                    full = saved
                share = (after.offloaded_bytes - before.offloaded_bytes) / saved if saved \
                    else math.nan
                rows.append({"step": step, "share": share,
                             "quota_bytes": after.offload_quota_bytes,
                             "reason": after.offload_quota_reason})
                print(f"[{len(rows)}/{args.steps * args.micro_batches}] share "
                      f"{share:.2f}: {after.offload_quota_reason[:100]}", file=sys.stderr)
            optimizer_step()
    finally:
        off.close()
    return rows


def static_ab(args, spill_dir):
    """What offloading every eligible tensor costs the scenario's steps here, so that a
    share the default keeps low can be told from noise: the step (forward and backward,
    each write landed) with no offloader, with ``policy="static"``, and with
    ``policy="static", verify=False``, in turn in one process, ``--static-ab`` rounds
    after two warm-up rounds. ``{way: {"step_s": median, "ratio": to none}}``."""
    import contextlib
    import statistics
    build = gpt2_step_fn if args.scenario == "gpt2" else \
        (lambda seed: accum_step_fn(seed, args.optimizer_s))
    micro_batch, optimizer_step = build(args.seed)
    extra = {} if args.scenario == "gpt2" else {"keep_tail_bytes": 0}
    ways = {"none": contextlib.nullcontext(),
            "static": ssdtrain.Offloader(spill_dir=spill_dir, policy="static", **extra),
            "static, verify off": ssdtrain.Offloader(spill_dir=spill_dir, policy="static",
                                                     verify=False, **extra)}
    times = {w: [] for w in ways}
    names = list(ways)
    try:
        for r in range(args.static_ab + 2):
            for w in names[r % 3:] + names[:r % 3]:
                off = ways[w]
                t = time.perf_counter()
                micro_batch(off)
                if w != "none":
                    off.wait()
                if r >= 2:
                    times[w].append(time.perf_counter() - t)
                optimizer_step()
        offloaded = {w: 0 if w == "none" else ways[w].stats().offloaded_bytes for w in names}
    finally:
        for w in names[1:]:
            ways[w].close()
    med = {w: statistics.median(v) for w, v in times.items()}
    return {w: {"step_s": med[w], "ratio": med[w] / med["none"], "steps": times[w],
                "offloaded_bytes": offloaded[w]} for w in names}


def summarize(rows, warmup):
    after = rows[warmup:]
    shares = [0.0 if math.isnan(r["share"]) else r["share"] for r in after]
    return {"mean_share_after_warmup": sum(shares) / len(shares) if shares else math.nan,
            "steps_after_warmup": len(after),
            "steps_without_hooks": sum(math.isnan(r["share"]) for r in after),
            "lowered": sum("lowered" in r["reason"] for r in rows)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scenario", choices=["gpt2", "accum"], default="gpt2")
    p.add_argument("--steps", type=int, default=24, help="optimizer steps")
    p.add_argument("--micro-batches", type=int, default=None,
                   help="forward+backward passes per optimizer step (default: 1 for gpt2, "
                        "4 for accum)")
    p.add_argument("--optimizer-s", type=float, default=0.1,
                   help="accum: seconds of other work per optimizer step")
    p.add_argument("--warmup", type=int, default=8, help="steps (micro-batches) not summarized")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--spill-dir", default=None)
    p.add_argument("--static-ab", type=int, default=0, metavar="ROUNDS",
                   help="then time the scenario's steps with no offloader, with "
                        "policy='static' and with verify off as well, in turn, ROUNDS rounds "
                        "(what offloading everything costs here; default 0: not run)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.threads is not None:
        if args.threads < 1:
            p.error("--threads must be >= 1")
        torch.set_num_threads(args.threads)
    if args.micro_batches is None:
        args.micro_batches = 1 if args.scenario == "gpt2" else 4
    if args.steps < 1 or args.micro_batches < 1 or args.optimizer_s < 0 or args.warmup < 0:
        p.error("--steps and --micro-batches must be >= 1, --optimizer-s and --warmup >= 0")
    if args.static_ab < 0:
        p.error("--static-ab must be >= 0")
    with tempfile.TemporaryDirectory(dir=args.spill_dir) as spill_dir:
        rows = run(args, spill_dir)
        ab = static_ab(args, spill_dir) if args.static_ab else None
    summary = summarize(rows, args.warmup)
    print(f"## default_policy_check: {args.scenario}, {args.steps} optimizer steps x "
          f"{args.micro_batches} micro-batch(es)"
          + (f", {args.optimizer_s} s between optimizer steps" if args.scenario == "accum"
             else ""))
    print()
    print(_common.md_table(
        ["step>", "share offloaded>", "reason"],
        [[i, "no hooks" if math.isnan(r["share"]) else f"{r['share']:.2f}", r["reason"][:90]]
         for i, r in enumerate(rows)]))
    print()
    print(f"Mean share after {args.warmup} steps: {summary['mean_share_after_warmup']:.2f} "
          f"({summary['steps_without_hooks']} of {summary['steps_after_warmup']} without "
          f"hooks, counted 0); reasons that said 'lowered': {summary['lowered']}.")
    if ab is not None:
        print()
        print(f"Every eligible tensor offloaded, {args.static_ab} rounds in turn, "
              f"{torch.get_num_threads()} torch threads (median step: forward, backward, "
              f"writes landed):")
        print()
        print(_common.md_table(["way", "step (ms)>", "x none>"],
                               [[w, f"{a['step_s'] * 1e3:.0f}", f"{a['ratio']:.3f}"]
                                for w, a in ab.items()]))
    print(f"ssdtrain from {os.path.dirname(ssdtrain.__file__)}; command: "
          f"{' '.join([os.path.basename(sys.executable)] + sys.argv)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"scenario": args.scenario, "args": vars(args), "rows": rows,
                       "summary": summary, "static_ab": ab,
                       "ssdtrain": os.path.dirname(ssdtrain.__file__)},
                      f, indent=1)
    return summary


if __name__ == "__main__":
    main()
