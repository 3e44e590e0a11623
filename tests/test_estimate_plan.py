"""``ssdtrain estimate --plan``: the planner run on the estimate's per-block bytes and
FLOPs (NOTE [ Plan from the estimate ] in ssdtrain/estimate/__init__.py).

The costs are the estimate's (bytes, FLOPs / TFLOP/s, the disk given); the plan is the
planner's best and never predicted slower than a reference that fits; the budget is
respected or the command says it cannot be and exits 3; bad inputs are refused
without a traceback. The emulator comparison's premise (the estimate's GPT saves what
the emulator's model saves) and its plan mode are checked here; the comparison itself
takes minutes (benchmarks/plan_vs_emulator.py, docs/accelerator_regime.md).
Timings are never asserted.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch

import ssdtrain.estimate as E
from ssdtrain._config import MAX_BYTES
from ssdtrain import OffloadConfig

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpt import GPT, GPTConfig  # noqa: E402

SHAPE = dict(n_layers=4, d_model=64, n_heads=4, vocab_size=256)
CFG = dict(min_tensor_bytes="4KiB", keep_tail_bytes=0, prefetch_bytes="128KiB")
FACTORY = "test_estimate_plan:make_gpt"
HW = ["--tflops", "1e-3", "--ssd-write-gbps", "0.01"]


def make_gpt(batch=2, seq=64):
    """A 4-block GPT (examples/gpt.py), (ids, targets)."""
    model = GPT(GPTConfig(seq_len=seq, dropout=0.0, **SHAPE))
    ids = torch.randint(0, SHAPE["vocab_size"], (batch, seq))
    return model, (ids, ids)


@pytest.fixture(scope="module")
def est():
    return E.estimate(make_gpt, batch=2, seq=64, config=OffloadConfig(**CFG),
                      hardware=E.Hardware(tflops=1e-3, ssd_write_gbps=0.01))


def _finite_json(text):
    def bad(name):
        raise AssertionError(f"--json printed {name}")
    return json.loads(text, parse_constant=bad)


def _with(est, **hw):
    return dataclasses.replace(est, hardware=E.Hardware(**hw))


# ------------------------------------------------------------------------- costs
def test_per_block_flops_add_up_to_the_forward(est):
    """Each block's forward FLOPs are its matmuls, 24 x tokens x d^2 for a GPT block
    (qkv 6, proj 2, MLP 16), and attention's two batched matmuls, 4 x batch x seq^2 x d
    (counted as torch counts its CUDA kernels; before, the CPU kernel was not counted
    at all); the blocks and the head add up to the total."""
    m = est.measurement
    batch, seq, d = 2, 64, SHAPE["d_model"]
    tokens = batch * seq
    assert m.layer_flops == [24 * tokens * d * d + 4 * batch * seq * seq * d] * SHAPE["n_layers"]
    head = 2 * tokens * d * SHAPE["vocab_size"]
    assert m.flops == sum(m.layer_flops) + head


def test_costs_come_from_the_estimate(est):
    """LayerCost per block from its unique, input and activation bytes and its FLOPs;
    StepCost from the disk (read defaults to write; x ssds) and the settings."""
    layers, step = E.plan_costs(_with(est, tflops=2e-3, ssd_write_gbps=0.5, ssds=2))
    m = est.measurement
    assert [c.name for c in layers] == [lb.name for lb in m.layers]
    for c, lb, f in zip(layers, m.layers, m.layer_flops):
        assert (c.saved_bytes, c.input_bytes, c.recompute_bytes) == \
            (lb.unique_bytes, lb.input_bytes, lb.activation_bytes)
        assert c.saved_bytes > 0 and c.input_bytes > 0
        assert math.isclose(c.fwd_s, f / 2e9) and math.isclose(c.bwd_s, 2 * c.fwd_s)
    assert step.write_bps == step.read_bps == 1e9
    assert math.isclose(step.fwd_other_s, (m.flops - sum(m.layer_flops)) / 2e9)
    assert math.isclose(step.bwd_head_s, 2 * step.fwd_other_s)
    assert step.head_bytes == m.outside.unique_bytes and step.keep_tail_bytes == 0
    assert step.fixed_bytes == m.kept_held_bytes
    # --step-seconds: the step split over the blocks by their FLOPs (3 passes)
    layers, step = E.plan_costs(_with(est, step_seconds=3.0, ssd_write_gbps=1,
                                      ssd_read_gbps=2))
    total = sum(c.fwd_s for c in layers) + step.fwd_other_s
    assert math.isclose(total, 1.0)
    assert (step.write_bps, step.read_bps) == (1e9, 2e9)


def test_compact_plan():
    assert E.compact_plan(["offload"] * 20 + ["keep"] * 12) == "O x20, K x12"
    assert E.compact_plan(["recompute", "keep", "recompute"]) == "R x1, K x1, R x1"
    assert E.compact_plan([]) == "(no blocks)"


# ---------------------------------------------------------------------- the plan
@pytest.mark.parametrize("gbps", [1e-4, 0.01, 10.0])
def test_plan_is_never_slower_than_a_reference_that_fits(est, gbps):
    """The uniform plans are in the search's family: whatever the disk and the budget,
    the plan's predicted step is at most that of none, checkpoint-all and offload-all
    when they fit, and its peak fits whenever one of them does."""
    at = _with(est, tflops=1e-3, ssd_write_gbps=gbps, ssd_read_gbps=gbps / 3)
    none = at.plan().references["none"].peak_bytes
    for fraction in (1.5, 1.0, 0.6, 0.4, 0.25, 0.1):
        p = at.plan(int(fraction * none))
        fitting = [name for name in p.references if p.reference_fits(name)]
        if fitting:
            assert p.fits
        if p.fits:
            assert p.plan.prediction.peak_bytes <= p.budget_bytes
        for name in fitting:
            assert p.plan.prediction.step_s <= p.references[name].step_s * (1 + 1e-9), \
                (gbps, fraction, name, p.plan.choices)


def test_plan_changes_with_the_disk(est):
    """A fast disk and a slow one give different plans under the same budget: with a
    slow disk offloading stalls, so the plan recomputes; with a fast one it offloads
    (a prefetch window smaller than a block, else offloading saves no memory in
    backward)."""
    budget = int(0.4 * est.plan().references["none"].peak_bytes)
    slow = _with(est, tflops=1e-3, ssd_write_gbps=1e-4).plan(budget)
    fast = _with(est, tflops=1e-3, ssd_write_gbps=100.0).plan(budget)
    assert "offload" in fast.plan.choices and "offload" not in slow.plan.choices
    assert fast.plan.prediction.step_s < slow.plan.prediction.step_s


def test_budget_from_device_memory(est):
    """Without --memory-budget the budget is device memory minus weights, gradients and
    optimizer state (trainable x bytes_per_param + frozen + buffers)."""
    m = est.measurement
    static = m.trainable_params * 16 + m.frozen_param_bytes + m.buffer_bytes
    p = _with(est, tflops=1e-3, ssd_write_gbps=1.0, device_memory=static + (1 << 20)).plan()
    assert p.budget_bytes == 1 << 20 and "device memory" in p.budget_from
    assert _with(est, tflops=1e-3, ssd_write_gbps=1.0).plan().budget_bytes is None


# --------------------------------------------------------------------------- CLI
def test_cli_plan_table(capsys):
    assert E.main(["--factory", FACTORY, "--min-tensor-bytes", "4KiB", "--keep-tail-bytes",
                   "0", *HW, "--plan", "--memory-budget", "2MiB"]) == 0
    out = capsys.readouterr().out
    assert "plan (budget 2.00 MiB (--memory-budget)" in out
    for row in ("| **plan** ", "| none (keep all) ", "| checkpoint-all (recompute all) ",
                "| offload-all "):
        assert row in out
    assert "| K x4 " in out and "| R x4 " in out and "| O x4 " in out


def test_cli_plan_json(capsys):
    assert E.main(["--factory", FACTORY, "--min-tensor-bytes", "4KiB", *HW, "--plan",
                   "--memory-budget", "2MiB", "--json"]) == 0
    out = _finite_json(capsys.readouterr().out)
    plan = out["plan"]
    assert len(plan["choices"]) == len(plan["names"]) == 4
    assert set(plan["choices"]) <= {"keep", "offload", "recompute"}
    assert plan["fits"] is True and plan["budget_bytes"] == 2 << 20
    assert plan["references"].keys() == {"none", "checkpoint_all", "offload_all"}
    for row in [plan["predicted"], *plan["references"].values()]:
        assert {"step_s", "stall_s", "recompute_s", "peak_bytes", "written_bytes",
                "layers", "fits"} <= row.keys()
        assert row["step_s"] > 0
    assert plan["predicted"]["peak_bytes"] <= plan["budget_bytes"]
    assert plan["references"]["none"]["layers"] == "K x4"
    assert len(out["layer_forward_flops"]) == 4 and out["layer_forward_flops"][0] > 0


@pytest.mark.parametrize("hw", [
    ["--tflops", "1e9", "--ssd-write-gbps", "1e-6", "--ssd-read-gbps", "1e6"],
    ["--step-seconds", "1e-9", "--ssd-write-gbps", "1e6", "--ssds", "1048576"],
    ["--step-seconds", "1e9", "--ssd-write-gbps", "1e-6", "--device-memory", "4096TiB"],
], ids=["fast-device", "fast-step", "slow-step"])
def test_cli_plan_json_is_finite_at_the_edges_of_the_ranges(hw, capsys):
    assert E.main(["--factory", FACTORY, "--min-tensor-bytes", "4KiB", "--plan", "--json",
                   *hw]) == 0
    _finite_json(capsys.readouterr().out)


def test_cli_budget_that_cannot_be_met_exits_3(capsys):
    """The least-memory plan is shown, marked, and the exit status says so."""
    assert E.main(["--factory", FACTORY, "--min-tensor-bytes", "4KiB", *HW, "--plan",
                   "--memory-budget", "1KiB"]) == 3
    cap = capsys.readouterr()
    assert "NO plan fits the budget" in cap.out
    assert "no plan fits the budget of 1.00 KiB" in cap.err and "Traceback" not in cap.err
    assert E.main(["--factory", FACTORY, "--min-tensor-bytes", "4KiB", *HW, "--plan",
                   "--memory-budget", "1KiB", "--json"]) == 3
    assert _finite_json(capsys.readouterr().out)["plan"]["fits"] is False


@pytest.mark.parametrize("argv,message", [
    (["--plan", "--ssd-write-gbps", "1"], "--plan needs --tflops or --step-seconds"),
    (["--plan", "--tflops", "1"], "--plan needs --ssd-write-gbps"),
    (["--plan", *HW, "--memory-budget", "0"], "must be > 0"),
    (["--plan", *HW, "--memory-budget", "-5"], "must be a byte count"),
    (["--plan", *HW, "--memory-budget", "lots"], "memory_budget"),
    (["--plan", *HW, "--memory-budget", "1e400GiB"], "memory_budget"),
    ([*HW, "--memory-budget", "1GiB"], "add --plan"),
    (["--plan", *HW, "--gradient-checkpointing"], "without --gradient-checkpointing"),
])
def test_cli_plan_bad_inputs_exit_2_without_traceback(argv, message, capsys):
    assert E.main(["--factory", FACTORY, *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and "usage:" in err, err


def test_cli_plan_model_without_blocks_exits_1(capsys):
    assert E.main(["--factory", "models:tied", *HW, "--plan"]) == 1
    err = capsys.readouterr().err
    assert "has none (no nn.ModuleList)" in err and "Traceback" not in err


# ------------------------------------------------------------- the emulator check
def test_emulator_model_and_the_estimate_save_the_same_bytes():
    """plan_vs_emulator gives the estimate examples/gpt.py's GPT at the emulator's
    shape: at the default shape it offloads exactly the emulator's bytes per step."""
    import accel_emulator as emu
    import plan_vs_emulator as pve
    shape = emu.DEFAULT_SHAPE
    cfg = OffloadConfig(keep_tail_bytes=0)
    est = E.estimate(pve.gpt_factory(shape), batch=shape["batch"], seq=shape["seq"],
                     dtype="float32", config=cfg)
    spec = emu.spec_summary(shape, cfg.min_tensor_bytes)
    assert est.offloadable_bytes == est.unique_bytes == spec["offload_bytes"]


