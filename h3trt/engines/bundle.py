"""Loading a bundle: checks, the shipped compiled code, weights, and the DiT runner built from the segments.

`EngineDiT` has the eager runner's signature, so the pipeline never knows which backend compiled what.
"""

from __future__ import annotations

from pathlib import Path

import torch

# Imported to register h3trt::attention and h3trt::fp8_sdpa, which compiled blocks call by name.
from ..calibration.fp8_attention import check_attention_kernel
from ..models.attention import bound_attention, check_attention_record, dense_kernel
from ..models.config import NUM_MODALITIES, H3Config
from ..models.dit import rope_inv_freq, rope_tables
from ..models.packing import PackedLayout
from ..models.step_cache import run_blocks
from ..parallel.ulysses import RowShard, UlyssesExchange
from .adaln import load_adaln
from .loaders import LoadedSegment, load_segments, load_weights
from .manifest import BundleError, check_environment, read_manifest, verify_files
from .signing import read_trusted_manifest
from .tensorrt_runtime import load_trt_engine
from .video_decoder import TileDecoder, parse_video_decoder_name


class EngineDiT:
    """The DiT forward from compiled segments: embed, the block segment(s) once per layer, final. With an sp group
    the block is the two halves around the Ulysses exchange, on this rank's rows."""

    def __init__(self, cfg: H3Config, segments: dict[str, LoadedSegment], entries: dict, weights: dict, adaln,
                 device, group=None, layer_segments: list[str] | None = None, attention_kernel: str | None = None):
        self.cfg, self.segments, self.adaln, self.device, self.group = cfg, segments, adaln, device, group
        self.embed_w = [weights["embed"][n] for n in entries["embed"]["weights"]]
        block_segments = ("block",) if "block" in entries else ("block_pre", "block_post")
        # A quantized bundle may keep some layers in bf16: those run the "block_hp" segment with its own weight names.
        self.layer_segments = layer_segments or ["block"] * cfg.num_layers
        serving = {"block": self.layer_segments}
        self.block_w = {name: [[weights["blocks"][f"blocks.{i}.{n}"]
                                for n in entries[serving.get(name, [name] * cfg.num_layers)[i]]["weights"]]
                               for i in range(cfg.num_layers)] for name in block_segments}
        self.final_w = [weights["final"][n] for n in entries["final"]["weights"]]
        self.inv_freq = rope_inv_freq(cfg).to(device)
        # Sharded attention, between the halves (at sp=1 it is inside the compiled block): the bundle's kernel
        # (`attention_kernel`; None: a bundle from before kernels were recorded, bf16 SDPA), or FP8 attention as its
        # own compiled segment bound to each layer's calibrated q/k/v scales.
        dense = bound_attention(attention_kernel) if attention_kernel is not None else None
        self.sharded_attention = [dense] * cfg.num_layers
        if "attention" in entries:
            self.sharded_attention = [self._bound_attention([weights["blocks"][f"blocks.{i}.{n}"]
                                                             for n in entries["attention"]["weights"]])
                                      for i in range(cfg.num_layers)]

    def __call__(self, video, audio, text, unique_t, t_index, layout: PackedLayout, cache=None):
        if unique_t.numel() == 1:
            # Compiled for T >= 2 distinct timesteps; a duplicate row is never indexed, so outputs are unchanged.
            unique_t = unique_t.repeat(2)
        x, temb = self.segments["embed"](video, audio, text, unique_t, layout.video_index, layout.audio_index,
                                         layout.text_index, layout.token_tags, *self.embed_w)
        rows = self.adaln.rows(unique_t)
        adaln_index = t_index * NUM_MODALITIES + layout.token_tags
        cos, sin = rope_tables(layout.position_ids, self.inv_freq)
        if self.group is None:
            def block_fn(i, x):
                blk = self.segments[self.layer_segments[i]]
                return blk(x, self.adaln.block(i, rows, temb).contiguous(), adaln_index, cos, sin,
                           *self.block_w["block"][i])[0]

            x = run_blocks(x, self.cfg.num_layers, block_fn, cache)
        else:
            x = self._sharded_blocks(x, rows, temb, adaln_index, cos, sin, layout.seq_len, cache)
        return self.segments["final"](x, self.adaln.final_table(rows, temb).contiguous(), t_index, layout.video_index,
                                      layout.audio_index, *self.final_w)

    def _bound_attention(self, scales: list[torch.Tensor]):
        segment = self.segments["attention"]
        return lambda q, k, v: segment(q, k, v, *scales)[0]

    def _sharded_blocks(self, x, rows, temb, adaln_index, cos, sin, seq_len, cache=None):
        """The block stack on this rank's rows: pre half (compiled), exchange + SDPA (eager), post half (compiled)."""
        shard = RowShard(self.group, seq_len)
        exchange = UlyssesExchange(self.group, seq_len, shard.padded)
        pre, post = self.segments["block_pre"], self.segments["block_post"]
        x = shard.local(x, 1)
        adaln_index, cos, sin = shard.local(adaln_index, 0), shard.local(cos, 0), shard.local(sin, 0)

        def block_fn(i, x):
            mod = self.adaln.block(i, rows, temb).contiguous()
            (qkv,) = pre(x, mod, adaln_index, cos, sin, *self.block_w["block_pre"][i])
            attn = exchange(qkv, self.sharded_attention[i])
            return post(x, attn, mod, adaln_index, *self.block_w["block_post"][i])[0]

        return shard.gather(run_blocks(x, self.cfg.num_layers, block_fn, cache, self.group, shard.live_rows))


