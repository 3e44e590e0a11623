"""``make gpu-bench`` (benchmarks/gpu_bench.py): its CPU dry run on the loopback device
gives every row of both tables, exact, in the JSON schema automation reads; without
CUDA the real run says why and exits 2; rows that did not run are listed, never
reported as measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "benchmarks", "gpu_bench.py")
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import gpu_bench  # noqa: E402


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    env = dict(os.environ, PYTHONPATH=REPO)
    for k in [k for k in env if k.startswith("SSDTRAIN_")]:
        del env[k]
    proc = subprocess.run([sys.executable, SCRIPT, "--cpu-dry-run", "--out", str(out),
                           "--date", "2026-01-02", "--auto-warmup", "8", "--adaptive-warmup", "4",
                           "--steps", "2",
                           "--warmup", "1"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(out / "gpu_bench_2026-01-02.json") as f:
        data = json.load(f)
    return data, (out / "gpu_bench_2026-01-02.md").read_text(), proc


def test_json_has_the_schema_automation_reads(dry_run):
    data, _, _ = dry_run
    assert isinstance(data["device"], str) and data["date"] == "2026-01-02"
    keys = {"table", "mode", "budget", "step_s", "peak_gib", "exact"}
    for row in data["rows"]:
        assert keys <= set(row) and set(row) - keys <= {"seq"}
        assert row["table"] in ("A", "B") and isinstance(row["exact"], bool)
        assert isinstance(row["step_s"], float) and row["step_s"] > 0
        assert isinstance(row["peak_gib"], float) and row["peak_gib"] > 0
        assert row["budget"] is None or isinstance(row["budget"], str)
    a = [(r["mode"], r["budget"]) for r in data["rows"] if r["table"] == "A"]
    assert a == list(gpu_bench.A_ROWS)
    b = [r["mode"] for r in data["rows"] if r["table"] == "B"]
    assert b == list(gpu_bench.B_ROWS)
    assert isinstance(data["free_bound_gib"], float) and data["free_bound_gib"] > 0
    assert isinstance(data["default_offloaded_gib"], float)
    assert data["missing"] == []


def test_every_row_is_exact(dry_run):
    """Each row's loss and gradients are bitwise its table's reference's (none in A,
    checkpointing with the inputs in memory in B): checkpointing, selective
    checkpointing, save_on_cpu and ssdtrain's rows on the loopback device."""
    data, _, _ = dry_run
    assert all(r["exact"] for r in data["rows"]), [r for r in data["rows"] if not r["exact"]]


def test_table_b_offloads_every_layer_input(dry_run):
    """ssdtrain's rows of table B move at least the layers' inputs each step (keep_tail
    is 0 in the dry run), to RAM or to the SSD; the synchronous baseline is not
    ssdtrain's."""
    data, _, _ = dry_run
    b = {d["mode"]: d for d in data["details"] if d["table"] == "B"}
    inputs = b["checkpoint"]["inputs_bytes"]
    for mode in ("ssdtrain_ram", "ssdtrain_ssd"):
        assert b[mode]["offloaded_gib"] * (1 << 30) >= inputs, mode
    assert b["ssdtrain_ssd"]["written_gib"] * (1 << 30) >= inputs
    assert b["ssdtrain_ram"]["written_gib"] == 0
    assert b["ssdtrain_ram"]["host_loaded_gib"] > 0 or b["ssdtrain_ram"]["offloaded_gib"] > 0


def test_budget_rows_plan_within_their_budget(dry_run):
    data, _, _ = dry_run
    budgets = [d for d in data["details"] if d["mode"] == "budget"]
    assert len(budgets) == 3
    for d in budgets:
        assert d["memory_budget_bytes"] >= 1 and d["plan"]


def test_report_has_both_tables_and_every_target(dry_run):
    _, md, proc = dry_run
    assert "## Table A" in md and "## Table B" in md and "## Targets" in md
    for mode in ("sac", "save_on_cpu", "offload_all", "checkpoint_offload_sync",
                 "ssdtrain_ssd"):
        assert f"| {mode} |" in md
    assert "every row exact" in md
    assert "table A done" in proc.stderr and "table B done" in proc.stderr


def test_without_cuda_it_says_why_and_exits_2():
    import torch
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    proc = subprocess.run([sys.executable, SCRIPT, "--out", "/nonexistent"],
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == gpu_bench.EXIT_NO_CUDA
    assert "CUDA is not available" in proc.stderr and not os.path.exists("/nonexistent")


def _row(mode, budget=None, digest="d", **extra):
    return dict({"mode": mode, "budget": budget, "step_s": [1.0, 1.0], "peak": [2 << 30],
                 "peak_delta": [1 << 30], "stats": [], "digest": digest, "repeats": True},
                **extra)


def test_rows_not_measured_are_listed_not_reported():
    """A skipped, out-of-memory or failed row is in ``missing`` with its reason, never in
    ``rows``; a row whose digest differs from the reference's is not exact; a table
    whose worker failed is missing as a whole; targets needing absent rows say so."""
    results = {
        "A": {"device": "X", "rows": [
            _row("none", saved_bytes=1 << 29), _row("checkpoint", digest="other"),
            dict(_row("sac"), oom="CUDA out of memory"),
            dict(_row("save_on_cpu"), skipped="out of time (--budget-s)"),
            dict(_row("default"), error="RuntimeError: boom")]},
        "B": {"error": "exit 1: Traceback"}}
    data = gpu_bench.summarize(results, "2026-01-02", "cmd")
    assert [(r["mode"], r["exact"]) for r in data["rows"]] == [("none", True),
                                                               ("checkpoint", False)]
    why = {m.get("mode"): m["why"] for m in data["missing"]}
    assert why["sac"].startswith("out of memory") and "budget-s" in why["save_on_cpu"]
    assert "boom" in why["default"] and why[None].startswith("worker failed")
    assert data["free_bound_gib"] is None and data["default_offloaded_gib"] is None
    texts = dict(data["targets"])
    assert texts["A: default vs the free bound: not measured"] is None
    assert any(t.startswith("A and B: every row exact") and met is False
               for t, met in data["targets"])
    md = gpu_bench.render(data)
    assert "## Not measured" in md and "out of memory" in md


def test_a_worker_that_hangs_is_killed_at_its_limit(tmp_path):
    """A table's worker stuck past its limit is killed (``spawn_worker(timeout=...)``),
    so the other table and the report still come: return code -9 and why."""
    import _common
    script = tmp_path / "hang.py"
    script.write_text("import time\ntime.sleep(60)\n")
    proc, wall, text = _common.spawn_worker(str(script), "t", "A", {}, dict(os.environ),
                                            timeout=1)
    assert proc.returncode == -9 and "killed after 1 s" in proc.stderr
    assert text == "" and wall < 30
