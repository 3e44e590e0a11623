"""examples/zero_infinity_nvme.py: ZeRO-Infinity (parameters and optimizer state on NVMe
through DeepSpeed's async_io op) plus ssdtrain's activations, exact against the same run
without the "ssdtrain" section.

Marked ``slow`` and skipped unless DeepSpeed's ``async_io`` op is already built (its JIT
build takes about 7 minutes): ``make zero-infinity`` builds it into
build/torch_extensions and runs this test. Timings are printed, never asserted.
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
from zero_infinity_nvme import async_io_status  # noqa: E402  (imports no torch, no DeepSpeed)


@pytest.mark.slow
def test_zero_infinity_recipe_is_exact(tmp_path):
    built, detail = async_io_status()
    if not built:
        pytest.skip(detail)
    out = tmp_path / "zi.json"
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in env.get(
        "PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "examples" / "zero_infinity_nvme.py"),
         "--spill-dir", str(tmp_path), "--steps", "2", "--json", str(out)],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        timeout=900)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert "bitwise equal to ZeRO-Infinity without the ssdtrain section: yes" in proc.stdout
    result = json.loads(out.read_text())
    assert result["exact"]
    for run in ("reference", "ssdtrain"):
        # Parameters and optimizer state really went to NVMe through DeepSpeed.
        assert sum(result[run]["nvme_zero_files"].values()) > 0, result[run]
    act = result["ssdtrain"]["activations"]
    assert act["offloaded_bytes_per_step"] > 0 and act["read_bytes_per_step"] > 0
    assert "activations" not in result["reference"]
    # Everything was in the temporary directory the recipe made under --spill-dir.
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("zero_infinity_")] == []
