"""tierkit's public API: compile a model into variants, load them, predict at the edge, escalate to the cloud.

Example:
    >>> import sdk
    >>> with sdk.load("variants/", cloud="grpc://127.0.0.1:8001/cnn", budget=sdk.Budget(latency_ms=30)) as model:
    ...     pred = model.predict(x)
    ...     pred.tier, pred.degraded, pred.score
"""

from runtimes.errors import TierkitError
from sdk._tiered import Budget, Prediction, TieredModel, load
from sdk._tiered import compile_model as compile  # noqa: A004 - the public verb; shadows the builtin here only

__version__ = "0.1.0"

__all__ = ["Budget", "Prediction", "TieredModel", "TierkitError", "__version__", "compile", "load"]
