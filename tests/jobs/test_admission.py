"""One admission (jobs/admission.py) behind every front door, one request-field table (pipeline/schema.py) behind
every view of the schema, and the API's 400 naming the field the error carries (issue 37, steps 4 and 5)."""

import json
import re

import pytest

from h3trt.errors import UserError, about
from h3trt.jobs.admission import admit
from h3trt.jobs.model_source import Entry, ModelSource
from h3trt.request import fields as schema
from h3trt.request import parse
from h3trt.request.fields import FLAGS, KEY_WORDS
from h3trt.request.parse import RequestDefaults, parse_object
from h3trt.request.request import Request
from h3trt.server.service import ApiError

from stand_ins import NoGroups, fake_bundle

pytestmark = pytest.mark.unit

# Requests the fake bundle (a tiny 160x96, 5 s, 8-step bundle with baked AdaLN tables) does not serve, in the schema's
# keys; (the field at fault, the API's param).
INADMISSIBLE = {
    "canvas": ({"prompt": "a fox", "resolution": "128x32"}, "resolution", "size"),
    "schedule": ({"prompt": "a fox", "resolution": "160x96", "steps": 4}, "steps", "steps"),
    "guidance": ({"prompt": "a fox", "resolution": "160x96", "guidance": 2.0}, "guidance", "guidance"),
}


@pytest.fixture(scope="module")
def bundle_entry(tmp_path_factory, tiny_root):
    return Entry.local(ModelSource.resolve(engine=fake_bundle(tmp_path_factory.mktemp("admission") / "bundle",
                                                                tiny_root)), "cpu")


def _service(tmp_path, entry, guidance_branches=1):
    from h3trt.server.metrics import Metrics
    from h3trt.server.options import ServeOptions
    from h3trt.server.service import VideoService
    from h3trt.server.storage import Storage
    from h3trt.server.store import JobStore, sqlite_url

    for folder in ("clips", "uploads"):
        (tmp_path / folder).mkdir(parents=True, exist_ok=True)
    return VideoService(entry, ServeOptions(tmp_path), JobStore(sqlite_url(tmp_path)), Storage(tmp_path), NoGroups(),
                        Metrics(), guidance_branches, log=lambda *a, **k: None)


def _refusal(door: str, entry: Entry, data: dict, tmp_path) -> tuple[str, str | None]:
    """(message, param) of `door`'s refusal of the request `data` (schema keys) to `entry`'s model."""
    if door == "run_clip":
        from h3trt.run.commands import run_clip

        request = parse_object(data, 0, tmp_path, (), RequestDefaults(steps=entry.model.default_steps)).request
        with pytest.raises(UserError) as refused:
            run_clip(entry, request, tmp_path / "clip.mp4", 18, quiet=True)
        return str(refused.value), None
    if door == "run_requests":
        from h3trt.run.commands import run_requests

        path = tmp_path / "r.jsonl"
        path.write_text(json.dumps({"id": "a", "task": "t2va", **data}) + "\n")
        with pytest.raises(UserError) as refused:
            run_requests(entry, path, tmp_path / "out", quiet=True)
        return str(refused.value), None
    service = _service(tmp_path, entry)
    try:
        with pytest.raises(ApiError) as refused:
            service.create({schema.api_name(k): v for k, v in data.items()}, [], multipart=False)
        assert refused.value.status == 400 and service.store.counts().get("queued", 0) == 0
        return str(refused.value), refused.value.param
    finally:
        service.store.close()


@pytest.mark.parametrize("door", ["run_clip", "run_requests", "api"])
@pytest.mark.parametrize("case", INADMISSIBLE)
def test_every_front_door_refuses_with_admissions_message(tmp_path, tiny_root, bundle_entry, no_model_load, door,
                                                          case):
    """The same request is refused by `h3trt run --prompt`, a line of `h3trt run --requests` and `POST /v1/videos`
    with admission's own message in that door's words (the bundle's refusals are word for word the same), and the
    API's param is the field the error carries."""
    data, field, param = INADMISSIBLE[case]
    words = {"run_clip": FLAGS, "run_requests": KEY_WORDS, "api": schema.API_WORDS}[door]
    request = parse_object(data, 0, tmp_path, (), RequestDefaults(steps=bundle_entry.model.default_steps)).request
    with pytest.raises(UserError) as expected:
        admit(bundle_entry, request, words)
    assert expected.value.field == field
    message, sent_param = _refusal(door, bundle_entry, data, tmp_path)
    assert str(expected.value) in message, (message, str(expected.value))
    if door == "run_requests":
        assert f"r.jsonl:1: {expected.value}" in message
    if door == "api":
        assert sent_param == param
    if case != "guidance":  # what a bundle serves reads the same at every door
        assert str(expected.value).startswith("This bundle")


