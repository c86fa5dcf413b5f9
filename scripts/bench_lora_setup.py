"""scripts/bench_lora.py's set-up: the shape (full width or tiny), one evaluation's inputs, random layers, the
precision's recipe and its calibrated copies, the attention kernels the build would bake, and the Diffusers reference
block (bench_lora.py's docstring says what each row measures)."""

from __future__ import annotations

import dataclasses

import torch

from bench_common import rel_err  # noqa: F401  (first: puts this checkout on sys.path)

from h3trt.build.attention_choice import AttentionShape, resolve_attention
from h3trt.models.config import NUM_MODALITIES, H3Config
from h3trt.models.precision import Precision

BF16 = torch.bfloat16


@dataclasses.dataclass
class Inputs:
    """One evaluation's tensors at the bench's shape: x [1, S, H] bf16, temb [T, E] fp32 and the layout's indices."""

    layout: object
    x: torch.Tensor
    temb: torch.Tensor
    unique_t: torch.Tensor
    t_index: torch.Tensor
    adaln_index: torch.Tensor
    pos: torch.Tensor
    rope: tuple[torch.Tensor, torch.Tensor]


def versions() -> dict:
    """The packages the rows depend on, as installed (None: absent)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("diffusers", "nvidia-modelopt", "fa3-fwd", "nvidia-cudnn-frontend", "triton"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def shape_of(tiny: bool):
    """(config, packed layout): H3 at full width over 37,838 rows, or the tiny config over 114 rows."""
    from bench_dit import AUDIO, LATENT_H, LATENT_T, LATENT_W, TEXT

    from h3trt.models.packing import pack_t2va, text_tags_for

    if tiny:
        return H3Config.tiny(), pack_t2va(text_tags_for(16), 3, 8, 12, 13)
    return H3Config(), pack_t2va(text_tags_for(TEXT), LATENT_T, LATENT_H, LATENT_W, AUDIO)


def make_inputs(cfg: H3Config, layout, dev: torch.device) -> Inputs:
    from h3trt.models.dit import rope_inv_freq, rope_tables
    from h3trt.models.packing import row_timesteps

    g = torch.Generator().manual_seed(0)
    layout = layout.to(dev)
    unique_t, t_index = (t.to(dev) for t in row_timesteps(layout, 0.25, 0.5))
    x = torch.randn(1, layout.seq_len, cfg.hidden_size, generator=g).to(dev, BF16)
    temb = torch.randn(unique_t.numel(), cfg.time_embed_dim, generator=g).to(dev)
    rope = rope_tables(layout.position_ids, rope_inv_freq(cfg).to(dev))
    return Inputs(layout, x, temb, unique_t, t_index, t_index * NUM_MODALITIES + layout.token_tags,
                  layout.position_ids, rope)


def random_blocks(cfg: H3Config, layers: int, dev: torch.device) -> list:
    """`layers` eager h3trt blocks, bf16, every weight N(0, 0.02), made on the device (a full-width block is 385M
    parameters)."""
    from h3trt.models.dit import Block

    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        with torch.device(dev):
            block = Block(cfg).to(BF16).eval()
        for p in block.parameters():
            torch.nn.init.normal_(p, std=0.02)
        blocks.append(block)
    return blocks


def reference(cfg: H3Config, block, inp: Inputs, dev: torch.device, timer) -> dict:
    """The eager reference block's ms: Diffusers' block with `block`'s weights loaded from it (bench_dit's mapping),
    or, where diffusers is not importable, `block` itself eager (the repo's block, bitwise the Diffusers one in
    bench_dit's runs)."""
    from h3trt.models.dit import sdpa_attention

    mod = block.modulation(inp.temb).contiguous()
    try:
        from diffusers.models.transformers.transformer_minimax_h3 import (MiniMaxH3RotaryPosEmbed,
                                                                          MiniMaxH3TransformerBlock)
    except ImportError as e:
        ms = timer(lambda: block(inp.x, mod, inp.adaln_index, inp.rope, sdpa_attention))
        return {"name": "h3trt_eager_block", "ms": ms,
                "why": f"diffusers is not importable here ({type(e).__name__}: {e}): the repo's eager block "
                       "(models/dit.py Block, SDPA) is the reference in its place"}
    from bench_dit import diffusers_block_to_native

    with torch.device(dev):
        ref = MiniMaxH3TransformerBlock(cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.ffn_dim,
                                        cfg.time_embed_dim, cfg.norm_eps, cfg.norm_eps).to(BF16).eval()
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.02)
    block.load_state_dict(diffusers_block_to_native(ref), strict=True)  # layer 0 gets the reference's weights
    mod = block.modulation(inp.temb).contiguous()
    rot = MiniMaxH3RotaryPosEmbed(cfg.rope_freq_dim, cfg.rope_theta).to(dev)(inp.pos)
    want = ref(inp.x, inp.temb, inp.adaln_index, rot)
    got = block(inp.x, mod, inp.adaln_index, inp.rope, sdpa_attention)
    ms = timer(lambda: ref(inp.x, inp.temb, inp.adaln_index, rot))
    return {"name": "diffusers_eager_block", "ms": ms, "h3trt_eager_rel_err_vs_diffusers": rel_err(got, want)}


def attention_kernels(args, cfg: H3Config, layout, dev: torch.device) -> dict:
    """The kernels the build would bake (build/attention_choice.py resolve_attention, `--attention` as given): the
    block-dtype attention's, and FP8 attention's where an fp8 row runs it."""
    shape = AttentionShape(layout.seq_len, cfg.num_heads, cfg.head_dim)
    choices = {"bf16": resolve_attention(args.attention, Precision.BF16, dev, shape)}
    if "fp8" in args.precision and args.fp8_attention:
        choices["fp8"] = resolve_attention(args.attention, Precision.FP8, dev, shape)
    return choices


def recipe_for(precision: str, args, kernels: dict):
    """None for bf16; fp8: the recipe of `h3trt build --precision fp8 [--fp8-attention] --fp8-accum fast`."""
    from h3trt.calibration.recipe import QuantRecipe

    if precision == "bf16":
        return None
    fp8_attention = args.fp8_attention
    return QuantRecipe("fp8", calib_steps=2, fp8_attention=fp8_attention, fp8_accum="fast",
                       attention_kernel=kernels["fp8"].kernel if fp8_attention else "")


def layer_blocks(blocks: list, cfg: H3Config, recipe, inp: Inputs) -> list:
    """The layers as the recipe serves them: the bf16 blocks, or copies quantized with scales from ModelOpt's max
    calibration on the layer's input (bench_fp8.quantized_copy: one input, a benchmark, not a recipe)."""
    if recipe is None:
        return blocks
    from bench_fp8 import quantized_copy

    with torch.no_grad():
        return [quantized_copy(b, cfg, recipe, inp.x, b.modulation(inp.temb).contiguous(), inp.adaln_index, inp.rope)
                for b in blocks]


def block_tensors(block) -> dict[str, torch.Tensor]:
    return {n: t.detach() for n, t in [*block.named_parameters(), *block.named_buffers()]}
