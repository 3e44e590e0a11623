"""The benchmarks run once at a tiny size: they work, and their checks are not vacuous.

Timings are printed by the benchmark, never asserted here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
MODES = ["none", "ssdtrain", "recompute", "torch_save", "save_on_cpu"]


def test_step_overhead_tiny(tmp_path, spill_dir):
    out = tmp_path / "step_overhead.json"
    spill = spill_dir
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in
                                         env.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / "step_overhead.py"), "--tiny",
         "--repeats", "1", "--steps", "1", "--spill-dir", str(spill), "--json", str(out)],
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    # The table was printed, one row per mode.
    assert "| mode | step time median (s) | ratio to none |" in proc.stdout
    for mode in MODES:
        assert f"| {mode} |" in proc.stdout

    result = json.loads(out.read_text())
    assert set(result["summary"]) == set(MODES)
    for mode in MODES:
        assert not result["summary"][mode].get("failed"), mode
        runs = [r for r in result["runs"] if r["mode"] == mode]
        assert len(runs) == 1 and "error" not in runs[0], runs
        assert len([s for s in runs[0]["steps"] if not s["warmup"]]) == 1
    for mode in ["ssdtrain", "recompute", "torch_save", "save_on_cpu"]:
        assert result["summary"][mode]["grads_equal"] is True, (mode, result["summary"][mode])

    # ssdtrain really offloaded (the equality above is not that of a no-op), each
    # storage once, and torch_save really wrote files.
    ssd = result["summary"]["ssdtrain"]
    assert ssd["written_bytes_per_step"] > 0
    run = next(r for r in result["runs"] if r["mode"] == "ssdtrain")
    step = run["steps"][-1]
    # Backward reads the records back, or (writes still in flight on a slow disk) uses
    # them from memory: which one depends on the disk's speed, not on ssdtrain.
    assert step["stats"]["records_written"] > 0
    assert step["stats"]["bytes_read"] > 0 or step["stats"]["forwarded"] > 0, step["stats"]
    assert ssd["max_writes_per_record"] == 1
    assert result["summary"]["torch_save"]["written_bytes_per_step"] > 0
    assert any(t["name"] == "every storage written once" and t["met"] for t in result["targets"])

    # The spill directory is left empty (ssdtrain's files are anonymous; torch_save's removed).
    assert list(spill.iterdir()) == []


def test_step_overhead_compute_threads_tiny(tmp_path, spill_dir):
    """The accelerator analog (--compute-threads 1) runs beside the all-cores mode, with the
    keep_tail_bytes=0 variant, each compared with none at its own thread count; with
    --trace, each ssdtrain mode writes a Chrome trace of one more step holding
    ssdtrain's ranges (which thread records which: tests/test_trace.py)."""
    out = tmp_path / "step_overhead.json"
    trace = tmp_path / "step.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in
                                         env.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / "step_overhead.py"), "--tiny",
         "--repeats", "1", "--steps", "1", "--threads", "2", "--compute-threads", "1",
         "--spill-dir", str(spill_dir), "--json", str(out), "--trace", str(trace)],
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "### accelerator analog: torch.set_num_threads(1)" in proc.stdout
    assert "| ssdtrain_tail0 |" in proc.stdout

    result = json.loads(out.read_text())
    modes = ["none", "ssdtrain", "ssdtrain_tail0"]  # the default modes with --compute-threads
    assert result["modes"] == modes
    analog = result["compute_threads"]
    assert analog["threads"] == 1
    for summary in (result["summary"], analog["summary"]):
        assert set(summary) == set(modes)
        for mode in modes:
            assert not summary[mode].get("failed"), (mode, summary[mode])
            assert summary[mode]["grads_equal"] is True, mode
            assert summary[mode]["step_ratio"] > 0
        for mode in ("ssdtrain", "ssdtrain_tail0"):
            assert summary[mode]["written_bytes_per_step"] > 0, mode
    # Each worker really ran with its thread count, and every (mode, threads) ran once.
    seen = sorted((r["mode"], r["compute_threads"], r["threads"]) for r in result["runs"])
    assert seen == sorted((m, n, n) for m in modes for n in (1, 2)), seen
    tail0 = [r for r in result["runs"] if r["mode"] == "ssdtrain_tail0"]
    assert all(r["offload_config"]["keep_tail_bytes"] == 0 for r in tail0)
    assert any(t["name"].startswith("accelerator analog (1 compute threads), step time <= 1.02x")
               for t in result["targets"])

    # --trace: one file per ssdtrain mode, from its first repeat at --threads, named in
    # the output; the measured steps are not the traced one (1 step measured above).
    paths = {"ssdtrain": trace, "ssdtrain_tail0": tmp_path / "step.ssdtrain_tail0.json"}
    for mode, path in paths.items():
        assert f"Trace ({mode}, one more step after repeat 1): {path}" in proc.stdout
        names = {e.get("name") for e in json.loads(path.read_text())["traceEvents"]}
        for name in ("ssdtrain::pack", "ssdtrain::unpack", "ssdtrain::write",
                     "ssdtrain::end_forward", "ssdtrain::flush"):
            assert name in names, (mode, name)
    traced = [r for r in result["runs"] if r.get("trace")]
    assert sorted((r["mode"], r["compute_threads"]) for r in traced) == \
        [("ssdtrain", 2), ("ssdtrain_tail0", 2)]
    assert list(spill_dir.iterdir()) == []


def _common_module():
    import importlib.util
    spec = importlib.util.spec_from_file_location("_bench_common",
                                                  REPO_ROOT / "benchmarks" / "_common.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_md_table_aligns_and_refuses_a_short_row():
    import pytest
    common = _common_module()
    assert common.md_table(["way", "ms>"], [["none", 1.5], ["ssd", "2.0"]]).splitlines() == [
        "| way | ms |", "| --- | ---: |", "| none | 1.5 |", "| ssd | 2.0 |"]
    with pytest.raises(ValueError, match="a row of 1 cells for 2 columns"):
        common.md_table(["way", "ms>"], [["none"]])


def test_every_benchmark_table_comes_from_md_table():
    """The header rule of a markdown table (``| --- |``, ``---: |``) is written in
    benchmarks/_common.py only: every benchmark's table goes through md_header/md_table,
    so they read alike and one change reaches all."""
    import re
    rule = re.compile(r"\|\s*-{3}:?\s*\|")
    found = [f"{path.name}:{i}" for path in sorted((REPO_ROOT / "benchmarks").glob("*.py"))
             if path.name != "_common.py"
             for i, line in enumerate(path.read_text().splitlines(), 1) if rule.search(line)]
    assert not found, f"tables built by hand (use _common.md_table): {found}"
