"""The DiT's main blocks brought onto the build device one at a time, for a build that streams them
(h3trt/build/stream.py; build/memory.py decides when).

Each block is read from the checkpoint when it is asked for (models/checkpoint/stream.py: pread of its tensors'
bytes, nothing else of the model), copied to the device, converted there to the native layout and the build dtype,
its --lora files merged (adapters/merge.py LoraMerge: the fp32 sums of merge_loras) and assigned into a fresh Block,
then the --distilled file's patches of that block fused into it (models/distilled/merge.py fuse_into, filtered to the
block; a parameter the checkpoint lacks and the file assigns whole, a FastH3-VSA file's `attn.to_gate_compress`, is
made there by the fusion's assign): the tensors `load_dit`, `merge_loras` and `merge_distilled` would have given it.
While the caller works on one block, a thread reads the next one's bytes into the other of two host slots, pinned on
CUDA so that the copy to the GPU is a DMA at full speed.
The host footprint is those two slots (2 x 1.3 GB at full size), whatever the number of layers.

The loader is also the accountant of what it materialized: a weak reference to every block it made, and the most
that were alive at once (`peak_alive`), which the tests assert on (a phase that kept every block would fail them).
"""

from __future__ import annotations

import queue
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..adapters.merge import LoraMerge
from ..models.checkpoint.stream import CheckpointTensors, NativeTensor
from ..models.config import H3Config
from ..models.distilled.files import Fusion
from ..models.distilled.merge import fuse_into
from ..models.dit import Block, parameter_dtype

READ_THREADS = 4  # preads of one block in flight (tmpfs and the page cache serve them in parallel)
SLOTS = 2  # host buffers: the block being copied to the device, and the next one being read


class BlockLoader:
    """Blocks of one checkpoint, materialized on `device` at `dtype` on demand; `close` when done. `fusion`: a
    --distilled file's patches (checked against the model by the caller), each block's fused as it arrives."""

    def __init__(self, tensors: CheckpointTensors, cfg: H3Config, dtype: torch.dtype, device: torch.device,
                 merge: LoraMerge | None, fusion: Fusion | None = None):
        self.tensors, self.cfg, self.dtype, self.device, self.merge = tensors, cfg, dtype, device, merge
        self.fusion = fusion
        with torch.device("meta"):
            self.shapes = {n: p.shape for n, p in Block(cfg).state_dict().items()}
        # What the checkpoint holds of each block; the rest (a FastH3-VSA file's gates) the fusion assigns
        self.parts: list[list[NativeTensor]] = [[tensors.tensors[f"blocks.{i}.{n}"] for n in self.shapes
                                                 if f"blocks.{i}.{n}" in tensors.tensors]
                                                for i in range(cfg.num_layers)]
        self.slot_bytes = max(tensors.nbytes(p) for p in self.parts)
        self._slots: list[torch.Tensor | None] = [None] * SLOTS
        self._free: queue.Queue = queue.Queue()
        for k in range(SLOTS):
            self._free.put((k, None))  # (slot, the CUDA event its last copy to the device recorded)
        self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="h3trt-block-read")
        self._readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="h3trt-pread")
        self._pending: dict[int, Future] = {}
        self._made: list[weakref.ref] = []
        self.loads = 0
        self.peak_alive = 0  # the most blocks made here and not yet freed, at any load

    def prefetch(self, index: int) -> None:
        """Start reading block `index`'s bytes into a free host slot (no-op past the last block)."""
        if 0 <= index < self.cfg.num_layers and index not in self._pending:
            self._pending[index] = self._prefetcher.submit(self._read, index)

    def _read(self, index: int):
        slot, copied = self._free.get()
        if copied is not None:
            copied.synchronize()  # the slot's last copy to the device has finished reading it
        if self._slots[slot] is None:
            self._slots[slot] = torch.empty(self.slot_bytes, dtype=torch.uint8,
                                            pin_memory=self.device.type == "cuda")
        try:
            return slot, self.tensors.read(self.parts[index], self._slots[slot], self._readers)
        except BaseException:
            self._free.put((slot, None))
            raise

    @torch.no_grad()
    def load(self, index: int) -> Block:
        """Block `index` on the device, at the build dtype, its LoRAs merged; the next block's read is started."""
        self.prefetch(index)
        slot, views = self._pending.pop(index).result()
        cuda = self.device.type == "cuda"
        prefix = f"blocks.{index}."
        state = {}
        try:
            for t in self.parts[index]:
                state[t.name.removeprefix(prefix)] = _materialize(self.tensors, t, views[t.name], self.dtype,
                                                                  self.device, self.merge, cuda)
        finally:
            event = None
            if cuda:
                event = torch.cuda.Event()
                event.record()
            self._free.put((slot, event))
        self.prefetch(index + 1)
        state.update(assigned_places(self.shapes, state, prefix, self.fusion, self.dtype, self.device))
        with torch.device("meta"):
            block = Block(self.cfg)
        block.load_state_dict(state, strict=True, assign=True)
        block.eval().requires_grad_(False)
        if self.fusion is not None:  # after the LoRAs, in fp32, as merge_distilled fuses the whole model
            fuse_into(self.fusion, {prefix + n: p for n, p in block.named_parameters()},
                      lambda name: name.startswith(prefix))
        self._account(block)
        return block

    def _account(self, block: Block) -> None:
        self._made = [r for r in self._made if r() is not None] + [weakref.ref(block)]
        self.loads += 1
        self.peak_alive = max(self.peak_alive, len(self._made))

    def alive(self) -> int:
        """Blocks made here that are still alive (referenced somewhere)."""
        return sum(r() is not None for r in self._made)

    def close(self) -> None:
        for future in self._pending.values():
            future.cancel()
        self._prefetcher.shutdown(wait=True)
        self._readers.shutdown(wait=True)
        self._pending.clear()
        self._slots = [None] * SLOTS


