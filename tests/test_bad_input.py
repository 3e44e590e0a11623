"""Bad input: invalid configuration values, and tensors ssdtrain cannot spill.

* Every ``OffloadConfig`` field has invalid values, passed as keywords and as
  ``SSDTRAIN_*`` strings, each refused with a ``ConfigError`` naming the field; a new
  field without entries here fails :func:`test_every_field_is_covered`.
* Tensors ssdtrain cannot spill and rebuild (sparse, nested, meta, subclasses,
  quantized, zero-size) are passed through in memory, as ``is_offloadable_kind``
  documents: backward gets them back unchanged, nothing is written, gradients equal
  those without ssdtrain.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

import ssdtrain
from ssdtrain import ConfigError, OffloadConfig
from helpers import save_and_unpack

INVALID = {
    "spill_dir": [123, b"/tmp", [], [""], ["/tmp", "/tmp"], {"/tmp"}, [None]],
    "min_tensor_bytes": [-1, "lots", True, 1.5, None],
    "prefetch_bytes": [-4096, "1 parsec", False, [1], None, 10 ** 400, -10 ** 5000, 1 << 63,
                       "9" * 400, float("inf"), float("nan")],
    "keep_tail_bytes": [-1, "-1MiB", True, None],
    "engine": ["gds", "", None, 1, "NATIVE"],
    "io_threads": [0, 257, -1, True, "4", 2.0, None, 10 ** 5000],
    "io_chunk_bytes": [0, 4095, -1, "1k", None],
    "direct_io": ["sometimes", "", None, 1],
    "write_behind_bytes": [-1, "x", None],
    "verify": ["yes", 1, 0, None, "true"],
    "io_timeout_s": [0, -1, float("nan"), True, "10", None, float("inf"), 1e300, 10 ** 400,
                     -float("inf"), -10 ** 5000],
    "on_spill_error": ["ignore", "", None, True, "KEEP"],
    "max_spill_bytes": [-1, "lots", True, 2.5, [1], "9" * 5000, "99999999999 TiB"],
    "on_spill_full": ["drop", "", None, False],
    "policy": ["dynamic", "", None, "ADAPTIVE", 1],
    "memory_budget_bytes": [-1, "lots", True, [1]],
    "profile_steps": [0, 1001, True, 1.5, None, "2", 10 ** 5000],
    "replan_stall_fraction": [0, -0.1, float("nan"), True, "x", None, -float("inf"),
                              10 ** 400, -10 ** 400],
    "host_budget_bytes": [-1, "lots", True, [1], 2.5, "autoo", "9" * 5000],
    "max_slowdown": [-0.01, -1e-320, float("nan"), True, "3%", None, 10.5, float("inf"),
                     -float("inf"), 10 ** 400, -10 ** 400],
}

INVALID_ENV = {
    "spill_dir": [],  # any string is a path list; its problems show when the Offloader opens it
    "min_tensor_bytes": ["-1", "lots", ""],
    "prefetch_bytes": ["1 parsec", "-3", "9" * 400, "9" * 5000, "inf", "nan", "1e999"],
    "keep_tail_bytes": ["x"],
    "engine": ["gds", ""],
    "io_threads": ["four", "0", "1.5", "9" * 400, "9" * 5000],
    "io_chunk_bytes": ["100", "nope"],
    "direct_io": ["sometimes"],
    "write_behind_bytes": ["-1MiB"],
    "verify": ["maybe", "2"],
    "io_timeout_s": ["soon", "0", "-1", "inf", "nan", "1e999", "9" * 400, "-inf"],
    "on_spill_error": ["ignore"],
    "max_spill_bytes": ["-1", "lots", "9" * 20, "9223372036854775808"],
    "on_spill_full": ["drop"],
    "policy": ["dynamic"],
    "memory_budget_bytes": ["-1", "lots"],
    "profile_steps": ["0", "two", "9" * 400],
    "replan_stall_fraction": ["0", "often", "1e999", "9" * 400, "nan", "-inf"],
    "host_budget_bytes": ["-1", "lots", "9" * 400],
    "max_slowdown": ["-0.1", "soon", "1e999", "9" * 400, "nan", "inf"],
}


def _id(value):
    """A short test id: some invalid values are thousands of digits long (and repr()
    of an int beyond 4300 digits raises)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"int{value.bit_length()}bits" if value > 0 else f"-int{value.bit_length()}bits"
    text = repr(value)
    return text if len(text) <= 30 else f"{text[:12]}..{len(text)}chars"


