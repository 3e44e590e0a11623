"""The adaptive planner on the estimate's bytes and FLOPs: ``PlanEstimate``, ``make_plan``
(NOTE [ Plan from the estimate ])."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Optional

from .._config import MAX_BYTES, parse_bytes
from .._errors import ConfigError
from .replay import EstimateError
from .format import _b, finite, _md
from .hardware import DEFAULT_HOST_GBPS, Hardware, _static_bytes

if TYPE_CHECKING:
    from .report import Estimate


# NOTE [ Plan from the estimate ]
# ``ssdtrain estimate --plan`` runs the adaptive policy's planner (planner.plan in
# _policies/planner.py, costmodel.predict in _policies/costmodel.py: the same functions,
# no copy) on costs built from the estimate instead of a profile:
#
# * per block: ``saved_bytes`` = its unique bytes (the records first created in it,
#   what ssdtrain would write if it offloads the block), ``input_bytes`` = its input
#   storages, ``recompute_bytes`` = its activation bytes (what a recompute creates and
#   holds, small tensors included); forward time = its forward FLOPs / TFLOP/s (or its
#   share of the forward FLOPs x --step-seconds / 3), backward 2x, a recompute the
#   forward again;
# * the rest: outside the blocks, forward time from the FLOPs outside them, backward
#   2x (all of it before the blocks' backward: the head's, the embedding's is small);
#   ``head_bytes`` = the unique bytes outside the blocks (before and after them: the
#   embedding's records are normally small token ids); ``fixed_bytes`` = the storages
#   kept per pack (small tensors, other kinds), held in every plan; no time after the
#   last backward (no optimizer, data or launch overhead: fold those into
#   --step-seconds); no CPU cost per byte of I/O (``fwd_s_per_byte`` 0: it is a
#   property of the host that only a run measures);
# * the disk: ``ssds x --ssd-write-gbps``, ``ssds x --ssd-read-gbps`` (default: the
#   write bandwidth); ssdtrain's prefetch window, write-behind limit and tail from the
#   settings;
# * with --host-budget, the host tier: its budget, whether an SSD lies beyond it
#   (--no-ssd: none, and no SSD bandwidth is needed), and the device <-> host copy
#   rate, --host-gbps each way (default DEFAULT_HOST_GBPS, a PCIe 4.0 x16 link): the
#   planner prices the bytes that fit the budget at the link's rate and the rest at
#   the SSD's, or holds them in device memory without an SSD (NOTE [ Tiers in the step
#   cost model ] in _policies/costmodel.py). Without --host-budget the planner prices every byte
#   at the SSD's bandwidth, as it always has.
#
# The budget for activations: --memory-budget, else --device-memory minus what the
# estimate puts on the device besides activations (weights, gradients, optimizer state:
# trainable x bytes_per_param, frozen parameters, buffers), else none. The three
# references are predicted with the same StepCost, at the configured settings as a
# static configuration runs them (no budget throttle): keep-all is
# "none" (no block offloaded or recomputed, so no layer I/O; its memory has the head's
# records as no offload holds them), recompute-all is ssdtrain's (its inputs offloaded,
# as ``set_plan`` with "recompute" does), offload-all is every block offloaded. The
# search predicts each plan with the write-behind limit lowered to fit the budget
# (``planner.write_behind_for``; the adaptive policy runs it so); the table says when
# the plan needs that limit (``OffloadConfig(write_behind_bytes=...)`` with
# ``set_plan``). The uniform plans are in every search's family and a lower limit
# never slows a plan whose unthrottled peak fits (its writes in flight never reach
# the lower limit), so the plan's predicted step is never slower than a reference
# that fits the budget.


PLAN_LETTERS = {"keep": "K", "offload": "O", "recompute": "R"}
REFERENCES = (("none", "keep"), ("checkpoint_all", "recompute"), ("offload_all", "offload"))


def compact_plan(choices) -> str:
    """Run-length form of a plan: ``("offload", "offload", "keep")`` -> ``"O x2, K x1"``."""
    runs = []
    for c in choices:
        letter = PLAN_LETTERS[c]
        if runs and runs[-1][0] == letter:
            runs[-1][1] += 1
        else:
            runs.append([letter, 1])
    return ", ".join(f"{letter} x{n}" for letter, n in runs) or "(no blocks)"


@dataclass
class PlanEstimate:
    """What :meth:`Estimate.plan` predicts: the planner's choice per block, and the same
    cost model's step time and peak activation memory for it and the three references
    (NOTE [ Plan from the estimate ], above)."""

    plan: Any
    """The planner's plan (``choices``, ``prediction``, ``fits``, ``table()``)."""
    references: Dict[str, Any]
    """``"none"``, ``"checkpoint_all"``, ``"offload_all"`` -> their predictions."""
    budget_bytes: Optional[int]
    budget_from: str
    """Where the budget came from (``--memory-budget``, device memory, or none)."""
    configured_write_behind_bytes: int = 0
    """The configured ``write_behind_bytes`` (the plan may need less:
    ``plan.write_behind_bytes``)."""

    @property
    def host_tier(self) -> bool:
        """Whether the plan prices a host tier (``--host-budget``)."""
        return self.plan.step.prices_host_tier

    @property
    def fits(self) -> bool:
        """Whether the plan's predicted peak fits the budget (always True without one)."""
        return bool(self.plan.fits)

    def reference_fits(self, name) -> bool:
        p = self.references[name]
        return self.budget_bytes is None or p.peak_bytes <= self.budget_bytes

    def _rows(self):
        n = len(self.plan.choices)
        yield "plan", self.plan.choices, self.plan.prediction, self.fits
        for name, choice in REFERENCES:
            yield name, (choice,) * n, self.references[name], self.reference_fits(name)

    def to_json(self) -> dict:
        """The ``"plan"`` object of ``--json`` (every number finite)."""
        def pred(p, choices, fits):
            out = {"layers": compact_plan(choices), "step_s": p.step_s, "stall_s": p.stall_s,
                   "recompute_s": p.recompute_s, "peak_bytes": p.peak_bytes,
                   "written_bytes": p.written_bytes, "kept_bytes": p.kept_bytes, "fits": fits}
            if self.host_tier:
                out.update(host_bytes=p.host_bytes, ssd_bytes=p.ssd_bytes,
                           device_bytes=p.device_bytes)
            return out
        s = self.plan.step
        rows = {name: pred(p, c, f) for name, c, p, f in self._rows()}
        out = {"choices": list(self.plan.choices),
               "names": [layer.name for layer in self.plan.layers],
               "compact": compact_plan(self.plan.choices), "fits": self.fits,
               "budget_bytes": self.budget_bytes, "budget_from": self.budget_from,
               "predicted": rows.pop("plan"), "references": rows,
               "plans_searched": self.plan.plans_searched,
               "write_bps": s.write_bps if s.ssd_tier else None,
               "read_bps": s.read_bps if s.ssd_tier else None,
               "write_behind_bytes": s.write_behind_bytes,
               "host_tier": None if not self.host_tier else {
                   "budget_bytes": s.host_budget_bytes, "ssd_tier": s.ssd_tier,
                   "write_bps": s.host_write_bps, "read_bps": s.host_read_bps}}
        return finite(out)

    def table(self) -> str:
        """The plan and the references, one row each (markdown)."""
        none = self.references["none"].step_s
        budget = "no budget" if self.budget_bytes is None else \
            f"budget {_b(self.budget_bytes)} ({self.budget_from})"
        labels = {"plan": "**plan**", "none": "none (keep all)",
                  "checkpoint_all": "checkpoint-all (recompute all)",
                  "offload_all": "offload-all"}
        s = self.plan.step
        tiers = ()
        if self.host_tier:   # NOTE [ Tiers in the step cost model ]
            tiers = (("to host RAM", "host_bytes"),
                     ("to SSD", "ssd_bytes") if s.ssd_tier else
                     ("kept on device (over host budget)", "device_bytes"))
        rows = [("", "blocks", "step (ms)", "vs none", "stalls (ms)", "recompute (ms)",
                 "peak activations", "fits", "written per step")
                + tuple(label for label, _ in tiers)]
        for name, choices, p, fits in self._rows():
            rows.append((labels[name], compact_plan(choices), f"{p.step_s * 1e3:.1f}",
                         f"{p.step_s / none:.2f}x" if none > 0 else "-",
                         f"{p.stall_s * 1e3:.1f}", f"{p.recompute_s * 1e3:.1f}",
                         _b(p.peak_bytes), "yes" if fits else "NO", _b(p.written_bytes))
                        + tuple(_b(getattr(p, key)) for _, key in tiers))
        disk = f"disk {s.write_bps / 1e9:.2f} GB/s write, {s.read_bps / 1e9:.2f} GB/s read"
        if self.host_tier:
            budget_h = "unlimited" if s.host_budget_bytes >= MAX_BYTES else \
                _b(s.host_budget_bytes)
            disk = (f"host tier {budget_h} at {s.host_write_bps / 1e9:.2f} GB/s to host, "
                    f"{s.host_read_bps / 1e9:.2f} GB/s back, then "
                    + (disk if s.ssd_tier else "no SSD (the rest stays on the device)"))
        lines = [f"plan ({budget}; {disk}; {self.plan.plans_searched} plans "
                 f"searched): " + "".join(PLAN_LETTERS[c] for c in self.plan.choices)
                 + " (K keep, O offload, R recompute, first block first)", ""]
        lines += _md(rows, right=range(2, 9 + len(tiers)))
        wb = self.plan.write_behind_bytes
        if self.plan.prediction.written_bytes > wb and wb < self.configured_write_behind_bytes:
            lines.append("")
            lines.append(f"the plan keeps its writes in flight within the budget with "
                         f"write_behind_bytes {_b(wb)} (configured "
                         f"{_b(self.configured_write_behind_bytes)}): run it with "
                         f"OffloadConfig(write_behind_bytes={wb}) and set_plan, or "
                         f"policy='adaptive' with memory_budget_bytes.")
        if not self.fits:
            lines.append("")
            lines.append(f"NO plan fits the budget: the plan shown needs the least memory "
                         f"of those searched, {_b(self.plan.prediction.peak_bytes)}.")
        lines.extend(self.plan.notes)
        return "\n".join(lines)


