#!/usr/bin/env bash
# Run here (with the package registry): build a virtual environment holding the GPU machine image's versions
# of the packages the check imports, and run the check's dry run in it, so a version difference between this
# checkout's venv and the GPU image (an API the image's torch or transformers lacks) shows here, before a
# scarce GPU call meets it.
#
#   tools/gpu/image_venv.sh [VENV_DIR] [OUT_DIR]     (defaults: /tmp/diffserve-gpu-image-venv, /tmp/diffserve-gpu-image-dry-run)
#
# The versions are the image's as /work/.library/device/KINDS.md records them (torch 2.11.0, the CUDA 13.0
# build, which imports and runs on a CPU; transformers 5.17.0, tokenizers 0.23.2, huggingface_hub 1.33.0,
# accelerate 1.15.0, safetensors 0.8.0, sentencepiece 0.2.2); the packages the image lacks come at the
# versions tools/gpu/prepare.sh carries (this checkout's). Python stays this machine's 3.11 (the image has
# 3.12, which Debian 12 does not package). About 4.5 GB and ten minutes; not part of `make test`.
set -euo pipefail
cd "$(dirname "$0")/../.."

VENV=${1:-/tmp/diffserve-gpu-image-venv}
OUT=${2:-/tmp/diffserve-gpu-image-dry-run}
IMAGE_TORCH=torch==2.11.0
IMAGE_PACKAGES=(transformers==5.17.0 tokenizers==0.23.2 huggingface_hub==1.33.0 accelerate==1.15.0
                safetensors==0.8.0 sentencepiece==0.2.2)

if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
fi
PIP=("$VENV/bin/python" -m pip install -q --no-compile)
echo "[image-venv] $IMAGE_TORCH (the image's CUDA build)"
"${PIP[@]}" "$IMAGE_TORCH"
echo "[image-venv] diffserve with its test extras, this checkout's versions (editable)"
"${PIP[@]}" -e ".[test]"
echo "[image-venv] the image's versions: ${IMAGE_PACKAGES[*]}"
"${PIP[@]}" "${IMAGE_PACKAGES[@]}"
"$VENV/bin/python" -c "import torch, transformers; print('[image-venv] torch', torch.__version__, '| transformers', transformers.__version__)"

echo "[image-venv] tools/gpu/check.sh --dry-run --out $OUT"
PYTHON="$VENV/bin/python" OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} tools/gpu/check.sh --dry-run --out "$OUT"
