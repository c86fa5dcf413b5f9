"""Benchmark the H3 DiT block and a 4-block stack on one GPU against the Diffusers reference, in the same run.

    python scripts/bench_dit.py blocks --out bench/results/dit_blocks.json
    python scripts/bench_dit.py stack  --out bench/results/dit_stack.json [--layers 4]

Shape: MiniMax-H3 at full width (hidden 5376, 56 heads x 128, SwiGLU 14336), random bf16 weights (std 0.02), the
validated T2VA workload 1344x768, 124 frames: 128 text + 2 x 207 audio + 37 x 24 x 42 video rows = 37,838 tokens.

`blocks`: ms per block for the Diffusers block (eager, default SDPA), the Diffusers block under torch.compile, the
h3trt eager block and the h3trt compiled block (built exactly as `h3trt build` builds it: exported with dynamic
sequence length, Inductor standalone_compile, saved, loaded), one compiled row per --attention-kernels kernel
(h3trt_compiled_cudnn, h3trt_compiled_fa3; a kernel the GPU cannot run is skipped, the reason recorded). Median of 5
after 2 warm-ups, CUDA events.
`stack`: writes a full-width random checkpoint with --layers blocks in the official layout, runs `h3trt build`
on it (bf16, inductor, AdaLN baked), then in a fresh process loads the bundle and times a denoising step of the
stack against the h3trt eager model and the Diffusers model with the same weights; peak memory for each.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

from bench_common import ROOT, rel_err, write_json  # noqa: E402  (first: it puts this checkout on sys.path)

from h3trt.build.attention_choice import median_cuda_ms  # noqa: E402

TEXT, LATENT_T, LATENT_H, LATENT_W, AUDIO = 128, 37, 48, 84, 207


def bench(fn, n=5, warm=2) -> float:
    return median_cuda_ms(fn, n, warm)


def env() -> dict:
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(), "precision": "bf16",
            "shape": {"width": 1344, "height": 768, "frames": 124, "tokens": TEXT + 2 * AUDIO + LATENT_T * 24 * 42}}


def layout():
    from h3trt.models.packing import pack_t2va, text_tags_for

    return pack_t2va(text_tags_for(TEXT), LATENT_T, LATENT_H, LATENT_W, AUDIO)


def diffusers_block_to_native(block) -> dict[str, torch.Tensor]:
    """A diffusers MiniMaxH3TransformerBlock's weights under h3trt's native block names."""
    from h3trt.models.checkpoint.names import native_name

    sd = block.state_dict()
    out = {}
    for key, value in sd.items():
        if ".to_q." in key or ".to_k." in key or ".to_v." in key:
            continue
        name = native_name("transformer_blocks.0." + key).removeprefix("blocks.0.")
        if name.endswith("mlp.fc1.weight"):
            value_half, gate = value.chunk(2)
            value = torch.cat([gate, value_half])
        out[name] = value
    out["attn.qkv_proj.weight"] = torch.cat([sd["attn.to_q.weight"], sd["attn.to_k.weight"], sd["attn.to_v.weight"]])
    return out


# Compile-option experiments for the block (--variants): (static shapes?, Inductor config patch).
VARIANTS = {
    "static_shapes": (True, {}),
    "coordinate_descent": (False, {"coordinate_descent_tuning": True}),
    "max_autotune_gemm": (False, {"max_autotune_gemm": True}),
}


def block_pair(cfg, lay, dev: str):
    """A Diffusers block with random bf16 weights (std 0.02), the h3trt block loaded from the same weights, and the
    inputs both take at layout `lay`: (ref, ours, x, temb, idx, pos, mod, (cos, sin))."""
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3TransformerBlock

    from h3trt.models.dit import Block, rope_inv_freq, rope_tables
    from h3trt.models.packing import row_timesteps

    ref = MiniMaxH3TransformerBlock(cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.ffn_dim, cfg.time_embed_dim,
                                    1e-5, 1e-5).to(dev, torch.bfloat16).eval()
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(1, lay.seq_len, cfg.hidden_size, device=dev, dtype=torch.bfloat16)
    temb = torch.randn(2, cfg.time_embed_dim, device=dev, dtype=torch.float32)
    _, t_index = row_timesteps(lay, 0.25, 0.5)
    idx = (t_index * 3 + lay.token_tags).to(dev)
    pos = lay.position_ids.to(dev)
    ours = Block(cfg).to(dev, torch.bfloat16).eval()
    ours.load_state_dict(diffusers_block_to_native(ref), strict=True)
    with torch.no_grad():
        mod = ours.modulation(temb).contiguous()
    return ref, ours, x, temb, idx, pos, mod, rope_tables(pos, rope_inv_freq(cfg).to(dev))


def run_blocks(out_path: Path, variants: bool = False, kernels: tuple[str, ...] = ("cudnn", "fa3")) -> dict:
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3RotaryPosEmbed
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    from h3trt.build.backends import compile_segment
    from h3trt.build.segments import block_segment
    from h3trt.models.config import H3Config

    torch.manual_seed(0)
    dev, cfg = "cuda", H3Config()
    lay = layout()
    result = {"env": env(), "ms_per_block": {}, "notes": []}
    ref, ours, x, temb, idx, pos, mod, (cos, sin) = block_pair(cfg, lay, dev)
    rot = MiniMaxH3RotaryPosEmbed().to(dev)(pos)
    ms = result["ms_per_block"]
    with torch.no_grad():
        want = ref(x, temb, idx, rot)
        ms["diffusers_eager"] = bench(lambda: ref(x, temb, idx, rot))
        print(f"diffusers block eager        {ms['diffusers_eager']:7.1f} ms", flush=True)

        got = ours(x, mod, idx, (cos, sin))
        result["h3trt_eager_rel_err_vs_diffusers"] = rel_err(got, want)
        ms["h3trt_eager"] = bench(lambda: ours(x, mod, idx, (cos, sin)))
        print(f"h3trt block eager            {ms['h3trt_eager']:7.1f} ms  (rel err vs diffusers "
              f"{result['h3trt_eager_rel_err_vs_diffusers']:.1e})", flush=True)

        from h3trt.models.attention import kernel_problem

        result["skipped"] = {}
        for kernel in kernels:  # one compiled row per attention kernel (`h3trt build --attention K`)
            problem = kernel_problem(kernel, "bf16", torch.device(dev))
            if problem:
                result["skipped"][f"h3trt_compiled_{kernel}"] = problem
                print(f"h3trt block compiled [{kernel}] skipped: {problem}", flush=True)
                continue
            spec = block_segment(cfg, torch.bfloat16, attention=kernel)
            weights = [dict(ours.named_parameters())[n].detach() for n in spec.weights]
            example = [x, mod, idx, cos, sin, *weights]
            work = Path(tempfile.mkdtemp(prefix="bench-block-"))
            t0 = time.perf_counter()
            with temporary_cache_dir(str(work / "cache")):
                entry = compile_segment("inductor", spec, example, work)  # exactly as `h3trt build` compiles it
            result[f"block_compile_s_{kernel}"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            seg = _load_local(entry, work, dev)
            (y,) = seg(*example)
            torch.cuda.synchronize()
            result[f"block_load_first_call_s_{kernel}"] = time.perf_counter() - t0
            result[f"h3trt_compiled_{kernel}_rel_err_vs_eager"] = rel_err(y, got)
            ms[f"h3trt_compiled_{kernel}"] = bench(lambda: seg(*example))
            print(f"h3trt block compiled [{kernel}] {ms[f'h3trt_compiled_{kernel}']:7.1f} ms  (compile "
                  f"{result[f'block_compile_s_{kernel}']:.0f} s, rel err vs eager "
                  f"{result[f'h3trt_compiled_{kernel}_rel_err_vs_eager']:.1e}, "
                  f"{ms['diffusers_eager'] / ms[f'h3trt_compiled_{kernel}']:.3f}x vs Diffusers eager)", flush=True)
            write_json(out_path, result)

        for variant, (static, patch) in VARIANTS.items() if variants else ():
            vspec = block_segment(cfg, torch.bfloat16, attention=kernels[0])
            if static:
                vspec.dynamic = {}
            vwork = Path(tempfile.mkdtemp(prefix=f"bench-{variant}-"))
            t0 = time.perf_counter()
            from h3trt.build import backends

            with temporary_cache_dir(str(vwork / "cache")), \
                    mock.patch.dict(backends.INDUCTOR_OPTIONS, patch):
                ventry = compile_segment("inductor", vspec, example, vwork)
            vseg = _load_local(ventry, vwork, dev)
            ms[f"h3trt_compiled_{variant}"] = bench(lambda: vseg(*example))
            print(f"h3trt block compiled [{variant}] {ms[f'h3trt_compiled_{variant}']:7.1f} ms "
                  f"(compile {time.perf_counter() - t0:.0f} s)", flush=True)
            write_json(out_path, result)

        compiled_ref = torch.compile(ref)
        t0 = time.perf_counter()
        compiled_ref(x, temb, idx, rot)
        result["diffusers_torch_compile_s"] = time.perf_counter() - t0
        ms["diffusers_torch_compile"] = bench(lambda: compiled_ref(x, temb, idx, rot))
        print(f"diffusers block torch.compile {ms['diffusers_torch_compile']:7.1f} ms", flush=True)
    result["speedup_vs_diffusers_eager"] = {k: ms["diffusers_eager"] / v for k, v in ms.items()}
    result["notes"].append("h3trt blocks read a precomputed modulation table (AdaLN baked at build time); the "
                           "Diffusers block computes adaln_proj(temb) inside every call.")
    result["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    write_json(out_path, result)
    return result


def _load_local(entry: dict, work: Path, dev: str):
    from h3trt.engines.loaders import LoadedSegment

    artifact = torch._inductor.CompiledArtifact.load(path=str(work / entry["artifact"]), format="binary")
    return LoadedSegment("block", artifact)


def run_stack(out_path: Path, layers: int) -> dict:
    from h3trt.build.builder import build
    from h3trt.build.config import BuildConfig, Profile
    from h3trt.models.checkpoint.writer import random_state_dict, save_official
    from h3trt.models.config import H3Config

    result = {"env": env(), "layers": layers}
    cfg = H3Config(num_layers=layers)
    work = Path(tempfile.mkdtemp(prefix="bench-stack-"))
    t0 = time.perf_counter()
    state = random_state_dict(cfg, 0)
    save_official(work / "ckpt", cfg, {"FL2VA": state}, torch.bfloat16, shards=4)
    del state
    result["checkpoint_write_s"] = time.perf_counter() - t0
    print(f"wrote a {layers}-layer full-width checkpoint in {result['checkpoint_write_s']:.0f} s", flush=True)
    t0 = time.perf_counter()
    manifest = build(BuildConfig(work / "ckpt", work / "bundle", profiles=(Profile(1344, 768, 5.0),), device="cuda"),
                     log=lambda m: print("  build:", m, flush=True))
    result["build_s"] = time.perf_counter() - t0
    result["bundle_bytes"] = manifest.total_bytes
    result["adaln"] = manifest.raw["adaln"]
    result["build_timings_s"] = manifest.build_timings_s
    print(f"built the bundle in {result['build_s']:.0f} s, {result['bundle_bytes'] / 1e9:.2f} GB", flush=True)
    write_json(out_path, result)
    proc = subprocess.run([sys.executable, __file__, "_stack_child", str(work)], capture_output=True, text=True,
                          timeout=500)
    print(proc.stdout[-3000:], proc.stderr[-3000:], flush=True)
    child = json.loads((work / "child.json").read_text())
    result.update(child)
    write_json(out_path, result)
    return result


def stack_child(work: Path) -> None:
    """Fresh process: load the bundle (timed), then one DiT evaluation of each implementation on the same inputs."""
    from diffusers import MiniMaxH3Transformer3DModel

    from h3trt.engines.bundle import Engine
    from h3trt.engines.guard import no_compile
    from h3trt.models.checkpoint.reader import load_dit
    from h3trt.models.checkpoint.writer import diffusers_state_dict
    from h3trt.models.packing import row_timesteps
    from h3trt.models.dit import EagerDiT

    dev = torch.device("cuda")
    out = {}
    t0 = time.perf_counter()
    engine = Engine.load(work / "bundle", dev)
    torch.cuda.synchronize()
    out["bundle_load_s"] = time.perf_counter() - t0
    cfg = engine.dit.cfg
    lay = layout().to(dev)
    g = torch.Generator().manual_seed(0)
    video = torch.randn(1, lay.video_index.numel(), cfg.video_patch_dim, generator=g).to(dev)
    audio = torch.randn(1, lay.audio_index.numel(), cfg.audio_in_channels, generator=g).to(dev)
    text = torch.randn(1, TEXT, cfg.text_dim, generator=g).to(dev, torch.bfloat16)
    from h3trt.models.sampler import Schedule

    schedule_t = Schedule().timesteps()[10]  # a (video t, audio t) pair of the baked 50-step schedule
    unique_t, t_index = (t.to(dev) for t in row_timesteps(lay, *schedule_t))
    ms, peak = {}, {}
    with torch.no_grad():
        with no_compile():
            torch.cuda.reset_peak_memory_stats()
            engine_out = engine.dit(video, audio, text, unique_t, t_index, lay)
            ms["h3trt_engine"] = bench(lambda: engine.dit(video, audio, text, unique_t, t_index, lay), n=3, warm=1)
            peak["h3trt_engine"] = torch.cuda.max_memory_allocated() / 2**30
        del engine
        torch.cuda.empty_cache()
        model, _ = load_dit(work / "ckpt", "t2va", dtype=torch.bfloat16, device=dev)
        eager = EagerDiT(model)
        torch.cuda.reset_peak_memory_stats()
        eager_out = eager(video, audio, text, unique_t, t_index, lay)
        ms["h3trt_eager"] = bench(lambda: eager(video, audio, text, unique_t, t_index, lay), n=3, warm=1)
        peak["h3trt_eager"] = torch.cuda.max_memory_allocated() / 2**30
        out["engine_rel_err_vs_eager"] = [rel_err(a, b) for a, b in zip(engine_out, eager_out)]
        ref = MiniMaxH3Transformer3DModel(**cfg.to_diffusers_kwargs()).to(torch.bfloat16)
        for name in ("proj_in", "audio_proj_in", "time_embedder", "proj_out", "audio_proj_out"):
            getattr(ref, name).float()
        ref.load_state_dict(diffusers_state_dict(model.state_dict(), cfg), strict=True)
        ref = ref.to(dev).eval()
        del model, eager
        torch.cuda.empty_cache()
        args = dict(hidden_states=video, audio_hidden_states=audio, encoder_hidden_states=text, timestep=unique_t,
                    timestep_indices=t_index, token_tags=lay.token_tags, position_ids=lay.position_ids,
                    video_indices=lay.video_index, audio_indices=lay.audio_index, text_indices=lay.text_index,
                    return_dict=False)
        torch.cuda.reset_peak_memory_stats()
        ref_out = ref(**args)
        ms["diffusers_eager"] = bench(lambda: ref(**args), n=3, warm=1)
        peak["diffusers_eager"] = torch.cuda.max_memory_allocated() / 2**30
        out["engine_rel_err_vs_diffusers"] = [rel_err(a, b) for a, b in zip(engine_out, ref_out)]
    out["ms_per_step"] = ms
    out["peak_memory_gib"] = peak
    out["speedup_vs_diffusers_eager"] = {k: ms["diffusers_eager"] / v for k, v in ms.items()}
    for k, v in ms.items():
        print(f"{k:<18} {v:8.1f} ms/step  peak {peak[k]:5.1f} GiB", flush=True)
    (work / "child.json").write_text(json.dumps(out, indent=1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["blocks", "stack", "_stack_child"])
    p.add_argument("arg", nargs="?")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--variants", action="store_true", help="blocks: also time other compile options")
    p.add_argument("--attention-kernels", nargs="+", default=["cudnn", "fa3"], choices=("cudnn", "fa3"),
                   help="blocks: a compiled row per attention kernel (default: cudnn fa3)")
    args = p.parse_args()
    if args.what == "_stack_child":
        stack_child(Path(args.arg))
    elif args.what == "blocks":
        run_blocks(args.out or ROOT / "bench/results/dit_blocks.json", args.variants, tuple(args.attention_kernels))
    else:
        run_stack(args.out or ROOT / "bench/results/dit_stack.json", args.layers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
