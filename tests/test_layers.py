"""The import layers of docs/ARCHITECTURE.md ("Layers"), checked by scanning source.

Every module's imports are read with :mod:`ast` (module level and inside functions
alike), resolved to module names and checked against the table ``LAYERS`` (each package
or top-level module in one layer; an import goes to its own layer or below; the
policies and the estimate never import the store; no cycle between modules or between
packages), and:

    __init__, api, __main__, check, tools, testing   (top)
      -> ... estimate/, _offloader/, _policies/, _store/, _config, _device/, _decision/
      -> io/                                           (imports only io/ and the leaves)
      -> leaves: _errors, _align, _fork, _C, ...       (import nothing from ssdtrain)

plus: only ``ssdtrain/_device/cuda.py`` touches ``torch.cuda``; comments and docstrings
point inside the repository, and every invariant they cite by name is defined in
docs/ARCHITECTURE.md ("Invariants"). Each failure lists ``file:line: what``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ssdtrain"

# Modules ssdtrain/io/ may import from the rest of ssdtrain; each imports nothing from
# ssdtrain itself (checked below). `_C` is the extension module built from csrc/.
LEAVES = {"ssdtrain._errors", "ssdtrain._align", "ssdtrain._fork", "ssdtrain._C"}
EXTENSIONS = {"ssdtrain._C"}
# The top layer: the package, its public modules and the command line.
TOP_PRIVATE = {"ssdtrain.__main__"}

# ssdtrain's packages and top-level modules in their layers, lowest first
# (docs/ARCHITECTURE.md, "Layers"). An entry names a module or a package (every module
# under it); a module belongs to its longest entry (``testing.loopback`` is below the
# ``testing`` package's other modules). A module imports from its own layer or those
# below, never above; no module imports itself back through others (no cycle), and no
# package through another package. A new top-level module or package gets a row here.
LAYERS = (
    ("leaves", {"_errors", "_align", "_fork", "_C", "_identity", "_limits", "_stats"}),
    ("io", {"io"}),
    ("decision", {"_decision"}),
    ("device", {"_device", "testing.loopback"}),
    ("config", {"_config"}),
    ("store", {"_store"}),
    ("policies", {"_policies"}),
    ("offloader", {"_offloader"}),
    ("estimate", {"estimate"}),
    ("top", {"", "api", "__main__", "check", "tools", "testing"}),
)
# Layers that reach the store only through the top (api): the policies set a step's
# limits through the Offloader, and the estimate replays the pack decision without one.
NOT_INTO_STORE = {"policies", "estimate"}
# The only module that may touch torch.cuda, and those that may import a CUDA library.
CUDA_MODULE = "ssdtrain._device.cuda"
CUDA_LIBRARIES = {"kvikio", "cupy", "cuda", "pynvml", "cuda_python"}
CUDA_LIBRARY_MODULES = {"ssdtrain._device.cuda", "ssdtrain.io.gds"}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "integrations":            # installed as ssdtrain.integrations
        parts = ["ssdtrain"] + parts
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources(*trees):
    for tree in trees:
        for path in sorted((ROOT / tree).rglob("*.py")):
            if "__pycache__" not in path.parts:
                yield path


MODULES = {_module_name(p): p for p in _sources("ssdtrain", "integrations")}
KNOWN = set(MODULES) | EXTENSIONS


def _runtime_nodes(tree):
    """Every node of ``tree`` but those under ``if TYPE_CHECKING:`` (imports for type
    annotations only, which never run)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                stack.extend(child.orelse)
                continue
            stack.append(child)


def _imports(path: Path):
    """``(line, module name)`` for every import in the file, relative ones resolved.

    ``from X import name`` counts as an import of ``X.name`` where that is a module of
    ssdtrain (``from .. import _fork``), else of ``X``.
    """
    name = _module_name(path) if path.is_relative_to(PACKAGE) or \
        path.is_relative_to(ROOT / "integrations") else None
    package = None
    if name is not None:
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                assert package is not None, f"{path}:{node.lineno}: relative import outside a package"
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - (node.level - 1)])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                yield node.lineno, sub if sub in KNOWN else target


def _ssdtrain_imports(path: Path):
    """The ssdtrain modules ``path`` imports: sorted ``(line, module)`` pairs, each once."""
    return sorted({(line, mod) for line, mod in _imports(path)
                   if mod == "ssdtrain" or mod.startswith("ssdtrain.")})


