"""Import layering: which parts of ``lantern_rt`` may import which, no import cycles, no eager TensorRT.

Which parts may import which is one table of layers, read from docs/architecture.md ("Layers"): a
module imports only from its own layer or below, but for the upward imports the doc allows by name.

The checks read the source with :mod:`ast` (nothing is imported), so they see every import, including
the ones inside functions and methods (a lazy import still ties the layers together and can still
close a cycle at run time) and the ones under ``if TYPE_CHECKING:`` (they tie the modules for a
reader and a type checker, and close cycles there). The last test imports the TensorRT backend in a
fresh interpreter and looks at ``sys.modules``, which catches what the source alone cannot (a
package ``__init__`` that pulls more in).

The first tests check the analyser itself on small synthetic sources, so that it can fail too.
"""

from __future__ import annotations

import ast
import functools
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

import lantern_rt

PACKAGE_DIR = Path(lantern_rt.__file__).resolve().parent
REPO_ROOT = PACKAGE_DIR.parent
PKG = PACKAGE_DIR.name  # "lantern_rt"


# --------------------------------------------------------------------------------------------------
# The analyser


@dataclass(frozen=True)
class Import:
    """One imported module, as the importing file names it (relative imports resolved)."""

    line: int
    target: str  # absolute dotted module name
    lazy: bool  # inside a function or method body (runs when called, not at module import)
    typing: bool = False  # under ``if TYPE_CHECKING:`` (read by type checkers, never run)


@dataclass(frozen=True)
class Edge:
    """An import of a package module by another, located in the importing file."""

    source: str  # importing module
    where: str  # file:line
    target: str  # imported module
    lazy: bool
    via: str = ""  # for an implicit edge to a package __init__: the submodule actually named
    typing: bool = False

    def __str__(self) -> str:
        notes = (
            (["function-level"] if self.lazy else [])
            + (["type-checking"] if self.typing else [])
            + ([f"package __init__ of {self.via}"] if self.via else [])
        )
        return f"{self.where} -> {self.target}" + (f"  ({', '.join(notes)})" if notes else "")


def _is_type_checking(test: ast.expr) -> bool:
    """``TYPE_CHECKING`` or ``typing.TYPE_CHECKING`` (any ``x.TYPE_CHECKING``)."""
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _package_of(module: str, is_package: bool) -> str:
    """The package that relative imports in ``module`` are relative to."""
    return module if is_package else module.rpartition(".")[0]


def find_imports(
    source: str,
    module: str,
    *,
    is_package: bool = False,
    is_module: Callable[[str], bool] = lambda name: False,
) -> list[Import]:
    """Every module that ``source`` (the text of ``module``) imports, those under ``if
    TYPE_CHECKING:`` too (marked ``typing``).

    ``from a import b`` names ``a.b`` when ``is_module("a.b")`` (a submodule), else ``a``. Imports
    of other packages are kept too (the TensorRT rule needs them); ``import a.b`` names ``a.b``.
    """
    tree = ast.parse(source)
    found: list[Import] = []
    package = _package_of(module, is_package)

    def resolve_from(node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        parts = package.split(".") if package else []
        if node.level - 1 > len(parts) - 1:
            raise ValueError(f"{module}:{node.lineno}: relative import beyond the top-level package")
        base = ".".join(parts[: len(parts) - (node.level - 1)])
        return f"{base}.{node.module}" if node.module else base

    def visit(node: ast.AST, lazy: bool, typing: bool) -> None:
        for child in ast.iter_child_nodes(node):
            visit_stmt(child, lazy, typing)

    def visit_stmt(child: ast.AST, lazy: bool, typing: bool) -> None:
        if isinstance(child, ast.Import):
            found.extend(Import(child.lineno, alias.name, lazy, typing) for alias in child.names)
        elif isinstance(child, ast.ImportFrom):
            base = resolve_from(child)
            for alias in child.names:
                sub = f"{base}.{alias.name}"
                named = sub if alias.name != "*" and is_module(sub) else base
                found.append(Import(child.lineno, named, lazy, typing))
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.body:
                visit_stmt(stmt, lazy, True)
            for stmt in child.orelse:
                visit_stmt(stmt, lazy, typing)
        else:
            inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(child, inner, typing)

    visit(tree, False, False)
    # One entry per (line, target): ``from a import b, c`` that both resolve to ``a`` is one import.
    return list(dict.fromkeys(found))


@dataclass
class Scan:
    """A package read from disk: its modules (by dotted name), their files and their imports."""

    root: Path  # the directory holding the top-level package
    files: dict[str, Path]
    imports: dict[str, list[Import]]

    def where(self, module: str, line: int) -> str:
        return f"{self.files[module].relative_to(self.root).as_posix()}:{line}"

    def edges(self, module: str, prefix: str) -> list[Edge]:
        """The imports of ``module`` whose targets lie under ``prefix`` (``prefix`` itself included)."""
        return [
            Edge(module, self.where(module, imp.line), imp.target, imp.lazy, typing=imp.typing)
            for imp in self.imports[module]
            if _under(imp.target, prefix)
        ]


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def module_exists(root: Path, name: str) -> bool:
    """``name`` is a module or package under ``root``: ``a/b.py``, ``a/b/__init__.py``, or a namespace
    package directory ``a/b/`` (``lantern_rt/runtime`` has no ``__init__.py``)."""
    path = root.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or path.is_dir()


def scan_package(package_dir: Path) -> Scan:
    package_dir = package_dir.resolve()
    root = package_dir.parent
    files: dict[str, Path] = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join(parts)] = path
    is_module = functools.partial(module_exists, root)
    imports = {
        name: find_imports(
            path.read_text(encoding="utf-8"), name, is_package=path.name == "__init__.py", is_module=is_module
        )
        for name, path in files.items()
    }
    return Scan(root, files, imports)


