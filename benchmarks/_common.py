"""Helpers shared by the benchmark scripts (``step_overhead.py``, ``gpu_smoke.py``,
``io_bandwidth.py``).

Not a benchmark itself. The scripts run as ``python benchmarks/<script>.py`` (and
re-run themselves with a hidden ``--worker`` flag); each puts this directory on
``sys.path`` before ``import _common``, so it imports the same way however the
script was started.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

MiB = 1 << 20
KiB = 1 << 10


# --------------------------------------------------------------------------- /proc readers
def proc_status(*keys):
    """The ``/proc/self/status`` fields ``keys`` (kB values), in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in keys:
                out[name] = int(rest.split()[0]) * 1024
    return out


def reset_peak_rss(ignore_errors=False):
    """Reset ``VmHWM`` to the current RSS (Linux >= 4.0: ``echo 5 > /proc/self/clear_refs``).

    With ``ignore_errors`` an ``OSError`` (a kernel without it) is swallowed, and the
    peak then stays the peak since process start.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        if not ignore_errors:
            raise


def mount_of(path):
    """``(device, mount point, fstype)`` of the mount holding ``path`` (``""`` each if unknown).

    The longest mount point that is ``path`` or one of its parents wins; among equal
    ones the last mounted, as the kernel resolves it.
    """
    try:
        with open("/proc/self/mounts") as f:
            mounts = [line.split()[:3] for line in f if len(line.split()) >= 3]
    except OSError:
        return "", "", ""
    path = os.path.realpath(path)
    best = ("", "", "")
    for device, point, fstype in mounts:
        point = point.replace("\\040", " ")
        if (path == point or path.startswith(point.rstrip("/") + "/")) \
                and len(point) >= len(best[1]):
            best = (device, point, fstype)
    return best


# ----------------------------------------------------------------------------------- worker
def _tensor_sha256(t):
    """SHA-256 of a tensor's dtype, shape and bytes (copied to CPU first if it is not there)."""
    t = t.detach().to("cpu").contiguous()
    h = hashlib.sha256(str((t.dtype, tuple(t.shape))).encode())
    n = t.numel() * t.element_size()
    if n:
        h.update(memoryview((ctypes.c_char * n).from_address(t.data_ptr())))
    return h.hexdigest()


def digest(loss, named_parameters, loss_sha256=False):
    """SHA-256 of the loss and of each gradient (by name): bitwise equality, cheaply.

    ``named_parameters`` is an iterable of ``(name, parameter)`` (e.g.
    ``model.named_parameters()``); ``grads`` keeps its order, while the combined
    ``sha256`` always goes over the names sorted. ``loss_sha256`` adds the loss's own
    hash to the result.
    """
    grads = {name: (_tensor_sha256(p.grad) if p.grad is not None else None)
             for name, p in named_parameters}
    loss_hash = _tensor_sha256(loss)
    total = hashlib.sha256(loss_hash.encode())
    for name in sorted(grads):
        total.update(f"{name}={grads[name]}".encode())
    out = {"loss": float(loss)}
    if loss_sha256:
        out["loss_sha256"] = loss_hash
    out.update(sha256=total.hexdigest(), grads=grads)
    return out


# Stats fields that are not running totals: maxima (``peak_*``) and levels held now.
def stats_delta(after, before):
    """Per-step ``Stats`` (as dicts, numbers only): counters as differences; levels and
    maxima (``ssdtrain.Stats.LEVELS``: ``peak_*``, ``host_bytes``, ``budget_*``...) as
    they are after the step (``Stats.since`` on dicts)."""
    import ssdtrain
    return {k: (v if k in ssdtrain.Stats.LEVELS else v - before[k])
            for k, v in after.items() if isinstance(v, (int, float))}


def jsonable_config(config):
    """A dataclass (an ``OffloadConfig``) as a dict of JSON values (others as ``str``)."""
    import dataclasses
    return {k: (v if isinstance(v, (int, float, str, type(None))) else str(v))
            for k, v in dataclasses.asdict(config).items()}


# ----------------------------------------------------------------------------------- parent
def median(xs):
    """The median of ``xs``; NaN when it is empty."""
    return statistics.median(xs) if xs else float("nan")


def measured(run):
    """The steps of one worker's result that were not warm-up steps."""
    return [s for s in run["steps"] if not s["warmup"]]