def test_emulator_runs_a_plan_mode(spill_dir):
    """accel_emulator's plan-<letters> mode runs that plan through set_plan, exactly."""
    import accel_emulator as emu
    assert emu.is_plan_mode("plan-okr", 3) and not emu.is_plan_mode("plan-okx", 3)
    assert not emu.is_plan_mode("plan-ok", 3)
    assert emu.plan_for("plan-rOk", 3) == ["recompute", "offload", "keep"]
    shape = dict(n_layers=2, batch=2, seq=128, d_model=128, n_heads=4, mlp_ratio=4, vocab=512)
    cfg = dict(shape=shape, spill_dir=str(spill_dir), threads=1, check="sparse", launch_us=0.0,
               launch_fraction=None, steps=1, warmup=1, mode="plan-ro", r=1.0, tflops=1e6,
               budget_bytes=None)
    emu.EMU = emu.Emu(cfg)
    try:
        out = emu.run_mode(cfg)
    finally:
        emu.EMU = None
    assert out["failures"] == []
    assert out["steps"][-1]["plan"] == "ro"
    assert all(s["checks"] > 0 and s["check_failures"] == 0 for s in out["steps"])


def test_predictions_beside_a_recorded_emulator_run(tmp_path, capsys):
    """plan_vs_emulator --from-emulator predicts every static mode of a recorded
    accel_emulator run (and the adaptive policy's plan) from that run's numbers; the
    predicted peaks (a function of bytes, not of timing) are those the emulator's
    allocator tracked, within 10%, for keeping, recomputing and mixing."""
    import plan_vs_emulator as pve
    src = ROOT / "docs" / "results" / "accel_emulator.json"
    out = tmp_path / "pve.json"
    assert pve.main(["--from-emulator", str(src), "--json", str(out)]) == 0
    assert "| predicted step (ms) | measured step (ms) | error |" in capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    recorded = json.loads(src.read_text())["summary"]
    assert {(r["mode"], r["r"]) for r in rows} == {(s["mode"], s["r"]) for s in recorded}
    for row in rows:
        assert row["predicted_step_s"] > 0 and row["measured_step_s"] > 0
        if row["mode"] in ("none", "checkpoint", "budget") or row["mode"].startswith("rk"):
            assert abs(row["predicted_peak_bytes"] / row["measured_peak_bytes"] - 1) <= 0.10, row


