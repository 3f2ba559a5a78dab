"""Every name a script in bench/ imports from the packages exists: the scripts run only on the GPU host, so a
renamed or inlined function would otherwise break them unseen (as `chat_totals` once did `regen_speed.py`)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

BENCH = sorted((Path(__file__).resolve().parent.parent / "bench").glob("*.py"))


def package_imports(path: Path) -> list[tuple[str, str | None, int]]:
    """(module, name or None, line) of each import from ``dflash`` in ``path``, at any depth of the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dflash"):
            found += [(node.module, alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, None, node.lineno) for alias in node.names if alias.name.startswith("dflash")]
    return found


@pytest.mark.parametrize("path", BENCH, ids=[p.name for p in BENCH])
def test_bench_script_imports_resolve(path):
    missing = []
    for module, name, line in package_imports(path):
        mod = importlib.import_module(module)
        if name is not None and not hasattr(mod, name) and importlib.util.find_spec(f"{module}.{name}") is None:
            missing.append(f"{path.name}:{line}: {module} has no {name}")
    assert not missing, missing


def test_the_check_sees_a_missing_name(tmp_path):
    script = tmp_path / "broken.py"
    script.write_text("def main():\n    from dflash.extract.regenerate import Chat, no_such_function\n")
    names = [(m, n) for m, n, _ in package_imports(script)]
    assert names == [("dflash.extract.regenerate", "Chat"), ("dflash.extract.regenerate", "no_such_function")]
    assert not hasattr(importlib.import_module("dflash.extract.regenerate"), "no_such_function")
