#!/usr/bin/env python
"""An accelerator emulator: ssdtrain where activations come faster than the disk takes them.

On a GPU a training step takes milliseconds and the disk is the bottleneck; on this
CPU a real step takes seconds and the disk keeps up. This benchmark reproduces the
GPU regime on a CPU host: a GPT-shaped model whose layers save
exactly the tensors a real transformer block saves, with real bytes that backward
checks, while their compute is emulated.

The model (NOTE [ Emulated block ]): the op sequence of ``examples/gpt.py``'s
``Block`` (pre-LayerNorm, fused QKV, causal attention, GELU MLP), each op a custom
``torch.autograd.Function`` that saves what the real op saves (its input, the three
interleaved QKV views, the attention output, LayerNorm's mean/rstd, attention's
log-sum-exp; 16 x ``batch*seq*d_model`` bytes of large tensors per block, as
autograd saves for the real block), then an embedding, a final LayerNorm, an LM head
and a cross-entropy whose saves match the real ones too.

Compute (NOTE [ Emulated compute ]): each op has a FLOP count (matmuls 2mnk,
causal attention 2*b*t^2*d, elementwise ops 20 FLOP/element) and takes
``flops / tflops`` seconds, 2x in backward; ``--launch-us`` (or
``--launch-fraction`` of the op's compute) of it is a GIL-held Python spin (the
kernel launch; measured in the thread's own CPU time, so a launch whose thread is
kept off the GIL takes longer, as on a GPU host), the rest is spent with the GIL
released (filling the op's output, checking saved tensors in backward, then
``time.sleep`` to the op's deadline). The launch overlaps the op's compute, as a
GPU host launches ahead of the device: an op takes ``max(compute, launch)``.
Recompute (checkpointing) re-runs the emulated forward, at the same cost.

Bytes (NOTE [ Emulated bytes ]): every activation comes from the emulator's own
caching allocator (pre-faulted buffers reused across steps, as a GPU's caching
allocator reuses device memory; no page faults in the step), and its content is a
deterministic function of (step, layer, op): ``--check sparse`` (default) writes
one 8-byte marker (unique per tensor and position) every 4 KiB and at the end,
``--check full`` fills every byte from a random pool. Backward checks every saved
tensor's whole storage against that (markers, or every byte): ``exact`` is whether
every check of every step passed. Full checks cost a memory pass per byte, which
this VM's memory does at about the disk's speed, so they limit the reachable R;
sparse checks catch a wrong record, a shifted or misplaced page and a truncated
tail, while ssdtrain's own CRC32C (on by default) covers every byte.

Peak memory (NOTE [ Tracked peak ]): the emulator's allocator counts live
activation bytes exactly (a buffer is live until the last tensor over it dies,
wherever that happens: training thread, ssdtrain's I/O thread, checkpoint); the
peak is the maximum at every allocation, and at every layer boundary of backward
(and the end of forward) plus the bytes ssdtrain holds read back from disk there
(records loading or loaded whose original storage is no longer alive). RSS is not
used (the caching allocator keeps its buffers). Those samples take a snapshot of
ssdtrain's records (``Offloader.records()``, about a millisecond a layer here): their
time is the harness's and is taken off the step (``sample_s`` in the JSON).

R (NOTE [ The ratio R ]): offload bytes per step (every saved storage at or above
``min_tensor_bytes``, counted from the model's shape; the offload-all runs' Stats
confirm it) over the disk's write bandwidth, measured at the start through
ssdtrain itself (a probe worker saves one step's records with ``keep_tail_bytes=0``
and waits for the writes, best of two), over the step's emulated compute time.
For each target R the harness solves ``--tflops``: ``tflops = 3 * forward FLOPs *
R * bandwidth / offload bytes``.

Modes: ``none``; ``checkpoint`` (``torch.utils.checkpoint`` per layer, no
ssdtrain); ``offload_all`` (static, ``keep_tail_bytes=0``); ``default``
(``OffloadConfig(spill_dir=...)`` only); ``auto`` (``policy="auto"`` and nothing else;
not run unless named); ``budget`` (``policy="adaptive"``,
``memory_budget_bytes`` = ``--budget-fraction`` of none's tracked peak, layers via
``track``); and static mixes through ``set_plan`` with ``keep_tail_bytes=0``:
``ok<k>`` offload the first k layers and keep the rest, ``rk<k>`` recompute the
first k and keep the rest, ``ro<k>`` recompute the first k and offload the rest;
``plan-<letters>`` any plan, one of k / o / r per layer (``plan_vs_emulator.py``
runs ``ssdtrain estimate --plan``'s plans so).

Every (R, mode, repeat) is a fresh process, modes interleaved (rotated each
repeat); ``none`` runs first once to set the budget. Each worker runs
``--warmup`` steps (2; ``--warmup-adaptive`` 4 for ``default``, ``auto`` and ``budget``:
the budget mode profiles 2 steps, runs one recompute-all step, and plans, probing the
disk, at the start of the 4th) then ``--steps`` measured ones.
Output: a markdown table, the accelerator-regime targets (reported, never asserted), a
JSON file with every number, and a PNG of step time and memory against R. The budget
run also records its plan's costs and the cost model's prediction, forward to the end
of backward (``Prediction.backward_end_s``), of its own plan and of every static
mode's (``plan_detail``; the table's ``predicted`` column).

Example::

    PYTHONPATH=. .venv/bin/python benchmarks/accel_emulator.py             # ~8 min here
    PYTHONPATH=. .venv/bin/python benchmarks/accel_emulator.py --tiny      # seconds
    PYTHONPATH=. .venv/bin/python benchmarks/accel_emulator.py --launch-fraction 0.5
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import math
import mmap
import os
import platform
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for _common, however run
from _common import (  # noqa: E402
    MiB, add_worker_arguments, command_line, finish, md_header, median, mount_of, progress,
    run_worker, work_dir, worker_env)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_JSON = os.path.join(REPO_ROOT, "benchmarks", "results", "accel_emulator.json")
BASE_MODES = ("none", "checkpoint", "offload_all", "default", "budget")
# not in the default set: policy="auto" by name (what "default" runs too, now it is the default)
EXTRA_MODES = ("auto",)
POLICY_MODES = ("default", "auto", "budget")  # modes whose policy decides: more warm-up
DEFAULT_SHAPE = dict(n_layers=8, batch=8, seq=512, d_model=256, n_heads=4, mlp_ratio=4,
                     vocab=1024)
TINY_SHAPE = dict(n_layers=4, batch=2, seq=128, d_model=128, n_heads=4, mlp_ratio=4,
                  vocab=512)
MARKER_STRIDE = 4096          # bytes between the markers of --check sparse
ELEMENTWISE_FLOPS = 20        # per element, for LayerNorm, GELU, adds, softmax


# ===================================================================== model spec
# NOTE [ Emulated block ]
# One entry per op, in forward order: (name, output shape, FLOPs, what it saves). The
# saves mirror examples/gpt.py's autograd graph (listed by tests/test_accel_emulator.py
# against a real Block): "in" = the op's input as is, "in2d" = its input viewed 2-D
# (a linear layer's input), "qkv" = the three (b, h, t, hd) views of the fused QKV
# output (one storage), "out_bhtd" = the op's own output viewed (b, h, t, hd), and
# "small:<shape>" = a fresh small tensor (LayerNorm mean/rstd, attention's log-sum-exp).
def block_ops(s):
    b, t, d, h, m = s["batch"], s["seq"], s["d_model"], s["n_heads"], s["mlp_ratio"]
    bt, ew = b * t, ELEMENTWISE_FLOPS
    return [
        ("ln1", (b, t, d), ew * bt * d, ["in", f"small:{b},{t},1", f"small:{b},{t},1"]),
        ("qkv", (b, t, 3 * d), 2 * bt * d * 3 * d, ["in2d"]),
        ("attn", (b, t, d), 2 * b * t * t * d, ["qkv", f"small:{b},{h},{t}", "out_bhtd"]),
        ("proj", (b, t, d), 2 * bt * d * d, ["in2d"]),
        ("add1", (b, t, d), ew * bt * d, []),
        ("ln2", (b, t, d), ew * bt * d, ["in", f"small:{b},{t},1", f"small:{b},{t},1"]),
        ("fc1", (b, t, m * d), 2 * bt * d * m * d, ["in2d"]),
        ("gelu", (b, t, m * d), ew * bt * m * d, ["in"]),
        ("fc2", (b, t, d), 2 * bt * m * d * d, ["in2d"]),
        ("add2", (b, t, d), ew * bt * d, []),
    ]


def outside_ops(s):
    """(before the layers, after the layers): embedding; final LayerNorm, head, loss."""
    b, t, d, v = s["batch"], s["seq"], s["d_model"], s["vocab"]
    bt, ew = b * t, ELEMENTWISE_FLOPS
    pre = [("emb", (b, t, d), ew * bt * d, [f"small:{b},{t}"])]
    post = [("ln_f", (b, t, d), ew * bt * d, ["in", f"small:{b},{t},1", f"small:{b},{t},1"]),
            ("head", (b, t, v), 2 * bt * d * v, ["in2d"]),
            ("xent", (), ew * bt * v, ["logp", f"small:{bt}"])]
    return pre, post


def spec_summary(s, min_tensor_bytes):
    """Forward FLOPs, and bytes a step saves: unique, and at or above ``min_tensor_bytes``
    (what offloading everything writes)."""
    pre, post = outside_ops(s)
    ops = pre + block_ops(s) * s["n_layers"] + post
    sizes = []
    for i, (_, shape, _, saves) in enumerate(ops):
        # an op's output is one saved storage when the next op saves its input, or when
        # the op saves its own output (attention)
        nxt = ops[i + 1][3] if i + 1 < len(ops) else []
        if shape and ({"in", "in2d", "qkv"} & set(nxt) or "out_bhtd" in saves):
            sizes.append(4 * math.prod(shape))
        for what in saves:
            if what == "logp":
                sizes.append(4 * s["batch"] * s["seq"] * s["vocab"])
            elif what.startswith("small:"):
                sizes.append(4 * math.prod(int(x) for x in what[6:].split(",")))
    return {"forward_flops": sum(op[2] for op in ops), "unique_saved_bytes": sum(sizes),
            "offload_bytes": sum(n for n in sizes if n >= min_tensor_bytes),
            "records": len([n for n in sizes if n >= min_tensor_bytes])}


# ================================================================ worker machinery
class Emu:
    """The worker's emulation state (one per process)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.step = 0
        self.off = None
        self.lock = threading.Lock()
        self.free = {}          # nbytes -> [address]
        self.types = {}         # nbytes -> ctypes array type whose __del__ frees
        self.maps = []          # the mmaps backing the pool (kept for the process)
        self.live = 0           # live activation bytes (exact)
        self.live_keys = {}     # storage _cdata -> nbytes of live buffers
        self.addr_key = {}
        self.peak = 0
        self.sampled_peak = 0
        self.checks = 0
        self.failures = []
        self.delay = 0.0        # op time beyond its emulated duration
        self.spin_lost = 0.0    # launch spins' wall time beyond their CPU time
        self.overrun = 0.0      # fill / check time beyond the op's GIL-free compute
        self.sample_s = 0.0     # time in sample() this step (taken off the step's time)
        self.pool = None        # random bytes for --check full
        self.index = {}         # marker count -> arange

    # ---------------------------------------------------------------- allocator
    def alloc(self, nbytes):
        """A uint8 tensor over a pooled, pre-faulted buffer; counted live until freed."""
        with self.lock:
            free = self.free.setdefault(nbytes, [])
            if free:
                addr = free.pop()
            else:
                size = (nbytes + 4095) // 4096 * 4096
                m = mmap.mmap(-1, size)
                m.write(b"\0" * size)            # fault every page in now, not in a step
                self.maps.append(m)
                addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
            kind = self.types.get(nbytes)
            if kind is None:
                emu = self

                def _del(obj, _n=nbytes):
                    emu._release(ctypes.addressof(obj), _n)
                kind = self.types[nbytes] = type(f"Buf{nbytes}", (ctypes.c_char * nbytes,),
                                                 {"__del__": _del})
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        t = _torch().frombuffer(kind.from_address(addr), dtype=_torch().uint8)
        key = t.untyped_storage()._cdata
        with self.lock:
            self.live_keys[key] = nbytes
            self.addr_key[addr] = key
        return t

    def _release(self, addr, nbytes):
        with self.lock:
            self.live -= nbytes
            self.live_keys.pop(self.addr_key.pop(addr, None), None)
            self.free.setdefault(nbytes, []).append(addr)

    def sample(self):
        """Live activations plus what ssdtrain holds read back (NOTE [ Tracked peak ]).
        Its time (``Offloader.records()`` takes a snapshot of every record) is the
        harness's, not the mode's: it is taken off the step (``sample_s``)."""
        t0 = time.perf_counter()
        try:
            self._sample()
        finally:
            self.sample_s += time.perf_counter() - t0

    def _sample(self):
        readback = 0
        if self.off is not None:
            with self.lock:
                keys = dict(self.live_keys)
            for r in self.off.records():
                if r.state in ("LOADING", "LOADED") and r.key not in keys:
                    readback += r.nbytes
        with self.lock:
            total = self.live + readback
        self.sampled_peak = max(self.sampled_peak, total)

    # ------------------------------------------------------------------ content
    def uid(self, layer, op, sub=0):
        """A tensor's identity within the run: (step, layer, op, which of its tensors)."""
        return ((self.step & 0x7FFF) << 24) | ((layer + 1) << 16) | (sub << 8) | op

    def _pool_slice(self, n, uid):
        off = (uid * 2654435761) % (self.pool.numel() - n + 1) // 8 * 8
        return self.pool[off:off + n]

    def fill(self, buf, uid):
        """Write ``buf``'s deterministic content for ``uid`` (NOTE [ Emulated bytes ])."""
        if self.cfg["check"] == "full":
            buf.copy_(self._pool_slice(buf.numel(), uid))
        else:
            marks = self._marks(buf)
            _torch().add(self._index(marks.numel()), uid << 24, out=marks)

    def _index(self, k):
        """0, 1, ..., k-1 as int64 (cached per k)."""
        idx = self.index.get(k)
        if idx is None:
            idx = self.index[k] = _torch().arange(k, dtype=_torch().int64)
        return idx

    @staticmethod
    def _marks(buf):
        """The marker words of ``buf``: one every MARKER_STRIDE bytes, aligned so that the
        last word of the buffer is one (a truncated tail is caught); one strided view."""
        words = buf.view(_torch().int64)
        n, step = words.numel(), MARKER_STRIDE // 8
        first = (n - 1) % step
        return words.as_strided(((n - 1) // step + 1,), (step,), words.storage_offset() + first)

    def check(self, saved, info, where):
        """Whether ``saved``'s whole storage base has the content its producer wrote."""
        torch = _torch()
        uid, nbytes, elem_offset = info
        start = (saved.storage_offset() - elem_offset) * saved.element_size()
        base = torch.empty(0, dtype=torch.uint8).set_(saved.untyped_storage(), start, (nbytes,))
        if self.cfg["check"] == "full":
            ok = torch.equal(base, self._pool_slice(nbytes, uid))
        else:
            marks = self._marks(base)
            ok = torch.equal(marks, self._index(marks.numel()) + (uid << 24))
        self.checks += 1
        if not ok and len(self.failures) < 20:
            self.failures.append(f"step {self.step} {where}: saved tensor uid {uid:#x} "
                                 f"({nbytes} B) differs from what was saved")


EMU = None
_TORCH = None


def _torch():
    global _TORCH
    if _TORCH is None:
        import torch
        _TORCH = torch
    return _TORCH


def spin(seconds):
    """Hold the GIL for ``seconds`` of this thread's CPU time (the emulated launch)."""
    if seconds <= 0:
        return
    w0 = time.perf_counter()
    c0 = time.thread_time()
    end = c0 + seconds
    while time.thread_time() < end:
        pass
    EMU.spin_lost += max(0.0, (time.perf_counter() - w0) - seconds)


def run_op(compute_s, launch_s, work):
    """One emulated op: launch (GIL held), ``work`` (GIL released in torch), sleep to the
    deadline. Returns ``work``'s result."""
    t0 = time.perf_counter()
    spin(launch_s)
    w0 = time.perf_counter()
    result = work()
    worked = time.perf_counter() - w0
    EMU.overrun += max(0.0, worked - max(0.0, compute_s - launch_s))
    deadline = t0 + max(compute_s, launch_s)
    left = deadline - time.perf_counter()
    if left > 0:
        time.sleep(left)
    EMU.delay += max(0.0, time.perf_counter() - deadline)
    return result


def make_function():
    torch = _torch()

    class EmuOp(torch.autograd.Function):
        """One emulated op (NOTE [ Emulated block ])."""

        @staticmethod
        def forward(ctx, x, in_info, layer, index, op, timing):
            name, shape, _, saves = op
            compute_s, launch_s, _ = timing
            shp = s_shape(shape)
            nbytes = padded(4 * math.prod(shp))
            uid = EMU.uid(layer, index)

            def work():
                buf = EMU.alloc(nbytes)
                EMU.fill(buf, uid)
                return buf
            buf = run_op(compute_s, launch_s, work)
            out = buf[:4 * math.prod(shp)].view(torch.float32).view(shp)
            tensors, infos = [], []
            for what in saves:
                if what == "in":
                    tensors.append(x); infos.append(in_info)
                elif what == "in2d":
                    tensors.append(x.view(-1, x.shape[-1])); infos.append(in_info)
                elif what == "qkv":
                    b, t, d3 = x.shape
                    h = EMU.cfg["shape"]["n_heads"]
                    q, k, v = x.view(b, t, 3, h, d3 // 3 // h).unbind(2)
                    for view in (q, k, v):
                        tensors.append(view.transpose(1, 2)); infos.append(in_info)
                elif what == "out_bhtd":
                    b, t, d = shp
                    h = EMU.cfg["shape"]["n_heads"]
                    tensors.append(out.view(b, t, h, d // h).transpose(1, 2))
                    infos.append((uid, nbytes, 0))
                elif what == "logp":
                    n = 4 * math.prod(x.shape)
                    luid = EMU.uid(layer, index, 0x80)
                    lb = EMU.alloc(n)
                    EMU.fill(lb, luid)
                    tensors.append(lb.view(torch.float32).view(x.shape))
                    infos.append((luid, n, 0))
                elif what.startswith("small:"):
                    sshape = tuple(int(v) for v in what[6:].split(","))
                    n = padded(4 * math.prod(sshape))
                    suid = EMU.uid(layer, index, len(tensors) + 1)
                    sb = EMU.alloc(n)
                    EMU.fill(sb, suid)
                    tensors.append(sb[:4 * math.prod(sshape)].view(torch.float32).view(sshape))
                    infos.append((suid, n, 0))
            for tns, info in zip(tensors, infos):
                if info is None:
                    raise RuntimeError(f"emulator: op {name} saves an input with no origin")
            ctx.save_for_backward(*tensors)
            ctx.infos = [(u, n, tns.storage_offset()) for (u, n, _), tns in zip(infos, tensors)]
            ctx.where = f"layer {layer} op {name}"
            ctx.in_shape = x.shape
            ctx.timing = timing
            ctx.layer_end = index == 9 and layer >= 0
            if not shape:           # the loss: a scalar
                return out.reshape(())
            return out

        @staticmethod
        def backward(ctx, grad):
            if ctx.layer_end:
                EMU.sample()
            compute_s, _, launch_s = ctx.timing

            def work():
                for tns, info in zip(ctx.saved_tensors, ctx.infos):
                    EMU.check(tns, info, ctx.where)
            run_op(2 * compute_s, launch_s, work)
            g = torch.zeros((), dtype=torch.float32).expand(ctx.in_shape)
            return g, None, None, None, None, None

    return EmuOp


def padded(nbytes):
    """Buffers are whole int64 words (the markers are int64)."""
    return (nbytes + 7) // 8 * 8


def s_shape(shape):
    return tuple(shape) if shape else (1,)


def build_model(cfg):
    torch = _torch()
    EmuOp = make_function()
    s = cfg["shape"]
    tflops = cfg["tflops"]
    lf, lus = cfg["launch_fraction"], cfg["launch_us"] * 1e-6

    def timing(op):
        c = op[2] / (tflops * 1e12)
        return (c, lf * c, lf * 2 * c) if lf is not None else (c, lus, lus)

    def info(layer, index, op):
        """What the op that produced an input wrote: (uid, bytes, element offset)."""
        return (EMU.uid(layer, index), padded(4 * math.prod(s_shape(op[1]))), 0)

    ops = block_ops(s)
    pre, post = outside_ops(s)

    class Block(torch.nn.Module):
        def __init__(self, i):
            super().__init__()
            self.i = i
            self.ops = [(op, timing(op)) for op in ops]

        def forward(self, x):
            # inputs are known by structure, not by attribute: checkpoint's recompute
            # gets its input back from ssdtrain as a new tensor object
            prev = info(self.i - 1, 9, ops[-1]) if self.i else info(-1, 20, pre[-1])
            for j, (op, tm) in enumerate(self.ops):
                x = EmuOp.apply(x, prev, self.i, j, op, tm)
                prev = info(self.i, j, op)
            return x

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.src = torch.nn.Parameter(torch.zeros(1))
            self.layers = torch.nn.ModuleList(Block(i) for i in range(s["n_layers"]))
            self.pre = [(op, timing(op)) for op in pre]
            self.post = [(op, timing(op)) for op in post]
            self.checkpoint = False

        def forward(self):
            x, prev = self.src, None
            for j, (op, tm) in enumerate(self.pre):
                x = EmuOp.apply(x, prev, -1, 20 + j, op, tm)
                prev = info(-1, 20 + j, op)
            for layer in self.layers:
                if self.checkpoint:
                    x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
                else:
                    x = layer(x)
            prev = info(len(self.layers) - 1, 9, ops[-1])
            for j, (op, tm) in enumerate(self.post):
                x = EmuOp.apply(x, prev, -1, 30 + j, op, tm)
                prev = info(-1, 30 + j, op)
            return x

    return Model()


PLAN_LETTERS = {"k": "keep", "o": "offload", "r": "recompute"}


def is_plan_mode(mode, n):
    """Whether ``mode`` is ``plan-<letters>``: one of k / o / r per layer, first layer
    first (a plan of ``ssdtrain estimate --plan``, run through ``set_plan``)."""
    letters = mode[5:].lower() if mode.startswith("plan-") else ""
    return len(letters) == n and all(c in PLAN_LETTERS for c in letters)


def plan_for(mode, n):
    """The set_plan choices of a static mix ``ok<k>``, ``rk<k>``, ``ro<k>``, or of a
    ``plan-<letters>`` mode (:func:`is_plan_mode`)."""
    if mode.startswith("plan-"):
        return [PLAN_LETTERS[c] for c in mode[5:].lower()]
    family, k = mode[:2], int(mode[2:])
    first = {"ok": "offload", "rk": "recompute", "ro": "recompute"}[family]
    rest = {"ok": "keep", "rk": "keep", "ro": "offload"}[family]
    return [first] * k + [rest] * (n - k)


def worker_main(kind, cfg, out_path):
    global EMU
    os.environ.setdefault("OMP_NUM_THREADS", str(cfg["threads"]))
    torch = _torch()
    torch.set_num_threads(cfg["threads"])
    try:        # accurate short sleeps: 1 ns timer slack on this thread (PR_SET_TIMERSLACK)
        ctypes.CDLL(None).prctl(29, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if kind == "probe":
        result = probe(cfg)
    else:
        points = []
        for point in cfg["points"]:
            EMU = Emu(dict(cfg, **point))
            points.append(run_mode(dict(cfg, **point)))
            EMU = None
            gc.collect()
        result = {"mode": cfg["mode"], "points": points}
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 0


def probe(cfg):
    """Write bandwidth of the spill directory through ssdtrain, with one step's records."""
    import ssdtrain
    torch = _torch()
    s = cfg["shape"]
    a = 4 * s["batch"] * s["seq"] * s["d_model"]
    sizes = [a, a, 3 * a, a, a, a, 4 * a, 4 * a] * s["n_layers"]
    tensors = [torch.full((n,), i % 251, dtype=torch.uint8) for i, n in enumerate(sizes)]
    total = sum(sizes)
    out = {"bytes": total, "write_gbps": [], "read_gbps": []}
    off = ssdtrain.Offloader(ssdtrain.OffloadConfig(spill_dir=cfg["spill_dir"], policy="static",
                                                    keep_tail_bytes=0, prefetch_bytes=0))
    try:
        for _ in range(2):
            t0 = time.perf_counter()
            off.begin_forward()
            handles = [off.save(t) for t in tensors]
            off.end_forward()
            off.wait()
            out["write_gbps"].append(total / (time.perf_counter() - t0) / 1e9)
            t0 = time.perf_counter()
            for h in reversed(handles):
                off.restore(h)
            out["read_gbps"].append(total / (time.perf_counter() - t0) / 1e9)
            del handles
        out["engine"] = off.stats().engine
    finally:
        off.close()
    out["write"] = max(out["write_gbps"])
    out["read"] = max(out["read_gbps"])
    return out


def run_mode(cfg):
    import ssdtrain
    torch = _torch()
    mode = cfg["mode"]
    s = cfg["shape"]
    if cfg["check"] == "full":
        g = torch.Generator().manual_seed(0)
        EMU.pool = torch.randint(0, 256, (16 * 4 * s["batch"] * s["seq"] * max(
            s["d_model"] * s["mlp_ratio"], s["vocab"]) // 8 + (1 << 20),), dtype=torch.uint8,
            generator=g)
    model = build_model(cfg)
    off = None
    base = dict(spill_dir=cfg["spill_dir"])
    if mode == "checkpoint":
        model.checkpoint = True
    elif mode == "offload_all":
        off = ssdtrain.Offloader(ssdtrain.OffloadConfig(policy="static", keep_tail_bytes=0,
                                                        **base))
    elif mode in ("default", "auto"):
        if cfg.get("max_slowdown") is not None:  # --max-slowdown: the default's margin
            base["max_slowdown"] = cfg["max_slowdown"]
        if mode == "auto":
            base["policy"] = "auto"
        off = ssdtrain.Offloader(ssdtrain.OffloadConfig(**base))
    elif mode == "budget":
        off = ssdtrain.Offloader(ssdtrain.OffloadConfig(
            policy="adaptive", memory_budget_bytes=int(cfg["budget_bytes"]), **base))
        off.track(model, list(model.layers))
    elif mode != "none":
        off = ssdtrain.Offloader(ssdtrain.OffloadConfig(policy="static", keep_tail_bytes=0,
                                                        **base))
        off.track(model, list(model.layers))
        off.set_plan(plan_for(mode, s["n_layers"]))
    EMU.off = off
    steps = []
    fields = ("stall_seconds", "write_stall_seconds", "offloaded_bytes", "bytes_read",
              "kept_bytes", "prefetch_misses")
    snaps = []
    try:
        for step in range(cfg["warmup"] + cfg["steps"]):
            EMU.step = step
            gc.collect()
            before = off.stats() if off is not None else None
            with EMU.lock:
                EMU.peak = EMU.live
            EMU.sampled_peak = 0
            EMU.delay = EMU.spin_lost = EMU.overrun = EMU.sample_s = 0.0
            checks0, fails0 = EMU.checks, len(EMU.failures)
            t0 = time.perf_counter()
            with (off if off is not None else contextlib.nullcontext()):
                loss = model()
                if off is not None and cfg.get("settle"):
                    # (tests) every write lands before backward, so every offloaded
                    # record is read back from the disk, however late the I/O thread
                    off.wait()
            EMU.sample()
            loss.backward()
            dt = time.perf_counter() - t0 - EMU.sample_s
            del loss
            rec = {"warmup": step < cfg["warmup"], "step_s": dt, "sample_s": EMU.sample_s,
                   "peak_bytes": max(EMU.peak, EMU.sampled_peak), "alloc_peak_bytes": EMU.peak,
                   "delay_s": EMU.delay, "spin_lost_s": EMU.spin_lost,
                   "overrun_s": EMU.overrun, "checks": EMU.checks - checks0,
                   "check_failures": len(EMU.failures) - fails0}
            if off is not None:
                plan = off.active_plan
                rec["plan"] = None if plan is None else "".join(c[0] for c in plan.choices)
                quota = off.stats().offload_quota_bytes  # policy "auto": the step's quota
                rec["offload_quota_bytes"] = quota
                if plan is None and quota is not None:
                    rec["plan"] = f"Q {quota / MiB:.0f} MiB"
                if plan is not None and mode == "budget":
                    # forward to the end of backward: what this step's time measures (the
                    # plan's step_s runs to the next forward, through gc and the stats)
                    rec["predicted_step_s"] = plan.prediction.backward_end_s
                    rec["predicted_period_s"] = plan.prediction.step_s
                    rec["predicted_peak_bytes"] = plan.prediction.peak_bytes
            snaps.append(before)
            steps.append(rec)
        # A step's I/O counters run from its start to the next step's start (writes of
        # records backward took from memory may end after backward); the last step's end
        # is after waiting for all I/O, outside its timing.
        if off is not None:
            off.wait()
            snaps.append(off.stats())
        for i, rec in enumerate(steps):
            for f in fields:
                rec[f] = getattr(snaps[i + 1], f) - getattr(snaps[i], f) if off is not None \
                    else 0
            if off is not None:
                rec["peak_resident_bytes"] = snaps[i + 1].peak_resident_bytes
                # the budget mode's own measure (NOTE [ Measured memory ]): a level
                rec["budget_measured_bytes"] = snaps[i + 1].budget_measured_bytes
                rec["budget_exceeded_bytes"] = snaps[i + 1].budget_exceeded_bytes
        engine = off.stats().engine if off is not None else ""
        detail = plan_detail(off.active_plan, s["n_layers"], cfg.get("mix_ks", ())) \
            if mode == "budget" and off.active_plan is not None else None
    finally:
        if off is not None:
            off.close()
    return {"mode": mode, "r": cfg["r"], "tflops": cfg["tflops"], "steps": steps,
            "engine": engine, "failures": EMU.failures, "plan_detail": detail}


def plan_detail(p, n, mix_ks):
    """The budget run's plan: its costs, its table, and what the same cost model
    predicts for the static modes (forward to the end of backward; ``checkpoint`` as
    every layer recomputed), so that predictions are compared with every mode's
    measurement (NOTE [ Step cost model ] in ssdtrain/_policies/costmodel.py)."""
    from dataclasses import asdict, replace
    import ssdtrain
    from ssdtrain.tools import predict
    # the static modes run with keep_tail_bytes=0 and the default write-behind; the
    # checkpoint mode keeps every layer's input, as the plan's kept tail does
    static = replace(p.step, keep_tail_bytes=0,
                     write_behind_bytes=ssdtrain.OffloadConfig().write_behind_bytes)
    plans = {"none": ["keep"] * n, "checkpoint": ["recompute"] * n,
             "offload_all": ["offload"] * n}
    for k in mix_ks:
        if 0 < k < n:
            for m in ("ok", "rk", "ro"):
                plans[f"{m}{k}"] = plan_for(f"{m}{k}", n)
    predicted = {}
    for name, choices in plans.items():
        pr = predict(p.layers, choices, static if name != "checkpoint" else p.step)
        predicted[name] = {"step_s": pr.backward_end_s, "peak_bytes": pr.peak_bytes}
    return {"layers": [asdict(layer) for layer in p.layers], "step": asdict(p.step),
            "table": p.table(), "predicted": predicted}


# ========================================================================= parent
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ratios", type=float, nargs="+", default=[0.5, 1, 2, 4],
                   help="target compute:disk ratios R (default 0.5 1 2 4)")
    p.add_argument("--tflops", type=float, default=None,
                   help="one fixed emulated FLOP rate instead of solving it per R")
    p.add_argument("--modes", nargs="+", default=None,
                   help="modes to run (default: the base modes and the mixes of --mix-ks)")
    p.add_argument("--mix-ks", type=int, nargs="+", default=[2, 5],
                   help="k of the static mixes ok<k>, rk<k>, ro<k> (default 2 5)")
    p.add_argument("--launch-us", type=float, default=10.0,
                   help="GIL-held launch cost per op, microseconds (default 10)")
    p.add_argument("--launch-fraction", type=float, default=None,
                   help="launch cost as a fraction of each op's compute (overrides --launch-us)")
    p.add_argument("--check", choices=("sparse", "full"), default="sparse",
                   help="saved-tensor content: markers every 4 KiB (default) or every byte")
    p.add_argument("--budget-fraction", type=float, default=0.3,
                   help="budget mode's memory_budget_bytes as a fraction of none's peak")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--max-slowdown", type=float, default=None,
                   help="OffloadConfig.max_slowdown of the default mode (default: the "
                        "library's)")
    p.add_argument("--warmup", type=int, default=2,
                   help="warm-up steps of the static modes (default 2)")
    p.add_argument("--warmup-adaptive", type=int, default=4,
                   help="warm-up steps of default and budget (default 4: the budget mode "
                        "profiles 2 steps, runs one recompute-all step and plans at the "
                        "start of the 4th, which probes the disk)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    for k, v in DEFAULT_SHAPE.items():
        p.add_argument("--" + k.replace("_", "-"), type=int, default=None,
                       help=f"model shape (default {v})")
    p.add_argument("--tiny", action="store_true", help="a tiny run (seconds), for the tests")
    p.add_argument("--spill-dir", default=None)
    p.add_argument("--json", default=DEFAULT_JSON)
    p.add_argument("--png", default=None, help="write the plot here (default: beside --json)")
    p.add_argument("--md", default=None, help="also write the report (markdown) here")
    add_worker_arguments(p, choices=("probe", "mode"))
    return p.parse_args(argv)


def summarize(run):
    meas = [s for s in run["steps"] if not s["warmup"]]
    med = lambda k: median([s[k] for s in meas if s.get(k) is not None])  # noqa: E731
    out = {k: med(k) for k in ("step_s", "delay_s", "spin_lost_s", "overrun_s",
                               "offloaded_bytes", "bytes_read")}
    out["stall_s"] = med("stall_seconds") + med("write_stall_seconds")
    out["peak_bytes"] = max(s["peak_bytes"] for s in meas)
    out["exact"] = all(s["check_failures"] == 0 for s in run["steps"]) and \
        all(s["checks"] > 0 for s in run["steps"])
    out["checks"] = sum(s["checks"] for s in run["steps"])
    out["plan"] = meas[-1].get("plan")
    out["predicted_step_s"] = meas[-1].get("predicted_step_s")
    return out


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return worker_main(args.worker, json.loads(args.worker_config), args.worker_out)
    shape = dict(TINY_SHAPE if args.tiny else DEFAULT_SHAPE)
    for k in shape:
        if getattr(args, k) is not None:
            shape[k] = getattr(args, k)
    if args.tiny:
        args.steps, args.warmup = min(args.steps, 1), min(args.warmup, 2)
        if args.modes is None:
            args.modes = list(BASE_MODES) + ["ok1", "rk1", "ro1"]
        if args.ratios == [0.5, 1, 2, 4]:
            args.ratios = [1.0]
    n = shape["n_layers"]
    modes = args.modes or list(BASE_MODES) + [f"{f}{k}" for f in ("ok", "rk", "ro")
                                              for k in args.mix_ks if 0 < k < n]
    known = BASE_MODES + EXTRA_MODES
    for m in modes:
        if m not in known and not (m[:2] in ("ok", "rk", "ro") and m[2:].isdigit()
                                   and 0 < int(m[2:]) <= n) and not is_plan_mode(m, n):
            raise SystemExit(f"accel_emulator: unknown mode {m!r}: use {', '.join(known)}, "
                             f"ok<k>/rk<k>/ro<k> with 1 <= k <= {n}, or plan-<one of k, o, r "
                             f"per layer>")
    if "none" not in modes:
        modes = ["none"] + modes
    import torch  # noqa: F401  (parent: only for min_tensor_bytes' default)
    import ssdtrain
    min_tensor = ssdtrain.OffloadConfig().min_tensor_bytes
    spec = spec_summary(shape, min_tensor)
    spill_dir, own = work_dir(args.spill_dir, "ssdtrain-emu-", "accel_emulator", "--spill-dir")
    env = worker_env(REPO_ROOT)
    script = os.path.abspath(__file__)
    base_cfg = {"shape": shape, "spill_dir": spill_dir, "threads": args.threads,
                "check": args.check, "launch_us": args.launch_us,
                "launch_fraction": args.launch_fraction, "steps": args.steps,
                "warmup": args.warmup, "mix_ks": args.mix_ks,
                "max_slowdown": args.max_slowdown}
    update, write, close = progress(len(modes) * args.repeats + 3)
    failed, runs = [], []
    try:
        bw = run_worker(script, "emu", "probe", 0, dict(base_cfg), env)
        update()
        if "error" in bw:
            raise SystemExit(f"accel_emulator: the bandwidth probe failed:\n{bw['stderr']}")
        write(f"disk: write {bw['write']:.2f} GB/s, read {bw['read']:.2f} GB/s ({bw['engine']})")
        # NOTE [ The ratio R ]: the step's Python and fill costs that do not overlap the
        # emulated compute are measured once (none at no compute) and taken off the
        # compute each R asks for, so none's step is about offload bytes / (bw * R).
        cal = run_worker(script, "emu", "mode", 0, dict(base_cfg, mode="none", budget_bytes=None,
                                                        points=[{"r": None, "tflops": 1e9}]), env)
        update()
        if "error" in cal:
            raise SystemExit(f"accel_emulator: the calibration run failed:\n{cal['stderr']}")
        overhead = summarize(cal["points"][0])["step_s"]
        write(f"step overhead at no compute: {overhead * 1e3:.0f} ms")
        tflops, unreachable = {}, []
        for r in args.ratios:
            want = spec["offload_bytes"] / (bw["write"] * 1e9) / r
            compute_s = want - overhead
            if compute_s < 0.2 * want:
                unreachable.append(r)
                compute_s = 0.2 * want
            tflops[r] = args.tflops or 3 * spec["forward_flops"] / compute_s / 1e12
        budget = None
        for rep in range(args.repeats):
            # one fresh process per (mode, repeat), modes rotated each repeat; inside it
            # each R runs on a fresh model and Offloader, R order rotated too
            order = modes[rep % len(modes):] + modes[:rep % len(modes)]
            if budget is None:              # none first: the budget is a fraction of its peak
                order.remove("none")
                order.insert(0, "none")
            for mi, mode in enumerate(order):
                shift = (rep + mi) % len(args.ratios)
                rs = args.ratios[shift:] + args.ratios[:shift]
                cfg = dict(base_cfg, mode=mode, budget_bytes=budget,
                           warmup=args.warmup_adaptive if mode in POLICY_MODES
                           else args.warmup,
                           points=[{"r": r, "tflops": tflops[r]} for r in rs])
                res = run_worker(script, "emu", "mode", rep, cfg, env)
                update()
                if "error" in res:
                    failed.append(f"{mode}#{rep}")
                    write(f"{mode} FAILED: {res['stderr'][-2000:]}")
                    continue
                for point in res["points"]:
                    point.update(mode=mode, repeat=rep, wall_s=res["wall_s"])
                    point["summary"] = summarize(point)
                    runs.append(point)
                if mode == "none" and budget is None:
                    budget = args.budget_fraction * max(p["summary"]["peak_bytes"]
                                                        for p in res["points"])
                write(f"{mode}: " + ", ".join(f"R={p['r']:g} {p['summary']['step_s'] * 1e3:.0f} ms"
                                              for p in res["points"]))
        bw_end = {} if args.tiny else run_worker(script, "emu", "probe", 1, dict(base_cfg), env)
        update()
    finally:
        close()
        if own:
            import shutil
            shutil.rmtree(spill_dir, ignore_errors=True)
    return report(args, shape, spec, bw, bw_end, tflops, budget, modes, runs, failed,
                  spill_dir, overhead, unreachable)


def _agg(runs, modes, ratios):
    """(mode, R) -> summary, medians over repeats."""
    out = {}
    for m in modes:
        for r in ratios:
            ss = [x["summary"] for x in runs if x["mode"] == m and x["r"] == r and "summary" in x]
            if not ss:
                continue
            agg = {k: median([s[k] for s in ss]) for k in ("step_s", "stall_s", "delay_s",
                                                           "spin_lost_s", "overrun_s",
                                                           "offloaded_bytes", "bytes_read")}
            agg["peak_bytes"] = max(s["peak_bytes"] for s in ss)
            agg["exact"] = all(s["exact"] for s in ss)
            agg["checks"] = sum(s["checks"] for s in ss)
            agg["plan"] = ss[-1]["plan"]
            ps = [s["predicted_step_s"] for s in ss if s.get("predicted_step_s")]
            if m != "budget":   # the budget run's cost model, applied to this static mode
                ps = [x["plan_detail"]["predicted"][m]["step_s"] for x in runs
                      if x["mode"] == "budget" and x["r"] == r and x.get("plan_detail")
                      and m in x["plan_detail"]["predicted"]]
            agg["predicted_step_s"] = median(ps) if ps else None
            out[(m, r)] = agg
    return out


def targets(agg, modes, ratios, budget, failed=()):
    """The accelerator-regime targets, per R: (name, R, value, met)."""
    out = []
    static = [m for m in modes if m not in POLICY_MODES]
    for r in ratios:
        none = agg.get(("none", r))
        if none is None:
            continue
        ns = none["step_s"]
        oa = agg.get(("offload_all", r))
        if oa is not None and r >= 4:
            x = oa["step_s"] / ns
            out.append(("offload-all >= 1.5x none at R = 4 (the emulator is right)", r,
                        f"{x:.2f}x", x >= 1.5))
        for dm in ("default", "auto"):
            d = agg.get((dm, r))
            if d is None:
                continue
            fast = [agg[(m, r)] for m in static if (m, r) in agg
                    and agg[(m, r)]["step_s"] <= 1.03 * ns]
            least = min((s["peak_bytes"] for s in fast), default=None)
            x = d["step_s"] / ns
            out.append((f"{dm}: step <= 1.03x none", r, f"{x:.2f}x", x <= 1.03))
            if least:
                y = d["peak_bytes"] / least
                out.append((f"{dm}: peak <= 1.10x the least-memory static plan within 1.03x "
                            "none", r, f"{y:.2f}x ({d['peak_bytes'] / MiB:.0f} vs "
                            f"{least / MiB:.0f} MiB)", y <= 1.10))
        b = agg.get(("budget", r))
        if b is not None and budget:
            out.append(("budget: peak within the budget", r,
                        f"{b['peak_bytes'] / MiB:.0f} of {budget / MiB:.0f} MiB",
                        b["peak_bytes"] <= budget))
            fit = [agg[(m, r)]["step_s"] for m in static if (m, r) in agg and m != "none"
                   and agg[(m, r)]["peak_bytes"] <= budget]
            if fit:
                x = b["step_s"] / min(fit)
                out.append(("budget: step <= 1.03x the fastest static plan that fits", r,
                            f"{x:.2f}x", x <= 1.03))
            else:
                out.append(("budget: step <= 1.03x the fastest static plan that fits", r,
                            "no static plan fits", None))
            if b.get("predicted_step_s"):
                e = b["predicted_step_s"] / b["step_s"] - 1
                out.append(("budget: predicted step within 15% of measured", r,
                            f"{e * 100:+.0f}%", abs(e) <= 0.15))
        for m in modes:
            if (m, r) in agg:
                gil = (agg[(m, r)]["spin_lost_s"] - none["spin_lost_s"]) / agg[(m, r)]["step_s"]
                if m != "none" and m != "checkpoint" and not m.startswith("rk"):
                    out.append((f"{m}: launch time lost beyond none's <= 1% of the step", r,
                                f"{gil * 100:.1f}%", gil <= 0.01))
    exact = bool(agg) and all(v["exact"] for v in agg.values()) and not failed
    out.append(("every mode bit-exact", None, "yes" if exact else "NO", exact))
    return out


def report(args, shape, spec, bw, bw_end, tflops, budget, modes, runs, failed, spill_dir,
           overhead, unreachable):
    agg = _agg(runs, modes, args.ratios)
    device, _, fstype = mount_of(spill_dir)
    lines = []
    say = lines.append
    say(f"Emulated GPT: {shape['n_layers']} layers, batch {shape['batch']}, seq {shape['seq']}, "
        f"d_model {shape['d_model']}, {shape['n_heads']} heads, vocab {shape['vocab']}, fp32; "
        f"forward {spec['forward_flops'] / 1e9:.2f} GFLOP; offload bytes per step "
        f"{spec['offload_bytes'] / MiB:.1f} MiB (unique saved {spec['unique_saved_bytes'] / MiB:.1f}"
        f" MiB)")
    say(f"Disk (spill_dir on {fstype or '?'} {device or '?'}, {bw['engine']}): write "
        f"{bw['write']:.2f} GB/s, read {bw['read']:.2f} GB/s (one request at a time) at the "
        f"start" + (f"; {bw_end['write']:.2f} / {bw_end['read']:.2f} GB/s at the end"
                    if "write" in bw_end else ""))
    launch = (f"{args.launch_fraction:g} of each op's compute" if args.launch_fraction is not None
              else f"{args.launch_us:g} us per op")
    say(f"Launch cost (GIL held): {launch}; check: {args.check}; budget "
        f"{budget / MiB:.1f} MiB ({args.budget_fraction:g} of none's peak)" if budget else "")
    say(f"Step overhead at no compute (none): {overhead * 1e3:.0f} ms, taken off each R's compute"
        + (f"; R = {', '.join(f'{r:g}' for r in unreachable)} NOT reachable (compute floored "
           f"at 20% of the target step)" if unreachable else ""))
    say("R eff = offload bytes / write bandwidth / none's measured step at that R.")
    say("")
    say("Predicted: the budget run's cost model (its profile and probe at that R), forward "
        "to the end of backward; for the static modes, that model applied to their plan.")
    say("")
    say(md_header(["R>", "R eff>", "TFLOP/s>", "mode", "plan", "step (ms)>", "predicted (ms)>",
                   "vs none>", "stall (ms)>", "peak (MiB)>", "vs none>", "written (MiB)>",
                   "read (MiB)>", "launch lost (ms)>", "exact"]))
    for r in args.ratios:
        none = agg.get(("none", r))
        for m in modes:
            a = agg.get((m, r))
            if a is None:
                say(f"| {r:g} | | {tflops[r]:.3g} | {m} | | FAILED | | | | | | | | | |")
                continue
            vs = f"{a['step_s'] / none['step_s']:.2f}x" if none else ""
            vm = f"{a['peak_bytes'] / none['peak_bytes']:.2f}x" if none else ""
            reff = f"{spec['offload_bytes'] / (bw['write'] * 1e9) / none['step_s']:.2f}" \
                if none else ""
            pred = "" if a.get("predicted_step_s") is None else \
                f"{a['predicted_step_s'] * 1e3:.0f}"
            say(f"| {r:g} | {reff} | {tflops[r]:.3g} | {m} | {a['plan'] or ''} | "
                f"{a['step_s'] * 1e3:.0f} | "
                f"{pred} | "
                f"{vs} | {a['stall_s'] * 1e3:.0f} | "
                f"{a['peak_bytes'] / MiB:.1f} | {vm} | {a['offloaded_bytes'] / MiB:.0f} | "
                f"{a['bytes_read'] / MiB:.0f} | {a['spin_lost_s'] * 1e3:.1f} | "
                f"{'yes' if a['exact'] else 'NO'} |")
    tg = targets(agg, modes, args.ratios, budget, failed)
    say("")
    say("Targets (the accelerator regime's; reported, not asserted):")
    for name, r, value, met in tg:
        verdict = "n/a" if met is None else "met" if met else "NOT met"
        say(f"- {name}" + (f" (R={r:g})" if r is not None else "") + f": {value} -> {verdict}")
    say("")
    say(f"Command: {command_line()}")
    text = "\n".join(lines)
    print(text)
    png = args.png or os.path.splitext(args.json)[0] + ".png"
    plot(agg, modes, args.ratios, png)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text + "\n")
    machine = {"cpu_count": os.cpu_count(), "python": platform.python_version(),
               "load_avg": os.getloadavg()}
    return finish("accel_emulator", args.json, {
        "command": command_line(), "machine": machine, "shape": shape, "spec": spec,
        "bandwidth_start": bw, "bandwidth_end": bw_end, "tflops": {str(k): v for k, v in
                                                                   tflops.items()},
        "budget_bytes": budget, "launch_us": args.launch_us, "overhead_s": overhead,
        "unreachable_ratios": unreachable,
        "launch_fraction": args.launch_fraction, "check": args.check, "modes": modes,
        "summary": [dict(mode=m, r=r, **v) for (m, r), v in agg.items()],
        "targets": [{"name": n, "r": r, "value": v, "met": m} for n, r, v, m in tg],
        "runs": runs}, failed)


def plot(agg, modes, ratios, path):
    """Step time and peak memory (both vs none) against R, one line per mode."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for m in modes:
        rs = [r for r in ratios if (m, r) in agg and ("none", r) in agg]
        if not rs:
            continue
        style = dict(lw=2.2) if m in BASE_MODES + EXTRA_MODES else \
            dict(lw=0.8, ls="--", alpha=0.7)
        ax1.plot(rs, [agg[(m, r)]["step_s"] / agg[("none", r)]["step_s"] for r in rs],
                 marker="o", label=m, **style)
        ax2.plot(rs, [agg[(m, r)]["peak_bytes"] / MiB for r in rs], marker="o", label=m,
                 **style)
    for ax, title in ((ax1, "step time / none"), (ax2, "peak activation memory (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("R = (offload bytes / disk write bandwidth) / step compute")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    ax1.axhline(1.03, color="k", lw=0.6, ls=":")
    ax2.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
