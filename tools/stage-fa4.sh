#!/usr/bin/env bash
# The FLASH backend (FlashAttention-4) for the flex_prefill suite's `flash` column, on the GPU
# machine, which has no network. Two halves:
#   here:             bash tools/stage-fa4.sh download   (wheels into .device/fa4, ~2.5 MB)
#   GPU, carry .device/fa4:  bash tools/stage-fa4.sh install && export PYTHONPATH=/opt/fa4:$PYTHONPATH
# Needs the CuTe DSL staged first (its nvidia-cutlass-dsl and apache-tvm-ffi are reused).
set -euo pipefail
D=$(cd "$(dirname "$0")/.." && pwd)/.device/fa4
case "${1:-}" in
  download)
    mkdir -p "$D"
    python3 -m pip download -q --no-deps --pre --only-binary=:all: --python-version 3.12 \
      --platform manylinux_2_28_x86_64 -d "$D" "flash-attn-4==4.0.0b36" quack-kernels torch-c-dlpack-ext einops
    ls "$D" ;;
  install)
    python3 -m pip install -q --no-index --no-deps --no-compile --target /opt/fa4 "$D"/*.whl
    PYTHONPATH=/opt/fa4:$PYTHONPATH python3 -c "import flash_attn.cute; print('FA4 ready')" ;;
  *) echo "usage: $0 download|install" >&2; exit 2 ;;
esac
