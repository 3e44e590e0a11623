"""What a check found: :class:`CheckResult`, its verdict, report and JSON, and the
command's exit statuses."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict, List, Optional

from ..estimate.format import finite
from .compare import MARGIN, Mismatch, Varying

EXIT_EXACT, EXIT_MISMATCH, EXIT_USAGE, EXIT_NONDETERMINISTIC = 0, 1, 2, 3
EXIT_INTERRUPTED = 130  # 128 + SIGINT, the shell's convention

@dataclasses.dataclass
class CheckResult:
    """What :func:`check_model` found. ``exact`` is the verdict; ``verdict`` names it."""

    exact: bool
    deterministic: bool
    compared: str
    tensors_compared: int
    mismatches: List[Mismatch]
    error: Optional[str]
    stats: Dict[str, Any]
    reference_seconds: float
    ssdtrain_seconds: float
    device: str
    references: int = 2
    varying: List[Varying] = dataclasses.field(default_factory=list)
    kinds: Dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def verdict(self) -> str:
        """``"exact"``, ``"failed"`` (the step with ssdtrain raised), ``"mismatch"`` or
        ``"nondeterministic"``."""
        if self.exact:
            return "exact"
        if self.error is not None:
            return "failed"
        if self.mismatches:
            return "mismatch"
        return "nondeterministic"

    @property
    def exit_status(self) -> int:
        return {"exact": EXIT_EXACT, "failed": EXIT_MISMATCH, "mismatch": EXIT_MISMATCH,
                "nondeterministic": EXIT_NONDETERMINISTIC}[self.verdict]

    def report(self) -> str:
        mib = lambda n: f"{n / (1 << 20):.2f} MiB"  # noqa: E731
        s = self.stats
        lines = []
        verdict = self.verdict
        if verdict == "failed":
            lines.append(f"FAILED: the step with ssdtrain raised, where {self.references} "
                         f"steps without it ran: {self.error}")
        elif verdict == "exact":
            words = {"gradient": "gradient", "buffer": "buffer", "attribute": "tensor attribute",
                     "rng": "RNG state"}
            counted = "".join(f", {n} {words[kind]}{'s' if n != 1 else ''}"
                              for kind, n in self.kinds.items() if kind in words and n)
            lines.append(f"EXACT: the loss{counted} are bitwise equal to the step without "
                         f"ssdtrain ({self.references} steps without it agreed).")
        elif verdict == "nondeterministic":
            worst = max(self.varying, key=lambda v: v.spread)
            lines.append(
                f"NONDETERMINISTIC: without ssdtrain the model itself varies: "
                f"{len(self.varying)} of {self.tensors_compared} tensors differ between "
                f"{self.references} identical steps (widest: {worst.kind} {worst.name}, spread "
                f"{worst.spread:.6g}). With ssdtrain every tensor they agreed on is bitwise "
                f"equal and the others lie within {MARGIN:g}x their spread, so nothing points "
                f"at ssdtrain; exactness cannot be shown bitwise on a model that is not "
                f"deterministic.")
        else:
            first = self.mismatches[0]
            lines.append(f"MISMATCH ({self.compared}): {len(self.mismatches)} of "
                         f"{self.tensors_compared} tensors differ; first: {first}")
            worst = max(self.mismatches, key=lambda m: m.max_abs_diff)
            if worst is not first:
                lines.append(f"  largest: {worst}")
        if not self.deterministic:
            lines.append("note: without ssdtrain the model gave different results in identical "
                         "steps (a kernel with no deterministic variant? noise the model draws "
                         "from a source check does not restore?); on CUDA try "
                         "torch.use_deterministic_algorithms(True).")
        if s:
            lines.append(
                f"offloaded {mib(s['offloaded_bytes'])} of {mib(s['unique_bytes'])} saved "
                f"({s['records_written']} writes), read back {mib(s['bytes_read'])} "
                f"({s['records_read']} reads), kept in memory {mib(s['kept_bytes'])}; engine "
                f"{s['engine']}")
            held = s.get("resident_at_backward_bytes")
            if held is not None:
                lines.append(
                    f"memory: when backward started ssdtrain held {mib(held)} of the "
                    f"{mib(s['unique_bytes'])} saved (without it: all of them; saves "
                    f"{mib(max(0, s['unique_bytes'] - held))})")
        if self.reference_seconds > 0 and self.ssdtrain_seconds > 0:
            lines.append(f"step time with ssdtrain {self.ssdtrain_seconds:.3f} s vs "
                         f"{self.reference_seconds:.3f} s without "
                         f"({self.ssdtrain_seconds / self.reference_seconds:.2f}x; every write "
                         f"waited for before backward, so slower than in training)")
        return "\n".join(lines)

    def to_json(self) -> dict:
        """The result as a JSON-ready dict (every field, ``verdict``, ``exit_status``;
        an infinite difference is ``null``)."""
        d = dataclasses.asdict(self)
        d["verdict"] = self.verdict
        d["exit_status"] = self.exit_status
        return json.loads(json.dumps(finite(d), default=str, allow_nan=False))
