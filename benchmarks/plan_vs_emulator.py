#!/usr/bin/env python
"""Plan before launch, checked: ``ssdtrain estimate --plan``'s predictions against the
accelerator emulator's measurements.

The emulator (``benchmarks/accel_emulator.py``, docs/accelerator_regime.md) runs a
GPT-shaped model whose layers save what ``examples/gpt.py``'s blocks save, with
emulated compute, against a real disk. This script gives the estimate the emulator's
numbers and compares, per target ratio R, the predicted step time and peak activation
memory of none, checkpoint-all, offload-all and the estimate's plan with what the
emulator measures running them:

* the model: the estimate builds ``examples/gpt.py``'s ``GPT`` at the emulator's shape
  (fp32, dropout 0) on the meta device; the two save the same bytes
  (``tests/test_accel_emulator.py`` checks the block, the script prints both totals);
* the disk: the emulator's probe (``ssdtrain`` writing one step's records, best of
  two) gives ``--ssd-write-gbps`` and ``--ssd-read-gbps``;
* the compute: ``--step-seconds`` = the emulated compute of a step at R (3 x forward
  FLOPs / the TFLOP/s the emulator solves for R) plus the step overhead the emulator
  calibrates at no compute (Python, autograd, fills and checks), which its emulated
  device spends on every step; the estimate splits it over the blocks by their FLOPs;
* ssdtrain's settings: ``keep_tail_bytes=0``, as the emulator's static modes run;
  the plan's budget: ``--budget-fraction`` of the predicted none peak.

Modes run (each a fresh emulator worker, ``--warmup`` then ``--steps`` steps):
``none``, ``checkpoint`` (``torch.utils.checkpoint``, no ssdtrain), ``rk<n>`` (ssdtrain
recomputing every layer: the estimate's checkpoint-all), ``offload_all``, and
``plan-<letters>``, the estimate's plan at each R through ``set_plan``.

Example::

    PYTHONPATH=. .venv/bin/python benchmarks/plan_vs_emulator.py            # R = 1 4
    PYTHONPATH=. .venv/bin/python benchmarks/plan_vs_emulator.py --tiny     # seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for _common, however run
import accel_emulator as emu  # noqa: E402
from _common import (MiB, command_line, finish, md_header, median, mount_of,  # noqa: E402
                     progress, run_worker, work_dir, worker_env)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_JSON = os.path.join(REPO_ROOT, "benchmarks", "results", "plan_vs_emulator.json")
TARGET = 0.15   # predicted step within 15% of measured


def gpt_factory(shape):
    """A factory for ``ssdtrain.estimate``: ``examples/gpt.py``'s GPT at the emulator's
    shape, with (ids, targets) as inputs."""
    examples = os.path.join(REPO_ROOT, "examples")
    if examples not in sys.path:
        sys.path.insert(0, examples)
    import torch
    from gpt import GPT, GPTConfig

    def make(batch=shape["batch"], seq=shape["seq"]):
        cfg = GPTConfig(vocab_size=shape["vocab"], seq_len=seq, d_model=shape["d_model"],
                        n_heads=shape["n_heads"], n_layers=shape["n_layers"],
                        mlp_ratio=shape["mlp_ratio"], dropout=0.0)
        ids = torch.randint(0, shape["vocab"], (batch, seq))
        return GPT(cfg), (ids, ids)
    return make


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ratios", type=float, nargs="+", default=[1.0, 4.0],
                   help="target compute:disk ratios R (default 1 4)")
    p.add_argument("--budget-fraction", type=float, default=0.3,
                   help="the plan's memory budget as a fraction of the predicted none peak "
                        "(default 0.3, the emulator's budget mode's)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--launch-us", type=float, default=10.0)
    p.add_argument("--threads", type=int, default=1)
    for k, v in emu.DEFAULT_SHAPE.items():
        p.add_argument("--" + k.replace("_", "-"), type=int, default=None,
                       help=f"model shape (default {v})")
    p.add_argument("--tiny", action="store_true", help="a tiny run (seconds), for the tests")
    p.add_argument("--spill-dir", default=None)
    p.add_argument("--json", default=None,
                   help="write every number here (default benchmarks/results/"
                        "plan_vs_emulator.json; with --report-only: only when given)")
    p.add_argument("--md", default=None, help="also write the report (markdown) here")
    p.add_argument("--report-only", metavar="JSON", default=None,
                   help="print the report of a saved run's JSON again (no runs)")
    p.add_argument("--from-emulator", metavar="JSON", default=None,
                   help="no runs: predict every static mode (and the budget mode's plan) of "
                        "an accel_emulator.py JSON with its numbers, beside its measurements")
    return p.parse_args(argv)


def _estimate(shape):
    """The estimate of the emulator's model (keep_tail_bytes 0, as the emulator's static
    modes run), and the emulator's own count of its offload bytes and FLOPs."""
    import ssdtrain
    from ssdtrain.estimate import estimate
    cfg = ssdtrain.OffloadConfig(keep_tail_bytes=0)
    est = estimate(gpt_factory(shape), batch=shape["batch"], seq=shape["seq"], dtype="float32",
                   config=cfg)
    return est, emu.spec_summary(shape, cfg.min_tensor_bytes)


