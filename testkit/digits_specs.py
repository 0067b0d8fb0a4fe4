"""The digits models' tensor specs: input x (batch, 1, 8, 8) and output logits (batch, 10), float32."""

from __future__ import annotations

from runtimes.spec import TensorSpec

X_SPEC = TensorSpec("x", "float32", ("batch", 1, 8, 8))
LOGITS_SPEC = TensorSpec("logits", "float32", ("batch", 10))
