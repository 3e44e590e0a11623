"""The accelerator emulator (benchmarks/accel_emulator.py) at a tiny size.

It saves what a real GPT block saves, its checks catch wrong bytes, every mode comes
back exact, offload-all writes what the harness counts as a step's offload bytes, and
the command line prints its table, targets, JSON and PNG. Timings are never asserted.
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
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
sys.path.insert(0, str(REPO_ROOT / "examples"))

import accel_emulator as emu  # noqa: E402

SHAPE = dict(n_layers=2, batch=2, seq=128, d_model=128, n_heads=4, mlp_ratio=4, vocab=512)


def _cfg(spill_dir, mode, check="sparse", **extra):
    return dict(shape=SHAPE, spill_dir=str(spill_dir), threads=1, check=check, launch_us=0.0,
                launch_fraction=None, steps=1, warmup=1, mode=mode, r=1.0, tflops=1e6,
                budget_bytes=None, **extra)


@pytest.fixture
def fresh_emu():
    """Each test gets its own emulator state; the module global is restored after."""
    yield
    emu.EMU = None


def _run(cfg):
    emu.EMU = emu.Emu(cfg)
    return emu.run_mode(cfg)


def _new_storage_sizes(run, param_ptrs):
    """nbytes of each new (not yet saved) non-parameter storage saved while ``run()`` runs."""
    seen, sizes = set(), []

    def pack(t):
        st = t.untyped_storage()
        key = st.data_ptr()
        if key not in param_ptrs and key not in seen:
            seen.add(key)
            sizes.append(st.nbytes())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sizes


def test_emulated_block_saves_what_the_gpt_block_saves(spill_dir, fresh_emu):
    from gpt import Block, GPTConfig
    b, t, d = SHAPE["batch"], SHAPE["seq"], SHAPE["d_model"]
    block = Block(GPTConfig(seq_len=t, d_model=d, n_heads=SHAPE["n_heads"],
                            mlp_ratio=SHAPE["mlp_ratio"]))
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    x = torch.randn(b, t, d) * 1.0
    x.requires_grad_(True)
    real = _new_storage_sizes(lambda: block(x * 1.0), params)

    cfg = _cfg(spill_dir, "none")
    emu.EMU = emu.Emu(cfg)
    model = emu.build_model(cfg)
    # the block's input comes from the embedding op, as in the model
    x0 = emu.make_function().apply(model.src, None, -1, 20, *model.pre[0])
    fake = _new_storage_sizes(lambda: model.layers[0](x0), set())
    # both lists start with the block's input, which the first LayerNorm saves
    assert fake == real, (fake, real)
    assert sum(n for n in real if n >= 4 * b * t * d) == 16 * 4 * b * t * d


def test_checks_catch_a_wrong_byte(spill_dir, fresh_emu):
    for check, where in (("sparse", (64 << 10) - 1), ("full", 4100 * 8 + 3)):
        cfg = _cfg(spill_dir, "none", check=check)
        e = emu.EMU = emu.Emu(cfg)
        e.pool = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8,
                               generator=torch.Generator().manual_seed(0))
        buf = e.alloc(64 << 10)
        e.fill(buf, e.uid(0, 1))
        e.check(buf, (e.uid(0, 1), 64 << 10, 0), "intact")
        assert e.failures == [], check
        e.check(buf, (e.uid(0, 2), 64 << 10, 0), "another tensor's content")
        assert len(e.failures) == 1, check
        buf[where] ^= 1
        e.check(buf, (e.uid(0, 1), 64 << 10, 0), "flipped")
        assert len(e.failures) == 2 and "flipped" in e.failures[1], (check, e.failures)
        del buf
        assert e.live == 0                        # the tracker saw the buffer die


@pytest.mark.parametrize("check", ["sparse", "full"])
def test_every_mode_comes_back_exact(spill_dir, fresh_emu, check):
    spec = emu.spec_summary(SHAPE, 256 << 10)
    results, written = {}, {}
    for mode in ("none", "checkpoint", "offload_all", "ro1"):
        # settle: the writes land before backward, so the read path is taken whatever the
        # machine's load (else backward may take every record from memory: 0 bytes read)
        out = _run(_cfg(spill_dir, mode, check=check, settle=True))
        assert out["failures"] == [], (mode, out["failures"])
        results[mode] = out["steps"][-1]
        written[mode] = sum(s["offloaded_bytes"] for s in out["steps"])
        assert all(s["checks"] > 0 and s["check_failures"] == 0 for s in out["steps"]), mode
    # the same tensors are checked whatever holds them (checkpoint: the recomputed ones)
    assert len({r["checks"] for r in results.values()}) == 1, results
    # offload-all writes what the harness counts (less the kept tail), and reads it back
    steps = 2
    assert steps * spec["offload_bytes"] / 2 < written["offload_all"] <= \
        steps * spec["offload_bytes"]
    assert results["offload_all"]["bytes_read"] > 0
    # ro1: the first layer recomputed (its input offloaded), the other offloaded
    assert results["ro1"]["plan"] == "ro"
    assert 0 < written["ro1"] < written["offload_all"]
    # checkpointing holds less at its peak than keeping everything
    assert results["checkpoint"]["peak_bytes"] < results["none"]["peak_bytes"]
    assert results["none"]["peak_bytes"] >= spec["unique_saved_bytes"]


def test_command_line_tiny(tmp_path, spill_dir):
    out = tmp_path / "emu.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in
                                         env.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / "accel_emulator.py"), "--tiny",
         "--modes", "offload_all", "--ratios", "1", "--warmup", "1",
         "--spill-dir", str(spill_dir), "--json", str(out)],
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| R | R eff | TFLOP/s | mode |" in proc.stdout
    assert "| none |" in proc.stdout and "| offload_all |" in proc.stdout
    result = json.loads(out.read_text())
    assert {s["mode"] for s in result["summary"]} == {"none", "offload_all"}
    assert all(s["exact"] for s in result["summary"])
    assert any(t["name"] == "every mode bit-exact" and t["met"] for t in result["targets"])
    assert result["bandwidth_start"]["write"] > 0
    assert (tmp_path / "emu.png").exists()
    assert os.listdir(spill_dir) == []


def test_budget_run_records_its_plan_and_the_static_modes_predictions(spill_dir, fresh_emu):
    """The budget mode's predicted step is its plan's forward to end of backward (the
    harness's gc and statistics between steps are in the plan's period, not in the
    step it times); plan_detail has the cost model's prediction of every static mode;
    the peak sampling's time is recorded and taken off the step."""
    cfg = dict(_cfg(spill_dir, "budget", mix_ks=[1]), warmup=4, budget_bytes=1 << 40)
    out = _run(cfg)
    last = out["steps"][-1]
    assert last["plan"] is not None and 0 < last["predicted_step_s"] < last["predicted_period_s"]
    assert all(s["sample_s"] > 0 for s in out["steps"])  # ssdtrain's records() snapshot
    detail = out["plan_detail"]
    assert set(detail["predicted"]) == {"none", "checkpoint", "offload_all", "ok1", "rk1",
                                        "ro1"}
    assert all(v["step_s"] > 0 for v in detail["predicted"].values())
    assert detail["step"]["between_s"] > 0 and len(detail["layers"]) == SHAPE["n_layers"]
    # no budget to speak of: keeping everything is predicted fastest, and chosen
    assert last["plan"] == "kk"
    assert detail["predicted"]["none"]["step_s"] == pytest.approx(last["predicted_step_s"])


