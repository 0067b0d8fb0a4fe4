"""docs/PATHS.md walks a release and an escalation through the modules they cross, and docs/TESTKIT.md names
testkit's modules: every file either names must exist, so a move or a rename that forgets them fails here."""

from __future__ import annotations

import re
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