@functools.cache
def real_package() -> Scan:
    return scan_package(PACKAGE_DIR)


def import_graph(scan: Scan, prefix: str) -> dict[str, dict[str, list[Edge]]]:
    """module -> imported module -> the imports, among modules with a file under ``prefix``.

    Importing ``a.b.c`` also runs the ``__init__`` of ``a`` and ``a.b``; that is an edge too when
    the importer lies outside that package (from inside, the ``__init__`` is already running).
    An ``__init__`` that imports nothing of the package (all of them here, at the time of writing)
    cannot close a cycle, so these edges only matter once one does. A namespace package has no
    file and runs nothing: no node. Self-imports are dropped.
    """
    graph: dict[str, dict[str, list[Edge]]] = {name: {} for name in scan.files if _under(name, prefix)}
    for source in graph:
        for edge in scan.edges(source, prefix):
            parts = edge.target.split(".")
            ancestors = [".".join(parts[:i]) for i in range(1, len(parts))]
            implicit = [
                Edge(source, edge.where, pkg, edge.lazy, via=edge.target, typing=edge.typing)
                for pkg in ancestors
                if not _under(source, pkg)
            ]
            for e in [edge, *implicit]:
                if e.target in graph and e.target != source:
                    graph[source].setdefault(e.target, []).append(e)
    return graph


