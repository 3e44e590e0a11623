"""examples/pipeline_sweep.py at a tiny size (two stages per run, each run in fresh processes).

Timings are printed by the script, never asserted here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "examples"))


def test_bubble_formula():
    import pipeline_sweep
    assert pipeline_sweep.bubble(1) == 0.5
    assert pipeline_sweep.bubble(2) == pytest.approx(1 / 3)
    assert pipeline_sweep.bubble(8, p=4) == pytest.approx(3 / 11)


def test_pipeline_sweep_tiny(tmp_path, spill_dir):
    out = tmp_path / "sweep"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in env.get(
        "PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "examples" / "pipeline_sweep.py"), "--tiny",
         "--micro-batches", "1", "2", "--setups", "none", "ssdtrain", "--steps", "1",
         "--prefetch-mib", "0",
         "--out", str(out), "--spill-dir", str(spill_dir)],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    stdout = proc.stdout
    assert "| setup | m=1 | m=2 | largest m that fits | bubble there | step there |" in stdout
    assert "VmHWM" in stdout  # says how memory was measured
    assert (out / "results.md").read_text().strip() == stdout.strip()
    assert (out / "pipeline_sweep.png").stat().st_size > 1000
    result = json.loads((out / "results.json").read_text())
    runs = {(r["setup"], r["m"]): r for r in result["runs"]}
    assert set(runs) == {(s, m) for s in ("none", "ssdtrain") for m in (1, 2)}
    for r in runs.values():
        assert "error" not in r, r
        assert len(r["stages"]) == 2 and r["step_s_median"] > 0
        assert all(s["peak_rss"] > 0 and len(s["step_s"]) == 1 for s in r["stages"])
    # The budget is none's own larger stage peak at the budget m (1 when tiny): it fits.
    # (m=2 may fit too: at the tiny size its activations are within the noise of a
    # process's peak RSS.)
    assert result["budget_rss_per_stage"] == runs[("none", 1)]["peak_rss"]
    fit = result["summary"]["none"]["largest_fit"]
    assert fit in (1, 2)
    import pipeline_sweep
    assert result["summary"]["none"]["bubble_at_largest_fit"] == \
        pytest.approx(pipeline_sweep.bubble(fit))
    # ssdtrain really offloaded and read back on both stages, more with more in flight.
    # With no prefetch window a record is read when backward needs it, if its write has
    # ended by then (else its bytes are still in memory and serve backward): certain at
    # m=2 (the first micro-batch's writes had the second's forward to end), likely but
    # timing-dependent at m=1 on the last stage, whose backward follows its forward.
    for m in (1, 2):
        stages = runs[("ssdtrain", m)]["stages"]
        assert all(stage["written_bytes_per_step"] > 0 for stage in stages)
        assert sum(stage["read_bytes_per_step"] for stage in stages) > 0
    assert all(stage["read_bytes_per_step"] > 0 for stage in runs[("ssdtrain", 2)]["stages"])
    for k in range(2):
        assert runs[("ssdtrain", 2)]["stages"][k]["written_bytes_per_step"] == \
            2 * runs[("ssdtrain", 1)]["stages"][k]["written_bytes_per_step"]
    assert list(spill_dir.iterdir()) == []
