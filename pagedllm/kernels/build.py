"""The one loader of the native CPU kernels: each library built from its translation units in cpu/
(with include/ and cpu/ on the include path) by the system C compiler (the one torch.compile's
Inductor needs on CPU anyway), cached (`cache`: a private directory, files keyed by a hash of every
source and header, the compiler and the flags, checked before loading), loaded with ctypes, and its
structs checked against their ctypes mirrors (`abi`).

Flag sets, tried in order until one builds: `-march=native` (everything this CPU has, and its
tuning), then the named instruction-set levels this CPU supports (AVX-512 with BF16 and VNNI, AVX-512,
AVX2 + FMA + F16C), then portable code (the compiler's baseline target: every vector path's generic
C); each with OpenMP, the last also without (a compiler without OpenMP still gives correct
single-threaded kernels). `PAGEDLLM_KERNEL_ISA` forces one set (tests build the AVX2 and portable
code this way on machines that have more). Reassociation lets the compiler sum a dot product's lanes
as a tree instead of a chain of scalar adds (3x on the attention kernel); unlike -ffast-math it
changes no process-wide floating-point state.

Without a working compiler `load` returns None (logged once) and each caller keeps its torch path,
or says what cannot run.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import platform
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pagedllm import envs
from pagedllm.config.utils import cache_root
from pagedllm.kernels import abi, cache
from pagedllm.platforms.cpu import CpuPlatform

logger = logging.getLogger("pagedllm.kernels")

KERNELS = Path(__file__).resolve().parent
INCLUDE = KERNELS / "include"
UNITS = KERNELS / "cpu"
# Part of every build key: changes when the way a build is made or stored changes.
_BUILD_FORMAT = b"pagedllm-kernels-1"
_MATH = ("-O3", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math")
# cpu/build_info.c's bits, in order: what a library was compiled for.
ISA_BITS = ("AVX2", "FMA", "F16C", "AVX-512F", "AVX-512 BF16", "AVX-512 VNNI", "AMX", "OpenMP")


@dataclass(frozen=True)
class Library:
    """A kernel library: its translation units under cpu/ (build_info.c is added to each), the
    structs its callers fill (checked at load), and for the warning where it cannot be built, what
    it is and what runs without it."""

    name: str
    units: tuple[str, ...]
    structs: tuple[type[ctypes.Structure], ...]
    what: str
    otherwise: str


DENSE = Library(
    "dense",
    ("attention_decode.c", "attention_prefill.c", "skinny_gemm.c", "bf16_gemm.c", "llama_decode.c"),
    (abi.StepArgs, abi.LayerArgs, abi.LlamaLayer, abi.LlamaModel, abi.SegmentArgs),
    "CPU kernels (paged attention, few-row and batch-invariant bf16 products, the native decode body)",
    "attention and decode steps use tensor ops and the compiled graphs, which are slower",
)
GGUF = Library(
    "gguf", ("gguf_kernels.c", "gguf_panels.c"), (abi.GGUFMatvec,), "GGUF block kernels", "quantized GGUF layers cannot run"
)
INT4 = Library(
    "int4", ("int4_kernels.c",), (abi.Int4Matvec,), "4-bit (AWQ/GPTQ) kernels", "AWQ/GPTQ layers cannot run"
)
FP8 = Library(
    "fp8",
    ("fp8_kernels.c",),
    (abi.Fp8Matvec,),
    "fp8 kernels",
    "fp8 layers widen slowly and decode through the graphs",
)
LIBRARIES = (DENSE, GGUF, INT4, FP8)


@dataclass(frozen=True)
class FlagSet:
    """Compiler flags for one instruction-set target; `needs`: the CPU flags (/proc/cpuinfo names)
    its code needs to run."""

    name: str
    flags: tuple[str, ...]
    needs: frozenset[str] = frozenset()


_AVX2 = ("-mavx2", "-mfma", "-mf16c")
_AVX512 = (*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")
NATIVE = FlagSet("native", ("-march=native",))
# Named instruction-set levels, best first.
ISA_SETS = (
    FlagSet(
        "avx512-bf16",
        (*_AVX512, "-mavx512bf16", "-mavx512vnni"),
        frozenset(
            {
                "avx2",
                "fma",
                "f16c",
                "avx512f",
                "avx512bw",
                "avx512vl",
                "avx512dq",
                "avx512_bf16",
                "avx512_vnni",
            }
        ),
    ),
    FlagSet(
        "avx512", _AVX512, frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"})
    ),
    FlagSet("avx2", _AVX2, frozenset({"avx2", "fma", "f16c"})),
)
PORTABLE = FlagSet("portable", ())
FLAG_SETS = {s.name: s for s in (NATIVE, *ISA_SETS, PORTABLE)}


class KernelBuildError(RuntimeError):
    """A kernel build asked for something this machine cannot give (a forced flag set it cannot run)."""


@dataclass(frozen=True)
class Loaded:
    """A loaded kernel library and how it was built."""

    cdll: ctypes.CDLL
    library: Library
    flag_set: FlagSet
    openmp: bool
    path: Path

    @property
    def flags(self) -> tuple[str, ...]:
        return _flags(self.flag_set, self.openmp)

    def isa(self) -> tuple[str, ...]:
        """The instruction sets (and OpenMP) its code was compiled for."""
        fn = self.cdll.kernel_isa
        fn.restype = ctypes.c_int64
        bits = fn()
        return tuple(name for i, name in enumerate(ISA_BITS) if bits >> i & 1)


def _flags(flag_set: FlagSet, openmp: bool) -> tuple[str, ...]:
    return (*_MATH, *flag_set.flags, *(("-fopenmp",) if openmp else ()))


def compiler() -> str | None:
    """The C compiler the kernels are built with: $CC, else cc, gcc or clang, as found on PATH."""
    for name in (envs.CC, "cc", "gcc", "clang"):
        path = shutil.which(name) if name else None
        if path:
            return path
    return None


@functools.cache
def _compiler_identity(path: str) -> str:
    """The compiler's path and version banner: a compiler upgraded in place builds anew."""
    try:
        result = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return path
    return f"{path}\n{result.stdout}"