def strongly_connected(graph: dict[str, Iterable[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iteratively; each sorted, in a stable order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))
    return sorted(components)


def _shortest_cycle(graph: dict[str, Iterable[str]], start: str, allowed: set[str]) -> list[str]:
    """The shortest path start -> ... -> start inside ``allowed`` (breadth first), or []."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node]):
                if child not in allowed:
                    continue
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    return []


def find_cycles(graph: dict[str, dict[str, list[Edge]]]) -> list[list[str]]:
    """Each import cycle as [a, b, ..., a]: in every strongly connected component, the shortest cycle
    through each of its modules (duplicates, the same cycle rotated, reported once)."""
    cycles: list[list[str]] = []
    seen: set[tuple[str, ...]] = set()
    for component in strongly_connected(graph):
        if len(component) < 2:
            continue
        for start in component:
            cycle = _shortest_cycle(graph, start, set(component))
            body = cycle[:-1]
            turn = body.index(min(body))
            key = tuple(body[turn:] + body[:turn])
            if key not in seen:
                seen.add(key)
                cycles.append([*key, key[0]])
    return cycles


def describe_cycles(graph: dict[str, dict[str, list[Edge]]], cycles: list[list[str]]) -> str:
    lines = []
    for number, cycle in enumerate(cycles, 1):
        lines.append(f"cycle {number}: {' -> '.join(cycle)}")
        for a, b in zip(cycle, cycle[1:], strict=False):
            lines.extend(f"    {edge}" for edge in graph[a][b])
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# The table of layers (docs/architecture.md, "Layers")


@dataclass(frozen=True)
class Layers:
    """A table of layers: each entry (a module, or a package and every module under it) with its
    layer, 0 at the bottom; and the upward imports allowed by name, (importing module, imported)."""

    entries: dict[str, int]  # dotted name -> layer
    packages: frozenset[str]  # the entries that are packages
    allowed: frozenset[tuple[str, str]]

    def layer_of(self, module: str) -> int | None:
        """The layer of the most specific entry that holds ``module`` (None: no entry does)."""
        holding = [
            entry
            for entry in self.entries
            if module == entry or (entry in self.packages and module.startswith(entry + "."))
        ]
        return self.entries[max(holding, key=len)] if holding else None


def entry_name(path: str, package: str) -> tuple[str, bool]:
    """A table entry as a dotted name, and whether it is a package: ``cli/`` is ``package.cli``
    and every module under it, ``engines/cli.py`` the module ``package.engines.cli``,
    ``__init__.py`` the package's own ``__init__``."""
    if path.endswith("/"):
        return ".".join([package, *path.rstrip("/").split("/")]), True
    if not path.endswith(".py"):
        raise ValueError(f"layer table: {path!r} is neither a module (name.py) nor a package (name/)")
    parts = path.removesuffix(".py").split("/")
    return ".".join([package, *(parts[:-1] if parts[-1] == "__init__" else parts)]), False


_LAYER_ROW = re.compile(r"^\|\s*(\d+)\s*\|([^|]*)\|")
_ALLOWED = re.compile(r"^- Allowed upward: `([^`]+)` imports `([^`]+)`")


def parse_layers(text: str, package: str, heading: str = "## Layers") -> Layers:
    """The table of the section ``heading`` of a Markdown text: rows ``| N | `entry` ... | what |``,
    the top layer first, N counting down to 0; and its lines ``- Allowed upward: `a.py` imports
    `b.py` ...``, each one upward import allowed by name."""
    lines = text.splitlines()
    if heading not in lines:
        raise ValueError(f"no section {heading!r}")
    start = lines.index(heading) + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    entries: dict[str, int] = {}
    packages: set[str] = set()
    allowed: set[tuple[str, str]] = set()
    numbers = []
    for line in lines[start:end]:
        if row := _LAYER_ROW.match(line):
            number = int(row.group(1))
            numbers.append(number)
            for path in re.findall(r"`([^`]+)`", row.group(2)):
                name, is_package = entry_name(path, package)
                if name in entries:
                    raise ValueError(f"layer table: {path} is in two rows")
                entries[name] = number
                if is_package:
                    packages.add(name)
        elif match := _ALLOWED.match(line):
            importer, imported = (entry_name(path, package) for path in match.groups())
            if importer[1] or imported[1]:
                raise ValueError(f"layer table: an allowed import names two modules, not {line!r}")
            allowed.add((importer[0], imported[0]))
    if not numbers or numbers != list(range(len(numbers) - 1, -1, -1)):
        raise ValueError(f"layer table: the rows must count down to 0, not {numbers}")
    return Layers(entries, frozenset(packages), frozenset(allowed))


def layer_violations(scan: Scan, prefix: str, layers: Layers) -> list[str]:
    """What breaks the table in the package ``prefix``: a module in no layer, an entry that holds
    no module, an import of a higher layer (function-level ones too) that is not allowed by name,
    and an allowed import that no module makes."""
    modules = [m for m in scan.files if _under(m, prefix)]
    problems = [
        f"{scan.where(m, 1).removesuffix(':1')}: in no layer of the table (add it to a row)"
        for m in modules
        if layers.layer_of(m) is None
    ]
    problems += [
        f"the table's entry {entry} holds no module (renamed or removed?)"
        for entry in layers.entries
        if not any(m == entry or (entry in layers.packages and _under(m, entry)) for m in modules)
    ]
    used = set()
    for module in modules:
        own = layers.layer_of(module)
        for edge in scan.edges(module, prefix):
            theirs = layers.layer_of(edge.target)
            if edge.target == module or own is None or (theirs is not None and theirs <= own):
                continue
            if (module, edge.target) in layers.allowed:
                used.add((module, edge.target))
            elif theirs is None:
                problems.append(f"{edge}  (a module in no layer of the table)")
            else:
                problems.append(f"{edge}  (layer {own} imports layer {theirs})")
    problems += [
        f"{a} -> {b} is allowed upward but no longer imported: remove the line"
        for a, b in sorted(layers.allowed - used)
    ]
    return problems


# --------------------------------------------------------------------------------------------------
# The analyser on synthetic sources


def _targets(source: str, module: str = "pkg.sub.mod", **kwargs) -> list[tuple[str, bool]]:
    return [(imp.target, imp.lazy) for imp in find_imports(textwrap.dedent(source), module, **kwargs)]


def test_type_checking_imports_are_counted_and_marked():
    source = """
        import typing
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from pkg.a import A
        if typing.TYPE_CHECKING:
            import pkg.b
        else:
            import pkg.c
        def f():
            if TYPE_CHECKING:
                import pkg.d
    """
    found = find_imports(textwrap.dedent(source), "pkg.sub.mod")
    assert [(imp.target, imp.lazy, imp.typing) for imp in found] == [
        ("typing", False, False),
        ("typing", False, False),
        ("pkg.a", False, True),
        ("pkg.b", False, True),
        ("pkg.c", False, False),  # the else branch runs
        ("pkg.d", True, True),
    ]


def test_function_and_method_imports_are_counted_and_marked_lazy():
    source = """
        import pkg.top
        try:
            import pkg.in_try
        except ImportError:
            pkg = None
        class C:
            import pkg.in_class
            def method(self):
                import pkg.in_method
        async def g():
            with open("x"):
                from pkg import thing
    """
    assert _targets(source) == [
        ("pkg.top", False),
        ("pkg.in_try", False),
        ("pkg.in_class", False),  # a class body runs at module import
        ("pkg.in_method", True),
        ("pkg", True),
    ]


def test_from_import_names_the_submodule_only_when_it_exists():
    source = "from pkg.sub import mod2, CONSTANT, other\nfrom pkg.sub import *\n"
    modules = {"pkg.sub.mod2", "pkg.sub.other"}
    assert _targets(source, is_module=modules.__contains__) == [
        ("pkg.sub.mod2", False),
        ("pkg.sub", False),
        ("pkg.sub.other", False),
        ("pkg.sub", False),  # line 2: the star import
    ]


def test_relative_imports_are_resolved():
    source = """
        from . import sibling
        from .sibling import name
        from .. import top
        from ..other.deep import thing
    """
    modules = {"pkg.sub.sibling", "pkg.top", "pkg.other.deep.thing"}.__contains__
    assert _targets(source, "pkg.sub.mod", is_module=modules) == [
        ("pkg.sub.sibling", False),
        ("pkg.sub.sibling", False),
        ("pkg.top", False),
        ("pkg.other.deep.thing", False),
    ]
    # In a package's __init__, "." is the package itself.
    assert _targets(
        "from . import mod\nfrom .mod import x\nfrom .. import y\n", "pkg.sub", is_package=True
    ) == [
        ("pkg.sub", False),
        ("pkg.sub.mod", False),
        ("pkg", False),
    ]
    with pytest.raises(ValueError, match="beyond the top-level package"):
        find_imports("from ... import x\n", "pkg.mod")


def _write_package(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text), encoding="utf-8")
    return root / "pkg"


