"""The fleet's control plane at scale, simulated on the CPU (issue 35 item 16): no GPU, no model, no Ray.

    python scripts/sim_fleet.py --out bench/results/sim_fleet_cpu.json    # 50 replicas, 10,000 jobs, 200 clients
    python scripts/sim_fleet.py --replicas 5 --jobs 200 --clients 20     # the small one (tests/fleet/test_sim_fleet.py)

What is real: the API (server/app.py over server/service.py, admission of the embedded tiny model included) served by
uvicorn on 127.0.0.1, the PostgreSQL store (tests/postgres.py: a throwaway cluster), the storage folder, and the worker
side of every replica: `StoreQueue.take` (the claim), its `report` of a job's events (the lease's fence, the clip
published before its row says completed) and `keep_leases` (renewal every lease / 4, reclaim of stale jobs), the same
calls as a Serve worker replica's (fleet/deploy.py), over parts wired as theirs are (server/parts.py). What is
simulated: a replica's replica group. Each replica is a process (spawned: a fork of a process whose torch has started
its thread pool fails torch's parallel ops) that claims a job, "generates" it by sleeping a drawn duration, and
commits a small clip and its record with pipeline/records.py's `commit_clip`, as a rank does; the clip's bytes and its record name the replica and the claim
(attempt) that made them.

Clients: --clients asyncio tasks over HTTP, each keeping --window jobs in flight (POST, then GET every --poll-s until
the job ends), retrying a 429/503 or a dropped connection after a pause (bounded by --time-limit). Faults, at fixed
shares of the jobs completed: --kill-fraction of the replicas SIGKILLed mid-job (each holding a job on its first
attempt, so a kill never meets the store's second-attempt limit by design), one replica stalled mid-job (SIGSTOP
after its sleep, before it commits the clip, held until its lease ran out, another replica re-claimed the job, re-ran
it and committed its clip and the row says completed; then SIGCONT: it writes its clip and reports late; its report
must be fenced and its bytes must not become the job's: the harness then fetches the job's content from the API and
checks it against the row, `late_report` in the faults), and PostgreSQL stopped for --outage-s and started again.

The audit, after every client has its answers and the replicas and the API have stopped:
  lost              jobs a client was given an id for that did not end completed
  completed twice   jobs the replicas' own logs show completed by more than one report (each replica logs the
                    completions its store calls accepted), or whose clip on disk was made by another claim than the
                    one its row reports (a late report that overwrote the re-run, or a re-run that overwrote a
                    completed job)
  rows without files / files without rows
                    completed rows whose clip or record (the files of the claim the row names) is missing; clips/
                    entries that are not a completed row's clip, record or thumbnail (a fenced-out claim's files and
                    temporary files included) and uploads/ of jobs that ended or do not exist
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import random
import signal
import socket
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from bench_common import ROOT  # noqa: E402  (first: it puts this checkout on sys.path)
sys.path.insert(0, str(ROOT / "tests"))

ENDED = ("completed", "failed", "cancelled")
REQUEST = {"size": "128x32", "steps": 2}  # the cheapest request the tiny model admits


def arguments(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=50)
    p.add_argument("--jobs", type=int, default=10_000)
    p.add_argument("--clients", type=int, default=200)
    p.add_argument("--window", type=int, default=1, help="jobs each client keeps in flight (default 1)")
    p.add_argument("--poll-s", type=float, default=2.0, help="how often a client GETs a job in flight (default 2)")
    p.add_argument("--generate-ms", type=float, nargs=2, default=(50.0, 300.0), metavar=("MIN", "MAX"),
                   help="a simulated generation sleeps a duration drawn uniformly from [MIN, MAX] ms")
    p.add_argument("--lease-s", type=float, default=10.0, help="the fleet's --lease (at least 2 s, as it allows; "
                   "its default is 30)")
    p.add_argument("--idle-poll-s", type=float, default=2.0, help="how long a replica that found no queued job waits "
                   "before it claims again (jobs/supervisor.py polls every 0.2 s; 50 replicas doing so would take most "
                   "of a 2-core machine from the API)")
    p.add_argument("--kill-fraction", type=float, default=0.1, help="share of replicas SIGKILLed mid-job")
    p.add_argument("--kills", type=int, help="replicas SIGKILLed mid-job (overrides --kill-fraction)")
    p.add_argument("--no-stall", action="store_true", help="leave out the stalled late reporter")
    p.add_argument("--no-restart", action="store_true", help="leave out the PostgreSQL restart")
    p.add_argument("--outage-s", type=float, default=3.0, help="how long PostgreSQL stays down")
    p.add_argument("--time-limit", type=float, default=540.0, help="seconds the clients may submit jobs for")
    p.add_argument("--drain-s", type=float, default=120.0, help="then, at most this long to wait for the jobs they "
                   "were given ids for to end (a job that has not ended by then counts as lost)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="write the result here (JSON)")
    p.add_argument("--keep", type=Path, help="keep the storage and logs in this folder (default: a temporary one)")
    args = p.parse_args(argv)
    if args.lease_s < 2:
        p.error(f"--lease-s must be at least 2 (the fleet's bound), got {args.lease_s:g}")
    if args.kills is None:
        args.kills = round(args.kill_fraction * args.replicas)
    if args.kills + (0 if args.no_stall else 1) >= args.replicas:
        p.error(f"{args.kills} kills and a stalled replica leave no replica of {args.replicas} to finish the jobs")
    return args


# --- the processes: the API, and the simulated replicas ----------------------------------------------------------------

class Replicas:
    """The API's view of the worker replicas (/ready, a 429's Retry-After): all serving."""

    def __init__(self, n: int):
        self.n = n

    def status(self) -> list:
        from h3trt.jobs.supervisor import GroupState, GroupStatus

        return [GroupStatus(i, GroupState.SERVING) for i in range(self.n)]

    def serving(self) -> int:
        return self.n


def api_main(entry, store_url: str, storage_dir: Path, folder: Path, listener: socket.socket, replicas: int,
             max_queue: int) -> None:
    """The API process: the FastAPI app of `h3trt serve` over the fleet's store and storage (an ingress)."""
    import uvicorn

    from h3trt.server.app import create_app
    from h3trt.server.log import JsonLog
    from h3trt.server.options import ServeOptions
    from h3trt.server.parts import Parts

    parts = Parts.shared(store_url, storage_dir, log=JsonLog(folder / "api.jsonl"))
    service = parts.service(entry, ServeOptions(data_dir=folder / "api", max_queue=max_queue), Replicas(replicas))
    config = uvicorn.Config(create_app(service), log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[listener])


