"""fp16 for onnxruntime: weights and compute in float16, inputs and outputs kept float32.

Uses onnxruntime's own converter (`onnxruntime.transformers.float16`), which keeps ops without
fp16 kernels in fp32 behind Casts; onnxconverter-common's version produces graphs that fail to
load on some transformer exports. On CPUs without fp16 arithmetic this variant is slower than
fp32 and only halves the size; the compiler measures it and never recommends it there.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import onnx
from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16

from compilers.passes import PassContext, PassResult
from runtimes.errors import CompileError

# Ops that lose range or precision in fp16 on the reductions they do.
_DEFAULT_BLOCK = ("Softmax", "LayerNormalization", "ReduceMean", "Pow", "Sqrt", "Erf")


def convert(artifact: Path, ctx: PassContext, *, op_block_list: Sequence[str] = _DEFAULT_BLOCK) -> PassResult:
    """Write an fp16 copy of `artifact`, keeping fp32 I/O, and the ops in `op_block_list` (plus
    onnxruntime's default block list) in fp32."""
    blocked = sorted({*DEFAULT_OP_BLOCK_LIST, *op_block_list})
    out = ctx.workdir / "model.onnx"
    try:
        model = convert_float_to_float16(onnx.load(str(artifact)), keep_io_types=True,
                                         op_block_list=blocked)
        onnx.save(model, str(out))
    except (ValueError, RuntimeError, KeyError, onnx.checker.ValidationError) as exc:
        msg = f"fp16 conversion of {artifact.name} failed: {exc}"
        raise CompileError(msg) from exc
    return PassResult(out, {"name": "fp16", "keep_io_types": True, "op_block_list": list(op_block_list)})
