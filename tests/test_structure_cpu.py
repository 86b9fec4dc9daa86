"""The package's shape: imports point one way (no cycle among src's modules, imports inside
functions included), kernels/ imports nothing of the package above it, no ``global``
statement, no file over 450 lines, a public surface of at most 12 names, and the names
that moved out of it still resolve, with a warning."""

import ast
import os
import warnings

import pytest

import csa_compressor as C

SRC = os.path.join(os.path.dirname(__file__), "..", "src")
PKG = os.path.join(SRC, "csa_compressor")
# what kernels/ may import from the package: the leaves beneath it
KERNEL_LEAVES = {"csa_compressor.checks", "csa_compressor.runtime", "csa_compressor.rotary",
                 "csa_compressor.softmax_order"}


def _modules():
    out = {}
    for root, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                rel = os.path.relpath(path, SRC)[:-3].replace(os.sep, ".")
                out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return out


def _imports(name, path, modules):
    """The package modules ``name`` imports anywhere in its file."""
    is_pkg = path.endswith("__init__.py")
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = base[: len(base) - node.level + 1] + (node.module.split(".") if node.module else [])
            else:
                parts = (node.module or "").split(".")
            target = ".".join(parts)
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in modules:
                    found.add(sub)
                elif target in modules:
                    found.add(target)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    found.add(alias.name)
    found.discard(name)
    return found


def test_no_import_cycle_and_kernels_import_only_the_leaves():
    modules = _modules()
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    for m, deps in graph.items():
        if m.startswith("csa_compressor.kernels"):
            above = {d for d in deps if not d.startswith("csa_compressor.kernels")} - KERNEL_LEAVES
            assert not above, (m, above)
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for d in graph[m]:
            if d == "csa_compressor":  # the lazy top-level namespace, not an edge
                continue
            assert state.get(d) != "open", "import cycle: " + " -> ".join(stack[stack.index(d):] + [d])
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = "done"

    for m in graph:
        if m not in state:
            visit(m)


def test_no_global_statement_and_no_file_over_450_lines():
    for name, path in _modules().items():
        text = open(path).read()
        assert not any(isinstance(n, ast.Global) for n in ast.walk(ast.parse(text))), name
        assert text.count("\n") <= 450, (name, text.count("\n"))


def test_the_public_surface():
    assert len(C.__all__) <= 12
    for name in C.__all__:
        assert getattr(C, name) is not None


@pytest.mark.parametrize("name,where", [("pool_forward", "kernel_api"), ("precompile", "kernel_api"),
                                        ("compressed_capacity", "layout"), ("YaRN", "epilogue")])
def test_moved_names_still_resolve_with_a_warning(name, where):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        value = getattr(C, name)
    assert value is getattr(getattr(C, where), name)
    assert any(issubclass(w.category, DeprecationWarning) and where in str(w.message) for w in seen)
