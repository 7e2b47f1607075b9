"""Bearer tokens: how they are made, stored (hashed) and found, and the local token file.

A token is 32 random bytes (url-safe text); the store keeps only its SHA-256, so a leaked
database does not leak credentials. Each token maps to a principal and a role: `user` sees
and touches only its own jobs, `admin` sees all.

The local token file ($UNBROKEN_HOME/token, default ~/.unbroken/token, mode 0600) holds
{"url": ..., "token": ...}; `unbroken serve` writes it and the SDK and CLI read it by default.
This module imports neither torch nor ray nor sqlalchemy: the SDK uses the file helpers.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Role = Literal["user", "admin"]
ROLES: tuple[str, ...] = ("user", "admin")
TOKEN_PREFIX = "ubk_"
MAX_TOKEN_LIFETIME_S = 10 * 365 * 86400.0
MAX_WEIGHT = 1000.0  # fair-share weights: an owner's share of spare capacity is weight / sum of weights


def check_weight(weight: float) -> None:
    """ValueError naming the field and the range unless 0 < weight <= MAX_WEIGHT."""
    if not isinstance(weight, int | float) or not 0 < float(weight) <= MAX_WEIGHT:
        raise ValueError(f"weight={weight!r} must be above 0 and at most {MAX_WEIGHT:g} (1 is the default share; "
                         "2 gets twice the spare capacity of an owner with 1)")


@dataclass(frozen=True)
class Principal:
    name: str
    role: Role

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"

    def can_see(self, owner: str) -> bool:
        return self.is_admin or owner == self.name


def new_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def unbroken_home() -> Path:
    return Path(os.environ.get("UNBROKEN_HOME") or Path.home() / ".unbroken")


def token_file_path() -> Path:
    return unbroken_home() / "token"


def write_token_file(url: str, token: str, path: Path | None = None) -> Path:
    """Write {"url", "token"} readable by this user only (0600 from creation, no window)."""
    p = path or token_file_path()
    p.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = p.with_name(p.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump({"url": url, "token": token}, f)
    os.chmod(tmp, 0o600)
    os.replace(tmp, p)
    return p


def read_token_file(path: Path | None = None) -> dict[str, str] | None:
    """The local server's {"url", "token"}, or None when there is no (readable, valid) file."""
    p = path or token_file_path()
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("token"), str):
        return None
    return {"url": str(data.get("url") or ""), "token": data["token"]}
