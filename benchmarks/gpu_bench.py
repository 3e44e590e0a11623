#!/usr/bin/env python
"""``make gpu-bench``: ssdtrain against checkpointing and the peers on one CUDA GPU.

Two tables, one worker process each (this script with the hidden ``--worker``
flag), every row measured in the same process as its reference:

**Table A**, the ~1B GPT of ``benchmarks/gpu_smoke.py`` (batch 4, seq 2048, bf16;
``examples/gpt.py``), forward + backward, no optimizer:

* ``none``: plain PyTorch, the reference;
* ``checkpoint``: every block recomputed (``torch.utils.checkpoint``, non-reentrant);
* ``sac``: PyTorch's selective activation checkpointing
  (``create_selective_checkpoint_contexts``) with the policy its documentation
  recommends: matrix multiplications and attention saved, everything else recomputed;
* ``save_on_cpu``: ``torch.autograd.graph.save_on_cpu(pin_memory=True)``;
* ``default``: ``ssdtrain.Offloader`` as a user gets it (``policy="auto"``) with a host
  tier (``host_budget_bytes="auto"``) and the SSD beyond it; its warm-up is
  ``--auto-warmup`` steps, so the quota has settled;
* ``offload_all``: every saved tensor to pinned host RAM (``policy="static"``, host
  tier unlimited, no SSD);
* ``budget``: ``policy="adaptive"`` with ``memory_budget_bytes`` set so that the step's
  peak over its start is at most 0.75x and 0.5x of ``none``'s, and at most
  ``checkpoint``'s (the ``budget`` column: ``0.75x``, ``0.5x``, ``checkpoint``). The
  budget counts saved activations only: what ``none``'s peak holds besides them
  (gradients, temporaries; its peak over start minus the bytes of the activations it
  saved, counted by a saved-tensor hook in one extra step) is subtracted from the
  target peak.

**Table B**, a Llama-3-8B-shaped stack (``examples/llama.py``: hidden 4096, 32 heads,
8 KV heads, SwiGLU 14336, bf16, base weights frozen, LoRA on q and v, a loss with no
LM head), ``--b-layers`` layers at batch 1 and each ``--b-seq``, every layer recomputed
in backward:

* ``checkpoint``: the layers' inputs stay in GPU memory (the reference);
* ``checkpoint_offload_sync``: the inputs copied to pinned RAM synchronously on the
  compute stream and back when needed (``save_on_cpu`` around the checkpointed
  layers: what transformers' ``offload`` does);
* ``ssdtrain_ram``: the checkpointed layers inside ``ssdtrain.Offloader``: the inputs go
  to pinned RAM on ssdtrain's copy stream while the next layer runs and are
  prefetched in backward (``policy="static"``, host tier unlimited, no SSD; the last
  ``keep_tail_bytes`` of forward stay on the device);
* ``ssdtrain_ssd``: the same with no host tier: the inputs go to ``--spill-dir``.

Per row: warm-up steps, then ``--steps`` measured ones; the step time (wall between two
``torch.cuda.synchronize()``), its median; the peak device memory
(``max_memory_allocated``) and its increase over the step's start; bitwise equality
of the loss and of every gradient with the table's reference at the first measured
step (``exact``; deterministic algorithms are required unless ``--no-deterministic``).
Rows past ``--budget-s`` (the whole run's wall clock) are not started and are listed
as skipped; a row that runs out of memory is listed as such.

Writes ``gpu_bench_<date>.md`` and ``gpu_bench_<date>.json`` into ``--out``. The JSON
is read by automation: ``{"device", "date", "rows": [{"table", "mode", "budget",
"step_s", "peak_gib", "exact"}], "free_bound_gib", "default_offloaded_gib"}`` (table B
rows also carry ``seq``), plus ``details`` (everything else measured), ``missing``
(rows not measured and why) and ``command``. ``free_bound_gib`` is what the default's
own controller measured the tiers can take in forward and give back in backward
(``Stats.offload_bound_bytes``); ``default_offloaded_gib`` the median bytes it
offloaded per measured step.

Without CUDA the script says why and exits 2. The hidden ``--cpu-dry-run`` runs both
tables on the CPU with small shapes (ssdtrain's rows on the loopback device,
``ssdtrain/testing/loopback.py``, so they take the device path): the tests run it.

Example::

    make gpu-bench                                   # after make gpu-check
    python benchmarks/gpu_bench.py --out /tmp/bench --b-seq 32768 65536 --spill-dir /nvme/tmp
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import gc
import json
import os
import platform
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for _common, however run
from _common import (  # noqa: E402
    add_worker_arguments, command_line, cuda_unavailable_reason, digest, md_table, median,
    proc_status, reset_peak_rss, spawn_worker, work_dir, worker_env)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 1 << 30
MiB = 1 << 20
EXIT_NO_CUDA = 2
TABLES = ("A", "B")
A_ROWS = (("none", None), ("checkpoint", None), ("sac", None), ("save_on_cpu", None),
          ("offload_all", None), ("default", None), ("budget", "0.75x"), ("budget", "0.5x"),
          ("budget", "checkpoint"))
B_ROWS = ("checkpoint", "checkpoint_offload_sync", "ssdtrain_ram", "ssdtrain_ssd")
A_MODEL = dict(vocab=50304, seq_len=2048, d_model=2048, n_heads=16, n_layers=18, batch_size=4)
A_MODEL_DRY = dict(vocab=512, seq_len=128, d_model=128, n_heads=4, n_layers=3, batch_size=2)
B_MODEL_DRY = dict(hidden=128, n_heads=4, n_kv_heads=2, ffn=256)
B_SEQ_DRY = 256
# Small shapes in the dry run: offload what the small tensors are.
DRY_OFFLOAD = dict(min_tensor_bytes=4096, keep_tail_bytes=0)


# ----------------------------------------------------------------------------------- worker
class _Device:
    """Clock and memory counters: CUDA, or the CPU's RSS in a dry run."""

    def __init__(self, dry):
        import torch
        self.torch, self.dry = torch, dry
        self.device = torch.device("cpu" if dry else "cuda")

    def sync(self):
        if not self.dry:
            self.torch.cuda.synchronize()

    def reset_peak(self):
        if self.dry:
            reset_peak_rss(ignore_errors=True)
        else:
            self.torch.cuda.reset_peak_memory_stats()

    def allocated(self):
        return proc_status("VmRSS")["VmRSS"] if self.dry else self.torch.cuda.memory_allocated()

    def peak(self):
        return proc_status("VmHWM")["VmHWM"] if self.dry else \
            self.torch.cuda.max_memory_allocated()

    def free(self):
        gc.collect()
        if not self.dry:
            self.torch.cuda.empty_cache()

    def name(self):
        if self.dry:
            return "cpu (dry run: memory columns are host RSS)"
        return self.torch.cuda.get_device_properties(0).name

    def copy_rates(self, nbytes):
        """Bytes/s of one device-to-pinned-host copy and back (the copy engines)."""
        torch = self.torch
        src = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=not self.dry)
        rates = []
        for a, b in ((dst, src), (src, dst)):
            best = None
            for _ in range(3):
                self.sync()
                t0 = time.perf_counter()
                a.copy_(b, non_blocking=True)
                self.sync()
                t = time.perf_counter() - t0
                best = t if best is None else min(best, t)
            rates.append(nbytes / best)
        return rates


