"""User-supplied JSON/YAML documents: parsed by suffix, every failure a ConfigError naming the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtimes.documents import read_document
from runtimes.errors import ConfigError


def test_json_and_yaml_are_parsed_by_suffix(tmp_path: Path) -> None:
    (tmp_path / "t.json").write_text('{"a": [1, 2]}')
    (tmp_path / "t.yaml").write_text("a: [1, 2]\nb: {c: x}\n")
    assert read_document(tmp_path / "t.json", "target file") == {"a": [1, 2]}
    assert read_document(tmp_path / "t.yaml", "target file") == {"a": [1, 2], "b": {"c": "x"}}


@pytest.mark.parametrize(("name", "text", "fragment"), [
    ("bad.json", "{not json", "target file .*bad.json' is not valid JSON"),
    ("bad.yaml", "a: [1, 2\n", "target file .*bad.yaml' is not valid YAML"),
])
def test_malformed_documents_name_the_file(tmp_path: Path, name: str, text: str, fragment: str) -> None:
    (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError, match=fragment):
        read_document(tmp_path / name, "target file")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot read the agent config .*nope.yaml"):
        read_document(tmp_path / "nope.yaml", "agent config")
