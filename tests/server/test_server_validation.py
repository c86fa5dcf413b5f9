"""The server's request validation and errors (issue 35, items 4, 5, 6 and 9's API parts), against the real HTTP app
(server/app.py over server/service.py and a SQLite store) in this process, without workers: what is refused is refused
before anything is stored, in OpenAI's envelope, at once, naming the JSON field the client sent; no row in the store
can break listing; which endpoints need the key."""

import json
import sqlite3
import time

import pytest

from h3trt.cli.args import crf
from h3trt.media.output_files import DEFAULT_CRF
from h3trt.models.sampler import MAX_STEPS

from stand_ins import api_client

SMALL = {"size": "128x32", "steps": 2}


@pytest.fixture(scope="module")
def api(tmp_path_factory, tiny_cache):
    client, service = api_client(tmp_path_factory.mktemp("validation"))
    yield client, service
    service.store.close()


def _stored(service) -> int:
    return sum(service.store.counts().values())


def _refused(api, param: str, *, json_body=None, status: int = 400, **post) -> dict:
    client, service = api
    before = _stored(service)
    start = time.monotonic()
    r = client.post("/v1/videos", json=json_body, **post) if json_body is not None else client.post("/v1/videos",
                                                                                                     **post)
    took = time.monotonic() - start
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json"), r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert _stored(service) == before  # nothing was queued
    assert took < 2, f"answered in {took:.1f} s"
    return error


# --- item 4: a bad field is a 400 before anything is stored; no row breaks listing -----------------------------------

def test_seconds_as_a_json_number_is_accepted_and_its_job_lists(api):
    client, service = api
    r = client.post("/v1/videos", json={"prompt": "a fox", "seconds": 5, **SMALL})
    assert r.status_code == 200, r.text
    assert r.json()["seconds"] == "5"
    job = r.json()["id"]
    assert client.get(f"/v1/videos/{job}").json()["seconds"] == "5"
    listed = client.get("/v1/videos", params={"limit": 100})
    assert listed.status_code == 200 and job in [v["id"] for v in listed.json()["data"]], listed.text
    r = client.post("/v1/videos", json={"prompt": "a fox", "seconds": 5.5, **SMALL})
    assert r.status_code == 200 and r.json()["seconds"] == "5.5", r.text


@pytest.mark.parametrize("seconds", [True, [5], {"s": 5}, "nan", "inf", 1e308])
def test_a_bad_seconds_is_a_400_before_anything_is_stored(api, seconds):
    error = _refused(api, "seconds", json_body={"prompt": "x", "seconds": seconds})
    assert "seconds" in error["message"], error


