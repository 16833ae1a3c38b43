"""Imports point down (docs/architecture.md): a test that fails on the first import pointing the wrong way."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).parent.parent / "omnijax"
# package -> packages it must never import
FORBIDDEN = {
    "data": {"models", "parallel", "train", "serve"},
    "models": {"data", "parallel", "train", "serve"},
    "layers": {"data", "models", "parallel", "train", "serve"},
    "mm_config": {"data", "models", "layers", "parallel", "train", "serve"},
    "config": {"data", "models", "layers", "parallel", "train", "mm_config", "serve"},
    "parallel": {"train", "serve"},
    "train": {"serve"},      # generation (serve) sits above training; the trainer never imports it
    "interop": {"serve"},
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