class Engine:
    """A loaded bundle."""

    def __init__(self, root: Path, manifest: dict, dit: EngineDiT, segments: dict[str, LoadedSegment]):
        self.root, self.manifest, self.dit, self.segments = Path(root), manifest, dit, segments

    def video_decoders(self, vae) -> dict[tuple[int, int, int], TileDecoder]:
        """The compiled tile decoders, by (window latents, tile h, tile w), bound to `vae`'s tensors (the VAE loaded
        at the bundle's --vae-precision: its weights are the compiled segments' inputs)."""
        parts: dict[tuple[int, int, int], dict[str, str]] = {}
        for name in self.manifest["segments"]:
            parsed = parse_video_decoder_name(name)
            if parsed is not None:
                parts.setdefault(parsed[1], {})[parsed[0]] = name
        cuda_graph = self.manifest["video_decoder"]["cuda_graph"]
        return {key: TileDecoder({p: self.segments[n] for p, n in names.items()},
                                 {p: self.manifest["segments"][n] for p, n in names.items()}, vae, cuda_graph)
                for key, names in parts.items()}

    @classmethod
    def load(cls, root: Path, device: str | torch.device, mesh=None, sp_group=None, trust=None) -> "Engine":
        """Load a bundle for one rank: `mesh` is the launched MeshConfig (None: one process), `sp_group` this
        rank's sequence-parallel group when the bundle's sp > 1. With `trust` (an Ed25519 public key file) the
        manifest must carry that key's signature; every file is checked against it before any code loads."""
        root = Path(root)
        device = torch.device(device)
        manifest = read_trusted_manifest(root, trust) if trust is not None else read_manifest(root)
        if manifest["backend"] == "tensorrt":  # plans: their own GPU check, runner and loader
            return load_trt_engine(cls, root, manifest, device, mesh)
        check_environment(manifest, device, mesh)
        quant = manifest.get("quant") or {}
        attention = manifest.get("attention")  # absent: a bundle from before kernels were recorded (bf16 SDPA)
        try:
            if attention is not None:
                check_attention_record(attention, device)
            elif quant.get("fp8_attention"):
                check_attention_kernel(quant["attention_kernel"], device)
        except (ValueError, RuntimeError) as e:
            raise BundleError(f"{root}: {e}") from e
        problems = verify_files(root, manifest)
        if problems:
            listed = "; ".join(problems[:10]) + (f"; and {len(problems) - 10} more" if len(problems) > 10 else "")
            raise BundleError(f"{root} does not match its manifest: {listed}. Re-copy the bundle or rebuild it.")
        cfg = H3Config.from_dict(manifest["model_config"])
        segments = load_segments(root, manifest["backend"], manifest["segments"], device)
        weights = {name: load_weights(root / "weights" / f"{name}.safetensors", device)
                   for name in ("embed", "blocks", "final")}
        adaln = load_adaln(root, manifest, cfg, device)
        dit = EngineDiT(cfg, segments, manifest["segments"], weights, adaln, device,
                        sp_group if manifest["mesh"]["sp"] > 1 else None,
                        quant.get("layer_segments"), dense_kernel(attention) if attention else None)
        return cls(root, manifest, dit, segments)
