"""The worker side of a job store, shared by `h3trt serve` (one node) and a fleet's worker replicas (h3trt/fleet/):

  - `StoreQueue` is the JobQueue (jobs/job.py) replica groups take work from (jobs/supervisor.py): the store's
    queued jobs, oldest first, each claimed by one worker, with up to --max-batch - 1 later jobs of its batch key that
    share its batched denoise (server/store.py `claim_batch`, one transaction)
  - their events become the job's row: progress, stage, the end; a finished clip is published to storage
    (server/storage.py) before its row says completed. Each claim writes files of its own names (clip_key(id,
    attempt)) and the completed row names the claim whose files are the clip: a worker that stalled past its lease
    and writes after another claim completed the job leaves only its own claim's files, which its fenced report
    removes; it never replaces the clip the row serves
  - jobs whose worker is gone are dealt with once: a restart of one node (`recover`: every running job), or in a
    fleet the jobs whose lease ran out (`reclaim`, from any live worker: `keep_leases`); a clip committed before its
    worker died is completed, not run again

The API side (admission, reads, cancel requests, expiry) is server/service.py.
"""

from __future__ import annotations

import json
import time
from typing import Callable

from ..errors import UserError
from ..jobs.job import Event, EventKind, Job
from ..request.parse import RequestDefaults
from ..pipeline.records import ClipRecord, Failure
from .metrics import Metrics
from .service import stored_request
from .storage import Storage, claim_keys, clip_key, job_keys, job_of, record_key, thumbnail_key, uploads_key
from .store import MAX_ATTEMPTS, JobRow, JobStatus, JobStore, is_disk_full, store_unreachable

STORE_RETRY_S = 1.0  # how often a worker tries again to record an event while the store is unreachable
HEARTBEAT_DIVISOR = 4  # a worker renews its leases this many times per lease: a few missed renewals are survived


DISK_FULL = ("the server's disk filled while this job ran, and what it had written was removed; send the job again "
             "once the server has room (it takes new jobs again by itself).")