def _where(path: Path, line: int) -> str:
    return f"{path.relative_to(ROOT)}:{line}"


def _report(violations, what):
    return f"{len(violations)} {what}:\n  " + "\n  ".join(violations)


def _is_io(mod: str) -> bool:
    return mod == "ssdtrain.io" or mod.startswith("ssdtrain.io.")


def _is_top(mod: str) -> bool:
    """Whether ``mod`` is in the top layer of LAYERS (the package, its public modules and
    packages, and the modules inside those: ``ssdtrain.check.cli`` too)."""
    entries = _entries()
    entry = _entry_of(mod, entries)
    return entry is not None and entries[entry][1] == "top"


def test_the_scan_sees_the_modules():
    """Guards the scan itself: it finds the layers it checks."""
    for mod in ("ssdtrain", "ssdtrain.api", "ssdtrain._store.store", "ssdtrain.io",
                "ssdtrain.io.posix", "ssdtrain.io.gds", "ssdtrain._device.transfers",
                "ssdtrain.integrations.megatron"):
        assert mod in MODULES, mod
    base = dict(_ssdtrain_imports(MODULES["ssdtrain.io.base"]))
    assert "ssdtrain._fork" in base.values() and "ssdtrain._errors" in base.values()
    assert ("ssdtrain.io.base" in
            {m for _, m in _ssdtrain_imports(MODULES["ssdtrain._device.transfers"])})
    assert _is_top("ssdtrain") and _is_top("ssdtrain.api") and _is_top("ssdtrain.check.compare")
    assert not _is_top("ssdtrain._store.store") and not _is_top("ssdtrain.testing.loopback")
    assert not _is_top("ssdtrain.estimate.replay") and not _is_top("ssdtrain.integrations.hf")


def test_io_imports_only_io_and_leaves():
    """(a) ssdtrain/io/ imports nothing of ssdtrain outside io/ but the leaves."""
    bad = []
    for mod, path in MODULES.items():
        if not _is_io(mod):
            continue
        for line, dep in _ssdtrain_imports(path):
            if not _is_io(dep) and dep not in LEAVES:
                bad.append(f"{_where(path, line)}: {mod} imports {dep}")
    assert not bad, _report(bad, "imports from ssdtrain/io/ past the leaves "
                                 f"({', '.join(sorted(LEAVES))})")


def test_leaves_import_nothing_from_ssdtrain():
    bad = []
    leaves = LEAVES | {"ssdtrain." + m for m in dict(LAYERS)["leaves"]}
    for leaf in sorted(leaves - EXTENSIONS):
        assert leaf in MODULES, f"leaf {leaf} does not exist"
        path = MODULES[leaf]
        bad += [f"{_where(path, line)}: leaf {leaf} imports {dep}"
                for line, dep in _ssdtrain_imports(path)]
    # The extension module: torch-free C++ that imports no Python module at all.
    for path in sorted((ROOT / "csrc").rglob("*")):
        if path.suffix in (".cpp", ".h", ".cc", ".hpp"):
            for i, text in enumerate(path.read_text().splitlines(), 1):
                if re.search(r"module_?::import\s*\(", text):
                    bad.append(f"{_where(path, i)}: ssdtrain._C imports a Python module")
    assert not bad, _report(bad, "imports from leaf modules")


def test_store_modules_do_not_import_the_top():
    """api -> store modules -> io: nothing below the top imports it, and the core never
    imports the adapters (integrations/)."""
    bad = []
    for mod, path in MODULES.items():
        if mod.startswith("ssdtrain.integrations"):
            continue
        for line, dep in _ssdtrain_imports(path):
            if dep.startswith("ssdtrain.integrations"):
                bad.append(f"{_where(path, line)}: the core module {mod} imports {dep}")
            elif _is_top(dep) and not _is_top(mod):
                bad.append(f"{_where(path, line)}: {mod} (below the top) imports {dep}")
    assert not bad, _report(bad, "upward imports")


def _cuda_uses(path: Path):
    """``(line, what)`` for each use of torch.cuda and each import of a CUDA library."""
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "cuda" and \
                isinstance(node.value, ast.Name) and node.value.id == "torch":
            yield node.lineno, "torch.cuda"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "torch.cuda" or alias.name.startswith("torch.cuda."):
                    yield node.lineno, "import torch.cuda"
                elif alias.name.split(".")[0] in CUDA_LIBRARIES:
                    yield node.lineno, f"import {alias.name}"
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module == "torch" and any(a.name == "cuda" for a in node.names):
                yield node.lineno, "from torch import cuda"
            elif node.module.startswith("torch.cuda"):
                yield node.lineno, f"from {node.module} import"
            elif node.module.split(".")[0] in CUDA_LIBRARIES:
                yield node.lineno, f"from {node.module} import"