def progress(total, use_tqdm=True):
    """``(update, write, close)`` for ``total`` runs: a tqdm bar on a terminal, else lines.

    Without a terminal, without tqdm or with ``use_tqdm=False``, ``write`` prints
    ``[done/total] msg`` lines to stderr and ``close`` does nothing.
    """
    tqdm = None
    if use_tqdm:
        try:
            from tqdm import tqdm
        except ImportError:
            tqdm = None
    if tqdm is not None and sys.stderr.isatty():
        bar = tqdm(total=total, unit="run", file=sys.stderr)
        return bar.update, bar.write, bar.close

    done = [0]

    def update(n=1):
        done[0] += n

    def write(msg):
        print(f"[{done[0]}/{total}] {msg}", file=sys.stderr, flush=True)

    return update, write, lambda: None


def worker_env(repo_root):
    """The environment for worker processes: ``repo_root`` first on ``PYTHONPATH``.

    Also ``PYTHONWARNINGS=ignore`` unless set (torch warns when NumPy is absent).
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([repo_root] + [p for p in
                                                       env.get("PYTHONPATH", "").split(os.pathsep)
                                                       if p])
    env.setdefault("PYTHONWARNINGS", "ignore")
    return env


def spawn_worker(script, prefix, kind, cfg, env, timeout=None):
    """Run ``script --worker kind`` in a fresh process; ``(proc, wall seconds, its JSON text)``.

    The worker gets ``cfg`` as ``--worker-config`` JSON and writes its result to a
    temporary ``--worker-out`` file (named ``{prefix}-{kind}-*.json``), whose text
    (``""`` if it wrote nothing) is returned and which is removed afterwards.
    ``proc`` is the ``subprocess.CompletedProcess`` (stdout and stderr captured).
    ``timeout`` (seconds, None: none): a worker still running then is killed, and
    ``proc`` has return code -9 and what it had printed.
    """
    fd, out_path = tempfile.mkstemp(prefix=f"{prefix}-{kind}-", suffix=".json")
    os.close(fd)
    try:
        cmd = [sys.executable, os.path.abspath(script), "--worker", kind,
               "--worker-config", json.dumps(cfg), "--worker-out", out_path]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            def text_of(b):
                return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
            proc = subprocess.CompletedProcess(
                cmd, -9, text_of(e.stdout),
                text_of(e.stderr) + f"\n(killed after {timeout:.0f} s: the time limit)")
        wall = time.perf_counter() - t0
        with open(out_path) as f:
            text = f.read()
        return proc, wall, text
    finally:
        os.unlink(out_path)


def run_worker(script, prefix, mode, repeat, cfg, env):
    """One (mode, repeat) run of ``script``'s worker: its result with ``wall_s``.

    A worker that exits non-zero gives ``{"mode", "repeat", "error", "stderr",
    "wall_s"}`` instead.
    """
    proc, wall, text = spawn_worker(script, prefix, mode, dict(cfg, repeat=repeat), env)
    if proc.returncode != 0:
        return {"mode": mode, "repeat": repeat, "error": f"exit {proc.returncode}",
                "stderr": proc.stderr[-8000:], "wall_s": wall}
    result = json.loads(text)
    result["wall_s"] = wall
    return result


def command_line():
    """This process's command line as a shell would take it (the interpreter relative to
    the working directory when it lies below it)."""
    return shlex.join([os.path.relpath(sys.executable) if sys.executable.startswith(os.getcwd())
                       else sys.executable] + sys.argv)


def work_dir(given, prefix, script, option):
    """``(directory, own)``: ``given`` made absolute, or a fresh temporary one (``own``).

    Exits with ``{script}: {option} ... is not a directory`` when ``given`` is not one.
    """
    own = given is None
    directory = tempfile.mkdtemp(prefix=prefix) if own else os.path.abspath(given)
    if not os.path.isdir(directory):
        raise SystemExit(f"{script}: {option} {directory!r} is not a directory")
    return directory, own


def model_from_args(args, preset, offload_preset, use_preset_offload):
    """The model shape: ``preset`` overridden by the options given; ``offload_preset``.

    When ``use_preset_offload`` (``--tiny`` / ``--small``), the ``offload_preset``
    options not given on the command line are set on ``args``.
    """
    model = {k: (getattr(args, k) if getattr(args, k) is not None else v)
             for k, v in preset.items()}
    if use_preset_offload:
        for k, v in offload_preset.items():
            if getattr(args, k) is None:
                setattr(args, k, v)
    return model


def offload_overrides(args):
    """``OffloadConfig`` overrides from ``--keep-tail-mib``, ``--prefetch-mib``,
    ``--min-tensor-kib`` and ``--io-threads`` (``None``: not given)."""
    return {
        "keep_tail_bytes": None if args.keep_tail_mib is None else int(args.keep_tail_mib * MiB),
        "prefetch_bytes": None if args.prefetch_mib is None else int(args.prefetch_mib * MiB),
        "min_tensor_bytes": None if args.min_tensor_kib is None else int(args.min_tensor_kib * KiB),
        "io_threads": args.io_threads,
    }


def add_offload_arguments(group, min_tensor_help="OffloadConfig.min_tensor_bytes in KiB"):
    """``--keep-tail-mib``, ``--prefetch-mib``, ``--min-tensor-kib``, ``--io-threads`` on
    ``group`` (read back by :func:`offload_overrides`)."""
    group.add_argument("--keep-tail-mib", type=float, help="OffloadConfig.keep_tail_bytes in MiB")
    group.add_argument("--prefetch-mib", type=float, help="OffloadConfig.prefetch_bytes in MiB")
    group.add_argument("--min-tensor-kib", type=float, help=min_tensor_help)
    group.add_argument("--io-threads", type=int, help="OffloadConfig.io_threads")


def add_worker_arguments(parser, choices=None):
    """The hidden ``--worker KIND``, ``--worker-config``, ``--worker-out`` options that
    :func:`spawn_worker` passes to the script's worker process."""
    import argparse
    parser.add_argument("--worker", choices=choices, help=argparse.SUPPRESS)
    parser.add_argument("--worker-config", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)


