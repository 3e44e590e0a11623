"""``ssdtrain estimate``: the command line, its checks and its JSON."""

from __future__ import annotations

import argparse
import json
import os
import sys

from .._config import OffloadConfig
from .._errors import ConfigError
from .replay import EstimateError
from .hardware import DEFAULT_HOST_GBPS, DTYPES, Hardware
from .memory import _dtype, estimate
from .models import load_factory
from .plan import _check_plan_inputs, _parse_budget, compact_plan
from .format import _b, _json_default


class _Parser(argparse.ArgumentParser):
    def error(self, message):   # argparse style: usage, message, exit code 2
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parser(prog="ssdtrain estimate"):
    p = _Parser(prog=prog, description="Estimate what ssdtrain saves, offloads and keeps per "
                "micro-batch, from the model alone (meta device, fake tensors: nothing is "
                "allocated). Byte sizes take units (256KiB, 80GiB, 1.5GB); GB/s and TB are "
                "decimal.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf-config", metavar="PATH",
                     help="a Hugging Face config.json (or its directory); built with "
                          "from_config on the meta device, nothing downloaded")
    src.add_argument("--factory", metavar="MODULE:FUNCTION",
                     help="a function returning (model, inputs); called under "
                          "torch.device('meta') with those of batch, seq, dtype, "
                          "gradient_checkpointing it accepts")
    p.add_argument("--batch", type=int, help="micro-batch size (default 1 for --hf-config)")
    p.add_argument("--seq", type=int, help="sequence length (default min(2048, max positions))")
    p.add_argument("--dtype", help=f"one of {', '.join(sorted(DTYPES))} (default: the config's "
                                   f"dtype, else float32)")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="enable the model's activation checkpointing (non-reentrant)")
    g = p.add_argument_group("ssdtrain settings (OffloadConfig fields)")
    g.add_argument("--min-tensor-bytes", help="default 256KiB")
    g.add_argument("--keep-tail-bytes", help="default 128MiB")
    g.add_argument("--prefetch-bytes", help="default 256MiB (memory model only)")
    g.add_argument("--write-behind-bytes", help="default 1GiB (memory model only)")
    g.add_argument("--max-spill-bytes", help="disk budget (default none)")
    g.add_argument("--offload-quota", help="replay one step's offload quota of the default "
                   "policy (Stats.offload_quota_bytes; default: none, the most it offloads)")
    g.add_argument("--host-budget", metavar="SIZE|auto|unlimited",
                   help="host_budget_bytes: the host-RAM tier before the SSD (64GiB; 'auto': "
                        "half of this machine's memory limit; 'unlimited'). Reports the bytes "
                        "held in RAM, their peak and those going on to the SSD (default: no "
                        "host tier)")
    g.add_argument("--no-ssd", action="store_true",
                   help="with --host-budget: no SSD tier (no spill_dir); what does not fit "
                        "in the budget stays in device memory")
    h = p.add_argument_group("hardware (all optional)")
    h.add_argument("--device-memory", help="accelerator memory for one process, e.g. 80GiB")
    h.add_argument("--ssd-write-gbps", type=float, help="per drive, GB/s")
    h.add_argument("--ssd-read-gbps", type=float, help="per drive, GB/s")
    t = h.add_mutually_exclusive_group()
    t.add_argument("--step-seconds", type=float,
                   help="compute time of one micro-batch (forward + backward)")
    t.add_argument("--tflops", type=float,
                   help="sustained TFLOP/s; compute time from the model's FLOPs")
    h.add_argument("--ssd-tbw", type=float, help="drive endurance, TB written")
    h.add_argument("--ssds", type=int, default=1, help="drives for this device (default 1)")
    h.add_argument("--host-gbps", type=float,
                   help=f"with --plan and --host-budget: device <-> host copy rate, GB/s each "
                        f"way, at which the plan prices the bytes in host RAM (default "
                        f"{DEFAULT_HOST_GBPS:g}: a PCIe 4.0 x16 link)")
    h.add_argument("--bytes-per-param", type=float, default=16.0,
                   help="device bytes per trainable parameter for weights, gradients and "
                        "optimizer state (default 16: mixed-precision Adam)")
    pl = p.add_argument_group("plan (docs/estimate.md, 'Plan before launch')")
    pl.add_argument("--plan", action="store_true",
                    help="choose keep / offload / recompute per block with the adaptive "
                         "policy's planner and print its predicted step time and peak "
                         "activation memory beside none, checkpoint-all and offload-all; "
                         "needs --tflops or --step-seconds and --ssd-write-gbps (read "
                         "defaults to write; not with --no-ssd); with --host-budget the "
                         "bytes that fit in host RAM are priced at --host-gbps; exit "
                         "status 3 when no plan fits the budget")
    pl.add_argument("--memory-budget",
                    help="activation bytes the plan may hold, e.g. 40GiB (default: "
                         "--device-memory minus weights, gradients and optimizer state, "
                         "else none)")
    h.add_argument("--longest-seq", action="store_true",
                   help="with --device-memory: also search the longest sequence whose "
                        "micro-batch fits, with no offload, full recompute and ssdtrain "
                        "(from --seq, in steps of --seq-unit; the model runs on fake tensors "
                        "once per length tried, a line each on stderr)")
    h.add_argument("--seq-unit", type=int, default=1024,
                   help="granularity of --longest-seq in tokens (default 1024)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--traceback", action="store_true",
                   help="on an error, show Python's full traceback instead of one line")
    return p


