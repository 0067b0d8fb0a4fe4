"""Fixtures for the compiler tests: digits data as the compiler takes it, one shared compiled ladder, keys."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from compilers import VariantSet, compile_model
from testkit import zoo


@pytest.fixture(scope="session")
def digits_calibration(digits: zoo.Split) -> dict[str, np.ndarray]:
    return {"x": digits.x_train[:300]}


@pytest.fixture(scope="session")
def digits_validation(digits: zoo.Split) -> dict[str, np.ndarray]:
    return {"x": digits.x_val, "labels": digits.y_val}


@pytest.fixture(scope="session")
def sign_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


@pytest.fixture(scope="session")
def digits_ladder(digits_cnn_onnx: Path, digits_calibration: dict[str, np.ndarray],
                  digits_validation: dict[str, np.ndarray], sign_key: Ed25519PrivateKey,
                  tmp_path_factory: pytest.TempPathFactory) -> VariantSet:
    """The digits CNN compiled for x86-avx512, fp32 + int8 (ORT static QDQ per-channel, NNCF), signed."""
    out = tmp_path_factory.mktemp("ladder") / "digits"
    return compile_model(digits_cnn_onnx, output=out, target="x86-avx512", precisions=("fp32", "int8"),
                         calibration=digits_calibration, validation=digits_validation, batch_sizes=(1, 64),
                         sign_key=sign_key, progress=False)

