"""Signed release archives of real digits models, and an agent.yaml enrolled as a device, for the swap tests."""

from __future__ import annotations

import io
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from compilers import signing
from compilers.golden import write_golden
from compilers.package import ModelPackage, write_package
from compilers.release import create_release, pack_release
from runtimes.registry import open_session
from testkit import zoo
from testkit.packages import make_variant_set

DEVICE, USER, PASSWORD = "dev-swap", "dev-swap-mqtt", "s3cret-for-tests"


def variant_set(root: Path, onnx: Path, vid: str, x: np.ndarray, y: np.ndarray, *, perturb: float = 0.0) -> Path:
    """A one-rung variant set whose package carries golden inputs; with `perturb`, the golden reference is
    shifted before the package (and any release of it) is hashed and signed, so it cannot reproduce anywhere."""
    make_variant_set(root, {vid: onnx}, name="digits", x_val=x, y_val=y)
    pkg = ModelPackage.open(root / vid)
    inputs = {pkg.manifest.inputs[0].name: x[:4]}
    with open_session(root / vid / "model.onnx") as session:
        outputs = session.run(inputs)
    reference = {k: v + perturb * (np.abs(v).max() + 1) for k, v in outputs.items()}
    record = write_golden(root / vid, inputs, reference, reference, "fp32")
    write_package(root / vid, pkg.manifest.replace(golden=record))
    return root


def release(variants: Path, out: Path, version: str, key: Ed25519PrivateKey | None, *,
            rollback_to: tuple[str, ...] = (), threshold: float = 0.5) -> tuple[str, Path]:
    """(digest, archive) of a release of `variants`."""
    rel = create_release(variants, {"version": version, "threshold": threshold, "budget": {"latency_ms": 250}},
                         out, sign_key=key, rollback_to=rollback_to)
    return rel.digest, pack_release(out, out.with_suffix(".tar"))


def tampered(archive: Path, out: Path) -> Path:
    """The archive with one byte of its model changed (release.json and its signature untouched)."""
    with tarfile.open(archive) as src, tarfile.open(out, "w") as dst:
        for member in src.getmembers():
            data = src.extractfile(member).read()  # type: ignore[union-attr]
            if member.name.endswith("model.onnx"):
                data = data[:-1] + bytes([data[-1] ^ 1])
            dst.addfile(member, io.BytesIO(data))
    return out


def device_config(tmp: Path, model: Path, fleet_url: str, keys: list[Path], *, broker: str | None = None,
                  listen: str = "127.0.0.1:0", cloud: str | None = None) -> Path:
    """agent.yaml of an enrolled device (its identity written where enrollment keeps it)."""
    state = tmp / "state"
    state.mkdir(parents=True, exist_ok=True)
    (state / "fleet.json").write_text(json.dumps({
        "device_id": DEVICE, "fleet_url": fleet_url, "labels": {}, "key_file": "", "cert_file": "", "ca_file": "",
        "mqtt_username": USER, "mqtt_password": PASSWORD}))
    lines = [f"model: {model}", f"device_id: {DEVICE}", f"listen: {listen}", "telemetry_interval_s: 1",
             "threads: 1", f"fleet: {{url: '{fleet_url}', state_dir: '{state}', release_keys: "
             f"[{', '.join(repr(str(k)) for k in keys)}]}}"]
    if broker:
        lines.append(f"broker: {broker}")
    if cloud:
        lines.append(f"cloud: {cloud}")
    path = tmp / "agent.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


@dataclass
class Kit:
    """The operators' public key, a local model, and release archives by name: r1 (v1), r2 (v2, may roll back
    to r1), bad (golden reference perturbed), unsigned, wrong_key, tampered, older (v0)."""

    pub: Path
    local: Path
    archives: dict[str, Path]
    digests: dict[str, str]


def build_kit(root: Path, onnx: Path, digits: zoo.Split) -> Kit:
    priv, pub = signing.generate_keypair(root / "ops")
    key = signing.load_private_key(priv)
    other = signing.load_private_key(signing.generate_keypair(root / "other")[0])
    x, y = digits.x_val, digits.y_val
    lin = variant_set(root / "vs-lin", onnx, "lin", x, y)
    lin2 = variant_set(root / "vs-lin2", onnx, "lin2", x, y)
    bad = variant_set(root / "vs-bad", onnx, "lin", x, y, perturb=0.05)
    local = variant_set(root / "vs-local", onnx, "local", x, y)
    d: dict[str, str] = {}
    a: dict[str, Path] = {}
    d["r1"], a["r1"] = release(lin, root / "r1", "1", key)
    d["r2"], a["r2"] = release(lin2, root / "r2", "2", key, rollback_to=(d["r1"],))
    d["bad"], a["bad"] = release(bad, root / "bad", "3", key)
    d["unsigned"], a["unsigned"] = release(lin, root / "unsigned", "4", None)
    d["wrong_key"], a["wrong_key"] = release(lin, root / "wrong", "4", other)
    d["tampered"], signed = release(lin, root / "t4", "4", key)
    a["tampered"] = tampered(signed, root / "tampered.tar")
    d["older"], a["older"] = release(lin, root / "r0", "0", key)
    return Kit(pub, local, a, d)