def _at(est, step_seconds, bw):
    """``est`` with the emulator's numbers as its hardware."""
    from ssdtrain.estimate import Hardware
    return dataclasses.replace(est, hardware=Hardware(
        step_seconds=step_seconds, ssd_write_gbps=bw["write"], ssd_read_gbps=bw["read"]))


def _plan(est, step_seconds, bw, fraction):
    at = _at(est, step_seconds, bw)
    budget = int(fraction * at.plan().references["none"].peak_bytes)
    return at.plan(budget)


def main(argv=None):
    args = parse_args(argv)
    if args.report_only:
        with open(args.report_only) as f:
            return report(args, json.load(f))
    if args.from_emulator:
        return from_emulator(args, args.from_emulator)
    args.json = args.json or DEFAULT_JSON
    shape = dict(emu.TINY_SHAPE if args.tiny else emu.DEFAULT_SHAPE)
    for k in shape:
        if getattr(args, k) is not None:
            shape[k] = getattr(args, k)
    if args.tiny:
        args.steps, args.warmup = 1, 1
        if args.ratios == [1.0, 4.0]:
            args.ratios = [1.0]
    n = shape["n_layers"]
    est, spec = _estimate(shape)
    spill_dir, own = work_dir(args.spill_dir, "ssdtrain-plan-", "plan_vs_emulator",
                              "--spill-dir")
    env = worker_env(REPO_ROOT)
    script = os.path.abspath(emu.__file__)
    base_cfg = {"shape": shape, "spill_dir": spill_dir, "threads": args.threads,
                "check": "sparse", "launch_us": args.launch_us, "launch_fraction": None,
                "steps": args.steps, "warmup": args.warmup, "budget_bytes": None}
    static = ["none", "checkpoint", f"rk{n}", "offload_all"]
    update, write, close = progress(2 + (len(static) + len(args.ratios)) * args.repeats)
    failed, runs = [], []
    device, _, fstype = mount_of(spill_dir)
    try:
        bw = run_worker(script, "plan", "probe", 0, dict(base_cfg), env)
        update()
        if "error" in bw:
            raise SystemExit(f"plan_vs_emulator: the bandwidth probe failed:\n{bw['stderr']}")
        write(f"disk: write {bw['write']:.2f} GB/s, read {bw['read']:.2f} GB/s")
        cal = run_worker(script, "plan", "mode", 0, dict(base_cfg, mode="none", points=[
            {"r": None, "tflops": 1e9}]), env)
        update()
        if "error" in cal:
            raise SystemExit(f"plan_vs_emulator: the calibration run failed:\n{cal['stderr']}")
        overhead = emu.summarize(cal["points"][0])["step_s"]
        write(f"step overhead at no compute: {overhead * 1e3:.0f} ms")
        tflops, step_s, plans = {}, {}, {}
        for r in args.ratios:   # as accel_emulator.main solves it (NOTE [ The ratio R ])
            want = spec["offload_bytes"] / (bw["write"] * 1e9) / r
            compute = max(want - overhead, 0.2 * want)
            tflops[r] = 3 * spec["forward_flops"] / compute / 1e12
            step_s[r] = compute + overhead
            planned = _plan(est, step_s[r], bw, args.budget_fraction)
            plans[r] = "plan-" + "".join(c[0] for c in planned.plan.choices)
            write(f"R={r:g}: {step_s[r] * 1e3:.0f} ms per step predicted for none; plan "
                  f"{plans[r][5:]} within {planned.budget_bytes / MiB:.0f} MiB")
        # one fresh process per (mode, repeat), the order rotated each repeat
        one = [(m, args.ratios) for m in static] + [(plans[r], [r]) for r in args.ratios]
        jobs = [(rep, job) for rep in range(args.repeats)
                for job in one[rep % len(one):] + one[:rep % len(one)]]
        for rep, (mode, rs) in jobs:
            res = run_worker(script, "plan", "mode", rep, dict(base_cfg, mode=mode, points=[
                {"r": r, "tflops": tflops[r]} for r in rs]), env)
            update()
            if "error" in res:
                failed.append(mode)
                write(f"{mode} FAILED: {res['stderr'][-2000:]}")
                continue
            for point in res["points"]:
                point.update(mode=mode, summary=emu.summarize(point))
                runs.append(point)
            write(f"{mode}: " + ", ".join(f"R={p['r']:g} {p['summary']['step_s'] * 1e3:.0f} ms"
                                          for p in res["points"]))
    finally:
        close()
        if own:
            import shutil
            shutil.rmtree(spill_dir, ignore_errors=True)
    data = {"command": command_line(), "shape": shape, "ratios": args.ratios,
            "budget_fraction": args.budget_fraction, "bandwidth": bw, "overhead_s": overhead,
            "disk": f"{fstype or '?'} {device or '?'}",
            "tflops": {str(k): v for k, v in tflops.items()},
            "step_seconds": {str(k): v for k, v in step_s.items()},
            "plans": {str(k): v for k, v in plans.items()}, "runs": runs, "failed": failed}
    return report(args, data)