# ------------------------------------------------------------------- the host tier
# NOTE [ Plan from the estimate ]'s host tier bullet; NOTE [ Tiers in the step cost
# model ] in _policies/costmodel.py.
GB = 1e9

# The plan and its references from the code before the host tier was priced (commit
# 53ce136): key "ssd GB/s|--memory-budget" -> the plan, and per row step_s, stall_s,
# peak_bytes, written_bytes.
_BEFORE = {
    "0.0001|None": ("KKKK", {
        "plan": [0.18874368000000005, 0.0, 2312708, 0],
        "none": [0.18874368000000005, 0.0, 2312708, 0],
        "checkpoint_all": [2.680160256, 2.4326963199999994, 707076, 131072],
        "offload_all": [41.987080192, 41.798336512, 2312708, 2097152]}),
    "0.01|1MiB": ("RRRK", {
        "plan": [0.23278387200000003, 0.0, 838148, 98304],
        "none": [0.18874368000000005, 0.0, 2312708, 0],
        "checkpoint_all": [0.24746393600000002, 0.0, 707076, 131072],
        "offload_all": [0.46347059199999996, 0.274726912, 2312708, 2097152]}),
    "0.001|600KiB": ("ROOO", {
        "plan": [3.2699842559999994, 3.0665605119999992, 614400, 1605632],
        "none": [0.18874368000000005, 0.0, 2312708, 0],
        "checkpoint_all": [0.35468083199999995, 0.10721689599999996, 707076, 131072],
        "offload_all": [4.238344192, 4.049600512, 2312708, 2097152]}),
}


