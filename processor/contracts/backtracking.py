"""Exponential and polynomial backtracking in ECMA-262 patterns, decided before a
contract loads.

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

*Polynomial* backtracking is the next concern: ``^\\d+\\d+$`` splits a run of n digits in
n ways, and on a near miss tries each, n^2 steps; ``\\s*,\\s*$`` is linear from one start,
but a search that is not anchored with ``^`` tries every start, n^2 again. At 64 KB that
is seconds. Counted repetitions multiply the same way, up to their counts:
``[a-z]{0,90}[a-z]{0,90}`` splits a run in 91 places, and ``(?:a?){22}`` in 2^22.
``steps`` bounds the work on a text of n characters (``_Search`` says how),
``longest_text`` is the longest text a pattern may meet within ``STEP_BUDGET``, and the
registry refuses a schema that lets a longer one reach it. The validators never search
a longer text (``validation.ecma_search``): the bound the registry demands is what
makes that safe.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

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


@dataclass(frozen=True, slots=True)
class Assertion:
    """Reads nothing, and may fail: ``^`` (the start of the text), ``$`` (its end), or
    ``""`` for the others (``\\b``, ``\\B``, ``^`` under the ``m`` flag)."""

    kind: str


@dataclass(frozen=True, slots=True)
class Backref:
    """A backreference: read as any text (``[^]*``), which it may fail to be."""


@dataclass(frozen=True, slots=True)
class Look:
    """A lookaround, run where it stands; its body is the parser's ``lookarounds[index]``."""

    index: int


Node = Chars | Seq | Alt | Repeat | Assertion | Backref | Look

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
        self.behind: list[bool] = []  # of each lookaround: whether it looks behind
        self.ignore_case = False
        self.dot_all = False
        self.multiline = False

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
            if not isinstance(atom, Assertion | Look):
                items.append(self.quantified(atom))
                continue
            items.append(atom)
            if self.quantifier() is not None:  # a quantified assertion: still zero-width
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

    def term(self) -> Node:
        ch = self.peek()
        if ch == "^":
            self.i += 1
            return Assertion("" if self.multiline else "^")  # (?m:^) also after a newline
        if ch == "$":
            self.i += 1
            return Assertion("$")  # (?m:$) also before a newline: taken as the end alone
        if self.take("\\b") or self.take("\\B"):
            return Assertion("")
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

    def group(self) -> Node:
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
            self.behind.append(lookaround.startswith("?<"))
            return Look(len(self.lookarounds) - 1)
        return body

    def modified(self) -> Node:
        """``(?i:...)``, ``(?s-i:...)``: flags for the group's body alone."""
        flags = _MODIFIERS.match(self.src, self.i)
        if flags is None:
            raise Unanalysable(f"unknown group syntax at {self.i - 1}")
        self.i = flags.end()
        saved = self.ignore_case, self.dot_all, self.multiline
        on, off = flags[1], flags[2] or ""
        self.ignore_case = "i" in on or (self.ignore_case and "i" not in off)
        self.dot_all = "s" in on or (self.dot_all and "s" not in off)
        self.multiline = "m" in on or (self.multiline and "m" not in off)
        body = self.disjunction()
        self.ignore_case, self.dot_all, self.multiline = saved
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
            return Backref()
        if ch.isdigit() and ch != "0":
            self.digits()
            return Backref()  # the text of a group
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

_NONE: frozenset[int] = frozenset()


@dataclass(slots=True)
class _Fragment:
    """What a subexpression contributes: in how many ways it matches the empty text, and
    in how many ways each position can be its first or its last (all capped at 2).

    For the polynomial analysis also: the last positions after which it is sure to end,
    passing nothing that may fail (an assertion, a lookaround or a backreference;
    ``ends``, and ``empty_ends`` for the empty text), the first positions it can begin
    with without passing a ``^`` (``starts``; ``empty_starts``), and the lookarounds it
    runs before reading anything (``looks``)."""

    empty: int
    first: dict[int, int]
    last: dict[int, int]
    ends: frozenset[int] = _NONE
    empty_ends: bool = False
    starts: frozenset[int] = _NONE
    empty_starts: bool = False
    looks: frozenset[int] = _NONE


def _nothing() -> _Fragment:
    """The empty sequence."""
    return _Fragment(1, {}, {}, empty_ends=True, empty_starts=True)