def main(argv=None, prog="ssdtrain estimate") -> int:
    """The ``ssdtrain estimate`` command; returns the exit code (2: bad arguments)."""
    p = _parser(prog)
    a = p.parse_args(argv)
    try:
        overrides = {k: getattr(a, k) for k in ("min_tensor_bytes", "keep_tail_bytes",
                                                "prefetch_bytes", "write_behind_bytes",
                                                "max_spill_bytes")
                     if getattr(a, k) is not None}
        if a.host_budget is not None:
            word = a.host_budget.strip().lower()
            overrides["host_budget_bytes"] = word if word in ("auto", "unlimited") else \
                a.host_budget
        elif a.no_ssd:
            raise ConfigError("ssdtrain estimate: --no-ssd leaves only the host tier, which "
                              "needs --host-budget (e.g. --host-budget 64GiB).")
        try:
            cfg = OffloadConfig(**overrides)
        except ConfigError as e:
            if "host_budget_bytes" in str(e):   # name the flag the user typed
                raise ConfigError(f"{e} (--host-budget also takes 'auto' or "
                                  f"'unlimited')") from None
            raise
        ssd_tier = False if a.no_ssd else True
        hw = Hardware(device_memory=a.device_memory, ssd_write_gbps=a.ssd_write_gbps,
                      ssd_read_gbps=a.ssd_read_gbps, step_seconds=a.step_seconds,
                      tflops=a.tflops, ssd_tbw=a.ssd_tbw, ssds=a.ssds,
                      bytes_per_param=a.bytes_per_param, host_gbps=a.host_gbps)
        if a.host_gbps is not None and (a.host_budget is None or not a.plan):
            raise ConfigError("ssdtrain estimate: --host-gbps is the host tier's copy rate "
                              "that --plan prices it at; add --plan and --host-budget (e.g. "
                              "--host-budget 64GiB), or drop --host-gbps.")
        dtype = _dtype(a.dtype)
        if a.factory is not None:
            model = a.factory
            load_factory(model)   # a bad string or module is a usage error (exit 2)
        else:
            model = a.hf_config
            if not os.path.exists(model):
                raise ConfigError(f"ssdtrain estimate: --hf-config {model!r}: no such file "
                                  f"(give a Hugging Face config.json, or its directory).")
        planned = None
        if a.memory_budget is not None and not a.plan:
            raise ConfigError("ssdtrain estimate: --memory-budget is the plan's budget; add "
                              "--plan.")
        if a.plan:   # refused before the model runs
            _check_plan_inputs(hw, a.gradient_checkpointing, ssd_tier)
            if a.memory_budget is not None:
                _parse_budget(a.memory_budget)
        if a.longest_seq and hw.device_memory is None:
            raise ConfigError("ssdtrain estimate: --longest-seq needs --device-memory (e.g. "
                              "--device-memory 80GiB).")
        est = estimate(model, batch=a.batch, seq=a.seq, dtype=dtype,
                       gradient_checkpointing=a.gradient_checkpointing, config=cfg, hardware=hw,
                       offload_quota=a.offload_quota, ssd_tier=ssd_tier,
                       longest_seq=a.longest_seq, seq_unit=a.seq_unit,
                       progress=lambda line: print(line, file=sys.stderr, flush=True))
        if a.plan:
            planned = est.plan(a.memory_budget)
    except ConfigError as e:
        if a.traceback:
            raise
        p.print_usage(sys.stderr)
        print(f"{p.prog}: error: {_strip(e)}", file=sys.stderr)
        return 2
    except EstimateError as e:
        if a.traceback:
            raise
        print(f"{p.prog}: error: {_strip(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if a.traceback:
            raise
        print(f"{p.prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:   # the model's own code failed on fake tensors
        if a.traceback:
            raise
        print(f"{p.prog}: error: building or running the model on fake tensors failed: "
              f"{type(e).__name__}: {e} (--traceback shows where)", file=sys.stderr)
        return 1
    if a.json:
        out = est.to_json()
        if planned is not None:
            out["plan"] = planned.to_json()
        print(json.dumps(out, indent=2, default=_json_default, allow_nan=False))
    else:
        print(est.table())
        if planned is not None:
            print()
            print(planned.table())
    if planned is not None and not planned.fits:
        p_ = planned.plan.prediction
        print(f"{p.prog}: no plan fits the budget of {_b(planned.budget_bytes)} "
              f"({planned.budget_from}): the least memory predicted is {_b(p_.peak_bytes)} "
              f"({compact_plan(planned.plan.choices)}); give more memory, a smaller "
              f"micro-batch or sequence, or a larger --memory-budget.", file=sys.stderr)
        return 3
    return 0


def _strip(e):
    s = str(e)
    for prefix in ("ssdtrain estimate: ", "ssdtrain: "):
        if s.startswith(prefix):
            return s[len(prefix):]
    return s


if __name__ == "__main__":   # pragma: no cover
    sys.exit(main())