def replica_main(index: int, entry, store_url: str, storage_dir: Path, folder: Path, lease_s: float,
                 generate_ms: tuple[float, float], idle_poll_s: float, seed: int) -> None:
    """One simulated worker replica (module doc): SIGTERM stops it after its job; SIGUSR1 makes it stall once, after
    its next generation (SIGSTOP to itself before it commits the clip: every thread stops, its lease renewals
    too)."""
    from h3trt.engines.atomic import temp_path
    from h3trt.jobs.job import Event
    from h3trt.pipeline.records import ClipRecord, commit_clip
    from h3trt.server.log import JsonLog
    from h3trt.server.parts import Parts
    from h3trt.server.queue import keep_leases

    stop, stall = threading.Event(), threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the harness stops it
    signal.signal(signal.SIGUSR1, lambda *_: stall.set())
    replica = f"{socket.gethostname()}:{os.getpid()}"
    log, rng = JsonLog(folder / f"replica-{index:03d}.jsonl"), random.Random(seed * 1000 + index)
    parts = Parts.shared(store_url, storage_dir, log=log)
    queue = parts.queue(entry, 86400.0, name=lambda g: f"{replica}/group{g}")
    threading.Thread(target=keep_leases, args=(queue, lease_s, stop, log, replica), daemon=True).start()
    log("replica_ready", replica=replica, index=index)
    while not stop.is_set():
        work = queue.take(0, 1)
        if not work:
            stop.wait(idle_poll_s)  # jobs/supervisor.py polls a queue that may have new work every POLL_S
            continue
        job = work[0]
        claim = {"replica": replica, "attempt": job.attempt}
        seconds = rng.uniform(*generate_ms) / 1000
        time.sleep(seconds)
        if stall.is_set():  # a group that hangs mid-job, its process with it, and wakes up after its lease ran out
            stall.clear()
            log("stalling", job=job.id, **claim)
            os.kill(os.getpid(), signal.SIGSTOP)  # held until the harness sends SIGCONT
            log("resumed", job=job.id, **claim)
        mp4 = temp_path(job.output)
        mp4.write_bytes(json.dumps({"job": job.id, **claim}).encode())  # the "clip" names its claim
        log("generated", job=job.id, **claim)
        record = commit_clip(ClipRecord(timings_s={"sleep": seconds}, status="done", id=job.id,
                                        extra={"simulated": claim, **job.record}), mp4, job.output,
                             overwrite=job.overwrite)
        queue.report(Event(job.id, "done", "done", 100, record=record, group=0, attempt=job.attempt))
    parts.close()


