#!/usr/bin/env python
"""Sequential write and read bandwidth of ssdtrain's I/O engines, the raw device and peers.

Writes ``--size`` bytes (default 2 GiB) and reads them back, in one run, for:

* ``raw``: the device through the file system with ``O_DIRECT``, by ``fio`` where it
  is installed, with the engines' parallelism (``--io-threads`` jobs, each streaming
  its own contiguous part of the file in ``--chunk-size`` blocks, ``--queue-depth``
  requests in flight per job, ``--ioengine libaio``), else ``dd`` (``oflag=direct`` /
  ``iflag=direct``, one stream, one request in flight); the reference every ratio is
  taken against;
* ``native-uring`` and ``native-threads``: ``ssdtrain.io.native.NativeEngine`` with
  its io_uring and its pread/pwrite thread-pool back end;
* ``posix``: ``ssdtrain.io.posix.PosixEngine``, the pure-Python reference engine;
* ``torch_save``: ``torch.save`` of each record to its own file (then ``fsync``) and
  ``torch.load`` back;
* ``deepspeed_aio``: DeepSpeed's ``aio_handle`` (``async_pwrite``/``async_pread``
  into page-locked buffers from ``new_cpu_locked_tensor``), only where its op is
  prebuilt and compatible, or with ``--with-deepspeed-aio`` (which may JIT-build it).

The engines are used the way ssdtrain uses them: the data is a list of records
(``--record-size``, default 64 MiB), each its own ``torch.uint8`` CPU tensor (64-byte
aligned, i.e. *not* page aligned: NOTE [ Zero-copy O_DIRECT from unaligned tensors ]),
written into slots of an anonymous spill file from ``ssdtrain.tools.SpillSet``
(``O_DIRECT`` where the file system takes it) at offsets congruent to the tensor's
address, all requests submitted at once; reads land in page-aligned mappings with the
record's misalignment from ``ssdtrain.tools.ReadBuffers``, touched beforehand (as
reused buffers are in steady state; ``--cold-read-buffers`` reads into fresh pages).

Page cache. The engines, ``raw`` and ``deepspeed_aio`` bypass it (``O_DIRECT``;
where the file system refuses ``O_DIRECT``, the engines fall back to buffered I/O +
``fdatasync`` + ``POSIX_FADV_DONTNEED`` and the table says so). ``torch_save`` writes
through it: its write time includes an ``fsync`` of every file, and between write and
read every file is dropped from the cache (``POSIX_FADV_DONTNEED`` after the
``fsync``, untimed). Every phase records the bytes the process (or its ``fio``/``dd``
child) actually moved to and from the block layer (``getrusage`` ``ru_oublock`` /
``ru_inblock``); the ``disk/logical`` column shows them over the logical bytes, so a
reading below 1.0 means the page cache served part of the data, and the ``page
cache`` column says so.

Method: every (configuration, repeat) runs in a fresh process (this script with the
hidden ``--worker`` flag) on fresh files, which are removed at its end; the order of
configurations rotates from repeat to repeat; the parent calls ``sync`` before each
run so earlier dirty data is not written back during it. Per phase: seconds (``raw``
uses the tool's own timing, the others the wall time from the first submission to the
last completion), CPU seconds of the whole process (every thread, including the
engines' native workers and io_uring's kernel workers: ``time.process_time``; for
``raw`` the child's ``RUSAGE_CHILDREN``), block-layer bytes, and what else the machine
did meanwhile (other processes' CPU share from ``/proc/stat``, other I/O on the device
from ``/proc/diskstats``). Data is generated before and verified after the timed
phases (CRC32C of every record read back against the written one; ``raw`` checks byte
counts only, its data never passes through Python): a mismatch fails the run loudly.

Output: a markdown table on stdout (GB = 10^9 bytes; medians with min-max over
repeats; ratios of medians to ``raw``), the issue's targets (reported, never asserted),
and a JSON file with every raw number. Progress goes to stderr.

Example::

    .venv/bin/python benchmarks/io_bandwidth.py                       # 2 GiB x 3 repeats
    .venv/bin/python benchmarks/io_bandwidth.py --size 64MiB --repeats 1
    .venv/bin/python benchmarks/io_bandwidth.py --dir /nvme/tmp --configs raw native-uring
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import resource
import shlex
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for _common, however run
from _common import (  # noqa: E402
    add_worker_arguments, command_line, finish, md_table, median, mount_of, progress, spawn_worker,
    work_dir, worker_env)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_JSON = os.path.join(REPO_ROOT, "benchmarks", "results", "io_bandwidth.json")
CONFIGS = ("raw", "native-uring", "native-threads", "posix", "torch_save", "deepspeed_aio")
ENGINE_CONFIGS = ("native-uring", "native-threads", "posix")
PEERS = ("torch_save", "deepspeed_aio")
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
GB = 1e9
BLOCK = 4096  # O_DIRECT alignment used everywhere (ssdtrain.tools.BLOCK)

# Targets (benchmarks/README.md; reported, never asserted).
TARGET_RAW_RATIO = 0.9

_UNITS = {"": 1, "b": 1, "k": KiB, "kib": KiB, "kb": 1000, "m": MiB, "mib": MiB, "mb": 1000 ** 2,
          "g": GiB, "gib": GiB, "gb": 1000 ** 3}


def parse_size(text):
    """``"2GiB"``, ``"64MiB"``, ``"8M"``, ``"4096"`` -> bytes (argparse type)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 2GiB, 64MiB, 1048576)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _size_text(n):
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"