def test_cfg2_groups_need_guidance_at_every_door(tmp_path, tiny_root):
    """The cfg=2 rule is admission's, with the launched cfg degree as its parameter; the server's 400 names guidance."""
    entry = Entry.local(device="cpu")
    request = Request.of("a fox", width=128, height=32, steps=2)
    admit(entry, request, guidance_branches=1)
    with pytest.raises(UserError, match="cfg=2 rank groups") as refused:
        admit(entry, request, guidance_branches=2)
    assert refused.value.field == "guidance" and "--guidance" in str(refused.value)
    service = _service(tmp_path, entry, guidance_branches=2)
    try:
        with pytest.raises(ApiError, match="cfg=2 rank groups") as api:
            service.create({"prompt": "a fox", "size": "128x32", "steps": 2}, [], multipart=False)
        assert api.value.param == "guidance" and "--" not in str(api.value)
    finally:
        service.store.close()


def test_the_param_is_the_errors_field_not_its_message(tmp_path, tiny_root, monkeypatch):
    """The 400's param is the field the UserError carries, in the API's name; a message naming other fields (or a
    path's words) does not change it, and an error about no field names none."""
    import h3trt.server.service as service_module

    service = _service(tmp_path, Entry.local(device="cpu"))
    try:
        for raised, param in ((UserError("steps and seed are wrong, says the message", field="duration"), "seconds"),
                              (UserError("the prompt names a field, the error none"), None)):
            def refuse(*args, **kwargs):
                raise raised

            monkeypatch.setattr(service_module, "admit", refuse)
            with pytest.raises(ApiError) as api:
                service.create({"prompt": "a fox", "size": "128x32", "steps": 2}, [], multipart=False)
            assert (api.value.status, api.value.param) == (400, param)
    finally:
        service.store.close()


def test_about_names_the_field_of_an_error_without_one():
    with pytest.raises(UserError) as raised:
        with about("refs"):
            raise UserError("clip.xyz: cannot tell whether this reference is an image")
    assert raised.value.field == "refs"
    with pytest.raises(UserError) as kept:
        with about("refs"):
            raise UserError("its own", field="image")
    assert kept.value.field == "image"


# --- one table of request fields ------------------------------------------------------------------------------------

def test_a_field_added_to_the_table_is_in_every_view():
    colour = schema.RequestField("colour", {"type": "integer", "minimum": 0}, api="hue")
    table = schema.FIELDS + (colour,)
    assert "colour" in schema.keys(table) and "colour" not in schema.KEYS
    assert schema.api_names(table)["colour"] == "hue"
    assert schema.openapi_fields(False, table)["hue"] == colour.schema
    assert schema.openapi_fields(True, table)["hue"] == colour.schema
    assert "hue" in schema.form_numbers(table) and "hue" in schema.api_fields(table, openai=False)
    assert parse.schema_values({"hue": 3, "prompt": "x"}, table) == {"colour": 3, "prompt": "x"}


def test_every_view_is_the_tables():
    """The requests file's keys, the API's JSON and multipart schema (served at /openapi.json), its file fields, its
    OpenAI and H3 fields and its form coercion all come from request/fields.py's table."""
    from h3trt.request import parse as requests
    from h3trt.server import service, wire

    assert requests.KEYS is schema.KEYS
    assert wire.CREATE_FIELDS == schema.openapi_fields(False)
    multipart = wire.CREATE_BODY["content"]["multipart/form-data"]["schema"]["properties"]
    assert multipart == schema.openapi_fields(True)
    assert set(multipart) - set(wire.CREATE_FIELDS) == set(schema.UPLOADS) == {"input_reference", "last_image", "refs"}
    assert set(schema.OPENAI_FIELDS) | set(schema.H3_FIELDS) == set(multipart)
    assert service.H3_FIELDS is schema.H3_FIELDS and service.OPENAI_FIELDS is schema.OPENAI_FIELDS
    for f in schema.FIELDS:  # every key parses (no "unknown key"), every API name maps back
        if f.key is not None:
            assert schema.api_name(f.key) == f.api_name
    assert parse.form_value("steps", "4") == 4 and parse.form_value("seconds", "5.0") == "5.0"
    assert parse.form_value("prompt", "4") == "4"


