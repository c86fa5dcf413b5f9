"""Step caching against diffusers 0.42.1's hooks (FirstBlockCache, MagCache) on the tiny model, identical weights.

diffusers 0.42.1 registers no MiniMax-H3 block with its cache hooks and its H3 denoise loop sets no cache context, so
the reference side here does both: it registers `MiniMaxH3TransformerBlock` with `TransformerBlockRegistry` and wraps
every transformer call in `cache_context("cond")` (and "uncond" for the negative branch). Both sides denoise the
same seeded latents with the same Euler update (h3trt's sampler; the sampler is not what is under test).

Tolerances: the same evaluations are skipped on both sides; fp32 final latents within a relative error (norm) of
1e-4 of the reference's (1e-5 per forward, over 19 evaluations); threshold 0 equals the uncached run bit for bit.
"""

import ast
import json

import pytest
import torch
from diffusers import MiniMaxH3Transformer3DModel
from diffusers.hooks import FirstBlockCacheConfig, MagCacheConfig, apply_first_block_cache, apply_mag_cache
from diffusers.hooks._helpers import TransformerBlockMetadata, TransformerBlockRegistry
from diffusers.loaders.single_file_utils import convert_minimax_h3_transformer_checkpoint_to_diffusers
from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3TransformerBlock

from h3trt.errors import UserError
from h3trt.models.checkpoint.reader import load_dit
from h3trt.models.dit import EagerDiT
from h3trt.models.packing import pack_t2va, row_timesteps, text_tags_for
from h3trt.models.runner import EvalExtras
from h3trt.models.sampler import Latents, Schedule, denoise, euler_step, initial_latents
from h3trt.models.step_cache import StepCache, StepCacheConfig, nearest_interp
from h3trt.models.tiny import TINY_HEIGHT, TINY_REFERENCE_SHORT_EDGE, TINY_WIDTH
from h3trt.parallel.launch import init_rank, launch
from h3trt.parallel.mesh import MeshConfig, build_mesh
from h3trt.pipeline.h3_pipeline import H3Pipeline
from h3trt.request.request import CanvasDefaults, Request
from h3trt.pipeline.prepare import prepare
from h3trt.jobs.rank import WorkerSpec, load_rank_pipeline

LATENT_TOL = 1e-4
SCHEDULE = Schedule(20, 12.0, 3.0)  # 19 evaluations
LAYOUT = pack_t2va(text_tags_for(9, [range(2, 5)]), 7, 4, 6, 23, keyframes=("first",))
# A per-step magnitude ratio list of another length (interpolated to 19, as the reference does); no ratio is exactly 1.
MAG_RATIOS = (1.0 + 1e-3, 0.995, 0.99, 0.985, 0.99, 0.97, 0.985, 0.96, 0.95, 0.93, 0.91)

TransformerBlockRegistry.register(MiniMaxH3TransformerBlock, TransformerBlockMetadata(
    return_hidden_states_index=0, return_encoder_hidden_states_index=None))


@pytest.fixture(scope="module")
def models(tiny_cfg, tiny_checkpoints):
    ours, _ = load_dit(tiny_checkpoints["official"], "t2va", torch.float32)
    return ours, tiny_cfg


def reference_model(ours, cfg):
    ref = MiniMaxH3Transformer3DModel(**cfg.to_diffusers_kwargs())
    state = {k: v.clone() for k, v in ours.state_dict().items()}
    ref.load_state_dict(convert_minimax_h3_transformer_checkpoint_to_diffusers(state, ref.config))
    return ref.eval()


def start(cfg):
    g = torch.Generator().manual_seed(11)
    cond = (torch.randn(1, cfg.in_channels, 1, 4, 6, generator=g),)
    latents = initial_latents(5, 7, 4, 6, 23, cfg.patch_size, cfg.in_channels, cfg.audio_in_channels, cond)
    return latents, torch.randn(1, LAYOUT.text_index.numel(), cfg.text_dim, generator=g)


def ours_run(model, cfg, config: StepCacheConfig | None):
    latents, text = start(cfg)
    dit = EagerDiT(model)
    cache = StepCache(config, SCHEDULE.num_evaluations) if config else None
    ctx = cache.context("cond") if cache else None

    def fn(video, audio, unique_t, t_index):
        return dit(video, audio, text, unique_t, t_index, LAYOUT, EvalExtras(cache=ctx))

    with torch.no_grad():
        final = denoise(fn, latents, LAYOUT, SCHEDULE)
    return final, (cache.report() if cache else None)