def _rows(pe):
    return {name: [p.step_s, p.stall_s, p.peak_bytes, p.written_bytes]
            for name, _, p, _ in pe._rows()}


def _letters(pe):
    return "".join(E.PLAN_LETTERS[c] for c in pe.plan.choices)


@pytest.mark.parametrize("key", sorted(_BEFORE))
@pytest.mark.parametrize("host", [None, 0], ids=["no-host-tier", "host-budget-0"])
def test_plan_without_host_bytes_is_the_old_one(est, key, host):
    """No host tier, or a budget of 0 bytes (every record goes to the SSD, as without
    one; the link, 25 GB/s by default, faster than the SSD): the plan and every
    prediction are those of the code before the tier was priced, to the bit."""
    gbps, budget = key.split("|")
    at = dataclasses.replace(_with(est, tflops=1e-3, ssd_write_gbps=float(gbps)),
                             host_budget_bytes=host)
    pe = at.plan(None if budget == "None" else budget)
    plan, rows = _BEFORE[key]
    assert (_letters(pe), _rows(pe)) == (plan, rows)
    assert pe.host_tier == (host is not None)


def test_plan_costs_carry_the_host_tier(est):
    """--host-budget puts the tier's budget, --host-gbps (default 25 GB/s each way) and
    whether an SSD lies beyond it in the planner's StepCost; none without it."""
    _, step = E.plan_costs(_with(est, tflops=1e-3, ssd_write_gbps=1.0))
    assert (step.host_budget_bytes, step.host_write_bps, step.ssd_tier) == (0, None, True)
    tiered = dataclasses.replace(_with(est, tflops=1e-3, ssd_write_gbps=1.0),
                                 host_budget_bytes=1 << 20)
    _, step = E.plan_costs(tiered)
    assert step.host_budget_bytes == 1 << 20 and step.ssd_tier
    assert step.host_write_bps == step.host_read_bps == E.DEFAULT_HOST_GBPS * GB == 25 * GB
    _, step = E.plan_costs(dataclasses.replace(
        _with(est, tflops=1e-3, host_gbps=3.0), host_budget_bytes=1 << 20, ssd_tier=False))
    assert step.host_write_bps == step.host_read_bps == 3 * GB and not step.ssd_tier


