#!/usr/bin/env python
"""A long soak of device records with the host tier, an SSD and injected write faults:
does ssdtrain hold anything beyond its bounds, and does every error land in its own step?

One offloader (``policy="static"``) with a stand-in accelerator
(``ssdtrain.tools.LoopbackDevice``: every saved tensor is a device record, staged through
pinned memory; ``--device cuda`` uses a GPU instead), a host tier (``--host-budget-mib``)
and an SSD tier (``--spill-dir``). Each step saves 1 to ``--max-records`` device tensors
of ``--min-mib`` to ``--max-mib`` (every size unique, so a failed request's size names
its step) and then runs backward (checking every byte that comes back), drops its graph,
runs backward twice (``retain_graph``), or keeps two graphs alive at once (two forwards,
then two backwards). With probability ``--fault-rate`` a step has the writes of its first record
fail (``ssdtrain.io.faulty``, ``Fault(nbytes=...)``: ENOSPC, EIO or a short write); the
fault fires if that record is written (the host tier sends its earliest records on to
the SSD first).

After every phase of ``--phase-steps`` steps every graph is gone and ``wait()`` has
returned; then it checks, through the public API only:

* pinned staging: ``Stats.staging_bytes`` (all pinned memory ssdtrain holds) is at most
  the idle limit, ``write_behind_bytes + prefetch_bytes + host_budget_bytes``, and is all
  idle (``Stats.staging_idle_bytes``; NOTE [ Bounded staging ] in ssdtrain/_device/transfers.py);
* ``live_records()``, ``spill_bytes_in_use()``, ``resident_bytes()`` are 0;
* open file descriptors (``/proc/self/fd``) and threads (``threading.active_count()``,
  ``/proc/self/task``) are no more than after the first two phases;
* RSS (after the device's cache is emptied) grows by less than ``--rss-slack-mib`` from
  the second phase on;
* every error raised was raised in the step whose own write failed, and every fault
  that fired is raised or counted (``Stats.unneeded_failures``; NOTE [ One event, one
  error ] in ssdtrain/_store/events.py).

Output: a markdown table (one row per phase, or every ``--print-every``-th), a summary,
and JSON (``--json``, default ``benchmarks/results/soak.json``) with every phase's numbers.
The exit status is 1 if any check failed. Nothing here is a timing.

Example::

    PYTHONPATH=. .venv/bin/python benchmarks/soak.py                      # 2600 steps
    PYTHONPATH=. .venv/bin/python benchmarks/soak.py --tiny               # seconds
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import random
import re
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for _common, however run
from _common import md_header  # noqa: E402

MiB = 1 << 20
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_JSON = os.path.join(REPO_ROOT, "benchmarks", "results", "soak.json")
SHAPES = ("normal", "normal", "drop", "retain", "accum")
KINDS = ("ENOSPC", "EIO", "short")


def _rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _fds():
    return len(os.listdir("/proc/self/fd"))


def _tasks():
    return len(os.listdir("/proc/self/task"))


def _saver():
    import torch

    class Saved(torch.autograd.Function):
        """Saves one tensor whose every element is ``value``; backward appends whether
        it came back whole to ``seen``."""

        @staticmethod
        def forward(ctx, anchor, t, value, seen):
            ctx.value, ctx.seen = value, seen
            ctx.save_for_backward(t)
            return anchor * 1

        @staticmethod
        def backward(ctx, grad):
            (t,) = ctx.saved_tensors
            ctx.seen.append(bool((t == ctx.value).all()))
            return grad, None, None, None

    return Saved


class Soak:
    """The offloader, the device, the faults and what was seen (see the module docstring)."""

    def __init__(self, args, spill_dir):
        import torch
        import ssdtrain
        from ssdtrain import tools
        from ssdtrain.io import faulty
        self.torch, self.ssdtrain, self.faulty = torch, ssdtrain, faulty
        self.args = args
        self.rng = random.Random(args.seed)
        self.off = ssdtrain.Offloader(ssdtrain.OffloadConfig(
            policy="static", spill_dir=spill_dir, min_tensor_bytes=4096,
            keep_tail_bytes=0, write_behind_bytes=args.write_behind_mib * MiB,
            prefetch_bytes=args.prefetch_mib * MiB,
            host_budget_bytes=args.host_budget_mib * MiB or None, io_timeout_s=120))
        cfg = self.off.config
        self.limit = cfg.write_behind_bytes + cfg.prefetch_bytes + (cfg.host_budget_bytes or 0)
        if args.device == "loopback":
            self.dev = tools.attach_loopback(self.off, tools.LoopbackDevice(capacity=64 << 30))
            self.alloc = lambda n: self.dev.alloc((n,), dtype=torch.uint8)
            self.align = 512  # the loopback's blocks: a record covers its whole block
        else:
            self.dev = None
            self.alloc = lambda n: torch.empty(n, dtype=torch.uint8, device="cuda")
            self.align = 512
        self.inj = faulty.install(self.off)
        self.Saved = _saver()
        self.owner, self.doomed, self.raised, self.wrong, self.seen = {}, {}, {}, [], []
        self.phases = []

    def _size(self, step):
        lo = max(1, int(self.args.min_mib * MiB) // self.align)
        hi = max(lo, int(self.args.max_mib * MiB) // self.align)
        n = self.rng.randint(lo, hi) * self.align
        while n in self.owner:
            n += self.align
        self.owner[n] = step
        return n

    def _forward(self, step, k, fail, kind):
        sizes = [self._size(step) for _ in range(k)]
        if fail:  # the earliest saved: the host tier sends it on to the SSD first
            n = sizes[0]
            self.doomed[n] = step
            self.inj.faults.append(self.faulty.Fault("write", kind, nth=1, times=None,
                                                     nbytes=n))
        value = step % 251
        out = self.torch.zeros((), requires_grad=True)
        with self.off:
            for n in sizes:
                t = self.alloc(n)
                t.fill_(value)
                out = self.Saved.apply(out, t, value, self.seen)
                del t
        return out.sum()

    def _run(self, step, fn):
        try:
            return fn()
        except self.ssdtrain.SpillIOError as e:
            msg = str(e)
            m = re.search(r"writing (\d+) bytes", msg)
            if m is None or self.doomed.get(int(m.group(1))) != step:
                self.wrong.append((step, msg[:300]))
            self.raised[step] = self.raised.get(step, 0) + 1
            return None

    def step(self, step):
        """One step of a random shape; returns the next step number."""
        rng, a = self.rng, self.args
        shape = rng.choice(SHAPES)
        k = rng.randint(1, a.max_records)
        fail, kind = rng.random() < a.fault_rate, rng.choice(KINDS)
        if shape == "accum":
            x = self._run(step, lambda: self._forward(step, k, fail, kind))
            y = self._run(step + 1, lambda: self._forward(step + 1, k, False, kind))
            if x is not None:
                self._run(step, x.backward)
            if y is not None:
                self._run(step + 1, y.backward)
            return step + 2
        loss = self._run(step, lambda: self._forward(step, k, fail, kind))
        if loss is not None and shape != "drop":
            if shape == "retain":
                self._run(step, lambda: loss.backward(retain_graph=True))
            self._run(step, loss.backward)
        return step + 1

    def check(self, phase, steps_done, seconds):
        """Everything after a phase (every graph gone): a row of numbers and its verdicts."""
        off = self.off
        gc.collect()
        off.wait()
        if self.dev is not None:
            self.dev.empty_cache()  # device blocks cached per size (torch.cuda.empty_cache)
        else:
            self.torch.cuda.empty_cache()
        first = self.phases[:2]
        deadline = time.monotonic() + (5 if first else 0.5)
        while time.monotonic() < deadline and (not first or
                                               _tasks() > max(p["tasks"] for p in first)):
            time.sleep(0.01)  # idle device threads end (the loopback's after 0.5 s)
        s = off.stats()
        row = dict(phase=phase, steps=steps_done, seconds=round(seconds, 1),
                   # (getattr: the fields are new; the script also runs on older commits)
                   staging_bytes=s.staging_bytes,
                   staging_idle_bytes=getattr(s, "staging_idle_bytes", None),
                   peak_staging_bytes=s.peak_staging_bytes, live_records=off.live_records(),
                   spill_bytes_in_use=off.spill_bytes_in_use(),
                   resident_bytes=off.resident_bytes(), rss=_rss(), fds=_fds(),
                   threads=threading.active_count(), tasks=_tasks(),
                   faults_fired=len(self.inj.injected_nbytes),
                   errors_raised=sum(self.raised.values()), errors_wrong_step=len(self.wrong),
                   unneeded_failures=getattr(s, "unneeded_failures", 0),
                   bytes_written=s.bytes_written)
        bad = []
        if row["staging_bytes"] > self.limit:
            bad.append(f"staging {row['staging_bytes']} > idle limit {self.limit}")
        if row["staging_idle_bytes"] not in (None, row["staging_bytes"]):
            bad.append("staging in use with no live record")
        if row["live_records"] or row["spill_bytes_in_use"] or row["resident_bytes"]:
            bad.append("records, spill bytes or resident bytes left")
        warm = self.phases[:2]
        if len(warm) == 2:
            for key in ("fds", "threads", "tasks"):
                top = max(p[key] for p in warm)
                if row[key] > top:
                    bad.append(f"{key} {row[key]} > {top} after the first phases")
            grew = row["rss"] - warm[1]["rss"]
            if grew > self.args.rss_slack_mib * MiB:
                bad.append(f"RSS grew {grew / MiB:.0f} MiB")
        if self.wrong:
            bad.append(f"{len(self.wrong)} error(s) raised in a step whose write did not fail")
        if not all(self.seen):
            bad.append("backward got wrong bytes")
        fired = {self.doomed[n] for n in self.inj.injected_nbytes}
        silent = [st for st in fired if st not in self.raised]
        if not len(silent) <= row["unneeded_failures"] <= row["faults_fired"]:
            bad.append(f"{len(silent)} fault(s) neither raised nor counted")
        row["violations"] = bad
        self.phases.append(row)
        return row


def _mib(n):
    return f"{n / MiB:.1f}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2600)
    p.add_argument("--phase-steps", type=int, default=100)
    p.add_argument("--min-mib", type=float, default=1)
    p.add_argument("--max-mib", type=float, default=16)
    p.add_argument("--max-records", type=int, default=3, help="device tensors saved per step")
    p.add_argument("--fault-rate", type=float, default=0.1,
                   help="share of steps whose first record's writes fail (they fire only if "
                        "it is written: evicted from the host tier, or past it)")
    p.add_argument("--host-budget-mib", type=int, default=32, help="0: no host tier")
    p.add_argument("--write-behind-mib", type=int, default=32)
    p.add_argument("--prefetch-mib", type=int, default=32)
    p.add_argument("--rss-slack-mib", type=int, default=128)
    p.add_argument("--device", choices=("loopback", "cuda"), default="loopback")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--spill-dir", default=None, help="default: a fresh temporary directory")
    p.add_argument("--print-every", type=int, default=1, help="print every n-th phase")
    p.add_argument("--json", default=DEFAULT_JSON)
    p.add_argument("--tiny", action="store_true", help="a few seconds (for the tests)")
    args = p.parse_args(argv)
    if args.tiny:
        args.steps, args.phase_steps, args.min_mib, args.max_mib = 60, 15, 0.0625, 1
        args.host_budget_mib, args.write_behind_mib, args.prefetch_mib = 1, 2, 2
        args.fault_rate = 0.3
    logging.getLogger("ssdtrain").setLevel(logging.CRITICAL)  # the faults are expected
    spill = args.spill_dir or tempfile.mkdtemp(prefix="ssdtrain-soak-")
    soak = Soak(args, spill)
    print(f"{args.steps} steps, records of {args.min_mib:g}-{args.max_mib:g} MiB (1-"
          f"{args.max_records} per step), faults in {args.fault_rate:.0%} of steps; "
          f"device {args.device}, host tier {args.host_budget_mib} MiB, write-behind "
          f"{args.write_behind_mib} MiB, prefetch {args.prefetch_mib} MiB: idle staging "
          f"limit {_mib(soak.limit)} MiB. After each phase (every graph gone, wait()):")
    print(md_header(["phase>", "steps>", "staging (MiB)>", "idle (MiB)>", "peak (MiB)>",
                     "live>", "spill (MiB)>", "RSS (MiB)>", "fds>", "threads>", "tasks>",
                     "faults fired>", "raised>", "wrong step>", "unneeded>", "ok"]))
    t0 = time.monotonic()
    step = phase = 0
    try:
        while step < args.steps:
            end = min(args.steps, step + args.phase_steps)
            while step < end:
                step = soak.step(step)
            row = soak.check(phase, step, time.monotonic() - t0)
            if phase % args.print_every == 0 or step >= args.steps or row["violations"]:
                idle = row["staging_idle_bytes"] or 0
                print(f"| {phase} | {step} | {_mib(row['staging_bytes'])} | "
                      f"{_mib(idle)} | {_mib(row['peak_staging_bytes'])} | "
                      f"{row['live_records']} | {_mib(row['spill_bytes_in_use'])} | "
                      f"{_mib(row['rss'])} | {row['fds']} | {row['threads']} | {row['tasks']} | "
                      f"{row['faults_fired']} | {row['errors_raised']} | "
                      f"{row['errors_wrong_step']} | {row['unneeded_failures']} | "
                      f"{'yes' if not row['violations'] else '; '.join(row['violations'])} |",
                      flush=True)
            phase += 1
    finally:
        soak.off.close()
    bad = [(r["phase"], v) for r in soak.phases for v in r["violations"]]
    last = soak.phases[-1]
    print(f"\n{step} steps in {last['seconds']} s; peak staging {_mib(last['peak_staging_bytes'])}"
          f" MiB (idle limit {_mib(soak.limit)} MiB); {last['faults_fired']} faults fired, "
          f"{last['errors_raised']} errors raised ({last['errors_wrong_step']} in a step whose "
          f"write did not fail), {last['unneeded_failures']} counted as unneeded; "
          f"{len(bad)} violation(s)" + (f": first {bad[0]}" if bad else "") + ".")
    print("Command: " + " ".join(["benchmarks/soak.py"] + (argv if argv is not None
                                                             else sys.argv[1:])))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "idle_limit_bytes": soak.limit,
                       "phases": soak.phases, "wrong_step_errors": soak.wrong}, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