def _skippable(f: _Fragment) -> _Fragment:
    """``f`` or nothing: the rounds of a repetition beyond its minimum."""
    return _Fragment(1, f.first, f.last, f.ends, True, f.starts, True, f.looks)


def _nonempty(f: _Fragment) -> _Fragment:
    """``f`` reading at least one character, as an optional round must."""
    return _Fragment(0, f.first, f.last, f.ends, False, f.starts, False, f.looks)


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
    """Position automaton whose transitions count the ways the regex takes them.

    ``counted`` builds the optional part of a bounded repetition ``{n,m}`` as a loop that
    reads at most so many characters (``width``), where the loop is no more ambiguous
    than the copies (``_countable``): its paths take in the copies', and the width keeps
    the count of a loop that stops (``[a-z]{0,90}[a-z]{0,90}`` splits a text in up to 91
    places, not n) while a long run of copies no longer hides it among positions."""

    def __init__(self, counted: bool = False) -> None:
        self.counted = counted
        self.sets: list[Ranges] = []
        self.follow: list[dict[int, int]] = []
        self.width: list[float] = []
        """Of each position: the characters the outermost loop holding it reads (0: in none)."""
        self.look_after: dict[int, set[int]] = {}
        """The positions after which each lookaround runs."""

    def build(self, node: Node) -> _Fragment:
        if isinstance(node, Chars):
            self.sets.append(node.ranges)
            self.follow.append({})
            self.width.append(0)
            p = len(self.sets) - 1
            return _Fragment(0, {p: 1}, {p: 1}, frozenset({p}), False, frozenset({p}), False)
        if isinstance(node, Seq):
            out = _nothing()
            for item in node.items:
                out = self.then(out, self.build(item))
            return out
        if isinstance(node, Alt):
            return self.either([self.build(b) for b in node.branches])
        if isinstance(node, Assertion):
            return _Fragment(1, {}, {}, empty_starts=node.kind != "^")
        if isinstance(node, Look):
            self.look_after.setdefault(node.index, set())
            return _Fragment(1, {}, {}, empty_starts=True, looks=frozenset({node.index}))
        if isinstance(node, Backref):
            read = self.repeat(Repeat(Chars(ANY), 0, None))
            return _Fragment(read.empty, read.first, read.last, _NONE, False, read.starts,
                             read.empty_starts, read.looks)  # fmt: skip
        return self.repeat(node)

    def then(self, a: _Fragment, b: _Fragment) -> _Fragment:
        self.link(a.last, b.first)
        for k in b.looks:
            self.look_after[k].update(a.last)
        return _Fragment(
            _cap(a.empty * b.empty),
            _added(a.first, _scaled(b.first, a.empty)),
            _added(b.last, _scaled(a.last, b.empty)),
            b.ends | a.ends if b.empty_ends else b.ends,
            a.empty_ends and b.empty_ends,
            a.starts | b.starts if a.empty_starts else a.starts,
            a.empty_starts and b.empty_starts,
            a.looks | b.looks if a.empty else a.looks,
        )

    @staticmethod
    def either(fragments: list[_Fragment]) -> _Fragment:
        out = _Fragment(0, {}, {})
        for f in fragments:
            out = _Fragment(
                _cap(out.empty + f.empty),
                _added(out.first, f.first),
                _added(out.last, f.last),
                out.ends | f.ends,
                out.empty_ends or f.empty_ends,
                out.starts | f.starts,
                out.empty_starts or f.empty_starts,
                out.looks | f.looks,
            )
        return out

    def link(self, last: dict[int, int], first: dict[int, int]) -> None:
        for p, m in last.items():
            follow = self.follow[p]
            for q, n in first.items():
                follow[q] = _cap(follow.get(q, 0) + m * n)

    def repeat(self, node: Repeat) -> _Fragment:
        low, high = _bounds(node)
        width = math.inf
        counted = self.counted and node.high is not None and node.high > node.low
        if counted and node.high is not None and _countable(node.body):
            if node.low * _size(node.body) <= EXPANSION_LIMIT:
                low = node.low  # else fewer required copies: only more ways to read a text
            high, width = None, (node.high - low) * _longest(node.body)
        out = _nothing()
        for _ in range(low):
            out = self.then(out, self.build(node.body))
        if high is None:
            start = len(self.sets)
            body = self.build(node.body)
            self.link(body.last, body.first)  # the loop: each iteration reads something
            for k in body.looks:
                self.look_after[k].update(body.last)
            self.width[start:] = [width] * (len(self.sets) - start)
            return self.then(out, _skippable(_nonempty(body)))
        optional = _nothing()
        for _ in range(high - low):  # (e(e(e)?)?)?, each e reading something
            body = self.build(node.body)
            optional = _skippable(self.then(_nonempty(body), optional))
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
    if isinstance(node, Assertion | Look):
        return 0
    if isinstance(node, Backref):
        return 1
    if isinstance(node, Seq):
        return sum(_size(n) for n in node.items)
    if isinstance(node, Alt):
        return sum(_size(n) for n in node.branches)
    low, high = _bounds(node)
    return _size(node.body) * max(high if high is not None else low + 1, 1)


