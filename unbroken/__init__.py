"""Unbroken's public SDK names: `from unbroken import Client, JobSpec`.

Loaded lazily, so `import unbroken` costs nothing and never imports torch or ray.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from api.client import Client, JobProgress
    from api.errors import (
        Conflict,
        Forbidden,
        JobCancelled,
        JobFailed,
        JobNotFound,
        ServerError,
        ServerUnavailable,
        Unauthorized,
        UnbrokenError,
        ValidationFailed,
    )
    from api.schemas import Job
    from service.spec import JobSpec, SpecError

_WHERE = {
    "Client": "api.client",
    "JobProgress": "api.client",
    "JobFailed": "api.errors",
    "JobCancelled": "api.errors",
    "Job": "api.schemas",
    "JobSpec": "service.spec",
    "SpecError": "service.spec",
    "UnbrokenError": "api.errors",
    "Unauthorized": "api.errors",
    "Forbidden": "api.errors",
    "JobNotFound": "api.errors",
    "Conflict": "api.errors",
    "ValidationFailed": "api.errors",
    "ServerError": "api.errors",
    "ServerUnavailable": "api.errors",
}

__all__ = [
    "Client",
    "Conflict",
    "Forbidden",
    "Job",
    "JobCancelled",
    "JobFailed",
    "JobNotFound",
    "JobProgress",
    "JobSpec",
    "ServerError",
    "ServerUnavailable",
    "SpecError",
    "Unauthorized",
    "UnbrokenError",
    "ValidationFailed",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'unbroken' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
