"""The example inputs of every segment a build compiles, made from the eager model: the compile traces them, and the
fresh-process check compares the compiled segments with the eager ones on them."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from ..adapters.slots import MIN_ROW_GROUPS, ROW_GROUP, row_groups, target_shape
from ..calibration.build import first_layer
from ..calibration.recipe import QuantRecipe
from ..calibration.vae_fp8 import load_video_vae_at
from ..engines.manifest import AdapterSlotsRecord
from ..models.config import NUM_MODALITIES, H3Config
from ..models.dit import H3DiT
from ..models.packing import Geometry, PackedLayout, pack_t2va, row_timesteps, text_tags_for
from ..models.vae_precision import VAEPrecision
from ..models.video_vae import decoder_prologue
from ..parallel.ulysses import padded_length
from .segments import SegmentSpec, dit_segments, video_decoder_segments

EXAMPLE_TEXT_ROWS = 37  # the text length the example inputs use; every dimension is dynamic anyway


def example_layout(cfg: H3Config, geometry: Geometry) -> PackedLayout:
    """The packed sequence of the examples at one profile: fl2va with a first keyframe, so condition rows are present
    (its length is also the attention shape `--attention auto` times kernels at)."""
    return pack_t2va(text_tags_for(EXAMPLE_TEXT_ROWS, [range(3, 9)]), geometry.latent_frames, geometry.latent_height,
                     geometry.latent_width, geometry.audio_latents, cfg.patch_size, ("first",))


@torch.no_grad()
def example_inputs(model: H3DiT, geometry: Geometry, device, sp: int = 1, recipe: QuantRecipe | None = None,
                   sparse: bool = False, slots: AdapterSlotsRecord | None = None) -> dict[str, list[torch.Tensor]]:
    """Inputs for every segment at one profile (fl2va with a first keyframe, so condition rows are present), from
    the eager model: the same tensors check the compiled segments. With sp > 1 the block halves get the first rank's
    rows of the padded sequence; at sp=1 with `sparse` (the halves beside the fused block) every row. With `slots`
    the block_lora twins get their block's inputs and random banks (lora_examples)."""
    cfg = model.cfg
    layout = example_layout(cfg, geometry).to(device)
    g = torch.Generator().manual_seed(0)
    video = torch.randn(1, layout.video_index.numel(), cfg.video_patch_dim, generator=g).to(device)
    audio = torch.randn(1, layout.audio_index.numel(), cfg.audio_in_channels, generator=g).to(device)
    text = torch.randn(1, EXAMPLE_TEXT_ROWS, cfg.text_dim, generator=g).to(device, model.dtype)
    unique_t, t_index = (t.to(device) for t in row_timesteps(layout, 0.25, 0.5))
    sd = model.state_dict()
    emb, *blocks, fin = dit_segments(cfg, model.dtype, sp, recipe, sparse=sparse,
                                     lora_targets=slots.targets if slots else None)
    x, temb = model.embed(video, audio, text, unique_t, layout.video_index, layout.audio_index, layout.text_index,
                          layout.seq_len)
    cos, sin = model.rope(layout.position_ids)
    adaln_index = t_index * NUM_MODALITIES + layout.token_tags
    mod = model.blocks[0].modulation(temb).contiguous()
    examples = {
        "embed": [video, audio, text, unique_t, layout.video_index, layout.audio_index, layout.text_index,
                  layout.token_tags] + [sd[n] for n in emb.weights],
        "final": [x, model.final_layer.modulation(temb).contiguous(), t_index, layout.video_index, layout.audio_index]
                 + [sd[f"final_layer.{n}"] for n in fin.weights],
    }
    if sp == 1:
        if not cfg.vsa_gate:  # a FastH3-VSA model has no fused block (build/segments.py dit_segments)
            examples["block"] = [x, mod, adaln_index, cos, sin]
        if sparse or cfg.vsa_gate:  # the halves around a sparse attention: the "exchange" of one rank is the identity
            attn = torch.randn(1, 1, layout.seq_len, cfg.num_heads, cfg.head_dim, generator=g).to(device, model.dtype)
            examples["block_pre"] = [x, mod, adaln_index, cos, sin]
            examples["block_post"] = [x, attn, mod, adaln_index]
    else:
        rows = padded_length(layout.seq_len, sp) // sp
        x, adaln_index, cos, sin = (F.pad(t, (0, 0) * (t.dim() - 1 - d) + (0, rows * sp - layout.seq_len))
                                    .narrow(d, 0, rows).contiguous() for t, d in
                                    ((x, 1), (adaln_index, 0), (cos, 0), (sin, 0)))
        attn = torch.randn(sp, 1, rows, cfg.num_heads // sp, cfg.head_dim, generator=g).to(device, model.dtype)
        examples["block_pre"] = [x, mod, adaln_index, cos, sin]
        examples["block_post"] = [x, attn, mod, adaln_index]
    if sp != 1 and recipe is not None and recipe.fp8_attention:
        # Sharded FP8 attention: every real row, a rank's heads (what the exchange hands it).
        examples["attention"] = [torch.randn(1, layout.seq_len, cfg.num_heads // sp, cfg.head_dim, generator=g)
                                 .to(device, model.dtype) for _ in range(3)]
    if "block_hp" in {spec.name for spec in blocks}:
        examples["block_hp"] = list(examples["block"])
    for spec in blocks:
        if spec.lora:
            continue
        i = first_layer(recipe, cfg.num_layers, spec.name) if spec.name in ("block", "block_hp") else 0
        examples[spec.name] += [sd[f"blocks.{i}.{n}"] for n in spec.weights]
    for spec in blocks:
        if spec.lora:
            examples[spec.name] = lora_examples(examples[spec.name.removesuffix("_lora")], spec, cfg, slots, g)
    return examples


def lora_examples(plain: list[torch.Tensor], spec: SegmentSpec, cfg: H3Config, slots: AdapterSlotsRecord,
                  g: torch.Generator) -> list[torch.Tensor]:
    """A block_lora twin's inputs from its plain block's: the same activations and weights, every row of every slot
    selected (padded to whole groups as `AdapterSlots.select` pads) at distinct scales per slot, and seeded banks whose
    side branch moves the output as much as a trained adapter might, so that the fresh-process check really compares
    it.

    The row groups G are as many as no other input has along any dimension: Inductor's standalone compile derives
    the graph's dimensions again from the example's values, one symbol per distinct value (build/backends.py), and
    a G equal to, say, the three parts of the fused QKV would be compiled as that constant."""
    x = plain[0]
    acts, weights = plain[: len(spec.inputs) - 2], plain[len(spec.inputs) - 2:]
    n, rank = slots.slots, slots.max_rank
    banks = []
    for name in spec.lora:
        local, part = name.rsplit(".", 1)
        n_in, n_out, parts = target_shape(cfg, local)
        shape = (n, parts, rank, n_in if part == "lora_down" else n_out // parts)
        fan_in = n_in if part == "lora_down" else rank
        banks.append((torch.randn(*shape, generator=g) / fan_in ** 0.5).to(x.device, x.dtype))
    taken = {size for t in (*plain, *banks) for size in t.shape}
    groups = max(MIN_ROW_GROUPS, -(-n * rank // ROW_GROUP))
    while groups in taken:
        groups += 1
    scales = torch.linspace(0.5, 0.25, n).repeat_interleave(rank).tolist()
    return [*acts, *row_groups(list(range(n * rank)), scales, x.device, groups), *weights, *banks]


def profile_decoder_specs(component_root: Path, profiles, device, precision: VAEPrecision, examples: dict) -> dict:
    """The video decoder segments (in, block, out) of every (window, tile) shape the profiles decode, at
    `precision`; fills `examples`."""
    video_vae = load_video_vae_at(component_root, device, precision)
    shapes = sorted({key for p in profiles for key in video_vae.tile_shapes(p.geometry.latent_frames,
                                                                             p.geometry.latent_height,
                                                                             p.geometry.latent_width)})
    specs, found = video_decoder_specs(video_vae, shapes)
    examples.update(found)
    return specs


def video_decoder_specs(video_vae, shapes) -> tuple[dict, dict]:
    """({name: SegmentSpec}, {name: example inputs}) of the in / block / out segments of each (window latents, tile h,
    tile w) in `shapes`, bound to `video_vae`'s tensors (block: layer 0's); the block's and out's example activations
    come from the eager `in` on a seeded latent."""
    vae = video_vae.vae
    tensors = {**dict(vae.named_parameters()), **dict(vae.named_buffers())}
    block = vae.decoder.transformer_blocks[0]
    block_tensors = {**dict(block.named_parameters()), **dict(block.named_buffers())}
    channels = vae.config.latent_channels
    specs, examples = {}, {}
    for t, h, w in shapes:
        seg_in, seg_block, seg_out = video_decoder_segments(vae, t, h, w)
        z = torch.randn(1, channels, t, h, w, generator=torch.Generator().manual_seed(0)).to(video_vae.device,
                                                                                             video_vae.dtype)
        with torch.no_grad():
            x, cos, sin = decoder_prologue(vae, z)
        examples[seg_in.name] = [z] + [tensors[n].detach() for n in seg_in.weights]
        examples[seg_block.name] = [x, cos, sin] + [block_tensors[n].detach() for n in seg_block.weights]
        examples[seg_out.name] = [x] + [tensors[n].detach() for n in seg_out.weights]
        specs.update({s.name: s for s in (seg_in, seg_block, seg_out)})
    return specs, examples