def record_sizes(total, record):
    """Split ``total`` bytes into records of ``record`` bytes (the last may be shorter)."""
    sizes = [record] * (total // record)
    if total % record:
        sizes.append(total % record)
    return sizes


# ------------------------------------------------------------------------ measuring a phase
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _machine_busy_seconds():
    """CPU seconds the whole machine spent busy (incl. steal) so far, from ``/proc/stat``."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / _CLK_TCK


def _device_sectors(device):
    """``(sectors read, sectors written)`` of block device ``device`` (e.g. ``vda``)."""
    if not device:
        return None
    try:
        with open("/proc/diskstats") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 10 and parts[2] == device:
                    return int(parts[5]), int(parts[9])
    except (OSError, ValueError):
        pass
    return None


def block_device_of(path):
    """The ``/proc/diskstats`` name of the block device holding ``path`` (``""`` if none)."""
    device = mount_of(path)[0]
    if not device.startswith("/dev/"):
        return ""
    name = os.path.basename(os.path.realpath(device))
    return name if _device_sectors(name) is not None else ""


def filesystem_type(path):
    """The file system type holding ``path`` (``ext4``, ``tmpfs``...; ``""`` if unknown)."""
    from ssdtrain.tools import filesystem_type as fs_type  # imported late, as elsewhere here
    return fs_type(path)


class Phase:
    """Measures one timed phase: wall time, CPU, block-layer bytes, what others did.

    ``children=True`` attributes CPU and block I/O to waited-for child processes
    (``fio``/``dd``) instead of this process. Used as a context manager; the numbers
    are in :attr:`result` afterwards.
    """

    def __init__(self, device, children=False):
        self.device = device
        self.who = resource.RUSAGE_CHILDREN if children else resource.RUSAGE_SELF
        self.result = {}

    def __enter__(self):
        self._usage = resource.getrusage(self.who)
        self._busy = _machine_busy_seconds()
        self._sectors = _device_sectors(self.device)
        self._cpu = time.process_time()
        self._t = time.perf_counter()
        return self

    def __exit__(self, *exc):
        wall = time.perf_counter() - self._t
        cpu_self = time.process_time() - self._cpu
        usage = resource.getrusage(self.who)
        busy = _machine_busy_seconds() - self._busy
        sectors = _device_sectors(self.device)
        u0 = self._usage
        cpu = (usage.ru_utime + usage.ru_stime) - (u0.ru_utime + u0.ru_stime)
        if self.who == resource.RUSAGE_CHILDREN:
            cpu_all = cpu + cpu_self
        else:
            cpu, cpu_all = cpu_self, cpu_self
        r = dict(wall_s=wall, cpu_s=cpu,
                 disk_read_bytes=(usage.ru_inblock - u0.ru_inblock) * 512,
                 disk_write_bytes=(usage.ru_oublock - u0.ru_oublock) * 512,
                 other_cpu_share=max(0.0, busy - cpu_all) / max(1e-9, wall * (os.cpu_count() or 1)))
        if sectors is not None and self._sectors is not None:
            r["device_read_bytes"] = (sectors[0] - self._sectors[0]) * 512
            r["device_write_bytes"] = (sectors[1] - self._sectors[1]) * 512
            r["other_device_bytes"] = max(0, r["device_read_bytes"] - r["disk_read_bytes"]) + \
                max(0, r["device_write_bytes"] - r["disk_write_bytes"])
        self.result = r
        return False


# ----------------------------------------------------------------------------- worker side
def _crc(tensor):
    """CRC32C (``ssdtrain.tools.crc32c``) of a contiguous CPU tensor's bytes; zlib CRC32
    without the compiled extension."""
    from ssdtrain import tools
    n = tensor.numel() * tensor.element_size()
    if not tools.crc32c_available():
        import ctypes
        import zlib
        return zlib.crc32(memoryview((ctypes.c_char * n).from_address(tensor.data_ptr())))
    return tools.crc32c(tensor.data_ptr(), n)


def _make_records(sizes, seed):
    """One fresh uint8 tensor per record, filled with seeded random bytes."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    records = []
    for n in sizes:
        t = torch.empty(n, dtype=torch.uint8)
        words = n // 8
        if words:
            t[:words * 8].view(torch.int64).random_(generator=gen)
        if n % 8:
            t[words * 8:] = torch.randint(0, 256, (n % 8,), dtype=torch.uint8, generator=gen)
        records.append(t)
    return records


def _verify(loaded, crcs, sizes, inject):
    """Compare each record read back with the one written; the result dict for the JSON."""
    if inject and loaded:  # test hook: prove that a corrupted read is caught
        loaded[len(loaded) // 2].view(-1)[-1] ^= 0xFF
    got = [(_crc(t), t.numel()) for t in loaded]
    bad = [i for i, ((c, n), want, size) in enumerate(zip(got, crcs, sizes))
           if c != want or n != size]
    if len(got) != len(crcs):
        bad.append(len(got))
    return {"method": "crc32c per record", "records": len(crcs), "ok": not bad,
            "mismatched_records": bad[:20]}


def _run_engine(config, cfg, sizes, phases, check):
    import torch
    from ssdtrain.tools import ReadBuffers, SpillSet
    from ssdtrain.io.native import NativeEngine
    from ssdtrain.io.posix import PosixEngine

    if config == "posix":
        engine = PosixEngine(io_threads=cfg["io_threads"], chunk_bytes=cfg["chunk_bytes"])
        backend = "posix"
    else:
        engine = NativeEngine(io_threads=cfg["io_threads"], chunk_bytes=cfg["chunk_bytes"],
                              backend=config.split("-", 1)[1])
        backend = f"native({engine.backend})"
    spill = SpillSet([cfg["dir"]], cfg["direct_io"])
    info = {"engine": backend, "direct": spill.files[0].direct,
            "direct_io_setting": cfg["direct_io"]}
    try:
        records = _make_records(sizes, cfg["seed"])
        crcs = [_crc(t) for t in records]
        info["source_misalign"] = sorted({t.data_ptr() % BLOCK for t in records})
        slots = [spill.alloc(t.numel(), t.data_ptr() % BLOCK) for t in records]
        with Phase(cfg["device"]) as w:
            futures = [engine.write(s.file, s.offset, t.data_ptr(), t.numel())
                       for s, t in zip(slots, records)]
            written = sum(f.result() for f in futures)
        phases["write"] = dict(w.result, seconds=w.result["wall_s"], bytes=written)
        del records, futures  # as after a write in ssdtrain: the memory is free again

        buffers = ReadBuffers(limit=0)
        dests = [torch.empty(0, dtype=torch.uint8).set_(buffers.storage(s.offset % BLOCK,
                                                                        0, s.nbytes))
                 for s in slots]
        if not cfg["cold_read_buffers"]:
            for d in dests:
                d.fill_(0)
        info["dest_misalign"] = sorted({d.data_ptr() % BLOCK for d in dests})
        with Phase(cfg["device"]) as r:
            futures = [engine.read(s.file, s.offset, d.data_ptr(), s.nbytes)
                       for s, d in zip(slots, dests)]
            read = sum(f.result() for f in futures)
        phases["read"] = dict(r.result, seconds=r.result["wall_s"], bytes=read)
        info["file_bytes"] = spill.files[0].size_bytes()
        info["verify"] = check(dests, crcs)
        return info
    finally:
        engine.shutdown()
        spill.close()


def _run_torch_save(cfg, sizes, phases, check):
    import torch
    records = _make_records(sizes, cfg["seed"])
    crcs = [_crc(t) for t in records]
    paths = [os.path.join(cfg["dir"], f"torch_save-{os.getpid()}-{i}.pt")
             for i in range(len(records))]
    info = {"engine": "torch.save/torch.load", "direct": False,
            "source_misalign": sorted({t.data_ptr() % BLOCK for t in records})}
    try:
        with Phase(cfg["device"]) as w:
            for t, path in zip(records, paths):
                torch.save(t, path)
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)  # the engines' data is on the device when they finish
                finally:
                    os.close(fd)
        info["file_bytes"] = sum(os.path.getsize(p) for p in paths)
        phases["write"] = dict(w.result, seconds=w.result["wall_s"],
                               bytes=sum(t.numel() for t in records))
        del records
        for path in paths:  # untimed: clean pages leave the cache, so load reads the device
            _drop_cached(path)
        with Phase(cfg["device"]) as r:
            loaded = [torch.load(p, weights_only=True) for p in paths]
        phases["read"] = dict(r.result, seconds=r.result["wall_s"],
                              bytes=sum(t.numel() for t in loaded))
        info["verify"] = check(loaded, crcs)
        return info
    finally:
        for p in paths:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass


def _deepspeed_op(build):
    """DeepSpeed's async_io op module, or a reason string why it is not usable.

    Never builds unless ``build``: the op must be prebuilt (``installed_ops``) and
    compatible; with ``build`` it is loaded through ``AsyncIOBuilder().load()``, which
    JIT-compiles it (minutes) when it is not prebuilt or cached.
    """
    # Runs in a worker process, whose output the parent captures: DeepSpeed's logging
    # and compiler messages never reach the table. (No redirection of sys.stderr here:
    # is_compatible() needs its file descriptor.)
    try:
        from deepspeed.git_version_info import installed_ops
        from deepspeed.ops.op_builder import AsyncIOBuilder
        builder = AsyncIOBuilder()
        if not builder.is_compatible(verbose=False):
            return ("not compatible here (AsyncIOBuilder().is_compatible() is False: "
                    "libaio-dev missing?)")
        if not installed_ops.get("async_io", False) and not build:
            return ("not prebuilt (DeepSpeed installed without DS_BUILD_AIO=1); "
                    "--with-deepspeed-aio builds it (JIT, minutes)")
        return builder.load(verbose=False)
    except ImportError as e:
        return f"not importable ({e})"
    except Exception as e:  # a failed JIT build: report it as the reason, do not crash
        return f"failed to load: {type(e).__name__}: {str(e)[-500:]}"


def _run_deepspeed(cfg, sizes, phases, check):
    import torch
    op = _deepspeed_op(cfg["with_deepspeed_aio"])
    if isinstance(op, str):
        raise RuntimeError(f"io_bandwidth: deepspeed_aio unavailable: {op}")
    threads = cfg["io_threads"]
    bad = [n for n in sizes if n % (threads * BLOCK)]
    if bad:
        raise RuntimeError(f"io_bandwidth: deepspeed_aio needs record sizes divisible by "
                           f"io_threads x 4096 = {threads * BLOCK}; got {bad[0]}. Pick --size and "
                           f"--record-size multiples of {threads * BLOCK}.")
    handle = op.aio_handle(cfg["chunk_bytes"], cfg["queue_depth"], False, True, threads)
    example = torch.empty(0, dtype=torch.uint8)
    records = _make_records(sizes, cfg["seed"])
    crcs = [_crc(t) for t in records]
    path = os.path.join(cfg["dir"], f"deepspeed_aio-{os.getpid()}.bin")
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    info = {"engine": f"deepspeed aio_handle(block {_size_text(cfg['chunk_bytes'])}, queue "
                      f"depth {cfg['queue_depth']}, {threads} threads), locked buffers",
            "direct": True}
    locked = []
    try:
        for t in records:  # its recommended use: page-locked buffers it allocates (untimed copy)
            buf = handle.new_cpu_locked_tensor(t.numel(), example)
            buf.copy_(t)
            locked.append(buf)
        del records
        with Phase(cfg["device"]) as w:
            for buf, off in zip(locked, offsets):
                handle.async_pwrite(buf, path, off)
            handle.wait()
        phases["write"] = dict(w.result, seconds=w.result["wall_s"], bytes=sum(sizes))
        info["file_bytes"] = os.path.getsize(path)
        for buf in locked:
            buf.zero_()
        with Phase(cfg["device"]) as r:
            for buf, off in zip(locked, offsets):
                handle.async_pread(buf, path, off)
            handle.wait()
        phases["read"] = dict(r.result, seconds=r.result["wall_s"], bytes=sum(sizes))
        info["verify"] = check(locked, crcs)  # before the buffers are freed
        return info
    finally:
        for buf in locked:
            handle.free_cpu_locked_tensor(buf)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _drop_cached(path):
    """Drop a file's clean pages from the page cache (after an fsync: all of them)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _raw_commands(cfg, path):
    """``(engine text, block bytes, jobs, {phase: argv}, parse)`` for fio or dd.

    ``O_DIRECT`` where the file system takes it; elsewhere (tmpfs...) buffered I/O
    with an fsync at the end of the write and the file dropped from the cache before
    the read, as the engines do there.
    """
    size, direct = cfg["size"], cfg["direct_supported"]
    mode = "O_DIRECT" if direct else "buffered + fsync"
    if cfg["raw_tool"] == "fio":
        # Like the engines: io_threads streams, each over its own part of the file.
        jobs = cfg["io_threads"] if size % (cfg["io_threads"] * BLOCK) == 0 else 1
        part = size // jobs
        bs = math.gcd(part, cfg["chunk_bytes"])
        common = [f"--filename={path}", f"--bs={bs}", f"--size={part}",
                  f"--offset_increment={part}", f"--numjobs={jobs}", "--group_reporting",
                  f"--direct={int(direct)}", f"--ioengine={cfg['fio_ioengine']}",
                  f"--iodepth={cfg['queue_depth']}", "--output-format=json"]
        cmds = {"write": ["fio", "--name=ssdtrain-write", "--rw=write"] + common
                + ([] if direct else ["--end_fsync=1"]),
                "read": ["fio", "--name=ssdtrain-read", "--rw=read"] + common}
        text = (f"fio {cfg['fio_ioengine']}, {mode}, {jobs} jobs x iodepth {cfg['queue_depth']}, "
                f"bs {_size_text(bs)}")
        return text, bs, jobs, cmds, _parse_fio
    bs = math.gcd(size, cfg["chunk_bytes"])
    cmds = {"write": ["dd", "if=/dev/zero", f"of={path}", f"bs={bs}", f"count={size // bs}",
                      "oflag=direct" if direct else "conv=fsync"],
            "read": ["dd", f"if={path}", "of=/dev/null", f"bs={bs}"]
            + (["iflag=direct"] if direct else [])}
    return f"dd, {mode}, 1 stream x 1 request, bs {_size_text(bs)}", bs, 1, cmds, _parse_dd


def _parse_fio(phase, proc, measured):
    """``(bytes, seconds, cpu seconds)`` from fio's JSON."""
    job = json.loads(proc.stdout[proc.stdout.index("{"):])["jobs"][0]
    nbytes, bw = job[phase]["io_bytes"], job[phase]["bw_bytes"]
    seconds = nbytes / bw if bw > 0 else measured["wall_s"]
    # fio's own CPU share of its jobs' run time (job_runtime sums the jobs): the I/O,
    # not fio's start-up, which the child's rusage (kept as cpu_s_rusage) includes.
    cpu = (job["usr_cpu"] + job["sys_cpu"]) / 100 * job["job_runtime"] / 1e3
    return nbytes, seconds, cpu


def _parse_dd(phase, proc, measured):
    """``(bytes, seconds, cpu seconds)`` from dd's closing line and the child's rusage."""
    m = re.search(r"^(\d+) bytes .* copied, ([0-9.e+-]+) s", proc.stderr, re.M)
    nbytes = int(m.group(1)) if m else 0
    seconds = float(m.group(2)) if m and float(m.group(2)) > 0 else measured["wall_s"]
    return nbytes, seconds, measured["cpu_s"]


def _run_raw(cfg, phases):
    path = os.path.join(cfg["dir"], f"raw-{os.getpid()}.bin")
    env = dict(os.environ, LC_ALL="C")
    text, bs, jobs, cmds, parse = _raw_commands(cfg, path)
    info = {"engine": text, "direct": cfg["direct_supported"], "block_bytes": bs, "jobs": jobs,
            "direct_io_setting": cfg["direct_io"]}
    try:
        for phase in ("write", "read"):
            if phase == "read" and not cfg["direct_supported"]:
                _drop_cached(path)  # untimed, as for torch_save
            cmd = cmds[phase]
            with Phase(cfg["device"], children=True) as p:
                proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"io_bandwidth: {shlex.join(cmd)} failed "
                                   f"({proc.returncode}): {proc.stderr[-2000:]}")
            nbytes, seconds, cpu = parse(phase, proc, p.result)
            phases[phase] = dict(p.result, seconds=seconds, bytes=nbytes, cpu_s=cpu,
                                 cpu_s_rusage=p.result["cpu_s"], command=shlex.join(cmd))
        info["file_bytes"] = os.path.getsize(path)
        return info
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def worker(config, cfg, out_path):
    """One process, one configuration: write, read, verify; a JSON result to ``out_path``."""
    sizes = record_sizes(cfg["size"], cfg["record_bytes"])
    result = {"config": config, "repeat": cfg["repeat"], "pid": os.getpid(), "phases": {}}
    phases = result["phases"]
    try:
        if config == "raw":
            result.update(_run_raw(cfg, phases))
            result["verify"] = {"method": "byte counts (fio/dd data never passes through "
                                          "Python)",
                                "ok": all(phases[p]["bytes"] == cfg["size"]
                                          for p in ("write", "read"))}
        else:
            def check(loaded, crcs):
                return _verify(loaded, crcs, sizes, cfg.get("inject_corruption") == config)

            if config in ENGINE_CONFIGS:
                result.update(_run_engine(config, cfg, sizes, phases, check))
            elif config == "torch_save":
                result.update(_run_torch_save(cfg, sizes, phases, check))
            elif config == "deepspeed_aio":
                result.update(_run_deepspeed(cfg, sizes, phases, check))
            else:
                raise SystemExit(f"io_bandwidth: unknown configuration {config!r}")
        for phase in ("write", "read"):
            p = phases[phase]
            p["bytes_expected"] = cfg["size"]
            p["gb_per_s"] = p["bytes"] / GB / p["seconds"] if p["seconds"] > 0 else 0.0
            p["cpu_s_per_gb"] = p["cpu_s"] / (p["bytes"] / GB) if p["bytes"] else float("nan")
            moved = p["disk_read_bytes"] if phase == "read" else p["disk_write_bytes"]
            p["disk_over_logical"] = moved / p["bytes"] if p["bytes"] else 0.0
    finally:
        with open(out_path, "w") as f:
            json.dump(result, f)
    if not result["verify"]["ok"]:
        print(f"io_bandwidth: DATA MISMATCH in {config}: {result['verify']}", file=sys.stderr)
        return 3
    return 0