def _sac_context():
    """``context_fn`` for PyTorch's selective checkpointing with the policy its
    documentation recommends: save matrix multiplications and attention (costly to
    recompute), recompute the rest."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_flash_attention_for_cpu")
    save = {getattr(aten, n).default for n in names if hasattr(aten, n)}

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE
    return functools.partial(create_selective_checkpoint_contexts, policy)


@contextlib.contextmanager
def _wrapped_blocks(blocks, context_fn=None):
    """Run every block through non-reentrant checkpointing while inside."""
    from torch.utils.checkpoint import checkpoint
    for block in blocks:
        original = block.forward
        extra = {} if context_fn is None else {"context_fn": context_fn}
        block.forward = functools.partial(
            lambda f, *a, **k: checkpoint(f, *a, use_reentrant=False, **extra, **k), original)
    try:
        yield
    finally:
        for block in blocks:
            del block.forward


class _SavedBytes:
    """Saved-tensor hooks that count the distinct storages autograd saves (not parameters)."""

    def __init__(self, params):
        import torch
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.seen, self.nbytes = set(), 0
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    def pack(self, t):
        s = t.untyped_storage()
        if s.data_ptr() not in self.params and s.data_ptr() not in self.seen:
            self.seen.add(s.data_ptr())
            self.nbytes += s.nbytes()
        return t


def _offloader(ssdtrain, dev, cfg, **overrides):
    if dev.dry:
        overrides = dict(DRY_OFFLOAD, **overrides)
    off = ssdtrain.Offloader(ssdtrain.OffloadConfig.from_env(**overrides))
    if dev.dry:
        from ssdtrain.tools import LoopbackDevice, attach_loopback
        attach_loopback(off, LoopbackDevice(claim_host_tensors=True, capacity=1 << 40))
    return off


def _run_row(dev, row, step_fn, context, warmup, steps, named_params, off=None):
    """Warm-up and measured steps of one row; fills ``row`` (times, peaks, digests)."""
    row.update(step_s=[], peak=[], peak_delta=[], stats=[])
    for i in range(warmup + steps):
        for _, p in named_params:
            p.grad = None
        gc.collect()
        before = off.stats() if off is not None else None
        dev.sync()
        dev.reset_peak()
        start = dev.allocated()
        t0 = time.perf_counter()
        with context():
            loss = step_fn()
        loss.backward()
        dev.sync()
        t = time.perf_counter() - t0
        if i < warmup:
            del loss
            continue
        peak = dev.peak()
        row["step_s"].append(t)
        row["peak"].append(peak)
        row["peak_delta"].append(peak - start)
        if off is not None:
            after = off.stats()
            d = after.since(before)
            row["stats"].append({"offloaded": d.offloaded_bytes, "written": d.bytes_written,
                                 "host_loaded": d.host_loaded_bytes, "stall_s": d.stall_seconds,
                                 "quota": after.offload_quota_bytes,
                                 "bound": after.offload_bound_bytes,
                                 "budget_measured": after.budget_measured_bytes,
                                 "reason": after.offload_quota_reason})
        if i == warmup:
            row["digest"] = digest(loss, named_params)["sha256"]
        elif i == warmup + 1:
            row["repeats"] = digest(loss, named_params)["sha256"] == row["digest"]
        del loss


def _guarded(dev, row, fn):
    """Run ``fn``; an out-of-memory error marks the row instead of ending the table."""
    torch = dev.torch
    try:
        fn()
    except torch.OutOfMemoryError as e:
        row["oom"] = str(e).splitlines()[0]
    except Exception as e:  # noqa: BLE001 - reported in the table, with its type
        row["error"] = f"{type(e).__name__}: {e}"
    finally:
        dev.free()


def worker_a(cfg, dev, deadline):
    import torch
    sys.path.insert(0, os.path.join(REPO_ROOT, "examples"))
    from gpt import GPT, GPTConfig, make_batch
    import ssdtrain
    m = A_MODEL_DRY if dev.dry else A_MODEL
    mcfg = GPTConfig(vocab_size=m["vocab"], seq_len=m["seq_len"], d_model=m["d_model"],
                     n_heads=m["n_heads"], n_layers=m["n_layers"])
    torch.manual_seed(0)
    with dev.device:
        model = GPT(mcfg).to(getattr(torch, cfg["dtype"]))
    idx, targets = make_batch(mcfg, m["batch_size"], torch.Generator().manual_seed(1))
    idx, targets = idx.to(dev.device), targets.to(dev.device)
    named = sorted(model.named_parameters())
    step = lambda: model(idx, targets)  # noqa: E731
    out = {"model": m, "params": sum(p.numel() for p in model.parameters()), "rows": []}
    ref = {}
    for mode, budget in A_ROWS:
        row = {"table": "A", "mode": mode, "budget": budget}
        out["rows"].append(row)
        if time.monotonic() > deadline:
            row["skipped"] = "out of time (--budget-s)"
            continue
        warm, n = cfg["warmup"], cfg["steps"]

        def run(mode=mode, budget=budget, row=row, warm=warm, n=n):
            off = None
            try:
                if mode in ("none", "checkpoint", "sac"):
                    blocks = list(model.blocks) if mode != "none" else []
                    ctx_fn = _sac_context() if mode == "sac" else None
                    with _wrapped_blocks(blocks, ctx_fn):
                        _run_row(dev, row, step, contextlib.nullcontext, warm, n, named)
                    if mode == "none":  # the activations none's peak holds (module doc)
                        counter = _SavedBytes(model.parameters())
                        with counter.hooks:
                            loss = step()
                        del loss
                        row["saved_bytes"] = counter.nbytes
                elif mode == "save_on_cpu":
                    ctx = lambda: torch.autograd.graph.save_on_cpu(pin_memory=not dev.dry)  # noqa
                    _run_row(dev, row, step, ctx, warm, n, named)
                else:
                    spill = cfg["spill_dir"]
                    if mode == "offload_all":
                        off = _offloader(ssdtrain, dev, cfg, policy="static", spill_dir=None,
                                         host_budget_bytes="unlimited")
                    elif mode == "default":
                        off = _offloader(ssdtrain, dev, cfg, policy="auto", spill_dir=spill,
                                         host_budget_bytes="auto")
                        warm = cfg["auto_warmup"]
                    else:
                        b = _budget_bytes(ref, budget)
                        row["memory_budget_bytes"] = b
                        off = _offloader(ssdtrain, dev, cfg, policy="adaptive", spill_dir=spill,
                                         host_budget_bytes="auto", memory_budget_bytes=b)
                        off.track(model, list(model.blocks))
                        warm = cfg["adaptive_warmup"]
                    _run_row(dev, row, step, lambda: off, warm, n, named, off)
                    if mode == "budget":
                        plan = off.active_plan  # the one in force (makes none)
                        row["plan"] = None if plan is None else "".join(
                            c[0] for c in plan.choices)
            finally:
                if off is not None:
                    off.close()
        _guarded(dev, row, run)
        if mode in ("none", "checkpoint") and "step_s" in row and row["step_s"]:
            ref[mode] = row
    # The copy engines' rates, for offload_all's copy bound (targets()).
    out["copy_rates"] = dev.copy_rates(16 * MiB if dev.dry else 1 * GiB)
    return out


def _budget_bytes(ref, budget):
    """``memory_budget_bytes`` for a target peak over the step's start (module doc)."""
    none = ref.get("none")
    if none is None:
        raise RuntimeError("the budget rows need the none row, which did not run")
    none_delta = median(none["peak_delta"])
    other = max(0, none_delta - none["saved_bytes"])
    if budget == "checkpoint":
        if "checkpoint" not in ref:
            raise RuntimeError("the budget row at checkpoint's peak needs the checkpoint row")
        target = median(ref["checkpoint"]["peak_delta"])
    else:
        target = float(budget.rstrip("x")) * none_delta
    return max(1, int(target - other))