def test_cycle_through_a_function_level_import_is_found(tmp_path):
    package = _write_package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from pkg.b import B\n",
            "pkg/b.py": """
                from typing import TYPE_CHECKING
                if TYPE_CHECKING:
                    from pkg.c import C
                def f():
                    from pkg import a
            """,
            "pkg/c.py": "import pkg.b\n",  # pkg.b -> pkg.c only under TYPE_CHECKING: a cycle too
            "pkg/ns/leaf.py": "from pkg.ns import other\n",  # namespace package, no __init__.py
            "pkg/ns/other.py": "from . import leaf\n",
        },
    )
    scan = scan_package(package)
    assert sorted(scan.files) == ["pkg", "pkg.a", "pkg.b", "pkg.c", "pkg.ns.leaf", "pkg.ns.other"]
    graph = import_graph(scan, "pkg")
    assert find_cycles(graph) == [
        ["pkg.a", "pkg.b", "pkg.a"],
        ["pkg.b", "pkg.c", "pkg.b"],
        ["pkg.ns.leaf", "pkg.ns.other", "pkg.ns.leaf"],
    ]
    report = describe_cycles(graph, find_cycles(graph))
    assert "pkg/a.py:1 -> pkg.b\n" in report
    assert "pkg/b.py:6 -> pkg.a  (function-level)" in report
    assert "pkg/b.py:4 -> pkg.c  (type-checking)" in report


