"""Every struct a kernel library takes is checked at load against the size the library exports: a
ctypes mirror with a field too many or too few, or a struct the library does not define, is a clear
error naming the struct, never a call that reads past it."""

from __future__ import annotations

import ctypes
import dataclasses

import pytest

from pagedllm.kernels import abi, build

needs_compiler = pytest.mark.skipif(build.compiler() is None, reason="no C compiler")


@needs_compiler
@pytest.mark.parametrize("library", build.LIBRARIES, ids=lambda lib: lib.name)
def test_every_mirror_matches_its_library(library: build.Library) -> None:
    loaded = build.load(library)
    assert loaded is not None
    abi.check(loaded.cdll, library.structs)  # what load() ran
    for struct in library.structs:
        size = getattr(loaded.cdll, f"{struct.__name__}_size")
        assert size() == ctypes.sizeof(struct)


class LayerArgs(ctypes.Structure):
    """attention.h's LayerArgs with a field the C struct lacks."""

    _fields_ = [*abi.LayerArgs._fields_, ("sinks", ctypes.c_void_p)]


class Fp8Matvec(ctypes.Structure):
    """fp8_kernels.c's Fp8Matvec without its last field."""

    _fields_ = abi.Fp8Matvec._fields_[:-1]


class Unknown(ctypes.Structure):
    _fields_ = [("x", ctypes.c_int64)]


@needs_compiler
@pytest.mark.parametrize(
    ("library", "struct"),
    [(build.DENSE, LayerArgs), (build.FP8, Fp8Matvec), (build.FP8, Unknown)],
    ids=["field-added", "field-missing", "unknown-struct"],
)
def test_a_wrong_mirror_is_refused_at_load(library: build.Library, struct: type[ctypes.Structure]) -> None:
    """The library loaded with a deliberately wrong mirror in place of the right one."""
    others = tuple(s for s in library.structs if s.__name__ != struct.__name__)
    with pytest.raises(abi.KernelABIError) as error:
        build.load(dataclasses.replace(library, structs=(*others, struct)))
    if struct is Unknown:
        assert "exports no Unknown_size()" in str(error.value)
    else:
        right = next(s for s in library.structs if s.__name__ == struct.__name__)
        loaded = build.load(library)
        assert loaded is not None
        assert (
            f"struct {struct.__name__} is {ctypes.sizeof(right)} bytes in {loaded.path} "
            f"but {ctypes.sizeof(struct)} bytes in its ctypes mirror {__name__}.{struct.__name__}"
        ) in str(error.value)