def probe(cfg, out_path):
    """What can run here: the native engine and its back ends, O_DIRECT, DeepSpeed aio."""
    out = {}
    try:
        from ssdtrain.io import native
        out["native"] = native.available()
        out["native_reason"] = native.unavailable_reason()
        if native.available():
            from ssdtrain.tools import uring_probe
            out["uring"], out["uring_reason"] = uring_probe()
        from ssdtrain.tools import SpillFile
        f = SpillFile(cfg["dir"], "auto")  # whether the file system takes O_DIRECT
        out["direct"] = f.direct
        f.close()
    except Exception as e:  # reported as a reason in the table, never hidden
        out["error"] = f"{type(e).__name__}: {e}"
    op = _deepspeed_op(False) if "deepspeed_aio" in cfg["configs"] else \
        "not requested (--configs)"
    out["deepspeed"] = not isinstance(op, str)
    out["deepspeed_reason"] = "" if out["deepspeed"] else op
    with open(out_path, "w") as f:
        json.dump(out, f)
    return 0


# ----------------------------------------------------------------------------- parent side
def _spawn(kind, cfg, env):
    """One worker (or the probe) in a fresh process: its result, with what went wrong.

    Unlike ``_common.run_worker``, a failed worker's partial result is kept: a
    verification failure (exit 3) reads as ``DATA MISMATCH``.
    """
    proc, wall, text = spawn_worker(__file__, "io_bandwidth", kind, cfg, env)
    try:
        result = json.loads(text) if text else {}
    except ValueError:
        result = {}
    result.setdefault("config", kind)
    result["wall_s"] = wall
    if proc.returncode != 0:
        verify = result.get("verify", {})
        result["error"] = ("DATA MISMATCH" if verify and not verify.get("ok")
                           else f"exit {proc.returncode}")
        result["stderr"] = proc.stderr[-8000:]
    return result