class StoreQueue:
    """A JobQueue over a job store and a storage (module doc). Group `g` claims jobs as `name(g)` (unique across a
    fleet: host, process and group); its events apply only while it still holds the job under the claim they report on
    (Job.attempt, Event.attempt: the row's attempts when it was taken; server/store.py's fence)."""

    def __init__(self, store: JobStore, storage: Storage, retention_s: float, defaults: RequestDefaults,
                 metrics: Metrics, log: Callable[..., None], name: Callable[[int], str] = lambda g: f"group{g}"):
        self.store, self.storage, self.retention_s, self.defaults = store, storage, retention_s, defaults
        self.metrics, self.log, self.name = metrics, log, name
        self._unrecorded: list[Event] = []  # jobs' ends the store could not take (its disk full): retried each poll
        self._disk_full = False

    # --- the JobQueue ------------------------------------------------------------------------------------------------

    def take(self, group: int, limit: int) -> list[Job] | None:
        if not self._flush_unrecorded():
            return []  # the disk is still full: no new job until what ended is recorded
        try:
            rows = self.store.claim_batch(self.name(group), limit)
        except Exception as e:  # noqa: BLE001 -- a full disk and an unreachable store are survived; else raised
            if is_disk_full(e):
                self._full(e)
                return []
            if not store_unreachable(e):
                raise
            self.log("store_unreachable", worker=self.name(group), during="claim", error=_short(e))
            time.sleep(STORE_RETRY_S)  # nothing claimed: the group asks again, the replica stays (issue 35 #10)
            return []
        self._space_again()
        jobs = []
        for row in rows:
            try:
                jobs.append(self.job_of(row))
            except (UserError, OSError) as e:  # its uploads vanished since it was admitted: it fails alone
                self.report(Event(row.id, "failed", "encode", error=f"encode: {e}", group=group, attempt=row.attempts))
        return jobs

    def job_of(self, row: JobRow) -> Job:
        # The request as the API side admitted it (server/service.py stored_request): this worker may be another process than the one
        # that admitted it, or a later one, and its uploads are fetched into another folder.
        request, key = stored_request(row.request, self.storage.fetch(uploads_key(row.id)), self.defaults)
        # The claim's own names: another claim of the job (a re-run while this one stalls) never writes them.
        return Job(row.id, request, self.storage.work_path(clip_key(row.id, row.attempts)), overwrite=True,
                   record={"job": row.id}, key=key, attempt=row.attempts)

    def report(self, event: Event) -> None:
        """Record a job's event; while the store is unreachable, wait for it (the job keeps running, it is not
        failed or run again for an outage). A full data disk stops no worker: a progress event is dropped, a job's end is kept
        and recorded when space returns (each poll retries it); the job that met the full disk fails (disk_full)."""
        if self._unrecorded and event.ends:
            self._unrecorded.append(event)
            self._flush_unrecorded()
            return
        try:
            self._until_reachable(self._report, event, during=f"report {event.kind} of {event.job}")
        except Exception as e:  # noqa: BLE001 -- only a full disk is survived; anything else is raised
            if not is_disk_full(e):
                raise
            self._full(e)
            if event.ends:
                self._unrecorded.append(event)

    def _flush_unrecorded(self) -> bool:
        """Record the ends kept while the disk was full, oldest first; True when none is left."""
        while self._unrecorded:
            event = self._unrecorded[0]
            try:
                self._until_reachable(self._report, event, during=f"report {event.kind} of {event.job}")
            except Exception as e:  # noqa: BLE001
                if not is_disk_full(e):
                    raise
                self._full(e)
                if event.kind == EventKind.DONE:  # its clip cannot be recorded: it fails, and its files free space
                    self._drop_claim(event.job, event.attempt or None, self.store.get(event.job))
                    self._unrecorded[0] = Event(event.job, "failed", "store", group=event.group, attempt=event.attempt,
                                                error=f"the server's data disk is full: {e.__class__.__name__}",
                                                record=Failure("DiskFull"))
                return False
            self._unrecorded.pop(0)
        self._space_again()
        return True

    def _full(self, error: BaseException) -> None:
        if not self._disk_full:
            self._disk_full = True
            self.log("disk_full", error=" ".join(str(error).split())[:300],
                     message="the data disk is full: new jobs wait, jobs that meet it fail; serving resumes by "
                             "itself when space is freed")

    def _space_again(self) -> None:
        if self._disk_full:
            self._disk_full = False
            self.log("disk_space_again", message="the data disk takes writes again; serving resumes")

    def _until_reachable(self, call: Callable, *args, during: str):
        said = False
        while True:
            try:
                return call(*args)
            except Exception as e:
                if not store_unreachable(e):
                    raise
                if not said:
                    self.log("store_unreachable", during=during, error=_short(e))
                    said = True
            time.sleep(STORE_RETRY_S)

    def _report(self, event: Event) -> None:
        worker, attempt = self.name(event.group), event.attempt or None
        row = self.store.get(event.job)
        if row is None or row.status != JobStatus.IN_PROGRESS or not _holds(row, worker, attempt):
            # It ended, or its lease went to another worker while this one stalled, or to this worker again under a
            # later claim: not this claim's to record. What this claim wrote goes (its own names: another claim's
            # files, the accepted clip among them, are left alone), unless the row completed with it (a lease
            # recovery found it committed). The store's UPDATEs check the same, for a lease lost after this read.
            if not event.ends:  # a stalled claim's progress: its files go once, with its last report
                return
            self._drop_claim(event.job, attempt, row)
            if row is None or row.worker != worker:  # this process fetched its uploads for that claim alone
                self.storage.discard(uploads_key(event.job))
            self.log("late_report_ignored", job=event.job, kind=str(event.kind), worker=worker, attempt=attempt,
                     holder=None if row is None else row.worker, status=None if row is None else str(row.status))
            return
        if event.kind in (EventKind.STARTED, EventKind.PROGRESS):
            self.store.progress(event.job, event.progress, event.stage or row.stage, event.evaluations, worker, attempt)
            return
        if row.deleted or (event.kind == EventKind.DONE and row.cancel_requested):
            # DELETE or cancel while it ran: whatever it made goes.
            self._remove_files(event.job, row.attempts)
            if row.deleted:
                self.store.remove(event.job)
                self.log("deleted", job=event.job)
                return
            event = Event(event.job, "cancelled", error="cancelled by request", group=event.group,
                          attempt=event.attempt)
        if event.kind == EventKind.DONE:
            self._complete(event.job, event.record.to_json(), worker, row.attempts)
        elif event.kind == EventKind.FAILED:
            code = _error_code(event.record.error_type if event.record is not None else "")
            if is_disk_full(Exception(event.error or "")):
                code = "disk_full"
            # What the client reads: a full disk in the API's words (the rank's error names the server's files,
            # which the log keeps for the operator)
            shown = DISK_FULL if code == "disk_full" else event.error
            ended = self.store.end(event.job, "failed", self.retention_s, error=(code, shown), worker=worker,
                                   attempt=attempt)
            self._remove_files(event.job, row.attempts)
            if ended is not None:
                self.metrics.ended(ended)
            self.log("failed", job=event.job, code=code, error=event.error)
        elif event.kind == EventKind.CANCELLED:
            self._remove_files(event.job, row.attempts)
            ended = self.store.end(event.job, "cancelled", self.retention_s,
                                   error=("cancelled", event.error or "cancelled by request"), worker=worker,
                                   attempt=attempt)
            if ended is not None:
                self.metrics.ended(ended)
            self.log("cancelled", job=event.job, detail=event.error)

    def lost(self, group: int, jobs: list[Job], reason: str, died: bool) -> None:
        try:
            self._until_reachable(self._lost, group, jobs, reason, died, during="a group's lost jobs")
        except Exception as e:  # noqa: BLE001 -- only a full disk is survived; anything else is raised
            if not is_disk_full(e):
                raise
            self._full(e)
            self._unrecorded += [Event(job.id, "failed", "worker", error=f"worker: {reason}",
                                       record=Failure("WorkerLost"), group=group, attempt=job.attempt)
                                 for job in jobs]

    def _lost(self, group: int, jobs: list[Job], reason: str, died: bool) -> None:
        for job in jobs:
            row = self.store.get(job.id)
            if row is None or not _holds(row, self.name(group), job.attempt or None):
                continue
            if row.deleted or row.cancel_requested:
                self.report(Event(job.id, "cancelled", error="cancelled while its worker stopped", group=group,
                                  attempt=job.attempt))
            elif died and row.attempts < MAX_ATTEMPTS:
                if self.store.requeue(job.id, worker=self.name(group), attempt=job.attempt or None):
                    self.log("requeued", job=job.id, reason=reason, attempts=row.attempts)
            else:  # a rank raised `reason` ("OutOfMemoryError: ..."), or the job already ran twice
                kind = reason.split(":", 1)[0] if not died and ":" in reason else "WorkerLost"
                self.report(Event(job.id, "failed", "worker", error=f"worker: {reason}", record=Failure(kind),
                                  group=group, attempt=job.attempt))

    def cancels(self) -> list[str]:
        if self._unrecorded:  # every poll, draining too (a drain claims nothing but waits on these ends)
            self._flush_unrecorded()
        try:
            return self.store.cancels()
        except Exception as e:  # noqa: BLE001
            if not store_unreachable(e):
                raise
            return []  # asked again on the next turn, once the store answers

    # --- workers that are gone ----------------------------------------------------------------------------------------

    def heartbeat(self, groups: int) -> int:
        """Renew the leases of the jobs this process's `groups` run (a fleet's worker, every lease / 4)."""
        return self.store.heartbeat([self.name(g) for g in range(groups)])

    def reclaim(self, lease_s: float | None = None) -> tuple[list[str], list[str]]:
        """Running jobs whose worker is gone: all of them (`lease_s` None: one node restarting), or those whose lease
        ran out `lease_s` ago (a fleet). A committed clip completes its job; other jobs are queued again once, then
        failed (store.recover). (queued again, failed)."""
        stale_before = None if lease_s is None else time.time() - lease_s
        for row in self.store.rows(status="in_progress", stale_before=stale_before):
            if self._committed(row.id, row.attempts):  # committed before its worker died: done, not run again
                self._complete(row.id, json.loads(self.storage.read_text(record_key(row.id, row.attempts))),
                               row.worker, row.attempts)
        requeued, failed = self.store.recover(self.retention_s, stale_before=stale_before)
        for job_id in requeued:
            self.log("requeued", job=job_id, reason="its worker stopped renewing its lease" if lease_s else
                     "the server stopped while it ran")
        return requeued, failed

    def recover(self) -> None:
        """One node, before its workers start (it alone uses its store and folder): every running job was
        interrupted; partial files of killed ranks, files without a job, and the rank-group and scratch folders that
        killed processes of this host left in $TMPDIR (a SIGKILLed server's) go, as a fleet replica's start sweeps."""
        self.log("swept", **self.storage.sweep())
        requeued, failed = self.reclaim()
        known = {row.id for row in self.store.rows()}
        orphans = [f"{folder}/{name}" for folder in ("clips", "uploads") for name in self.storage.names(folder)
                   if job_of(name) not in known]
        self.storage.remove(*orphans)
        self.log("recovered", requeued=requeued, failed=failed, orphans_removed=len(orphans),
                 queued=self.store.queued())

    # --- files --------------------------------------------------------------------------------------------------------

    def _remove_files(self, job_id: str, attempts: int) -> None:
        """Every file of a job that ends without a clip (or is deleted), after `attempts` claims."""
        self.storage.remove(*job_keys(job_id, attempts))

    def _drop_claim(self, job_id: str, attempt: int | None, row: JobRow | None) -> None:
        """Remove what the claim `attempt` wrote of a job (its scratch copies too), unless `row` (the job as read
        after the claim lost it; None: gone) completed the job with it. Another claim's files are never touched."""
        if attempt is None:  # a report that names no claim: only its unpublished copies
            self.storage.discard(*claim_keys(job_id, None))
            return
        if row is not None and row.status == JobStatus.COMPLETED and row.clip_attempt == attempt:
            self.storage.discard(*claim_keys(job_id, attempt))
            return
        self.storage.remove(*claim_keys(job_id, attempt))

    def _committed(self, job_id: str, attempt: int) -> bool:
        """Whether the MP4 and record of a job's claim `attempt` are in storage and agree (a worker commits them
        together; on object storage the record is published last)."""
        from ..engines.atomic import sha256_file

        clip, record = clip_key(job_id, attempt), record_key(job_id, attempt)
        if not (self.storage.exists(clip) and self.storage.exists(record)):
            return False
        mp4 = self.storage.local_path(clip)
        if mp4 is None:
            return True
        try:
            return ClipRecord.from_json(json.loads(self.storage.read_text(record))).mp4_sha256 == sha256_file(mp4)
        except (OSError, ValueError):
            return False

    def _complete(self, job_id: str, record: dict, worker: str | None, attempt: int) -> None:
        """Publish the files of the claim `attempt` and complete the job with them, if that claim still holds it;
        if not (its lease ran out after the caller's read), they go: the row never names them."""
        clip, thumbnail = clip_key(job_id, attempt), thumbnail_key(job_id, attempt)
        mp4 = self.storage.work_path(clip)
        if mp4.is_file() and not self.storage.exists(thumbnail):
            _thumbnail(mp4, self.storage.work_path(thumbnail), self.log)
        self.storage.publish(*claim_keys(job_id, attempt))  # the record last
        row = self.store.end(job_id, "completed", self.retention_s, record=record, output=self.storage.path(clip),
                             worker=worker, attempt=attempt, clip_attempt=attempt)
        if row is None:
            self._drop_claim(job_id, attempt, self.store.get(job_id))
            self.log("late_report_ignored", job=job_id, kind="done", worker=worker, attempt=attempt)
            return
        # The claims before this one lost the job (killed, or stalled past their lease): what they wrote (a record
        # committed beside an MP4 that never was, an MP4 still under its temporary name, whichever host wrote it)
        # is no clip of the job's.
        earlier = [key for claim in range(1, attempt) for key in claim_keys(job_id, claim)]
        self.storage.remove(uploads_key(job_id), *earlier, *self.storage.temporaries(*earlier))
        self.metrics.ended(row)
        self.log("completed", job=job_id, seconds=round(row.completed_at - row.created_at, 3))


