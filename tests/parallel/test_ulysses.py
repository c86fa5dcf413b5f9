"""Ulysses sequence parallelism on the CPU with gloo: sharded blocks give the single-process outputs.

Tolerance: fp32, relative error (norm) <= 1e-5 against the unsharded forward. Collectives run under a 60 s gloo
timeout so a broken exchange fails the test instead of hanging it.
"""

import datetime
import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from h3trt.models.checkpoint.writer import random_state_dict
from h3trt.models.config import H3Config
from h3trt.models.dit import build_dit
from h3trt.models.packing import RefBlock, pack_ref2va, pack_t2va, row_timesteps, text_tags_for
from h3trt.models.runner import EvalExtras
from h3trt.parallel.mesh import MeshConfig, valid_sp
from h3trt.parallel.ulysses import forward_sp

from helpers import dit_inputs

REL_TOL = 1e-5
LAYOUTS = {
    "t2va_padded": lambda: pack_t2va(text_tags_for(11), 7, 4, 6, 23),  # 11 + 46 + 42 = 99 rows: pads for sp 2 and 4
    "fl2va_even": lambda: pack_t2va(text_tags_for(12, [range(2, 6)]), 7, 4, 6, 23, keyframes=("first",)),
    "ref2va": lambda: pack_ref2va(text_tags_for(9), [RefBlock("image", (1, 4, 4)), RefBlock("audio", audio_latents=5)],
                                  7, 4, 6, 23),
}


def _worker(rank, world, store, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        cfg = H3Config.tiny(num_heads=4, head_dim=32)  # 4 heads: sp 2 and 4 both divide them
        model = build_dit(cfg, torch.float32)
        model.load_state_dict(random_state_dict(cfg, 3))
        results = {}
        for name, make in LAYOUTS.items():
            layout = make()
            video, audio, text = dit_inputs(layout, cfg, seed=1)
            unique_t, t_index = row_timesteps(layout, 0.3, 0.6)
            got = forward_sp(model, dist.group.WORLD, video, audio, text, unique_t, t_index, layout)
            with torch.no_grad():
                want = model(video, audio, text, unique_t, t_index, layout.token_tags, layout.position_ids,
                             layout.video_index, layout.audio_index, layout.text_index)
            results[name] = [((a - b).norm() / b.norm()).item() for a, b in zip(got, want)]
        (out_dir / f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallel_matches_one_process(world, tmp_path):
    mp.spawn(_worker, args=(world, str(tmp_path / "store"), tmp_path), nprocs=world, join=True)
    for rank in range(world):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert set(results) == set(LAYOUTS)
        for name, errors in results.items():
            assert max(errors) <= REL_TOL, f"rank {rank}, {name}: relative errors {errors}"


def test_mesh_validation_names_the_arithmetic():
    assert valid_sp(56) == [1, 2, 4, 7, 8, 14, 28, 56]
    with pytest.raises(ValueError, match=r"sp=3 does not divide the 56 attention heads .* valid sp: \[1, 2, 4, 7, 8"):
        MeshConfig(sp=3).validate(3, 56)
    with pytest.raises(ValueError, match=r"replica\(2\) \* cfg\(1\) \* sp\(2\) = 4 != world size \(8\)"):
        MeshConfig(replica=2, sp=2).validate(8, 56)
    with pytest.raises(ValueError, match="cfg must be 1 or 2"):
        MeshConfig(cfg=3)
    MeshConfig(replica=2, cfg=2, sp=2).validate(8, 56)


def test_a_row_shard_needs_the_exchanging_attention():
    """The one block-stack runner keeps this rank's rows under a shard; plain SDPA there would attend over those rows
    only, so the eager forward refuses a shard without the attention that exchanges rows."""
    cfg = H3Config.tiny(num_heads=4, head_dim=32)
    model = build_dit(cfg, torch.float32)
    layout = LAYOUTS["t2va_padded"]()
    video, audio, text = dit_inputs(layout, cfg, seed=1)
    unique_t, t_index = row_timesteps(layout, 0.3, 0.6)
    with pytest.raises(ValueError, match=r"attn_fn=shard.attention\(\)"):
        model(video, audio, text, unique_t, t_index, layout.token_tags, layout.position_ids, layout.video_index,
              layout.audio_index, layout.text_index, shard=object())


def _sparse_worker(rank, world, store, out_dir):
    """Block-sparse attention under Ulysses: each rank routes its own heads after the exchange, so the sharded
    forward equals the one-process sparse forward (and differs from the dense one)."""
    from h3trt.models.dit import EagerDiT
    from h3trt.models.sparse.plan import SparseSettings
    from h3trt.models.sparse.run import SparseRun

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        cfg = H3Config.tiny(num_heads=4, head_dim=32)
        model = build_dit(cfg, torch.float32)
        model.load_state_dict(random_state_dict(cfg, 3))
        layout = LAYOUTS["t2va_padded"]()
        video, audio, text = dit_inputs(layout, cfg, seed=1)
        unique_t, t_index = row_timesteps(layout, 0.3, 0.6)

        def run(fn):
            sparse = SparseRun(SparseSettings(0.5, dense_steps=0, min_seq=1), "reference", block=8)  # 13 blocks
            sparse.next_evaluation()
            return fn(sparse), sparse.report()

        got, report = run(lambda s: forward_sp(model, dist.group.WORLD, video, audio, text, unique_t, t_index,
                                                layout, EvalExtras(sparse=s)))
        want, _ = run(lambda s: EagerDiT(model)(video, audio, text, unique_t, t_index, layout, EvalExtras(sparse=s)))
        with torch.no_grad():
            dense = model(video, audio, text, unique_t, t_index, layout.token_tags, layout.position_ids,
                          layout.video_index, layout.audio_index, layout.text_index)
        results = {"sharded": [((a - b).norm() / b.norm()).item() for a, b in zip(got, want)],
                   "from_dense": [((a - b).norm() / b.norm()).item() for a, b in zip(want, dense)],
                   "kept_fraction": report["kept_fraction"]}
        (out_dir / f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


@pytest.mark.multiproc
def test_sparse_attention_under_sequence_parallel_matches_one_process(tmp_path):
    mp.spawn(_sparse_worker, args=(2, str(tmp_path / "store"), tmp_path), nprocs=2, join=True)
    for rank in range(2):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert max(results["sharded"]) <= REL_TOL, results
        assert min(results["from_dense"]) > 1e-4 and 0 < results["kept_fraction"] < 1, results
