"""``OffloadConfig`` validation, ``from_env`` and the errors an ``Offloader`` raises at creation.

Every invalid value must raise :class:`ssdtrain.ConfigError` whose message names the
offending field (or environment variable), so a user can find the typo without reading
the source. Directory problems (missing, not a directory, not writable) are detected
when the :class:`~ssdtrain.Offloader` is created, not at the first write.
"""

from __future__ import annotations

import logging
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch

import ssdtrain
from ssdtrain import testing
from ssdtrain import ConfigError, OffloadConfig, Offloader
from ssdtrain._config import parse_bytes

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
REPO = Path(ssdtrain.__file__).resolve().parent.parent
BYTE_FIELDS = ("min_tensor_bytes", "prefetch_bytes", "keep_tail_bytes", "io_chunk_bytes",
               "write_behind_bytes")


@pytest.fixture(autouse=True)
def _no_ssdtrain_env(monkeypatch):
    """Tests must not depend on SSDTRAIN_* variables of the shell that runs them."""
    for key in list(os.environ):
        if key.startswith("SSDTRAIN_"):
            monkeypatch.delenv(key)


def _assert_config_error(excinfo, *names):
    err = excinfo.value
    assert isinstance(err, ssdtrain.SSDTrainError)
    assert isinstance(err, ValueError)  # ConfigError is also a ValueError
    msg = str(err)
    assert msg.startswith("ssdtrain:"), msg
    for name in names:
        assert name in msg, f"{name!r} not named in: {msg}"


# --------------------------------------------------------------------- invalid values

_BAD_BYTES = [-1, -(1 << 40), True, False, "garbage", "12 parsecs", "-5MiB", "MiB", "",
              "1.5.2GiB", None, 1.5, [4096], b"4096"]


@pytest.mark.parametrize("value", _BAD_BYTES, ids=repr)
@pytest.mark.parametrize("field", BYTE_FIELDS)
def test_bad_byte_values_name_the_field(field, value):
    with pytest.raises(ConfigError) as excinfo:
        OffloadConfig(**{field: value})
    _assert_config_error(excinfo, field)


@pytest.mark.parametrize("value", [0, 1, 4095, "4095", "1KiB", "4000B", "3.99KiB"], ids=repr)
def test_io_chunk_bytes_below_one_block(value):
    with pytest.raises(ConfigError) as excinfo:
        OffloadConfig(io_chunk_bytes=value)
    _assert_config_error(excinfo, "io_chunk_bytes", "4096")


@pytest.mark.parametrize("value", ["fast", "POSIX", "", "io_uring", None, 3, ["posix"]], ids=repr)
def test_unknown_engine(value):
    with pytest.raises(ConfigError) as excinfo:
        OffloadConfig(engine=value)
    _assert_config_error(excinfo, "engine")


def test_kvikio_where_gds_does_not_work_says_why(tmp_path):
    """engine='kvikio' is a valid name; where kvikio/cuFile cannot do I/O (here: no GPU),
    building the offloader fails with the probe's reason and what to use instead."""
    from ssdtrain._device.transfers import GDS_PROBE_MEMORY
    from ssdtrain.io import gds
    reason = gds.probe(str(tmp_path), GDS_PROBE_MEMORY)
    if not reason:
        pytest.skip("GPUDirect Storage works on this machine")
    assert OffloadConfig(engine="kvikio").engine == "kvikio"
    with pytest.raises(ConfigError) as excinfo:
        Offloader(OffloadConfig(spill_dir=str(tmp_path), engine="kvikio"))
    _assert_config_error(excinfo, "kvikio", reason, "engine='native'")


def test_kvikio_with_verify_is_refused(tmp_path):
    with pytest.raises(ConfigError) as excinfo:
        Offloader(OffloadConfig(spill_dir=str(tmp_path), engine="kvikio", verify=True))
    _assert_config_error(excinfo, "verify=True", "kvikio")


def test_auto_passes_over_kvikio_where_the_probe_fails(tmp_path, caplog, monkeypatch):
    """auto = kvikio only if the real test I/O passed; the log says why it was not picked."""
    import logging
    from ssdtrain import io as ssd_io
    from ssdtrain.io import gds, native
    monkeypatch.setattr(ssd_io, "_logged_auto", False)
    monkeypatch.setitem(gds._probed, str(tmp_path), "cuFile said no (test)")
    with caplog.at_level(logging.INFO, logger="ssdtrain"):
        off = Offloader(OffloadConfig(spill_dir=str(tmp_path), engine="auto"))
    off.close()
    expected = "native" if native.available() else "posix"
    assert off.stats().engine.startswith(expected)
    assert f"engine auto -> {expected}" in caplog.text
    assert "cuFile said no (test)" in caplog.text