def _longest(node: Node) -> float:
    """The most characters ``node`` reads."""
    if isinstance(node, Chars):
        return 1
    if isinstance(node, Assertion | Look):
        return 0
    if isinstance(node, Backref):
        return math.inf
    if isinstance(node, Seq):
        return sum(_longest(n) for n in node.items)
    if isinstance(node, Alt):
        return max(_longest(n) for n in node.branches)
    return math.inf if node.high is None else node.high * _longest(node.body)


def _nullable(node: Node) -> bool:
    if isinstance(node, Chars):
        return False
    if isinstance(node, Assertion | Look | Backref):
        return True
    if isinstance(node, Seq):
        return all(_nullable(n) for n in node.items)
    if isinstance(node, Alt):
        return any(_nullable(n) for n in node.branches)
    return node.low == 0 or _nullable(node.body)


@lru_cache(maxsize=4096)
def _countable(body: Node) -> bool:
    """Whether copies of ``body`` can be read as a loop without more ways to read a text:
    the body reads something (an empty required copy is a choice a loop has not), and
    repeated it has no exponential ambiguity (``(?:\\d{1,9}){1,9}`` has, in 9^9 ways)."""
    if isinstance(body, Chars):
        return True
    if _nullable(body):
        return False
    automaton = _Automaton()
    automaton.build(Repeat(body, 1, None))
    return _ambiguous_word(automaton) is None


def _loops(node: Node) -> bool:
    """Whether ``node`` holds an unbounded repetition."""
    if isinstance(node, Backref):
        return True
    if isinstance(node, Chars | Assertion | Look):
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


def _ambiguous_word(automaton: _Automaton) -> str | None:
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


# -- polynomial growth ---------------------------------------------------------------------------

STEP_BUDGET = 1_000_000
"""The most steps (``steps``) a pattern may take on the longest text a contract lets reach
it. regress takes 0.3 to 20 ns a step on this reckoning (measured on quadratic, cubic,
quartic and counted patterns at the length this budget allows them, on a loaded
machine), so one search stays within about 20 ms: the order of the whole validation of
a call, not the seconds of a stalled partition."""

LONGEST_TEXT = 65_536
"""The longest text where no maxLength bounds it: the parse gate refuses arguments larger
than this (``max_arguments_bytes``' default). A pattern within the budget at this
length needs no bound; a linear one is, unless its repetitions multiply a lot."""


def _difference(a: Ranges, b: Ranges) -> Ranges:
    return _intersection(a, _complement(b)) if b else a


def _union(sets: Iterator[Ranges]) -> Ranges:
    return _normalise([r for s in sets for r in s])


Edges = list[list[tuple[int, Ranges]]]


