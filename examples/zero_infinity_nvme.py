#!/usr/bin/env python
"""ZeRO-Infinity plus ssdtrain on one spill device: parameters, optimizer state and
activations on NVMe (the Fuyou-style "big model on one GPU" recipe).

DeepSpeed ZeRO-3 with ``offload_param`` and ``offload_optimizer`` on ``"nvme"``
(DeepSpeed's own ``async_io`` op swaps them to ``<spill-dir>/zero``) and ssdtrain's
``"ssdtrain"`` section for the activations (``<spill-dir>/activations``), through
``ssdtrain.integrations.deepspeed.initialize``. The model is trained twice from the
same seed and data, without and with the ``"ssdtrain"`` section; losses, every full
gradient (``deepspeed.utils.safe_get_full_grad``) and the final fp32 parameters must be
``torch.equal``. Then it prints where every byte of the training state lives and the
step time.

Where the bytes are:

* device: the accelerator's memory (``get_accelerator().memory_allocated()``); on
  the CPU accelerator there is none, the "device" is host memory.
* host: the process's peak RSS (``VmHWM``) and DeepSpeed's swap buffers (the
  parameter swapper's and the optimizer swapper's host buffers, as DeepSpeed reports
  their sizes).
* NVMe: the files under ``<spill-dir>/zero`` (parameters and optimizer state; their
  allocated bytes, ``st_blocks * 512``, grouped by DeepSpeed's subdirectory), and
  ssdtrain's spill files (anonymous: ``Offloader.spill_bytes_in_use()`` at the peak,
  ``Stats.offloaded_bytes`` per step).

DeepSpeed's ``async_io`` op needs ``libaio`` (``apt-get install libaio-dev``) and is
JIT-built on first use (about 7 minutes on 2 cores); without ``--build`` this script
refuses to start a build and says so. ``make zero-infinity`` builds it into
``build/torch_extensions`` and runs the test (tests/test_zero_infinity.py).

Example::

    TORCH_EXTENSIONS_DIR=build/torch_extensions DS_ACCELERATOR=cpu \\
        .venv/bin/python examples/zero_infinity_nvme.py --spill-dir /nvme/scratch --build
"""

from __future__ import annotations

import argparse
import copy
import glob
import importlib.util
import json
import os
import socket
import sys
import tempfile
import time

MiB = 1 << 20


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spill-dir", default=None,
                   help="the one spill device (default: the system temporary directory)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--layers", type=int, default=4)
    # DeepSpeed swaps a parameter partition to NVMe only from 1 MiB up (MIN_AIO_BYTES);
    # smaller ones stay in host memory. d_model 256 and vocab 1024 make every weight
    # matrix 1 MiB, so all of them go (biases and norms stay on the host).
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--offload-device", default="nvme", choices=("nvme", "cpu"),
                   help="where ZeRO puts parameters and optimizer state (default nvme; cpu: "
                        "ZeRO-Offload to host memory, no async_io op needed)")
    p.add_argument("--build", action="store_true",
                   help="JIT-build DeepSpeed's async_io op if it is not built (minutes)")
    p.add_argument("--json", default=None, help="write the results here")
    return p


def async_io_status():
    """``(built, detail)``: whether DeepSpeed's ``async_io`` op can be loaded without
    compiling. Cheap (imports neither torch nor DeepSpeed): looks for a prebuilt op
    (a ``DS_BUILD_AIO=1`` install puts it in ``deepspeed/ops/aio``) and for the JIT
    build in ``$TORCH_EXTENSIONS_DIR/async_io`` (without the variable, in torch's default
    ``~/.cache/torch_extensions/<python>_<accelerator>/async_io``)."""
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        return False, "DeepSpeed is not installed: pip install -e .[deepspeed]"
    pkg = list(spec.submodule_search_locations)[0]
    prebuilt = glob.glob(os.path.join(pkg, "ops", "aio", "*async_io*.so"))
    if prebuilt:
        return True, f"prebuilt with DeepSpeed ({prebuilt[0]})"
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    pattern = os.path.join(root, "async_io", "async_io.so") if root else os.path.join(
        os.path.expanduser("~"), ".cache", "torch_extensions", "*", "async_io", "async_io.so")
    found = glob.glob(pattern)
    if found:
        return True, f"JIT-built at {found[0]}"
    libaio = any(os.path.exists(os.path.join(d, "libaio.h"))
                 for d in ("/usr/include", "/usr/local/include"))
    hint = "" if libaio else " It also needs libaio: apt-get install libaio-dev."
    return False, (f"DeepSpeed's async_io op is not built (no {pattern}); `make zero-infinity` "
                   f"builds it (about 7 minutes) and runs the recipe's test, or run this "
                   f"script with --build.{hint}")


