"""Random distilled files in each family's published format, for a model of any size: the tests' synthetic files
(tiny) and the GPU bench's full-size ones (scripts/bench_distilled.py). Deterministic per seed; the deltas are small
(a few percent of a weight), so a merged random model stays as well-behaved as the base.

Formats (distilled/files.py reads them): FastH3 `fastvideo-lora-v2` as FastVideo's extractor writes it (block
matrices as lora_A/lora_B, block norms and biases and every model-level tensor as exact .diff/.diff_b, the VSA gates
as .set_weight, the counts in the header); PDD as alibaba-pai's Acc LoRA (bare lora_down/lora_up on 7 block targets
and 6 refiner targets, the 32-head banks); Turbo as LightX2V's PEFT dump (`base_model.model.` root, `.default.`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import H3Config

BLOCK_LINEARS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.net.0.proj", "ff.net.2")
BLOCK_NORMS = ("norm1", "norm2", "attn.norm_q", "attn.norm_k")


def diffusers_shapes(cfg: H3Config) -> dict[str, tuple[int, ...]]:
    """The diffusers transformer's tensor shapes (names the distilled files use), without building it."""
    h, inner, ffn, e = cfg.hidden_size, cfg.inner_dim, cfg.ffn_dim, cfg.time_embed_dim
    shapes = {"proj_in.weight": (h, cfg.video_patch_dim), "proj_in.bias": (h,),
              "audio_proj_in.weight": (h, cfg.audio_in_channels), "audio_proj_in.bias": (h,),
              "context_embedder.weight": (h, cfg.text_dim), "context_embedder.bias": (h,),
              "time_embedder.linear_1.weight": (cfg.time_embed_hidden_dim, cfg.freq_dim),
              "time_embedder.linear_1.bias": (cfg.time_embed_hidden_dim,),
              "time_embedder.linear_2.weight": (e, cfg.time_embed_hidden_dim), "time_embedder.linear_2.bias": (e,),
              "norm_out.linear.weight": (2 * h, e), "norm_out.linear.bias": (2 * h,), "norm_out.norm.weight": (h,),
              "proj_out.weight": (cfg.video_patch_dim, h), "proj_out.bias": (cfg.video_patch_dim,),
              "audio_proj_out.weight": (cfg.audio_in_channels, h), "audio_proj_out.bias": (cfg.audio_in_channels,)}
    linears = {"attn.to_q": (inner, h), "attn.to_k": (inner, h), "attn.to_v": (inner, h),
               "attn.to_out.0": (h, inner), "ff.net.0.proj": (2 * ffn, h), "ff.net.2": (h, ffn)}
    norms = {"norm1": (h,), "norm2": (h,), "attn.norm_q": (cfg.head_dim,), "attn.norm_k": (cfg.head_dim,)}
    for prefix, count, adaln in (("transformer_blocks", cfg.num_layers, True),
                                 ("token_refiner.refiner_blocks", cfg.num_refiner_layers, False)):
        for i in range(count):
            for m, shape in {**linears, **({"adaln_proj.linear": (cfg.modulation_dim, e)} if adaln else {})}.items():
                shapes[f"{prefix}.{i}.{m}.weight"] = shape
            for m, shape in norms.items():
                shapes[f"{prefix}.{i}.{m}.weight"] = shape
            if adaln:
                shapes[f"{prefix}.{i}.adaln_proj.linear.bias"] = (cfg.modulation_dim,)
    return shapes


def _factors(gen, shape, rank, dtype, size=0.02):
    out, inp = shape
    return ((torch.randn(rank, inp, generator=gen, device=gen.device) / inp ** 0.5).to(dtype),
            (size * torch.randn(out, rank, generator=gen, device=gen.device) / rank ** 0.5).to(dtype))


