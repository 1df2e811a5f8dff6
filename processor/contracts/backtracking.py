"""Exponential backtracking in ECMA-262 patterns, decided before a contract loads.

The processor runs a contract's ``pattern`` and ``patternProperties`` regexes with
``regress``, a backtracking engine with no step limit, on arguments a model wrote. A
pattern with *exponential degree of ambiguity* (EDA) has a loop that can read the same
text in two different ways, so a run of that text can be read in 2^n ways, and a text
that almost matches makes the engine try every one of them: ``^(\\w+\\s?)*$`` spends
seconds on 24 characters, and the partition behind the call waits.

The decision is the standard one (Weber and Seidl; Weideman et al. for backtracking
matchers). The pattern becomes a position (Glushkov) automaton over character sets
whose transitions carry *how many* ways the regex reaches them (capped at 2): ``(a*)*``
has one position with two ``a`` loops, the inner and the outer star, which a set of
follow positions would merge. The automaton has EDA when some state q has two different
paths back to itself reading the same word: in the product automaton A x A, a cycle
through (q, q) that passes a pair (p, p') with p != p', or takes a doubled transition.
Only pairs inside one strongly connected component of A can be on such a cycle, so a
pattern without loops is settled without building the product.

What the engine does, the automaton mirrors: an iteration of ``*``, ``+`` or the
optional part of ``{n,m}`` that matches nothing fails (ECMA-262's empty check), so such
iterations read at least one character; required iterations may be empty. The rest is
treated conservatively (it can only add ways to match, never hide one):

* anchors and ``\\b``/``\\B`` read nothing and are passed over as if always true;
* a lookaround is passed over the same way, and its body is decided on its own (the
  engine runs it, atomically, at each position it is reached);
* a backreference reads any text (``[^]*``);
* ``\\p{...}`` and ``\\P{...}`` may hold any character, and under ``(?i:...)`` a set
  holding a letter or any character beyond ASCII holds every character beyond ASCII;
* ``{n,m}`` is expanded into copies while that stays small (``EXPANSION_LIMIT``
  positions) and, for a body that loops, while m is at most ``COUNT_LIMIT``; beyond,
  it is decided as ``{min(n,1),}``, unbounded (``(.*a){12}`` reads a run of text in
  n^12 ways: polynomial, but no faster than exponential).

Polynomial ambiguity (``^\\d+\\d+$``) is not exponential and is not reported.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache

MAX_CODE_POINT = 0x10FFFF
EXPANSION_LIMIT = 100
"""Positions one bounded repetition may expand to before it is decided as unbounded."""
COUNT_LIMIT = 10
"""Copies of a looping body a bounded repetition may have before it is decided as unbounded."""

Ranges = tuple[tuple[int, int], ...]
"""A character set: sorted, disjoint, non-adjacent inclusive code point ranges."""

ANY: Ranges = ((0, MAX_CODE_POINT),)
DIGIT: Ranges = ((0x30, 0x39),)
WORD: Ranges = ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A))
SPACE: Ranges = (
    (0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A),
    (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF),
)  # fmt: skip
LINE_TERMINATORS: Ranges = ((0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029))


class Unanalysable(ValueError):
    """The pattern uses syntax the analysis does not read."""


def _normalise(ranges: list[tuple[int, int]]) -> Ranges:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return tuple(out)


def _complement(ranges: Ranges) -> Ranges:
    out, start = [], 0
    for lo, hi in ranges:
        if lo > start:
            out.append((start, lo - 1))
        start = hi + 1
    if start <= MAX_CODE_POINT:
        out.append((start, MAX_CODE_POINT))
    return tuple(out)


def _intersection(a: Ranges, b: Ranges) -> Ranges:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo <= hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return tuple(out)


# -- syntax ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Chars:
    """One character from a set."""

    ranges: Ranges


@dataclass(frozen=True, slots=True)
class Seq:
    """Its items one after another; the empty sequence matches the empty text."""

    items: tuple[Node, ...]


@dataclass(frozen=True, slots=True)
class Alt:
    branches: tuple[Node, ...]


@dataclass(frozen=True, slots=True)
class Repeat:
    """``body{low,high}``; ``high`` None is unbounded."""

    body: Node
    low: int
    high: int | None


Node = Chars | Seq | Alt | Repeat

EMPTY = Seq(())
_CLASS_ESCAPES = {"d": DIGIT, "w": WORD, "s": SPACE}
_CONTROL_ESCAPES = {"t": 9, "n": 10, "v": 11, "f": 12, "r": 13}
_MODIFIERS = re.compile(r"\?([ims]*)(?:-([ims]*))?:")


class _Parser:
    """ECMA-262 pattern syntax (unicode mode) into ``Node``s; lookaround bodies are kept
    apart, to be decided on their own."""

    def __init__(self, pattern: str) -> None:
        self.src = pattern
        self.i = 0
        self.lookarounds: list[Node] = []
        self.ignore_case = False
        self.dot_all = False

    def parse(self) -> Node:
        node = self.disjunction()
        if self.i != len(self.src):
            raise Unanalysable(f"unexpected {self.src[self.i]!r} at {self.i}")
        return node

    def peek(self, n: int = 0) -> str:
        j = self.i + n
        return self.src[j] if j < len(self.src) else ""

    def take(self, text: str) -> bool:
        if self.src.startswith(text, self.i):
            self.i += len(text)
            return True
        return False

    def disjunction(self) -> Node:
        branches = [self.alternative()]
        while self.take("|"):
            branches.append(self.alternative())
        return branches[0] if len(branches) == 1 else Alt(tuple(branches))

    def alternative(self) -> Node:
        items: list[Node] = []
        while self.peek() not in ("", "|", ")"):
            atom = self.term()
            if atom is not None:
                items.append(self.quantified(atom))
            elif self.quantifier() is not None:  # a quantified assertion: still zero-width
                self.take("?")
        return items[0] if len(items) == 1 else Seq(tuple(items))

    def quantified(self, atom: Node) -> Node:
        bounds = self.quantifier()
        if bounds is None:
            return atom
        self.take("?")  # lazy: the same paths, tried in another order
        return Repeat(atom, *bounds)

    def quantifier(self) -> tuple[int, int | None] | None:
        ch = self.peek()
        if ch in ("*", "+", "?"):
            self.i += 1
            return {"*": (0, None), "+": (1, None), "?": (0, 1)}[ch]
        if ch != "{":
            return None
        start = self.i
        self.i += 1
        low, high = self.digits(), None
        if low is not None and self.take(","):
            high = self.digits()
        elif low is not None:
            high = low
        if low is None or not self.take("}"):
            self.i = start  # a literal brace
            return None
        return low, high

    def digits(self) -> int | None:
        start = self.i
        while self.peek().isdigit() and self.peek().isascii():
            self.i += 1
        return int(self.src[start : self.i]) if self.i > start else None

    def term(self) -> Node | None:
        ch = self.peek()
        if ch in ("^", "$"):
            self.i += 1
            return None
        if self.take("\\b") or self.take("\\B"):
            return None
        if ch == "(":
            return self.group()
        if ch == ".":
            self.i += 1
            return Chars(ANY if self.dot_all else _complement(LINE_TERMINATORS))
        if ch == "[":
            return self.chars(self.char_class())
        if ch == "\\":
            return self.atom_escape()
        if ch in ("*", "+", "?", ")"):
            raise Unanalysable(f"nothing to repeat at {self.i}")
        cp = self.literal()
        return self.chars(((cp, cp),))

    def literal(self) -> int:
        ch = self.src[self.i]
        self.i += 1
        return ord(ch)

    def group(self) -> Node | None:
        self.i += 1
        lookaround = next((p for p in ("?=", "?!", "?<=", "?<!") if self.take(p)), None)
        if lookaround is None and not self.take("?:") and self.take("?<"):
            end = self.src.find(">", self.i)
            if end < 0:
                raise Unanalysable("unterminated group name")
            self.i = end + 1
        elif lookaround is None and self.peek() == "?":
            return self.modified()
        body = self.disjunction()
        if not self.take(")"):
            raise Unanalysable("unterminated group")
        if lookaround is not None:
            self.lookarounds.append(body)
            return None
        return body

    def modified(self) -> Node:
        """``(?i:...)``, ``(?s-i:...)``: flags for the group's body alone."""
        flags = _MODIFIERS.match(self.src, self.i)
        if flags is None:
            raise Unanalysable(f"unknown group syntax at {self.i - 1}")
        self.i = flags.end()
        saved = self.ignore_case, self.dot_all
        on, off = flags[1], flags[2] or ""
        self.ignore_case = "i" in on or (self.ignore_case and "i" not in off)
        self.dot_all = "s" in on or (self.dot_all and "s" not in off)
        body = self.disjunction()
        self.ignore_case, self.dot_all = saved
        if not self.take(")"):
            raise Unanalysable("unterminated group")
        return body

    def chars(self, ranges: Ranges) -> Chars:
        """A set as the engine matches it: without case, under the ``i`` flag. Beyond ASCII
        the folded set is taken to be every character beyond ASCII (a superset)."""
        if not self.ignore_case:
            return Chars(ranges)
        extra: list[tuple[int, int]] = []
        for lo, hi in _intersection(ranges, ((0x41, 0x5A), (0x61, 0x7A))):
            extra.append((lo ^ 0x20, hi ^ 0x20))  # the other case of an ASCII letter run
        if _intersection(ranges, ((0x80, MAX_CODE_POINT),)) or extra:
            extra.append((0x80, MAX_CODE_POINT))  # K and s fold with U+212A and U+017F, too
        return Chars(_normalise([*ranges, *extra]))

    def atom_escape(self) -> Node:
        self.i += 1
        ch = self.peek()
        if ch == "k" and self.peek(1) == "<":
            end = self.src.find(">", self.i)
            if end < 0:
                raise Unanalysable("unterminated group name")
            self.i = end + 1
            return Repeat(Chars(ANY), 0, None)
        if ch.isdigit() and ch != "0":
            self.digits()
            return Repeat(Chars(ANY), 0, None)  # a backreference: the text of a group
        return self.chars(self.class_escape())

    def class_escape(self) -> Ranges:
        """The character set of the escape at ``self.i`` (just after the backslash)."""
        ch = self.peek()
        self.i += 1
        if ch.lower() in _CLASS_ESCAPES:
            ranges = _CLASS_ESCAPES[ch.lower()]
            return _complement(ranges) if ch.isupper() else ranges
        if ch in ("p", "P"):
            end = self.src.find("}", self.i)
            if self.peek() != "{" or end < 0:
                raise Unanalysable("malformed property escape")
            self.i = end + 1
            return ANY  # a Unicode property: assumed to share a character with anything
        cp = self.escaped_code_point(ch)
        return ((cp, cp),)

    def escaped_code_point(self, ch: str) -> int:
        if ch in _CONTROL_ESCAPES:
            return _CONTROL_ESCAPES[ch]
        if ch == "0":
            return 0
        if ch == "c" and self.peek().isascii() and self.peek().isalpha():
            return self.literal() % 32
        if ch == "x":
            return self.hex(2)
        if ch == "u":
            if self.take("{"):
                end = self.src.find("}", self.i)
                digits = self.src[self.i : end] if end > self.i else ""
                hexadecimal = digits and all(c in "0123456789abcdefABCDEF" for c in digits)
                cp = int(digits, 16) if hexadecimal else -1
                self.i = end + 1
            else:
                cp = self.hex(4)
                if 0xD800 <= cp <= 0xDBFF and self.src.startswith("\\u", self.i):
                    save = self.i
                    self.i += 2
                    low = self.hex(4)
                    if 0xDC00 <= low <= 0xDFFF:
                        return 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00)
                    self.i = save
            if not 0 <= cp <= MAX_CODE_POINT:
                raise Unanalysable("malformed unicode escape")
            return cp
        if ch == "":
            raise Unanalysable("a pattern that ends in a backslash")
        return ord(ch)  # an identity escape: \. \/ \- \$ ...

    def hex(self, n: int) -> int:
        digits = self.src[self.i : self.i + n]
        if len(digits) != n or not all(c in "0123456789abcdefABCDEF" for c in digits):
            raise Unanalysable(f"malformed hex escape at {self.i}")
        self.i += n
        return int(digits, 16)

    def char_class(self) -> Ranges:
        self.i += 1
        negated = self.take("^")
        ranges: list[tuple[int, int]] = []
        while not self.take("]"):
            if self.peek() == "":
                raise Unanalysable("unterminated character class")
            low = self.class_atom()
            if self.peek() == "-" and self.peek(1) not in ("]", ""):
                self.i += 1
                high = self.class_atom()
                if len(low) == 1 and len(high) == 1 and low[0][0] == low[0][1]:
                    ranges.append((low[0][0], high[0][1]))
                    continue
                ranges += [*low, *high, (0x2D, 0x2D)]  # Annex B: a class escape, then '-'
                continue
            ranges += low
        found = _normalise(ranges)
        return _complement(found) if negated else found

    def class_atom(self) -> Ranges:
        if self.peek() != "\\":
            cp = self.literal()
            return ((cp, cp),)
        self.i += 1
        if self.take("b"):
            return ((8, 8),)
        if self.peek() == "-":
            self.i += 1
            return ((0x2D, 0x2D),)
        return self.class_escape()