def test_a_deeply_nested_body_is_a_400_not_a_500(api):
    client, _ = api
    r = client.post("/v1/videos", content=b"[" * 100_000, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"], r.text


def test_a_bad_row_in_the_store_breaks_no_listing_and_no_get(tmp_path, tiny_cache):
    client, service = api_client(tmp_path)
    good = client.post("/v1/videos", json={"prompt": "a fox", **SMALL}).json()["id"]
    bad = {  # rows an older h3trt, a hand edit or another writer left behind
        "video_" + "1" * 32: json.dumps({"schema": {"prompt": "x"}, "openai": {"seconds": 5}}),
        "video_" + "2" * 32: "{not json",
        "video_" + "3" * 32: json.dumps({"openai": {}}),
        "video_" + "4" * 32: json.dumps({"schema": {"prompt": 7, "seed": "x", "steps": None},
                                         "geometry": "wide"}),
        "video_" + "5" * 32: json.dumps([1, 2]),
    }
    with sqlite3.connect(tmp_path / "jobs.sqlite3") as db:
        for job, request in bad.items():
            db.execute("INSERT INTO jobs (id, status, created_at, progress, stage, evaluations_done, "
                       "evaluations_total, attempts, cancel_requested, deleted, request, record) VALUES "
                       "(?, 'completed', ?, 100, 'done', 0, 0, 1, 0, 0, ?, ?)", (job, time.time(), request, "{bad"))
    listed = client.get("/v1/videos", params={"limit": 100})
    assert listed.status_code == 200, listed.text
    assert set(bad) | {good} <= {v["id"] for v in listed.json()["data"]}
    for job in bad:
        r = client.get(f"/v1/videos/{job}")
        assert r.status_code == 200 and r.json()["id"] == job, r.text
    assert client.get("/").status_code == 200
    service.store.close()


# --- item 5: every count is bounded, and answered at once -------------------------------------------------------------

@pytest.mark.parametrize("steps", [10 ** 9, 100_000, 1001])
def test_steps_has_an_upper_bound_answered_at_once(api, steps):
    error = _refused(api, "steps", json_body={"prompt": "x", "steps": steps})
    assert "steps must be" in error["message"] and f"at most {MAX_STEPS}" in error["message"], error


def test_a_very_long_prompt_is_refused_at_once(api):
    for field, body in (("prompt", {"prompt": "fox " * 250_000}),
                        ("negative_prompt", {"prompt": "x", "guidance": 2, "negative_prompt": "blur " * 250_000})):
        error = _refused(api, field, json_body=body)
        assert field in error["message"] and "at most" in error["message"], error


def test_too_many_references_are_refused_before_they_are_read(api, tmp_path):
    from serving import png

    image = png(tmp_path / "r.png", 1).read_bytes()
    files = [("refs", (f"r{i}.png", image, "image/png")) for i in range(10)]
    error = _refused(api, "refs", data={"prompt": "x", **{k: str(v) for k, v in SMALL.items()}}, files=files)
    assert "at most 9 image references" in error["message"], error


# --- item 6: a multipart prompt that is not UTF-8 is refused, naming the field ---------------------------------------

def _multipart(fields: dict, files: list) -> tuple[bytes, dict]:
    """A multipart body with text fields as the raw bytes given (httpx writes a bytes value as its repr)."""
    boundary = b"h3trt-test-boundary"
    parts = [b'--%s\r\nContent-Disposition: form-data; name="%s"\r\n\r\n%s\r\n' % (boundary, k.encode(), v)
             for k, v in fields.items()]
    parts += [b'--%s\r\nContent-Disposition: form-data; name="%s"; filename="%s"\r\nContent-Type: %s\r\n\r\n%s\r\n'
              % (boundary, k.encode(), name.encode(), kind.encode(), data) for k, (name, data, kind) in files]
    headers = {"Content-Type": f"multipart/form-data; boundary={boundary.decode()}"}
    return b"".join(parts) + b"--%s--\r\n" % boundary, headers


def test_a_multipart_prompt_that_is_not_utf8_is_refused(api, tmp_path):
    from serving import png

    client, _ = api
    files = [("input_reference", ("k.png", png(tmp_path / "k.png", 1).read_bytes(), "image/png"))]
    for fields, param in (({"prompt": b"caf\xe9 au lait", "size": b"128x32"}, "prompt"),
                          ({"prompt": b"x", "guidance": b"2", "negative_prompt": b"\xff\xfe"}, "negative_prompt")):
        body, headers = _multipart(fields, files)
        error = _refused(api, param, content=body, headers=headers)
        assert "UTF-8" in error["message"] and param in error["message"], error
    error = _refused(api, "prompt", content=b"prompt=caf%E9&size=128x32",
                     headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert "UTF-8" in error["message"], error
    # The same text as UTF-8 is taken, multipart and urlencoded.
    body, headers = _multipart({"prompt": "café au lait".encode(), "size": b"128x32", "steps": b"2"}, files)
    for content, headers in ((body, headers), ("prompt=caf%C3%A9%20au%20lait&size=128x32&steps=2".encode(),
                                               {"Content-Type": "application/x-www-form-urlencoded"})):
        r = client.post("/v1/videos", content=content, headers=headers)
        assert r.status_code == 200 and r.json()["prompt"] == "café au lait", r.text


# --- item 9: errors in the API's words ------------------------------------------------------------------------------

def test_an_upload_error_names_the_users_file_not_the_servers_path(api, tmp_path):
    error = _refused(api, "input_reference", data={"prompt": "x", "size": "128x32"},
                     files=[("input_reference", ("holiday.png", b"not a png", "image/png"))])
    message = error["message"]
    assert "holiday.png" in message and "input_reference" in message, message
    assert "uploads" not in message and str(tmp_path.parent) not in message and "/" not in message, message
    assert message.count("holiday.png") == 1, message  # PIL's own words repeated the path, quoted in quotes


API_WORDS = [  # (body, param, words the message must hold)
    ({"prompt": "x", "seconds": "0"}, "seconds", "seconds must be a positive number of seconds, got 0"),
    ({"prompt": "x", "seconds": -5}, "seconds", "seconds must be a positive number of seconds, got -5"),
    ({"prompt": "x", "seconds": "30"}, "seconds", "Unsupported duration"),
    ({"prompt": "  "}, "prompt", "prompt is empty"),
    ({"prompt": "x", "steps": 1}, "steps", "steps must be at least 2"),
    ({"prompt": "x", "task": "fl2va"}, "task", "the request's inputs make it t2va"),
    ({"prompt": "x", "guidance": 0.5}, "guidance", "guidance must be"),
    ({"prompt": "x", "guidance": 2}, "guidance", "negative_prompt"),
    ({"prompt": "x", "negative_prompt": "blur"}, "negative_prompt", "guidance"),
    ({"prompt": "x", "video_shift": -1}, "video_shift", "video_shift must be"),
    ({"prompt": "x", "audio_shift": 0}, "audio_shift", "audio_shift must be"),
    ({"prompt": "x", "seed": 2 ** 70}, "seed", "seed"),
    ({"prompt": "x", "size": "2048x256"}, "size", "Crop the input or pick size within that range"),
    ({"prompt": "x", "cache": "first-block", "cache_threshold": -1}, "cache_threshold", "cache_threshold must be >= 0"),
    ({"prompt": "x", "profile": "fast", "cache_max_skip": 0}, "cache_max_skip", "cache_max_skip must be a whole"),
    ({"prompt": "x", "cache": "first-block", "cache_warmup": -1}, "cache_warmup", "cache_warmup must be a whole"),
    ({"prompt": "x", "cache": "none"}, "cache", "leave cache out, with no profile or profile 'lossless'"),
]


@pytest.mark.parametrize("body,param,words", API_WORDS, ids=[f"{b[1]}-{i}" for i, b in enumerate(API_WORDS)])
def test_api_errors_name_the_json_fields(api, body, param, words):
    message = _refused(api, param, json_body=body)["message"]
    assert words in message, message
    assert "--" not in message and "line" not in message and "Duration must" not in message, message


def test_the_crf_error_states_the_real_default():
    import argparse

    with pytest.raises(argparse.ArgumentTypeError, match=f"default {DEFAULT_CRF}\\b"):
        crf("99")
    assert DEFAULT_CRF == 18


# --- item 9: which endpoints need the key -----------------------------------------------------------------------------

def test_operations_endpoints_open_and_keyed_as_documented(api):
    from fastapi.testclient import TestClient

    client, service = api
    anonymous = TestClient(client.app, raise_server_exceptions=False)
    assert anonymous.get("/health").status_code == 200
    assert anonymous.get("/ready").status_code == 503 and anonymous.get("/ready").json()["ready"] is False
    assert anonymous.get("/").status_code == 200  # the page: static, it asks for the key itself
    for path in ("/metrics", "/docs", "/openapi.json", "/v1/videos"):
        r = anonymous.get(path)
        assert r.status_code == 401 and "Bearer" in r.json()["error"]["message"], (path, r.text)
        assert client.get(path).status_code == 200, path


def test_open_endpoints_are_a_flag(tmp_path, tiny_cache):
    from fastapi.testclient import TestClient

    from h3trt.cli.parser import build_parser
    from h3trt.server.options import ServeOptions

    args = build_parser().parse_args(["serve", "--data-dir", str(tmp_path), "--open", "metrics", "--open", "docs"])
    assert ServeOptions.from_args(args).open_endpoints == ("metrics", "docs")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--open", "videos"])
    client, service = api_client(tmp_path, open_endpoints=("metrics",))
    anonymous = TestClient(client.app, raise_server_exceptions=False)
    assert anonymous.get("/metrics").status_code == 200
    assert anonymous.get("/openapi.json").status_code == 401
    service.store.close()


# --- what no handler classifies: the envelope and a logged traceback; a pool timed out is an outage ------------------

def test_an_unexpected_error_is_the_envelope_and_a_logged_traceback(tmp_path, tiny_cache, monkeypatch):
    client, service = api_client(tmp_path)
    logged = []
    service.log = lambda event, **fields: logged.append((event, fields))

    def broken():
        raise RuntimeError("a defect in the admission path")

    monkeypatch.setattr(service.store, "queued", broken)
    r = client.post("/v1/videos", json={"prompt": "a fox", **SMALL})
    assert r.status_code == 500 and r.headers["content-type"].startswith("application/json"), r.text
    error = r.json()["error"]
    assert (error["type"], error["code"]) == ("server_error", "internal_error"), error
    [(event, fields)] = [e for e in logged if e[0] == "internal_error"]
    assert fields["path"] == "/v1/videos" and fields["method"] == "POST"
    assert "RuntimeError: a defect in the admission path" in fields["error"] and "broken" in fields["trace"]
    service.store.close()


def test_a_connection_pool_that_timed_out_is_a_503_with_retry_after(tmp_path, tiny_cache, monkeypatch):
    from sqlalchemy.exc import TimeoutError as PoolTimeout

    client, service = api_client(tmp_path)

    def exhausted():
        raise PoolTimeout("QueuePool limit of size 5 overflow 10 reached, connection timed out, timeout 30.00")

    monkeypatch.setattr(service.store, "queued", exhausted)
    r = client.post("/v1/videos", json={"prompt": "a fox", **SMALL})
    assert r.status_code == 503 and r.headers["retry-after"], r.text
    assert r.json()["error"]["code"] == "store_unreachable", r.text
    service.store.close()
