#!/usr/bin/env python
"""What ``verify=True`` (CRC32C of every record, on write and on read) costs per step.

Runs the ``ssdtrain`` mode of ``step_overhead.py`` (same GPT, same worker: a fresh
process per run, a warm-up step, then ``--steps`` measured steps) with
``SSDTRAIN_VERIFY=0`` and ``SSDTRAIN_VERIFY=1``, alternating within each repeat (the
order flips every repeat) so drifts of the machine hit both alike. Steps that other
processes disturbed are skipped as in ``step_overhead.py`` (NOTE [ Contention ]).
Also times ``ssdtrain._C.crc32c`` alone over 256 MiB.

Output: a markdown table on stdout, per-repeat ratios, and a JSON file with every raw
number. Nothing here asserts a timing.

Example::

    PYTHONPATH=. .venv/bin/python benchmarks/verify_overhead.py              # ~6 min
    PYTHONPATH=. .venv/bin/python benchmarks/verify_overhead.py --tiny --repeats 1 --steps 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import step_overhead as so  # noqa: E402

DEFAULT_JSON = os.path.join(so.REPO_ROOT, "benchmarks", "results", "verify_overhead.json")


def crc_throughput(nbytes=256 << 20, repeats=5):
    """GB/s of ``ssdtrain._C.crc32c`` over an ``nbytes`` buffer (best of ``repeats``)."""
    import torch
    from ssdtrain import _checksum
    if not _checksum.available():
        return None
    buf = torch.ones(nbytes, dtype=torch.uint8)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        _checksum.crc32c(buf.data_ptr(), nbytes)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny model (for the tests)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--engine", default="auto", help="OffloadConfig.engine (native or posix)")
    p.add_argument("--spill-dir")
    p.add_argument("--json", default=DEFAULT_JSON)
    args = p.parse_args(argv)

    model = dict(so.TINY_MODEL if args.tiny else so.DEFAULT_MODEL)
    offload = {"keep_tail_bytes": None, "prefetch_bytes": None, "min_tensor_bytes": None,
               "io_threads": None}
    if args.tiny:
        offload.update(min_tensor_bytes=4 * so.KiB, keep_tail_bytes=0)
    own = args.spill_dir is None
    spill_dir = tempfile.mkdtemp(prefix="ssdtrain-verify-") if own else args.spill_dir
    cfg = dict(model, steps=args.steps, threads=args.threads, spill_dir=spill_dir,
               offload=offload)
    base_env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", PYTHONWARNINGS="ignore",
                    OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads),
                    SSDTRAIN_ENGINE=args.engine,
                    PYTHONPATH=os.pathsep.join([so.REPO_ROOT, os.environ.get("PYTHONPATH", "")]))
    runs = []
    update, write, close = so._progress(args.repeats * 2)
    try:
        for repeat in range(args.repeats):
            order = (0, 1) if repeat % 2 == 0 else (1, 0)
            for verify in order:
                env = dict(base_env, SSDTRAIN_VERIFY=str(verify))
                r = so.run_worker("ssdtrain", repeat, cfg, env)
                r["verify"] = verify
                runs.append(r)
                if "error" in r:
                    write(f"repeat {repeat + 1} verify={verify}: FAILED {r['error']}\n"
                          f"{r['stderr']}")
                else:
                    st = [x["step_s"] for x in so._measured(r)]
                    write(f"repeat {repeat + 1}/{args.repeats} verify={verify} step "
                          f"{so._median(st):.3f} s [{r.get('engine')}]")
                update(1)
    finally:
        close()
        if own:
            import shutil
            shutil.rmtree(spill_dir, ignore_errors=True)

    ok = [r for r in runs if "error" not in r]
    per = {0: [], 1: []}
    pairs = []
    for repeat in range(args.repeats):
        med = {}
        for r in ok:
            if r["repeat"] == repeat:
                st = [x["step_s"] for x in so._measured(r)]
                if st:
                    med[r["verify"]] = so._median(st)
                    per[r["verify"]].append(med[r["verify"]])
        if 0 in med and 1 in med:
            pairs.append(med[1] / med[0])
    gbps = crc_throughput(16 << 20 if args.tiny else 256 << 20)
    engines = sorted({r.get("engine", "?") for r in ok})
    summary = {
        "command": " ".join([sys.executable] + sys.argv),
        "model": model, "engines": engines,
        "median_step_s": {str(k): (statistics.median(v) if v else None) for k, v in per.items()},
        "per_repeat_ratio": pairs,
        "median_ratio": statistics.median(pairs) if pairs else None,
        "crc32c_gb_per_s": gbps,
        "runs": runs,
    }
    print(f"| verify | median step (s) | runs |\n|---|---|---|")
    for k in (0, 1):
        v = per[k]
        print(f"| {'on' if k else 'off'} | "
              f"{statistics.median(v) if v else float('nan'):.3f} | {len(v)} |")
    if pairs:
        print(f"\nverify on / off, per repeat: {', '.join(f'{x:.3f}' for x in pairs)}; "
              f"median {statistics.median(pairs):.3f} (engine {', '.join(engines)})")
    if gbps:
        print(f"crc32c alone: {gbps:.2f} GB/s on one thread")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(summary, f, indent=1, default=str)
    print(f"raw numbers: {args.json}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