def keep_leases(queue: StoreQueue, lease_s: float, stop, log: Callable[..., None], replica: str,
                groups: int = 1) -> None:
    """A fleet's worker replica, until `stop` (a threading.Event) is set: renew the leases of the jobs its `groups`
    run every lease / HEARTBEAT_DIVISOR, and recover the jobs of replicas that stopped renewing theirs (fleet/deploy.py
    runs it beside its replica group; scripts/sim_fleet.py beside its simulated ones)."""
    period = lease_s / HEARTBEAT_DIVISOR
    renewing_since = time.monotonic()  # since when this replica's renewals reach the store without a gap
    while not stop.wait(period):
        try:
            queue.heartbeat(groups)
        except Exception as e:  # noqa: BLE001 -- the store may be unreachable for a moment; try again
            renewing_since = time.monotonic()
            log("lease_error", replica=replica, error=f"{type(e).__name__}: {e}")
            continue
        # After a store outage every replica's leases look stale: take no job from another replica until it has had
        # a whole lease to renew its own (nothing that did not fail is run again).
        if time.monotonic() - renewing_since < lease_s:
            continue
        try:
            queue.reclaim(lease_s)
        except Exception as e:  # noqa: BLE001 -- the store may be unreachable for a moment; try again
            log("lease_error", replica=replica, error=f"{type(e).__name__}: {e}")


def _thumbnail(mp4, out, log) -> None:
    """The clip's first frame as WebP (GET /content?variant=thumbnail)."""
    import av

    tmp = out.with_name(f".{out.name}.tmp")
    try:
        with av.open(str(mp4)) as container:
            frame = next(container.decode(video=0))
            frame.to_image().save(tmp, format="WEBP", quality=85)
        tmp.replace(out)
    except Exception as e:  # noqa: BLE001 -- a thumbnail is a convenience: the clip is what was asked for
        tmp.unlink(missing_ok=True)
        log("thumbnail_failed", job=job_of(mp4.name), error=str(e))


def _holds(row: JobRow, worker: str, attempt: int | None) -> bool:
    """Whether `worker` holds the job of `row` under the claim `attempt` (any claim when None)."""
    return row.worker == worker and (attempt is None or row.attempts == attempt)


def _short(e: BaseException) -> str:
    """An exception in one line (a driver's message spans several)."""
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


def _error_code(error_type: str) -> str:
    return {"OutOfMemoryError": "out_of_memory", "FloatingPointError": "numerical_error", "MediaError": "bad_media",
            "WorkerLost": "worker_lost", "DiskFull": "disk_full"}.get(error_type, "generation_failed")
