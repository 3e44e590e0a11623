#!/usr/bin/env python
"""The recompute-offload-keep (ROK) curve: plans from keep-all to recompute-all, measured.

For one GPT-like model and micro-batch, each plan of ``ssdtrain.tools.rok_plans``
(keep all blocks; then offload blocks from the first on, one more each time;
then recompute blocks from the first on, until all are recomputed) runs in a
fresh process (examples/step_worker.py, setup ``plan``): the blocks are
tracked, profiled for ``profile_steps`` steps, the plan is set with
``Offloader.set_plan``, one warm-up step runs, then ``--steps`` measured steps.
Per plan: peak RSS of the measured steps, median step time, and the planner's
prediction of both (step time; peak activation bytes). Output in ``--out``:
``rok.json``, ``rok.md`` and ``rok_curve.png`` (step time against peak RSS, one
point per plan). Nothing asserts a timing.

Example::

    .venv/bin/python examples/rok_curve.py --out results/rok
    .venv/bin/python examples/rok_curve.py --tiny --out /tmp/rok     # seconds
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from step_worker import run_in_child  # noqa: E402
from microbatch_sweep import DEFAULT_MODEL, TINY_MODEL, _progress  # noqa: E402
from ssdtrain.tools import rok_plans  # noqa: E402

MiB = 1 << 20


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="rok_out", help="output directory")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=3, help="measured steps per plan (default 3)")
    p.add_argument("--spill-dir", default=None, help="default: the system temporary directory")
    p.add_argument("--keep-tail-mib", type=float, default=16)
    p.add_argument("--prefetch-mib", type=float, default=32)
    p.add_argument("--model", default=None, help="JSON overriding the model shape")
    p.add_argument("--tiny", action="store_true", help="a tiny model, for the tests")
    return p


def label(choices):
    return "".join(c[0] for c in choices)


def render(rows, args_line):
    lines = [f"Command: `{args_line}`", "",
             "| plan | peak RSS (MiB) | step (s) | predicted step (s) | predicted error | "
             "predicted peak activations (MiB) | written (MiB/step) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| `{label(r['choices'])}` | {r['error']} | | | | | |")
            continue
        p = r.get("plan") or {}
        pred = p.get("predicted_step_s")
        err = f"{pred / r['step_s_median'] - 1:+.1%}" if pred else ""
        lines.append(f"| `{label(r['choices'])}` | {r['peak_rss'] / MiB:.0f} | "
                     f"{r['step_s_median']:.3f} | {pred:.3f} | {err} | "
                     f"{p.get('predicted_peak_bytes', 0) / MiB:.0f} | "
                     f"{r.get('written_bytes_per_step', 0) / MiB:.0f} |")
    lines += ["", "k = keep, o = offload, r = recompute, one letter per block in forward order."]
    return "\n".join(lines)


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ok = [r for r in rows if "error" not in r]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [r["peak_rss"] / MiB for r in ok]
    ys = [r["step_s_median"] for r in ok]
    ax.plot(xs, ys, marker="o", label="measured")
    preds = [(r["peak_rss"] / MiB, r["plan"]["predicted_step_s"]) for r in ok if r.get("plan")]
    if preds:
        ax.plot(*zip(*preds), marker="x", linestyle=":", label="predicted step")
    for r, x, y in zip(ok, xs, ys):
        ax.annotate(label(r["choices"]), (x, y), textcoords="offset points", xytext=(4, 4),
                    fontsize=7)
    ax.set_xlabel("peak RSS (MiB)")
    ax.set_ylabel("step time (s)")
    ax.set_title("ROK curve: keep -> offload -> recompute")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    args = build_parser().parse_args(argv)
    model = dict(TINY_MODEL if args.tiny else DEFAULT_MODEL)
    if args.model:
        model.update(json.loads(args.model))
    batch = 2 if args.tiny and args.batch == 16 else args.batch
    offload = dict(keep_tail_bytes=0 if args.tiny else int(args.keep_tail_mib * MiB),
                   prefetch_bytes=1 * MiB if args.tiny else int(args.prefetch_mib * MiB),
                   min_tensor_bytes=1024 if args.tiny else 256 * 1024)
    os.makedirs(args.out, exist_ok=True)
    spill = args.spill_dir or tempfile.gettempdir()
    plans = rok_plans(model["n_layers"])
    bar = _progress(len(plans))
    rows = []
    t0 = time.perf_counter()
    for choices in plans:
        bar.set_description(label(choices))
        r = run_in_child(dict(model=model, spill_dir=spill, steps=args.steps, offload=offload,
                              setup="plan", batch=batch, choices=list(choices)))
        r["choices"] = list(choices)
        rows.append(r)
        bar.update()
    bar.close()
    args_line = "python examples/rok_curve.py " + " ".join(sys.argv[1:] if argv is None else argv)
    md = render(rows, args_line)
    with open(os.path.join(args.out, "rok.json"), "w") as f:
        json.dump({"model": model, "batch": batch, "offload": offload, "runs": rows,
                   "wall_s": time.perf_counter() - t0}, f, indent=1, default=str)
    with open(os.path.join(args.out, "rok.md"), "w") as f:
        f.write(md + "\n")
    plot(rows, os.path.join(args.out, "rok_curve.png"))
    print(md)
    errors = [r for r in rows if "error" in r]
    for r in errors:
        print(f"\nplan {label(r['choices'])} failed: {r['error']}\n{r.get('stderr', '')}",
              file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
