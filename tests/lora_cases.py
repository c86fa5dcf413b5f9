"""LoRA files and models the tests share across floors: the merge against diffusers (test_lora.py), the slots, the
bundles with slots and the adapters a server holds.

- CFG, the tiny config with 128-wide heads (the reference de-interleaves DiffSynth QKV with a fixed head_dim of 128),
  and `original_factors(seed)`: random original-name factors on every kind of Linear the reference converts, at mixed
  ranks as the published H3 LoRAs are (4 on attention and FFN, 2 on the AdaLN projections);
- FORMATS: each file layout diffusers' loader reads, written from those factors (`fmt_*`, `write`, `adapter_metadata`
  for diffusers' LoraConfig record), and ReferencePipe, the reference's loader mixin over one partition;
- LAYOUT, the packed layout the LoRA parity tests run the DiT over; `model` (the DiT with files merged) and `forward`
  (it over LAYOUT, two batch rows, with or without slots), `block_factors` and `layout_file` (the factors on the main
  blocks' linears only, as slots hold them, in one of FORMATS' layouts);
- `tiny_factors(seed)`: factors on every main-block linear of the embedded tiny model (the served model's), and
  PROMPT, the prompt the adapter tests denoise.
"""

import json

import torch
from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_minimax_h3_lora_to_diffusers
from diffusers.loaders.lora_pipeline import MiniMaxH3LoraLoaderMixin
from diffusers.utils.peft_utils import get_peft_kwargs
from safetensors.torch import save_file

from h3trt.adapters.merge import merge_loras
from h3trt.adapters.slots import BLOCK_TARGETS
from h3trt.models.config import H3Config
from h3trt.models.dit import build_dit
from h3trt.models.packing import pack_t2va, row_timesteps, text_tags_for
from h3trt.models.weight_layout import interleave_qkv

from helpers import dit_inputs

CFG = H3Config.tiny(head_dim=128)
# Original module name -> rank; every kind of Linear the reference converts.
MODULES = {
    "blocks.0.attn.qkv_proj": 4, "blocks.1.attn.out_proj": 4, "blocks.0.mlp.fc1": 4, "blocks.1.mlp.fc2": 4,
    "blocks.0.adaln_proj.linear": 2, "blocks.1.adaln_proj.linear": 2, "token_refiner.blocks.1.attn.qkv_proj": 4,
    "token_refiner.blocks.0.mlp.fc1": 4, "video_patch_proj": 4, "audio_patch_proj": 4, "condition_proj": 4,
    "time_embedder.proj_in": 4, "time_embedder.proj_out": 4, "final_layer.adaln_proj.linear": 2,
    "final_layer.video_out": 4, "final_layer.audio_out": 4,
}
LAYOUT = pack_t2va(text_tags_for(9, [range(2, 5)]), 7, 4, 6, 23, keyframes=("first",))


class ReferencePipe(MiniMaxH3LoraLoaderMixin):
    """The mixin over a pipeline that holds one partition, as `workflow="t2va"` / `"ref2va"` loads."""

    def __init__(self, transformer=None, transformer_ref=None):
        self.transformer, self.transformer_ref = transformer, transformer_ref
        self.hf_device_map = None
        self.components = {k: v for k, v in (("transformer", transformer), ("transformer_ref", transformer_ref)) if v}


