"""OpenVINO, imported the one way tierkit imports it: with usage telemetry dropped first.

`import openvino` posts an "import" event, and NNCF (which imports openvino) posts more (runtimes/ov_telemetry.py
says why that matters offline). Every tierkit module takes OpenVINO from here, so whichever of them is imported
first, `silence` runs before OpenVINO loads:

    from runtimes.ov_import import openvino as ov

A module that also imports NNCF imports this one first (NNCF's own import loads OpenVINO).
"""

from __future__ import annotations

from runtimes.ov_telemetry import silence

silence()
import openvino  # noqa: E402

__all__ = ["openvino"]
