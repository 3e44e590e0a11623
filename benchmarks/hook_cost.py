#!/usr/bin/env python
"""What ssdtrain costs the training thread: pack and unpack time per saved tensor.

Two measurements, in one run:

1. **Per record size** (``--sizes``, default 1 KiB .. 64 MiB) and per configuration
   (``--configs``: ``native-uring``, ``native-threads``, ``posix``, each with
   ``verify`` on and off; ``identity`` is a pair of hooks that return their argument,
   the floor of timing a hook at all): an op loop in which each op
   (``torch.autograd.Function``) saves one new tensor of that size, then backward
   unpacks them in reverse order. Pack is timed in forward; unpack is timed twice,
   in two separate passes of the same loop:

   * ``prefetched``: ``prefetch_bytes`` holds every record of the step, and the
     untimed ``Offloader.wait()`` between forward and backward lets every write and
     prefetch read end: backward finds each record in memory (a prefetch hit);
   * ``on-demand``: ``prefetch_bytes=0``: after the same wait every record is on
     disk, and each unpack reads its record and waits for it (a miss).

   ``keep_tail_bytes=0``, so every record at or above ``min_tensor_bytes`` is written
   as soon as it is saved (its "fate" is ``written``; the store's I/O thread starts
   the write right after the pack); smaller ones are kept in
   memory (``kept``), as ssdtrain does by default with records below 256 KiB. A step
   holds at most ``--step-mib`` of records (and at most 256 of them); steps repeat
   until ``--budget-mib`` of records (at least ``--min-iters``, at most
   ``--max-iters`` records) were packed per (size, configuration, pass), so big sizes
   get fewer samples. Configurations are interleaved within each size, and each
   (size, configuration) runs in ``--rounds`` rounds, so drifts of the machine hit
   all alike. Between ops the loop fills the next tensor (a torch op that releases
   the GIL, as compute between saves does).

2. **Per training step of the GPT of ``step_overhead.py``** (its default shape, or
   its tiny one with ``--tiny``), for the native and posix engines with ssdtrain's
   defaults: the training thread's time inside ssdtrain per step, i.e. entering and
   leaving ``with offloader:`` plus every pack and unpack call, in ms per step and
   as a share of the step's wall time (1 warm-up step, then ``--gpt-steps``).

What exactly is timed: the saved-tensor hooks *as autograd calls them*.
``ssdtrain.tools.HookTimer`` looks up the innermost pack/unpack pair in force inside
``with offloader:`` (the offloader's own hooks, whatever they do) and pushes a pair
that calls them between two ``time.perf_counter_ns`` readings; autograd then calls
the timed pair for every tensor it saves and unpacks. Work ssdtrain does on its I/O
threads (writes, reads, CRC32C, completion callbacks) is not counted, except where
it makes a hook wait (for the GIL, the store's lock, or a read). Not counted either:
the end-of-backward callback ssdtrain queues on autograd's engine (it settles
releases; it runs on the training thread after the last unpack).

Output: a markdown table per part on stdout (microseconds: median and 99th
percentile per call), the targets (reported, never asserted), and a JSON
file with every number (``--json``). Progress goes to stderr.

Example::

    .venv/bin/python benchmarks/hook_cost.py                        # ~4 min here
    .venv/bin/python benchmarks/hook_cost.py --tiny                 # seconds (the tests)
    .venv/bin/python benchmarks/hook_cost.py --sizes 4MiB --configs native-threads --no-gpt
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import platform
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for _common, however run
from _common import (command_line, finish, md_table, median, mount_of, progress,  # noqa: E402
                     work_dir)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_JSON = os.path.join(REPO_ROOT, "benchmarks", "results", "hook_cost.json")
KiB, MiB = 1 << 10, 1 << 20
SIZES = (1 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB)
TINY_SIZES = (1 * KiB, 64 * KiB, 256 * KiB, 1 * MiB)
CONFIGS = ("identity", "native-uring", "native-threads", "posix")
PASSES = ("prefetched", "on-demand")
MAX_RECORDS_PER_STEP = 256

# Targets (reported, never asserted).
TARGET_PACK_US = 15.0
TARGET_UNPACK_PREFETCHED_US = 15.0
TARGET_STEP_SHARE = 0.01


def parse_size(text):
    """``"64KiB"``, ``"4MiB"``, ``"1024"`` -> bytes (argparse type)."""
    units = {"": 1, "b": 1, "k": KiB, "kib": KiB, "m": MiB, "mib": MiB, "g": 1 << 30,
             "gib": 1 << 30}
    s = str(text).strip().lower()
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    if not num or s[len(num):] not in units:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 64KiB, 4MiB, 1048576)")
    return int(float(num) * units[s[len(num):]])


def size_text(n):
    for unit, scale in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def percentile(xs, q):
    """The ``q``-th percentile of ``xs`` (nearest rank); NaN when empty."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))]


