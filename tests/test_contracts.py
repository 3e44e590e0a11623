"""Contracts kept by code, not by prose: each rule is one function or
one type, and these tests check that nothing goes around it.

* A record's state changes through ``_records.transition`` alone (NOTE [ Record state
  machine ]): ``Record.state`` is read-only, nothing else writes the slot behind it, and
  the store calls ``transition`` only from ``RecordTable.move`` (which also moves the
  aggregates that follow the state: NOTE [ Record table ] in ssdtrain/_table.py).
  Checked at run time and by scanning the source.
* What an engine's requests take (``crc=``, ``device=``) is declared on its type
  (NOTE [ Engine capabilities ] in ssdtrain/io/base.py): every engine class declares
  ``capabilities``, one that does not cannot be made, and wrappers (fault injection
  included) have their inner engine's, so a fault-injection run takes the CRC path a
  production run takes.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
from pathlib import Path

import pytest
import torch

from ssdtrain import _records
from ssdtrain._records import Record, State

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted(p for tree in ("ssdtrain", "integrations") for p in (ROOT / tree).rglob("*.py")
                 if "__pycache__" not in p.parts)


class _Scan(ast.NodeVisitor):
    """Every write of a record's state and every call of ``transition`` in one module,
    with the qualified name of the function it is in."""

    def __init__(self, path, handles_records):
        self.path = path
        self.handles_records = handles_records
        self.scope = []
        self.writes = []   # (line, scope, what)
        self.calls = []    # (line, scope)

    def _visit_scope(self, node):
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _visit_scope

    def _target(self, target, line):
        for t in ast.walk(target):
            if isinstance(t, ast.Attribute) and isinstance(t.ctx, ast.Store) and (
                    t.attr == "_state" or (t.attr == "state" and self.handles_records)):
                self.writes.append((line, ".".join(self.scope), f".{t.attr} ="))

    def visit_Assign(self, node):
        for target in node.targets:
            self._target(target, node.lineno)
        self.generic_visit(node)

    def visit_AugAssign(self, node):
        self._target(node.target, node.lineno)
        self.generic_visit(node)

    visit_AnnAssign = visit_AugAssign

    def visit_Call(self, node):
        fn = node.func
        name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) \
            else None
        if name == "transition":
            self.calls.append((node.lineno, ".".join(self.scope)))
        if name in ("setattr", "__setattr__") and len(node.args) >= 2 and \
                isinstance(node.args[1], ast.Constant) and node.args[1].value in ("state",
                                                                                  "_state"):
            self.writes.append((node.lineno, ".".join(self.scope), f"{name}(..., "
                                f"{node.args[1].value!r})"))
        self.generic_visit(node)


def _imports_records(tree):
    """Whether a module uses ssdtrain's records (imports ``_records`` or the store)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and \
                node.module.split(".")[-1] in ("_records", "_store"):
            return True
    return False


@functools.lru_cache(maxsize=None)
def _scans():
    out = []
    for path in SOURCES:
        tree = ast.parse(path.read_text(), str(path))
        scan = _Scan(path.relative_to(ROOT), _imports_records(tree))
        scan.visit(tree)
        out.append(scan)
    return tuple(out)


def test_record_state_cannot_be_assigned():
    t = torch.zeros(4)
    rec = Record(0, None, 0, 16, 0, t, 1, t.untyped_storage())
    with pytest.raises(AttributeError):
        rec.state = State.FREED
    assert rec.state is State.PENDING
    _records.transition(rec, State.KEPT)
    assert rec.state is State.KEPT
    with pytest.raises(AssertionError, match="illegal record transition kept -> on_disk"):
        _records.transition(rec, State.ON_DISK)
    assert rec.state is State.KEPT


def test_only_transition_writes_a_record_state():
    allowed = {("ssdtrain/_records.py", "transition"), ("ssdtrain/_records.py", "Record.__init__")}
    bad = [f"{s.path}:{line}: {what} in {scope or '<module>'}"
           for s in _scans() for line, scope, what in s.writes
           if (str(s.path), scope) not in allowed]
    assert not bad, "a record state written outside transition():\n" + "\n".join(bad)


def test_the_store_calls_transition_only_from_the_record_table():
    allowed = {("ssdtrain/_table.py", "RecordTable.move")}
    calls = [(str(s.path), scope, line) for s in _scans() for line, scope in s.calls]
    assert ("ssdtrain/_table.py", "RecordTable.move") in {(p, sc) for p, sc, _ in calls}
    bad = [f"{p}:{line}: transition() in {scope}" for p, scope, line in calls
           if (p, scope) not in allowed]
    assert not bad, ("a state change that bypasses RecordTable.move (its aggregates go "
                     "stale):\n" + "\n".join(bad))


