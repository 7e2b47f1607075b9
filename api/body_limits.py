"""Structure limits of a request body, checked before it is parsed: nesting depth, YAML aliases and
the size a YAML document would expand to. A YAML bomb (aliases of aliases) is refused from its event
stream, which never expands it, so the refusal costs time linear in the body's bytes."""

from __future__ import annotations

from dataclasses import dataclass

import yaml

MAX_DEPTH = 32
MAX_YAML_ALIASES = 100
MAX_YAML_NODES = 100_000


@dataclass(frozen=True)
class LimitExceeded:
    status: int  # 413: too large when expanded; 422: too deep or too many aliases
    limit: str
    message: str


def _too_deep(depth: int) -> LimitExceeded:
    return LimitExceeded(422, "depth", f"the request body nests deeper than {MAX_DEPTH} levels; a job spec "
                                       f"needs far fewer: flatten it")


def check_json(body: bytes) -> LimitExceeded | None:
    """Nesting depth of a JSON body (brackets outside strings), without parsing it."""
    if body.count(b"[") + body.count(b"{") <= MAX_DEPTH:
        return None
    depth = 0
    in_str = escaped = False
    for b in body:
        if in_str:
            if escaped:
                escaped = False
            elif b == 0x5C:  # backslash
                escaped = True
            elif b == 0x22:
                in_str = False
        elif b == 0x22:
            in_str = True
        elif b in (0x5B, 0x7B):
            depth += 1
            if depth > MAX_DEPTH:
                return _too_deep(depth)
        elif b in (0x5D, 0x7D):
            depth -= 1
    return None


def check_yaml(body: bytes) -> LimitExceeded | None:
    """Depth, alias count and expanded node count of a YAML body, from its events (no expansion).
    A body that is not YAML passes: the parser behind refuses it with its own message."""
    sizes: dict[str, int] = {}  # anchor -> nodes its value expands to
    stack: list[list] = [[0, None]]  # [nodes so far, anchor] per open collection
    aliases = 0
    try:
        for ev in yaml.parse(body, Loader=yaml.SafeLoader):
            if isinstance(ev, yaml.AliasEvent):
                aliases += 1
                if aliases > MAX_YAML_ALIASES:
                    return LimitExceeded(422, "aliases", f"the YAML body uses more than {MAX_YAML_ALIASES} "
                                                         "aliases (*name); write the values out")
                stack[-1][0] += sizes.get(ev.anchor, 1)
            elif isinstance(ev, yaml.ScalarEvent):
                stack[-1][0] += 1
                if ev.anchor:
                    sizes[ev.anchor] = 1
            elif isinstance(ev, yaml.CollectionStartEvent):
                stack.append([1, ev.anchor])
                if len(stack) - 1 > MAX_DEPTH:
                    return _too_deep(len(stack) - 1)
            elif isinstance(ev, yaml.CollectionEndEvent):
                n, anchor = stack.pop()
                if anchor:
                    sizes[anchor] = n
                stack[-1][0] += n
            else:
                continue
            if stack[-1][0] > MAX_YAML_NODES or any(s[0] > MAX_YAML_NODES for s in stack):
                return LimitExceeded(413, "expanded_size", f"the YAML body expands to more than {MAX_YAML_NODES} "
                                                           "values (aliases counted as copies); send a smaller spec")
    except yaml.YAMLError:
        return None
    return None
