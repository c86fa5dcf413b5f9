"""A LoRA file read once onto the slots' device (h3trt/adapters/stream.py; issue 44: loading an adapter costs no
more than reading its file): the same LoraFile as lora_format.read_lora (every layout, alpha rule, tensor and the file's
sha256) from one pass, through the reader thread and staging buffers in chunks smaller than the tensors, a
misaligned tensor included; a short or damaged file refused in one line; a non-finite factor refused, checked where
the factors are, with the slot kept. The CUDA parts (pinned buffers, the side stream, its events) run on a GPU only:
scripts/bench_lora.py's `slots_read` / `load_from_path` rows."""

import hashlib
import io
import json
import struct

import pytest
import torch

from lora_cases import CFG, FORMATS, block_factors, fmt_original, layout_file, write

from h3trt.adapters.slots import AdapterSlots
from h3trt.adapters.stream import Staging, _fill, read_lora_to
from h3trt.errors import UserError
from h3trt.models.lora_format import LoraError, read_lora

CPU = torch.device("cpu")


def same_file(got, want) -> None:
    assert (got.sha256, got.layout, got.alpha_rule) == (want.sha256, want.layout, want.alpha_rule)
    assert got.components.keys() == want.components.keys()
    for prefix, modules in want.components.items():
        assert modules.keys() == got.components[prefix].keys()
        for name, m in modules.items():
            g = got.components[prefix][name]
            assert torch.equal(g.down, m.down) and torch.equal(g.up, m.up) and g.scaling == m.scaling, name


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_one_pass_reads_what_read_lora_reads(name, tmp_path):
    path = layout_file(tmp_path, name, 1)
    want = read_lora(path, CFG.head_dim)
    assert want.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    for staging in (Staging(CPU), Staging(CPU, chunk_bytes=1000, count=3, staged=True)):  # straight in; in chunks
        same_file(read_lora_to(path, CPU, CFG.head_dim, staging), want)


def test_the_slots_load_a_path_in_one_pass_as_they_load_the_read_file(tmp_path, monkeypatch):
    import h3trt.models.lora_format as lora_format

    path = layout_file(tmp_path, "kohya_alpha_tensors", 2)
    via_read = AdapterSlots(CFG, "t2va", 2, 8, torch.float32)
    via_read.load(1, read_lora(path, CFG.head_dim))
    passes = []
    real = lora_format.sha256_of
    monkeypatch.setattr(lora_format, "sha256_of", lambda p: passes.append(p) or real(p))  # read_lora's second pass
    via_path = AdapterSlots(CFG, "t2va", 2, 8, torch.float32)
    record = via_path.load(1, path)
    assert not passes and record == via_read.records[1]
    for name, bank in via_read.banks.items():
        assert all(torch.equal(a, b) for a, b in zip(bank, via_path.banks[name])), name


def raw_safetensors(path, tensors: list[tuple[str, str, list[int], bytes]]) -> None:
    """A safetensors file written by hand, data in the given order with no alignment padding."""
    header, offset = {}, 0
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(t[3] for t in tensors))


def test_a_tensor_off_its_alignment_is_copied_out_not_viewed(tmp_path):
    down, up = torch.randn(2, 5), torch.randn(3, 2)
    path = tmp_path / "odd.safetensors"
    raw_safetensors(path, [("blocks.0.mlp.fc2.alpha", "U8", [1], bytes([2])),  # one byte: what follows is odd
                           ("blocks.0.mlp.fc2.lora_A.weight", "F32", [2, 5], down.numpy().tobytes()),
                           ("blocks.0.mlp.fc2.lora_B.weight", "F32", [3, 2], up.numpy().tobytes())])
    try:
        want = read_lora(path, CFG.head_dim)
    except LoraError:
        pytest.skip("this safetensors refuses unaligned offsets itself")
    same_file(read_lora_to(path, CPU, CFG.head_dim, Staging(CPU)), want)


def test_a_short_or_damaged_file_is_one_line(tmp_path):
    path = layout_file(tmp_path, "original_alpha_less", 1)
    short = tmp_path / "short.safetensors"
    short.write_bytes(path.read_bytes()[:-100])
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    for bad in (short, garbage, tmp_path / "missing.safetensors"):
        with pytest.raises(LoraError) as e:
            read_lora_to(bad, CPU, CFG.head_dim, Staging(CPU))
        assert "\n" not in str(e.value) and str(bad) in str(e.value)
    with pytest.raises(LoraError, match="ended before its header's last tensor: it changed while it was read"):
        _fill(io.BytesIO(b"12345"), memoryview(bytearray(8)), short)


def test_a_non_finite_factor_is_refused_where_it_lies_and_the_slot_is_kept(tmp_path):
    s = AdapterSlots(CFG, "t2va", 2, 8, torch.float32)
    s.load(0, layout_file(tmp_path, "original_alpha_less", 1))
    held = [t.clone() for pair in s.banks.values() for t in pair]
    factors = block_factors(2)
    down, up = factors["blocks.1.mlp.fc2"]
    factors["blocks.1.mlp.fc2"] = (down, up.clone().index_fill_(0, torch.tensor([3]), float("nan")))
    with pytest.raises(UserError, match=r"transformer_blocks\.1\.ff\.net\.2 holds non-finite values \(NaN or inf\); "
                                        "the file is damaged") as e:
        s.load(0, write(tmp_path / "nan.safetensors", fmt_original(factors)))
    assert "\n" not in str(e.value)
    assert all(torch.equal(a, b) for a, b in zip((t for pair in s.banks.values() for t in pair), held))
    assert s.records[0].file == "original_alpha_less_1.safetensors"