def worker_b(cfg, dev, deadline):
    import torch
    from torch.utils.checkpoint import checkpoint
    sys.path.insert(0, os.path.join(REPO_ROOT, "examples"))
    from llama import LlamaConfig, LlamaStack, layer_input_bytes, make_hidden
    import ssdtrain
    shape = B_MODEL_DRY if dev.dry else {}
    lcfg = LlamaConfig(n_layers=cfg["b_layers"], **shape)
    dtype = getattr(torch, cfg["dtype"])
    torch.manual_seed(0)
    with dev.device:
        model = LlamaStack(lcfg).to(dtype)
    named = sorted((n, p) for n, p in model.named_parameters() if p.requires_grad)
    call = lambda layer, x: checkpoint(layer, x, use_reentrant=False)  # noqa: E731
    out = {"layers": cfg["b_layers"], "shape": dataclasses.asdict(lcfg), "rows": []}
    for seq in cfg["b_seq"]:
        x = make_hidden(lcfg, 1, seq, torch.Generator().manual_seed(2)).to(dev.device, dtype)
        step = lambda: model(x, call)  # noqa: E731
        inputs = lcfg.n_layers * layer_input_bytes(lcfg, 1, seq, x.element_size())
        for mode in B_ROWS:
            row = {"table": "B", "mode": mode, "budget": None, "seq": seq,
                   "inputs_bytes": inputs}
            out["rows"].append(row)
            if time.monotonic() > deadline:
                row["skipped"] = "out of time (--budget-s)"
                continue

            def run(mode=mode, row=row):
                off = None
                try:
                    if mode == "checkpoint":
                        ctx = contextlib.nullcontext
                    elif mode == "checkpoint_offload_sync":
                        ctx = lambda: torch.autograd.graph.save_on_cpu(  # noqa: E731
                            pin_memory=not dev.dry)
                    else:
                        tier = (dict(spill_dir=None, host_budget_bytes="unlimited")
                                if mode == "ssdtrain_ram" else
                                dict(spill_dir=cfg["spill_dir"], host_budget_bytes=None))
                        off = _offloader(ssdtrain, dev, cfg, policy="static", **tier)
                        ctx = lambda: off  # noqa: E731
                    _run_row(dev, row, step, ctx, cfg["warmup"], cfg["steps"], named, off)
                finally:
                    if off is not None:
                        off.close()
            _guarded(dev, row, run)
        del x
    return out


