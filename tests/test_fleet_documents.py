"""The fleet's documents are read through their types (`cloud_service.protocol.fleet_docs`), never by string key.

An AST scan of the packages that handle the documents (`cloud_service/`, its fleet included, `edge_agent/` and
`sdk/`; the types' own module excepted) follows, within each function, the values that hold
a document as parsed JSON: what `json.loads` / `json.load` return, parameters typed `dict[str, Any]` or
`Mapping[str, Any]` that are named like a document (`doc`, `desired`, `reported`, `window`, ...), and
whatever is read out of those (`swap = doc.get("swap") or {}`). Reading one of the documents' field names
from such a value (`x["release"]`, `x.get("soak")`, `"budget" in x`) fails the test: parse the JSON with
`parse_desired` / `parse_reported` / `parse_telemetry` and use the attributes. Other dicts (database rows,
snapshots of the agent's counters) are not followed, so the scan does not depend on names elsewhere.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from cloud_service.protocol import fleet_docs as fd

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("cloud_service", "edge_agent", "sdk")
TYPES_MODULE = "cloud_service/protocol/fleet_docs.py"  # the parsers: the one place that reads the JSON by key
TYPES = (fd.Desired, fd.Soak, fd.Reported, fd.SwapReport, fd.SoakProgress, fd.GoldenReport, fd.SlotsReport,
         fd.TelemetryWindow, fd.LatencyHistogram)
# the documents' JSON names: every field of their types, and the few spelled differently on the wire
FIELDS = {f.name for t in TYPES for f in dataclasses.fields(t)} | {"tiers", "A", "B"}
DOC_NAMES = {"doc", "document", "desired", "reported", "report", "window", "payload", "body"}
# JSON that is not a fleet document and shares field names with them (function "*": the whole module)
NOT_DOCUMENTS = {
    ("cloud_service/fleet/rollouts.py", "from_json"): "the rollout's own stored options",
    ("cloud_service/fleet/releases.py", "*"): "release.json, the compiler's release manifest",
    ("edge_agent/config.py", "*"): "agent.yaml",
    ("edge_agent/router.py", "*"): "the learned router's state file",
}


def _is_doc_annotation(node: ast.expr | None) -> bool:
    text = ast.unparse(node) if node is not None else ""
    return text.replace(" ", "") in {"dict[str,Any]", "Mapping[str,Any]", "Any"}


def _loads(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("loads", "load")
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "json")


class _Scan(ast.NodeVisitor):
    """String-key reads of document fields on tainted values, one function at a time."""

    def __init__(self) -> None:
        self.found: list[tuple[int, str, str]] = []  # (line, function, code)
        self.tainted: set[str] = set()
        self.function = ""

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        outer = (self.tainted, self.function)
        args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
        self.tainted = {a.arg for a in args if a.arg in DOC_NAMES and _is_doc_annotation(a.annotation)}
        self.function = node.name
        for stmt in node.body:
            self.visit(stmt)
        self.tainted, self.function = outer

    visit_AsyncFunctionDef = visit_FunctionDef

    def holds_document(self, node: ast.AST) -> bool:
        if _loads(node) or (isinstance(node, ast.Name) and node.id in self.tainted):
            return True
        if isinstance(node, ast.BoolOp):
            return any(self.holds_document(v) for v in node.values)
        if isinstance(node, ast.IfExp):
            return self.holds_document(node.body) or self.holds_document(node.orelse)
        if isinstance(node, ast.Subscript):
            return self.holds_document(node.value)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            return self.holds_document(node.func.value)
        return False

    def _bind(self, targets: list[ast.expr], value: ast.AST) -> None:
        names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
        if self.holds_document(value):
            self.tainted.update(names)
        else:
            self.tainted.difference_update(names)

    def visit_Assign(self, node: ast.Assign) -> None:
        self.generic_visit(node)
        self._bind(node.targets, node.value)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self.generic_visit(node)
        if node.value is not None:
            self._bind([node.target], node.value)

    def visit_NamedExpr(self, node: ast.NamedExpr) -> None:
        self.generic_visit(node)
        self._bind([node.target], node.value)

    def _flag(self, node: ast.AST, key: ast.AST, on: ast.AST) -> None:
        if isinstance(key, ast.Constant) and key.value in FIELDS and self.holds_document(on):
            self.found.append((getattr(node, "lineno", 0), self.function, ast.unparse(node)))

    def visit_Subscript(self, node: ast.Subscript) -> None:
        self._flag(node, node.slice, node.value)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Attribute) and node.func.attr in ("get", "pop", "setdefault") and node.args:
            self._flag(node, node.args[0], node.func.value)
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:
        if len(node.ops) == 1 and isinstance(node.ops[0], ast.In | ast.NotIn):
            self._flag(node, node.left, node.comparators[0])
        self.generic_visit(node)


def scan(source: str) -> list[tuple[int, str, str]]:
    s = _Scan()
    s.visit(ast.parse(source))
    return s.found


def _files() -> list[Path]:
    return [p for folder in SCANNED for p in sorted((ROOT / folder).rglob("*.py"))
            if p.relative_to(ROOT).as_posix() != TYPES_MODULE]


def test_the_scan_covers_every_module_that_touches_a_document() -> None:
    """A module that names a document's topic or parser is scanned (a new home for that code is not missed)."""
    scanned = {p.relative_to(ROOT).as_posix() for p in _files()}
    marks = ("desired_topic", "reported_topic", "telemetry_topic", "parse_desired", "parse_reported",
             "parse_telemetry")
    product = [p for folder in ("cloud_service", "edge_agent", "sdk", "compilers", "runtimes")
               for p in sorted((ROOT / folder).rglob("*.py"))]
    touching = {p.relative_to(ROOT).as_posix() for p in product if any(m in p.read_text() for m in marks)}
    assert touching - {TYPES_MODULE} <= scanned, sorted(touching - scanned - {TYPES_MODULE})
    assert len(touching) >= 5, touching  # the ingest, the fleet's desired state, the telemetry store, the agent


@pytest.mark.parametrize("path", _files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_document_field_is_read_by_string_key(path: Path) -> None:
    rel = path.relative_to(ROOT).as_posix()
    found = [f"{rel}:{line} in {fn}(): {code}" for line, fn, code in scan(path.read_text())
             if (rel, fn) not in NOT_DOCUMENTS and (rel, "*") not in NOT_DOCUMENTS]
    assert not found, ("fleet document fields read by string key; parse the JSON once with "
                       "cloud_service.protocol.fleet_docs and use the attributes:\n" + "\n".join(found))


def test_the_scan_finds_the_reads_it_forbids() -> None:
    bad = '''
def a(payload: bytes) -> None:
    doc = json.loads(payload)
    swap = doc.get("swap") or {}
    if swap["state"] == "active" and "release" in doc:
        pass

def b(reported: dict[str, Any]) -> float:
    return reported["crashes"] + (json.loads(x).get("soak") or 0)
'''
    assert [code for _, _, code in scan(bad)] == [
        "doc.get('swap')", "swap['state']", "'release' in doc", "reported['crashes']", "json.loads(x).get('soak')"]
    fine = '''
def c(row: dict[str, Any], doc: dict[str, Any]) -> None:
    row["release"], doc["labels"]          # a database row; a key that is no document field
    doc = parse_reported(doc)              # rebinding to a typed document ends the tracking
    doc.release
'''
    assert scan(fine) == []