# --- the clients -------------------------------------------------------------------------------------------------------

class Clients:
    """--clients clients over HTTP (module doc); every request's (kind, status, seconds)."""

    def __init__(self, url: str, args: argparse.Namespace, deadline: float, folder: Path):
        self.url, self.args, self.deadline, self.folder = url, args, deadline, folder
        self.samples: list[tuple[str, int, float]] = []
        self.acked: dict[str, int] = {}  # job id -> the client given it
        self.final: dict[str, str] = {}  # job id -> the status its client saw last
        self.submitted = 0

    def run(self) -> None:
        asyncio.run(self._all())

    async def _all(self) -> None:
        import httpx

        share = [self.args.jobs // self.args.clients + (i < self.args.jobs % self.args.clients)
                 for i in range(self.args.clients)]
        # One HTTP client (connection pool) per client, as separate users have: httpx looks over every connection
        # of its pool for each request, and one pool of 200 took a third of a core in this process, from the API's
        # share of the machine.
        limits = httpx.Limits(max_connections=self.args.window, max_keepalive_connections=self.args.window)
        https = [httpx.AsyncClient(base_url=self.url, timeout=30, limits=limits) for _ in share]
        try:
            await asyncio.gather(*(self._client(http, i, n) for i, (http, n) in enumerate(zip(https, share))))
        finally:
            await asyncio.gather(*(http.aclose() for http in https))

    async def _request(self, http, kind: str, method: str, path: str, **kwargs):
        """One request, timed; None when the connection failed or timed out (status 0)."""
        import httpx

        started = time.perf_counter()
        try:
            answer = await http.request(method, path, **kwargs)
        except httpx.HTTPError:
            self.samples.append((kind, 0, time.perf_counter() - started))
            return None
        self.samples.append((kind, answer.status_code, time.perf_counter() - started))
        return answer

    async def _pause(self, answer, rng: random.Random) -> None:
        """After a refusal (429, 503) or a dropped connection: its Retry-After, at most 1 s, jittered."""
        wait = 1.0
        if answer is not None:
            try:
                wait = min(1.0, float(answer.headers.get("retry-after", 1)))
            except ValueError:
                pass
        await asyncio.sleep(wait * rng.uniform(0.5, 1.0))

    def _why(self) -> str:
        """The API's logged internal errors (their tracebacks), for an answer the harness did not expect."""
        try:
            lines = (self.folder / "api.jsonl").read_text().splitlines()
        except OSError as e:
            return f"\n(no API log: {e})"
        errors = [json.loads(line) for line in lines if '"internal_error"' in line]
        return "".join(f"\nAPI {e['method']} {e['path']}: {e['error']}\n{e['trace']}" for e in errors[-3:])

    async def _client(self, http, index: int, jobs: int) -> None:
        rng = random.Random(self.args.seed * 7919 + index)
        inflight: list[str] = []
        made = 0
        while (made < jobs and time.monotonic() < self.deadline) or (
                inflight and time.monotonic() < self.deadline + self.args.drain_s):
            while made < jobs and len(inflight) < self.args.window and time.monotonic() < self.deadline:
                answer = await self._request(http, "POST", "POST", "/v1/videos", json={
                    "prompt": f"client {index} clip {made}", "seed": rng.randrange(1 << 31), **REQUEST})
                if answer is not None and answer.status_code == 200:
                    job = answer.json()["id"]
                    self.acked[job], made = index, made + 1
                    inflight.append(job)
                elif answer is not None and answer.status_code not in (429, 503):
                    raise AssertionError(f"POST answered {answer.status_code}: {answer.text[:500]}{self._why()}")
                else:
                    await self._pause(answer, rng)
            await asyncio.sleep(self.args.poll_s * rng.uniform(0.75, 1.25))
            for job in list(inflight):
                answer = await self._request(http, "GET", "GET", f"/v1/videos/{job}")
                if answer is not None and answer.status_code == 200:
                    status = answer.json()["status"]
                    self.final[job] = status
                    if status in ENDED:
                        inflight.remove(job)
                elif answer is not None and answer.status_code != 503:
                    raise AssertionError(f"GET {job} answered {answer.status_code}: {answer.text[:500]}{self._why()}")


