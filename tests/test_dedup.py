"""Dedup and view reconstruction.

A storage saved many times (by several ops, through several views) is one record:
written once, read once. Every view comes back with the dtype, size, stride and (when
its whole storage is recorded) storage offset it was saved with, over bitwise the same
bytes, for every dtype ssdtrain may meet.
"""

from __future__ import annotations

import pytest
import torch

from helpers import EngineCalls, SaveForBackward, save_and_unpack

KiB = 1 << 10

# How a record comes back in backward.
MODES = {
    # written before forward ends, prefetched at `with` exit
    "prefetched": dict(keep_tail_bytes=0),
    # written before forward ends, read synchronously by the first unpack
    "read-on-unpack": dict(keep_tail_bytes=0, prefetch_bytes=0),
    # kept in memory (the tail): served without I/O
    "kept": dict(),
}


def _nbytes(t):
    return t.numel() * t.element_size()


def _geometry(t):
    return t.dtype, tuple(t.size()), tuple(t.stride()), t.storage_offset()


def _bits(t):
    """The bytes of ``t``'s elements in logical order (bit patterns, NaN payloads included)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def _assert_mode_happened(mode, s, records, nbytes):
    """The stats show that ``records`` records of ``nbytes`` went the way ``mode`` says."""
    if mode == "kept":
        assert s.records_written == 0 and s.bytes_read == 0
        assert s.forwarded > 0
    else:
        assert s.records_written == records and s.offloaded_bytes == nbytes
        assert s.records_read == records and s.bytes_read == nbytes
        if mode == "prefetched":
            assert s.prefetch_hits == records and s.prefetch_misses == 0
        else:
            assert s.prefetch_misses == records and s.prefetch_hits == 0


# ----------------------------------------------------------------- one storage, many saves
@pytest.mark.parametrize("mode", list(MODES))
def test_tensor_saved_by_two_ops(mode, make_offloader):
    """``x.sin() + x.cos()`` saves ``x`` twice: one record, one write, one read."""
    def step(off):
        a = torch.linspace(-3, 3, 128 * 128).view(128, 128).requires_grad_()
        if off is None:
            y = (a * 2).sin() + (a * 2).cos()
            y.sum().backward()
            return a.grad
        with off:
            x = a * 2  # saves nothing (scalar multiply)
            y = x.sin() + x.cos()  # x saved by sin and by cos
            if mode != "kept":
                off.wait()
        y.sum().backward()
        return a.grad

    ref = step(None)
    off = make_offloader(min_tensor_bytes=4096, **MODES[mode])
    calls = EngineCalls(off)
    grad = step(off)
    assert torch.equal(grad, ref)
    off.wait()
    s = off.stats()
    nbytes = 128 * 128 * 4
    assert s.packed_bytes == 2 * nbytes
    assert s.unique_bytes == nbytes
    assert s.deduplicated_bytes == nbytes
    _assert_mode_happened(mode, s, 1, nbytes)
    if mode != "kept":
        assert [n for _, n in calls.writes] == [nbytes]
        assert [n for _, n in calls.reads] == [nbytes]
    assert off.live_records() == 0


@pytest.mark.parametrize("mode", list(MODES))
def test_views_share_one_record(mode, make_offloader):
    """``x``, ``x.t()``, ``x[1:]``, ``x.view(-1)``, a strided window and a dtype view
    of ``x`` saved by one node: one record; each comes back as the same view of one
    storage, bitwise equal."""
    x = torch.randn(96, 160, generator=torch.Generator().manual_seed(0))
    x[0, 0] = float("nan")
    x[0, 1] = -0.0
    views = [x, x.t(), x[1:], x.view(-1), x[3:90:2, 5:150:3].t(), x.view(torch.int32),
             x[1:].view(torch.uint8)]
    want = [v.clone() for v in views]
    off = make_offloader(min_tensor_bytes=4096, **MODES[mode])
    calls = EngineCalls(off)
    got = save_and_unpack(views, off, settle=mode != "kept")

    for g, v, w in zip(got, views, want):
        assert _geometry(g) == _geometry(v)
        assert torch.equal(_bits(g), _bits(w))
    # rebuilt as views of one storage, like the originals
    assert len({g.untyped_storage().data_ptr() for g in got}) == 1
    off.wait()
    s = off.stats()
    nbytes = _nbytes(x)
    assert s.unique_bytes == nbytes
    assert s.packed_bytes == sum(_nbytes(v) for v in views)
    assert s.deduplicated_bytes == sum(_nbytes(v) for v in views[1:])
    _assert_mode_happened(mode, s, 1, nbytes)
    if mode != "kept":
        assert calls.writes == [(x.data_ptr(), nbytes)]
        assert [n for _, n in calls.reads] == [nbytes]
    assert off.live_records() == 0


@pytest.mark.parametrize("mode", list(MODES))
def test_fused_qkv_slices(mode, make_offloader):
    """One fused projection split into q, k, v, each saved by its own matmul: the three
    (non-contiguous) slices share one record of the whole fused output."""
    n, d, din = 256, 64, 16

    def step(off):
        g = torch.Generator().manual_seed(0)
        inp = torch.randn(n, din, generator=g)  # 16 KiB: under the threshold
        w = torch.randn(din, 3 * d, generator=g).requires_grad_()
        mats = [torch.randn(d, d, generator=g).requires_grad_() for _ in range(3)]
        ctx = off if off is not None else torch.autograd.graph.saved_tensors_hooks(
            lambda t: t, lambda t: t)
        with ctx:
            fused = inp @ w  # (n, 3d), 192 KiB
            q, k, v = fused.split(d, dim=-1)  # strides (3d, 1), offsets 0, d, 2d
            # adds and sum save nothing: the slices are the only large saved tensors
            out = torch.mm(q, mats[0]) + torch.mm(k, mats[1]) + torch.mm(v, mats[2])
            if off is not None and mode != "kept":
                off.wait()
        out.sum().backward()
        return [w.grad] + [m.grad for m in mats], fused

    ref, _ = step(None)
    off = make_offloader(min_tensor_bytes=32 * KiB, **MODES[mode])
    calls = EngineCalls(off)
    got, fused = step(off)
    for g, r in zip(got, ref):
        assert torch.equal(g, r)
    off.wait()
    s = off.stats()
    nbytes = _nbytes(fused)
    assert s.unique_bytes == nbytes
    assert s.deduplicated_bytes == 2 * nbytes // 3
    _assert_mode_happened(mode, s, 1, nbytes)
    if mode != "kept":
        assert calls.writes_within(fused.untyped_storage()) == [(fused.data_ptr(), nbytes)]
        assert len(calls.writes) == 1 and [n for _, n in calls.reads] == [nbytes]


def test_same_storage_saved_by_many_nodes_is_read_once(make_offloader):
    """Handles in different nodes of one storage: the first unpack reads the record, the
    others are served from memory (forwarded) until every handle has been unpacked."""
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    anchors = [torch.zeros((), requires_grad=True) for _ in range(4)]
    sinks = [[] for _ in anchors]
    off = make_offloader(min_tensor_bytes=4096, keep_tail_bytes=0, prefetch_bytes=0)
    calls = EngineCalls(off)
    with off:
        outs = [SaveForBackward.apply(a, s, x[i:]) for i, (a, s) in enumerate(zip(anchors, sinks))]
        off.wait()
    sum(outs).backward()
    for i, sink in enumerate(sinks):
        assert torch.equal(sink[0][0], x[i:])
    s = off.stats()
    assert s.records_written == 1 and s.records_read == 1
    assert s.prefetch_misses == 1 and s.forwarded == 3
    assert len(calls.writes) == 1 and len(calls.reads) == 1


# ---------------------------------------------------------------------- view geometry
class _CheckGeometry(torch.autograd.Function):
    """Saves a view with ``ctx.save_for_backward`` and asserts in backward that the
    unpacked tensor has the geometry and values it was saved with."""

    @staticmethod
    def forward(ctx, anchor, view, expected):
        ctx.save_for_backward(view)
        ctx.expected = expected
        return anchor * 1

    @staticmethod
    def backward(ctx, grad):
        (view,) = ctx.saved_tensors
        geometry, values, whole = ctx.expected
        if whole:
            assert _geometry(view) == geometry, (_geometry(view), geometry)
        else:  # only the view's bytes were recorded: the offset into them is new
            assert _geometry(view)[:3] == geometry[:3], (_geometry(view), geometry)
        assert torch.equal(_bits(view), _bits(values))
        ctx.expected = None
        return grad, None, None


@pytest.mark.parametrize("mode", ["prefetched", "read-on-unpack"])
@pytest.mark.parametrize("case", ["transposed-window", "small-window"])
def test_view_geometry_rebuilt_in_backward(case, mode, make_offloader):
    """A non-contiguous view with a nonzero storage offset comes back with the same
    dtype, size, stride, and storage offset (when its record is the whole storage)."""
    base = torch.randn(128, 300, generator=torch.Generator().manual_seed(0))
    if case == "transposed-window":
        view, whole = base[3:, 5:290:2].t(), True  # extent > half the storage
    else:
        view, whole = base[40:60, 7:250:2], False  # extent < half: only its bytes
    assert view.storage_offset() > 0 and not view.is_contiguous()
    anchor = torch.zeros((), requires_grad=True)
    off = make_offloader(min_tensor_bytes=4096, **MODES[mode])
    with off:
        out = _CheckGeometry.apply(anchor, view, (_geometry(view), view.clone(), whole))
        off.wait()
    out.backward()
    s = off.stats()
    assert s.records_written == 1 and s.records_read == 1
    if whole:
        assert s.offloaded_bytes == base.untyped_storage().nbytes()


# ------------------------------------------------------------------------------ dtypes
def _dtypes():
    names = ["float64", "float32", "float16", "bfloat16", "complex128", "complex64",
             "complex32", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
             "uint64", "bool", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
             "float8_e5m2fnuz", "float8_e8m0fnu"]
    return [getattr(torch, n) for n in names if isinstance(getattr(torch, n, None), torch.dtype)]


# Bit patterns planted at the start of floating tensors (little-endian element values):
# -0.0, a quiet NaN with a payload, a signalling NaN, a negative NaN, +inf, a subnormal.
_SPECIAL = {
    torch.float64: [0x8000000000000000, 0x7FF8000000012345, 0x7FF0000000000001,
                    0xFFF8000000000003, 0x7FF0000000000000, 0x0000000000000001],
    torch.float32: [0x80000000, 0x7FC12345, 0x7F800001, 0xFFC00003, 0x7F800000, 0x00000001],
    torch.float16: [0x8000, 0x7E01, 0x7C01, 0xFE03, 0x7C00, 0x0001],
    torch.bfloat16: [0x8000, 0x7FC1, 0x7F81, 0xFFC3, 0x7F80, 0x0001],
}
_SPECIAL[torch.complex128] = _SPECIAL[torch.float64]  # planted in real and imaginary parts
_SPECIAL[torch.complex64] = _SPECIAL[torch.float32]
_SPECIAL[torch.complex32] = _SPECIAL[torch.float16]


def _random_tensor(dtype, shape, seed=0):
    """Random bit patterns of ``dtype`` (NaN payloads, -0.0, subnormals planted for floats)."""
    g = torch.Generator().manual_seed(seed)
    numel = 1
    for n in shape:
        numel *= n
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=g)
    special = _SPECIAL.get(dtype)
    if special:
        width = dtype.itemsize // (2 if dtype.is_complex else 1)
        for i, pattern in enumerate(special):
            raw[i * width:(i + 1) * width] = torch.tensor(list(pattern.to_bytes(width, "little")),
                                                          dtype=torch.uint8)
    return raw.view(dtype).view(shape)


def _assert_equal_values(got, want):
    """Bitwise equal; and ``torch.equal`` away from NaNs where the dtype supports it."""
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(_bits(got), _bits(want))
    try:
        if want.dtype.is_floating_point or want.dtype.is_complex:
            keep = want == want  # NaN-free positions
            assert torch.equal(got != got, ~keep)
            assert torch.equal(got[keep], want[keep])
        else:
            assert torch.equal(got, want)
    except NotImplementedError:  # float8 / complex32 have no comparison kernels on CPU
        pass


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("dtype", _dtypes(), ids=lambda d: str(d).replace("torch.", ""))
def test_every_dtype_round_trips_bitwise(dtype, make_offloader):
    """A tensor of each dtype and a strided view of it, saved by a custom Function (so
    non-float dtypes can be saved), are written once, read once and come back bitwise."""
    t = _random_tensor(dtype, (128, 194))
    views = [t, t[1:, ::3]]  # >= 4 KiB even for 1-byte dtypes
    want = [v.clone() for v in views]
    off = make_offloader(min_tensor_bytes=4096, keep_tail_bytes=0, prefetch_bytes=0)
    calls = EngineCalls(off)
    got = save_and_unpack(views, off)
    for g, v, w in zip(got, views, want):
        assert _geometry(g) == _geometry(v)
        _assert_equal_values(g, w)
    s = off.stats()
    nbytes = _nbytes(t)
    assert s.records_written == 1 and s.offloaded_bytes == nbytes
    assert s.records_read == 1 and s.bytes_read == nbytes
    assert s.deduplicated_bytes == _nbytes(views[1])
    assert len(calls.writes) == 1 and len(calls.reads) == 1


def test_conj_view_kept_and_correct(make_offloader):
    """A lazily conjugated complex view is not a plain strided tensor: kept in memory,
    and still comes back right; the plain tensor next to it is offloaded."""
    t = _random_tensor(torch.complex64, (64, 130))
    c = t.conj()
    assert c.is_conj()
    want = c.resolve_conj()
    off = make_offloader(min_tensor_bytes=4096, keep_tail_bytes=0, prefetch_bytes=0)
    got_c, got_t = save_and_unpack([c, t], off)
    assert got_c.is_conj()
    _assert_equal_values(got_c.resolve_conj(), want)
    _assert_equal_values(got_t, t)
    s = off.stats()
    assert s.kept_bytes == _nbytes(c)
    assert s.records_written == 1 and s.offloaded_bytes == _nbytes(t)


# ---------------------------------------------------------------- a window into a storage
@pytest.mark.parametrize("case", ["rows", "strided-window", "just-under-half", "half"])
def test_small_view_records_only_its_bytes(case, make_offloader):
    """A view spanning less than half its storage records (writes, reads) only the bytes
    it can touch; from half up, the whole storage is recorded."""
    big = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0))  # 4 MiB
    storage_bytes = big.untyped_storage().nbytes()
    view = {"rows": big[10:20],
            "strided-window": big[100:110, 3:500:3],
            "just-under-half": big[1:512],
            "half": big[512:]}[case]
    first = view.storage_offset() * 4
    last = first + 4 * (1 + sum((n - 1) * st for n, st in zip(view.shape, view.stride())))
    expected = storage_bytes if case == "half" else last - first
    want = view.clone()
    off = make_offloader(min_tensor_bytes=4096, keep_tail_bytes=0, prefetch_bytes=0)
    calls = EngineCalls(off)
    (got,) = save_and_unpack([view], off)
    assert got.shape == view.shape and got.stride() == view.stride()
    assert torch.equal(got, want)
    s = off.stats()
    assert s.records_written == 1
    assert s.offloaded_bytes == expected
    assert s.unique_bytes == expected
    assert s.bytes_read == expected
    if case != "half":
        assert calls.writes == [(big.data_ptr() + first, expected)]
    assert [n for _, n in calls.reads] == [expected]
