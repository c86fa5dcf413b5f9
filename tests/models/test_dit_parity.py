"""The h3trt DiT against diffusers 0.42.1's MiniMaxH3Transformer3DModel with identical weights.

Diffusers reads the official shards through its own converter (`qkv_layout="interleaved"`), so neither the h3trt
loader nor the h3trt name mapping is on the oracle's side.
"""

import pytest
import torch
from diffusers import MiniMaxH3Transformer3DModel
from diffusers.loaders.single_file_utils import convert_minimax_h3_transformer_checkpoint_to_diffusers
from safetensors.torch import load_file

from h3trt.models.checkpoint.reader import load_dit
from h3trt.models.config import H3Config
from h3trt.models.dit import build_dit
from h3trt.models.packing import RefBlock, pack_ref2va, pack_t2va, row_timesteps, text_tags_for

from helpers import dit_inputs

# fp32 forward: max abs error <= REL_TOL x max |output| (the bar).
REL_TOL = 1e-5


def diffusers_from_official(partition_dir, cfg: H3Config, dtype=torch.float32) -> MiniMaxH3Transformer3DModel:
    state = {}
    for f in sorted((partition_dir / "transformer").glob("*.safetensors")):
        state.update(load_file(str(f)))
    model = MiniMaxH3Transformer3DModel(**cfg.to_diffusers_kwargs())
    converted = convert_minimax_h3_transformer_checkpoint_to_diffusers(state, model.config, qkv_layout="interleaved")
    model.load_state_dict(converted, strict=True)
    return model.to(dtype).eval()


LAYOUTS = {
    "t2va": lambda: pack_t2va(text_tags_for(9), 7, 4, 6, 23),
    "fl2va_first_last": lambda: pack_t2va(text_tags_for(12, [range(2, 7)]), 7, 4, 6, 23, keyframes=("first", "last")),
    "ref2va_2img_audio": lambda: pack_ref2va(
        text_tags_for(14, [range(1, 4), range(6, 9)]),
        [RefBlock("image", (1, 4, 4)), RefBlock("image", (1, 6, 4)), RefBlock("audio", audio_latents=10)],
        7, 4, 6, 23,
    ),
}
PARTITION = {"t2va": "FL2VA", "fl2va_first_last": "FL2VA", "ref2va_2img_audio": "Ref2VA"}
TASK = {"t2va": "t2va", "fl2va_first_last": "fl2va", "ref2va_2img_audio": "ref2va"}


def random_inputs(layout, cfg, seed=0, batch=1):
    video, audio, text = dit_inputs(layout, cfg, seed, batch)
    unique_t, t_index = row_timesteps(layout, 0.3125, 0.55)
    return dict(video=video, audio=audio, text=text, timesteps=unique_t, t_index=t_index)


def run_h3trt(model, layout, x):
    return model(x["video"], x["audio"], x["text"], x["timesteps"], x["t_index"], layout.token_tags,
                 layout.position_ids, layout.video_index, layout.audio_index, layout.text_index)


def run_diffusers(model, layout, x):
    return model(hidden_states=x["video"], audio_hidden_states=x["audio"], encoder_hidden_states=x["text"],
                 timestep=x["timesteps"], timestep_indices=x["t_index"], token_tags=layout.token_tags,
                 position_ids=layout.position_ids, video_indices=layout.video_index,
                 audio_indices=layout.audio_index, text_indices=layout.text_index, return_dict=False)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@torch.no_grad()
def test_forward_matches_diffusers_fp32(name, tiny_cfg, tiny_checkpoints):
    layout = LAYOUTS[name]()
    ours, _ = load_dit(tiny_checkpoints["official"], TASK[name], dtype=torch.float32)
    ref = diffusers_from_official(tiny_checkpoints["official"] / PARTITION[name], tiny_cfg)
    x = random_inputs(layout, tiny_cfg)
    for a, b in zip(run_h3trt(ours, layout, x), run_diffusers(ref, layout, x)):
        assert a.shape == b.shape
        assert a.dtype == b.dtype == torch.float32
        err, scale = (a - b).abs().max().item(), b.abs().max().item()
        assert scale > 0.1, "degenerate output: the comparison would prove nothing"
        assert err <= REL_TOL * scale, f"{name}: max abs err {err:.3e} > {REL_TOL} x {scale:.3e}"