def worker(table, cfg, out_path):
    import torch
    dev = _Device(cfg["cpu_dry_run"])
    if cfg["deterministic"]:
        torch.use_deterministic_algorithms(True)
    deadline = time.monotonic() + cfg["seconds"]
    fn = worker_a if table == "A" else worker_b
    result = fn(cfg, dev, deadline)
    result.update(table=table, device=dev.name(), torch=torch.__version__)
    with open(out_path, "w") as f:
        json.dump(result, f)


# ----------------------------------------------------------------------------------- parent
def summarize(results, date, command):
    """The report's JSON (module docstring) from the two workers' results."""
    rows, details, missing = [], [], []
    device = next((r["device"] for r in results.values() if "device" in r), "?")
    refs = {}
    for table in TABLES:
        res = results.get(table, {})
        if "error" in res:
            missing.append({"table": table, "why": f"worker failed: {res['error']}"})
            continue
        for r in res.get("rows", []):
            why = r.get("skipped") or (f"out of memory: {r['oom']}" if "oom" in r else None) \
                or r.get("error")
            if why or not r.get("step_s"):
                missing.append({"table": table, "mode": r["mode"], "budget": r["budget"],
                                "seq": r.get("seq"), "why": why or "no measured step"})
                continue
            key = (table, r.get("seq"))
            if (table == "A" and r["mode"] == "none") or (table == "B" and
                                                          r["mode"] == "checkpoint"):
                refs[key] = r
            ref = refs.get(key)
            exact = (bool(r.get("repeats", True)) if ref is r else
                     ref is not None and r["digest"] == ref["digest"])
            out = {"table": table, "mode": r["mode"], "budget": r["budget"],
                   "step_s": median(r["step_s"]), "peak_gib": median(r["peak"]) / GiB,
                   "exact": exact}
            if table == "B":
                out["seq"] = r["seq"]
            rows.append(out)
            d = dict(out, peak_delta_gib=median(r["peak_delta"]) / GiB,
                     step_ratio=(out["step_s"] / median(ref["step_s"]) if ref else None),
                     repeats_in_process=r.get("repeats"))
            for k in ("memory_budget_bytes", "plan", "saved_bytes", "inputs_bytes"):
                if k in r:
                    d[k] = r[k]
            if r["stats"]:
                st = r["stats"]
                d.update(offloaded_gib=median([s["offloaded"] for s in st]) / GiB,
                         written_gib=median([s["written"] for s in st]) / GiB,
                         host_loaded_gib=median([s["host_loaded"] for s in st]) / GiB,
                         stall_s=median([s["stall_s"] for s in st]),
                         reason=st[-1]["reason"], bound=st[-1]["bound"],
                         budget_measured_gib=st[-1]["budget_measured"] / GiB)
            details.append(d)
    default = next((d for d in details if d["mode"] == "default"), None)
    copy = results.get("A", {}).get("copy_rates")
    data = {"device": device, "date": date, "rows": rows,
            "free_bound_gib": (default["bound"] or 0) / GiB if default else None,
            "default_offloaded_gib": default["offloaded_gib"] if default else None,
            "details": details, "missing": missing, "command": command,
            "copy_rates_bps": copy,
            "models": {t: {k: v for k, v in results.get(t, {}).items()
                           if k in ("model", "params", "layers", "shape")} for t in TABLES}}
    data["targets"] = targets(data)
    return data


