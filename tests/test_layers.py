"""Imports point down DESIGN.md's table: sdk -> edge_agent | cloud_service -> compilers -> runtimes.

`edge_agent` may import `cloud_service.protocol` (the published wire contract) and nothing else of
`cloud_service`; the protocol itself imports only the standard library, numpy, protobuf, grpc and,
of tierkit, the bottom layer's shared vocabulary: `runtimes.spec` (the one dtype table),
`runtimes.errors` (the root of `CodecError`) and `runtimes.budget` (the budget the fleet's documents carry).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ALLOWED = {
    "runtimes": {"runtimes"},
    "compilers": {"compilers", "runtimes"},
    "edge_agent": {"edge_agent", "compilers", "runtimes", "cloud_service.protocol"},
    "cloud_service": {"cloud_service", "cloud_service.protocol", "compilers", "runtimes"},
    "cloud_service.protocol": {"cloud_service.protocol"},
    "sdk": {"sdk", "edge_agent", "cloud_service", "cloud_service.protocol", "compilers", "runtimes"},
}
OWN = {"runtimes", "compilers", "edge_agent", "cloud_service", "sdk"}
# what the wire contract may take from the bottom layer
VOCABULARY = {"runtimes.spec", "runtimes.errors", "runtimes.budget"}


def _layer(module: str) -> str:
    return "cloud_service.protocol" if module.startswith("cloud_service.protocol") else module.split(".", maxsplit=1)[0]


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def _modules() -> list[tuple[str, Path]]:
    out = []
    for pkg in sorted(OWN):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            out.append((".".join(rel.parts), path))
    return out


@pytest.mark.parametrize(("module", "path"), _modules(), ids=lambda v: v if isinstance(v, str) else "")
def test_imports_point_down(module: str, path: Path) -> None:
    allowed = ALLOWED[_layer(module)]
    bad = []
    for line, imported in _imports(path):
        if imported.split(".")[0] not in OWN:
            continue
        if _layer(module) == "cloud_service.protocol" and imported in VOCABULARY:
            continue
        if _layer(imported) not in allowed:
            bad.append(f"{path.relative_to(ROOT)}:{line} imports {imported}")
    assert not bad, "imports against the layering of DESIGN.md:\n" + "\n".join(bad)


# Tests and benchmarks share their real parts through `testkit`, which sits below both.
APART = {"tests": {"bench"}, "bench": {"tests"}, "testkit": {"tests", "bench"}}


@pytest.mark.parametrize("folder", sorted(APART))
def test_tests_and_bench_do_not_import_each_other(folder: str) -> None:
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for line, imported in _imports(path):
            if imported.split(".")[0] in APART[folder]:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {imported}")
    assert not bad, (f"{folder}/ may not import {' or '.join(sorted(APART[folder]))}; move what both need into "
                     "testkit/:\n" + "\n".join(bad))
