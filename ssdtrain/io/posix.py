"""The ``posix`` engine: ``pwrite``/``preadv`` on a bounded thread pool.

The reference implementation. ``os.pwrite``/``os.preadv`` release the GIL, so
workers overlap with the training thread. On ``O_DIRECT`` files a record's file
offset is congruent to its address modulo ``BLOCK`` (NOTE [ Zero-copy O_DIRECT
from unaligned tensors ]): the aligned middle of a buffer moves straight
between the tensor's memory and the disk, and only the partial first and last
blocks pass through a small per-thread bounce buffer. On buffered files a write
ends with ``sync_file_range`` of its own blocks and ``POSIX_FADV_DONTNEED`` so
written data does not stay in the page cache (NOTE [ Range sync in buffered mode ]
in ``csrc/engine/engine.cpp``: not ``fdatasync``, which waits for the whole shared
spill file and flushes the device cache per record); a read ends with
``POSIX_FADV_DONTNEED``.
"""

import ctypes
import errno
import mmap
import os
import threading
from concurrent.futures import Future

from .._errors import SpillIOError
from .._align import BLOCK, align_down, align_up
from .base import Capabilities, Engine, abandoned, io_error, start_pool

__all__ = ["PosixEngine"]


def memory_at(address: int, nbytes: int) -> memoryview:
    """A writable byte view of ``nbytes`` at ``address``; the caller keeps the memory alive."""
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


class _Request:
    """One engine request split into pieces; completes its future when the last piece ends.

    Every piece queued holds it, and it holds ``owner`` (NOTE [ Requests own their
    memory ] in base.py): an interrupt after the pool took a piece loses nothing a piece
    can touch. The last piece lets go of ``owner`` before it settles the future."""

    __slots__ = ("future", "remaining", "error", "lock", "file", "offset", "nbytes", "on_done",
                 "owner")

    def __init__(self, file, offset, nbytes, pieces, on_done, owner):
        self.future = Future()
        self.future.set_running_or_notify_cancel()
        self.remaining = pieces
        self.error = None
        self.lock = threading.Lock()
        self.file, self.offset, self.nbytes = file, offset, nbytes
        self.on_done = on_done
        self.owner = owner

    def piece_done(self, error):
        with self.lock:
            if error is not None and self.error is None:
                self.error = error
            self.remaining -= 1
            last = self.remaining == 0
        if not last:
            return
        if self.error is None and self.on_done is not None:
            try:
                self.on_done(self)
            except OSError as e:
                self.error = SpillIOError(
                    f"ssdtrain: flushing {self.nbytes} bytes at offset {self.offset} of "
                    f"{self.file.name} out of the page cache failed: {e.strerror or e} (errno "
                    f"{e.errno}). Check the device's health.", errno=e.errno,
                    filename=self.file.directory)
        self.owner = None  # every piece has ended: the memory is the owner's again
        if self.error is None:
            self.future.set_result(self.nbytes)
        else:
            self.future.set_exception(self.error)