def _row(data, table, mode, budget=None, seq=None):
    for d in data["details"]:
        if d["table"] == table and d["mode"] == mode and d["budget"] == budget and \
                d.get("seq") == seq:
            return d
    return None


def targets(data):
    """The GPU tables' targets (benchmarks/README.md, gpu_bench), each with its figure: ``[(text, met)]``;
    ``met`` is None where a row it needs was not measured."""
    out = []
    none, default = _row(data, "A", "none"), _row(data, "A", "default")
    if none and default and data["free_bound_gib"]:
        share = data["default_offloaded_gib"] / data["free_bound_gib"]
        ratio = default["step_s"] / none["step_s"]
        out.append((f"A: default offloads {share:.0%} of the free bound "
                    f"({data['free_bound_gib']:.2f} GiB) at {ratio:.3f}x none "
                    f"(target >= 75% at <= 1.03x)", share >= 0.75 and ratio <= 1.03))
    else:
        out.append(("A: default vs the free bound: not measured", None))
    ckpt, at_ckpt = _row(data, "A", "checkpoint"), _row(data, "A", "budget", "checkpoint")
    if ckpt and at_ckpt:
        peak_ok = abs(at_ckpt["peak_delta_gib"] - ckpt["peak_delta_gib"]) <= \
            0.05 * ckpt["peak_delta_gib"] or at_ckpt["peak_delta_gib"] < ckpt["peak_delta_gib"]
        faster = 1 - at_ckpt["step_s"] / ckpt["step_s"]
        out.append((f"A: budget at checkpoint's peak: {faster:+.1%} faster than checkpoint, "
                    f"peak over start {at_ckpt['peak_delta_gib']:.2f} vs "
                    f"{ckpt['peak_delta_gib']:.2f} GiB (target >= 6% faster at that peak "
                    f"+-5%)", peak_ok and faster >= 0.06))
    for f in ("0.75x", "0.5x"):
        b = _row(data, "A", "budget", f)
        if not (b and none):
            out.append((f"A: budget {f}: not measured", None))
            continue
        limit = float(f[:-1]) * none["peak_delta_gib"]
        fits = [r for r in (_row(data, "A", m) for m in ("checkpoint", "sac", "save_on_cpu"))
                if r and r["peak_delta_gib"] <= limit * 1.05]
        if not fits:
            out.append((f"A: budget {f}: {b['step_s']:.3f} s; none of checkpoint, sac, "
                        f"save_on_cpu fits {limit:.2f} GiB", None))
            continue
        best = min(fits, key=lambda r: r["step_s"])
        ratio = b["step_s"] / best["step_s"]
        out.append((f"A: budget {f}: {ratio:.3f}x the fastest that fits ({best['mode']}), "
                    f"peak over start {b['peak_delta_gib']:.2f} GiB of {limit:.2f} "
                    f"(target <= 1.03x)", ratio <= 1.03 and b["peak_delta_gib"] <= limit * 1.05))
    ram = _row(data, "A", "offload_all")
    if ram and data.get("copy_rates_bps") and none:
        d2h, h2d = data["copy_rates_bps"]
        moved = ram["offloaded_gib"] * GiB
        bound = max(none["step_s"], moved / d2h, moved / h2d)
        out.append((f"A: offload_all to RAM {ram['step_s']:.3f} s = {ram['step_s'] / bound:.2f}x "
                    f"the copy bound {bound:.3f} s ({moved / GiB:.2f} GiB at "
                    f"{d2h / 1e9:.1f} GB/s out, {h2d / 1e9:.1f} GB/s in; target <= 1.2x)",
                    ram["step_s"] <= 1.2 * bound))
    rows = [d for d in data["details"]]
    out.append((f"A and B: every row exact ({sum(d['exact'] for d in rows)} of {len(rows)})",
                all(d["exact"] for d in rows) if rows else None))
    for seq in sorted({d.get("seq") for d in rows if d["table"] == "B"}):
        ref = _row(data, "B", "checkpoint", seq=seq)
        sync = _row(data, "B", "checkpoint_offload_sync", seq=seq)
        for mode, limit in (("ssdtrain_ssd", 1.03), ("ssdtrain_ram", 1.01)):
            r = _row(data, "B", mode, seq=seq)
            if not (r and ref):
                out.append((f"B seq {seq}: {mode}: not measured", None))
                continue
            ratio = r["step_s"] / ref["step_s"]
            beats = sync is not None and r["step_s"] < sync["step_s"]
            drop = (ref["peak_gib"] - r["peak_gib"]) * GiB
            inputs = r["inputs_bytes"]
            out.append((f"B seq {seq}: {mode} {ratio:.3f}x checkpoint (target <= {limit}x), "
                        f"{'faster' if beats else 'NOT faster'} than the synchronous copy; "
                        f"peak drop {drop / GiB:.2f} GiB for {inputs / GiB:.2f} GiB of inputs "
                        f"(target within 5%)",
                        ratio <= limit and beats and abs(drop - inputs) <= 0.05 * inputs))
    return out