@torch.no_grad()
def reference_run(ref, cfg, hook_name):
    """The loop of `sampler.denoise` over the diffusers transformer, each call in cache_context("cond"); returns the
    final latents and, per evaluation, whether the hook ran the block stack."""
    latents, text = start(cfg)
    video, audio = latents.video.clone(), latents.audio.clone()
    cv, ca = LAYOUT.num_condition_video_rows, LAYOUT.num_condition_audio_rows
    sv, sa = SCHEDULE.video_sigmas, SCHEDULE.audio_sigmas
    manager = ref.transformer_blocks[0]._diffusers_hook.get_hook(hook_name).state_manager
    computed = []
    for i, (tv, ta) in enumerate(SCHEDULE.timesteps()):
        unique_t, t_index = row_timesteps(LAYOUT, tv, ta)
        with ref.cache_context("cond"):
            v_video, v_audio = ref(hidden_states=video[None], audio_hidden_states=audio[None],
                                   encoder_hidden_states=text, timestep=unique_t, timestep_indices=t_index,
                                   token_tags=LAYOUT.token_tags, position_ids=LAYOUT.position_ids,
                                   video_indices=LAYOUT.video_index, audio_indices=LAYOUT.audio_index,
                                   text_indices=LAYOUT.text_index, return_dict=False)
            computed.append(bool(manager.get_state().should_compute))
        video[cv:] = euler_step(video[cv:], v_video[0, cv:], tv, sv[i], sv[i + 1])
        audio[ca:] = euler_step(audio[ca:], v_audio[0, ca:], ta, sa[i], sa[i + 1])
    return Latents(video, audio), computed


def skipped_of(computed):
    return [i for i, ran in enumerate(computed) if not ran]


def check_latents(got: Latents, want: Latents):
    for a, b in ((got.video, want.video), (got.audio, want.audio)):
        err = ((a - b).norm() / b.norm()).item()
        assert err <= LATENT_TOL, f"relative error {err:.2e}"


@pytest.mark.parametrize("threshold", [0.05, 0.1])
def test_first_block_cache_matches_the_diffusers_hook(models, threshold):
    ours, cfg = models
    ref = reference_model(ours, cfg)
    apply_first_block_cache(ref, FirstBlockCacheConfig(threshold=threshold))
    want, computed = reference_run(ref, cfg, "fbc_leader_block_hook")
    got, report = ours_run(ours, cfg, StepCacheConfig("first-block", threshold))
    skipped = report["branches"]["cond"]["skipped_steps"]
    assert skipped == skipped_of(computed)
    assert 0 < len(skipped) < SCHEDULE.num_evaluations - 1, "a test that skips nothing (or everything) proves little"
    check_latents(got, want)


@pytest.mark.parametrize("threshold,max_skip,retention", [(0.06, 3, 0.2), (0.15, 2, 0.1)])
def test_mag_cache_matches_the_diffusers_hook(models, threshold, max_skip, retention):
    ours, cfg = models
    ref = reference_model(ours, cfg)
    apply_mag_cache(ref, MagCacheConfig(threshold=threshold, max_skip_steps=max_skip, retention_ratio=retention,
                                        num_inference_steps=SCHEDULE.num_evaluations, mag_ratios=list(MAG_RATIOS)))
    want, computed = reference_run(ref, cfg, "mag_cache_leader_block_hook")
    got, report = ours_run(ours, cfg, StepCacheConfig("mag", threshold, MAG_RATIOS, max_skip, retention))
    skipped = report["branches"]["cond"]["skipped_steps"]
    assert skipped == skipped_of(computed) and 0 < len(skipped) < SCHEDULE.num_evaluations - 1
    check_latents(got, want)
    used = nearest_interp(torch.tensor(MAG_RATIOS), SCHEDULE.num_evaluations)
    assert report["mag_ratios"] == [float(r) for r in used] and report["mag_ratios_given"] == len(MAG_RATIOS)


def test_mag_calibration_matches_the_diffusers_hook(models, capsys):
    ours, cfg = models
    ref = reference_model(ours, cfg)
    apply_mag_cache(ref, MagCacheConfig(calibrate=True, num_inference_steps=SCHEDULE.num_evaluations))
    capsys.readouterr()
    want, computed = reference_run(ref, cfg, "mag_cache_leader_block_hook")
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    ratios = ast.literal_eval(printed[-1])
    got, report = ours_run(ours, cfg, StepCacheConfig("mag", 0.06, calibrate=True))
    ours_ratios = report["branches"]["cond"]["mag_ratios_calibrated"]
    assert all(computed) and report["skipped"] == 0
    assert len(ours_ratios) == len(ratios) == SCHEDULE.num_evaluations
    assert max(abs(a - b) for a, b in zip(ours_ratios, ratios)) <= 1e-5
    check_latents(got, want)


