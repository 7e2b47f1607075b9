"""The web console's files: page templates and static assets (served by api.routers.ui), and its
session store (sessions.py). Vendored third-party files live under static/vendor/, each with
its licence."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
STATIC_DIR = HERE / "static"
TEMPLATES_DIR = HERE / "templates"
