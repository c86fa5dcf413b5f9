"""Turbo per request (issue 38, item 3): an adapter brings its own schedule (its file's metadata, or its --adapter
flag), which a request that names it and leaves steps or a shift out runs; a bundle bakes its AdaLN tables for
several schedules (`h3trt build --steps 6,4`) and serves each of them.

One bundle is built (the CLI, in a fresh process) and shared by the module: the tiny model, fp32 on the CPU, for the
schedules 6 points at the checkpoint's shifts (12/3, the default) and 4 points at video shift 5, with one LoRA slot.
Tolerance: test_engine.py's for fp32 bundles, the compiled DiT within a relative error (norm) of 1e-5 of the eager
DiT, at every evaluation of each schedule.
"""

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from helpers import SLOT_BUNDLE, dit_inputs
from lora_cases import fmt_original, tiny_factors, write

from h3trt.adapters.schedule import adapter_schedules
from h3trt.adapters.spec import AdapterSpec
from h3trt.build.adaln import schedule_timesteps
from h3trt.build.config import BuildConfig
from h3trt.cli import main
from h3trt.engines.bundle import Engine
from h3trt.engines.guard import no_compile
from h3trt.engines.manifest import Manifest, ScheduleRecord, read_manifest
from h3trt.errors import UserError
from h3trt.jobs.admission import admit
from h3trt.jobs.model_source import Entry, ModelSource
from h3trt.models.checkpoint.reader import load_dit
from h3trt.models.dit import EagerDiT
from h3trt.models.packing import pack_t2va, row_timesteps, text_tags_for
from h3trt.models.sampler import Schedule
from h3trt.models.sampler import ScheduleValues
from h3trt.request.fields import KEY_WORDS as KEYS
from h3trt.request.parse import RequestDefaults, parse_object
from h3trt.request.request import Request, ScheduleFrom

REL_TOL = 1e-5  # test_engine.py's compiled-vs-eager bound for fp32 bundles
SCHEDULES = (Schedule(6, 12.0, 3.0), Schedule(4, 5.0, 3.0))  # the bundle's: the first is the default
TURBO = {"h3trt.steps": "4", "h3trt.video_shift": "5"}  # the Turbo adapter's file metadata: the bundle's second


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """turbo (its schedule in its metadata: 4 points at video shift 5), plain (none), eight (8 points)."""
    folder = tmp_path_factory.mktemp("turbo")
    return {"turbo": write(folder / "turbo.safetensors", fmt_original(tiny_factors(1)), TURBO),
            "plain": write(folder / "plain.safetensors", fmt_original(tiny_factors(2))),
            "eight": write(folder / "eight.safetensors", fmt_original(tiny_factors(3)), {"h3trt.steps": "8"})}


@pytest.fixture(scope="module")
def turbo_bundle(bundle_cache):
    """`--steps 6,4 --video-shift 12,5` with LoRA slots: conftest's SLOT_BUNDLE (shared with test_bundle_lora.py)."""
    built = bundle_cache.get(*SLOT_BUNDLE)
    assert "(2 schedule(s))" in built.stderr, built.stderr
    return built.path


# --- an adapter's schedule, and a request's ---------------------------------------------------------------------------