def _model(args):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.ln = nn.LayerNorm(d)
            self.up = nn.Linear(d, 4 * d)
            self.down = nn.Linear(4 * d, d)

        def forward(self, x):
            return x + self.down(F.gelu(self.up(self.ln(x))))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(args.vocab, args.d_model)
            self.blocks = nn.ModuleList([Block(args.d_model) for _ in range(args.layers)])
            self.head = nn.Linear(args.d_model, args.vocab, bias=False)

        def forward(self, idx, targets):
            x = self.embed(idx)
            for block in self.blocks:
                x = block(x)
            return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        return Net().train()


def ds_config(args, zero_dir, largest_param):
    """ZeRO-3, parameters and optimizer state on NVMe (``zero_dir``); small swap buffers."""
    buffer = max(largest_param, 1 << 16)
    if args.offload_device == "cpu":
        return {"train_batch_size": args.batch, "zero_force_ds_cpu_optimizer": False,
                "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                      "offload_param": {"device": "cpu", "pin_memory": False},
                                      "offload_optimizer": {"device": "cpu",
                                                            "pin_memory": False}}}
    return {
        "train_batch_size": args.batch,
        "zero_force_ds_cpu_optimizer": False,  # torch's AdamW on the host: no cpu_adam build
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_max_live_parameters": 4 * buffer,
            "stage3_prefetch_bucket_size": buffer,
            "offload_param": {"device": "nvme", "nvme_path": zero_dir, "pin_memory": False,
                              "buffer_count": 16, "buffer_size": buffer, "max_in_cpu": 0},
            "offload_optimizer": {"device": "nvme", "nvme_path": zero_dir,
                                  "pin_memory": False, "buffer_count": 4},
        },
        "aio": {"block_size": 1 << 18, "queue_depth": 8, "intra_op_parallelism": 1,
                "single_submit": False, "overlap_events": True},
    }


def _dir_bytes(path):
    """Allocated bytes of the files under ``path``, by subdirectory (two levels:
    DeepSpeed's ``zero_stage_3/float32params`` and ``zero_stage_3/optimizer``)."""
    out = {}
    for root, _, files in os.walk(path):
        rel = os.path.relpath(root, path)
        key = "/".join(rel.split(os.sep)[:2]) if rel != "." else "."
        for name in files:
            st = os.lstat(os.path.join(root, name))
            out[key] = out.get(key, 0) + st.st_blocks * 512
    return out


def _swap_buffer_bytes(engine):
    """Host bytes of DeepSpeed's NVMe swap buffers, as far as its objects say."""
    out = {}
    # ZeRO-3 gives every partitioned parameter its swapper (``param.nvme_swapper``).
    param = next(iter(engine.module.parameters()), None)
    swapper = getattr(param, "nvme_swapper", None)
    if getattr(swapper, "buffers", None) is not None:
        b = swapper.buffers
        out["parameter swap buffers"] = b.numel() * b.element_size()
    pool = getattr(getattr(engine.optimizer, "optimizer_swapper", None), "swap_buffer_manager",
                   None)
    if getattr(pool, "all_buffers", None) is not None:
        out["optimizer swap buffers"] = sum(t.numel() * t.element_size() for t in pool.all_buffers)
    return out


