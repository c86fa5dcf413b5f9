"""The device mesh: one object owns the parallel degrees, validates them once, and builds the mesh.

Axes, outermost to innermost: replica (independent requests), cfg (guidance branches), sp (Ulysses sequence
parallel). Ulysses is innermost because its two all-to-alls per block need the fastest links; replicas only meet at
start-up. Groups are passed explicitly to whatever needs them; there is no module-level mesh.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from ..errors import UserError

AXES = ("replica", "cfg", "sp")


def valid_sp(num_heads: int) -> list[int]:
    """Sequence-parallel degrees that split the heads evenly (56 heads: 1, 2, 4, 7, 8, 14, 28, 56)."""
    return [d for d in range(1, num_heads + 1) if num_heads % d == 0]


@dataclass(frozen=True)
class MeshConfig:
    """Parallel degrees of one job."""

    replica: int = 1  # independent request groups
    cfg: int = 1  # guidance branches (H3 is guidance-distilled: 1 unless guidance > 1)
    sp: int = 1  # Ulysses sequence-parallel degree: ranks sharing one sequence

    def __post_init__(self):
        for axis in AXES:
            if getattr(self, axis) < 1:
                flag = "--replicas" if axis == "replica" else f"--{axis}"
                raise UserError(f"Mesh degree {axis} must be >= 1, got {getattr(self, axis)}; pass {flag} 1 or more.")
        if self.cfg not in (1, 2):
            raise UserError(f"cfg parallelism splits the two guidance branches: --cfg must be 1 or 2, got {self.cfg}.")

    @property
    def world_size(self) -> int:
        return self.replica * self.cfg * self.sp

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.replica, self.cfg, self.sp

    def validate(self, world_size: int, num_heads: int) -> None:
        """Raise, with the arithmetic, unless the degrees fill the world and sp splits the heads."""
        if self.world_size != world_size:
            raise UserError(f"Invalid mesh: replica({self.replica}) * cfg({self.cfg}) * sp({self.sp}) = "
                            f"{self.world_size} != world size ({world_size}). Launch {self.world_size} ranks or "
                            "change the degrees.")
        if num_heads % self.sp:
            raise UserError(f"Invalid mesh: sp={self.sp} does not divide the {num_heads} attention heads "
                            f"({num_heads} % {self.sp} = {num_heads % self.sp}); valid sp: {valid_sp(num_heads)}.")


@dataclass(frozen=True)
class Parallel:
    """This rank's place in the mesh and the groups it talks to (None where that degree is 1)."""

    config: MeshConfig
    replica_index: int = 0  # which replica group this rank belongs to
    sp_group: object = None  # ranks sharing one sequence (Ulysses)
    cfg_group: object = None  # the 2 ranks (same replica, same sp rank) holding the two guidance branches
    group_rank: int = 0  # rank within the replica group (cfg-major): 0 writes the group's files
    decode_group: object = None  # every rank of this replica group: they share the VAE decode, rank 0 writes

    @property
    def writes(self) -> bool:
        """Only each replica group's first rank writes files."""
        return self.group_rank == 0


SINGLE = Parallel(MeshConfig())


def resolve_mesh(world: int, num_heads: int, built=None, cfg: int | None = None,
                 sp: int | None = None, replicas: int | None = None) -> MeshConfig:
    """The launched mesh: explicit degrees (None: not given), else a bundle's (`built`: its manifest's mesh, with .cfg
    and .sp), else sp takes the ranks cfg and replicas leave; validated with the arithmetic before any process
    starts."""
    cfg = cfg or (built.cfg if built is not None else 1)
    sp = sp or (built.sp if built is not None else None) or max(1, world // (cfg * (replicas or 1)))
    replicas = replicas or max(1, world // (cfg * sp))
    mesh = MeshConfig(replicas, cfg, sp)
    mesh.validate(world, num_heads)
    return mesh


def build_mesh(config: MeshConfig, device_type: str, world_size: int, num_heads: int) -> Parallel:
    """`init_device_mesh` with axes (replica, cfg, sp), validated first (before any collective), and this rank's
    groups. Every rank must call it (creating the sub-groups is collective)."""
    config.validate(world_size, num_heads)
    mesh = init_device_mesh(device_type, config.shape, mesh_dim_names=AXES)
    replica, cfg, sp = mesh.get_coordinate()
    size = config.cfg * config.sp  # ranks per replica group: global ranks [replica * size, (replica + 1) * size)
    decode_group = None
    if size > 1:
        for r in range(config.replica):  # new_group is collective: every rank creates every group, in order
            group = dist.new_group(list(range(r * size, (r + 1) * size)))
            decode_group = group if r == replica else decode_group
    return Parallel(config, replica, mesh.get_group("sp") if config.sp > 1 else None,
                    mesh.get_group("cfg") if config.cfg > 1 else None, cfg * config.sp + sp, decode_group)
