"""The job store's tables of the front door: API tokens (expiry, revocation, fair-share weight) and the
audit log of mutating requests."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import insert, or_, select, update

from service import auth
from service.models import AuditEntry, Token
from service.store_engine import retried


class TokenTables:
    """Tokens and the audit log; JobStore has them (it supplies `engine` and `api_write_retry_s`)."""

    engine: Any
    api_write_retry_s: float

    def create_token(self, principal: str, role: str = "user", label: str | None = None, *,
                     expires_in_s: float | None = None, created_by: str | None = None, weight: float = 1.0) -> str:
        """Make a new token for `principal`; returns the token text (only its hash is stored)."""
        return self.issue_token(principal, role, label, expires_in_s=expires_in_s, created_by=created_by,
                                weight=weight)[1]

    @retried("api_write_retry_s")
    def issue_token(self, principal: str, role: str = "user", label: str | None = None, *,
                    expires_in_s: float | None = None, created_by: str | None = None,
                    weight: float = 1.0) -> tuple[TokenRecord, str]:
        """A new token for `principal` valid for `expires_in_s` seconds (None: until revoked);
        returns (its record, its text). The text is shown once: only its hash is stored. `weight`: the
        owner's fair share of spare capacity (auth.check_weight)."""
        auth.check_weight(weight)
        if role not in auth.ROLES:
            raise ValueError(f"role {role!r} must be one of {auth.ROLES}")
        if not principal or len(principal) > 128:
            raise ValueError("principal must be 1 to 128 characters")
        if expires_in_s is not None and not (0 < expires_in_s <= auth.MAX_TOKEN_LIFETIME_S):
            raise ValueError(f"expires_in_s={expires_in_s} must be above 0 and at most "
                             f"{auth.MAX_TOKEN_LIFETIME_S:.0f} (10 years); leave it out for a token that never expires")
        token = auth.new_token()
        now = time.time()
        with self.engine.begin() as conn:
            res = conn.execute(insert(Token).values(
                token_hash=auth.hash_token(token), principal=principal, role=role,
                label=None if label is None else label[:128], created_at=now,
                expires_at=None if expires_in_s is None else now + expires_in_s, created_by=created_by,
                weight=float(weight),
            ))
            token_id = int(res.inserted_primary_key[0])
        rec = self.get_token(token_id)
        assert rec is not None
        return rec, token

    def principal_for_token(self, token: str) -> auth.Principal | None:
        """Whom a token speaks for; None when it is unknown, revoked or expired."""
        with self.engine.connect() as conn:
            row = conn.execute(
                select(Token.principal, Token.role).where(
                    Token.token_hash == auth.hash_token(token), Token.revoked_at.is_(None),
                    or_(Token.expires_at.is_(None), Token.expires_at > time.time()))
            ).first()
        return None if row is None else auth.Principal(row[0], row[1])

    def get_token(self, token_id: int) -> TokenRecord | None:
        with self.engine.connect() as conn:
            row = conn.execute(select(*_TOKEN_COLS).where(Token.id == token_id)).first()
        return None if row is None else TokenRecord(*row)

    def list_tokens(self, *, principal: str | None = None, include_revoked: bool = False) -> list[TokenRecord]:
        """Tokens (never their text nor hash), oldest first."""
        q = select(*_TOKEN_COLS).order_by(Token.id)
        if principal is not None:
            q = q.where(Token.principal == principal)
        if not include_revoked:
            q = q.where(Token.revoked_at.is_(None))
        with self.engine.connect() as conn:
            return [TokenRecord(*r) for r in conn.execute(q).all()]

    @retried("api_write_retry_s")
    def revoke_token(self, token_id: int) -> bool:
        """Revoke one token at once (its sessions end too); False if no such token or revoked already."""
        with self.engine.begin() as conn:
            res = conn.execute(update(Token).where(Token.id == token_id, Token.revoked_at.is_(None))
                               .values(revoked_at=time.time()))
            return bool(res.rowcount)

    @retried("api_write_retry_s")
    def revoke_tokens(self, principal: str) -> int:
        """Revoke every token of `principal`; returns how many."""
        with self.engine.begin() as conn:
            return int(conn.execute(update(Token).where(Token.principal == principal, Token.revoked_at.is_(None))
                                    .values(revoked_at=time.time())).rowcount)

    # ---- the audit log -------------------------------------------------------------------------

    @retried("api_write_retry_s")
    def add_audit(self, principal: str, client: str | None, method: str, path: str, status: int) -> None:
        with self.engine.begin() as conn:
            conn.execute(insert(AuditEntry).values(ts=time.time(), principal=principal[:128],
                                                   client=None if client is None else client[:64],
                                                   method=method[:16], path=path[:512], status=int(status)))

    def audit(self, *, after_id: int = 0, limit: int = 100, principal: str | None = None) -> list[AuditRecord]:
        """Audit entries after `after_id`, oldest first."""
        q = select(*_AUDIT_COLS).where(AuditEntry.id > after_id).order_by(AuditEntry.id).limit(limit)
        if principal is not None:
            q = q.where(AuditEntry.principal == principal)
        with self.engine.connect() as conn:
            return [AuditRecord(*r) for r in conn.execute(q).all()]


@dataclass(frozen=True)
class TokenRecord:
    id: int
    principal: str
    role: str
    label: str | None
    created_at: float
    expires_at: float | None
    revoked_at: float | None
    created_by: str | None
    weight: float = 1.0


_TOKEN_COLS = [Token.id, Token.principal, Token.role, Token.label, Token.created_at, Token.expires_at,
               Token.revoked_at, Token.created_by, Token.weight]


@dataclass(frozen=True)
class AuditRecord:
    id: int
    ts: float
    principal: str
    client: str | None
    method: str
    path: str
    status: int


_AUDIT_COLS = [AuditEntry.id, AuditEntry.ts, AuditEntry.principal, AuditEntry.client, AuditEntry.method,
               AuditEntry.path, AuditEntry.status]
