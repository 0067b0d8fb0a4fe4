"""Turn a model into a ladder of verified, optionally signed packages.

`compile_model` is the entry point (`sdk.compile` and `tierkit compile` call it). Heavy libraries
(onnxruntime.quantization, openvino, nncf, torch, torch-pruning, tensorrt) are imported only by
the passes that need them, so importing this package stays light.
"""

from compilers.calibration import CalibrationData
from compilers.compile import compile_model
from compilers.fidelity import Guard
from compilers.manifest import Manifest
from compilers.package import ModelPackage, pack, unpack, write_package
from compilers.recipes import PassSpec, PruneConfig, Rung, Target, get_target, target_names
from compilers.variants import VariantEntry, VariantSet

__all__ = [
    "CalibrationData",
    "Guard",
    "Manifest",
    "ModelPackage",
    "PassSpec",
    "PruneConfig",
    "Rung",
    "Target",
    "VariantEntry",
    "VariantSet",
    "compile_model",
    "get_target",
    "pack",
    "target_names",
    "unpack",
    "write_package",
]
