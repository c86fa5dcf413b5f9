"""LoRA slots bounded by the memory that holds them (issue 45 item 2): `build` and `serve` with --lora-slots 100000
--lora-max-rank 100000 tried a 7.68 TB allocation (a build's traceback; a server's group restarting for good). Both
are refused in one line before anything loads, naming the largest value that fits, and --help states the bound."""

import pytest
import torch

from h3trt.adapters import memory as slots_memory
from h3trt.adapters.memory import check_slots_fit, unit_bytes
from h3trt.adapters.slots import AdapterSlots
from h3trt.errors import UserError
from h3trt.jobs.model_source import Entry
from h3trt.models.config import H3Config

from lora_cases import fmt_original, tiny_factors, write

pytestmark = pytest.mark.unit


def test_the_slots_bytes_are_the_banks_bytes_and_the_largest_values_that_fit_are_named():
    cfg = H3Config.tiny()
    slots = AdapterSlots(cfg, "t2va", 3, 5, torch.float32, "meta")
    assert 3 * 5 * unit_bytes(cfg, dtype=torch.float32) == sum(
        d.numel() * d.element_size() + u.numel() * u.element_size() for d, u in slots.banks.values())
    unit = unit_bytes(cfg, dtype=torch.float32)
    memory = (10 * 8 * unit, "a test device")
    check_slots_fit(cfg, 10, 8, "cpu", torch.float32, memory=memory)  # exactly full: fits
    check_slots_fit(cfg, 80, 1, "cpu", torch.float32, memory=memory)
    with pytest.raises(UserError) as refused:
        check_slots_fit(cfg, 11, 16, "cpu", torch.float32, memory=memory)
    assert str(refused.value) == (
        f"--lora-slots 11 --lora-max-rank 16: the slots take {11 * 16 * unit / 1e6:.3g} MB (11 x 16 x "
        f"{unit / 1e3:.3g} KB in fp32), more than the {80 * unit / 1e6:.3g} MB of a test device; the largest that "
        "fit: --lora-slots 5 at --lora-max-rank 16, or --lora-max-rank 7 at --lora-slots 11.")
    with pytest.raises(UserError, match="the largest that fit: no slot of rank 81, or --lora-max-rank 80 at"):
        check_slots_fit(cfg, 1, 81, "cpu", torch.float32, memory=memory)


def test_build_refuses_slots_past_the_memory_before_it_starts(h3trt, monkeypatch, tmp_path, tiny_root):
    import h3trt.build.builder as builder

    monkeypatch.setattr(builder, "build", lambda *a, **k: pytest.fail("the build started"))
    code, err = h3trt("build", "--model", "tiny", "--output", str(tmp_path / "b"), "--device", "cpu",
                      "--precision", "fp32", "--lora-slots", "100000", "--lora-max-rank", "100000")
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("h3trt: error: --lora-slots 100000 --lora-max-rank 100000: the slots take 169 TB")
    assert "of this host; the largest that fit: --lora-slots " in err[0] and not (tmp_path / "b").exists()


def test_serve_refuses_its_slots_past_the_memory_flags_or_fitted(tmp_path, tiny_root, monkeypatch):
    adapter = write(tmp_path / "a.safetensors", fmt_original(tiny_factors(1)))
    entry = Entry.local(device="cpu", adapters=(), folder=tmp_path, num_slots=100000, max_rank=100000)
    with pytest.raises(UserError, match=r"^--lora-slots 100000 --lora-max-rank 100000 \(the slots: 100000 of rank "
                                        r"100000\): the slots take .* the largest that fit: --lora-slots \d+ at"):
        entry.adapter_catalog()
    assert adapter.exists()
    unit = unit_bytes(H3Config.tiny(), dtype=torch.float32)
    monkeypatch.setattr(slots_memory, "memory_of", lambda device: (4 * 63 * unit, "a small host"))
    with pytest.raises(UserError, match=r"^the slots fitted to the adapters at start \(4 of rank 64; --lora-slots and "
                                        r"--lora-max-rank set them\): .*: --lora-slots 3 at --lora-max-rank 64, or "
                                        r"--lora-max-rank 63 at --lora-slots 4\.$"):
        Entry.local(device="cpu", folder=tmp_path).adapter_catalog()
    assert Entry.local(device="cpu", folder=tmp_path, max_rank=63).adapter_catalog().names() == ["a"]


@pytest.mark.parametrize("command", ["build", "serve"])
def test_help_states_the_slots_bound(command, capsys):
    from h3trt.cli import main

    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"N x R x {unit_bytes(H3Config()) / 1e6:.1f} MB (full-size H3, bf16) must fit in the GPU's memory" in text
