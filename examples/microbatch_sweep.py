#!/usr/bin/env python
"""How big a micro-batch fits a memory budget: none, full recompute, ssdtrain static, adaptive.

For a GPT-like model (examples/gpt.py) and a budget on the peak RSS of the
training process, every setup runs at every micro-batch size, each
(setup, size) in a fresh process (examples/step_worker.py), setups interleaved
within each size. Per run: the median step time of ``--steps`` measured steps
(after warm-up; for ``adaptive``, after its profiled steps and its first
planned step), tokens/s, and the peak RSS of the measured steps. A run *fits*
when its peak RSS is within the budget.

* ``none``: plain PyTorch;
* ``recompute``: every block checkpointed (non-reentrant ``torch.utils.checkpoint``);
* ``static``: ``ssdtrain.Offloader`` (static policy, ``--keep-tail-mib``,
  ``--prefetch-mib``);
* ``adaptive``: ``policy="adaptive"``, tracked blocks; its activation budget is
  the RSS budget minus what a static step holds besides activations (NOTE
  [ Activation budget from an RSS budget ] in step_worker.py) minus
  ``--reserve-mib`` of headroom.

The budget defaults to the peak RSS of ``none`` at ``--budget-batch`` (so no
offload fits exactly that size). Output in ``--out``: ``results.json`` (every
run), ``results.md`` (the table and the targets, see :func:`check_targets`), ``microbatch_sweep.png``
(micro-batch vs tokens/s and vs peak RSS). Nothing asserts a timing.

Example::

    .venv/bin/python examples/microbatch_sweep.py --out results/microbatch_sweep
    .venv/bin/python examples/microbatch_sweep.py --tiny --out /tmp/sweep     # seconds
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from step_worker import run_in_child  # noqa: E402

MiB = 1 << 20
SETUPS = ("none", "recompute", "static", "adaptive")
DEFAULT_MODEL = dict(vocab=2048, seq_len=256, d_model=128, n_heads=4, n_layers=6)
TINY_MODEL = dict(vocab=256, seq_len=32, d_model=32, n_heads=2, n_layers=2)


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="microbatch_sweep_out", help="output directory")
    p.add_argument("--sizes", type=int, nargs="+", default=[4, 8, 16, 32],
                   help="micro-batch sizes (default 4 8 16 32)")
    p.add_argument("--setups", nargs="+", default=list(SETUPS), choices=SETUPS)
    p.add_argument("--budget-mib", type=float, default=None,
                   help="peak RSS budget; default: none's peak RSS at --budget-batch")
    p.add_argument("--budget-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=3, help="measured steps per run (default 3)")
    p.add_argument("--spill-dir", default=None, help="default: the system temporary directory")
    p.add_argument("--keep-tail-mib", type=float, default=16)
    p.add_argument("--prefetch-mib", type=float, default=32)
    p.add_argument("--min-tensor-kib", type=float, default=256)
    p.add_argument("--reserve-mib", type=float, default=16,
                   help="headroom taken off adaptive's activation budget (default 16)")
    p.add_argument("--model", default=None, help="JSON overriding the model shape, e.g. "
                   "'{\"d_model\": 256}'")
    p.add_argument("--tiny", action="store_true", help="a tiny model and sizes, for the tests")
    return p


def _progress(total):
    try:
        from tqdm import tqdm
        return tqdm(total=total, unit="run", file=sys.stderr, dynamic_ncols=True)
    except ImportError:  # the bench extra is not installed: plain lines
        class Plain:
            n = 0

            def update(self, k=1):
                self.n += k
                print(f"[{self.n}/{total}]", file=sys.stderr, flush=True)

            def set_description(self, s):
                print(s, file=sys.stderr, flush=True)

            def close(self):
                pass
        return Plain()


def summarize(runs, setups, sizes, budget):
    """Per setup: per size (tokens/s, peak RSS, fits), and the largest size that fits."""
    table = {}
    for setup in setups:
        rows = {}
        for size in sizes:
            r = next((r for r in runs if r["setup"] == setup and r["batch"] == size), None)
            if r is None:
                continue
            if "error" in r:
                rows[size] = {"error": r["error"]}
                continue
            rows[size] = {"tokens_per_s": r["tokens_per_s"], "step_s": r["step_s_median"],
                          "peak_rss": r["peak_rss"], "fits": r["peak_rss"] <= budget,
                          "plan": r.get("plan")}
        fitting = [s for s, row in rows.items() if row.get("fits")]
        table[setup] = {"rows": rows, "largest_fit": max(fitting) if fitting else None}
    return table


def check_targets(table, budget):
    """The targets (reported, never asserted), for ``static`` and ``adaptive``: fit >= 2x
    the micro-batch of ``none`` at >= 0.95x its tokens/s at that size, and beat full
    recompute on tokens/s under the budget."""
    out = []

    def tps(setup, size):
        row = table.get(setup, {}).get("rows", {}).get(size, {})
        return row.get("tokens_per_s")

    none_fit = table.get("none", {}).get("largest_fit")
    for setup in ("static", "adaptive"):
        if setup not in table or "none" not in table:
            continue
        fit = table[setup]["largest_fit"]
        if none_fit and fit:
            ratio = tps(setup, fit) / tps("none", fit) if tps("none", fit) else None
            met = fit >= 2 * none_fit and ratio is not None and ratio >= 0.95
            out.append({"name": f"{setup}: fits >= 2x none's micro-batch at >= 0.95x none's "
                                f"tokens/s at that size",
                        "detail": f"largest fit {fit} vs none {none_fit} "
                                  f"({fit / none_fit:.1f}x); tokens/s ratio to none at "
                                  f"{fit}: " + (f"{ratio:.3f}" if ratio else "n/a"),
                        "met": bool(met)})
        if "recompute" in table:
            both = [s for s, row in table[setup]["rows"].items()
                    if row.get("fits") and table["recompute"]["rows"].get(s, {}).get("fits")]
            if both:
                ratios = {s: tps(setup, s) / tps("recompute", s) for s in sorted(both)}
                out.append({"name": f"{setup}: beats full recompute on tokens/s under the budget",
                            "detail": ", ".join(f"batch {s}: {r:.3f}x" for s, r in ratios.items()),
                            "met": all(r > 1 for r in ratios.values())})
    if "adaptive" in table:
        ratios, inside = {}, []
        for size, row in table["adaptive"]["rows"].items():
            if "tokens_per_s" not in row:
                continue
            inside.append((size, row["fits"]))
            best = max((tps(s, size) for s in ("none", "recompute", "static")
                        if s in table and table[s]["rows"].get(size, {}).get("fits")),
                       default=None)
            if best:
                ratios[size] = row["tokens_per_s"] / best
        out.append({"name": "adaptive: >= 0.98x the best other setup that fits, at each size",
                    "detail": ", ".join(f"batch {s}: {r:.3f}x" for s, r in sorted(ratios.items())),
                    "met": bool(ratios) and all(r >= 0.98 for r in ratios.values())})
        out.append({"name": "adaptive: peak RSS within the budget (where a plan fits)",
                    "detail": ", ".join(f"batch {s}: {'yes' if ok else 'NO'}"
                                        for s, ok in sorted(inside)),
                    "met": all(ok for s, ok in inside
                               if (table["adaptive"]["rows"][s].get("plan") or {}).get("fits"))})
        errs = {}
        for size, row in table["adaptive"]["rows"].items():
            plan = row.get("plan")
            if plan and row.get("step_s"):
                errs[size] = plan["predicted_step_s"] / row["step_s"] - 1
        out.append({"name": "planner: predicted step time within 15% of measured",
                    "detail": ", ".join(f"batch {s}: {e:+.1%}" for s, e in sorted(errs.items())),
                    "met": bool(errs) and all(abs(e) <= 0.15 for e in errs.values())})
    return out


def render(table, targets, setups, sizes, budget, args_line):
    lines = [f"Budget: peak RSS <= {budget / MiB:.0f} MiB. Command: `{args_line}`", "",
             "| setup | " + " | ".join(f"batch {s}" for s in sizes) + " | largest fit |",
             "| --- | " + " | ".join("---:" for _ in sizes) + " | ---: |"]
    for setup in setups:
        cells = []
        for size in sizes:
            row = table[setup]["rows"].get(size)
            if row is None:
                cells.append("")
            elif "error" in row:
                cells.append(row["error"])
            else:
                mark = "" if row["fits"] else " (over)"
                cells.append(f"{row['tokens_per_s']:.0f} tok/s, {row['peak_rss'] / MiB:.0f} MiB"
                             + mark)
        fit = table[setup]["largest_fit"]
        lines.append(f"| {setup} | " + " | ".join(cells) + f" | {fit if fit else 'none'} |")
    if "adaptive" in table:
        lines += ["", "Adaptive plans (k = keep, o = offload, r = recompute, per block), "
                      "predicted vs measured step:", ""]
        for size in sizes:
            row = table["adaptive"]["rows"].get(size, {})
            plan = row.get("plan")
            if plan:
                lines.append(f"- batch {size}: `{''.join(c[0] for c in plan['choices'])}`, "
                             f"predicted {plan['predicted_step_s']:.3f} s, measured "
                             f"{row['step_s']:.3f} s, predicted peak activations "
                             f"{plan['predicted_peak_bytes'] / MiB:.0f} MiB"
                             + ("" if plan["fits"] else " (no plan fits)"))
    lines += ["", "Targets:", ""]
    for t in targets:
        lines.append(f"- {t['name']}: {t['detail']} -> {'met' if t['met'] else 'NOT met'}")
    return "\n".join(lines)


def plot(table, setups, sizes, budget, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for setup in setups:
        rows = table[setup]["rows"]
        xs = [s for s in sizes if "tokens_per_s" in rows.get(s, {})]
        ax1.plot(xs, [rows[s]["tokens_per_s"] for s in xs], marker="o", label=setup)
        ax2.plot(xs, [rows[s]["peak_rss"] / MiB for s in xs], marker="o", label=setup)
    ax2.axhline(budget / MiB, color="k", linestyle="--", linewidth=1, label="budget")
    for ax, ylabel in ((ax1, "tokens/s"), (ax2, "peak RSS (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes)
        ax.set_xticklabels([str(s) for s in sizes])
        ax.set_xlabel("micro-batch")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle("micro-batch sweep under a peak-RSS budget")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    args = build_parser().parse_args(argv)
    model = dict(TINY_MODEL if args.tiny else DEFAULT_MODEL)
    if args.model:
        model.update(json.loads(args.model))
    sizes = sorted(set([1, 2] if args.tiny and args.sizes == [4, 8, 16, 32] else args.sizes))
    budget_batch = 1 if args.tiny and args.budget_batch == 8 else args.budget_batch
    kib = 1 if args.tiny else args.min_tensor_kib
    offload = dict(keep_tail_bytes=int(args.keep_tail_mib * MiB) if not args.tiny else 0,
                   prefetch_bytes=int(args.prefetch_mib * MiB) if not args.tiny else 1 * MiB,
                   min_tensor_bytes=int(kib * 1024))
    os.makedirs(args.out, exist_ok=True)
    spill = args.spill_dir or tempfile.gettempdir()
    base = dict(model=model, spill_dir=spill, steps=args.steps, offload=offload,
                reserve=0 if args.tiny else int(args.reserve_mib * MiB))
    runs = []
    total = len(sizes) * len(args.setups) + (args.budget_mib is None)
    bar = _progress(total)
    t0 = time.perf_counter()
    if args.budget_mib is None:
        bar.set_description(f"budget: none at batch {budget_batch}")
        r = run_in_child(dict(base, setup="none", batch=budget_batch))
        bar.update()
        if "error" in r:
            raise SystemExit(f"microbatch_sweep: the budget run failed: {r['error']}\n"
                             f"{r.get('stderr', '')}")
        budget = r["peak_rss"]
        if budget_batch in sizes and "none" in args.setups:
            runs.append(r)
    else:
        budget = int(args.budget_mib * MiB)
    for k, size in enumerate(sizes):
        order = args.setups[k % len(args.setups):] + args.setups[:k % len(args.setups)]
        for setup in order:
            if any(r["setup"] == setup and r["batch"] == size for r in runs):
                continue
            bar.set_description(f"{setup} batch {size}")
            runs.append(run_in_child(dict(base, setup=setup, batch=size, rss_budget=budget)))
            bar.update()
    bar.close()
    table = summarize(runs, args.setups, sizes, budget)
    targets = check_targets(table, budget)
    args_line = "python examples/microbatch_sweep.py " + " ".join(
        sys.argv[1:] if argv is None else argv)
    md = render(table, targets, args.setups, sizes, budget, args_line)
    result = {"budget_rss": budget, "sizes": sizes, "setups": args.setups, "model": model,
              "offload": offload, "spill_dir": spill, "runs": runs, "summary": table,
              "targets": targets, "wall_s": time.perf_counter() - t0,
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}}
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(md + "\n")
    plot(table, args.setups, sizes, budget, os.path.join(args.out, "microbatch_sweep.png"))
    print(md)
    errors = [r for r in runs if "error" in r]
    for r in errors:
        print(f"\nrun {r['setup']} batch {r['batch']} failed: {r['error']}\n{r.get('stderr', '')}",
              file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
