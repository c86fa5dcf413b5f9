"""How many adapters the slots hold at once (one evaluation carries at most that many) and their max rank
(`SlotShape`): from the flags (`h3trt serve --lora-slots / --lora-max-rank`, a bundle's manifest), else fitted to the
adapters at start."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UserError
from .slots import BLOCK_TARGETS

# `h3trt serve --lora-dir`'s slots when the flags leave them out: room to load adapters while it runs (the set may
# change), at least as many and as large as the adapters it starts with.
SERVE_SLOTS, SERVE_MAX_RANK = 4, 64


@dataclass(frozen=True)
class SlotShape:
    """LoRA slots: how many adapters they hold at once (one evaluation carries at most that many) and their max rank
    (an adapter of a larger rank is refused)."""

    num_slots: int
    max_rank: int
    targets: tuple[str, ...] = BLOCK_TARGETS  # the block linears they adapt (a bundle's: its manifest's)

    def __post_init__(self):
        if self.num_slots < 1 or self.max_rank < 1:
            raise UserError(f"--lora-slots {self.num_slots} / --lora-max-rank {self.max_rank}: both must be >= 1.")

    @classmethod
    def fitted(cls, ranks: list[int], num_slots: int | None = None, max_rank: int | None = None,
               room: bool = False, targets: tuple[str, ...] = BLOCK_TARGETS) -> "SlotShape":
        """The flags' values, else slots for the adapters at start (their `ranks`): exactly them, or with `room`
        (a set that may change while it serves) at least SERVE_SLOTS of rank SERVE_MAX_RANK."""
        floor_slots, floor_rank = (SERVE_SLOTS, SERVE_MAX_RANK) if room else (1, 1)
        return cls(num_slots or max(floor_slots, len(ranks)), max_rank or max([floor_rank, *ranks]), tuple(targets))
