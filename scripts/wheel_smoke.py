"""Smoke test of an installed (non-editable) pagedllm, run by scripts/wheel_smoke.sh from a fresh
venv outside the checkout: the package imports from the venv, its native C sources are installed and
build, and the embedded SmolLM2 model generates a few tokens at -O0."""

from __future__ import annotations

import sys
from pathlib import Path

import pagedllm
from pagedllm import LLM, SamplingParams
from pagedllm.kernels import build


def main() -> None:
    installed = Path(pagedllm.__file__).resolve()
    assert installed.is_relative_to(Path(sys.prefix).resolve()), f"pagedllm imported from {installed}"
    package = installed.parent
    sources = sorted(p.relative_to(package).as_posix() for p in package.rglob("*.c"))
    assert all(f"kernels/cpu/{name}.c" in sources for name in ("llama_decode", "attention_decode")), sources
    assert any(p.name.endswith(".h") for p in (package / "kernels" / "include").iterdir()), "headers missing"
    if build.compiler() is not None:
        for library in build.LIBRARIES:
            assert build.cdll(library) is not None, f"the native {library.name} library did not build"
    llm = LLM(optimization_level=0, max_model_len=256)
    (out,) = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=8))
    assert len(out.outputs[0].token_ids) == 8, out
    print(f"wheel smoke test passed: {installed.parent}, {len(sources)} C sources, {out.outputs[0].text!r}")


if __name__ == "__main__":
    main()
