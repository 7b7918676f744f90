"""Rewrite Metal source into C++ that compiles against csrc/metal_compat.h.

The rewrite works on tokens and keeps every newline, so line numbers in g++
messages are those of the Metal source. It does, in order:

1. drops attributes: ``[[kernel]]``, ``[[buffer(0)]]``, ``[[thread_position_in_grid]]``;
2. turns half/bfloat literals (``1.0h``, ``2bf``) into casts;
3. routes ``reinterpret_cast``/``const_cast`` through helpers that also cast
   checked pointers;
4. turns multi-letter swizzles into member templates: ``v.xy`` ->
   ``v.template swz<0, 1>()``, and ``v.xy = e`` -> ``v.template swzref<0, 1>() = e``;
5. rewrites address spaces: ``[const] device T*`` -> ``emu::device_ptr<[const] T>``,
   ``constant T*`` -> ``emu::constant_ptr<const T>`` (a distinct type: a cast to
   ``device`` does not compile, as on Apple's compiler), ``threadgroup T*`` ->
   ``emu::tg_ptr<T>``, ``device T&`` -> ``emu::device_ref<T>``,
   ``threadgroup T name[A][B];`` -> per-worker storage shared by the
   threadgroup's fibers, and drops ``thread`` and leftover qualifiers.
"""

import re

from .errors import MetalCompileError

_TOKEN_RE = re.compile(
    r"""
    (?P<ws>\s+)
  | (?P<comment>//[^\n]*|/\*.*?\*/)
  | (?P<string>"(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*')
  | (?P<number>\.?\d(?:[eEpP][+-]|[\w.])*)
  | (?P<ident>[A-Za-z_]\w*)
  | (?P<punct>>>=|<<=|\.\.\.|->\*|::|->|\+\+|--|<<|>>|<=|>=|==|!=|&&|\|\||
               \+=|-=|\*=|/=|%=|&=|\|=|\^=|\#\#|.)
    """,
    re.S | re.X,
)

_ADDRESS_SPACES = {"device", "constant", "threadgroup", "thread"}
_ASSIGN_OPS = {"=", "+=", "-=", "*=", "/=", "%=", "&=", "|=", "^=", "<<=", ">>=", "++", "--"}
_SWIZZLE_RE = re.compile(r"^(?:[xyzw]{2,4}|[rgba]{2,4})$")
_SWIZZLE_INDEX = {c: i for i, c in enumerate("xyzw")} | {c: i for i, c in enumerate("rgba")}
_BUILTIN_TYPE_WORDS = {"unsigned", "signed", "long", "short", "int", "char"}
_HALF_LITERAL_RE = re.compile(r"^((?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)(h|H|bf|BF)$")


class TranslateError(MetalCompileError):
    """The Metal source uses a construct the emulator cannot translate."""


class _Tok:
    __slots__ = ("kind", "text")

    def __init__(self, kind, text):
        self.kind = kind
        self.text = text

    def __repr__(self):
        return f"{self.kind}:{self.text!r}"


def tokenize(source: str) -> list[_Tok]:
    return [_Tok(m.lastgroup, m.group()) for m in _TOKEN_RE.finditer(source)]


def _text(toks) -> str:
    return "".join(t.text for t in toks)


class _Edit:
    """Token list plus the positions of its significant tokens."""

    def __init__(self, source: str):
        self.toks = tokenize(source)
        self.sig = [i for i, t in enumerate(self.toks) if t.kind not in ("ws", "comment")]

    def t(self, k: int) -> str:
        """Text of the k-th significant token ('' past either end)."""
        return self.toks[self.sig[k]].text if 0 <= k < len(self.sig) else ""

    def kind(self, k: int) -> str:
        return self.toks[self.sig[k]].kind if 0 <= k < len(self.sig) else ""

    def replace(self, k0: int, k1: int, text: str) -> None:
        """Replace significant tokens k0..k1 (inclusive) and what lies between,
        keeping the newlines of the replaced span."""
        i0, i1 = self.sig[k0], self.sig[k1]
        newlines = sum(self.toks[i].text.count("\n") for i in range(i0, i1 + 1))
        self.toks[i0].text = text + "\n" * newlines
        for i in range(i0 + 1, i1 + 1):
            self.toks[i].text = ""

    def result(self) -> str:
        return _text(self.toks)


def _closing_bracket(e, j: int) -> int:
    """Index of the ']' closing the '[' at token j, or len(e.sig) when it is unterminated."""
    depth = 0
    while j < len(e.sig):
        if e.t(j) == "[":
            depth += 1
        elif e.t(j) == "]":
            depth -= 1
            if depth == 0:
                return j
        j += 1
    return j


def _strip_attributes(source: str) -> str:
    e = _Edit(source)
    k = 0
    while k < len(e.sig):
        if e.t(k) == "[" and e.t(k + 1) == "[" and e.kind(k + 2) == "ident":
            j = _closing_bracket(e, k)
            e.replace(k, j, " ")
            k = j + 1
        else:
            k += 1
    return e.result()


def _literals_and_casts(source: str) -> str:
    e = _Edit(source)
    for k in range(len(e.sig)):
        text, kind = e.t(k), e.kind(k)
        if kind == "number":
            m = _HALF_LITERAL_RE.match(text)
            if m:
                value = m.group(1)
                if not any(c in value for c in ".eE"):
                    value += ".0"
                ctype = "half" if m.group(2) in ("h", "H") else "bfloat16_t"
                e.replace(k, k, f"{ctype}({value}f)")
        elif kind == "ident" and text in ("reinterpret_cast", "const_cast") and e.t(k + 1) == "<":
            if e.t(k - 1) not in (".", "->", "::"):
                e.replace(k, k, f"emu::{text}_")
    return e.result()


