"""``make gpu-check`` (tools/gpu_check.py): without CUDA it says why and exits 2, running
nothing; its phases keep their logs and outcome under one time budget, and the report
says what failed."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = REPO_ROOT / "tools" / "gpu_check.py"


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_it_says_why_and_exits_2(tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPT)], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120, env={"GPU_CHECK_DIR": str(tmp_path / "r"),
                                                      "PATH": "/usr/bin:/bin"})
    assert out.returncode == 2, out.stderr
    assert "no usable CUDA device" in out.stderr and "Nothing was run" in out.stderr
    assert not (tmp_path / "r").exists()


def test_phases_keep_logs_and_respect_the_budget(tmp_path):
    gc = _module()
    phases = gc.Phases(str(tmp_path), budget_s=60)
    ok = phases.run("ok", [sys.executable, "-c", "print('hello')"], 30)
    bad = phases.run("bad", [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"], 30)
    slow = phases.run("slow", [sys.executable, "-c", "import time; time.sleep(30)"], 6)
    assert (ok["status"], bad["status"], slow["status"]) == ("passed", "failed", "timed out")
    assert bad["returncode"] == 3 and "boom" in bad["tail"]
    assert (tmp_path / "ok.log").read_text().strip() == "hello"
    phases.deadline = 0  # the budget is spent: later phases are skipped, not run
    assert phases.run("late", [sys.executable, "-c", "pass"], 30)["status"] == "skipped"
    env = {"gpu": "none (test)", "gds": {"summary": "kvikio does not import"}}
    gc.write_report(str(tmp_path), env, phases, {"smoke": str(tmp_path / "missing.json")}, 0)
    report = (tmp_path / "report.md").read_text()
    assert "| bad | failed |" in report and "boom" in report and "(no JSON written)" in report
    data = json.loads((tmp_path / "report.json").read_text())
    assert [p["status"] for p in data["phases"]] == ["passed", "failed", "timed out", "skipped"]
