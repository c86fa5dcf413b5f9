"""`GET /metrics`: the server's Prometheus metrics (prometheus-client's registry and exposition; nothing hand-written).

    h3trt_jobs{status}                      jobs in the store by status (queued is the queue depth)
    h3trt_jobs_created_total                jobs admitted
    h3trt_jobs_ended_total{status}          jobs ended: completed, failed, cancelled
    h3trt_queue_time_seconds                created -> taken by a worker (histogram)
    h3trt_job_latency_seconds               created -> ended, end to end (histogram)
    h3trt_denoise_step_seconds              one denoise evaluation, as the worker timed it (histogram)
    h3trt_stage_seconds{stage}              text_encode, condition_encode, denoise, video_decode, ... (histogram)
    h3trt_gpu_peak_memory_bytes{group}      a group's peak GPU memory in its last job
    h3trt_replica_groups{state}             groups by state: loading, serving, busy, restarting, stopped
    h3trt_replica_group_restarts_total      restarts of groups whose rank died
    h3trt_http_requests_total{method,route,status}
"""

from __future__ import annotations

from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..jobs.supervisor import GroupState, GroupStatus
from ..pipeline.records import ClipRecord

LATENCY_BUCKETS = (1, 2, 5, 10, 20, 30, 60, 90, 120, 180, 240, 300, 450, 600, 900, 1200, 1800, 3600, float("inf"))
STEP_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 3, 4, 5, 7.5, 10, 20, float("inf"))


class Groups(Protocol):
    """The replica groups a server's /ready and /metrics describe: its own (jobs/supervisor.py `Workers`), or a
    fleet's worker replicas (h3trt/fleet/)."""

    def status(self) -> list[GroupStatus]:
        """Each group's state (loading, serving, busy, restarting, stopped), restarts, jobs and processes."""

    def serving(self) -> int:
        """Groups loaded and serving (busy or free)."""


class Metrics:
    """The counters a process updates as jobs end (the worker side) and requests are answered (the API side); `watch`
    adds what is read at scrape time."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.created = Counter("h3trt_jobs_created", "Jobs admitted to the queue.", registry=r)
        self.ended_total = Counter("h3trt_jobs_ended", "Jobs ended, by how.", ["status"], registry=r)
        self.queue_time = Histogram("h3trt_queue_time_seconds", "From created to taken by a worker.",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("h3trt_job_latency_seconds", "From created to ended (end to end).",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.step = Histogram("h3trt_denoise_step_seconds", "One denoise evaluation, as its worker timed it.",
                              buckets=STEP_BUCKETS, registry=r)
        self.stage = Histogram("h3trt_stage_seconds", "Seconds of a job's stage.", ["stage"],
                               buckets=LATENCY_BUCKETS, registry=r)
        self.gpu_memory = Gauge("h3trt_gpu_peak_memory_bytes", "A replica group's peak GPU memory in its last job.",
                                ["group"], registry=r)
        self.http = Counter("h3trt_http_requests", "HTTP requests answered.", ["method", "route", "status"],
                            registry=r)

    def watch(self, store, groups: Groups) -> None:
        """Report the store's counts and these groups' states at every scrape (once, by whoever serves /metrics)."""
        self.registry.register(_StoreCollector(store, groups))

    def ended(self, row) -> None:
        """Account a job that just ended (its row as stored)."""
        self.ended_total.labels(row.status).inc()
        if row.started_at is not None:
            self.queue_time.observe(max(0.0, row.started_at - row.created_at))
        if row.completed_at is not None:
            self.latency.observe(max(0.0, row.completed_at - row.created_at))
        record = ClipRecord.from_json(row.record or {})
        for stage, seconds in (record.timings_s or {}).items():
            if not stage.endswith("_s"):
                self.stage.labels(stage).observe(seconds)
        marks = record.step_marks_s or []
        for a, b in zip([0.0] + marks[:-1], marks):
            self.step.observe(max(0.0, b - a))
        peak = (record.peak_memory_gib or {}).get("allocated")
        if peak is not None and row.worker:
            self.gpu_memory.labels(row.worker).set(peak * 2**30)

    def retry_after(self, queued: int, serving: int) -> int:
        """Seconds a client refused for a full queue should wait: the queue ahead of it at the mean job latency over
        the `serving` groups (30 s before any job has ended)."""
        count, total = _histogram_totals(self.latency)
        mean = total / count if count else 30.0
        groups = max(1, serving)
        return max(1, min(3600, round(mean * max(1, queued) / groups / 4)))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _StoreCollector:
    """What is read at scrape time: the store's counts and the workers' states."""

    def __init__(self, store, groups: Groups):
        self.store, self.groups = store, groups

    def collect(self):
        jobs = GaugeMetricFamily("h3trt_jobs", "Jobs in the store, by status.", labels=["status"])
        for status, n in self.store.counts().items():
            jobs.add_metric([status], n)
        yield jobs
        groups = GaugeMetricFamily("h3trt_replica_groups", "Replica groups, by state.", labels=["state"])
        status = self.groups.status()
        states = [g.state for g in status]
        for state in GroupState:
            groups.add_metric([state.value], states.count(state))
        yield groups
        restarts = CounterMetricFamily("h3trt_replica_group_restarts", "Restarts of groups whose rank died.")
        restarts.add_metric([], sum(g.restarts for g in status))
        yield restarts


def _histogram_totals(histogram: Histogram) -> tuple[float, float]:
    count = total = 0.0
    for metric in histogram.collect():
        for sample in metric.samples:
            if sample.name.endswith("_count"):
                count = sample.value
            elif sample.name.endswith("_sum"):
                total = sample.value
    return count, total