_YES = {True: "met", False: "NOT met", None: "not measured"}


def render(data):
    """The Markdown report."""
    lines = [f"# gpu_bench {data['date']} on {data['device']}", "",
             f"Command: `{data['command']}`", ""]
    ma = data["models"].get("A", {})
    lines += [f"## Table A: GPT {ma.get('params', 0) / 1e9:.2f}B, {ma.get('model')}", ""]
    rows = []
    for d in data["details"]:
        if d["table"] != "A":
            continue
        ratio = "-" if d["step_ratio"] is None else f"{d['step_ratio']:.3f}"
        off = f"{d['offloaded_gib']:.2f}" if "offloaded_gib" in d else "-"
        notes = []
        if "memory_budget_bytes" in d:
            notes.append(f"memory_budget_bytes {d['memory_budget_bytes'] / GiB:.2f} GiB, "
                         f"measured {d.get('budget_measured_gib', 0):.2f} GiB; plan "
                         f"{d.get('plan')}")
        if d["mode"] == "default":
            notes.append(f"quota: {d.get('reason', '')}")
        if "saved_bytes" in d:
            notes.append(f"saves {d['saved_bytes'] / GiB:.2f} GiB of activations")
        rows.append([d["mode"], d["budget"] or "-", f"{d['step_s']:.3f}", ratio,
                     f"{d['peak_gib']:.2f}", f"{d['peak_delta_gib']:.2f}",
                     "yes" if d["exact"] else "NO", off, "; ".join(notes)])
    lines.append(md_table(["mode", "budget", "step (s)>", "x none>", "peak (GiB)>",
                           "peak over start (GiB)>", "exact", "offloaded (GiB/step)>", "notes"],
                          rows))
    mb = data["models"].get("B", {})
    lines += ["", f"## Table B: Llama-3-8B-shaped stack, {mb.get('layers')} layers, batch 1, "
              f"every layer recomputed", ""]
    rows = []
    for d in data["details"]:
        if d["table"] != "B":
            continue
        ratio = "-" if d["step_ratio"] is None else f"{d['step_ratio']:.3f}"
        off = f"{d['offloaded_gib']:.2f}" if "offloaded_gib" in d else "-"
        wr = f"{d['written_gib']:.2f}" if "written_gib" in d else "-"
        rows.append([d["seq"], d["mode"], f"{d['step_s']:.3f}", ratio, f"{d['peak_gib']:.2f}",
                     f"{d['peak_delta_gib']:.2f}", "yes" if d["exact"] else "NO",
                     f"{d['inputs_bytes'] / GiB:.2f}", off, wr])
    lines.append(md_table(["seq>", "mode", "step (s)>", "x checkpoint>", "peak (GiB)>",
                           "peak over start (GiB)>", "exact", "inputs (GiB)>",
                           "offloaded (GiB/step)>", "written to SSD (GiB/step)>"], rows))
    lines += ["", "## Targets", ""]
    lines += [f"- {text}: **{_YES[met]}**" for text, met in data["targets"]]
    if data["missing"]:
        lines += ["", "## Not measured", ""]
        lines += [f"- table {m['table']} {m.get('mode', '')} {m.get('budget') or ''} "
                  f"{m.get('seq') or ''}: {m['why']}" for m in data["missing"]]
    lines += ["", f"free_bound_gib {data['free_bound_gib']}, default_offloaded_gib "
              f"{data['default_offloaded_gib']}; machine {platform.platform()}, python "
              f"{platform.python_version()}"]
    return "\n".join(lines) + "\n"


