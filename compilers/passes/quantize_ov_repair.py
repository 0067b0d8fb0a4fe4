"""Repair of an NNCF int8 model: keep its most quantization-sensitive ops in fp32, found in logarithmic steps.

NNCF's own accuracy-controlled mode ranks every quantizer group by reverting it, compiling the model
and validating it: one OpenVINO compile per group (57 for the 572 KB OCR direction classifier, 82 s of
its 158 s compile on 2 cores), and more for larger graphs. Here the ranking costs one compile:

- each FakeQuantize's injected noise, ||fq(x) - x||² / ||x||², is measured where it acts, on a few
  validation batches run through the quantized model itself (its inputs exposed as extra outputs, so
  upstream error is included); a weight NNCF compressed to int8 is scored by its rounding noise
  (scale² / 12 over its power);
- an op's score is the worst noise among the FakeQuantize nodes feeding it (its quantized inputs);
- `sensitivity.search` bypasses the FakeQuantize inputs of the top 1, 2, 4, ... ops (those ops then
  run in fp32) on a copy of the quantized model, with no re-calibration, until the guard passes: at
  most log2(ops / 2) + 1 builds and validations plus two bisection steps, each one compile.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from runtimes.ov_import import openvino as ov

_FQ = "FakeQuantize"
_SMOOTHING = "nncf_smooth_quant"  # SmoothQuant's activation scaling (its weights are scaled the other way)
_PASS_THROUGH = {"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Convert"}


def fake_quantize(x: np.ndarray, limits: Sequence[np.ndarray], levels: int) -> np.ndarray:
    """OpenVINO's FakeQuantize in numpy (its specification, numpy broadcasting); `limits` are its
    input low, input high, output low and output high."""
    x = np.asarray(x, np.float64)
    lo_in, hi_in, lo_out, hi_out = (np.asarray(v, np.float64) for v in limits)
    span = np.where(hi_in == lo_in, 1.0, hi_in - lo_in)
    q = np.round((x - lo_in) / span * (levels - 1)) / (levels - 1) * (hi_out - lo_out) + lo_out
    q = np.where(x <= np.minimum(lo_in, hi_in), lo_out, q)
    out: np.ndarray = np.where(x > np.maximum(lo_in, hi_in), hi_out, q)
    return out


_ARITHMETIC = {"Multiply": np.multiply, "Subtract": np.subtract, "Add": np.add}


def _constant(output: ov.Output) -> np.ndarray | None:
    """The value behind `output` when it is constant: a Constant, or NNCF's compressed weight (an int8
    Constant -> Convert -> [Subtract zero point] -> Multiply by the scale); else None."""
    node = output.get_node()
    kind = node.get_type_name()
    if kind == "Constant":
        return np.asarray(node.get_data(), np.float64)
    if kind == "Convert":
        return _constant(node.input_value(0))
    if kind in _ARITHMETIC:
        a, b = _constant(node.input_value(0)), _constant(node.input_value(1))
        return None if a is None or b is None else np.asarray(_ARITHMETIC[kind](a, b), np.float64)
    return None


def _noise(pre: np.ndarray, post: np.ndarray) -> tuple[float, float]:
    pre = np.asarray(pre, np.float64)
    return float(((post - pre) ** 2).sum()), float((pre ** 2).sum())


def _owners(fq: ov.Node) -> list[str]:
    """The ops that take `fq`'s output, through reshapes (a MatMul's weight is quantized before its Transpose)."""
    found: list[str] = []
    stack = [t.get_node() for t in fq.output(0).get_target_inputs()]
    while stack:
        node = stack.pop()
        if node.get_type_name() in _PASS_THROUGH:
            stack += [t.get_node() for output in node.outputs() for t in output.get_target_inputs()]
        elif node.get_type_name() != _FQ and node.get_friendly_name() not in found:
            found.append(node.get_friendly_name())
    return found


def _unquantize(port: ov.Input, *, unsmooth: bool) -> None:
    """Feed `port` (through the reshapes before it) from before the FakeQuantize that quantizes it, and with
    `unsmooth` from before SmoothQuant's scaling of it too (its weight then gets the original back)."""
    while True:
        node = port.get_source_output().get_node()
        if node.get_type_name() == _FQ:
            port.replace_source_output(node.input_value(0))
        elif unsmooth and node.get_type_name() == "Multiply" and _SMOOTHING in node.get_friendly_name():
            port.replace_source_output(next(node.input_value(k) for k in (0, 1)
                                            if node.input_value(k).get_node().get_type_name() != "Constant"))
        elif node.get_type_name() in _PASS_THROUGH and node.get_input_size():
            port = node.input(0)
        else:
            return


def _weight_noise(model: ov.Model) -> dict[str, float]:
    """Ops whose constant input NNCF compressed to int8, and the noise that rounding injects there.

    The noise is modelled (uniform rounding, scale² / 12 per element, over the dequantized weight's
    power) rather than measured against the original weight: SmoothQuant rescales a transformer's
    weights per input channel before quantizing them, so the original is not what was rounded.
    """
    noise: dict[str, float] = {}
    for op in model.get_ops():
        for i in range(op.get_input_size()):
            node = op.input_value(i).get_node()
            if node.get_type_name() != "Multiply" or not node.get_friendly_name().endswith(f"/fq_weights_{i}"):
                continue
            weight = _constant(op.input_value(i))
            scale = next((_constant(node.input_value(k)) for k in (0, 1)
                          if node.input_value(k).get_node().get_type_name() == "Constant"), None)
            if weight is None or scale is None:
                continue
            rounding = float(np.mean(np.broadcast_to(scale, weight.shape) ** 2)) / 12
            noise[op.get_friendly_name()] = rounding / max(float(np.mean(weight ** 2)), 1e-30)
    return noise


