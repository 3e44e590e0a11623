"""benchmarks/verify_overhead.py runs once at a tiny size; its checks are not vacuous.

Timings are printed by the benchmark, never asserted here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ssdtrain.io import checksum as _checksum

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(not _checksum.available(), reason="needs ssdtrain._C (pip install -e .)")
def test_verify_overhead_tiny(tmp_path, spill_dir):
    out = tmp_path / "verify.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO_ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / "verify_overhead.py"), "--tiny",
         "--pairs", "1", "--spill-dir", str(spill_dir), "--json", str(out)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| verify | median step wall (s) |" in proc.stdout
    result = json.loads(out.read_text())
    assert result["grads_equal"] is True
    assert len(result["pairs"]) == 1 and result["crc32c_gb_per_s"] > 0
    assert set(result["samples"]) == {"False", "True"}
    assert list(spill_dir.iterdir()) == []
