#!/usr/bin/env python
"""GPU acceptance in one command (``make gpu-check``): build, CUDA tests, smoke runs, report.

For a machine with an NVIDIA GPU, a CUDA build of torch already installed and no
network. In order, each phase under a time limit of its own, whatever the earlier
phases gave:

1. **build**: the native engine ``ssdtrain._C`` in place, against this Python, with
   ``setup.py build_ext --inplace`` (no pip, no build isolation, nothing downloaded;
   pybind11's headers come from the ``pybind11`` package, or from torch's copy);
2. **environment**: GPU, driver, torch/CUDA versions, the engines usable here, and
   the GPUDirect Storage probe when kvikio imports (saying whether cuFile runs in
   compatibility mode, where the "GPUDirect" path really goes through host memory);
3. **tests**: every test marked ``cuda`` (``pytest -m cuda``), JUnit XML kept;
   then ``ssdtrain check`` on a small Llama on the GPU (bitwise, forced through the SSD);
4. **smoke**: ``benchmarks/gpu_smoke.py --small``, then the ~1B GPT (none, ssdtrain
   SSD only, ssdtrain-host: host RAM then the SSD, ssdtrain-ram: host RAM only,
   save_on_cpu, checkpoint): step time, device peak, host RSS, pinned host peak,
   the host tier's bytes in RAM and on the SSD, bitwise equality; and for each run one
   verdict line, the host tier (ssdtrain-ram) against save_on_cpu at equal memory
   (step-time ratio), or "not measured" when either did not run.

The report (``report.md``, ``report.json`` and each phase's log) goes to the folder
named by ``GPU_CHECK_DIR`` (default: a fresh folder under the system temp dir; the
path is printed). Exit status: 0 when every phase passed (or was skipped because
``GPU_CHECK_SKIP`` names it), 1 when one failed or the budget left it out, 2
without a usable CUDA device (nothing else is run).

Environment: ``GPU_CHECK_DIR``; ``GPU_CHECK_SPILL_DIR`` (the NVMe folder for spill
files, default a temp folder); ``GPU_CHECK_BUDGET_S`` (the whole run's wall-clock
budget, default 480); ``GPU_CHECK_SKIP`` (phases to skip, comma-separated:
build, tests, check, smoke-small, smoke-1b); ``GPU_CHECK_SMOKE_ARGS`` (extra arguments for the ~1B run,
e.g. ``--batch-size 2``, or ``--modes none ssdtrain-ram save_on_cpu`` where six modes do
not fit the budget); ``GPU_CHECK_PYTEST_ARGS`` (extra pytest arguments).
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))
from _common import cuda_unavailable_reason  # noqa: E402  (the same check as the benchmarks')
EXIT_NO_CUDA = 2
# `ssdtrain check` on CUDA: a small Llama built from this config (random weights).
TINY_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 256,
              "intermediate_size": 688, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 1024, "max_position_embeddings": 512}


SKIPPED_ON_REQUEST = "GPU_CHECK_SKIP names it"

class Phases:
    """Runs commands under the remaining budget; keeps each one's log and outcome."""

    def __init__(self, out_dir: str, budget_s: float):
        self.out_dir, self.deadline = out_dir, time.monotonic() + budget_s
        self.results: list[dict] = []

    def run(self, name: str, argv: list[str], limit_s: float, env=None) -> dict:
        left = self.deadline - time.monotonic()
        limit = max(0.0, min(limit_s, left))
        log = os.path.join(self.out_dir, f"{name}.log")
        res = {"phase": name, "command": shlex.join(argv), "log": os.path.basename(log)}
        if name in os.environ.get("GPU_CHECK_SKIP", "").split(","):
            res.update(status="skipped", why=SKIPPED_ON_REQUEST, seconds=0.0)
            self.results.append(res)
            print(f"[gpu-check] {name}: skipped (GPU_CHECK_SKIP)", flush=True)
            return res
        if limit < 5:
            res.update(status="skipped", why="the run's time budget is spent", seconds=0.0)
            self.results.append(res)
            print(f"[gpu-check] {name}: skipped (budget spent)", flush=True)
            return res
        print(f"[gpu-check] {name}: {res['command']} (limit {limit:.0f} s)", flush=True)
        t0 = time.monotonic()
        with open(log, "w") as f:
            try:
                proc = subprocess.run(argv, cwd=REPO_ROOT, env=env, stdout=f,
                                      stderr=subprocess.STDOUT, timeout=limit)
                res.update(status="passed" if proc.returncode == 0 else "failed",
                           returncode=proc.returncode)
            except subprocess.TimeoutExpired:
                res.update(status="timed out", returncode=None)
        res["seconds"] = round(time.monotonic() - t0, 1)
        with open(log, errors="replace") as f:
            res["tail"] = f.read()[-3000:]
        print(f"[gpu-check] {name}: {res['status']} in {res['seconds']} s", flush=True)
        self.results.append(res)
        return res


