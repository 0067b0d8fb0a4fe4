"""Releases: one signed unit of variant set and policy; tamper, wrong key, extra file and version floor refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from compilers.release import (
    RELEASE_FILE,
    create_release,
    load_policy,
    open_release,
    pack_release,
    unpack_release,
)
from compilers.version_floor import VersionFloor
from runtimes.errors import ConfigError, IntegrityError, PackageError, SignatureError, UnsafeArchiveError
from testkit import zoo
from testkit.packages import make_variant_set


@pytest.fixture(scope="module")
def variants(digits_linear_onnx: Path, digits: zoo.Split, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("vs") / "digits"
    make_variant_set(root, {"fp32": digits_linear_onnx}, name="digits", x_val=digits.x_val, y_val=digits.y_val)
    return root


KEY = Ed25519PrivateKey.generate()


def _release(variants: Path, out: Path, version: str, *, rollback_to: tuple[str, ...] = (),
             key: Ed25519PrivateKey | None = KEY) -> Path:
    policy = {"version": version, "threshold": 0.8, "budget": {"latency_ms": 25}, "energy_profile": "generic-cpu"}
    create_release(variants, policy, out, sign_key=key, rollback_to=rollback_to)
    return out


def test_release_round_trip_names_itself_by_digest(variants: Path, tmp_path: Path) -> None:
    rel = create_release(variants, {"version": "3", "threshold": 0.7, "policy": {"score": "calibrated"}},
                         tmp_path / "r3", sign_key=KEY)
    opened = open_release(tmp_path / "r3", trusted_keys=[KEY.public_key()])
    assert opened.digest == rel.digest
    assert opened.digest.startswith("sha256:")
    assert (opened.name, opened.version, opened.threshold) == ("digits", "3", 0.7)
    assert opened.policy == {"score": "calibrated"}
    assert opened.variant_set().recommended.id == "fp32"
    archive = pack_release(tmp_path / "r3", tmp_path / "r3.tar")
    again = open_release(unpack_release(archive, tmp_path / "dl"), trusted_keys=[KEY.public_key()],
                         expect_digest=rel.digest)
    assert again.digest == rel.digest
    with pytest.raises(IntegrityError, match="not the release"):
        open_release(tmp_path / "dl", trusted_keys=[KEY.public_key()], expect_digest="sha256:" + "0" * 64)


def test_policy_typos_and_bad_values_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text("version: '2'\nthreshhold: 0.8\nbudget: {latency_ms: -1}\n")
    with pytest.raises(ConfigError, match=r"threshhold.*|budget\.latency_ms"):
        load_policy(path)
    with pytest.raises(PackageError, match="not a variant set"):
        create_release(tmp_path, {"version": "1"}, tmp_path / "out", sign_key=KEY)


def test_unsigned_wrong_key_and_tampered_releases_are_refused(variants: Path, tmp_path: Path) -> None:
    keys = [KEY.public_key()]
    with pytest.raises(SignatureError, match="not signed"):
        open_release(_release(variants, tmp_path / "unsigned", "1", key=None), trusted_keys=keys)
    with pytest.raises(SignatureError, match="does not verify"):
        open_release(_release(variants, tmp_path / "other", "1", key=Ed25519PrivateKey.generate()), trusted_keys=keys)
    with pytest.raises(SignatureError, match="no trusted key"):
        open_release(_release(variants, tmp_path / "nokeys", "1"), trusted_keys=[])

    tampered = _release(variants, tmp_path / "tampered", "1")
    model = next(tampered.rglob("model.onnx"))
    model.write_bytes(model.read_bytes()[:-1] + b"\0")
    with pytest.raises(IntegrityError, match="does not match its sha256"):
        open_release(tampered, trusted_keys=keys)

    extra = _release(variants, tmp_path / "extra", "1")
    (extra / "variants" / "evil.onnx").write_bytes(b"x")
    with pytest.raises(IntegrityError, match="not listed"):
        open_release(extra, trusted_keys=keys)

    edited = _release(variants, tmp_path / "edited", "1")
    doc = json.loads((edited / RELEASE_FILE).read_text())
    doc["threshold"] = 0.1
    (edited / RELEASE_FILE).write_text(json.dumps(doc))
    with pytest.raises(SignatureError, match="does not verify"):
        open_release(edited, trusted_keys=keys)

    linked = _release(variants, tmp_path / "linked", "1")
    (linked / "variants" / "link").symlink_to("/etc/passwd")
    with pytest.raises(UnsafeArchiveError, match="symlink"):
        open_release(linked, trusted_keys=keys)

    missing = _release(variants, tmp_path / "missing", "1")
    shutil.rmtree(missing / "variants" / "fp32")
    with pytest.raises(IntegrityError, match="missing"):
        open_release(missing, trusted_keys=keys)


def test_version_floor_refuses_older_unless_the_running_release_allows_the_rollback(variants: Path,
                                                                                   tmp_path: Path) -> None:
    keys = [KEY.public_key()]
    floor = VersionFloor(tmp_path / "floor.json")
    r4 = open_release(_release(variants, tmp_path / "r4", "4"), trusted_keys=keys, floor=floor, record=True)
    r5_dir = _release(variants, tmp_path / "r5", "5", rollback_to=(r4.digest,))
    open_release(r5_dir, trusted_keys=keys, floor=floor)  # staged, not committed: the floor stays at 4
    assert floor.get("release:digits") == "4"
    r5 = open_release(r5_dir, trusted_keys=keys, floor=floor, record=True)
    assert floor.get("release:digits") == "5"
    with pytest.raises(IntegrityError, match="older than version '5'"):
        open_release(r4.directory, trusted_keys=keys, floor=floor)
    r3 = open_release(_release(variants, tmp_path / "r3", "3"), trusted_keys=keys)  # no floor: verifies
    with pytest.raises(IntegrityError, match="rollback_to"):
        open_release(r3.directory, trusted_keys=keys, floor=floor, leaving=r5)  # 5 does not allow 3
    back = open_release(r4.directory, trusted_keys=keys, floor=floor, leaving=r5, record=True)
    assert back.digest == r4.digest
    assert floor.get("release:digits") == "4"