def test_cycle_through_a_package_init_is_found_and_intra_package_inits_are_not(tmp_path):
    package = _write_package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/core.py": "import pkg.sub.leaf\n",  # runs pkg/sub/__init__.py first
            "pkg/sub/__init__.py": "from pkg.core import X\nfrom pkg.sub.leaf import Y\n",
            "pkg/sub/leaf.py": "from pkg.sub.util import Z\n",  # inside pkg.sub: no edge to its __init__
            "pkg/sub/util.py": "",
        },
    )
    graph = import_graph(scan_package(package), "pkg")
    assert find_cycles(graph) == [["pkg.core", "pkg.sub", "pkg.core"]]
    assert "pkg/core.py:1 -> pkg.sub  (package __init__ of pkg.sub.leaf)" in describe_cycles(
        graph, find_cycles(graph)
    )


def test_every_cycle_in_a_component_is_reported():
    graph = {"a": {"b": []}, "b": {"a": [], "c": []}, "c": {"b": []}, "d": {"a": []}}
    assert strongly_connected(graph) == [["a", "b", "c"], ["d"]]
    assert find_cycles(graph) == [["a", "b", "a"], ["b", "c", "b"]]
    assert find_cycles({"x": {"y": []}, "y": {"z": []}, "z": {"x": []}}) == [["x", "y", "z", "x"]]


def test_layer_violations_are_found_with_their_lines(tmp_path):
    package = _write_package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/low.py": "import os\n\ndef f():\n    from pkg.high.cli import main\n",
            "pkg/high/__init__.py": "",
            "pkg/high/cli.py": "from pkg import low\n",
        },
    )
    scan = scan_package(package)
    assert [str(e) for e in scan.edges("pkg.low", "pkg")] == [
        "pkg/low.py:4 -> pkg.high.cli  (function-level)"
    ]
    assert [str(e) for e in scan.edges("pkg.high.cli", "pkg")] == ["pkg/high/cli.py:1 -> pkg.low"]


_TABLE = """
# A package

## Layers

| layer | modules | what |
| ---: | --- | --- |
| 2 | `high/cli.py` | the command |
| 1 | `high/` `mid.py` | the rest of high; mid |
| 0 | `__init__.py` `low.py` `gone.py` | the bottom |

- Allowed upward: `low.py` imports `mid.py` (a reason)
- Allowed upward: `mid.py` imports `high/cli.py` (no longer imported)

## Next section

| 9 | `ignored.py` | outside the section |
"""


def test_the_table_of_layers_is_read_from_its_section():
    layers = parse_layers(_TABLE, "pkg")
    assert layers.entries == {
        "pkg.high.cli": 2,
        "pkg.high": 1,
        "pkg.mid": 1,
        "pkg": 0,
        "pkg.low": 0,
        "pkg.gone": 0,
    }
    assert layers.packages == {"pkg.high"}
    assert layers.allowed == {("pkg.low", "pkg.mid"), ("pkg.mid", "pkg.high.cli")}
    # the most specific entry: high/cli.py, not high/; the package's __init__ alone, not all of it
    assert [
        layers.layer_of(m) for m in ("pkg.high.cli", "pkg.high.core", "pkg.high", "pkg", "pkg.other")
    ] == [2, 1, 1, 0, None]
    with pytest.raises(ValueError, match="count down to 0"):
        parse_layers(_TABLE.replace("| 1 |", "| 3 |"), "pkg")
    with pytest.raises(ValueError, match="in two rows"):
        parse_layers(_TABLE.replace("`gone.py`", "`mid.py`"), "pkg")
    with pytest.raises(ValueError, match="no section"):
        parse_layers(_TABLE.replace("## Layers", "## Strata"), "pkg")


