"""examples/microbatch_sweep.py and examples/rok_curve.py run at a tiny size.

Each configuration runs in its own process, so these take a few seconds per
run. Timings are printed by the scripts, never asserted here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def _run(script, *args, tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in env.get(
        "PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "examples" / script), *args],
                          cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    return proc.stdout


def test_microbatch_sweep_tiny(tmp_path, spill_dir):
    out = tmp_path / "sweep"
    stdout = _run("microbatch_sweep.py", "--tiny", "--sizes", "1", "--steps", "1", "--out",
                  str(out), "--spill-dir", str(spill_dir), tmp_path=tmp_path)
    assert "| setup | batch 1 | largest fit |" in stdout
    result = json.loads((out / "results.json").read_text())
    assert (out / "results.md").read_text().strip() == stdout.strip()
    assert (out / "microbatch_sweep.png").stat().st_size > 1000
    runs = {r["setup"]: r for r in result["runs"]}
    assert set(runs) == {"none", "recompute", "static", "adaptive"}
    for r in runs.values():
        assert "error" not in r, r
        assert r["peak_rss"] > 0 and r["tokens_per_s"] > 0 and len(r["step_s"]) == 1
    # The budget is none's own peak at the budget batch, so none fits it.
    assert result["budget_rss"] == runs["none"]["peak_rss"]
    assert result["summary"]["none"]["largest_fit"] == 1
    # ssdtrain really offloaded, and the adaptive run planned from its profile.
    assert runs["static"]["written_bytes_per_step"] > 0
    plan = runs["adaptive"]["plan"]
    assert len(plan["choices"]) == 2 and plan["predicted_step_s"] > 0
    assert runs["adaptive"]["memory_budget_bytes"] >= 1
    names = [t["name"] for t in result["targets"]]
    assert any("predicted step time" in n for n in names)
    assert list(spill_dir.iterdir()) == []


def test_rok_curve_tiny(tmp_path, spill_dir):
    out = tmp_path / "rok"
    stdout = _run("rok_curve.py", "--tiny", "--steps", "1", "--out", str(out), "--spill-dir",
                  str(spill_dir), tmp_path=tmp_path)
    result = json.loads((out / "rok.json").read_text())
    assert (out / "rok_curve.png").stat().st_size > 1000
    labels = ["kk", "ok", "oo", "ro", "rr"]
    for lab in labels:
        assert f"| `{lab}` |" in stdout
    runs = result["runs"]
    assert ["".join(c[0] for c in r["choices"]) for r in runs] == labels
    for r in runs:
        assert "error" not in r, r
        # The plan in force is the one asked for, and it was predicted from a profile.
        assert r["plan"]["choices"] == r["choices"] and r["plan"]["predicted_step_s"] > 0
    written = {lab: r["written_bytes_per_step"] for lab, r in zip(labels, runs)}
    # Keep-all writes only what lies outside the blocks; offloading blocks writes more;
    # recomputing them writes only their inputs.
    assert written["oo"] > written["ok"] > written["kk"]
    assert written["rr"] < written["oo"]