def load_resident(tensors: CheckpointTensors, model, dtype: torch.dtype, device: torch.device,
                  merge: LoraMerge | None, fusion: Fusion | None = None) -> None:
    """Every tensor of `model` (an H3DiT on the meta device) outside its main blocks, read, converted and assigned on
    `device` (LoRAs merged, then `fusion`'s patches of them fused): what stays on the device for the whole build.
    The blocks stay on meta."""
    shapes = {n: p.shape for n, p in model.state_dict().items() if not n.startswith("blocks.")}
    wanted = [tensors.tensors[n] for n in shapes if n in tensors.tensors]
    buffer = torch.empty(tensors.nbytes(wanted), dtype=torch.uint8)
    with ThreadPoolExecutor(READ_THREADS) as pool:
        views = tensors.read(wanted, buffer, pool)
    state = {}
    for t in wanted:
        state[t.name] = _materialize(tensors, t, views[t.name], dtype, device, merge)
    state.update(assigned_places(shapes, state, "", fusion, dtype, device))
    model.load_state_dict(state, strict=False, assign=True)
    if fusion is not None:  # proj_in/out, the embedders, norm_out, the refiner: FastH3's, Turbo's model-level ones
        fuse_into(fusion, dict(model.named_parameters()), lambda name: not name.startswith("blocks."))


def _materialize(tensors: CheckpointTensors, t: NativeTensor, views: list[torch.Tensor], dtype: torch.dtype,
                 device: torch.device, merge: LoraMerge | None, non_blocking: bool = False) -> torch.Tensor:
    """`t` on `device` from its read bytes, in the native layout at its build dtype, LoRAs merged. The bytes are
    copied into buffers of its own (not `.to(device)`: on the CPU that is the host slot itself, reused for the next
    block)."""
    parts = [torch.empty(v.numel(), dtype=torch.uint8, device=device).copy_(v, non_blocking=non_blocking)
             for v in views]
    value = tensors.convert(t, parts, parameter_dtype(t.name, dtype))
    return merge.merged(t.name, value) if merge is not None and t.name in merge.targets else value


def assigned_places(shapes: dict[str, torch.Size], state: dict[str, torch.Tensor], prefix: str, fusion: Fusion | None,
                    dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """The parameters of `shapes` (names under `prefix`) the checkpoint lacks, which `fusion` assigns whole (a
    FastH3-VSA file's gates, `.set_weight`): each an empty tensor at its place, whose values fuse_into's assign then
    writes, as checkpoint.load_dit takes them from the file (the caller checked that the fusion assigns every one)."""
    assigned = fusion.assigned() if fusion is not None else {}
    places = {}
    for name, shape in shapes.items():
        if name not in state:
            if prefix + name not in assigned:
                raise ValueError(f"{prefix}{name} is neither in the checkpoint nor assigned by the --distilled file")
            places[name] = torch.empty(shape, dtype=parameter_dtype(prefix + name, dtype), device=device)
    return places