def _swizzles(source: str) -> str:
    e = _Edit(source)
    for k in range(1, len(e.sig)):
        text = e.t(k)
        if e.kind(k) != "ident" or e.t(k - 1) not in (".", "->") or not _SWIZZLE_RE.match(text):
            continue
        if e.t(k + 1) == "(":
            continue
        idx = ", ".join(str(_SWIZZLE_INDEX[c]) for c in text)
        member = "swzref" if e.t(k + 1) in _ASSIGN_OPS else "swz"
        e.replace(k, k, f"template {member}<{idx}>()")
    return e.result()


def _skip_angle(e: _Edit, k: int) -> int:
    """k is at '<'; return the index just past the matching '>'."""
    depth = 0
    while k < len(e.sig):
        t = e.t(k)
        if t == "<":
            depth += 1
        elif t == ">":
            depth -= 1
        elif t == ">>":
            depth -= 2
        elif t in (";", "{", "}"):
            raise TranslateError(f"unbalanced '<' in a type near {e.t(k)!r}")
        k += 1
        if depth <= 0:
            return k
    raise TranslateError("unbalanced '<' in a type")


def _parse_type(e: _Edit, k: int) -> int:
    """Parse a type name from k; return the index just past it."""
    start = k
    while k < len(e.sig):
        t = e.t(k)
        if t in ("struct", "class", "typename", "enum"):
            k += 1
        elif t in _BUILTIN_TYPE_WORDS:
            while e.t(k) in _BUILTIN_TYPE_WORDS:
                k += 1
            break
        elif t == "::":
            k += 1
        elif e.kind(k) == "ident" and t not in ("const", "volatile"):
            k += 1
            if e.t(k) == "<":
                k = _skip_angle(e, k)
            if e.t(k) == "::":
                k += 1
                continue
            break
        else:
            break
    return k if k > start else start


def _address_spaces(source: str) -> str:
    e = _Edit(source)
    k = 0
    while k < len(e.sig):
        space = e.t(k)
        if e.kind(k) != "ident" or space not in _ADDRESS_SPACES or e.t(k - 1) in (".", "->", "::"):
            k += 1
            continue
        start, is_const = k, False
        if e.t(k - 1) in ("const", "volatile"):
            # `const` before the space belongs to the pointee, unless it
            # closes a member function's qualifiers: `void f() const thread {`.
            if e.t(k - 2) != ")":
                start, is_const = k - 1, e.t(k - 1) == "const"
        j = k + 1
        while e.t(j) in ("const", "volatile"):
            is_const |= e.t(j) == "const"
            j += 1
        type_start = j
        j = _parse_type(e, j)
        type_text = " ".join(e.t(i) for i in range(type_start, j))
        while e.t(j) in ("const", "volatile"):
            is_const |= e.t(j) == "const"
            j += 1
        nxt = e.t(j)
        const = "const " if is_const else ""
        if type_text and nxt == "*":
            if space == "device":
                e.replace(start, j, f"emu::device_ptr<{const}{type_text}>")
            elif space == "constant":
                e.replace(start, j, f"emu::constant_ptr<const {type_text}>")
            elif space == "threadgroup":
                e.replace(start, j, f"emu::tg_ptr<{const}{type_text}>")
            else:
                e.replace(start, j, f"{const}{type_text}*")
            k = j + 1
        elif type_text and nxt == "&":
            if space == "device" and not is_const:
                e.replace(start, j, f"emu::device_ref<{type_text}>")
            elif space == "constant":
                e.replace(start, j, f"const {type_text}&")
            else:
                e.replace(start, j, f"{const}{type_text}&")
            k = j + 1
        elif type_text and e.kind(j) == "ident" and space == "threadgroup":
            k = _threadgroup_declaration(e, k, start, type_text, j)
        elif type_text and e.kind(j) == "ident" and space == "constant":
            e.replace(k, k, "" if is_const else "const")
            k += 1
        else:
            # A qualifier with nothing to rewrite: `void f() thread`,
            # `device T x` (not valid Metal), `thread T x`.
            e.replace(k, k, " ")
            k += 1
    return e.result()


def _threadgroup_declaration(e: _Edit, k: int, start: int, type_text: str, j: int) -> int:
    """Rewrite `threadgroup T a[N][M], b;` starting with the name at j."""
    if e.t(start) == "const":
        raise TranslateError("a threadgroup variable cannot be const")
    out = []
    while True:
        if e.kind(j) != "ident":
            raise TranslateError(f"cannot parse the threadgroup declaration near {e.t(j)!r}")
        name = e.t(j)
        j += 1
        dims = []
        while e.t(j) == "[":
            d0 = j + 1
            j = _closing_bracket(e, j)
            if j >= len(e.sig):
                raise TranslateError("unterminated array bound in a threadgroup declaration")
            dims.append(" ".join(e.t(i) for i in range(d0, j)))
            j += 1
        args = ", ".join([type_text] + [f"({d})" for d in dims])
        out.append(
            f"static thread_local emu::tg_storage<{args}> {name}__tg; "
            f'auto&& {name} = {name}__tg.enter("{name}");'
        )
        if e.t(j) == ",":
            j += 1
            continue
        if e.t(j) != ";":
            raise TranslateError(
                f"threadgroup variable '{name}' cannot have an initializer (Metal leaves it uninitialized)"
            )
        break
    e.replace(start, j, " ".join(out))
    return j + 1


def translate(source: str) -> str:
    """Metal source -> C++ source for metal_compat.h, line for line."""
    source = _strip_attributes(source)
    source = _literals_and_casts(source)
    source = _swizzles(source)
    return _address_spaces(source)
