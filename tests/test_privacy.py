"""Privacy and crash safety of spill data (INV-PRIVATE, docs/ARCHITECTURE.md).

NOTE [ Spill directory privacy ] in ssdtrain/io/spill.py says what is guaranteed:
anonymous files that can never get a name, 0600 where a name exists for an instant,
a private 0700 default directory, and refusal of directories (and links) that other
users control. A child killed by SIGKILL mid-step leaves no data behind.
"""

from __future__ import annotations

import ctypes
import errno
import os
import select
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
import torch

import ssdtrain
from ssdtrain import testing
from ssdtrain.io import spill as _spill
from ssdtrain._errors import ConfigError
from ssdtrain.io.spill import SpillFile, default_spill_dir

NOBODY = 65534
is_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chown to another user, "
                                                       "setuid to nobody); run the suite as root")


@pytest.fixture
def shared_dir():
    """A directory outside pytest's 0700 tmp tree (another user can reach its children)."""
    d = tempfile.mkdtemp(prefix="ssdtrain-privacy-", dir="/tmp")
    os.chmod(d, 0o755)
    yield d
    subprocess.run(["rm", "-rf", d], check=False)


# ------------------------------------------------------------------------ files
AT_FDCWD, AT_SYMLINK_FOLLOW, AT_EMPTY_PATH = -100, 0x400, 0x1000