def test_same_process_ab(tmp_path, capsys, fresh_emu):
    """benchmarks/accel_ab.py: every mode in one process, steps in turn; a row per mode,
    exact, and the budget mode's plan and prediction."""
    import accel_ab
    assert accel_ab.main(["--tflops", "1e6", "--n-layers", "2", "--batch", "2", "--seq", "128",
                          "--d-model", "128", "--vocab", "512", "--steps", "1",
                          "--launch-us", "0", "--modes", "checkpoint", "budget", "rk1",
                          "ok1", "--probe-mib", "1", "--spill-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| 1e+06 |")]
    assert [r.split("|")[2].strip() for r in rows] == ["none", "checkpoint", "budget", "rk1",
                                                       "ok1"]
    assert all(r.rstrip().endswith("| yes |") for r in rows), out
    cells = [[c.strip() for c in r.split("|")] for r in rows]
    # The I/O bound: none of it for the modes that move no byte, one for ok1 (it writes
    # and reads its first layer), never below the none mode's step.
    assert cells[0][11] == cells[1][11] == "", out
    assert float(cells[4][11]) >= float(cells[0][4]) and cells[4][12].endswith("x"), out
    assert "disk (best write/read GB/s" in out, out
    budget = rows[2].split("|")
    assert budget[3].strip() and "(" in budget[6], out   # its plan, its prediction
    assert os.listdir(tmp_path) == []
