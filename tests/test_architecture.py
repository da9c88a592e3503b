"""The package layers of localgen, read from the source: imports point down, no package imports
itself back through others, and no module grows past 600 lines.

Every module under localgen/, tui/ and kernels/ is parsed (ast), and each ``import`` and
``from … import`` in it is counted, at module level and inside functions alike: a lazy import is
still a dependency. A package is a first-level name under ``localgen`` (``localgen.runtime``, a
top-level module such as ``localgen.fileio``, and ``kernels``/``tui``, which install as
``localgen.kernels``/``localgen.tui``). `LAYERS` is the declared order, written out with its
reasons in docs/ARCHITECTURE.md "Layers and imports".
"""

from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# source folder -> the dotted name it installs under (pyproject's package-dir)
SOURCES = {"localgen": "localgen", "kernels": "localgen.kernels", "tui": "localgen.tui"}

# Lowest first. A package may import packages of its own layer and of any layer below.
LAYERS: list[set[str]] = [
    {"localgen", "version", "fileio", "hostmem", "profile_files"},  # no localgen imports but these
    {"kernels"},  # Triton and C kernels with their torch reference twins
    {"quant", "kv", "attention", "hub"},  # packed weights, the paged KV cache, downloads
    {"models"},  # configs, weight sources, the layer math
    {"runtime"},  # the engine, its runners, the offload runtime and its Policy
    {"policy", "profiler"},  # FlexGen's cost model and search; measuring the machine
    {"api", "conversation"},  # the LLM facade; chat transcripts
    {"bench", "batch", "service", "server"},  # programs over the engine
    {"cli", "tui"},  # front ends
]

# (importing package, imported package) -> why this import points up. At most three; each is
# written in docs/ARCHITECTURE.md too.
ALLOWED_UPWARD: dict[tuple[str, str], str] = {}

MAX_LINES = 600
# modules allowed past MAX_LINES (path under the repository root) -> why
LONG_MODULES: dict[str, str] = {}


