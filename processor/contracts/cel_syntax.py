"""What a rule's CEL text says, read once when its contract loads: the names it uses and
where each is bound, and the parts of its variables it can read.

The engine compiles a rule but keeps its syntax tree to itself: ``Program.variables()``
lists every identifier, a comprehension's variable included, with nothing to tell where
it is used. So the text is parsed again here, with the grammar of the CEL specification
(the engine refuses the optional syntax ``.?`` / ``[?``, and message construction only
compiles to fail at run time: both are refused as ``Unanalysable``). Only expressions the
engine has compiled are parsed, so a parse that fails means this grammar and the
engine's disagree, and the caller treats the rule as one it cannot trust.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NoReturn

Path = tuple[str, ...]
"""A variable and the fields selected from it: ``args.items`` is ``("args", "items")``."""

MACROS = {
    "all": (2,), "exists": (2,), "exists_one": (2,), "existsOne": (2,), "filter": (2,),
    "map": (2, 3),
}  # fmt: skip
"""The comprehension macros and their argument counts: ``range.all(x, body)`` binds ``x`` in
``body`` (and ``range.map(x, filter, body)`` in both). With another count the engine reads
the call as an ordinary method, and ``x`` as a variable of the context."""


class Unanalysable(ValueError):
    """The expression uses syntax this parser does not read."""


@dataclass(frozen=True, slots=True)
class Ident:
    name: str


@dataclass(frozen=True, slots=True)
class Select:
    operand: Node
    field: str


@dataclass(frozen=True, slots=True)
class Index:
    operand: Node
    key: Node


@dataclass(frozen=True, slots=True)
class Literal:
    text: str | None
    """The value of a string literal without escapes (what a key can be matched against);
    None for any other literal."""


@dataclass(frozen=True, slots=True)
class Call:
    """A function, global or called on ``target``, or an operator, a list or a map (their
    order does not matter here)."""

    function: str
    target: Node | None
    args: tuple[Node, ...]


@dataclass(frozen=True, slots=True)
class Comprehension:
    macro: str
    range: Node
    variable: str
    body: tuple[Node, ...]


Node = Ident | Select | Index | Literal | Call | Comprehension

_TOKEN = re.compile(
    r"""
    (?P<space>[\t\n\f\r\ ]+|//[^\n]*)
  | (?P<raw>(?:[bB][rR]|[rR][bB]?)(?:\"\"\"[\s\S]*?\"\"\"|'''[\s\S]*?'''|"[^"\n\r]*"|'[^'\n\r]*'))
  | (?P<string>[bB]?(?:\"\"\"(?:\\[\s\S]|[^\\])*?\"\"\"|'''(?:\\[\s\S]|[^\\])*?'''
                   |"(?:\\.|[^"\\\n\r])*"|'(?:\\.|[^'\\\n\r])*'))
  | (?P<number>0[xX][0-9a-fA-F]+[uU]?|[0-9]*\.[0-9]+(?:[eE][+-]?[0-9]+)?
               |[0-9]+[eE][+-]?[0-9]+|[0-9]+[uU]?)
  | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<punct>==|!=|<=|>=|&&|\|\||[-+*/%!<>?:.,()\[\]{}])
    """,
    re.VERBOSE,
)

_PRECEDENCE = {
    "||": 1, "&&": 2, "==": 3, "!=": 3, "<": 3, "<=": 3, ">": 3, ">=": 3, "in": 3,
    "+": 4, "-": 4, "*": 5, "/": 5, "%": 5,
}  # fmt: skip
"""The binary operators, the tighter binding the higher."""


def _string_value(kind: str, text: str) -> str | None:
    """A string literal's value where reading it needs no escape processing, else None."""
    prefix = len(text) - len(text.lstrip("rRbB"))
    if "b" in text[:prefix].lower() or text[prefix : prefix + 3] in ('"""', "'''"):
        return None
    inner = text[prefix + 1 : -1]
    return inner if kind == "raw" or "\\" not in inner else None


class _Parser:
    def __init__(self, expression: str) -> None:
        self.tokens: list[tuple[str, str, int]] = []
        at = 0
        while at < len(expression):
            m = _TOKEN.match(expression, at)
            if m is None:
                raise Unanalysable(f"unexpected {expression[at]!r} at {at}")
            kind = m.lastgroup
            assert kind is not None
            if kind != "space":
                self.tokens.append((kind, m.group(), at))
            at = m.end()
        self.i = 0

    def peek(self) -> str:
        return self.tokens[self.i][1] if self.i < len(self.tokens) else ""

    def take(self, text: str) -> bool:
        if self.peek() == text:
            self.i += 1
            return True
        return False

    def expect(self, text: str) -> None:
        if not self.take(text):
            self.fail(f"expected {text!r}")

    def fail(self, what: str) -> NoReturn:
        if self.i < len(self.tokens):
            _, text, at = self.tokens[self.i]
            raise Unanalysable(f"{what}, found {text!r} at {at}")
        raise Unanalysable(f"{what} at the end")

    def name(self) -> str:
        if self.i < len(self.tokens) and self.tokens[self.i][0] == "name":
            self.i += 1
            return self.tokens[self.i - 1][1]
        self.fail("expected a name")

    def parse(self) -> Node:
        node = self.expr()
        if self.i != len(self.tokens):
            self.fail("expected the end")
        return node

    def expr(self) -> Node:
        node = self.binary(1)
        if self.take("?"):
            then = self.binary(1)
            self.expect(":")
            node = Call("_?_:_", None, (node, then, self.expr()))
        return node

    def binary(self, floor: int) -> Node:
        """Operators binding at least as tightly as ``floor``, left to right: a chain of
        ``&&`` is a loop here, not a recursion."""
        node = self.unary()
        while (precedence := _PRECEDENCE.get(self.peek(), 0)) >= floor:
            op = self.peek()
            self.i += 1
            node = Call(op, None, (node, self.binary(precedence + 1)))
        return node

    def unary(self) -> Node:
        ops = 0
        while self.take("!") or self.take("-"):
            ops += 1
        node = self.member()
        for _ in range(ops):
            node = Call("unary", None, (node,))
        return node

    def member(self) -> Node:
        node = self.primary()
        while True:
            if self.take("."):
                field = self.name()
                if self.take("("):
                    node = _call(field, node, self.arguments(")"))
                else:
                    node = Select(node, field)
            elif self.take("["):
                node = Index(node, self.expr())
                self.expect("]")
            else:
                return node

    def primary(self) -> Node:
        if self.i >= len(self.tokens):
            self.fail("expected a value")
        kind, text, _ = self.tokens[self.i]
        if kind in ("string", "raw"):
            self.i += 1
            return Literal(_string_value(kind, text))
        if kind == "number" or text in ("true", "false", "null"):
            self.i += 1
            return Literal(None)
        if self.take("("):
            node = self.expr()
            self.expect(")")
            return node
        if self.take("["):
            return Call("list", None, self.arguments("]"))
        if self.take("{"):
            entries: list[Node] = []
            while not self.take("}"):
                entries.append(self.expr())
                self.expect(":")
                entries.append(self.expr())
                if not self.take(","):
                    self.expect("}")
                    break
            return Call("map", None, tuple(entries))
        name = ("." if self.take(".") else "") + self.name()
        if self.take("("):
            return Call(name, None, self.arguments(")"))
        if self.peek() == "{":
            self.fail("message construction is not supported")
        return Ident(name)

    def arguments(self, close: str) -> tuple[Node, ...]:
        """Expressions separated by commas up to ``close`` (a trailing comma allowed)."""
        out: list[Node] = []
        while not self.take(close):
            out.append(self.expr())
            if not self.take(","):
                self.expect(close)
                break
        return tuple(out)


def _call(function: str, target: Node, args: tuple[Node, ...]) -> Node:
    if len(args) in MACROS.get(function, ()) and isinstance(args[0], Ident):
        variable = args[0].name
        if not variable.startswith("."):
            return Comprehension(function, target, variable, args[1:])
    return Call(function, target, args)


def parse(expression: str) -> Node:
    """The syntax tree of a CEL expression; ``Unanalysable`` when it cannot be read."""
    try:
        return _Parser(expression).parse()
    except RecursionError:
        raise Unanalysable("nested too deeply to analyse") from None


def _children(node: Node) -> tuple[Node, ...]:
    if isinstance(node, Select):
        return (node.operand,)
    if isinstance(node, Index):
        return (node.operand, node.key)
    if isinstance(node, Call):
        return node.args if node.target is None else (node.target, *node.args)
    if isinstance(node, Comprehension):
        return (node.range, *node.body)
    return ()


@dataclass(frozen=True, slots=True)
class Names:
    free: frozenset[str]
    """The identifiers used where no macro binds them: variables of the context or names
    the engine resolves itself (``int``), or else names it does not know."""
    bindings: tuple[tuple[str, frozenset[str]], ...]
    """Each macro's variable, with the variables of the macros around it."""


def names(tree: Node) -> Names:
    free: set[str] = set()
    bindings: list[tuple[str, frozenset[str]]] = []
    stack: list[tuple[Node, frozenset[str]]] = [(tree, frozenset())]
    while stack:
        node, bound = stack.pop()
        if isinstance(node, Ident):
            if node.name not in bound:
                free.add(node.name)
        elif isinstance(node, Comprehension):
            bindings.append((node.variable, bound))
            stack.append((node.range, bound))
            stack.extend((b, bound | {node.variable}) for b in node.body)
        else:
            stack.extend((child, bound) for child in _children(node))
    return Names(frozenset(free), tuple(bindings))


def reads(tree: Node, variables: frozenset[str]) -> tuple[Path, ...]:
    """The paths under ``variables`` the expression can read; a value is read whole.

    A path goes as far as fields are selected by name (``args.a.b``, ``args["a-b"]``); what
    is then done with the value, a size, a comprehension over it, a dynamic index into it,
    passing it to a function, may read all of it. A variable itself, used any other way
    (``size(args)``, ``dyn(args)``), is read whole. A name in ``variables`` is taken for
    that variable even inside a macro whose variable has the same name: the registry
    refuses such a rule anyway, and counting more as read than is read is the safe side."""
    out: set[Path] = set()
    stack = [tree]
    while stack:
        node = stack.pop()
        path = _path(node, variables)
        if path is not None:
            out.add(path)
        else:
            stack.extend(_children(node))
    return tuple(sorted(out))


def _path(node: Node, variables: frozenset[str]) -> Path | None:
    steps: list[str] = []
    while True:
        if isinstance(node, Select):
            steps.append(node.field)
            node = node.operand
        elif (
            isinstance(node, Index) and isinstance(node.key, Literal) and node.key.text is not None
        ):
            steps.append(node.key.text)
            node = node.operand
        elif isinstance(node, Ident) and node.name in variables:
            return (node.name, *reversed(steps))
        else:
            return None
