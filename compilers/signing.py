"""Ed25519 keys and signatures over a package's manifest bytes.

The signature covers the exact bytes of `manifest.json`, which in turn holds the sha256 of every
other file, so one signature covers the whole package.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from runtimes.errors import ConfigError, SignatureError

SIGNATURE_FILE = "manifest.sig"


def key_id(public_key: Ed25519PublicKey) -> str:
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def generate_keypair(stem: str | Path) -> tuple[Path, Path]:
    """Write `STEM.key` (private, mode 0600) and `STEM.pub`; return both paths."""
    stem = Path(stem)
    priv_path, pub_path = stem.with_suffix(".key"), stem.with_suffix(".pub")
    for path in (priv_path, pub_path):
        if path.exists():
            msg = f"{path} exists; remove it or choose another name"
            raise ConfigError(msg)
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    fd = os.open(priv_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(pem)
    pub_path.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                       serialization.PublicFormat.SubjectPublicKeyInfo))
    return priv_path, pub_path


def load_private_key(path: str | Path) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        msg = f"cannot read an Ed25519 private key from {str(path)!r}: {exc}; create one with `tierkit keygen`"
        raise ConfigError(msg) from None
    if not isinstance(key, Ed25519PrivateKey):
        msg = f"{str(path)!r} is not an Ed25519 private key; create one with `tierkit keygen`"
        raise ConfigError(msg)
    return key


def load_public_key(path: str | Path) -> Ed25519PublicKey:
    try:
        key = serialization.load_pem_public_key(Path(path).read_bytes())
    except (OSError, ValueError, TypeError) as exc:
        msg = f"cannot read an Ed25519 public key from {str(path)!r}: {exc}"
        raise ConfigError(msg) from None
    if not isinstance(key, Ed25519PublicKey):
        msg = f"{str(path)!r} is not an Ed25519 public key"
        raise ConfigError(msg)
    return key


def sign(manifest_bytes: bytes, key: Ed25519PrivateKey) -> bytes:
    """Return the signature file's content for `manifest_bytes`."""
    doc = {"algorithm": "ed25519", "key_id": key_id(key.public_key()),
           "signature": base64.b64encode(key.sign(manifest_bytes)).decode()}
    return json.dumps(doc, indent=2).encode()


def verify(manifest_bytes: bytes, signature_file: bytes | None, keys: list[Ed25519PublicKey],
           where: str) -> str:
    """Check the signature against any of `keys`; return the key id that matched."""
    if signature_file is None:
        msg = f"{where} is not signed, and a trusted key is configured: sign it with `tierkit compile --sign-key`"
        raise SignatureError(msg)
    try:
        doc = json.loads(signature_file)
        signature = base64.b64decode(doc["signature"], validate=True)
        if doc.get("algorithm") != "ed25519":
            raise ValueError(doc.get("algorithm"))
    except (ValueError, KeyError, TypeError):
        msg = f"{where}: {SIGNATURE_FILE} is malformed"
        raise SignatureError(msg) from None
    for key in keys:
        try:
            key.verify(signature, manifest_bytes)
        except InvalidSignature:
            continue
        return key_id(key)
    known = ", ".join(key_id(k) for k in keys)
    msg = (f"{where}: signature does not verify with the trusted key(s) [{known}]: the manifest was edited "
           f"after signing, or it was signed by another key (key id {doc.get('key_id')!r})")
    raise SignatureError(msg)
