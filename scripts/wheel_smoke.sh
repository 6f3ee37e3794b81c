#!/usr/bin/env bash
# Builds the wheel, installs it into a fresh venv and runs wheel_smoke.py from outside the checkout:
# a non-editable install must ship what it loads at run time (the native C sources) and generate.
# Built from a copy of the tree: an in-tree build leaves build/, whose stale files a later wheel
# would pick up.
set -euo pipefail
cd "$(dirname "$0")/.."
smoke="$(mktemp -d)"
trap 'rm -rf "$smoke"' EXIT
mkdir "$smoke/src"
tar --exclude=.git --exclude=build --exclude=dist --exclude='*.egg-info' --exclude=__pycache__ -cf - . \
    | tar -xf - -C "$smoke/src"
python3 -m pip install -q "setuptools>=68" wheel
python3 -m pip wheel -q --no-deps --no-build-isolation -w "$smoke/wheel" "$smoke/src"
python3 -m venv --system-site-packages "$smoke/venv"
"$smoke/venv/bin/python" -m pip install -q --no-deps --force-reinstall "$smoke"/wheel/pagedllm-*.whl
cp scripts/wheel_smoke.py "$smoke/"
# The native libraries are keyed by the installed sources' bytes (a missing source fails), found in the
# cache the test suite filled: building them afresh takes minutes on a small CPU.
(cd "$smoke" && env -u PYTHONPATH timeout 300 venv/bin/python wheel_smoke.py)
