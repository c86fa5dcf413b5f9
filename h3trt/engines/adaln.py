"""The AdaLN runners a bundle serves with: modulation tables gathered from the baked rows (`BakedAdaLN`) or computed
from the kept `adaln_proj` weights (`LiveAdaLN`, `--keep-adaln`). Baking itself is build-time
(h3trt/build/adaln.py); both runners share one interface: rows(unique_t), block(i, rows, temb), final_table(rows,
temb). Shapes: T distinct timesteps, U baked timesteps, H hidden size.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..models.config import H3Config
from .loaders import load_weights
from .manifest import Manifest


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


def load_adaln(root: Path, manifest: Manifest, cfg: H3Config, device: torch.device):
    """The bundle's AdaLN runner: its baked tables (kept on the CPU for the lookup, rows moved to `device`), or its
    kept modulation weights."""
    name = "adaln_tables" if manifest.adaln.baked else "adaln_weights"
    return adaln_runner(manifest, load_weights(Path(root) / "weights" / f"{name}.safetensors", device), cfg, device)


def adaln_runner(manifest: Manifest, tensors: dict[str, torch.Tensor], cfg: H3Config, device: torch.device):
    """The AdaLN runner from the bundle's adaln file, already loaded (on any device)."""
    if manifest.adaln.baked:
        return BakedAdaLN({**tensors, "timesteps": tensors["timesteps"].cpu()}, device)
    return LiveAdaLN(tensors, cfg.num_layers, cfg.hidden_size, device)
