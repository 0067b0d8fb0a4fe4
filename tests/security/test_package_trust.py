"""The tamper matrix: signed packages and variant sets, edited as an attacker with write access to
the models directory (but not the signing key) would, against `tierkit verify`, `sdk`'s loader
(`VariantSet.open`, as the edge agent opens a ladder) and `tierkit serve`. Every case is refused with
a clear message, counted by the server, and another model keeps answering."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from cloud_service.protocol import decode_outputs, encode_request
from cloud_service.protocol import inference_pb2_grpc as pbg
from compilers import signing
from compilers.package import ModelPackage, pack
from compilers.variants import VariantEntry, VariantSet
from runtimes.errors import TierkitError
from sdk.cli import main as tierkit
from testkit.cloud_helpers import ServerThread, make_package, metric_value

CASES = ("parent-path", "absolute-path", "symlinked-dir", "other-model", "symlink-in-package", "precision-lie")
SERVE_CASES = CASES[:-1]  # the server opens variants by path and name; precision is the loader's check


def _entry(path: str, precision: str = "fp32") -> VariantEntry:
    return VariantEntry(id="fp32", path=path, precision=precision, runtime="onnxruntime", passes=[], fidelity={},
                        latency_ms={"batch_1": {"p50": 1.0}}, size_bytes=1, recommended=True)


def _tampered(root: Path, case: str, onnx: Path, key: object) -> Path:
    """A variant set `root/case` of model `case`, signed, then edited as `case` says."""
    outside = root.parent / "outside" / case
    old = make_package(outside, onnx, name=case, version="1", sign_key=key)  # an older signed release
    directory = root / case
    make_package(directory / "fp32", onnx, name=case, version="2", sign_key=key)
    path, precision = "fp32", "fp32"
    if case == "parent-path":
        path = f"../../outside/{case}"
    elif case == "absolute-path":
        path = str(old)
    elif case == "symlinked-dir":
        (directory / "old").symlink_to(old, target_is_directory=True)
        path = "old"
    elif case == "other-model":
        make_package(directory / "other", onnx, name="someone-else", version="9", sign_key=key)
        path = "other"
    elif case == "symlink-in-package":
        (directory / "fp32" / "extra").symlink_to(outside, target_is_directory=True)
    elif case == "precision-lie":
        precision = "int8"
    VariantSet(directory, case, "x86-avx512", (_entry(path, precision),)).write()
    return directory


@pytest.fixture
def keys(tmp_path: Path) -> tuple[object, Path]:
    priv, pub = signing.generate_keypair(tmp_path / "ops")
    return signing.load_private_key(priv), pub


@pytest.mark.parametrize("case", CASES)
def test_tampered_variant_sets_are_refused_by_verify_and_the_loader(
        tmp_path: Path, digits_cnn_onnx: Path, keys: tuple[object, Path], case: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    key, pub = keys
    directory = _tampered(tmp_path / "models", case, digits_cnn_onnx, key)
    with pytest.raises(TierkitError) as info:
        VariantSet.load(directory).open(trusted_keys=[signing.load_public_key(pub)])
    assert any(word in str(info.value) for word in ("leaves the variant set", "symlink", "does not describe"))
    assert tierkit(["verify", str(directory), "--trusted-key", str(pub)]) == 1
    assert "tierkit: error:" in capsys.readouterr().err


def test_tampered_sets_are_refused_and_counted_by_serve_while_another_model_answers(
        tmp_path: Path, digits_cnn_onnx: Path, keys: tuple[object, Path], serve: Callable[..., ServerThread],
        digits_x: np.ndarray) -> None:
    import grpc

    key, pub = keys
    models = tmp_path / "models"
    for case in SERVE_CASES:
        _tampered(models, case, digits_cnn_onnx, key)
    make_package(models / "good", digits_cnn_onnx, name="good", version="1", sign_key=key)
    (models / "garbage.tkpkg").write_bytes(b"not a tar archive" * 10)  # refused while scanning
    server = serve(models, trusted_keys=(pub,))
    served = {m.name for m in server.service.repository}
    assert served == {"good"}
    refused = len(SERVE_CASES) + 1
    assert metric_value(server.metrics_text, "tierkit_model_loads_total", outcome="refused") == refused
    server.call(server.service.reload())  # a rescan counts nothing twice
    assert metric_value(server.metrics_text, "tierkit_model_loads_total", outcome="refused") == refused
    with grpc.insecure_channel(server.grpc) as channel:
        reply = pbg.GRPCInferenceServiceStub(channel).ModelInfer(encode_request("good", {"x": digits_x[:1]}),
                                                                 timeout=5.0)
    assert decode_outputs(reply)["logits"].shape == (1, 10)


def test_opening_an_archive_leaves_no_extracted_copy(tmp_path: Path, digits_cnn_onnx: Path,
                                                     keys: tuple[object, Path]) -> None:
    key, _ = keys
    good = pack(make_package(tmp_path / "pkg", digits_cnn_onnx, sign_key=key), tmp_path / "good.tkpkg")
    bad = tmp_path / "bad.tkpkg"
    data = bytearray(good.read_bytes())
    data[-20_000] ^= 0xFF  # a byte of the model: its hash no longer matches
    bad.write_bytes(bytes(data))
    tmp = tmp_path / "tmpdir"
    tmp.mkdir()
    script = (
        "import gc, os, sys\n"
        "from compilers.package import ModelPackage\n"
        "from runtimes.errors import TierkitError\n"
        "pkg = ModelPackage.open(sys.argv[1])\n"
        "assert os.listdir(os.environ['TMPDIR'])\n"
        "del pkg; gc.collect()\n"
        "assert not os.listdir(os.environ['TMPDIR']), os.listdir(os.environ['TMPDIR'])\n"
        "try:\n    ModelPackage.open(sys.argv[2])\nexcept TierkitError:\n    pass\n"
        "assert not os.listdir(os.environ['TMPDIR']), 'a refused archive left its copy'\n"
        "keep = ModelPackage.open(sys.argv[1])\n"  # still open at exit: removed then
    )
    env = {**os.environ, "TMPDIR": str(tmp)}
    run = subprocess.run([sys.executable, "-c", script, str(good), str(bad)], env=env, capture_output=True, check=False,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert os.listdir(tmp) == []
    shutil.rmtree(tmp)


def test_a_symlinked_package_directory_is_refused(tmp_path: Path, digits_cnn_onnx: Path) -> None:
    real = make_package(tmp_path / "real", digits_cnn_onnx)
    (tmp_path / "link").symlink_to(real, target_is_directory=True)
    with pytest.raises(TierkitError, match="symlink"):
        ModelPackage.open(tmp_path / "link")