def _cpu_signature() -> str:
    """What `-march=native` compiles for: a cache directory shared by machines with different CPUs
    (a network home) must not hand one of them another's instructions."""
    return " ".join([platform.machine(), platform.processor(), *CpuPlatform.cpu_flags()])


_INCLUDE = re.compile(rb'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


def sources(library: Library) -> list[Path]:
    """The library's translation units and every header they include (transitively), each once."""
    seen: dict[Path, None] = {}
    pending = [UNITS / unit for unit in (*library.units, "build_info.c")]
    while pending:
        path = pending.pop(0)
        if path in seen:
            continue
        seen[path] = None
        for name in _INCLUDE.findall(path.read_bytes()):
            found = [d / name.decode() for d in (path.parent, INCLUDE) if (d / name.decode()).is_file()]
            if not found:
                raise KernelBuildError(
                    f"{path} includes {name.decode()!r}, found neither beside it nor in {INCLUDE}"
                )
            pending.append(found[0].resolve())
    return list(seen)


def build_key(library: Library, flag_set: FlagSet, openmp: bool, compiler_path: str) -> str:
    """The hash a build is stored under: its sources (with every header), compiler, flags and, for
    `-march=native`, the CPU."""
    h = hashlib.sha256(_BUILD_FORMAT)
    for path in sorted(sources(library)):
        h.update(path.relative_to(KERNELS).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    recipe = [_compiler_identity(compiler_path), *_flags(flag_set, openmp)]
    if flag_set is NATIVE:
        recipe.append(_cpu_signature())
    h.update("\0".join(recipe).encode())
    return h.hexdigest()


def _candidates(choice: str | None) -> list[tuple[FlagSet, bool]]:
    """(flag set, with OpenMP) in the order tried: `choice` alone (`PAGEDLLM_KERNEL_ISA`) or all."""
    cpu = set(CpuPlatform.cpu_flags())
    if choice:
        if choice not in FLAG_SETS:
            raise KernelBuildError(f"PAGEDLLM_KERNEL_ISA={choice!r} is not one of {', '.join(FLAG_SETS)}")
        missing = FLAG_SETS[choice].needs - cpu
        if missing:
            raise KernelBuildError(
                f"PAGEDLLM_KERNEL_ISA={choice} needs CPU features this CPU lacks: {', '.join(sorted(missing))}"
            )
        sets = [FLAG_SETS[choice]]
    else:
        sets = [NATIVE, *(s for s in ISA_SETS if s.needs <= cpu), PORTABLE]
    return [(s, True) for s in sets] + [(sets[-1], False)]


def _compile(compiler_path: str, library: Library, flags: tuple[str, ...], out: Path) -> bool:
    """Compile the library's units in parallel, then link them into `out`; False (logged at debug
    level) where the compiler refuses."""
    units = [UNITS / unit for unit in (*library.units, "build_info.c")]
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        objects = [Path(tmp) / f"{unit.stem}.o" for unit in units]
        commands = [
            [compiler_path, *flags, "-fPIC", "-I", str(INCLUDE), "-c", "-o", str(obj), str(unit)]
            for unit, obj in zip(units, objects, strict=True)
        ]
        jobs = [
            subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for cmd in commands
        ]
        errors = [(cmd, job.communicate()[1]) for cmd, job in zip(commands, jobs, strict=True)]
        failed = [(cmd, err) for (cmd, err), job in zip(errors, jobs, strict=True) if job.returncode != 0]
        if not failed:
            link = [compiler_path, *flags, "-shared", "-o", str(out), *map(str, objects)]
            result = subprocess.run(link, capture_output=True, text=True)
            if result.returncode == 0:
                return True
            failed = [(link, result.stderr)]
    for cmd, err in failed:
        logger.debug("kernel library %s: %s failed: %s", library.name, " ".join(cmd), err.strip())
    return False


def _build(library: Library, choice: str | None) -> Loaded | None:
    compiler_path = compiler()
    if compiler_path is None:
        logger.warning("no C compiler could build the %s (set CC); %s", library.what, library.otherwise)
        return None
    try:
        directory = cache.private_directory(cache_root() / "kernels")
        for flag_set, openmp in _candidates(choice):
            key = build_key(library, flag_set, openmp, compiler_path)
            serial = "" if openmp else "-serial"
            path = directory / f"{library.name}-{flag_set.name}{serial}-{key[:16]}.so"
            flags = _flags(flag_set, openmp)
            with cache.build_lock(directory, library.name):
                built = cache.verified(path, key) or cache.store(
                    path,
                    {"library": library.name, "flag_set": flag_set.name, "flags": flags, "key": key},
                    functools.partial(_compile, compiler_path, library, flags),
                )
            if built:
                cdll = ctypes.CDLL(str(path))
                abi.check(cdll, library.structs)
                return Loaded(cdll, library, flag_set, openmp, path)
    except (OSError, cache.KernelCacheError, KernelBuildError) as e:
        logger.warning("cannot build the %s: %s; %s", library.what, e, library.otherwise)
        return None
    logger.warning("no C compiler could build the %s (set CC); %s", library.what, library.otherwise)
    return None


@functools.cache
def _load(library: Library, choice: str | None) -> Loaded | None:
    return _build(library, choice)


def load(library: Library) -> Loaded | None:
    """The library built for this machine (or with the flag set `PAGEDLLM_KERNEL_ISA` names), built
    at the first call of a process if the cache lacks it; None (logged once) where no compiler can
    build it. Raises KernelABIError where its structs and their ctypes mirrors disagree."""
    choice = envs.PAGEDLLM_KERNEL_ISA
    return _load(library, None if choice == "auto" else choice)


def cdll(library: Library) -> ctypes.CDLL | None:
    """`load(library)`'s handle, for a binding to declare its entries' types on; None where it cannot
    be built."""
    loaded = load(library)
    return None if loaded is None else loaded.cdll
