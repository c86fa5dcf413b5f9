"""Cold start: weights read in hashed chunks on several threads, the verified-once record, and the load report.

CPU only. The chunked reader must give exactly the tensors safetensors gives (every dtype, tensors straddling chunk
edges, chunks of a few hundred bytes so one file has dozens); a chunk that differs from its digest must be refused;
the record must stop trusting a file whose size, mtime or content changed, including content changed with the mtime
put back. Whole-bundle loads (the record skipping the hashes, a changed file still refused) are in test_engine.py,
on its bundle.
"""

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import load_file, save_file

from h3trt.engines.verified import VerifiedRecord, identity
from h3trt.engines.weights_io import (WeightsError, chunk_digests, read_safetensors, verify_file,
                                      write_safetensors)


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(37, 29, generator=g).to(torch.bfloat16),
        "b.f32": torch.randn(101, generator=g),
        "c.fp8": torch.randn(13, 7, generator=g).to(torch.float8_e4m3fn),
        "d.i64": torch.arange(9),
        "e.bool": torch.rand(5, generator=g) > 0.5,
        "f.scalar": torch.tensor(3.5),
        "g.empty": torch.zeros(0, 4),
        "h.f16": torch.randn(3, 5, 2, generator=g).half(),
    }


def test_writer_matches_safetensors_and_reader_is_exact(tmp_path):
    tensors = _tensors()
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    write_safetensors(ours, tensors)
    save_file(tensors, str(theirs))
    loaded = load_file(str(ours))  # safetensors reads what we write
    assert set(loaded) == set(tensors)
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype and torch.equal(loaded[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
    for chunk in (64, 200, 1 << 20):  # dozens of chunks, a few, one
        digests = chunk_digests(theirs, chunk)
        with ThreadPoolExecutor(4) as pool:
            got = read_safetensors(theirs, torch.device("cpu"), pool, digests, chunk).result()
        assert set(got) == set(tensors)
        for name, t in tensors.items():
            assert got[name].dtype == t.dtype and got[name].shape == t.shape
            assert torch.equal(got[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name


def test_one_chunk_digest_is_the_plain_sha256(tmp_path):
    import hashlib

    path = tmp_path / "x.safetensors"
    write_safetensors(path, _tensors())
    assert chunk_digests(path, 1 << 20) == [hashlib.sha256(path.read_bytes()).hexdigest()]


@pytest.mark.parametrize("where", [3, 150, -5])  # the header, a middle chunk, the last chunk
def test_a_corrupted_chunk_is_refused(tmp_path, where):
    path = tmp_path / "x.safetensors"
    write_safetensors(path, _tensors())
    digests = chunk_digests(path, 64)
    raw = bytearray(path.read_bytes())
    raw[where] ^= 0xFF
    path.write_bytes(bytes(raw))
    with ThreadPoolExecutor(3) as pool:
        with pytest.raises(WeightsError, match=r"weights/x changed: bytes \d+-\d+ do not match"):
            read_safetensors(path, torch.device("cpu"), pool, digests, 64, label="weights/x").result()
        with pytest.raises(WeightsError, match="do not match"):
            verify_file(path, pool, digests, 64).result()


def test_record_trusts_only_an_unchanged_identity(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root = tmp_path / "bundle"
    root.mkdir()
    (root / "manifest.json").write_text("{}")
    f = root / "w.bin"
    f.write_bytes(b"x" * 100)
    ident = identity(f)
    record = VerifiedRecord.open(root)
    assert not record.trusted("w.bin", ident)
    record.add("w.bin", ident)
    record.save()
    assert VerifiedRecord.open(root).trusted("w.bin", identity(f))
    # Same size, content changed, mtime put back: the ctime still moves, so the file is no longer trusted.
    st = os.stat(f)
    f.write_bytes(b"y" * 100)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert identity(f)["mtime_ns"] == ident["mtime_ns"] and identity(f)["size"] == ident["size"]
    assert not VerifiedRecord.open(root).trusted("w.bin", identity(f))
    # Another manifest: another record.
    (root / "manifest.json").write_text('{"x": 1}')
    f.write_bytes(b"x" * 100)
    assert not VerifiedRecord.open(root).trusted("w.bin", identity(f))