def environment() -> dict:
    """What the machine is: GPU, driver, versions, engines, GPUDirect Storage."""
    import torch
    env = {"python": platform.python_version(), "platform": platform.platform(),
           "torch": torch.__version__, "cuda": torch.version.cuda,
           "gpu": torch.cuda.get_device_name(0),
           "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)}
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        env["driver"] = smi.stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        env["driver"] = f"nvidia-smi failed: {e}"
    sys.path.insert(0, REPO_ROOT)
    try:
        from ssdtrain.io import native
        env["native_engine"] = ("built" if native.available()
                                else f"not available: {native.unavailable_reason()}")
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        env["native_engine"] = f"import failed: {type(e).__name__}: {e}"
    env["gds"] = gds_probe()
    return env


def gds_probe() -> dict:
    """kvikio's version, cuFile's compatibility mode and ssdtrain's probe, in plain words."""
    out: dict = {}
    try:
        import kvikio
        out["kvikio"] = getattr(kvikio, "__version__", "?")
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        out["summary"] = f"kvikio does not import ({type(e).__name__}: {e}): no GPUDirect Storage"
        return out
    from ssdtrain._device.transfers import GDS_PROBE_MEMORY
    from ssdtrain.io import gds
    try:
        import kvikio.cufile_driver as driver  # a submodule `import kvikio` leaves out
    except Exception:  # noqa: BLE001 - older kvikio
        driver = None
    for key in ("is_gds_available", "allow_compat_mode"):
        try:
            out[f"cufile {key}"] = driver.get(key)
        except Exception as e:  # noqa: BLE001 - older kvikio, or no cuFile
            out[f"cufile {key}"] = f"unknown ({type(e).__name__})"
    try:
        out["libcufile"] = ".".join(map(str, driver.libcufile_version()))
    except Exception as e:  # noqa: BLE001
        out["libcufile"] = f"unknown ({type(e).__name__})"
    compat = gds._compat_mode_reason(kvikio)
    out["compat_mode"] = compat or "off: GPUDirect Storage DMA"
    try:
        with tempfile.TemporaryDirectory(dir=os.environ.get("GPU_CHECK_SPILL_DIR")) as d:
            why = gds.probe(d, GDS_PROBE_MEMORY)
        out["ssdtrain_probe"] = "passed: the kvikio engine is selectable" if not why else \
            f"refused: {why}"
    except Exception as e:  # noqa: BLE001
        out["ssdtrain_probe"] = f"raised {type(e).__name__}: {e}"
    out["summary"] = (f"kvikio {out['kvikio']}: cuFile in COMPATIBILITY mode (POSIX I/O through "
                      f"host bounce buffers, not GPUDirect DMA)" if compat else
                      f"kvikio {out['kvikio']}: cuFile native mode; probe {out['ssdtrain_probe']}")
    return out


def _gpu_smoke():
    for path in (REPO_ROOT, os.path.join(REPO_ROOT, "benchmarks")):
        if path not in sys.path:
            sys.path.insert(0, path)
    import gpu_smoke
    return gpu_smoke


def _smoke_section(path: str) -> tuple:
    """``(table, verdict)`` of a gpu_smoke JSON: the rendered table (or why there is
    none) and the host tier vs save_on_cpu line ("not measured" without a run)."""
    gpu_smoke = _gpu_smoke()
    if not os.path.exists(path):
        return "(no JSON written)", gpu_smoke.host_tier_verdict({})
    with open(path) as f:
        data = json.load(f)
    return (gpu_smoke.render_table(data["summary"], data["modes"]),
            gpu_smoke.host_tier_verdict(data["summary"]))


def write_report(out_dir, env, phases, smoke_jsons, started) -> None:
    lines = ["# ssdtrain GPU acceptance (make gpu-check)", "",
             f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}, "
             f"{time.time() - started:.0f} s in all.", "",
             "## Machine", ""]
    lines += [f"- {k}: {v}" for k, v in env.items() if k != "gds"]
    gds = env.get("gds", {})
    lines += [f"- GPUDirect Storage: {gds.get('summary')}"]
    lines += [f"  - {k}: {v}" for k, v in gds.items() if k != "summary"]
    lines += ["", "## Phases", "", "| phase | status | seconds | command |", "| --- | --- | ---: | --- |"]
    for p in phases.results:
        lines.append(f"| {p['phase']} | {p['status']} | {p['seconds']} | `{p['command']}` |")
    for p in phases.results:
        if p["status"] != "passed" and p.get("tail"):
            lines += ["", f"### {p['phase']}: end of its log", "", "```", p["tail"].rstrip(), "```"]
    tests = next((p for p in phases.results if p["phase"] == "tests"), None)
    if tests and tests.get("tail"):
        summary = [ln for ln in tests["tail"].splitlines() if " passed" in ln or " failed" in ln
                   or " error" in ln]
        if summary:
            lines += ["", f"Tests: {summary[-1].strip('= ')}"]
    verdicts = {}
    for name, path in smoke_jsons.items():
        table, verdicts[name] = _smoke_section(path)
        lines += ["", f"## {name}", "", table, "", f"**Verdict**: {verdicts[name]}."]
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump({"environment": env, "phases": phases.results,
                   "smoke": {k: os.path.basename(v) for k, v in smoke_jsons.items()},
                   "host_tier_vs_save_on_cpu": verdicts}, f, indent=1)


