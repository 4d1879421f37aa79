"""The modules of fused_attn and bench import each other without a cycle, and `import fused_attn` loads
none of the heavy modules only some calls need.

The graph is read from the sources (ast), not from an import: every `import` and `from ... import`
counts, the lazy ones inside functions too (a lazy import that closes a circle is still a circle, only
hidden). A module depends on a package's `__init__` only where it imports a name bound there;
importing a submodule does not count as depending on its parents (Python runs them first, but they
are not what the module uses). Names no source binds (the compiled `fused_attn._C`) are leaves.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("fused_attn", "bench")


def _modules(root: Path, packages) -> dict[str, tuple[Path, bool]]:
    """{dotted name: (source, is a package's __init__)} for every .py file of the packages."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def _bound_names(tree: ast.Module) -> set[str]:
    """The names a module binds at its top level (definitions, assignments, imports)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return names


def import_graph(root: Path = ROOT, packages=PACKAGES) -> dict[str, set[str]]:
    """{module: the modules of `packages` it imports}, read from the sources under `root`."""
    modules = _modules(root, packages)
    trees = {name: ast.parse(path.read_text(), str(path)) for name, (path, _) in modules.items()}
    graph = {}
    for name, (path, is_package) in modules.items():
        package = name if is_package else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(trees[name]):
            if isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names if alias.name in modules)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module
                for alias in node.names:
                    if f"{target}.{alias.name}" in modules:
                        edges.add(f"{target}.{alias.name}")  # a submodule
                    elif target in modules and (not modules[target][1] or alias.name == "*"
                                                or alias.name in _bound_names(trees[target])):
                        edges.add(target)  # a name of that module (or of that package's __init__)
        edges.discard(name)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle through each strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph.get(node, ())):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(set(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    found = []
    for component in components:  # a path from the component's first module back to itself
        start = min(component)
        paths, seen = {start: [start]}, {start}
        frontier = [start]
        while frontier and start not in {s for n in frontier for s in graph[n]}:
            following = []
            for node in frontier:
                for successor in sorted(graph[node] & component):
                    if successor not in seen:
                        seen.add(successor)
                        paths[successor] = paths[node] + [successor]
                        following.append(successor)
            frontier = following
        last = next(n for n in frontier if start in graph[n])
        found.append(paths[last] + [start])
    return found


def test_no_import_cycles():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in found)


def test_the_graph_sees_the_imports():
    """The graph is not vacuous: the layering the modules are meant to have is in it."""
    graph = import_graph()
    assert {"fused_attn.functional", "fused_attn.varlen", "fused_attn.kvcache", "bench.inspect"} <= set(graph)
    # The shared argument checks live below the public modules, and import none of them.
    for module in ("fused_attn.functional", "fused_attn.varlen", "fused_attn.kvcache"):
        assert "fused_attn.checks" in graph[module], module
    assert not {name for name in graph["fused_attn.checks"] if name.startswith("fused_attn")}
    assert "fused_attn.varlen" in graph["fused_attn.functional"]  # nested tensors run as varlen
    assert "fused_attn.functional" not in graph["fused_attn.varlen"]
    # kvcache builds on `attention`, one way: neither functional nor varlen imports it.
    assert "fused_attn.kvcache" not in graph["fused_attn.functional"] | graph["fused_attn.varlen"]
    # The static GPU report's table lives below the reports.
    for module in ("bench.inspect", "bench.triton_report", "bench.cuda_report"):
        assert "bench.kernel_table" in graph[module], module
    assert "bench.inspect" not in graph["bench.triton_report"] | graph["bench.cuda_report"]


def test_a_lazy_import_cycle_is_found(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("from .a import f\n")
    (package / "a.py").write_text("from .b import g\n\ndef f():\n    return g()\n")
    (package / "b.py").write_text("def g():\n    from .a import f  # lazy\n    return f\n")
    (package / "c.py").write_text("from . import _native\nfrom . import f\n")  # _native: bound nowhere
    graph = import_graph(tmp_path, ("pkg",))
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}, "pkg.c": {"pkg"}}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.a"]]


def test_import_leaves_dynamo_and_triton_unloaded():
    """`import fused_attn` costs little more than `import torch`: torch._dynamo (which
    torch.nn.attention.bias loads) and Triton are loaded only by the calls that need them."""
    import subprocess
    import sys

    heavy = ("torch._dynamo", "torch.nn.attention.bias", "triton")
    script = f"import sys, fused_attn\nprint(' '.join(m for m in {heavy!r} if m in sys.modules))\n"
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            check=True)
    assert result.stdout.strip() == ""
