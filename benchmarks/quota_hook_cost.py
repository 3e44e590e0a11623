#!/usr/bin/env python
"""What a saved tensor costs the training thread past ``policy="auto"``'s quota.

Once a step's offload quota is spent, a tensor whose storage has no record is kept in
memory without becoming one (NOTE [ The pack decision ] in ssdtrain/_decision/policy.py). This
times ssdtrain's pack and unpack hooks (``ssdtrain.tools.HookTimer``) for the same op
loop in three ways, interleaved in one process:

* ``small``: below ``min_tensor_bytes`` (passed through by ``pass_reason``: the floor);
* ``record``: ``policy="static"`` with a tail window that holds the whole step: a
  record that is kept in memory (what every tensor past the quota cost before);
* ``passed``: ``policy="auto"``'s first step (quota 0, its baseline): kept without a
  record.

Each round builds a fresh Offloader per way (so ``auto`` is in its first step), saves
``--count`` tensors of ``--size`` bytes through a ``torch.autograd.Function`` with a
small fill between saves (an op launch's worth of host work), then runs backward.
Medians over rounds of the per-call median; a markdown table and JSON.

Example::

    PYTHONPATH=. .venv/bin/python benchmarks/quota_hook_cost.py --rounds 15
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import md_table  # noqa: E402
from hook_cost import _Saved  # noqa: E402 (the op that saves one tensor)

KiB = 1 << 10
WAYS = ("small", "record", "passed")


def one_round(way, size, count, spill_dir, Save):
    import torch
    import ssdtrain
    from ssdtrain import tools
    if way == "small":
        cfg = dict(policy="static", min_tensor_bytes=2 * size)
    elif way == "record":
        cfg = dict(policy="static", keep_tail_bytes=4 * count * size)
    else:
        cfg = dict(policy="auto")
    off = ssdtrain.Offloader(spill_dir=spill_dir, **cfg)
    try:
        xs = [torch.full((size // 4,), float(i)) for i in range(count)]
        a = torch.ones((), requires_grad=True)
        tick = torch.empty(1024)
        # "auto"'s first step offloads as "static" does (its sizing step, NOTE [ The
        # offload quota ]); the step measured is the next, a baseline step (quota 0).
        for step in range(2 if way == "passed" else 1):
            timer = tools.HookTimer()
            with off, timer.wrap():
                outs = []
                for i, x in enumerate(xs):
                    tick.fill_(i)
                    outs.append(Save.apply(a, x))
            nodes = [o.grad_fn for o in outs]
            torch.stack(outs).sum().backward()
            wrong = sum(n.first != float(i) for i, n in enumerate(nodes))
            if wrong:
                raise RuntimeError(f"quota_hook_cost: {wrong} tensors came back wrong ({way})")
            off.wait()
        st = off.stats()
        if way == "passed" and (st.offload_quota_bytes != 0 or off.records()):
            raise RuntimeError("quota_hook_cost: the auto step was not past its quota")
        return (statistics.median(timer.pack_ns) / 1e3, statistics.median(timer.unpack_ns) / 1e3)
    finally:
        off.close()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, default=256 * KiB, help="bytes per saved tensor")
    p.add_argument("--count", type=int, default=150, help="saved tensors per step")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--spill-dir", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    Save = _Saved.function()
    spill = args.spill_dir or tempfile.mkdtemp(prefix="ssdtrain-qhc-")
    res = {w: [] for w in WAYS}
    for r in range(args.rounds):
        for w in WAYS[r % 3:] + WAYS[:r % 3]:
            res[w].append(one_round(w, args.size, args.count, spill, Save))
    print(f"{args.count} saves of {args.size} B per step, {args.rounds} rounds; median of "
          f"per-round medians, us")
    out, rows = {}, []
    for w in WAYS:
        pk = statistics.median(x[0] for x in res[w])
        up = statistics.median(x[1] for x in res[w])
        out[w] = {"pack_us": pk, "unpack_us": up, "rounds": res[w]}
        rows.append([w, f"{pk:.1f}", f"{up:.1f}"])
    print(md_table(["way", "pack (us)>", "unpack (us)>"], rows))
    print("Command: " + " ".join(["benchmarks/quota_hook_cost.py"] + (argv or sys.argv[1:])))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size": args.size, "count": args.count, "results": out}, f, indent=1)


if __name__ == "__main__":
    main()
