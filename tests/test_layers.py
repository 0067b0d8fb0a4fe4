"""Imports point down DESIGN.md's table: sdk -> edge_agent | cloud_service -> compilers -> runtimes.

`edge_agent` may import `cloud_service.protocol` (the published wire contract) and
`cloud_service.mqtt_client` (the one MQTT client layer, over paho), nothing else of `cloud_service`;
the protocol itself imports only the standard library, numpy, protobuf, grpc (and zstandard, lazily,
for that wire encoding), no MQTT client and, of tierkit, the bottom layer's shared vocabulary:
`runtimes.spec` (the one dtype table), `runtimes.errors` (the root of `CodecError`) and `runtimes.budget`
(the budget the fleet's documents carry).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ALLOWED = {
    "runtimes": {"runtimes"},
    "compilers": {"compilers", "runtimes"},
    "edge_agent": {"edge_agent", "compilers", "runtimes", "cloud_service.protocol", "cloud_service.mqtt_client"},
    "cloud_service": {"cloud_service", "cloud_service.protocol", "cloud_service.mqtt_client", "compilers", "runtimes"},
    "cloud_service.protocol": {"cloud_service.protocol"},
    "cloud_service.mqtt_client": set(),
    "sdk": {"sdk", "edge_agent", "cloud_service", "cloud_service.protocol", "cloud_service.mqtt_client", "compilers",
            "runtimes"},
}
OWN = {"runtimes", "compilers", "edge_agent", "cloud_service", "sdk"}
# what the wire contract may take from the bottom layer
VOCABULARY = {"runtimes.spec", "runtimes.errors", "runtimes.budget"}


PUBLISHED = ("cloud_service.protocol", "cloud_service.mqtt_client")  # the parts of cloud_service the agent may import
# the third-party libraries the wire contract may import (the standard library aside)
PROTOCOL_THIRD_PARTY = {"numpy", "google", "grpc", "zstandard"}


def _layer(module: str) -> str:
    for part in PUBLISHED:
        if module == part or module.startswith(part + "."):
            return part
    return module.split(".", maxsplit=1)[0]


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from cloud_service import mqtt_client` imports the module cloud_service.mqtt_client
            found += [(node.lineno, _submodule(node.module, alias.name)) for alias in node.names]
    return found


def _submodule(package: str, name: str) -> str:
    where = ROOT.joinpath(*package.split("."), name)
    return f"{package}.{name}" if where.with_suffix(".py").is_file() or where.is_dir() else package


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



def test_the_wire_contract_needs_no_transport_library() -> None:
    """`cloud_service.protocol` is read by whoever speaks the contract: no MQTT client (paho lives in
    `cloud_service.mqtt_client`), nothing beyond the standard library and the libraries DESIGN.md names."""
    bad = []
    for path in sorted((ROOT / "cloud_service" / "protocol").rglob("*.py")):
        for line, imported in _imports(path):
            top = imported.split(".")[0]
            if top in OWN or top in sys.stdlib_module_names or top in PROTOCOL_THIRD_PARTY:
                continue
            bad.append(f"{path.relative_to(ROOT)}:{line} imports {imported}")
    assert not bad, "the wire contract imports a library it may not:\n" + "\n".join(bad)


# how a paho connection is set up (client, credentials, TLS, reconnect): only the one MQTT client layer does it
MQTT_SETUP = {"username_pw_set", "tls_set", "tls_set_context", "reconnect_delay_set", "max_inflight_messages_set",
              "max_queued_messages_set"}
MQTT_LAYER = "cloud_service/mqtt_client.py"


def _is_mqtt_setup(func: ast.expr) -> bool:
    if not isinstance(func, ast.Attribute):
        return False
    if func.attr == "Client":  # paho.Client(...), mqtt.Client(...); not another library's Client
        return any(word in ast.unparse(func.value) for word in ("paho", "mqtt"))
    return func.attr in MQTT_SETUP


def _mqtt_setup(source: str) -> list[tuple[int, str]]:
    return [(node.lineno, ast.unparse(node.func)) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and _is_mqtt_setup(node.func)]


def test_one_mqtt_client_layer_sets_up_every_connection() -> None:
    """The agent's session, the bridge, the ingest and the broker admin get their clients from
    `cloud_service.mqtt_client.new_client` (MQTT v5, TCP_NODELAY, TLS, bounded queues, jittered reconnect):
    a second place that builds or tunes a paho client is a second copy of those rules."""
    bad = [f"{path.relative_to(ROOT)}:{line} {call}(...)" for _, path in _modules()
           if path.relative_to(ROOT).as_posix() != MQTT_LAYER for line, call in _mqtt_setup(path.read_text())]
    assert not bad, f"MQTT clients set up outside {MQTT_LAYER} (use mqtt_client.new_client/start):\n" + "\n".join(bad)
    assert _mqtt_setup("c = paho.Client(CallbackAPIVersion.VERSION2)\nc.tls_set_context(ctx)\nhttpx.Client()") == [
        (1, "paho.Client"), (2, "c.tls_set_context")]

# Tests and benchmarks share their real parts through `testkit`, which sits below both and above the product:
# the wheel ships only the product packages, so none of them may import what stays behind in the repository.
APART = {"tests": {"bench"}, "bench": {"tests"}, "testkit": {"tests", "bench"},
         **{pkg: {"testkit", "tests", "bench"} for pkg in OWN}}


@pytest.mark.parametrize("folder", sorted(APART))
def test_tests_and_bench_do_not_import_each_other(folder: str) -> None:
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for line, imported in _imports(path):
            if imported.split(".")[0] in APART[folder]:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {imported}")
    assert not bad, (f"{folder}/ may not import {' or '.join(sorted(APART[folder]))}; move what both need into "
                     "testkit/:\n" + "\n".join(bad))


# Helpers live in testkit/, not in test modules: a test module imports no other test module or conftest
# (fixtures shared by several folders are in the conftest.py of the folder above them all).


def test_test_modules_take_their_helpers_from_testkit() -> None:
    found = set()
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("tests.")):
                found.add((str(path.relative_to(ROOT)), "." * node.level + (node.module or "")))
            elif isinstance(node, ast.Import):
                found |= {(str(path.relative_to(ROOT)), a.name) for a in node.names if a.name.startswith("tests.")}
    assert not found, "test modules importing helpers from other test modules (move them into testkit/):\n" + \
        "\n".join(f"{a} imports {b}" for a, b in sorted(found))


def test_tests_run_nothing_from_bench() -> None:
    """A test that starts a script by its path depends on bench/ as much as one importing it: what a test runs
    lies in testkit/ or the product (a path `ROOT / "bench" / ...` or `"bench/x.py"` in code fails here)."""
    bad = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if path == Path(__file__).resolve():  # names bench/ to check the rule
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                    (node.value == "bench" or node.value.startswith("bench/")):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} names {node.value!r}")
    assert not bad, "tests that use a file of bench/ (move it into testkit/):\n" + "\n".join(bad)


def test_no_testkit_module_shadows_a_package_testkit_imports() -> None:
    """A script in testkit/ run by path (pytriton_server.py) has testkit/ first on sys.path, so a module there
    named like a package it imports (a `pytriton.py`) would be imported in that package's place."""
    own = {path.stem for path in (ROOT / "testkit").glob("*.py")}
    bad = [f"testkit/{path.name}:{line} imports {imported}, the name of testkit/{imported.split('.')[0]}.py"
           for path in sorted((ROOT / "testkit").glob("*.py")) for line, imported in _imports(path)
           if imported.split(".")[0] in own]
    assert not bad, "testkit modules that shadow what testkit imports (rename the module):\n" + "\n".join(bad)
