"""What a sequence model's outputs say: decoded sequences, and how far a variant's differ from the reference's.

A recognizer's output `[N, T, C]` (per time step, a score for each of C symbols) is read through a
decoder; what the user gets is the decoded sequence, not the scores. A variant can agree with the
reference on 97.7 % of time steps and still change 19 % of its lines (PP-OCRv4's recognizer in int8,
measured on 128 rendered lines): one flipped step in forty changes a line. So a sequence output is
judged on what its decoder yields:

- `sequence_rows_unchanged`: the share of rows whose decoded sequence equals the reference's;
- `char_error_rate`: edit distance between the decoded sequences over the reference's total length.

Decoders (the manifest's `decoder` field names the one used):

- `ctc-greedy` (default): argmax per step, collapse repeats, drop the blank (index 0), as PP-OCR,
  CRNN and wav2vec2 CTC heads are read;
- `argmax`: argmax per step, nothing collapsed (taggers, per-frame classifiers).

Example:
    >>> seqs = decode(probs, "ctc-greedy")
    >>> measure_sequences(reference, outputs, "ctc-greedy")["sequence_rows_unchanged"]
"""

from __future__ import annotations

import numpy as np

from runtimes.errors import ConfigError

CTC_GREEDY = "ctc-greedy"
ARGMAX = "argmax"
DECODERS = (CTC_GREEDY, ARGMAX)
DEFAULT_DECODER = CTC_GREEDY
CTC_BLANK = 0
# A variant may change at most 1 % of the decoded rows (lines, utterances) of the validation data.
DEFAULT_MIN_ROWS_UNCHANGED = 0.99


def check_decoder(name: str) -> str:
    """`name` when it is a known decoder, else `ConfigError` listing them."""
    if name not in DECODERS:
        msg = f"sequence decoder {name!r} is not one of {', '.join(DECODERS)}"
        raise ConfigError(msg)
    return name


def decode(scores: np.ndarray, decoder: str = DEFAULT_DECODER, *, blank: int = CTC_BLANK) -> list[tuple[int, ...]]:
    """One symbol sequence per row of `scores` `[N, T, C]`."""
    scores = np.asarray(scores)
    if scores.ndim != 3:
        msg = f"a sequence output must be [samples, steps, symbols]; got shape {list(scores.shape)}"
        raise ConfigError(msg)
    best = scores.argmax(axis=2)
    if check_decoder(decoder) == ARGMAX:
        return [tuple(int(s) for s in row) for row in best]
    keep = np.ones_like(best, dtype=bool)
    keep[:, 1:] = best[:, 1:] != best[:, :-1]
    keep &= best != blank
    return [tuple(int(s) for s in row[mask]) for row, mask in zip(best, keep, strict=True)]


def edit_distance(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Levenshtein distance between two symbol sequences (insertions, deletions, substitutions)."""
    if a == b:
        return 0
    if not a or not b:
        return max(len(a), len(b))
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        cur = [i]
        for j, y in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y)))
        prev = cur
    return prev[-1]


def measure_sequences(reference: np.ndarray, outputs: np.ndarray, decoder: str = DEFAULT_DECODER) -> dict[str, float]:
    """Decoded-sequence fidelity of `outputs` against `reference` (both `[N, T, C]`, samples first)."""
    ref, out = decode(reference, decoder), decode(outputs, decoder)
    if len(ref) != len(out):
        msg = f"{len(out)} decoded rows against the reference's {len(ref)}"
        raise ConfigError(msg)
    unchanged = sum(r == o for r, o in zip(ref, out, strict=True))
    errors = sum(edit_distance(r, o) for r, o in zip(ref, out, strict=True))
    total = sum(len(r) for r in ref)
    return {"sequence_rows_unchanged": unchanged / max(len(ref), 1),
            "char_error_rate": errors / total if total else float(errors > 0),
            "sequence_rows": float(len(ref))}


def looks_like_sequence(reference: np.ndarray) -> bool:
    """A `[N, T, C]` output of per-step probabilities over at least 2 symbols (each step sums to 1)."""
    ref = np.asarray(reference)
    if ref.ndim != 3 or ref.shape[2] < 2 or ref.shape[1] < 2 or not ref.size:
        return False
    sums = ref.sum(axis=2, dtype=np.float64)
    return bool(ref.min() >= 0 and np.allclose(sums, 1.0, atol=1e-3))
