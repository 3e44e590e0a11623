"""The process tests/test_limits.py runs inside a memory cgroup it made (one per run).

``python cgroup_child.py budget``: prints the resolved ``host_budget_bytes="auto"``
and its reason as JSON.

``python cgroup_child.py train MODE SPILL_DIR ROOM_MIB STEPS CGROUP_DIR VERSION``: sets
its own cgroup's (``CGROUP_DIR``, cgroup ``VERSION`` 1 or 2: the test found it) limit to what it uses once torch is imported plus ``ROOM_MIB``, then trains a CPU
model whose saved activations are several times that room for ``STEPS`` steps under
``MODE`` (``none``: without ssdtrain, ``static``, ``auto``), and prints the cgroup's
peak usage over the limit as JSON. A run the limit kills ends with SIGKILL.
"""

import json
import os
import sys

import torch

import ssdtrain

MiB = 1 << 20


def budget():
    cfg = ssdtrain.OffloadConfig(host_budget_bytes="auto").resolve()
    print(json.dumps({"budget": cfg.host_budget_bytes,
                      "reason": getattr(cfg, "host_budget_reason", "")}))


class Chain(torch.nn.Module):
    """Elementwise layers over one wide activation: each saves a new 16 MiB tensor for
    backward and costs milliseconds, so a step saves a lot and runs fast."""

    def __init__(self, layers, width):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.full((layers, width), 1.001))

    def forward(self, x):
        for s in self.scale:
            x = torch.tanh(x * s)
        return x.sum()


def _files(version):
    if version == 1:
        return "memory.limit_in_bytes", "memory.usage_in_bytes", "memory.max_usage_in_bytes"
    return "memory.max", "memory.current", "memory.peak"


def train(mode, spill_dir, room_mib, steps, directory, version):
    limit_file, usage_file, peak_file = _files(version)
    with open(os.path.join(directory, usage_file)) as f:
        used = int(f.read())
    limit = used + room_mib * MiB
    with open(os.path.join(directory, limit_file), "w") as f:
        f.write(str(limit))
    torch.manual_seed(0)
    width, rows, layers = 4096, 1024, 24   # 16 MiB per saved tensor, 384 MiB a step
    model = Chain(layers, width)
    x = torch.randn(rows, width)
    off = None if mode == "none" else ssdtrain.Offloader(
        spill_dir=spill_dir, policy=mode, keep_tail_bytes=0, prefetch_bytes="32MiB",
        write_behind_bytes="32MiB")
    for _ in range(steps):
        if off is None:
            loss = model(x)
        else:
            with off:
                loss = model(x)
        loss.backward()
        model.scale.grad = None
    stats = off.stats() if off is not None else None
    if off is not None:
        off.close()
    try:
        with open(os.path.join(directory, peak_file)) as f:
            peak = int(f.read())
    except OSError:
        peak = None
    print(json.dumps({"limit": limit, "used_at_start": used, "peak": peak,
                      "floor": getattr(getattr(off, "_auto", None), "floor", None),
                      "offloaded": stats.offloaded_bytes if stats else 0}))


if __name__ == "__main__":
    if sys.argv[1] == "budget":
        budget()
    else:
        train(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6],
              int(sys.argv[7]))