def _linkat(fd, path, new, flags):
    """linkat(2); the errno, or 0 if the file got the name ``new``."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.linkat(fd, path, AT_FDCWD, new.encode(), flags) == 0:
        return 0
    return ctypes.get_errno()


def test_linkat_control(tmp_path):
    """Without O_EXCL an O_TMPFILE file can be named: what the test below rules out."""
    fd = os.open(tmp_path, os.O_RDWR | os.O_TMPFILE, 0o600)
    try:
        assert _linkat(AT_FDCWD, f"/proc/self/fd/{fd}".encode(), str(tmp_path / "named"),
                       AT_SYMLINK_FOLLOW) == 0
        assert os.listdir(tmp_path) == ["named"]
    finally:
        os.close(fd)


@pytest.mark.parametrize("direct_io", ["auto", "off"])
def test_anonymous_file_can_never_be_named(tmp_path, direct_io):
    """O_TMPFILE|O_EXCL: not even this process (root here) can link it into a directory."""
    f = SpillFile(str(tmp_path), direct_io)
    try:
        assert os.fstat(f.fd).st_nlink == 0
        # Both ways of naming an open file (os.link would link /proc's symlink itself).
        assert _linkat(f.fd, b"", str(tmp_path / "a"), AT_EMPTY_PATH) == errno.ENOENT
        assert _linkat(AT_FDCWD, f"/proc/self/fd/{f.fd}".encode(), str(tmp_path / "b"),
                       AT_SYMLINK_FOLLOW) == errno.ENOENT
        assert os.listdir(tmp_path) == []
    finally:
        f.close()


def test_file_mode_is_0600_even_with_umask_0(tmp_path):
    old = os.umask(0)
    try:
        f = SpillFile(str(tmp_path), "auto")
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE(os.fstat(f.fd).st_mode) == 0o600
    finally:
        f.close()


def _named_fallback_file(directory, monkeypatch):
    """A spill file made the fallback way (no O_TMPFILE) whose unlink is skipped, so the
    instant in which it has a name can be inspected. Returns (SpillFile, path)."""
    real_open, names = os.open, []

    def no_tmpfile(path, flags, mode=0o777, *, dir_fd=None):
        if (flags & os.O_TMPFILE) == os.O_TMPFILE:
            raise OSError(errno.EOPNOTSUPP, "Operation not supported")
        return real_open(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(_spill.os, "open", no_tmpfile)
    monkeypatch.setattr(_spill.os, "unlink", lambda path, dir_fd=None: names.append(path))
    old = os.umask(0)
    try:
        f = SpillFile(directory, "off")
    finally:
        os.umask(old)
        monkeypatch.undo()
    (name,) = names
    return f, os.path.join(directory, name)


def test_fallback_name_is_private_and_not_a_link_target(tmp_path, monkeypatch):
    f, path = _named_fallback_file(str(tmp_path), monkeypatch)
    try:
        st = os.lstat(path)
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        assert os.path.basename(path).startswith(".ssdtrain-")
    finally:
        f.close()
        os.unlink(path)


# -------------------------------------------------------------------- directories
@is_root
def test_directory_of_another_user_is_refused(shared_dir):
    d = os.path.join(shared_dir, "theirs")
    os.mkdir(d, 0o755)
    os.chown(d, NOBODY, NOBODY)
    with pytest.raises(ConfigError, match=r"belongs to uid 65534.*Use a directory you own"):
        ssdtrain.Offloader(spill_dir=d)
    assert os.listdir(d) == []


@pytest.mark.parametrize("mode,ok", [(0o777, False), (0o1777, True), (0o775, True),
                                     (0o700, True)])
def test_world_writable_needs_the_sticky_bit(tmp_path, mode, ok):
    d = tmp_path / "spill"
    d.mkdir()
    os.chmod(d, mode)
    if ok:
        ssdtrain.Offloader(spill_dir=str(d)).close()
    else:
        with pytest.raises(ConfigError, match="world-writable without the sticky bit"):
            ssdtrain.Offloader(spill_dir=str(d))
    assert os.listdir(d) == []


@pytest.mark.parametrize("path", ["/tmp", "/dev/shm"])
def test_sticky_system_directories_are_allowed(path):
    if not os.path.isdir(path):
        pytest.skip(f"no {path}")
    st = os.stat(path)
    assert st.st_mode & stat.S_ISVTX and st.st_mode & stat.S_IWOTH and st.st_uid == 0
    ssdtrain.Offloader(spill_dir=path).close()


@is_root
def test_symlink_of_another_user_is_not_followed(shared_dir):
    target = os.path.join(shared_dir, "target")
    os.mkdir(target, 0o700)
    link = os.path.join(shared_dir, "link")
    os.symlink(target, link)
    os.lchown(link, NOBODY, NOBODY)
    with pytest.raises(ConfigError, match="symbolic link owned by uid 65534"):
        ssdtrain.Offloader(spill_dir=link)
    os.lchown(link, os.geteuid(), os.getegid())  # one's own link is followed
    off = ssdtrain.Offloader(policy="static",
                             spill_dir=link, min_tensor_bytes=4096, keep_tail_bytes=0)
    try:
        x = torch.randn(256, 256, requires_grad=True)
        with off:
            loss = (x * 2).sin().sum()
            off.wait()
        assert off.spill_bytes_in_use() > 0
        loss.backward()
    finally:
        off.close()


def test_default_spill_dir_is_private(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    path = default_spill_dir()
    assert path == str(tmp_path / f"ssdtrain-{os.geteuid()}")
    st = os.lstat(path)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
    os.chmod(path, 0o755)  # loosened by hand: narrowed again
    assert default_spill_dir() == path and stat.S_IMODE(os.lstat(path).st_mode) == 0o700
    off = ssdtrain.Offloader()
    try:
        assert off.config.spill_dir == [path]
    finally:
        off.close()


def test_planted_default_spill_dir_is_refused(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, tmp_path / f"ssdtrain-{os.geteuid()}")
    with pytest.raises(ConfigError, match="planted"):
        ssdtrain.Offloader()


@is_root
def test_planted_default_spill_dir_of_another_user_is_refused(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    planted = tmp_path / f"ssdtrain-{os.geteuid()}"
    planted.mkdir()
    os.chown(planted, NOBODY, NOBODY)
    with pytest.raises(ConfigError, match="owned by uid 65534"):
        default_spill_dir()


# ------------------------------------------------------------- another user id
@is_root
def test_another_user_cannot_open_the_data(shared_dir, monkeypatch):
    """A forked child that drops to uid 65534 can reach none of the spill data: not the
    anonymous file (through /proc/<pid>/fd), not a fallback file in the instant it has a
    name, not the default spill directory's contents."""
    off = ssdtrain.Offloader(policy="static",
                             spill_dir=shared_dir, min_tensor_bytes=4096, keep_tail_bytes=0)
    named, named_path = _named_fallback_file(shared_dir, monkeypatch)
    monkeypatch.setattr(tempfile, "tempdir", shared_dir)
    private = default_spill_dir()
    with open(os.path.join(private, "probe"), "w") as fh:  # something to look for
        fh.write("x")
    try:
        x = torch.randn(256, 256, requires_grad=True)
        with off:
            loss = (x * 2).sin().sum()
            off.wait()
        (fd,) = {f.fd for f in testing.spill(off).files}
        assert off.spill_bytes_in_use() > 0
        targets = {"proc fd": f"/proc/{os.getpid()}/fd/{fd}", "named fallback": named_path,
                   "private dir entry": os.path.join(private, "probe")}
        # Control: this process (root) can open each of them.
        for path in targets.values():
            os.close(os.open(path, os.O_RDONLY))
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: only system calls, then _exit
            os.close(r)
            try:
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                out = []
                for what, path in targets.items():
                    try:
                        os.close(os.open(path, os.O_RDONLY))
                        out.append(f"{what}:OPENED")
                    except OSError as e:
                        out.append(f"{what}:{errno.errorcode.get(e.errno, e.errno)}")
                try:
                    os.listdir(private)
                    out.append("private dir listing:OPENED")
                except OSError as e:
                    out.append(f"private dir listing:{errno.errorcode.get(e.errno, e.errno)}")
                os.write(w, ";".join(out).encode())
            finally:
                os._exit(0)
        os.close(w)
        os.waitpid(pid, 0)
        with os.fdopen(r) as fh:
            report = dict(item.split(":") for item in fh.read().split(";"))
        assert set(report) == set(targets) | {"private dir listing"}, report
        assert all(v in ("EACCES", "EPERM") for v in report.values()), report
        loss.backward()
    finally:
        named.close()
        os.unlink(named_path)
        off.close()