def describe(ns):
    """``{n, median_us, p99_us, max_us, total_ms}`` of durations in nanoseconds."""
    us = [x / 1000 for x in ns]
    return {"n": len(us), "median_us": median(us), "p99_us": percentile(us, 99),
            "max_us": max(us) if us else float("nan"), "total_ms": sum(us) / 1000}


# --------------------------------------------------------------------- configurations
def engine_config(name):
    """``(OffloadConfig.engine, native back end or None)`` of a configuration name."""
    if name == "posix":
        return "posix", None
    if name.startswith("native-"):
        return "native", name.split("-", 1)[1]
    raise ValueError(name)


def available_configs(requested):
    """``(configs to run, {skipped: reason})``."""
    from ssdtrain.io import native
    run, skipped = [], {}
    for c in requested:
        if c.startswith("native-") and not native.available():
            skipped[c] = native.unavailable_reason()
        elif c == "native-uring":
            from ssdtrain import tools
            ok, why = tools.uring_probe()
            if ok:
                run.append(c)
            else:
                skipped[c] = f"io_uring unusable here: {why}"
        else:
            run.append(c)
    return run, skipped


def make_offloader(spill_dir, config, verify, prefetch_bytes, min_tensor_bytes):
    """An Offloader for one configuration (the native back end swapped in as asked)."""
    import ssdtrain
    from ssdtrain.io.native import NativeEngine
    engine, backend = engine_config(config)
    off = ssdtrain.Offloader(spill_dir=spill_dir, engine=engine, verify=verify,
                             policy="static", keep_tail_bytes=0, prefetch_bytes=prefetch_bytes,
                             min_tensor_bytes=min_tensor_bytes)
    if backend is not None:
        cfg = off.config

        def swap(old):
            new = NativeEngine(io_threads=cfg.io_threads, chunk_bytes=cfg.io_chunk_bytes,
                               backend=backend)
            old.shutdown()  # nothing is in flight yet
            return new

        off.wrap_engine(swap)
    return off


class _Saved:
    """The op of the loop: saves ``x`` for backward (its one saved tensor)."""

    @staticmethod
    def function():
        import torch

        class Save(torch.autograd.Function):
            @staticmethod
            def forward(ctx, a, x):
                ctx.save_for_backward(x)
                return a.clone()

            @staticmethod
            def backward(ctx, grad):
                (x,) = ctx.saved_tensors
                ctx.first = float(x.view(-1)[0])  # the bytes came back (checked below)
                return grad, None

        return Save


