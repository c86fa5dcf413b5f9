"""AdaLN baking: every block's modulation rows for every timestep a schedule can present, computed at build time.

The modulation network (`adaln_proj`, 13B parameters, 24 GB in bf16 at full size) depends only on the timestep, so
a bundle built for its schedules (each: steps, video shift, audio shift) stores the rows it will ever read and leaves
those weights out. The timesteps a request can present at step i: the video t, the audio t, condition rows at
max(t_video, 0.999) and reference audio at 1.0.
"""

from __future__ import annotations

import torch

from ..models.dit import Block, H3DiT
from ..models.packing import CONDITION_AUDIO_T, CONDITION_VIDEO_T
from ..models.sampler import Schedule


def schedule_timesteps(*schedules: Schedule) -> torch.Tensor:
    """Every timestep value (float32, sorted, distinct) a request on any of `schedules` evaluates the DiT at: one
    table serves them all (`h3trt build --steps 50,8`), a timestep two schedules share baked once."""
    values = {CONDITION_AUDIO_T}
    for schedule in schedules:
        for tv, ta in schedule.timesteps():
            values |= {tv, ta, max(tv, CONDITION_VIDEO_T)}
    return torch.tensor(sorted(values), dtype=torch.float32).unique()


@torch.no_grad()
def bake_tables(model: H3DiT, values: torch.Tensor) -> dict[str, torch.Tensor]:
    """{"timesteps": [U], "blocks.i": [U, 3, 6, H], "final": [U, 2, H]} in the block dtype."""
    temb = time_embedding(model, values)
    tables = {"timesteps": values.clone()}
    for i, block in enumerate(model.blocks):
        tables[f"blocks.{i}"] = block_table(block, temb)
    tables["final"] = final_table(model, temb)
    return tables


def time_embedding(model: H3DiT, values: torch.Tensor) -> torch.Tensor:
    """temb [U, E] fp32 of the baked timesteps, on the model's device."""
    return model.time_embedder(values.to(model.condition_proj.weight.device))


def block_table(block: Block, temb_UE: torch.Tensor) -> torch.Tensor:
    """One block's baked rows [U, 3, 6, H] on the host (a streamed build bakes each block as it passes)."""
    return block.modulation(temb_UE).reshape(temb_UE.shape[0], 3, 6, block.hidden_size).contiguous().cpu()


def final_table(model: H3DiT, temb_UE: torch.Tensor) -> torch.Tensor:
    return model.final_layer.modulation(temb_UE).reshape(temb_UE.shape[0], 2, model.cfg.hidden_size).contiguous().cpu()
