"""The ``extern "C"`` kernels a ``csrc/`` source instantiates, read from its text: one program
per kernel for the NVRTC path (:mod:`.launch`) and the kernel table of the ahead-of-time build
(``setup.py``), from the same parser, so neither keeps a list of kernels beside the sources.

Imports nothing but the standard library: the build loads this file by its path, before
torch or ragged can be imported.
"""

from __future__ import annotations

import dataclasses
import re

__all__ = ["Program", "SourceError", "parse"]


# --------------------------------------------------------------------------------------
# One program per kernel, read from the source text
#
# The preprocessing this needs, done on the source's own #defines: function-like macros with
# named parameters, substitution of plain arguments, ``##`` pasting. An instantiation line is a
# top-level, unconditional invocation of a macro whose expansion writes ``extern "C"``
# definitions; a group macro's body is nothing but invocations of other such macros. Anything
# else there (``#`` stringizing, variadic macros, an instantiation under ``#if``, a group body
# with other text) is refused with the source's name rather than guessed at.
# tests/test_cuda_jit_units.py checks every program against nvcc's own preprocessor.


_TOKEN = re.compile(r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|[A-Za-z_]\w*|\d[\w.]*|##|\s+|.', re.S)
_COMMENT = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.S)
_DEFINE = re.compile(r"#\s*define\s+([A-Za-z_]\w*)(\([^)]*\))?(.*)", re.S)
_CONDITIONAL = re.compile(r"#\s*(if|ifdef|ifndef|endif)\b")
_LINE_START = re.compile(r"^([A-Za-z_]\w*)[ \t]*\(", re.M)
_INVOCATION = re.compile(r"\s*([A-Za-z_]\w*)\s*(?=\()")


@dataclasses.dataclass(frozen=True)
class _Macro:
    name: str
    params: tuple[str, ...] | None  # None: an object-like macro
    body: str


@dataclasses.dataclass(frozen=True)
class Program:
    """The NVRTC program of one kernel of ``csrc/<source>``: :attr:`text` is the source with every
    instantiation line blanked, then ``#line`` and :attr:`invocation`, the invocation of the
    innermost macro that defines :attr:`kernels` (one kernel in ragged's sources), its
    arguments as the instantiation line ``line`` (1-based) gives them."""

    source: str
    kernels: tuple[str, ...]
    macro: str
    arguments: tuple[tuple[str, str], ...]  # (parameter, argument) of the macro
    line: int
    prefix: str = dataclasses.field(repr=False, compare=False)

    @property
    def invocation(self) -> str:
        return f"{self.macro}({', '.join(a for _, a in self.arguments)})"

    @property
    def text(self) -> str:
        return f'{self.prefix}\n#line {self.line} "{self.source}"\n{self.invocation}\n'


class SourceError(ValueError):
    pass


def _blank_comments(text: str) -> str:
    """``text`` with comments replaced by spaces (newlines kept): the same offsets and lines."""

    def repl(m):
        t = m.group(0)
        return t if t[0] in "\"'" else re.sub(r"[^\n]", " ", t)

    return _COMMENT.sub(repl, text)


def _logical_lines(code: str):
    """(start offset, end offset, text with continuations joined) of each logical line."""
    start, pos, parts = 0, 0, []
    for line in code.splitlines(keepends=True):
        body = line.rstrip("\r\n")
        pos += len(line)
        if body.endswith("\\"):
            parts.append(body[:-1])
            continue
        parts.append(body)
        yield start, pos, "\n".join(parts)
        start, parts = pos, []
    if parts:
        yield start, pos, "\n".join(parts)


def _matching_paren(text: str, open_at: int, what: str) -> int:
    """Offset just past the ``)`` that closes the ``(`` at ``open_at``."""
    depth = 0
    for m in _TOKEN.finditer(text, open_at):
        t = m.group(0)
        if t == "(":
            depth += 1
        elif t == ")":
            depth -= 1
            if depth == 0:
                return m.end()
    raise SourceError(f"unbalanced parentheses in {what}")


