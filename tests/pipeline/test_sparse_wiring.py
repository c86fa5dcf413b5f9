"""Block-sparse attention through the real path: `h3trt run` on the tiny model (lowered --sparse-min-seq and
--sparse-dense-steps reach its short sequences), the clip's record, request lines, the API, and the refusals."""

import json
import re

import pytest

from h3trt.cli import main
from h3trt.errors import UserError

STEPS = ("--steps", "5", "--quiet", "--device", "cpu")  # 4 evaluations


def clip(tmp_path, name, *flags):
    out = tmp_path / f"{name}.mp4"
    assert main(["run", "--prompt", "a fox", "--output", str(out), *STEPS, *flags]) == 0
    return out.read_bytes(), json.loads(out.with_suffix(".json").read_text())


@pytest.fixture(scope="module")
def dense(tmp_path_factory, tiny_cache):
    return clip(tmp_path_factory.mktemp("dense"), "dense")


def test_sparsity_0_is_the_dense_clip_bit_for_bit(dense, tmp_path):
    mp4, record = clip(tmp_path, "zero", "--sparse-attention", "0", "--sparse-dense-steps", "0",
                       "--sparse-min-seq", "1")
    assert mp4 == dense[0]
    assert record["sparse_attention"] == {"sparsity": 0.0} == dense[1]["sparse_attention"]


def test_a_sparse_clip_whose_evaluations_all_stay_dense_is_the_dense_clip(dense, tmp_path):
    """The gating: with every evaluation before --sparse-dense-steps, the sparse path is never entered."""
    mp4, record = clip(tmp_path, "late", "--sparse-attention", "0.75", "--sparse-dense-steps", "4",
                       "--sparse-min-seq", "1")
    assert mp4 == dense[0]
    assert record["sparse_attention"]["sparse_evaluations"] == [] and record["sparse_attention"]["evaluations"] == 4


def test_a_sparse_clip_differs_from_dense_and_its_record_names_it(dense, tmp_path):
    mp4, record = clip(tmp_path, "sparse", "--sparse-attention", "0.75", "--sparse-dense-steps", "2",
                       "--sparse-min-seq", "1")
    assert mp4 != dense[0]
    sparse = record["sparse_attention"]
    assert (sparse["sparsity"], sparse["dense_steps"], sparse["min_seq"]) == (0.75, 2, 1)
    assert sparse["sparse_evaluations"] == [2, 3] and sparse["kernel"] == "reference"
    assert 0 < sparse["kept_fraction"] < 1


def test_min_seq_above_the_sequence_keeps_it_dense(dense, tmp_path):
    mp4, record = clip(tmp_path, "short", "--sparse-attention", "0.75", "--sparse-dense-steps", "0")
    assert mp4 == dense[0]  # the tiny sequence is under the default 4096 rows
    assert record["sparse_attention"]["sparse_evaluations"] == []




@pytest.mark.parametrize("flags, line", [
    (["--sparse-attention", "-0.1"], "--sparse-attention takes a fraction of key blocks to skip, 0 <= s < 1"),
    (["--sparse-attention", "1"], "--sparse-attention takes a fraction"),
    (["--sparse-attention", "nan"], "--sparse-attention takes a fraction"),
    (["--sparse-attention", "half"], "--sparse-attention takes a number, got 'half'"),
    (["--sparse-dense-steps", "2.5"], "--sparse-dense-steps takes a whole number, got '2.5'"),
    (["--sparse-dense-steps", "-1"], "--sparse-dense-steps takes a whole number of at least 0"),
    (["--sparse-min-seq", "0"], "--sparse-min-seq takes a whole number of at least 1"),
])
def test_bad_sparse_flags_are_one_line_and_exit_2(h3trt, no_model_load, tmp_path, flags, line):
    code, err = h3trt("run", "--prompt", "a fox", "--output", str(tmp_path / "c.mp4"), "--device", "cpu", *flags)
    assert code == 2 and len(err) == 1 and err[0].startswith(f"h3trt: error: {line}"), err


def test_profiles_set_the_sparsity_and_a_flag_overrides_it():
    from h3trt.request.parse import profile_fields

    assert profile_fields("balanced")["sparse_attention"] == 0.75
    fields = profile_fields("fast", sparse_attention=0.5, sparse_min_seq=64)
    assert (fields["sparse_attention"], fields["sparse_dense_steps"], fields["sparse_min_seq"]) == (0.5, 10, 64)


def request_of(data: dict):
    from pathlib import Path

    from h3trt.request.parse import parse_object

    return parse_object(data, 1, Path("."), ("prompt",)).request