@pytest.mark.parametrize("value", ["auto", "native", "posix"])
def test_engine_names_select_an_engine(value, tmp_path):
    """auto picks native where ssdtrain._C is built; each name yields that engine."""
    from ssdtrain import Offloader
    from ssdtrain.io import native
    if value == "native" and not native.available():
        with pytest.raises(ConfigError, match="not available"):
            Offloader(OffloadConfig(spill_dir=str(tmp_path), engine=value))
        return
    off = Offloader(OffloadConfig(spill_dir=str(tmp_path), engine=value))
    try:
        expected = {"auto": "native" if native.available() else "posix"}.get(value, value)
        assert testing.engine(off).name == expected
        assert off.stats().engine.startswith(expected)
    finally:
        off.close()


@pytest.mark.parametrize("value", [0, -1, 1000, 257, True, False, "4", 4.0, None], ids=repr)
def test_bad_io_threads(value):
    with pytest.raises(ConfigError) as excinfo:
        OffloadConfig(io_threads=value)
    _assert_config_error(excinfo, "io_threads")


@pytest.mark.parametrize("value", ["maybe", "", "yes", None, 1, 0, "O_DIRECT"], ids=repr)
def test_bad_direct_io(value):
    with pytest.raises(ConfigError) as excinfo:
        OffloadConfig(direct_io=value)
    _assert_config_error(excinfo, "direct_io")


@pytest.mark.parametrize("value", [0, 0.0, -1, -0.5, float("nan"), True, "10", None], ids=repr)
def test_bad_io_timeout(value):
    with pytest.raises(ConfigError) as excinfo:
        OffloadConfig(io_timeout_s=value)
    _assert_config_error(excinfo, "io_timeout_s")


_BAD_DIRS = {
    "empty-list": [],
    "empty-tuple": (),
    "empty-entry": [""],
    "empty-string": "",
    "empty-among-good": ["/tmp", ""],
    "duplicate": ["/tmp/ssdtrain-a", "/tmp/ssdtrain-a"],
    "duplicate-trailing-slash": ["/tmp/ssdtrain-a", "/tmp/ssdtrain-a/"],
    "duplicate-dot": ["/tmp/ssdtrain-a", "/tmp/./ssdtrain-a"],
    "int": 123,
    "int-entry": [123],
    "bytes": b"/tmp",
    "none-entry": [None],
    "set": {"/tmp"},
}


@pytest.mark.parametrize("value", list(_BAD_DIRS.values()), ids=list(_BAD_DIRS))
def test_bad_spill_dir(value):
    with pytest.raises(ConfigError) as excinfo:
        OffloadConfig(spill_dir=value)
    _assert_config_error(excinfo, "spill_dir")


# ----------------------------------------------------------------------- valid forms

