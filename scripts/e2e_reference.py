"""bench_e2e.py's reference phase: on the checkpoint's weights (regenerated on the GPU from the same seeds, checked
against the file), Diffusers' MiniMaxH3Transformer3DModel and h3trt's eager DiT at the clip's rows, and Diffusers' own
video VAE decode of the clip's latent, loaded in bf16 as its pipeline loads it. Each measurement is saved into the
results as it lands.

On an 80 GB card: the bf16 DiT is 61.7 GiB. h3trt's eager evaluation peaked at 70.8 GiB on the H200; Diffusers' at 83.1
GiB there, because its model was built beside h3trt's and its fc1 weights ([value; gate], a new tensor each: 14.3
GiB) were copies. Here h3trt's model is dropped first and each tensor is converted and released in turn, so only one
copy of each weight exists (Diffusers' evaluation then peaks at ~68 GiB). If it still runs out of memory, Diffusers is
timed with half and a quarter of its blocks resident and its evaluation extrapolated linearly to all 50 (the result
says so)."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

import torch

from bench_common import NvmlSampler, peak_gib, timed_runs
from e2e_checkpoint import TEXT_ROWS, checkpoint_complete, dit_tensor_specs, random_tensor
from e2e_summary import FULL_EVALUATIONS

if TYPE_CHECKING:
    from e2e_ctx import Ctx


def reference_inputs(ctx: Ctx):
    from h3trt.models.packing import pack_t2va, row_timesteps, text_tags_for
    from h3trt.models.sampler import Schedule

    geo, cfg, dev = ctx.geometry, ctx.cfg, ctx.device
    lay = pack_t2va(text_tags_for(TEXT_ROWS), geo.latent_frames, geo.latent_height, geo.latent_width,
                    geo.audio_latents, cfg.patch_size).to(dev)
    g = torch.Generator().manual_seed(0)
    video = torch.randn(1, lay.video_index.numel(), cfg.video_patch_dim, generator=g).to(dev)
    audio = torch.randn(1, lay.audio_index.numel(), cfg.audio_in_channels, generator=g).to(dev)
    text = torch.randn(1, TEXT_ROWS, cfg.text_dim, generator=g).to(dev, torch.bfloat16)
    unique_t, t_index = (t.to(dev) for t in row_timesteps(lay, *Schedule().timesteps()[10]))
    return lay, video, audio, text, unique_t, t_index


@torch.no_grad()
def phase_reference(ctx: Ctx) -> None:
    from h3trt.models.dit import EagerDiT, build_dit, rope_inv_freq
    from h3trt.models.weight_layout import deinterleave_qkv

    if checkpoint_complete(ctx) is None:
        ctx.results["reference"] = {"error": f"no checkpoint in {ctx.ckpt}: run --phase checkpoint first (the machine "
                                             "may have been released between calls, taking /dev/shm with it)"}
        ctx.log(f"reference: {ctx.results['reference']['error']}")
        return
    cfg, dev = ctx.cfg, ctx.device
    out = ctx.results["reference"] = {"evaluation_rows": None, "notes": []}
    nvml = NvmlSampler().start()
    t0 = time.perf_counter()
    # The checkpoint's tensors, regenerated (QKV de-interleaved as the loader does), in place of a 66 GB read.
    state = {}
    for name, shape, dtype in dit_tensor_specs(cfg):
        t = random_tensor(name, shape, dtype, dev)
        state[name] = deinterleave_qkv(t, cfg.num_heads, cfg.head_dim) if name.endswith(".attn.qkv_proj.weight") else t
    out["weights_s"] = round(time.perf_counter() - t0, 2)
    out["weights_match_checkpoint"] = _matches_checkpoint(ctx, "blocks.0.mlp.fc2.weight", state)
    model = build_dit(cfg, torch.bfloat16, device="meta")
    model.load_state_dict(state, strict=True, assign=True)
    model.rope_inv_freq = rope_inv_freq(cfg).to(dev)
    model.eval()
    inputs = reference_inputs(ctx)
    lay, video, audio, text, unique_t, t_index = inputs
    out["evaluation_rows"] = lay.seq_len
    ctx.log(f"reference: weights on {dev} in {out['weights_s']:.1f} s; {lay.seq_len} rows per evaluation")

    eager = EagerDiT(model)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    out["h3trt_eager"], eager_out = timed_runs(lambda: eager(video, audio, text, unique_t, t_index, lay), dev,
                                               ctx.args.eager_evals, nvml)
    out["h3trt_eager"]["peak_gib"] = peak_gib(dev)
    eager_out = tuple(o.cpu() for o in eager_out)
    ctx.log(f"reference: h3trt eager {out['h3trt_eager']['s']:.3f} s per evaluation")
    ctx.save()
    del model, eager
    out["diffusers"], ref_out = time_diffusers(ctx, state, inputs, nvml)
    if ref_out is not None:
        out["h3trt_eager_rel_err_vs_diffusers"] = [_rel(a, b.cpu()) for a, b in zip(eager_out, ref_out)]
    ctx.log(f"reference: Diffusers {out['diffusers']['s']:.3f} s per evaluation"
            + (f" ({out['diffusers']['how']})" if "how" in out["diffusers"] else "")
            + (f" (h3trt eager vs Diffusers rel. err {out['h3trt_eager_rel_err_vs_diffusers']})" if ref_out is not None
               else ""))
    ctx.save()
    del state, eager_out, ref_out
    release(dev)
    out["vae_decode"] = reference_decode(ctx, nvml)
    nvml.stop()
    d = out["diffusers"]
    decode_s = out["vae_decode"].get("s")
    out["diffusers_end_to_end_s"] = (round(FULL_EVALUATIONS * d["s"] + decode_s, 2) if decode_s is not None else None)
    out["diffusers_end_to_end_joules"] = (round(FULL_EVALUATIONS * d["joules"] + out["vae_decode"]["joules"], 0)
                                          if d.get("joules") is not None and out["vae_decode"].get("joules") else None)
    out["notes"].append(f"Diffusers end to end = {FULL_EVALUATIONS} x its measured evaluation (median of "
                        f"{d['timed_runs']} after a warm-up) + its bf16 VAE decode of the clip; no text encode, "
                        "audio decode, mux or load (in Diffusers' favour).")


def time_diffusers(ctx: Ctx, state: dict, inputs, nvml: NvmlSampler) -> tuple[dict, tuple | None]:
    """Diffusers' model over `state` (emptied: each tensor is converted to Diffusers' layout and released in turn),
    timed at full depth; on an out-of-memory error, at half and a quarter of its blocks, extrapolated to all."""
    from diffusers import MiniMaxH3Transformer3DModel
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3RotaryPosEmbed

    from h3trt.models.checkpoint.writer import diffusers_state_dict

    cfg, dev = ctx.cfg, ctx.device
    converted = {}
    for key in list(state):
        converted.update(diffusers_state_dict({key: state.pop(key)}, cfg))
    with torch.device("meta"):
        ref = MiniMaxH3Transformer3DModel(**cfg.to_diffusers_kwargs())
    ref.load_state_dict(converted, strict=True, assign=True)
    del converted
    ref.rope = MiniMaxH3RotaryPosEmbed(cfg.rope_freq_dim, cfg.rope_theta).to(dev)  # non-persistent: rebuilt
    left = [n for n, t in list(ref.named_parameters()) + list(ref.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"Diffusers model tensors left on meta after loading: {left[:5]}")
    ref.eval()
    lay, video, audio, text, unique_t, t_index = inputs
    args = dict(hidden_states=video, audio_hidden_states=audio, encoder_hidden_states=text, timestep=unique_t,
                timestep_indices=t_index, token_tags=lay.token_tags, position_ids=lay.position_ids,
                video_indices=lay.video_index, audio_indices=lay.audio_index, text_indices=lay.text_index,
                return_dict=False)
    try:
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        timing, ref_out = timed_runs(lambda: ref(**args), dev, ctx.args.ref_evals, nvml)
        return {**timing, "peak_gib": peak_gib(dev)}, tuple(o.cpu() for o in ref_out)
    except torch.OutOfMemoryError as e:
        oom = f"{type(e).__name__} at full depth ({peak_gib(dev)} GiB peak): {str(e).splitlines()[0][:200]}"
        ctx.log(f"reference: Diffusers does not fit at full depth: {oom}")
    release(dev)
    depths, times = [cfg.num_layers // 2, cfg.num_layers // 4], []
    for depth in depths:
        del ref.transformer_blocks[depth:]  # the later blocks' weights go; the earlier ones stay resident
        release(dev)
        timing, _ = timed_runs(lambda: ref(**args), dev, ctx.args.ref_evals, nvml)
        times.append(timing)
    per_block = (times[0]["s"] - times[1]["s"]) / (depths[0] - depths[1])
    full = times[0]["s"] + (cfg.num_layers - depths[0]) * per_block
    how = (f"extrapolated: the full model ran out of memory on this card; timed with {depths[0]} and {depths[1]} of "
           f"{cfg.num_layers} blocks resident ({times[0]['s']:.3f} / {times[1]['s']:.3f} s), {per_block:.4f} s a "
           f"block, linearly to {cfg.num_layers}")
    return {"s": round(full, 4), "first_s": None, "runs": times[0]["runs"], "timed_runs": times[0]["timed_runs"],
            "joules": None, "how": how, "full_depth_error": oom, "by_depth": dict(zip(map(str, depths), times)),
            "peak_gib": peak_gib(dev)}, None


def release(dev: torch.device) -> None:
    import gc

    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def reference_decode(ctx: Ctx, nvml: NvmlSampler) -> dict:
    """Diffusers' own tiled decode (`AutoencoderKLMiniMaxH3.decode`) of the clip's latent, the VAE loaded in bf16 the
    way its pipeline loads it: the `_keep_in_fp32_modules` stay fp32."""
    from h3trt.models.checkpoint.vae import load_video_vae

    dev, geo = ctx.device, ctx.geometry
    vae = load_video_vae(ctx.ckpt / "FL2VA", dev, dtype=torch.bfloat16)
    z = torch.randn(1, vae.vae.config.latent_channels, geo.latent_frames, geo.latent_height, geo.latent_width,
                    generator=torch.Generator().manual_seed(1)).to(dev)
    z = vae.denormalize(z)
    result = {"dtype": "bf16 (fp32 _keep_in_fp32_modules)", "latent": list(z.shape)}
    try:
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        timing, frames = timed_runs(lambda: vae.vae.decode(z, return_dict=False)[0], dev, ctx.args.ref_decodes, nvml)
        result.update(timing, frames=list(frames.shape), peak_gib=peak_gib(dev))
        ctx.log(f"reference: Diffusers bf16 VAE decode {timing['s']:.2f} s for {frames.shape[2]} frames")
    except Exception as e:  # recorded as a failed row, not replaced by another decode
        result["error"] = f"{type(e).__name__}: {e}"
        ctx.log(f"reference: Diffusers bf16 VAE decode failed: {result['error']}")
    ctx.save()
    return result


def _matches_checkpoint(ctx: Ctx, name: str, state: dict) -> bool:
    from safetensors import safe_open

    index = json.loads((ctx.ckpt / "FL2VA" / "transformer" / "model.safetensors.index.json").read_text())
    with safe_open(str(ctx.ckpt / "FL2VA" / "transformer" / index["weight_map"][name]), "pt") as f:
        return bool(torch.equal(f.get_tensor(name), state[name].cpu()))


def _rel(a, b) -> float:
    return round(((a.float() - b.float()).norm() / b.float().norm()).item(), 6)
