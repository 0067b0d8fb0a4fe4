"""Regenerate inference_pb2*.py from inference.proto (run from the repository root).

    python -m cloud_service.protocol.regenerate

Needs grpcio-tools (the `dev` extra). The generated message module registers its descriptors
in a private descriptor pool instead of protobuf's default one: tritonclient (and any other
Open Inference Protocol client) registers the same `inference.*` names in the default pool, and
two registrations of one name in one pool fail at import. Keeping ours apart lets an application
import both.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
PROTO = "cloud_service/protocol/inference.proto"


def main() -> int:
    cmd = [sys.executable, "-m", "grpc_tools.protoc", "-I.", "--python_out=.", "--pyi_out=.",
           "--grpc_python_out=.", PROTO]
    subprocess.run(cmd, cwd=ROOT, check=True)
    module = HERE / "inference_pb2.py"
    text = module.read_text()
    default = "DESCRIPTOR = _descriptor_pool.Default().AddSerializedFile("
    if default not in text:
        msg = f"unexpected generated code in {module}: {default!r} not found"
        raise SystemExit(msg)
    text = text.replace(default, "POOL = _descriptor_pool.DescriptorPool()\nDESCRIPTOR = POOL.AddSerializedFile(")
    module.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
