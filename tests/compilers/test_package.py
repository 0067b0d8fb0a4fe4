"""Model packages: written, verified, signed, archived; every kind of damage refused with its own error."""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest

from compilers import signing
from compilers.manifest import Manifest
from compilers.package import ModelPackage, pack, unpack, write_package
from runtimes.errors import IntegrityError, PackageError, SignatureError, UnsafeArchiveError
from runtimes.spec import TensorSpec
from sdk.cli import main


def _manifest(**changes: object) -> Manifest:
    base = Manifest(name="digits-cnn", version="1", target="x86-avx512", precision="fp32", runtime="onnxruntime",
                    artifact="model.onnx", inputs=(TensorSpec("x", "float32", ("batch", 1, 8, 8)),),
                    outputs=(TensorSpec("logits", "float32", ("batch", 10)),),
                    passes=({"name": "export", "exporter": "torch.onnx"},), fidelity={"top1_agreement": 1.0})
    return base.replace(**changes)


@pytest.fixture
def keys(tmp_path: Path) -> tuple[Path, Path]:
    (tmp_path / "keys").mkdir()
    return signing.generate_keypair(tmp_path / "keys" / "ops")


@pytest.fixture
def pkg_dir(tmp_path: Path, digits_cnn_onnx: Path, keys: tuple[Path, Path]) -> Path:
    d = tmp_path / "pkg"
    d.mkdir()
    shutil.copy(digits_cnn_onnx, d / "model.onnx")
    np.savez(d / "validation.npz", logits=np.zeros((4, 10), np.float32))
    write_package(d, _manifest(), sign_key=signing.load_private_key(keys[0]))
    return d


def test_write_then_open_verifies_hashes_and_signature(pkg_dir: Path, keys: tuple[Path, Path]) -> None:
    pkg = ModelPackage.open(pkg_dir, trusted_keys=[signing.load_public_key(keys[1])])
    assert pkg.signed_by == signing.key_id(signing.load_public_key(keys[1]))
    assert set(pkg.manifest.files) == {"model.onnx", "validation.npz"}
    assert pkg.manifest.size_bytes == sum((pkg_dir / f).stat().st_size for f in pkg.manifest.files)
    assert pkg.manifest.inputs[0].dynamic_batch
    assert json.loads((pkg_dir / "manifest.json").read_text())["schema_version"] == 1


def test_flipped_byte_in_artifact_is_refused(pkg_dir: Path) -> None:
    data = bytearray((pkg_dir / "model.onnx").read_bytes())
    data[len(data) // 2] ^= 0x01
    (pkg_dir / "model.onnx").write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=r"'model.onnx' has sha256 .* modified or corrupted"):
        ModelPackage.open(pkg_dir)


def test_manifest_edited_after_signing_is_refused(pkg_dir: Path, keys: tuple[Path, Path]) -> None:
    doc = json.loads((pkg_dir / "manifest.json").read_text())
    doc["fidelity"]["top1_agreement"] = 0.5
    (pkg_dir / "manifest.json").write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    ModelPackage.open(pkg_dir)  # hashes still match: only the signature can tell
    with pytest.raises(SignatureError, match="edited after signing"):
        ModelPackage.open(pkg_dir, trusted_keys=[signing.load_public_key(keys[1])])


def test_wrong_key_is_refused(pkg_dir: Path, tmp_path: Path) -> None:
    _, other_pub = signing.generate_keypair(tmp_path / "other")
    with pytest.raises(SignatureError, match="another key"):
        ModelPackage.open(pkg_dir, trusted_keys=[signing.load_public_key(other_pub)])


def test_unsigned_package_is_refused_when_a_key_is_required(pkg_dir: Path, keys: tuple[Path, Path]) -> None:
    (pkg_dir / signing.SIGNATURE_FILE).unlink()
    ModelPackage.open(pkg_dir)
    with pytest.raises(SignatureError, match="not signed"):
        ModelPackage.open(pkg_dir, trusted_keys=[signing.load_public_key(keys[1])])


def test_unlisted_and_missing_files_are_refused(pkg_dir: Path) -> None:
    (pkg_dir / "extra.bin").write_bytes(b"x")
    with pytest.raises(IntegrityError, match="not listed"):
        ModelPackage.open(pkg_dir)
    (pkg_dir / "extra.bin").unlink()
    (pkg_dir / "validation.npz").unlink()
    with pytest.raises(IntegrityError, match="missing"):
        ModelPackage.open(pkg_dir)