# -- the automaton -------------------------------------------------------------------------------


@dataclass(slots=True)
class _Fragment:
    """What a subexpression contributes: in how many ways it matches the empty text, and
    in how many ways each position can be its first or its last (all capped at 2)."""

    empty: int
    first: dict[int, int]
    last: dict[int, int]


def _cap(n: int) -> int:
    return n if n < 2 else 2


def _scaled(ways: dict[int, int], by: int) -> dict[int, int]:
    return {p: _cap(n * by) for p, n in ways.items()} if by else {}


def _added(a: dict[int, int], b: dict[int, int]) -> dict[int, int]:
    out = dict(a)
    for p, n in b.items():
        out[p] = _cap(out.get(p, 0) + n)
    return out


class _Automaton:
    """Position automaton whose transitions count the ways the regex takes them."""

    def __init__(self) -> None:
        self.sets: list[Ranges] = []
        self.follow: list[dict[int, int]] = []

    def build(self, node: Node) -> _Fragment:
        if isinstance(node, Chars):
            self.sets.append(node.ranges)
            self.follow.append({})
            p = len(self.sets) - 1
            return _Fragment(0, {p: 1}, {p: 1})
        if isinstance(node, Seq):
            out = _Fragment(1, {}, {})
            for item in node.items:
                out = self.then(out, self.build(item))
            return out
        if isinstance(node, Alt):
            return self.either([self.build(b) for b in node.branches])
        return self.repeat(node)

    def then(self, a: _Fragment, b: _Fragment) -> _Fragment:
        self.link(a.last, b.first)
        return _Fragment(
            _cap(a.empty * b.empty),
            _added(a.first, _scaled(b.first, a.empty)),
            _added(b.last, _scaled(a.last, b.empty)),
        )

    @staticmethod
    def either(fragments: list[_Fragment]) -> _Fragment:
        out = _Fragment(0, {}, {})
        for f in fragments:
            out = _Fragment(
                _cap(out.empty + f.empty), _added(out.first, f.first), _added(out.last, f.last)
            )
        return out

    def link(self, last: dict[int, int], first: dict[int, int]) -> None:
        for p, m in last.items():
            follow = self.follow[p]
            for q, n in first.items():
                follow[q] = _cap(follow.get(q, 0) + m * n)

    def repeat(self, node: Repeat) -> _Fragment:
        low, high = _bounds(node)
        out = _Fragment(1, {}, {})
        for _ in range(low):
            out = self.then(out, self.build(node.body))
        if high is None:
            body = self.build(node.body)
            self.link(body.last, body.first)  # the loop: each iteration reads something
            return self.then(out, _Fragment(1, body.first, body.last))
        optional = _Fragment(1, {}, {})
        for _ in range(high - low):  # (e(e(e)?)?)?, each e reading something
            body = self.build(node.body)
            inner = self.then(_Fragment(0, body.first, body.last), optional)
            optional = _Fragment(1, inner.first, inner.last)
        return self.then(out, optional)