# --- the harness -------------------------------------------------------------------------------------------------------

def _stopped(pid: int) -> bool:
    """Whether a process is stopped (SIGSTOP): its state in /proc."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


class Faults:
    """The faults, each at a share of the jobs completed (module doc); what happened, for the result."""

    def __init__(self, args, store, pg, replicas: list, names: dict[int, str], url: str, folder: Path):
        self.args, self.store, self.pg, self.replicas, self.names = args, store, pg, replicas, names
        self.url, self.folder = url, folder
        self.stall_index = None if args.no_stall else len(replicas) - 1
        kills = [0.1 + 0.6 * i / max(args.kills, 1) for i in range(args.kills)]
        self.plan = sorted([(share, "kill") for share in kills] + ([] if args.no_stall else [(0.3, "stall")])
                           + ([] if args.no_restart else [(0.5, "restart")]))
        self.events: list[dict] = []
        self.killed: set[int] = set()
        self._stalled_job: str | None = None

    def run(self, done: threading.Event, deadline: float) -> None:
        from h3trt.server.store import store_unreachable

        plan = list(self.plan)
        while not done.is_set() and time.monotonic() < deadline:
            try:
                completed = self.store.counts()["completed"]
                if plan and completed >= plan[0][0] * self.args.jobs:
                    _, what = plan.pop(0)
                    getattr(self, what)()
            except Exception as e:  # noqa: BLE001 -- the store is down while it restarts; else a bug to see
                if not store_unreachable(e):
                    raise
            done.wait(0.5)
        self.events.append({"fault": "not_done", "left": [w for _, w in plan]} if plan else {"fault": "all_done"})

    def _note(self, fault: str, **fields) -> None:
        self.events.append({"fault": fault, "t": round(time.time(), 3), **fields})

    def kill(self) -> None:
        """SIGKILL a replica that runs a job on its first attempt (not the stalled one)."""
        for _ in range(200):
            for row in self.store.rows(status="in_progress"):
                index = next((i for i, n in self.names.items() if row.worker == f"{n}/group0"), None)
                if index is None or index in self.killed or index == self.stall_index or row.attempts != 1:
                    continue
                os.kill(self.replicas[index].pid, signal.SIGKILL)
                self.killed.add(index)
                self._note("kill", replica=self.names[index], job=row.id)
                return
            time.sleep(0.05)
        self._note("kill_skipped", reason="no replica held a first attempt for 10 s")

    def stall(self) -> None:
        """Stall a replica past its lease; let it go once another replica has re-claimed its job."""
        index = self.stall_index
        proc, name = self.replicas[index], self.names[index]
        os.kill(proc.pid, signal.SIGUSR1)
        until = time.monotonic() + 30
        while not _stopped(proc.pid) and time.monotonic() < until:
            time.sleep(0.02)
        held = [r.id for r in self.store.rows(status="in_progress") if r.worker == f"{name}/group0"]
        if not held:
            os.kill(proc.pid, signal.SIGCONT)
            self._note("stall_failed", replica=name, reason="it did not stop holding a job")
            return
        job, stalled_at = held[0], time.monotonic()
        self._note("stall", replica=name, job=job)
        until = time.monotonic() + 4 * self.args.lease_s + 60
        while time.monotonic() < until:
            row = self.store.get(job)
            if row.status in ENDED:
                break  # re-claimed under another replica's claim, re-run, its clip committed and its row completed
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGCONT)
        self._note("stall_released", replica=name, job=job, stalled_s=round(time.monotonic() - stalled_at, 2),
                   then={"status": row.status, "worker": row.worker, "attempts": row.attempts,
                         "clip_attempt": row.clip_attempt})
        self._late_report(index, job)

    def _late_report(self, index: int, job: str) -> None:
        """After the stalled replica woke up: wait for it to write its clip and report it (its log says the report
        was ignored), then check that the clip the API serves is the one the row names: its bytes' sha256 is the
        row's record's, and it was made by the claim the row's record names."""
        import hashlib

        import httpx

        log, until, seen = self.folder / f"replica-{index:03d}.jsonl", time.monotonic() + 60, None
        while seen is None and time.monotonic() < until:
            for line in log.read_text().splitlines():
                event = json.loads(line)
                if event["event"] == "late_report_ignored" and event["job"] == job:
                    seen = event
            time.sleep(0.1)
        row = self.store.get(job)
        answer = httpx.get(f"{self.url}/v1/videos/{job}/content", timeout=30)
        made_by = json.loads(answer.content) if answer.status_code == 200 else None
        named = (row.record or {}).get("simulated", {})
        self._note("late_report", replica=self.names[index], job=job, ignored=seen is not None,
                   late_attempt=None if seen is None else seen.get("attempt"), row_clip_attempt=row.clip_attempt,
                   content_status=answer.status_code,
                   served_matches_row=answer.status_code == 200 and hashlib.sha256(answer.content).hexdigest()
                   == (row.record or {}).get("mp4_sha256") and made_by == {"job": job, **named})

    def restart(self) -> None:
        """Stop PostgreSQL (its connections dropped, its data kept) for --outage-s, then start it again."""
        started = time.monotonic()
        self.pg.halt()
        self._note("postgres_down")
        time.sleep(self.args.outage_s)
        self.pg.start()
        self._note("postgres_up", outage_s=round(time.monotonic() - started, 2))


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))]


