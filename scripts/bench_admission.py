"""What one POST and one GET cost the API process, below HTTP, on a PostgreSQL store that holds many ended jobs (the
simulated fleet's bottleneck, bench/README.md "Control plane at scale, simulated"):

    python scripts/bench_admission.py --rows 10000 100000 --calls 300 --out bench/results/admission_cpu.json

For each --rows: a throwaway PostgreSQL cluster (tests/postgres.py) with that many completed jobs in its table (the
retention's worth of a fleet), then --calls admissions (`VideoService.create` of the cheapest request the embedded tiny
model admits: the fields mapped, the request prepared and checked, the queue bound read, the row inserted) and --calls
reads of one job (`VideoService.get` and the API's `video_of`: what GET /v1/videos/{id} does). Per call: wall
milliseconds (this process waits on PostgreSQL's round trips) and this process's CPU milliseconds. Run it from the
trees to compare; the machine's load is recorded, as PostgreSQL shares it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

from bench_common import ROOT  # noqa: E402  (first: it puts this checkout on sys.path)
sys.path.insert(0, str(ROOT / "tests"))


class _Replicas:
    def status(self) -> list[dict]:
        return []

    def serving(self) -> int:
        return 50


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(rows: int, calls: int) -> dict:
    from postgres import Postgres
    from sqlalchemy import insert

    from h3trt.jobs.model_source import Entry
    from h3trt.server.app import video_of
    from h3trt.server.metrics import Metrics
    from h3trt.server.options import ServeOptions
    from h3trt.server.service import VideoService
    from h3trt.server.storage import Storage
    from h3trt.server.store import JobStore, jobs

    pg = Postgres()
    try:
        store = JobStore(pg.database())
        now, request = time.time(), json.dumps({"schema": {"prompt": "x"}, "openai": {}, "geometry": [128, 32]})
        with store.engine.begin() as c:
            if rows:
                c.execute(insert(jobs), [dict(
                    id=f"video_{i:032x}", status="completed", created_at=now, completed_at=now, expires_at=now + 86400,
                    progress=100, stage="done", evaluations_done=2, evaluations_total=2, attempts=1,
                    cancel_requested=False, deleted=False, request=request, record="{}", output="x", worker="w")
                    for i in range(rows)])
            c.exec_driver_sql("ANALYZE jobs")
        folder = Path(tempfile.mkdtemp(prefix="h3trt-bench-admission-"))
        service = VideoService(Entry.local(device="cpu"), ServeOptions(data_dir=folder, max_queue=10**6), store,
                               Storage(folder / "storage"), _Replicas(), Metrics(), log=lambda *a, **k: None)
        fields = {"prompt": "client 1 clip 1", "seed": 5, "size": "128x32", "steps": 2}
        job = [service.create(dict(fields), [], False) for _ in range(10)][3].id  # warm: imports, caches
        result = {}
        for name, call in (("POST", lambda: service.create(dict(fields), [], False)),
                           ("GET", lambda: video_of(service, service.get(job)))):
            wall, cpu = time.perf_counter(), _cpu_s()
            for _ in range(calls):
                call()
            result[name] = {"wall_ms": round((time.perf_counter() - wall) / calls * 1000, 2),
                            "cpu_ms": round((_cpu_s() - cpu) / calls * 1000, 2)}
        store.close()
        return result
    finally:
        pg.stop()


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[10_000, 100_000])
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    result = {"tree": str(ROOT), "cores": len(os.sched_getaffinity(0)),
              "rows": {str(n): measure(n, args.calls) for n in args.rows},
              "load_average_1_5_15_min_at_end": [round(x, 1) for x in os.getloadavg()]}
    print(json.dumps(result, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