def _bounds(node: Repeat) -> tuple[int, int | None]:
    """The repetition as decided: as written while its copies stay few, else as
    ``{min(n,1),}``. Unbounded can only add ways to match; and m copies of a body that
    loops (``(.*a){12}``) share a run of text in n^m ways, which for m beyond
    ``COUNT_LIMIT`` is as slow as exponential, and unbounded is what exposes it."""
    low, high = node.low, node.high
    copies = max(high if high is not None else low + 1, 1)
    if copies * _size(node.body) > EXPANSION_LIMIT or (
        high is not None and high > COUNT_LIMIT and _loops(node.body)
    ):
        return min(low, 1), None
    return low, high


def _size(node: Node) -> int:
    """Positions ``node`` builds."""
    if isinstance(node, Chars):
        return 1
    if isinstance(node, Seq):
        return sum(_size(n) for n in node.items)
    if isinstance(node, Alt):
        return sum(_size(n) for n in node.branches)
    low, high = _bounds(node)
    return _size(node.body) * max(high if high is not None else low + 1, 1)


def _loops(node: Node) -> bool:
    """Whether ``node`` holds an unbounded repetition."""
    if isinstance(node, Chars):
        return False
    if isinstance(node, Seq):
        return any(_loops(n) for n in node.items)
    if isinstance(node, Alt):
        return any(_loops(n) for n in node.branches)
    return _bounds(node)[1] is None or _loops(node.body)


