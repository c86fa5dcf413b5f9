"""Autoscaling a fleet's worker replicas on queue depth, through Ray Serve's documented hooks (Serve 2.60):

  - every worker replica reports custom metrics (`record_autoscaling_stats`, pushed to the Serve controller): the
    store's `queued` and `running` job counts (the whole fleet's, read from the shared store)
  - the deployment's custom policy (`AutoscalingConfig(policy=AutoscalingPolicy(policy_function=QueueDepthPolicy))`)
    turns them into a number of replicas: ceil((queued + running) / jobs_per_replica)
  - Serve clamps it to [min_replicas, max_replicas] and applies its upscale / downscale delays

A replica serves one job at a time, so jobs_per_replica 1 asks for a replica per waiting or running job; 2 lets each
replica keep one job queued behind the one it runs. Every replica reports the same fleet-wide counts: the policy
takes the newest (the largest, over the replicas) rather than their sum.
"""

from __future__ import annotations

import math

QUEUED, RUNNING = "queued", "running"


def desired_replicas(queued: float, running: float, jobs_per_replica: float) -> int:
    """Replicas for this queue depth (before Serve's bounds): every running job keeps its replica, and the queued
    ones ask for one replica per `jobs_per_replica` jobs."""
    return math.ceil((max(0.0, queued) + max(0.0, running)) / jobs_per_replica)


class QueueDepthPolicy:
    """Serve's custom autoscaling policy (a class: Serve builds it once with `policy_kwargs`, then calls it with an
    AutoscalingContext on every autoscaling tick)."""

    def __init__(self, jobs_per_replica: float = 1.0):
        self.jobs_per_replica = jobs_per_replica

    def __call__(self, ctx) -> tuple[int, dict]:
        metrics = ctx.aggregated_metrics or {}
        queued, running = (max(metrics.get(name, {}).values(), default=None) for name in (QUEUED, RUNNING))
        if queued is None or running is None:  # no replica has reported yet: keep what there is
            return ctx.target_num_replicas, ctx.policy_state
        return desired_replicas(queued, running, self.jobs_per_replica), ctx.policy_state
