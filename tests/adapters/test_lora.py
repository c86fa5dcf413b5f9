"""LoRA merging against diffusers 0.42.1's `MiniMaxH3LoraLoaderMixin` (peft, unfused) with identical weights.

Each format the reference loader reads is written from one set of random original-name factors (mixed ranks, as the
published H3 LoRAs are: 4 on attention and FFN, 2 on the AdaLN projections); h3trt merges the file into the native
weights, diffusers loads the same file as a peft adapter, and the two forwards must agree.

Tolerance: fp32 forward, max abs error <= REL_TOL x max |output|, while the LoRA moves the output by > 100 x that.
The tiny config has 128-wide heads, because the reference de-interleaves DiffSynth QKV with a fixed head_dim of 128.
"""

import pytest
import torch
from diffusers import MiniMaxH3Transformer3DModel
from diffusers.loaders.single_file_utils import convert_minimax_h3_transformer_checkpoint_to_diffusers

from h3trt.adapters.merge import LoraSpec, merge_loras
from h3trt.cli import main
from h3trt.models.checkpoint.writer import random_state_dict
from h3trt.models.dit import build_dit
from h3trt.models.lora_format import LoraError, read_lora
from h3trt.models.packing import row_timesteps

from lora_cases import (CFG, FORMATS, KOHYA_ALPHAS, LAYOUT, ReferencePipe, adapter_metadata, fmt_diffusers, fmt_kohya,
                        fmt_original, original_factors, write)

REL_TOL = 2e-5


@pytest.fixture(scope="module")
def weights():
    return {"FL2VA": random_state_dict(CFG, 0), "Ref2VA": random_state_dict(CFG, 1)}


def h3trt_model(state, loras, task="t2va"):
    model = build_dit(CFG, torch.float32)
    model.load_state_dict(state)
    return model, merge_loras(model, loras, task)


def diffusers_model(state):
    model = MiniMaxH3Transformer3DModel(**CFG.to_diffusers_kwargs())
    model.load_state_dict(convert_minimax_h3_transformer_checkpoint_to_diffusers(dict(state), model.config))
    return model.eval()


def forward_both(ours, ref):
    g = torch.Generator().manual_seed(5)
    video = torch.randn(1, LAYOUT.video_index.numel(), CFG.video_patch_dim, generator=g)
    audio = torch.randn(1, LAYOUT.audio_index.numel(), CFG.audio_in_channels, generator=g)
    text = torch.randn(1, LAYOUT.text_index.numel(), CFG.text_dim, generator=g)
    unique_t, t_index = row_timesteps(LAYOUT, 0.3125, 0.55)
    with torch.no_grad():
        a = ours(video, audio, text, unique_t, t_index, LAYOUT.token_tags, LAYOUT.position_ids, LAYOUT.video_index,
                 LAYOUT.audio_index, LAYOUT.text_index)
        b = ref(hidden_states=video, audio_hidden_states=audio, encoder_hidden_states=text, timestep=unique_t,
                timestep_indices=t_index, token_tags=LAYOUT.token_tags, position_ids=LAYOUT.position_ids,
                video_indices=LAYOUT.video_index, audio_indices=LAYOUT.audio_index, text_indices=LAYOUT.text_index,
                return_dict=False)
    return a, b


def check_close(a, b, base):
    for got, want, before in zip(a, b, base):
        err, scale = (got - want).abs().max().item(), want.abs().max().item()
        assert scale > 0.1
        assert err <= REL_TOL * scale, f"max abs err {err:.3e} > {REL_TOL} x {scale:.3e}"
        assert (want - before).abs().max().item() > 100 * REL_TOL * scale, "the LoRA changed nothing"


def merged_like_diffusers(path, weights, scale=0.8) -> list[dict]:
    """Merge the LoRA file at `scale` into the FL2VA weights and load it into diffusers' model as a peft adapter
    at that strength; the two forwards must agree. Returns h3trt's LoRA records."""
    base, _ = h3trt_model(weights["FL2VA"], [])
    ours, records = h3trt_model(weights["FL2VA"], [LoraSpec(path, scale)])
    ref = diffusers_model(weights["FL2VA"])
    ReferencePipe(ref).load_lora_weights(str(path), adapter_name="x")
    ref.set_adapters(["x"], [scale])
    a, b = forward_both(ours, ref)
    check_close(a, b, forward_both(base, ref)[0])
    return records


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_merged_model_matches_diffusers_with_the_lora_loaded(name, weights, tmp_path):
    build, meta = FORMATS[name]
    tensors = build(original_factors(1))
    if meta == "adapter":
        meta = adapter_metadata(tensors)
    path = write(tmp_path / f"{name}.safetensors", tensors, meta)
    records = merged_like_diffusers(path, weights)
    assert records[0]["scale"] == 0.8 and len(records[0]["sha256"]) == 64 and records[0]["partition"] == "FL2VA"


def test_a_metadata_alpha_that_is_not_a_number_is_ignored_as_diffusers_ignores_it(weights, tmp_path, capsys):
    """diffusers warns and loads such a file with alpha == rank; h3trt merges it the same way, says so on stderr and
    records the rule it used (the record reaches the manifest and each clip's JSON)."""
    path = write(tmp_path / "odd_alpha.safetensors", fmt_original(original_factors(6), "diffusion_model."),
                 {"alpha": "sixteen"})
    records = merged_like_diffusers(path, weights)
    assert "'sixteen' is not a number" in records[0]["alpha"] and "alpha == rank" in records[0]["alpha"]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("h3trt: warning: --lora") and "'sixteen'" in err[0]

    # NaN parses as a float: diffusers would scale every module by it; h3trt refuses the file.
    nan = write(tmp_path / "nan_alpha.safetensors", fmt_original(original_factors(6)), {"alpha": "nan"})
    with pytest.raises(LoraError, match="alpha = 'nan'.*non-finite"):
        h3trt_model(weights["FL2VA"], [LoraSpec(nan)])


