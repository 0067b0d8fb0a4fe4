"""Running a candidate over the validation data: batch size, stopping early, and outputs already known.

Three things keep a rung's validation from costing more than it must:

- **Batch size by bytes** (`eval_batch`): up to 64 samples a call, fewer where one sample's inputs and
  outputs are large. PP-OCRv4's recognizer returns 40 x 6,625 probabilities a line (1 MB): at 64 lines a
  call each line cost 40 ms of CPU, at 8 lines 29 ms (onnxruntime, one thread, AMD EPYC).
- **Stopping once the guard cannot pass** (`SequenceStop`): a sequence guard allows at most
  `floor((1 - min_rows_unchanged) * N)` changed rows of N; once more rows than that have changed, no
  later row can bring the share back, so the remaining rows are not run. The verdict is the same as
  over all rows (it fails), and the figures say over how many rows they were measured.
- **Outputs already known** (`artifact_digest`): an artifact byte-identical to one already run under the
  same runtime and precision (an fp32 rung whose fusion kept the original graph) has the same outputs;
  they are reused instead of recomputed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from compilers.package import sha256_file
from compilers.passes.execute import Runner, join_outputs, samples_first
from compilers.sequence import decode

MAX_BATCH = 64
# Bytes of inputs and outputs one validation call may hold: 16 MiB keeps the recognizer at 8 lines a call.
BATCH_BYTES = 16 << 20


def eval_batch(per_sample_bytes: int, *, most: int = MAX_BATCH, budget: int = BATCH_BYTES) -> int:
    """Samples per validation call: a power of two up to `most`, whose inputs and outputs fit `budget` bytes."""
    fits = max(1, budget // max(per_sample_bytes, 1))
    return max(1, min(most, 1 << int(math.log2(fits))))


def sample_bytes(inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> int:
    """Bytes of one call's inputs and outputs (of a one-sample call: the bytes per sample)."""
    return int(sum(np.asarray(v).nbytes for v in (*inputs.values(), *outputs.values())))


def artifact_digest(artifact: Path) -> str:
    """The artifact's identity with its companion files (an OpenVINO `.xml` and its `.bin`): their SHA-256s."""
    files = [artifact] + ([artifact.with_suffix(".bin")] if artifact.suffix == ".xml" else [])
    return "+".join(sha256_file(f) for f in files if f.is_file())


@dataclass
class SequenceStop:
    """Stops a validation once more decoded rows changed than the guard allows over all `total` rows."""

    reference: list[tuple[int, ...]]  # the reference's decoded rows, in validation order
    allowed: int  # most changed rows over the whole validation set that still pass
    decoder: str
    changed: int = 0
    rows: int = 0

    def done(self, values: np.ndarray) -> bool:
        """Count the changed rows of one batch (samples first); True once the guard cannot pass."""
        decoded = decode(values, self.decoder)
        expected = self.reference[self.rows:self.rows + len(decoded)]
        self.changed += sum(a != b for a, b in zip(decoded, expected, strict=True))
        self.rows += len(decoded)
        return self.changed > self.allowed


@dataclass
class Validation:
    """The joined outputs of a validation run, and how many samples it ran (fewer when stopped early)."""

    outputs: dict[str, np.ndarray]
    samples: int
    stopped: bool = False
    note: str = field(default="")


def run_validation(runner: Runner, batches: Iterable[Mapping[str, np.ndarray]], axes: Mapping[str, int | None],
                   *, primary: str, stop: SequenceStop | None = None) -> Validation:
    """Run every batch, or until `stop` says the guard cannot pass; outputs joined along their sample axes."""
    parts: dict[str, list[np.ndarray]] = {}
    samples = 0
    for batch in batches:
        result = runner.run(batch)
        for name, value in result.items():
            parts.setdefault(name, []).append(np.asarray(value))
        values = samples_first(np.asarray(result.get(primary, next(iter(result.values())))), axes.get(primary, 0))
        samples += len(values) if values.ndim else 1
        if stop is not None and stop.done(values):
            note = (f"validation stopped after {stop.rows} rows: {stop.changed} decoded rows changed, more than the "
                    f"{stop.allowed} the guard allows over all rows")
            return Validation(join_outputs(parts, axes), samples, stopped=True, note=note)
    return Validation(join_outputs(parts, axes), samples)
