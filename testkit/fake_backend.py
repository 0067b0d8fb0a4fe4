"""A deterministic in-memory backend for testing the layers above `runtimes`.

Two ways in:

- `FakeSession(fn, inputs, outputs)` wraps a plain Python callable `fn(inputs) -> outputs`, for a
  test that scripts exactly what the model answers (fixed logits, a failure on the third call,
  a slow model via `delay_s`).
- `FakeBackend().load(path, options)`, reached with `open_session(path, backend="fake")` or a
  package whose manifest says `"runtime": "fake"`, reads a small JSON model description written by
  `write_fake_model` and answers with a seeded random linear map of the inputs: deterministic,
  input-dependent, and needing no ML library.

Both check inputs against the specs on every call (it is a test double: it should catch callers
that send the wrong thing) and check that what `fn` returns matches the output specs.

Example:
    >>> def logits(inputs):
    ...     return {"logits": np.tile([[0.1, 0.9]], (len(inputs["x"]), 1)).astype(np.float32)}
    >>> session = FakeSession(logits, [TensorSpec("x", "float32", ("batch", 4))],
    ...                       [TensorSpec("logits", "float32", ("batch", 2))])
    >>> session.run({"x": np.zeros((3, 4), np.float32)})["logits"].shape
    (3, 2)
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from runtimes.errors import ConfigError, InferenceError, PackageError, TierkitError
from runtimes.session import Session, SessionOptions
from runtimes.spec import TensorSpec, check_inputs

ModelFn = Callable[[Mapping[str, np.ndarray]], Mapping[str, np.ndarray]]
FAKE_FORMAT = "tierkit-fake-model/1"


class FakeSession(Session):
    """A session whose answers come from a Python callable.

    Args:
        fn: maps the input dict to the output dict.
        inputs, outputs: the specs the session reports and enforces.
        delay_s: sleep this long in each call, to stand in for a slow model.

    Attributes:
        calls: how many times `run` was called (including failed calls).
    """

    backend = "fake"

    def __init__(self, fn: ModelFn, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec], *,
                 delay_s: float = 0.0) -> None:
        if not inputs or not outputs:
            msg = "FakeSession needs at least one input and one output spec"
            raise ConfigError(msg)
        if delay_s < 0:
            msg = f"delay_s must be >= 0, got {delay_s}"
            raise ConfigError(msg)
        self._fn = fn
        self.inputs = tuple(inputs)
        self.outputs = tuple(outputs)
        self.delay_s = delay_s
        self.calls = 0

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.calls += 1
        check_inputs(self.inputs, inputs)
        if self.delay_s:
            time.sleep(self.delay_s)
        try:
            produced = self._fn(inputs)
        except TierkitError:
            raise
        except Exception as exc:  # whatever the scripted model raises is a backend failure to the caller
            msg = f"fake model failed: {exc!r}"
            raise InferenceError(msg) from exc
        result = {}
        for spec in self.outputs:
            if spec.name not in produced:
                msg = f"fake model returned {sorted(produced)}, not the declared output {spec.name!r}"
                raise InferenceError(msg)
            array = np.asarray(produced[spec.name])
            if not spec.matches(array):
                msg = (f"fake model output {spec.name!r} is {array.dtype.name}{list(array.shape)}, "
                       f"declared {spec.dtype}{list(spec.shape)}")
                raise InferenceError(msg)
            result[spec.name] = array
        return result


def _fixed_size(spec: TensorSpec) -> int:
    if not spec.shape or any(isinstance(d, str) for d in spec.shape[1:]):
        msg = f"fake linear model: {spec.name!r} needs a batch axis and fixed other axes, got {list(spec.shape)}"
        raise ConfigError(msg)
    return math.prod(int(d) for d in spec.shape[1:])


def linear_model(inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec], seed: int = 0) -> ModelFn:
    """A seeded random linear map: each output = concat(flattened inputs) @ W + b, per batch row."""
    rng = np.random.default_rng(seed)
    n_in = sum(_fixed_size(s) for s in inputs)
    weights = {s.name: (rng.standard_normal((n_in, _fixed_size(s))) / math.sqrt(max(n_in, 1)),
                        rng.standard_normal(_fixed_size(s)) * 0.1) for s in outputs}
    in_names = [s.name for s in inputs]

    def fn(feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        batch = len(feed[in_names[0]])
        flat = np.concatenate([np.asarray(feed[n], np.float64).reshape(batch, -1) for n in in_names], axis=1)
        return {s.name: (flat @ w + b).reshape((batch, *(int(d) for d in s.shape[1:]))).astype(s.dtype)
                for s in outputs for w, b in [weights[s.name]]}

    return fn


def write_fake_model(path: str | Path, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec], *,
                     seed: int = 0, delay_s: float = 0.0) -> Path:
    """Write a fake model file that `FakeBackend` loads as a seeded linear model."""
    path = Path(path)
    linear_model(inputs, outputs, seed)  # fail now, not at load time, on specs it cannot serve
    doc = {"format": FAKE_FORMAT, "seed": seed, "delay_s": delay_s,
           "inputs": [s.to_json() for s in inputs], "outputs": [s.to_json() for s in outputs]}
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


class FakeBackend:
    """Loads files written by `write_fake_model`; no library needed."""

    name = "fake"

    def load(self, artifact: Path, options: SessionOptions) -> FakeSession:
        try:
            doc = json.loads(Path(artifact).read_text())
            if doc.get("format") != FAKE_FORMAT:
                raise ValueError("format is not " + FAKE_FORMAT)
            inputs = tuple(TensorSpec.from_json(s) for s in doc["inputs"])
            outputs = tuple(TensorSpec.from_json(s) for s in doc["outputs"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            msg = f"{str(artifact)!r} is not a fake model written by write_fake_model ({exc})"
            raise PackageError(msg) from None
        fn = linear_model(inputs, outputs, int(doc.get("seed", 0)))
        return FakeSession(fn, inputs, outputs, delay_s=float(doc.get("delay_s", 0.0)))
