"""The job store: every job of a server (or a fleet), its state and its result, in one table that outlives the
process. SQLite by default (a file under the server's data folder, write-ahead logged); any database SQLAlchemy
speaks through the same class (a fleet's PostgreSQL: a URL). The schema is versioned by Alembic migrations
(server/migrations/), applied when a store opens.

A job moves queued -> in_progress -> completed | failed | cancelled. `claim` takes the oldest queued job for a
worker atomically (one UPDATE guarded by the status it expects, so two workers never take the same job; PostgreSQL
also skips rows another transaction holds: SELECT ... FOR UPDATE SKIP LOCKED); `claim_batch` takes with it, in the
same UPDATE, later queued jobs whose stored batch key (`batch_key`, request/request.py BatchKey.digest) is the
oldest one's, which share its batched denoise. A job found in_progress when a server
starts was running when the previous one stopped: `recover` queues it again, once (MAX_ATTEMPTS), else fails it with
the reason.

Several processes on one store (a fleet): each running job holds a lease. Its worker renews it (`heartbeat`, every
few seconds, `heartbeat_at`); a job whose lease ran out (`stale_before`) belongs to a worker that died, and any live
process recovers it as a restart would. A worker whose lease was taken from it (it stalled) no longer owns the job:
its late progress and end are ignored. The fence is the claim itself: `worker` (who holds the job) and `attempt` (which
claim of it, the row's `attempts` when it was taken) are compared in the UPDATE, so a report of an earlier claim is
ignored even when the same worker has taken the job again since (its end was still to be recorded when its lease ran
out, and the requeued job, oldest in the queue, came back to it).

No SQL is written by hand: statements are SQLAlchemy Core expressions with bound parameters.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import (Boolean, Column, Float, Integer, MetaData, String, Table, Text, create_engine, event, func,
                        select, update, delete)
from sqlalchemy.engine import Engine, Row
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from ..errors import UserError
from ..str_enum import StrEnum


class JobStatus(StrEnum):
    """A job's status, as OpenAI's Videos API names it (module doc: queued -> in_progress -> one of the ends); a
    row's column holds the string."""

    QUEUED = "queued"
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def ended(self) -> bool:
        """The job will not run again: its files and row expire after the retention."""
        return self in (JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED)


STATUSES = tuple(JobStatus)
ENDED = tuple(status for status in JobStatus if status.ended)
CONNECT_TIMEOUT_S = 5  # a PostgreSQL store that does not answer a connection within this is unreachable
MAX_ATTEMPTS = 2  # a job that was running when its worker or server died runs once more, then fails

metadata = MetaData()
jobs = Table(
    "jobs", metadata,
    Column("seq", Integer, primary_key=True, autoincrement=True),  # creation order (the list's cursor order)
    Column("id", String(64), nullable=False, unique=True),  # video_<hex>
    Column("status", String(16), nullable=False, index=True),
    Column("created_at", Float, nullable=False),  # Unix seconds
    Column("started_at", Float),  # taken by a worker (the latest attempt)
    Column("completed_at", Float),  # ended, whichever way
    Column("expires_at", Float, index=True),  # its files and this row are removed then (ended jobs only)
    Column("progress", Integer, nullable=False, default=0),  # 0-100, monotonic (jobs/job.py)
    Column("stage", String(32), nullable=False, default="queued"),
    Column("evaluations_done", Integer, nullable=False, default=0),
    Column("evaluations_total", Integer, nullable=False, default=0),
    Column("attempts", Integer, nullable=False, default=0),  # times a worker took it
    Column("cancel_requested", Boolean, nullable=False, default=False),
    Column("deleted", Boolean, nullable=False, default=False),  # DELETE while running: removed when it stops
    Column("error_code", String(64)),
    Column("error_message", Text),
    Column("request", Text, nullable=False),  # JSON: the request in the one schema, and the OpenAI fields as sent
    Column("record", Text),  # JSON: the clip's record (timings, seed, the bundle's manifest hash)
    Column("output", Text),  # where the MP4 is (a path, or a URL of a fleet's storage)
    Column("worker", String(128)),  # which replica group ran it (a fleet: host:pid/group)
    Column("heartbeat_at", Float),  # its worker's last renewal of the lease (in_progress jobs; migration 0002)
    # A completed job's clip is the files of this claim (storage.py clip_key(id, clip_attempt)); NULL on rows completed
    # before each claim wrote files of its own names (migration 0003), whose clip is clip_key(id)
    Column("clip_attempt", Integer),
    # The request's batch key (request/request.py BatchKey.digest): a claim takes queued jobs of the oldest one's key
    # together (claim_batch); NULL: it runs alone (a request that shares no evaluation, or a row of before: migration
    # 0004)
    Column("batch_key", String(64)),
)