def test_host_tier_covering_everything_prices_offload_at_the_link(est):
    """A host budget covering every offloaded byte and an SSD too slow to hide: offload-all
    is predicted at the link's cost (25 GB/s: hidden behind compute, the step of none),
    nothing goes to the SSD, and under a budget the planner offloads where, pricing every
    byte at the SSD, it recomputed."""
    slow = _with(est, tflops=1e-3, ssd_write_gbps=0.01)
    tiered = dataclasses.replace(slow, host_budget_bytes=MAX_BYTES)
    pe = tiered.plan("1MiB")
    off, none = pe.references["offload_all"], pe.references["none"]
    assert off.step_s == pytest.approx(none.step_s) and off.stall_s == pytest.approx(0.0)
    assert off.ssd_bytes == 0 and off.host_bytes == off.written_bytes + \
        est.measurement.outside.unique_bytes   # the head's records too (no kept tail)
    before = slow.plan("1MiB")
    assert "offload" not in before.plan.choices and "recompute" in before.plan.choices
    assert "offload" in pe.plan.choices and "recompute" not in pe.plan.choices
    assert pe.plan.prediction.step_s < before.plan.prediction.step_s
    # A slow link is priced as such: offload-all stalls on it.
    crawl = dataclasses.replace(_with(est, tflops=1e-3, ssd_write_gbps=0.01, host_gbps=1e-3),
                                host_budget_bytes=MAX_BYTES)
    assert crawl.plan("1MiB").references["offload_all"].step_s > off.step_s


def test_plan_split_is_the_tiers(capsys):
    """The bytes the plan's offload-all sends to the SSD (with an SSD) or keeps on the
    device (--no-ssd) are those the estimate's replay of the tier (HostBudget, as the
    store runs it) sends there, and the text and JSON show them."""
    argv = ["--factory", FACTORY, "--min-tensor-bytes", "4KiB", "--keep-tail-bytes", "0",
            "--prefetch-bytes", "128KiB", "--tflops", "1e-3", "--plan", "--json",
            "--host-budget", "1MiB"]
    assert E.main(argv + ["--ssd-write-gbps", "0.01"]) == 0
    out = _finite_json(capsys.readouterr().out)
    off, tier = out["plan"]["references"]["offload_all"], out["host_tier"]
    assert off["ssd_bytes"] == tier["ssd_bytes"] > 0 and off["host_bytes"] == 1 << 20
    assert off["device_bytes"] == 0
    assert out["plan"]["host_tier"] == {"budget_bytes": 1 << 20, "ssd_tier": True,
                                        "write_bps": 25 * GB, "read_bps": 25 * GB}
    assert E.main(argv + ["--no-ssd", "--host-gbps", "2"]) == 0   # no SSD bandwidth needed
    out = _finite_json(capsys.readouterr().out)
    off, tier = out["plan"]["references"]["offload_all"], out["host_tier"]
    assert off["device_bytes"] == tier["device_bytes"] > 0 and off["ssd_bytes"] == 0
    assert out["plan"]["write_bps"] is None and out["plan"]["host_tier"]["write_bps"] == 2 * GB
    # Kept on the device: in offload-all's peak, as much as keeping everything.
    assert off["peak_bytes"] >= out["plan"]["references"]["none"]["peak_bytes"] - (1 << 20)
    argv[argv.index("--json")] = "--memory-budget"
    argv.insert(argv.index("--memory-budget") + 1, "1.5MiB")
    assert E.main(argv + ["--ssd-write-gbps", "0.01"]) == 0
    text = capsys.readouterr().out
    assert "host tier 1.00 MiB at 25.00 GB/s to host, 25.00 GB/s back, then disk 0.01 GB/s" \
        in text
    assert re.search(r"\| written per step \| +to host RAM \| +to SSD \|", text)
    assert E.main(argv + ["--no-ssd"]) == 0
    text = capsys.readouterr().out
    assert "then no SSD (the rest stays on the device)" in text
    assert re.search(r"\| +to host RAM \| kept on device \(over host budget\) \|", text)
