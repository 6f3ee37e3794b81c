"""The environment-variable registry: one place reads the environment, config construction never writes it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import pagedllm
from pagedllm import envs

PACKAGE = Path(pagedllm.__file__).parent

# Places that hand the whole environment to a child process (or apply the parent's in the child), and
# the one that tells a third-party library where to cache: none reads a pagedllm variable.
_ENV_COPIES = {
    "engine/core_client.py",
    "engine/core_proc.py",
    "benchmarks/startup.py",
    # Inductor reads its cache directory only from TORCHINDUCTOR_CACHE_DIR (no config setting); the
    # compiled forward points it at pagedllm's per-config cache when it compiles, not at construction.
    "worker/compiled_forward.py",
    # oneDNN and ideep read their kernel-cache capacities only from the environment; the CPU worker
    # bounds them (an operator's own setting wins).
    "platforms/cpu.py",
}
_ENV_ACCESS = re.compile(r"os\.environ|os\.getenv|os\.putenv")


def test_only_envs_reads_the_environment() -> None:
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "envs.py" or rel in _ENV_COPIES:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if _ENV_ACCESS.search(line.split("#", 1)[0]):
                offenders.append(f"{rel}:{number}: {line.strip()}")
    assert not offenders, "read environment variables through pagedllm.envs:\n" + "\n".join(offenders)


def test_values_are_parsed_at_access(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEDLLM_BATCH_INVARIANT", raising=False)
    assert envs.PAGEDLLM_BATCH_INVARIANT is None
    monkeypatch.setenv("PAGEDLLM_BATCH_INVARIANT", "yes")
    assert envs.PAGEDLLM_BATCH_INVARIANT is True
    monkeypatch.setenv("PAGEDLLM_BATCH_INVARIANT", "0")
    assert envs.PAGEDLLM_BATCH_INVARIANT is False
    monkeypatch.setenv("PAGEDLLM_CACHE_ROOT", "")
    assert envs.PAGEDLLM_CACHE_ROOT is None
    assert envs.is_set("PAGEDLLM_CACHE_ROOT")


def test_unregistered_names_are_refused() -> None:
    with pytest.raises(AttributeError, match="not a registered variable"):
        envs.PAGEDLLM_NO_SUCH_THING  # noqa: B018
    with pytest.raises(KeyError):
        envs.is_set("PAGEDLLM_NO_SUCH_THING")


def test_every_variable_is_documented() -> None:
    rows = envs.describe()
    assert {name for name, _, _ in rows} == set(envs.REGISTRY)
    assert all(doc.strip() for _, _, doc in rows)

