"""The DiT cut into the segments the engine compiles: pure tensor functions whose weights are trailing inputs.

Weights as inputs is what lets ONE compiled block serve all 50 layers (build time is that of one block) and lets the
bundle keep weights in plain safetensors beside the compiled code. Every segment declares its inputs by name and the
dimensions that vary between requests, so backends can compile it once for every sequence length.

  embed(video, audio, text, timesteps, video_index, audio_index, text_index, token_tags, *W) -> (x, temb)
  block(x, mod, adaln_index, cos, sin, *W) -> x                      (mod: the block's [3T, 6, H] table)
  block_lora(x, mod, adaln_index, cos, sin, lora_rows, lora_row_scales, *W, *LoRA) -> x
                              (--lora-slots N: the block with adapters, beside the plain one; LoRA: its slot banks;
                               with --sparse-attention too, the halves' twins block_pre_lora / block_post_lora)
  final(x, mod, timestep_index, video_index, audio_index, *W) -> (video_v, audio_v)   (mod: [T, 2, H])

Dimension names: S packed rows, V video rows, A audio rows, L text rows, T distinct timesteps, M = 3T, G groups of
16 LoRA rank rows.

`block_lora` takes an evaluation's adapters as rank rows (adapters/slots.py): lora_rows / lora_row_scales
[G, 16], G dynamic, so one compiled segment serves any adapter set of any ranks (one adapter, a style with a Turbo
LoRA, ...) computing only the rows of the adapters at a nonzero scale: nothing of a slot's padding, nothing of an
unused slot. The rows come in whole groups of 16 so that the FP8 layout's GEMM reduction stays a multiple of 16 for
every G, which Inductor then knows without a guard.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..adapters.slots import FUSED, LORA_INPUTS, AdapterBlock, segment_lora_names
from ..calibration.modules import ATTENTION_SCALES, attention_fn, fp8_attention, quantized_template
from ..calibration.recipe import QuantRecipe
from ..engines.video_decoder import video_decoder_names
from ..errors import UserError
from ..models.config import H3Config
from ..models.dit import ADALN_PREFIX, EMBED_PREFIXES, H3DiT, build_dit
from ..models.video_vae import decoder_epilogue, decoder_prologue
from ..parallel.ulysses import from_head_groups, to_head_groups



@dataclass
class SegmentSpec:
    """A compilable function and its named inputs; `dynamic` maps input name -> {dim: dimension name}."""

    name: str
    fn: Callable
    inputs: list[str]  # activation inputs, in call order
    weights: list[str]  # weight inputs (names in the segment's weight file), after the activations
    dynamic: dict[str, dict[int, str]] = field(default_factory=dict)
    outputs: list[str] = field(default_factory=list)
    lora: list[str] = field(default_factory=list)  # LoRA slot banks (block_lora), after the weights

    @property
    def all_inputs(self) -> list[str]:
        return self.inputs + self.weights + self.lora


def _template(cfg: H3Config, dtype: torch.dtype) -> H3DiT:
    """A DiT on the meta device: only its code is used, every weight arrives as an input."""
    return build_dit(cfg, dtype, device="meta")


class _Embed(torch.nn.Module):
    """`H3DiT.embed` as a module forward, so functional_call can swap its weights."""

    def __init__(self, model: H3DiT):
        super().__init__()
        self.model = model

    def forward(self, video, audio, text, timesteps, video_index, audio_index, text_index, token_tags):
        return self.model.embed(video, audio, text, timesteps, video_index, audio_index, text_index,
                                token_tags.shape[0])


def embed_segment(cfg: H3Config, dtype: torch.dtype) -> SegmentSpec:
    wrapper = _Embed(_template(cfg, dtype))
    weights = [n for n, _ in wrapper.model.named_parameters() if n.startswith(EMBED_PREFIXES)]

    def embed(video, audio, text, timesteps, video_index, audio_index, text_index, token_tags, *w):
        params = {"model." + n: t for n, t in zip(weights, w)}
        return torch.func.functional_call(
            wrapper, params, (video, audio, text, timesteps, video_index, audio_index, text_index, token_tags),
            strict=False)

    return SegmentSpec(
        "embed", embed,
        ["video", "audio", "text", "timesteps", "video_index", "audio_index", "text_index", "token_tags"], weights,
        dynamic={"video": {1: "V"}, "audio": {1: "A"}, "text": {1: "L"}, "timesteps": {0: "T"},
                 "video_index": {0: "V"}, "audio_index": {0: "A"}, "text_index": {0: "L"}, "token_tags": {0: "S"}},
        outputs=["x", "temb"],
    )


def _block_template(cfg: H3Config, dtype: torch.dtype, recipe: QuantRecipe | None = None):
    block = _template(cfg, dtype).blocks[0]
    return quantized_template(block, cfg, recipe) if recipe is not None else block


def block_weight_names(cfg: H3Config, dtype: torch.dtype = torch.bfloat16,
                       recipe: QuantRecipe | None = None) -> list[str]:
    """Parameters and buffers (a quantized linear keeps its e4m3 weight and scales as buffers), AdaLN left out."""
    return list(block_weight_specs(cfg, dtype, recipe))


def block_weight_specs(cfg: H3Config, dtype: torch.dtype = torch.bfloat16,
                       recipe: QuantRecipe | None = None) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """{name: (dtype, shape)} of `block_weight_names`, in that order."""
    block = _block_template(cfg, dtype, recipe)
    tensors = list(block.named_parameters()) + list(block.named_buffers())
    return {n: (t.dtype, tuple(t.shape)) for n, t in tensors if not n.startswith(ADALN_PREFIX)}


def block_segment(cfg: H3Config, dtype: torch.dtype, recipe: QuantRecipe | None = None,
                  name: str = "block", attention: str = "sdpa") -> SegmentSpec:
    """The main block; with a recipe, its quantized linears (and FP8 attention) take quantized weights and scales.
    `attention`: the `h3trt::attention` kernel of a block whose attention is not FP8 (h3trt/models/attention.py)."""
    block = _block_template(cfg, dtype, recipe)
    weights = block_weight_names(cfg, dtype, recipe)
    fp8 = recipe is not None and recipe.fp8_attention
    kernel = recipe.attention_kernel if fp8 else attention

    def run_block(x, mod, adaln_index, cos, sin, *w):
        params = dict(zip(weights, w))
        scales = {n: params[f"attn.{n}"] for n in ATTENTION_SCALES} if fp8 else None
        return torch.func.functional_call(block, params, (x, mod, adaln_index, (cos, sin), attention_fn(scales, kernel)),
                                          strict=False)

    return SegmentSpec(
        name, run_block, ["x", "mod", "adaln_index", "cos", "sin"], weights,
        dynamic={"x": {1: "S"}, "mod": {0: "M"}, "adaln_index": {0: "S"}, "cos": {0: "S"}, "sin": {0: "S"}},
        outputs=["x"],
    )


def block_lora_segment(plain: SegmentSpec, cfg: H3Config, dtype: torch.dtype, recipe: QuantRecipe | None,
                       attention: str, targets: tuple[str, ...], layout: str = FUSED) -> SegmentSpec:
    """`plain`'s twin with adapters (`<name>_lora`): the same block, weights and attention, plus the evaluation's
    rank rows [G, 16] (int64) and their scales [G, 16] (fp32) and the layer's slot banks as inputs, so that loading
    or switching an adapter changes data, never code. The base linears keep their weights and precision (bf16, or
    FP8 / NVFP4 with their scales); `layout` is how the rows join them (adapters/slots.py LAYOUTS: FUSED, the
    build's; DELTA, the side branch beside them, for scripts/bench_lora.py's comparison)."""
    block = _block_template(cfg, dtype, recipe)
    weights, lora = plain.weights, segment_lora_names(targets)
    fp8 = recipe is not None and recipe.fp8_attention
    kernel = recipe.attention_kernel if fp8 else attention

    def run_block_lora(x, mod, adaln_index, cos, sin, lora_rows, lora_row_scales, *rest):
        params = dict(zip(weights, rest[: len(weights)]))
        adapters = AdapterBlock.from_inputs(dict(zip(lora, rest[len(weights):])), lora_rows, lora_row_scales, layout)
        scales = {n: params[f"attn.{n}"] for n in ATTENTION_SCALES} if fp8 else None
        return torch.func.functional_call(block, params, (x, mod, adaln_index, (cos, sin),
                                                          attention_fn(scales, kernel), adapters), strict=False)

    return _lora_twin(plain, run_block_lora, lora)


def _lora_twin(plain: SegmentSpec, fn: Callable, lora: list[str]) -> SegmentSpec:
    """The spec of `plain`'s twin with adapters: its inputs, then the rank rows and scales [G, ROW_GROUP] (G dynamic:
    one compiled twin serves every adapter set), its weights, then the slot banks `lora`."""
    rows = {name: {0: "G"} for name in LORA_INPUTS}
    return SegmentSpec(f"{plain.name}_lora", fn, plain.inputs + list(LORA_INPUTS), plain.weights,
                       dynamic={**plain.dynamic, **rows}, outputs=plain.outputs, lora=lora)


# Under sequence parallelism the block is two segments around the attention exchange (h3trt/parallel/ulysses.py):
#   block_pre(x, mod, adaln_index, cos, sin, *W) -> qkv send buffer [sp, 3, B, Sl, N / sp, D]
#   block_post(x, attn, mod, adaln_index, *W) -> x                    (attn: the received [sp, B, Sl, N / sp, D])
# sp is baked into both (the head grouping of the buffers); Sl, the rows per rank, stays symbolic.
PRE_ATTENTION_PREFIXES = ("norm1.", "attn.qkv_proj.", "attn.q_norm.", "attn.k_norm.", "attn.to_gate_compress.")


class _PreAttention(torch.nn.Module):
    def __init__(self, block, sp: int):
        super().__init__()
        self.block, self.sp = block, sp

    def forward(self, x, mod, adaln_index, cos, sin, lora: AdapterBlock | None = None):
        return to_head_groups(*self.block.pre_attention(x, mod, adaln_index, (cos, sin), lora), sp=self.sp)


class _PostAttention(torch.nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x, attn, mod, adaln_index, lora: AdapterBlock | None = None):
        return self.block.post_attention(x, from_head_groups(attn), mod, adaln_index, lora)


def _half_wrapper(name: str, cfg: H3Config, dtype: torch.dtype, sp: int,
                  recipe: QuantRecipe | None) -> torch.nn.Module:
    block = _block_template(cfg, dtype, recipe)
    return _PreAttention(block, sp) if name == "block_pre" else _PostAttention(block)


def _half_block_segment(name: str, wrapper: torch.nn.Module, weights: list[str], inputs: list[str],
                        dynamic: dict) -> SegmentSpec:
    def run(*args):
        acts, w = args[: len(inputs)], args[len(inputs):]
        return torch.func.functional_call(wrapper, {"block." + n: t for n, t in zip(weights, w)}, acts, strict=False)

    return SegmentSpec(name, run, inputs, weights, dynamic=dynamic, outputs=["qkv" if name == "block_pre" else "x"])


def block_pre_segment(cfg: H3Config, dtype: torch.dtype, sp: int, recipe: QuantRecipe | None = None) -> SegmentSpec:
    """With a recipe, qkv_proj is the quantized linear (its e4m3 weight and scales are `attn.qkv_proj.*` inputs)."""
    weights = [n for n in block_weight_names(cfg, dtype, recipe) if n.startswith(PRE_ATTENTION_PREFIXES)]
    return _half_block_segment(
        "block_pre", _half_wrapper("block_pre", cfg, dtype, sp, recipe), weights,
        ["x", "mod", "adaln_index", "cos", "sin"],
        {"x": {1: "S"}, "mod": {0: "M"}, "adaln_index": {0: "S"}, "cos": {0: "S"}, "sin": {0: "S"}})


def block_post_segment(cfg: H3Config, dtype: torch.dtype, recipe: QuantRecipe | None = None) -> SegmentSpec:
    """With a recipe, out_proj and the MLP are the quantized linears."""
    weights = [n for n in block_weight_names(cfg, dtype, recipe) if not n.startswith(PRE_ATTENTION_PREFIXES)]
    return _half_block_segment(
        "block_post", _half_wrapper("block_post", cfg, dtype, 1, recipe), weights, ["x", "attn", "mod", "adaln_index"],
        {"x": {1: "S"}, "attn": {2: "S"}, "mod": {0: "M"}, "adaln_index": {0: "S"}})


def half_lora_segment(plain: SegmentSpec, cfg: H3Config, dtype: torch.dtype, recipe: QuantRecipe | None,
                      targets: tuple[str, ...], layout: str = FUSED) -> SegmentSpec:
    """The twin with adapters of a half at sp=1 (`block_pre_lora`, `block_post_lora`), what a sparse evaluation with
    adapters runs around its block-sparse attention as a dense one runs block_lora: the same half, weights and
    inputs, then the rank rows and scales, then the banks of the half's own linears (pre: attn.qkv_proj; post:
    attn.out_proj, mlp.fc1, mlp.fc2; AdaLN's are the runner's, in `mod`). Base linears as the half has them."""
    wrapper = _half_wrapper(plain.name, cfg, dtype, 1, recipe)
    pre = plain.name == "block_pre"
    lora = [n for n in segment_lora_names(targets) if n.startswith(PRE_ATTENTION_PREFIXES) == pre]
    acts, weights = len(plain.inputs), plain.weights

    def run_half_lora(*args):
        rows, scales = args[acts: acts + len(LORA_INPUTS)]
        rest = args[acts + len(LORA_INPUTS):]
        adapters = AdapterBlock.from_inputs(dict(zip(lora, rest[len(weights):])), rows, scales, layout)
        return torch.func.functional_call(wrapper, {"block." + n: t for n, t in zip(weights, rest)},
                                          (*args[:acts], adapters), strict=False)

    return _lora_twin(plain, run_half_lora, lora)


def final_weight_names(cfg: H3Config, dtype: torch.dtype = torch.bfloat16) -> list[str]:
    final = _template(cfg, dtype).final_layer
    return [n for n, _ in final.named_parameters() if not n.startswith(ADALN_PREFIX)]


def final_segment(cfg: H3Config, dtype: torch.dtype) -> SegmentSpec:
    final = _template(cfg, dtype).final_layer
    weights = final_weight_names(cfg, dtype)

    def run_final(x, mod, timestep_index, video_index, audio_index, *w):
        return torch.func.functional_call(final, dict(zip(weights, w)),
                                          (x, mod, timestep_index, video_index, audio_index), strict=False)

    return SegmentSpec(
        "final", run_final, ["x", "mod", "timestep_index", "video_index", "audio_index"], weights,
        dynamic={"x": {1: "S"}, "mod": {0: "T"}, "timestep_index": {0: "S"}, "video_index": {0: "V"},
                 "audio_index": {0: "A"}},
        outputs=["video", "audio"],
    )


def sharded_attention_segment(cfg: H3Config, recipe: QuantRecipe) -> SegmentSpec:
    """FP8 attention between the sharded halves (`--fp8-attention --sp N`): [B, S, N / sp, D] q/k/v of the real rows
    in, [B, S, N / sp, D] out, a layer's q/k/v scales as weights. Compiled so that the quantization, v's centering
    and the dequantization fuse around the kernel, as they do inside the sp=1 block."""
    weights = [f"attn.{n}" for n in ATTENTION_SCALES]

    def run_attention(q, k, v, q_scale, k_scale, v_scale):
        return fp8_attention(q, k, v, q_scale, k_scale, v_scale, recipe.attention_kernel)

    return SegmentSpec("attention", run_attention, ["q", "k", "v"], weights,
                       dynamic={"q": {1: "S"}, "k": {1: "S"}, "v": {1: "S"}}, outputs=["out"])


def check_sharded_recipe(recipe: QuantRecipe, sp: int) -> None:
    """What a quantized bundle can shard: its FP8/NVFP4 linears and FP8 attention, yes; whole-block exclusions, no."""
    if recipe.exclude_blocks:
        raise UserError(f"--quant-exclude blocks.N is built for --sp 1 only (got --sp {sp}, blocks "
                        f"{list(recipe.exclude_blocks)}): a bf16 block would need its own pair of sharded halves. "
                        "Exclude block linears instead, or build --sp 1.")


def dit_segments(cfg: H3Config, dtype: torch.dtype, sp: int = 1, recipe: QuantRecipe | None = None,
                 attention: str = "sdpa", sparse: bool = False,
                 lora_targets: tuple[str, ...] | None = None) -> list[SegmentSpec]:
    """The DiT's segments: one fused block when a rank holds the whole sequence, else the two halves. A quantization
    recipe that keeps whole blocks in the block dtype adds their segment, block_hp. `attention`: the kernel of every
    attention that is not FP8 (at sp > 1 it runs in the exchange, between the halves, not in a segment).

    `sparse` (a bundle built with --sparse-attention) at sp=1: the halves too, beside the fused block, for the
    evaluations whose attention is block-sparse (dense ones keep the fused block). The halves read the block's own
    weights (their names are subsets of the block's), so the bundle stores no weight twice; only their compiled code is
    added, which is why a bundle without --sparse-attention goes without them.

    `lora_targets` (a bundle built with --lora-slots, sp=1 only): each fused block segment (block, block_hp) gets its
    twin with adapters, block_lora / block_hp_lora; with `sparse` the halves get theirs too, block_pre_lora /
    block_post_lora, for the sparse evaluations of a request with adapters.

    A FastH3-VSA model (cfg.vsa_gate) has the halves only, at every sp: its attention is VSA in every evaluation
    (engines/bundle.py runs it between them), and block_pre's buffer carries the gate ([sp, 4, ...])."""
    if sp != 1 and recipe is not None:
        check_sharded_recipe(recipe, sp)
    if sparse and recipe is not None and recipe.exclude_blocks:
        raise UserError(f"a bundle that serves sparse attention has no halves for bf16 blocks "
                        f"{list(recipe.exclude_blocks)} (--quant-exclude blocks.N); exclude block linears instead.")
    halves = [block_pre_segment(cfg, dtype, sp, recipe), block_post_segment(cfg, dtype, recipe)]
    if cfg.vsa_gate:  # FastH3-VSA: VSA runs between the halves in every evaluation (its gate in their buffer)
        check_vsa_segments(sp, recipe, sparse, lora_targets)
        return [embed_segment(cfg, dtype), *halves, final_segment(cfg, dtype)]
    blocks = ([block_segment(cfg, dtype, recipe, attention=attention)] + (halves if sparse else []) if sp == 1
              else halves)
    if sp != 1 and recipe is not None and recipe.fp8_attention:
        blocks.append(sharded_attention_segment(cfg, recipe))
    if recipe is not None and recipe.exclude_blocks:
        blocks.append(block_segment(cfg, dtype, None, name="block_hp", attention=attention))
    if lora_targets is not None:
        if sp != 1:
            raise UserError(f"--lora-slots is built for --sp 1 only (got --sp {sp}): the sharded halves have no "
                            "twin with adapters. Build --sp 1, or drop --lora-slots/--lora-max-rank.")
        twins = [block_lora_segment(b, cfg, dtype, recipe if b.name == "block" else None, attention, lora_targets)
                 for b in blocks if b.name in ("block", "block_hp")]
        blocks += twins + ([half_lora_segment(h, cfg, dtype, recipe, lora_targets) for h in halves] if sparse else [])
    return [embed_segment(cfg, dtype), *blocks, final_segment(cfg, dtype)]


def check_vsa_segments(sp: int, recipe: QuantRecipe | None, sparse: bool, lora_targets) -> None:
    """A FastH3-VSA model's segments are the halves and nothing else: what would need another block segment or
    another attention is refused (BuildConfig.check_vsa says it in the flags' words first)."""
    if sparse or lora_targets is not None or (recipe is not None and (recipe.exclude_blocks or recipe.fp8_attention)):
        raise UserError("a FastH3-VSA model's block is its two halves around VSA: no SubBlock sparse attention, LoRA "
                        "slots, bf16 whole blocks or FP8 attention beside them.")


class _Decode(torch.nn.Module):
    """A VAE decoder behind its input projection (`post_quant_conv` for video, `dec_in_proj` for audio)."""

    def __init__(self, vae, input_proj: str):
        super().__init__()
        self.vae, self.input_proj = vae, input_proj

    def forward(self, x):
        return self.vae.decoder(getattr(self.vae, self.input_proj)(x))


def _vae_segment(name: str, wrapper: torch.nn.Module, prefixes: tuple[str, ...], input_name: str) -> SegmentSpec:
    # Buffers too (rotary frequencies, anti-aliasing filters): an exported graph must have no lifted tensors.
    tensors = list(wrapper.vae.named_parameters()) + list(wrapper.vae.named_buffers())
    weights = [n for n, _ in tensors if n.startswith(prefixes)]

    def run(x, *w):
        return torch.func.functional_call(wrapper, {"vae." + n: t for n, t in zip(weights, w)}, (x,), strict=False)

    # Static shapes: a VAE segment is compiled per tile shape / clip length of the bundle's profiles.
    return SegmentSpec(name, run, [input_name], weights, dynamic={}, outputs=["waveform" if "audio" in name else
                                                                               "pixels"])


# The video decoder of one (window, tile) shape is three segments, so that one compiled block serves all 36 layers
# (build time is that of one block, not of an unrolled 36-block graph; h3trt/models/video_vae.py splits diffusers'
# decoder forward at the same seams, bitwise):
#   video_decoder_in_TxHxW(z, *W)              -> (x [1, S, D] residual dtype, cos, sin [1, S, 1, R])
#   video_decoder_block_TxHxW(x, cos, sin, *W) -> x              (W: one layer's tensors, block-relative names)
#   video_decoder_out_TxHxW(x, *W)             -> pixels [1, 3, 4T, 16H, 16W]
_DECODER_IN_PREFIXES = ("post_quant_conv.", "decoder.proj_in.", "decoder.register_tokens", "decoder.rope.")
_DECODER_OUT_PREFIXES = ("decoder.norm_out.", "decoder.proj_out.")


class _DecoderIn(torch.nn.Module):
    def __init__(self, vae):
        super().__init__()
        self.vae = vae

    def forward(self, z):
        return decoder_prologue(self.vae, z)


class _DecoderOut(torch.nn.Module):
    def __init__(self, vae, t: int, h: int, w: int):
        super().__init__()
        self.vae, self.shape = vae, (t, h, w)

    def forward(self, x):
        return decoder_epilogue(self.vae, x, *self.shape)


def _module_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    # Buffers too (rotary frequencies, an FP8 linear's e4m3 weight and scales): an exported graph must have no
    # lifted tensors.
    return list(module.named_parameters()) + list(module.named_buffers())


def video_decoder_segments(vae, window_latents: int, tile_h: int, tile_w: int) -> list[SegmentSpec]:
    """The three segments of one temporal window of one spatial tile, at the precision `vae` is placed (and, for
    fp8, quantized) at. Static shapes: compiled per tile shape of the bundle's profiles."""
    key = (window_latents, tile_h, tile_w)
    names = video_decoder_names(*key)
    wrapper_in, wrapper_out = _DecoderIn(vae), _DecoderOut(vae, *key)
    in_weights = [n for n, _ in _module_tensors(vae) if n.startswith(_DECODER_IN_PREFIXES)]
    out_weights = [n for n, _ in _module_tensors(vae) if n.startswith(_DECODER_OUT_PREFIXES)]
    block = vae.decoder.transformer_blocks[0]  # the code of every layer; each layer's tensors arrive as inputs
    block_weights = [n for n, _ in _module_tensors(block)]

    def run_in(z, *w):
        return torch.func.functional_call(wrapper_in, {"vae." + n: t for n, t in zip(in_weights, w)}, (z,),
                                          strict=False)

    def run_block(x, cos, sin, *w):
        return torch.func.functional_call(block, dict(zip(block_weights, w)), (x, (cos, sin)), strict=False)

    def run_out(x, *w):
        return torch.func.functional_call(wrapper_out, {"vae." + n: t for n, t in zip(out_weights, w)}, (x,),
                                          strict=False)

    return [SegmentSpec(names["in"], run_in, ["z"], in_weights, outputs=["x", "cos", "sin"]),
            SegmentSpec(names["block"], run_block, ["x", "cos", "sin"], block_weights, outputs=["x"]),
            SegmentSpec(names["out"], run_out, ["x"], out_weights, outputs=["pixels"])]


def audio_decoder_segment(vae, audio_latents: int) -> SegmentSpec:
    """Denormalised stereo latents [2, C, A] -> waveform [2, 1, A * 800]."""
    return _vae_segment(audio_decoder_name(audio_latents), _Decode(vae, "dec_in_proj"), ("dec_in_proj.", "decoder."), "latents")


def audio_decoder_name(audio_latents: int) -> str:
    return f"audio_decoder_{audio_latents}"
