"""``Estimate``: what one estimate found, as a table, markdown and JSON."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, Optional

import torch

from .._config import MAX_BYTES, OffloadConfig
from .replay import Measurement
from .format import _b, finite, _md
from .hardware import Hardware

if TYPE_CHECKING:
    from .plan import PlanEstimate


@dataclass
class Estimate:
    """The result of :func:`estimate`: per micro-batch bytes, per layer, and hardware math."""

    measurement: Measurement
    config: OffloadConfig
    hardware: Hardware
    batch: Optional[int]
    seq: Optional[int]
    dtype: Optional[torch.dtype]
    model: str
    times: Optional[Dict[str, float]] = None
    required_write_gbps: Optional[float] = None
    required_read_gbps: Optional[float] = None
    write_ok: Optional[bool] = None
    read_ok: Optional[bool] = None
    max_micro_batch: Optional[Dict[str, Optional[int]]] = None
    memory: Optional[Dict[str, int]] = None
    max_seq: Optional[Dict[str, Optional[int]]] = None
    """With ``longest_seq``: per mode (``none``, ``recompute``, ``ssdtrain``) the longest
    sequence, a multiple of ``seq_unit``, whose micro-batch fits ``device_memory``."""
    tb_written_per_day: Optional[float] = None
    drive_years: Optional[float] = None
    notes: tuple = ()
    host_budget_bytes: Optional[int] = None
    """The host tier's budget in bytes (``"auto"``/``"unlimited"`` resolved), or None."""
    ssd_tier: bool = True
    """Whether an SSD tier takes what is offloaded beyond the host tier (or everything,
    without one); False: a host tier alone, what does not fit stays in device memory."""

    # the fixed keys
    @property
    def unique_bytes(self):
        return self.measurement.unique_bytes

    @property
    def offloadable_bytes(self):
        return self.measurement.offloadable_bytes

    @property
    def kept_bytes(self):
        return self.measurement.kept_bytes

    @property
    def packed_bytes(self):
        return self.measurement.packed_bytes

    @property
    def layers(self):
        return self.measurement.layers

    @property
    def ssd_bytes(self) -> int:
        """Bytes written to the SSD per micro-batch: everything offloaded without a host
        tier; with one, what goes past RAM (``host_spilled_bytes``); 0 without an SSD."""
        m = self.measurement
        if not self.ssd_tier:
            return 0
        return m.offloadable_bytes if self.host_budget_bytes is None else m.host_spilled_bytes

    def host_tier(self) -> Optional[dict]:
        """The host tier per micro-batch (``--json``'s ``host_tier``), or None without one:
        ``budget_bytes``; ``ssd_tier``; ``host_bytes`` (in RAM when forward ends: what
        backward loads from RAM); ``peak_host_bytes`` (the most in RAM at once, at most the
        budget); ``ssd_bytes`` (went past RAM to the SSD); ``device_bytes`` (kept in device
        memory beyond the budget, only without an SSD tier). As ``Stats.host_bytes``,
        ``peak_host_bytes``, ``host_spilled_bytes``, ``over_budget_bytes`` count them."""
        if self.host_budget_bytes is None:
            return None
        m = self.measurement
        return {"budget_bytes": self.host_budget_bytes, "ssd_tier": self.ssd_tier,
                "host_bytes": m.host_bytes, "peak_host_bytes": m.peak_host_bytes,
                "ssd_bytes": m.host_spilled_bytes,
                "device_bytes": 0 if self.ssd_tier else m.over_budget_bytes}

    def to_json(self) -> dict:
        """The ``--json`` object. Fixed keys: ``unique_bytes``, ``offloadable_bytes``,
        ``kept_bytes``, ``packed_bytes``, ``layers`` (``name``, ``unique_bytes``,
        ``offloadable_bytes``, and more per layer); with hardware, those of
        ``required_write_gbps``, ``required_read_gbps``, ``max_micro_batch`` (``none``,
        ``recompute``, ``ssdtrain``), ``tb_written_per_day``, ``drive_years`` that the
        numbers given allow. Other keys add detail (docs/estimate.md)."""
        m = self.measurement
        out = {
            "unique_bytes": m.unique_bytes,
            "offloadable_bytes": m.offloadable_bytes,
            "kept_bytes": m.kept_bytes,
            "packed_bytes": m.packed_bytes,
            "layers": [lb.to_json() for lb in m.layers],
            "outside_layers": m.outside.to_json(),
            "kept_tail_bytes": m.kept_tail_bytes,
            "deduplicated_bytes": m.deduplicated_bytes,
            "over_budget_bytes": m.over_budget_bytes,
            "model": self.model,
            "parameters": m.params,
            "trainable_parameters": m.trainable_params,
            "batch": self.batch,
            "seq": self.seq,
            "dtype": None if self.dtype is None else str(self.dtype).replace("torch.", ""),
            "gradient_checkpointing": m.gradient_checkpointing,
            "forward_flops": m.flops,
            "layer_forward_flops": m.layer_flops,
            "settings": {"min_tensor_bytes": self.config.min_tensor_bytes,
                         "keep_tail_bytes": self.config.keep_tail_bytes,
                         "prefetch_bytes": self.config.prefetch_bytes,
                         "write_behind_bytes": self.config.write_behind_bytes,
                         "max_spill_bytes": self.config.max_spill_bytes,
                         "host_budget_bytes": self.host_budget_bytes},
        }
        if self.host_budget_bytes is not None:
            out["host_tier"] = self.host_tier()
        if self.hardware.given:
            out["hardware"] = {k: v for k, v in dataclasses.asdict(self.hardware).items()
                               if v is not None}
        if self.required_write_gbps is not None:
            out["required_write_gbps"] = self.required_write_gbps
            out["required_read_gbps"] = self.required_read_gbps
            out["seconds"] = self.times
            if self.write_ok is not None:
                out["write_ok"] = self.write_ok
            if self.read_ok is not None:
                out["read_ok"] = self.read_ok
        if self.max_micro_batch is not None:
            out["max_micro_batch"] = dict(self.max_micro_batch)
            out["memory_bytes"] = dict(self.memory)
        if self.max_seq is not None:
            out["max_seq"] = dict(self.max_seq)
        if self.tb_written_per_day is not None:
            out["tb_written_per_day"] = self.tb_written_per_day
        if self.drive_years is not None:   # inf (nothing written) is null: JSON has no inf
            out["drive_years"] = self.drive_years
        if self.notes:
            out["notes"] = list(self.notes)
        return finite(out)

    def table(self) -> str:
        """A readable report (markdown tables)."""
        m = self.measurement
        dt = "" if self.dtype is None else str(self.dtype).replace("torch.", "") + ", "
        shape = ", ".join(x for x in (
            None if self.batch is None else f"micro-batch {self.batch}",
            None if self.seq is None else f"seq {self.seq}") if x)
        name = self.model if m.model_name in self.model else f"{self.model} ({m.model_name})"
        lines = [f"ssdtrain estimate: {name}, {m.params / 1e9:.2f} B "
                 f"parameters, {dt}{shape}"
                 + (", gradient checkpointing" if m.gradient_checkpointing else ""),
                 f"settings: min_tensor_bytes {_b(self.config.min_tensor_bytes)}, "
                 f"keep_tail_bytes {_b(self.config.keep_tail_bytes)}, prefetch_bytes "
                 f"{_b(self.config.prefetch_bytes)}", ""]
        rows = [("layer", "saved (per pack)", "unique", "offloaded", "kept", "held w/o offload")]
        for first, last, lb in _runs(m.layers):   # identical consecutive blocks: one row
            name = lb.name if first == last else \
                f"{m.layers[first].name} .. {m.layers[last].name} (each)"
            rows.append((name, _b(lb.packed_bytes), _b(lb.unique_bytes),
                         _b(lb.offloadable_bytes), _b(lb.kept_bytes), _b(lb.activation_bytes)))
        o = m.outside
        rows.append(("(outside layers)", _b(o.packed_bytes), _b(o.unique_bytes),
                     _b(o.offloadable_bytes), _b(o.kept_bytes), _b(m.outside_held_bytes)))
        rows.append(("**total per micro-batch**", _b(m.packed_bytes), _b(m.unique_bytes),
                     _b(m.offloadable_bytes), _b(m.kept_bytes), _b(m.held_bytes)))
        lines += _md(rows, right=range(1, 6))
        lines.append("")
        per_pack = m.kept_bytes - m.kept_tail_bytes - m.over_budget_bytes
        over = "host_budget_bytes" if not self.ssd_tier else "max_spill_bytes"
        lines.append(f"kept = {_b(per_pack)} per pack ({_b(m.kept_state_bytes)} of them "
                     f"parameters, {_b(per_pack - m.kept_state_bytes)} small or other kinds) + "
                     f"{_b(m.kept_tail_bytes)} tail"
                     + (f" + {_b(m.over_budget_bytes)} over {over}"
                        if m.over_budget_bytes else "")
                     + f"; deduplicated {_b(m.deduplicated_bytes)}"
                     + ("" if m.flops is None else
                        f"; forward {m.flops / 1e12:.3g} TFLOP per micro-batch"))
        tier = self.host_tier()
        if tier is not None:
            budget = "unlimited" if tier["budget_bytes"] >= MAX_BYTES else \
                _b(tier["budget_bytes"])
            lines.append("")
            lines += _md([("host tier (host_budget_bytes " + budget + ", "
                           + ("SSD beyond" if self.ssd_tier else "no SSD tier") + ")", ""),
                          ("in host RAM when forward ends", _b(tier["host_bytes"])),
                          ("peak in host RAM", _b(tier["peak_host_bytes"])),
                          ("on to the SSD (beyond the budget)" if self.ssd_tier else
                           "kept in device memory (beyond the budget)",
                           _b(tier["ssd_bytes"] if self.ssd_tier else tier["device_bytes"]))],
                         right=(1,))
        hw = []
        if self.required_write_gbps is not None:
            t = self.times
            hw.append(("compute per micro-batch", f"{t['forward']:.3f} s forward + "
                       f"{t['backward']:.3f} s backward"))
            hw.append(("SSD write needed (full overlap)", _gbps(self.required_write_gbps,
                                                                 self._provided("w"),
                                                                 self.write_ok)))
            hw.append(("SSD read needed (full overlap)", _gbps(self.required_read_gbps,
                                                                self._provided("r"),
                                                                self.read_ok)))
        if self.max_micro_batch is not None:
            mm = self.max_micro_batch
            mem = self.memory
            b = self.batch
            for mode, label in (("none", "no offload"), ("recompute", "full recompute"),
                                ("ssdtrain", "ssdtrain")):
                v = mm.get(mode)
                hw.append((f"largest micro-batch, {label}",
                           ("?" if v is None else str(v)) +
                           (f" ({_b(mem[mode])} at "
                            f"{'its batch' if b is None else f'micro-batch {b}'})"
                            if mode in mem else "")))
        if self.max_seq is not None:
            for mode, label in (("none", "no offload"), ("recompute", "full recompute"),
                                ("ssdtrain", "ssdtrain")):
                v = self.max_seq.get(mode)
                hw.append((f"longest sequence at micro-batch {self.batch}, {label}",
                           "?" if v is None else f"{v} tokens"))
        if self.tb_written_per_day is not None:
            hw.append(("written per day (all drives)", f"{self.tb_written_per_day:.1f} TB"))
        if self.drive_years is not None:
            hw.append((f"years to rated endurance ({self.hardware.ssd_tbw:g} TBW x "
                       f"{self.hardware.ssds})", f"{self.drive_years:.2f}"))
        if hw:
            lines.append("")
            lines += _md([("hardware", "")] + hw, right=())
        for n in self.notes:
            lines.append("")
            lines.append(f"note: {n}")
        return "\n".join(lines)

    def plan(self, memory_budget=None, *, max_plans: int = 6561) -> "PlanEstimate":
        """The per-block keep / offload / recompute plan for this estimate and its
        predicted step time and peak activation memory beside none, checkpoint-all and
        offload-all (:func:`make_plan`; ``ssdtrain estimate --plan``)."""
        from .plan import make_plan   # the plan module builds on this one
        return make_plan(self, memory_budget, max_plans=max_plans)

    def _provided(self, which):
        h = self.hardware
        v = h.ssd_write_gbps if which == "w" else h.ssd_read_gbps
        return None if v is None else v * h.ssds


def _runs(layers):
    """``(first, last, LayerBytes)`` for each run of consecutive blocks with equal bytes."""
    out = []
    for i, lb in enumerate(layers):
        key = dataclasses.astuple(lb)[1:]
        if out and out[-1][3] == key:
            out[-1][1] = i
        else:
            out.append([i, i, lb, key])
    return [(a, b, lb) for a, b, lb, _ in out]


def _gbps(need, have, ok):
    s = f"{need:.2f} GB/s"
    if have is not None:
        s += f" (have {have:.2f} GB/s: {'yes' if ok else 'NO'})"
    return s
