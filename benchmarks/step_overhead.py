#!/usr/bin/env python
"""Step time and peak memory of one training step of a GPT, with and without ssdtrain.

Compares, side by side in one run, five ways of holding the activations that
autograd saves for backward:

* ``none``: plain PyTorch (the reference);
* ``ssdtrain``: ``with ssdtrain.Offloader(...)`` around forward;
* ``recompute``: per-block recomputation (``torch.utils.checkpoint``,
  ``GPTConfig.checkpoint_blocks``);
* ``torch_save``: a naive synchronous ``saved_tensors_hooks`` pair that
  ``torch.save``\\ s each large saved tensor to its own file and ``torch.load``\\ s
  (and deletes) it in backward;
* ``save_on_cpu``: ``torch.autograd.graph.save_on_cpu(pin_memory=False)``;
* ``ssdtrain_tail0`` (not run unless named, or with ``--compute-threads``): ssdtrain
  with ``keep_tail_bytes=0``, so everything it may offload is written, the last
  activations of forward included.

Accelerator analog (``--compute-threads N``): on an accelerator, compute does not
run on the host cores the I/O threads use. Here every mode also runs with
``torch.set_num_threads(N)`` (and ``OMP_NUM_THREADS=N``), leaving the other cores to
ssdtrain's I/O threads (nothing is pinned: the scheduler places threads), and the
report shows its table beside the all-cores one (``--threads``), each with ratios to
``none`` at the same thread count. Thread counts alternate within each repeat.

Each (mode, repeat) runs in a fresh process (this script with the hidden
``--worker`` flag); modes are interleaved within each repeat so drifts of the
machine hit every mode alike. A worker builds the same seeded model and batch,
runs one warm-up step, then ``--steps`` measured steps of forward + backward
(``zero_grad(set_to_none=True)`` before each; no optimizer). Per step it records
the wall time, the peak RSS increase over the step (``VmHWM`` after the step minus
``VmRSS`` before it, ``VmHWM`` reset through ``/proc/self/clear_refs``; children
run with ``MALLOC_MMAP_THRESHOLD_=65536`` so freed tensors go back to the OS),
the bytes written, CPU times, and, after the first measured step, a SHA-256 of the
loss and of every gradient, so the parent can report bitwise equality with
``none``.

Output: a markdown table on stdout (medians over the measured steps of every
repeat, ratios to ``none``; step times skip steps that other processes disturbed,
see NOTE [ Contention ]), whether the targets (benchmarks/README.md) were met, and a JSON
file with every raw per-step number. Progress goes to stderr. Nothing here
asserts a timing.

Example::

    PYTHONPATH=. .venv/bin/python benchmarks/step_overhead.py               # defaults, ~9 min
    PYTHONPATH=. .venv/bin/python benchmarks/step_overhead.py --tiny --repeats 1 --steps 1
    PYTHONPATH=. .venv/bin/python benchmarks/step_overhead.py --compute-threads 1 \\
        --modes none ssdtrain ssdtrain_tail0      # accelerator analog beside all cores
    PYTHONPATH=. .venv/bin/python benchmarks/step_overhead.py --modes none ssdtrain \\
        --keep-tail-mib 64 --prefetch-mib 128 --spill-dir /nvme/tmp
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import resource
import shutil
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for _common, however run
from _common import (  # noqa: E402
    add_offload_arguments, add_worker_arguments, command_line, digest, finish, jsonable_config,
    md_table, measured, median, model_from_args, mount_of, offload_overrides, proc_status, progress,
    reset_peak_rss, run_worker, stats_delta, work_dir, worker_env)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_JSON = os.path.join(REPO_ROOT, "benchmarks", "results", "step_overhead.json")
MODES = ("none", "ssdtrain", "recompute", "torch_save", "save_on_cpu")
# Run only when named in --modes (or by default with --compute-threads).
VARIANT_MODES = ("ssdtrain_tail0",)
ALL_MODES = MODES + VARIANT_MODES
COMPUTE_THREADS_MODES = ("none", "ssdtrain", "ssdtrain_tail0")
MiB = 1 << 20

# Targets (benchmarks/README.md; reported, never asserted).
TARGET_STEP_RATIO = 1.05
TARGET_MEMORY_RATIO = 0.5
TARGET_ANALOG_STEP_RATIO = 1.02  # --compute-threads (accelerator analog)

# Model shape. The default saves ~1.15 GiB per step in fp32 (0.9 GiB of it in distinct
# storages >= 256 KiB that ssdtrain may offload; none's peak RSS delta is ~1.15 GiB) and
# a step takes ~6 s on this 2-core machine: 15 runs take ~9 min. --tiny is for the tests.
DEFAULT_MODEL = dict(d_model=512, n_layers=6, n_heads=8, seq_len=512, batch_size=8, vocab=8192)
TINY_MODEL = dict(d_model=64, n_layers=2, n_heads=2, seq_len=64, batch_size=2, vocab=256)
# --tiny also offloads everything (its tensors are ~32 KiB, below the 256 KiB default).
TINY_OFFLOAD = dict(min_tensor_kib=4, keep_tail_mib=0)

MODE_NOTES = {
    "none": "reference: no hooks",
    "ssdtrain": "ssdtrain.Offloader around forward",
    "ssdtrain_tail0": "ssdtrain with keep_tail_bytes=0: everything eligible is written",
    "recompute": "per-block torch.utils.checkpoint: forward runs twice",
    "torch_save": ("synchronous torch.save/torch.load of each saved tensor >= min size, one file "
                   "each (weights and views write their whole storage); written data stays in "
                   "the page cache, which RSS does not count"),
    "save_on_cpu": ("on a CPU-only machine it copies every saved tensor to another CPU tensor: "
                    "the cost of a host copy, with no saving"),
}


# --------------------------------------------------------------------------- /proc readers
def _hwm_reset_works():
    """Whether resetting ``VmHWM`` works here: raise the peak by 64 MiB, free, reset, compare."""
    block = bytearray(64 * MiB)
    for i in range(0, len(block), 4096):
        block[i] = 1
    del block
    before = proc_status("VmHWM", "VmRSS")
    try:
        reset_peak_rss()
    except OSError:
        return False
    after = proc_status("VmHWM", "VmRSS")
    return before["VmHWM"] - before["VmRSS"] > 32 * MiB and \
        after["VmHWM"] - after["VmRSS"] < 8 * MiB


def _proc_io():
    """``/proc/self/io``: bytes this process sent to and fetched from the storage layer."""
    out = {}
    try:
        with open("/proc/self/io") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name in ("read_bytes", "write_bytes"):
                    out[name] = int(value)
    except OSError:
        pass
    return out


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _machine_cpu_seconds():
    """``(busy, steal)`` CPU seconds of the whole machine so far, from ``/proc/stat``.

    ``busy`` minus this process's own CPU time over a step is what other processes
    (and kernel threads) took from the same cores: a measure of contention.
    """
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0, 0.0
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq) / _CLK_TCK, steal / _CLK_TCK


def _thread_cpu_seconds(native_id):
    """User + system CPU seconds of one thread of this process (0.0 if it is gone)."""
    try:
        with open(f"/proc/self/task/{native_id}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return 0.0
    # After "pid (comm)": state is fields[0], utime and stime are fields 14 and 15 of stat.
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def _io_thread_ids():
    """Native ids of ssdtrain's threads: Python threads named ``ssdtrain-*`` (the store's
    I/O thread, the posix engine's pool, the device copy waiter) and threads whose OS
    name says so (the native engine's workers, named ``ssdtrain-io`` in C++)."""
    ids = {t.native_id for t in threading.enumerate()
           if t.name.startswith("ssdtrain") and t.native_id is not None}
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return ids
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().startswith("ssdtrain"):
                    ids.add(int(tid))
        except (OSError, ValueError):
            continue
    return ids


def _io_threads_cpu_seconds():
    return sum(_thread_cpu_seconds(i) for i in _io_thread_ids())


def filesystem_of(path):
    """``(fstype, device, mount point)`` of the file system holding ``path``."""
    device, point, fstype = mount_of(path)
    return fstype, device, point


# ----------------------------------------------------------------------------------- worker
class _TorchSaveHooks:
    """A naive synchronous offload: one ``torch.save`` file per large saved tensor."""

    def __init__(self, directory, min_bytes):
        self.directory = directory
        self.min_bytes = min_bytes
        self.count = 0
        self.written = 0
        self.files = 0

    def pack(self, t):
        import torch
        if t.numel() * t.element_size() < self.min_bytes:
            return t
        self.count += 1
        path = os.path.join(self.directory, f"{self.count}.pt")
        torch.save(t, path)
        self.written += os.path.getsize(path)
        self.files += 1
        return path

    def unpack(self, packed):
        import torch
        if not isinstance(packed, str):
            return packed
        t = torch.load(packed, weights_only=True)
        os.remove(packed)
        return t

    def context(self):
        import torch
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def _eligible_storages(model, idx, targets, min_bytes):
    """Storages the offloader should record in one forward, counted independently of it.

    Saved tensors >= ``min_bytes`` that are neither parameters/buffers nor leaves
    requiring grad, grouped by storage: ssdtrain should create one record per
    storage and write each at most once.
    """
    import torch
    state = {p.untyped_storage().data_ptr() for p in model.parameters()}
    state |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    seen = {}

    def pack(t):
        leaf = t.requires_grad and t.grad_fn is None
        if t.numel() * t.element_size() >= min_bytes and not leaf:
            s = t.untyped_storage()
            if s.data_ptr() not in state:
                seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(idx, targets)
    del loss
    return len(seen), sum(seen.values())


def _inspect_records(off):
    """After forward: the records ssdtrain holds for this step (read-only views)."""
    records = off.records()
    groups = {}
    for r in records:
        groups.setdefault(r.key, []).append((r.lo, r.hi, r.version))
    overlapping = 0
    for spans in groups.values():
        spans.sort()
        for (lo1, hi1, v1), (lo2, hi2, v2) in zip(spans, spans[1:]):
            overlapping += lo2 < hi1 and v1 == v2
    return records, len(groups), overlapping


def worker(mode, cfg, out_path):
    """One process, one mode: warm-up + measured steps; writes a JSON result to ``out_path``."""
    import torch
    sys.path.insert(0, os.path.join(REPO_ROOT, "examples"))
    from gpt import GPT, GPTConfig, make_batch  # noqa: E402
    import ssdtrain

    torch.set_num_threads(cfg["threads"])
    hwm_ok = _hwm_reset_works()
    model_cfg = GPTConfig(vocab_size=cfg["vocab"], seq_len=cfg["seq_len"], d_model=cfg["d_model"],
                          n_heads=cfg["n_heads"], n_layers=cfg["n_layers"],
                          checkpoint_blocks=(mode == "recompute"))
    torch.manual_seed(0)
    model = GPT(model_cfg)
    idx, targets = make_batch(model_cfg, cfg["batch_size"], torch.Generator().manual_seed(1))

    overrides = {k: v for k, v in cfg["offload"].items() if v is not None}
    if mode == "ssdtrain_tail0":
        overrides["keep_tail_bytes"] = 0
    # The offload path (policy "static"), not the default's measured quota, unless
    # --policy auto asks for the default.
    offload_cfg = ssdtrain.OffloadConfig.from_env(**dict(dict(policy=cfg.get("policy", "static")),
                                                         **overrides, spill_dir=cfg["spill_dir"]))
    min_bytes = offload_cfg.min_tensor_bytes
    result = {"mode": mode, "repeat": cfg["repeat"], "pid": os.getpid(),
              "torch": torch.__version__, "threads": torch.get_num_threads(),
              "hwm_reset_works": hwm_ok, "min_tensor_bytes": min_bytes,
              "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
              "steps": []}

    off = saver = scratch = None
    if mode in ("ssdtrain", "ssdtrain_tail0"):
        off = ssdtrain.Offloader(offload_cfg)
        result["offload_config"] = jsonable_config(off.config)
        result["engine"] = off.stats().engine
        context = lambda: off  # noqa: E731
    elif mode == "torch_save":
        scratch = tempfile.mkdtemp(prefix="torch_save-", dir=offload_cfg.spill_dir[0])
        saver = _TorchSaveHooks(scratch, min_bytes)
        context = saver.context
    elif mode == "save_on_cpu":
        context = lambda: torch.autograd.graph.save_on_cpu(pin_memory=False)  # noqa: E731
    elif mode in ("none", "recompute"):
        import contextlib
        context = contextlib.nullcontext
    else:
        raise SystemExit(f"step_overhead: unknown mode {mode!r}; choose from {ALL_MODES}")

    try:
        warmup = cfg.get("warmup", 1)
        for step in range(warmup + cfg["steps"]):
            model.zero_grad(set_to_none=True)
            gc.collect()
            rec = {"step": step, "warmup": step < warmup}
            stats0 = dataclasses.asdict(off.stats()) if off is not None else None
            live0 = off.live_records() if off is not None else 0
            written0 = saver.written if saver is not None else 0
            io0, cpu0, machine0 = _proc_io(), os.times(), _machine_cpu_seconds()
            usage0 = resource.getrusage(resource.RUSAGE_SELF)
            main0, iocpu0 = time.thread_time(), _io_threads_cpu_seconds()
            reset_peak_rss()
            rss0 = proc_status("VmRSS")["VmRSS"]

            t0 = time.perf_counter()
            with context():
                loss = model(idx, targets)
            t1 = time.perf_counter()
            inspect_s = 0.0
            records = None
            if off is not None:  # not timed: subtracted below
                records, n_keys, overlapping = _inspect_records(off)
                inspect_s = time.perf_counter() - t1
            loss.backward()
            t2 = time.perf_counter()

            mem = proc_status("VmHWM", "VmRSS")
            main1, iocpu1 = time.thread_time(), _io_threads_cpu_seconds()
            io1, cpu1, machine1 = _proc_io(), os.times(), _machine_cpu_seconds()
            usage1 = resource.getrusage(resource.RUSAGE_SELF)
            own_cpu = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
            rec.update(
                step_s=t2 - t0 - inspect_s, forward_s=t1 - t0, backward_s=t2 - t1 - inspect_s,
                rss_before=rss0, rss_after=mem["VmRSS"], peak_rss=mem["VmHWM"],
                peak_rss_delta=mem["VmHWM"] - rss0,
                process_cpu_s=own_cpu,
                other_cpu_s=max(0.0, machine1[0] - machine0[0] - own_cpu),
                steal_cpu_s=machine1[1] - machine0[1],
                minor_faults=usage1.ru_minflt - usage0.ru_minflt,
                main_thread_cpu_s=main1 - main0,
                disk_write_bytes=io1.get("write_bytes", 0) - io0.get("write_bytes", 0),
                disk_read_bytes=io1.get("read_bytes", 0) - io0.get("read_bytes", 0),
                written_bytes=0)
            rec["other_cpu_share"] = (rec["other_cpu_s"] + rec["steal_cpu_s"]) \
                / (rec["step_s"] * (os.cpu_count() or 1))
            if saver is not None:
                rec["written_bytes"] = saver.written - written0
                rec["files_written"] = saver.files
                saver.files = 0
            if off is not None:
                # Untimed: writes still in flight after backward (records dropped before
                # their write ended) are counted when they complete; count them here.
                off.wait()
                st = stats_delta(dataclasses.asdict(off.stats()), stats0)
                writes = [r.writes for r in records]
                rec.update(
                    written_bytes=st["offloaded_bytes"], stats=st,
                    io_threads_cpu_s=iocpu1 - iocpu0, live_records_before=live0,
                    records=len(records), record_storages=n_keys,
                    overlapping_records=overlapping,
                    records_written_once=sum(w == 1 for w in writes),
                    records_never_written=sum(w == 0 for w in writes),
                    max_writes_per_record=max(writes, default=0),
                    bytes_of_written_records=sum(r.nbytes for r in records if r.writes),
                    bytes_of_unwritten_records=sum(r.nbytes for r in records if not r.writes))
                del records
            if step == warmup:
                result["digest"] = digest(loss, model.named_parameters(), loss_sha256=True)
            del loss
            result["steps"].append(rec)

        if mode == "none":  # an independent count of what ssdtrain should record
            n, nbytes = _eligible_storages(model, idx, targets, min_bytes)
            result["eligible_storages"], result["eligible_bytes"] = n, nbytes
        if off is not None:
            off.wait()
            result["final_stats"] = dataclasses.asdict(off.stats())
            result["live_records_end"] = off.live_records()
            if cfg.get("trace"):
                result["trace"] = _traced_step(model, idx, targets, off, cfg["trace"])
    finally:
        if off is not None:
            off.close()
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    with open(out_path, "w") as f:
        json.dump(result, f)


def _traced_step(model, idx, targets, off, path):
    """One more step (not measured) under ``torch.profiler``, its Chrome trace written to
    ``path``: ssdtrain's ranges (docs/guide.md, "Seeing ssdtrain in a profiler trace")
    beside torch's ops. Every thread is recorded (``profile_all_threads``), so the ranges
    of ssdtrain's I/O thread are in it too. Returns ``path``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    model.zero_grad(set_to_none=True)
    with profile(activities=activities, record_shapes=True,
                 experimental_config=torch.profiler._ExperimentalConfig(
                     profile_all_threads=True)) as prof:
        with off:
            loss = model(idx, targets)
        loss.backward()
        off.wait()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    prof.export_chrome_trace(path)
    return path


def _trace_paths(path, modes):
    """``--trace PATH``: where each ssdtrain mode's traced step goes (``PATH`` for
    ``ssdtrain``, ``PATH`` with ``.<mode>`` before its suffix for the others)."""
    if path is None:
        return {}
    stem, suffix = os.path.splitext(path)
    return {m: path if m == "ssdtrain" else f"{stem}.{m}{suffix or '.json'}"
            for m in modes if m.startswith("ssdtrain")}


# ----------------------------------------------------------------------------------- parent
def _timed(steps, max_other):
    """The steps whose timing other processes did not disturb (all of them if none is clean).

    NOTE [ Contention ]: on a shared machine another process busy on the same
    cores slows a step by up to the share of the CPUs it takes. Each step records
    that share (``other_cpu_share``, from ``/proc/stat``); step times are
    summarized over steps below ``--max-other-cpu`` only. Memory and bytes are
    not affected and use every step.
    """
    clean = [s for s in steps if s.get("other_cpu_share", 0.0) <= max_other]
    return clean or steps


def summarize(runs, modes, max_other=1.0):
    """Per mode: medians over the measured steps of every repeat, ratios to ``none``.

    Times use the steps other processes left alone (NOTE [ Contention ]).
    """
    by_mode = {m: [r for r in runs if r["mode"] == m and "error" not in r] for m in modes}
    ref_digests = {r["repeat"]: r["digest"]["sha256"] for r in by_mode.get("none", [])
                   if "digest" in r}
    summary = {}
    for mode, rs in by_mode.items():
        steps = [s for r in rs for s in measured(r)]
        if not steps:
            summary[mode] = {"failed": True}
            continue
        timed = _timed(steps, max_other)
        s = {
            "step_s_median": median([x["step_s"] for x in timed]),
            "forward_s_median": median([x["forward_s"] for x in timed]),
            "backward_s_median": median([x["backward_s"] for x in timed]),
            "timed_steps": sum(x.get("other_cpu_share", 0.0) <= max_other for x in steps),
            "measured_steps": len(steps),
            "repeat_step_s_medians": [median([x["step_s"] for x in _timed(measured(r),
                                                                           max_other)])
                                      for r in rs],
            "peak_rss_delta_median": median([x["peak_rss_delta"] for x in steps]),
            "written_bytes_per_step": median([x["written_bytes"] for x in steps]),
            "disk_write_bytes_per_step": median([x["disk_write_bytes"] for x in steps]),
            "process_cpu_s_median": median([x["process_cpu_s"] for x in steps]),
            "other_cpu_s_median": median([x["other_cpu_s"] for x in steps]),
            "other_cpu_share_median": median([(x["other_cpu_s"] + x["steal_cpu_s"])
                                               / (x["step_s"] * (os.cpu_count() or 1))
                                               for x in steps]),
            "param_bytes": rs[0]["param_bytes"],
        }
        if mode == "none":
            same = len(set(ref_digests.values())) <= 1
            s["grads_equal"] = same  # the reference is deterministic across repeats
        else:
            pairs = [(r["digest"]["sha256"], ref_digests.get(r["repeat"])) for r in rs]
            s["grads_equal"] = bool(pairs) and all(d == ref and ref is not None
                                                   for d, ref in pairs)
            mismatched = set()
            refs = {r["repeat"]: r for r in by_mode.get("none", [])}
            for r in rs:
                ref = refs.get(r["repeat"])
                if ref is not None:
                    mismatched |= {n for n, h in r["digest"]["grads"].items()
                                   if ref["digest"]["grads"].get(n) != h}
            s["mismatched_grads"] = sorted(mismatched)
        if mode.startswith("ssdtrain"):
            st = [x["stats"] for x in steps]
            s.update(
                stall_s_median=median([x["stall_seconds"] for x in st]),
                prefetch_hits_median=median([x["prefetch_hits"] for x in st]),
                prefetch_misses_median=median([x["prefetch_misses"] for x in st]),
                forwarded_median=median([x["forwarded"] for x in st]),
                kept_bytes_median=median([x["kept_bytes"] for x in st]),
                unique_bytes_median=median([x["unique_bytes"] for x in st]),
                peak_resident_bytes=max(r.get("final_stats", {}).get("peak_resident_bytes", 0)
                                        for r in rs),
                io_threads_cpu_s_median=median([x["io_threads_cpu_s"] for x in steps]),
                main_thread_cpu_s_median=median([x["main_thread_cpu_s"] for x in steps]),
                records_per_step=sorted({x["records"] for x in steps}),
                record_storages_per_step=sorted({x["record_storages"] for x in steps}),
                max_writes_per_record=max(x["max_writes_per_record"] for x in steps),
                records_written_once_per_step=sorted({x["records_written_once"] for x in steps}),
                records_kept_per_step=sorted({x["records_never_written"] for x in steps}),
                overlapping_records=max(x["overlapping_records"] for x in steps),
                live_records_before_step=max(x["live_records_before"] for x in steps),
                engine=rs[0].get("engine", ""),
            )
        summary[mode] = s
    ref = summary.get("none", {})
    for mode, s in summary.items():
        if s.get("failed") or ref.get("failed") or not ref:
            continue
        s["step_ratio"] = s["step_s_median"] / ref["step_s_median"]
        s["memory_ratio"] = s["peak_rss_delta_median"] / ref["peak_rss_delta_median"] \
            if ref["peak_rss_delta_median"] > 0 else float("nan")
    return summary


def check_targets(runs, summary, max_other=1.0, mode="ssdtrain", step_target=TARGET_STEP_RATIO):
    """The targets for ``mode`` (an ssdtrain mode) versus none: (name, value text, met)
    triples. Names carry a ``"{mode}: "`` prefix for modes other than ``ssdtrain``."""
    s, ref = summary.get(mode), summary.get("none")
    if not s or not ref or s.get("failed") or ref.get("failed"):
        return []
    out = []
    paired = []
    target_mode = mode
    by = {(r["mode"], r["repeat"]): r for r in runs if "error" not in r}
    for (mode, rep), r in by.items():
        if mode == target_mode and ("none", rep) in by:
            a = median([x["step_s"] for x in _timed(measured(r), max_other)])
            b = median([x["step_s"] for x in _timed(measured(by[("none", rep)]), max_other)])
            paired.append(a / b)
    mode = target_mode
    reliable = s["timed_steps"] > 0 and ref["timed_steps"] > 0
    out.append((f"step time <= {step_target:.2f}x none",
                f"{s['step_ratio']:.3f}x (per-repeat ratios "
                + ", ".join(f"{p:.3f}" for p in sorted(paired)) + ")"
                + ("" if reliable else "; every step of a mode was contended"),
                s["step_ratio"] <= step_target if reliable else None))
    grads = s["param_bytes"]
    act = (s["peak_rss_delta_median"] - grads) / max(1, ref["peak_rss_delta_median"] - grads)
    out.append((f"peak activation memory <= {TARGET_MEMORY_RATIO:.2f}x none",
                f"{s['memory_ratio']:.3f}x peak RSS delta ({act:.3f}x without the "
                f"{grads / MiB:.0f} MiB of gradients both allocate)",
                s["memory_ratio"] <= TARGET_MEMORY_RATIO))
    eligible = {r.get("eligible_storages") for r in runs
                if r["mode"] == "none" and "error" not in r}
    once = s["max_writes_per_record"] <= 1 and s["overlapping_records"] == 0 \
        and s["records_per_step"] == s["record_storages_per_step"] \
        and len(eligible) == 1 and s["record_storages_per_step"] == sorted(eligible)
    out.append(("every storage written once",
                f"records/step {s['records_per_step']} (written once "
                f"{s['records_written_once_per_step']}, kept in memory, never written "
                f"{s['records_kept_per_step']}), distinct storages/step "
                f"{s['record_storages_per_step']}, eligible storages counted without ssdtrain "
                f"{sorted(eligible)}, max writes per record {s['max_writes_per_record']}, "
                f"overlapping records {s['overlapping_records']}",
                once))
    if mode != "ssdtrain":
        out = [(f"{mode}: {name}", value, met) for name, value, met in out]
    return out


def _notes(mode, s):
    if s.get("failed"):
        return "FAILED (see stderr / JSON)"
    notes = []
    if mode.startswith("ssdtrain"):
        if mode != "ssdtrain":
            notes.append(MODE_NOTES[mode])
        notes.append(f"{s['engine']}; stall {s['stall_s_median']:.2f} s/step; prefetch "
                     f"{s['prefetch_hits_median']:.0f} hits / {s['prefetch_misses_median']:.0f} "
                     f"misses; kept {s['kept_bytes_median'] / MiB:.0f} MiB/step; I/O threads CPU "
                     f"{s['io_threads_cpu_s_median']:.2f} s/step")
    else:
        notes.append(MODE_NOTES[mode])
    if s.get("mismatched_grads"):
        notes.append(f"{len(s['mismatched_grads'])} grads differ")
    reps = s["repeat_step_s_medians"]
    notes.append(f"repeat medians {min(reps):.2f}-{max(reps):.2f} s")
    if s["timed_steps"] < s["measured_steps"]:
        notes.append(f"time over {s['timed_steps']}/{s['measured_steps']} steps"
                     + (" (all contended)" if s["timed_steps"] == 0 else
                        " (rest contended)"))
    return "; ".join(notes)


def render_table(summary, modes):
    rows = []
    for mode in modes:
        s = summary.get(mode, {"failed": True})
        if s.get("failed"):
            rows.append([mode, "-", "-", "-", "-", "-", "-", _notes(mode, s)])
            continue
        rows.append([mode, f"{s['step_s_median']:.3f}",
                     f"{s['step_ratio']:.3f}" if "step_ratio" in s else "-",
                     f"{s['peak_rss_delta_median'] / MiB:.0f}",
                     f"{s['memory_ratio']:.3f}" if "memory_ratio" in s else "-",
                     f"{s['written_bytes_per_step'] / MiB:.0f}",
                     "yes" if s["grads_equal"] else "NO", _notes(mode, s)])
    return md_table(["mode", "step time median (s)>", "ratio to none>",
                     "peak RSS delta (MiB)>", "ratio to none>", "written (MiB/step)>",
                     "grads equal", "notes"], rows)


def build_parser():
    p = argparse.ArgumentParser(
        description="Step time and peak memory of a GPT training step under each way of holding "
                    "activations (none, ssdtrain, recompute, torch_save, save_on_cpu).")
    m = p.add_argument_group("model (default: ~1.15 GiB of fp32 activations per step)")
    m.add_argument("--d-model", type=int, help=f"default {DEFAULT_MODEL['d_model']}")
    m.add_argument("--n-layers", type=int, help=f"default {DEFAULT_MODEL['n_layers']}")
    m.add_argument("--n-heads", type=int, help=f"default {DEFAULT_MODEL['n_heads']}")
    m.add_argument("--seq-len", type=int, help=f"default {DEFAULT_MODEL['seq_len']}")
    m.add_argument("--batch-size", type=int, help=f"default {DEFAULT_MODEL['batch_size']}")
    m.add_argument("--vocab", type=int, help=f"default {DEFAULT_MODEL['vocab']}")
    m.add_argument("--tiny", action="store_true",
                   help=f"a very small model for the test suite ({TINY_MODEL}); also "
                        f"--min-tensor-kib {TINY_OFFLOAD['min_tensor_kib']} --keep-tail-mib "
                        f"{TINY_OFFLOAD['keep_tail_mib']} unless given")
    r = p.add_argument_group("runs")
    r.add_argument("--steps", type=int, default=3,
                   help="measured steps per run, after 1 warm-up step (default 3)")
    r.add_argument("--warmup", type=int, default=1,
                   help="warm-up steps per run before the measured ones (default 1; give "
                        "the default policy about 12 with --policy auto)")
    r.add_argument("--policy", choices=("static", "auto"), default="static",
                   help="ssdtrain's policy in the ssdtrain modes: 'static' (default: the "
                        "offload path, every step) or 'auto' (the default policy, which "
                        "offloads what the disk absorbs in time)")
    r.add_argument("--repeats", type=int, default=3,
                   help="fresh processes per mode, modes interleaved (default 3)")
    r.add_argument("--modes", nargs="+", choices=ALL_MODES,
                   help=f"modes to run (default {' '.join(MODES)}; with --compute-threads "
                        f"{' '.join(COMPUTE_THREADS_MODES)}); 'none' is needed for ratios")
    r.add_argument("--threads", type=int, default=2,
                   help="torch.set_num_threads in every mode (default 2)")
    r.add_argument("--compute-threads", type=int,
                   help="accelerator analog: also run every mode with torch.set_num_threads(N), "
                        "the other cores left to the I/O threads; reported beside the "
                        "--threads (all-cores) runs")
    r.add_argument("--spill-dir",
                   help="directory for ssdtrain and torch_save (default: a fresh directory under "
                        "the system temp dir, removed at the end)")
    r.add_argument("--max-other-cpu", type=float, default=0.1,
                   help="step times are summarized over steps during which other processes used "
                        "at most this share of the CPUs (default 0.1; 1 keeps every step)")
    r.add_argument("--json", default=DEFAULT_JSON,
                   help="where to write every raw number (default benchmarks/results/"
                        "step_overhead.json)")
    r.add_argument("--trace", metavar="PATH",
                   help="write a Chrome/Perfetto trace (torch.profiler, every thread) of one "
                        "more step of the first repeat of each ssdtrain mode, after its "
                        "measured steps and not counted in them: PATH for 'ssdtrain', "
                        "PATH.<mode>.json for the others (ssdtrain's ranges: docs/guide.md, "
                        "'Seeing ssdtrain in a profiler trace')")
    o = p.add_argument_group("ssdtrain (default: ssdtrain's own defaults / SSDTRAIN_* variables)")
    add_offload_arguments(o, "OffloadConfig.min_tensor_bytes in KiB (also torch_save's "
                             "threshold)")
    add_worker_arguments(p, ALL_MODES)
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.worker:
        worker(args.worker, json.loads(args.worker_config), args.worker_out)
        return 0
    if args.steps < 1 or args.repeats < 1:
        raise SystemExit("step_overhead: --steps and --repeats must be >= 1")

    model = model_from_args(args, TINY_MODEL if args.tiny else DEFAULT_MODEL, TINY_OFFLOAD,
                            args.tiny)
    offload = offload_overrides(args)
    spill_dir, own_spill = work_dir(args.spill_dir, "ssdtrain-bench-", "step_overhead",
                                    "--spill-dir")
    if args.compute_threads is not None and not 1 <= args.compute_threads != args.threads:
        raise SystemExit(f"step_overhead: --compute-threads must be >= 1 and differ from "
                         f"--threads ({args.threads})")
    if args.modes is None:
        args.modes = list(MODES if args.compute_threads is None else COMPUTE_THREADS_MODES)
    thread_counts = [args.threads] + ([args.compute_threads] if args.compute_threads else [])
    cfgs, envs = {}, {}
    for n in thread_counts:
        cfgs[n] = dict(model, steps=args.steps, threads=n, spill_dir=spill_dir, offload=offload,
                       warmup=args.warmup, policy=args.policy)
        env = worker_env(REPO_ROOT)
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"  # freed tensors go back to the OS: RSS is meaningful
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            env[var] = str(n)
        envs[n] = env

    command = command_line()
    fstype, device, mount = filesystem_of(spill_dir)
    machine = {"cpu_count": os.cpu_count(), "cpu_affinity": len(os.sched_getaffinity(0)),
               "python": platform.python_version(), "platform": platform.platform(),
               "spill_dir": spill_dir, "spill_fs": fstype, "spill_device": device,
               "spill_mount": mount}

    traces = _trace_paths(args.trace and os.path.abspath(args.trace), args.modes)
    runs = []
    total = args.repeats * len(args.modes) * len(thread_counts)
    update, write, close = progress(total)
    try:
        for repeat in range(args.repeats):
            # Thread counts alternate (and swap order each repeat), modes interleaved.
            order = thread_counts if repeat % 2 == 0 else thread_counts[::-1]
            for n in order:
                for mode in args.modes:
                    cfg = cfgs[n]
                    if repeat == 0 and n == args.threads and mode in traces:
                        cfg = dict(cfg, trace=traces[mode])
                    result = run_worker(__file__, "step_overhead", mode, repeat, cfg, envs[n])
                    result["compute_threads"] = n
                    runs.append(result)
                    if "error" in result:
                        write(f"repeat {repeat + 1} {mode} ({n} threads): FAILED "
                              f"({result['error']})\n{result['stderr']}")
                    else:
                        st = [x["step_s"] for x in measured(result)]
                        pk = [x["peak_rss_delta"] for x in measured(result)]
                        write(f"repeat {repeat + 1}/{args.repeats} {mode:<14} {n} threads: step "
                              f"{median(st):.3f} s, peak RSS delta {median(pk) / MiB:.0f} MiB "
                              f"({result['wall_s']:.0f} s wall)")
                    update(1)
    finally:
        close()
        if own_spill:
            shutil.rmtree(spill_dir, ignore_errors=True)

    all_runs = runs
    runs = [r for r in all_runs if r["compute_threads"] == args.threads]  # all cores
    ok = [r for r in runs if "error" not in r]
    if ok:
        machine["torch"] = ok[0]["torch"]
        machine["torch_threads"] = ok[0]["threads"]
    summary = summarize(runs, args.modes, args.max_other_cpu)
    targets = check_targets(runs, summary, args.max_other_cpu)
    for mode in args.modes:
        if mode.startswith("ssdtrain") and mode != "ssdtrain":
            targets += check_targets(runs, summary, args.max_other_cpu, mode)
    analog = None
    if args.compute_threads:
        n = args.compute_threads
        aruns = [r for r in all_runs if r["compute_threads"] == n]
        asummary = summarize(aruns, args.modes, args.max_other_cpu)
        atargets = []
        for mode in args.modes:
            if mode.startswith("ssdtrain"):
                atargets += [(f"accelerator analog ({n} compute threads), " + name, value, met)
                             for name, value, met in
                             check_targets(aruns, asummary, args.max_other_cpu, mode,
                                           TARGET_ANALOG_STEP_RATIO)]
        targets += atargets
        analog = {"threads": n, "summary": asummary,
                  "targets": [{"name": a, "value": v, "met": m} for a, v, m in atargets]}
    hwm_ok = all(r.get("hwm_reset_works") for r in all_runs if "error" not in r)
    hwm_ok = all(r.get("hwm_reset_works") for r in ok)

    print(f"## step_overhead: {model['n_layers']} layers, d_model {model['d_model']}, "
          f"{model['n_heads']} heads, seq {model['seq_len']}, batch {model['batch_size']}, "
          f"vocab {model['vocab']}, fp32; {args.steps} measured steps x {args.repeats} repeats")
    print()
    print(render_table(summary, args.modes))
    print()
    if analog is not None:
        print(f"### accelerator analog: torch.set_num_threads({analog['threads']}), the other "
              f"{(os.cpu_count() or 1) - analog['threads']} core(s) left to ssdtrain's I/O "
              f"threads (same steps, modes and repeats)")
        print()
        print(render_table(analog["summary"], args.modes))
        print()
        rows = []
        for mode in args.modes:
            a, b = summary.get(mode, {}), analog["summary"].get(mode, {})
            rows.append([mode, f"{a['step_ratio']:.3f}" if "step_ratio" in a else "-",
                         f"{b['step_ratio']:.3f}" if "step_ratio" in b else "-"])
        print(md_table(["mode", f"ratio to none, {args.threads} threads (all cores)>",
                        f"ratio to none, {analog['threads']} compute threads>"], rows))
        print()
    ref = summary.get("none", {})
    if ref and not ref.get("failed"):
        print(f"Peak RSS delta = VmHWM after forward+backward minus VmRSS before; it includes the "
              f"{ref['param_bytes'] / MiB:.0f} MiB of gradients (zero_grad(set_to_none=True) "
              f"before each step). Medians over the measured steps of all repeats.")
    busy = {m: s["other_cpu_share_median"] for m, s in summary.items() if not s.get("failed")}
    contended = sum(s["measured_steps"] - s["timed_steps"] for s in summary.values()
                    if not s.get("failed"))
    if contended:
        print(f"WARNING: other processes took more than {args.max_other_cpu:.0%} of the CPUs "
              f"during {contended} measured steps (median share per mode: "
              + ", ".join(f"{m} {v:.0%}" for m, v in busy.items()) + "); step times use the "
              "other steps only (where a mode has none, all of its steps, and its times are "
              "unreliable). A quiet machine gives better numbers.")
    if not hwm_ok:
        print("WARNING: resetting VmHWM via /proc/self/clear_refs did not work here; peak RSS "
              "deltas are peaks since process start.")
    print(f"Machine: {machine['cpu_count']} CPUs ({machine['cpu_affinity']} usable), torch "
          f"{machine.get('torch', '?')} with {machine.get('torch_threads', '?')} threads, python "
          f"{machine['python']}, spill_dir {spill_dir} on {fstype or '?'} ({device or '?'})")
    print(f"Command: {command}")
    for r in all_runs:
        if r.get("trace"):
            print(f"Trace ({r['mode']}, one more step after repeat 1): {r['trace']} (open in "
                  f"https://ui.perfetto.dev or chrome://tracing)")
    if targets:
        print()
        print("Targets (ssdtrain modes vs none at the same thread count; reported, not "
              "asserted):")
        for name, value, met in targets:
            verdict = "unknown (contended)" if met is None else "met" if met else "NOT met"
            print(f"- {name}: {value} -> {verdict}")

    return finish("step_overhead", args.json,
                  {"command": command, "machine": machine, "model": model,
                   "steps": args.steps, "repeats": args.repeats, "threads": args.threads,
                   "offload_overrides": offload, "modes": args.modes,
                   "targets": [{"name": n, "value": v, "met": m} for n, v, m in targets],
                   "summary": summary, "compute_threads": analog, "runs": all_runs},
                  [f"{r['mode']}#{r['repeat']}@{r['compute_threads']}" for r in all_runs
                   if "error" in r])


if __name__ == "__main__":
    sys.exit(main())
