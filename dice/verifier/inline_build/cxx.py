"""A small C++ tokenizer and file-scope splitter, enough to cut load_inline sources (see `inline`).

`tokenize` yields tokens with their offsets: identifiers, numbers, string and character literals
(raw strings too), punctuators (`<<<` and `>>>` as one token each), whole preprocessor directives
(their own tokens in `sub`), and whitespace/comments as "ws". `items` groups the tokens into
file-scope declarations (`Item`): a directive, or tokens up to a `;` or the `}` closing a
function body at brace depth 0. `normalise` is the text with comments and whitespace runs
collapsed, for cache keys: what the preprocessor treats alike hashes alike.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property

_TOKEN = re.compile(r"""
  (?P<nl>\n)
| (?P<ws>[ \t\f\v\r]+|\\\n)
| (?P<lc>//[^\n]*)
| (?P<bc>/\*(?:.|\n)*?\*/)
| (?P<raw>(?:u8|u|U|L)?R"(?P<delim>[^()\\\s"]{0,16})\((?:.|\n)*?\)(?P=delim)")
| (?P<str>(?:u8|u|U|L)?"(?:[^"\\\n]|\\(?:.|\n))*")
| (?P<chr>(?:u8|u|U|L)?'(?:[^'\\\n]|\\(?:.|\n))*')
| (?P<num>\.?\d(?:[eEpP][+-]|[\w.']|)*)
| (?P<id>[A-Za-z_$][\w$]*)
| (?P<punct><<<|>>>|<<=|>>=|->\*|\.\.\.|::|->|\+\+|--|<<|>>|&&|\|\||\#\#|[-+*/%&|^!=<>]=
            |[{}\[\]();:,.?~!+\-*/%&|^=<>\#@])
| (?P<bad>[^\n])
""", re.VERBOSE)
_ATTRIBUTES = {"__launch_bounds__", "__attribute__", "alignas", "__align__", "decltype", "__declspec", "sizeof",
               "static_assert", "__cluster_dims__"}


class CxxError(ValueError):
    """Text the tokenizer cannot read (an unterminated comment or literal, a stray character)."""


@dataclass(frozen=True)
class Token:
    kind: str          # id, num, str, chr, punct, pp, ws
    text: str
    start: int
    end: int
    sub: tuple = ()    # a directive's own tokens


def _scan(source: str, pos: int, in_directive: bool):
    """Raw tokens from `pos`; in a directive, to the end of its line and any character goes."""
    while pos < len(source):
        m = _TOKEN.match(source, pos)
        kind = "bad" if m is None else m.lastgroup if m.lastgroup != "delim" else "raw"
        if kind == "nl" and in_directive:
            return
        if kind == "bad" and not in_directive:
            raise CxxError(f"cannot read the C++ source at line {source.count(chr(10), 0, pos) + 1}: "
                           f"{source[pos:pos + 20]!r}")
        end = pos + 1 if m is None else m.end()
        yield Token(kind, source[pos:end], pos, end)
        pos = end


def tokenize(source: str) -> list[Token]:
    """All tokens; directives (a `#` first on its line) become one "pp" token each."""
    out, pos, line_start = [], 0, True
    while pos < len(source):
        t = next(_scan(source, pos, False))
        if t.kind in ("nl", "ws", "lc", "bc"):
            out.append(Token("ws", t.text, t.start, t.end))
            line_start = line_start and t.kind != "lc" or t.kind == "nl"
        elif t.text == "#" and line_start:
            scanned = list(_scan(source, pos, True))
            sub = tuple(s for s in scanned if s.kind not in ("ws", "lc", "bc"))
            t = Token("pp", source[pos:scanned[-1].end], pos, scanned[-1].end, sub)
            out.append(t)
        else:
            out.append(Token("str" if t.kind == "raw" else t.kind, t.text, t.start, t.end))
            line_start = False
        pos = t.end
    return out


def directive(token: Token) -> tuple[str, str]:
    """(name, the text after it) of a "pp" token: ("include", " <cuda.h>")."""
    sub = token.sub
    if len(sub) < 2 or sub[1].kind != "id":
        return "", ""
    return sub[1].text, token.text[sub[1].end - token.start:]


def normalise(source: str) -> str:
    """`source` with comments and whitespace runs collapsed (to a newline where the run held one)."""
    source = source.replace("\\\n", "")
    try:
        tokens = list(_scan(source, 0, False))
    except CxxError:
        return source.strip()
    out, gap = [], ""
    for t in tokens:
        if t.kind in ("nl", "ws", "lc", "bc"):
            gap = "\n" if gap == "\n" or t.kind == "nl" else " "   # a comment is one space (phase 3)
            continue
        out += [gap, t.text]
        gap = ""
    return "".join(out).strip()


@dataclass
class Item:
    """One file-scope declaration or directive, as tokens (no whitespace) with the span it covers."""
    tokens: list[Token]
    line: int
    directive: bool = field(init=False)

    def __post_init__(self):
        self.directive = self.tokens[0].kind == "pp"

    @property
    def start(self) -> int:
        return self.tokens[0].start

    @property
    def end(self) -> int:
        return self.tokens[-1].end

    @cached_property
    def ids(self) -> set[str]:
        """Every identifier, those inside nested directives included."""
        found = set()
        for t in self.tokens:
            found |= {s.text for s in t.sub if s.kind == "id"} if t.kind == "pp" else {t.text} if t.kind == "id" else set()
        return found

    @cached_property
    def header(self) -> str | None:
        m = re.match(r'#\s*include\s*([<"])([^>"]+)[>"]', self.tokens[0].text) if self.directive else None
        return m.group(2).strip() if m else None

    @cached_property
    def head(self) -> list[Token]:
        """Tokens before the first `{` or `=` at depth 0."""
        depth = 0
        for i, t in enumerate(self.tokens):
            if depth == 0 and t.text in ("{", "=", ";") and t.kind == "punct":
                return self.tokens[:i]
            depth += t.text in "([" and t.kind == "punct"
            depth -= t.text in ")]" and t.kind == "punct"
        return self.tokens

    @cached_property
    def _call(self) -> tuple[str | None, list[Token] | None]:
        """(name, parameter tokens) of a function declaration, else (None, None)."""
        head, i = self.head, 0
        while i < len(head):
            t = head[i]
            if t.text == "(" and t.kind == "punct":
                close = _matching(head, i)
                before = head[i - 1] if i else None
                if before is not None and before.kind == "id" and before.text not in _ATTRIBUTES:
                    return before.text, head[i + 1:close]
                i = close
            i += 1
        return None, None

    @property
    def name(self) -> str | None:
        return self._call[0]

    @property
    def param_tokens(self) -> list[Token] | None:
        return self._call[1]

    @cached_property
    def words(self) -> list[str]:
        """The head's words after any `template<...>` and `typedef`."""
        words = [t.text for t in self.head]
        if words[:1] == ["template"] and "<" in words:
            depth = 0
            for i, w in enumerate(words):
                depth += w == "<"
                depth -= w == ">"
                if depth == 0 and w == ">":
                    words = words[i + 1:]
                    break
        return words[1:] if words[:1] == ["typedef"] else words

    @property
    def is_type(self) -> bool:
        return self.words[:1] in (["struct"], ["class"], ["union"], ["enum"]) and self.name is None

    @property
    def is_const_value(self) -> bool:
        """`const int N = 4;` / `static const float EPS = 1e-5f;`: a constant, internal linkage."""
        words = [t.text for t in self.head]
        return "const" in words and self.name is None and not {"*", "&", "&&", "extern"} & set(words) \
            and len(self.head) < len(self.tokens) and self.tokens[len(self.head)].text == "="

    @property
    def body_after_string(self) -> bool:
        """`extern "C" { ... }`."""
        return len(self.tokens) > 2 and self.tokens[1].kind == "str" and self.tokens[2].text == "{"

    @cached_property
    def declared(self) -> set[str]:
        """Names this item declares (approximately: functions, variables, types, aliases)."""
        if self.name is not None:
            return {self.name}
        # initializer: from a top-level `=` to the next `,` or `;`, where names are used, not declared
        toks, names, depth, initializer = self.tokens, set(), 0, False
        for i, t in enumerate(toks):
            if t.kind == "punct" and t.text in ("(", "[", "{"):
                if depth == 0 and i and toks[i - 1].kind == "id" and t.text != "(" and not initializer:
                    names.add(toks[i - 1].text)
                depth += 1
            elif t.kind == "punct" and t.text in (")", "]", "}"):
                depth -= 1
            elif depth == 0 and t.text in (",", "=", ";"):
                if i and toks[i - 1].kind == "id" and not initializer:
                    names.add(toks[i - 1].text)
                initializer = t.text == "="
        if self.words[:1] in (["struct"], ["class"], ["union"], ["enum"]) and len(self.words) > 1:
            names.add(self.words[2] if self.words[1] == "class" and len(self.words) > 2 else self.words[1])
        if self.words[:1] == ["using"] and len(self.words) > 1:
            names.add(self.words[1])
        return names - {"struct", "class", "union", "enum", "namespace"}


def _matching(tokens: list[Token], i: int) -> int:
    """Index of the bracket closing tokens[i] (or the last index if unbalanced)."""
    pairs, depth = {"(": ")", "[": "]", "{": "}"}, 0
    opener, closer = tokens[i].text, pairs[tokens[i].text]
    for j in range(i, len(tokens)):
        if tokens[j].kind == "punct":
            depth += tokens[j].text == opener
            depth -= tokens[j].text == closer
            if depth == 0:
                return j
    return len(tokens) - 1


def items(tokens: list[Token]) -> list[Item]:
    """File-scope items: directives at depth 0, declarations ending in `;`, function bodies."""
    out, current, depth, source_lines = [], [], 0, _LineCounter(tokens)
    for t in tokens:
        if t.kind == "ws":
            continue
        if t.kind == "pp" and depth == 0:
            if current:
                raise CxxError(f"a directive inside the declaration on line {source_lines(current[0])}")
            out.append(Item([t], source_lines(t)))
            continue
        current.append(t)
        if t.kind != "punct":
            continue
        depth += t.text in "([{"
        depth -= t.text in ")]}"
        if depth < 0:
            raise CxxError(f"unbalanced {t.text!r} on line {source_lines(t)}")
        if depth == 0 and (t.text == ";" or t.text == "}" and _ends_at_brace(current)):
            out.append(Item(current, source_lines(current[0])))
            current = []
    if current:
        raise CxxError(f"the declaration on line {source_lines(current[0])} is not terminated")
    return [i for i in out if [t.text for t in i.tokens] != [";"]]


def _ends_at_brace(tokens: list[Token]) -> bool:
    """A `}` at depth 0 ends a function body, not a class body or a braced initializer."""
    item = Item(tokens, 0)
    return not (item.words[:1] in (["struct"], ["class"], ["union"], ["enum"]) and item.name is None
                or len(item.head) < len(tokens) and tokens[len(item.head)].text == "="
                or [t.text for t in tokens[:1]] == ["typedef"])


class _LineCounter:
    """Line numbers of token offsets, counted incrementally."""

    def __init__(self, tokens: list[Token]):
        self.tokens, self.at, self.line = tokens, 0, 1

    def __call__(self, token: Token) -> int:
        for t in self.tokens[self.at:]:
            if t.start >= token.start:
                break
            self.line += t.text.count("\n")
            self.at += 1
        return self.line
