"""The package map in crowdtrain/__init__.py holds: no package imports one above it, and there are no cycles."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "crowdtrain"

LAYERS: dict[str, int] = {
    "errors": 0,
    "files": 0,
    "forking": 0,
    "structured": 0,
    "roles": 0,
    "proto": 0,
    "manifest": 1,
    "codecs": 1,
    "optimizer": 2,
    "dht": 2,
    "models": 2,
    "data": 2,
    "rpc": 3,
    "averaging": 4,
    "state": 4,
    "moe": 4,
    "links": 4,
    "planning": 5,
    "collaboration": 5,
    "modes": 6,
    "training": 7,
    "node": 8,
    "cli": 9,
    "__main__": 10,
}
"""Each top-level module or package of crowdtrain and its height: it may import only what is lower, or itself.
`collaboration` (hivemind.Optimizer for the run) stands on `averaging` and `state` (the verified state transfer),
which import neither each other nor any other sibling."""

MODE_SETTINGS = re.compile(r"modes(\.\w+)?\.settings")
"""A training mode's run-file section (`crowdtrain.modes.settings`, `crowdtrain.modes.<mode>.settings`) is the
manifest's layer: the manifest reads it, and it may import only what the manifest may."""


def _unit(path: Path) -> str:
    relative = path.relative_to(PACKAGE)
    if MODE_SETTINGS.fullmatch(".".join(relative.with_suffix("").parts)):
        return "manifest"
    return relative.parts[0].removesuffix(".py")


def _module_unit(parts: list[str]) -> str:
    """The unit of `crowdtrain.<parts>`: its top-level package, or the manifest's layer for a mode's settings."""
    return "manifest" if MODE_SETTINGS.fullmatch(".".join(parts)) else parts[0]


def _imported_units(path: Path) -> set[str]:
    units = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] != "crowdtrain":
                continue
            if len(parts) == 1:
                units.update(alias.name for alias in node.names if alias.name != "__version__")
            else:
                units.add(_module_unit(parts[1:]))
        elif isinstance(node, ast.Import):
            modules = [alias.name.split(".")[1:] for alias in node.names if alias.name.startswith("crowdtrain.")]
            units.update(_module_unit(parts) for parts in modules)
    return units


def _sources() -> list[Path]:
    return sorted(path for path in PACKAGE.rglob("*.py") if not path.name.endswith("_pb2.py"))


def test_every_module_has_a_layer() -> None:
    assert {_unit(path) for path in _sources()} - {"__init__"} <= set(LAYERS)


@pytest.mark.parametrize("path", _sources(), ids=lambda path: str(path.relative_to(PACKAGE)))
def test_no_module_imports_upward(path: Path) -> None:
    unit = _unit(path)
    if unit == "__init__":
        return
    for imported in _imported_units(path):
        if imported == unit:
            continue
        assert imported in LAYERS, f"{path.name} imports crowdtrain.{imported}, which has no layer"
        assert LAYERS[imported] < LAYERS[unit], (
            f"crowdtrain/{path.relative_to(PACKAGE)} ({unit}, layer {LAYERS[unit]}) imports {imported} "
            f"(layer {LAYERS[imported]}): a package may only import those below it"
        )


def _imports_the_lab(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            modules = [node.module or ""]
        else:
            continue
        if any(module.split(".")[0] == "lab" for module in modules):
            return True
    return False


def test_no_module_imports_the_lab(tmp_path: Path) -> None:
    """scripts/lab, the tests' and benchmarks' harness, is not installed: the package never imports it."""
    assert [str(path.relative_to(PACKAGE)) for path in _sources() if _imports_the_lab(path)] == []
    module = tmp_path / "bad.py"
    module.write_text("from crowdtrain import proto\nfrom laboratory import x\n")
    assert not _imports_the_lab(module)
    module.write_text("import lab.swarm\n")
    assert _imports_the_lab(module), "the check itself catches one"


def test_the_check_itself_catches_an_upward_import(tmp_path: Path) -> None:
    module = tmp_path / "bad.py"
    module.write_text("from crowdtrain.node.daemon import Daemon\nfrom crowdtrain import proto\n")
    assert _imported_units(module) == {"node", "proto"}
    module.write_text("from crowdtrain.modes.spes.settings import SPESSpec\nfrom crowdtrain.modes.spes import mode\n")
    assert _imported_units(module) == {"manifest", "modes"}, "a mode's settings are the manifest's; the mode is not"