def _measured(runs, mode, r):
    ss = [x["summary"] for x in runs if x["mode"] == mode and x["r"] == r]
    if not ss:
        return None
    return {"step_s": median([s["step_s"] for s in ss]),
            "stall_s": median([s["stall_s"] for s in ss]),
            "peak_bytes": max(s["peak_bytes"] for s in ss),
            "exact": all(s["exact"] for s in ss), "repeats": len(ss)}


def report(args, data):
    """The table: predictions (recomputed from ``data``: the estimate is deterministic)
    beside the measurements; the target; JSON unless re-rendering (``--report-only``)."""
    from ssdtrain.estimate import predict_choices
    shape, bw, runs = data["shape"], data["bandwidth"], data["runs"]
    n = shape["n_layers"]
    est, spec = _estimate(shape)
    lines = []
    say = lines.append
    say(f"Emulated GPT: {n} layers, batch {shape['batch']}, seq {shape['seq']}, d_model "
        f"{shape['d_model']}, vocab {shape['vocab']}, fp32. Offloaded per step: emulator "
        f"{spec['offload_bytes'] / MiB:.1f} MiB, estimate {est.unique_bytes / MiB:.1f} MiB "
        f"unique (keep_tail_bytes 0).")
    say(f"Disk (spill_dir on {data['disk']}): write {bw['write']:.2f} GB/s, read "
        f"{bw['read']:.2f} GB/s (the emulator's probe). Step overhead at no compute "
        f"{data['overhead_s'] * 1e3:.0f} ms, in --step-seconds.")
    say("")
    say("predicted: `--step-seconds` = the emulator's compute at R + its overhead; "
        "`none-cal.`: the same model with `--step-seconds` = none's measured step at that R "
        "(the device's speed measured without offload; a diagnostic, not the target).")
    say("")
    say(md_header(["R>", "TFLOP/s>", "--step-seconds>", "mode", "blocks",
                   "predicted step (ms)>", "measured step (ms)>", "error>", "none-cal. (ms)>",
                   "error>", "predicted stall (ms)>", "measured stall (ms)>",
                   "predicted peak (MiB)>", "measured peak (MiB)>", "budget (MiB)>", "exact"]))
    rows = []
    for r in data["ratios"]:
        step_s = data["step_seconds"][str(r)]
        planned = _plan(est, step_s, bw, data["budget_fraction"])
        plan_mode = data["plans"][str(r)]
        assert plan_mode[5:] == "".join(c[0] for c in planned.plan.choices), plan_mode
        none_meas = _measured(runs, "none", r)
        cal = _at(est, none_meas["step_s"], bw) if none_meas else None
        refs = planned.references
        pairs = [("none", refs["none"], "keep"), ("checkpoint", refs["checkpoint_all"],
                                                   "recompute"),
                 (f"rk{n}", refs["checkpoint_all"], "recompute"),
                 ("offload_all", refs["offload_all"], "offload"),
                 (plan_mode, planned.plan.prediction, None)]
        for mode, pred, uniform in pairs:
            choices = planned.plan.choices if uniform is None else (uniform,) * n
            blocks = "".join(c[0] for c in choices).upper()
            meas = _measured(runs, mode, r)
            alt = predict_choices(cal, choices) if cal is not None else None
            if alt is not None and mode == "none":
                alt = cal.plan().references["none"]
            row = {"r": r, "mode": mode, "blocks": blocks, "predicted_step_s": pred.step_s,
                   "predicted_stall_s": pred.stall_s, "predicted_peak_bytes": pred.peak_bytes,
                   "is_plan": uniform is None,
                   "none_calibrated_step_s": None if alt is None else alt.step_s}
            m = meas or {}
            if meas is not None:
                row.update(measured_step_s=meas["step_s"], measured_stall_s=meas["stall_s"],
                           measured_peak_bytes=meas["peak_bytes"], exact=meas["exact"],
                           repeats=meas["repeats"], error=pred.step_s / meas["step_s"] - 1)
                if alt is not None:
                    row["none_calibrated_error"] = alt.step_s / meas["step_s"] - 1
            rows.append(row)
            say(f"| {r:g} | {data['tflops'][str(r)]:.3g} | {step_s:.3f} | "
                f"{'**plan**' if row['is_plan'] else mode} | {blocks} | {pred.step_s * 1e3:.0f} | "
                + (f"{m['step_s'] * 1e3:.0f} | {row['error'] * 100:+.0f}% | " if m else
                   "FAILED | | ")
                + (f"{alt.step_s * 1e3:.0f} | {row['none_calibrated_error'] * 100:+.0f}% | "
                   if m and alt is not None else " | | ")
                + f"{pred.stall_s * 1e3:.0f} | "
                + (f"{m['stall_s'] * 1e3:.0f} | " if m else " | ")
                + f"{pred.peak_bytes / MiB:.1f} | "
                + (f"{m['peak_bytes'] / MiB:.1f} | " if m else " | ")
                + (f"{planned.budget_bytes / MiB:.0f} | " if row["is_plan"] else " | ")
                + ("" if not m else "yes |" if m["exact"] else "NO |"))
    say("")
    say("`checkpoint` is torch.utils.checkpoint without ssdtrain; `rk<n>` is ssdtrain "
        "recomputing every block (its inputs offloaded), which is what the estimate's "
        "checkpoint-all predicts. Measured: the median over repeats of each run's median "
        "step; peak: the largest.")
    say("")
    say(f"Target: the plan's predicted step within {TARGET:.0%} of measured:")
    for row in rows:
        if row["is_plan"] and "error" in row:
            met = abs(row["error"]) <= TARGET
            budget = _plan(est, data["step_seconds"][str(row["r"])], bw,
                           data["budget_fraction"]).budget_bytes
            say(f"- R={row['r']:g} {row['blocks']}: {row['error'] * 100:+.0f}% -> "
                f"{'met' if met else 'NOT met'}")
            fits = row["measured_peak_bytes"] <= budget
            say(f"- R={row['r']:g} measured peak {row['measured_peak_bytes'] / MiB:.1f} MiB "
                f"within the plan's budget {budget / MiB:.0f} MiB -> "
                f"{'met' if fits else 'NOT met'}")
    say("")
    say(f"Command: {data['command']}")
    text = "\n".join(lines)
    print(text)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text + "\n")
    if not args.json:
        return 0
    return finish("plan_vs_emulator", args.json, dict(data, spec=spec, rows=rows),
                  data["failed"])


