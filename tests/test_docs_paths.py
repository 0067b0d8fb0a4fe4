"""docs/PATHS.md walks a release and an escalation through the modules they cross, and docs/TESTKIT.md names
testkit's modules: every file, class and function either names must exist, so a move or a rename that forgets
them fails here. And what TESTKIT.md and the README's layout say of testkit/ (not shipped) holds."""

from __future__ import annotations

import ast
import functools
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ("docs/PATHS.md", "docs/TESTKIT.md")
# where a short path (`fleet/gates.py`, `transports/mqtt.py`, `broker.py`, `conftest.py`) may lie
BASES = ("", "cloud_service", "edge_agent", "testkit", "tests", "compilers", "runtimes", "sdk")
PATH = re.compile(r"`([A-Za-z0-9_./-]+\.py)\b")


def _missing(text: str, root: Path = ROOT) -> list[str]:
    names = sorted(set(PATH.findall(text)))
    return [name for name in names if not any((root / base / name).is_file() for base in BASES)]


@pytest.mark.parametrize("doc", DOCS)
def test_the_files_the_docs_name_exist(doc: str) -> None:
    missing = _missing((ROOT / doc).read_text())
    assert not missing, f"{doc} names files that do not exist (correct the doc): " + ", ".join(missing)


def test_paths_md_walks_both_paths_through_the_layers() -> None:
    text = (ROOT / "docs/PATHS.md").read_text()
    release, _, escalation = text.partition("## An escalation")
    assert "## A release" in release, "docs/PATHS.md: a section for the release's path"
    assert escalation, "docs/PATHS.md: a section for the escalation's path"
    for section, layers in ((release, ("cloud_service/", "edge_agent/", "compilers/")),
                            (escalation, ("sdk/", "edge_agent/", "cloud_service/", "runtimes/"))):
        assert all(layer in section for layer in layers), f"docs/PATHS.md: {section[:40]!r} misses one of {layers}"


def test_the_check_finds_a_missing_file(tmp_path: Path) -> None:
    (tmp_path / "edge_agent").mkdir()
    (tmp_path / "edge_agent" / "agent.py").touch()
    assert _missing("`agent.py` and `edge_agent/agent.py`, then `gone.py`", tmp_path) == ["gone.py"]


# -- the names the docs give in backticks: `EdgeAgent`, `AgentDaemon.switch`, `fleet_docs.parse_desired` ------
PRODUCT = ("cloud_service", "edge_agent", "compilers", "runtimes", "sdk")
_ID = r"[A-Za-z_][A-Za-z0-9_]*"
# a class (`Pending`), a dotted path through one (`sdk.TieredModel.predict`), or `module.name` (`topics.PARAM_DEVICE`)
NAME = re.compile(rf"`((?:{_ID}\.)*[A-Z][A-Za-z0-9_]*(?:\.{_ID})?|[a-z_][a-z0-9_]*\.{_ID})`")
DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _names(body: list[ast.stmt]) -> set[str]:
    """What a module or class body defines: functions, classes, assigned names and imported names."""
    out = {n.name for n in body if isinstance(n, DEFS)}
    out |= {t.id for n in body if isinstance(n, ast.Assign | ast.AnnAssign) for t in ast.walk(n)
            if isinstance(t, ast.Name)}
    return out | {a.asname or a.name for n in body if isinstance(n, ast.ImportFrom) for a in n.names}


class _Index:
    """Classes (with their bases and members) and each module's top-level names, over the product packages."""

    def __init__(self, root: Path = ROOT) -> None:
        self.members: dict[str, set[str]] = {}
        self.bases: dict[str, set[str]] = {}
        self.modules: dict[str, set[str]] = {}  # "fleet_docs" and "cloud_service.protocol.fleet_docs" -> names
        for package in PRODUCT:
            for path in sorted((root / package).rglob("*.py")):
                tree = ast.parse(path.read_text())
                dotted = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
                for key in (dotted.rsplit(".", 1)[-1], dotted):
                    self.modules.setdefault(key, set()).update(_names(tree.body))
                for node in ast.walk(tree):
                    if isinstance(node, ast.ClassDef):
                        self.members.setdefault(node.name, set()).update(_names(node.body))
                        self.bases.setdefault(node.name, set()).update(ast.unparse(b).split(".")[-1]
                                                                       for b in node.bases)

    def has_member(self, cls: str, name: str, seen: frozenset[str] = frozenset()) -> bool:
        if name in self.members.get(cls, ()):
            return True
        return any(self.has_member(b, name, seen | {cls}) for b in self.bases.get(cls, ()) if b not in seen)

    def resolves(self, dotted: str) -> bool:
        parts = dotted.split(".")
        if len(parts) == 1:
            return parts[0] in self.members
        for i in range(len(parts) - 1, 0, -1):  # the longest module prefix: `compilers.variants.VariantSet`
            module = ".".join(parts[:i])
            if module in self.modules:
                rest = parts[i:]
                if rest[0] not in self.modules[module]:
                    return False
                return len(rest) == 1 or (len(rest) == 2 and self.has_member(rest[0], rest[1]))
        return len(parts) == 2 and parts[0] in self.members and self.has_member(parts[0], parts[1])


@functools.cache
def _index() -> _Index:
    return _Index()


def _unresolved(text: str, index: _Index) -> list[str]:
    files = (".py", ".md", ".toml")
    return sorted({n for n in NAME.findall(text) if not n.endswith(files) and not index.resolves(n)})


def test_the_classes_and_functions_the_docs_name_exist() -> None:
    index = _index()
    missing = {doc: _unresolved((ROOT / doc).read_text(), index) for doc in DOCS}
    assert not any(missing.values()), f"docs name code that does not exist (correct the doc): {missing}"


def test_the_name_check_finds_a_missing_name() -> None:
    index = _index()
    text = ("`EdgeAgent.escalate` `AgentDaemon.switch` `fleet_docs.parse_desired` `compilers.variants.VariantSet` "
            "`sdk.TieredModel.predict` `Pending` `EdgeAgent.fly` `Nowhere` `fleet_docs.parse_nothing`")
    assert _unresolved(text, index) == ["EdgeAgent.fly", "Nowhere", "fleet_docs.parse_nothing"]


def test_testkit_tests_and_bench_stay_out_of_the_wheel_and_the_sdist() -> None:
    build = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["hatch"]["build"]["targets"]
    assert set(build["wheel"]["packages"]) == set(PRODUCT), build["wheel"]  # testkit, tests and bench stay behind
    assert set(build["sdist"]["include"]) == {*PRODUCT, "README.md", "pyproject.toml"}, build["sdist"]
    layout = (ROOT / "README.md").read_text().split("### Layout", 1)[1].split("\n\n", 2)[1]
    row = re.search(r"^\| `testkit/` \|.*\| no \|$", layout, re.M)
    assert row, "README's layout table: a row for testkit/, not shipped"