def test_only_device_touches_cuda():
    """(b) torch.cuda only in ssdtrain/_device/cuda.py; CUDA libraries (kvikio, cupy) only
    there and in ssdtrain/io/gds.py."""
    bad = []
    for mod, path in MODULES.items():
        if mod.startswith("ssdtrain.integrations"):
            continue  # adapters are outside the core's layers (distributed needs the device)
        for line, what in _cuda_uses(path):
            torch_cuda = "torch" in what
            if (torch_cuda and mod != CUDA_MODULE) or \
                    (not torch_cuda and mod not in CUDA_LIBRARY_MODULES):
                bad.append(f"{_where(path, line)}: {mod} uses {what}")
    assert not bad, _report(bad, "CUDA uses outside ssdtrain/_device/cuda.py")
    assert list(_cuda_uses(MODULES[CUDA_MODULE])), "the scan no longer sees _cuda's CUDA"


def _private(mod: str) -> bool:
    return mod.startswith("ssdtrain.") and any(
        p.startswith("_") for p in mod.split(".")[1:])


def _private_attributes():
    """Names of private attributes and methods of ssdtrain's own classes: ``self._x``
    assigned, ``def _x`` in a class body, ``_x`` in ``__slots__``."""
    names = set()
    for path in _sources("ssdtrain"):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                    isinstance(node.value, ast.Name) and node.value.id == "self":
                names.add(node.attr)
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        names.add(item.name)
                    elif isinstance(item, ast.Assign) and any(
                            isinstance(t, ast.Name) and t.id == "__slots__" for t in item.targets):
                        names.update(c.value for c in ast.walk(item.value)
                                     if isinstance(c, ast.Constant) and isinstance(c.value, str))
    return {n for n in names if n.startswith("_") and not n.endswith("__")}


