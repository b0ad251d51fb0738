"""Which part of the core may import which: the layering the architecture doc describes, checked on the source.

Every import statement counts, the lazy ones inside functions included: a circle that only closes at run
time is still a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import pegainfer

CORE = Path(pegainfer.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(CORE).with_suffix("").parts
    return ".".join(("pegainfer", *(p for p in parts if p != "__init__")))


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            # ``from pegainfer import ops`` imports the module pegainfer.ops.
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


MODULES = {_module_name(p): _imports(p) for p in sorted(CORE.rglob("*.py"))}


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _offenders(importer: str, imported: str) -> list[str]:
    return sorted(
        f"{module} imports {target}"
        for module, targets in MODULES.items()
        if _within(module, importer)
        for target in targets
        if _within(target, imported)
    )


def test_the_scan_sees_the_core() -> None:
    assert "pegainfer.ops" in MODULES and "pegainfer.layers.attention" in MODULES
    assert "pegainfer.kernels.paged_decode_attention" in MODULES["pegainfer.ops"]


@pytest.mark.parametrize(
    ("importer", "imported"),
    [
        # The torch references are the bottom: kernels are checked against them, ops picks between them.
        ("pegainfer.layers", "pegainfer.kernels"),
        ("pegainfer.layers", "pegainfer.ops"),
        ("pegainfer.kernels", "pegainfer.ops"),
    ],
)
def test_dependencies_point_one_way(importer: str, imported: str) -> None:
    assert _offenders(importer, imported) == []


def test_the_runtime_imports_nothing_from_testing() -> None:
    runtime = [m for m in MODULES if not _within(m, "pegainfer.testing")]
    assert [f"{m} imports {t}" for m in runtime for t in MODULES[m] if _within(t, "pegainfer.testing")] == []


def test_the_core_imports_no_plugin() -> None:
    plugin_imports = [
        f"{m} imports {t}" for m, targets in MODULES.items() for t in targets if t.startswith("pegainfer_")
    ]
    assert plugin_imports == []