def audit(store, storage_dir: Path, folder: Path, clients: Clients) -> dict:
    """The counts of the module doc, from the store, the storage folder and the replicas' logs."""
    from h3trt.server.storage import claim_keys, clip_key, record_key

    rows = {r.id: r for r in store.rows()}
    completed = {j for j, r in rows.items() if r.status == "completed"}
    lost = sorted(j for j in clients.acked if j not in completed)
    accepted, generated = Counter(), Counter()
    for path in sorted(folder.glob("replica-*.jsonl")):
        for line in path.read_text().splitlines():
            event = json.loads(line)
            if event["event"] == "completed":
                accepted[event["job"]] += 1
            elif event["event"] == "generated":
                generated[event["job"]] += 1
    clips = storage_dir / "clips"
    twice, other_claim, no_files = set(j for j, n in accepted.items() if n > 1), [], []
    for job in sorted(completed):  # the files the row names (a claim's own: storage.py)
        claim = rows[job].clip_attempt
        mp4, record = storage_dir / clip_key(job, claim), storage_dir / record_key(job, claim)
        if not (mp4.is_file() and record.is_file()):
            no_files.append(job)
            continue
        made_by = json.loads(mp4.read_bytes())
        if (made_by["replica"], made_by["attempt"]) != tuple(
                (rows[job].record or {}).get("simulated", {}).get(k) for k in ("replica", "attempt")):
            other_claim.append(job)
    twice |= set(other_claim)
    running = {j for j, r in rows.items() if r.status in ("queued", "in_progress")}
    named = {key for j in completed for key in claim_keys(j, rows[j].clip_attempt)}
    orphans = sorted([f"clips/{n}" for n in (os.listdir(clips) if clips.is_dir() else []) if f"clips/{n}" not in named]
                     + [f"uploads/{n}" for n in (os.listdir(storage_dir / "uploads")
                                                 if (storage_dir / "uploads").is_dir() else []) if n not in running])
    return {
        "acknowledged": len(clients.acked), "not_submitted": clients.args.jobs - len(clients.acked), "rows": len(rows), "unacknowledged_rows": len(set(rows) - set(clients.acked)),
        "statuses": dict(Counter(r.status for r in rows.values())),
        "lost": len(lost), "lost_jobs": lost[:20],
        "completed_twice": len(twice), "completed_twice_jobs": sorted(twice)[:20],
        "accepted_completions": sum(accepted.values()), "clip_of_another_claim": other_claim[:20],
        "generated": sum(generated.values()), "generated_more_than_once": sum(1 for n in generated.values() if n > 1),
        "claims": sum(r.attempts for r in rows.values()),
        "attempts": dict(Counter(r.attempts for r in rows.values())),
        "rows_without_files": len(no_files), "rows_without_files_jobs": no_files[:20],
        "files_without_rows": len(orphans), "files_without_rows_names": orphans[:20],
    }


