"""Reading the JSON and YAML documents users hand to tierkit (targets, model and agent configs)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from runtimes.errors import ConfigError


def read_document(path: str | Path, what: str) -> Any:
    """Parse `path` as JSON (`.json`) or YAML (anything else); `ConfigError` naming `what` when it cannot.

    Args:
        path: the file.
        what: how the message names the file, e.g. "target file" or "agent config".
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        msg = f"cannot read the {what} {str(path)!r}: {exc.strerror or exc}"
        raise ConfigError(msg) from None
    if path.suffix == ".json":
        try:
            return json.loads(text)
        except ValueError as exc:
            msg = f"the {what} {str(path)!r} is not valid JSON: {exc}"
            raise ConfigError(msg) from None
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        msg = f"the {what} {str(path)!r} is not valid YAML: {exc}"
        raise ConfigError(msg) from None


def validation_problems(exc: Any) -> str:
    """One line naming each problem of a pydantic `ValidationError`: `budget.latency_ms: ...; threshold: ...`."""
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '(top)'}: {e['msg']}" for e in exc.errors())
