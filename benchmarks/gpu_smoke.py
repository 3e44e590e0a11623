#!/usr/bin/env python
"""GPU smoke test: step time and peak device memory of a ~1B-parameter GPT on CUDA.

One command for a GPU owner. Compares, side by side in one run, six ways of
holding the activations autograd saves for backward, on the GPT of
``examples/gpt.py`` in bf16:

* ``none``: plain PyTorch (the reference);
* ``ssdtrain``: ``with ssdtrain.Offloader(...)`` around forward, SSD only (no host
  tier: every offloaded record is written to ``--spill-dir`` and read back from it);
* ``ssdtrain-host``: the host-RAM tier with the SSD beyond it (``host_budget_bytes``
  from ``--host-budget``, NOTE [ Host tier ] in ``ssdtrain/_store/hosttier.py``): records go
  to pinned RAM while the budget allows, the earliest saved on to the SSD;
* ``ssdtrain-ram``: the host tier alone (``host_budget_bytes="unlimited"``, no
  ``spill_dir``: nothing touches the disk). This is the mode to hold against
  ``save_on_cpu``: both keep every offloaded activation in pinned host RAM and free
  its device memory, so they compare at equal memory (the table shows device peak
  and pinned host peak of both to confirm it); ``ssdtrain-host`` holds less in RAM
  and pays the SSD for the rest, so it is not an equal-memory comparison;
* ``save_on_cpu``: ``torch.autograd.graph.save_on_cpu(pin_memory=True)``;
* ``checkpoint``: per-block recomputation (``torch.utils.checkpoint``,
  ``GPTConfig.checkpoint_blocks``).

``--host-budget`` takes what ``OffloadConfig.host_budget_bytes`` takes (``"4GiB"``,
``"auto"``, ``"unlimited"``) or a fraction ``"0.5x"`` (the default) of the bytes the
tier receives per step: a *sizing step* (one forward and backward under an unlimited
host tier with no SSD, before the warm-up) measures those bytes, so that the RAM and
the SSD each take about half at any model size.

The default model (``--d-model 2048 --n-layers 18 --n-heads 16 --seq-len 2048
--vocab 50304``) has ~1.01B parameters; with ``--batch-size 4`` it should need
~16 GiB with no offload (weights and gradients 2 GiB each, ~10 GiB of saved
activations by a count of the saved tensors: an estimate, not measured here), so
it fits one 24 GiB or larger GPU; lower ``--batch-size`` on smaller ones. ``--small``
is a quick try (a few MiB).

Each (mode, repeat) runs in a fresh process (this script with the hidden
``--worker`` flag); modes are interleaved within each repeat. A worker builds
the same seeded model and batch, runs ``--warmup`` steps, then ``--steps``
measured steps of forward + backward (``zero_grad(set_to_none=True)`` first; no
optimizer, so the memory compared is that of activations and gradients). Per
step: wall time between two ``torch.cuda.synchronize()``; peak device memory
(``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``) and its
increase over the memory allocated before the step (activations + gradients);
the host's peak RSS increase (``VmHWM`` reset through ``/proc/self/clear_refs``;
pinned memory from the CUDA driver may not show there); the peak of pinned host memory
handed out by torch's caching host allocator (``torch.cuda.host_memory_stats()``
``active_bytes.peak``, where save_on_cpu's copies and ssdtrain's staging and host tier
live; ``-`` where torch has no such counter or on the CPU); for ssdtrain its ``Stats``
per step (with a host tier: its budget, the peak held in RAM, the bytes loaded back
from RAM and those that went on to the SSD). After
the first measured step a SHA-256 of the loss and of every gradient lets the
parent report bitwise equality with ``none`` (only meaningful when ``none``
itself repeats bitwise across processes: the output says whether it did).
Deterministic algorithms are required (``torch.use_deterministic_algorithms(True)``,
strict, and ``CUBLAS_WORKSPACE_CONFIG=:4096:8``) unless ``--no-deterministic``: with
``warn_only`` a kernel with no deterministic variant would still run and make the
"bitwise equal" column noise. Each worker also compares the digests of its first two
measured steps (same weights, same batch): "deterministic in process" says whether
the mode repeats itself at all.

Without CUDA the script prints why and exits with status 2. (The hidden
``--cpu-dry-run`` runs the same loop on the CPU for the tests; there the ssdtrain modes
run on the loopback device, ``ssdtrain/testing/loopback.py``, which gives CPU tensors the
device path and so the host tier, as a GPU would.)

Example::

    .venv/bin/python benchmarks/gpu_smoke.py --spill-dir /nvme/tmp            # ~1B, bf16
    .venv/bin/python benchmarks/gpu_smoke.py --small --repeats 1               # seconds
    .venv/bin/python benchmarks/gpu_smoke.py --batch-size 2 --modes none ssdtrain
    .venv/bin/python benchmarks/gpu_smoke.py --modes none ssdtrain-ram save_on_cpu
    .venv/bin/python benchmarks/gpu_smoke.py --modes none ssdtrain-host --host-budget 4GiB
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import platform
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for _common, however run
from _common import (  # noqa: E402
    add_offload_arguments, add_worker_arguments, command_line, cuda_unavailable_reason, digest,
    finish, jsonable_config, md_table, measured, median, model_from_args, offload_overrides,
    proc_status, progress, reset_peak_rss, run_worker, stats_delta, work_dir, worker_env)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_JSON = os.path.join(tempfile.gettempdir(), "ssdtrain-gpu_smoke.json")
MODES = ("none", "ssdtrain", "ssdtrain-host", "ssdtrain-ram", "save_on_cpu", "checkpoint",
         "ssdtrain-auto")
# ssdtrain-auto is run only when named: its quota needs warm-up steps (--warmup >= 6).
DEFAULT_MODES = MODES[:-1]
SSDTRAIN_MODES = ("ssdtrain", "ssdtrain-host", "ssdtrain-ram", "ssdtrain-auto")
HOST_TIER_MODES = ("ssdtrain-host", "ssdtrain-ram", "ssdtrain-auto")
DEFAULT_HOST_BUDGET = "0.5x"
GiB = 1 << 30
EXIT_NO_CUDA = 2

# ~1.01B parameters: 12 * L * d^2 in the blocks + (vocab + seq) * d in the embeddings.
DEFAULT_MODEL = dict(vocab=50304, seq_len=2048, d_model=2048, n_heads=16, n_layers=18,
                     batch_size=4)
SMALL_MODEL = dict(vocab=1024, seq_len=256, d_model=256, n_heads=4, n_layers=2, batch_size=2)
# --small also offloads everything (its tensors are ~0.5 MiB, near the 256 KiB default).
SMALL_OFFLOAD = dict(min_tensor_kib=4, keep_tail_mib=0)

MODE_NOTES = {
    "none": "reference: no hooks",
    "ssdtrain": "SSD only",
    "ssdtrain-auto": "policy auto (offload what the tiers absorb in time), host tier 'auto' "
                     "budget, SSD beyond",
    "save_on_cpu": "pinned host copies of every saved tensor (host RAM is the tier)",
    "checkpoint": "per-block torch.utils.checkpoint: forward runs twice",
}


def count_parameters(m):
    """Parameters of ``examples/gpt.py``'s GPT with tied embeddings and ``mlp_ratio`` 4."""
    d, n_layers = m["d_model"], m["n_layers"]
    per_block = 12 * d * d + 13 * d  # qkv, proj, 2 MLP matrices; their biases; 2 LayerNorms
    return n_layers * per_block + (m["vocab"] + m["seq_len"]) * d + 2 * d


