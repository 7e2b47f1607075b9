"""A renderer for the small subset of Helm templates that deploy/helm/unbroken uses.

There is no `helm` binary on this machine (not on PyPI for Python 3.11, not in Debian), so the
tests render the chart themselves. This is honest only because the chart keeps to a subset whose
meaning is simple and is reproduced exactly here; anything outside it is refused with an error,
never guessed:

- actions `{{ X }}`, with Go's trim markers `{{- ` and ` -}}` (all whitespace, newlines included);
- `if X` / `else` / `end` (Go truthiness: false, 0, "", nil, empty map or list are false);
- X is a field path: `.Values.a.b`, `.Release.Name`, `.Release.Namespace`, `.Chart.Name`,
  `.Chart.Version`, `.Chart.AppVersion`; a missing key is nil (Helm's default);
- pipelines through `quote`, `toYaml`, `nindent N`, `indent N`, and `toYaml X` / `quote X` as calls.

Printing follows Go's fmt: Helm reads numbers in values as float64, so integers print plainly
below 1e6 and in Go's exponent form from there ("1e+06"); this renderer refuses those (quote them
in values) rather than imitate the exponent form. Values files merge as in Helm: maps deep-merge,
anything else is replaced.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class TemplateError(ValueError):
    pass


ACTION = re.compile(r"\{\{(-\s)?(.*?)(\s-)?\}\}", re.S)
NUMBER = re.compile(r"^[0-9]+$")


@dataclass
class Node:
    kind: str  # "text", "expr", "if"
    text: str = ""
    then: list[Node] = field(default_factory=list)
    orelse: list[Node] = field(default_factory=list)


def _tokens(src: str, name: str) -> list[tuple[str, str]]:
    """[("text", s) | ("action", s)] with trim markers applied to the neighbouring text."""
    out: list[tuple[str, str]] = []
    pos = 0
    trim_next = False
    for m in ACTION.finditer(src):
        text = src[pos:m.start()]
        if trim_next:
            text = text.lstrip(" \t\r\n")
        if m.group(1):
            text = text.rstrip(" \t\r\n")
        out.append(("text", text))
        body = m.group(2).strip()
        if body.startswith("/*") or "{{" in body:
            raise TemplateError(f"{name}: comments and nested actions are outside the supported subset: {body!r}")
        out.append(("action", body))
        trim_next = bool(m.group(3))
        pos = m.end()
    text = src[pos:]
    if trim_next:
        text = text.lstrip(" \t\r\n")
    out.append(("text", text))
    if "{{" in "".join(t for k, t in out if k == "text") or "}}" in "".join(t for k, t in out if k == "text"):
        raise TemplateError(f"{name}: an unterminated or malformed action")
    return out


def parse(src: str, name: str = "template") -> list[Node]:
    root: list[Node] = []
    stack: list[tuple[Node | None, list[Node]]] = [(None, root)]
    for kind, s in _tokens(src, name):
        body = stack[-1][1]
        if kind == "text":
            if s:
                body.append(Node("text", s))
            continue
        word = s.split()[0] if s else ""
        if word == "if":
            node = Node("if", s[2:].strip())
            body.append(node)
            stack.append((node, node.then))
        elif word == "else":
            top = stack[-1][0]
            if top is None or s != "else" or body is top.orelse:
                raise TemplateError(f"{name}: `{s}` is outside the supported subset or misplaced")
            stack[-1] = (top, top.orelse)
        elif word == "end":
            if len(stack) == 1:
                raise TemplateError(f"{name}: `end` without `if`")
            stack.pop()
        elif word in ("range", "with", "define", "template", "include", "block", "tpl", "else if"):
            raise TemplateError(f"{name}: `{word}` is outside the supported subset")
        else:
            body.append(Node("expr", s))
    if len(stack) != 1:
        raise TemplateError(f"{name}: `if` without `end`")
    return root


_MISSING = None


def _lookup(path: str, ctx: dict[str, Any]) -> Any:
    if not path.startswith("."):
        raise TemplateError(f"only field paths like .Values.x are supported, got {path!r}")
    parts = path[1:].split(".")
    if parts[0] not in ("Values", "Release", "Chart"):
        raise TemplateError(f"unsupported top-level field {parts[0]!r}")
    cur: Any = ctx
    for i, p in enumerate(parts):
        if cur is None:
            raise TemplateError(f"nil pointer evaluating {'.'.join(parts[:i])}.{p}")
        if not isinstance(cur, dict):
            raise TemplateError(f"{'.'.join(parts[:i])} is not a map")
        cur = cur.get(p, _MISSING)
    return cur


def _go_print(v: Any) -> str:
    if v is None:
        raise TemplateError("a nil value would print as empty (Helm); give it a value")
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        f = float(v)
        if f == int(f) and abs(f) < 1e6:
            return str(int(f))
        if f != int(f) and 1e-4 <= abs(f) < 1e6:
            return repr(f)
        raise TemplateError(f"{v!r} prints in Go's exponent form under Helm; quote it in the values")
    if isinstance(v, str):
        return v
    raise TemplateError(f"printing a {type(v).__name__} gives Go's map[...] form; use toYaml")


def _quote(s: str) -> str:
    if any(ord(c) < 0x20 or ord(c) > 0x7E for c in s):
        raise TemplateError(f"quote of {s!r}: only printable ASCII is supported (Go's %q escapes the rest)")
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _to_yaml(v: Any) -> str:
    return yaml.safe_dump(v, default_flow_style=False, sort_keys=True).rstrip("\n")


def _indent(n: int, s: str) -> str:
    pad = " " * n
    return pad + s.replace("\n", "\n" + pad)


def evaluate(expr: str, ctx: dict[str, Any]) -> Any:
    stages = [p.strip() for p in expr.split("|")]
    head = stages[0].split()
    value: Any
    if len(head) == 2 and head[0] == "toYaml":
        value = _to_yaml(_lookup(head[1], ctx))
    elif len(head) == 2 and head[0] == "quote":
        value = _quote(_go_print(_lookup(head[1], ctx)))
    elif len(head) == 1:
        value = _lookup(head[0], ctx)
    else:
        raise TemplateError(f"`{stages[0]}` is outside the supported subset")
    for stage in stages[1:]:
        fn, *args = stage.split()
        if fn == "quote" and not args:
            value = _quote(_go_print(value))
        elif fn == "toYaml" and not args:
            value = _to_yaml(value)
        elif fn in ("nindent", "indent") and len(args) == 1 and NUMBER.match(args[0]):
            s = _go_print(value)
            value = ("\n" if fn == "nindent" else "") + _indent(int(args[0]), s)
        else:
            raise TemplateError(f"`{stage}` is outside the supported subset")
    return value


def _truthy(v: Any) -> bool:
    return not (v is None or v is False or v == 0 or v == "" or v == [] or v == {})


def _render(nodes: list[Node], ctx: dict[str, Any]) -> str:
    out: list[str] = []
    for n in nodes:
        if n.kind == "text":
            out.append(n.text)
        elif n.kind == "expr":
            out.append(_go_print(evaluate(n.text, ctx)))
        else:
            out.append(_render(n.then if _truthy(evaluate(n.text, ctx)) else n.orelse, ctx))
    return "".join(out)


def merge_values(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in override.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge_values(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def render_chart(chart: Path, values_files: list[Path] | None = None, *, overrides: dict[str, Any] | None = None,
                 release: str = "unbroken", namespace: str = "default") -> dict[str, str]:
    """{template path: rendered text}, like `helm template RELEASE CHART -f ...` (hooks included)."""
    meta = yaml.safe_load((chart / "Chart.yaml").read_text(encoding="utf-8"))
    values = yaml.safe_load((chart / "values.yaml").read_text(encoding="utf-8")) or {}
    for f in values_files or []:
        values = merge_values(values, yaml.safe_load(f.read_text(encoding="utf-8")) or {})
    if overrides:
        values = merge_values(values, overrides)
    ctx = {
        "Values": values,
        "Release": {"Name": release, "Namespace": namespace},
        "Chart": {"Name": meta["name"], "Version": meta["version"], "AppVersion": meta.get("appVersion")},
    }
    out: dict[str, str] = {}
    for path in sorted((chart / "templates").rglob("*")):
        if not path.is_file() or path.name.startswith("_") or path.name == "NOTES.txt":
            continue
        rel = str(path.relative_to(chart))
        try:
            out[rel] = _render(parse(path.read_text(encoding="utf-8"), rel), ctx)
        except TemplateError as e:
            raise TemplateError(f"{rel}: {e}") from None
    return out


def chart_values(chart: Path, values_files: list[Path] | None = None,
                 overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    values = yaml.safe_load((chart / "values.yaml").read_text(encoding="utf-8")) or {}
    for f in values_files or []:
        values = merge_values(values, yaml.safe_load(f.read_text(encoding="utf-8")) or {})
    return merge_values(values, overrides or {})
