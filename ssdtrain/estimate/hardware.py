"""What the estimate knows of the machine: ``Hardware``, its valid ranges, the dtypes."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from .._config import parse_bytes
from .._errors import ConfigError

if TYPE_CHECKING:
    from .replay import Measurement


DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}

_SEARCH_LIMIT = 1 << 16   # largest micro-batch the search considers

# The range each hardware number may take: wide enough for any machine there is or will
# be soon, narrow enough that the formulas never overflow, underflow to 0 or give inf or
# NaN (a subnormal step time, 1e300 TFLOP/s). Outside it the number is a typo.
HARDWARE_RANGES = {
    "ssd_write_gbps": (1e-6, 1e6, "GB/s per drive", "7"),
    "ssd_read_gbps": (1e-6, 1e6, "GB/s per drive", "7"),
    "step_seconds": (1e-9, 1e9, "seconds", "0.5"),
    "tflops": (1e-6, 1e9, "TFLOP/s", "400"),
    "ssd_tbw": (1e-6, 1e9, "TB written", "7000"),
    "bytes_per_param": (1e-3, 1e6, "bytes per parameter", "16"),
    "host_gbps": (1e-6, 1e6, "GB/s each way", "25"),
}
MAX_SSDS = 1 << 20
DEFAULT_HOST_GBPS = 25.0
"""The device <-> host copy rate ``--plan`` prices the host tier at when ``--host-gbps``
is not given: about what a PCIe 4.0 x16 link sustains each way (32 GB/s raw)."""


@dataclass
class Hardware:
    """Hardware numbers, all optional; each output needs only some of them.

    Bandwidths are decimal GB/s (1e9 bytes per second) per drive; ``ssd_tbw`` is the
    drive's rated endurance in decimal TB written (1e12 bytes)."""

    device_memory: Optional[int] = None
    """Bytes of accelerator memory one training process may use (``"80GiB"`` accepted)."""
    ssd_write_gbps: Optional[float] = None
    ssd_read_gbps: Optional[float] = None
    """The plan (``Estimate.plan``) takes the write bandwidth when this is not given."""
    step_seconds: Optional[float] = None
    """Compute time of one micro-batch, forward + backward (no I/O)."""
    tflops: Optional[float] = None
    """Sustained TFLOP/s of the device; compute time = the model's FLOPs / this."""
    ssd_tbw: Optional[float] = None
    ssds: int = 1
    """Drives serving this device; ssdtrain stripes over them (``spill_dir`` list)."""
    bytes_per_param: float = 16.0
    """Device bytes per trainable parameter: weights, gradients, optimizer state.
    16 = mixed-precision Adam: 2 (bf16 weights) + 2 (bf16 grads) + 12 (fp32 master,
    m, v). Frozen parameters count their own size only."""
    host_gbps: Optional[float] = None
    """Device <-> host copy rate, decimal GB/s each way, at which the plan prices the
    host tier's bytes (NOTE [ Tiers in the step cost model ] in _policies/costmodel.py); default
    :data:`DEFAULT_HOST_GBPS`."""

    def __post_init__(self):
        if self.device_memory is not None:
            self.device_memory = parse_bytes(self.device_memory, name="device_memory")
        for name, (lo, hi, unit, example) in HARDWARE_RANGES.items():
            v = getattr(self, name)
            if v is None:
                continue
            flag = "--" + name.replace("_", "-")
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ConfigError(f"ssdtrain estimate: {name} ({flag}) must be a number of "
                                  f"{unit}, got {v!r}.")
            if not (math.isfinite(v) and lo <= v <= hi):
                what = ("is not a finite number" if not math.isfinite(v) else
                        "must be > 0" if v <= 0 else
                        "is too small to be real" if v < lo else "is too large to be real")
                raise ConfigError(f"ssdtrain estimate: {name} ({flag}) {what}: got {v!r}, "
                                  f"expected {unit} between {lo:g} and {hi:g} (e.g. {flag} "
                                  f"{example}).")
        if isinstance(self.ssds, bool) or not isinstance(self.ssds, int) \
                or not 1 <= self.ssds <= MAX_SSDS:
            raise ConfigError(f"ssdtrain estimate: ssds (--ssds) must be a whole number of "
                              f"drives between 1 and {MAX_SSDS}, got {self.ssds!r}.")

    @property
    def given(self) -> bool:
        return any(getattr(self, f.name) is not None for f in dataclasses.fields(self)
                   if f.name not in ("ssds", "bytes_per_param"))


# ------------------------------------------------------------------------ factories


def _static_bytes(m: Measurement, hw: Hardware) -> int:
    """Weights, gradients and optimizer state: trainable x bytes_per_param + frozen + buffers."""
    return int(m.trainable_params * hw.bytes_per_param + m.frozen_param_bytes + m.buffer_bytes)
