"""The supervisor of replica groups (runtime/workers.py `Workers`), in this process: a fake rank group whose ranks are
threads at the other end of the launcher's pipes, speaking the pipe messages of runtime/messages.py, so the
supervisor's state changes (hand out work, forward events and cancels, drain, restart a group whose rank died, give
back what it held) are checked without spawning a process. The group's status record (`GroupStatus`) and its JSON
are checked here too."""

from __future__ import annotations

import json

import pytest

from h3trt.runtime.workers import GroupState, GroupStatus

pytestmark = pytest.mark.unit


# --- the group's status record -----------------------------------------------------------------------------------------

def test_a_groups_status_is_the_json_the_api_served_before_it_was_a_type():
    """/ready's groups keep their bytes: a node's group (last_failure only when set) and a fleet's replica (Serve's
    state, then the replica once busy), keys in the order the dicts had."""
    node = GroupStatus(1, "busy", restarts=2, jobs=["video_a"], pids=[11, 12], last_failure="rank 1 of 2 failed")
    assert json.dumps(node.to_json()) == json.dumps({"group": 1, "state": "busy", "restarts": 2, "jobs": ["video_a"],
                                                     "pids": [11, 12], "last_failure": "rank 1 of 2 failed"})
    assert json.dumps(GroupStatus(0, GroupState.LOADING).to_json()) == \
        '{"group": 0, "state": "loading", "restarts": 0, "jobs": [], "pids": []}'
    fleet = GroupStatus(0, GroupState.BUSY, jobs=["video_b"], pids=[22], replica_state="RUNNING", replica="h:22")
    assert list(fleet.to_json()) == ["group", "state", "restarts", "jobs", "pids", "replica_state", "replica"]
    replica = GroupStatus(0, "serving", last_failure="x", replica="h:22")  # a worker replica's own groups
    assert list(replica.to_json()) == ["group", "state", "restarts", "jobs", "pids", "last_failure", "replica"]
    for status in (node, fleet, replica, GroupStatus(3, "stopped")):
        assert GroupStatus.from_json(json.loads(json.dumps(status.to_json()))) == status


def test_a_groups_state_is_its_member_and_knows_whether_it_serves():
    status = GroupStatus(0, "restarting")
    assert status.state is GroupState.RESTARTING and status.state == "restarting"
    assert [s.value for s in GroupState if s.serves] == ["serving", "busy"]
    with pytest.raises(ValueError):
        GroupStatus(0, "asleep")
