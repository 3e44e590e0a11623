#!/usr/bin/env python
"""What taking the hooks off past the quota saves the training thread (NOTE [ Hooks off
past the window ] in ssdtrain/_policies/auto.py).

A launch-like loop (``--count`` saves of ``--size`` bytes through a
``torch.autograd.Function``, ``--fill`` small tensor ops between saves, as a thread
launching kernels does), then backward, timed three ways interleaved in one process:

* ``none``: no offloader (the reference);
* ``hooked``: ``policy="auto"`` with the quota pinned to ``--share`` of the step's bytes
  (``ssdtrain.tools.pin_auto_quota``), the hooks kept on to the end of forward (as
  before the change: every save past the quota passed through by the pack hook, every
  unpack through ours);
* ``cut``: the same, as shipped: the hooks come off once the quota and
  the prefetch window's bytes more are past (but in one step of 17, which counts what a step
  saves: the medians leave it out).

Per way: the median over rounds of forward's and backward's wall time, and the time
added per saved tensor against ``none``. Each offloader runs ``--warmup`` steps first
(its first step counts what a step saves). A markdown table and JSON.

Example::

    .venv/bin/python benchmarks/hooks_cut.py --rounds 15
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  (this checkout's ssdtrain first)

KiB = 1 << 10
WAYS = ("none", "hooked", "cut")


def _function():
    import torch

    class Save(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, x):
            ctx.save_for_backward(x)
            return a * 1.0

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return g * x[0], None
    return Save


def one_step(off, xs, a, tick, fill, Save):
    import torch
    t0 = time.perf_counter()
    if off is not None:
        off.__enter__()
    try:
        outs = []
        for i, x in enumerate(xs):
            for _ in range(fill):
                tick.add_(1.0)
            outs.append(Save.apply(a, x))
    finally:
        if off is not None:
            off.__exit__(None, None, None)
    t1 = time.perf_counter()
    torch.stack(outs).sum().backward()
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, default=256 * KiB, help="bytes per saved tensor")
    p.add_argument("--count", type=int, default=400, help="saved tensors per step")
    p.add_argument("--fill", type=int, default=4, help="small ops between two saves")
    p.add_argument("--share", type=float, default=1 / 16, help="quota: share of the bytes")
    p.add_argument("--prefetch-mib", type=float, default=8.0, help="prefetch_bytes, MiB")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--spill-dir", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    import torch
    import ssdtrain
    from ssdtrain.tools import pin_auto_quota, set_hooks_cut
    torch.set_num_threads(1)
    Save = _function()
    spill = args.spill_dir or tempfile.mkdtemp(prefix="ssdtrain-hooks-cut-")
    xs = [torch.full((args.size // 4,), float(i)) for i in range(args.count)]
    a = torch.ones((), requires_grad=True)
    tick = torch.zeros(64)
    quota = int(args.share * args.size * args.count)
    offs = {}
    for way in WAYS[1:]:
        off = ssdtrain.Offloader(spill_dir=spill, policy="auto", min_tensor_bytes=args.size,
                                 prefetch_bytes=int(args.prefetch_mib * (1 << 20)))
        pin_auto_quota(off, quota)
        set_hooks_cut(off, way == "cut")  # "hooked": the hooks as before the change
        offs[way] = off
    for off in offs.values():
        for _ in range(args.warmup):
            one_step(off, xs, a, tick, args.fill, Save)
            off.wait()
    for _ in range(args.warmup):
        one_step(None, xs, a, tick, args.fill, Save)
    res = {w: [] for w in WAYS}
    cut0 = offs["cut"].stats().hooks_cut_steps
    for r in range(args.rounds):
        for w in WAYS[r % 3:] + WAYS[:r % 3]:
            off = offs.get(w)
            res[w].append(one_step(off, xs, a, tick, args.fill, Save))
            if off is not None:
                off.wait()
    cut = offs["cut"].stats().hooks_cut_steps - cut0
    hooked = offs["hooked"].stats().hooks_cut_steps
    for off in offs.values():
        off.close()
    # One step in 17 runs its hooks to the end to count what a step saves (RECOUNT_STEPS).
    if cut < args.rounds - (args.rounds // 16 + 1) or hooked:
        raise SystemExit(f"hooks_cut: expected every cut step but the recounts cut and no "
                         f"hooked step cut; got {cut} of {args.rounds} and {hooked}")
    fw = {w: statistics.median(x[0] for x in res[w]) for w in WAYS}
    bw = {w: statistics.median(x[1] for x in res[w]) for w in WAYS}
    print(f"{args.count} saves of {args.size} B, {args.fill} ops between saves, quota "
          f"{args.share:.4g} of the step ({quota / (1 << 20):.1f} MiB), prefetch "
          f"{args.prefetch_mib} MiB; {args.rounds} rounds interleaved, medians")
    out, rows = {}, []
    for w in WAYS:
        af = (fw[w] - fw["none"]) / args.count * 1e6
        ab = (bw[w] - bw["none"]) / args.count * 1e6
        out[w] = {"forward_s": fw[w], "backward_s": bw[w], "added_forward_us": af,
                  "added_backward_us": ab, "rounds": res[w]}
        rows.append([w, f"{fw[w] * 1e3:.2f}", f"{bw[w] * 1e3:.2f}", f"{af:.1f}", f"{ab:.1f}"])
    print(_common.md_table(["way", "forward (ms)>", "backward (ms)>",
                            "added per save, forward (us)>", "added per save, backward (us)>"],
                           rows))
    print("Command: " + " ".join(["benchmarks/hooks_cut.py"] + (argv or sys.argv[1:])))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