@pytest.fixture(autouse=True)
def _no_ssdtrain_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith("SSDTRAIN_"):
            monkeypatch.delenv(key)


def test_every_field_is_covered():
    fields = {f.name for f in dataclasses.fields(OffloadConfig)}
    assert set(INVALID) == fields, "add invalid values for new OffloadConfig fields"
    assert set(INVALID_ENV) == fields


@pytest.mark.parametrize("field,value", [(f, v) for f, vs in INVALID.items() for v in vs],
                         ids=_id)
def test_invalid_value_names_the_field(field, value):
    with pytest.raises(ConfigError) as excinfo:
        OffloadConfig(**{field: value})
    msg = str(excinfo.value)
    assert msg.startswith("ssdtrain:") and field in msg, msg


@pytest.mark.parametrize("field,raw", [(f, v) for f, vs in INVALID_ENV.items() for v in vs],
                         ids=_id)
def test_invalid_env_value_names_the_field(field, raw):
    with pytest.raises(ConfigError) as excinfo:
        OffloadConfig.from_env({f"SSDTRAIN_{field.upper()}": raw})
    msg = str(excinfo.value)
    assert msg.startswith("ssdtrain:") and (field in msg or field.upper() in msg), msg


@pytest.mark.parametrize("field", sorted(INVALID))
def test_invalid_value_through_offloader_and_replace(field, tmp_path):
    """The same validation applies to ``Offloader(**overrides)`` and ``config.replace``."""
    value = INVALID[field][0]
    with pytest.raises(ConfigError, match=field):
        ssdtrain.Offloader(OffloadConfig(spill_dir=str(tmp_path)), **{field: value})
    with pytest.raises(ConfigError, match=field):
        OffloadConfig(spill_dir=str(tmp_path)).replace(**{field: value})


def test_valid_new_fields():
    cfg = OffloadConfig(on_spill_error="keep", max_spill_bytes="1GiB", on_spill_full="raise")
    assert (cfg.on_spill_error, cfg.max_spill_bytes, cfg.on_spill_full) == \
        ("keep", 1 << 30, "raise")
    assert OffloadConfig().max_spill_bytes is None
    assert OffloadConfig(max_spill_bytes=0).max_spill_bytes == 0
    assert OffloadConfig.from_env({"SSDTRAIN_MAX_SPILL_BYTES": "none"}).max_spill_bytes is None


def test_huge_byte_string_from_env_is_a_config_error():
    """``SSDTRAIN_PREFETCH_BYTES='9'*400`` used to raise OverflowError (int(float('inf')))."""
    with pytest.raises(ConfigError, match="prefetch_bytes.*larger than any byte count"):
        OffloadConfig.from_env({"SSDTRAIN_PREFETCH_BYTES": "9" * 400})


def test_extreme_but_valid_numbers():
    """The bounds themselves are accepted, and byte strings are parsed exactly."""
    import threading

    from ssdtrain._config import MAX_BYTES

    cfg = OffloadConfig(max_spill_bytes=MAX_BYTES, prefetch_bytes=str(MAX_BYTES),
                        io_timeout_s=threading.TIMEOUT_MAX,
                        replan_stall_fraction=float("inf"))
    assert (cfg.max_spill_bytes, cfg.prefetch_bytes) == (MAX_BYTES, MAX_BYTES)
    assert cfg.io_timeout_s == threading.TIMEOUT_MAX
    assert cfg.replan_stall_fraction == float("inf")
    env = OffloadConfig.from_env({"SSDTRAIN_REPLAN_STALL_FRACTION": "inf",
                                  "SSDTRAIN_KEEP_TAIL_BYTES": "9007199254740993",
                                  "SSDTRAIN_MIN_TENSOR_BYTES": "0" * 5000 + "1.5KiB",
                                  "SSDTRAIN_WRITE_BEHIND_BYTES": "1." + "0" * 5000 + "1KiB"})
    assert env.replan_stall_fraction == float("inf")
    assert env.keep_tail_bytes == 9007199254740993  # exact: not rounded through a float
    assert env.min_tensor_bytes == 1536
    assert env.write_behind_bytes == 1024


