"""The private jax modules omnijax uses are where omnijax/jax_private.py says, with what omnijax reads from them;
a jax release that moves one fails here, by name, and in use as one line."""
import re
import tomllib
from pathlib import Path

import jax
import pytest
from packaging.specifiers import SpecifierSet

from omnijax import jax_private
from omnijax.errors import UserError

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", sorted(jax_private.MODULES))
def test_each_private_module_is_where_omnijax_reads_it(name):
    module = jax_private.load(name)   # raises, naming the module and what is missing, where this jax moved it
    assert getattr(jax_private, name) is module


def test_installed_jax_is_in_the_supported_range_pyproject_pins():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = {re.match(r"[a-z]+", d).group(): d[len(re.match(r"[a-z]+", d).group()):] for d in deps}
    assert pins["jax"] == pins["jaxlib"] == jax_private.SUPPORTED_JAX
    assert "<" in pins["jax"]                                    # an upper bound: the newest jax tested
    assert jax.__version__ in SpecifierSet(jax_private.SUPPORTED_JAX)


def test_a_moved_module_or_attribute_is_one_line(monkeypatch):
    monkeypatch.setitem(jax_private.MODULES, "gone", ("jax._src.no_such_module", (), "testing"))
    with pytest.raises(UserError, match=r"no jax\._src\.no_such_module .*uses it for testing.*pip install 'jax"):
        jax_private.gone
    monkeypatch.setitem(jax_private.MODULES, "renamed", ("jax._src.distributed", ("global_state.no_client",), "x"))
    with pytest.raises(UserError, match=r"jax\._src\.distributed lacks global_state\.no_client"):
        jax_private.load("renamed")
    with pytest.raises(AttributeError):
        jax_private.not_an_entry


def test_nothing_else_imports_private_jax():
    """New uses of jax's private modules go through jax_private, so this test covers them too."""
    private = re.compile(r"^\s*(from|import)\s+jax\._src\b", re.M)
    users = [str(p.relative_to(ROOT)) for d in ("omnijax", "recipes", "tests") for p in (ROOT / d).rglob("*.py")
             if private.search(p.read_text()) and p.name != "jax_private.py"]
    assert users == []
