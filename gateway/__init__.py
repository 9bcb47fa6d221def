"""kvgate's gateway: the ASGI app, the proxy hot path, SSE relay, CLI and settings."""

from .settings import ConfigError, Settings, load_settings

__all__ = ["ConfigError", "Settings", "load_settings"]
