"""The distilled families' schedules against the published sigma vectors (shared/docs/distilled_notes.md, the peers'
tests), h3trt's Euler step against FastVideo's MiniMaxH3Scheduler.step, and PDD's fused heads against the bank
averaged by hand."""

import pytest
import torch

from h3trt.errors import UserError
from h3trt.models.distilled.schedule import (FASTH3_V2_RUNGS, fasth3_schedule, pdd_boundaries, pdd_rungs,
                                             pdd_schedule, turbo_schedule)
from h3trt.models.distilled.pdd import StepHeads, fuse_heads, fused_step_heads, interval_grid, interval_plan
from h3trt.models.sampler import Schedule, euler_step, shifted_sigmas


def close(got, want, atol=5e-5):
    assert torch.allclose(got, torch.tensor(want, dtype=torch.float32), atol=atol), (got.tolist(), want)


def test_fasth3_v1_rungs_and_the_uniform_variant():
    s = fasth3_schedule().schedule
    # The rungs' vectors as exact fractions (a peer's test of the explicit DMD coordinates), and the notes' .99992.
    close(s.video_sigmas, [11988 / 11989, 8988 / 9239, 12 / 13, 0.8, 0.0], atol=1e-6)
    close(s.audio_sigmas, [2997 / 2998, 2247 / 2498, 0.75, 0.5, 0.0], atol=1e-6)
    assert abs(s.video_sigmas[0].item() - 0.99992) < 1e-5 and s.num_evaluations == 4
    u = fasth3_schedule(grid="uniform").schedule
    close(u.video_sigmas, [1, 0.97297, 0.92308, 0.8, 0])
    close(u.audio_sigmas, [1, 0.9, 0.75, 0.5, 0])
    assert torch.equal(u.video_sigmas, Schedule(5, 12.0, 3.0).video_sigmas)  # uniform: H3's own 5-point grid
    tv, ta = s.timesteps()[0]
    assert tv == float(1 - s.video_sigmas[0]) and ta == float(1 - s.audio_sigmas[0])  # t = 1 - sigma


def test_fasth3_v2_eight_rungs_at_shift_10():
    s = fasth3_schedule(FASTH3_V2_RUNGS, (10.0, 3.0)).schedule
    close(s.video_sigmas, [0.9999, 0.9858, 0.9676, 0.9432, 0.9091, 0.8571, 0.7692, 0.5882, 0.0])
    assert s.steps == 9 and s.num_evaluations == 8
    with pytest.raises(UserError, match="no substitute"):
        fasth3_schedule(FASTH3_V2_RUNGS, (10.0, 3.0), grid="uniform")


def test_turbo_shift_6():
    close(turbo_schedule(5, (6.0, 3.0)).schedule.video_sigmas, [1, 0.947, 0.857, 0.667, 0], atol=5e-4)