def test_two_loras_and_the_ref2va_partition(weights, tmp_path):
    """transformer_ref.-prefixed layers go to Ref2VA; two LoRAs at their own scales add up, as two active adapters."""
    ref_file = write(tmp_path / "ref.safetensors", fmt_diffusers(original_factors(2), "transformer_ref"))
    plain = write(tmp_path / "plain.safetensors", fmt_kohya(original_factors(3), KOHYA_ALPHAS))
    base, _ = h3trt_model(weights["Ref2VA"], [], "ref2va")
    ours, records = h3trt_model(weights["Ref2VA"], [LoraSpec(ref_file, 1.0), LoraSpec(plain, -0.6)], "ref2va")
    ref = diffusers_model(weights["Ref2VA"])
    pipe = ReferencePipe(transformer_ref=ref)
    pipe.load_lora_weights(str(ref_file), adapter_name="a")
    pipe.load_lora_weights(str(plain), adapter_name="b")  # transformer.-prefixed: routed to the lone Ref2VA model
    ref.set_adapters(["a", "b"], [1.0, -0.6])
    a, b = forward_both(ours, ref)
    check_close(a, b, forward_both(base, ref)[0])
    assert [r["component"] for r in records] == ["transformer_ref", "transformer"]
    assert {r["partition"] for r in records} == {"Ref2VA"}


def test_wrong_partition_and_pruned_loras_are_refused_in_one_line(weights, tmp_path):
    ref_file = write(tmp_path / "ref.safetensors", fmt_diffusers(original_factors(2), "transformer_ref"))
    with pytest.raises(LoraError, match="trained against the Ref2VA partition.*--task ref2va"):
        h3trt_model(weights["FL2VA"], [LoraSpec(ref_file)])
    with pytest.raises(ValueError, match="does not hold a `transformer_ref`"):  # the reference refuses it too
        ReferencePipe(diffusers_model(weights["FL2VA"])).load_lora_weights(str(ref_file))

    # A pruned checkpoint's adaln_proj is rank-reduced ([96768, 8] at full size): its LoRA takes 8 inputs.
    pruned = fmt_original(original_factors(4), "diffusion_model.")
    pruned["diffusion_model.blocks.0.adaln_proj.linear.lora_A.weight"] = torch.randn(2, 8)
    path = write(tmp_path / "pruned.safetensors", pruned)
    with pytest.raises(LoraError, match="pruned MiniMax-H3 checkpoint .*takes 8 inputs") as info:
        h3trt_model(weights["FL2VA"], [LoraSpec(path)])
    assert "\n" not in str(info.value)
    with pytest.raises(Exception, match="size mismatch"):  # the reference: a size mismatch
        ReferencePipe(diffusers_model(weights["FL2VA"])).load_lora_weights(str(path))

    table = write(tmp_path / "table.safetensors", {"diffusion_model.adaln_t_table.lora_A.weight": torch.randn(2, 8)})
    with pytest.raises(LoraError, match="pruned"):
        h3trt_model(weights["FL2VA"], [LoraSpec(table)])


def test_lora_spec_parsing(tmp_path):
    assert LoraSpec.parse("a/b.safetensors") == LoraSpec(tmp_path.__class__("a/b.safetensors"), 1.0)
    assert LoraSpec.parse("a/b.safetensors:0.5").scale == 0.5
    assert str(LoraSpec.parse("C:/x.safetensors").path) == "C:/x.safetensors"
    with pytest.raises(LoraError, match="does not exist"):
        h3trt_model(random_state_dict(CFG, 0), [LoraSpec(tmp_path / "missing.safetensors")])


@pytest.mark.parametrize("scale", ["nan", "inf", "-inf"])
def test_a_scale_that_is_not_finite_says_so(scale, capsys):
    """`f.safetensors:nan` is a scale that is not finite, not a file named that (which then "does not exist")."""
    with pytest.raises(LoraError, match="the scale must be a finite number"):
        LoraSpec.parse(f"f.safetensors:{scale}")
    with pytest.raises(SystemExit) as exit_:  # the CLI's argparse type: its message, not "invalid parse value"
        main(["run", "--prompt", "x", "--output", "x.mp4", "--lora", f"f.safetensors:{scale}"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "the scale must be a finite number" in err and "does not exist" not in err


def test_a_file_without_lora_names_is_refused_counting_them_right(tmp_path):
    """One key without 'lora' was "(and 0 more) carry"; one is named alone, more are counted."""
    for keys, words in ((["transformer.a.weight"], "transformer.a.weight carries no 'lora' in its name."),
                        (["transformer.a.weight", "transformer.b.weight"],
                         "transformer.a.weight (and 1 more) carry no 'lora' in their names.")):
        path = write(tmp_path / f"{len(keys)}.safetensors", {k: torch.zeros(2, 2) for k in keys})
        with pytest.raises(LoraError) as refused:
            read_lora(path, CFG.head_dim)
        assert str(refused.value) == f"--lora {path} is not a LoRA file: {words}"