def main() -> int:
    why = cuda_unavailable_reason()
    if why:
        print(f"gpu-check: no usable CUDA device: {why}. Nothing was run.", file=sys.stderr)
        return EXIT_NO_CUDA
    started = time.time()
    out_dir = os.environ.get("GPU_CHECK_DIR") or tempfile.mkdtemp(prefix="ssdtrain-gpu-check-")
    os.makedirs(out_dir, exist_ok=True)
    spill_root = os.environ.get("GPU_CHECK_SPILL_DIR") or tempfile.mkdtemp(prefix="ssdtrain-spill-")
    budget = float(os.environ.get("GPU_CHECK_BUDGET_S", "480"))
    print(f"[gpu-check] report folder: {out_dir}; spill folder: {spill_root}; budget {budget:.0f} s",
          flush=True)
    phases = Phases(out_dir, budget)
    py = sys.executable
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [REPO_ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
        PYTHONWARNINGS=os.environ.get("PYTHONWARNINGS", "ignore"),
        CUBLAS_WORKSPACE_CONFIG=os.environ.get("CUBLAS_WORKSPACE_CONFIG", ":4096:8"),
        TMPDIR=spill_root)

    phases.run("build", [py, "setup.py", "build_ext", "--inplace"], 240, env)
    machine = environment()
    print(f"[gpu-check] {json.dumps(machine)}", flush=True)
    phases.run("tests", [py, "-m", "pytest", "tests", "-m", "cuda", "-q", "-p", "no:cacheprovider",
                         "--continue-on-collection-errors", "-rfEs",
                         f"--junitxml={os.path.join(out_dir, 'junit.xml')}"]
               + shlex.split(os.environ.get("GPU_CHECK_PYTEST_ARGS", "")), 240, env)
    tiny = os.path.join(out_dir, "tiny_llama_config.json")
    with open(tiny, "w") as f:
        json.dump(TINY_LLAMA, f)
    phases.run("check", [py, "-m", "ssdtrain", "check", "--hf-config", tiny, "--seq", "256",
                         "--batch", "2", "--device", "cuda"], 90, env)
    smoke = {}
    small = os.path.join(out_dir, "gpu_smoke_small.json")
    phases.run("smoke-small", [py, "benchmarks/gpu_smoke.py", "--small", "--repeats", "1",
                               "--json", small], 90, env)
    smoke["gpu_smoke --small"] = small
    big = os.path.join(out_dir, "gpu_smoke_1b.json")
    phases.run("smoke-1b", [py, "benchmarks/gpu_smoke.py", "--repeats", "1", "--json", big]
               + shlex.split(os.environ.get("GPU_CHECK_SMOKE_ARGS", "")), 300, env)
    smoke["gpu_smoke ~1B"] = big
    write_report(out_dir, machine, phases, smoke, started)
    shutil.rmtree(spill_root, ignore_errors=True)
    print(f"[gpu-check] report: {os.path.join(out_dir, 'report.md')}", flush=True)
    # A phase GPU_CHECK_SKIP names was asked away; one the budget left out was not.
    return 0 if all(p["status"] == "passed" or p.get("why") == SKIPPED_ON_REQUEST
                    for p in phases.results) else 1


if __name__ == "__main__":
    sys.exit(main())
