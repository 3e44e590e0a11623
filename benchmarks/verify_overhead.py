#!/usr/bin/env python
"""What ``verify=True`` (CRC32C of every record, on write and on read) costs per step.

One process, one GPT, two offloaders that differ only in ``verify``; training steps
alternate between them in ABBA order (off, on, on, off, ...) so drifts of a shared
machine hit both alike. Per step it records the wall time and the CPU time of the
whole process (training thread + I/O threads: the checksums run on the I/O threads,
so on a busy machine CPU time shows their cost more steadily than wall time). Also
checks that both give bitwise-equal gradients, and times ``crc32c`` alone.

Output: a markdown table on stdout and a JSON file with every raw number. Nothing here
asserts a timing.

Example::

    PYTHONPATH=. .venv/bin/python benchmarks/verify_overhead.py                 # ~5 min
    PYTHONPATH=. .venv/bin/python benchmarks/verify_overhead.py --tiny --pairs 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for _common, however run
from _common import md_table  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_JSON = os.path.join(REPO_ROOT, "benchmarks", "results", "verify_overhead.json")
# ~0.5 GiB of fp32 activations per step, ~0.4 GiB of them offloaded with the defaults.
MEDIUM = dict(d_model=512, n_layers=4, n_heads=8, seq_len=512, batch_size=4, vocab=8192)
TINY = dict(d_model=64, n_layers=2, n_heads=2, seq_len=64, batch_size=2, vocab=256)


def crc_throughput(nbytes, repeats=5):
    """GB/s of ``ssdtrain.tools.crc32c`` over an ``nbytes`` buffer (best of ``repeats``)."""
    import torch
    from ssdtrain import tools
    buf = torch.ones(nbytes, dtype=torch.uint8)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        tools.crc32c(buf.data_ptr(), nbytes)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def _progress(total):
    try:
        from tqdm import tqdm
        return tqdm(total=total, unit="step", file=sys.stderr)
    except ImportError:
        return None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny model (for the tests)")
    p.add_argument("--pairs", type=int, default=12, help="ABBA pairs of measured steps")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--engine", default="native", choices=["native", "posix"])
    p.add_argument("--spill-dir", help="default: a new directory under the system tmp dir")
    p.add_argument("--json", default=DEFAULT_JSON)
    args = p.parse_args(argv)

    import torch
    sys.path.insert(0, os.path.join(REPO_ROOT, "examples"))
    from gpt import GPT, GPTConfig, make_batch
    import ssdtrain
    from ssdtrain import tools
    if not tools.crc32c_available():
        raise SystemExit("verify_overhead: needs the compiled extension ssdtrain._C "
                         "(pip install -e .)")

    torch.set_num_threads(args.threads)
    shape = TINY if args.tiny else MEDIUM
    cfg = GPTConfig(vocab_size=shape["vocab"], seq_len=shape["seq_len"],
                    d_model=shape["d_model"], n_heads=shape["n_heads"],
                    n_layers=shape["n_layers"])
    torch.manual_seed(0)
    model = GPT(cfg)
    idx, targets = make_batch(cfg, shape["batch_size"], torch.Generator().manual_seed(1))
    spill = args.spill_dir or tempfile.mkdtemp(prefix="ssdtrain-verify-")
    extra = dict(min_tensor_bytes=4096, keep_tail_bytes=0) if args.tiny else {}
    offs = {v: ssdtrain.Offloader(spill_dir=spill, engine=args.engine, verify=v,
                                  policy="static", **extra)
            for v in (False, True)}

    def step(verify):
        model.zero_grad(set_to_none=True)
        c0, t0 = time.process_time(), time.perf_counter()
        with offs[verify]:
            loss = model(idx, targets)
        loss.backward()
        offs[verify].wait()
        return time.perf_counter() - t0, time.process_time() - c0

    grads = {}
    for v in (False, True):  # warm-up, and the equality check
        step(v)
        grads[v] = [q.grad.clone() for q in model.parameters()]
    equal = all(torch.equal(a, b) for a, b in zip(grads[False], grads[True]))

    samples = {False: [], True: []}
    pairs = []
    bar = _progress(2 * args.pairs)
    for i in range(args.pairs):
        order = (False, True) if i % 2 == 0 else (True, False)
        got = {}
        for v in order:
            got[v] = step(v)
            samples[v].append(got[v])
            if bar is not None:
                bar.update(1)
        pairs.append({"wall": got[True][0] / got[False][0], "cpu": got[True][1] / got[False][1]})
    if bar is not None:
        bar.close()
    stats = {v: offs[v].stats() for v in offs}
    for off in offs.values():
        off.close()

    med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    wall = {v: med([s[0] for s in samples[v]]) for v in samples}
    cpu = {v: med([s[1] for s in samples[v]]) for v in samples}
    wall_ratio = med([q["wall"] for q in pairs])
    cpu_ratio = med([q["cpu"] for q in pairs])
    gbps = crc_throughput((16 if args.tiny else 256) << 20)
    per_step = stats[True].offloaded_bytes / (args.pairs + 1)  # measured steps + warm-up
    print(md_table(["verify", "median step wall (s)>", "median step CPU (s)>", "engine"],
                   [["on" if v else "off", f"{wall[v]:.3f}", f"{cpu[v]:.3f}", stats[v].engine]
                    for v in (False, True)]))
    print(f"\nverify on / off, median of {len(pairs)} ABBA pairs: wall {wall_ratio:.3f}, "
          f"CPU {cpu_ratio:.3f}; gradients bitwise equal: {equal}")
    print("per-pair wall ratios: " + ", ".join(f"{q['wall']:.3f}" for q in pairs))
    print(f"crc32c alone: {gbps:.2f} GB/s on one thread; ~{per_step / 2**20:.0f} MiB written "
          f"(and read back) per step")
    out = {"command": " ".join([sys.executable] + sys.argv), "model": shape,
           "engine": args.engine, "threads": args.threads, "grads_equal": equal,
           "median_wall_s": {str(k): v for k, v in wall.items()},
           "median_cpu_s": {str(k): v for k, v in cpu.items()},
           "median_wall_ratio": wall_ratio, "median_cpu_ratio": cpu_ratio, "pairs": pairs,
           "samples": {str(k): v for k, v in samples.items()}, "crc32c_gb_per_s": gbps}
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    print(f"raw numbers: {args.json}")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
