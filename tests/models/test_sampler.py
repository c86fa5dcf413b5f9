"""h3trt.models.sampler against the diffusers 0.42.1 MiniMax-H3 scheduler and noise recipe (the oracle).

Every comparison here is bit-exact (`torch.equal`): the sampler reproduces the reference's float32 arithmetic op for
op, so there is no tolerance to state.
"""

from __future__ import annotations

import pytest
import torch

from diffusers import MiniMaxH3Scheduler
from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3SetTimestepsStep, patchify_video_latents
from diffusers.utils.torch_utils import randn_tensor

from h3trt.models.packing import RefBlock, pack_ref2va, pack_t2va, text_tags_for
from h3trt.models.sampler import (Latents, Schedule, denoise, denoise_batch, euler_step, initial_latents,
                                  shifted_sigmas)

PATCH = (1, 2, 2)
CPU = torch.device("cpu")


def d_scheduler(shift: float, steps: int) -> MiniMaxH3Scheduler:
    s = MiniMaxH3Scheduler(shift=shift)
    s.set_timesteps(steps)
    return s


# ----------------------------------------------------------------------------------------------------------------------
# 1. Sigma grids and timesteps


@pytest.mark.parametrize("steps", [2, 3, 4, 10, 50, 100])
@pytest.mark.parametrize("video_shift,audio_shift", [(12.0, 3.0), (5.0, 3.0), (12.0, 5.0), (1.0, 7.5)])
def test_schedule_matches_diffusers(steps, video_shift, audio_shift):
    sched = Schedule(steps, video_shift=video_shift, audio_shift=audio_shift)
    dv, da = d_scheduler(video_shift, steps), d_scheduler(audio_shift, steps)
    assert sched.video_sigmas.dtype == torch.float32
    assert torch.equal(sched.video_sigmas, dv.sigmas)
    assert torch.equal(sched.audio_sigmas, da.sigmas)
    ts = sched.timesteps()
    assert len(ts) == sched.num_evaluations == len(dv.timesteps) == len(da.timesteps) == steps - 1
    assert torch.equal(torch.tensor([t for t, _ in ts], dtype=torch.float32), dv.timesteps)
    assert torch.equal(torch.tensor([t for _, t in ts], dtype=torch.float32), da.timesteps)
    # the Python floats are what diffusers passes on: float(timestep) of the float32 grid
    assert [t for t, _ in ts] == [float(t) for t in dv.timesteps]
    assert [t for _, t in ts] == [float(t) for t in da.timesteps]


def test_schedule_default_50_steps():
    sched = Schedule()
    assert (sched.steps, sched.video_shift, sched.audio_shift) == (50, 12.0, 3.0)
    assert sched.num_evaluations == 49
    assert len(sched.timesteps()) == 49
    assert sched.video_sigmas[0] == 1.0 and sched.video_sigmas[-1] == 0.0
    assert sched.timesteps()[0] == (0.0, 0.0)


def test_set_shift_override_matches():
    d = MiniMaxH3Scheduler(shift=12.0)
    d.set_shift(5.0)
    d.set_timesteps(10)
    assert torch.equal(shifted_sigmas(10, 5.0), d.sigmas)
    assert not torch.equal(shifted_sigmas(10, 12.0), d.sigmas)


@pytest.mark.parametrize("steps,shift", [(1, 12.0), (0, 3.0), (10, 0.0), (10, -1.0), (10, float("nan")),
                                         (10, float("inf"))])
def test_schedule_rejects_bad_arguments(steps, shift):
    with pytest.raises(ValueError):
        shifted_sigmas(steps, shift)
    with pytest.raises(ValueError):
        Schedule(steps, video_shift=shift)


# ----------------------------------------------------------------------------------------------------------------------
# 2. One Euler update


