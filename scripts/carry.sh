# Sourced by the GPU carry scripts (make_gpu_site.sh, make_gpu_fleet_site.sh), run from the repository root.
#   carry_unpack NAME PACKAGE...   the packages' wheels for the GPU image's Python 3.12 on x86_64 (binary wheels only,
#                                  each named package alone: the image has the rest), unpacked into .whl/NAME
#   carry_pack NAME                .whl/NAME as .whl/NAME.tar.xz (zip-compressed wheels do not shrink under xz; their
#                                  contents do), its size printed
carry_unpack() {
  local name=$1
  shift
  rm -rf ".whl/$name-wheels" ".whl/$name"
  mkdir -p ".whl/$name-wheels" ".whl/$name"
  python3 -m pip download -q --python-version 3.12 --implementation cp --only-binary=:all: --no-deps \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d ".whl/$name-wheels" "$@"
  for wheel in ".whl/$name-wheels"/*.whl; do
    unzip -q -o "$wheel" -d ".whl/$name"
  done
}

carry_pack() {
  find ".whl/$1" -name __pycache__ -prune -exec rm -rf {} +
  tar cf - -C ".whl/$1" . | xz -T2 -8 > ".whl/$1.tar.xz"
  ls -l ".whl/$1.tar.xz"
}