# --------------------------------------------------- NOTE [ Engine capabilities ]
def _engine_classes():
    """Every engine class ssdtrain and the test helpers define (imported first)."""
    import manual_engine  # noqa: F401 - test helpers' engines count too
    import ssdtrain.io.faulty  # noqa: F401
    import ssdtrain.io.gds  # noqa: F401
    import ssdtrain.io.native  # noqa: F401
    import ssdtrain.io.posix  # noqa: F401
    from ssdtrain.io.base import Engine
    out, todo = [], [Engine]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub.__module__.startswith(("ssdtrain", "manual_engine", "test_")):
                out.append(sub)
            todo.append(sub)
    return out


def _takes(fn, name):
    params = inspect.signature(fn).parameters
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def test_every_engine_class_declares_its_capabilities():
    import test_fork  # noqa: F401 - GatedEngine
    import test_timeouts  # noqa: F401 - SlowEngine
    from ssdtrain.io.base import Capabilities, Engine, EngineWrapper
    classes = _engine_classes()
    names = {c.__name__ for c in classes}
    assert {"PosixEngine", "NativeEngine", "KvikioEngine", "FaultyEngine", "EngineWrapper",
            "ManualEngine", "GatedEngine", "SlowEngine"} <= names, names
    bad = []
    for cls in classes:
        declared = [k for k in cls.__mro__ if k is not Engine and "capabilities" in k.__dict__]
        if not declared:
            bad.append(f"{cls.__qualname__}: no capabilities")
            continue
        caps = declared[0].__dict__["capabilities"]
        if isinstance(caps, property):  # a wrapper: inner's, and every keyword passes on
            assert issubclass(cls, EngineWrapper), cls
            for op in (cls.write, cls.read):
                if not _takes(op, "crc") or not _takes(op, "device"):
                    bad.append(f"{cls.__qualname__}.{op.__name__} does not forward keywords")
            continue
        if not isinstance(caps, Capabilities):
            bad.append(f"{cls.__qualname__}.capabilities is {caps!r}")
            continue
        for flag, kw in (("checksums", "crc"), ("device_memory", "device")):
            for op in (cls.write, cls.read):
                if getattr(caps, flag) and not _takes(op, kw):
                    bad.append(f"{cls.__qualname__} declares {flag} but "
                               f"{op.__name__}() takes no {kw}=")
    assert not bad, "\n".join(bad)


def test_an_engine_class_without_capabilities_cannot_be_made():
    from ssdtrain.io.base import Engine

    class Bare(Engine):
        def write(self, file, offset, address, nbytes):
            raise AssertionError

        read = write

        def shutdown(self):
            pass

    with pytest.raises(TypeError, match="does not declare its capabilities"):
        Bare()


def test_engine_capabilities_are_read_only():
    from ssdtrain.io.posix import PosixEngine
    engine = PosixEngine(io_threads=1)
    try:
        with pytest.raises(AttributeError):
            engine.checksums = True
        with pytest.raises(dataclasses.FrozenInstanceError):
            engine.capabilities.checksums = True
    finally:
        engine.shutdown()


def _inner_engines():
    from ssdtrain.io import native
    yield "posix"
    if native.available():
        yield "native"


@pytest.mark.parametrize("inner_name", list(_inner_engines()))
@pytest.mark.parametrize("wrapper", ["EngineWrapper", "FaultyEngine", "ManualEngine"])
def test_wrappers_have_their_inner_engines_capabilities(tmp_path, inner_name, wrapper):
    import manual_engine
    from ssdtrain.io.base import EngineWrapper
    from ssdtrain.io.faulty import FaultyEngine
    from ssdtrain.io.native import NativeEngine
    from ssdtrain.io.posix import PosixEngine
    from ssdtrain.tools import SpillSet, crc32c
    inner = NativeEngine(io_threads=2) if inner_name == "native" else PosixEngine(io_threads=2)
    make = {"EngineWrapper": EngineWrapper, "FaultyEngine": FaultyEngine,
            "ManualEngine": manual_engine.ManualEngine}[wrapper]
    engine = make(inner)
    spill = SpillSet([str(tmp_path)], "off")
    try:
        assert engine.capabilities == inner.capabilities
        assert (engine.name, engine.backend, engine.checksums) == \
            (inner.name, inner.backend, inner.checksums)
        src = torch.arange(10_000, dtype=torch.uint8)
        slot = spill.alloc(src.numel(), src.data_ptr() % 4096)
        kw = {"crc": True} if engine.capabilities.checksums else {}
        fut = engine.write(slot.file, slot.offset, src.data_ptr(), src.numel(), **kw)
        if wrapper == "ManualEngine":
            engine.complete(0)
        want = crc32c(src.data_ptr(), src.numel()) if kw else src.numel()
        assert fut.result(timeout=30) == want
    finally:
        engine.shutdown()
        spill.close()