# -- the decision --------------------------------------------------------------------------------


def _components(n: int, edges: list[list[int]]) -> list[int]:
    """Strongly connected components (Tarjan, iterative): the component of each node."""
    index, low, comp = [-1] * n, [0] * n, [-1] * n
    stack: list[int] = []
    on_stack = [False] * n
    counter = found = 0
    for root in range(n):
        if index[root] >= 0:
            continue
        work = [(root, 0)]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack[root] = True
        while work:
            v, k = work[-1]
            if k < len(edges[v]):
                work[-1] = (v, k + 1)
                w = edges[v][k]
                if index[w] < 0:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack[w] = True
                    work.append((w, 0))
                elif on_stack[w]:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                u = work[-1][0]
                low[u] = min(low[u], low[v])
            if low[v] == index[v]:
                while True:
                    w = stack.pop()
                    on_stack[w] = False
                    comp[w] = found
                    if w == v:
                        break
                found += 1
    return comp


def _witness_char(ranges: Ranges) -> str:
    """A readable character of a non-empty set, for the message."""
    for lo, hi in ((0x61, 0x7A), (0x30, 0x39), (0x41, 0x5A), (0x21, 0x7E), (0x20, 0x20)):
        shared = _intersection(ranges, ((lo, hi),))
        if shared:
            return chr(shared[0][0])
    return chr(ranges[0][0])


