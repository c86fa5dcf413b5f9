#!/usr/bin/env bash
# Install the wheels of DIR whose distribution is not installed yet (--no-deps, --no-index: nothing is fetched), and
# leave every distribution the image already has as it is. For carrying ModelOpt and its pure-Python dependencies to
# the GPU image (bench/README.md lists them), which may already hold some of them (numpy, requests, huggingface_hub).
#     scripts/install_missing_wheels.sh .whl/calib_a
set -euo pipefail
dir=${1:?usage: install_missing_wheels.sh DIR}
missing=()
for wheel in "$dir"/*.whl; do
  name=$(basename "$wheel" | cut -d- -f1)
  if python -c "import importlib.metadata as m, sys; m.version(sys.argv[1])" "$name" 2>/dev/null; then
    echo "have $name $(python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")"
  else
    missing+=("$wheel")
  fi
done
if [ ${#missing[@]} -gt 0 ]; then
  python -m pip install -q --no-deps --no-index "${missing[@]}"
  printf 'installed %s\n' "${missing[@]##*/}"
fi
