"""Writing a compile's results: one package per variant, the index, and the report table.

The report (also stored in the index's `build["report"]`) has one row per variant, kept or
rejected: precision, passes, fidelity, latency ratio against the fp32 baseline per batch size,
size, and, for rejected ones, why, with the numbers.
"""

from __future__ import annotations

import importlib.metadata
import logging
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from compilers.golden import write_golden
from compilers.manifest import Manifest
from compilers.measure import host_cpu
from compilers.package import write_package
from compilers.variants import INDEX_FILE, VariantEntry, VariantSet, is_variant_set

if TYPE_CHECKING:
    from compilers.ladder import BuiltVariant, Ladder

logger = logging.getLogger(__name__)

REFERENCE_ID = "fp32-reference-ort"
VALIDATION_FILE = "validation.npz"
_TOOLS = ("onnx", "onnxruntime", "openvino", "nncf", "torch", "torch-pruning", "onnxslim", "tensorrt", "numpy")


def brief(fid: Mapping[str, float]) -> str:
    """Fidelity in a few words: drop / agreement / cosine."""
    parts = []
    if "accuracy" in fid:
        parts.append(f"acc {100 * fid['accuracy']:.2f}% (fp32 {100 * fid['reference_accuracy']:.2f}%)")
    if "top1_agreement" in fid:
        parts.append(f"agree {100 * fid['top1_agreement']:.2f}%")
    if "sequence_rows_unchanged" in fid:
        parts.append(f"rows unchanged {100 * fid['sequence_rows_unchanged']:.1f}%, "
                     f"cer {100 * fid['char_error_rate']:.2f}%")
    if "cosine_mean" in fid:
        parts.append(f"cos {fid['cosine_mean']:.4f}")
    return ", ".join(parts)


def pass_labels(records: list[dict[str, Any]]) -> list[str]:
    """Short names of the passes that changed the model, e.g. ["prune", "fuse:onnxslim", "quantize_ort:static"]."""
    labels = []
    for r in records:
        name = str(r["name"])
        if name in ("source", "note") or (name == "fuse" and r.get("kept") == "none"):
            continue
        detail = r.get("kept") or r.get("mode") or ("fp16" if r.get("compress_to_fp16") else None)
        labels.append(f"{name}:{detail}" if detail else name)
    return labels


def tool_versions() -> dict[str, str]:
    out = {}
    for dist in _TOOLS:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def _recommend(candidates: list[BuiltVariant], baseline_latency: Mapping[str, Any], batch: int) -> str:
    key = f"batch_{batch}"
    limit = float(baseline_latency[key]["p50"])
    eligible = [c for c in candidates if c.latency[key]["p50"] <= limit]
    if not eligible:
        logger.warning("every kept variant is slower than fp32 at batch %d; recommending the fastest", batch)
        eligible = candidates
    return min(eligible, key=lambda c: c.latency[key]["p50"]).id


def _remove_previous(out: Path) -> None:
    """Delete the packages and index of a variant set previously written to `out`."""
    if not is_variant_set(out):
        return
    for entry in VariantSet.load(out).entries:
        target = (out / entry.path).resolve()
        if target.parent == out.resolve() and target.is_dir():
            shutil.rmtree(target)
    (out / INDEX_FILE).unlink()


def _copy_artifact(artifact: Path, directory: Path) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    for f in artifact.parent.iterdir():
        if f.is_file() and (f.name == artifact.name or f.name.startswith(artifact.stem + ".")):
            shutil.copyfile(f, directory / f.name)
    return artifact.name