class _Search:
    """The paths a backtracking search of one text explores, as an automaton over states
    that each read one character set, and how their number grows with the text's length.

    A search that is not anchored with ``^`` tries the pattern at each position in turn:
    a state ANY, reading any character, stands for moving on to the next (the lazy
    ``[^]*?`` in front). A path that reaches the end of the pattern without passing a
    ``$`` succeeds there, and the search stops: a *final* state. Where a state could read
    the next character into a final state, the search is bound to succeed beneath that
    node of its tree, so such nodes (*stops*) lie on one path from the root. Every node
    explored is then either on paths free of stops from the root, or on such paths
    hanging off one of the stops: two copies of the automaton model that. The R copy
    takes only steps that cannot be stops (a state reads nothing its ``stop`` set holds);
    the U copy takes any step, and passes into R after a stop. The number of nodes at a
    state of R grows as n^(D+1) past a loop, where D is the most links in a chain of
    pairs of loops that read a common word both round the loop and from the one to the
    other (Weber and Seidl's IDA); a U loop adds a factor n (the stops along one path),
    never more, so a pair of U loops is no link. A loop standing for counted copies
    reads at most ``width`` characters: a link of it splits a run in at most width + 1
    places, not n, and only its width adds to the length of a path. Moving on to the
    next position is the last thing a search tries, so ANY is not left for the next
    position where the pattern would succeed at this one.

    A lookaround runs at each node at the states it follows, and its cost multiplies:
    its body is decided as a search anchored where it stands."""

    def __init__(self, automaton: _Automaton, top: _Fragment, *, anywhere: bool, stops: bool):
        n = len(automaton.sets)
        self.init, self.any = n, n + 1
        self.size = m = n + 2
        sets = [*automaton.sets, (), ANY]
        succ = [sorted(f) for f in automaton.follow] + [sorted(top.first), []]
        if anywhere:
            succ[self.init].append(self.any)
            succ[self.any] = [self.any, *sorted(top.starts)]
        finals = ({*top.ends, *([self.init] if top.empty_ends else [])}) if stops else set()
        stop = [
            ANY if s in finals else _union(sets[y] for y in succ[s] if y in finals)
            for s in range(m)
        ]
        edges: Edges = [[] for _ in range(2 * m)]
        for s in range(m):
            for y in succ[s]:
                chars = _difference(sets[y], stop[s])
                if chars:
                    edges[m + s].append((m + y, chars))
        roots = [m + self.init]
        if any(stop):
            roots.append(self.init)
            for s in range(m):
                for y in succ[s]:
                    chars = _difference(sets[y], stop[s]) if y == self.any else sets[y]
                    if chars:
                        edges[s].append((y, chars))
                    chars = _intersection(sets[y], stop[s]) if y != self.any else ()
                    if chars:
                        edges[s].append((m + y, chars))
        self.edges = edges
        self.nodes = self._reached(roots)
        index = {v: i for i, v in enumerate(self.nodes)}
        adjacency = [[index[w] for w, _ in edges[v]] for v in self.nodes]
        comp_of = _components(len(self.nodes), adjacency)
        self.comp = {v: comp_of[i] for i, v in enumerate(self.nodes)}
        self.count = max(comp_of, default=-1) + 1
        self.members: list[list[int]] = [[] for _ in range(self.count)]
        for v in self.nodes:
            self.members[self.comp[v]].append(v)
        self.loop_chars: list[Ranges] = [()] * self.count
        self.successors: list[set[int]] = [set() for _ in range(self.count)]
        for v in self.nodes:
            c = self.comp[v]
            inside = [chars for w, chars in edges[v] if self.comp[w] == c]
            if inside:
                self.loop_chars[c] = _union(iter([self.loop_chars[c], *inside]))
            self.successors[c].update(self.comp[w] for w, _ in edges[v] if self.comp[w] != c)
        widths = [*automaton.width, 0, math.inf]
        self.wide = [
            max(widths[v % m] for v in self.members[c]) if self.loop_chars[c] else 0
            for c in range(self.count)
        ]
        self.links = self._links()
        self.depth = [0.0] * self.count
        """Of each component: the most characters read on a path to it (inf: unbounded)."""
        self.degree_of = [0] * self.count
        """Of each component: the exponent of n in the nodes explored at its states."""
        chain = [0] * self.count
        for c in range(self.count - 1, -1, -1):  # sources first
            self.depth[c] += self.wide[c] if self.loop_chars[c] else 1
            for d in self.successors[c]:
                self.depth[d] = max(self.depth[d], self.depth[c])
                chain[d] = max(chain[d], chain[c])
            for d, _, factor in self.links[c]:
                chain[d] = max(chain[d], chain[c] + (factor == math.inf))
            self.degree_of[c] = chain[c] + (self.depth[c] == math.inf)

    def _reached(self, roots: list[int]) -> list[int]:
        seen = set(roots)
        stack = list(roots)
        while stack:
            for w, _ in self.edges[stack.pop()]:
                if w not in seen:
                    seen.add(w)
                    stack.append(w)
        return sorted(seen)

    def _links(self) -> list[list[tuple[int, str, float]]]:
        """Of each component: the later ones its loop is linked to, by a word both loops
        and the way between read (``_link``), and the most places a run of it can be
        split at between them (one more than the characters either loop reads)."""
        reach = [0] * self.count
        for c in range(self.count):  # Tarjan numbers a component after all it reaches
            reach[c] = 1 << c
            for d in self.successors[c]:
                reach[c] |= reach[d]
        links: list[list[tuple[int, str, float]]] = [[] for _ in range(self.count)]
        for c1 in range(self.count):
            if not self.loop_chars[c1]:
                continue
            for c2 in range(self.count):
                if (
                    c2 != c1
                    and self.loop_chars[c2]
                    and self.members[c2][0] >= self.size  # a U loop adds one factor n, no more
                    and reach[c1] >> c2 & 1
                    and _intersection(self.loop_chars[c1], self.loop_chars[c2])
                ):
                    pump = self._link(c1, c2)
                    if pump is not None:
                        links[c1].append((c2, pump, min(self.wide[c1], self.wide[c2]) + 1))
        return links

    def steps(self, n: int) -> tuple[list[float], list[str]]:
        """Of each component, on a text of ``n`` characters: at most how many nodes are
        explored at its states (the splits of the chain of links to it that splits most,
        times the positions where it can be), and the word that chain repeats."""
        chain = [1.0] * self.count
        word = [_witness_char(chars) if chars else "" for chars in self.loop_chars]
        for c in range(self.count - 1, -1, -1):  # sources first
            for d in self.successors[c]:
                if chain[c] > chain[d] or (chain[c] == chain[d] and not word[d]):
                    chain[d], word[d] = chain[c], word[c]
            for d, pump, factor in self.links[c]:
                if chain[c] * min(n, factor) > chain[d]:
                    chain[d], word[d] = chain[c] * min(n, factor), pump
        return [chain[c] * min(n, self.depth[c]) for c in range(self.count)], word

    def _link(self, c1: int, c2: int) -> str | None:
        """A word v read round a loop of ``c1`` from p, round a loop of ``c2`` from q, and
        from p to q; None if there is none. Pairs (x, z) of states of the two components
        reading the same text form a product; in one of its strongly connected components
        K, a path of triples (x, y, z) from some (p, p, q) to some (p', q', q') followed by
        the way back from (p', q') to (p, q) within K reads such a v."""
        comp, edges = self.comp, self.edges
        one, two = self.members[c1], self.members[c2]
        pairs = [(x, z) for x in one for z in two]
        number = {pair: i for i, pair in enumerate(pairs)}
        moves: list[list[tuple[int, Ranges]]] = []
        for x, z in pairs:
            out = []
            for x2, a in edges[x]:
                if comp[x2] != c1:
                    continue
                for z2, b in edges[z]:
                    if comp[z2] == c2:
                        ab = _intersection(a, b)
                        if ab:
                            out.append((number[(x2, z2)], ab))
            moves.append(out)
        within = _components(len(pairs), [[j for j, _ in out] for out in moves])
        between = self._between(c1, c2)
        for k in set(within):
            sources = [i for i in range(len(pairs)) if within[i] == k]
            if not any(within[j] == k for i in sources for j, _ in moves[i]):
                continue  # no loop: the two components share no word round it
            found = self._triples(pairs, moves, within, k, sources, between)
            if found is not None:
                return found
        return None

    def _between(self, c1: int, c2: int) -> set[int]:
        """The states on paths from ``c1`` to ``c2``."""
        after = set(self.members[c1])
        stack = list(after)
        while stack:
            for w, _ in self.edges[stack.pop()]:
                if w not in after:
                    after.add(w)
                    stack.append(w)
        before = set(self.members[c2])
        back: dict[int, list[int]] = {}
        for v in after:
            for w, _ in self.edges[v]:
                back.setdefault(w, []).append(v)
        stack = list(before)
        while stack:
            for v in back.get(stack.pop(), ()):
                if v not in before:
                    before.add(v)
                    stack.append(v)
        return after & before

    def _triples(
        self,
        pairs: list[tuple[int, int]],
        moves: list[list[tuple[int, Ranges]]],
        within: list[int],
        k: int,
        sources: list[int],
        between: set[int],
    ) -> str | None:
        Triple = tuple[int, int]  # (the pair (x, z), y)
        parent: dict[Triple, tuple[Triple, str] | None] = {}
        frontier: list[Triple] = []
        for i in sources:
            parent[(i, pairs[i][0])] = None
            frontier.append((i, pairs[i][0]))
        while frontier:
            reached: list[Triple] = []
            for node in frontier:
                i, y = node
                for j, ab in moves[i]:
                    if within[j] != k:
                        continue
                    for y2, c in self.edges[y]:
                        if y2 not in between or (j, y2) in parent:
                            continue
                        abc = _intersection(ab, c)
                        if not abc:
                            continue
                        parent[(j, y2)] = (node, _witness_char(abc))
                        if y2 == pairs[j][1]:
                            word, origin = _path(parent, (j, y2))
                            return word + _back(moves, within, k, j, origin[0])
                        reached.append((j, y2))
            frontier = reached
        return None

    def at(self, states: list[int]) -> list[int]:
        """The components of ``states``, in either copy, that a search reaches."""
        found = (self.comp.get(v) for s in states for v in (s, self.size + s))
        return sorted({c for c in found if c is not None})