def _private_attribute_uses(path: Path, private):
    """``(line, expression)`` for each ``x._name`` where ``_name`` is a private attribute
    of an ssdtrain class and ``x`` is not ``self``/``cls`` (a class's own attributes)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr in private and not (
                isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            yield node.lineno, f"{ast.unparse(node.value)}.{node.attr}"


# Library code that uses an Offloader from outside, as an adapter does: the fault
# injector installs itself through Offloader.wrap_engine.
OUTSIDE_USERS = ("ssdtrain/io/faulty.py",)


def test_adapters_examples_benchmarks_use_public_names_only():
    """(c) integrations/, examples/, benchmarks/ and the library's own outside users
    (``OUTSIDE_USERS``) import no private ssdtrain module and touch no private attribute
    of an ssdtrain object (``off._store``, ``store._lock``...)."""
    private = _private_attributes()
    assert {"_store", "_lock", "_table", "_layers"} <= private  # guards the scan
    bad = []
    users = [ROOT / p for p in OUTSIDE_USERS]
    assert all(p.is_file() for p in users), OUTSIDE_USERS
    for path in [*_sources("integrations", "examples", "benchmarks"), *users]:
        own = "ssdtrain.integrations." if path.parent.name == "integrations" else None
        for line, dep in _ssdtrain_imports(path):
            if _private(dep) and not (own and dep.startswith(own)):  # adapters share theirs
                bad.append(f"{_where(path, line)}: imports {dep}")
        for line, expr in _private_attribute_uses(path, private):
            bad.append(f"{_where(path, line)}: uses {expr}")
    assert not bad, _report(bad, "uses of private ssdtrain names")


TEST_MODULES = {p.stem for p in (ROOT / "tests").glob("*.py")}


def _test_imports(path: Path):
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
        for name in names:
            top = name.split(".")[0]
            if top in TEST_MODULES or top == "tests":
                yield node.lineno, name
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                node.value in ("tests", "../tests"):
            yield node.lineno, f"path {node.value!r}"


def test_examples_and_benchmarks_do_not_use_test_code():
    """Examples and benchmarks are what users run: none imports the test suite's helpers
    or shims (``megatron_shim``...) or puts ``tests/`` on ``sys.path``."""
    assert "megatron_shim" in TEST_MODULES  # guards the scan
    bad = [f"{_where(path, line)}: {what}"
           for path in _sources("integrations", "examples", "benchmarks", "ssdtrain")
           for line, what in _test_imports(path)]
    assert not bad, _report(bad, "uses of test code")


# References to documents and trackers outside the repository. Comments name NOTE
# titles, sections of docs/ARCHITECTURE.md or its invariants (INV-EXACT...) instead;
# numbered invariants are gone, so a bare numbered one is flagged too. This file is
# scanned like any other: each pattern is written with regex escapes (`\s`, `\.`,
# `\(`, `\b` before a letter) where the text it catches has a space, a dot, a
# parenthesis or a word boundary, so its own source text never matches it.
OUTSIDE = [re.compile(p, re.IGNORECASE) for p in
           (r"DESIGN\s+invariant", r"\bissue\s+#?\d", r"DESIGN\.md", r"\bshared/",
            r"\(DESIGN\s*:", r"\binvariants?\s+\d")]
TEXT_SUFFIXES = {".py", ".pyi", ".cpp", ".cc", ".h", ".hpp", ".c", ".md", ".txt", ".sh",
                 ".toml", ".cfg", ".yaml", ".yml", ".json", ""}
# What the repository says about itself: the source trees, the tests, the docs, and
# the top-level files that explain or run it.
TEXT_TREES = ("ssdtrain", "integrations", "csrc", "benchmarks", "examples", "tests",
              "docs")
TEXT_FILES = ("README.md", "Makefile")


def _texts(trees=TEXT_TREES, files=TEXT_FILES):
    """``(path, text)`` of every text file of ``trees`` and of the top-level ``files``."""
    paths = [ROOT / name for name in files if (ROOT / name).is_file()]
    for tree in trees:
        paths += [path for path in sorted((ROOT / tree).rglob("*"))
                  if path.is_file() and "__pycache__" not in path.parts and
                  path.suffix in TEXT_SUFFIXES]
    for path in paths:
        try:
            yield path, path.read_text()
        except UnicodeDecodeError:
            continue


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def test_comments_point_inside_the_repository():
    scanned = {path.relative_to(ROOT).as_posix() for path, _ in _texts()}
    assert {"tests/test_layers.py", "docs/ARCHITECTURE.md", "README.md"} <= scanned
    bad = []
    for path, text in _texts():
        for pattern in OUTSIDE:  # \s+ also matches a reference broken over two lines
            for m in pattern.finditer(text):
                bad.append(f"{_where(path, _line(text, m.start()))}: {m.group(0)!r}")
    assert not bad, _report(bad, "references outside the repository (name a NOTE, a "
                                 "section or an INV- invariant of docs/ARCHITECTURE.md "
                                 "instead)")


# The invariants of docs/ARCHITECTURE.md ("Invariants"): comments cite them by name.
INVARIANT_NAME = re.compile(r"\bINV-[A-Z]+(?:-[A-Z]+)*\b")
# A definition: a heading or a list entry of that section that starts with the name.
INVARIANT_DEFINITION = re.compile(
    r"^(?:#{3,6}[ \t]+|[*-][ \t]+)[`*]*(INV-[A-Z]+(?:-[A-Z]+)*)\b", re.MULTILINE)
INVARIANTS = {"INV-EXACT", "INV-IDENTITY", "INV-OWNED", "INV-RETAIN", "INV-RELEASE",
              "INV-INNERMOST", "INV-NO-SWALLOW", "INV-INPLACE", "INV-THREADS",
              "INV-PRIVATE"}


def _invariants_section() -> str:
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    m = re.search(r"^## Invariants[ \t]*\n(.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    assert m, "docs/ARCHITECTURE.md has no \"## Invariants\" section"
    return m.group(1)


def test_cited_invariants_are_defined():
    """Every ``INV-`` name cited anywhere is defined (a heading or a list entry) in the
    "Invariants" section of docs/ARCHITECTURE.md, once; the section defines at least
    the invariants the code and the tests rely on."""
    names = INVARIANT_DEFINITION.findall(_invariants_section())
    duplicates = sorted({n for n in names if names.count(n) > 1})
    assert not duplicates, f"invariants defined twice: {duplicates}"
    defined = set(names)
    assert INVARIANTS <= defined, f"not defined: {sorted(INVARIANTS - defined)}"
    cited = 0
    bad = []
    for path, text in _texts():
        for m in INVARIANT_NAME.finditer(text):
            cited += 1
            if m.group(0) not in defined:
                bad.append(f"{_where(path, _line(text, m.start()))}: {m.group(0)}")
    assert cited > len(defined), "the scan found no citations"  # guards the scan
    assert not bad, _report(bad, "citations of undefined invariants (define them under "
                                 "\"## Invariants\" in docs/ARCHITECTURE.md)")


def _entry_of(mod: str, entries) -> str:
    """The longest entry of ``entries`` (full names) that is ``mod`` or a package of it."""
    best = None
    for entry in entries:
        if mod == entry or (entry != "ssdtrain" and mod.startswith(entry + ".")):
            if best is None or len(entry) > len(best):
                best = entry
    return best if best is not None else ("ssdtrain" if mod == "ssdtrain" else None)


def _entries():
    """``{full entry name: (rank, layer name)}`` from LAYERS."""
    out = {}
    for rank, (name, mods) in enumerate(LAYERS):
        for short in mods:
            mod = "ssdtrain" + ("." + short if short else "")
            assert mod not in out, f"{mod} is in two layers"
            out[mod] = (rank, name)
    return out


def _layer_of():
    """``{module: (rank, layer name)}`` for every module of ssdtrain that has an entry."""
    entries = _entries()
    out = {}
    for mod in set(_core_graph()) | EXTENSIONS:
        entry = _entry_of(mod, entries)
        if entry is not None:
            out[mod] = entries[entry]
    return out


def _core_graph():
    """``{module: {(line, dependency)}}`` over ssdtrain's own modules (not the adapters)."""
    return {mod: {(line, dep) for line, dep in _ssdtrain_imports(path)}
            for mod, path in MODULES.items() if not mod.startswith("ssdtrain.integrations")}