@pytest.mark.parametrize("config", [StepCacheConfig("first-block", 0.0), StepCacheConfig("mag", 0.0, MAG_RATIOS)])
def test_threshold_zero_equals_the_uncached_run_exactly(models, config):
    ours, cfg = models
    plain, _ = ours_run(ours, cfg, None)
    cached, report = ours_run(ours, cfg, config)
    assert report["skipped"] == 0
    assert torch.equal(cached.video, plain.video) and torch.equal(cached.audio, plain.audio)


def test_cache_options_are_validated():
    with pytest.raises(ValueError, match="needs the model's ratios"):
        StepCacheConfig("mag", 0.06)
    with pytest.raises(ValueError, match="apply to --cache mag"):
        StepCacheConfig("first-block", 0.05, MAG_RATIOS)
    with pytest.raises(ValueError, match="must be one of"):
        StepCacheConfig("teacache", 0.1)
    with pytest.raises(ValueError, match=">= 0"):
        StepCacheConfig("first-block", -1.0)
    for ratios, named in (((-1.0, 0.0, float("inf")), r"not -1.0 \(#1\), 0.0 \(#2\), inf \(#3\)"),
                          ((1.0, float("inf")), r"not inf \(#2\)"), ((0.99, float("nan")), r"not nan \(#2\)"),
                          ((), "and at least one")):
        with pytest.raises(UserError, match="--mag-ratios must be finite positive numbers, " + named):
            StepCacheConfig("mag", 0.06, ratios)


# ----------------------------------------------------------------------------------------------------------------------
# Under the mesh: sp=2 x cfg=2, guided, an odd packed length (975 rows: the last sp rank holds a padding row). The
# first-block cache is the data-dependent one (MagCache decides from the step index, the same on every rank).

CANVAS = CanvasDefaults(short_edge=TINY_HEIGHT, max_pixels=TINY_WIDTH * TINY_HEIGHT,
                        reference_short_edge=TINY_REFERENCE_SHORT_EDGE)
MESH_REQUESTS = {
    "fbc": Request.of("a fox runs through the snow", steps=12, seed=3, guidance=2.5, negative_prompt="blurry",
                   cache=StepCacheConfig("first-block", 0.12)),
}


def _cached(pipeline, name):
    request = MESH_REQUESTS[name]
    cache = StepCache(request.speed.cache, pipeline.schedule(request).num_evaluations)
    _, layout, final = pipeline.denoise_request(prepare(request, CANVAS), cache=cache)
    return {"video": final.video, "audio": final.audio, "report": cache.report(), "rows": layout.seq_len}


def _serve(rank, world, store, root, out):
    init_rank(rank, world, store, "cpu")
    mesh = MeshConfig(cfg=2, sp=2)
    par = build_mesh(mesh, "cpu", world, 2)
    pipeline = load_rank_pipeline(WorkerSpec(str(root), False, "t2va", "cpu", mesh, 2, canvas=CANVAS), par,
                                  torch.device("cpu"))
    for name in MESH_REQUESTS:
        torch.save(_cached(pipeline, name), out / f"{name}.rank{rank}.pt")


@pytest.mark.multiproc
def test_sp2_x_cfg2_ranks_take_the_one_process_decisions(tiny_root, tmp_path):
    single = H3Pipeline.load(tiny_root, "t2va", "cpu", CANVAS)
    want = {name: _cached(single, name) for name in MESH_REQUESTS}
    assert want["fbc"]["rows"] % 2 == 1  # sp=2 pads: the metric must leave the padding row out
    launch(_serve, 4, (tiny_root, tmp_path))
    for name, expected in want.items():
        branches = expected["report"]["branches"]
        assert set(branches) == {"cond", "uncond"}
        assert any(b["skipped_steps"] for b in branches.values()), f"{name}: nothing skipped"
        for rank in range(4):
            got = torch.load(tmp_path / f"{name}.rank{rank}.pt")
            assert {k: v["skipped_steps"] for k, v in got["report"]["branches"].items()} == \
                   {k: v["skipped_steps"] for k, v in branches.items()}, f"{name} rank {rank}"
            for k, v in branches.items():  # the sharded metric is the unsharded one: padding rows left out
                for a, b in zip(got["report"]["branches"][k].get("relative_change", []), v.get("relative_change", [])):
                    assert (a is None and b is None) or abs(a - b) <= 1e-5 * max(1.0, b)
            for key in ("video", "audio"):
                err = ((got[key] - expected[key]).norm() / expected[key].norm()).item()
                assert err <= 1e-5, f"{name} {key} rank {rank}: relative error {err:.2e}"
    json.dumps(want["fbc"]["report"])  # the record is JSON as written beside the clip
