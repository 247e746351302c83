#!/usr/bin/env bash
# Run here (with network): collect into tools/gpu/wheels/ (git-ignored) the Python wheels the GPU machine
# lacks, for its Python 3.12 on x86-64 Linux: diffserve itself, diffusers (the tests' and the benchmark's
# reference), and diffserve's runtime dependencies its image does not hold. The versions are the ones
# installed in this checkout's venv, so the GPU runs what the suite here tests. tools/gpu/check.sh installs
# them there; the call carries the folder:  run(command="tools/gpu/check.sh --out $OUT", carry=["tools/gpu/wheels"]).
#
# Left out: `av` (PyAV, ~35 MB: MP4 writing, which the check never does) and everything the GPU image
# already has (torch, transformers, tokenizers, safetensors, numpy, pillow, accelerate, pytest, ...: the
# image's package list, /work/.library/device/KINDS.md). The folder plus the working tree must stay under
# the 64 MiB a call may carry: this script fails when the wheels pass WHEELS_BUDGET_MIB.
set -euo pipefail
cd "$(dirname "$0")/../.."

PY=${PYTHON:-.venv/bin/python}
OUT=tools/gpu/wheels
WHEELS_BUDGET_MIB=${WHEELS_BUDGET_MIB:-40}
#: On the GPU machine's Python these are missing (KINDS.md's list): diffusers, and diffserve's runtime deps
#: gguf, pydantic (+ pydantic-core, annotated-types, typing-inspection), fastapi (+ starlette), uvicorn,
#: python-multipart, pyzmq; ftfy (+ wcwidth) for diffusers' Wan pipelines.
PACKAGES=(diffusers gguf pydantic pydantic-core annotated-types typing-inspection fastapi starlette uvicorn
          python-multipart pyzmq ftfy wcwidth)

rm -rf "$OUT"
mkdir -p "$OUT"
echo "[prepare] diffserve wheel"
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$OUT" .

for package in "${PACKAGES[@]}"; do
    version=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$package" 2>/dev/null || true)
    spec="$package${version:+==$version}"
    echo "[prepare] $spec"
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$OUT" "$spec"
done

total=$(du -cb "$OUT"/*.whl | tail -1 | cut -f1)
ls -l "$OUT"
echo "[prepare] $(ls "$OUT"/*.whl | wc -l) wheels, $(( total / 1048576 )) MiB in $OUT"
if [ "$total" -gt $(( WHEELS_BUDGET_MIB * 1048576 )) ]; then
    echo "[prepare] over the ${WHEELS_BUDGET_MIB} MiB budget (a call carries 64 MiB with the working tree)" >&2
    exit 1
fi