def _check_plan_inputs(hw: Hardware, gradient_checkpointing: bool, ssd_tier: bool = True):
    """``ConfigError`` unless ``hw`` has what a plan needs (checked before the model runs;
    without an SSD tier no SSD bandwidth)."""
    missing = [flag for flag, ok in (("--tflops or --step-seconds",
                                      hw.tflops is not None or hw.step_seconds is not None),
                                     ("--ssd-write-gbps",
                                      hw.ssd_write_gbps is not None or not ssd_tier))
               if not ok]
    if missing:
        raise ConfigError(f"ssdtrain estimate: --plan needs {' and '.join(missing)} (the "
                          f"compute time and the disk's speed; --ssd-read-gbps defaults to the "
                          f"write bandwidth), e.g. --tflops 400 --ssd-write-gbps 7.")
    if gradient_checkpointing:
        raise ConfigError("ssdtrain estimate: --plan chooses per block between keeping, "
                          "offloading and recomputing; estimate the model without "
                          "--gradient-checkpointing (the plan's 'recompute' is checkpointing).")


def _parse_budget(memory_budget) -> int:
    b = parse_bytes(memory_budget, name="memory_budget (--memory-budget)")
    if b <= 0:
        raise ConfigError("ssdtrain estimate: memory_budget (--memory-budget) must be > 0 "
                          "bytes of activations, e.g. --memory-budget 40GiB.")
    return b