# ----------------------------------------------------------- unsupported tensors
class Tagged(torch.Tensor):
    """A plain Python subclass (``as_subclass``): torch functions keep the type."""


def _subclass():
    x = torch.randn(256, 256).as_subclass(Tagged).requires_grad_()
    return x, (lambda x: (x * 2).sin().sum())


def _sparse():
    x = torch.randn(256, 256).requires_grad_()
    idx = torch.stack([torch.arange(256), torch.arange(256)])
    sp = torch.sparse_coo_tensor(idx, torch.ones(256), (256, 256))
    return x, (lambda x: torch.sparse.mm(sp, x).sin().sum())  # mm saves the sparse matrix


def _sparse_csr():
    x = torch.randn(256, 256).requires_grad_()
    sp = torch.eye(256).to_sparse_csr()
    return x, (lambda x: (sp @ x).sin().sum())


def _nested():
    x = torch.randn(3 * 128 * 64).requires_grad_()

    def f(x):
        parts = [x[:128 * 64].view(128, 64), x[128 * 64:].view(256, 64)]
        nt = torch.nested.as_nested_tensor(parts, layout=torch.jagged)
        return (nt * nt).sin().values().sum()  # saves nested tensors
    return x, f


def _meta():
    x = torch.empty(256, 256, device="meta").requires_grad_()
    return x, (lambda x: (x * 2).sin().sum())


def _zero_size():
    x = torch.randn(0, 256).requires_grad_()
    return x, (lambda x: (x * 2).sin().sum())


KINDS = {"subclass": _subclass, "sparse_coo": _sparse, "sparse_csr": _sparse_csr,
         "nested": _nested, "meta": _meta, "zero_size": _zero_size}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_unsupported_tensors_pass_through_in_memory(make_offloader, kind):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        x_ref, f = KINDS[kind]()
        torch.manual_seed(0)
        x, f = KINDS[kind]()
    try:
        f(x_ref).backward()
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"torch {torch.__version__} cannot run this graph at all: {e}")
    off = make_offloader(min_tensor_bytes=1, keep_tail_bytes=0)
    with off:
        loss = f(x)
        off.wait()
    loss.backward()
    if x.device.type != "meta":
        assert torch.equal(x.grad, x_ref.grad)
    else:
        assert x.grad.shape == x_ref.grad.shape and x.grad.device.type == "meta"
    off.wait()
    s = off.stats()
    assert s.packed_bytes > 0 or kind == "zero_size"
    assert off.live_records() == 0 and off.spill_bytes_in_use() == 0


@pytest.mark.parametrize("make", [
    lambda: torch.sparse_coo_tensor(torch.tensor([[0, 1], [1, 0]]), torch.ones(2), (4096, 4096)),
    lambda: torch.nested.nested_tensor([torch.randn(300, 64), torch.randn(200, 64)],
                                       layout=torch.jagged),
    lambda: torch.empty(512, 512, device="meta"),
    lambda: torch.randn(512, 512).as_subclass(Tagged),
    lambda: torch.quantize_per_tensor(torch.randn(512, 512), 0.1, 0, torch.qint8),
    lambda: torch.randn(512, 512, dtype=torch.complex64).conj(),
], ids=["sparse", "nested", "meta", "subclass", "quantized", "conj"])
def test_saved_unsupported_tensor_comes_back_as_itself(make_offloader, make):
    """Saved by hand: what backward gets is the very object saved (kept, not rebuilt)."""
    t = make()
    off = make_offloader(min_tensor_bytes=1, keep_tail_bytes=0)
    (got,) = save_and_unpack([t], off)
    assert type(got) is type(t) and got.layout == t.layout and got.device == t.device
    assert got.is_conj() == t.is_conj() and got.dtype == t.dtype
    if t.device.type != "meta" and not t.is_nested and t.layout == torch.strided:
        assert got.data_ptr() == t.data_ptr()  # the same memory: passed through
    s = off.stats()
    assert s.records_written == 0 and s.unique_bytes == 0
