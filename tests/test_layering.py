"""Imports point down (docs/architecture.md): a test that fails on the first import pointing the wrong way."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).parent.parent / "omnijax"
# package -> packages it must never import
FORBIDDEN = {
    "data": {"models", "parallel", "train", "perfmodel", "serve"},
    "models": {"data", "parallel", "train", "perfmodel", "serve"},
    "layers": {"data", "models", "parallel", "train", "perfmodel", "serve"},
    "mm_config": {"data", "models", "layers", "parallel", "train", "perfmodel", "serve"},
    "config": {"data", "models", "layers", "parallel", "train", "mm_config", "perfmodel", "serve"},
    "parallel": {"train", "perfmodel", "serve"},
    "train": {"perfmodel", "serve"},      # generation (serve) sits above training; the trainer never imports it
    "interop": {"perfmodel", "serve"},
}


def _imports():
    for f in ROOT.rglob("*.py"):
        parts = f.relative_to(ROOT).parts
        pkg = parts[0].removesuffix(".py")
        for node in ast.walk(ast.parse(f.read_text())):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                yield f, pkg, name.split(".")


def test_packages_import_only_downwards():
    bad = [f"{f.relative_to(ROOT.parent)} imports {'.'.join(mod)}" for f, pkg, mod in _imports()
           if mod[0] == "omnijax" and len(mod) > 1 and mod[1] in FORBIDDEN.get(pkg, ())]
    assert not bad, bad


def test_nothing_under_omnijax_imports_recipes():
    bad = [str(f) for f, _, mod in _imports() if mod[0] == "recipes"]
    assert not bad, bad


def _module_graph(root: pathlib.Path, top: str) -> dict[str, set[str]]:
    """Module -> modules of the same tree it imports, at module level or inside functions alike."""
    files = {".".join((top,) + f.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): f
             for f in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, f in files.items():
        out = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                if name in files and name != mod:
                    out.add(name)
                    break
        graph[mod] = out
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> list[str]:
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        state[m] = 2
        path.pop()
        return []
    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return []


def test_no_two_modules_import_each_other():
    """No import circle among omnijax's modules or among the recipes (function-level imports count too)."""
    for root, top in ((ROOT, "omnijax"), (ROOT.parent / "recipes", "recipes")):
        graph = _module_graph(root, top)
        assert graph and not _cycle(graph), " -> ".join(_cycle(graph))