Pair = tuple[int, int]


class _Product:
    """A x A restricted to one strongly connected component of A."""

    def __init__(self, automaton: _Automaton, members: list[int]) -> None:
        self.sets = automaton.sets
        self.follow = automaton.follow
        self.members = set(members)
        self.shared: dict[Pair, Ranges] = {}

    def common(self, r: int, s: int) -> Ranges:
        key = (r, s) if r <= s else (s, r)
        if key not in self.shared:
            self.shared[key] = _intersection(self.sets[r], self.sets[s])
        return self.shared[key]

    def steps(self, pair: Pair) -> Iterator[Pair]:
        p, q = pair
        inside = self.members
        for r in self.follow[p]:
            if r in inside:
                for s in self.follow[q]:
                    if s in inside and self.common(r, s):
                        yield r, s

    def ambiguous_loop(self) -> str | None:
        """A word read from some state back to it along two different paths, or None."""
        nodes: list[Pair] = [(q, q) for q in sorted(self.members)]
        number = {pair: i for i, pair in enumerate(nodes)}
        edges: list[list[int]] = []
        i = 0
        while i < len(nodes):
            out = []
            for nxt in self.steps(nodes[i]):
                if nxt not in number:
                    number[nxt] = len(nodes)
                    nodes.append(nxt)
                out.append(number[nxt])
            edges.append(out)
            i += 1
        comp = _components(len(nodes), edges)
        loops_at = {comp[number[(q, q)]] for q in self.members}
        for i, (p, q) in enumerate(nodes):
            if comp[i] not in loops_at:
                continue
            if p != q:
                return self.word(nodes, edges, comp, i)
            for j in edges[i]:
                r, s = nodes[j]
                if comp[j] == comp[i] and r == s and self.follow[p][r] >= 2:
                    return self.word(nodes, edges, comp, i, j)
        return None

    def word(
        self, nodes: list[Pair], edges: list[list[int]], comp: list[int], at: int, then: int = -1
    ) -> str:
        """The word of a cycle from a diagonal pair through the pair ``at`` of different
        states or, given ``then``, through the doubled transition from ``at`` to ``then``."""
        if then == at:
            path = [then]
        elif then >= 0:
            path = [then, *self.path(nodes, edges, comp, then, at)]
        else:
            diagonal = next(i for i, (p, q) in enumerate(nodes) if p == q and comp[i] == comp[at])
            path = self.path(nodes, edges, comp, diagonal, at)
            path += self.path(nodes, edges, comp, at, diagonal)
        return "".join(_witness_char(self.common(*nodes[j])) for j in path)

    @staticmethod
    def path(
        nodes: list[Pair], edges: list[list[int]], comp: list[int], src: int, dst: int
    ) -> list[int]:
        """The nodes after ``src`` on a shortest path to ``dst`` (a cycle where they are
        the same node) within their component."""
        parent: dict[int, int] = {}
        frontier = [src]
        while dst not in parent:
            reached = []
            for v in frontier:
                for w in edges[v]:
                    if comp[w] == comp[src] and w not in parent:
                        parent[w] = v
                        reached.append(w)
            frontier = reached
        out = [dst]
        while parent[out[-1]] != src:
            out.append(parent[out[-1]])
        return out[::-1]