@pytest.mark.skipif("not __import__('ssdtrain').io.native.available()")
def test_fault_injection_takes_the_production_crc_path(make_offloader, monkeypatch):
    """Under ``faulty.install`` the native engine's workers still take the CRCs
    (``crc=True``), as without it: no CRC in Python; a corrupted read is still caught."""
    import ssdtrain
    from helpers import SaveForBackward
    from ssdtrain import _checksum
    from ssdtrain.io import faulty
    real = _checksum.crc32c
    calls = []
    monkeypatch.setattr(_checksum, "crc32c", lambda *a: calls.append(a) or real(*a))
    off = make_offloader(engine="native", verify=True, min_tensor_bytes=1, keep_tail_bytes=0,
                         prefetch_bytes=0)
    inj = faulty.install(off, faulty.Fault("read", "corrupt", nth=2))
    for attempt in range(2):
        t = torch.randn(100_001)
        anchor = torch.zeros((), requires_grad=True)
        sink = []
        with off:
            out = SaveForBackward.apply(anchor, sink, t)
            off.wait()
        if attempt == 0:
            out.backward()
            assert torch.equal(sink[0][0], t)
        else:
            with pytest.raises(ssdtrain.IntegrityError, match="CRC32C"):
                out.backward()
    assert inj.injected == [("read", 2, "corrupt")]
    assert calls == [], "a CRC taken in Python: the wrapper hid the engine's checksums"


# ------------------------------------------------ NOTE [ Memory owned by requests ]
def test_the_bandwidth_probe_keeps_its_buffer_and_slot_past_a_timeout(make_offloader):
    """The adaptive policy's bandwidth probe goes through the store's probe (``Probe.time_io``):
    a write past ``io_timeout_s`` raises an ssdtrain error, keeps its buffer (owned by
    the request) and its disk slot until it really ends; then the slot is freed."""
    import ssdtrain
    from ssdtrain._profile import measure_bandwidth
    from ssdtrain.io import faulty
    off = make_offloader(io_timeout_s=0.2)
    inj = faulty.install(off, faulty.Fault("write", "hang"))
    nbytes = 1 << 20
    with pytest.raises(ssdtrain.SpillIOError, match="bandwidth probe's write.*io_timeout_s=0.2"):
        measure_bandwidth(off._store, nbytes=nbytes, repeats=1)
    (fut, *_), = inj._hung
    assert off.spill_bytes_in_use() >= nbytes, "the slot was freed under a running write"
    view, buf = fut.ssdtrain_owners  # the request owns its buffer: still mapped
    assert not buf.closed and int(view[nbytes - 1]) == 0x5A
    del view, buf
    inj._hung.clear()
    fut.set_result(nbytes)  # the hung write ends now
    assert off.spill_bytes_in_use() == 0
    off._store.check_invariants()
    inj.faults.clear()
    w, r = measure_bandwidth(off._store, nbytes=nbytes, repeats=1)
    assert w > 0 and r > 0 and off.spill_bytes_in_use() == 0


def test_engine_requests_are_made_only_where_they_own_their_memory():
    """Outside ssdtrain/io/, an engine's ``write``/``read`` is called in three functions
    only, each of which hands the request the memory it uses (``_owning``)."""
    allowed = {("ssdtrain/_writeback.py", "WritePath.submit_write"),
               ("ssdtrain/_prefetch.py", "ReadPath.submit_read"),
               ("ssdtrain/_probe.py", "Probe.submit")}
    found = set()
    for path in SOURCES:
        rel = str(path.relative_to(ROOT))
        if rel.startswith("ssdtrain/io/"):
            continue
        tree = ast.parse(path.read_text(), rel)
        for scope, node in _walk_scoped(tree):
            if isinstance(node, ast.Attribute) and node.attr in ("write", "read") and \
                    "engine" in ast.unparse(node.value):
                found.add((rel, scope, node.lineno))
    bad = [f"{p}:{line}: engine.{'write/read'} in {scope}" for p, scope, line in sorted(found)
           if (p, scope) not in allowed]
    assert not bad, "an engine request outside the functions that own its memory:\n" + \
        "\n".join(bad)
    assert {(p, s) for p, s, _ in found} == allowed


def _walk_scoped(tree, scope=()):
    for node in ast.iter_child_nodes(tree):
        inner = scope + (node.name,) if isinstance(node, (ast.FunctionDef, ast.ClassDef,
                                                          ast.AsyncFunctionDef)) else scope
        yield ".".join(inner), node
        yield from _walk_scoped(node, inner)