class PosixEngine(Engine):
    """Thread-pool engine over ``os.pwrite``/``os.preadv``.

    Args:
        io_threads: worker threads, all started here.
        chunk_bytes: requests are split at addresses that are multiples of this
            (a multiple of ``BLOCK``) so several workers share a large request.

    Raises:
        ResourceError: a worker thread could not be started.
    """

    name = "posix"
    capabilities = Capabilities()  # NOTE [ Engine capabilities ] in base.py

    def __init__(self, *, io_threads: int = 4, chunk_bytes: int = 16 << 20):
        self.chunk_bytes = chunk_bytes
        self._pool = start_pool(io_threads, "ssdtrain-io", "posix engine")  # or ResourceError
        self._local = threading.local()
        self._abandoned = False

    def write(self, file, offset, address, nbytes, *, owner=None):
        return self._submit(self._write_piece, file, offset, address, nbytes,
                            None if file.direct else _drop_from_page_cache, owner)

    def read(self, file, offset, address, nbytes, *, owner=None):
        return self._submit(self._read_piece, file, offset, address, nbytes,
                            None if file.direct else _drop_clean_pages, owner)

    def shutdown(self):
        if self._abandoned:
            return
        self._pool.shutdown(wait=True)

    def abandon(self):
        """In a forked child: the pool's threads do not exist here, and its lock may have
        been copied held, so the pool is not touched again (not even shut down): it is
        dropped, with the pieces queued before the fork, which never run."""
        if getattr(self, "_abandoned", True):  # done already, or __init__ did not finish
            return
        self._abandoned = True
        self._pool = None

    def _submit(self, fn, file, offset, address, nbytes, on_done, owner):
        if self._abandoned:
            return abandoned(self, "writing" if fn == self._write_piece else "reading", file,
                             offset, nbytes)
        if file.direct and offset % BLOCK != address % BLOCK:
            raise AssertionError(f"ssdtrain: O_DIRECT request with offset {offset} not congruent "
                                 f"to address {address:#x} modulo {BLOCK}; please report.")
        pieces = []
        start = address
        while start < address + nbytes:
            end = min(align_down(start + self.chunk_bytes, self.chunk_bytes), address + nbytes)
            pieces.append((start, end))
            start = end
        if not pieces:
            pieces = [(address, address)]
        req = _Request(file, offset, nbytes, len(pieces), on_done, owner)
        for a, b in pieces:
            self._pool.submit(self._run, fn, req, file, offset + (a - address), a, b - a)
        return req.future

    def _run(self, fn, req, file, offset, address, nbytes):
        try:
            fd = file.fd
            if fd < 0:
                raise OSError(9, "spill file already closed")
            fn(fd, file.direct, offset, address, nbytes)
        except OSError as e:
            verb = "writing" if fn == self._write_piece else "reading"
            req.piece_done(io_error(verb, file, offset, nbytes, e.errno, e.strerror or str(e)))
            return
        except BaseException as e:  # never leave a future pending: a waiter would hang
            req.piece_done(e)
            return
        req.piece_done(None)

    def _bounce(self) -> memoryview:
        buf = getattr(self._local, "buf", None)
        if buf is None:
            self._local.mm = mmap.mmap(-1, BLOCK)  # page aligned, as O_DIRECT needs
            buf = self._local.buf = memoryview(self._local.mm)
        return buf

    def _write_piece(self, fd, direct, offset, address, nbytes):
        self._piece(True, fd, direct, offset, address, nbytes)

    def _read_piece(self, fd, direct, offset, address, nbytes):
        self._piece(False, fd, direct, offset, address, nbytes)

    def _piece(self, write, fd, direct, offset, address, nbytes):
        move = _pwrite_all if write else _preadv_all
        if not direct:
            move(fd, memory_at(address, nbytes), offset)
            return
        # O_DIRECT: the partial first and last blocks pass through the bounce buffer
        # (a whole block each: the slot owns every block it touches), the aligned
        # middle moves in place.
        end = address + nbytes
        lo, hi = align_up(address), align_down(end)
        if lo > hi:  # starts and ends inside one block
            lo = hi = end
        for edge_start, edge_end in ((address, lo), (hi, end)):
            if edge_start < edge_end:
                block = align_down(edge_start)
                bounce = self._bounce()
                inside = slice(edge_start - block, edge_end - block)
                memory = memory_at(edge_start, edge_end - edge_start)
                if write:
                    bounce[inside] = memory
                    _pwrite_all(fd, bounce, offset + (block - address))
                else:
                    _preadv_all(fd, bounce, offset + (block - address))
                    memory[:] = bounce[inside]
        if lo < hi:
            move(fd, memory_at(lo, hi - lo), offset + (lo - address))


def _pwrite_all(fd, view, offset):
    done = 0
    while done < len(view):
        n = os.pwrite(fd, view[done:], offset + done)
        if n <= 0:
            raise OSError(5, f"short write ({done} of {len(view)} bytes)")
        done += n


def _preadv_all(fd, view, offset):
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            # End of file: see ssdtrain.io.base.io_error (ENODATA -> IntegrityError).
            raise OSError(errno.ENODATA, f"short read ({done} of {len(view)} bytes): spill data "
                                         f"truncated")
        done += n


# sync_file_range(2) flags (<fcntl.h>): start writeback of the range and wait for it.
_SYNC_RANGE_FLAGS = 1 | 2 | 4  # WAIT_BEFORE | WRITE | WAIT_AFTER


def _libc_sync_file_range():
    """libc's ``sync_file_range`` (ctypes releases the GIL around it), or ``None``."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # not Linux/glibc: fdatasync below
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _libc_sync_file_range()


def _sync_range(fd, start, nbytes):
    """Write out the dirty pages of ``[start, start + nbytes)`` and wait for them."""
    if _sync_file_range is None:
        os.fdatasync(fd)
        return
    if nbytes > 0 and _sync_file_range(fd, start, nbytes, _SYNC_RANGE_FLAGS) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"sync_file_range: {os.strerror(err)}")


def _drop_from_page_cache(req):
    # Buffered files: write the record's own blocks out, then let the kernel drop its
    # pages, so spilled activations really leave RAM (DONTNEED skips dirty pages).
    start = align_down(req.offset)
    _sync_range(req.file.fd, start, align_up(req.offset + req.nbytes) - start)
    _drop_clean_pages(req)


def _drop_clean_pages(req):
    # Advise whole blocks: DONTNEED ignores partial pages at the ends of the range,
    # and the slot owns every block it touches.
    start = align_down(req.offset)
    os.posix_fadvise(req.file.fd, start, align_up(req.offset + req.nbytes) - start,
                     os.POSIX_FADV_DONTNEED)