@pytest.mark.parametrize("shift", [12.0, 3.0])
@pytest.mark.parametrize("index", [0, 1, 24, 47, 48])  # first, second, middle, penultimate, last of 49 evaluations
def test_euler_step_matches_scheduler_step(shift, index):
    steps = 50
    g = torch.Generator().manual_seed(1234 + index)
    x = torch.randn(96, 96, generator=g)
    v = torch.randn(96, 96, generator=g) * 3.0
    d = d_scheduler(shift, steps)
    # advance the scheduler to `index` by stepping it, as the denoising loop does
    dummy = torch.zeros(2, 2)
    for i in range(index):
        d.step(dummy, d.timesteps[i], dummy)
    assert (d.step_index or 0) == index
    expected = d.step(v, d.timesteps[index], x).prev_sample

    sigmas = shifted_sigmas(steps, shift)
    t_float = Schedule(steps, video_shift=shift, audio_shift=shift).timesteps()[index][0]
    ours = euler_step(x, v, t_float, sigmas[index], sigmas[index + 1])
    assert ours.dtype == torch.float32
    assert torch.equal(ours, expected), f"max abs err {(ours - expected).abs().max().item():.3g}"
    # a tensor timestep is the same thing
    assert torch.equal(euler_step(x, v, d.timesteps[index], sigmas[index], sigmas[index + 1]), expected)
    if index == steps - 2:  # the last step lands on the denoised estimate x + (1 - t) * v
        t = torch.tensor(t_float, dtype=torch.float32)
        assert torch.equal(ours, x + (1 - t) * v)


# ----------------------------------------------------------------------------------------------------------------------
# 3. Initial noise

GEOM = dict(latent_frames=7, latent_h=4, latent_w=6, audio_latents=20)


def diffusers_initial(seed, conditions=(), reference_audio_rows=(), latent_frames=7, latent_h=4, latent_w=6,
                      audio_latents=20):
    """The diffusers draw order: MiniMaxH3PrepareConditionLatentsStep (one randn per condition, scale_noise to 0.999,
    patchify), then MiniMaxH3PrepareLatentsStep (video [1, 24, T, H, W], then audio rows [2A, 32]), all off one
    generator; Ref2VAPrepareLatentsStep / FL2VAPrepareLatentsStep put the conditioning in front."""
    gen = torch.Generator("cpu").manual_seed(seed)
    scheduler = MiniMaxH3Scheduler()
    packed = []
    for cond in conditions:
        noise = randn_tensor(cond.shape, generator=gen, device=CPU, dtype=torch.float32)
        packed.append(patchify_video_latents(scheduler.scale_noise(cond, 0.999, noise), PATCH))
    latents = randn_tensor((1, 24, latent_frames, latent_h, latent_w), generator=gen, device=CPU, dtype=torch.float32)
    video = patchify_video_latents(latents, PATCH)
    audio = randn_tensor((audio_latents * 2, 32), generator=gen, device=CPU, dtype=torch.float32)
    if packed:
        video = torch.cat(packed + [video])
    if reference_audio_rows:
        audio = torch.cat(list(reference_audio_rows) + [audio])
    return video, audio