def _split_arguments(text: str) -> tuple[str, ...]:
    """The comma-separated arguments inside ``(...)``, each with its whitespace normalised."""
    args: list[list[str]] = []
    depth = 0
    current: list[str] = []
    for m in _TOKEN.finditer(text, 1, len(text) - 1):
        t = m.group(0)
        if t == "," and depth == 0:
            args.append(current)
            current = []
            continue
        depth += (t == "(") - (t == ")")
        current.append(t)
    args.append(current)
    out = tuple(" ".join("".join(a).split()) for a in args)
    return () if out == ("",) else out


def _substitute(macro: _Macro, args: tuple[str, ...], where: str) -> str:
    """The body of ``macro`` with its parameters replaced by ``args`` and ``##`` pasted."""
    params = macro.params or ()
    if len(args) != len(params):
        raise SourceError(f"{where}: {macro.name} takes {len(params)} arguments, got {len(args)}: {args}")
    values = dict(zip(params, args))
    out: list[str] = []
    paste = False
    for t in (m.group(0) for m in _TOKEN.finditer(macro.body)):
        if t.isspace():
            if not paste:
                out.append(" ")
            continue
        if t == "##":
            while out and out[-1] == " ":
                out.pop()
            paste = True
            continue
        if t == "#" or t == "__VA_ARGS__":
            raise SourceError(f"{where}: {macro.name} uses {t!r}, which the per-kernel programs do not support")
        out.append(values.get(t, t))
        paste = False
    return "".join(out).strip()


def _invocations(text: str, macros: dict[str, _Macro], what: str):
    """Yield (macro name, arguments) of every function-like macro of ``macros`` invoked in ``text``,
    which must hold nothing else."""
    pos = 0
    while True:
        m = _INVOCATION.match(text, pos)
        if m is None:
            if text[pos:].strip():
                raise SourceError(f"{what}: expected only macro invocations, got {text[pos:].strip()[:80]!r}")
            return
        name = m.group(1)
        if name not in macros or macros[name].params is None:
            raise SourceError(f"{what}: {name} is not a function-like macro of the source")
        end = _matching_paren(text, m.end(), what)
        yield name, _split_arguments(text[m.end() : end])
        pos = end


def _defined_names(text: str, what: str) -> tuple[str, ...]:
    """The ``extern "C"`` functions a macro expansion defines, in order."""
    tokens = [t for t in (m.group(0) for m in _TOKEN.finditer(text)) if not t.isspace()]
    names = []
    for i, t in enumerate(tokens):
        if t == "extern" and i + 1 < len(tokens) and tokens[i + 1] == '"C"':
            j = i + 2
            while j < len(tokens):  # the name is the identifier before the first ( outside __launch_bounds__(...)
                if tokens[j] == "__launch_bounds__":
                    depth, j = 0, j + 1
                    while j < len(tokens):
                        depth += (tokens[j] == "(") - (tokens[j] == ")")
                        j += 1
                        if depth == 0:
                            break
                    continue
                if tokens[j] == "(":
                    names.append(tokens[j - 1])
                    break
                j += 1
            else:
                raise SourceError(f'{what}: no function name after extern "C"')
    return tuple(names)


def _kernel_macros(macros: dict[str, _Macro]) -> dict[str, bool]:
    """Function-like macro -> whether its own body writes ``extern "C"`` (True: a defining macro)
    or False (a group: it invokes defining macros); macros that lead to no kernel are absent."""
    out: dict[str, bool] = {}

    def visit(name: str, seen: tuple[str, ...]) -> bool:
        if name in out:
            return True
        macro = macros[name]
        if re.search(r'\bextern\s*"C"', macro.body):
            out[name] = True
            return True
        called = [
            n
            for n in re.findall(r"\b([A-Za-z_]\w*)\s*\(", macro.body)
            if n in macros and macros[n].params is not None and n not in seen
        ]
        if any([visit(n, seen + (name,)) for n in called]):
            out[name] = False
            return True
        return False

    for name, macro in macros.items():
        if macro.params is not None:
            visit(name, ())
    return out