# ----------------------------------------------------------------- crash safety
_CRASH_CHILD = textwrap.dedent("""
    import os, sys, time
    import torch, ssdtrain
    from ssdtrain import testing
    from ssdtrain.io import spill as _spill
    if sys.argv[2] == "no-tmpfile":   # a file system without O_TMPFILE: the fallback path
        real_open = os.open
        def no_tmpfile(path, flags, mode=0o777, *, dir_fd=None):
            if (flags & os.O_TMPFILE) == os.O_TMPFILE:
                raise OSError(95, "Operation not supported")
            return real_open(path, flags, mode, dir_fd=dir_fd)
        _spill.os.open = no_tmpfile
    off = ssdtrain.Offloader(policy="static",
                             spill_dir=sys.argv[1], min_tensor_bytes=4096, keep_tail_bytes=0)
    x = torch.randn(1024, 1024, requires_grad=True)
    with off:
        y = x
        for _ in range(8):            # 8 x 4 MiB saved, written while forward goes on
            y = (y * 1.0001).sin()
        off.wait()
        (fd,) = [f.fd for f in testing.spill(off).files]
        print("READY", fd, off.spill_bytes_in_use(), flush=True)
        time.sleep(600)               # mid-step: SIGKILL arrives here
""")


@pytest.fixture
def spill_fs(tmp_path):
    """A private 64 MiB tmpfs where this process may mount one (its usage is the child's
    alone), else a plain directory."""
    point = tmp_path / "fs"
    point.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,mode=0700", "tmpfs", str(point)],
                       capture_output=True, text=True)
    mounted = r.returncode == 0
    try:
        yield str(point), mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(point)], check=False)


def _used_bytes(path):
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


@pytest.mark.parametrize("how", ["tmpfile", "no-tmpfile"])
def test_sigkill_mid_step_leaves_no_data(spill_fs, how):
    d, mounted = spill_fs
    used_before = _used_bytes(d)
    child = subprocess.Popen([sys.executable, "-c", _CRASH_CHILD, d, how],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([child.stdout], [], [], 120)
        assert ready, "the child never got to the middle of its step"
        line = child.stdout.readline().split()
        assert line[:1] == ["READY"], (line, child.stderr.read() if child.poll() else "")
        fd, in_use = int(line[1]), int(line[2])
        assert in_use >= 32 << 20
        # While it runs: the data exists, in a file that has no name.
        link = os.readlink(f"/proc/{child.pid}/fd/{fd}")
        assert link.endswith("(deleted)"), link
        assert os.stat(f"/proc/{child.pid}/fd/{fd}").st_blocks * 512 >= 32 << 20
        assert os.listdir(d) == []
        if mounted:
            assert _used_bytes(d) - used_before >= 32 << 20
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
        child.stdout.close()
        child.stderr.close()
    assert child.returncode == -signal.SIGKILL
    assert os.listdir(d) == []  # nothing to reap at the next start
    if mounted:  # and the blocks went back to the file system
        deadline = time.monotonic() + 10
        while _used_bytes(d) - used_before > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _used_bytes(d) - used_before <= 0