def _ambiguous_word(node: Node) -> str | None:
    automaton = _Automaton()
    automaton.build(node)
    n = len(automaton.sets)
    edges = [list(f) for f in automaton.follow]
    comp = _components(n, edges)
    members: dict[int, list[int]] = {}
    for p in range(n):
        members.setdefault(comp[p], []).append(p)
    for group in members.values():
        if len(group) == 1 and group[0] not in automaton.follow[group[0]]:
            continue  # no loop through it
        word = _Product(automaton, group).ambiguous_loop()
        if word is not None:
            return word
    return None


@lru_cache(maxsize=4096)
def exponential_word(pattern: str) -> str | None:
    """A word that the pattern can read, looping, in two ways (so n repetitions of it in
    2^n ways), or None when the pattern's ambiguity is at most polynomial.

    Raises ``Unanalysable`` on syntax outside ECMA-262's unicode mode."""
    parser = _Parser(pattern)
    tree = parser.parse()
    for part in (tree, *parser.lookarounds):
        word = _ambiguous_word(part)
        if word is not None:
            return word
    return None


def explain(pattern: str) -> str | None:
    """Why ``pattern`` would take exponential time on a text that almost matches, or None."""
    try:
        word = exponential_word(pattern)
    except Unanalysable as exc:
        return f"cannot be checked for exponential backtracking ({exc})"
    if word is None:
        return None
    return (
        f"can match {word!r} repeated in exponentially many ways (a repetition whose "
        "body, or two of whose alternatives, can read the same text): a text that "
        "almost matches takes time doubling with each repetition; make the repetition "
        "unambiguous"
    )