def write(out: Path, ladder: Ladder, candidates: list[BuiltVariant], baseline: str, *, name: str, version: str,
          sign_key: Ed25519PrivateKey | None, arguments: dict[str, Any]) -> VariantSet:
    """Write every candidate as a package under `out`, then the index; return the `VariantSet`."""
    started = time.monotonic()
    _remove_previous(out)
    default = ladder.batch_sizes[0]
    recommended = _recommend(candidates, ladder.baseline_latency, default)
    data = {"calibration": {"sha256": ladder.calibration.digest(), "samples": len(ladder.calibration),
                            "origin": ladder.calibration.origin},
            "validation": {"sha256": ladder.validation.digest(), "samples": len(ladder.validation),
                           "origin": ladder.validation.origin}}
    build = {"tools": tool_versions(), "arguments": arguments, "data": data, "host": host_cpu(),
             "threads": ladder.threads, "target": ladder.target.to_json(), "source": ladder.source.kind,
             "baseline": baseline, "default_batch": default, "output_sample_axes": dict(ladder.out_axes)}
    entries = []
    for c in candidates:
        directory = out / c.id
        if directory.exists():
            shutil.rmtree(directory)
        artifact = _copy_artifact(c.artifact, directory)
        calibration = dict(c.calibration)
        if calibration:
            arrays = {"logits": c.outputs.astype(np.float32), "reference_logits": ladder.ref_val.astype(np.float32)}
            if ladder.validation.labels is not None:
                arrays["labels"] = ladder.validation.labels
            np.savez(directory / VALIDATION_FILE, **arrays)  # type: ignore[arg-type]
            calibration["validation_file"] = VALIDATION_FILE
        golden = write_golden(directory, ladder.golden_inputs, ladder.golden_reference, c.golden_outputs,
                              c.rung.precision)
        energy = ladder.energy(c.latency)
        manifest = Manifest(name=name, version=version, target=ladder.target.name, precision=c.rung.precision,
                            runtime=c.rung.runtime, artifact=artifact, inputs=ladder.source.inputs,
                            outputs=ladder.source.outputs, task=str(ladder.task), passes=tuple(c.records),
                            reference_sha256=ladder.source.sha256, fidelity=c.fidelity, latency_ms=c.latency,
                            energy=energy, calibration=calibration, golden=golden,
                            decoder=ladder.decoder if ladder.task == "sequence" else "",
                            build={**build, "variant": c.id, "rung": c.rung.id, "base": c.base.label or "reference",
                                   "executed_precision": c.executed_precision})
        pkg = write_package(directory, manifest, sign_key=sign_key)
        entries.append(VariantEntry(id=c.id, path=c.id, precision=c.rung.precision, runtime=c.rung.runtime,
                                    passes=pass_labels(c.records), fidelity=c.fidelity,
                                    latency_ms=c.latency, size_bytes=pkg.manifest.size_bytes, energy=energy,
                                    recommended=c.id == recommended, batch_sizes=list(ladder.batch_sizes)))
    entries.sort(key=lambda e: e.cost_ms)
    rows = report_rows(entries, ladder.rejected, ladder.baseline_latency, ladder.batch_sizes,
                       {c.id: c.seconds for c in candidates})
    ladder.seconds["write"] = round(time.monotonic() - started, 2)
    ladder.seconds["total"] = round(sum(ladder.seconds.values()), 2)
    vs = VariantSet(out, name, ladder.target.name, tuple(entries), tuple(_jsonable(r) for r in ladder.rejected),
                    {**build, "report": rows, "baseline_latency_ms": ladder.baseline_latency,
                     "signed": sign_key is not None, "seconds": dict(ladder.seconds), "cut_short": ladder.cut_short,
                     "slowest_step": slowest_step(ladder.seconds, rows)})
    vs.write()
    logger.info("wrote %d variant(s) to %s; recommended %s\n%s", len(entries), out, recommended,
                format_table(rows, ladder.batch_sizes))
    return vs


# A compile a user can wait for; past it the report names the step that took the time.
PLANNED_SECONDS = 120.0


