"""Build, validate, time, rank and write the rungs of one compile (the work behind `compile_model`).

Every rung is judged by the same guard against the same fp32 reference outputs. The survivors are
timed together (interleaved, per declared batch size) so that their ratios to fp32 are measured
under the same load. The recommended variant is the fastest at the default batch size among
those no slower than the fp32 baseline: a variant that wins at batch 1 but loses at batch 64 is
recommended only when batch 1 is the default.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from tqdm import tqdm

from compilers import report
from compilers.calibration import CalibrationData
from compilers.fidelity import Guard, Verdict, classifier_calibration, measure
from compilers.measure import latency_record, modeled_energy, time_runners
from compilers.passes import PassContext, PassSkipped, run_pass
from compilers.passes.execute import Runner, open_runner, run_all
from compilers.recipes import PruneConfig, Rung, Target
from compilers.variants import VariantSet
from runtimes.errors import BackendUnavailable, CompileError, FidelityError, InferenceError
from runtimes.registry import available_backends
from runtimes.spec import Task

if TYPE_CHECKING:
    from compilers.compile import Source

logger = logging.getLogger(__name__)

_OOD_SAMPLES = 512
_EXTRA = {"openvino": "openvino", "tensorrt": "tensorrt", "torch": "torch", "onnxruntime": "onnx"}


@dataclass
class Base:
    """A starting point for the rungs: the reference model, or its pruned and recovered copy."""

    label: str
    onnx: Path
    torch_model: Any
    records: list[dict[str, Any]]


@dataclass
class Candidate:
    """A rung that was built and passed the guard."""

    id: str
    base: Base
    rung: Rung
    artifact: Path
    records: list[dict[str, Any]]
    fidelity: dict[str, float]
    outputs: np.ndarray
    latency: dict[str, Any] = field(default_factory=dict)
    calibration: dict[str, Any] = field(default_factory=dict)
    calib_outputs: np.ndarray | None = None


@dataclass
class Ladder:
    """One compile's state; `run` does the work and writes the variant set."""

    source: Source
    target: Target
    rungs: Sequence[Rung]
    calibration: CalibrationData
    validation: CalibrationData
    guard: Guard
    task: str | None
    batch_sizes: tuple[int, ...]
    threads: int
    work: Path
    strict: bool
    progress: bool
    prune: PruneConfig | None
    rejected: list[dict[str, Any]] = field(default_factory=list)
    # Filled in by run(): reference outputs on the validation data and on the OOD calibration subset,
    # the fp32 baseline's latency, and each evaluated artifact's validation outputs.
    ref_val: np.ndarray = field(init=False)
    ref_cal: np.ndarray = field(init=False)
    baseline_latency: dict[str, Any] = field(init=False)
    _ood_data: CalibrationData = field(init=False)
    _outputs: dict[str, np.ndarray] = field(default_factory=dict)

    def run(self, out: Path, *, name: str, version: str, sign_key: Ed25519PrivateKey | None,
            arguments: dict[str, Any]) -> VariantSet:
        """Build every rung on every base, time the survivors, write the packages and the index."""
        rungs = self._available_rungs()
        total = 3 + len(rungs) * (2 if self.prune else 1)
        with tqdm(total=total, desc="reference", file=sys.stderr, disable=not self.progress, unit="step") as bar:
            self._reference()
            bar.update()
            bases = [Base("", self.source.onnx, self.source.torch_model, [self.source.record])]
            if self.prune is not None:
                bar.set_description(f"prune {self.prune.ratio:.0%} + recovery")
                bases.append(self._pruned_base())
            candidates = []
            for base in bases:
                for rung in rungs:
                    vid = "-".join(filter(None, (base.label, rung.id)))
                    bar.set_description(f"build+validate {vid}")
                    cand = self._build(vid, base, rung)
                    if cand is not None:
                        candidates.append(cand)
                    bar.update()
            if not candidates:
                raise self._nothing_kept()
            bar.set_description("timing")
            baseline = self._time(candidates)
            bar.update()
            bar.set_description("write packages")
            vs = report.write(out, self, candidates, baseline, name=name, version=version, sign_key=sign_key,
                              arguments=arguments)
            bar.update()
        return vs

    # -- reference ------------------------------------------------------------------------------

    def _reference(self) -> None:
        names = [s.name for s in self.source.inputs]
        batch = self._eval_batch()
        self._ood_data = self.calibration.subset(_OOD_SAMPLES)
        if self.source.torch_model is not None:
            from compilers.passes import export

            self.ref_val = export.predict(self.source.torch_model, self.validation.batches(batch), names)[0]
            self.ref_cal = export.predict(self.source.torch_model, self._ood_data.batches(batch), names)[0]
        else:
            runner = open_runner(self.source.onnx, "onnxruntime", threads=self.threads)
            try:
                first = self.source.outputs[0].name
                self.ref_val = run_all(runner, self.validation.batches(batch))[first]
                self.ref_cal = run_all(runner, self._ood_data.batches(batch))[first]
            except InferenceError as exc:
                msg = f"the fp32 reference does not run on the given data: {exc}"
                raise CompileError(msg) from exc
            finally:
                runner.close()
        if self.task is None:
            self.task = self._infer_task()
        labels = self.validation.labels
        if self.task == Task.CLASSIFICATION and labels is not None and self.ref_val.ndim == 2:
            accuracy = float((self.ref_val.argmax(axis=1) == labels).mean())
            logger.info("fp32 reference accuracy on validation: %.4f", accuracy)

    def _infer_task(self) -> str:
        """Labels, or a 2-D output of at most 1,000 columns that is not L2-normalised, mean a classifier."""
        ref = self.ref_val
        normalised = ref.ndim == 2 and bool(np.allclose(np.linalg.norm(ref, axis=1), 1.0, atol=1e-3))
        if self.validation.labels is not None or (ref.ndim == 2 and ref.shape[1] <= 1000 and not normalised):
            task = Task.CLASSIFICATION.value
        else:
            task = Task.EMBEDDING.value
        logger.info("task inferred as %s from the output shape %s (pass task= to override)", task, list(ref.shape))
        return task

    def _eval_batch(self) -> int:
        first = self.source.inputs[0].shape[0] if self.source.inputs[0].shape else 1
        return first if isinstance(first, int) else 64

    def _pruned_base(self) -> Base:
        from compilers.passes import export, prune

        assert self.prune is not None
        names = [s.name for s in self.source.inputs]
        pruned, record = prune.prune(self.source.torch_model, self.source.example_inputs, self.calibration,
                                     self.prune, input_names=names, task=str(self.task), validation=self.validation)
        label = f"pruned{round(self.prune.ratio * 100)}"
        path, _ = export.to_onnx(pruned, self.source.example_inputs, self.work / label / "reference.onnx",
                                 output_names=[s.name for s in self.source.outputs], input_names=names)
        return Base(label, path, pruned, [self.source.record, record])

    # -- rungs ----------------------------------------------------------------------------------

    def _available_rungs(self) -> list[Rung]:
        have = available_backends()
        rungs = []
        for rung in self.rungs:
            if have.get(rung.runtime):
                rungs.append(rung)
                continue
            reason = f"{rung.runtime} is not installed: pip install 'tierkit[{_EXTRA[rung.runtime]}]'"
            self.rejected.append({"id": rung.id, "precision": rung.precision, "runtime": rung.runtime,
                                  "stage": "unavailable", "reason": reason})
        if not rungs:
            runtimes = ", ".join(sorted({r.runtime for r in self.rungs}))
            msg = (f"target {self.target.name!r} runs on {runtimes}, and none is installed here: pip install "
                   f"'tierkit[{_EXTRA[self.rungs[0].runtime]}]' (TensorRT also needs an NVIDIA GPU)")
            raise BackendUnavailable(msg)
        return rungs

    def evaluate(self, artifact: Path, runtime: str) -> tuple[dict[str, float], Verdict]:
        """Run `artifact` on the validation data; its fidelity against the reference and the guard's verdict."""
        runner = open_runner(artifact, runtime, threads=self.threads, device=self._device(runtime))
        try:
            outputs = run_all(runner, self.validation.batches(self._eval_batch()))
        finally:
            runner.close()
        first = self.source.outputs[0].name
        values = outputs.get(first, next(iter(outputs.values())))
        self._outputs[str(artifact)] = values
        fid = measure(self.ref_val, values, self.validation.labels, task=str(self.task))
        return fid, self.guard.check(fid, str(self.task))

    def _device(self, runtime: str) -> str:
        return "cuda" if runtime == "tensorrt" else "cpu"

    def _build(self, vid: str, base: Base, rung: Rung) -> Candidate | None:
        ctx = PassContext(workdir=self.work, source=base.onnx, specs=self.source.inputs, calibration=self.calibration,
                          validation=self.validation, task=str(self.task), guard=self.guard, evaluate=self.evaluate,
                          threads=self.threads, batch_sizes=self.batch_sizes, torch_model=base.torch_model,
                          example_inputs=self.source.example_inputs, device=self._device(rung.runtime),
                          reference=self.ref_val, outputs=self.source.outputs)
        artifact, records = base.onnx, list(base.records)
        entry = {"id": vid, "precision": rung.precision, "runtime": rung.runtime,
                 "passes": [p.name for p in rung.passes]}
        try:
            for i, spec in enumerate(rung.passes):
                workdir = self.work / vid / f"{i}-{spec.name}"
                workdir.mkdir(parents=True, exist_ok=True)
                result = run_pass(spec.name, artifact, dataclasses.replace(ctx, workdir=workdir), spec.params)
                artifact = result.artifact
                records.append(result.record)
            fid, verdict = self.evaluate(artifact, rung.runtime)
        except PassSkipped as exc:
            self.rejected.append({**entry, "stage": "skipped", "reason": str(exc)})
            return None
        except (BackendUnavailable, CompileError, InferenceError) as exc:
            logger.warning("%s: %s", vid, exc)
            logger.debug("%s failed", vid, exc_info=True)
            self.rejected.append({**entry, "stage": "build", "reason": str(exc)})
            return None
        void = next((r["sensitivity"]["note"] for r in records
                     if isinstance(r.get("sensitivity"), dict) and r["sensitivity"].get("note")), None)
        if not verdict.passed or void:
            reason = void or verdict.reason
            attempts = next((r["sensitivity"].get("attempts") for r in records if "sensitivity" in r), None)
            rejected = {**entry, "stage": "guard", "reason": reason, "measured": fid, "required": verdict.required}
            if attempts:
                rejected["attempts"] = attempts
            self.rejected.append(rejected)
            logger.warning("%s rejected: %s", vid, reason)
            if self.strict:
                msg = (f"variant {vid} fails the accuracy guard: {reason} (measured {report.brief(fid)}; required "
                       f"{verdict.required})")
                raise FidelityError(msg, measured=fid, required=verdict.required)
            return None
        if rung.note:
            records.append({"name": "note", "text": rung.note})
        return Candidate(vid, base, rung, artifact, records, fid, self._outputs[str(artifact)])

    def _nothing_kept(self) -> CompileError:
        lines = "; ".join(f"{r['id']}: {r['reason']}" for r in self.rejected)
        guard = [r for r in self.rejected if r.get("stage") == "guard"]
        msg = f"no variant was kept: {lines}"
        if guard:
            return FidelityError(msg, measured=guard[0]["measured"], required=guard[0]["required"])
        return CompileError(msg)

    # -- timing ---------------------------------------------------------------------------------

    def _time(self, candidates: list[Candidate]) -> str:
        """Time every candidate (and the fp32 baseline) interleaved; returns the baseline's id."""
        baseline = next((c.id for c in candidates if c.rung.precision == "fp32" and not c.base.label), None)
        sizes = tuple(dict.fromkeys((1, *self.batch_sizes)))
        runners: dict[str, Runner] = {}
        try:
            for c in candidates:
                runners[c.id] = open_runner(c.artifact, c.rung.runtime, threads=self.threads,
                                            device=self._device(c.rung.runtime))
            if baseline is None:
                baseline = report.REFERENCE_ID
                runners[baseline] = open_runner(self.source.onnx, "onnxruntime", threads=self.threads)
            timing = time_runners(runners, {b: self.validation.batch(b) for b in sizes})
            for c in candidates:
                c.latency = latency_record(timing[c.id], self.threads)
                if self.task == Task.CLASSIFICATION and c.outputs.ndim == 2:
                    outs = run_all(runners[c.id], self._ood_data.batches(self._eval_batch()))
                    c.calib_outputs = outs.get(self.source.outputs[0].name, next(iter(outs.values())))
                    c.calibration = classifier_calibration(c.outputs, self.ref_val, self.validation.labels,
                                                           c.calib_outputs)
            self.baseline_latency = latency_record(timing[baseline], self.threads)
        finally:
            for r in runners.values():
                r.close()
        return baseline

    def energy(self, latency: dict[str, Any]) -> dict[str, Any]:
        return modeled_energy(latency, self.batch_sizes[0])
