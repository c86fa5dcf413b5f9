"""Which block-sparse kernel a bundle serves (h3trt/build/sparse_choice.py): timed at the bundle's own shape on a GPU,
the fastest recorded with every time, refused in one line where none runs; checked, not raced, where named. The
device, the kernels' problems and the timings are parameters here, so the choice runs without a GPU."""

import pytest
import torch

from h3trt.build.attention_choice import AttentionShape
from h3trt.build.config import BuildConfig
from h3trt.build.sparse_choice import MEASURE_SPARSITY, SPARSE_KERNEL_REQUESTS, resolve_sparse_kernel
from h3trt.cli.parser import build_parser
from h3trt.engines.manifest import SparseRecord, _sparse_record, _Fields
from h3trt.errors import UserError

CUDA, CPU = torch.device("cuda"), torch.device("cpu")
SHAPE = AttentionShape(37838, 56, 128)
TILES = ("m64n128w4s3", "m64n64w4s3")


def timings(ms: dict):
    calls = []

    def measure(kernel, tile, shape, block, sparsity, device):
        calls.append((kernel, tile, shape, block, sparsity))
        return ms[kernel if tile is None else f"{kernel}:{tile}"]

    return measure, calls


def runs_all(kernel, device):
    return None


def choose(requested="auto", device=CUDA, fp8_attention=True, ms=None, problem=runs_all, sparsity=0.0):
    measure, calls = timings(ms or {"fa4": 23.5, "fp8:m64n128w4s3": 11.2, "fp8:m64n64w4s3": 12.9})
    choice = resolve_sparse_kernel(requested, device, fp8_attention, SHAPE, sparsity, measure, problem,
                                   tiles=lambda block: TILES)
    return choice, calls


def test_auto_times_fa4_and_every_fp8_tile_at_the_bundle_shape_and_keeps_the_fastest():
    choice, calls = choose()
    assert (choice.kernel, choice.tile, choice.block, choice.requested) == ("fp8", "m64n128w4s3", 64, "auto")
    assert choice.measured_ms == {"fa4": 23.5, "fp8:m64n128w4s3": 11.2, "fp8:m64n64w4s3": 12.9}
    assert {c[2] for c in calls} == {SHAPE} and {c[3] for c in calls} == {64}
    assert {c[4] for c in calls} == {MEASURE_SPARSITY}  # the bundle's default was 0: dense unless asked
    slower_fp8, _ = choose(ms={"fa4": 10.0, "fp8:m64n128w4s3": 11.2, "fp8:m64n64w4s3": 12.9}, sparsity=0.8)
    assert (slower_fp8.kernel, slower_fp8.tile) == ("fa4", None)


def test_the_bundle_default_sparsity_is_what_is_timed():
    _, calls = choose(sparsity=0.8)
    assert {c[4] for c in calls} == {0.8}


def test_without_fp8_attention_only_fa4_races_and_the_record_says_why_fp8_did_not():
    choice, calls = choose(fp8_attention=False)
    assert choice.kernel == "fa4" and [c[0] for c in calls] == ["fa4"]
    assert "--fp8-attention" in choice.unavailable["fp8"]


def test_a_gpu_without_fa4_serves_fp8_and_without_either_is_refused_naming_the_package():
    no_fa4 = lambda kernel, device: "flash-attn-4 does not load" if kernel == "fa4" else None  # noqa: E731
    choice, calls = choose(problem=no_fa4)
    assert choice.kernel == "fp8" and "fa4" not in choice.measured_ms and "flash-attn-4" in choice.unavailable["fa4"]
    with pytest.raises(UserError, match=r"no block-sparse kernel a bundle serves runs on cuda.*pip install "
                                         r"'h3trt\[fa4\]'.*flash-attn-4") as e:
        choose(problem=no_fa4, fp8_attention=False)
    assert "\n" not in str(e.value)


def test_flex_is_never_a_bundles_kernel():
    assert "flex" not in SPARSE_KERNEL_REQUESTS
    _, calls = choose()
    assert "flex" not in {c[0] for c in calls}
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["build", "--model", "m", "--output", "o", "--sparse-attention", "0.5", "--sparse-kernel",
                           "flex"])


def test_a_cpu_build_times_nothing():
    assert choose(device=CPU)[0].kernel == "fp8_emulated" and choose(device=CPU)[1] == []
    assert choose(device=CPU, fp8_attention=False)[0].kernel == "reference"


def test_a_named_kernel_is_checked_not_raced_and_fp8_still_times_its_tiles():
    choice, calls = choose("fa4")
    assert (choice.kernel, choice.requested, calls, choice.measured_ms) == ("fa4", "fa4", [], {})
    choice, calls = choose("fp8", ms={"fp8:m64n128w4s3": 14.0, "fp8:m64n64w4s3": 12.0})
    assert (choice.kernel, choice.tile) == ("fp8", "m64n64w4s3") and {c[0] for c in calls} == {"fp8"}
    with pytest.raises(UserError, match=r"--sparse-kernel fp8 runs FP8 attention .* --fp8-attention"):
        choose("fp8", fp8_attention=False)
    with pytest.raises(UserError, match=r"--sparse-kernel fa4: needs FA4"):
        choose("fa4", problem=lambda kernel, device: "needs FA4")


def test_build_flags_are_checked_before_anything_loads(tmp_path, tiny_root):
    base = dict(model_root=tiny_root, output=tmp_path / "out", device="cpu")
    with pytest.raises(UserError, match="--sparse-kernel must be one of"):
        BuildConfig(**base, sparse_attention=0.5, sparse_kernel="flex")
    with pytest.raises(UserError, match="add --sparse-attention"):
        BuildConfig(**base, sparse_kernel="fa4")
    with pytest.raises(UserError, match="--sparse-kernel fp8 runs FP8 attention.*--fp8-attention"):
        BuildConfig(**base, sparse_attention=0.5, sparse_kernel="fp8")
    assert BuildConfig(**base, sparse_attention=0.5, sparse_kernel="reference").sparse_kernel == "reference"
    args = build_parser().parse_args(["build", "--model", "m", "--output", "o", "--sparse-attention", "0.5"])
    assert args.sparse_kernel == "auto"
    assert set(SPARSE_KERNEL_REQUESTS) == set(next(a for a in build_parser()._subparsers._group_actions[0]
                                                   .choices["build"]._actions if a.dest == "sparse_kernel").choices)


def test_the_manifest_keeps_the_choice_and_reads_a_record_from_before_it():
    choice, _ = choose()
    data = {"sparsity": 0.75, "dense_steps": 10, "min_seq": 4096, "kernel": "fp8", "block": 64, "tile": choice.tile,
            "requested": "auto", "measured_ms": choice.measured_ms, "unavailable": {}}
    record = _sparse_record(_Fields({"sparse": data}, "manifest.json"))
    assert (record.kernel, record.tile, record.measured_ms) == ("fp8", "m64n128w4s3", choice.measured_ms)
    old = {k: data[k] for k in ("sparsity", "dense_steps", "min_seq", "block")} | {"kernel": "fa4"}
    record = _sparse_record(_Fields({"sparse": old}, "manifest.json"))
    assert record == SparseRecord(0.75, 10, 4096, "fa4", 64)
    assert (record.tile, record.requested, record.measured_ms) == (None, "auto", {})