def plan_costs(est: "Estimate"):
    """``(layers, step)``: the planner's :class:`~ssdtrain._policies.costmodel.LayerCost` per block and
    :class:`~ssdtrain._policies.costmodel.StepCost` built from ``est`` (NOTE [ Plan from the estimate ]).

    Raises:
        ConfigError: a number the plan needs was not given, or the model was estimated
            with its own checkpointing.
        EstimateError: the model has no repeated blocks, or no FLOPs to time them by.
    """
    from .._policies.costmodel import LayerCost, StepCost
    m, hw, cfg = est.measurement, est.hardware, est.config
    _check_plan_inputs(hw, m.gradient_checkpointing, est.ssd_tier)
    if not m.layers:
        raise EstimateError(f"ssdtrain estimate: --plan plans per repeated block, and "
                            f"{m.model_name or 'the model'} has none (no nn.ModuleList); "
                            f"pass layers= to estimate() to name them.")
    total = m.flops or 0.0
    layer_flops = list(m.layer_flops or [0.0] * len(m.layers))
    if hw.tflops is not None:
        if total <= 0:
            raise EstimateError("ssdtrain estimate: the model's forward counts no FLOPs, so "
                                "--tflops cannot time it; give --step-seconds.")
        per_flop = 1.0 / (hw.tflops * 1e12)
    elif total > 0:
        per_flop = hw.step_seconds / 3.0 / total
    else:   # no FLOPs counted: the step split evenly over the blocks
        layer_flops, total = [1.0] * len(m.layers), float(len(m.layers))
        per_flop = hw.step_seconds / 3.0 / total
    outside_s = max(0.0, total - sum(layer_flops)) * per_flop
    layers = [LayerCost(name=lb.name, saved_bytes=lb.unique_bytes, input_bytes=lb.input_bytes,
                        fwd_s=f * per_flop, bwd_s=2.0 * f * per_flop,
                        recompute_bytes=lb.activation_bytes)
              for lb, f in zip(m.layers, layer_flops)]
    host = None if est.host_budget_bytes is None else \
        (hw.host_gbps if hw.host_gbps is not None else DEFAULT_HOST_GBPS) * 1e9
    if hw.ssd_write_gbps is not None:
        write = hw.ssd_write_gbps * hw.ssds * 1e9
        read = (hw.ssd_read_gbps if hw.ssd_read_gbps is not None else hw.ssd_write_gbps) \
            * hw.ssds * 1e9
    else:   # no SSD tier (--no-ssd): nothing is priced at the SSD's bandwidth
        write = read = host
    step = StepCost(write_bps=write, read_bps=read, fwd_other_s=outside_s,
                    bwd_head_s=2.0 * outside_s, tail_s=0.0, prefetch_bytes=cfg.prefetch_bytes,
                    write_behind_bytes=cfg.write_behind_bytes, fixed_bytes=m.kept_held_bytes,
                    head_bytes=m.outside.unique_bytes, keep_tail_bytes=cfg.keep_tail_bytes,
                    host_budget_bytes=est.host_budget_bytes or 0, host_write_bps=host,
                    host_read_bps=host, ssd_tier=est.ssd_tier)
    return layers, step


