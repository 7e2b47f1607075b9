"""Alembic environment, run programmatically by service.store.migrate (no alembic.ini).

The caller passes an open connection in `config.attributes["connection"]`.
"""

from __future__ import annotations

from alembic import context

from service.models import Base

config = context.config
connection = config.attributes.get("connection")
if connection is None:
    raise RuntimeError("run migrations through service.store.migrate(url), which passes a connection")

context.configure(
    connection=connection,
    target_metadata=Base.metadata,
    render_as_batch=connection.dialect.name == "sqlite",  # SQLite alters tables by copying them
)
with context.begin_transaction():
    context.run_migrations()