@pytest.mark.parametrize("text, expected", [
    ("256MiB", 256 * MiB),
    ("1.5GiB", int(1.5 * GiB)),
    ("4096", 4096),
    ("0", 0),
    ("1 KiB", KiB),
    (" 2mib ", 2 * MiB),
    ("1k", KiB),
    ("1KB", 1000),
    ("3MB", 3_000_000),
    ("2GB", 2_000_000_000),
    ("1TiB", 1 << 40),
    ("512B", 512),
    (".5MiB", MiB // 2),
    (0, 0),
    (12345, 12345),
])
def test_parse_bytes_valid(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("field", ["min_tensor_bytes", "prefetch_bytes", "keep_tail_bytes"])
def test_byte_fields_accept_strings_and_ints(field):
    assert getattr(OffloadConfig(**{field: "256MiB"}), field) == 256 * MiB
    assert getattr(OffloadConfig(**{field: "1.5GiB"}), field) == int(1.5 * GiB)
    assert getattr(OffloadConfig(**{field: "4096"}), field) == 4096
    assert getattr(OffloadConfig(**{field: 0}), field) == 0
    assert getattr(OffloadConfig(**{field: 12345}), field) == 12345
    assert type(getattr(OffloadConfig(**{field: "1.5GiB"}), field)) is int


def test_defaults():
    cfg = OffloadConfig()
    assert cfg.spill_dir is None
    assert cfg.min_tensor_bytes == 256 * KiB
    assert cfg.prefetch_bytes == 256 * MiB
    assert cfg.keep_tail_bytes == 128 * MiB
    assert cfg.engine == "auto"
    assert cfg.io_threads == 4
    assert cfg.io_chunk_bytes == 16 * MiB
    assert cfg.direct_io == "auto"
    assert cfg.io_timeout_s == 600
    assert cfg.write_behind_bytes == GiB
    assert cfg.verify == "auto"


@pytest.mark.parametrize("value", [1, 0, "yes", "true", None, 1.0], ids=repr)
def test_bad_verify(value):
    with pytest.raises(ConfigError) as excinfo:
        OffloadConfig(verify=value)
    _assert_config_error(excinfo, "verify")


@pytest.mark.parametrize("raw, expected", [("1", True), ("true", True), ("ON", True),
                                           ("yes", True), ("0", False), ("off", False),
                                           (" False ", False), ("no", False)])
def test_from_env_verify(raw, expected):
    assert OffloadConfig.from_env({"SSDTRAIN_VERIFY": raw}).verify is expected


@pytest.mark.parametrize("value, expected", [(True, "on"), (False, "off"), ("on", "on"),
                                             ("off", "off"), ("auto", "auto")])
def test_direct_io_forms(value, expected):
    assert OffloadConfig(direct_io=value).direct_io == expected


@pytest.mark.parametrize("value, expected", [
    (4096, 4096), (4097, 4096), (8191, 4096), (8192, 8192),
    ("16MiB", 16 * MiB), (16 * MiB + 100, 16 * MiB), ("1.5MiB", 1536 * KiB), ("5000", 4096),
])
def test_io_chunk_bytes_rounded_down_to_blocks(value, expected):
    assert OffloadConfig(io_chunk_bytes=value).io_chunk_bytes == expected


@pytest.mark.parametrize("value", [1, 2, 4, 256])
def test_io_threads_valid(value):
    assert OffloadConfig(io_threads=value).io_threads == value


@pytest.mark.parametrize("value", [0.001, 1, 2.5, 600])
def test_io_timeout_valid(value):
    assert OffloadConfig(io_timeout_s=value).io_timeout_s == value


def test_spill_dir_normalized_to_absolute_list(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert OffloadConfig(spill_dir="a").spill_dir == [str(tmp_path / "a")]
    assert OffloadConfig(spill_dir=tmp_path).spill_dir == [str(tmp_path)]
    assert OffloadConfig(spill_dir=[tmp_path / "x", "y/"]).spill_dir == [
        str(tmp_path / "x"), str(tmp_path / "y")]
    assert OffloadConfig(spill_dir=("p", "q")).spill_dir == [str(tmp_path / "p"),
                                                              str(tmp_path / "q")]


def test_replace_validates():
    cfg = OffloadConfig()
    assert cfg.replace(io_threads=2).io_threads == 2
    assert cfg.io_threads == 4  # the original is untouched
    with pytest.raises(ConfigError) as excinfo:
        cfg.replace(io_threads=0)
    _assert_config_error(excinfo, "io_threads")
    with pytest.raises(ConfigError) as excinfo:
        cfg.replace(io_thread=2)
    _assert_config_error(excinfo, "io_thread")


# -------------------------------------------------------------------------- from_env

def test_from_env_reads_every_field(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    environ = {
        "SSDTRAIN_SPILL_DIR": f"{a}{os.pathsep}{b}",
        "SSDTRAIN_MIN_TENSOR_BYTES": "1MiB",
        "SSDTRAIN_PREFETCH_BYTES": "1.5GiB",
        "SSDTRAIN_KEEP_TAIL_BYTES": "0",
        "SSDTRAIN_ENGINE": "posix",
        "SSDTRAIN_IO_THREADS": "8",
        "SSDTRAIN_IO_CHUNK_BYTES": "8193",
        "SSDTRAIN_DIRECT_IO": "off",
        "SSDTRAIN_IO_TIMEOUT_S": "2.5",
        "SSDTRAIN_WRITE_BEHIND_BYTES": "64MiB",
        "SSDTRAIN_VERIFY": "1",
        "SSDTRAIN_ON_SPILL_ERROR": "keep",
        "SSDTRAIN_MAX_SPILL_BYTES": "2GiB",
        "SSDTRAIN_ON_SPILL_FULL": "raise",
        "SSDTRAIN_HOST_BUDGET_BYTES": "3GiB",
        "SSDTRAIN_POLICY": "adaptive",
        "SSDTRAIN_MEMORY_BUDGET_BYTES": "2GiB",
        "SSDTRAIN_PROFILE_STEPS": "3",
        "SSDTRAIN_REPLAN_STALL_FRACTION": "0.25",
        "SSDTRAIN_MAX_SLOWDOWN": "0.05",
        "PATH": "/nonexistent",           # other variables are ignored
        "XSSDTRAIN_ENGINE": "native",
    }
    cfg = OffloadConfig.from_env(environ)
    assert cfg.spill_dir == [str(a), str(b)]
    assert cfg.min_tensor_bytes == MiB
    assert cfg.prefetch_bytes == int(1.5 * GiB)
    assert cfg.keep_tail_bytes == 0
    assert cfg.engine == "posix"
    assert cfg.io_threads == 8
    assert cfg.io_chunk_bytes == 8192
    assert cfg.direct_io == "off"
    assert cfg.io_timeout_s == 2.5
    assert cfg.write_behind_bytes == 64 * MiB
    assert cfg.verify is True
    assert (cfg.on_spill_error, cfg.max_spill_bytes, cfg.on_spill_full) == ("keep", 2 * GiB,
                                                                            "raise")
    assert cfg.host_budget_bytes == 3 * GiB
    assert (cfg.policy, cfg.memory_budget_bytes, cfg.profile_steps,
            cfg.replan_stall_fraction, cfg.max_slowdown) == ("adaptive", 2 * GiB, 3, 0.25, 0.05)
    assert {f.name for f in dataclasses.fields(OffloadConfig)} == {
        k[len("SSDTRAIN_"):].lower() for k in environ if k.startswith("SSDTRAIN_")}


def test_from_env_empty_gives_defaults():
    assert OffloadConfig.from_env({}) == OffloadConfig()


def test_from_env_single_dir_and_empty_segments(tmp_path):
    env = {"SSDTRAIN_SPILL_DIR": f"{tmp_path}{os.pathsep}{os.pathsep}"}
    assert OffloadConfig.from_env(env).spill_dir == [str(tmp_path)]


def test_from_env_overrides_win(tmp_path):
    environ = {"SSDTRAIN_IO_THREADS": "8", "SSDTRAIN_PREFETCH_BYTES": "1GiB",
               "SSDTRAIN_SPILL_DIR": "/somewhere/else"}
    cfg = OffloadConfig.from_env(environ, io_threads=2, spill_dir=tmp_path)
    assert cfg.io_threads == 2
    assert cfg.spill_dir == [str(tmp_path)]
    assert cfg.prefetch_bytes == GiB  # not overridden: from the environment


def test_from_env_defaults_to_os_environ(monkeypatch, tmp_path):
    monkeypatch.setenv("SSDTRAIN_IO_THREADS", "3")
    monkeypatch.setenv("SSDTRAIN_SPILL_DIR", str(tmp_path))
    cfg = OffloadConfig.from_env()
    assert cfg.io_threads == 3
    assert cfg.spill_dir == [str(tmp_path)]


@pytest.mark.parametrize("key", ["SSDTRAIN_FOO", "SSDTRAIN_IO_THREAD", "SSDTRAIN_SPILLDIR",
                                 "SSDTRAIN_"])
def test_from_env_unknown_variable(key):
    with pytest.raises(ConfigError) as excinfo:
        OffloadConfig.from_env({key: "1"})
    _assert_config_error(excinfo, key)


def test_from_env_leaves_the_test_suites_knobs_alone(tmp_path):
    """``SSDTRAIN_TEST_*`` (the suite's own switches: full sweeps, a slow disk) are not
    config fields, and an Offloader built from the environment while one is set still
    works (before, every such Offloader raised, so `SSDTRAIN_INTERRUPT_FULL=1 make
    test` failed in every test that used the environment)."""
    env = {"SSDTRAIN_TEST_INTERRUPT_FULL": "1", "SSDTRAIN_TEST_IO_DELAY_MS": "30",
           "SSDTRAIN_SPILL_DIR": str(tmp_path)}
    assert OffloadConfig.from_env(env).spill_dir == [str(tmp_path)]
    with pytest.raises(ConfigError):  # a near miss of the prefix is still a typo
        OffloadConfig.from_env({"SSDTRAIN_TESTS_X": "1"})


@pytest.mark.parametrize("raw", ["four", "", "4.0", "0x4"])
def test_from_env_bad_io_threads_not_an_int(raw):
    with pytest.raises(ConfigError) as excinfo:
        OffloadConfig.from_env({"SSDTRAIN_IO_THREADS": raw})
    _assert_config_error(excinfo, "SSDTRAIN_IO_THREADS")


@pytest.mark.parametrize("raw", ["0", "-1", "1000"])
def test_from_env_bad_io_threads_out_of_range(raw):
    with pytest.raises(ConfigError) as excinfo:
        OffloadConfig.from_env({"SSDTRAIN_IO_THREADS": raw})
    _assert_config_error(excinfo, "io_threads")


@pytest.mark.parametrize("key, raw, field", [
    ("SSDTRAIN_IO_TIMEOUT_S", "soon", "SSDTRAIN_IO_TIMEOUT_S"),
    ("SSDTRAIN_IO_TIMEOUT_S", "0", "io_timeout_s"),
    ("SSDTRAIN_PREFETCH_BYTES", "lots", "prefetch_bytes"),
    ("SSDTRAIN_IO_CHUNK_BYTES", "1KiB", "io_chunk_bytes"),
    ("SSDTRAIN_ENGINE", "gds", "engine"),
    ("SSDTRAIN_DIRECT_IO", "maybe", "direct_io"),
    ("SSDTRAIN_VERIFY", "perhaps", "SSDTRAIN_VERIFY"),
    ("SSDTRAIN_SPILL_DIR", "", "spill_dir"),
])
def test_from_env_bad_values(key, raw, field):
    with pytest.raises(ConfigError) as excinfo:
        OffloadConfig.from_env({key: raw})
    _assert_config_error(excinfo, field)


def test_from_env_unknown_override():
    with pytest.raises(ConfigError) as excinfo:
        OffloadConfig.from_env({}, prefetch=1)
    _assert_config_error(excinfo, "prefetch")


# ------------------------------------------------------------------ Offloader creation

def test_offloader_applies_overrides(tmp_path):
    cfg = OffloadConfig(spill_dir=tmp_path, io_threads=4)
    off = Offloader(cfg, io_threads=2, keep_tail_bytes="1MiB", direct_io=False, engine="posix")
    try:
        assert off.config.io_threads == 2
        assert off.config.keep_tail_bytes == MiB
        assert off.config.direct_io == "off"
        assert off.config.spill_dir == [str(tmp_path)]
        assert cfg.io_threads == 4 and cfg.direct_io == "auto"  # caller's config untouched
        engine = testing.engine(off)
        engine = getattr(engine, "inner", engine)  # under tests/late_io.py's wrapper
        assert engine._pool._max_workers == 2
        assert [f.direct for f in testing.spill(off).files] == [False]
    finally:
        off.close()


def test_offloader_without_config_reads_env_then_overrides(tmp_path, monkeypatch):
    monkeypatch.setenv("SSDTRAIN_IO_THREADS", "3")
    monkeypatch.setenv("SSDTRAIN_PREFETCH_BYTES", "1MiB")
    off = Offloader(spill_dir=tmp_path, prefetch_bytes=0)
    try:
        assert off.config.io_threads == 3
        assert off.config.prefetch_bytes == 0
        assert off.config.spill_dir == [str(tmp_path)]
    finally:
        off.close()


def test_offloader_default_spill_dir_is_tempdir():
    off = Offloader()
    try:
        assert off.config.spill_dir == [os.path.join(os.path.abspath(tempfile.gettempdir()),
                                                     f"ssdtrain-{os.geteuid()}")]
    finally:
        off.close()


@pytest.mark.parametrize("bad", ["x", {"spill_dir": "/tmp"}, 4, OffloadConfig])
def test_offloader_rejects_non_config(bad):
    with pytest.raises(ConfigError) as excinfo:
        Offloader(bad)
    _assert_config_error(excinfo, "config", "OffloadConfig")


@pytest.mark.parametrize("overrides, field", [({"io_threads": 0}, "io_threads"),
                                              ({"engine": "gds"}, "engine"),
                                              ({"min_tensor_byte": 1}, "min_tensor_byte")])
def test_offloader_bad_overrides(tmp_path, overrides, field):
    with pytest.raises(ConfigError) as excinfo:
        Offloader(OffloadConfig(spill_dir=tmp_path), **overrides)
    _assert_config_error(excinfo, field)


def _open_fds():
    return set(os.listdir("/proc/self/fd"))


def test_missing_spill_dir(tmp_path):
    missing = tmp_path / "does-not-exist"
    with pytest.raises(ConfigError) as excinfo:
        Offloader(OffloadConfig(spill_dir=missing))
    _assert_config_error(excinfo, "spill_dir", str(missing), "does not exist")
    assert not missing.exists()  # not created behind the user's back


def test_spill_dir_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_bytes(b"not a dir")
    with pytest.raises(ConfigError) as excinfo:
        Offloader(OffloadConfig(spill_dir=f))
    _assert_config_error(excinfo, "spill_dir", str(f), "not a directory")
    assert f.read_bytes() == b"not a dir"


def test_bad_second_dir_leaks_no_fd(tmp_path):
    good = tmp_path / "good"
    good.mkdir()
    before = _open_fds()
    with pytest.raises(ConfigError) as excinfo:
        Offloader(OffloadConfig(spill_dir=[good, tmp_path / "missing"]))
    _assert_config_error(excinfo, "spill_dir", str(tmp_path / "missing"))
    assert _open_fds() <= before, "the first directory's spill file was left open"
    assert list(good.iterdir()) == []


# NOTE [ Testing an unwritable spill_dir as root ]
# Root ignores permission bits (CAP_DAC_OVERRIDE), so chmod alone cannot make a
# directory unwritable. The check therefore runs in a child process that has given up
# that privilege: preferably as uid/gid 65534 (nobody) against a root-owned 0755
# directory; where nobody cannot run this interpreter (the venv's python lives under
# /root, mode 0700, on this machine), as uid 0 with CAP_DAC_OVERRIDE and
# CAP_DAC_READ_SEARCH removed from its capability sets against a root-owned 0555
# directory. Either way the child first proves that it really cannot create a file
# there, so the test cannot pass vacuously.

_CHILD = textwrap.dedent(r"""
    import ctypes, os, sys
    target, drop_caps = sys.argv[1], sys.argv[2] == "caps"
    if drop_caps:
        # Threads are created later (torch) and inherit the reduced sets.
        class Hdr(ctypes.Structure):
            _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
        class Data(ctypes.Structure):
            _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                        ("inheritable", ctypes.c_uint32)]
        libc = ctypes.CDLL(None, use_errno=True)
        hdr, data = Hdr(0x20080522, 0), (Data * 2)()
        if libc.capget(ctypes.byref(hdr), data) != 0:
            print("SKIP capget failed errno", ctypes.get_errno()); sys.exit(3)
        mask = ~((1 << 1) | (1 << 2)) & 0xFFFFFFFF  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        data[0].effective &= mask
        data[0].permitted &= mask
        data[0].inheritable &= mask
        if libc.capset(ctypes.byref(hdr), data) != 0:
            print("SKIP capset failed errno", ctypes.get_errno()); sys.exit(3)
    try:
        fd = os.open(os.path.join(target, "probe"), os.O_CREAT | os.O_WRONLY, 0o600)
    except PermissionError:
        pass
    else:
        os.close(fd); os.unlink(os.path.join(target, "probe"))
        print("SKIP still privileged: could create a file in", target); sys.exit(3)
    import ssdtrain
    try:
        ssdtrain.Offloader(ssdtrain.OffloadConfig(spill_dir=target))
    except ssdtrain.ConfigError as e:
        print("CONFIGERROR", e)
        sys.exit(0)
    except BaseException as e:
        print("OTHER", type(e).__name__, e)
        sys.exit(1)
    print("NOERROR")
    sys.exit(1)
""")


def _child_env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SSDTRAIN_")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def _nobody_can_import_ssdtrain():
    try:
        r = subprocess.run([sys.executable, "-c", "import ssdtrain"], user=65534, group=65534,
                           extra_groups=[], env=_child_env(), cwd="/", capture_output=True,
                           text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as e:
        return f"{type(e).__name__}: {e}"
    return None if r.returncode == 0 else (r.stderr.strip().splitlines() or ["?"])[-1]


@pytest.mark.skipif(not hasattr(os, "geteuid"), reason="POSIX only")
def test_unwritable_spill_dir(tmp_path):
    if os.geteuid() != 0:
        target = tmp_path / "ro"
        target.mkdir()
        target.chmod(0o500)
        try:
            with pytest.raises(ConfigError) as excinfo:
                Offloader(OffloadConfig(spill_dir=target))
        finally:
            target.chmod(0o700)
        _assert_config_error(excinfo, "spill_dir", str(target), "not writable")
        return

    # pytest's tmp_path lives under a 0700 directory: use one any user can traverse.
    base = tempfile.mkdtemp(prefix="ssdtrain-ro-", dir="/tmp")
    try:
        os.chmod(base, 0o755)
        target = os.path.join(base, "spill")
        os.mkdir(target)
        why_not_nobody = _nobody_can_import_ssdtrain()
        if why_not_nobody is None:
            os.chmod(target, 0o755)  # root-owned: writable by root only
            r = subprocess.run([sys.executable, "-c", _CHILD, target, "uid"], user=65534,
                               group=65534, extra_groups=[], env=_child_env(), cwd="/",
                               capture_output=True, text=True, timeout=120)
        else:
            os.chmod(target, 0o555)  # root-owned, no write bit even for root
            r = subprocess.run([sys.executable, "-c", _CHILD, target, "caps"],
                               env=_child_env(), cwd="/", capture_output=True, text=True,
                               timeout=120)
        if r.returncode == 3:
            pytest.skip(f"cannot drop root's privileges here: nobody (uid 65534) cannot run "
                        f"{sys.executable} ({why_not_nobody}) and {r.stdout.strip()}")
        assert r.returncode == 0, (r.stdout, r.stderr)
        assert r.stdout.startswith("CONFIGERROR ssdtrain:"), r.stdout
        assert "spill_dir" in r.stdout and target in r.stdout and "not writable" in r.stdout
        assert os.listdir(target) == []
    finally:
        os.chmod(base, 0o700)
        shutil.rmtree(base, ignore_errors=True)


# ------------------------------------------------------------------------------ tmpfs

@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm on this system")
def test_tmpfs_spill_dir_warns_and_works(caplog):
    shm = tempfile.mkdtemp(prefix="ssdtrain-test-", dir="/dev/shm")
    try:
        x = torch.randn(256, 1024, dtype=torch.float64, generator=torch.Generator().manual_seed(0),
                        requires_grad=True)
        ref = (x * 2).sin().sum()
        ref.backward()
        ref_grad, x.grad = x.grad, None

        with caplog.at_level(logging.WARNING, logger="ssdtrain"):
            off = Offloader(OffloadConfig(spill_dir=shm, policy="static", keep_tail_bytes=0,
                                          prefetch_bytes=0))
        try:
            warnings = [r for r in caplog.records
                        if r.name == "ssdtrain" and r.levelno == logging.WARNING]
            assert len(warnings) == 1, caplog.text
            msg = warnings[0].getMessage()
            assert "RAM" in msg and "tmpfs" in msg and shm in msg, msg
            # Linux >= 6.6 accepts O_DIRECT on tmpfs, older kernels refuse it: either way
            # the engine name must say which mode is in use.
            direct = testing.spill(off).files[0].direct
            assert ("+O_DIRECT" if direct else "+buffered") in off.stats().engine

            with off:
                loss = (x * 2).sin().sum()  # saves the 2 MiB product for backward
            off.wait()  # written before backward, so backward must read it back
            loss.backward()
            stats = off.stats()
            assert stats.offloaded_bytes >= 256 * 1024 * 8, stats
            assert stats.records_written >= 1 and stats.bytes_read >= 256 * 1024 * 8, stats
            assert torch.equal(loss, ref)
            assert torch.equal(x.grad, ref_grad)
            assert os.listdir(shm) == []  # anonymous spill file
        finally:
            off.close()
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_disk_spill_dir_does_not_warn(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="ssdtrain"):
        off = Offloader(OffloadConfig(spill_dir=tmp_path))
    off.close()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