def test_every_module_has_a_layer():
    entries = _entries()
    core = set(_core_graph()) | EXTENSIONS
    homeless = sorted(mod for mod in core if _entry_of(mod, entries) is None)
    assert not homeless, f"modules with no layer in LAYERS: {homeless}"
    used = {_entry_of(mod, entries) for mod in core}
    assert not set(entries) - used, f"LAYERS names modules or packages that do not " \
                                    f"exist: {sorted(set(entries) - used)}"
    # Every subpackage is an entry: a package is a layer's unit, not a loose folder.
    packages = {mod for mod, path in MODULES.items()
                if path.name == "__init__.py" and mod.count(".") == 1 and
                path.is_relative_to(PACKAGE)}
    assert not packages - set(entries), f"packages with no row: {sorted(packages - set(entries))}"


def _package_graph(graph):
    """The import graph between LAYERS' entries (a package counts as one node)."""
    entries = _entries()
    out = {}
    for mod, deps in graph.items():
        src = _entry_of(mod, entries)
        out.setdefault(src, set())
        for line, dep in deps:
            dst = _entry_of(dep, entries)
            if dst is not None and dst != src:
                out[src].add((line, dst))
    return out


def _against_layers(graph, layer):
    """``[(module, line, what)]``: each import of ``graph`` that goes above its module's
    layer, or from the policies or the estimate into the store."""
    bad = []
    for mod, deps in sorted(graph.items()):
        rank, name = layer[mod]
        for line, dep in sorted(deps):
            if dep == mod or dep not in layer:
                continue
            dep_rank, dep_name = layer[dep]
            if dep_rank > rank:
                bad.append((mod, line, f"{mod} ({name}) imports {dep} ({dep_name}, above it)"))
            elif name in NOT_INTO_STORE and dep_name == "store":
                bad.append((mod, line, f"{mod} ({name}) imports the store module {dep}"))
    return bad


def _cycles(graph):
    """The import cycles of ``graph`` (strongly connected components of more than one
    module), imports inside functions included; the package's ``__init__`` (every module
    is imported through it) and self-imports aside."""
    edges = {mod: {dep for _, dep in deps if dep in graph and dep not in (mod, "ssdtrain")}
             for mod, deps in graph.items()}
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return cycles


def test_no_module_imports_from_a_layer_above_it():
    """Ranks follow LAYERS; the policies and the estimate never import the store."""
    bad = [f"{_where(MODULES[mod], line)}: {what}"
           for mod, line, what in _against_layers(_core_graph(), _layer_of())]
    assert not bad, _report(bad, "imports against the layers")