def test_an_adapters_schedule_is_its_files_metadata_under_its_flags_values(adapters, tmp_path, tiny_cache, capsys):
    spec = AdapterSpec.parse(f"turbo={adapters['turbo']}:0.8@video_shift=6")
    assert (spec.path, spec.scale, spec.schedule) == (adapters["turbo"], 0.8, ScheduleValues(video_shift=6.0))
    plain = AdapterSpec.parse(f"plain={adapters['plain']}")
    assert adapter_schedules([spec, plain]) == {"turbo": ScheduleValues(4, 6.0, None)}  # the flag's shift wins
    assert AdapterSpec.parse("t=a@b.safetensors").path == Path("a@b.safetensors")  # an '@' in a file name stays
    entry = Entry.local(device="cpu", adapters=(spec, plain))
    listed = [info.to_json() for info in entry.adapter_catalog().infos()]
    assert [i["schedule"] for i in listed] == [{"steps": 4, "video_shift": 6.0}, {}]  # GET /v1/loras's
    bad = write(tmp_path / "bad.safetensors", fmt_original(tiny_factors(1)), {"h3trt.steps": "eight"})
    with pytest.raises(UserError, match=r"bad.safetensors: __metadata__ h3trt.steps: steps must be an integer"):
        Entry.local(device="cpu", adapters=(AdapterSpec("bad", bad),))  # at start, before any model loads
    for flag, words in (("@steps=1", "steps must be at least 2 (the grid includes the final sigma 0) and at most 1000"),
                        ("@video_shift=-1", "video_shift must be a positive finite number"),
                        ("@turbo=1", "expected KEY=VALUE pairs after '@'")):
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            main(["run", "--prompt", "p", "--output", str(tmp_path / "x.mp4"), "--adapter",
                  f"t={adapters['plain']}{flag}"])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and words in err[-1], err


def _parse(data: dict, schedules: dict) -> Request:
    return parse_object(data, 1, Path("."), ("prompt",), RequestDefaults(steps=50, adapter_schedules=schedules)).request


def test_a_request_naming_the_adapter_runs_its_schedule_unless_it_states_its_own():
    schedules = {"turbo": ScheduleValues(4, 5.0), "eight": ScheduleValues(8)}
    turbo = [{"name": "turbo"}]
    silent = _parse({"prompt": "x", "lora": turbo}, schedules)
    # None: the model's audio shift
    assert (silent.schedule.steps, silent.schedule.video_shift, silent.schedule.audio_shift) == (4, 5.0, None)
    assert silent.schedule.origin == ScheduleFrom("adapter turbo", "adapter turbo", "default")
    stated = _parse({"prompt": "x", "lora": turbo, "steps": 8, "audio_shift": 2}, schedules)
    assert (stated.schedule.steps, stated.schedule.video_shift, stated.schedule.audio_shift) == (8, 5.0, 2.0)
    assert stated.schedule.origin == ScheduleFrom("request", "adapter turbo", "request")
    plain = _parse({"prompt": "x"}, schedules)
    assert (plain.schedule.steps, plain.schedule.video_shift, plain.schedule.origin) == (50, None, ScheduleFrom())
    with pytest.raises(UserError, match=r"bring different steps \(turbo 4, eight 8\)") as e:
        _parse({"prompt": "x", "lora": turbo + [{"name": "eight"}]}, schedules)
    assert e.value.field == "lora"
    both = _parse({"prompt": "x", "lora": turbo + [{"name": "eight"}], "steps": 6}, schedules)  # the request decides
    assert (both.schedule.steps, both.schedule.video_shift, both.schedule.origin.video_shift) == (6, 5.0,
                                                                                            "adapter turbo")