def original_factors(seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{module: (down [r, in], up [out, r])} with the QKV rows in [q; k; v] order."""
    shapes = {k.removesuffix(".weight"): v.shape for k, v in build_dit(CFG, torch.float32, "meta").state_dict().items()
              if k.endswith(".weight") and v.ndim == 2}
    g = torch.Generator().manual_seed(seed)
    out = {}
    for module, r in MODULES.items():
        rows, cols = shapes[module]
        out[module] = (torch.randn(r, cols, generator=g) / cols ** 0.5,
                       0.3 * torch.randn(rows, r, generator=g) / r ** 0.5)
    return out


def every_linear_lora(cfg: H3Config, seed: int, rank_of) -> dict[str, torch.Tensor]:
    """An ai-toolkit style LoRA's tensors (diffusion_model. prefix) over every Linear of the DiT of `cfg`: the main
    blocks, the refiner, the embeddings and the final layer, AdaLN included; `rank_of(weight name)`: each one's rank."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, meta in build_dit(cfg, torch.float32, "meta").state_dict().items():
        if name.endswith(".weight") and meta.ndim == 2:
            rows, cols, r = *meta.shape, rank_of(name)
            tensors[f"diffusion_model.{name[:-7]}.lora_A.weight"] = torch.randn(r, cols, generator=g) / cols ** 0.5
            tensors[f"diffusion_model.{name[:-7]}.lora_B.weight"] = 0.3 * torch.randn(rows, r, generator=g) / r ** 0.5
    return tensors


def write(path, tensors, metadata=None):
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    return path


def fmt_original(factors, prefix=""):
    return {f"{prefix}{m}.lora_{ab}.weight": t for m, (d, u) in factors.items() for ab, t in (("A", d), ("B", u))}


def fmt_kohya(factors, alphas):
    out = {}
    for m, (d, u) in factors.items():
        out[f"{m}.lora_down.weight"], out[f"{m}.lora_up.weight"] = d, u
        if m in alphas:
            out[f"{m}.alpha"] = torch.tensor(alphas[m])
    return out


def fmt_musubi(factors, alphas):
    """kohya factors under musubi-tuner's flattened `lora_unet_` module names."""
    out = {}
    for key, value in fmt_kohya(factors, alphas).items():
        cut = len(key) - len(".alpha") if key.endswith(".alpha") else key.index(".lora_")
        out[f"lora_unet_{key[:cut].replace('.', '_')}{key[cut:]}"] = value
    return out


def fmt_diffsynth(factors):
    out = {}
    for m, (d, u) in factors.items():
        if m.endswith("qkv_proj"):  # DiffSynth trains on the raw checkpoint's per-head interleaved rows
            u = interleave_qkv(u, CFG.num_heads, CFG.head_dim)
        out[f"{m}.lora_A.default.weight"], out[f"{m}.lora_B.default.weight"] = d, u
    return out


def fmt_diffusers(factors, component="transformer"):
    """Diffusers names, converted by the reference's own converter."""
    converted = _convert_non_diffusers_minimax_h3_lora_to_diffusers(fmt_original(factors))
    return {component + k.removeprefix("transformer"): v for k, v in converted.items()}


def adapter_metadata(tensors, component="transformer", lora_alpha=3.0):
    """diffusers' `lora_adapter_metadata` (a LoraConfig record) with a non-trivial alpha and an alpha pattern."""
    sd = {k.removeprefix(f"{component}."): v for k, v in tensors.items()}
    rank = {f"^{k}": v.shape[1] for k, v in sd.items() if "lora_B" in k}
    kwargs = get_peft_kwargs(rank, None, sd, is_unet=False)
    kwargs.update(lora_alpha=lora_alpha, alpha_pattern={"^transformer_blocks.0.ff.net.0.proj": 6.0})
    return {"lora_adapter_metadata": json.dumps({f"{component}.{k}": v for k, v in kwargs.items()})}


KOHYA_ALPHAS = {"blocks.0.attn.qkv_proj": 2.0, "blocks.0.adaln_proj.linear": 8.0, "condition_proj": 1.0}
FORMATS = {
    # name: (tensors(factors), file metadata or None)
    "original_alpha_less": (lambda f: fmt_original(f), None),
    "ai_toolkit_metadata_alpha": (lambda f: fmt_original(f, "diffusion_model."), {"alpha": "2"}),
    "kohya_alpha_tensors": (lambda f: fmt_kohya(f, KOHYA_ALPHAS), None),
    "musubi_flattened": (lambda f: fmt_musubi(f, KOHYA_ALPHAS), None),
    "diffsynth_interleaved_qkv": (lambda f: fmt_diffsynth(f), None),
    "diffusers_prefixed": (lambda f: fmt_diffusers(f), None),
    "diffusers_adapter_metadata": (lambda f: fmt_diffusers(f), "adapter"),
    "peft_dump_unprefixed": (lambda f: {k.removeprefix("transformer.").replace(".lora_A.", ".lora_A.default.")
                                        .replace(".lora_B.", ".lora_B.default."): v
                                        for k, v in fmt_diffusers(f).items()}, None),
}


def block_factors(seed: int, only: str = "blocks.") -> dict:
    """original_factors (ranks 4, and 2 on adaln_proj) on the main blocks' linears only."""
    return {m: f for m, f in original_factors(seed).items() if m.startswith(only)}


def layout_file(tmp_path, name: str, seed: int):
    """The block factors of `seed` written in the layout FORMATS[name]."""
    build, meta = FORMATS[name]
    tensors = build(block_factors(seed))
    if meta == "adapter":
        meta = adapter_metadata(tensors)
    return write(tmp_path / f"{name}_{seed}.safetensors", tensors, meta)


def model(state, loras=()):
    dit = build_dit(CFG, torch.float32)
    dit.load_state_dict(state)
    merge_loras(dit, list(loras), "t2va")
    return dit


def forward(dit, adapters=None):
    """The DiT over LAYOUT, two batch rows; `adapters` passed only when given (the call without slots)."""
    video, audio, text = dit_inputs(LAYOUT, CFG, seed=5, batch=2)
    unique_t, t_index = row_timesteps(LAYOUT, 0.3125, 0.55)
    extra = {} if adapters is None else {"adapters": adapters}
    with torch.no_grad():
        return dit(video, audio, text, unique_t, t_index, LAYOUT.token_tags, LAYOUT.position_ids, LAYOUT.video_index,
                   LAYOUT.audio_index, LAYOUT.text_index, **extra)


PROMPT = "a red fox runs through snow"


def tiny_factors(seed: int) -> dict:
    """Random factors on every main-block linear of the embedded tiny model (rank 4, 2 on the AdaLN projections)."""
    cfg = H3Config.tiny()
    shapes = {k.removesuffix(".weight"): v.shape for k, v in build_dit(cfg, torch.float32, "meta").state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(cfg.num_layers):
        for local in BLOCK_TARGETS:
            m, r = f"blocks.{i}.{local}", 2 if local.startswith("adaln") else 4
            rows, cols = shapes[m]
            out[m] = (torch.randn(r, cols, generator=g) / cols ** 0.5, torch.randn(rows, r, generator=g) / r ** 0.5)
    return out
