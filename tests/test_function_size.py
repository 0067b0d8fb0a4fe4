"""No function over 80 lines in the agent and the fleet service: past that, split it into named steps.
The agent and its controller stay under 500 lines each: past that, move a coherent piece into its own module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("edge_agent", "cloud_service/fleet")
MAX_LINES = 80
LONG_MODULES = ("edge_agent/agent.py", "edge_agent/controller.py")
MAX_MODULE_LINES = 500


def _too_long(path: Path, root: Path = ROOT) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno is not None:
            lines = node.end_lineno - node.lineno + 1  # from `def` to the last line of the body
            if lines > MAX_LINES:
                out.append(f"{path.relative_to(root)}:{node.lineno} {node.name}() is {lines} lines")
    return out


@pytest.mark.parametrize("package", PACKAGES)
def test_no_function_over_the_limit(package: str) -> None:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no Python files under {package}/"
    found = [line for path in files for line in _too_long(path)]
    assert not found, f"functions over {MAX_LINES} lines (split them into named steps):\n" + "\n".join(found)


def test_the_check_counts_a_long_function(tmp_path: Path) -> None:
    path = tmp_path / "probe.py"
    body = [f"    x{i} = {i}" for i in range(MAX_LINES)]
    path.write_text("class C:\n    async def long(self) -> None:\n" + "\n".join("    " + b for b in body) + "\n")
    assert _too_long(path, tmp_path) == [f"probe.py:2 long() is {MAX_LINES + 1} lines"]
    path.write_text("def short() -> None:\n" + "\n".join(body[:-1]) + "\n")
    assert _too_long(path, tmp_path) == []


def _module_too_long(path: Path, root: Path = ROOT) -> str | None:
    lines = len(path.read_text().splitlines())
    return f"{path.relative_to(root)} is {lines} lines" if lines >= MAX_MODULE_LINES else None


@pytest.mark.parametrize("module", LONG_MODULES)
def test_the_agent_and_controller_stay_under_the_module_limit(module: str) -> None:
    found = _module_too_long(ROOT / module)
    assert found is None, f"{found}: keep it under {MAX_MODULE_LINES} (move a coherent piece into its own module)"


def test_the_check_counts_a_long_module(tmp_path: Path) -> None:
    path = tmp_path / "probe.py"
    path.write_text("x = 1\n" * MAX_MODULE_LINES)
    assert _module_too_long(path, tmp_path) == f"probe.py is {MAX_MODULE_LINES} lines"
    path.write_text("x = 1\n" * (MAX_MODULE_LINES - 1))
    assert _module_too_long(path, tmp_path) is None
