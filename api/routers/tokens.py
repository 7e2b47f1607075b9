"""Admins manage API tokens: create (shown once), list (never the text), revoke (at once, with the
console sessions logged in with it)."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Path, Query
from pydantic import BaseModel, ConfigDict, Field

from api import schemas
from api.deps import AdminCaller, ApiError, State
from service.auth import MAX_TOKEN_LIFETIME_S, MAX_WEIGHT
from service.store import TokenRecord

router = APIRouter(prefix="/v1", tags=["tokens"])
ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": schemas.ErrorBody, "description": "missing or invalid token"},
    403: {"model": schemas.ErrorBody, "description": "the caller is not an admin"},
    422: {"model": schemas.ErrorBody, "description": "invalid input; `fields` names each bad field"},
}


class TokenCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    principal: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.@+-]+$",
                           description="whom the token speaks for (a job's owner)")
    role: Literal["user", "admin"] = "user"
    label: str | None = Field(default=None, max_length=128)
    expires_in_s: float | None = Field(default=None, gt=0, le=MAX_TOKEN_LIFETIME_S,
                                       description="lifetime in seconds; leave out for a token that never expires")
    weight: float = Field(default=1.0, gt=0, le=MAX_WEIGHT,
                          description="the owner's fair share of spare capacity (an owner's weight is the largest "
                                      "of its valid tokens'; 2 gets twice the share of 1)")


class TokenOut(BaseModel):
    id: int
    principal: str
    role: str
    label: str | None
    created_at: float
    expires_at: float | None
    revoked_at: float | None
    created_by: str | None
    weight: float = 1.0


class TokenCreated(TokenOut):
    token: str = Field(description="the token's text: shown only now, only its hash is stored")


class TokenList(BaseModel):
    items: list[TokenOut]


def token_out(rec: TokenRecord) -> TokenOut:
    return TokenOut(id=rec.id, principal=rec.principal, role=rec.role, label=rec.label, created_at=rec.created_at,
                    expires_at=rec.expires_at, revoked_at=rec.revoked_at, created_by=rec.created_by,
                    weight=rec.weight)


@router.post("/tokens", status_code=201, response_model=TokenCreated, responses=ERRORS, summary="Create a token")
def create_token(body: TokenCreate, admin: AdminCaller, state: State) -> TokenCreated:
    rec, text = state.store.issue_token(body.principal, body.role, body.label, expires_in_s=body.expires_in_s,
                                        created_by=admin.name, weight=body.weight)
    return TokenCreated(**token_out(rec).model_dump(), token=text)


@router.get("/tokens", response_model=TokenList, responses=ERRORS, summary="List tokens (never their text)")
def list_tokens(
    _admin: AdminCaller, state: State,
    principal: str | None = Query(None, max_length=128, description="only this principal's tokens"),
    include_revoked: bool = Query(False, description="also revoked tokens"),
) -> TokenList:
    recs = state.store.list_tokens(principal=principal, include_revoked=include_revoked)
    return TokenList(items=[token_out(r) for r in recs])


@router.delete("/tokens/{token_id}", response_model=TokenOut,
               responses={**ERRORS, 404: {"model": schemas.ErrorBody, "description": "no such unrevoked token"}},
               summary="Revoke a token at once")
def revoke_token(_admin: AdminCaller, state: State, token_id: int = Path(ge=1, le=2**62)) -> TokenOut:
    if not state.store.revoke_token(token_id):
        raise ApiError(404, "not_found", f"no unrevoked token with id {token_id}; list them with GET /v1/tokens")
    rec = state.store.get_token(token_id)
    assert rec is not None
    return token_out(rec)