def _path(parent: dict[tuple[int, int], Any], node: tuple[int, int]) -> tuple[str, Any]:
    """The word from the search's source to ``node``, and that source."""
    out = []
    while (step := parent[node]) is not None:
        node, ch = step
        out.append(ch)
    return "".join(reversed(out)), node


def _back(
    moves: list[list[tuple[int, Ranges]]], within: list[int], k: int, src: int, dst: int
) -> str:
    """The word of a shortest path from pair ``src`` to pair ``dst`` within K."""
    parent: dict[int, tuple[int, str] | None] = {src: None}
    frontier = [src]
    while dst not in parent:
        reached = []
        for i in frontier:
            for j, chars in moves[i]:
                if within[j] == k and j not in parent:
                    parent[j] = (i, _witness_char(chars))
                    reached.append(j)
        frontier = reached
    out = []
    node = dst
    while (step := parent[node]) is not None:
        node, ch = step
        out.append(ch)
    return "".join(reversed(out))


@dataclass(frozen=True, slots=True)
class Growth:
    """How the work of searching a text that almost matches grows with its length n."""

    degree: int
    """The work grows as n^degree."""
    word: str
    """A word whose repetition makes it so."""


def _loop_count(automaton: _Automaton) -> int:
    """The strongly connected components of the automaton that hold a loop."""
    follow = automaton.follow
    if not any(q <= p for p, f in enumerate(follow) for q in f):
        return 0  # positions are numbered in order: only a loop leads back
    comp = _components(len(follow), [list(f) for f in follow])
    return len({comp[p] for p, f in enumerate(follow) for q in f if comp[q] == comp[p]})