class CpuShare:
    """How busy the machine was during the run, and how much of it this run's processes used (this process, its
    children: the API and the replicas, reaped ones included, and its PostgreSQL), from /proc: on a shared machine
    the rest is other users' work. Approximate: the PostgreSQL server stopped by the restart fault is not counted as
    this run's."""

    def __init__(self, pg_data: Path):
        self.pg_data = str(pg_data)
        self.started = (time.monotonic(), _busy_ticks(), self._own_ticks(), os.getloadavg()[0])

    def _own_ticks(self) -> int:
        stats = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    text = Path(f"/proc/{entry}/stat").read_text()
                    fields = text[text.rindex(")") + 2:].split()
                    stats[int(entry)] = (int(fields[1]), sum(int(x) for x in fields[11:15]))
                except (OSError, ValueError, IndexError):
                    pass
        roots = {os.getpid()}
        for pid in stats:
            try:
                if self.pg_data in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                    roots.add(pid)  # the postmaster (its backends are its children)
            except OSError:
                pass
        own, grown = set(roots), True
        while grown:
            more = {pid for pid, (ppid, _) in stats.items() if ppid in own} - own
            own |= more
            grown = bool(more)
        return sum(stats[pid][1] for pid in own if pid in stats)  # utime, stime and reaped children's

    def result(self) -> dict:
        t, busy, own, load = self.started
        seconds, tick = time.monotonic() - t, os.sysconf("SC_CLK_TCK")
        busy_cores, own_cores = (_busy_ticks() - busy) / tick / seconds, (self._own_ticks() - own) / tick / seconds
        return {"cores_busy": round(busy_cores, 2), "cores_used_by_this_run": round(own_cores, 2),
                "cores_used_by_others": round(max(0.0, busy_cores - own_cores), 2),
                "load_average_1_min_at_start_and_end": [round(load, 1), round(os.getloadavg()[0], 1)]}


