"""Real models on real data that ship offline, for the tests and benchmarks.

The data and the models are the demo's (`sdk._demo_models`: digits, MNIST, a small CNN, a linear
classifier, training); this module adds what only tests and benchmarks need: torch's predictions
and the export to ONNX with the legacy exporter (its graphs are the ones onnxruntime's fusions
recognise). torch is imported lazily.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from sdk._demo_models import (
    MNIST_MEAN,
    MNIST_STD,
    Split,
    accuracy,
    digits,
    linear_classifier,
    mnist,
    small_cnn,
    train,
)

if TYPE_CHECKING:
    import torch

__all__ = ["MNIST_MEAN", "MNIST_STD", "Split", "accuracy", "digits", "export_onnx", "linear_classifier", "mnist",
           "predict", "small_cnn", "train"]


def predict(model: torch.nn.Module, x: np.ndarray) -> np.ndarray:
    """torch's logits for `x` (the reference the backends are compared with)."""
    import torch

    with torch.inference_mode():
        logits: np.ndarray = model(torch.from_numpy(x)).numpy()
        return logits


def export_onnx(model: torch.nn.Module, example: np.ndarray, path: str | Path, *, input_name: str = "x",
                output_name: str = "logits", dynamic_batch: bool = True, opset: int = 17) -> Path:
    """Export with the legacy exporter and a named dynamic batch axis."""
    import torch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    axes: dict[str, Any] = {input_name: {0: "batch"}, output_name: {0: "batch"}} if dynamic_batch else {}
    torch.onnx.export(model.eval(), (torch.from_numpy(example),), str(path), input_names=[input_name],
                      output_names=[output_name], dynamic_axes=axes, opset_version=opset, dynamo=False)
    return path