Built = tuple[_Automaton, _Fragment]


class _Work:
    """The steps searching a text takes, as the length of the text grows: of the pattern
    (``parts[0]``) or of the body of lookaround k (``parts[k + 1]``), with the
    lookarounds it runs."""

    def __init__(self, k: int, parts: list[Built], behind: list[bool], *, anywhere: bool,
                 stops: bool) -> None:  # fmt: skip
        automaton, top = parts[k]
        anchored = not top.starts and not top.empty_starts  # every way through passes a ^
        anywhere = anywhere and not anchored
        self.search: _Search | None = None
        self.looks: list[tuple[list[int], _Work]] = []
        loops = _loop_count(automaton) + anywhere
        self.degree = min(loops, 1)
        if not automaton.look_after and (
            loops == 0 or (loops == 1 and not (stops and (top.ends or top.empty_ends)))
        ):
            return  # at most one loop, every node on one path through it
        self.search = search = _Search(automaton, top, anywhere=anywhere, stops=stops)
        self.degree = max(search.degree_of, default=0)
        for look, after in automaton.look_after.items():
            points = [*after, *((search.init, search.any) if look in top.looks else ())]
            body = _Work(look + 1, parts, behind, anywhere=False, stops=not behind[look])
            runs = search.at(points)
            if runs:
                self.looks.append((runs, body))
                self.degree = max(self.degree, max(search.degree_of[c] for c in runs) + body.degree)

    def steps(self, n: int) -> tuple[float, str]:
        """At most how many steps a text of ``n`` characters takes, and a word whose
        repetition makes it take them."""
        if self.search is None:
            return float(n if self.degree else 1), ""
        at, words = self.search.steps(n)
        c = max(range(len(at)), key=at.__getitem__)
        best, word = at[c], words[c]
        for runs, body in self.looks:
            inner, inner_word = body.steps(n)
            c = max(runs, key=at.__getitem__)
            if at[c] * inner > best:
                best, word = at[c] * inner, inner_word or words[c]
        return best, word


