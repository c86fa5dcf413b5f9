#!/usr/bin/env bash
# Everything the H200 benches need beyond the GPU image, in ONE carry under 64 MiB: the wheels for Python 3.12
# x86_64 unpacked into one folder and xz-compressed (zip-compressed wheels do not shrink under xz; their contents do).
#     scripts/make_gpu_site.sh            # writes .whl/site.tar.xz (about 48 MB; .whl/ is git-ignored)
# On the device, carrying .whl/site.tar.xz:
#     mkdir -p /tmp/site && tar xJf .whl/site.tar.xz -C /tmp/site && export PYTHONPATH=/tmp/site:$PWD
# What it holds: diffusers 0.42.1 (the oracle) and importlib_metadata/zipp, PyAV (MP4 output), fa3-fwd 0.0.3
# (FlashAttention-3), nvidia-cudnn-frontend 1.16.0 (cuDNN FP8 attention), cryptography/cffi/pycparser (signed
# bundles), ModelOpt 0.47.0 with the dependencies the image lacks (PuLP, omegaconf, pydantic and its parts), and
# h3trt serve's [serve] extra with its dependencies (FastAPI, Starlette, uvicorn, python-multipart, prometheus-client,
# SQLAlchemy, Alembic, Mako) and httpx for the benches' HTTP client.
# PuLP's bundled CBC solver binaries are dropped (35 MB): ModelOpt imports PuLP, calibration never solves anything.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/carry.sh
carry_unpack site \
  diffusers==0.42.1 importlib_metadata zipp av fa3-fwd==0.0.3 nvidia-cudnn-frontend==1.16.0 \
  cryptography cffi pycparser \
  nvidia-modelopt==0.47.0 PuLP==3.3.2 omegaconf==2.4.0 pydantic==2.13.4 pydantic-core==2.46.4 \
  annotated-types==0.7.0 typing-inspection==0.4.2 \
  fastapi starlette uvicorn h11 click python-multipart prometheus-client sqlalchemy alembic Mako MarkupSafe opentelemetry-api annotated-doc \
  anyio sniffio idna httpx httpcore certifi typing_extensions
rm -rf .whl/site/pulp/solverdir/cbc
carry_pack site