@torch.no_grad()
def test_condition_rows_change_the_output(tiny_cfg, tiny_checkpoints):
    """Guards the parity test against a layout bug that both models would share: keyframe rows must matter."""
    layout = LAYOUTS["fl2va_first_last"]()
    model, _ = load_dit(tiny_checkpoints["official"], "fl2va", dtype=torch.float32)
    x = random_inputs(layout, tiny_cfg)
    base = run_h3trt(model, layout, x)[0][:, layout.num_condition_video_rows:]
    x["video"][:, : layout.num_condition_video_rows] += 1.0
    moved = run_h3trt(model, layout, x)[0][:, layout.num_condition_video_rows:]
    assert (base - moved).abs().max() > 1e-3


@torch.no_grad()
def test_bf16_islands_match_diffusers(tiny_cfg, tiny_checkpoints):
    """At the checkpoint's mixed precision (bf16 stack, fp32 islands) both agree to bf16 accuracy."""
    layout = LAYOUTS["t2va"]()
    ours, _ = load_dit(tiny_checkpoints["official"], "t2va", dtype=torch.bfloat16)
    assert ours.video_patch_proj.weight.dtype == torch.float32
    assert ours.final_layer.audio_out.weight.dtype == torch.float32
    assert ours.time_embedder.proj_in.weight.dtype == torch.float32
    assert ours.blocks[0].attn.qkv_proj.weight.dtype == torch.bfloat16
    assert ours.blocks[0].adaln_proj.linear.weight.dtype == torch.bfloat16
    ref = diffusers_from_official(tiny_checkpoints["official"] / "FL2VA", tiny_cfg, torch.float32)
    ref = ref.to(torch.bfloat16)
    for name in ("proj_in", "audio_proj_in", "time_embedder", "proj_out", "audio_proj_out"):
        getattr(ref, name).float()
    x = random_inputs(layout, tiny_cfg)
    for a, b in zip(run_h3trt(ours, layout, x), run_diffusers(ref, layout, x)):
        assert a.dtype == torch.float32
        err, scale = (a - b).abs().max().item(), b.abs().max().item()
        assert err <= 2e-2 * scale, f"bf16: max abs err {err:.3e} vs scale {scale:.3e}"


@torch.no_grad()
def test_segments_compose_to_forward(tiny_cfg, tiny_checkpoints):
    """embed -> block x N -> final, each called alone, reproduce forward bit for bit (they become compiled segments)."""
    from h3trt.models.config import NUM_MODALITIES

    layout = LAYOUTS["ref2va_2img_audio"]()
    model, _ = load_dit(tiny_checkpoints["official"], "ref2va", dtype=torch.float32)
    x = random_inputs(layout, tiny_cfg, batch=2)
    full = run_h3trt(model, layout, x)
    h, temb = model.embed(x["video"], x["audio"], x["text"], x["timesteps"], layout.video_index, layout.audio_index,
                          layout.text_index, layout.seq_len)
    rope = model.rope(layout.position_ids)
    adaln_index = x["t_index"] * NUM_MODALITIES + layout.token_tags
    for block in model.blocks:
        h = block(h, block.modulation(temb), adaln_index, rope)
    parts = model.final(h, temb, x["t_index"], layout.video_index, layout.audio_index)
    for a, b in zip(full, parts):
        assert torch.equal(a, b)


def test_full_size_parameter_count():
    """33.1B parameters at the released dimensions, identical to diffusers' model (both on the meta device)."""
    ours = build_dit(H3Config(), torch.bfloat16, device="meta")
    n = sum(p.numel() for p in ours.parameters())
    assert round(n / 1e9, 1) == 33.1
    with torch.device("meta"):
        ref = MiniMaxH3Transformer3DModel()
    assert n == sum(p.numel() for p in ref.parameters())
    adaln = sum(p.numel() for name, p in ours.named_parameters() if ".adaln_proj." in name)
    assert round(adaln / 1e9, 1) == 13.0