# --------------------------------------------------------------------------- host memory
class _Cuda:
    """Device clock and memory counters on CUDA."""

    name = "cuda"

    def __init__(self):
        import torch
        self.torch = torch
        self.device = torch.device("cuda")

    def sync(self):
        self.torch.cuda.synchronize()

    def reset_peak(self):
        self.torch.cuda.reset_peak_memory_stats()

    def allocated(self):
        return self.torch.cuda.memory_allocated()

    def peak(self):
        return self.torch.cuda.max_memory_allocated()

    def reset_host_peak(self):
        reset = getattr(self.torch.cuda, "reset_peak_host_memory_stats", None)
        if reset is not None:
            reset()

    def host_peak(self):
        """Peak bytes of pinned host memory handed out since :meth:`reset_host_peak`
        (torch's caching host allocator, rounded blocks); None where torch cannot say."""
        stats = getattr(self.torch.cuda, "host_memory_stats", None)
        if stats is None:
            return None
        return stats().get("active_bytes.peak")

    def describe(self):
        p = self.torch.cuda.get_device_properties(0)
        return {"name": p.name, "total_memory": p.total_memory,
                "capability": f"{p.major}.{p.minor}", "cuda": self.torch.version.cuda}


class _CpuDryRun(_Cuda):
    """The same loop on CPU, for testing this script where no GPU exists (RSS as memory)."""

    name = "cpu (dry run)"

    def __init__(self):
        import torch
        self.torch = torch
        self.device = torch.device("cpu")

    def sync(self):
        pass

    def reset_peak(self):
        reset_peak_rss(ignore_errors=True)

    def allocated(self):
        return proc_status("VmRSS")["VmRSS"]

    def peak(self):
        return proc_status("VmHWM")["VmHWM"]

    def reset_host_peak(self):
        pass

    def host_peak(self):
        return None  # nothing is pinned on the CPU

    def describe(self):
        return {"name": "cpu (dry run: memory columns are host RSS)"}


