"""CPU seconds per GB: ssdtrain's native engine against DeepSpeed's ``aio_handle``, in one
process, interleaved.

``io_bandwidth.py`` runs each configuration in a fresh process, which suits bandwidth
(no page cache or allocator state carried over) but compares the CPU of processes
that differ in more than their engine: the allocation history of their records, the
first write of each file's blocks, their Python. This script measures what one
engine costs against the other on the same machine at the same moment: the same
record sizes, written to and read from files both engines have written once already
(a warm-up round, not counted), in rounds that run every configuration in turn
(order rotated per round), and reports the median over rounds of the CPU time of the
whole process (all threads: ``getrusage(RUSAGE_SELF)``) per GB moved.

Configurations (``write`` and ``read`` each):

* ``native``: ssdtrain's native engine (``--backend``) as the store uses it: writes
  from ordinary torch CPU tensors (64-byte aligned), reads into its read-buffer pool
  (``ReadBuffers``), O_DIRECT.
* ``native_locked``: the same engine on DeepSpeed's page-locked buffers: what locked
  memory itself costs the kernel (pinning a locked page for O_DIRECT costs more CPU
  than pinning an ordinary one on this VM).
* ``deepspeed``: ``aio_handle`` (block ``--chunk-size``, queue depth 1, ``--io-threads``
  threads) on the page-locked buffers it allocates itself
  (``new_cpu_locked_tensor``), its recommended use; only where DeepSpeed's async_io
  op is built (``make zero-infinity`` builds it into build/torch_extensions; set
  ``TORCH_EXTENSIONS_DIR`` to it) or with ``--with-deepspeed-aio`` (JIT, minutes).

Every read is checked against the CRC32C of what was written (untimed); a mismatch
fails the run. Nothing here asserts a timing: the table and JSON report what was
measured, and the targets (native <= DeepSpeed in both directions) are reported as
met or not.

    TORCH_EXTENSIONS_DIR=$PWD/build/torch_extensions .venv/bin/python \
        benchmarks/cpu_per_gb.py --with-deepspeed-aio [--size 1GiB] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import command_line, finish, md_table, median, progress, work_dir  # noqa: E402
from io_bandwidth import _deepspeed_op, _make_records, parse_size  # noqa: E402

MiB = 1 << 20


def _cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class Native:
    """The native engine on a set of source tensors, its own slots and read buffers."""

    def __init__(self, engine, spill, sources, dests):
        from ssdtrain.tools import BLOCK
        self.engine, self.sources, self.dests = engine, sources, dests
        self.slots = [spill.alloc(t.numel(), t.data_ptr() % BLOCK) for t in sources]

    def write(self):
        futures = [self.engine.write(s.file, s.offset, t.data_ptr(), t.numel())
                   for s, t in zip(self.slots, self.sources)]
        return sum(f.result() for f in futures)

    def read(self):
        futures = [self.engine.read(s.file, s.offset, d.data_ptr(), d.numel())
                   for s, d in zip(self.slots, self.dests)]
        return sum(f.result() for f in futures)


class DeepSpeed:
    """``aio_handle`` on its own page-locked buffers, one file."""

    def __init__(self, handle, path, buffers):
        self.handle, self.path, self.sources = handle, path, buffers
        self.dests = buffers
        self.offsets, at = [], 0
        for b in buffers:
            self.offsets.append(at)
            at += b.numel()

    def write(self):
        for b, off in zip(self.sources, self.offsets):
            self.handle.async_pwrite(b, self.path, off)
        self.handle.wait()
        return sum(b.numel() for b in self.sources)

    def read(self):
        for b, off in zip(self.dests, self.offsets):
            self.handle.async_pread(b, self.path, off)
        self.handle.wait()
        return sum(b.numel() for b in self.dests)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=parse_size, default=1 << 30, help="bytes written and read per configuration "
                   "and round (default 1GiB)")
    p.add_argument("--record-size", type=parse_size, default=64 * MiB, help="bytes per record (default 64MiB)")
    p.add_argument("--rounds", type=int, default=5, help="measured rounds (default 5), after "
                   "one warm-up round")
    p.add_argument("--io-threads", type=int, default=4, help="engine workers; DeepSpeed "
                   "intra_op_parallelism (default 4)")
    p.add_argument("--chunk-size", type=parse_size, default=16 * MiB, help="engine io_chunk_bytes; DeepSpeed "
                   "block size (default 16MiB)")
    p.add_argument("--backend", choices=["threads", "uring"], default="threads",
                   help="the native engine's back end (default threads, ssdtrain's default)")
    p.add_argument("--dir", default=None, help="directory on the device to measure "
                   "(default: a fresh one under the system temp dir, removed at the end)")
    p.add_argument("--with-deepspeed-aio", action="store_true",
                   help="load DeepSpeed's async_io op even where it is not prebuilt (from "
                        "TORCH_EXTENSIONS_DIR, or a JIT build: minutes)")
    p.add_argument("--no-deepspeed", action="store_true", help="native rows only")
    p.add_argument("--json", default="benchmarks/results/cpu_per_gb.json")
    args = p.parse_args(argv)

    import torch

    from ssdtrain.io.native import NativeEngine
    from ssdtrain.tools import BLOCK, ReadBuffers, SpillSet, crc32c

    size, record, chunk = args.size, args.record_size, args.chunk_size
    if record <= 0 or size < record or record % (args.io_threads * 4096):
        raise SystemExit(f"cpu_per_gb.py: --record-size must be a positive multiple of "
                         f"io_threads x 4096 = {args.io_threads * 4096} (DeepSpeed splits each "
                         f"record among its threads in whole blocks), at most --size")
    sizes = [record] * (size // record)
    total = sum(sizes)
    directory, own = work_dir(args.dir, "ssdtrain-cpu-gb-", "cpu_per_gb.py", "--dir")
    op = "--no-deepspeed given" if args.no_deepspeed else _deepspeed_op(args.with_deepspeed_aio)
    ds_reason = op if isinstance(op, str) else ""

    engine = NativeEngine(io_threads=args.io_threads, chunk_bytes=chunk, backend=args.backend)
    spill = SpillSet([directory], "auto")
    pool = ReadBuffers(limit=total + MiB)
    handle, locked, configs = None, [], {}
    try:
        sources = _make_records(sizes, 0)
        want = [crc32c(t.data_ptr(), t.numel()) for t in sources]
        native = Native(engine, spill, sources, [])
        native.dests = [torch.empty(0, dtype=torch.uint8).set_(
            pool.storage(s.offset % BLOCK, 0, s.nbytes)) for s in native.slots]
        configs["native"] = native
        if not ds_reason:
            handle = op.aio_handle(chunk, 1, False, True, args.io_threads)
            example = torch.empty(0, dtype=torch.uint8)
            locked = [handle.new_cpu_locked_tensor(n, example) for n in sizes]
            for b, t in zip(locked, sources):
                b.copy_(t)
            configs["native_locked"] = Native(engine, spill, locked, locked)
            configs["deepspeed"] = DeepSpeed(handle, os.path.join(directory, "deepspeed.bin"),
                                             locked)
        names = list(configs)
        cpu = {(n, d): [] for n in names for d in ("write", "read")}
        wall = {(n, d): [] for n in names for d in ("write", "read")}
        update, write_line, close_bar = progress((args.rounds + 1) * len(names))
        bad = []
        for r in range(args.rounds + 1):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                cfg = configs[name]
                for direction in ("write", "read"):
                    if direction == "read":
                        for d in cfg.dests:
                            d.zero_()  # untimed: the read must bring the bytes back
                    c0, t0 = _cpu(), time.perf_counter()
                    moved = getattr(cfg, direction)()
                    c1, t1 = _cpu(), time.perf_counter()
                    if moved != total:
                        bad.append(f"{name} {direction}: {moved} of {total} bytes")
                    if r:  # round 0 warms up: files' blocks allocated, buffers touched
                        cpu[name, direction].append((c1 - c0) / (total / 1e9))
                        wall[name, direction].append(total / 1e9 / (t1 - t0))
                got = [crc32c(d.data_ptr(), d.numel()) for d in cfg.dests]
                if got != want:
                    bad.append(f"{name}: {sum(g != w for g, w in zip(got, want))} records read "
                               f"back wrong in round {r}")
                update()
                write_line(f"round {r}/{args.rounds}{' (warm-up)' if not r else ''}: {name}")
        close_bar()
    finally:
        engine.shutdown()
        spill.close()
        for b in locked:
            handle.free_cpu_locked_tensor(b)
        if own:
            shutil.rmtree(directory, ignore_errors=True)

    label = {"native": f"ssdtrain native ({args.backend}), torch tensors / read buffers",
             "native_locked": f"ssdtrain native ({args.backend}), DeepSpeed's locked buffers",
             "deepspeed": "DeepSpeed aio_handle, its locked buffers"}
    print(f"## cpu_per_gb: {total / 1e9:.2f} GB in {len(sizes)} records of "
          f"{record // MiB} MiB, {args.rounds} rounds interleaved in one process, "
          f"{args.io_threads} I/O threads, chunk {chunk // MiB} MiB, O_DIRECT\n")
    summary, rows = {}, []
    for name in names:
        w, rd = cpu[name, "write"], cpu[name, "read"]
        summary[name] = {"cpu_s_per_gb_write": median(w), "cpu_s_per_gb_read": median(rd),
                         "gb_s_write": median(wall[name, "write"]),
                         "gb_s_read": median(wall[name, "read"])}
        rows.append([label[name], f"{median(w):.3f} [{min(w):.3f}, {max(w):.3f}]",
                     f"{median(rd):.3f} [{min(rd):.3f}, {max(rd):.3f}]",
                     f"{summary[name]['gb_s_write']:.2f}", f"{summary[name]['gb_s_read']:.2f}"])
    print(md_table(["config", "CPU s/GB write [min, max]>", "CPU s/GB read [min, max]>",
                    "write GB/s>", "read GB/s>"], rows))
    if ds_reason:
        print(f"\nDeepSpeed not run: {ds_reason}")
    print("\nCPU s/GB: CPU time of the whole process (all threads, getrusage) per GB moved, "
          "median over rounds [min, max]; GB = 10^9 bytes. Every read checked by CRC32C.")
    print(f"Machine: {os.cpu_count()} CPUs, dir {directory} ({'own' if own else 'given'}); "
          f"load average {os.getloadavg()[0]:.2f} at end")
    print(f"Command: {command_line()}")
    targets = []
    if not ds_reason:
        print("\nTargets (reported, not asserted):")
        for d in ("write", "read"):
            ours, theirs = summary["native"][f"cpu_s_per_gb_{d}"], \
                summary["deepspeed"][f"cpu_s_per_gb_{d}"]
            met = ours <= theirs
            targets.append({"direction": d, "native": ours, "deepspeed": theirs, "met": met})
            print(f"- native CPU s/GB {d} <= DeepSpeed's: {ours:.3f} vs {theirs:.3f} -> "
                  f"{'met' if met else 'NOT met'}")
    data = {"command": command_line(), "size": total, "record_size": record,
            "rounds": args.rounds, "io_threads": args.io_threads, "chunk_bytes": chunk,
            "backend": args.backend, "deepspeed": not ds_reason, "deepspeed_reason": ds_reason,
            "cpu_s_per_gb": {f"{n}/{d}": v for (n, d), v in cpu.items()},
            "gb_s": {f"{n}/{d}": v for (n, d), v in wall.items()},
            "summary": summary, "targets": targets, "errors": bad}
    for line in bad:
        print(f"cpu_per_gb.py: {line}", file=sys.stderr)
    return finish("cpu_per_gb.py", args.json, data, bad)


if __name__ == "__main__":
    sys.exit(main())
