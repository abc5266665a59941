"""Loads the CUDA C++ kernels of ``csrc/`` and launches them on torch tensors.

The kernels are compiled at first use through CuPy's NVRTC, so installing ragged needs no
build step; and only the kernel a launch asks for is compiled, not the whole file. A source
defines its ``extern "C"`` entry points by top-level instantiation lines (macro invocations
such as ``RAGGED_ATTENTION_SHORT_TYPES(64, 32, 2, 10)``); :func:`programs` reads them from the
source text itself (the file's ``#define`` s, expanded down to the innermost macro that writes
an ``extern "C"`` definition) and gives each kernel its own program: the whole file with the
instantiation lines blanked (shared code and line numbers kept), then the one macro invocation
that defines it. There is no table of kernels beside the sources, and each ``.cu`` file still
compiles as a whole with every kernel (the nvcc check; an ahead-of-time build).

A program is compiled once per (kernel, device) in this process (CuPy's disk cache, keyed by
the program text and options, keeps it across processes); :func:`precompile` compiles a list
of kernels concurrently (NVRTC runs without the GIL). Kernels are launched on torch's current
stream of the tensor's device, with raw ``data_ptr()`` arguments: no copies, no sync.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import difflib
import functools
import importlib.resources
import os
import pathlib
import re
import struct
import threading
import types
from collections.abc import Mapping

import numpy as np
import torch


@functools.lru_cache(maxsize=None)
def source(name: str) -> str:
    """Text of ``csrc/<name>`` (installed as the ``ragged._csrc`` package data)."""
    try:
        return importlib.resources.files("ragged._csrc").joinpath(name).read_text()
    except (ModuleNotFoundError, FileNotFoundError):
        return (pathlib.Path(__file__).resolve().parents[3] / "csrc" / name).read_text()


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


class _SourceError(ValueError):
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
    raise _SourceError(f"unbalanced parentheses in {what}")


def _split_arguments(text: str) -> tuple[str, ...]:
    """The comma-separated arguments inside ``(...)``, each with its whitespace normalised."""
    args, depth, current = [], 0, []
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
    if len(args) != len(macro.params):
        raise _SourceError(f"{where}: {macro.name} takes {len(macro.params)} arguments, got {len(args)}: {args}")
    values = dict(zip(macro.params, args))
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
            raise _SourceError(f"{where}: {macro.name} uses {t!r}, which the per-kernel programs do not support")
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
                raise _SourceError(f"{what}: expected only macro invocations, got {text[pos:].strip()[:80]!r}")
            return
        name = m.group(1)
        if name not in macros or macros[name].params is None:
            raise _SourceError(f"{what}: {name} is not a function-like macro of the source")
        end = _matching_paren(text, m.end(), what)
        yield name, _split_arguments(text[m.end():end])
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
                raise _SourceError(f"{what}: no function name after extern \"C\"")
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
        called = [n for n in re.findall(r"\b([A-Za-z_]\w*)\s*\(", macro.body)
                  if n in macros and macros[n].params is not None and n not in seen]
        if any([visit(n, seen + (name,)) for n in called]):
            out[name] = False
            return True
        return False

    for name, macro in macros.items():
        if macro.params is not None:
            visit(name, ())
    return out


@functools.lru_cache(maxsize=None)
def programs(src_name: str) -> Mapping[str, Program]:
    """Kernel name -> its :class:`Program`, for every ``extern "C"`` kernel ``csrc/<src_name>``
    instantiates, read from the source text (see the module docstring); read-only."""
    return types.MappingProxyType(_parse(src_name, source(src_name)))


def _parse(src_name: str, text: str) -> dict[str, Program]:
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
            raise _SourceError(f"{where}: an instantiation line inside #if / #ifdef (the per-kernel programs "
                               f"take unconditional instantiation lines only)")
        end = _matching_paren(code, m.end() - 1, where)
        eol = code.find("\n", end)
        rest = code[end:eol if eol >= 0 else len(code)]
        if rest.strip(" \t;\r"):
            raise _SourceError(f"{where}: text after the instantiation {name}(...): {rest.strip()!r}")
        for macro_name, args in _leaves(name, _split_arguments(code[m.end() - 1:end]), macros, defining, where):
            macro = macros[macro_name]
            kernels = _defined_names(_substitute(macro, args, where), where)
            prog = None
            for kernel in kernels:
                if kernel in out:
                    raise _SourceError(f"{where}: kernel {kernel} is also defined at line {out[kernel].line}")
                prog = prog or Program(src_name, kernels, macro_name, tuple(zip(macro.params, args)), line, "")
                out[kernel] = prog
        chunks.append(text[last:m.start()])
        chunks.append(re.sub(r"[^\n]", "", text[m.start():end]))  # blanked, its line breaks kept
        last = end
    chunks.append(text[last:])
    prefix = f'#line 1 "{src_name}"\n' + "".join(chunks)
    return {k: dataclasses.replace(p, prefix=prefix) for k, p in out.items()}


def _leaves(name: str, args: tuple[str, ...], macros: dict[str, _Macro], defining: dict[str, bool], where: str,
            depth: int = 0):
    """(defining macro, arguments) of each ``extern "C"`` definition that ``name(args)`` expands to."""
    if depth > 32:
        raise _SourceError(f"{where}: macro nesting too deep at {name}")
    if defining[name]:
        yield name, args
        return
    body = _substitute(macros[name], args, where)
    for inner, inner_args in _invocations(body, macros, f"{where} (the body of {name})"):
        if inner not in defining:
            raise _SourceError(f"{where}: {name} invokes {inner}, which defines no kernel")
        yield from _leaves(inner, inner_args, macros, defining, where, depth + 1)


def program(src_name: str, kernel: str) -> Program:
    """The :class:`Program` that defines ``kernel`` in ``csrc/<src_name>``."""
    table = programs(src_name)
    prog = table.get(kernel)
    if prog is None:
        close = difflib.get_close_matches(kernel, list(table), n=3)
        hint = f"; closest: {', '.join(close)}" if close else ""
        raise ValueError(f"ragged.kernels.cuda.launch.program(): csrc/{src_name} defines no kernel {kernel!r} "
                         f"(it instantiates {len(table)} kernels{hint})")
    return prog


_OPTIONS = ("-std=c++17",)
# (source, the program's first kernel, device index) -> the compiled cupy.RawModule
_modules: dict[tuple[str, str, int], object] = {}
_compile_locks: dict[tuple[str, str, int], threading.Lock] = {}
_functions: dict[tuple[str, int], object] = {}
_streams: dict[int, object] = {}


def _module(prog: Program, index: int):
    key = (prog.source, prog.kernels[0], index)
    mod = _modules.get(key)
    if mod is None:
        with _compile_locks.setdefault(key, threading.Lock()):  # one compile per program, whichever thread asks
            mod = _modules.get(key)
            if mod is None:
                import cupy

                with cupy.cuda.Device(index):
                    mod = cupy.RawModule(code=prog.text, options=_OPTIONS)
                    mod.compile()
                _modules[key] = mod
    return mod


def precompile(items, device=None, max_workers: int | None = None) -> None:
    """Compile the kernels ``items`` names, ``(src_name, kernel)`` pairs, for ``device`` (a
    ``torch.device``, an index, or None: the current device), each program once, concurrently
    in a pool of threads (NVRTC's compile runs without the GIL); returns when all are loaded.
    Unknown names raise before anything compiles; a failed compile raises once all are done."""
    if device is None:
        index = _current_device()
    elif isinstance(device, int):
        index = device
    else:
        device = torch.device(device)
        index = device.index if device.index is not None else _current_device()
    wanted = [(src_name, kernel, program(src_name, kernel)) for src_name, kernel in items]
    todo = {}
    for _, kernel, prog in wanted:
        if (kernel, index) not in _functions:
            todo.setdefault((prog.source, prog.kernels[0]), prog)
    if len(todo) > 1:
        workers = max(1, min(len(todo), max_workers or os.cpu_count() or 1))
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="ragged-nvrtc") as pool:
            futures = [pool.submit(_module, prog, index) for prog in todo.values()]
        for f in futures:  # every compile has ended: the first failure, if any
            f.result()
    for src_name, kernel, _ in wanted:
        _function(src_name, kernel, index)


def _raw_stream(index: int) -> int:
    try:  # the handle alone, without building a torch.cuda.Stream (about 3 us less per launch)
        return torch._C._cuda_getCurrentRawStream(index)
    except AttributeError:  # pragma: no cover - older torch
        return torch.cuda.current_stream(index).cuda_stream


def _current_device() -> int:
    try:
        return torch._C._cuda_getDevice()
    except AttributeError:  # pragma: no cover - older torch
        return torch.cuda.current_device()


# --------------------------------------------------------------------------------------
# Parameter lists and the driver's launch


_NUMPY_TYPES = {"P": np.uint64, "q": np.int64, "i": np.int32, "I": np.uint32, "f": np.float32}


class Params:
    """A kernel's parameter list, one code per parameter: ``P`` pointer (an int address),
    ``q`` int64, ``i`` int32, ``I`` uint32, ``f`` float32.

    :meth:`pack` lays the values out as the kernel's ABI does (each parameter at its natural
    alignment, the C layout of a struct of them), the buffer ``cuLaunchKernel`` takes through
    ``CU_LAUNCH_PARAM_BUFFER_POINTER``; :meth:`scalars` gives the typed NumPy scalars of the
    CuPy launch (the fallback path)."""

    def __init__(self, codes: str) -> None:
        unknown = set(codes) - set(_NUMPY_TYPES)
        if unknown:
            raise ValueError(f"ragged.kernels.cuda.Params(): unknown parameter codes {sorted(unknown)}")
        self.codes = codes
        self._struct = struct.Struct("@" + codes.replace("P", "Q"))
        self._types = tuple(_NUMPY_TYPES[c] for c in codes)
        self.size = ctypes.c_size_t(self._struct.size)
        self.size_pointer = ctypes.pointer(self.size)

    def pack(self, values) -> bytes:
        return self._struct.pack(*values)

    def scalars(self, values) -> tuple:
        return tuple(t(v) for t, v in zip(self._types, values))


class _LaunchExtra(ctypes.Structure):
    # cuLaunchKernel's `extra` array: BUFFER_POINTER, buffer, BUFFER_SIZE, &size, END.
    _fields_ = [("buffer_key", ctypes.c_void_p), ("buffer", ctypes.c_char_p), ("size_key", ctypes.c_void_p),
                ("size", ctypes.POINTER(ctypes.c_size_t)), ("end", ctypes.c_void_p)]


_CU_LAUNCH_PARAM_BUFFER_POINTER = 1
_CU_LAUNCH_PARAM_BUFFER_SIZE = 2
_driver_launch: list = []  # [cuLaunchKernel through ctypes, or None where the driver library is not found]


def _load_driver_launch():
    """``cuLaunchKernel`` of the CUDA driver library (the one CuPy and torch use), or None."""
    import ctypes.util

    names = ["libcuda.so.1", "libcuda.so", "nvcuda.dll"]
    found = ctypes.util.find_library("cuda")
    if found:
        names.append(found)
    for name in names:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        fn = lib.cuLaunchKernel
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                       ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        return fn
    return None


def _driver():
    if not _driver_launch:
        _driver_launch.append(_load_driver_launch() if DRIVER_LAUNCH else None)
    return _driver_launch[0]


# Launch through the driver directly (about 4 us less host time per launch than CuPy's
# argument handling); False: always through CuPy.
DRIVER_LAUNCH = True


def _function(src_name: str, kernel: str, index: int):
    fn = _functions.get((kernel, index))
    if fn is None:
        fn = _functions[(kernel, index)] = _module(program(src_name, kernel), index).get_function(kernel).kernel
    return fn


def launch(src_name: str, kernel: str, device: torch.device, grid: int, block: tuple[int, int], params: Params,
           values: tuple) -> None:
    """Launch ``kernel`` from ``csrc/<src_name>`` on torch's current stream of ``device``, with
    ``values`` laid out by ``params``.

    On the current device the parameters go to the driver's ``cuLaunchKernel`` as one packed
    buffer; anywhere else (another device, no driver library found, or a launch the driver
    refuses, e.g. a thread without a current context) CuPy launches it, with the device
    made current."""
    index = device.index if device.index is not None else _current_device()
    fn = _function(src_name, kernel, index)
    handle = _raw_stream(index)
    driver = _driver_launch[0] if _driver_launch else _driver()
    if driver is not None and index == _current_device():
        extra = _LaunchExtra(_CU_LAUNCH_PARAM_BUFFER_POINTER, params.pack(values), _CU_LAUNCH_PARAM_BUFFER_SIZE,
                             params.size_pointer, None)
        if driver(fn.ptr, grid, 1, 1, block[0], block[1], 1, 0, handle, None, ctypes.byref(extra)) == 0:
            return
    _cupy_launch(fn, index, handle, grid, block, params.scalars(values))


def _cupy_launch(fn, index: int, handle: int, grid: int, block: tuple[int, int], args: tuple) -> None:
    import cupy

    stream = _streams.get(handle)
    if stream is None:
        stream = _streams[handle] = _wrap_stream(cupy, handle, index)
    with cupy.cuda.Device(index):
        fn((grid,), block, args, stream=stream)


class _StreamHandle:
    """A raw ``cudaStream_t`` exposed through the CUDA stream protocol."""

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


def _wrap_stream(cupy, handle: int, index: int):
    """A CuPy view of torch's stream (``Stream.from_external`` in CuPy >= 14)."""
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:
        with cupy.cuda.Device(index):
            return from_external(_StreamHandle(handle))
    return cupy.cuda.ExternalStream(handle, index)
