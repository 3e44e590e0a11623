"""Multi-rank runs: one spill subdirectory per rank, and an all-ranks summary of the stats.

Ranks of one job often share a disk (several GPUs of a node, one NVMe array), and
spill directories are given once for the whole job. :func:`rank_spill_dir` turns
such a directory into this rank's own subdirectory, named from the host, the
global rank and the local rank, so no two ranks ever open files in the same
place. :func:`summarize` all-reduces every rank's :class:`ssdtrain.Stats` into
one for the whole job.

Example::

    import torch.distributed as dist
    import ssdtrain
    from ssdtrain.integrations.distributed import rank_spill_dir, summarize

    dist.init_process_group("nccl")
    off = ssdtrain.Offloader(spill_dir=rank_spill_dir("/nvme/ssdtrain"))
    ...
    off.wait()
    total = summarize(off)            # a collective: every rank calls it
    if dist.get_rank() == 0:
        print(total.summary())
"""

import dataclasses
import os
import re
import socket
import stat
from typing import List, Optional, Sequence, Tuple, Union

import torch

import ssdtrain

__all__ = ["rank_identity", "rank_spill_dir", "rank_subdir_name", "summarize"]

PathLike = Union[str, os.PathLike]


def rank_identity() -> Tuple[str, int, int]:
    """``(host, rank, local_rank)`` of this process.

    ``rank`` is ``torch.distributed.get_rank()`` once the default process group is
    initialized, else the ``RANK`` environment variable, else 0. ``local_rank`` is
    ``LOCAL_RANK`` (set by torchrun and the DeepSpeed launcher), else
    ``OMPI_COMM_WORLD_LOCAL_RANK``, else 0. ``host`` is ``socket.gethostname()``.

    Raises:
        ssdtrain.ConfigError: ``RANK`` or ``LOCAL_RANK`` is set but not an integer.
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        rank = torch.distributed.get_rank()
    else:
        rank = _env_int("RANK")
    local_rank = _env_int("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK")
    return socket.gethostname(), rank, local_rank


def rank_subdir_name(host: str, rank: int, local_rank: int) -> str:
    """The subdirectory name of one rank: ``"<host>-rank<rank>-local<local_rank>"``.

    Characters of ``host`` other than letters, digits, ``.``, ``_`` and ``-`` become
    ``_``, so the name is always one path component.
    """
    host = re.sub(r"[^A-Za-z0-9._-]", "_", host).strip(".") or "host"
    return f"{host}-rank{int(rank)}-local{int(local_rank)}"


def rank_spill_dir(spill_dir: Union[PathLike, Sequence[PathLike]], *, host: Optional[str] = None,
                   rank: Optional[int] = None, local_rank: Optional[int] = None,
                   create: bool = True) -> Union[str, List[str]]:
    """This rank's own subdirectory of ``spill_dir`` (of each directory, for a list).

    The subdirectory is named by :func:`rank_subdir_name` from (host, rank, local
    rank), given or taken from :func:`rank_identity`, and created private
    (mode 0700) when missing, so it can be passed straight to
    :class:`ssdtrain.OffloadConfig`. Spill files are anonymous, so the
    subdirectory stays empty; it is left in place and reused by the next run.

    Args:
        spill_dir: one directory, or a list of directories (one per device).
        host: the host name to use. Default: ``socket.gethostname()``.
        rank: the global rank to use. Default: see :func:`rank_identity`.
        local_rank: the local rank to use. Default: see :func:`rank_identity`.
        create: create missing subdirectories. Default True.

    Returns:
        A path for a path, a list of paths for a list (absolute, in the same order).

    Raises:
        ssdtrain.ConfigError: ``spill_dir`` is empty, does not exist or is not a
            directory, or the subdirectory exists as something other than a
            directory (a symlink, say) or cannot be created.

    Example::

        >>> rank_spill_dir("/nvme/ssdtrain", host="node7", rank=9, local_rank=1, create=False)
        '/nvme/ssdtrain/node7-rank9-local1'
    """
    single = isinstance(spill_dir, (str, os.PathLike))
    dirs = [spill_dir] if single else list(spill_dir)
    if not dirs:
        raise ssdtrain.ConfigError("ssdtrain: rank_spill_dir() got an empty list of spill "
                                   "directories; give at least one directory.")
    if host is None or rank is None or local_rank is None:
        env_host, env_rank, env_local = rank_identity()
        host = env_host if host is None else host
        rank = env_rank if rank is None else rank
        local_rank = env_local if local_rank is None else local_rank
    name = rank_subdir_name(host, rank, local_rank)
    out = []
    for d in dirs:
        base = os.path.abspath(os.fspath(d))
        path = os.path.join(base, name)
        if create:
            _make_private_dir(base, path)
        out.append(path)
    return out[0] if single else out


def summarize(offloader: "ssdtrain.Offloader", group=None) -> "ssdtrain.Stats":
    """All ranks' :class:`ssdtrain.Stats` in one: counters summed, peaks (``peak_*``,
    ``budget_*``) maxed.

    A collective over ``group``: every rank of it must call it, at the same point.
    Numeric fields are all-reduced (a sum, seconds included; the maximum for fields
    named ``peak_*``, and ``budget_*``: a step's peak against each rank's own
    ``memory_budget_bytes``); ``engine`` is this rank's. Without an initialized process
    group it returns this rank's stats. Call ``offloader.wait()`` first for write
    counters that include every write submitted (they count at completion).

    Args:
        offloader: this rank's offloader.
        group: the process group. Default None: the default (world) group.

    Returns:
        A new :class:`ssdtrain.Stats` for the whole group.
    """
    local = offloader.stats()
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return local
    numeric = [f.name for f in dataclasses.fields(local)
               if isinstance(getattr(local, f.name), (int, float))
               and not isinstance(getattr(local, f.name), bool)]
    peaks = [n for n in numeric if n.startswith(("peak_", "budget_"))]
    summed = [n for n in numeric if n not in peaks]
    device = _collective_device(group)
    # float64 holds every byte count below 2**53 (8 PiB) exactly.
    values = {}
    for names, op in ((summed, dist.ReduceOp.SUM), (peaks, dist.ReduceOp.MAX)):
        if not names:
            continue
        t = torch.tensor([float(getattr(local, n)) for n in names], dtype=torch.float64,
                         device=device)
        dist.all_reduce(t, op=op, group=group)
        values.update(zip(names, t.tolist()))
    out = dataclasses.replace(local)
    for n, v in values.items():
        setattr(out, n, int(round(v)) if isinstance(getattr(local, n), int) else v)
    return out


def _collective_device(group):
    backend = torch.distributed.get_backend(group)
    if "nccl" in str(backend).lower():  # NCCL reduces device tensors only
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _env_int(*names):
    for name in names:
        raw = os.environ.get(name)
        if raw is None or raw == "":
            continue
        try:
            return int(raw)
        except ValueError:
            raise ssdtrain.ConfigError(f"ssdtrain: environment variable {name} must be an integer "
                                       f"rank, got {raw!r}; fix or unset it.") from None
    return 0


def _make_private_dir(base, path):
    if not os.path.isdir(base):
        raise ssdtrain.ConfigError(f"ssdtrain: spill_dir {base!r} does not exist or is not a "
                                   f"directory; create it first (one per NVMe device).")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise ssdtrain.ConfigError(f"ssdtrain: cannot create this rank's spill directory "
                                   f"{path!r}: {e.strerror} (errno {e.errno}); check that "
                                   f"spill_dir is writable.") from e
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ssdtrain.ConfigError(f"ssdtrain: this rank's spill directory {path!r} exists but is "
                                   f"not a directory (a symlink or a file); ssdtrain never follows "
                                   f"links there. Remove it or choose another spill_dir.")
