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


def _smoke_module():
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    import gpu_smoke
    return gpu_smoke


def _run(mode, step_s, *, pinned=None):
    """A gpu_smoke worker's result with one measured step (what ``summarize`` reads)."""
    stats = dict(offloaded_bytes=8 << 20, kept_bytes=1 << 20, bytes_written=0, stall_seconds=0.0,
                 prefetch_misses=0, peak_host_bytes=8 << 20, host_loaded_bytes=8 << 20,
                 host_spilled_bytes=0, over_budget_bytes=0)
    step = dict(warmup=False, step_s=step_s, peak_mem=3 << 30, peak_mem_delta=1 << 30,
                host_peak_rss_delta=0, host_pinned_peak=pinned, stats=stats)
    return dict(mode=mode, repeat=0, digest={"sha256": "same"}, param_count=1, param_bytes=2,
                engine="native", host_budget_bytes=(1 << 63) - 1, steps=[step])


def test_report_gives_the_host_tier_verdict_or_says_not_measured(tmp_path):
    """The report has one line per gpu_smoke run: the host tier alone (ssdtrain-ram)
    against save_on_cpu, a step-time ratio; "not measured" where either did not run (a
    missing JSON, a run without one of the modes, a failed mode). Without the host-tier
    mode there is no such line (and ``summarize`` has no ``ssdtrain-ram`` numbers)."""
    gc, smoke = _module(), _smoke_module()
    modes = ["none", "ssdtrain-ram", "save_on_cpu"]
    runs = [_run("none", 1.0), _run("ssdtrain-ram", 1.5, pinned=9 << 20),
            _run("save_on_cpu", 3.0, pinned=16 << 20)]
    summary, _ = smoke.summarize(runs, modes)
    both = tmp_path / "both.json"
    both.write_text(json.dumps({"summary": summary, "modes": modes}))
    summary, _ = smoke.summarize(runs[:2], modes[:2])
    only_ram = tmp_path / "only_ram.json"
    only_ram.write_text(json.dumps({"summary": summary, "modes": modes[:2]}))
    phases = gc.Phases(str(tmp_path), budget_s=60)
    env = {"gpu": "none (test)", "gds": {"summary": "kvikio does not import"}}
    gc.write_report(str(tmp_path), env, phases, {"a": str(both), "b": str(only_ram),
                                                 "c": str(tmp_path / "missing.json")}, 0)
    report = (tmp_path / "report.md").read_text()
    assert ("**Verdict**: host tier vs save_on_cpu: ssdtrain-ram step 1.500 s, save_on_cpu "
            "3.000 s: ratio 0.500 (faster than save_on_cpu)") in report
    assert "pinned host peak 9.00 MiB vs 16.00 MiB" in report
    assert "| ssdtrain-ram | 1.500 | 1.500 |" in report and "host tier budget unlimited" in report
    verdicts = json.loads((tmp_path / "report.json").read_text())["host_tier_vs_save_on_cpu"]
    assert "ratio 0.500" in verdicts["a"]
    assert verdicts["b"] == "host tier vs save_on_cpu: not measured (save_on_cpu: not run or " \
                            "failed)"
    assert verdicts["c"].startswith("host tier vs save_on_cpu: not measured")
    failed = smoke.host_tier_verdict({"ssdtrain-ram": {"failed": True}, "save_on_cpu": {}})
    assert "not measured (ssdtrain-ram" in failed


@pytest.mark.parametrize("text,want", [
    ("0.5x", {"fraction": 0.5}), ("2x", {"fraction": 2.0}), ("4GiB", {"bytes": 4 << 30}),
    ("auto", {"bytes": "auto"}), ("Unlimited", {"bytes": "unlimited"}), ("0", {"bytes": 0})])
def test_host_budget_forms(text, want):
    assert _smoke_module().parse_host_budget(text) == want


@pytest.mark.parametrize("text", ["-1x", "nanx", "x", "lots", "-4GiB", "1e400x"])
def test_bad_host_budget_exits_2_before_any_run(text, capsys, tmp_path):
    smoke = _smoke_module()
    with pytest.raises(SystemExit) as e:
        smoke.main(["--cpu-dry-run", "--small", f"--host-budget={text}",
                    "--json", str(tmp_path / "g.json")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"--host-budget {text!r}" in err and "0.5x" in err and "Traceback" not in err
    assert not (tmp_path / "g.json").exists()
