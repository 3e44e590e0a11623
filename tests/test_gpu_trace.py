"""tools/gpu_trace.py: the summary of a profiler trace (on a synthetic trace whose answer
is known) and a dry run on the CPU with a loopback device (the GPU run itself needs a
GPU: `python tools/gpu_trace.py --out DIR` on one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "tools"))

from gpu_trace import summarize_trace  # noqa: E402


def _x(name, cat, tid, ts, dur):
    return {"ph": "X", "name": name, "cat": cat, "tid": tid, "pid": 1, "ts": ts, "dur": dur}


def test_summary_of_a_known_trace():
    """Kernels 0-100, 150-250, 260-300 µs: busy 240, idle 60 (gaps 50 and 10). A DtoH copy
    of 40 µs half over a kernel; the launching thread (tid 1, three launches against one)
    spends 30 µs in ssdtrain::pack, with a cudaEventSynchronize of 20 µs inside, when
    the long gap begins; thread 2 spends 70 µs in ranges of its own."""
    events = [
        _x("k1", "kernel", 7, 0, 100), _x("k2", "kernel", 7, 150, 100),
        _x("k3", "kernel", 7, 260, 40),
        _x("Memcpy DtoH (Device -> Pinned)", "gpu_memcpy", 8, 80, 40),
        _x("cudaLaunchKernel", "cuda_runtime", 1, 0, 5),
        _x("cudaLaunchKernel", "cuda_runtime", 1, 140, 5),
        _x("cudaLaunchKernel", "cuda_runtime", 1, 255, 5),
        _x("cudaLaunchKernel", "cuda_runtime", 2, 10, 5),
        _x("ssdtrain::pack", "user_annotation", 1, 95, 30),
        _x("cudaEventSynchronize", "cuda_runtime", 1, 100, 20),
        _x("ssdtrain::write", "user_annotation", 2, 0, 50),
        _x("ssdtrain::write", "user_annotation", 2, 40, 30),   # overlaps: 70 in all
        {"ph": "i", "name": "instant", "ts": 5, "tid": 1},      # not a span: ignored
    ]
    s = summarize_trace(events)
    assert s["launch_thread"] == 1
    assert s["step_ms"] == pytest.approx(0.3)
    assert s["launch_thread_in_ssdtrain_ms"] == pytest.approx(0.03)
    assert s["launch_thread_ssdtrain_ranges_ms"] == {"ssdtrain::pack": pytest.approx(0.03)}
    assert s["launch_thread_runtime_calls"]["cudaEventSynchronize"] == \
        {"count": 1, "ms": pytest.approx(0.02)}
    assert s["launch_thread_runtime_calls"]["cudaLaunchKernel"]["count"] == 3
    assert s["other_threads_in_ssdtrain_ms"] == {"2": pytest.approx(0.07)}
    d = s["device"]
    assert d["kernel_ms"] == pytest.approx(0.24) and d["idle_ms"] == pytest.approx(0.06)
    assert [g["ms"] for g in d["longest_gaps"]] == [pytest.approx(0.05), pytest.approx(0.01)]
    assert d["longest_gaps"][0]["launch_thread_was_in"] == ["ssdtrain::pack",
                                                            "cudaEventSynchronize"]
    assert d["copies"] == {"DtoH": {"ms": pytest.approx(0.04), "count": 1,
                                    "overlapping_kernels_ms": pytest.approx(0.02)}}


def test_summary_of_no_events():
    assert summarize_trace([]) == {"empty": True}


def test_dry_run_traces_each_quota(tmp_path):
    """On the CPU with a loopback device: a trace per run, each quota's budget a share of
    the bytes the sizing step offloaded, ssdtrain's pack and unpack ranges found on the
    launching thread, and the summary files written."""
    out = tmp_path / "trace"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "gpu_trace.py"), "--small",
                           "--cpu-dry-run", "--dtype", "float32", "--quotas", "0.25", "1",
                           "--warmup", "0", "--steps", "1", "--out", str(out)],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads((out / "summary.json").read_text())
    assert (out / "summary.md").read_text().startswith("## gpu_trace:")
    assert [r["name"] for r in data["runs"]] == ["none", "quota-0.25", "quota-1"]
    assert data["saved_bytes"] > 0
    quarter, whole = data["runs"][1], data["runs"][2]
    assert quarter["budget_bytes"] == int(0.25 * data["saved_bytes"])
    assert 0 < quarter["offloaded_bytes_per_step"] <= quarter["budget_bytes"]
    assert quarter["offloaded_bytes_per_step"] < whole["offloaded_bytes_per_step"]
    for r in data["runs"]:
        assert Path(r["trace"]).is_file() and len(r["step_s"]) == 1
    ranges = whole["summary"]["launch_thread_ssdtrain_ranges_ms"]
    assert "ssdtrain::pack" in ranges and "ssdtrain::unpack" in ranges
    assert data["runs"][0]["summary"]["launch_thread_in_ssdtrain_ms"] == 0


def test_dry_run_ab_runs_each_quota_both_ways(tmp_path):
    """``--ab``: each quota shipped (hooks off past the window: steps cut) and as before
    (hooks on to the end of forward, the window at prefetch_bytes: no step cut)."""
    out = tmp_path / "trace"
    # A window far below the small model's step, so that the shipped steps are cut.
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), SSDTRAIN_PREFETCH_BYTES="64KiB")
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "gpu_trace.py"), "--small",
                           "--cpu-dry-run", "--dtype", "float32", "--quotas", "0.0625", "--ab",
                           "--warmup", "1", "--steps", "2", "--out", str(out)],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = json.loads((out / "summary.json").read_text())["runs"]
    assert [r["name"] for r in runs] == ["none", "quota-0.0625",
                                         "quota-0.0625-hooked-fixed-window"]
    shipped, before = runs[1], runs[2]
    assert shipped["shipped"] and not before["shipped"]
    assert shipped["hooks_cut_steps"] > 0 and before["hooks_cut_steps"] == 0
