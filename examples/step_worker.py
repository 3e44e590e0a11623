"""One training configuration in a fresh process: step times and peak RSS, as JSON.

Used by ``microbatch_sweep.py`` and ``rok_curve.py`` (each configuration runs in
its own process so that its peak RSS is its own). Run directly::

    python examples/step_worker.py '{"setup": "static", "batch": 4, ...}' out.json

Setups:

* ``none``: plain PyTorch;
* ``recompute``: every block checkpointed (``torch.utils.checkpoint``, non-reentrant);
* ``static``: ``ssdtrain.Offloader`` with the static policy;
* ``adaptive``: ``policy="adaptive"``; its ``memory_budget_bytes`` is what the RSS
  budget leaves for activations (NOTE [ Activation budget from an RSS budget ]);
* ``plan``: profiled like ``adaptive`` (no budget, no re-planning), then
  ``choices`` (one per block) set by ``Offloader.set_plan``.

NOTE [ Activation budget from an RSS budget ]

``memory_budget_bytes`` counts saved activations only; the experiments' budget
is the process's peak RSS, which also holds the interpreter, the model, its
gradients and the step's temporaries. The worker first runs two steps under the
static policy (which holds few activations); during the second, a thread
samples, every 0.5 ms, the RSS and the activation bytes ssdtrain holds
(``Offloader.resident_bytes``, read before and after the RSS). RSS minus those
bytes is everything but the activations ssdtrain manages (interpreter, model,
gradients, temporaries, small tensors it does not offload, a record backward is
using after its last unpack); the largest value seen bounds it. The adaptive
offloader gets ``rss_budget`` minus that, minus ``reserve`` (headroom for what
the planner's memory model misses). Peak RSS is then at most that bound plus
the activations, whenever they peak.

Two earlier choices under-estimated it, and adaptive overshot its budget at
micro-batch 16 by about 1 MiB: the value at the sample with the highest RSS
(not a bound: the head's backward peaks later with fewer activations held), and
the first step (cold: about 37 MiB less outside the activations during the
head's backward than every later step, measured with a dispatch mode counting
the backward's live tensors).

Peak RSS is ``VmHWM``, reset (``/proc/self/clear_refs``) after the warm-up and
profiling steps, so it covers the measured steps only; where the reset does not
work it covers the whole process (``hwm_reset_works`` in the output).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import time

MiB = 1 << 20
HERE = os.path.dirname(os.path.abspath(__file__))


def proc_status(*keys):
    """``/proc/self/status`` fields (kB values) in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in keys:
                out[name] = int(rest.split()[0]) * 1024
    return out


def reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current RSS; whether that worked."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    s = proc_status("VmHWM", "VmRSS")
    return s["VmHWM"] - s["VmRSS"] < 8 * MiB


