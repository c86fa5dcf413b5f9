"""AdaLN baking: every block's modulation rows for every timestep a schedule can present, computed at build time.

The modulation network (`adaln_proj`, 13B parameters, 24 GB in bf16 at full size) depends only on the timestep, so
a bundle built for one schedule (steps, video shift, audio shift) stores the rows it will ever read and leaves those
weights out. The timesteps a request can present at step i: the video t, the audio t, condition rows at
max(t_video, 0.999) and reference audio at 1.0.
"""

from __future__ import annotations

import torch

from ..models.dit import H3DiT
from ..models.packing import CONDITION_AUDIO_T, CONDITION_VIDEO_T
from ..models.sampler import Schedule


def schedule_timesteps(schedule: Schedule) -> torch.Tensor:
    """Every timestep value (float32, sorted, distinct) a request on `schedule` evaluates the DiT at."""
    values = {CONDITION_AUDIO_T}
    for tv, ta in schedule.timesteps():
        values |= {tv, ta, max(tv, CONDITION_VIDEO_T)}
    return torch.tensor(sorted(values), dtype=torch.float32).unique()


@torch.no_grad()
def bake_tables(model: H3DiT, values: torch.Tensor) -> dict[str, torch.Tensor]:
    """{"timesteps": [U], "blocks.i": [U, 3, 6, H], "final": [U, 2, H]} in the block dtype."""
    device = model.condition_proj.weight.device
    temb = model.time_embedder(values.to(device))
    U, H = values.numel(), model.cfg.hidden_size
    tables = {"timesteps": values.clone()}
    for i, block in enumerate(model.blocks):
        tables[f"blocks.{i}"] = block.modulation(temb).reshape(U, 3, 6, H).contiguous().cpu()
    tables["final"] = model.final_layer.modulation(temb).reshape(U, 2, H).contiguous().cpu()
    return tables


class BakedAdaLN:
    """Modulation tables for a request's distinct timesteps, gathered from the baked rows."""

    def __init__(self, tables: dict[str, torch.Tensor], device: torch.device):
        self.values = tables["timesteps"].to(torch.float32)
        n = len([k for k in tables if k.startswith("blocks.")])
        self.blocks = [tables[f"blocks.{i}"].to(device) for i in range(n)]
        self.final = tables["final"].to(device)
        self.device = device

    def rows(self, unique_t: torch.Tensor) -> torch.Tensor:
        t = unique_t.detach().float().cpu()
        idx = torch.searchsorted(self.values, t).clamp(max=self.values.numel() - 1)
        missing = t[self.values[idx] != t]
        if missing.numel():
            raise ValueError(f"timesteps {missing.tolist()} are not in this bundle's baked AdaLN tables; the request's "
                             "schedule differs from the one the bundle was built for.")
        return idx.to(self.device)

    def block(self, i: int, rows: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        table = self.blocks[i].index_select(0, rows)  # [T, 3, 6, H]
        return table.reshape(-1, *table.shape[2:])  # [3T, 6, H]

    def final_table(self, rows: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        return self.final.index_select(0, rows)


class LiveAdaLN:
    """`--keep-adaln`: the modulation projections themselves, evaluated per step (any schedule)."""

    def __init__(self, weights: dict[str, torch.Tensor], num_layers: int, hidden: int, device: torch.device):
        self.blocks = [(weights[f"blocks.{i}.weight"].to(device), weights[f"blocks.{i}.bias"].to(device))
                       for i in range(num_layers)]
        self.final = (weights["final.weight"].to(device), weights["final.bias"].to(device))
        self.hidden = hidden

    def rows(self, unique_t: torch.Tensor) -> None:
        return None

    @staticmethod
    def _project(temb: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        # SiLU at temb's precision, then the projection's dtype: the same order as the eager AdaLNProj.
        return torch.nn.functional.linear(torch.nn.functional.silu(temb).to(weight.dtype), weight, bias)

    def block(self, i: int, rows, temb: torch.Tensor) -> torch.Tensor:
        return self._project(temb, *self.blocks[i]).view(-1, 6, self.hidden)

    def final_table(self, rows, temb: torch.Tensor) -> torch.Tensor:
        return self._project(temb, *self.final).view(-1, 2, self.hidden)