def _busy_ticks() -> int:
    """The machine's busy CPU ticks since boot (all cores): user, nice, system, irq, softirq, steal."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return sum(fields) - fields[3] - fields[4]  # less idle and iowait


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    memory = next((line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()
                   if line.startswith("MemTotal")), "0")
    return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "memory_gib": round(int(memory) / 2**20, 1),
            "python": platform.python_version(), "platform": platform.platform(),
            "load_average_1_5_15_min_at_end": [round(x, 1) for x in os.getloadavg()]}


def main(argv: list[str] | None = None) -> dict:
    import tempfile

    from postgres import Postgres

    from h3trt.jobs.model_source import Entry
    from h3trt.server.store import JobStore
    import h3trt.server.app  # noqa: F401  -- imported here first: a missing dependency fails before any process starts
    import h3trt.server.parts  # noqa: F401
    import h3trt.server.queue  # noqa: F401
    import h3trt.pipeline.records  # noqa: F401
    import h3trt.jobs.supervisor  # noqa: F401
    import av  # noqa: F401  -- the queue's thumbnail attempt imports it per job otherwise
    import uvicorn  # noqa: F401

    args = arguments(argv)
    folder = Path(args.keep or tempfile.mkdtemp(prefix="h3trt-sim-fleet-"))
    folder.mkdir(parents=True, exist_ok=True)
    storage_dir = folder / "storage"
    entry = Entry.local(device="cpu")
    pg = Postgres()
    processes: list = []
    started = time.time()
    try:
        url = pg.database()
        JobStore(url).close()  # migrated once, before the replicas connect
        # Every process is started before this one starts a thread (the clients, the faults).
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        # Spawned, not forked: a child forked from a process whose torch had started its OpenMP pool (pytest's worker,
        # after other tests) fails its first parallel torch op ("pool INTERNAL ASSERT FAILED ... Invalid thread
        # pool!"): the API's admission computes a schedule, and CI's POSTs answered 500.
        spawn = mp.get_context("spawn")
        api = spawn.Process(target=api_main, args=(entry, url, storage_dir, folder, listener, args.replicas,
                                                  args.jobs + 100), daemon=True)
        api.start()
        listener.close()
        processes.append(api)
        replicas = [spawn.Process(target=replica_main, args=(i, entry, url, storage_dir, folder,
                                                            args.lease_s, tuple(args.generate_ms),
                                                            args.idle_poll_s, args.seed),
                                 daemon=True) for i in range(args.replicas)]
        for proc in replicas:
            proc.start()
        processes += replicas
        names = {i: f"{socket.gethostname()}:{p.pid}" for i, p in enumerate(replicas)}
        _wait_ready(f"http://127.0.0.1:{port}", api, time.monotonic() + 120)
        store = JobStore(url)
        deadline = time.monotonic() + args.time_limit
        clients = Clients(f"http://127.0.0.1:{port}", args, deadline, folder)
        faults = Faults(args, store, pg, replicas, names, f"http://127.0.0.1:{port}", folder)
        done = threading.Event()
        fault_thread = threading.Thread(target=faults.run, args=(done, deadline + args.drain_s), daemon=True)
        run_started, cpu = time.monotonic(), CpuShare(pg.data)
        fault_thread.start()
        clients.run()
        run_s, cpu_share = time.monotonic() - run_started, cpu.result()
        done.set()
        fault_thread.join(4 * args.lease_s + 60 + args.outage_s)
        _stop(processes)
        counts = audit(store, storage_dir, folder, clients)
        store.close()
    finally:
        for proc in processes:
            if proc.is_alive():
                proc.kill()
        pg.stop()
    result = {"machine": {**machine(), "during_the_run": cpu_share},
              "parameters": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "what": "a CPU simulation of the fleet's control plane: the real API, PostgreSQL store and claim/lease/"
                      "report code; replicas sleep instead of generating (no GPU, no model)",
              "run_s": round(run_s, 2), "wall_s": round(time.time() - started, 2), "faults": faults.events,
              "requests": _latencies(clients.samples), **counts,
              "claims_per_s": round(counts["claims"] / run_s, 1),
              "completed_per_s": round(counts["statuses"].get("completed", 0) / run_s, 1),
              "timed_out": counts["not_submitted"] > 0, "folder": str(folder)}
    print(table(result))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


def _wait_ready(url: str, api, deadline: float) -> None:
    import httpx

    while time.monotonic() < deadline:
        if not api.is_alive():
            raise RuntimeError(f"the API process exited ({api.exitcode})")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the API did not answer /health within 120 s")


def _stop(processes: list) -> None:
    """SIGTERM: each replica stops after its job (the API at once); SIGKILL what is left after 30 s."""
    for proc in processes:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGCONT)  # a replica still stopped (a stall not released) could not stop
            proc.terminate()
    until = time.monotonic() + 30
    for proc in processes:
        proc.join(max(0.0, until - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def _latencies(samples: list[tuple[str, int, float]]) -> dict:
    out = {}
    for kind in ("POST", "GET"):
        ok = [s for k, code, s in samples if k == kind and 200 <= code < 300]
        out[kind] = {"count": len(ok), "p50_ms": _ms(percentile(ok, 50)), "p99_ms": _ms(percentile(ok, 99)),
                     "refused": dict(Counter(str(code) for k, code, _ in samples if k == kind and not 200 <= code < 300))}
    return out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def table(r: dict) -> str:
    p = r["parameters"]
    post, get = r["requests"]["POST"], r["requests"]["GET"]
    busy = r["machine"]["during_the_run"]
    lines = [
        f"sim_fleet: {p['replicas']} simulated replicas, {p['jobs']} jobs from {p['clients']} clients; generate = sleep "
        f"U[{p['generate_ms'][0]:g}, {p['generate_ms'][1]:g}] ms; lease {p['lease_s']:g} s; "
        f"{r['machine']['cores']} cores ({r['machine']['cpu']}); during the run the machine was busy "
        f"{busy['cores_busy']} cores, {busy['cores_used_by_others']} of them other users' work",
        "faults: " + "; ".join(f"{e['fault']} {e.get('replica', '')}{' ' + e['job'] if 'job' in e else ''}".strip()
                               for e in r["faults"]),
        "",
        "| measure | value |", "|---|---|",
        f"| POST /v1/videos p50 / p99 | {post['p50_ms']} / {post['p99_ms']} ms ({post['count']} answered 200; refused "
        f"or dropped: {post['refused'] or 0}) |",
        f"| GET /v1/videos/{{id}} p50 / p99 | {get['p50_ms']} / {get['p99_ms']} ms ({get['count']} answered 200; "
        f"refused or dropped: {get['refused'] or 0}) |",
        f"| claims per second | {r['claims_per_s']} ({r['claims']} claims in {r['run_s']} s; jobs completed per "
        f"second {r['completed_per_s']}) |",
        f"| jobs lost | {r['lost']} (of {r['acknowledged']} acknowledged; {r['not_submitted']} not submitted within "
        f"the time limit) |",
        f"| jobs completed twice | {r['completed_twice']} ({r['accepted_completions']} completions accepted; "
        f"{r['generated_more_than_once']} jobs generated more than once) |",
        f"| rows without files | {r['rows_without_files']} |",
        f"| files without rows | {r['files_without_rows']} |",
    ]
    late = next((e for e in r["faults"] if e["fault"] == "late_report"), None)
    if late is not None:
        lines.append(f"| stalled replica's late clip and report (after the re-run completed) | report ignored: "
                     f"{'yes' if late['ignored'] else 'NO'}; the served clip is the row's: "
                     f"{'yes' if late['served_matches_row'] else 'NO'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    result = main()
    ok = not (result["lost"] or result["completed_twice"] or result["rows_without_files"]
              or result["files_without_rows"] or result["timed_out"])
    sys.exit(0 if ok else 1)
