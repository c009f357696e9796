"""Bounds on a request's output constraint, checked before it reaches llguidance (native code).

llguidance compiles grammars recursively on the calling thread's stack: a JSON schema whose `$ref`s nest
a thousand levels deep, or a Lark grammar of a few thousand chained rules, overflows the stack and kills
the process (issue 36, N1). Other inputs compile but fail later, mid-generation, past its row and lexer
limits (a `choice` written as rule alternatives, a regex `a{1000000}`). These bounds refuse such inputs
with a ValueError naming the limit, generously above real use and, for depth, well inside the stack
(measured on an 8 MiB stack: 1,500 chained Lark rules and ~1,200 schema levels compile, 3,000 and ~4,000
overflow; schemas and grammars at these bounds compile on a 1 MiB thread stack). Every walk here is
linear in the input and its recursion is bounded by the limits.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GrammarLimits:
    max_chars: int = 4_000_000  # the schema (as JSON), regex, grammar text or choices, in characters
    max_choices: int = 100_000  # options of a `choice`
    max_depth: int = 256  # schema: nested objects/arrays plus `$ref` hops; Lark: rule references plus groups
    max_refs: int = 64  # `$ref`s resolved along one path of a schema (a recursive schema's cycle ends it)
    max_width: int = 1_000  # entries of one `properties`, `enum`, `anyOf`/`oneOf`/`allOf`, `prefixItems`
    max_rules: int = 2_000  # Lark rules and terminals
    max_alternatives: int = 1_000  # `|` branches of one Lark rule
    max_repeat: int = 10_000  # a regex `{n,m}` or Lark `~ n..m` bound; nested bounds multiply


DEFAULT_LIMITS = GrammarLimits()

_WIDE = ("properties", "patternProperties", "enum", "anyOf", "oneOf", "allOf", "prefixItems", "required")


def check_bounds(kind: str, spec: str, limits: GrammarLimits = DEFAULT_LIMITS) -> None:
    """Raises ValueError naming the first limit `spec` (of StructuredOutput kind `kind`) exceeds."""
    if len(spec) > limits.max_chars:
        raise ValueError(f"{len(spec)} characters, at most {limits.max_chars} are allowed")
    if kind == "json":
        schema_bounds(json.loads(spec), limits)
    elif kind == "regex":
        regex_bounds(spec, limits)
    elif kind == "choice":
        n = len(json.loads(spec))
        if n > limits.max_choices:
            raise ValueError(f"{n} choices, at most {limits.max_choices} are allowed")
    elif kind == "grammar":
        lark_bounds(spec, limits)


# ---- JSON schema ------------------------------------------------------------------------------


def _resolve(root: Any, ref: str) -> Any:
    """The node a local `$ref` ("#/$defs/X", "#") points at; None when it is not local or not there."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/")[1:] if ref != "#" else ():
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


class _SchemaWalk:
    """Height (levels below, `$ref`s resolved) of every container, each computed once (a DAG of refs is not
    expanded); a `$ref` back into the current path is a recursive schema, which llguidance compiles lazily."""

    def __init__(self, root: Any, limits: GrammarLimits) -> None:
        self.root, self.limits = root, limits
        self.height: dict[int, tuple[int, int]] = {}  # id(node) -> (depth below, refs below)
        self.on_path: set[int] = set()

    def visit(self, node: Any, depth: int, refs: int) -> tuple[int, int]:
        lim = self.limits
        if depth > lim.max_depth:
            raise ValueError(f"nested deeper than {lim.max_depth} levels (objects, arrays and $ref resolution)")
        if refs > lim.max_refs:
            raise ValueError(f"more than {lim.max_refs} $ref resolutions along one path")
        if not isinstance(node, (dict, list)) or id(node) in self.on_path:
            return 0, 0
        known = self.height.get(id(node))
        if known is not None:
            self.visit(None, depth + known[0], refs + known[1])  # raises if this path is too deep
            return known
        self.on_path.add(id(node))
        best = (0, 0)
        for key, child, hop in self._children(node):
            if key in _WIDE and isinstance(child, (dict, list)) and len(child) > lim.max_width:
                raise ValueError(f"`{key}` has {len(child)} entries, at most {lim.max_width} are allowed")
            if key == "pattern" and isinstance(child, str):
                regex_bounds(child, lim)
            d, r = self.visit(child, depth + 1, refs + hop)
            best = max(best[0], d + 1), max(best[1], r + hop)
        self.on_path.discard(id(node))
        self.height[id(node)] = best
        return best

    def _children(self, node: dict | list) -> list[tuple[str | None, Any, int]]:
        if isinstance(node, list):
            return [(None, v, 0) for v in node]
        out: list[tuple[str | None, Any, int]] = [(k, v, 0) for k, v in node.items()]
        ref = node.get("$ref")
        if isinstance(ref, str):
            out.append(("$ref", _resolve(self.root, ref), 1))
        return out


def schema_bounds(schema: Any, limits: GrammarLimits = DEFAULT_LIMITS) -> None:
    _SchemaWalk(schema, limits).visit(schema, 0, 0)


# ---- regex ------------------------------------------------------------------------------------

_QUANT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