def parse_host_budget(text):
    """``--host-budget``: ``{"fraction": f}`` for ``"<f>x"`` (of the bytes the host tier
    receives per step, measured by the sizing step), else ``{"bytes": value}`` with a
    value ``OffloadConfig.host_budget_bytes`` accepts (validated by it).

    Raises:
        ValueError: what is wrong and what is accepted.
    """
    t = str(text).strip().lower()
    if t.endswith("x"):
        try:
            f = float(t[:-1])
        except ValueError:
            f = float("nan")
        if not 0 <= f <= 1e6:  # NaN fails too
            raise ValueError(f"--host-budget {text!r}: a fraction of the bytes the host tier "
                             f"receives per step must be a number >= 0 followed by 'x', such "
                             f"as 0.5x")
        return {"fraction": f}
    import ssdtrain
    try:
        cfg = ssdtrain.OffloadConfig(host_budget_bytes=t if t in ("auto", "unlimited") else text)
    except ssdtrain.ConfigError as e:
        raise ValueError(f"--host-budget {text!r}: {e} (or a fraction such as 0.5x)") from None
    return {"bytes": cfg.host_budget_bytes}


# ----------------------------------------------------------------------------------- worker
def worker(mode, cfg, out_path):
    """One process, one mode: warm-up + measured steps; a JSON result to ``out_path``."""
    import torch
    sys.path.insert(0, os.path.join(REPO_ROOT, "examples"))
    from gpt import GPT, GPTConfig, make_batch  # noqa: E402
    import ssdtrain

    dev = _CpuDryRun() if cfg["cpu_dry_run"] else _Cuda()
    if cfg["deterministic"]:  # strict: a kernel with no deterministic variant raises
        torch.use_deterministic_algorithms(True)
    result = {"mode": mode, "repeat": cfg["repeat"], "pid": os.getpid(),
              "torch": torch.__version__, "device": dev.describe(), "steps": []}
    model_cfg = GPTConfig(vocab_size=cfg["vocab"], seq_len=cfg["seq_len"], d_model=cfg["d_model"],
                          n_heads=cfg["n_heads"], n_layers=cfg["n_layers"],
                          checkpoint_blocks=(mode == "checkpoint"))
    dtype = getattr(torch, cfg["dtype"])
    torch.manual_seed(0)
    with dev.device:  # initialise on the device: a 1B model inits in seconds there
        model = GPT(model_cfg).to(dtype)
    idx, targets = make_batch(model_cfg, cfg["batch_size"], torch.Generator().manual_seed(1))
    idx, targets = idx.to(dev.device), targets.to(dev.device)
    result["param_count"] = sum(p.numel() for p in model.parameters())
    result["param_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())

    def one_step(context):
        with context():
            loss = model(idx, targets)
        loss.backward()
        return loss

    off = None
    if mode in SSDTRAIN_MODES:
        budget = cfg["host_budget"]
        if mode == "ssdtrain-host" and "fraction" in budget:
            # The sizing step (module docstring): what the tier receives per step.
            probe = _offloader(ssdtrain, "ssdtrain-ram", cfg, None)
            try:
                model.zero_grad(set_to_none=True)
                one_step(lambda: probe)
                probe.wait()
                sized = probe.stats().offloaded_bytes
            finally:
                probe.close()
            result["host_budget_sized_from"] = sized
            budget = {"bytes": int(budget["fraction"] * sized)}
        off = _offloader(ssdtrain, mode, cfg, budget.get("bytes"))
        result["engine"] = off.stats().engine
        result["offload_config"] = jsonable_config(off.config)
        result["host_budget_bytes"] = off.config.host_budget_bytes
        context = lambda: off  # noqa: E731
    elif mode == "save_on_cpu":
        pin = dev.name == "cuda"
        context = lambda: torch.autograd.graph.save_on_cpu(pin_memory=pin)  # noqa: E731
    elif mode in ("none", "checkpoint"):
        context = contextlib.nullcontext
    else:
        raise SystemExit(f"gpu_smoke: unknown mode {mode!r}; choose from {MODES}")

    try:
        for step in range(cfg["warmup"] + cfg["steps"]):
            model.zero_grad(set_to_none=True)
            gc.collect()
            rec = {"step": step, "warmup": step < cfg["warmup"]}
            stats0 = dataclasses.asdict(off.stats()) if off is not None else None
            dev.sync()
            dev.reset_peak()
            dev.reset_host_peak()
            reset_peak_rss(ignore_errors=True)
            mem0 = dev.allocated()
            rss0 = proc_status("VmRSS")["VmRSS"]
            t0 = time.perf_counter()
            loss = one_step(context)
            dev.sync()
            rec["step_s"] = time.perf_counter() - t0
            peak = dev.peak()
            rec.update(mem_before=mem0, peak_mem=peak, peak_mem_delta=peak - mem0,
                       host_peak_rss_delta=proc_status("VmHWM")["VmHWM"] - rss0,
                       host_pinned_peak=dev.host_peak())
            if off is not None:
                rec["stats"] = stats_delta(dataclasses.asdict(off.stats()), stats0)
            if step == cfg["warmup"]:
                result["digest"] = digest(loss, sorted(model.named_parameters()))
            elif step == cfg["warmup"] + 1:  # same weights and batch: must repeat bitwise
                again = digest(loss, sorted(model.named_parameters()))
                result["repeats_in_process"] = again["sha256"] == result["digest"]["sha256"]
            del loss
            result["steps"].append(rec)
        if off is not None:
            off.wait()
            result["final_stats"] = dataclasses.asdict(off.stats())
    except torch.cuda.OutOfMemoryError as e:
        result["oom"] = str(e).splitlines()[0]
    finally:
        if off is not None:
            off.close()
    with open(out_path, "w") as f:
        json.dump(result, f)


def _offloader(ssdtrain, mode, cfg, host_budget):
    """The :class:`ssdtrain.Offloader` of an ssdtrain mode: SSD only, the host tier with
    the SSD beyond (``host_budget`` bytes, ``"auto"`` or ``"unlimited"``), or the host
    tier alone (unlimited, no ``spill_dir``). ``SSDTRAIN_*`` variables apply, except
    those the mode is defined by. In a CPU dry run a loopback device is attached, so the
    model's CPU tensors take the device path (and the host tier) as CUDA tensors do."""
    overrides = {k: v for k, v in cfg["offload"].items() if v is not None}
    if "SSDTRAIN_POLICY" not in os.environ:  # the offload path, every step
        overrides.setdefault("policy", "static")
    if mode == "ssdtrain":
        overrides.update(spill_dir=cfg["spill_dir"], host_budget_bytes=None)
    elif mode == "ssdtrain-host":
        overrides.update(spill_dir=cfg["spill_dir"], host_budget_bytes=host_budget)
    elif mode == "ssdtrain-ram":
        overrides.update(spill_dir=None, host_budget_bytes="unlimited")
    elif mode == "ssdtrain-auto":
        overrides.update(spill_dir=cfg["spill_dir"], host_budget_bytes="auto", policy="auto")
    else:
        raise SystemExit(f"gpu_smoke: {mode!r} is not an ssdtrain mode; please report")
    off = ssdtrain.Offloader(ssdtrain.OffloadConfig.from_env(**overrides))
    if cfg["cpu_dry_run"]:
        from ssdtrain.tools import LoopbackDevice, attach_loopback
        attach_loopback(off, LoopbackDevice(claim_host_tensors=True, capacity=1 << 40))
    return off


# ----------------------------------------------------------------------------------- parent
def summarize(runs, modes):
    """Per mode: medians over the measured steps of every repeat; ratios to ``none``."""
    by_mode = {m: [r for r in runs if r["mode"] == m and "error" not in r] for m in modes}
    ref_digests = {r["repeat"]: r["digest"]["sha256"] for r in by_mode.get("none", [])
                   if "digest" in r}
    reference_repeats = len(set(ref_digests.values())) <= 1 if ref_digests else None
    summary = {}
    for mode, rs in by_mode.items():
        ooms = [r["oom"] for r in rs if "oom" in r]
        steps = [s for r in rs if "oom" not in r for s in measured(r)]
        if not steps:
            summary[mode] = {"failed": True, "oom": ooms[0] if ooms else None}
            continue
        s = {"step_s_median": median([x["step_s"] for x in steps]),
             "repeat_step_s_medians": [median([x["step_s"] for x in measured(r)])
                                       for r in rs if "oom" not in r],
             "peak_mem_median": median([x["peak_mem"] for x in steps]),
             "peak_mem_delta_median": median([x["peak_mem_delta"] for x in steps]),
             "host_peak_rss_delta_median": median([x["host_peak_rss_delta"] for x in steps]),
             "host_pinned_peak_median": _median_or_none([x.get("host_pinned_peak")
                                                         for x in steps]),
             "param_count": rs[0]["param_count"], "param_bytes": rs[0]["param_bytes"],
             "measured_steps": len(steps), "oom_runs": len(ooms)}
        digests = [(r["digest"]["sha256"], ref_digests.get(r["repeat"])) for r in rs
                   if "digest" in r]
        if mode == "none":
            s["grads_equal"] = reference_repeats
        else:
            s["grads_equal"] = bool(digests) and all(d == ref for d, ref in digests)
        in_process = [r["repeats_in_process"] for r in rs if "repeats_in_process" in r]
        s["deterministic_in_process"] = all(in_process) if in_process else None
        if mode in SSDTRAIN_MODES:
            st = [x["stats"] for x in steps]
            s.update(engine=rs[0].get("engine", ""),
                     offloaded_bytes_per_step=median([x["offloaded_bytes"] for x in st]),
                     kept_bytes_per_step=median([x["kept_bytes"] for x in st]),
                     bytes_written_per_step=median([x["bytes_written"] for x in st]),
                     stall_s_median=median([x["stall_seconds"] for x in st]),
                     prefetch_misses_median=median([x["prefetch_misses"] for x in st]))
        if mode == "ssdtrain-auto":
            s.update(offload_quota_bytes_median=median([x["offload_quota_bytes"] or 0
                                                        for x in st]),
                     offload_quota_reason=rs[0].get("final_stats", {}).get(
                         "offload_quota_reason", ""))
        if mode in HOST_TIER_MODES:
            # peak_host_bytes is a maximum since the offloader began: its largest value
            # over the measured steps is the most any of them held in RAM.
            s.update(host_budget_bytes=rs[0].get("host_budget_bytes"),
                     host_budget_sized_from=rs[0].get("host_budget_sized_from"),
                     peak_host_bytes=max(x["peak_host_bytes"] for x in st),
                     host_loaded_bytes_per_step=median([x["host_loaded_bytes"] for x in st]),
                     host_spilled_bytes_per_step=median([x["host_spilled_bytes"] for x in st]),
                     over_budget_bytes_per_step=median([x["over_budget_bytes"] for x in st]))
        summary[mode] = s
    ref = summary.get("none", {})
    for mode, s in summary.items():
        if s.get("failed") or not ref or ref.get("failed"):
            continue
        s["step_ratio"] = s["step_s_median"] / ref["step_s_median"]
        s["memory_ratio"] = (s["peak_mem_delta_median"] / ref["peak_mem_delta_median"]
                             if ref["peak_mem_delta_median"] > 0 else float("nan"))
    return summary, reference_repeats


def _median_or_none(xs):
    xs = [x for x in xs if x is not None]
    return median(xs) if xs else None


def host_tier_verdict(summary):
    """One line: the host tier alone (``ssdtrain-ram``) against ``save_on_cpu``, both
    holding the offloaded activations in pinned host RAM (equal memory; the device and
    pinned host peaks are given so that a reader can check it). Says "not measured" when
    either mode did not run or failed."""
    ram, soc = (summary or {}).get("ssdtrain-ram"), (summary or {}).get("save_on_cpu")
    missing = [m for m, s in (("ssdtrain-ram", ram), ("save_on_cpu", soc))
               if s is None or s.get("failed")]
    if missing:
        return (f"host tier vs save_on_cpu: not measured ({' and '.join(missing)}: not run "
                f"or failed)")
    ratio = ram["step_s_median"] / soc["step_s_median"]
    word = "faster than" if ratio < 1 else "slower than" if ratio > 1 else "as fast as"

    def pinned(s):
        v = s.get("host_pinned_peak_median")
        return "not measured" if v is None else _gib(v)
    return (f"host tier vs save_on_cpu: ssdtrain-ram step {ram['step_s_median']:.3f} s, "
            f"save_on_cpu {soc['step_s_median']:.3f} s: ratio {ratio:.3f} ({word} "
            f"save_on_cpu); step peak over start {_gib(ram['peak_mem_delta_median'])} vs "
            f"{_gib(soc['peak_mem_delta_median'])}, pinned host peak {pinned(ram)} vs "
            f"{pinned(soc)}, grads equal to none: "
            f"{_YES_NO[ram['grads_equal']]} / {_YES_NO[soc['grads_equal']]}")


_YES_NO = {True: "yes", False: "NO", None: "?"}


def _gib(n):
    """A byte count for the notes: GiB, or MiB below 1 GiB (a --small run's sizes)."""
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / (1 << 20):.2f} MiB"