def test_a_conflict_is_a_400_naming_lora_and_the_job_says_the_adapters_steps(adapters, tmp_path, tiny_cache):
    from fastapi.testclient import TestClient

    from h3trt.server.app import create_app
    from h3trt.server.metrics import Metrics
    from h3trt.server.options import ServeOptions
    from h3trt.server.service import VideoService
    from h3trt.server.storage import Storage
    from h3trt.server.store import JobStore, sqlite_url

    class NoGroups:  # no workers: a job admitted stays queued
        def status(self):
            return []

        def serving(self):
            return 0

    entry = Entry.local(device="cpu", adapters=(AdapterSpec("turbo", adapters["turbo"]),
                                                AdapterSpec("eight", adapters["eight"])))
    for folder in ("clips", "uploads"):
        (tmp_path / folder).mkdir()
    service = VideoService(entry, ServeOptions(tmp_path), JobStore(sqlite_url(tmp_path)), Storage(tmp_path),
                           NoGroups(), Metrics(), log=lambda *a, **k: None,
                           adapters=entry.adapter_catalog())
    client = TestClient(create_app(service), raise_server_exceptions=False)
    body = {"prompt": "a fox", "size": "128x32", "lora": [{"name": "turbo"}, {"name": "eight"}]}
    r = client.post("/v1/videos", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora", r.text
    assert "bring different steps (turbo 4, eight 8)" in r.json()["error"]["message"]
    assert sum(service.store.counts().values()) == 0  # nothing queued
    r = client.post("/v1/videos", json={**body, "lora": [{"name": "turbo"}]})
    assert r.status_code == 200 and r.json()["steps"] == 4, r.text  # the adapter's, not the default 50
    assert client.get(f"/v1/videos/{r.json()['id']}").json()["steps"] == 4
    assert client.get("/v1/loras").json()["data"][0]["schedule"] == {"steps": 4, "video_shift": 5.0}
    service.store.close()


def test_run_requests_refuses_a_conflict_on_its_line_and_run_records_where_steps_came_from(
        adapters, tmp_path, tiny_cache, capsys, monkeypatch):
    lines = tmp_path / "r.jsonl"
    lines.write_text(json.dumps({"id": "a", "task": "t2va", "prompt": "x", "lora": [{"name": "turbo"},
                                                                                    {"name": "eight"}]}) + "\n")
    assert main(["run", "--adapter", f"turbo={adapters['turbo']}", "--adapter", f"eight={adapters['eight']}",
                 "--requests", str(lines), "--out-dir", str(tmp_path / "out"), "--quiet"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("h3trt: error:")]
    assert len(err) == 1 and ":1: lora: the adapters this request names bring different steps" in err[0], err
    asked = []
    monkeypatch.setattr("h3trt.run.commands.run_clip", lambda entry, request, *a: asked.append(request) or 0)
    assert main(["run", "--prompt", "x", "--output", str(tmp_path / "c.mp4"), "--steps", "8"]) == 0
    assert asked[0].schedule.steps == 8 and asked[0].schedule.origin == ScheduleFrom("request", "default", "default")


# --- a bundle baked for several schedules -----------------------------------------------------------------------------

def test_build_takes_one_shift_per_schedule_or_one_for_all(tiny_root, tmp_path, capsys):
    config = BuildConfig(tiny_root, tmp_path / "b", steps=(6, 4), video_shift=5.0, device="cpu")
    assert config.schedules((12.0, 3.0)) == (Schedule(6, 5.0, 3.0), Schedule(4, 5.0, 3.0))
    with pytest.raises(UserError, match=r"--video-shift takes one shift for every schedule or one per --steps value "
                                         r"\(2: 6,4\), got 3"):
        BuildConfig(tiny_root, tmp_path / "b", steps=(6, 4), video_shift=(1.0, 2.0, 3.0), device="cpu")
    with pytest.raises(UserError, match="name the schedule steps=6, shifts 12/3 twice"):
        BuildConfig(tiny_root, tmp_path / "b", steps=(6, 6), video_shift=(None, 12.0), device="cpu").schedules(
            (12.0, 3.0))
    for argv, words in ((["--steps", "6,x"], "takes whole numbers separated by commas"),
                        (["--steps", "6,1"], "--steps must be at least 2")):
        capsys.readouterr()
        try:
            code = main(["build", "--model", "tiny", "--output", str(tmp_path / "c"), "--device", "cpu", *argv])
        except SystemExit as e:  # argparse's own refusal
            code = e.code
        assert code == 2 and words in capsys.readouterr().err


def test_the_manifest_records_every_schedule_and_the_tables_bake_their_union(turbo_bundle):
    m = read_manifest(turbo_bundle)
    assert m.schedules == tuple(ScheduleRecord(s.steps, s.video_shift, s.audio_shift) for s in SCHEDULES)
    assert m.schedule == m.schedules[0] and m.raw["schedule"] == {"steps": 6, "video_shift": 12.0, "audio_shift": 3.0}
    union = schedule_timesteps(*SCHEDULES)
    assert m.adaln.baked and m.adaln.timesteps == union.numel() > schedule_timesteps(SCHEDULES[0]).numel()
    # A manifest of one schedule is written as before bundles served several, and reads back as that one
    one = replace(m, schedules=m.schedules[:1]).to_dict()
    assert "schedules" not in one and Manifest.from_dict(json.loads(json.dumps(one))).schedules == m.schedules[:1]


def test_each_schedule_equals_the_eager_dit_without_compiling(turbo_bundle, tiny_root):
    engine = Engine.load(turbo_bundle, "cpu")
    eager = EagerDiT(load_dit(tiny_root, "t2va", torch.float32)[0])
    layout = pack_t2va(text_tags_for(11, [range(2, 6)]), 7, 6, 10, 23, keyframes=("first",))
    args = dit_inputs(layout, eager.cfg)
    with torch.no_grad(), no_compile():  # any compile raises
        for schedule in SCHEDULES:
            for tv, ta in schedule.timesteps():  # every evaluation of it
                unique_t, t_index = row_timesteps(layout, tv, ta)
                for got, want in zip(engine.dit(*args, unique_t, t_index, layout),
                                     eager(*args, unique_t, t_index, layout)):
                    err = ((got - want).norm() / want.norm()).item()
                    assert err <= REL_TOL, f"relative error {err:.2e} at t=({tv}, {ta}) of {schedule}"


def test_a_third_schedule_is_refused_naming_both(turbo_bundle, adapters, tmp_path, capsys):
    served = "steps=6, video shift 12, audio shift 3 (the default), steps=4, video shift 5, audio shift 3"
    entry = Entry.local(ModelSource.resolve(turbo_bundle), "cpu", adapters=(AdapterSpec("eight", adapters["eight"]),))
    for steps, shift in ((6, None), (4, 5.0)):
        admit(entry, Request.of("a fox", steps=steps, video_shift=shift), KEYS)  # both served
    with pytest.raises(UserError, match=re.escape(f"baked for {served}; the request asks for steps=4, shifts 12/3")
                       ) as e:
        admit(entry, Request.of("a fox", steps=4), KEYS)  # the 4-point grid at the default shift: not baked
    assert e.value.field == "steps"
    line = parse_object({"prompt": "a fox", "lora": [{"name": "eight"}]}, 1, tmp_path, ("prompt",),
                        RequestDefaults(6, adapter_schedules=entry.adapters.schedules), KEYS).request
    with pytest.raises(UserError, match=r"the request \(steps from adapter eight\) asks for steps=8") as e:
        admit(entry, line, KEYS)
    assert e.value.field == "lora"  # the adapter's schedule: its fix is there
    assert main(["run", "--engine", str(turbo_bundle), "--prompt", "a fox", "--output", str(tmp_path / "a.mp4"),
                 "--steps", "5"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("h3trt: error:")]
    assert len(err) == 1 and served in err[0], err


def test_a_turbo_request_and_a_default_one_run_in_one_batch_each_recording_its_schedule(
        turbo_bundle, adapters, tmp_path):
    lines = tmp_path / "r.jsonl"
    lines.write_text("".join(json.dumps(line) + "\n" for line in (
        {"id": "turbo", "task": "t2va", "prompt": "a fox", "seed": 1, "lora": [{"name": "turbo"}]},
        {"id": "base", "task": "t2va", "prompt": "a fox", "seed": 1})))
    out = tmp_path / "out"
    assert main(["run", "--engine", str(turbo_bundle), "--adapter", f"turbo={adapters['turbo']}", "--requests",
                 str(lines), "--out-dir", str(out), "--quiet"]) == 0
    turbo, base = (json.loads((out / f"{name}.json").read_text()) for name in ("turbo", "base"))
    assert (turbo["steps"], turbo["evaluations"], turbo["shifts"]) == (4, 3, {"video": 5.0, "audio": 3.0})
    assert turbo["schedule_from"] == {"steps": "adapter turbo", "video_shift": "adapter turbo",
                                      "audio_shift": "default"}
    assert [a["name"] for a in turbo["adapters"]] == ["turbo"]
    assert (base["steps"], base["evaluations"], base["shifts"]) == (6, 5, {"video": 12.0, "audio": 3.0})
    assert base["schedule_from"] == ScheduleFrom().to_json() and "adapters" not in base
