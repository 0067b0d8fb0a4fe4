"""A real 224x224 photo and a real ONNX graph on it that declares its preprocessing (the frame path).

Shared by tests/e2e/test_slow_link.py and tests/e2e/test_frame_escalation.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from compilers.manifest import Manifest
from compilers.package import write_package
from runtimes.spec import TensorSpec

PREPROCESS = {"size": [224, 224], "scale": 1 / 255, "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}


def pool_package(directory: Path) -> Path:
    """A real ONNX graph on a 1x3x224x224 input: per-channel means and a 4x4 grid of pooled cells."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 224, 224])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3, 4, 4])
    pool = helper.make_node("AveragePool", ["x"], ["y"], kernel_shape=[56, 56], strides=[56, 56])
    model = helper.make_model(helper.make_graph([pool], "pool", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 13)])
    directory.mkdir(parents=True)
    onnx.save(model, directory / "model.onnx")
    manifest = Manifest(name="pool", version="1", target="x86-avx512", precision="fp32", runtime="onnxruntime",
                        artifact="model.onnx", inputs=(TensorSpec("x", "float32", ("batch", 3, 224, 224)),),
                        outputs=(TensorSpec("y", "float32", ("batch", 3, 4, 4)),), preprocess=PREPROCESS)
    write_package(directory, manifest)
    return directory


def photo_frame() -> np.ndarray:
    from sklearn.datasets import load_sample_image  # a real photo shipped in scikit-learn's wheel

    photo = load_sample_image("china.jpg")
    return np.ascontiguousarray(photo[100:324, 200:424])  # 224x224x3 uint8
