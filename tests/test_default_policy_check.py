"""benchmarks/default_policy_check.py: a tiny run of its gradient-accumulation scenario
writes one row per micro-batch, with a share of the saved bytes in [0, 1] (or none where
the policy turned the hooks off) and the policy's reason, and a summary that agrees with
the rows."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_tiny_accumulation_run_reports_every_micro_batch(tmp_path):
    out = tmp_path / "check.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "benchmarks", "default_policy_check.py"),
         "--scenario", "accum", "--steps", "3", "--micro-batches", "2", "--optimizer-s", "0",
         "--warmup", "2", "--spill-dir", str(tmp_path), "--json", str(out)],
        capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert len(rows) == 6 and [r["step"] for r in rows] == [0, 0, 1, 1, 2, 2]
    assert rows[0]["share"] == 1.0 and "sizing" in rows[0]["reason"]  # the sizing step
    assert all(math.isnan(r["share"]) or 0.0 <= r["share"] <= 1.0 for r in rows)
    after = [0.0 if math.isnan(r["share"]) else r["share"] for r in rows[2:]]
    assert data["summary"]["mean_share_after_warmup"] == sum(after) / len(after)
    assert "| step | share offloaded | reason |" in proc.stdout


def test_the_static_comparison_times_every_way_in_turn(tmp_path):
    """--static-ab: none, static and static without verify, each timed every round; the
    ratios are to none's median, and static wrote (the model's tensors are eligible)."""
    out = tmp_path / "check.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "benchmarks", "default_policy_check.py"),
         "--scenario", "accum", "--steps", "1", "--micro-batches", "1", "--optimizer-s", "0",
         "--warmup", "0", "--static-ab", "2", "--threads", "1", "--spill-dir", str(tmp_path),
         "--json", str(out)],
        capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ab = json.loads(out.read_text())["static_ab"]
    assert list(ab) == ["none", "static", "static, verify off"]
    assert all(len(a["steps"]) == 2 and a["step_s"] > 0 for a in ab.values())
    assert ab["none"]["ratio"] == 1.0
    assert ab["none"]["offloaded_bytes"] == 0
    assert ab["static"]["offloaded_bytes"] == ab["static, verify off"]["offloaded_bytes"] > 0
    assert "| way | step (ms) | x none |" in proc.stdout and "1 torch threads" in proc.stdout