@dataclass(frozen=True, slots=True)
class _Analysis:
    exponential: str | None
    work: _Work | None


@lru_cache(maxsize=4096)
def _analyse(pattern: str) -> _Analysis:
    parser = _Parser(pattern)
    tree = parser.parse()
    nodes = (tree, *parser.lookarounds)
    for node in nodes:
        automaton = _Automaton()
        automaton.build(node)
        word = _ambiguous_word(automaton)
        if word is not None:
            return _Analysis(word, None)
    parts: list[Built] = []
    for node in nodes:
        automaton = _Automaton(counted=True)
        parts.append((automaton, automaton.build(node)))
    if any(_ambiguous_word(automaton) is not None for automaton, _ in parts):
        parts = []  # loops in place of copies read some text in more ways: the copies, then
        for node in nodes:
            automaton = _Automaton()
            parts.append((automaton, automaton.build(node)))
    return _Analysis(None, _Work(0, parts, parser.behind, anywhere=True, stops=True))


def steps(pattern: str, n: int) -> float:
    """At most how many steps searching a text of ``n`` characters that almost matches
    takes; for a pattern ``exponential_word`` passes (raises ``Unanalysable`` as it does).

    Lookbehinds are decided as if they read forwards and ran to the end of their body;
    a ``$`` under the ``m`` flag as the end of the text alone, and a ``^`` under it as
    no anchor (each can only add to the work)."""
    work = _analyse(pattern).work
    return 0.0 if work is None else work.steps(n)[0]


def growth(pattern: str) -> Growth | None:
    """How searching a text grows with its length, past linear; None when it is at most
    linear, or exponential (``exponential_word``). Raises ``Unanalysable`` as that does."""
    work = _analyse(pattern).work
    if work is None or work.degree < 2:
        return None
    return Growth(work.degree, work.steps(LONGEST_TEXT)[1])


@lru_cache(maxsize=4096)
def longest_text(pattern: str) -> int | None:
    """The longest text ``pattern`` may be searched in within ``STEP_BUDGET``; None when
    any text may be, and for a pattern no contract can carry (exponential, or not
    analysable)."""
    try:
        work = _analyse(pattern).work
    except Unanalysable:
        return None
    if work is None or work.steps(LONGEST_TEXT)[0] <= STEP_BUDGET:
        return None
    low, high = 0, LONGEST_TEXT  # steps grow with n: low is within the budget, high is not
    while high - low > 1:
        middle = (low + high) // 2
        if work.steps(middle)[0] <= STEP_BUDGET:
            low = middle
        else:
            high = middle
    return low


def explain_length(pattern: str, longest: int | None, bound: str) -> str | None:
    """Why ``pattern`` may not be searched in texts of up to ``longest`` characters (None:
    of any length), which ``bound`` limits, or None. For a pattern ``explain`` passes."""
    limit = longest_text(pattern)
    work = _analyse(pattern).work
    if work is None or limit is None or (longest is not None and longest <= limit):
        return None
    n = LONGEST_TEXT if longest is None else min(longest, LONGEST_TEXT)
    most, word = work.steps(n)
    why = (
        f"{word!r} repeated; the work grows as n^{work.degree}"
        if work.degree > 1
        else f"repetitions that each read {word!r} split a run of it in many ways"
    )
    has = f"it has {longest}" if longest is not None else "it has none"
    return (
        f"can take {most:.1e} steps on a text of {n:,} characters that almost matches "
        f"({why}), and a search may take {STEP_BUDGET:,}: give it a {bound} of at most "
        f"{limit} ({has})"
    )


def exponential_word(pattern: str) -> str | None:
    """A word that the pattern can read, looping, in two ways (so n repetitions of it in
    2^n ways), or None when the pattern's ambiguity is at most polynomial.

    Raises ``Unanalysable`` on syntax outside ECMA-262's unicode mode."""
    return _analyse(pattern).exponential


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