class PeakSampler:
    """Samples RSS and ssdtrain's resident activation bytes every ``interval`` seconds,
    keeping the sample with the highest RSS (NOTE [ Activation budget from an RSS budget ])."""

    def __init__(self, offloader, interval=0.0005):
        import threading
        self.off, self.interval = offloader, interval
        self.peak = (0, 0)  # (rss, resident at that moment)
        self.other = 0      # the largest RSS minus resident bytes seen
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            before = self.off.resident_bytes()
            rss = proc_status("VmRSS")["VmRSS"]
            after = self.off.resident_bytes()
            # A record allocated between the reads is in RSS but not in `before`; one
            # freed between them left both RSS and `after`: the smaller never under-counts.
            self.other = max(self.other, rss - min(before, after))
            if rss > self.peak[0]:
                self.peak = (rss, after)
            self._stop.wait(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.off = None


def run(spec):
    import torch
    sys.path.insert(0, HERE)
    from gpt import GPT, GPTConfig, make_batch
    import ssdtrain

    torch.set_num_threads(spec.get("threads", torch.get_num_threads()))
    setup, batch = spec["setup"], spec["batch"]
    m = spec["model"]
    cfg = GPTConfig(vocab_size=m["vocab"], seq_len=m["seq_len"], d_model=m["d_model"],
                    n_heads=m["n_heads"], n_layers=m["n_layers"],
                    checkpoint_blocks=setup == "recompute")
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    idx, targets = make_batch(cfg, batch, torch.Generator().manual_seed(1))
    offload = dict(spec.get("offload", {}))
    offload["spill_dir"] = spec["spill_dir"]
    offload.setdefault("policy", "static")  # the offload path, every step (not the default's quota)
    result = {"setup": setup, "batch": batch, "tokens_per_step": batch * cfg.seq_len,
              "choices": spec.get("choices"), "rss_budget": spec.get("rss_budget")}

    def step(ctx):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        with ctx:
            loss = model(idx, targets)
        loss.backward()
        opt.step()
        return time.perf_counter() - t0

    off = None
    warmup = spec.get("warmup", 1)
    if setup in ("static", "adaptive", "plan"):
        if setup == "adaptive":
            # NOTE [ Activation budget from an RSS budget ]
            calib = ssdtrain.Offloader(**offload)
            gc.collect()
            step(calib)  # the first step is cold: it holds less besides activations
            calib.wait()
            with PeakSampler(calib) as sampler:
                step(calib)
                calib.wait()
            other = sampler.other
            calib.close()
            del calib  # its idle read buffers go with it
            gc.collect()
            act_budget = max(1, spec["rss_budget"] - other - spec.get("reserve", 0))
            result.update(non_activation_rss=other, memory_budget_bytes=act_budget)
            offload.update(policy="adaptive", memory_budget_bytes=act_budget)
        if setup == "plan":  # profiled like adaptive, then the plan asked for is set
            offload.update(policy="adaptive", memory_budget_bytes=1 << 50,
                           replan_stall_fraction=float("inf"))
        off = ssdtrain.Offloader(**offload)
        result["engine"] = off.stats().engine
        if setup in ("adaptive", "plan"):
            off.track(model)
        if setup == "adaptive":  # profiled steps, the recompute-all step, the first planned
            warmup = max(warmup, off.config.profile_steps + 2)
        ctx = off
    else:
        ctx = contextlib.nullcontext()

    times = []
    if setup == "plan":
        for _ in range(off.config.profile_steps + 1):  # + the recompute-all step
            times.append(step(ctx))
        with off:  # the profile is complete once the next forward begins: begin it empty
            pass
        off.set_plan(spec["choices"])
        warmup = 1
    for _ in range(warmup):
        times.append(step(ctx))
    warm_times = list(times)
    gc.collect()
    if off is not None:
        off.wait()
    result["hwm_reset_works"] = reset_peak_rss()
    stats0 = off.stats() if off is not None else None
    times = [step(ctx) for _ in range(spec.get("steps", 2))]
    result["peak_rss"] = proc_status("VmHWM")["VmHWM"]
    result["step_s"] = times
    result["warmup_step_s"] = warm_times
    result["step_s_median"] = sorted(times)[len(times) // 2]
    result["tokens_per_s"] = result["tokens_per_step"] / result["step_s_median"]
    if off is not None:
        off.wait()  # count the last step's writes too
        st = off.stats()
        n = len(times)
        result["written_bytes_per_step"] = (st.offloaded_bytes - stats0.offloaded_bytes) / n
        result["stall_s_per_step"] = (st.stall_seconds - stats0.stall_seconds +
                                      st.write_stall_seconds - stats0.write_stall_seconds) / n
        if off.active_plan is not None:
            p = off.active_plan
            result["plan"] = {"choices": list(p.choices), "fits": p.fits,
                              "predicted_step_s": p.prediction.step_s,
                              "predicted_stall_s": p.prediction.stall_s,
                              "predicted_peak_bytes": p.prediction.peak_bytes,
                              "replans": off.replans, "table": p.table()}
        off.close()
    return result


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        raise SystemExit("usage: step_worker.py SPEC_JSON OUT_JSON")
    result = run(json.loads(argv[0]))
    with open(argv[1], "w") as f:
        json.dump(result, f)


def run_in_child(spec, timeout=1800):
    """Run ``spec`` in a fresh interpreter; the result dict, or one with ``error``."""
    import subprocess
    import tempfile
    fd, out = tempfile.mkstemp(prefix="ssdtrain-worker-", suffix=".json")
    os.close(fd)
    env = dict(os.environ)
    env.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # freed tensors go back to the OS
    repo = os.path.dirname(HERE)
    env["PYTHONPATH"] = os.pathsep.join([repo] + [p for p in env.get("PYTHONPATH", "").split(
        os.pathsep) if p])
    try:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), json.dumps(spec), out],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              timeout=timeout)
        if proc.returncode != 0:
            return dict(spec, error=f"exit {proc.returncode}", stderr=proc.stderr[-4000:])
        with open(out) as f:
            result = json.load(f)
        result["wall_s"] = time.perf_counter() - t0
        return result
    finally:
        os.unlink(out)


if __name__ == "__main__":
    main()