def _notes(mode, s):
    if s.get("failed"):
        return f"OUT OF MEMORY: {s['oom']}" if s.get("oom") else "FAILED (see stderr / JSON)"
    notes = []
    if mode in SSDTRAIN_MODES:
        notes.append(f"{MODE_NOTES[mode]}; " if mode in MODE_NOTES else "")
        notes[-1] += (f"{s['engine']}; offloaded {_gib(s['offloaded_bytes_per_step'])}/step"
                      f", kept {_gib(s['kept_bytes_per_step'])}/step, written to the SSD "
                      f"{_gib(s['bytes_written_per_step'])}/step; stall "
                      f"{s['stall_s_median']:.3f} s/step; {s['prefetch_misses_median']:.0f} "
                      f"prefetch misses/step")
        if mode in HOST_TIER_MODES:
            from ssdtrain.tools import MAX_BYTES  # what "unlimited" resolves to
            budget = s["host_budget_bytes"]
            sized = s.get("host_budget_sized_from")
            notes.append(
                "host tier budget " + ("unlimited" if budget >= MAX_BYTES else _gib(budget))
                + (f" ({budget / sized:.2f}x of {_gib(sized)}/step)" if sized else "")
                + f": peak in RAM {_gib(s['peak_host_bytes'])}, loaded from RAM "
                f"{_gib(s['host_loaded_bytes_per_step'])}/step, on to the SSD "
                f"{_gib(s['host_spilled_bytes_per_step'])}/step"
                + (f", kept on the device over the budget "
                   f"{_gib(s['over_budget_bytes_per_step'])}/step"
                   if s["over_budget_bytes_per_step"] else ""))
        if mode == "ssdtrain-auto":
            notes.append(f"quota {_gib(s['offload_quota_bytes_median'])}/step: "
                         f"{s['offload_quota_reason']}")
        if s["offloaded_bytes_per_step"] == 0:
            notes.append("NOTHING OFFLOADED: every saved tensor was kept in memory (all "
                         "below min_tensor_bytes or within keep_tail_bytes?)")
    else:
        notes.append(MODE_NOTES[mode])
    reps = s["repeat_step_s_medians"]
    notes.append(f"repeat medians {min(reps):.3f}-{max(reps):.3f} s")
    if s["oom_runs"]:
        notes.append(f"{s['oom_runs']} runs out of memory")
    return "; ".join(notes)


