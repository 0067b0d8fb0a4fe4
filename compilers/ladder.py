"""Build, validate, time, rank and write the rungs of one compile (the work behind `compile_model`).

Every rung is judged by the same guard against the same fp32 reference outputs. The survivors are
timed together (interleaved, per declared batch size) so that their ratios to fp32 are measured
under the same load. The recommended variant is the fastest at the default batch size among
those no slower than the fp32 baseline: a variant that wins at batch 1 but loses at batch 64 is
recommended only when batch 1 is the default.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from tqdm import tqdm

from compilers import report
from compilers.calibration import CalibrationData
from compilers.fidelity import Guard, Verdict, classifier_calibration, measure, measure_outputs
from compilers.golden import GOLDEN_SAMPLES
from compilers.maps import looks_like_map
from compilers.measure import TimingPlan, latency_record, modeled_energy, time_runners
from compilers.passes import PassContext, PassResult, PassSkipped, run_pass
from compilers.passes.execute import Runner, open_runner, output_axes, run_all, samples_first, take_samples
from compilers.recipes import PassSpec, PruneConfig, Rung, Target, native_precisions, probe_host
from compilers.sequence import DEFAULT_DECODER, decode, looks_like_sequence
from compilers.validation import SequenceStop, artifact_digest, eval_batch, run_validation, sample_bytes
from compilers.variants import VariantSet
from runtimes.errors import BackendUnavailable, CompileError, ConfigError, FidelityError, InferenceError
from runtimes.registry import available_backends
from runtimes.spec import Task

if TYPE_CHECKING:
    from compilers.compile import Source

logger = logging.getLogger(__name__)

_OOD_SAMPLES = 512
# A first low-precision build is repaired only when it runs at least this share of fp32's speed (the margin
# covers timing noise on a loaded host); the short plan costs about a second per repaired rung.
REPAIR_MIN_SPEEDUP = 0.9
REPAIR_TIMING = TimingPlan(budget_s=0.5, rounds=3)
# Passes whose output depends on their input and parameters alone: run once per compile and shared (the
# OpenVINO export under the fp32, bf16 and int8 OpenVINO rungs).
SHARED_PASSES = ("export_openvino",)
REUSED_NOTE = ("byte-identical to an artifact already validated under the same runtime and precision (the "
               "reference graph, when a fusion kept it): that run's validation outputs are its own")
_EXTRA = {"openvino": "openvino", "tensorrt": "tensorrt", "torch": "torch", "onnxruntime": "onnx"}


@dataclass
class Base:
    """A starting point for the rungs: the reference model, or its pruned and recovered copy."""

    label: str
    onnx: Path
    torch_model: Any
    records: list[dict[str, Any]]


@dataclass
class BuiltVariant:
    """The variant a rung (a recipe) built, after it passed the guard: not yet ranked or written."""

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
    executed_precision: str = ""
    golden_outputs: dict[str, np.ndarray] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)  # build, validate, time: where this rung's time went


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
    metric: Any = None  # user metric: (outputs by name, labels or None) -> float, higher is better
    generated_data: bool = False  # no data was given: inputs were generated, fp32 rungs only
    probe: dict[str, Any] | None = None  # `tierkit doctor`'s probe, read when a rung depends on it
    decoder: str = DEFAULT_DECODER  # how a sequence task's output is read (compilers.sequence)
    max_time: float | None = None  # seconds for the rung search; past them, the rest is refused as cut short
    repair_all: bool = False  # repair rungs slower than fp32 too (see _repair_pays)
    repair_budget: float | None = None  # seconds one rung's repair search may take
    rejected: list[dict[str, Any]] = field(default_factory=list)
    # Filled in by run(): reference outputs on the validation data and on the OOD calibration subset,
    # the fp32 baseline's latency, and each evaluated artifact's validation outputs.
    ref_val: np.ndarray = field(init=False)
    ref_outputs: dict[str, np.ndarray] = field(init=False)
    ref_cal: np.ndarray = field(init=False)
    # each output's sample axis (execute.output_axes): outputs are joined, sliced and compared along it;
    # `ref_val`, `ref_cal` and candidates' `outputs` hold the primary output with its samples first
    out_axes: dict[str, int | None] = field(default_factory=dict)
    baseline_latency: dict[str, Any] = field(init=False)
    _ood_data: CalibrationData = field(init=False)
    _outputs: dict[str, np.ndarray] = field(default_factory=dict)
    _reference_metric: float | None = None
    _executed: dict[str, str] = field(default_factory=dict)
    golden_inputs: dict[str, np.ndarray] = field(init=False)
    golden_reference: dict[str, np.ndarray] = field(init=False)
    # the rung being built: its precision is pinned in every session that evaluates it, and an
    # unpruned fp32 rung is held to the numeric bound
    _building: tuple[str, bool] = ("fp32", True)
    # where the compile's time went: per step (reference, rungs, timing, write) and the validation
    # seconds of the rung being built; `cut_short` says the search ended at max_time
    seconds: dict[str, float] = field(default_factory=dict)
    cut_short: str = ""
    _eval_s: float = 0.0
    _reused: bool = False  # the rung being built had the outputs of an identical artifact
    _batch: int = 0  # samples per validation call (validation.eval_batch), set by _reference
    _ref_decoded: list[tuple[int, ...]] = field(default_factory=list)  # a sequence reference's decoded rows
    # (artifact digest, runtime, precision) -> its validation outputs and executed precision: an identical
    # artifact is not run again
    _known: dict[tuple[str, str, str], tuple[dict[str, np.ndarray], str]] = field(default_factory=dict)
    # passes whose result depends on their input and parameters alone, done once per compile (the OpenVINO
    # export shared by the fp32, f16, bf16 and int8 OpenVINO rungs)
    _pass_results: dict[tuple[str, str, str], PassResult] = field(default_factory=dict)
    _repair: dict[str, Any] = field(default_factory=dict)  # the rung being built: its repair's record
    _deadline: float | None = None

    def run(self, out: Path, *, name: str, version: str, sign_key: Ed25519PrivateKey | None,
            arguments: dict[str, Any]) -> VariantSet:
        """Build every rung on every base, time the survivors, write the packages and the index."""
        rungs = self._available_rungs()
        total = 3 + len(rungs) * (2 if self.prune else 1)
        started = time.monotonic()
        self._deadline = None if self.max_time is None else started + self.max_time
        with tqdm(total=total, desc="reference", file=sys.stderr, disable=not self.progress, unit="step") as bar:
            self._reference()
            self.seconds["reference"] = round(time.monotonic() - started, 2)
            bar.update()
            bases = [Base("", self.source.onnx, self.source.torch_model, [self.source.record])]
            if self.prune is not None:
                bar.set_description(f"prune {self.prune.ratio:.0%} + recovery")
                bases.append(self._pruned_base())
            candidates: list[BuiltVariant] = []
            for base in bases:
                for rung in rungs:
                    vid = "-".join(filter(None, (base.label, rung.id)))
                    bar.set_description(f"build+validate {vid}")
                    cand = self._timed_build(vid, base, rung, may_cut=bool(candidates))
                    if cand is not None:
                        candidates.append(cand)
                    bar.update()
            self.seconds["rungs"] = round(time.monotonic() - started - self.seconds["reference"], 2)
            if not candidates:
                raise self._nothing_kept()
            bar.set_description("timing")
            mark = time.monotonic()
            baseline = self._time(candidates)
            self.seconds["timing"] = round(time.monotonic() - mark, 2)
            bar.update()
            bar.set_description("write packages")
            vs = report.write(out, self, candidates, baseline, name=name, version=version, sign_key=sign_key,
                              arguments=arguments)
            bar.update()
        return vs

    def _timed_build(self, vid: str, base: Base, rung: Rung, *, may_cut: bool) -> BuiltVariant | None:
        """`_build`, refused unbuilt once `max_time` is spent and a rung is kept (`may_cut`); records where the
        rung's seconds went."""
        entry = {"id": vid, "precision": rung.precision, "runtime": rung.runtime,
                 "passes": [p.name for p in rung.passes]}
        now = time.monotonic()
        if may_cut and self._deadline is not None and now > self._deadline:
            assert self.max_time is not None
            self.cut_short = (f"max_time {self.max_time:g} s was spent; rungs not built: "
                              + ", ".join(filter(None, (self.cut_short.partition(": ")[2], vid))))
            self.rejected.append({**entry, "stage": "cut short",
                                  "reason": f"not built: max_time {self.max_time:g} s was spent before it"})
            return None
        self._eval_s, self._repair = 0.0, {}
        cand = self._build(vid, base, rung)
        spent = time.monotonic() - now
        seconds = {"build": round(spent - self._eval_s, 3), "validate": round(self._eval_s, 3)}
        if self._repair:  # part of the two above: ranking and search, each attempt one build and validation
            seconds["repair"] = round(sum(self._repair.get("seconds", {}).values()), 3)
            seconds["attempts"] = max(len(self._repair.get("attempts", [])) - 1, 0)
        if cand is not None:
            cand.seconds = seconds
        elif self.rejected and self.rejected[-1]["id"] == vid:
            self.rejected[-1]["seconds"] = seconds
        return cand

    # -- reference ------------------------------------------------------------------------------

    def _reference(self) -> None:
        names = [s.name for s in self.source.inputs]
        batch = self._eval_batch()
        self._ood_data = self.calibration.subset(_OOD_SAMPLES)
        output_names = [s.name for s in self.source.outputs]
        if self.source.torch_model is not None:
            from compilers.passes import export

            values = export.predict(self.source.torch_model, self.validation.batches(batch), names)
            self.ref_outputs = dict(zip(output_names, values, strict=False))
            self.ref_val = self.ref_outputs[self.primary]
            cal = export.predict(self.source.torch_model, self._ood_data.batches(batch), names)
            self.ref_cal = dict(zip(output_names, cal, strict=False))[self.primary]
        else:
            runner = open_runner(self.source.onnx, "onnxruntime", threads=self.threads)
            try:
                first = self.primary
                self.out_axes = output_axes(runner, self.validation, self.source.inputs, self.source.outputs)
                batch = self._size_batch(runner)
                self.ref_outputs = run_all(runner, self.validation.batches(batch), self.out_axes)
                self._known[(artifact_digest(self.source.onnx), "onnxruntime", "fp32")] = (self.ref_outputs, "fp32")
                self.ref_val = samples_first(self.ref_outputs[first], self.out_axes.get(first, 0))
                ood = run_all(runner, self._ood_data.batches(batch), self.out_axes)[first]
                self.ref_cal = samples_first(ood, self.out_axes.get(first, 0))
            except InferenceError as exc:
                msg = f"the fp32 reference does not run on the given data: {exc}"
                raise CompileError(msg) from exc
            finally:
                runner.close()
        if self.task is None:
            self.task = self._infer_task()
        if self.task == Task.SEQUENCE and self.ref_val.ndim != 3:
            msg = (f"task 'sequence' needs an output [samples, steps, symbols]; {self.primary!r} is "
                   f"{list(self.ref_val.shape)}")
            raise ConfigError(msg)
        if self.task == Task.SEQUENCE:
            self._ref_decoded = decode(self.ref_val, self.decoder)
        if self.metric is not None:
            self._reference_metric = self._user_metric(self.ref_outputs)
        self._golden()
        labels = self.validation.labels
        if self.task == Task.CLASSIFICATION and labels is not None and self.ref_val.ndim == 2:
            accuracy = float((self.ref_val.argmax(axis=1) == labels).mean())
            logger.info("fp32 reference accuracy on validation: %.4f", accuracy)

    @property
    def primary(self) -> str:
        """The output the task is judged on: the first floating-point one (graphs may echo int64 ids first)."""
        specs = self.source.outputs
        return next((s.name for s in specs if s.dtype.startswith(("float", "bfloat"))), specs[0].name)

    def _golden(self) -> None:
        """The golden inputs every package carries: the first validation rows and their reference outputs."""
        first = self.source.inputs[0].shape[0] if self.source.inputs[0].shape else None
        rows = first if isinstance(first, int) and first > 0 else min(GOLDEN_SAMPLES, len(self.validation))
        self.golden_inputs = self.validation.batch(rows)
        self.golden_reference = {k: take_samples(v, self.out_axes.get(k, 0), rows)
                                 for k, v in self.ref_outputs.items()}

    def _infer_task(self) -> str:
        """Labels, or a 2-D output of 2 to 1,000 columns that is not L2-normalised, mean a classifier."""
        ref = self.ref_val
        if looks_like_sequence(ref):
            logger.info("task inferred as sequence from the output shape %s (per-step probabilities; read with %s, "
                        "pass task= to override)", list(ref.shape), self.decoder)
            return Task.SEQUENCE.value
        if looks_like_map(ref):
            logger.info("task inferred as segmentation from the output shape %s (maps read as regions; pass task= "
                        "to override)", list(ref.shape))
            return Task.SEGMENTATION.value
        normalised = ref.ndim == 2 and bool(np.allclose(np.linalg.norm(ref, axis=1), 1.0, atol=1e-3))
        if self.validation.labels is not None or (ref.ndim == 2 and 2 <= ref.shape[1] <= 1000 and not normalised):
            task = Task.CLASSIFICATION.value
        elif ref.ndim == 2 and ref.shape[1] == 1:
            task = Task.REGRESSION.value  # one score per sample (a VAD's speech probability): argmax says nothing
        else:
            task = Task.EMBEDDING.value
        logger.info("task inferred as %s from the output shape %s (pass task= to override)", task, list(ref.shape))
        return task

    def _eval_batch(self) -> int:
        first = self.source.inputs[0].shape[0] if self.source.inputs[0].shape else 1
        return first if isinstance(first, int) else self._batch or 64

    def _size_batch(self, runner: Runner) -> int:
        """Samples per validation call, from one sample's bytes (`validation.eval_batch`) where the batch is free."""
        first = self.source.inputs[0].shape[0] if self.source.inputs[0].shape else 1
        if not isinstance(first, int) and len(self.validation):
            one = self.validation.batch(1)
            self._batch = eval_batch(sample_bytes(one, runner.run(one)))
        return self._eval_batch()

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
            reason = None
            if not have.get(rung.runtime):
                reason = f"{rung.runtime} is not installed: pip install 'tierkit[{_EXTRA[rung.runtime]}]'"
            elif not self._native(rung):
                where = "this GPU" if rung.runtime == "tensorrt" else "this CPU (needs avx512_bf16 or AMX)"
                reason = f"no native {rung.precision} on {where}: it would be emulated or run as fp32"
            elif self.generated_data and rung.precision == "int8":
                reason = "int8 needs calibration data (--calibration); none was given"
            if reason is None:
                rungs.append(rung)
                continue
            self.rejected.append({"id": rung.id, "precision": rung.precision, "runtime": rung.runtime,
                                  "stage": "unavailable", "reason": reason})
        if not rungs and all(r["reason"].startswith(("no native", "int8 needs")) for r in self.rejected):
            raise self._nothing_kept()
        if not rungs:
            runtimes = ", ".join(sorted({r.runtime for r in self.rungs}))
            msg = (f"target {self.target.name!r} runs on {runtimes}, and none is installed here: pip install "
                   f"'tierkit[{_EXTRA[self.rungs[0].runtime]}]' (TensorRT also needs an NVIDIA GPU)")
            raise BackendUnavailable(msg)
        return rungs

    def _native(self, rung: Rung) -> bool:
        """bf16 (and TensorRT's fp16) rungs are built only where the hardware computes them natively."""
        if rung.precision == "fp32" or (rung.precision == "int8" and rung.runtime != "tensorrt"):
            return True
        if rung.precision == "fp16" and rung.runtime != "tensorrt":
            return True  # kept for size, with its note; the guard and timing judge it
        if self.probe is None:
            self.probe = probe_host()
        return rung.precision in native_precisions(rung.runtime, self.probe)

    def evaluate(self, artifact: Path, runtime: str) -> tuple[dict[str, float], Verdict]:
        """Run `artifact` on the validation data; its fidelity against the reference and the guard's verdict.

        The session pins the precision of the rung being built; every output is compared, and an
        unpruned fp32 rung is held to the numeric bound instead of accuracy.
        """
        started = time.monotonic()
        try:
            return self._evaluate(artifact, runtime)
        finally:
            self._eval_s += time.monotonic() - started

    def _evaluate(self, artifact: Path, runtime: str) -> tuple[dict[str, float], Verdict]:
        precision, numeric = self._building
        key = (artifact_digest(artifact), runtime, precision)
        if key in self._known:
            outputs, executed = self._known[key]
            logger.info("%s is identical to an artifact already validated: its outputs are reused", artifact)
            self._reused = True
            run = None
        else:
            # validation: the dynamic model (a fixed-shape compile per validation batch shape costs more
            # than the few calls save; the two differ by rounding)
            runner = open_runner(artifact, runtime, threads=self.threads, device=self._device(runtime),
                                 precision=precision, static_shapes=0)
            try:
                executed = str(getattr(runner, "precision", precision))
                run = run_validation(runner, self.validation.batches(self._eval_batch()), self.out_axes,
                                     primary=self.primary, stop=self._sequence_stop(numeric))
            finally:
                runner.close()
            outputs = run.outputs
            if not run.stopped:
                self._known[key] = (outputs, executed)
        if executed != precision:
            msg = (f"{runtime} runs this {precision} variant in {executed} on this host "
                   f"({'no native ' + precision if precision in ('bf16', 'fp16') else 'precision not pinned'})")
            raise CompileError(msg)
        first = self.primary
        values = samples_first(outputs.get(first, next(iter(outputs.values()))), self.out_axes.get(first, 0))
        self._outputs[str(artifact)] = values
        self._executed[str(artifact)] = executed
        if run is not None and run.stopped:
            return self._stopped_verdict(values, outputs, run.samples, run.note, numeric)
        fid = measure(self.ref_val, values, self.validation.labels, task=str(self.task), decoder=self.decoder)
        classified = first if (self.task == Task.CLASSIFICATION and self.ref_val.ndim == 2) or \
            (self.task == Task.SEGMENTATION and self.ref_val.ndim == 4) else None
        numeric_fid, where = measure_outputs(self.ref_outputs, outputs, judged_by_task=classified,
                                             sample_axes=self.out_axes)
        fid.update(numeric_fid)
        if self._reference_metric is not None:
            fid["metric"] = self._user_metric(outputs)
            fid["reference_metric"] = self._reference_metric
        return fid, self.guard.check(fid, str(self.task), numeric=numeric, where=where)

    def _sequence_stop(self, numeric: bool) -> SequenceStop | None:
        """A sequence guard's early stop: the changed rows it allows over the whole validation set."""
        if not self._ref_decoded:
            return None
        least = self.guard.required(str(self.task), numeric=numeric).get("min_sequence_rows_unchanged")
        if least is None:
            return None
        allowed = int(np.floor((1 - least) * len(self._ref_decoded) + 1e-9))
        return SequenceStop(self._ref_decoded, allowed, self.decoder)

    def _stopped_verdict(self, values: np.ndarray, outputs: dict[str, np.ndarray], rows: int, note: str,
                         numeric: bool) -> tuple[dict[str, float], Verdict]:
        """Figures over the first `rows` validation rows of a run stopped early, and the failing verdict."""
        labels = self.validation.labels
        fid = measure(self.ref_val[:rows], values, None if labels is None else labels[:rows], task=str(self.task),
                      decoder=self.decoder)
        reference = {k: take_samples(v, self.out_axes.get(k, 0), rows) for k, v in self.ref_outputs.items()}
        numeric_fid, where = measure_outputs(reference, outputs, sample_axes=self.out_axes)
        fid.update(numeric_fid)
        fid["validation_rows"] = float(len(self._ref_decoded))
        verdict = self.guard.check(fid, str(self.task), numeric=numeric, where=where)
        assert not verdict.passed, "a validation is stopped only once its guard cannot pass"
        return fid, Verdict(False, f"{verdict.reason} ({note})", verdict.required)

    def _repair_pays(self, artifact: Path, runtime: str) -> str:
        """"" when `artifact` (a first build that failed the guard) runs at least 0.9x the fp32 reference's speed
        at one of the declared batch sizes; else why repairing it cannot pay.

        A repair keeps more of the graph in fp32, so the repaired rung is no faster than this first build,
        and the recommendation never takes a rung slower than fp32: on a CPU where int8 does not pay (AVX2
        without VNNI), the repair search (NNCF's accuracy control: one compile per quantizer group) would
        be the longest step of the compile for a rung nobody would run.
        """
        if self.repair_all:
            return ""
        precision, _ = self._building
        runners: dict[str, Runner] = {}
        try:
            runners["fp32"] = open_runner(self.source.onnx, "onnxruntime", threads=self.threads)
            runners["first"] = open_runner(artifact, runtime, threads=self.threads, device=self._device(runtime),
                                           precision=precision)
            feeds = {b: self.validation.batch(b) for b in self.batch_sizes}
            timing = time_runners(runners, feeds, plan=REPAIR_TIMING)
        except Exception:  # cannot tell: repair as usual, and the rung is judged when timed with the others
            logger.debug("could not time %s before repairing it", artifact, exc_info=True)
            return ""
        finally:
            for r in runners.values():
                r.close()
        ratios = {b: timing["fp32"][f"batch_{b}"]["p50"] / max(timing["first"][f"batch_{b}"]["p50"], 1e-9)
                  for b in self.batch_sizes}
        if max(ratios.values()) >= REPAIR_MIN_SPEEDUP:
            return ""
        speeds = ", ".join(f"{r:.2f}x at batch {b}" for b, r in ratios.items())
        return (f"not repaired: before repair it runs at {speeds} of fp32's speed here (< {REPAIR_MIN_SPEEDUP:g}x; "
                "repair_all repairs it anyway), and keeping layers in fp32 would make it slower still")

    def _user_metric(self, outputs: dict[str, np.ndarray]) -> float:
        try:
            return float(self.metric(outputs, self.validation.labels))
        except Exception as exc:  # the user's code: any failure is reported with its message
            msg = f"the metric {getattr(self.metric, '__name__', self.metric)!r} failed: {type(exc).__name__}: {exc}"
            raise CompileError(msg) from exc

    def _device(self, runtime: str) -> str:
        return "cuda" if runtime == "tensorrt" else "cpu"

    def _build(self, vid: str, base: Base, rung: Rung) -> BuiltVariant | None:
        ctx = PassContext(workdir=self.work, source=base.onnx, specs=self.source.inputs, calibration=self.calibration,
                          validation=self.validation, task=str(self.task), guard=self.guard, evaluate=self.evaluate,
                          threads=self.threads, batch_sizes=self.batch_sizes, torch_model=base.torch_model,
                          example_inputs=self.source.example_inputs, device=self._device(rung.runtime),
                          reference=self.ref_val, outputs=self.source.outputs, deadline=self._deadline,
                          decoder=self.decoder, repair_pays=self._repair_pays, repair_budget=self.repair_budget)
        artifact, records = base.onnx, list(base.records)
        entry = {"id": vid, "precision": rung.precision, "runtime": rung.runtime,
                 "passes": [p.name for p in rung.passes]}
        self._building = (rung.precision, rung.precision == "fp32" and not base.label)
        self._reused = False
        try:
            for i, spec in enumerate(rung.passes):
                workdir = self.work / vid / f"{i}-{spec.name}"
                workdir.mkdir(parents=True, exist_ok=True)
                result = self._run_pass(spec, artifact, dataclasses.replace(ctx, workdir=workdir))
                artifact = result.artifact
                records.append(result.record)
                if isinstance(result.record.get("sensitivity"), dict):
                    self._repair = result.record["sensitivity"]
            fid, verdict = self.evaluate(artifact, rung.runtime)
        except PassSkipped as exc:
            self.rejected.append({**entry, "stage": "skipped", "reason": str(exc)})
            return None
        except (BackendUnavailable, CompileError, InferenceError) as exc:
            self._reject(entry, "build", exc)
            return None
        except Exception as exc:  # a rung's library failing in any way rejects that rung, not the compile
            self._reject(entry, "build", exc, unexpected=True)
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
        if self._reused:
            records.append({"name": "note", "text": REUSED_NOTE})
        return BuiltVariant(vid, base, rung, artifact, records, fid, self._outputs[str(artifact)],
                         executed_precision=self._executed[str(artifact)])

    def _run_pass(self, spec: PassSpec, artifact: Path, ctx: PassContext) -> PassResult:
        """`run_pass`, done once per compile for a pass in `SHARED_PASSES` with the same input and parameters."""
        key = (spec.name, json.dumps(spec.params, sort_keys=True, default=str), str(artifact))
        if spec.name in SHARED_PASSES and key in self._pass_results:
            done: PassResult = self._pass_results[key]
            return PassResult(done.artifact, dict(done.record))
        result = run_pass(spec.name, artifact, ctx, spec.params)
        if spec.name in SHARED_PASSES:
            self._pass_results[key] = result
        return result

    def _reject(self, entry: dict[str, Any], stage: str, exc: BaseException, *, unexpected: bool = False) -> None:
        """Record a rung that failed at `stage` with a one-line reason; the other rungs go on."""
        text = " ".join(str(exc).split()) or type(exc).__name__
        if unexpected:
            text = f"{type(exc).__name__}: {text}"
        reason = text if len(text) <= 300 else text[:297] + "..."
        logger.warning("%s rejected at %s: %s", entry["id"], stage, reason)
        logger.debug("%s failed", entry["id"], exc_info=exc)
        self.rejected.append({**entry, "stage": stage, "reason": reason})

    def _nothing_kept(self) -> CompileError:
        lines = "; ".join(f"{r['id']}: {r['reason']}" for r in self.rejected)
        guard = [r for r in self.rejected if r.get("stage") == "guard"]
        msg = f"no variant was kept: {lines}"
        if guard:
            return FidelityError(msg, measured=guard[0]["measured"], required=guard[0]["required"])
        return CompileError(msg)

    # -- timing ---------------------------------------------------------------------------------

    def _time(self, candidates: list[BuiltVariant]) -> str:
        """Time every candidate (and the fp32 baseline) interleaved; returns the baseline's id."""
        baseline = next((c.id for c in candidates if c.rung.precision == "fp32" and not c.base.label), None)
        sizes = tuple(dict.fromkeys((1, *self.batch_sizes)))
        runners: dict[str, Runner] = {}
        inputs = {b: self.validation.batch(b) for b in sizes}
        try:
            for c in list(candidates):
                try:
                    runner = open_runner(c.artifact, c.rung.runtime, threads=self.threads,
                                         device=self._device(c.rung.runtime), precision=c.rung.precision)
                    runners[c.id] = runner
                    for batch in inputs.values():
                        runner.run(batch)
                except Exception as exc:  # a rung that cannot run every timed batch size is rejected alone
                    runners.pop(c.id, None)
                    candidates.remove(c)
                    self._reject({"id": c.id, "precision": c.rung.precision, "runtime": c.rung.runtime,
                                  "passes": [p.name for p in c.rung.passes]}, "timing", exc,
                                  unexpected=not isinstance(exc, InferenceError))
            if not candidates:
                raise self._nothing_kept()
            if baseline not in runners:
                baseline = None
            if baseline is None:
                baseline = report.REFERENCE_ID
                runners[baseline] = open_runner(self.source.onnx, "onnxruntime", threads=self.threads)
            spent: dict[str, float] = {}
            timing = time_runners(runners, inputs, spent=spent)
            for c in candidates:
                c.golden_outputs = runners[c.id].run(self.golden_inputs)
            for c in candidates:
                c.seconds["time"] = round(spent.get(c.id, 0.0), 3)
                c.latency = latency_record(timing[c.id], self.threads)
                if self.task == Task.CLASSIFICATION and c.outputs.ndim == 2:
                    outs = run_all(runners[c.id], self._ood_data.batches(self._eval_batch()), self.out_axes)
                    c.calib_outputs = samples_first(outs.get(self.primary, next(iter(outs.values()))),
                                                    self.out_axes.get(self.primary, 0))
                    c.calibration = classifier_calibration(c.outputs, self.ref_val, self.validation.labels,
                                                           c.calib_outputs)
            self.baseline_latency = latency_record(timing[baseline], self.threads)
        finally:
            for r in runners.values():
                r.close()
        return baseline

    def energy(self, latency: dict[str, Any]) -> dict[str, Any]:
        return modeled_energy(latency, self.batch_sizes[0])