@dataclass(frozen=True)
class JobRow:
    """One job as stored."""

    seq: int
    id: str
    status: JobStatus | str  # a string only where a row holds none of the statuses (an older h3trt's, a hand edit)
    created_at: float
    started_at: float | None
    completed_at: float | None
    expires_at: float | None
    progress: int
    stage: str
    evaluations_done: int
    evaluations_total: int
    attempts: int
    cancel_requested: bool
    deleted: bool
    error_code: str | None
    error_message: str | None
    request: dict
    record: dict | None
    output: str | None
    worker: str | None
    heartbeat_at: float | None
    clip_attempt: int | None
    batch_key: str | None = None

    @classmethod
    def of(cls, row: Row) -> "JobRow":
        data = dict(row._mapping)
        # A column that does not hold a JSON object (an older h3trt's, a hand edit) reads as an empty one, so one
        # such row cannot break the reads of every other (the API renders what it can of it and logs it).
        data["request"] = _object(data["request"]) or {}
        data["record"] = _object(data["record"]) if data["record"] else None
        data["cancel_requested"], data["deleted"] = bool(data["cancel_requested"]), bool(data["deleted"])
        if data["status"] in STATUSES:
            data["status"] = JobStatus(data["status"])
        return cls(**data)


def _object(text) -> dict | None:
    """A JSON object column's value; None when it holds something else."""
    try:
        value = json.loads(text)
    except (TypeError, ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def sqlite_url(data_dir: Path) -> str:
    return f"sqlite:///{Path(data_dir).resolve() / 'jobs.sqlite3'}"


class JobStore:
    """The store's interface over one database URL (module doc). Thread-safe: every call is its own transaction."""

    def __init__(self, url: str):
        self.url = url
        self.sqlite = url.startswith("sqlite")
        # PostgreSQL: a connection the server dropped (a restart) is noticed and replaced before it is used, and an
        # unreachable server is an error within seconds, not a hang (store_unreachable).
        kwargs = ({"connect_args": {"check_same_thread": False, "timeout": 30}} if self.sqlite else
                  {"pool_pre_ping": True, "connect_args": {"connect_timeout": CONNECT_TIMEOUT_S}})
        self.engine: Engine = create_engine(url, future=True, **kwargs)
        if self.sqlite:
            event.listen(self.engine, "connect", _sqlite_pragmas)
        # Reads are one statement each: without a transaction around it (no BEGIN and ROLLBACK round trips, two of
        # the four a read made on PostgreSQL), they see what they saw before (PostgreSQL's READ COMMITTED gives each
        # statement its own snapshot anyway). The same pool of connections.
        self.reader: Engine = self.engine.execution_options(isolation_level="AUTOCOMMIT")
        migrate(self.engine)

    def close(self) -> None:
        self.engine.dispose()

    def reachable(self) -> bool:
        """Whether the database answers now (/ready)."""
        try:
            with self.reader.connect() as c:
                c.execute(select(1))
            return True
        except Exception as e:  # noqa: BLE001 -- only an outage is an answer; anything else is a bug to see
            if store_unreachable(e):
                return False
            raise

    # --- writes -----------------------------------------------------------------------------------------------------

    def create(self, job_id: str, request: dict, now: float | None = None, batch_key: str | None = None) -> JobRow:
        """A queued job; `batch_key`: its request's BatchKey.digest (None: it runs alone)."""
        with self.engine.begin() as c:
            return JobRow.of(c.execute(jobs.insert().values(
                id=job_id, status=JobStatus.QUEUED, created_at=now or time.time(), progress=0, stage="queued",
                evaluations_done=0, evaluations_total=0, attempts=0, cancel_requested=False, deleted=False,
                request=json.dumps(request), batch_key=batch_key).returning(*jobs.c)).one())

    def claim(self, worker: str, now: float | None = None) -> JobRow | None:
        """The oldest queued job, now in_progress for `worker` (attempts + 1); None when none is queued."""
        return next(iter(self.claim_batch(worker, 1, now)), None)

    def claim_batch(self, worker: str, limit: int, now: float | None = None) -> list[JobRow]:
        """The oldest queued job and, when it has a batch key, up to `limit` - 1 later queued jobs of the same key
        (oldest first), now in_progress for `worker` (attempts + 1 each), in one transaction; [] when none is queued.
        Each row is taken by one claim only: the UPDATE is guarded by the status it expects (and PostgreSQL's SELECTs
        skip the rows another claim holds), so of two racing claims each gets the rows it changed, all of one key."""
        while True:
            with self.engine.begin() as c:
                first = c.execute(_queued(select(jobs.c.id, jobs.c.batch_key), self.sqlite).limit(1)).first()
                if first is None:
                    return []
                ids = [first.id]
                if first.batch_key is not None and limit > 1:
                    ids += c.execute(_queued(select(jobs.c.id), self.sqlite).where(
                        jobs.c.batch_key == first.batch_key, jobs.c.id != first.id).limit(limit - 1)).scalars().all()
                now = now or time.time()
                taken = c.execute(update(jobs).where(jobs.c.id.in_(ids), jobs.c.status == JobStatus.QUEUED).values(
                    status="in_progress", started_at=now, heartbeat_at=now, worker=worker, stage="text_encode",
                    attempts=jobs.c.attempts + 1).returning(*jobs.c)).all()
            if taken:
                return sorted((JobRow.of(row) for row in taken), key=lambda row: row.seq)
            # another worker took them between the select and the update: look again

    def progress(self, job_id: str, progress: int, stage: str, evaluations: tuple[int, int],
                 worker: str | None = None, attempt: int | None = None) -> None:
        """A running job's progress (never backwards); `evaluations` (done, total), (0, 0) when not a denoise step;
        `worker` (and `attempt`): only while that worker holds it (under that claim)."""
        values = dict(progress=progress, stage=stage)
        if evaluations[1]:
            values.update(evaluations_done=evaluations[0], evaluations_total=evaluations[1])
        with self.engine.begin() as c:
            c.execute(update(jobs).where(jobs.c.id == job_id, jobs.c.status == JobStatus.IN_PROGRESS,
                                         jobs.c.progress <= progress, *_held_by(worker, attempt)).values(**values))

    def end(self, job_id: str, status: str, retention_s: float, now: float | None = None, record: dict | None = None,
            output: str | None = None, error: tuple[str, str] | None = None,
            worker: str | None = None, attempt: int | None = None, clip_attempt: int | None = None) -> JobRow | None:
        """A job's end: completed (its record, output and the claim whose files are its clip, `clip_attempt`),
        failed (error code and message) or cancelled; its files and row expire `retention_s` later. Only a job not
        already ended changes (an end is reported once), and with `worker` only one that worker holds (with
        `attempt`, under that claim: module doc)."""
        if status not in ENDED:
            raise ValueError(f"end status {status!r} is not one of {ENDED}.")
        now = now or time.time()
        values = dict(status=status, completed_at=now, expires_at=now + retention_s,
                      stage="done" if status == JobStatus.COMPLETED else status)
        if status == JobStatus.COMPLETED:
            values.update(progress=100, record=json.dumps(record), output=output, clip_attempt=clip_attempt)
        if error is not None:
            values.update(error_code=error[0], error_message=error[1])
        with self.engine.begin() as c:
            changed = c.execute(update(jobs).where(jobs.c.id == job_id, jobs.c.status.notin_(ENDED),
                                                   *_held_by(worker, attempt)).values(**values)).rowcount
        return self.get(job_id) if changed else None

    def requeue(self, job_id: str, stale_before: float | None = None, worker: str | None = None,
                attempt: int | None = None) -> bool:
        """Put an in_progress job back in the queue (its worker died; with `stale_before`, only if its lease ran out
        before then; with `worker` and `attempt`, only under that claim); False when it was not in progress (or its
        lease is live, or another claim holds it)."""
        with self.engine.begin() as c:
            return bool(c.execute(update(jobs).where(jobs.c.id == job_id, jobs.c.status == JobStatus.IN_PROGRESS,
                                                     *_stale(stale_before), *_held_by(worker, attempt)).values(
                status="queued", stage="queued", progress=0, evaluations_done=0, worker=None,
                heartbeat_at=None)).rowcount)

    def heartbeat(self, workers: list[str], now: float | None = None) -> int:
        """Renew the lease of every job these workers run; how many."""
        with self.engine.begin() as c:
            return c.execute(update(jobs).where(jobs.c.status == JobStatus.IN_PROGRESS, jobs.c.worker.in_(workers))
                             .values(heartbeat_at=now or time.time())).rowcount

    def request_cancel(self, job_id: str, delete_after: bool = False) -> JobRow | None:
        """Cancel a job: a queued one at once, a running one at its next denoise step (its worker confirms).
        `delete_after`: remove it (files and row) once it has stopped (DELETE)."""
        with self.engine.begin() as c:
            c.execute(update(jobs).where(jobs.c.id == job_id, jobs.c.status.notin_(ENDED))
                      .values(cancel_requested=True))
            if delete_after:
                c.execute(update(jobs).where(jobs.c.id == job_id).values(deleted=True))
        return self.get(job_id)

    def remove(self, job_id: str) -> None:
        with self.engine.begin() as c:
            c.execute(delete(jobs).where(jobs.c.id == job_id))

    def recover(self, retention_s: float, now: float | None = None,
                stale_before: float | None = None) -> tuple[list[str], list[str]]:
        """After a restart (every running job), or in a fleet (`stale_before`: the running jobs whose lease ran out
        before then): queued again, or failed after MAX_ATTEMPTS; (queued again, failed)."""
        requeued, failed = [], []
        for row in self.rows(status="in_progress", stale_before=stale_before):
            if row.attempts < MAX_ATTEMPTS and not row.cancel_requested:
                if self.requeue(row.id, stale_before):
                    requeued.append(row.id)
            elif row.cancel_requested:
                self.end(row.id, "cancelled", retention_s, now, worker=row.worker)
            elif self.end(row.id, "failed", retention_s, now, worker=row.worker, error=(
                    "worker_lost", f"the server or its worker stopped while this job ran, {row.attempts} times; it "
                                   "is not run again")) is not None:
                failed.append(row.id)
        return requeued, failed

    # --- reads ------------------------------------------------------------------------------------------------------

    def get(self, job_id: str) -> JobRow | None:
        with self.reader.connect() as c:
            row = c.execute(select(jobs).where(jobs.c.id == job_id)).first()
        return JobRow.of(row) if row is not None else None

    def rows(self, status: str | None = None, expired_before: float | None = None,
             stale_before: float | None = None) -> list[JobRow]:
        query = select(jobs).order_by(jobs.c.seq).where(*_stale(stale_before))
        if status is not None:
            query = query.where(jobs.c.status == status)
        if expired_before is not None:
            query = query.where(jobs.c.status.in_(ENDED), jobs.c.expires_at < expired_before)
        with self.reader.connect() as c:
            return [JobRow.of(r) for r in c.execute(query)]

    def page(self, after: str | None, limit: int, order: str) -> tuple[list[JobRow], bool]:
        """Visible jobs (not deleted) by creation, `after` the cursor job; (rows, more after them)."""
        query = select(jobs).where(jobs.c.deleted.is_(False))
        if after is not None:
            cursor = self.get(after)
            if cursor is None:
                raise KeyError(after)
            query = query.where(jobs.c.seq > cursor.seq if order == "asc" else jobs.c.seq < cursor.seq)
        query = query.order_by(jobs.c.seq.asc() if order == "asc" else jobs.c.seq.desc()).limit(limit + 1)
        with self.reader.connect() as c:
            rows = [JobRow.of(r) for r in c.execute(query)]
        return rows[:limit], len(rows) > limit

    def counts(self) -> dict[str, int]:
        """Jobs by status: reads every row (/metrics, a restart's log); admission reads `queued`."""
        with self.reader.connect() as c:
            found = dict(c.execute(select(jobs.c.status, func.count()).group_by(jobs.c.status)).all())
        return {s: int(found.get(s, 0)) for s in STATUSES}

    def queued(self) -> int:
        """Jobs waiting (the queue's depth, admission's bound): read from the status index, so its cost is the
        queue's length, not the table's (every job of the retention, ended ones included)."""
        with self.reader.connect() as c:
            queued = select(func.count()).select_from(jobs).where(jobs.c.status == JobStatus.QUEUED)
            return int(c.execute(queued).scalar())

    def cancels(self) -> list[str]:
        """Running jobs whose cancellation was asked for."""
        with self.reader.connect() as c:
            return list(c.execute(select(jobs.c.id).where(jobs.c.status == JobStatus.IN_PROGRESS,
                                                          jobs.c.cancel_requested.is_(True))).scalars())


DISK_FULL_WORDS = ("database or disk is full", "no space left on device", "disk quota exceeded")


def is_disk_full(error: BaseException) -> bool:
    """Whether an error is the data disk being full: an OSError ENOSPC/EDQUOT from storage, SQLite's "database or
    disk is full" (SQLITE_FULL) through SQLAlchemy, or either's words in a worker's error text."""
    import errno

    seen: list[BaseException] = []
    while error is not None and error not in seen:
        seen.append(error)
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(w in str(error).lower() for w in DISK_FULL_WORDS):
            return True
        error = getattr(error, "orig", None) or error.__cause__ or error.__context__
    return False


def store_unreachable(e: BaseException) -> bool:
    """Whether `e` says the database could not be reached or dropped the connection (a restart, a network fault), as
    opposed to a wrong statement: the API answers 503 and workers wait for it rather than failing their jobs. A full
    disk is an OperationalError too, but it is not an outage: waiting would never end while nothing frees space, so
    it is answered as a full disk (507, the job that met it fails) and never counted here. Every pooled connection
    busy past the pool's timeout (connects hanging on a restarting server, a store too slow for the load) is the same
    wait-and-retry case."""
    if is_disk_full(e):
        return False
    return isinstance(e, (OperationalError, PoolTimeout)) or (
        isinstance(e, DBAPIError) and bool(e.connection_invalidated))


def _queued(query, sqlite: bool):
    """`query` over the queued jobs, oldest first; on PostgreSQL the rows it reads are locked for this transaction,
    and rows another transaction holds skipped (SELECT ... FOR UPDATE SKIP LOCKED)."""
    query = query.where(jobs.c.status == JobStatus.QUEUED).order_by(jobs.c.seq)
    return query if sqlite else query.with_for_update(skip_locked=True)


def _held_by(worker: str | None, attempt: int | None = None) -> tuple:
    """The condition that `worker` still holds a job (none when no worker is named), under the claim that made
    `attempts` equal `attempt` (when given): the lease's fence (module doc)."""
    held = () if worker is None else (jobs.c.worker == worker,)
    return held if attempt is None else (*held, jobs.c.attempts == attempt)


def _stale(before: float | None) -> tuple:
    """The condition that a running job's lease ran out before `before` (none when None): its last heartbeat, or its
    start when it never had one."""
    return () if before is None else (func.coalesce(jobs.c.heartbeat_at, jobs.c.started_at) < before,)


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")  # readers never wait for the writer; a crash keeps what committed
    cursor.execute("PRAGMA synchronous=FULL")  # a committed job survives power loss too, not only kill -9
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


def migrate(engine: Engine) -> None:
    """Bring the database to the newest schema (Alembic, server/migrations/); a database from a newer h3trt is
    refused rather than written."""
    from alembic import command
    from alembic.config import Config
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    config = Config()
    config.set_main_option("script_location", str(Path(__file__).with_name("migrations")))
    head = ScriptDirectory.from_config(config).get_current_head()
    with engine.begin() as connection:
        current = MigrationContext.configure(connection).get_current_revision()
        if current == head:
            return
        known = {s.revision for s in ScriptDirectory.from_config(config).walk_revisions()}
        if current is not None and current not in known:
            raise UserError(f"The job store {engine.url!r} has schema revision {current}, which this h3trt does "
                               f"not know (newest known: {head}); run the h3trt that wrote it, or another store.")
        config.attributes["connection"] = connection
        command.upgrade(config, "head")
