"""Export a torch model: to ONNX (the fp32 reference every rung starts from) or to a `.pt2` program.

ONNX export uses the legacy TorchScript exporter: its graphs are the ones onnxruntime's fusions
recognise (the dynamo exporter's run about 20% slower under onnxruntime). A `torch.export`
program is exported through its `module()` the same way, and through the dynamo exporter when
tracing it fails. Axis 0 of every input and output is a named dynamic batch axis.
"""

from __future__ import annotations

import inspect
import logging
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from compilers.passes import PassContext, PassResult, PassSkipped
from runtimes.errors import CompileError, ConfigError

logger = logging.getLogger(__name__)


def as_tensors(example_inputs: Any, names: Sequence[str] | None = None) -> tuple[tuple[torch.Tensor, ...], list[str]]:
    """Example inputs (a tensor, array, tuple of them, or name -> value mapping) as a tuple and names."""
    if isinstance(example_inputs, Mapping):
        names = list(example_inputs)
        values = list(example_inputs.values())
    elif isinstance(example_inputs, tuple | list):
        values = list(example_inputs)
    else:
        values = [example_inputs]
    tensors = tuple(v if isinstance(v, torch.Tensor) else torch.from_numpy(np.asarray(v)) for v in values)
    if names is None or len(names) != len(tensors):
        names = ["x"] if len(tensors) == 1 else [f"input{i}" for i in range(len(tensors))]
    return tensors, list(names)


def forward_names(module: torch.nn.Module, count: int) -> list[str] | None:
    """The first `count` parameter names of `module.forward`, when it has that many plain ones."""
    try:
        params = [p for p in inspect.signature(module.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return None
    return [p.name for p in params[:count]] if len(params) >= count else None


def to_onnx(model: Any, example_inputs: Any, path: Path, *, output_names: Sequence[str] = ("logits",),
            input_names: Sequence[str] | None = None, opset: int = 17) -> tuple[Path, list[str]]:
    """Export a torch module or `torch.export.ExportedProgram` to ONNX with a dynamic batch axis.

    Input names: the keys of `example_inputs` when it is a mapping; else `input_names` (the names the
    data is keyed by) when they are as many as the inputs, ordered like `forward`'s parameters when
    they are the same names; else `forward`'s parameter names.

    Returns:
        The ONNX path and the input names.
    """
    exported = isinstance(model, torch.export.ExportedProgram)
    if exported and example_inputs is None:
        example_inputs = tuple(model.example_inputs[0]) if model.example_inputs else None
    if example_inputs is None:
        msg = "exporting a torch model needs example_inputs (a tensor, a tuple of tensors or a dict of them)"
        raise ConfigError(msg)
    module = model.module() if exported else model
    count = len(example_inputs) if isinstance(example_inputs, tuple | list | Mapping) else 1
    declared = forward_names(module, count)
    given = list(example_inputs) if isinstance(example_inputs, Mapping) else None
    if given is None and input_names is not None and len(input_names) == count:
        given = declared if declared is not None and set(declared) == set(input_names) else list(input_names)
    tensors, names = as_tensors(example_inputs, given or declared)
    outputs = list(output_names)
    axes = {n: {0: "batch"} for n in [*names, *outputs]}
    path.parent.mkdir(parents=True, exist_ok=True)
    if not exported:
        module.eval()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # tracer warnings about Python control flow on shapes
            # An exported program's module refuses .train(); PRESERVE keeps the exporter from calling it.
            mode = torch.onnx.TrainingMode.PRESERVE if exported else torch.onnx.TrainingMode.EVAL
            torch.onnx.export(module, tensors, str(path), input_names=names, output_names=outputs,
                              dynamic_axes=axes, opset_version=opset, dynamo=False, training=mode)
    except Exception as exc:  # the legacy tracer fails on some programs; the dynamo exporter may not
        if not exported:
            msg = f"ONNX export of the torch model failed: {exc}"
            raise CompileError(msg) from exc
        logger.info("legacy export of the program failed (%s); using the dynamo exporter", exc)
        try:
            torch.onnx.export(model, (), str(path), input_names=names, output_names=outputs, dynamo=True,
                              verbose=False)
        except Exception as exc2:
            msg = f"ONNX export of the torch.export program failed: {exc2}"
            raise CompileError(msg) from exc2
    return path, names


def to_pt2(artifact: Path, ctx: PassContext, *, strict: bool = False) -> PassResult:
    """Export the torch model as a `torch.export` program (`model.pt2`) with a dynamic batch axis."""
    model = ctx.torch_model
    if model is None:
        msg = "the torch runtime needs the model as a torch module or torch.export program, not an ONNX file"
        raise PassSkipped(msg)
    out = ctx.workdir / "model.pt2"
    if isinstance(model, torch.export.ExportedProgram):
        program = model
    else:
        tensors, _ = as_tensors(ctx.example_inputs)
        batch = torch.export.Dim("batch", min=1, max=max(4096, *ctx.batch_sizes))
        shapes = tuple({0: batch} for _ in tensors)
        try:
            program = torch.export.export(model.eval(), tensors, dynamic_shapes=shapes, strict=strict)
        except Exception as exc:  # torch.export raises many types for unsupported Python
            msg = f"torch.export of the model failed: {exc}"
            raise CompileError(msg) from exc
    torch.export.save(program, str(out))
    from runtimes import session

    writer = getattr(session, "write_io_sidecar", None)
    if writer is not None:  # names and shapes the .pt2 file does not keep
        writer(out, ctx.specs, ctx.outputs)
    return PassResult(out, {"name": "export_torch", "torch": torch.__version__, "strict": strict})



def static_batch(program: torch.export.ExportedProgram) -> int | None:
    """The batch size an exported program was specialised to, or None when axis 0 is symbolic."""
    for spec in program.graph_signature.input_specs:
        if spec.kind == torch.export.graph_signature.InputKind.USER_INPUT:
            node = next((n for n in program.graph.nodes if n.name == spec.arg.name), None)
            val = None if node is None else node.meta.get("val")
            if val is not None and val.ndim and isinstance(val.shape[0], int):
                return int(val.shape[0])
            return None
    return None


def predict(model: Any, batches: Any, names: Sequence[str]) -> list[np.ndarray]:
    """Run a torch module or exported program on input batches; the outputs in order, concatenated."""
    exported = isinstance(model, torch.export.ExportedProgram)
    module = model.module() if exported else model.eval()
    chunk = static_batch(model) if exported else None
    parts: list[list[np.ndarray]] = []
    with torch.inference_mode():
        for batch in batches:
            n = len(batch[names[0]])
            for start in range(0, n, chunk or n):
                args = (torch.from_numpy(np.ascontiguousarray(batch[k][start:start + (chunk or n)])) for k in names)
                out = module(*args)
                outs = list(out) if isinstance(out, tuple | list) else [out]
                if not parts:
                    parts = [[] for _ in outs]
                for i, o in enumerate(outs):
                    parts[i].append(o.detach().float().numpy())
    return [np.concatenate(p) for p in parts]
