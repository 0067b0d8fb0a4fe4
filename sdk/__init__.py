"""tierkit's public API: compile a model into variants, load them, predict at the edge, escalate to the cloud."""

from runtimes.errors import TierkitError

__version__ = "0.1.0"

__all__ = ["TierkitError", "__version__"]