def run_records(spill_dir, size, config, verify, unpack_pass, count, step_bytes,
                min_tensor_bytes, fill_value, compute="cpu"):
    """Pack ``count`` records of ``size`` bytes (in steps) and unpack them; the timings.

    ``compute``: ``"cpu"`` fills each tensor just before it is saved (compute on the
    host streams the saved bytes through the CPU's caches, as CPU training does);
    ``"accelerator"`` fills them all before the timed loop, saves every record of the
    run in one step, and runs a 4 KiB fill between saves (a kernel launch's worth of
    host work: on an accelerator the saved bytes never pass through the host's
    caches)."""
    import torch
    from ssdtrain import tools
    Save = _Saved.function()
    # With an accelerator's compute every record of the run is saved in one step (up to
    # MAX_RECORDS_PER_STEP), so that only the first pack follows the untimed fills.
    per_step = max(1, min(MAX_RECORDS_PER_STEP, count,
                          count if compute == "accelerator" else step_bytes // size))
    elements = max(1, size // 4)  # float32
    timer = tools.HookTimer()
    a = torch.ones((), requires_grad=True)
    off = None
    if config != "identity":
        off = make_offloader(spill_dir, config, verify,
                             prefetch_bytes=(max(size * per_step, 1) + 64 * KiB
                                             if unpack_pass == "prefetched" else 0),
                             min_tensor_bytes=min_tensor_bytes)
    stats0 = off.stats() if off is not None else None
    wrong = 0
    try:
        done = 0
        while done < count:
            k = min(per_step, count - done)
            xs = [torch.empty(elements) for _ in range(k)]
            tick = None
            if compute == "accelerator":
                for i, x in enumerate(xs):
                    x.fill_(fill_value + done + i)
                tick = torch.empty(1024)
            if off is not None:
                off.__enter__()
            try:
                if off is None:  # identity: the cost of a Python hook pair, timed alike
                    ident = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
                    ident.__enter__()
                else:
                    ident = None
                try:
                    with timer.wrap():
                        outs = []
                        for i, x in enumerate(xs):
                            if tick is None:
                                x.fill_(fill_value + done + i)  # compute between saves
                            else:
                                tick.fill_(i)
                            outs.append(Save.apply(a, x))
                finally:
                    if ident is not None:
                        ident.__exit__(None, None, None)
            finally:
                if off is not None:
                    off.__exit__(None, None, None)
            del xs
            loss = torch.stack(outs).sum()
            if off is not None:
                off.wait()  # untimed: writes (and prefetch reads) end before backward
            nodes = [o.grad_fn for o in outs]
            del outs
            loss.backward()
            wrong += sum(n.first != fill_value + done + i for i, n in enumerate(nodes))
            del loss, nodes
            done += k
        if off is not None:
            off.wait()
            st = off.stats()
            stats = {f: getattr(st, f) - getattr(stats0, f) for f in
                     ("records_written", "offloaded_bytes", "bytes_read", "prefetch_hits",
                      "prefetch_misses", "forwarded", "kept_bytes", "stall_seconds")}
            engine = st.engine
        else:
            stats, engine = {}, "identity hooks"
    finally:
        if off is not None:
            off.close()
    if wrong:
        raise RuntimeError(f"hook_cost: {wrong} unpacked tensors had wrong contents "
                           f"({config}, {size_text(size)})")
    fate = "hooks only" if off is None else \
        ("written" if stats["records_written"] else "kept")
    return {"pack_ns": timer.pack_ns, "unpack_ns": timer.unpack_ns, "stats": stats,
            "engine": engine, "fate": fate, "records_per_step": per_step}


def count_for(size, args):
    return int(min(args.max_iters, max(args.min_iters, (args.budget_mib * MiB) // size)))


def measure_records(args, spill_dir, configs, update, write):
    """Part 1: ``{(size, config, verify): result}`` and the list for the JSON."""
    verifies = [v == "on" for v in args.verify]
    rows = []
    for size in args.sizes:
        count = count_for(size, args)
        keys = [(c, v) for c in configs for v in (verifies if c != "identity" else [False])]
        acc = {key: {"pack_ns": [], "unpack_ns": {p: [] for p in PASSES}, "stats": {},
                     "fate": None, "engine": None} for key in keys}
        for rnd in range(args.rounds):
            n = count // args.rounds + (rnd < count % args.rounds)
            if n == 0:
                continue
            order = keys[rnd % len(keys):] + keys[:rnd % len(keys)]
            for config, verify in order:
                for unpack_pass in PASSES:
                    if config == "identity" and unpack_pass == "on-demand":
                        continue
                    r = run_records(spill_dir, size, config, verify, unpack_pass, n,
                                    int(args.step_mib * MiB), args.min_tensor_bytes,
                                    fill_value=1 + rnd * 1000003, compute=args.compute)
                    a = acc[(config, verify)]
                    a["pack_ns"] += r["pack_ns"]
                    a["unpack_ns"][unpack_pass] += r["unpack_ns"]
                    a["fate"], a["engine"] = r["fate"], r["engine"]
                    for k, v in r["stats"].items():
                        a["stats"].setdefault(unpack_pass, {}).setdefault(k, 0)
                        a["stats"][unpack_pass][k] += v
                    gc.collect()
                update(1)
        for (config, verify), a in acc.items():
            row = {"size": size, "size_text": size_text(size), "config": config,
                   "verify": verify, "engine": a["engine"], "fate": a["fate"],
                   "pack": describe(a["pack_ns"]),
                   "unpack": {p: describe(a["unpack_ns"][p]) for p in PASSES
                              if a["unpack_ns"][p]},
                   "stats": a["stats"]}
            rows.append(row)
            pk = row["pack"]
            write(f"{size_text(size):>7} {config:<14} verify {'on ' if verify else 'off'} "
                  f"pack {pk['median_us']:.1f}/{pk['p99_us']:.1f} us, unpack "
                  + ", ".join(f"{p} {u['median_us']:.1f}/{u['p99_us']:.1f} us"
                              for p, u in row["unpack"].items()))
    return rows


def render_records(rows):
    def cell(u, key):
        return f"{u[key]:.1f}" if u else "-"

    out = []
    for r in rows:
        pre, dem = r["unpack"].get("prefetched"), r["unpack"].get("on-demand")
        verify = "-" if r["config"] == "identity" else ("on" if r["verify"] else "off")
        out.append([r["size_text"], r["config"], verify, r["fate"],
                    f"{r['pack']['median_us']:.1f}", f"{r['pack']['p99_us']:.1f}",
                    cell(pre, "median_us"), cell(pre, "p99_us"), cell(dem, "median_us"),
                    cell(dem, "p99_us"), r["pack"]["n"]])
    return md_table(["size>", "config", "verify", "fate", "pack median (µs)>", "pack p99 (µs)>",
                     "unpack prefetched median (µs)>", "p99 (µs)>",
                     "unpack on-demand median (µs)>", "p99 (µs)>", "records>"], out)


# -------------------------------------------------------------------------- the GPT part
def measure_gpt(args, spill_dir, write):
    """Part 2: the training thread's time inside ssdtrain per step of the GPT."""
    import torch
    sys.path.insert(0, os.path.join(REPO_ROOT, "examples"))
    from gpt import GPT, GPTConfig, make_batch  # noqa: E402
    from step_overhead import DEFAULT_MODEL, TINY_MODEL, TINY_OFFLOAD  # noqa: E402
    import ssdtrain
    from ssdtrain import tools

    shape = TINY_MODEL if args.tiny else DEFAULT_MODEL
    model_cfg = GPTConfig(vocab_size=shape["vocab"], seq_len=shape["seq_len"],
                          d_model=shape["d_model"], n_heads=shape["n_heads"],
                          n_layers=shape["n_layers"])
    torch.manual_seed(0)
    model = GPT(model_cfg)
    idx, targets = make_batch(model_cfg, shape["batch_size"], torch.Generator().manual_seed(1))
    overrides = {}
    if args.tiny:  # as step_overhead.py --tiny: the tiny model's tensors are ~32 KiB
        overrides = dict(min_tensor_bytes=TINY_OFFLOAD["min_tensor_kib"] * KiB,
                         keep_tail_bytes=TINY_OFFLOAD["keep_tail_mib"] * MiB)
    runs = []
    offloaders = {}
    try:
        for engine in args.gpt_engines:
            if engine == "none":
                offloaders[engine] = None
            else:
                offloaders[engine] = ssdtrain.Offloader(spill_dir=spill_dir, engine=engine,
                                                        **dict(dict(policy="static"),
                                                               **overrides))
            runs.append({"engine": engine, "label": engine if engine == "none" else
                         offloaders[engine].stats().engine, "steps": []})
        timer = tools.HookTimer()
        for step in range(1 + args.gpt_steps):  # engines interleaved step by step
            for run in runs:
                off = offloaders[run["engine"]]
                model.zero_grad(set_to_none=True)
                gc.collect()
                timer.clear()
                t0 = time.perf_counter()
                if off is not None:
                    off.__enter__()
                t1 = time.perf_counter()
                try:
                    if off is not None:
                        with timer.wrap():
                            loss = model(idx, targets)
                    else:
                        loss = model(idx, targets)
                finally:
                    t2 = time.perf_counter()
                    if off is not None:
                        off.__exit__(None, None, None)
                t3 = time.perf_counter()
                loss.backward()
                t4 = time.perf_counter()
                del loss
                rec = {"step": step, "warmup": step == 0, "step_s": t4 - t0,
                       "enter_s": t1 - t0, "exit_s": t3 - t2,
                       "pack_s": sum(timer.pack_ns) / 1e9, "unpack_s": sum(timer.unpack_ns) / 1e9,
                       "packs": len(timer.pack_ns), "unpacks": len(timer.unpack_ns),
                       "pack_median_us": describe(timer.pack_ns)["median_us"],
                       "unpack_median_us": describe(timer.unpack_ns)["median_us"],
                       "packed_bytes": sum(timer.pack_bytes)}
                rec["inside_s"] = rec["enter_s"] + rec["exit_s"] + rec["pack_s"] + rec["unpack_s"]
                rec["inside_share"] = rec["inside_s"] / rec["step_s"]
                run["steps"].append(rec)
                write(f"GPT step {step} {run['label']:<28} {rec['step_s']:.3f} s, inside ssdtrain "
                      f"{rec['inside_s'] * 1e3:.1f} ms ({rec['inside_share']:.2%})")
                if off is not None:
                    off.wait()  # untimed: the next engine's step starts with no I/O in flight
        for run in runs:
            off = offloaders[run["engine"]]
            if off is not None:
                run["final_stats"] = {k: v for k, v in vars(off.stats()).items()
                                      if isinstance(v, (int, float, str))}
    finally:
        for off in offloaders.values():
            if off is not None:
                off.close()
    for run in runs:
        st = [s for s in run["steps"] if not s["warmup"]]
        run["summary"] = {k + "_median": median([s[k] for s in st]) for k in
                          ("step_s", "inside_s", "inside_share", "pack_s", "unpack_s",
                           "enter_s", "exit_s", "pack_median_us", "unpack_median_us")}
        run["summary"]["packs_per_step"] = median([s["packs"] for s in st])
        run["summary"]["unpacks_per_step"] = median([s["unpacks"] for s in st])
    return {"model": shape, "offload_overrides": overrides, "steps": args.gpt_steps,
            "runs": runs}


def render_gpt(gpt):
    ref = next((r for r in gpt["runs"] if r["engine"] == "none"), None)
    rows = []
    for r in gpt["runs"]:
        s = r["summary"]
        ratio = f"{s['step_s_median'] / ref['summary']['step_s_median']:.3f}" if ref else "-"
        if r["engine"] == "none":
            rows.append(["none", f"{s['step_s_median']:.3f}", "1.000"] + ["-"] * 8)
            continue
        rows.append([r["label"], f"{s['step_s_median']:.3f}", ratio,
                     f"{s['inside_s_median'] * 1e3:.1f}", f"{s['inside_share_median']:.2%}",
                     f"{s['pack_s_median'] * 1e3:.1f}", f"{s['unpack_s_median'] * 1e3:.1f}",
                     f"{(s['enter_s_median'] + s['exit_s_median']) * 1e3:.1f}",
                     f"{s['packs_per_step']:.0f}", f"{s['pack_median_us_median']:.1f}",
                     f"{s['unpack_median_us_median']:.1f}"])
    return md_table(["engine", "step (s)>", "ratio to none>", "inside ssdtrain (ms/step)>",
                     "% of step>", "pack (ms/step)>", "unpack (ms/step)>",
                     "enter+exit (ms/step)>", "packs/step>", "pack median (µs)>",
                     "unpack median (µs)>"], rows)


def check_targets(rows, gpt, compute="cpu"):
    """(name, value text, met) triples for the targets."""
    out = []
    measured = [r for r in rows if r["config"] != "identity" and r["verify"]]
    if measured:
        worst = max(measured, key=lambda r: r["pack"]["median_us"])
        out.append((f"pack <= {TARGET_PACK_US:g} µs median, every size, verify on "
                    f"(compute between saves: {compute})",
                    f"worst {worst['pack']['median_us']:.1f} µs ({worst['size_text']}, "
                    f"{worst['config']})", worst["pack"]["median_us"] <= TARGET_PACK_US))
        pre = [r for r in measured if "prefetched" in r["unpack"]]
        if pre:
            worst = max(pre, key=lambda r: r["unpack"]["prefetched"]["median_us"])
            v = worst["unpack"]["prefetched"]["median_us"]
            out.append((f"unpack of a prefetched record <= {TARGET_UNPACK_PREFETCHED_US:g} µs "
                        f"median, every size, verify on",
                        f"worst {v:.1f} µs ({worst['size_text']}, {worst['config']})",
                        v <= TARGET_UNPACK_PREFETCHED_US))
    if gpt:
        for r in gpt["runs"]:
            if r["engine"] == "none":
                continue
            v = r["summary"]["inside_share_median"]
            out.append((f"training-thread time inside ssdtrain <= {TARGET_STEP_SHARE:.0%} of "
                        f"step ({r['label']})",
                        f"{v:.2%} ({r['summary']['inside_s_median'] * 1e3:.1f} ms of "
                        f"{r['summary']['step_s_median']:.2f} s)", v <= TARGET_STEP_SHARE))
    return out


def build_parser():
    p = argparse.ArgumentParser(
        description="Training-thread time of ssdtrain's saved-tensor hooks: per record size, "
                    "engine and verify setting, and per step of the step_overhead GPT.")
    p.add_argument("--sizes", nargs="+", type=parse_size,
                   help="record sizes (default 1KiB 64KiB 256KiB 1MiB 4MiB 16MiB 64MiB)")
    p.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS),
                   help="default all (a native back end that cannot run here is skipped)")
    p.add_argument("--verify", nargs="+", choices=("on", "off"), default=["on", "off"],
                   help="OffloadConfig.verify settings to run (default on off)")
    p.add_argument("--budget-mib", type=float, default=256,
                   help="bytes of records per (size, config, pass), in MiB (default 256)")
    p.add_argument("--min-iters", type=int, default=8,
                   help="at least this many records per (size, config, pass) (default 8)")
    p.add_argument("--max-iters", type=int, default=1000,
                   help="at most this many records per (size, config, pass) (default 1000)")
    p.add_argument("--step-mib", type=float, default=64,
                   help="records held by one step, in MiB (default 64; at most 256 records)")
    p.add_argument("--rounds", type=int, default=2,
                   help="rounds per size, configurations interleaved in each (default 2)")
    p.add_argument("--min-tensor-kib", type=float,
                   help="OffloadConfig.min_tensor_bytes in KiB (default ssdtrain's, 256)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads (default: torch's default)")
    p.add_argument("--compute", choices=("cpu", "accelerator"), default="cpu",
                   help="what runs between saves in the per-size part: 'cpu' (default) fills "
                        "the tensor about to be saved (its bytes pass through the CPU's caches "
                        "just before pack, as in CPU training); 'accelerator' fills every "
                        "tensor before the timed loop and a 4 KiB tensor between saves (on a "
                        "GPU the saved bytes never pass through the host's caches)")
    p.add_argument("--no-gpt", action="store_true", help="skip the GPT step part")
    p.add_argument("--gpt-steps", type=int, default=3,
                   help="measured GPT steps per engine after 1 warm-up step (default 3)")
    p.add_argument("--gpt-engines", nargs="+", default=["none", "native", "posix"],
                   choices=("none", "native", "posix"),
                   help="GPT runs, interleaved step by step (default none native posix)")
    p.add_argument("--tiny", action="store_true",
                   help=f"for the test suite: sizes {' '.join(size_text(s) for s in TINY_SIZES)}, "
                        f"budget 1 MiB, 1 round, max 16 records, the tiny GPT for 1 step")
    p.add_argument("--spill-dir",
                   help="directory for the spill files (default: a fresh directory under the "
                        "system temp dir, removed at the end)")
    p.add_argument("--json", default=DEFAULT_JSON,
                   help="where to write every number (default benchmarks/results/hook_cost.json)")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.tiny:
        args.sizes = args.sizes or list(TINY_SIZES)
        args.budget_mib, args.rounds, args.max_iters = 1, 1, min(args.max_iters, 16)
        args.min_iters = min(args.min_iters, 2)
        args.gpt_steps = min(args.gpt_steps, 1)
    args.sizes = args.sizes or list(SIZES)
    if args.rounds < 1 or args.gpt_steps < 1 or args.min_iters < 1:
        raise SystemExit("hook_cost: --rounds, --gpt-steps and --min-iters must be >= 1")
    import torch
    import ssdtrain
    if args.threads:
        torch.set_num_threads(args.threads)
    args.min_tensor_bytes = (int(args.min_tensor_kib * KiB) if args.min_tensor_kib is not None
                             else ssdtrain.OffloadConfig().min_tensor_bytes)
    configs, skipped = available_configs(args.configs)
    spill_dir, own = work_dir(args.spill_dir, "ssdtrain-hooks-", "hook_cost", "--spill-dir")
    command = command_line()
    device, mount, fstype = mount_of(spill_dir)
    machine = {"cpu_count": os.cpu_count(), "python": platform.python_version(),
               "platform": platform.platform(), "torch": torch.__version__,
               "torch_threads": torch.get_num_threads(), "spill_dir": spill_dir,
               "spill_fs": fstype, "spill_device": device, "loadavg_start": os.getloadavg()}
    update, write, close = progress(len(args.sizes) * args.rounds, use_tqdm=False)
    gpt = None
    try:
        rows = measure_records(args, spill_dir, configs, update, write)
        if not args.no_gpt:
            gpt = measure_gpt(args, spill_dir, write)
    finally:
        close()
        if own:
            shutil.rmtree(spill_dir, ignore_errors=True)
    machine["loadavg_end"] = os.getloadavg()
    targets = check_targets(rows, gpt, args.compute)

    print(f"## hook_cost: training-thread time per pack / unpack call (min_tensor_bytes "
          f"{size_text(args.min_tensor_bytes)}, keep_tail_bytes 0, compute between saves: "
          f"{args.compute})")
    print()
    print(render_records(rows))
    print()
    print("fate: written = the record is written (keep_tail_bytes=0: the store's I/O thread "
          "starts its write right after its pack); kept = below min_tensor_bytes, kept in "
          "memory. Unpack prefetched: every record in memory when "
          "backward starts (prefetch hit); on-demand: prefetch_bytes=0, each unpack reads its "
          "record and waits. identity: a hook pair that returns its argument, timed alike.")
    if skipped:
        print("Skipped: " + "; ".join(f"{c} ({why})" for c, why in skipped.items()))
    if gpt:
        m = gpt["model"]
        print()
        print(f"## hook_cost: training thread inside ssdtrain per GPT step ({m['n_layers']} "
              f"layers, d_model {m['d_model']}, seq {m['seq_len']}, batch {m['batch_size']}, "
              f"fp32; medians of {gpt['steps']} steps)")
        print()
        print(render_gpt(gpt))
        print()
        print("inside ssdtrain = entering + leaving `with offloader:` + every pack and unpack "
              "call, on the training thread.")
    print(f"Machine: {machine['cpu_count']} CPUs, torch {machine['torch']} with "
          f"{machine['torch_threads']} threads, spill_dir {spill_dir} on {fstype or '?'} "
          f"({device or '?'}), load average {machine['loadavg_start'][0]:.2f} at start, "
          f"{machine['loadavg_end'][0]:.2f} at end")
    print(f"Command: {command}")
    if targets:
        print()
        print("Targets (reported, not asserted):")
        for name, value, met in targets:
            print(f"- {name}: {value} -> {'met' if met else 'NOT met'}")
    return finish("hook_cost", args.json,
                  {"command": command, "machine": machine,
                   "settings": {"sizes": args.sizes, "configs": configs, "skipped": skipped,
                                "verify": args.verify, "budget_mib": args.budget_mib,
                                "min_iters": args.min_iters, "max_iters": args.max_iters,
                                "step_mib": args.step_mib, "rounds": args.rounds,
                                "compute": args.compute,
                                "min_tensor_bytes": args.min_tensor_bytes,
                                "keep_tail_bytes": 0},
                   "records": rows, "gpt": gpt,
                   "targets": [{"name": n, "value": v, "met": m} for n, v, m in targets]},
                  [])


if __name__ == "__main__":
    sys.exit(main())