def _save(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> Path:
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    return path


def fasth3_tensors(cfg: H3Config, seed: int = 0, rank: int = 4, gates: bool = False,
                   dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """FastVideo's extractor's split: 2-D block weights factored, everything else an exact fp32 delta; gates set (the
    VSA variant). Drawn on `device` (a full-size file's 3.85 GB of gates: the GPU), returned on the CPU."""
    gen = torch.Generator(device).manual_seed(seed)
    out = {}
    for name, shape in sorted(diffusers_shapes(cfg).items()):
        module, _, kind = name.rpartition(".")
        is_block = name.startswith(("transformer_blocks.", "token_refiner.refiner_blocks."))
        if is_block and kind == "weight" and len(shape) == 2:
            out[f"{module}.lora_A.weight"], out[f"{module}.lora_B.weight"] = _factors(gen, shape, rank, dtype)
        else:
            out[f"{module}.{'diff' if kind == 'weight' else 'diff_b'}"] = 0.02 * torch.randn(shape, generator=gen,
                                                                                             device=gen.device)
    if gates:
        for i in range(cfg.num_layers):
            out[f"transformer_blocks.{i}.attn.to_gate_compress.set_weight"] = (torch.randn(
                cfg.inner_dim, cfg.hidden_size, generator=gen, device=gen.device) / cfg.hidden_size ** 0.5).to(dtype)
    return {k: v.cpu() for k, v in out.items()}


def fasth3_header(tensors: dict[str, torch.Tensor], rank: int) -> dict[str, str]:
    return {"format": "fastvideo-lora-v2", "base_model": "MiniMaxAI/MiniMax-H3",
            "finetuned_model": "FastVideo/FastVideo-FastH3-4-step-Preview-v1-h3trt-random", "rank": str(rank),
            "application": "W = W_base + lora_B @ lora_A; then .diff/.diff_b added and .set_weight assigned",
            "low_rank_tensors": str(sum(".lora_" in k for k in tensors)),
            "diff_tensors": str(sum(k.endswith((".diff", ".diff_b")) for k in tensors)),
            "set_weight_tensors": str(sum(k.endswith(".set_weight") for k in tensors))}


def write_fasth3(path: Path, cfg: H3Config, seed: int = 0, rank: int = 4, gates: bool = False,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> Path:
    tensors = fasth3_tensors(cfg, seed, rank, gates, dtype, device)
    return _save(path, tensors, fasth3_header(tensors, rank))


def pdd_tensors(cfg: H3Config, seed: int = 0, rank: int = 4, intervals: int = 32,
                dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The trunk (7 block targets incl. adaln_proj.linear, 6 refiner targets) and the two head banks."""
    gen = torch.Generator().manual_seed(seed)
    shapes = diffusers_shapes(cfg)
    out = {}
    for name, shape in sorted(shapes.items()):
        module = name.removesuffix(".weight")
        if module.endswith(BLOCK_LINEARS + ("adaln_proj.linear",)) and name.endswith(".weight"):
            out[f"{module}.lora_down"], out[f"{module}.lora_up"] = _factors(gen, shape, rank, dtype)
    for head in ("proj_out", "audio_proj_out"):
        rows, cols = shapes[f"{head}.weight"]
        out[f"{head}.weight"] = (torch.randn(intervals, rows, cols, generator=gen) / cols ** 0.5).to(dtype)
        out[f"{head}.bias"] = (0.02 * torch.randn(intervals, rows, generator=gen)).to(dtype)
    return out


def write_pdd(path: Path, cfg: H3Config, seed: int = 0, rank: int = 4, intervals: int = 32,
              dtype: torch.dtype = torch.float32, alpha: float | None = None) -> Path:
    header = {"lora_rank": str(rank), "lora_alpha": str(float(rank if alpha is None else alpha)),
              "pdd_num_steps": str(intervals), "pdd_block_size": "4",
              "lora_targets": "to_q,to_k,to_v,to_out.0,ff.net.0.proj,ff.net.2,adaln_proj.linear"}
    return _save(path, pdd_tensors(cfg, seed, rank, intervals, dtype), header)


def turbo_tensors(cfg: H3Config, seed: int = 0, rank: int = 8, root: bool = True, refiner: bool = True,
                  dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """LightX2V's PEFT dump: q/k/v/out/fc1/fc2 of every block (and the refiner's), `.default.` factors."""
    gen = torch.Generator().manual_seed(seed)
    prefix = "base_model.model." if root else ""
    out = {}
    for name, shape in sorted(diffusers_shapes(cfg).items()):
        module = name.removesuffix(".weight")
        if not module.endswith(BLOCK_LINEARS) or (module.startswith("token_refiner") and not refiner):
            continue
        down, up = _factors(gen, shape, rank, dtype, size=0.2)
        out[f"{prefix}{module}.lora_A.default.weight"], out[f"{prefix}{module}.lora_B.default.weight"] = down, up
    return out


def write_turbo(path: Path, cfg: H3Config, seed: int = 0, rank: int = 8, alpha: float | None = None,
                root: bool = True, metadata: dict[str, str] | None = None,
                dtype: torch.dtype = torch.float32, refiner: bool = True) -> Path:
    header = dict(metadata or {})
    if alpha is not None:
        header["alpha"] = str(alpha)
    return _save(path, turbo_tensors(cfg, seed, rank, root, refiner, dtype), header)
