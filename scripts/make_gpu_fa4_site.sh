#!/usr/bin/env bash
# FlashAttention-4 (CuTe DSL; block-sparse on sm_90) for the H200 image, as a carry in TWO parts: packed it is about
# 72 MB (nvidia-cutlass-dsl-libs-cu13's MLIR library alone is 193 MB unpacked), over one device call's 64 MiB.
#     scripts/make_gpu_fa4_site.sh        # writes .whl/fa4.part1 and .whl/fa4.part2 (.whl/ is git-ignored)
# The first part is the small one (13 MB), so it travels with .whl/site.tar.xz (make_gpu_site.sh, about 48 MB) in one call.
# On a warm device machine (released 30 s after a call), call 1 carries .whl/fa4.part1 and keeps it:
#     cp .whl/fa4.part1 /tmp/
# call 2 carries .whl/fa4.part2 and joins them:
#     mkdir -p /tmp/fa4 && cat /tmp/fa4.part1 .whl/fa4.part2 | xz -d | tar xf - -C /tmp/fa4
#     export PYTHONPATH=/tmp/fa4:/tmp/fa4/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH
# (the second path is what the cutlass-dsl wheel's .pth adds in a real site-packages). Versions as measured in
# ../shared/docs/sparse_notes.md: -libs-cu13, not -libs-cu12, for the image's CUDA 13.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/carry.sh
carry_unpack fa4 \
  flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
  nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 quack-kernels==0.6.5 \
  apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 einops
carry_pack fa4
# Part 1: the first 13,000,000 bytes; part 2 the rest (about 57 MB, a call of its own).
head -c 13000000 .whl/fa4.tar.xz > .whl/fa4.part1
tail -c +13000001 .whl/fa4.tar.xz > .whl/fa4.part2
rm .whl/fa4.tar.xz
ls -l .whl/fa4.part1 .whl/fa4.part2