def test_imports_against_the_table_of_layers(tmp_path):
    package = _write_package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/low.py": "def f():\n    from pkg.high import core\n    from pkg import mid\n",
            "pkg/mid.py": "from pkg import low\nfrom pkg.high import core\n",  # same layer and below: fine
            "pkg/high/__init__.py": "",
            "pkg/high/core.py": "import pkg.high.cli\n",
            "pkg/high/cli.py": "from pkg.high import core\nfrom pkg import low, stray\n",
            "pkg/stray.py": "",
        },
    )
    problems = layer_violations(scan_package(package), "pkg", parse_layers(_TABLE, "pkg"))
    assert problems == [
        "pkg/stray.py: in no layer of the table (add it to a row)",
        "the table's entry pkg.gone holds no module (renamed or removed?)",
        "pkg/high/cli.py:2 -> pkg.stray  (a module in no layer of the table)",
        "pkg/high/core.py:1 -> pkg.high.cli  (layer 1 imports layer 2)",
        # low -> high.core is function-level and still counts; low -> mid is allowed by name
        "pkg/low.py:2 -> pkg.high.core  (function-level)  (layer 0 imports layer 1)",
        "pkg.mid -> pkg.high.cli is allowed upward but no longer imported: remove the line",
    ]


# --------------------------------------------------------------------------------------------------
# The rules, on the real package

ARCHITECTURE = REPO_ROOT / "docs" / "architecture.md"


def test_every_import_keeps_to_the_table_of_layers():
    layers = parse_layers(ARCHITECTURE.read_text(encoding="utf-8"), PKG)
    problems = layer_violations(real_package(), PKG, layers)
    if problems:
        message = f"{len(problems)} break(s) of the table of layers in docs/architecture.md:\n"
        pytest.fail(message + "\n".join(problems), pytrace=False)


def test_only_the_command_line_and_the_export_cache_import_export():
    """Bundles are written by ``export/`` (called by the command line and the export cache's
    first-use export) and by ``calibration/``, which writes through ``lantern_rt.bundle``."""
    scan = real_package()
    callers = (f"{PKG}.export", f"{PKG}.cli", f"{PKG}.export_cache")
    bad = [
        str(e)
        for m in scan.files
        if not any(_under(m, c) for c in callers)
        for e in scan.edges(m, f"{PKG}.export")
    ]
    if bad:
        pytest.fail(
            f"{len(bad)} import(s) of {PKG}.export outside its callers:\n" + "\n".join(bad), pytrace=False
        )


def test_no_module_level_tensorrt_import():
    scan = real_package()
    bad = [
        f"{scan.where(m, imp.line)} -> {imp.target}"
        for m, imports in scan.imports.items()
        for imp in imports
        if not imp.lazy and imp.target.split(".")[0] == "tensorrt"
    ]
    if bad:
        message = "tensorrt imported at module import (import it in the function that needs it):\n"
        pytest.fail(message + "\n".join(bad), pytrace=False)


def test_no_import_cycles():
    graph = import_graph(real_package(), PKG)
    cycles = find_cycles(graph)
    if cycles:
        message = f"{len(cycles)} import cycle(s) among {PKG} modules (function-level imports count):\n"
        pytest.fail(message + describe_cycles(graph, cycles), pytrace=False)


def test_tensorrt_runner_imports_neither_onnx_nor_export():
    module = f"{PKG}.engines.runner"
    code = (
        f"import sys, {module}; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('onnx','onnxruntime') "
        "or m.startswith('lantern_rt.export')))"
    )
    path = [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    if proc.returncode != 0:
        pytest.fail(f"python -c 'import {module}' failed:\n{proc.stderr[-3000:]}", pytrace=False)
    loaded = ast.literal_eval(proc.stdout.strip().splitlines()[-1])
    if loaded:
        ours = [m for m in loaded if m.startswith(f"{PKG}.")]
        others = [f"{root} (+ submodules)" for root in sorted({m.split(".")[0] for m in loaded} - {PKG})]
        pytest.fail(
            f"importing {module} loaded {len(loaded)} unwanted module(s): {ours + others}", pytrace=False
        )