def test_the_api_schema_maps_onto_the_files_keys():
    """What a client sends under OpenAI's names is what a requests file states under the schema's keys."""
    sent = {"prompt": "a fox", "size": "160x96", "seconds": "5", "seed": 3, "model": "minimax-h3"}
    assert parse.schema_values(sent) == {"prompt": "a fox", "resolution": "160x96", "duration": 5.0, "seed": 3}
    assert parse.schema_values({"prompt": "a fox", "seconds": None}) == {"prompt": "a fox"}
    with pytest.raises(UserError) as bad:
        parse.schema_values({"seconds": "five"})
    assert bad.value.field == "duration" and schema.api_name(bad.value.field) == "seconds"


def test_a_job_is_parsed_once_where_it_is_admitted(tmp_path):
    """The API side parses a job's fields once to admit it (service.parse_sent) and stores the admitted request; a
    worker reads that (server/service.py stored_request), parsing nothing but a row written before it was stored."""
    import inspect

    from h3trt.server import queue, service

    assert "stored_request(" in inspect.getsource(queue.StoreQueue.job_of)
    assert "parse_sent(" in inspect.getsource(service.VideoService.create)
    assert "row_request(" in inspect.getsource(service.VideoService.create)
    assert inspect.getsource(service.stored_request).count("parse_sent(") == 1  # the row of before's reader only
    request = service.parse_sent({"prompt": "a fox", "resolution": "160x96", "duration": 5.0}, tmp_path,
                                 RequestDefaults())
    assert (request.canvas.width, request.canvas.height, request.canvas.duration) == (160, 96, 5.0)


@pytest.mark.parametrize("inputs, task", [({}, "t2va"), ({"image": "a.png"}, "fl2va"),
                                          ({"last_image": "b.png"}, "fl2va"), ({"refs": ["c.png"]}, "ref2va")])
def test_the_task_is_derived_once_for_every_front_door(tmp_path, inputs, task):
    """A request's task comes from its inputs through one function (request.task_of, which the API's job object also
    reads a stored schema with): the Request's own task and the requests file's check of a stated task agree."""
    from h3trt.request.request import task_of

    defaults = RequestDefaults(steps=2)
    parsed = parse_object({"prompt": "a fox", "task": task, **inputs}, 0, tmp_path, (), defaults)
    assert parsed.request.task == task == task_of(inputs.get("image"), inputs.get("last_image"), inputs.get("refs"))
    other = next(t for t in ("t2va", "fl2va", "ref2va") if t != task)
    with pytest.raises(UserError, match=f"inputs make it {task}") as e:
        parse_object({"prompt": "a fox", "task": other, **inputs}, 0, tmp_path, (), defaults)
    assert e.value.field == "task"


def test_the_steps_bound_is_the_tables_at_every_front_door(tmp_path, tiny_root, h3trt, monkeypatch):
    """The request field table's bound on steps (the API's schema states it) is what every door refuses outside and
    takes at its edges: a request (run, a requests line, the API: one admission), an adapter's schedule, and
    `h3trt build --steps` (which started baking 100000 steps)."""
    import h3trt.build.builder as builder
    from h3trt.build.config import BuildConfig
    from h3trt.models.sampler import ScheduleValues

    low, high = schema.VALUES["steps"].schema["minimum"], schema.VALUES["steps"].schema["maximum"]
    entry = Entry.local(device="cpu")
    monkeypatch.setattr(builder, "build", lambda *a, **k: pytest.fail("the build started"))
    for steps in (low - 1, high + 1, 100000):
        bound = f"must be at least {low} (the grid includes the final sigma 0) and at most {high}"
        code, err = h3trt("build", "--model", "tiny", "--output", str(tmp_path / "b"), "--device", "cpu",
                          "--steps", f"8,{steps}")
        assert code == 2 and err == [f"h3trt: error: --steps {bound} (H3's schedule is 50), got {steps}."], err
        with pytest.raises(UserError, match=re.escape(f"--adapter t: steps {bound}")):
            ScheduleValues.parse(f"steps={steps}", "--adapter t")
        for words in (FLAGS, KEY_WORDS, schema.API_WORDS):
            with pytest.raises(UserError, match=re.escape(f"{words.steps} {bound}")) as refused:
                admit(entry, Request.of("a fox", width=128, height=32, steps=steps), words)
            assert refused.value.field == "steps"
    assert not (tmp_path / "b").exists()
    for steps in (low, high):  # the edges are served
        assert ScheduleValues.parse(f"steps={steps}", "--adapter t").steps == steps
        admit(entry, Request.of("a fox", width=128, height=32, steps=steps))
        model = entry.model.path or tmp_path / "no-model"  # a folder that is no checkpoint is refused at the config
        assert BuildConfig(model, tmp_path / "b", steps=(steps,), device="cpu").steps == (steps,)
