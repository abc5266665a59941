"""Build hook: the ahead-of-time CUDA build ``ragged._C``, only with ``RAGGED_BUILD_CUDA=1``.

``pip install -e .`` (the default) builds nothing: the CUDA C++ kernels are compiled at first use
through NVRTC. ``RAGGED_BUILD_CUDA=1 pip install .`` (or ``pip wheel .``) compiles ``csrc/*.cu``
with nvcc for the architectures of ``RAGGED_CUDA_ARCHS`` (default ``80;90``, plus ``100`` and
``120`` when the installed nvcc knows them; PTX of the highest is embedded too) and links them with
the pybind11 binding ``csrc/aot.cpp`` into ``ragged/_C``.

Why setuptools with a custom ``build_ext`` rather than scikit-build-core + CMake: the project
already builds with setuptools, the binding is one file with no torch dependency, and the only
step CMake would add is running nvcc; the kernel table comes from the NVRTC path's own parser
(``ragged/kernels/cuda/instances.py``, standard library only, loaded here by its path), which a
CMake build would have to call from Python anyway.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.editable_wheel import editable_wheel

ROOT = pathlib.Path(__file__).resolve().parent
SOURCES = ("attention_short.cu", "fused.cu", "pack.cu")


def _instances():
    path = ROOT / "ragged" / "kernels" / "cuda" / "instances.py"
    spec = importlib.util.spec_from_file_location("_ragged_build_instances", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _nvcc() -> str:
    nvcc = shutil.which("nvcc") or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
    if not os.path.exists(nvcc):
        raise RuntimeError("RAGGED_BUILD_CUDA=1 needs nvcc (on PATH or in $CUDA_HOME/bin)")
    return nvcc


def _archs(nvcc: str) -> list[int]:
    given = os.environ.get("RAGGED_CUDA_ARCHS")
    if given:
        return sorted({int(a) for a in re.split(r"[;, ]+", given.strip()) if a})
    known = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True).stdout
    archs = [80, 90] + [a for a in (100, 120) if f"compute_{a}" in known]
    return archs


class NvccBuild(build_ext):
    """Compile ``ragged._C`` with nvcc (see the module docstring)."""

    def build_extension(self, ext: Extension) -> None:
        import pybind11

        nvcc = _nvcc()
        archs = _archs(nvcc)
        version = re.search(
            r"release ([\d.]+)", subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
        )
        version = version.group(1) if version else ""
        tmp = pathlib.Path(self.build_temp) / "ragged_aot"
        tmp.mkdir(parents=True, exist_ok=True)
        gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
        gencode.append(f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}")
        common = ["-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-DNDEBUG"]
        parse = _instances().parse
        units, tables = [], []
        for src in SOURCES:
            stem = src[:-3]
            names = sorted(parse(src, (ROOT / "csrc" / src).read_text()))
            unit = tmp / f"{stem}_aot.cu"
            rows = "\n".join(f'    {{"{n}", (const void*)&{n}}},' for n in names)
            unit.write_text(
                f'#include "{(ROOT / "csrc" / src).as_posix()}"\n\n'
                "struct RaggedAotEntry { const char* name; const void* stub; };\n"
                f"static const RaggedAotEntry ragged_aot_{stem}[] = {{\n{rows}\n}};\n"
                f'extern "C" const RaggedAotEntry* ragged_aot_table_{stem}(int* n) '
                f"{{ *n = {len(names)}; return ragged_aot_{stem}; }}\n"
            )
            units.append(unit)
            tables.append(stem)
        registry = tmp / "registry.cpp"
        registry.write_text(
            "#include <vector>\nstruct RaggedAotEntry { const char* name; const void* stub; };\n"
            + "".join(f'extern "C" const RaggedAotEntry* ragged_aot_table_{t}(int* n);\n' for t in tables)
            + 'extern "C" const RaggedAotEntry* ragged_aot_kernels(int* count) {\n'
            "    static const std::vector<RaggedAotEntry> all = [] {\n"
            "        std::vector<RaggedAotEntry> v; int n = 0; const RaggedAotEntry* e;\n"
            + "".join(f"        e = ragged_aot_table_{t}(&n); v.insert(v.end(), e, e + n);\n" for t in tables)
            + "        return v;\n    }();\n    *count = (int)all.size();\n    return all.data();\n}\n"
        )
        binding_flags = [
            f"-I{pybind11.get_include()}",
            f"-I{sysconfig.get_paths()['include']}",
            f'-DRAGGED_AOT_ARCHS="{",".join(map(str, archs))}"',
            f"-DRAGGED_AOT_PTX={archs[-1]}",
            f'-DRAGGED_AOT_NVCC="{version}"',
        ]
        jobs = [
            ([nvcc, *common, *gencode, "-c", str(u), "-o", str(u.with_suffix(".o"))], u.with_suffix(".o"))
            for u in units
        ]
        jobs.append(([nvcc, *common, "-c", str(registry), "-o", str(tmp / "registry.o")], tmp / "registry.o"))
        jobs.append(
            (
                [nvcc, *common, *binding_flags, "-c", str(ROOT / "csrc" / "aot.cpp"), "-o", str(tmp / "aot.o")],
                tmp / "aot.o",
            )
        )
        workers = int(os.environ.get("RAGGED_BUILD_JOBS", str(min(len(jobs), os.cpu_count() or 1))))
        print(f"ragged._C: nvcc {version}, sm {archs}, {len(jobs)} compiles on {workers} workers", flush=True)
        with ThreadPoolExecutor(workers) as pool:
            done = list(pool.map(lambda job: subprocess.run(job[0], capture_output=True, text=True), jobs))
        for (cmd, _), result in zip(jobs, done):
            if result.returncode != 0:
                raise RuntimeError(f"ragged._C: {' '.join(cmd)} failed:\n{result.stdout}{result.stderr}")
        out = pathlib.Path(self.get_ext_fullpath(ext.name))
        out.parent.mkdir(parents=True, exist_ok=True)
        link = subprocess.run(
            [nvcc, "-shared", "-cudart", "static", *[str(o) for _, o in jobs], "-o", str(out)],
            capture_output=True,
            text=True,
        )
        if link.returncode != 0:
            raise RuntimeError(f"ragged._C: link failed:\n{link.stdout}{link.stderr}")


# An editable install maps ``ragged`` and ``ragged.nn`` (from ``nn/``) through setuptools' meta path
# finder, which Python asks only after its path finder. A script run from the clone's parent folder
# has that folder first on sys.path, where the clone itself (a folder named like the package, with no
# ``__init__.py``) is a namespace package: the path finder returns it and ``import ragged`` gives an
# empty module. This start-up line (a .pth file runs after setuptools' own, by name order) moves the
# project's finder in front of the path finder, so the editable install wins wherever Python starts.
FINDER_FIRST_PTH = "ragged-editable-finder-first.pth"
FINDER_FIRST_LINE = (
    "import sys; sys.meta_path.sort(key=lambda finder: not getattr(finder, '__module__', '')"
    ".startswith('__editable___ragged_'))\n"
)


class _FinderFirst:
    """setuptools' editable strategy, plus the .pth file above."""

    def __init__(self, strategy):
        self.strategy = strategy

    def __enter__(self):
        self.strategy.__enter__()
        return self

    def __exit__(self, *exc):
        return self.strategy.__exit__(*exc)

    def __call__(self, wheel, files, mapping):
        self.strategy(wheel, files, mapping)
        wheel.writestr(FINDER_FIRST_PTH, FINDER_FIRST_LINE.encode())


class EditableWheel(editable_wheel):
    def _select_strategy(self, *args, **kwargs):
        # A private hook of setuptools: where a release renames it, the install stays the default one.
        return _FinderFirst(super()._select_strategy(*args, **kwargs))


ext_modules = [Extension("ragged._C", sources=[])] if os.environ.get("RAGGED_BUILD_CUDA") == "1" else []
cmdclass = {"build_ext": NvccBuild}
if hasattr(editable_wheel, "_select_strategy"):
    cmdclass["editable_wheel"] = EditableWheel
setup(ext_modules=ext_modules, cmdclass=cmdclass)