def rank(model: ov.Model, batches: Sequence[Mapping[str, np.ndarray]], *,
         threads: int = 0) -> list[tuple[str, float]]:
    """Ops of a quantized model that take a quantized input, most sensitive first, with their score."""
    fqs = [op for op in model.get_ops() if op.get_type_name() == _FQ]
    params: dict[str, tuple[list[np.ndarray], int]] = {}
    sums: dict[str, list[float]] = {}
    activations = []
    for fq in fqs:
        name = fq.get_friendly_name()
        limits = [v for v in (_constant(fq.input_value(i)) for i in range(1, 5)) if v is not None]
        if len(limits) < 4:
            continue  # limits computed at run time: not NNCF's layout, left unranked
        params[name] = (limits, int(fq.get_attributes()["levels"]))
        weight = _constant(fq.input_value(0))
        if weight is not None:
            sums[name] = list(_noise(weight, fake_quantize(weight, *params[name])))
        else:
            sums[name] = [0.0, 0.0]
            activations.append(fq)
    if activations:
        probe = model.clone()
        by_name = {op.get_friendly_name(): op for op in probe.get_ops()}
        exposed = probe.add_outputs([by_name[fq.get_friendly_name()].input_value(0) for fq in activations])
        config = {"INFERENCE_PRECISION_HINT": "f32", **({"INFERENCE_NUM_THREADS": threads} if threads else {})}
        compiled = ov.Core().compile_model(probe, "CPU", config)
        ports = [compiled.outputs[len(compiled.outputs) - len(exposed) + i] for i in range(len(exposed))]
        for batch in batches:
            result = compiled(dict(batch))
            for fq, port in zip(activations, ports, strict=True):
                name = fq.get_friendly_name()
                x = np.asarray(result[port], np.float64)
                err, power = _noise(x, fake_quantize(x, *params[name]))
                sums[name][0] += err
                sums[name][1] += power
    scores = _weight_noise(model)
    for fq in fqs:
        name = fq.get_friendly_name()
        if name not in sums:
            continue
        noise = sums[name][0] / max(sums[name][1], 1e-30)
        for owner in _owners(fq):
            scores[owner] = max(scores.get(owner, 0.0), noise)
    return sorted(scores.items(), key=lambda kv: -kv[1])


def bypass(model: ov.Model, ops: Sequence[str], out: Path, *, original: ov.Model | None = None) -> Path:
    """Save a copy of `model` to `out` in which `ops` read their inputs before quantization (run in fp32).

    NNCF's bias correction shifts the bias after each quantized op to offset its quantization error;
    once the op is fp32 again that shift is an error of its own (0.014 on the direction classifier's
    probabilities with every op bypassed). Given the `original` fp32 model, the bias after each bypassed
    op (an Add of a Constant the original has under the same name) is put back.
    """
    copy = model.clone()
    by_name = {op.get_friendly_name(): op for op in copy.get_ops()}
    before = {} if original is None else {op.get_friendly_name(): op for op in original.get_ops()}
    constants = {k: v for k, v in before.items() if v.get_type_name() == "Constant"}
    for name in ops:
        op = by_name.get(name)
        if op is None:
            continue
        restored = _restore_weights(op, before.get(name))
        for port in op.inputs():
            _unquantize(port, unsmooth=restored)
        _restore_bias(op, constants)
    out.parent.mkdir(parents=True, exist_ok=True)
    ov.save_model(copy, str(out), compress_to_fp16=False)
    return out


def _restore_weights(op: ov.Node, twin: ov.Node | None) -> bool:
    """Give `op` back the fp32 constants its `twin` in the original model had where NNCF compressed them;
    whether it did (then its activations must be read from before SmoothQuant's scaling as well)."""
    if twin is None or twin.get_input_size() != op.get_input_size():
        return False
    restored = False
    for i, port in enumerate(op.inputs()):
        source = twin.input_value(i).get_node()
        if source.get_type_name() == "Constant" and port.get_source_output().get_node().get_type_name() != "Constant":
            port.replace_source_output(ov.opset13.constant(source.get_data()).output(0))
            restored = True
    return restored


def _restore_bias(op: ov.Node, constants: Mapping[str, ov.Node]) -> None:
    for target in (t for output in op.outputs() for t in output.get_target_inputs()):
        add = target.get_node()
        if add.get_type_name() != "Add":
            continue
        for port in add.inputs():
            const = port.get_source_output().get_node()
            before = constants.get(const.get_friendly_name()) if const.get_type_name() == "Constant" else None
            if before is not None and tuple(before.get_output_shape(0)) == tuple(const.get_output_shape(0)):
                port.replace_source_output(ov.opset13.constant(before.get_data()).output(0))