def summarize(runs, configs):
    """Per configuration and phase: median, min and max over repeats; ratios to ``raw``."""
    summary = {}
    for config in configs:
        rs = [r for r in runs if r["config"] == config and "error" not in r]
        if not rs:
            summary[config] = {"failed": True}
            continue
        s = {"repeats": len(rs), "engine": rs[0].get("engine", ""),
             "direct": all(r.get("direct") for r in rs),
             "direct_io_setting": rs[0].get("direct_io_setting"),
             "verified": all(r["verify"]["ok"] for r in rs),
             "verify_method": rs[0]["verify"]["method"]}
        for phase in ("write", "read"):
            ps = [r["phases"][phase] for r in rs]
            gbs = [p["gb_per_s"] for p in ps]
            s[phase] = {
                "gb_per_s_median": median(gbs), "gb_per_s_min": min(gbs),
                "gb_per_s_max": max(gbs),
                "cpu_s_per_gb_median": median([p["cpu_s_per_gb"] for p in ps]),
                "disk_over_logical_median": median([p["disk_over_logical"] for p in ps]),
                "disk_over_logical_min": min(p["disk_over_logical"] for p in ps),
                "other_cpu_share_max": max(p["other_cpu_share"] for p in ps),
                "other_device_bytes_max": max((p.get("other_device_bytes", 0) for p in ps)),
            }
        summary[config] = s
    raw = summary.get("raw", {})
    for config, s in summary.items():
        if s.get("failed") or raw.get("failed") or not raw:
            continue
        for phase in ("write", "read"):
            s[phase]["ratio_to_raw"] = s[phase]["gb_per_s_median"] / \
                raw[phase]["gb_per_s_median"]
    return summary


