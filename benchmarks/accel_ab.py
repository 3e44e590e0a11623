#!/usr/bin/env python
"""Same-process A/B for the accelerator emulator: modes take turns, one step each.

``benchmarks/accel_emulator.py`` runs each mode in its own process, so on a machine
shared with other work its modes meet different load (its runs here moved 2-3x from
one step to the next). This script builds every mode in one process, on the same
emulated GPT (``accel_emulator``'s model, allocator and checks), and runs one step of
each in turn, the order rotated every round, so that each mode meets the same load.
Each ssdtrain step waits for its own I/O before the next mode's step
(``Offloader.wait()``, outside the timing), so that no mode's writes run into
another's step; writes that would have overlapped the next step's forward are
therefore not measured (offload modes look a little better than in the emulator).

Reported per mode: the median and least step time (forward to the end of backward,
less the peak sampling), the training thread's CPU time per step (``thread_time``:
barely moved by load), the peak of live activation bytes, the plan, and for the budget
mode its predicted step (``Prediction.backward_end_s``). ``--tflops`` takes the rates
the emulator solved for each R (its table's ``TFLOP/s`` column).

For every mode that offloads, the *I/O bound*: the least step the disk allows, the
larger of the none mode's step and the time the disk needs for the step's own I/O
(the bytes the mode wrote and read per measured step, ``Stats.bytes_written`` and
``bytes_read``, at the best write and read bandwidth the engine showed in this run:
``ssdtrain.testing.probe(...).time_io`` before and after the steps, the best of each).
"vs I/O bound" is the step over it: how much slower the mode is than its own disk
traffic allows.

Example::

    PYTHONPATH=. .venv/bin/python benchmarks/accel_ab.py --batch 4 --seq 256 \\
        --tflops 0.245 1.37 2.98 --modes none checkpoint budget
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import accel_emulator as E  # noqa: E402
from _common import md_header  # noqa: E402

MiB = 1 << 20


class StepClock:
    """A clock that runs only during one mode's own steps. ``policy="auto"`` measures a
    step from one forward to the next; here the other modes' steps come between, so
    its controller is given this clock (``ssdtrain.tools.set_auto_clock``)."""

    def __init__(self):
        self.total = 0.0
        self.since = None

    def resume(self):
        self.since = time.perf_counter()

    def pause(self):
        self.total += time.perf_counter() - self.since
        self.since = None

    def __call__(self):
        return self.total + (time.perf_counter() - self.since if self.since is not None else 0.0)


def setup(mode, cfg, budget, spill_dir):
    import ssdtrain
    from ssdtrain import tools
    emu = E.EMU = E.Emu(cfg)
    model = E.build_model(cfg)
    off = None
    base = dict(spill_dir=spill_dir)
    if mode == "checkpoint":
        model.checkpoint = True
    elif mode == "offload_all":
        off = ssdtrain.Offloader(ssdtrain.OffloadConfig(policy="static", keep_tail_bytes=0, **base))
    elif mode == "budget":
        off = ssdtrain.Offloader(ssdtrain.OffloadConfig(
            policy="adaptive", memory_budget_bytes=int(budget), **base))
        off.track(model, list(model.layers))
    elif mode in ("auto", "static"):  # a policy with nothing else set but spill_dir
        off = ssdtrain.Offloader(ssdtrain.OffloadConfig(policy=mode, **base))
        if mode == "auto":
            clock = StepClock()
            tools.set_auto_clock(off, clock)
    elif mode != "none":
        off = ssdtrain.Offloader(ssdtrain.OffloadConfig(policy="static", keep_tail_bytes=0, **base))
        off.track(model, list(model.layers))
        off.set_plan(E.plan_for(mode, cfg["shape"]["n_layers"]))
    emu.off = off
    return dict(mode=mode, emu=emu, model=model, off=off, step_s=[], cpu_s=[], peak=0,
                clock=clock if mode == "auto" else None, io=[])


def one_step(s, step, measured):
    E.EMU = emu = s["emu"]
    off = s["off"]
    emu.step = step
    gc.collect()
    with emu.lock:
        emu.peak = emu.live
    emu.sampled_peak = 0
    emu.delay = emu.overrun = emu.spin_lost = emu.sample_s = 0.0
    clock = s["clock"]
    before = off.stats() if off is not None else None
    if clock is not None:
        clock.resume()
    c0 = time.thread_time()
    t0 = time.perf_counter()
    with (off if off is not None else contextlib.nullcontext()):
        loss = s["model"]()
    emu.sample()
    loss.backward()
    dt = time.perf_counter() - t0 - emu.sample_s
    cpu = time.thread_time() - c0
    if clock is not None:
        clock.pause()
    del loss
    if off is not None:
        off.wait()
    if measured:
        s["step_s"].append(dt)
        s["cpu_s"].append(cpu)
        if off is not None:  # the step's own disk traffic (its writes have all ended)
            after = off.stats()
            s["io"].append((after.bytes_written - before.bytes_written,
                            after.bytes_read - before.bytes_read))
        s["peak"] = max(s["peak"], emu.peak, emu.sampled_peak)
    return max(emu.peak, emu.sampled_peak)


def _plan_text(s, plan):
    """The plan column: the adaptive plan's letters, or ``policy="auto"``'s quota and what
    its last measured step wrote."""
    if plan is not None:
        return "".join(c[0] for c in plan.choices)
    if s["off"] is not None and s["mode"] == "auto":
        st = s["off"].stats()
        return f"Q {(st.offload_quota_bytes or 0) / MiB:.0f} MiB"
    return ""


def run(args, tflops, spill_dir):
    shape = dict(E.DEFAULT_SHAPE)
    for k in shape:
        if getattr(args, k) is not None:
            shape[k] = getattr(args, k)
    cfg = dict(shape=shape, spill_dir=spill_dir, threads=1, check="sparse",
               launch_us=args.launch_us, launch_fraction=args.launch_fraction, r=None,
               tflops=tflops)
    # none first, alone, for the budget (a fraction of its peak)
    ref = setup("none", cfg, None, spill_dir)
    peak = max(one_step(ref, i, False) for i in range(2))
    budget = args.budget_fraction * peak
    setups = [ref if m == "none" else setup(m, cfg, budget, spill_dir) for m in args.modes]
    disk = [_disk_bandwidth(setups, args.probe_mib * MiB)]
    for step in range(args.warmup + args.steps):
        k = step % len(setups)
        for s in setups[k:] + setups[:k]:
            one_step(s, step, step >= args.warmup)
    disk.append(_disk_bandwidth(setups, args.probe_mib * MiB))
    write_bw = max((w for w, _ in disk if w), default=None)
    read_bw = max((r for _, r in disk if r), default=None)
    E.EMU = None
    rows = []
    med = {s["mode"]: statistics.median(s["step_s"]) for s in setups}
    fit = [m for m in med if m not in ("none", "budget") and
           next(s for s in setups if s["mode"] == m)["peak"] <= budget]
    best = min((med[m] for m in fit), default=None)
    for s in setups:
        plan = s["off"].active_plan if s["off"] is not None else None
        pred = plan.prediction.backward_end_s if plan is not None and s["mode"] == "budget" \
            else None
        m = med[s["mode"]]
        bound = _io_bound(s["io"], med["none"], write_bw, read_bw)
        rows.append(
            f"| {tflops:g} | {s['mode']} | {_plan_text(s, plan)} "
            f"| {m * 1e3:.0f} | {min(s['step_s']) * 1e3:.0f} | "
            f"{'' if pred is None else f'{pred * 1e3:.0f} ({pred / m - 1:+.0%})'} | "
            f"{m / med['none']:.2f}x | "
            f"{'' if best is None or s['mode'] != 'budget' else f'{m / best:.2f}x'} | "
            f"{statistics.median(s['cpu_s']) * 1e3:.0f} | {s['peak'] / MiB:.1f} | "
            f"{'' if bound is None else f'{bound * 1e3:.0f}'} | "
            f"{'' if bound is None else f'{m / bound:.2f}x'} | "
            f"{'yes' if not s['emu'].failures else 'NO'} |")
        if s["off"] is not None:
            s["off"].close()
    return rows, budget, fit, (write_bw, read_bw)


def _disk_bandwidth(setups, nbytes):
    """``(write, read)`` bytes/s the engine of the first offloading mode shows for one
    ``nbytes`` request each (the best of three), or ``(None, None)`` without one."""
    from ssdtrain import testing
    off = next((s["off"] for s in setups if s["off"] is not None), None)
    if off is None or nbytes <= 0:
        return None, None
    write_s, read_s = testing.probe(off).time_io(nbytes, 3)
    return nbytes / write_s, nbytes / read_s


def _io_bound(io, none_s, write_bw, read_bw):
    """The least step the disk allows for a mode's per-step traffic ``io`` ([(written,
    read)]): the none mode's step, or the disk's time for the median step's bytes if
    longer; None for a mode that moved no byte or without a bandwidth."""
    if not io or write_bw is None or read_bw is None:
        return None
    written = statistics.median(w for w, _ in io)
    read = statistics.median(r for _, r in io)
    if not (written or read):
        return None
    return max(none_s, written / write_bw + read / read_bw)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tflops", type=float, nargs="+", required=True,
                   help="emulated FLOP rates (the emulator's TFLOP/s column for each R)")
    p.add_argument("--modes", nargs="+", default=["none", "checkpoint", "budget"])
    p.add_argument("--budget-fraction", type=float, default=0.3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4,
                   help="rounds before measuring (the budget mode plans in the 4th)")
    p.add_argument("--launch-us", type=float, default=10.0)
    p.add_argument("--launch-fraction", type=float, default=None)
    p.add_argument("--spill-dir", default=None)
    p.add_argument("--probe-mib", type=int, default=64,
                   help="request size of the disk bandwidth probe for the I/O bound "
                        "(MiB; 0: no bound)")
    for k in E.DEFAULT_SHAPE:
        p.add_argument("--" + k.replace("_", "-"), type=int, default=None)
    args = p.parse_args(argv)
    if "none" not in args.modes:
        args.modes = ["none"] + args.modes
    import torch
    torch.set_num_threads(1)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(29, 1, 0, 0, 0)   # 1 ns timer slack, as the emulator
    with tempfile.TemporaryDirectory(prefix="ssdtrain-ab-", dir=args.spill_dir) as spill:
        print(md_header(["TFLOP/s>", "mode", "plan", "step (ms)>", "least (ms)>",
                         "predicted (ms)>", "vs none>", "vs fastest static that fits>",
                         "CPU (ms)>", "peak (MiB)>", "I/O bound (ms)>", "vs I/O bound>",
                         "exact"]))
        disks = []
        for tf in args.tflops:
            rows, budget, fit, disk = run(args, tf, spill)
            disks.append(disk)
            print("\n".join(rows), flush=True)
        print(f"\nbudget {budget / MiB:.1f} MiB; static modes that fit: {', '.join(fit) or 'none'}"
              f"; load average {os.getloadavg()[0]:.1f}")
        shown = [f"{w / 1e9:.2f}/{r / 1e9:.2f}" for w, r in disks if w and r]
        if shown:
            print(f"disk (best write/read GB/s per TFLOP/s row, {args.probe_mib} MiB "
                  f"requests): {', '.join(shown)}")
        print("Command: " + " ".join(sys.argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
