"""The standing hostile-input suite: the cloud service's fixtures (real packages, real servers, a CA)."""

from tests.cloud_service.conftest import digits_x, models_dir, pki, serve

__all__ = ["digits_x", "models_dir", "pki", "serve"]
