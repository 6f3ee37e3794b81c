"""The kernel cache trusts no file it did not build: its directory is this user's with mode 0700 (made
so, made anew where it was open to others, refused where another user owns it), and a library whose
bytes or ownership do not match its manifest is built again, never loaded."""

from __future__ import annotations

import ctypes
import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from pagedllm.kernels import build, cache

LIBRARY = build.FP8  # the smallest library: quick to build


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PAGEDLLM_CACHE_ROOT", str(tmp_path))
    monkeypatch.delenv("PAGEDLLM_KERNEL_ISA", raising=False)
    if build.compiler() is None:
        pytest.skip("no C compiler")
    return tmp_path


def _planted(path: Path) -> None:
    """A valid shared object that is not the kernel library (it says so: `planted()`), exporting what
    the loader checks."""
    source = path.with_suffix(".c")
    source.write_text(
        "#include <stdint.h>\nint planted(void) { return 1; }\n"
        f"int64_t Fp8Matvec_size(void) {{ return {ctypes.sizeof(LIBRARY.structs[0])}; }}\n"
    )
    compiler = build.compiler()
    assert compiler is not None
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(path), str(source)], check=True)
    source.unlink()


def _genuine(loaded: build.Loaded | None) -> build.Loaded:
    assert loaded is not None
    assert hasattr(loaded.cdll, "fp8_widen_rows") and not hasattr(loaded.cdll, "planted")
    return loaded


def test_builds_go_to_a_private_directory_with_their_hash(root: Path) -> None:
    loaded = _genuine(build._build(LIBRARY, None))
    directory = root / "kernels"
    st = os.lstat(directory)
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700
    assert loaded.path.parent == directory
    manifest = json.loads(loaded.path.with_suffix(".json").read_text())
    key = build.build_key(LIBRARY, loaded.flag_set, loaded.openmp, build.compiler() or "")
    assert manifest["key"] == key and loaded.path.name.endswith(f"-{key[:16]}.so")
    assert manifest["sha256"] == cache._sha256(loaded.path)
    assert manifest["flags"] == list(loaded.flags)


@pytest.mark.parametrize("mode", [0o755, 0o777])
def test_a_directory_open_to_others_is_made_anew(
    mode: int, root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Anything in it may have been written by another user, even a file that matches its manifest."""
    compiler = build.compiler()
    assert compiler is not None
    directory = root / "kernels"
    directory.mkdir(mode=mode)
    directory.chmod(mode)
    key = build.build_key(LIBRARY, build.NATIVE, True, compiler)
    planted = directory / f"{LIBRARY.name}-native-{key[:16]}.so"
    _planted(planted)
    planted.with_suffix(".json").write_text(json.dumps({"key": key, "sha256": cache._sha256(planted)}))
    with caplog.at_level("WARNING", logger="pagedllm.kernels"):
        _genuine(build._build(LIBRARY, None))
    assert "open to other users" in caplog.text
    assert stat.S_IMODE(os.lstat(directory).st_mode) == 0o700
    assert not list(root.glob("kernels.untrusted-*"))


def test_a_directory_of_another_user_is_refused(
    root: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    directory = cache.private_directory(root / "kernels")
    _planted(directory / "planted.so")
    # This process seen as another user: the directory (and what is in it) is not its own.
    other = os.geteuid() + 1
    monkeypatch.setattr(cache.os, "geteuid", lambda: other)
    with caplog.at_level("WARNING", logger="pagedllm.kernels"):
        assert build._build(LIBRARY, None) is None
    assert f"belongs to uid {os.getuid()}, not to this user (uid {other})" in caplog.text
    assert (directory / "planted.so").exists()  # left alone: not ours to remove


@pytest.mark.parametrize("swap", ["bytes", "writable-by-others", "manifest-key"])
def test_a_swapped_library_is_rebuilt_not_loaded(
    swap: str, root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = _genuine(build._build(LIBRARY, None)).path
    manifest_path = path.with_suffix(".json")
    manifest = json.loads(manifest_path.read_text())
    if swap == "bytes":  # another library in its place, its manifest untouched
        path.unlink()
        _planted(path)
    elif swap == "writable-by-others":  # the right bytes, but anyone could have changed them
        path.chmod(0o777)
    else:  # a manifest (and file) of another build under this build's name
        path.unlink()
        _planted(path)
        manifest_path.write_text(json.dumps({**manifest, "key": "0" * 64, "sha256": cache._sha256(path)}))
    with caplog.at_level("WARNING", logger="pagedllm.kernels"):
        rebuilt = _genuine(build._build(LIBRARY, None))
    assert rebuilt.path == path
    assert cache.verified(path, manifest["key"])
    assert "building it again" in caplog.text


def test_builds_of_one_library_are_bounded(root: Path) -> None:
    directory = cache.private_directory(root / "kernels")
    old = []
    for i in range(cache.KEEP_BUILDS + 3):
        stale = directory / f"{LIBRARY.name}-native-{i:016x}.so"
        stale.write_bytes(b"old")
        os.utime(stale, (i, i))
        old.append(stale)
    other = directory / f"{LIBRARY.name}-portable-{0:016x}.so"  # another flag set: its own count
    other.write_bytes(b"old")
    loaded = _genuine(build._build(LIBRARY, None))
    kept = sorted(directory.glob(f"{LIBRARY.name}-native-*.so"))
    assert len(kept) == cache.KEEP_BUILDS and loaded.path in kept
    assert old[-1] in kept and old[0] not in kept and other.exists()