def _cache_note(s):
    """How the page cache figured in a configuration's numbers (from block-layer bytes)."""
    read = s["read"]["disk_over_logical_min"]
    write = s["write"]["disk_over_logical_median"]
    if s["direct"]:
        how = "bypassed (O_DIRECT)"
    elif s["engine"].startswith("torch"):
        how = "write through it + fsync; dropped (fsync + FADV_DONTNEED) before read"
    else:
        why = "--direct-io off" if s.get("direct_io_setting") == "off" else \
            "the file system refused O_DIRECT"
        how = f"buffered + fdatasync (fio/dd: fsync) + FADV_DONTNEED ({why})"
    if read < 0.95:
        how += f"; CACHE HELPED reads: only {read:.2f}x of the bytes came from the device"
    if write < 0.95:
        how += f"; only {write:.2f}x of the written bytes reached the block layer"
    return how


def render_table(summary, configs, skipped):
    rows = []
    for config in configs:
        s = summary.get(config, {"failed": True})
        if s.get("failed"):
            rows.append([config] + ["-"] * 8 + ["FAILED (see stderr / JSON)"])
            continue
        cells = [config]
        for phase in ("write", "read"):
            p = s[phase]
            cells.append(f"{p['gb_per_s_median']:.2f} [{p['gb_per_s_min']:.2f}-"
                         f"{p['gb_per_s_max']:.2f}]")
            cells.append(f"{p['ratio_to_raw']:.2f}" if "ratio_to_raw" in p else "-")
        cells += [f"{s['write']['cpu_s_per_gb_median']:.3f}",
                  f"{s['read']['cpu_s_per_gb_median']:.3f}",
                  f"{s['write']['disk_over_logical_median']:.2f}, "
                  f"{s['read']['disk_over_logical_median']:.2f}",
                  _cache_note(s),
                  f"{s['engine']}; {s['repeats']} repeats; verified: "
                  f"{'yes' if s['verified'] else 'NO'} ({s['verify_method']})"]
        rows.append(cells)
    for config, why in skipped.items():
        rows.append([config] + ["-"] * 8 + [f"not run: {why}"])
    return md_table(["config", "write GB/s median [min-max]>", "write / raw>",
                     "read GB/s median [min-max]>", "read / raw>", "CPU s/GB write>",
                     "CPU s/GB read>", "disk/logical w, r>", "page cache", "notes"], rows)