def test_no_import_cycle():
    assert not _cycles(_core_graph()), f"import cycles: {_cycles(_core_graph())}"


def test_no_package_imports_itself_back():
    """Below the top, no package imports another that imports it back (modules may sit
    in a package above the one they import, never in a loop of packages)."""
    graph = {src: {(line, dst) for line, dst in deps if not _is_top(dst)}
             for src, deps in _package_graph(_core_graph()).items() if not _is_top(src)}
    assert not _cycles(graph)
    assert not _cycles(graph), f"package cycles: {_cycles(graph)}"


def test_the_layer_checks_catch_what_they_guard():
    """Guards the checks: an upward import, an import of the store by the estimate and a
    cycle (the one this layout removed: ``_config`` <-> ``_hosttier``), each planted in
    a copy of the graph, are found; the real graph has none of them."""
    layer, graph = _layer_of(), _core_graph()
    assert layer["ssdtrain._store.store"][0] > layer["ssdtrain._decision.policy"][0] > \
        layer["ssdtrain._C"][0]
    assert layer["ssdtrain.testing.loopback"] == layer["ssdtrain._device.cuda"]
    def planting(*edges):
        copy = {mod: set(deps) for mod, deps in graph.items()}
        for line, (mod, dep) in enumerate(edges, 1):
            copy[mod].add((line, dep))
        return copy

    upward = planting(("ssdtrain._decision.policy", "ssdtrain._store.store"),
                      ("ssdtrain.estimate.replay", "ssdtrain._store.table"),
                      ("ssdtrain._config", "ssdtrain._store.hosttier"))
    found = {(mod, line) for mod, line, _ in _against_layers(upward, layer)}
    assert found == {("ssdtrain._decision.policy", 1), ("ssdtrain.estimate.replay", 2),
                     ("ssdtrain._config", 3)}
    cycle = planting(("ssdtrain._config", "ssdtrain._store.hosttier"),
                     ("ssdtrain._store.hosttier", "ssdtrain._config"))
    assert ["ssdtrain._config", "ssdtrain._store.hosttier"] in _cycles(cycle)
    assert not _cycles(graph)
    # Two modules that import each other's packages (no module cycle): a package cycle.
    packages = _package_graph(planting(("ssdtrain._device.transfers", "ssdtrain._store.table")))
    assert not _cycles(planting(("ssdtrain._device.transfers", "ssdtrain._store.table")))
    assert any({"ssdtrain._device", "ssdtrain._store"} <= set(c) for c in _cycles(packages))
    assert not _cycles(_package_graph(graph))


def test_type_only_imports_are_not_counted(tmp_path):
    """An import under ``if TYPE_CHECKING:`` never runs, so it makes no layer edge; one
    in its ``else:`` and one beside it do (guards ``_runtime_nodes``)."""
    path = tmp_path / "m.py"
    path.write_text("from typing import TYPE_CHECKING\n"
                    "if TYPE_CHECKING:\n    import ssdtrain._store.store\n"
                    "else:\n    import ssdtrain._decision.policy\n"
                    "def f():\n    if typing.TYPE_CHECKING:\n        import ssdtrain.api\n"
                    "    import ssdtrain._stats\n")
    assert sorted(mod for _, mod in _imports(path)) == \
        ["ssdtrain._decision.policy", "ssdtrain._stats", "typing"]


# A path to a source file of the repository, as comments, docstrings and docs name one.
SOURCE_PATH = re.compile(r"(?<![\w/.-])((?:ssdtrain|integrations|tests|benchmarks|tools|"
                         r"examples|docs|csrc)/[\w/]+\.(?:py|cpp|h|md))\b")


def test_named_source_files_exist():
    """Every source file a comment, docstring or document names by its path from the
    repository's root exists: a module moved or split is renamed where it is cited, not
    left pointing at nothing (docs/results, records of past runs, aside)."""
    bad, seen = [], 0
    for path, text in _texts():
        if "results" in path.relative_to(ROOT).parts:
            continue
        for m in SOURCE_PATH.finditer(text):
            seen += 1
            if not (ROOT / m.group(1)).exists():
                bad.append(f"{_where(path, _line(text, m.start()))}: {m.group(1)}")
    assert seen > 100, "the scan found no paths"  # guards the scan
    assert not bad, _report(bad, "paths to files that do not exist")