def build_parser():
    p = argparse.ArgumentParser(
        description="Table A (~1B GPT: none, checkpointing, selective checkpointing, "
                    "save_on_cpu, ssdtrain's default, offload-all, budgets) and table B "
                    "(Llama-3-8B-shaped layers at long context, recomputed, inputs in GPU "
                    "memory / copied synchronously / offloaded by ssdtrain to RAM or SSD) "
                    "on one CUDA GPU. Exits 2 without CUDA.")
    p.add_argument("--out", default=os.path.join(REPO_ROOT, "docs", "results"),
                   help="directory for gpu_bench_<date>.{md,json} (default docs/results)")
    p.add_argument("--tables", nargs="+", choices=TABLES, default=list(TABLES))
    p.add_argument("--steps", type=int, default=3, help="measured steps per row (default 3)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up steps per row (default 2)")
    p.add_argument("--auto-warmup", type=int, default=30,
                   help="warm-up steps of the default's row, while its quota settles "
                        "(default 30)")
    p.add_argument("--adaptive-warmup", type=int, default=8,
                   help="warm-up steps of the budget rows (profile, plan; default 8)")
    p.add_argument("--b-layers", type=int, default=8, help="table B's layers (default 8)")
    p.add_argument("--b-seq", type=int, nargs="+", default=[32768],
                   help="table B's sequence lengths (default 32768)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    p.add_argument("--budget-s", type=float, default=450,
                   help="no row starts after this many seconds of the run (default 450)")
    p.add_argument("--spill-dir", help="directory on the NVMe (default: a fresh temporary "
                                       "directory, removed at the end)")
    p.add_argument("--no-deterministic", dest="deterministic", action="store_false")
    p.add_argument("--date", default=None, help=argparse.SUPPRESS)
    p.add_argument("--cpu-dry-run", action="store_true", help=argparse.SUPPRESS)
    add_worker_arguments(p, TABLES)
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.worker:
        worker(args.worker, json.loads(args.worker_config), args.worker_out)
        return 0
    if not args.cpu_dry_run:
        why = cuda_unavailable_reason()
        if why:
            print(f"gpu_bench: CUDA is not available: {why}. Run it on a machine with an "
                  f"NVIDIA GPU.", file=sys.stderr)
            return EXIT_NO_CUDA
    if args.steps < 2 or args.warmup < 0 or args.b_layers < 1 or min(args.b_seq) < 1:
        raise SystemExit("gpu_bench: --steps must be >= 2 (the second checks that a row "
                         "repeats itself), --warmup >= 0, --b-layers and --b-seq >= 1")
    t_start = time.monotonic()
    spill_dir, own = work_dir(args.spill_dir, "ssdtrain-gpu-bench-", "gpu_bench", "--spill-dir")
    env = worker_env(REPO_ROOT)
    if args.deterministic:
        env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    command = command_line()
    date = args.date or datetime.date.today().isoformat()
    results = {}
    try:
        for table in args.tables:
            left = args.budget_s - (time.monotonic() - t_start)
            if left <= 0:
                results[table] = {"error": "out of time (--budget-s) before it started"}
                continue
            cfg = dict(steps=args.steps, warmup=args.warmup, auto_warmup=args.auto_warmup,
                       adaptive_warmup=args.adaptive_warmup, b_layers=args.b_layers,
                       b_seq=[B_SEQ_DRY] if args.cpu_dry_run else args.b_seq,
                       dtype="float32" if args.cpu_dry_run else args.dtype,
                       spill_dir=spill_dir, deterministic=args.deterministic,
                       cpu_dry_run=args.cpu_dry_run,
                       # table A first gets most of what is left; B the rest
                       seconds=left * (0.6 if table == "A" and len(args.tables) > 1 else 1))
            print(f"gpu_bench: table {table} ...", file=sys.stderr, flush=True)
            # A worker stops starting rows at its deadline; one that hangs in a row is
            # killed two minutes past it, so the other table and the report still come.
            proc, wall, text = spawn_worker(__file__, "gpu_bench", table, cfg, env,
                                            timeout=cfg["seconds"] + 120)
            if proc.returncode != 0 or not text:
                results[table] = {"error": f"exit {proc.returncode}: {proc.stderr[-4000:]}"}
                print(f"gpu_bench: table {table} FAILED:\n{proc.stderr[-4000:]}",
                      file=sys.stderr)
                continue
            results[table] = json.loads(text)
            print(f"gpu_bench: table {table} done in {wall:.0f} s", file=sys.stderr, flush=True)
    finally:
        if own:
            shutil.rmtree(spill_dir, ignore_errors=True)
    data = summarize(results, date, command)
    report = render(data)
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, f"gpu_bench_{date}")
    with open(base + ".md", "w") as f:
        f.write(report)
    with open(base + ".json", "w") as f:
        json.dump(data, f, indent=1)
    print(report)
    print(f"Wrote {base}.md and {base}.json")
    return 1 if any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
