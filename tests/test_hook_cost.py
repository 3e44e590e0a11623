"""benchmarks/hook_cost.py runs once at a tiny size: its JSON has every row, and the
rows measure what they say (records really written, on-demand unpacks really read).

Timings are printed by the benchmark, never asserted here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
HOOK_COST = REPO_ROOT / "benchmarks" / "hook_cost.py"
KiB, MiB = 1 << 10, 1 << 20
SIZES = [1 * KiB, 64 * KiB, 256 * KiB, 1 * MiB]  # --tiny's


def test_hook_cost_tiny(tmp_path, spill_dir):
    out = tmp_path / "hook_cost.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in
                                         env.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.run([sys.executable, str(HOOK_COST), "--tiny", "--spill-dir", str(spill_dir),
                           "--json", str(out)], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| size | config | verify | fate | pack median (µs) |" in proc.stdout
    assert "| engine | step (s) | ratio to none | inside ssdtrain (ms/step) |" in proc.stdout

    result = json.loads(out.read_text())
    configs = result["settings"]["configs"]
    assert {"identity", "native-threads", "posix"} <= set(configs), result["settings"]
    assert set(configs) | set(result["settings"]["skipped"]) == \
        {"identity", "native-uring", "native-threads", "posix"}
    rows = {(r["size"], r["config"], r["verify"]): r for r in result["records"]}
    expected = {(s, c, v) for s in SIZES for c in configs
                for v in ([False] if c == "identity" else [True, False])}
    assert set(rows) == expected
    for (size, config, verify), r in rows.items():
        pack = r["pack"]
        assert pack["n"] >= 2 and 0 < pack["median_us"] <= pack["p99_us"] <= pack["max_us"], r
        if config == "identity":
            assert r["fate"] == "hooks only" and set(r["unpack"]) == {"prefetched"}
            continue
        assert set(r["unpack"]) == {"prefetched", "on-demand"}, r
        for p in ("prefetched", "on-demand"):
            assert r["unpack"][p]["n"] == pack["n"] // 2, (p, r)
            assert r["unpack"][p]["median_us"] > 0
        st = r["stats"]
        if size < 256 * KiB:  # below min_tensor_bytes: kept, nothing written or read
            assert r["fate"] == "kept", r
            assert st["on-demand"]["records_written"] == 0 and st["on-demand"]["bytes_read"] == 0
            continue
        assert r["fate"] == "written", r
        n = pack["n"] // 2
        for p in ("prefetched", "on-demand"):
            assert st[p]["records_written"] == n and st[p]["offloaded_bytes"] == n * size, (p, r)
        # Prefetched: every unpack found its record in memory; on-demand: every one read.
        assert st["prefetched"]["prefetch_misses"] == 0, r
        assert st["on-demand"]["prefetch_misses"] == n, r
        assert st["on-demand"]["bytes_read"] == n * size, r

    gpt = result["gpt"]
    assert [r["engine"] for r in gpt["runs"]] == ["none", "native", "posix"]
    for run in gpt["runs"]:
        steps = [s for s in run["steps"] if not s["warmup"]]
        assert len(steps) == 1
        if run["engine"] == "none":
            assert steps[0]["packs"] == 0
            continue
        s = steps[0]
        assert s["packs"] > 0 and s["unpacks"] == s["packs"], s
        assert 0 < s["inside_s"] < s["step_s"] and s["inside_share"] == s["inside_s"] / s["step_s"]
        assert run["final_stats"]["offloaded_bytes"] > 0  # the tiny GPT really offloads
        assert run["summary"]["inside_share_median"] > 0
    names = [t["name"] for t in result["targets"]]
    assert any(n.startswith("pack <=") for n in names)
    assert any(n.startswith("training-thread time inside ssdtrain") for n in names)
    assert list(spill_dir.iterdir()) == []


def test_hook_cost_accelerator_compute(tmp_path, spill_dir):
    """``--compute accelerator``: the records are filled before the timed loop and every
    record of a run is saved in one step; the rows measure the same things."""
    out = tmp_path / "hook_cost.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in
                                         env.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.run([sys.executable, str(HOOK_COST), "--tiny", "--compute", "accelerator",
                           "--no-gpt", "--configs", "identity", "posix", "--sizes", "1KiB",
                           "1MiB", "--spill-dir", str(spill_dir), "--json", str(out)],
                          cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "compute between saves: accelerator" in proc.stdout
    result = json.loads(out.read_text())
    assert result["settings"]["compute"] == "accelerator" and result["gpt"] is None
    rows = {(r["size"], r["config"], r["verify"]): r for r in result["records"]}
    r = rows[(1 * MiB, "posix", True)]
    n = r["pack"]["n"] // 2
    assert r["fate"] == "written" and r["stats"]["on-demand"]["bytes_read"] == n * MiB
    assert r["stats"]["prefetched"]["prefetch_misses"] == 0
    assert rows[(1 * KiB, "posix", False)]["fate"] == "kept"
