"""The directory of compiled kernel libraries, trusted only as far as it is private.

A shared object is code: whoever can put a file where the loader looks runs it in every pagedllm
process. So the directory must be this user's own with mode 0700 (created so; one that is this user's
but open to others is set aside and made anew, since anything may have been written into it; one owned
by someone else is refused), and each library is stored beside a manifest holding the build's key (a
hash of its sources, every header they include, the compiler and the flags) and the sha256 of the
file: a library whose manifest names another key, whose bytes hash to something else, or that is not
this user's regular file is not loaded but built again. Builds of one library are serialized by a
lock, and each library keeps its newest few builds (different checkouts or flag sets sharing a
cache), so the directory stays bounded.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import secrets
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

logger = logging.getLogger("pagedllm.kernels")

# Builds kept per library and flag set (the newest by modification time).
KEEP_BUILDS = 8


class KernelCacheError(RuntimeError):
    """The cache directory cannot be trusted and cannot be made private."""


def _is_private_directory(st: os.stat_result) -> bool:
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700


def _is_own_file(st: os.stat_result) -> bool:
    """A regular file (not a link) of this user that nobody else may write."""
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022


def private_directory(path: Path) -> Path:
    """`path` as a directory of this user with mode 0700: created so, or made anew where it is this
    user's but open to others (or not a directory); KernelCacheError where another user owns it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        st: os.stat_result | None = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None and not _is_private_directory(st):
        if st.st_uid != os.geteuid():
            raise KernelCacheError(
                f"the kernel cache {path} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}): "
                "refusing to load native code from it (remove it, or set PAGEDLLM_CACHE_ROOT)"
            )
        # Renamed first, so that a concurrent process never sees half of it removed.
        aside = path.with_name(f"{path.name}.untrusted-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            os.rename(path, aside)
        except OSError as e:
            raise KernelCacheError(
                f"the kernel cache {path} is open to other users and cannot be set aside: {e}"
            ) from e
        logger.warning(
            "the kernel cache %s was open to other users (mode %o): its files are discarded and it is made anew",
            path,
            stat.S_IMODE(st.st_mode),
        )
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(aside, ignore_errors=True)
        else:
            aside.unlink()
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
        os.chmod(path, 0o700)  # whatever the umask took away
    if not _is_private_directory(os.lstat(path)):  # made by someone else meanwhile
        raise KernelCacheError(f"the kernel cache {path} is not a directory of this user with mode 0700")
    return path


def _manifest_path(library: Path) -> Path:
    return library.with_suffix(".json")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def verified(library: Path, key: str) -> bool:
    """Whether `library` may be loaded as the build `key`: it and its manifest are this user's files
    that nobody else may write, the manifest names `key`, and the file's bytes hash to its record.
    False (logged where something was there) otherwise: it must be built again."""
    manifest_path = _manifest_path(library)
    try:
        own = _is_own_file(os.lstat(library)) and _is_own_file(os.lstat(manifest_path))
        manifest = json.loads(manifest_path.read_text()) if own else None
    except FileNotFoundError:
        return False
    except (OSError, ValueError) as e:
        logger.warning("the kernel library %s has no readable manifest (%s): building it again", library, e)
        return False
    if manifest is None:
        logger.warning("the kernel library %s is not this user's own file: building it again", library)
        return False
    if (
        not isinstance(manifest, dict)
        or manifest.get("key") != key
        or manifest.get("sha256") != _sha256(library)
    ):
        logger.warning("the kernel library %s does not match its manifest: building it again", library)
        return False
    return True


@contextlib.contextmanager
def build_lock(directory: Path, name: str) -> Iterator[None]:
    """Held while one process checks and builds library `name`: the others wait, then find it built."""
    with open(directory / f"{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def store(library: Path, manifest: dict[str, object], build: Callable[[Path], bool]) -> bool:
    """Build into a temporary file beside `library` (`build(path)` -> success), then move it and its
    manifest (`manifest` plus the file's sha256) into place: a reader never sees a half-written one.
    Older builds of the same name beyond KEEP_BUILDS are removed."""
    directory = library.parent
    fd, tmp = tempfile.mkstemp(suffix=".so.tmp", dir=directory)
    os.close(fd)
    tmp_path = Path(tmp)
    manifest_tmp = tmp_path.with_suffix(".json.tmp")
    try:
        if not build(tmp_path):
            return False
        os.chmod(tmp_path, 0o700)
        manifest_tmp.write_text(json.dumps({**manifest, "sha256": _sha256(tmp_path)}, indent=1))
        os.replace(tmp_path, library)
        os.replace(manifest_tmp, _manifest_path(library))
    finally:
        tmp_path.unlink(missing_ok=True)
        manifest_tmp.unlink(missing_ok=True)
    _prune(library)
    return True


def _prune(library: Path) -> None:
    """Keep the newest KEEP_BUILDS builds of `library`'s name and flag set (`<name>-<key>.so`)."""
    prefix = library.name.rsplit("-", 1)[0]
    builds = [p for p in library.parent.glob(f"{prefix}-*.so") if p.name.rsplit("-", 1)[0] == prefix]

    def age(path: Path) -> float:
        try:
            return -path.stat().st_mtime
        except FileNotFoundError:  # pruned by another process meanwhile
            return 0.0

    for old in sorted(builds, key=age)[KEEP_BUILDS:]:
        if old != library:
            old.unlink(missing_ok=True)
            _manifest_path(old).unlink(missing_ok=True)