def test_archive_round_trip(pkg_dir: Path, tmp_path: Path, keys: tuple[Path, Path]) -> None:
    archive = pack(pkg_dir, tmp_path / "digits.tkpkg")
    pkg = ModelPackage.open(archive, trusted_keys=[signing.load_public_key(keys[1])], extract_to=tmp_path / "x")
    assert pkg.directory == tmp_path / "x"
    assert pkg.manifest.name == "digits-cnn"


def test_truncated_archive_is_refused(pkg_dir: Path, tmp_path: Path) -> None:
    archive = pack(pkg_dir, tmp_path / "digits.tkpkg")
    archive.write_bytes(archive.read_bytes()[: archive.stat().st_size // 2])
    with pytest.raises(IntegrityError, match="truncated"):
        ModelPackage.open(archive, extract_to=tmp_path / "x")


def _evil_archive(path: Path, entries: list[tarfile.TarInfo]) -> Path:
    with tarfile.open(path, "w") as tar:
        for info in entries:
            tar.addfile(info, io.BytesIO(b"owned") if info.isfile() else None)
    return path


@pytest.mark.parametrize("name", ["../escaped.txt", "/tmp/absolute-escape.txt", "a/../../escaped.txt"])
def test_archive_with_traversal_is_refused_and_writes_nothing(tmp_path: Path, name: str) -> None:
    info = tarfile.TarInfo(name)
    info.size = 5
    archive = _evil_archive(tmp_path / "evil.tkpkg", [info])
    target = tmp_path / "deep" / "target"
    with pytest.raises(UnsafeArchiveError, match="escapes"):
        unpack(archive, target)
    assert not (tmp_path / "deep" / "escaped.txt").exists()
    assert not (tmp_path / "escaped.txt").exists()
    assert not target.exists() or not any(target.iterdir())


def test_archive_with_symlink_is_refused(tmp_path: Path) -> None:
    link = tarfile.TarInfo("model.onnx")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
    with pytest.raises(UnsafeArchiveError, match="link"):
        unpack(_evil_archive(tmp_path / "evil.tkpkg", [link]), tmp_path / "t")


def test_archive_over_the_size_limit_is_refused(pkg_dir: Path, tmp_path: Path) -> None:
    archive = pack(pkg_dir, tmp_path / "digits.tkpkg")
    with pytest.raises(UnsafeArchiveError, match="more than 1000 bytes"):
        unpack(archive, tmp_path / "t", max_bytes=1000)


def test_garbage_is_not_a_package(tmp_path: Path) -> None:
    junk = tmp_path / "junk.tkpkg"
    junk.write_bytes(b"\x00not a tar" * 10)
    with pytest.raises(PackageError):
        ModelPackage.open(junk, extract_to=tmp_path / "x")
    (tmp_path / "d").mkdir()
    with pytest.raises(PackageError, match=r"no manifest\.json"):
        ModelPackage.open(tmp_path / "d")


def test_cli_keygen_inspect_verify(pkg_dir: Path, keys: tuple[Path, Path], tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["keygen", str(tmp_path / "k2")]) == 0
    assert (tmp_path / "k2.key").stat().st_mode & 0o777 == 0o600
    assert main(["inspect", str(pkg_dir), "--json"]) == 0
    assert json.loads(capsys.readouterr().out.split("\n", 2)[-1])["name"] == "digits-cnn"
    assert main(["verify", str(pkg_dir), "--trusted-key", str(keys[1])]) == 0
    assert "signature by key" in capsys.readouterr().out
    with pytest.warns(FutureWarning, match="--key is deprecated; use --trusted-key"):
        # the old spelling still counts: the package is signed by another key, so it is refused
        assert main(["verify", str(pkg_dir), "--key", str(tmp_path / "k2.pub")]) == 1
    assert "another key" in capsys.readouterr().err
    with pytest.warns(FutureWarning):
        # both spellings together: either trusted key may have signed it
        assert main(["verify", str(pkg_dir), "--key", str(tmp_path / "k2.pub"), "--trusted-key", str(keys[1])]) == 0


def test_cli_run_matches_the_reference(pkg_dir: Path, tmp_path: Path, digits, digits_cnn_reference) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("onnxruntime")  # the extra, not our own module: a broken import must fail
    np.savez(tmp_path / "in.npz", x=digits.x_test[:16], labels=digits.y_test[:16])
    assert main(["run", str(pkg_dir), "--input", str(tmp_path / "in.npz"), "--output", str(tmp_path / "out.npz")]) == 0
    with np.load(tmp_path / "out.npz") as out:
        np.testing.assert_allclose(out["logits"], digits_cnn_reference[:16], atol=1e-4)