def regex_bounds(regex: str, limits: GrammarLimits = DEFAULT_LIMITS) -> None:
    """Repetition bounds: each `{n}`/`{n,m}` and, for nested groups, their product."""
    stack = [1]  # the largest repetition product inside each open group
    last = 1  # the product of the atom just closed (a group's) or 1, which a quantifier multiplies
    i, n = 0, len(regex)
    while i < n:
        c = regex[i]
        if c == "\\":
            i, last = i + 2, 1
            continue
        if c == "[":  # a class: skip to its closing bracket (a leading ] or escaped ] is a member)
            j = i + 2 if regex.startswith("[]", i) or regex.startswith("[^]", i) else i + 1
            while j < n and regex[j] != "]":
                j += 2 if regex[j] == "\\" else 1
            i, last = j + 1, 1
            continue
        if c == "(":
            stack.append(1)
        elif c == ")" and len(stack) > 1:
            last = stack.pop()
            stack[-1] = max(stack[-1], last)
            i += 1
            continue
        elif c == "{":
            m = _QUANT.match(regex, i)
            if m is not None:
                bound = max(int(m.group(1)), int(m.group(2) or 0))
                _repeat(bound, last * bound, limits)
                stack[-1] = max(stack[-1], last * bound)
                i, last = m.end(), 1
                continue
        i, last = i + 1, 1


def _repeat(bound: int, product: int, limits: GrammarLimits) -> None:
    if bound > limits.max_repeat:
        raise ValueError(f"repetition bound {bound} exceeds {limits.max_repeat}")
    if product > limits.max_repeat:
        raise ValueError(f"nested repetitions multiply to {product}, more than {limits.max_repeat}")


# ---- Lark -------------------------------------------------------------------------------------

_LARK = re.compile(r"""
    (?P<comment>//[^\n]*)
  | (?P<string>"(?:[^"\\\n]|\\.)*"i?)
  | (?P<regex>/(?:[^/\\\n]|\\.)+/[imslux]*)
  | (?P<json>%json\b)
  | (?P<define>^[ \t]*[?!]?(?P<rule>[A-Za-z_]\w*)(?:\.-?\d+)?[ \t]*:)
  | (?P<name>[A-Za-z_]\w*)
  | (?P<repeat>~\s*(?P<lo>\d+)(?:\s*\.\.\s*(?P<hi>\d+))?)
  | (?P<open>[(\[])
  | (?P<close>[)\]])
  | (?P<bar>\|)
  | (?P<other>.|\n)
""", re.M | re.X)


@dataclass
class _Rule:
    refs: list[tuple[str, int]]  # (rule referenced, group depth there)
    groups: int = 0  # the deepest group nesting in its body
    branches: int = 1


def _lark_rules(text: str, limits: GrammarLimits) -> dict[str, _Rule]:
    """Each rule's references, groups and branches; checks regex literals, `~` bounds and embedded %json."""
    rules: dict[str, _Rule] = {}
    rule, depth, pos = _Rule([]), 0, 0  # text before the first definition belongs to no rule
    while pos < len(text):
        m = _LARK.match(text, pos)
        assert m is not None  # `other` matches any character
        pos, kind = m.end(), m.lastgroup
        if kind == "define":
            name = m.group("rule")
            rule, depth = rules.setdefault(name, _Rule([])), 0
            if len(rules) > limits.max_rules:
                raise ValueError(f"more than {limits.max_rules} rules and terminals")
        elif kind == "name":
            rule.refs.append((m.group("name"), depth))
        elif kind == "regex":
            regex_bounds(m.group("regex")[1:m.group("regex").rindex("/")], limits)
        elif kind == "repeat":
            _repeat(max(int(m.group("lo")), int(m.group("hi") or 0)), 1, limits)
        elif kind == "open":
            depth += 1
            rule.groups = max(rule.groups, depth)
        elif kind == "close":
            depth = max(depth - 1, 0)
        elif kind == "bar":
            rule.branches += 1
            if rule.branches > limits.max_alternatives:
                raise ValueError(f"a rule with more than {limits.max_alternatives} alternatives")
        elif kind == "json":
            start = text.find("{", pos)
            if start >= 0:
                try:
                    schema, pos = json.JSONDecoder().raw_decode(text, start)
                except json.JSONDecodeError:
                    continue  # llguidance reports it
                schema_bounds(schema, limits)
    return rules


def lark_bounds(text: str, limits: GrammarLimits = DEFAULT_LIMITS) -> None:
    """Rule count, alternatives per rule, repetition bounds, and depth: the longest chain of rule references,
    each weighing one plus the groups it sits in (recursion ends a chain)."""
    rules = _lark_rules(text, limits)
    height: dict[str, int] = {}
    on_path: set[str] = set()

    def visit(name: str, depth: int) -> int:
        if depth > limits.max_depth:
            raise ValueError(f"rules nest deeper than {limits.max_depth} levels (rule references and groups)")
        rule = rules.get(name)
        if rule is None or name in on_path:
            return 0
        if name in height:
            visit("", depth + height[name])  # raises if this path is too deep
            return height[name]
        on_path.add(name)
        best = rule.groups
        for ref, groups in rule.refs:
            best = max(best, 1 + groups + visit(ref, depth + 1 + groups))
        on_path.discard(name)
        height[name] = best
        return best

    for name in rules:
        visit(name, 0)