TABLE = ["mode", "step time median (s)>", "ratio to none>", "peak device memory (GiB)>",
         "step peak over start (GiB)>", "ratio to none>", "host peak RSS delta (GiB)>",
         "pinned host peak (GiB)>", "grads equal", "deterministic in process", "notes"]


def render_table(summary, modes):
    rows = []
    for mode in modes:
        s = summary.get(mode, {"failed": True})
        if s.get("failed"):
            rows.append([mode] + ["-"] * 9 + [_notes(mode, s)])
            continue
        pinned = s.get("host_pinned_peak_median")
        rows.append([mode, f"{s['step_s_median']:.3f}",
                     f"{s['step_ratio']:.3f}" if "step_ratio" in s else "-",
                     f"{s['peak_mem_median'] / GiB:.2f}", f"{s['peak_mem_delta_median'] / GiB:.2f}",
                     f"{s['memory_ratio']:.3f}" if "memory_ratio" in s else "-",
                     f"{s['host_peak_rss_delta_median'] / GiB:.2f}",
                     "-" if pinned is None else f"{pinned / GiB:.2f}",
                     _YES_NO[s["grads_equal"]], _YES_NO[s.get("deterministic_in_process")],
                     _notes(mode, s)])
    return md_table(TABLE, rows)


def build_parser():
    p = argparse.ArgumentParser(
        description="Step time and peak GPU memory of a ~1B-parameter bf16 GPT on CUDA with no "
                    "offload, ssdtrain (SSD only, host RAM then SSD, host RAM only), "
                    "save_on_cpu and checkpointing. Exits 2 without CUDA.")
    m = p.add_argument_group("model (default ~1.01B parameters, bf16)")
    for key in ("d_model", "n_layers", "n_heads", "seq_len", "batch_size", "vocab"):
        m.add_argument("--" + key.replace("_", "-"), type=int,
                       help=f"default {DEFAULT_MODEL[key]} ({SMALL_MODEL[key]} with --small)")
    m.add_argument("--small", action="store_true",
                   help=f"a small model for a quick try ({SMALL_MODEL}); also --min-tensor-kib "
                        f"{SMALL_OFFLOAD['min_tensor_kib']} --keep-tail-mib "
                        f"{SMALL_OFFLOAD['keep_tail_mib']} unless given")
    m.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                   help="parameter and activation dtype (default bfloat16)")
    r = p.add_argument_group("runs")
    r.add_argument("--steps", type=int, default=3, help="measured steps per run (default 3)")
    r.add_argument("--warmup", type=int, default=1, help="warm-up steps per run (default 1)")
    r.add_argument("--repeats", type=int, default=2,
                   help="fresh processes per mode, modes interleaved (default 2)")
    r.add_argument("--modes", nargs="+", choices=MODES, default=list(DEFAULT_MODES),
                   help="modes to run (default all but ssdtrain-auto); 'none' is needed "
                        "for ratios")
    r.add_argument("--spill-dir",
                   help="directory on the NVMe for ssdtrain (default: a fresh directory under "
                        "the system temp dir, removed at the end)")
    r.add_argument("--host-budget", default=DEFAULT_HOST_BUDGET,
                   help="host_budget_bytes of the ssdtrain-host mode: a byte size (4GiB), "
                        "'auto', 'unlimited', or a fraction of the bytes the host tier "
                        "receives per step such as 0.5x, measured by a sizing step before "
                        f"the warm-up (default {DEFAULT_HOST_BUDGET})")
    r.add_argument("--no-deterministic", dest="deterministic", action="store_false",
                   help="do not request deterministic algorithms (grads then may differ "
                        "between processes even without offloading)")
    r.add_argument("--json", default=DEFAULT_JSON,
                   help="where to write every raw number (default: ssdtrain-gpu_smoke.json in "
                        "the system temp dir)")
    o = p.add_argument_group("ssdtrain (default: ssdtrain's defaults / SSDTRAIN_* variables)")
    add_offload_arguments(o)
    o.add_argument("--engine", help="OffloadConfig.engine")
    p.add_argument("--cpu-dry-run", action="store_true", help=argparse.SUPPRESS)
    add_worker_arguments(p, MODES)
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.worker:
        worker(args.worker, json.loads(args.worker_config), args.worker_out)
        return 0
    if not args.cpu_dry_run:
        why = cuda_unavailable_reason()
        if why:
            print(f"gpu_smoke: CUDA is not available: {why}. This script measures step time and "
                  f"GPU memory on a CUDA GPU; run it on a machine with one. (On CPU, "
                  f"benchmarks/step_overhead.py measures the same comparison.)", file=sys.stderr)
            return EXIT_NO_CUDA
    if args.steps < 1 or args.repeats < 1 or args.warmup < 0:
        raise SystemExit("gpu_smoke: --steps and --repeats must be >= 1, --warmup >= 0")
    if "ssdtrain-auto" in args.modes and args.warmup < 6:
        print("gpu_smoke: warning: ssdtrain-auto offloads nothing in its first 2 steps and "
              "adjusts its quota over the next few; with --warmup below 6 its measured "
              "steps include those", file=sys.stderr)
    try:
        host_budget = parse_host_budget(args.host_budget)
    except ValueError as e:
        build_parser().error(str(e))  # exit status 2, argparse style

    model = model_from_args(args, SMALL_MODEL if args.small else DEFAULT_MODEL, SMALL_OFFLOAD,
                            args.small)
    if model["d_model"] % model["n_heads"]:
        raise SystemExit("gpu_smoke: --d-model must be divisible by --n-heads")
    offload = dict(offload_overrides(args), engine=args.engine)
    spill_dir, own_spill = work_dir(args.spill_dir, "ssdtrain-gpu-smoke-", "gpu_smoke",
                                    "--spill-dir")
    cfg = dict(model, steps=args.steps, warmup=args.warmup, dtype=args.dtype,
               spill_dir=spill_dir, offload=offload, deterministic=args.deterministic,
               cpu_dry_run=args.cpu_dry_run, host_budget=host_budget)
    env = worker_env(REPO_ROOT)
    if args.deterministic:
        env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
    command = command_line()

    runs = []
    total = args.repeats * len(args.modes)
    update, write, _ = progress(total, use_tqdm=False)
    try:
        for repeat in range(args.repeats):
            for mode in args.modes:
                result = run_worker(__file__, "gpu_smoke", mode, repeat, cfg, env)
                runs.append(result)
                if "error" in result:
                    write(f"repeat {repeat + 1} {mode}: FAILED ({result['error']})\n"
                          f"{result['stderr']}")
                elif "oom" in result:
                    write(f"repeat {repeat + 1} {mode}: out of memory")
                else:
                    st = [x["step_s"] for x in measured(result)]
                    pk = [x["peak_mem"] for x in measured(result)]
                    write(f"repeat {repeat + 1}/{args.repeats} {mode:<13} step "
                          f"{median(st):.3f} s, peak {median(pk) / GiB:.2f} GiB "
                          f"({result['wall_s']:.0f} s wall)")
                update(1)
    finally:
        if own_spill:
            shutil.rmtree(spill_dir, ignore_errors=True)

    summary, reference_repeats = summarize(runs, args.modes)
    ok = [r for r in runs if "error" not in r]
    device = ok[0]["device"] if ok else {}
    params = count_parameters(model)
    size = f"{params / 1e9:.2f}B" if params >= 1e8 else f"{params / 1e6:.1f}M"
    print(f"## gpu_smoke: GPT {size} parameters ({model['n_layers']} layers, "
          f"d_model {model['d_model']}, {model['n_heads']} heads, seq {model['seq_len']}, "
          f"batch {model['batch_size']}, vocab {model['vocab']}), {args.dtype}; "
          f"{args.steps} measured steps x {args.repeats} repeats on {device.get('name', '?')}")
    print()
    print(render_table(summary, args.modes))
    print()
    print("Step peak over start = max_memory_allocated during forward+backward minus "
          "memory_allocated before it (activations + gradients; no optimizer). Medians over the "
          "measured steps of all repeats.")
    print(host_tier_verdict(summary))
    if reference_repeats is False:
        print("NOTE: 'none' itself gave different gradients in different processes "
              "(non-deterministic kernels), so 'grads equal' cannot show bitwise equality here.")
    print(f"Machine: {platform.platform()}, python {platform.python_version()}, torch "
          f"{ok[0]['torch'] if ok else '?'}, device {json.dumps(device)}, spill_dir {spill_dir}")
    print(f"Command: {command}")
    return finish("gpu_smoke", args.json,
                  {"command": command, "model": model, "param_count": params,
                   "dtype": args.dtype, "steps": args.steps, "warmup": args.warmup,
                   "repeats": args.repeats, "modes": args.modes, "offload_overrides": offload,
                   "host_budget": args.host_budget,
                   "host_tier_vs_save_on_cpu": host_tier_verdict(summary),
                   "reference_repeats_bitwise": reference_repeats, "device": device,
                   "summary": summary, "runs": runs},
                  [f"{r['mode']}#{r['repeat']}" for r in runs if "error" in r])


if __name__ == "__main__":
    sys.exit(main())
