"""A job's statuses: the one list. The store keeps them, the supervisor's finer states map onto them
(service/state_machine.py), the API returns them and the SDK and CLI read them.

Plain Python (no torch, ray or pydantic) in a package whose __init__ imports nothing, so the SDK
(api.client, api.schemas) imports it without loading the server.
"""

from __future__ import annotations

from typing import Literal, get_args

JobStatus = Literal["PENDING", "RUNNING", "RECOVERING", "SUCCEEDED", "FAILED", "CANCELLED"]
STATUSES: tuple[str, ...] = get_args(JobStatus)
PENDING, RUNNING, RECOVERING, SUCCEEDED, FAILED, CANCELLED = STATUSES
TERMINAL: frozenset[str] = frozenset({SUCCEEDED, FAILED, CANCELLED})  # final: a late write never moves them
ACTIVE: frozenset[str] = frozenset({RUNNING, RECOVERING})  # holding a gang