def choices_of(mode, plan, n):
    """The per-block choices an accel_emulator mode runs (None: not a static plan)."""
    if mode in ("none",):
        return ("keep",) * n
    if mode in ("checkpoint", "default", "offload_all"):
        return (("recompute",) if mode == "checkpoint" else ("offload",)) * n
    if mode == "budget":   # the adaptive policy's plan in force (k / o / r per layer)
        return tuple(emu.PLAN_LETTERS[c] for c in plan) if plan else None
    if mode.startswith("plan-") or mode[:2] in ("ok", "rk", "ro"):
        return tuple(emu.plan_for(mode, n))
    return None


def from_emulator(args, path):
    """Predict each (mode, R) of an accel_emulator.py run with the numbers it measured
    (its probe's bandwidth, its TFLOP/s per R and step overhead: ``--step-seconds`` as
    in :func:`main`) and print them beside what it measured. ``default`` is predicted
    as offload-all with ssdtrain's default 128 MiB tail, ``checkpoint`` as ssdtrain's
    recompute-all, ``budget`` as a static run of the plan the adaptive policy chose
    (its own prediction, from its profile, is shown beside)."""
    import ssdtrain
    from ssdtrain.estimate import predict_choices
    with open(path) as f:
        d = json.load(f)
    shape, n = d["shape"], d["shape"]["n_layers"]
    est, spec = _estimate(shape)
    bw = {"write": d["bandwidth_start"]["write"], "read": d["bandwidth_start"]["read"]}
    lines = []
    say = lines.append
    say(f"Predicted by the estimate from {os.path.relpath(path, REPO_ROOT)}'s numbers: disk "
        f"{bw['write']:.2f} GB/s write, {bw['read']:.2f} GB/s read; step overhead "
        f"{d['overhead_s'] * 1e3:.0f} ms; --step-seconds = 3 x forward FLOPs / TFLOP/s + "
        f"overhead. Measured: that run's table (one repeat).")
    say("")
    say(md_header(["R>", "--step-seconds>", "mode", "blocks", "predicted step (ms)>",
                   "measured step (ms)>", "error>", "adaptive's own prediction (ms)>",
                   "predicted peak (MiB)>", "measured peak (MiB)>"]))
    rows = []
    for row in d["summary"]:
        choices = choices_of(row["mode"], row.get("plan"), n)
        if choices is None:
            continue
        r = row["r"]
        step_s = 3 * spec["forward_flops"] / (d["tflops"][f"{r:g}"] * 1e12) + d["overhead_s"]
        at = _at(est, step_s, bw)
        if row["mode"] == "default":
            at = dataclasses.replace(at, config=ssdtrain.OffloadConfig())
        pred = predict_choices(at, choices)
        err = pred.step_s / row["step_s"] - 1
        own = row.get("predicted_step_s")
        rows.append({"r": r, "mode": row["mode"], "blocks": "".join(c[0] for c in choices),
                     "step_seconds": step_s, "predicted_step_s": pred.step_s,
                     "measured_step_s": row["step_s"], "error": err,
                     "adaptive_predicted_step_s": own, "predicted_peak_bytes": pred.peak_bytes,
                     "measured_peak_bytes": row["peak_bytes"]})
        say(f"| {r:g} | {step_s:.3f} | {row['mode']} | {rows[-1]['blocks'].upper()} | "
            f"{pred.step_s * 1e3:.0f} | {row['step_s'] * 1e3:.0f} | {err * 100:+.0f}% | "
            + (f"{own * 1e3:.0f}" if own else "") + f" | {pred.peak_bytes / MiB:.1f} | "
            f"{row['peak_bytes'] / MiB:.1f} |")
    say("")
    within = [x for x in rows if abs(x["error"]) <= TARGET]
    say(f"Within {TARGET:.0%}: {len(within)} of {len(rows)} (mode, R) rows: "
        + ", ".join(f"{x['mode']} R={x['r']:g}" for x in within) + ".")
    say("")
    say(f"Command: {command_line()}")
    text = "\n".join(lines)
    print(text)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text + "\n")
    if args.json:
        return finish("plan_vs_emulator", args.json, {"command": command_line(),
                                                       "source": path, "rows": rows}, [])
    return 0


if __name__ == "__main__":
    sys.exit(main())