def plan_budget(est: "Estimate", memory_budget=None):
    """``(budget bytes or None, where it came from)`` (NOTE [ Plan from the estimate ])."""
    if memory_budget is not None:
        return _parse_budget(memory_budget), "--memory-budget"
    if est.hardware.device_memory is not None:
        static = _static_bytes(est.measurement, est.hardware)
        return max(0, est.hardware.device_memory - static), \
            f"device memory - {_b(static)} weights, gradients, optimizer state"
    return None, "none given"


def predict_choices(est: "Estimate", choices):
    """The cost model's prediction for a plan of your own: one of ``"keep"``,
    ``"offload"``, ``"recompute"`` per block, first block first (``plan.choices`` of
    ``--json``), at the configured settings, as ``set_plan`` runs it.

    Returns:
        The planner's ``Prediction`` (``step_s``, ``stall_s``, ``recompute_s``,
        ``peak_bytes``, ``written_bytes``, ``kept_bytes``; with a host tier where the
        bytes go: ``host_bytes``, ``ssd_bytes``, ``device_bytes``).

    Raises:
        ConfigError, EstimateError: as :func:`plan_costs`.
        ValueError: a wrong number of choices or an unknown choice.
    """
    from .._policies.costmodel import predict
    layers, step = plan_costs(est)
    return predict(layers, tuple(choices), step)


def make_plan(est: "Estimate", memory_budget=None, *, max_plans: int = 6561) -> PlanEstimate:
    """The planner's plan for ``est`` and the predictions beside it (``--plan``).

    Args:
        est: an :class:`Estimate` with ``--tflops`` or ``--step-seconds`` and
            ``--ssd-write-gbps`` (``--ssd-read-gbps`` defaults to it).
        memory_budget: activation bytes allowed (``"40GiB"`` accepted); default: device
            memory minus weights, gradients and optimizer state, else no budget.
        max_plans: most plans the search predicts (NOTE [ Plan search ] in _policies/planner.py).

    Raises:
        ConfigError, EstimateError: as :func:`plan_costs`; a bad ``memory_budget``.
    """
    from .._policies.planner import plan as search, predict
    budget, source = plan_budget(est, memory_budget)
    layers, step = plan_costs(est)
    best = search(layers, budget, step, max_plans=max_plans)
    refs = {}
    for name, choice in REFERENCES:
        choices = (choice,) * len(layers)
        s = step
        if name == "none":   # no offload: the head's records stay in memory too
            s = dataclasses.replace(step, head_bytes=0, keep_tail_bytes=0,
                                    fixed_bytes=step.fixed_bytes + step.head_bytes)
        refs[name] = predict(layers, choices, s)
    return PlanEstimate(plan=best, references=refs, budget_bytes=budget, budget_from=source,
                        configured_write_behind_bytes=step.write_behind_bytes)


# ---------------------------------------------------------------------------- CLI