def test_request_lines_take_the_sparse_keys():
    r = request_of({"prompt": "a fox", "sparse_attention": 0.8, "sparse_dense_steps": 3, "sparse_min_seq": 128})
    assert (r.speed.sparse_attention, r.speed.sparse_dense_steps, r.speed.sparse_min_seq) == (0.8, 3, 128)


@pytest.mark.parametrize("line, message", [
    ({"sparse_attention": 1.5}, "sparse_attention takes a fraction"),
    ({"sparse_attention": "0.5"}, "sparse_attention takes a fraction"),
    ({"sparse_dense_steps": 2.5}, "sparse_dense_steps takes a whole number"),
    ({"sparse_min_seq": -3}, "sparse_min_seq takes a whole number of at least 1"),
])
def test_bad_sparse_request_keys_are_refused_by_name(line, message):
    with pytest.raises(UserError, match=re.escape(message)):
        request_of({"prompt": "a fox", **line})


def test_a_batch_takes_sparsity_from_its_lines_not_the_flags(h3trt, no_model_load, tmp_path):
    requests = tmp_path / "r.jsonl"
    requests.write_text('{"id": "a", "task": "t2va", "prompt": "a fox", "sparse_attention": 0.5}\n')
    code, err = h3trt("run", "--requests", str(requests), "--out-dir", str(tmp_path / "out"),
                      "--sparse-attention", "0.5")
    assert code == 2 and len(err) == 1 and "--sparse-attention set one clip's speed profile" in err[0], err


def test_a_sparse_request_is_not_batched():
    """A batch shares one evaluation per step; a sparse request counts its own evaluations (and encode_request
    refuses it), so the batcher runs it alone."""
    from h3trt.models.packing import Geometry
    from h3trt.request.request import Admitted

    def key(request):
        return Admitted(request, Geometry(96, 160, 124)).batch_key

    assert key(request_of({"prompt": "a fox"})) == key(request_of({"prompt": "a cat"})) is not None
    assert key(request_of({"prompt": "a fox", "sparse_attention": 0.5})) is None


def test_guidance_and_the_step_cache_compose_with_it(tmp_path):
    """Both guidance branches of a step are one evaluation; a profile's step cache runs beside the sparsity."""
    _, record = clip(tmp_path, "guided", "--guidance", "2", "--negative-prompt", "blur", "--sparse-attention", "0.5",
                     "--sparse-dense-steps", "2", "--sparse-min-seq", "1")
    assert record["sparse_attention"]["evaluations"] == 4 and record["sparse_attention"]["sparse_evaluations"] == [2, 3]
    _, record = clip(tmp_path, "profiled", "--profile", "fast", "--cache-warmup", "1", "--cache-threshold", "inf",
                     "--sparse-dense-steps", "1", "--sparse-min-seq", "1")
    sparse, cache = record["sparse_attention"], record["step_cache"]
    assert sparse["sparsity"] == 0.8 and sparse["evaluations"] == 4
    # A skipped evaluation runs block 0 alone: its attention still ran sparse in every evaluation after the first.
    assert sparse["sparse_evaluations"] == [1, 2, 3], (sparse, cache)


def test_flex_on_cuda_routes_128_row_blocks_and_the_others_subblocks_64():
    from h3trt.models.sparse.kernels import FLEX_BLOCK, sparse_block

    assert sparse_block("flex", "cuda") == FLEX_BLOCK == 128
    assert sparse_block("flex", "cpu") == sparse_block("fa4", "cuda") == sparse_block("reference", "cuda") == 64


def test_a_sparse_kernel_that_fails_at_load_stops_no_dense_run_and_a_sparse_one_names_why(
        dense, h3trt, monkeypatch, tmp_path):
    """On the H200 without FA4 the load warmed flex at 64-row blocks and refused every run, dense ones too (GPU smoke,
    session 13). Here flex, which needs CUDA, is made the default on the CPU so that its warm-up fails."""
    import h3trt.models.sparse.kernels as sparse_kernels

    monkeypatch.setattr(sparse_kernels, "default_sparse_kernel", lambda device, kernels: "flex")
    out = tmp_path / "dense.mp4"
    code, err = h3trt("run", "--prompt", "a fox", "--output", str(out), *STEPS)
    assert code == 0 and out.read_bytes() == dense[0]
    assert any("the flex block-sparse attention kernel did not compile" in line for line in err), err
    code, err = h3trt("run", "--prompt", "a fox", "--output", str(tmp_path / "sparse.mp4"), *STEPS,
                      "--sparse-attention", "0.75", "--sparse-min-seq", "1")
    assert code == 2 and err[-1].startswith("h3trt: error: the flex block-sparse attention kernel did not compile")
    assert "--sparse-attention 0" in err[-1] and not (tmp_path / "sparse.mp4").exists()