def _clean(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("seed", [0, 42, 2**31 + 7])
def test_initial_latents_no_conditions(seed):
    ours = initial_latents(seed, **GEOM)
    dv, da = diffusers_initial(seed)
    assert ours.video.shape == (7 * 2 * 3, 96) and ours.audio.shape == (40, 32)
    assert torch.equal(ours.video, dv)
    assert torch.equal(ours.audio, da)


@pytest.mark.parametrize("seed", [0, 42])
def test_initial_latents_two_keyframes(seed):
    conds = (_clean((1, 24, 1, 4, 6), 100), _clean((1, 24, 1, 4, 6), 101))
    ours = initial_latents(seed, **GEOM, conditions=conds)
    dv, da = diffusers_initial(seed, conds)
    assert ours.video.shape == ((2 + 7) * 6, 96)
    assert torch.equal(ours.video, dv)
    assert torch.equal(ours.audio, da)
    # the conditions consume draws: the generated rows are not those of an unconditioned request
    assert not torch.equal(ours.video[12:], initial_latents(seed, **GEOM).video)


@pytest.mark.parametrize("seed", [3, 42])
def test_initial_latents_ref2va_with_reference_audio(seed):
    conds = (_clean((1, 24, 1, 8, 4), 200), _clean((1, 24, 3, 4, 6), 201))  # an image and a video, own sizes
    ref_audio = (_clean((2 * 10, 32), 202), _clean((2 * 5, 32), 203))
    ours = initial_latents(seed, **GEOM, conditions=conds, reference_audio_rows=ref_audio)
    dv, da = diffusers_initial(seed, conds, ref_audio)
    assert ours.video.shape == ((8 + 18 + 42), 96) and ours.audio.shape == (30 + 40, 32)
    assert torch.equal(ours.video, dv)
    assert torch.equal(ours.audio, da)
    # reference audio is prepended untouched (never noised)
    assert torch.equal(ours.audio[:20], ref_audio[0]) and torch.equal(ours.audio[20:30], ref_audio[1])


# ----------------------------------------------------------------------------------------------------------------------
# 4. The denoising loop


def fake_model_for(layout, calls):
    """A deterministic stand-in for the transformer: depends on every row (roll across rows mixes condition rows into
    target outputs) and on each row's timestep, so wrong inputs or a wrong timestep plan change the result."""

    def model(video, audio, unique_t, t_index):
        calls.append((video.clone(), audio.clone(), unique_t.clone(), t_index.clone()))
        tv = unique_t[t_index[layout.video_index]][None, :, None]
        ta = unique_t[t_index[layout.audio_index]][None, :, None]
        v = torch.sin(1.7 * video) - tv * video + 0.25 * video.roll(1, dims=1)
        a = torch.cos(audio) * (1.0 - ta) - 0.5 * audio.flip(-1) + 0.1 * audio.roll(3, dims=1)
        return v, a

    return model


def reference_loop(model, video, audio, layout, steps, video_shift=12.0, audio_shift=3.0):
    """The diffusers loop: MiniMaxH3SetTimestepsStep's row plan, then per step the transformer and
    MiniMaxH3LoopSchedulerStep (scheduler.step on the non-condition rows only)."""
    sched, asched = d_scheduler(video_shift, steps), d_scheduler(audio_shift, steps)
    plan = [
        MiniMaxH3SetTimestepsStep.build_row_timesteps(
            layout.video_index, layout.audio_index, layout.num_condition_video_rows, layout.num_condition_audio_rows,
            layout.text_index.numel(), float(t), float(ta), max(float(t), 0.999), 1.0,
        )
        for t, ta in zip(sched.timesteps, asched.timesteps)
    ]
    cv, ca = layout.num_condition_video_rows, layout.num_condition_audio_rows
    video, audio = video.clone(), audio.clone()
    for i, t in enumerate(sched.timesteps):
        unique_t, t_index = plan[i]
        nv, na = model(video[None], audio[None], unique_t, t_index)
        video[cv:] = sched.step(nv[0, cv:].float(), t, video[cv:], return_dict=False)[0]
        audio[ca:] = asched.step(na[0, ca:].float(), asched.timesteps[i], audio[ca:], return_dict=False)[0]
    return video, audio


def _fl2va_case():
    layout = pack_t2va(text_tags_for(10, [range(2, 6)]), 7, 4, 6, 20, PATCH, keyframes=("first", "last"))
    conds = (_clean((1, 24, 1, 4, 6), 300), _clean((1, 24, 1, 4, 6), 301))
    return layout, initial_latents(5, 7, 4, 6, 20, conditions=conds)


def _ref2va_case():
    blocks = [RefBlock("image", (1, 8, 4)), RefBlock("video", (3, 4, 6), audio_latents=10),
              RefBlock("audio", audio_latents=5)]
    layout = pack_ref2va(text_tags_for(12, [range(3, 7)]), blocks, 7, 4, 6, 20, PATCH)
    conds = (_clean((1, 24, 1, 8, 4), 400), _clean((1, 24, 3, 4, 6), 401))
    ref_audio = (_clean((20, 32), 402), _clean((10, 32), 403))
    return layout, initial_latents(6, 7, 4, 6, 20, conditions=conds, reference_audio_rows=ref_audio)


def _t2va_case():
    layout = pack_t2va(torch.ones(8, dtype=torch.long), 7, 4, 6, 20, PATCH)
    return layout, initial_latents(7, 7, 4, 6, 20)


@pytest.mark.parametrize("case", [_t2va_case, _fl2va_case, _ref2va_case], ids=["t2va", "fl2va", "ref2va"])
@pytest.mark.parametrize("steps,video_shift,audio_shift", [(4, 12.0, 3.0), (6, 5.0, 3.0)])
def test_denoise_matches_diffusers_loop(case, steps, video_shift, audio_shift):
    layout, start = case()
    cv, ca = layout.num_condition_video_rows, layout.num_condition_audio_rows
    assert start.video.shape[0] == layout.video_index.numel() and start.audio.shape[0] == layout.audio_index.numel()
    video0, audio0 = start.video.clone(), start.audio.clone()

    ref_calls, our_calls, progress = [], [], []
    ref_v, ref_a = reference_loop(fake_model_for(layout, ref_calls), start.video, start.audio, layout, steps,
                                  video_shift, audio_shift)
    out = denoise(fake_model_for(layout, our_calls), start, layout, Schedule(steps, video_shift, audio_shift),
                  on_step=lambda i, n: progress.append((i, n)))

    assert isinstance(out, Latents)
    assert len(our_calls) == len(ref_calls) == steps - 1
    for k, (ours, ref) in enumerate(zip(our_calls, ref_calls)):
        for a, b, name in zip(ours, ref, ("video", "audio", "unique_t", "t_index")):
            assert torch.equal(a, b), f"step {k}: model input {name} differs"
    assert torch.equal(out.video, ref_v), f"video max abs err {(out.video - ref_v).abs().max().item():.3g}"
    assert torch.equal(out.audio, ref_a), f"audio max abs err {(out.audio - ref_a).abs().max().item():.3g}"
    # condition rows ride through unchanged, bit for bit; the generated rows moved
    assert torch.equal(out.video[:cv], video0[:cv])
    assert torch.equal(out.audio[:ca], audio0[:ca])
    assert not torch.equal(out.video[cv:], video0[cv:])
    assert not torch.equal(out.audio[ca:], audio0[ca:])
    # the input state is not modified in place
    assert torch.equal(start.video, video0) and torch.equal(start.audio, audio0)
    assert progress == [(i + 1, steps - 1) for i in range(steps - 1)]


def test_denoise_batch_ends_where_each_request_would_alone():
    """The one denoise loop with a batch dimension: three requests of one layout (their own seeds' noise, stacked)
    each end on the diffusers loop's rows for that request alone, bit for bit (the stand-in model and the update are
    elementwise per request), and the model sees [B, V, C] / [B, A, C] once per step."""
    layout = pack_t2va(torch.ones(8, dtype=torch.long), 7, 4, 6, 20, PATCH)
    starts = [initial_latents(seed, 7, 4, 6, 20) for seed in (7, 8, 9)]
    calls = []
    outs = denoise_batch(fake_model_for(layout, calls), starts, layout, Schedule(5, 12.0, 3.0))
    assert len(calls) == 4 and calls[0][0].shape == (3, *starts[0].video.shape)
    for start, out in zip(starts, outs):
        ref_v, ref_a = reference_loop(fake_model_for(layout, []), start.video, start.audio, layout, 5)
        assert torch.equal(out.video, ref_v) and torch.equal(out.audio, ref_a)
    assert not torch.equal(outs[0].video, outs[1].video)  # each kept its own noise