def finish(script, json_path, data, failed):
    """Write ``data`` to ``json_path`` (and say where); report ``failed`` runs: exit status.

    Prints ``JSON: path``; when ``failed`` (run descriptions) is not empty, prints
    ``{script}: runs failed: ...`` to stderr and returns 1, else 0.
    """
    os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
    with open(json_path, "w") as f:
        json.dump(data, f, indent=1)
    print(f"JSON: {json_path}")
    if failed:
        print(f"{script}: runs failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


# --------------------------------------------------------------------------- tables
def md_header(columns):
    """A markdown table's first two lines: ``columns`` are the header cells, each ending
    in ``">"`` for a right-aligned (numeric) column (the ``">"`` is not shown). Every
    benchmark's tables start here (or in :func:`md_table`), so they all read alike."""
    head = [c[:-1] if c.endswith(">") else c for c in columns]
    rule = ["---:" if c.endswith(">") else "---" for c in columns]
    return "| " + " | ".join(head) + " |\n| " + " | ".join(rule) + " |"


def md_row(cells):
    """One line of a markdown table (cells: strings, or anything ``str()`` takes)."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def md_table(columns, rows):
    """A markdown table, as text (no trailing newline): :func:`md_header` of
    ``columns``, then a :func:`md_row` per row; a row of the wrong length raises.

    >>> print(md_table(["way", "ms>"], [["none", "1.0"]]))
    | way | ms |
    | --- | ---: |
    | none | 1.0 |
    """
    lines = [md_header(columns)]
    for row in rows:
        if len(row) != len(columns):
            raise ValueError(f"md_table: a row of {len(row)} cells for {len(columns)} "
                             f"columns: {list(row)}")
        lines.append(md_row(row))
    return "\n".join(lines)


def cuda_unavailable_reason() -> str:
    """Why this Python cannot use a CUDA device (``""`` when it can): the one check, in
    the same words, of every script that needs a GPU (``gpu_smoke.py``, ``gpu_bench.py``,
    ``tools/gpu_check.py``, ``tools/gpu_trace.py``)."""
    try:
        import torch
    except ImportError as e:
        return f"torch cannot be imported ({e}); install a CUDA build of torch first"
    if torch.version.cuda is None:
        return (f"torch {torch.__version__} is a CPU-only build; a CUDA build of torch and an "
                f"NVIDIA GPU are needed (e.g. pip install torch --index-url "
                f"https://download.pytorch.org/whl/cu124)")
    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return (f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU"
                + (f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else "")
                + "; check the driver with nvidia-smi")
    return ""
