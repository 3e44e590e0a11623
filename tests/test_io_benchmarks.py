"""The I/O bandwidth benchmark and the GPU smoke script run once at a tiny size.

They work, every configuration produces positive numbers, the data read back is
checked against the data written (and a corrupted read is caught), and the GPU
script refuses clearly where there is no CUDA. Timings are printed by the scripts,
never asserted here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
IO_BANDWIDTH = REPO_ROOT / "benchmarks" / "io_bandwidth.py"
GPU_SMOKE = REPO_ROOT / "benchmarks" / "gpu_smoke.py"
SIZE = 8 << 20
# Always run here: the raw reference (fio or dd), both native back ends where built,
# the posix engine and torch.save. deepspeed_aio runs only where its op is prebuilt.
CORE_CONFIGS = ["raw", "native-uring", "native-threads", "posix", "torch_save"]


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in
                                         env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def _run(script, *args, timeout=300):
    return subprocess.run([sys.executable, str(script), *map(str, args)], cwd=REPO_ROOT,
                          env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          timeout=timeout)


def test_io_bandwidth_tiny(tmp_path):
    out, work = tmp_path / "io.json", tmp_path / "io"
    work.mkdir()
    # Records of 3 MiB + 4 KiB + 1 B: unaligned lengths and a short last record.
    proc = _run(IO_BANDWIDTH, "--size", "8MiB", "--repeats", "1", "--record-size", 3 * 2**20 + 4097,
                "--chunk-size", "1MiB", "--dir", work, "--json", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| config | write GB/s median [min-max] | write / raw |" in proc.stdout

    result = json.loads(out.read_text())
    expected = [c for c in CORE_CONFIGS if c not in result["skipped"]]
    # Every configuration this machine can run ran; a native back end is skipped only
    # with a reason (here both run: the native engine is built and io_uring works).
    assert set(CORE_CONFIGS) - set(expected) <= {"native-uring"}, result["skipped"]
    assert set(expected) <= set(result["configs"])
    if "deepspeed_aio" not in result["configs"]:
        assert "deepspeed_aio" in result["skipped"]
    for config in result["configs"]:
        s = result["summary"][config]
        assert not s.get("failed"), (config, result["runs"])
        assert s["verified"] is True, config
        for phase in ("write", "read"):
            assert s[phase]["gb_per_s_median"] > 0, (config, phase)
            assert s[phase]["cpu_s_per_gb_median"] >= 0, (config, phase)
            assert s[phase]["ratio_to_raw"] > 0, (config, phase)
        assert f"| {config} |" in proc.stdout
    for run in result["runs"]:
        assert "error" not in run, run
        for phase in ("write", "read"):
            p = run["phases"][phase]
            assert p["bytes"] == p["bytes_expected"] == SIZE, (run["config"], phase, p)
            assert p["seconds"] > 0 and p["gb_per_s"] > 0
        if run["config"] != "raw":
            # The bytes read back were compared with the bytes written, record by record.
            assert run["verify"]["method"] == "crc32c per record"
            assert run["verify"]["records"] == 3 and run["verify"]["ok"], run["verify"]
    # The engines really hit the disk, from 64-byte-aligned tensors (the unaligned case).
    for config in set(expected) & {"native-uring", "native-threads", "posix"}:
        run = next(r for r in result["runs"] if r["config"] == config)
        assert run["source_misalign"] != [0] and run["file_bytes"] >= SIZE
        assert run["phases"]["write"]["disk_write_bytes"] >= SIZE, run["phases"]["write"]
        assert run["phases"]["read"]["disk_read_bytes"] >= SIZE, run["phases"]["read"]
    # torch.load read from the device, not from the page cache the save filled.
    torch_save = next(r for r in result["runs"] if r["config"] == "torch_save")
    assert torch_save["phases"]["read"]["disk_over_logical"] > 0.9, torch_save["phases"]["read"]
    # Files are removed.
    assert list(work.iterdir()) == []


def test_io_bandwidth_catches_corrupted_reads(tmp_path):
    """The verification is not vacuous: one flipped byte after a read fails the run loudly.

    The raw reference runs with dd here (the fallback where fio is not installed).
    """
    out, work = tmp_path / "io.json", tmp_path / "io"
    work.mkdir()
    proc = _run(IO_BANDWIDTH, "--size", "2MiB", "--repeats", "1", "--record-size", "1MiB",
                "--configs", "raw", "posix", "--raw-tool", "dd", "--dir", work, "--json", out,
                "--inject-corruption", "posix")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "DATA MISMATCH in posix" in proc.stderr
    result = json.loads(out.read_text())
    raw = result["summary"]["raw"]
    assert raw["engine"].startswith("dd, O_DIRECT") and raw["verified"] is True
    assert raw["write"]["gb_per_s_median"] > 0 and raw["read"]["gb_per_s_median"] > 0
    run = next(r for r in result["runs"] if r["config"] == "posix")
    assert run["error"] == "DATA MISMATCH" and run["verify"]["mismatched_records"] == [1]
    assert result["summary"]["posix"] == {"failed": True}
    assert "| posix | - |" in proc.stdout and "FAILED" in proc.stdout
    assert list(work.iterdir()) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is absent")
def test_gpu_smoke_without_cuda_exits_2(tmp_path):
    proc = _run(GPU_SMOKE, "--small", "--json", tmp_path / "g.json", timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith("gpu_smoke: CUDA is not available:"), proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert not (tmp_path / "g.json").exists()


def _check_smoke(proc, out, modes):
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    for mode in modes:
        s = result["summary"][mode]
        assert not s.get("failed"), (mode, result["runs"])
        assert s["step_s_median"] > 0 and s["peak_mem_median"] > 0
        assert f"| {mode} |" in proc.stdout
    ssd = result["summary"]["ssdtrain"]
    return result, ssd


def _final(result, mode):
    """The offloader's stats at the end of ``mode``'s run (every step, warm-up too)."""
    return next(r["final_stats"] for r in result["runs"] if r["mode"] == mode)


def test_gpu_smoke_cpu_dry_run(tmp_path, spill_dir):
    """The script's whole loop (workers, digests, ssdtrain stats, the host tier's numbers,
    table, verdict, JSON) on CPU, for every mode that offloads, at a tiny size.

    ``--cpu-dry-run`` is a hidden flag for this test: memory columns are host RSS, and
    the ssdtrain modes run on the loopback device (the model's CPU tensors take the
    device path, so the host tier takes them as it takes CUDA tensors). The host-tier
    modes and their numbers are what fails without them (argparse refuses the modes).
    """
    out = tmp_path / "g.json"
    modes = ["none", "ssdtrain", "ssdtrain-host", "ssdtrain-ram", "save_on_cpu"]
    proc = _run(GPU_SMOKE, "--small", "--cpu-dry-run", "--repeats", "1", "--steps", "2",
                "--warmup", "1", "--d-model", "64", "--seq-len", "64", "--vocab", "128",
                "--modes", *modes, "--spill-dir", spill_dir, "--json", out)
    result, ssd = _check_smoke(proc, out, modes)
    summary = result["summary"]
    # Offloading happened, and the gradients are bitwise those of no offload.
    for mode in modes:
        assert summary[mode]["grads_equal"] is True, mode
    assert ssd["offloaded_bytes_per_step"] > 0 and ssd["bytes_written_per_step"] > 0
    assert "host_budget_bytes" not in ssd  # SSD only: no host tier
    assert max(s["stats"]["peak_host_bytes"] for r in result["runs"] if r["mode"] == "ssdtrain"
               for s in r["steps"]) == 0
    # RAM first, the SSD beyond: the sizing step measured what the tier receives (the
    # same decisions as the measured steps make), the default budget is half of it,
    # never exceeded, and both tiers were used.
    host = summary["ssdtrain-host"]
    assert host["host_budget_sized_from"] == host["offloaded_bytes_per_step"] > 0
    assert host["host_budget_bytes"] == host["host_budget_sized_from"] // 2
    assert 0 < host["peak_host_bytes"] <= host["host_budget_bytes"]
    assert host["host_spilled_bytes_per_step"] > 0 and host["bytes_written_per_step"] > 0
    # Loads from RAM: a record whose copy to RAM has not ended when backward reaches it
    # is served from device memory instead, and whether the loopback's copy threads got
    # the GIL before backward is the machine's doing (0 once, in a full suite): over
    # the run's three steps, some records were loaded back from RAM.
    assert _final(result, "ssdtrain-host")["host_loaded_bytes"] > 0
    # RAM only: nothing touches the disk, everything offloaded is held in RAM.
    ram = summary["ssdtrain-ram"]
    assert ram["host_budget_bytes"] == (1 << 63) - 1  # "unlimited"
    assert ram["bytes_written_per_step"] == 0 and ram["host_spilled_bytes_per_step"] == 0
    assert 0 < ram["peak_host_bytes"] <= ram["offloaded_bytes_per_step"]
    assert _final(result, "ssdtrain-ram")["host_loaded_bytes"] > 0
    assert ram["over_budget_bytes_per_step"] == 0
    assert "host tier budget unlimited: peak in RAM" in proc.stdout
    # The verdict: the host tier alone against save_on_cpu, a step-time ratio.
    verdict = result["host_tier_vs_save_on_cpu"]
    assert verdict.startswith("host tier vs save_on_cpu: ssdtrain-ram step") and "ratio" in verdict
    assert verdict in proc.stdout
    assert list(spill_dir.iterdir()) == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU: run `pytest tests/test_io_benchmarks.py -m cuda` "
                           "on a machine with one")
def test_gpu_smoke_small_on_cuda(tmp_path, spill_dir):
    out = tmp_path / "g.json"
    # Two repeats: whether 'none' repeats bitwise across processes on this GPU tells
    # whether bitwise equality of the other modes can be expected.
    proc = _run(GPU_SMOKE, "--small", "--repeats", "2", "--steps", "1", "--warmup", "1",
                "--spill-dir", spill_dir, "--json", out, timeout=600)
    modes = ["none", "ssdtrain", "ssdtrain-host", "ssdtrain-ram", "save_on_cpu", "checkpoint"]
    result, ssd = _check_smoke(proc, out, modes)
    assert result["device"]["name"] and "cuda" in result["device"]
    # The table never hides that ssdtrain offloaded nothing (no GPU data path yet).
    assert ssd["offloaded_bytes_per_step"] > 0 or "NOTHING OFFLOADED" in proc.stdout
    if result["reference_repeats_bitwise"]:
        for mode in modes[1:]:
            assert result["summary"][mode]["grads_equal"] is True, mode
    assert result["summary"]["ssdtrain-ram"]["bytes_written_per_step"] == 0
    assert "ratio" in result["host_tier_vs_save_on_cpu"]


def test_quota_hook_cost_tiny(tmp_path, spill_dir):
    """The pass-through benchmark runs, checks what came back, and says which way is
    which: the auto step really was past its quota (else it raises)."""
    out = tmp_path / "q.json"
    proc = _run(REPO_ROOT / "benchmarks" / "quota_hook_cost.py", "--rounds", "1", "--count", "4",
                "--size", 64 << 10, "--spill-dir", spill_dir, "--json", out, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(out.read_text())["results"]
    assert set(res) == {"small", "record", "passed"}
    assert all(r["pack_us"] > 0 and r["unpack_us"] > 0 for r in res.values())


def test_hooks_cut_tiny(tmp_path, spill_dir):
    """The hooks-off benchmark runs and checks itself: every step of the "cut" way was
    cut and none of the "hooked" way (else it exits non-zero)."""
    out = tmp_path / "c.json"
    proc = _run(REPO_ROOT / "benchmarks" / "hooks_cut.py", "--rounds", "2", "--count", "40",
                "--size", 16 << 10, "--prefetch-mib", "0.0625", "--spill-dir", spill_dir,
                "--json", out, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(out.read_text())["results"]
    assert set(res) == {"none", "hooked", "cut"}
    assert "| cut |" in proc.stdout


def test_soak_tiny(tmp_path, spill_dir):
    """The fault soak runs (60 steps, records of 64 KiB - 1 MiB, faults in 15% of steps),
    prints a row per phase, and its checks are not vacuous: faults fired, staging was
    held and given back to within the idle limit, every error was its own step's."""
    out = tmp_path / "soak.json"
    proc = _run(REPO_ROOT / "benchmarks" / "soak.py", "--tiny", "--seed", 3,
                "--spill-dir", spill_dir, "--json", out, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| phase | steps | staging (MiB) |" in proc.stdout
    res = json.loads(out.read_text())
    phases, limit = res["phases"], res["idle_limit_bytes"]
    assert len(phases) == 4 and not any(p["violations"] for p in phases), phases
    last = phases[-1]
    assert last["faults_fired"] > 0 and last["errors_raised"] > 0, last
    assert last["errors_wrong_step"] == 0 and not res["wrong_step_errors"]
    assert last["peak_staging_bytes"] > 0 and last["bytes_written"] > 0, last
    assert all(p["staging_bytes"] <= limit for p in phases)
    assert list(spill_dir.iterdir()) == []


def test_launch_loop_tiny(tmp_path, spill_dir):
    """The launch-loop benchmark runs every mode at two sizes and both launch kinds, and
    its static and callbacks modes' numbers are not vacuous: every record was written and read back,
    every unpack's markers were checked (and right), the handoff mode's thread was
    woken, and the per-thread CPU and context-switch counts were taken."""
    out = tmp_path / "launch.json"
    proc = _run(REPO_ROOT / "benchmarks" / "launch_loop.py", "--tiny", "--spill-dir", spill_dir,
                "--json", out, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| size | GIL-held | mode | fwd added µs/save [min, max] |" in proc.stdout
    res = json.loads(out.read_text())
    blocks = res["blocks"]
    assert {(b["size"], b["gil_held"]) for b in blocks} == \
        {(256 << 10, 0.0), (256 << 10, 0.5), (1 << 20, 0.0), (1 << 20, 0.5)}
    for b in blocks:
        count = b["count"]
        assert b["calibration"]["n_ops"] > 0
        assert (b["calibration"]["spin_per_op"] > 0) == (b["gil_held"] > 0)
        assert set(b["runs"]) == {"none", "identity", "handoff", "static", "callbacks",
                                  "default"}
        for mode, steps in b["runs"].items():
            assert len(steps) == 2, mode
            for st in steps:
                assert st["checked_markers"] == count and st["bad_markers"] == 0, (mode, st)
                assert st["forward_s"] > 0 and st["backward_s"] > 0
        for st in b["runs"]["static"] + b["runs"]["callbacks"]:
            s = st["stats"]
            assert s["records_written"] == count and s["records_read"] == count, s
            assert s["prefetch_hits"] + s["prefetch_misses"] == count, s
            assert s["bytes_written"] == s["bytes_read"] == count * b["size"], s
            assert len(st["pack_ns"]) == count and len(st["unpack_ns"]) == count
            # ssdtrain's engine workers ran, and were measured.
            assert sum(st[f"cpu_{p}"]["ssdtrain-io"] for p in ("forward", "wait", "backward",
                                                                "final_wait")) > 0
        # Where futures are settled by the engine's workers, the store's I/O thread
        # starts the writes: it ran, and was measured.
        assert all(st["cpu_forward"]["ssdtrain-store"] + st["cpu_wait"]["ssdtrain-store"] > 0
                   for st in b["runs"]["callbacks"])
        assert all(st["handoff_wakes"] > 0 for st in b["runs"]["handoff"])
        assert "forward_added_us" in b["summary"]["static"]
    assert any(t["name"].startswith("static, 256 KiB") for t in res["targets"])
    assert list(spill_dir.iterdir()) == []


def test_launch_breakdown_runs(tmp_path, spill_dir):
    """tools/launch_breakdown.py (it wraps the data path's private entry points: when one
    moves, update its list in instrument()) runs, attributes the calls to the training
    thread and the I/O thread, and its what-if variants keep every record written, read back
    and right."""
    tool = REPO_ROOT / "tools" / "launch_breakdown.py"
    proc = _run(tool, "--count", 4, "--steps", 2, "--launch-us", 50, "--spill-dir", spill_dir,
                timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "records written 8, read 8, prefetch hits 8, misses 0, markers wrong 0" in proc.stdout
    # The Offloader's native engine is polled (NOTE [ The data path on the hooks' thread ]):
    # pack starts each write, and no completion runs Python on an engine worker.
    assert "| training thread | forward | WritePath.start_write_locked |" in proc.stdout
    assert "| ssdtrain-io (engine worker) |" not in proc.stdout
    proc = _run(tool, "--count", 4, "--steps", 2, "--launch-us", 50, "--no-instrument",
                "--what-if", "bury-inline", "one-round", "submit-in-pack",
                "--spill-dir", spill_dir, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "what-if: bury-inline, one-round, submit-in-pack" in proc.stdout
    assert "records written 8, read 8, prefetch hits 8, misses 0, markers wrong 0" in proc.stdout
    assert list(spill_dir.iterdir()) == []


def test_cpu_per_gb_tiny(tmp_path):
    """The side-by-side CPU benchmark runs its native rows (DeepSpeed only where its op is
    built), every round of every configuration moved every byte and read it back right,
    and each median is a CPU time per GB that was measured (positive)."""
    out, work = tmp_path / "cpu.json", tmp_path / "cpu"
    work.mkdir()
    proc = _run(REPO_ROOT / "benchmarks" / "cpu_per_gb.py", "--size", "8MiB", "--record-size",
                "4MiB", "--chunk-size", "1MiB", "--rounds", "2", "--no-deepspeed", "--dir", work,
                "--json", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| config | CPU s/GB write [min, max] | CPU s/GB read [min, max] |" in proc.stdout
    res = json.loads(out.read_text())
    assert res["errors"] == [] and not res["deepspeed"] and res["targets"] == []
    assert set(res["summary"]) == {"native"}
    assert len(res["cpu_s_per_gb"]["native/write"]) == 2
    assert all(v > 0 for v in res["summary"]["native"].values()), res["summary"]
    assert list(work.iterdir()) == []  # the spill files are anonymous; nothing left behind


def test_cpu_per_gb_refuses_records_deepspeed_cannot_split(tmp_path):
    proc = _run(REPO_ROOT / "benchmarks" / "cpu_per_gb.py", "--size", "8MiB", "--record-size",
                "5000", "--no-deepspeed", "--json", tmp_path / "x.json")
    assert proc.returncode != 0 and "--record-size must be a positive multiple" in proc.stderr
