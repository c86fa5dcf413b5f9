"""Which VSA kernel a FastH3-VSA bundle serves (h3trt/build/vsa_choice.py): with --fp8-attention on a GPU, fa4 and
every fp8 tile that warms up timed at the bundle's VSA shape, the fastest recorded with every time and each left out
with why; on the CPU fp8_emulated; without --fp8-attention the bf16 order. The device, the warm-up and the timings are
parameters here, so the choice runs without a GPU; the record round-trips through the manifest."""

import pytest
import torch

from h3trt.build.vsa_choice import MEASURE_SPARSITY, resolve_vsa_kernel
from h3trt.errors import UserError
from h3trt.models.vsa.plan import VsaRun, VsaServing, VsaSettings, load_vsa_kernel
from h3trt.models.vsa.tiles import tile_geometry

CUDA, CPU = torch.device("cuda"), torch.device("cpu")
GEOMETRY = tile_geometry((180, 0, 126), (37, 24, 42))  # 1344x768, 5 s: 660 video tiles
TILES = ("m64n128w4s3", "m64n64w4s3")


def choose(device=CUDA, fp8=True, ms=None, fails=(), sparsity=0.9):
    calls, loads, lines = [], [], []

    def measure(kernel, tile, geometry, heads, head_dim, s, dev):
        calls.append((kernel, tile, geometry.padded_len, heads, head_dim, s))
        return (ms or {"fa4": 9.5, "fp8:m64n128w4s3": 5.1, "fp8:m64n64w4s3": 6.3})[kernel if tile is None
                                                                                   else f"{kernel}:{tile}"]

    def load(dev, heads, head_dim, dtype, kernel, tile=None):
        loads.append((kernel, tile))
        if (kernel if tile is None else f"{kernel}:{tile}") in fails:
            raise UserError(f"the {kernel} VSA kernel does not run here")
        return kernel

    choice = resolve_vsa_kernel(device, 56, 128, torch.bfloat16, fp8, GEOMETRY, sparsity, lines.append, measure,
                                load, tiles=lambda: TILES)
    return choice, calls, loads, lines


def test_fp8_vsa_on_a_gpu_times_fa4_and_every_fp8_tile_each_warmed_and_keeps_the_fastest():
    choice, calls, loads, lines = choose()
    assert (choice.kernel, choice.tile) == ("fp8", "m64n128w4s3")
    assert choice.measured_ms == {"fa4": 9.5, "fp8:m64n128w4s3": 5.1, "fp8:m64n64w4s3": 6.3} and not choice.left_out
    assert loads == [("fa4", None), ("fp8", "m64n128w4s3"), ("fp8", "m64n64w4s3")]  # compiled before timed
    assert {c[2:] for c in calls} == {(GEOMETRY.padded_len, 56, 128, 0.9)}
    assert "serving fp8:m64n128w4s3" in lines[-1]
    faster_bf16, *_ = choose(ms={"fa4": 4.0, "fp8:m64n128w4s3": 5.1, "fp8:m64n64w4s3": 6.3})
    assert (faster_bf16.kernel, faster_bf16.tile) == ("fa4", None)  # FP8 allows, the clock decides


def test_a_dense_default_is_timed_at_the_measure_sparsity():
    _, calls, _, _ = choose(sparsity=0.0)
    assert {c[5] for c in calls} == {MEASURE_SPARSITY}


def test_a_kernel_that_does_not_warm_up_is_left_out_loudly_and_none_falls_back_to_the_bf16_order(monkeypatch):
    choice, calls, _, lines = choose(fails=("fp8:m64n128w4s3",))
    assert (choice.kernel, choice.tile) == ("fp8", "m64n64w4s3")
    assert "fp8:m64n128w4s3" in choice.left_out and "fp8:m64n128w4s3" not in choice.measured_ms
    assert any(line.startswith("VSA kernel fp8:m64n128w4s3 left out") for line in lines)
    from h3trt.build import vsa_choice

    monkeypatch.setattr(vsa_choice, "choose_vsa_kernel", lambda *a: ("flex", {"fa4": "no fa4"}))
    choice, calls, _, _ = choose(fails=("fa4", *(f"fp8:{t}" for t in TILES)))
    assert choice.kernel == "flex" and not calls and set(choice.left_out) == {"fa4", *(f"fp8:{t}" for t in TILES)}


def test_a_cpu_build_serves_the_emulation_and_without_fp8_the_bf16_order():
    choice, calls, loads, lines = choose(device=CPU)
    assert (choice.kernel, choice.tile, choice.measured_ms) == ("fp8_emulated", None, {}) and not calls
    assert loads == [("fp8_emulated", None)] and "CUDA" in choice.left_out["fp8"] and lines
    bf16 = resolve_vsa_kernel(CPU, 2, 16, torch.float32, False, GEOMETRY, 0.9, log=lambda line: None)
    assert bf16.kernel == "reference" and set(bf16.left_out) == {"fa4", "flex"} and bf16.tile is None


def test_the_record_keeps_kernel_tile_and_times_and_a_run_reads_the_tile():
    served = VsaServing(VsaSettings(0.9), "fp8", {"fa4": "slower"}, "m64n64w4s3", {"fa4": 9.5, "fp8:m64n64w4s3": 5.1})
    data = served.to_dict()
    assert (data["kernel"], data["tile"], data["measured_ms"]) == ("fp8", "m64n64w4s3", served.measured_ms)
    back = VsaServing.from_dict(data)
    assert back == served and (back.tile, back.measured_ms, back.left_out) == (served.tile, served.measured_ms,
                                                                              served.left_out)
    run = VsaRun(back)
    run.next_evaluation()
    assert (run.kernel, run.tile, run.report()["tile"]) == ("fp8", "m64n64w4s3", "m64n64w4s3")
    for bad in ({**data, "kernel": "fp9"}, {**data, "kernel": "fa4"}, {**data, "tile": 3}):
        with pytest.raises(ValueError, match="VSA record"):
            VsaServing.from_dict(bad)
    assert VsaServing(VsaSettings(0.9), "reference").to_dict().keys().isdisjoint({"tile", "measured_ms"})


def test_loading_an_fp8_kernel_on_the_cpu_names_it_and_the_emulation_warms():
    with pytest.raises(UserError, match=r"the fp8 \(tile m64n64w4s3\) VSA kernel does not run on cpu.*CUDA"):
        load_vsa_kernel("cpu", 2, 32, torch.bfloat16, "fp8", "m64n64w4s3")
    assert load_vsa_kernel("cpu", 2, 32, torch.bfloat16, "fp8_emulated") == "fp8_emulated"
