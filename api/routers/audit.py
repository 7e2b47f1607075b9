"""The audit log, for admins: every mutating request (who, from where, what, when, outcome)."""

from __future__ import annotations

from fastapi import APIRouter, Query
from pydantic import BaseModel

from api import schemas
from api.deps import AdminCaller, State

router = APIRouter(prefix="/v1", tags=["audit"])


class AuditEntryOut(BaseModel):
    id: int
    ts: float
    principal: str  # "-": the request was not authenticated
    client: str | None
    method: str
    path: str
    status: int


class AuditList(BaseModel):
    items: list[AuditEntryOut]
    next_after_id: int | None  # pass back as after_id for the next page; None on the last


@router.get("/audit", response_model=AuditList, summary="Mutating requests, oldest first",
            responses={401: {"model": schemas.ErrorBody, "description": "missing or invalid token"},
                       403: {"model": schemas.ErrorBody, "description": "the caller is not an admin"}})
def read_audit(
    _admin: AdminCaller, state: State,
    after_id: int = Query(0, ge=0, le=2**62, description="entries after this id"),
    limit: int = Query(100, ge=1, le=1000),
    principal: str | None = Query(None, max_length=128, description="only this principal's requests"),
) -> AuditList:
    recs = state.store.audit(after_id=after_id, limit=limit, principal=principal)
    items = [AuditEntryOut(**r.__dict__) for r in recs]
    return AuditList(items=items, next_after_id=items[-1].id if len(items) == limit else None)