def check_targets(summary):
    """The targets: native >= 0.9x raw both ways, ahead of every peer measured."""
    raw = summary.get("raw")
    if not raw or raw.get("failed"):
        return []
    out = []
    peers = {c: s for c, s in summary.items() if c in PEERS and not s.get("failed")}
    for config in ("native-uring", "native-threads"):
        s = summary.get(config)
        if not s or s.get("failed"):
            continue
        for phase in ("write", "read"):
            ratio = s[phase]["ratio_to_raw"]
            out.append((f"{config} {phase} >= {TARGET_RAW_RATIO:.1f}x raw", f"{ratio:.2f}x",
                        ratio >= TARGET_RAW_RATIO))
            if peers:
                mine = s[phase]["gb_per_s_median"]
                best = max(peers, key=lambda c: peers[c][phase]["gb_per_s_median"])
                theirs = peers[best][phase]["gb_per_s_median"]
                out.append((f"{config} {phase} ahead of every peer",
                            f"{mine:.2f} vs best peer {best} {theirs:.2f} GB/s", mine > theirs))
    return out


def build_parser():
    p = argparse.ArgumentParser(
        description="Sequential write+read bandwidth and CPU cost of ssdtrain's I/O engines "
                    "against the raw device (fio/dd O_DIRECT), torch.save/torch.load and "
                    "DeepSpeed aio_handle. Prints a markdown table, writes JSON.")
    p.add_argument("--size", type=parse_size, default=2 * GiB,
                   help="bytes written and read per configuration and repeat (default 2GiB; "
                        "a multiple of 4096)")
    p.add_argument("--record-size", type=parse_size, default=64 * MiB,
                   help="bytes per record: one torch tensor, one engine request, one "
                        "torch.save file (default 64MiB)")
    p.add_argument("--repeats", type=int, default=3,
                   help="fresh processes per configuration, order rotated per repeat (default 3)")
    p.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS),
                   help="configurations (default all; deepspeed_aio runs only where usable, "
                        "raw is needed for ratios)")
    p.add_argument("--dir",
                   help="directory to write in, on the device to measure (default: a fresh "
                        "directory under the system temp dir, removed at the end)")
    p.add_argument("--io-threads", type=int, default=4,
                   help="engine worker threads; DeepSpeed intra_op_parallelism (default 4, "
                        "ssdtrain's default)")
    p.add_argument("--chunk-size", type=parse_size, default=16 * MiB,
                   help="engine io_chunk_bytes; fio/dd block size; DeepSpeed block size "
                        "(default 16MiB, ssdtrain's default)")
    p.add_argument("--queue-depth", type=int, default=1,
                   help="requests in flight per fio job and per DeepSpeed thread (fio --iodepth, "
                        "aio_handle queue_depth; default 1: like each engine worker)")
    p.add_argument("--raw-tool", choices=("auto", "fio", "dd"), default="auto",
                   help="raw reference: fio if installed (auto), else dd")
    p.add_argument("--fio-ioengine", default="libaio", help="fio --ioengine (default libaio)")
    p.add_argument("--direct-io", choices=("auto", "on", "off"), default="auto",
                   help="spill files' O_DIRECT mode, as OffloadConfig.direct_io (default auto)")
    p.add_argument("--cold-read-buffers", action="store_true",
                   help="read into freshly mapped (never touched) buffers: page faults count")
    p.add_argument("--with-deepspeed-aio", action="store_true",
                   help="load DeepSpeed's async_io op even when it is not prebuilt (JIT build, "
                        "minutes; needs libaio-dev and ninja)")
    p.add_argument("--json", default=DEFAULT_JSON,
                   help="where to write every raw number (default benchmarks/results/"
                        "io_bandwidth.json)")
    add_worker_arguments(p)
    p.add_argument("--inject-corruption", choices=CONFIGS, help=argparse.SUPPRESS)
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.worker == "probe":
        return probe(json.loads(args.worker_config), args.worker_out)
    if args.worker:
        return worker(args.worker, json.loads(args.worker_config), args.worker_out)

    if args.repeats < 1 or args.io_threads < 1 or args.queue_depth < 1:
        raise SystemExit("io_bandwidth: --repeats, --io-threads and --queue-depth must be >= 1")
    if args.size <= 0 or args.size % BLOCK or args.record_size <= 0:
        raise SystemExit(f"io_bandwidth: --size must be a positive multiple of {BLOCK} bytes "
                         f"(O_DIRECT), got {args.size}; --record-size must be positive")
    if args.chunk_size <= 0 or args.chunk_size % BLOCK:
        raise SystemExit(f"io_bandwidth: --chunk-size must be a positive multiple of {BLOCK}")
    raw_tool = args.raw_tool
    if raw_tool == "auto":
        raw_tool = "fio" if shutil.which("fio") else "dd"
    elif not shutil.which(raw_tool):
        raise SystemExit(f"io_bandwidth: --raw-tool {raw_tool} is not installed")

    directory, own_dir = work_dir(args.dir, "ssdtrain-iobench-", "io_bandwidth", "--dir")
    free = shutil.disk_usage(directory).free
    if free < 2 * args.size:
        raise SystemExit(f"io_bandwidth: {directory} has {free / GiB:.1f} GiB free; need 2x "
                         f"--size ({2 * args.size / GiB:.1f} GiB). Use a smaller --size or "
                         f"another --dir.")

    env = worker_env(REPO_ROOT)
    device = block_device_of(directory)
    cfg = {"size": args.size, "record_bytes": args.record_size, "dir": directory,
           "io_threads": args.io_threads, "chunk_bytes": args.chunk_size,
           "queue_depth": args.queue_depth,
           "raw_tool": raw_tool,
           "fio_ioengine": args.fio_ioengine, "direct_io": args.direct_io,
           "cold_read_buffers": args.cold_read_buffers,
           "with_deepspeed_aio": args.with_deepspeed_aio, "device": device,
           "configs": args.configs, "inject_corruption": args.inject_corruption}

    command = command_line()
    runs, skipped = [], {}
    try:
        probed = _spawn("probe", cfg, env)
        if "error" in probed or probed.get("error"):
            raise SystemExit(f"io_bandwidth: probing {directory} failed: "
                             f"{probed.get('error')} {probed.get('stderr', '')}")
        if args.direct_io == "on" and not probed.get("direct"):
            raise SystemExit(f"io_bandwidth: --direct-io on, but {directory} "
                             f"({filesystem_type(directory)}) refuses O_DIRECT; use another "
                             f"--dir or --direct-io auto")
        # raw follows the engines: O_DIRECT where the file system takes it, unless "off".
        cfg["direct_supported"] = bool(probed.get("direct")) and args.direct_io != "off"
        configs = []
        for config in args.configs:
            if config in ("native-uring", "native-threads") and not probed.get("native"):
                skipped[config] = f"native engine not built ({probed.get('native_reason')})"
            elif config == "native-uring" and not probed.get("uring"):
                skipped[config] = f"io_uring unusable here ({probed.get('uring_reason')})"
            elif config == "deepspeed_aio" and not probed.get("deepspeed") \
                    and not args.with_deepspeed_aio:
                skipped[config] = f"DeepSpeed aio_handle {probed.get('deepspeed_reason')}"
            elif config == "deepspeed_aio" and not probed.get("direct"):
                skipped[config] = "DeepSpeed aio_handle always opens files with O_DIRECT, " \
                                  "which this file system refuses"
            else:
                configs.append(config)
        fstype = filesystem_type(directory)
        machine = {"cpu_count": os.cpu_count(), "python": platform.python_version(),
                   "platform": platform.platform(), "dir": directory, "fs": fstype,
                   "block_device": device, "direct_io_supported": probed.get("direct"),
                   "raw_tool": raw_tool,
                   "raw_tool_version": subprocess.run([raw_tool, "--version"],
                                                      stdout=subprocess.PIPE,
                                                      stderr=subprocess.STDOUT, text=True
                                                      ).stdout.splitlines()[0:1],
                   "loadavg_start": os.getloadavg()}
        if fstype in ("tmpfs", "ramfs"):
            print(f"io_bandwidth: WARNING: {directory} is on {fstype} (RAM): no device is "
                  f"measured. Pass --dir on the SSD.", file=sys.stderr)

        total = args.repeats * len(configs)
        update, write, close = progress(total)
        try:
            for repeat in range(args.repeats):
                k = repeat % max(1, len(configs))
                for config in configs[k:] + configs[:k]:
                    os.sync()  # earlier dirty data is not written back during this run
                    result = _spawn(config, dict(cfg, repeat=repeat, seed=repeat), env)
                    result["repeat"] = repeat
                    runs.append(result)
                    if "error" in result:
                        write(f"repeat {repeat + 1} {config}: FAILED ({result['error']})\n"
                              f"{result.get('stderr', '')}")
                    else:
                        w, r = result["phases"]["write"], result["phases"]["read"]
                        write(f"repeat {repeat + 1}/{args.repeats} {config:<14} write "
                              f"{w['gb_per_s']:.2f} GB/s, read {r['gb_per_s']:.2f} GB/s "
                              f"({result['wall_s']:.0f} s wall)")
                    update(1)
        finally:
            close()
        machine["loadavg_end"] = os.getloadavg()
    finally:
        if own_dir:
            shutil.rmtree(directory, ignore_errors=True)

    summary = summarize(runs, configs)
    targets = check_targets(summary)
    print(f"## io_bandwidth: {_size_text(args.size)} sequential write then read, records of "
          f"{_size_text(args.record_size)}, {args.repeats} repeats, {args.io_threads} I/O "
          f"threads, chunk {_size_text(args.chunk_size)}")
    print()
    print(render_table(summary, configs, skipped))
    print()
    print("GB = 10^9 bytes. GB/s: medians over repeats [min-max]; ratios are of medians. CPU "
          "s/GB: CPU time of the whole process (all threads) during the phase, per GB moved "
          "(fio: its own usr+sys share of the job; dd: the child's rusage). disk/logical: bytes "
          "the process sent to / fetched from the block layer over the bytes written / read "
          "(below 1.0: the page cache served part).")
    busy = max((p["other_cpu_share"] for r in runs if "error" not in r
                for p in r["phases"].values()), default=0.0)
    other_io = max((p.get("other_device_bytes", 0) for r in runs if "error" not in r
                    for p in r["phases"].values()), default=0)
    print(f"Other activity during the timed phases: at most {busy:.0%} of the CPUs used by other "
          f"processes; at most {other_io / MiB:.0f} MiB of other I/O on {device or '?'} in one "
          f"phase (load average {machine['loadavg_start'][0]:.2f} at start, "
          f"{machine['loadavg_end'][0]:.2f} at end).")
    print(f"Machine: {machine['cpu_count']} CPUs, python {machine['python']}, dir {directory} on "
          f"{fstype or '?'} ({device or '?'}), O_DIRECT "
          f"{'yes' if probed.get('direct') else 'no'}; raw tool "
          f"{' '.join(machine['raw_tool_version']) or raw_tool}")
    print(f"Command: {command}")
    if targets:
        print()
        print("Targets (reported, not asserted):")
        for name, value, met in targets:
            print(f"- {name}: {value} -> {'met' if met else 'NOT met'}")

    return finish("io_bandwidth", args.json,
                  {"command": command, "machine": machine, "settings": cfg,
                   "configs": configs, "skipped": skipped, "probe": probed,
                   "targets": [{"name": n, "value": v, "met": m} for n, v, m in targets],
                   "summary": summary, "runs": runs},
                  [f"{r['config']}#{r['repeat']} ({r['error']})" for r in runs if "error" in r])


if __name__ == "__main__":
    sys.exit(main())