def _reset_peak_rss():
    """Reset ``VmHWM`` to the current RSS (where the kernel allows it), so each run's
    peak is its own."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peak_rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def run(args, spill, with_ssdtrain, data):
    """One ZeRO-Infinity training run; per step (loss, full grads), final params, layout."""
    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    from ssdtrain.integrations import deepspeed as ssd_deepspeed

    label = "ssdtrain" if with_ssdtrain else "reference"
    zero_dir = os.path.join(spill, label, "zero")
    act_dir = os.path.join(spill, label, "activations")
    os.makedirs(zero_dir)
    os.makedirs(act_dir)
    _reset_peak_rss()
    largest = max(args.vocab * args.d_model, 4 * args.d_model * args.d_model)
    config = ds_config(args, zero_dir, largest)
    # Built inside zero.Init, as ZeRO-Infinity is meant to be used: each parameter is
    # partitioned and swapped out as soon as its module is built, so the full model never
    # sits in memory. No dtype argument: with the config (no fp16/bf16 section) zero.Init
    # keeps float32. (DeepSpeed 0.19.8 on the CPU accelerator turns any dtype passed, and
    # the engine's own conversion of a model built outside zero.Init, into bfloat16
    # partitions whose parameter swaps then never happen: a 1 MiB float32 weight is
    # 512 KiB in bfloat16, under MIN_AIO_BYTES.)
    with deepspeed.zero.Init(remote_device=args.offload_device, config_dict_or_path=config,
                             pin_memory=False):
        model = _model(args)
    if with_ssdtrain:
        # policy "static": every step offloads (the default, "auto", only what the disk
        # absorbs in time or memory needs)
        config["ssdtrain"] = {"spill_dir": act_dir, "policy": "static", "keep_tail_bytes": 0,
                              "min_tensor_bytes": 4096}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, _, _, _ = ssd_deepspeed.initialize(model=model, optimizer=opt,
                                               config=copy.deepcopy(config))
    history, times, spill_peak = [], [], 0
    for idx, targets in data:
        t0 = time.perf_counter()
        loss = engine(idx, targets)
        if engine.ssdtrain is not None:
            spill_peak = max(spill_peak, engine.ssdtrain.spill_bytes_in_use())
        engine.backward(loss)
        grads = [safe_get_full_grad(p).clone() for p in engine.module.parameters()]
        engine.step()
        times.append(time.perf_counter() - t0)
        history.append((loss.detach().clone(), grads))
    params = [safe_get_full_fp32_param(p).clone() for p in engine.module.parameters()]
    n_params = sum(p.ds_numel for p in engine.module.parameters())
    # Partitions under DeepSpeed's MIN_AIO_BYTES (1 MiB) are not swapped: they stay on the host.
    small = [p for p in engine.module.parameters() if p.ds_numel * 4 < MiB]
    acc = get_accelerator()
    layout = {
        "accelerator": acc.device_name(),
        "device_allocated_bytes": acc.memory_allocated() if acc.device_name() != "cpu" else 0,
        "host_peak_rss_bytes": _peak_rss(),
        "host_swap_buffers": _swap_buffer_bytes(engine),
        "nvme_zero_files": _dir_bytes(zero_dir),
        "parameters": n_params,
        "fp32_parameter_bytes": n_params * 4,
        "host_small_parameter_bytes": sum(p.ds_numel * 4 for p in small),
        "host_small_parameters": len(small),
        "adam_state_bytes": n_params * 8,
        "step_s": times,
    }
    if engine.ssdtrain is not None:
        engine.ssdtrain.wait()
        st = engine.ssdtrain.stats()
        layout["activations"] = {"offloaded_bytes_per_step": st.offloaded_bytes / len(data),
                                 "read_bytes_per_step": st.bytes_read / len(data),
                                 "spill_bytes_in_use_peak": spill_peak,
                                 "prefetch_hits": st.prefetch_hits,
                                 "prefetch_misses": st.prefetch_misses,
                                 "spill_dir": engine.ssdtrain.config.spill_dir,
                                 "engine": st.engine}
    engine.destroy()
    return history, params, layout


def _compare(ref, got):
    (ref_hist, ref_params, _), (hist, params, _) = ref, got
    for step, ((a_loss, a_grads), (b_loss, b_grads)) in enumerate(zip(ref_hist, hist)):
        if not torch_equal(a_loss, b_loss):
            return f"step {step}: loss {b_loss.item()!r} != {a_loss.item()!r}"
        for i, (a, b) in enumerate(zip(a_grads, b_grads)):
            if not torch_equal(a, b):
                return f"step {step}: gradient of parameter {i} differs"
    for i, (a, b) in enumerate(zip(ref_params, params)):
        if not torch_equal(a, b):
            return f"final fp32 parameter {i} differs"
    return None


def torch_equal(a, b):
    import torch
    return torch.equal(a, b)


def _fmt(n):
    return f"{n / MiB:9.2f} MiB"


def report(ref_layout, layout, exact_problem, args):
    where = "NVMe" if args.offload_device == "nvme" else "host"
    lines = [f"ZeRO-3, offload_param + offload_optimizer on {args.offload_device} + ssdtrain "
             f"activations on the spill device", ""]
    lines.append(f"model: {layout['parameters']:,} parameters ({args.layers} blocks, d_model "
                 f"{args.d_model}, vocab {args.vocab}); batch {args.batch} x seq {args.seq}")
    lines.append(f"accelerator: {layout['accelerator']}  (on 'cpu' the device is host memory)")
    lines.append("")
    lines.append("where the training state lives (with ssdtrain):")
    lines.append(f"  device   allocated{'':25s}{_fmt(layout['device_allocated_bytes'])}")
    lines.append(f"  host     peak RSS of the process{'':11s}{_fmt(layout['host_peak_rss_bytes'])}")
    lines.append(f"  host     {layout['host_small_parameters']} parameters under 1 MiB "
                 f"(not swapped) {_fmt(layout['host_small_parameter_bytes'])}")
    for k, v in layout["host_swap_buffers"].items():
        lines.append(f"  host     {k:<33s} {_fmt(v)}")
    for k, v in sorted(layout["nvme_zero_files"].items()):
        what = {"zero_stage_3/optimizer": " (fp32 master, Adam moments, gradients)"}.get(k, "")
        lines.append(f"  NVMe     DeepSpeed swap files {k}{what}: {_fmt(v).strip()}")
    params, moments = (_fmt(layout[k]).strip() for k in ("fp32_parameter_bytes",
                                                          "adam_state_bytes"))
    lines.append(f"  {where:<8s} ZeRO's share: fp32 parameters {params}, Adam moments {moments}")
    act = layout.get("activations", {})
    lines.append(f"  NVMe     ssdtrain activations, per step    "
                 f"{_fmt(act.get('offloaded_bytes_per_step', 0))} written, "
                 f"{_fmt(act.get('read_bytes_per_step', 0)).strip()} read back; "
                 f"peak in use {_fmt(act.get('spill_bytes_in_use_peak', 0)).strip()}")
    lines.append(f"  prefetch: {act.get('prefetch_hits', 0)} hits, {act.get('prefetch_misses', 0)} "
                 f"misses; engine {act.get('engine')}")
    lines.append("")
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    lines.append(f"step time (median of {len(layout['step_s'])}, first included): "
                 f"reference {med(ref_layout['step_s']) * 1e3:.1f} ms, with ssdtrain "
                 f"{med(layout['step_s']) * 1e3:.1f} ms")
    lines.append(f"host peak RSS without the ssdtrain section: "
                 f"{_fmt(ref_layout['host_peak_rss_bytes']).strip()} (same process, run first; "
                 f"VmHWM is reset before each run, but the second run's peak also holds what "
                 f"the first left allocated, so the two peaks do not compare)")
    lines.append("bitwise equal to ZeRO-Infinity without the ssdtrain section: "
                 + ("yes" if exact_problem is None else f"NO ({exact_problem})"))
    return "\n".join(lines)


def main(argv=None):
    args = build_parser().parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    built, detail = async_io_status()
    if not built and not args.build and args.offload_device == "nvme":
        print(f"zero_infinity_nvme: {detail}", file=sys.stderr)
        return 2
    import warnings
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch.distributed renames
    import deepspeed.ops
    import torch
    import torch.distributed as dist

    # DeepSpeed's communication backend JIT-builds deepspeed_shm_comm on the CPU
    # accelerator (for inference all-reduces only); skip it.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=0, world_size=1)
    gen = torch.Generator().manual_seed(4321)
    data = [(torch.randint(args.vocab, (args.batch, args.seq), generator=gen),
             torch.randint(args.vocab, (args.batch, args.seq), generator=gen))
            for _ in range(args.steps)]
    base = args.spill_dir or tempfile.gettempdir()
    with tempfile.TemporaryDirectory(prefix="zero_infinity_", dir=base) as spill:
        ref = run(args, spill, False, data)
        got = run(args, spill, True, data)
        problem = _compare(ref, got)
    text = report(ref[2], got[2], problem, args)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"reference": ref[2], "ssdtrain": got[2], "exact": problem is None,
                       "problem": problem, "async_io": detail}, f, indent=1, default=str)
    dist.destroy_process_group()
    return 0 if problem is None else 1


if __name__ == "__main__":
    sys.exit(main())