def parse(src_name: str, text: str) -> dict[str, Program]:
    """Kernel name -> its :class:`Program` for the source ``text`` of ``csrc/<src_name>``."""
    what = f"csrc/{src_name}"
    code = _blank_comments(text)
    macros: dict[str, _Macro] = {}
    directives: list[tuple[int, int]] = []
    conditionals: list[tuple[int, int]] = []  # (offset, +1 / -1)
    for start, end, line in _logical_lines(code):
        stripped = line.lstrip()
        if not stripped.startswith("#"):
            continue
        directives.append((start, end))
        m = _DEFINE.match(stripped)
        if m:
            params = None
            if m.group(2) is not None:
                params = tuple(p.strip() for p in m.group(2)[1:-1].split(",") if p.strip())
            macros[m.group(1)] = _Macro(m.group(1), params, m.group(3).strip())
        c = _CONDITIONAL.match(stripped)
        if c:
            conditionals.append((start, -1 if c.group(1) == "endif" else 1))
    defining = _kernel_macros(macros)

    def inside_directive(offset: int) -> bool:
        return any(a <= offset < b for a, b in directives)

    def conditional_depth(offset: int) -> int:
        return sum(d for at, d in conditionals if at < offset)

    out: dict[str, Program] = {}
    chunks, last = [], 0
    for m in _LINE_START.finditer(code):
        name = m.group(1)
        if name not in defining or inside_directive(m.start()):
            continue
        line = code.count("\n", 0, m.start()) + 1
        where = f"{what} line {line}"
        if conditional_depth(m.start()):
            raise SourceError(
                f"{where}: an instantiation line inside #if / #ifdef (the per-kernel programs "
                f"take unconditional instantiation lines only)"
            )
        end = _matching_paren(code, m.end() - 1, where)
        eol = code.find("\n", end)
        rest = code[end : eol if eol >= 0 else len(code)]
        if rest.strip(" \t;\r"):
            raise SourceError(f"{where}: text after the instantiation {name}(...): {rest.strip()!r}")
        for macro_name, args in _leaves(name, _split_arguments(code[m.end() - 1 : end]), macros, defining, where):
            macro = macros[macro_name]
            kernels = _defined_names(_substitute(macro, args, where), where)
            prog = None
            for kernel in kernels:
                if kernel in out:
                    raise SourceError(f"{where}: kernel {kernel} is also defined at line {out[kernel].line}")
                prog = prog or Program(src_name, kernels, macro_name, tuple(zip(macro.params or (), args)), line, "")
                out[kernel] = prog
        chunks.append(text[last : m.start()])
        chunks.append(re.sub(r"[^\n]", "", text[m.start() : end]))  # blanked, its line breaks kept
        last = end
    chunks.append(text[last:])
    prefix = f'#line 1 "{src_name}"\n' + "".join(chunks)
    return {k: dataclasses.replace(p, prefix=prefix) for k, p in out.items()}


def _leaves(
    name: str, args: tuple[str, ...], macros: dict[str, _Macro], defining: dict[str, bool], where: str, depth: int = 0
):
    """(defining macro, arguments) of each ``extern "C"`` definition that ``name(args)`` expands to."""
    if depth > 32:
        raise SourceError(f"{where}: macro nesting too deep at {name}")
    if defining[name]:
        yield name, args
        return
    body = _substitute(macros[name], args, where)
    for inner, inner_args in _invocations(body, macros, f"{where} (the body of {name})"):
        if inner not in defining:
            raise SourceError(f"{where}: {name} invokes {inner}, which defines no kernel")
        yield from _leaves(inner, inner_args, macros, defining, where, depth + 1)
