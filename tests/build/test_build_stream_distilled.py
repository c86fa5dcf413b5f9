"""A --distilled file built a block at a time (h3trt/build/stream.py) against the whole build, on the CPU: a pair of
full builds (the CLI, fresh processes: a FastH3 --distilled file in bf16 with sparse attention, its served tasks and
rungs in the manifest) compares every file; the bakes alone compare a --distilled file fused block by block (FastH3
dense calibrated in FP8, PDD with its heads per forward) and a full FastH3-VSA export (the gate read per block, its
calibration trajectories attending with VSA, its sidecar's rungs baked). The helpers (stream_pairs.py) and the
4-layer model (conftest.py tiny4) are test_build_stream.py's; a file of its own so that its pair of builds runs beside
that file's pair under `--dist loadfile`.
"""

import json

import pytest
import torch
from safetensors.torch import load_file

from h3trt.models.config import H3Config
from h3trt.models.distilled.families import DistilledSpec
from h3trt.models.distilled.writer import write_fasth3, write_pdd

from stream_pairs import (LAYERS, assert_same_bundle, build_pair, compare_weights, config, streamed_budget,
                          tiny_checkpoint)

pytestmark = pytest.mark.usefixtures("no_bundle_served_here")  # conftest.py


@pytest.fixture(scope="module")
def distilled4(tmp_path_factory, tiny_root):
    """For the 4-layer model: a FastH3 dense file, a FastH3-VSA file (its gates `.set_weight`) and a PDD file
    (models/distilled/writer.py: random, in their published formats); and a full FastH3-VSA export of its own (the
    gate in every block, the V2 sidecar's 8 rungs)."""
    root = tmp_path_factory.mktemp("distilled4")
    cfg = H3Config.tiny(num_layers=LAYERS)
    files = {"fasth3": write_fasth3(root / "fasth3.safetensors", cfg, seed=5),
             "fasth3-vsa": write_fasth3(root / "fasth3-vsa.safetensors", cfg, seed=8, gates=True),
             "pdd": write_pdd(root / "pdd.safetensors", cfg, seed=6)}
    tiny_checkpoint(root / "vsa", tiny_root, H3Config.tiny(num_layers=LAYERS, vsa_gate=True), 4)
    (root / "vsa" / "ckpt" / "FL2VA" / "fastvideo_inference.json").write_text(json.dumps({
        "schema_version": "fasth3-inference-contract-v1", "dmd_denoising_steps": [999, 874, 749, 624, 500, 375, 250,
                                                                                  125],
        "num_inference_steps": 9, "transformer_forwards": 8, "guidance_scale": 1.0, "task": "t2av",
        "attention_backend": "VIDEO_SPARSE_ATTN_H3", "vsa_tile_size": 64, "vsa_sparsity": 0.5}))
    return root, files


@pytest.mark.parametrize("case", ["fasth3-dense-fp8", "fasth3-vsa-file-fp8", "pdd-bf16-steps7", "vsa-export-fp8"])
def test_streamed_distilled_and_vsa_weights_equal_whole_weights(tmp_path, tiny4, distilled4, case):
    """A --distilled file fused block by block as each block arrives (its model-level patches where the resident
    parts load), and a FastH3-VSA export (the gate read with each block; calibration attending with VSA, densely in
    the first evaluation and block 1, at 0.5 after; the sidecar's rungs in the AdaLN tables), against the whole
    build. A FastH3-VSA file on the base checkpoint: the model built with the file's gates, which the checkpoint lacks
    (each block's made by the fusion's assign as the block arrives), calibrated attending with VSA on the family's
    first 2 rungs. Calibration runs on 2 evaluations per prompt, the second sparse."""
    root, files = distilled4
    calibrated = {"precision": "fp8", "calib_prompts": tiny4 / "prompts.txt", "calib_steps": 3}
    model = tiny4
    vsa = {"vsa_sparsity": 0.5, "vsa_dense_first_steps": 1, "vsa_dense_layers": (1,)}
    if case == "fasth3-dense-fp8":
        cfg_kw = {**calibrated, "distilled": DistilledSpec(files["fasth3"])}
    elif case == "fasth3-vsa-file-fp8":
        cfg_kw = {**calibrated, **vsa, "distilled": DistilledSpec(files["fasth3-vsa"])}
    elif case == "pdd-bf16-steps7":
        cfg_kw = {"precision": "bf16", "distilled": DistilledSpec.parse(f"{files['pdd']}@steps=7")}
    else:
        cfg_kw = {**calibrated, **vsa}
        model = root / "vsa"
    dit, calibration = compare_weights(tmp_path, cfg_kw, model)
    record, schedule = dit.distilled_record, dit.schedules[0]
    assert record["family"] == ("pdd" if case.startswith("pdd") else "fasth3") and schedule.rungs is not None
    final = load_file(str(tmp_path / "streamed" / "weights" / "final.safetensors"))
    blocks = load_file(str(tmp_path / "streamed" / "weights" / "blocks.safetensors"))
    if case.startswith("pdd"):  # one fused head per forward beside the final layer
        assert final["pdd.video_out.weight"].shape[0] == schedule.steps - 1 == 6
    else:
        assert not [n for n in final if n.startswith("pdd.")] and calibration.quant["calib_prompts"] == 2
    gates = [n for n in blocks if n.endswith("attn.to_gate_compress.weight")]
    assert len(gates) == (LAYERS if "vsa" in case else 0) and dit.model.cfg.vsa_gate == ("vsa" in case)
    if case.endswith("vsa-export-fp8"):
        assert record["layout"].startswith("full export") and schedule.steps == 9
    if case == "fasth3-vsa-file-fp8":  # the file's gates, not the checkpoint's (it has none), in every block
        gate = load_file(str(files["fasth3-vsa"]))
        assert record["layout"] == "fastvideo-lora-v2" and schedule.steps == 5, record
        for i in range(LAYERS):
            got = blocks[f"blocks.{i}.attn.to_gate_compress.weight"]
            assert torch.equal(got, gate[f"transformer_blocks.{i}.attn.to_gate_compress.set_weight"].to(got.dtype)), i


@pytest.mark.build
def test_streamed_distilled_bundle_equals_whole_bundle_file_by_file(tmp_path_factory, tiny4, distilled4):
    """A FastH3 file fused block by block (its model-level patches where the resident parts load) with sparse
    attention builds the whole build's bundle: every weight and segment file, the distilled record, its served tasks
    (t2va alone), its schedule's rungs and the sparse kernel chosen."""
    out = tmp_path_factory.mktemp("distilled-pair")
    fasth3 = distilled4[1]["fasth3"]
    budget = streamed_budget(config(tiny4, out / "x", precision="bf16", distilled=DistilledSpec(fasth3),
                                    sparse_attention=0.5))
    flags = ["--precision", "bf16", "--distilled", str(fasth3), "--sparse-attention", "0.5"]
    whole, streamed, logs = build_pair(out, tiny4, flags, budget)
    manifest = assert_same_bundle(whole, streamed, logs)
    assert "each block's parameters as the block arrives" in logs["streamed"]
    assert manifest["distilled"]["family"] == "fasth3" and manifest["tasks"] == ["t2va"]
    assert manifest["schedule"]["rungs"] and manifest["sparse"]["kernel"] == "reference"