def test_pdd_grids():
    # 8 and 4 forwards are the plain shifted grids (linspace(1, 0, 33)[::L] == linspace(1, 0, N + 1) bit for bit).
    for forwards in (4, 8):
        assert pdd_rungs(forwards) is None
        fine = shifted_sigmas(33, 12.0)
        assert torch.equal(pdd_schedule(forwards).schedule.video_sigmas, fine[:: 32 // forwards])
    # 6 forwards: blocks (8, 8, 4, 4, 4, 4) -> boundaries 0, 8, 16, 20, 24, 28, 32 of 32.
    assert pdd_boundaries(6) == (0, 8, 16, 20, 24, 28, 32)
    six = pdd_schedule(6).schedule
    assert torch.equal(six.video_sigmas, shifted_sigmas(33, 12.0)[list(pdd_boundaries(6))])
    with pytest.raises(UserError, match="other counts give noise"):
        pdd_boundaries(5)


def fastvideo_step(sample, model_output, timestep, sigma, sigma_next):
    """FastVideo's MiniMaxH3Scheduler.step (scheduling_minimax_h3.py), its operations in its order."""
    sigma_from_timestep = 1 - timestep.to(dtype=sample.dtype)
    denoised = sample + sigma_from_timestep * model_output
    ratio = sigma_next / sigma
    return ratio * sample + (1.0 - ratio) * denoised


@pytest.mark.parametrize("schedule", [fasth3_schedule().schedule, pdd_schedule(6).schedule,
                                      turbo_schedule(9, (6.0, 3.0)).schedule, Schedule(50)])
def test_euler_step_is_fastvideos_bit_for_bit(schedule):
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(64, 96, generator=g), torch.randn(64, 96, generator=g)
    sigmas = schedule.video_sigmas
    for i, (tv, _) in enumerate(schedule.timesteps()):
        ours = euler_step(x, v, tv, sigmas[i], sigmas[i + 1])
        theirs = fastvideo_step(x, v, torch.tensor(tv, dtype=torch.float32), sigmas[i], sigmas[i + 1])
        assert torch.equal(ours, theirs)
        x = ours


def test_a_family_schedule_refuses_what_it_cannot_run():
    fasth3 = fasth3_schedule()
    assert fasth3.for_request(None, None, None, "fasth3") == fasth3.schedule
    with pytest.raises(UserError, match="runs 4 forwards \\(steps 5\\); the request asks for steps 9"):
        fasth3.for_request(9, None, None, "fasth3")
    with pytest.raises(UserError, match="distilled at shifts 12/3; the request asks for 5/3"):
        fasth3.for_request(None, 5.0, None, "fasth3")
    with pytest.raises(UserError, match="FILE@steps=N"):
        pdd_schedule(8).for_request(5, None, None, "pdd")
    turbo = turbo_schedule(5, (6.0, 3.0))
    assert turbo.for_request(9, 5.0, None, "turbo") == Schedule(9, 5.0, 3.0)  # a LoRA: any schedule


def test_pdd_plan_is_dt_weighted_on_each_modalitys_grid():
    for shift in (12.0, 3.0):
        grid = interval_grid(shift, 32)
        plan = interval_plan(shift, 32, (4,) * 8)
        dt = grid.diff()
        assert torch.allclose(plan.sum(1), torch.ones(8, dtype=torch.float64))
        assert torch.allclose(plan[1, 4:8], dt[4:8] / dt[4:8].sum()) and plan[1, :4].abs().sum() == 0
        # the block's start and end are the plain 9-point grid's
        assert torch.allclose(grid[::4].float(), 1 - shifted_sigmas(9, shift), atol=1e-7)


def test_pdd_fused_heads_against_the_bank_averaged_by_hand():
    g = torch.Generator().manual_seed(1)
    bank_w = torch.randn(32, 6, 5, generator=g).to(torch.bfloat16)
    bank_b = torch.randn(32, 6, generator=g).to(torch.bfloat16)
    w, b = fuse_heads(bank_w, bank_b, interval_plan(12.0, 32, (8, 8, 4, 4, 4, 4)))
    dt = interval_grid(12.0, 32).diff()
    start = 20  # forward 3 covers intervals [20, 24)
    hand_w = sum(dt[k] * bank_w[k].double() for k in range(start, start + 4)) / dt[start:start + 4].sum()
    hand_b = sum(dt[k] * bank_b[k].double() for k in range(start, start + 4)) / dt[start:start + 4].sum()
    assert w.dtype == torch.float32 and w.shape == (6, 6, 5)
    assert torch.allclose(w[3].double(), hand_w, atol=1e-6) and torch.allclose(b[3].double(), hand_b, atol=1e-6)
    # a forward covering one interval is that interval's head, exactly
    w1, b1 = fuse_heads(bank_w, bank_b, interval_plan(3.0, 32, (1,) * 32))
    assert torch.equal(w1, bank_w.float()) and torch.equal(b1, bank_b.float())


def test_step_heads_pick_each_forwards_head_by_its_video_timestep():
    from h3trt.models.packing import pack_t2va, row_timesteps, text_tags_for

    g = torch.Generator().manual_seed(2)
    bank = {h: (torch.randn(32, o, 8, generator=g), torch.randn(32, o, generator=g))
            for h, o in (("video_out", 4), ("audio_out", 3))}
    schedule = pdd_schedule(8).schedule
    heads = fused_step_heads(bank, (12.0, 3.0), (4,) * 8)
    steps = StepHeads(torch.tensor([tv for tv, _ in schedule.timesteps()]), heads)
    layout = pack_t2va(text_tags_for(5, []), 2, 2, 2, 3, keyframes=("first",))
    for f, (tv, ta) in enumerate(schedule.timesteps()):
        unique_t, t_index = row_timesteps(layout, tv, ta)
        chosen = steps.select(steps.index(unique_t, t_index, layout.video_index))
        assert torch.equal(chosen["video_out.weight"], heads["video_out.weight"][f])
        assert torch.equal(chosen["audio_out.bias"], heads["audio_out.bias"][f])
    unique_t, t_index = row_timesteps(layout, 0.123, 0.2)
    with pytest.raises(RuntimeError, match="none of the schedule's forwards"):
        steps.index(unique_t, t_index, layout.video_index)
