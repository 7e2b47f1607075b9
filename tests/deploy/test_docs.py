"""docs/deploy.md points at things that exist: files under deploy/, CLI commands, chart values."""

from __future__ import annotations

import re

import typer.main
import yaml

from api.cli import app
from tests.deploy.validation import REPO

DOC = (REPO / "docs" / "deploy.md").read_text(encoding="utf-8")


def test_files_named_exist() -> None:
    paths = set(re.findall(r"\b((?:deploy|docs|workers)/[\w./-]+\.(?:yaml|json|py|md)|deploy/Dockerfile(?:\.cpu)?)\b", DOC))
    assert len(paths) > 5, paths
    for path in paths:
        assert (REPO / path).exists(), path


def test_cli_commands_exist() -> None:
    commands = set(typer.main.get_command(app).commands)
    used = set(re.findall(r"^\s*(?:\S+\s+)?unbroken (\w[\w-]*)", DOC, re.M))
    used |= set(re.findall(r"`unbroken (\w[\w-]*)", DOC))
    assert used, "no commands found: the pattern is wrong"
    assert used <= commands, used - commands


def test_helm_set_flags_name_real_values() -> None:
    values = yaml.safe_load((REPO / "deploy" / "helm" / "unbroken" / "values.yaml").read_text(encoding="utf-8"))
    sets = re.findall(r"--set(?:-string)? (\S+)", DOC)
    assert sets
    for group in sets:
        for assignment in group.split(","):
            key = assignment.split("=", 1)[0]
            node = values
            for part in key.split("."):
                assert isinstance(node, dict) and part in node, f"--set {key}: no such value in values.yaml"
                node = node[part]