def _module_name(path: Path) -> str:
    top = path.relative_to(ROOT).parts[0]
    parts = [SOURCES[top], *path.relative_to(ROOT / top).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _source_files() -> list[Path]:
    return sorted(p for top in SOURCES for p in (ROOT / top).rglob("*.py"))


def _imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """Dotted names one import statement reaches (relative imports resolved)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if not node.level:
        base = node.module or ""
        return [base] + [f"{base}.{a.name}" for a in node.names]
    parts = module.split(".")
    keep = len(parts) - node.level + (1 if is_package else 0)
    base = ".".join(parts[:keep] + ([node.module] if node.module else []))
    return [base] + [f"{base}.{a.name}" for a in node.names]


def _resolve(name: str, modules: set[str]) -> str:
    """The module a dotted import name reaches: its longest prefix that is a source module
    (``localgen.fileio.atomic_write_text`` -> ``localgen.fileio``)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in modules:
            return ".".join(parts[:n])
    return name


@lru_cache(maxsize=None)
def import_edges() -> tuple[tuple[str, str, str], ...]:
    """(importing module, imported module, "file:line") for every import of a localgen module."""
    files = _source_files()
    modules = {_module_name(p) for p in files}
    edges = []
    for path in files:
        module = _module_name(path)
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            for name in _imported(node, module, path.name == "__init__.py"):
                if name == "localgen" or name.startswith("localgen."):
                    edges.append((module, _resolve(name, modules),
                                  f"{path.relative_to(ROOT)}:{node.lineno}"))
    return tuple(edges)


def package_of(name: str) -> str:
    """``localgen.runtime.offload.kv`` -> ``runtime``; ``localgen`` -> ``localgen``."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "localgen"


def package_edges() -> dict[tuple[str, str], list[str]]:
    """(package, package it imports) -> where, for imports that cross packages."""
    out: dict[tuple[str, str], list[str]] = {}
    for module, name, where in import_edges():
        a, b = package_of(module), package_of(name)
        if a != b and where not in out.setdefault((a, b), []):
            out[(a, b)].append(where)
    return out


def folder(module: str) -> str:
    """The package folder a module belongs to (``localgen.runtime.offload`` for
    ``localgen.runtime.offload.runner``); a top-level module of ``localgen`` stands for itself
    (``localgen.api``), since the root folder is no layer."""
    parts = module.split(".")
    for n in range(len(parts), 1, -1):
        prefix = ".".join(parts[:n])
        top = next((src for src, dotted in sorted(SOURCES.items(), key=lambda kv: -len(kv[1]))
                    if prefix == dotted or prefix.startswith(dotted + ".")), None)
        rest = prefix[len(SOURCES[top]):].lstrip(".").replace(".", "/")
        if (ROOT / top / rest).is_dir():
            return prefix
    return ".".join(parts[:2])


def layer_of(package: str) -> int:
    for i, layer in enumerate(LAYERS):
        if package in layer:
            return i
    raise KeyError(package)


def cycles(edges) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


# ---- the checker itself, on hand-made graphs ----------------------------------------------------


def test_cycles_finds_a_three_package_loop_and_nothing_in_a_chain():
    assert cycles([("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")]) == [["a", "b", "c"]]
    assert cycles([("a", "b"), ("b", "c"), ("a", "c")]) == []


def test_relative_and_absolute_imports_resolve_to_dotted_names():
    tree = ast.parse("from . import cache\nfrom ..models.config import ModelConfig\nimport localgen.fileio")
    found = [n for node in tree.body for n in _imported(node, "localgen.kv.cache", False)]
    assert found == ["localgen.kv", "localgen.kv.cache", "localgen.models.config",
                     "localgen.models.config.ModelConfig", "localgen.fileio"]
    init = ast.parse("from .runner import build_offload").body[0]
    assert _imported(init, "localgen.runtime.offload", True)[0] == "localgen.runtime.offload.runner"


def test_package_of_and_folder_name_packages():
    assert package_of("localgen.runtime.offload.kv") == "runtime"
    assert package_of("localgen.kernels.dispatch") == "kernels"
    assert package_of("localgen") == "localgen"
    assert folder("localgen.runtime.offload.runner") == "localgen.runtime.offload"
    assert folder("localgen.kernels.dispatch") == "localgen.kernels"
    assert folder("localgen.fileio") == "localgen.fileio"
    assert folder("localgen") == "localgen"
    assert _resolve("localgen.fileio.atomic_write_text", {"localgen", "localgen.fileio"}) == \
        "localgen.fileio"


# ---- the tree ------------------------------------------------------------------------------------


def test_the_sources_are_found():
    modules = {_module_name(p) for p in _source_files()}
    assert {"localgen.runtime.engine", "localgen.kernels.dispatch", "localgen.tui.chat"} <= modules


def test_every_package_has_a_layer():
    packages = {package_of(_module_name(p)) for p in _source_files()}
    missing = sorted(p for p in packages if not any(p in layer for layer in LAYERS))
    assert not missing, f"packages with no layer in LAYERS (add them, and to ARCHITECTURE.md): {missing}"


def test_no_import_cycle_between_packages():
    found = cycles(package_edges())
    detail = {tuple(c): [w for (a, b), ws in package_edges().items() if a in c and b in c for w in ws]
              for c in found}
    assert not found, f"packages that import each other (through function-level imports too): {detail}"


def test_no_import_cycle_between_subpackages():
    """``localgen.runtime`` and ``localgen.runtime.offload`` are separate nodes here."""
    edges = set()
    for module, name, _ in import_edges():
        a, b = folder(module), folder(name)
        if a != b:
            edges.add((a, b))
    assert not cycles(edges)


def test_imports_point_down_the_layers():
    assert len(ALLOWED_UPWARD) <= 3
    upward = {(a, b): ws for (a, b), ws in package_edges().items() if layer_of(a) < layer_of(b)}
    unexpected = {k: v for k, v in upward.items() if k not in ALLOWED_UPWARD}
    assert not unexpected, f"imports that point up a layer (package, imported) -> where: {unexpected}"
    stale = sorted(set(ALLOWED_UPWARD) - set(upward))
    assert not stale, f"ALLOWED_UPWARD lists imports that no longer exist: {stale}"


@pytest.mark.parametrize("path", _source_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_over_600_lines(path):
    rel = str(path.relative_to(ROOT))
    n = len(path.read_text().splitlines())
    if rel in LONG_MODULES:
        assert rel.startswith("kernels/"), "only kernel modules may be long"
        return
    assert n <= MAX_LINES, f"{rel} has {n} lines (at most {MAX_LINES}; split it by responsibility)"


# ---- the documents name only what exists ---------------------------------------------------------

DOCS = ("docs/ARCHITECTURE.md", "README.md")
# a backquoted path into one of the repository's own folders, e.g. `localgen/runtime/engine.py`
_DOC_PATH = re.compile(r"`((?:localgen|kernels|tui|tests|scripts|docs)/[^`\s]*)`")
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def doc_paths(text: str) -> list[str]:
    """The repository paths a Markdown text names in backquotes (an ``#anchor`` dropped)."""
    return [m.group(1).split("#")[0] for m in _DOC_PATH.finditer(text)]


def local_links(text: str) -> list[str]:
    """The targets of a Markdown text's links that are neither URLs nor in-page anchors."""
    return [t for t in _LINK.findall(text) if not re.match(r"[a-z]+:|#", t)]


def test_doc_paths_and_links_are_read_from_markdown():
    text = "see `localgen/api.py`, `tests/x.py#case`, `localgen generate` and [a](../b.md), [c](#d)"
    assert doc_paths(text) == ["localgen/api.py", "tests/x.py"]
    assert local_links(text + " [e](https://example.org/f)") == ["../b.md"]


@pytest.mark.parametrize("doc", DOCS)
def test_every_path_a_document_names_exists(doc):
    text = (ROOT / doc).read_text()
    missing = sorted({p for p in doc_paths(text) if not (ROOT / p).exists()})
    assert doc_paths(text), f"{doc} names no path: the pattern no longer reads it"
    assert not missing, f"{doc} names paths that do not exist: {missing}"


def test_readme_links_only_files_inside_the_repository():
    base = ROOT / "README.md"
    links = local_links(base.read_text())
    outside = [t for t in links if ROOT not in (base.parent / t).resolve().parents]
    missing = [t for t in links if not (base.parent / t.split("#")[0]).exists()]
    assert not outside, f"README.md links files outside the repository: {outside}"
    assert not missing, f"README.md links files that do not exist: {missing}"