def slowest_step(seconds: dict[str, float], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The single step that took the most of the compile: the reference, one rung's build (its repair
    included) or validation, the timing, or the writing; with its seconds and share of the total."""
    steps = {k: float(v) for k, v in seconds.items() if k in ("reference", "timing", "write")}
    for r in rows:
        for part in ("build", "validate"):
            if part in r.get("seconds", {}):
                steps[f"{r['id']} {part}"] = float(r["seconds"][part])
    if not steps:
        return {}
    name = max(steps, key=steps.__getitem__)
    total = float(seconds.get("total") or sum(steps.values()))
    out: dict[str, Any] = {"step": name, "seconds": round(steps[name], 2),
                           "share": round(steps[name] / total, 3) if total > 0 else 0.0}
    repair = next((r["seconds"] for r in rows if name == f"{r['id']} build" and "repair" in r["seconds"]), None)
    if repair is not None:
        out["repair_seconds"], out["repair_attempts"] = repair["repair"], repair.get("attempts", 0)
    out["over_planned"] = total > PLANNED_SECONDS
    return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def report_rows(entries: list[VariantEntry], rejected: list[dict[str, Any]], baseline: Mapping[str, Any],
                batch_sizes: tuple[int, ...],
                seconds: Mapping[str, Mapping[str, float]] | None = None) -> list[dict[str, Any]]:
    """One row per variant, kept ones first (cheapest first), then the rejected ones.

    `seconds`: per kept variant, where its compile time went (build, validate, time).
    """
    seconds = seconds or {}
    rows: list[dict[str, Any]] = []
    sizes = tuple(dict.fromkeys((*batch_sizes, 1)))
    for e in entries:
        speed = {}
        for b in sizes:
            key = f"batch_{b}"
            if key in e.latency_ms and key in baseline:
                speed[key] = round(baseline[key]["p50"] / e.latency_ms[key]["p50"], 3)
        rows.append({"id": e.id, "status": "recommended" if e.recommended else "kept", "precision": e.precision,
                     "runtime": e.runtime, "passes": e.passes, "fidelity": _jsonable(e.fidelity),
                     "speedup_vs_fp32": speed,
                     "p50_ms": {k: round(e.latency_ms[k]["p50"], 4) for k in speed},
                     "size_bytes": e.size_bytes, "energy_mj": round(float(e.energy.get("mj", float("nan"))), 4),
                     "seconds": dict(seconds.get(e.id, {}))})
    for r in rejected:
        rows.append({"id": r["id"], "status": "rejected" if r.get("stage") == "guard" else r.get("stage", "rejected"),
                     "precision": r["precision"], "runtime": r["runtime"], "passes": r.get("passes", []),
                     "fidelity": _jsonable(r.get("measured", {})), "reason": r["reason"],
                     "required": r.get("required", {}), "seconds": dict(r.get("seconds", {}))})
    return rows


def _fid_cell(fid: Mapping[str, float]) -> str:
    if "sequence_rows_unchanged" in fid:
        return f"seq {100 * fid['sequence_rows_unchanged']:.1f}% cer {100 * fid['char_error_rate']:.2f}%"
    if "drop_points" in fid:
        agree = f" agree {100 * fid['top1_agreement']:.1f}%" if "top1_agreement" in fid else ""
        return f"drop {fid['drop_points']:+.2f}pt{agree}"
    if "cosine_mean" in fid:
        return f"cos {fid['cosine_mean']:.4f}"
    return "-"


def format_table(rows: list[dict[str, Any]], batch_sizes: tuple[int, ...]) -> str:
    """The report as a fixed-width text table."""
    sizes = tuple(dict.fromkeys((*batch_sizes, 1)))
    head = ["variant", "status", "prec", "runtime", "passes", "fidelity", *[f"x fp32 b{b}" for b in sizes], "size",
            "build s", "valid s", "time s", "repair s"]
    lines = []
    for r in rows:
        speed = [f"{r['speedup_vs_fp32'][f'batch_{b}']:.2f}" if f"batch_{b}" in r.get("speedup_vs_fp32", {}) else "-"
                 for b in sizes]
        size = f"{r['size_bytes'] / 1024:.0f} KB" if "size_bytes" in r else "-"
        passes = ",".join(p for p in r["passes"] if not p.startswith("export_onnx"))
        secs = r.get("seconds", {})
        lines.append([r["id"], r["status"], r["precision"], r["runtime"], passes or "-", _fid_cell(r["fidelity"]),
                      *speed, size, *(f"{secs[k]:.1f}" if k in secs else "-" for k in ("build", "validate", "time")),
                      f"{secs['repair']:.1f} ({secs['attempts']} tries)" if "repair" in secs else "-"])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines, strict=True)]
    out = ["  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)).rstrip() for row in [head, *lines]]
    for r in rows:
        if "reason" in r:
            out.append(f"  {r['id']}: {r['reason']}")
    return "\n".join(out)

