"""`h3trt verify`'s exit statuses, as the README promises them: 0 every file matches, 1 files do not match an intact
(and, under --trust, trusted) manifest, 2 the bundle cannot be checked (a user error: one line). On a one-file
stand-in bundle with a valid manifest (no build), through the real command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from h3trt.cli import main
from h3trt.engines.signing import load_private_key, sign_bundle
from h3trt.engines.weights_io import chunk_digests

from helpers import REPO
from stand_ins import manifest_dict

pytestmark = pytest.mark.unit

WEIGHTS = "weights/blocks.safetensors"


@pytest.fixture
def bundle(tmp_path):
    root = tmp_path / "bundle"
    (root / "weights").mkdir(parents=True)
    (root / WEIGHTS).write_bytes(bytes(range(64)))
    files = {WEIGHTS: {"bytes": 64, "sha256_chunks": chunk_digests(root / WEIGHTS, 64 << 20)}}
    (root / "manifest.json").write_text(json.dumps(manifest_dict(files=files)))
    return root


def _verify(capsys, *args) -> tuple[int, list[str], str]:
    code = main(["verify", *map(str, args)])
    out = capsys.readouterr()
    return code, out.err.strip().splitlines(), out.out


def _flip_a_byte(bundle) -> None:
    data = bytearray((bundle / WEIGHTS).read_bytes())
    data[7] ^= 1
    (bundle / WEIGHTS).write_bytes(bytes(data))


def test_0_when_every_file_matches(bundle, capsys, signing_keys):
    code, err, out = _verify(capsys, bundle)
    assert code == 0 and err == [] and "all 1 files match the manifest" in out
    sign_bundle(bundle, load_private_key(signing_keys["builder"][0]))
    code, err, out = _verify(capsys, bundle, "--trust", signing_keys["builder"][1])
    assert code == 0 and err == [] and "signed by the trusted key" in out


@pytest.mark.parametrize("change, listed", [
    ("changed", f"{WEIGHTS} changed (sha256 differs from the manifest)"),
    ("missing", f"{WEIGHTS} is missing"),
    ("extra", "weights/extra.bin is not part of the bundle"),
    ("changed_under_trust", f"{WEIGHTS} changed (sha256 differs from the manifest)"),
])
def test_1_when_files_do_not_match_an_intact_manifest(bundle, capsys, signing_keys, change, listed):
    """Each file that does not match on its own line, then one summary line."""
    trust = ()
    if change in ("changed", "changed_under_trust"):
        _flip_a_byte(bundle)
    if change == "missing":
        (bundle / WEIGHTS).unlink()
    if change == "extra":
        (bundle / "weights" / "extra.bin").write_bytes(b"x")
    if change == "changed_under_trust":
        sign_bundle(bundle, load_private_key(signing_keys["builder"][0]))
        trust = ("--trust", signing_keys["builder"][1])
    code, err, _ = _verify(capsys, bundle, *trust)
    assert code == 1 and err == [f"h3trt verify: {listed}",
                                 f"h3trt: error: {bundle}: 1 file(s) do not match the manifest; re-copy or rebuild."]


@pytest.mark.parametrize("case, message", [
    ("no_bundle", "is not an h3trt bundle (no manifest.json)"),
    ("corrupt_manifest", "manifest.json is corrupted"),
    ("edited_manifest", "was changed after the build"),
    ("unsigned_under_trust", "is not signed"),
    ("other_signer", "it was signed by key"),
    ("signed_manifest_edited", "the manifest changed after it was signed"),
    ("missing_key", "key.pub"),
])
def test_2_when_the_bundle_cannot_be_checked(bundle, tmp_path, capsys, signing_keys, case, message):
    target, trust = bundle, ()
    if case == "no_bundle":
        target = tmp_path / "nothing"
    if case == "corrupt_manifest":
        (bundle / "manifest.json").write_text("{")
    if case == "edited_manifest":  # a field changed, manifest_sha256 left as it was
        data = json.loads((bundle / "manifest.json").read_text())
        data["schedule"]["steps"] = 9
        (bundle / "manifest.json").write_text(json.dumps(data))
    if case in ("unsigned_under_trust", "other_signer", "signed_manifest_edited"):
        trust = ("--trust", signing_keys["builder"][1])
    if case == "other_signer":
        sign_bundle(bundle, load_private_key(signing_keys["other"][0]))
    if case == "signed_manifest_edited":  # re-hashed by hand: an unsigned verify would pass it
        sign_bundle(bundle, load_private_key(signing_keys["builder"][0]))
        (bundle / "manifest.json").write_text(json.dumps(manifest_dict(**{"schedule.steps": 9, "files": json.loads(
            (bundle / "manifest.json").read_text())["files"]})))
    if case == "missing_key":
        trust = ("--trust", tmp_path / "key.pub")
    code, err, _ = _verify(capsys, target, *trust)
    assert code == 2 and len(err) == 1 and err[0].startswith("h3trt: error: ") and message in err[0], err


def test_the_process_exits_with_the_status(bundle):
    """The statuses are the process's own (cli.main's return value, sys.exit), and a usage mistake is 2 as well."""
    _flip_a_byte(bundle)
    run = [sys.executable, "-m", "h3trt.cli", "verify"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    assert subprocess.run([*run, str(bundle)], capture_output=True, env=env).returncode == 1
    assert subprocess.run(run, capture_output=True, env=env).returncode == 2


def test_the_readme_documents_the_statuses():
    text = " ".join((REPO / "README.md").read_text().split())
    documented = text[text.index("`h3trt verify` exits"):]
    for status, what in (("0", "when every file matches"), ("1", "when the manifest is intact"),
                         ("2", "when the bundle cannot be checked")):
        assert f"{status} {what}" in documented[:1000]
