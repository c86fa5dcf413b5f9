#!/usr/bin/env bash
# The H200 fleet bench's second carry (scripts/make_gpu_site.sh's is ~48 MB of the 64 MiB a device call carries): Ray
# Serve 2.60 with the dependencies the GPU image lacks, psycopg 3 (the job store's driver) and a PostgreSQL server
# (pgserver: PostgreSQL's binaries in a manylinux wheel, as the image has no Debian packages), for Python 3.12
# x86_64, unpacked into one folder and xz-compressed.
#     scripts/make_gpu_fleet_site.sh        # writes .whl/fleet-site.tar.xz (50.1 MB; .whl/ is git-ignored)
# With site.tar.xz (~48 MB) that is over one call's 64 MiB, so the H200 bench takes two calls on one warm machine:
#     call 1, carry [".whl/fleet-site.tar.xz"]:  mkdir -p /tmp/fleet-site && tar xJf .whl/fleet-site.tar.xz -C /tmp/fleet-site
#     call 2, carry [".whl/site.tar.xz"]:        mkdir -p /tmp/site && tar xJf .whl/site.tar.xz -C /tmp/site &&
#         PYTHONPATH=/tmp/site:/tmp/fleet-site:$PWD RAY_USAGE_STATS_ENABLED=0 python scripts/bench_fleet.py \
#         --pg-bin /tmp/fleet-site/pgserver/pginstall/bin --out bench/results/fleet_h200.json
# (a call that finds no /tmp/fleet-site got a fresh machine: run call 1 again.) Ray runs in-process (ray.init), so its
# command-line scripts are not needed.
# Left out: Ray's dashboard front end (ray/dashboard/client/build: the fleet runs with include_dashboard=False),
# its bundled Java jars, and the test suites inside the wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/carry.sh
carry_unpack fleet-site \
  "ray==2.60.0" msgpack jsonschema referencing rpds-py attrs jsonschema-specifications pyyaml protobuf \
  aiohttp aiohttp_cors aiosignal frozenlist multidict yarl propcache aiohappyeyeballs colorful grpcio grpcio-reflection \
  opencensus opencensus-context google-api-core googleapis-common-protos proto-plus google-auth pyasn1 \
  pyasn1-modules cachetools rsa opentelemetry-api opentelemetry-sdk opentelemetry-exporter-prometheus \
  opentelemetry-proto opentelemetry-semantic-conventions smart_open wrapt watchfiles requests urllib3 \
  charset-normalizer "psycopg[binary]" psycopg-binary pgserver
rm -rf .whl/fleet-site/ray/dashboard/client/build .whl/fleet-site/ray/jars .whl/fleet-site/ray/tests
du -sh .whl/fleet-site
carry_pack fleet-site
