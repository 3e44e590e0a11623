#!/usr/bin/env python
"""The pipeline bubble under a memory budget: how many micro-batches fit in flight.

A GPT-like model (examples/gpt.py, untied head) is split into ``p = 2`` pipeline
stages, one process each (``torch.distributed``, gloo, CPU), trained with the
all-forward-all-backward (GPipe) schedule: each stage runs the forward of all ``m``
micro-batches of a step, then their backwards, newest first, sending activations
forward and gradients back (``dist.send``/``dist.recv``). All ``m`` micro-batches
are in flight on every stage, so the memory budget bounds ``m``, and with it the
bubble ``(p - 1) / (m + p - 1)``: the share of a step the stages idle while the
pipeline fills and drains.

Setups, each at every ``m``:

* ``none``: plain PyTorch, every activation of every micro-batch held;
* ``recompute``: every block checkpointed (``torch.utils.checkpoint``, non-reentrant);
* ``ssdtrain``: each stage's forward of a micro-batch is one pass of an
  ``ssdtrain.Offloader`` (``--keep-tail-mib`` per pass, so keep it small: ``m`` passes
  keep their tails; ``--write-behind-mib`` bounds the writes in flight).

Memory is measured as in examples/microbatch_sweep.py: every (setup, ``m``) runs in
two fresh processes (one per stage); each reports its peak RSS (``VmHWM`` from
``/proc/self/status``) over the measured steps, reset through
``/proc/self/clear_refs`` after the warm-up step (``hwm_reset_works`` in the JSON
says whether the reset took; where it does not, the peak covers the whole process).
The stages run with ``MALLOC_MMAP_THRESHOLD_=65536`` (as step_worker.py's children), so
freed tensors go back to the OS and RSS follows the bytes held.
A run *fits* when the peak RSS of every stage is within the per-stage budget. The
step time is the median wall time of ``--steps`` measured steps on stage 0 (both
stages start each step after a barrier). Nothing is estimated: every number in the
table is measured, except the bubble fraction, which is the schedule's formula.

The budget defaults to the larger stage peak of ``none`` at ``--budget-m`` (so no
offload fits exactly that ``m``). Output in ``--out``: ``results.json`` (every run),
``results.md`` (the table), ``pipeline_sweep.png`` (``m`` vs per-stage peak RSS, and
vs step time per sample). Nothing asserts a timing.

Example::

    .venv/bin/python examples/pipeline_sweep.py --out results/pipeline_sweep
    .venv/bin/python examples/pipeline_sweep.py --tiny --out /tmp/pp_sweep    # seconds
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import socket
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

MiB = 1 << 20
STAGES = 2
SETUPS = ("none", "recompute", "ssdtrain")
DEFAULT_MODEL = dict(vocab=2048, seq_len=256, d_model=128, n_heads=4, n_layers=4,
                     micro_batch=4)
TINY_MODEL = dict(vocab=256, seq_len=32, d_model=32, n_heads=2, n_layers=2, micro_batch=2)


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="pipeline_sweep_out", help="output directory")
    p.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4, 8, 16],
                   help="micro-batches per step, all in flight (default 1 2 4 8 16)")
    p.add_argument("--setups", nargs="+", default=list(SETUPS), choices=SETUPS)
    p.add_argument("--budget-mib", type=float, default=None,
                   help="peak RSS budget per stage; default: none's at --budget-m")
    p.add_argument("--budget-m", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="measured steps per run (default 3)")
    p.add_argument("--spill-dir", default=None, help="default: the system temporary directory")
    p.add_argument("--keep-tail-mib", type=float, default=0,
                   help="kept tail per pass (default 0: every micro-batch's activations go out)")
    p.add_argument("--prefetch-mib", type=float, default=16)
    p.add_argument("--write-behind-mib", type=float, default=32,
                   help="most bytes of writes in flight (default 32): memory stays bounded "
                        "when the disk, or the CPU its I/O threads share, is slower than forward")
    p.add_argument("--min-tensor-kib", type=float, default=64)
    p.add_argument("--model", default=None, help="JSON overriding the model shape, e.g. "
                   "'{\"d_model\": 256, \"micro_batch\": 8}'")
    p.add_argument("--tiny", action="store_true", help="a tiny model and m, for the tests")
    return p


# ----------------------------------------------------------------- one stage

def _stage_modules(cfg, stage):
    """Stage 0: embeddings and the first half of the blocks; stage 1: the rest, the
    final norm and the head. Built from the full model with one seed, so the split is
    the same model whatever the setup."""
    import torch
    from gpt import GPT

    torch.manual_seed(0)
    full = GPT(cfg)
    half = cfg.n_layers // STAGES
    if stage == 0:
        return torch.nn.ModuleDict(dict(tok_emb=full.tok_emb, pos_emb=full.pos_emb,
                                        blocks=full.blocks[:half]))
    return torch.nn.ModuleDict(dict(blocks=full.blocks[half:], ln_f=full.ln_f, head=full.head))


def _run_blocks(blocks, x, recompute):
    import torch
    from torch.utils.checkpoint import checkpoint
    for block in blocks:
        x = checkpoint(block, x, use_reentrant=False) if recompute and torch.is_grad_enabled() \
            else block(x)
    return x


def stage_worker(rank, port, spec, out_dir):
    """One pipeline stage of one (setup, m) run; writes ``<rank>.json``."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from gpt import GPTConfig, make_batch
    from step_worker import proc_status, reset_peak_rss

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=STAGES)
    m_spec, setup, m = spec["model"], spec["setup"], spec["m"]
    cfg = GPTConfig(vocab_size=m_spec["vocab"], seq_len=m_spec["seq_len"],
                    d_model=m_spec["d_model"], n_heads=m_spec["n_heads"],
                    n_layers=m_spec["n_layers"], tie_weights=False)
    stage = _stage_modules(cfg, rank)
    opt = torch.optim.SGD(stage.parameters(), lr=1e-3)
    mb = m_spec["micro_batch"]
    data = [make_batch(cfg, mb, torch.Generator().manual_seed(i)) for i in range(m)]
    shape = (mb, cfg.seq_len, cfg.d_model)
    recompute = setup == "recompute"
    off = None
    if setup == "ssdtrain":
        import ssdtrain
        off = ssdtrain.Offloader(**spec["offload"], spill_dir=spec["spill_dir"])

    def forward(i):
        idx, targets = data[i]
        with off if off is not None else contextlib.nullcontext():
            if rank == 0:
                pos = torch.arange(cfg.seq_len)
                x = stage["tok_emb"](idx) + stage["pos_emb"](pos)
                return None, _run_blocks(stage["blocks"], x, recompute)
            x = torch.empty(shape)
            dist.recv(x, src=0)
            x.requires_grad_(True)
            h = stage["ln_f"](_run_blocks(stage["blocks"], x, recompute))
            logits = stage["head"](h)
            return x, F.cross_entropy(logits.flatten(0, 1), targets.flatten()) / m

    def step():
        opt.zero_grad(set_to_none=True)
        dist.barrier()
        t0 = time.perf_counter()
        in_flight = []
        for i in range(m):  # all forwards: every micro-batch stays in flight
            x, out = forward(i)
            if rank == 0:
                dist.send(out.detach().contiguous(), dst=1)
            in_flight.append((x, out))
        for i in reversed(range(m)):  # all backwards, newest first
            x, out = in_flight.pop()
            if rank == 0:
                grad = torch.empty(shape)
                dist.recv(grad, src=1)
                out.backward(grad)
            else:
                out.backward()
                dist.send(x.grad.contiguous(), dst=0)
            del x, out
        opt.step()
        return time.perf_counter() - t0

    times = [step()]  # warm-up
    if off is not None:
        off.wait()
    result = {"stage": rank, "warmup_step_s": times[0]}
    result["hwm_reset_works"] = reset_peak_rss()
    stats0 = off.stats() if off is not None else None
    times = [step() for _ in range(spec["steps"])]
    result["peak_rss"] = proc_status("VmHWM")["VmHWM"]
    result["step_s"] = times
    if off is not None:
        off.wait()
        st = off.stats()
        n = len(times)
        result["written_bytes_per_step"] = (st.offloaded_bytes - stats0.offloaded_bytes) / n
        result["read_bytes_per_step"] = (st.bytes_read - stats0.bytes_read) / n
        result["prefetch_misses_per_step"] = (st.prefetch_misses - stats0.prefetch_misses) / n
        result["stall_s_per_step"] = (st.stall_seconds - stats0.stall_seconds +
                                      st.write_stall_seconds - stats0.write_stall_seconds) / n
        result["engine"] = st.engine
        off.close()
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pipeline(spec, timeout_s=600):
    """Both stages of one (setup, m) run in fresh processes; the run's record."""
    import torch.multiprocessing as mp
    # Read by each stage's allocator at start-up (spawn starts a fresh interpreter):
    # freed tensors go back to the OS, so RSS follows what is held.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    with tempfile.TemporaryDirectory(prefix="pipeline_sweep_") as out_dir:
        record = {"setup": spec["setup"], "m": spec["m"]}
        try:
            ctx = mp.start_processes(stage_worker, args=(_free_port(), spec, out_dir),
                                     nprocs=STAGES, join=False, start_method="spawn")
            deadline = time.monotonic() + timeout_s
            try:
                while not ctx.join(timeout=1):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"stages still running after {timeout_s} s")
            finally:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
        except Exception as e:  # noqa: BLE001 - reported in the table and the JSON
            record["error"] = f"{type(e).__name__}: {e}"
            return record
        stages = []
        for r in range(STAGES):
            with open(os.path.join(out_dir, f"{r}.json")) as f:
                stages.append(json.load(f))
    times = stages[0]["step_s"]
    record.update(stages=stages, peak_rss=max(s["peak_rss"] for s in stages),
                  step_s_median=sorted(times)[len(times) // 2],
                  hwm_reset_works=all(s["hwm_reset_works"] for s in stages))
    return record


# ----------------------------------------------------------------- the sweep

def bubble(m, p=STAGES):
    """The pipeline bubble of a fill-and-drain schedule: ``(p - 1) / (m + p - 1)``."""
    return (p - 1) / (m + p - 1)


def summarize(runs, setups, ms, budget, micro_batch):
    table = {}
    for setup in setups:
        rows = {}
        for m in ms:
            r = next((r for r in runs if r["setup"] == setup and r["m"] == m), None)
            if r is None:
                continue
            if "error" in r:
                rows[m] = {"error": r["error"]}
                continue
            rows[m] = {"step_s": r["step_s_median"],
                       "step_s_per_sample": r["step_s_median"] / (m * micro_batch),
                       "stage_peak_rss": [s["peak_rss"] for s in r["stages"]],
                       "fits": r["peak_rss"] <= budget, "bubble": bubble(m)}
        fitting = [m for m, row in rows.items() if row.get("fits")]
        best = max(fitting) if fitting else None
        table[setup] = {"rows": rows, "largest_fit": best,
                        "bubble_at_largest_fit": bubble(best) if best else None,
                        "step_s_at_largest_fit": rows[best]["step_s"] if best else None}
    return table


def render(table, setups, ms, budget, args_line, micro_batch):
    lines = [f"Budget: peak RSS <= {budget / MiB:.0f} MiB per stage ({STAGES} stages, one "
             f"process each; micro-batch {micro_batch}; all m micro-batches in flight). "
             f"Memory: each stage process's VmHWM over the measured steps (reset through "
             f"/proc/self/clear_refs after warm-up; MALLOC_MMAP_THRESHOLD_=65536). "
             f"Step time: median measured wall time. "
             f"Command: `{args_line}`", "",
             "| setup | " + " | ".join(f"m={m}" for m in ms) + " | largest m that fits | "
             "bubble there | step there |",
             "| --- | " + " | ".join("---:" for _ in ms) + " | ---: | ---: | ---: |"]
    for setup in setups:
        cells = []
        for m in ms:
            row = table[setup]["rows"].get(m)
            if row is None:
                cells.append("")
            elif "error" in row:
                cells.append(row["error"])
            else:
                peaks = "/".join(f"{p / MiB:.0f}" for p in row["stage_peak_rss"])
                cells.append(f"{row['step_s'] * 1e3:.0f} ms, {peaks} MiB"
                             + ("" if row["fits"] else " (over)"))
        t = table[setup]
        fit = t["largest_fit"]
        there = (f"{fit} | {t['bubble_at_largest_fit']:.1%} | "
                 f"{t['step_s_at_largest_fit'] * 1e3:.0f} ms |") if fit else "none | | |"
        lines.append(f"| {setup} | " + " | ".join(cells) + " | " + there)
    lines += ["", "Cells: median step time, peak RSS of stage 0/stage 1. Bubble "
                  f"(p - 1)/(m + p - 1) with p = {STAGES}: "
              + ", ".join(f"m={m}: {bubble(m):.1%}" for m in ms) + "."]
    return "\n".join(lines)


def plot(table, setups, ms, budget, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for setup in setups:
        rows = table[setup]["rows"]
        xs = [m for m in ms if "step_s" in rows.get(m, {})]
        ax1.plot(xs, [max(rows[m]["stage_peak_rss"]) / MiB for m in xs], marker="o", label=setup)
        ax2.plot(xs, [rows[m]["step_s_per_sample"] * 1e3 for m in xs], marker="o", label=setup)
    ax1.axhline(budget / MiB, color="k", linestyle="--", linewidth=1, label="budget")
    for ax, ylabel in ((ax1, "peak RSS, larger stage (MiB)"), (ax2, "step time per sample (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ms)
        ax.set_xticklabels([f"{m}\n{bubble(m):.0%}" for m in ms])
        ax.set_xlabel("micro-batches in flight m (bubble)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(f"{STAGES}-stage pipeline: micro-batches in flight under a per-stage budget")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    args = build_parser().parse_args(argv)
    model = dict(TINY_MODEL if args.tiny else DEFAULT_MODEL)
    if args.model:
        model.update(json.loads(args.model))
    if model["n_layers"] % STAGES:
        raise SystemExit(f"pipeline_sweep: n_layers ({model['n_layers']}) must be a multiple "
                         f"of the {STAGES} stages")
    ms = sorted(set([1, 2] if args.tiny and args.micro_batches == [1, 2, 4, 8, 16]
                    else args.micro_batches))
    budget_m = 1 if args.tiny and args.budget_m == 2 else args.budget_m
    offload = dict(policy="static", keep_tail_bytes=int(args.keep_tail_mib * MiB),
                   write_behind_bytes=int(args.write_behind_mib * MiB),
                   prefetch_bytes=int(args.prefetch_mib * MiB),
                   min_tensor_bytes=int((1 if args.tiny else args.min_tensor_kib) * 1024))
    os.makedirs(args.out, exist_ok=True)
    spill = args.spill_dir or tempfile.gettempdir()
    base = dict(model=model, spill_dir=spill, steps=args.steps, offload=offload)
    runs = []
    t0 = time.perf_counter()
    if args.budget_mib is None:
        print(f"[budget: none at m={budget_m}]", file=sys.stderr, flush=True)
        r = run_pipeline(dict(base, setup="none", m=budget_m))
        if "error" in r:
            raise SystemExit(f"pipeline_sweep: the budget run failed: {r['error']}")
        budget = r["peak_rss"]
        if budget_m in ms and "none" in args.setups:
            runs.append(r)
    else:
        budget = int(args.budget_mib * MiB)
    for k, m in enumerate(ms):
        order = args.setups[k % len(args.setups):] + args.setups[:k % len(args.setups)]
        for setup in order:
            if any(r["setup"] == setup and r["m"] == m for r in runs):
                continue
            print(f"[{setup} m={m}]", file=sys.stderr, flush=True)
            runs.append(run_pipeline(dict(base, setup=setup, m=m)))
    table = summarize(runs, args.setups, ms, budget, model["micro_batch"])
    args_line = "python examples/pipeline_sweep.py " + " ".join(
        sys.argv[1:] if argv is None else argv)
    md = render(table, args.setups, ms, budget, args_line, model["micro_batch"])
    result = {"budget_rss_per_stage": budget, "stages": STAGES, "micro_batches": ms,
              "setups": args.setups, "model": model, "offload": offload, "spill_dir": spill,
              "schedule": "all-forward-all-backward (GPipe), backward newest first",
              "memory_measure": "VmHWM of each stage process over the measured steps, reset "
                                "through /proc/self/clear_refs after the warm-up step",
              "runs": runs, "summary": table, "wall_s": time.perf_counter() - t0,
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}}
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(md + "\n")
    try:
        plot(table, args.setups, ms, budget, os.path.join(args.out, "pipeline_sweep.png"))
    except ImportError:
        print("pipeline_sweep: matplotlib is not installed (pip install -e .[bench]); "
              "no PNG written", file=sys.stderr)
    print(md)
    errors = [r for r in runs if "error" in r]
    for r in errors:
        print(f"\nrun {r['setup']} m={r['m']} failed: {r['error']}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
