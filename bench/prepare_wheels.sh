#!/usr/bin/env bash
# Run on a machine with network access, before a GPU run on a machine without: puts DeepSpeed
# and the packages it needs that a GPU image may lack (hjson, pydantic, pydantic-core,
# annotated-types, typing-inspection), and the peers we compare with (torchao 0.17.0, built for
# torch 2.11; bitsandbytes 0.50.2, 43 MB: WITH_BNB=0 leaves it out) into .whl/ as Python 3.12
# x86-64 wheels. .whl/ is git-ignored; copy it with the checkout, and bench/device_env.sh installs it.
# DeepSpeed ships only an sdist, so it is built into a pure-Python wheel with no pre-built ops
# (DS_BUILD_OPS=0: ops are JIT-built if ever needed; CoatAdamW and torch AdamW need none).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_24_x86_64 \
    -d .whl pydantic==2.14.3 pydantic_core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 hjson==3.1.0 \
    torchao==0.17.0 $([ "${WITH_BNB:-1}" = 1 ] && echo bitsandbytes==0.50.2)
tmp=$(mktemp -d)
"$PY" -m pip download -q --no-deps --no-binary=:all: -d "$tmp" deepspeed==0.19.8
DS_BUILD_OPS=0 DS_ACCELERATOR=cuda "$PY" -m pip wheel -q --no-deps --no-build-isolation "$tmp"/deepspeed-0.19.8.tar.gz -w .whl
rm -rf "$tmp"
ls -la .whl
