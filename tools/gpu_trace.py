#!/usr/bin/env python
"""Where a GPU step's time goes when part of it is offloaded: a profiler trace per quota.

An investigation tool, not a benchmark (nothing is compared against a target). For the
first GPU runs' open question (docs/results/gpu_auto_2026-11-26.*): at ~1B parameters
on an H100 the default policy tried to offload 1/16 of a step's bytes to pinned RAM,
the step ran over its 3% margin, and nobody traced why.

What it runs, in one process, on the GPT of ``examples/gpt.py`` (``benchmarks/
gpu_smoke.py``'s ~1B model by default, ``--small`` for a quick try):

1. ``none``: no ssdtrain, the reference;
2. a sizing step: every eligible saved tensor offloaded to pinned RAM (the host tier
   alone, unlimited) counts ``S``, the bytes a step offloads at most;
3. for each ``--quotas`` fraction ``f``: the default policy (``"auto"``) with its quota
   pinned at ``f * S`` bytes (``ssdtrain.tools.pin_auto_quota``), the host tier alone
   (unlimited, no ``spill_dir``): the step's earliest ``f * S`` bytes go to pinned RAM
   and come back in backward, and every tensor past the quota takes the default's own
   path (kept without a record). (Before 2026-11-28 this was ``policy="static"`` with a
   host budget of ``f * S``: the records past the budget still paid a record's costs,
   which the default never pays; docs/results/gpu_trace_2026-11-28.md has both.)

For each: ``--warmup`` steps, ``--steps`` timed steps (between two device
synchronizations), then one step under ``torch.profiler`` (CPU and CUDA activity,
every thread: ``profile_all_threads``, ssdtrain's ranges included: docs/guide.md,
"Seeing ssdtrain in a profiler trace"), whose Chrome trace is written to ``--out``
(``trace-<run>.json``), with a summary of it (:func:`summarize_trace`):

* the device: kernel time, the device's idle time inside the step and its longest gaps
  (with what the launching thread ran when each began), device <-> host copy time and
  how much of it overlapped kernels;
* the launching thread (the one that launched the most kernels): its time inside
  ssdtrain's ranges, and its CUDA runtime calls by name (synchronizes, event records,
  host allocations, copies);
* every other thread: its time inside ssdtrain's ranges.

Outputs: ``summary.md`` and ``summary.json`` in ``--out``. Time spent waiting for the
GIL shows only as gaps: the profiler records no GIL. ``--cpu-dry-run`` runs the same
code on the CPU with a loopback device (``ssdtrain.tools.LoopbackDevice``), for testing
this script where no GPU exists.

    python tools/gpu_trace.py --out /tmp/trace [--quotas 0.0625 0.125 0.25] [--small]
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))
from _common import cuda_unavailable_reason  # noqa: E402  (the same check as the benchmarks')
DEFAULT_MODEL = dict(vocab=50304, seq_len=2048, d_model=2048, n_heads=16, n_layers=18,
                     batch_size=4)
SMALL_MODEL = dict(vocab=1024, seq_len=256, d_model=256, n_heads=4, n_layers=2, batch_size=2)
GAPS = 5  # longest device gaps reported per run
SYNC_CALLS = ("cudaEventSynchronize", "cudaStreamSynchronize", "cudaDeviceSynchronize",
              "cudaStreamWaitEvent", "cudaEventRecord", "cudaEventQuery", "cudaHostAlloc",
              "cudaHostRegister", "cudaFreeHost", "cudaMemcpyAsync", "cudaMalloc", "cudaFree",
              "cudaLaunchKernel")


# ------------------------------------------------------------------------------- analysis
def _union(intervals):
    """Total length of the union of ``(start, end)`` intervals."""
    total, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def _overlap(a, b):
    """Length of the intersection of two unions of intervals."""
    return _union(a) + _union(b) - _union(list(a) + list(b))


def summarize_trace(events):
    """The summary of one traced step from a Chrome trace's ``traceEvents`` (complete
    events, ``"ph": "X"``, times in µs): see the module docstring. Every time in the
    result is in milliseconds."""
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e and "ts" in e]
    if not spans:
        return {"empty": True}
    t0 = min(e["ts"] for e in spans)
    t1 = max(e["ts"] + e["dur"] for e in spans)
    cat = lambda e: str(e.get("cat", "")).lower()  # noqa: E731
    kernels = [(e["ts"], e["ts"] + e["dur"]) for e in spans if cat(e) == "kernel"]
    copies = {"DtoH": [], "HtoD": [], "other": []}
    for e in spans:
        if cat(e) == "gpu_memcpy":
            name = e.get("name", "")
            kind = "DtoH" if "DtoH" in name else "HtoD" if "HtoD" in name else "other"
            copies[kind].append((e["ts"], e["ts"] + e["dur"]))
    runtime = [e for e in spans if cat(e) in ("cuda_runtime", "cuda_driver")]
    launches = {}
    for e in runtime:
        if "Launch" in e.get("name", ""):
            launches[e["tid"]] = launches.get(e["tid"], 0) + 1
    host = [e for e in spans if cat(e) in ("cpu_op", "user_annotation", "python_function",
                                           "cuda_runtime", "cuda_driver")]
    if launches:
        launcher = max(launches, key=launches.get)
    else:  # no device: the thread with the most host events
        counts = {}
        for e in host:
            counts[e["tid"]] = counts.get(e["tid"], 0) + 1
        launcher = max(counts, key=counts.get) if counts else None
    ours = [e for e in spans if str(e.get("name", "")).startswith("ssdtrain::")]
    per_thread = {}
    for e in ours:
        per_thread.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
    by_name = {}
    for e in ours:
        if e["tid"] == launcher:
            by_name[e["name"]] = by_name.get(e["name"], 0.0) + e["dur"]
    calls = {}
    for e in runtime:
        if e["tid"] == launcher and e.get("name") in SYNC_CALLS:
            c = calls.setdefault(e["name"], [0, 0.0])
            c[0] += 1
            c[1] += e["dur"]
    out = {"step_ms": (t1 - t0) / 1e3, "launch_thread": launcher,
           "launch_thread_in_ssdtrain_ms": _union(per_thread.get(launcher, [])) / 1e3,
           "launch_thread_ssdtrain_ranges_ms": {k: v / 1e3 for k, v in sorted(
               by_name.items(), key=lambda kv: -kv[1])},
           "launch_thread_runtime_calls": {k: {"count": n, "ms": d / 1e3}
                                           for k, (n, d) in sorted(calls.items())},
           "other_threads_in_ssdtrain_ms": {str(t): _union(iv) / 1e3
                                            for t, iv in per_thread.items() if t != launcher},
           "device": None}
    if kernels:
        busy = _union(kernels)
        k0, k1 = min(s for s, _ in kernels), max(e for _, e in kernels)
        gaps, end = [], None
        for s, e in sorted(kernels):
            if end is not None and s > end:
                gaps.append((s - end, end, s))
            end = e if end is None else max(end, e)
        gaps.sort(reverse=True)
        launcher_host = sorted((e["ts"], e["ts"] + e["dur"], e.get("name", ""))
                               for e in host if e["tid"] == launcher)

        def running_at(t):
            names = [n for s, e, n in launcher_host if s <= t < e]
            return names[-3:]  # innermost last

        out["device"] = {
            "kernel_ms": busy / 1e3, "span_ms": (k1 - k0) / 1e3,
            "idle_ms": ((k1 - k0) - busy) / 1e3,
            "longest_gaps": [{"ms": g / 1e3, "at_ms": (s - t0) / 1e3,
                              "launch_thread_was_in": running_at(s)}
                             for g, s, _ in gaps[:GAPS]],
            "copies": {k: {"ms": _union(v) / 1e3, "count": len(v),
                           "overlapping_kernels_ms": _overlap(v, kernels) / 1e3}
                       for k, v in copies.items() if v}}
    return out


def load_trace(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


# ---------------------------------------------------------------------------------- runs
def _device(cpu_dry_run):
    import torch
    if cpu_dry_run:
        return torch.device("cpu"), (lambda: None)
    why = cuda_unavailable_reason()
    if why:
        raise SystemExit(f"gpu_trace.py: no usable CUDA device: {why} (--cpu-dry-run tests "
                         f"this script on the CPU)")
    return torch.device("cuda"), torch.cuda.synchronize


def _offloader(quota, cpu_dry_run, shipped=True):
    """The host tier alone (unlimited), no kept tail. ``quota`` None: ``policy="static"``
    (every eligible tensor: the sizing step); else ``policy="auto"`` with its quota pinned
    at ``quota`` bytes (``ssdtrain.tools.pin_auto_quota``): the step's earliest records
    within it go to pinned RAM, and every tensor past it takes the default's own path
    (kept without a record). ``shipped`` False: the hooks kept on to the end of forward
    and the prefetch window at ``prefetch_bytes`` (``tools.set_hooks_cut``,
    ``tools.set_load_lead``), as before NOTE [ Hooks off past the window ] and NOTE [
    Loads in time ] in ssdtrain/_policies/auto.py."""
    import ssdtrain
    from ssdtrain.tools import pin_auto_quota, set_hooks_cut, set_load_lead
    off = ssdtrain.Offloader(policy="static" if quota is None else "auto", spill_dir=None,
                             host_budget_bytes="unlimited", keep_tail_bytes=0)
    if quota is not None:
        pin_auto_quota(off, quota)
        set_hooks_cut(off, shipped)
        set_load_lead(off, shipped)
    if cpu_dry_run:
        from ssdtrain.tools import LoopbackDevice, attach_loopback
        attach_loopback(off, LoopbackDevice(claim_host_tensors=True, capacity=1 << 40))
    return off


def run(args):
    import torch
    from torch.profiler import ProfilerActivity, profile
    sys.path.insert(0, os.path.join(REPO_ROOT, "examples"))
    from gpt import GPT, GPTConfig, make_batch  # noqa: E402

    device, sync = _device(args.cpu_dry_run)
    m = dict(SMALL_MODEL if args.small else DEFAULT_MODEL)
    for k in m:
        if getattr(args, k) is not None:
            m[k] = getattr(args, k)
    cfg = GPTConfig(vocab_size=m["vocab"], seq_len=m["seq_len"], d_model=m["d_model"],
                    n_heads=m["n_heads"], n_layers=m["n_layers"])
    torch.manual_seed(0)
    with device:
        model = GPT(cfg).to(getattr(torch, args.dtype))
    idx, targets = make_batch(cfg, m["batch_size"], torch.Generator().manual_seed(1))
    idx, targets = idx.to(device), targets.to(device)
    os.makedirs(args.out, exist_ok=True)

    def step(ctx):
        model.zero_grad(set_to_none=True)
        with ctx():
            loss = model(idx, targets)
        loss.backward()

    activities = [ProfilerActivity.CPU] + ([] if args.cpu_dry_run else [ProfilerActivity.CUDA])

    def measure(name, ctx, off=None):
        print(f"gpu_trace: {name}: {args.warmup} warm-up, {args.steps} timed, 1 traced step",
              file=sys.stderr, flush=True)
        for _ in range(args.warmup):
            step(ctx)
        times = []
        for _ in range(args.steps):
            sync()
            t = time.perf_counter()
            step(ctx)
            sync()
            times.append(time.perf_counter() - t)
        if off is not None:
            off.wait()
        sync()
        with profile(activities=activities,
                     experimental_config=torch.profiler._ExperimentalConfig(
                         profile_all_threads=True)) as prof:
            step(ctx)
            sync()
        path = os.path.join(args.out, f"trace-{name}.json")
        prof.export_chrome_trace(path)
        summary = summarize_trace(load_trace(path))
        result = {"name": name, "step_s": sorted(times), "trace": path, "summary": summary}
        if off is not None:  # every step offloads the same records: the budget's share
            result["offloaded_bytes_per_step"] = \
                off.stats().offloaded_bytes // (args.warmup + args.steps + 1)
        return result

    results = [measure("none", contextlib.nullcontext)]
    sizing = _offloader(None, args.cpu_dry_run)
    try:
        step(lambda: sizing)
        sizing.wait()
        saved = sizing.stats().offloaded_bytes
    finally:
        sizing.close()
    for f in args.quotas:
        budget = max(1, int(f * saved))
        for shipped in ((True, False) if args.ab else (True,)):
            off = _offloader(budget, args.cpu_dry_run, shipped)
            try:
                r = measure(f"quota-{f:g}" + ("" if shipped else "-hooked-fixed-window"),
                            lambda: off, off)
                st = off.stats()
                r["prefetch_window_bytes"] = st.prefetch_window_bytes
                r["hooks_cut_steps"] = st.hooks_cut_steps
            finally:
                off.close()
            r["quota_fraction"], r["budget_bytes"], r["shipped"] = f, budget, shipped
            results.append(r)
    return {"model": m, "dtype": args.dtype, "device": str(device), "saved_bytes": saved,
            "torch": torch.__version__, "runs": results}


def render(data):
    lines = [f"## gpu_trace: {data['device']}, GPT {data['model']}, {data['dtype']}; "
             f"S = {data['saved_bytes'] / 2**20:.0f} MiB offloadable per step", "",
             "| run | step ms (median) | vs none | device idle ms | longest gap ms | "
             "DtoH ms (overlapping kernels) | HtoD ms (overlapping) | launch thread in "
             "ssdtrain ms | other threads in ssdtrain ms |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    base = None
    for r in data["runs"]:
        times = r["step_s"]
        med = times[len(times) // 2] * 1e3 if times else float("nan")
        base = med if base is None else base
        s, d = r["summary"], r["summary"].get("device") or {}
        copies = d.get("copies", {})

        def cp(k):
            c = copies.get(k)
            return f"{c['ms']:.2f} ({c['overlapping_kernels_ms']:.2f})" if c else "-"
        gaps = d.get("longest_gaps") or []
        lines.append(
            f"| {r['name']} | {med:.1f} | {med / base:.3f}x | "
            f"{d.get('idle_ms', float('nan')):.2f} | "
            f"{gaps[0]['ms'] if gaps else float('nan'):.2f} | {cp('DtoH')} | {cp('HtoD')} | "
            f"{s.get('launch_thread_in_ssdtrain_ms', 0):.2f} | "
            f"{sum(s.get('other_threads_in_ssdtrain_ms', {}).values()):.2f} |")
    lines.append("")
    for r in data["runs"]:
        s = r["summary"]
        lines.append(f"### {r['name']}")
        lines.append(f"- launch thread's ssdtrain ranges (ms): "
                     f"{json.dumps(s.get('launch_thread_ssdtrain_ranges_ms', {}))}")
        lines.append(f"- launch thread's CUDA runtime calls: "
                     f"{json.dumps(s.get('launch_thread_runtime_calls', {}))}")
        for g in ((s.get("device") or {}).get("longest_gaps") or []):
            lines.append(f"- device gap {g['ms']:.2f} ms at {g['at_ms']:.1f} ms; the launch "
                         f"thread was in {g['launch_thread_was_in']}")
        lines.append(f"- trace: {r['trace']}")
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "ssdtrain-gpu_trace"),
                   help="folder for the traces and the summary")
    p.add_argument("--quotas", type=float, nargs="+", default=[1 / 16, 1 / 8, 1 / 4],
                   help="fractions of the step's offloadable bytes sent to pinned RAM "
                        "(default 1/16 1/8 1/4)")
    p.add_argument("--ab", action="store_true",
                   help="each quota also with the hooks kept on and the window fixed at "
                        "prefetch_bytes (as before the hooks came off past the window and "
                        "the window led the loads), in the same process")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="timed steps per run (default 3)")
    p.add_argument("--small", action="store_true", help="a small GPT (seconds)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    for k in DEFAULT_MODEL:
        p.add_argument("--" + k.replace("_", "-"), type=int, default=None)
    p.add_argument("--cpu-dry-run", action="store_true",
                   help="run on the CPU with a loopback device (tests this script)")
    args = p.parse_args(argv)
    if any(not 0 < f <= 1 for f in args.quotas):
        raise SystemExit("gpu_trace.py: --quotas are fractions in (0, 1]")
    data = run(args)
    text = render(data)
    print(text)
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(data, f, indent=1)
    print(f"summary: {os.path.join(args.out, 'summary.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
