"""A full FastH3 export loaded as a checkpoint: FastVideo's `fastvideo_inference.json` sidecar
(`fasth3-inference-contract-v1`, beside the diffusers layout's model_index.json) declares the trained ladder, which
the checkpoint then serves in place of H3's 50-step default (FastVideo's own pipeline binds it: "a distilled
export's schedule is explicit; never silently use a uniform grid"; SGLang's FastH3InferenceContract likewise).

Read as FastVideo and SGLang read it: `dmd_denoising_steps` strictly decreasing integers in (0, 1000], as many as
`transformer_forwards`, one fewer than `num_inference_steps`; `guidance_scale` 1; a stated `task` t2av; a stated
`video_scheduler_shift` / `audio_scheduler_shift` equal to the scheduler configs' (the configs own the shifts: V1's
12 / 3, V2's 10 / 3). The VSA fields (`attention_backend`, `vsa_sparsity`, `vsa_tile_size`) are recorded for the VSA
attention (issue 47 item 4). A PDD or Ref2VA export's sidecar (`pdd_steps`, `model_type` ref2va) is refused by name.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .distilled import DistilledServing
from .distilled_files import DistilledError
from .distilled_schedule import fasth3_schedule

CONTRACT_FILE = "fastvideo_inference.json"
CONTRACT_SCHEMA = "fasth3-inference-contract-v1"
VSA_FIELDS = ("attention_backend", "vsa_sparsity", "vsa_tile_size", "vsa_kernel")


def checkpoint_contract(root: Path, shifts: tuple[float, float]) -> tuple[DistilledServing, dict] | None:
    """(what the export serves, its manifest/clip record) from `root`'s sidecar, `shifts` the checkpoint's scheduler
    configs' (video, audio); None when `root` has no sidecar (a base checkpoint)."""
    path = Path(root) / CONTRACT_FILE
    if not path.is_file():
        return None
    raw = path.read_bytes()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DistilledError(f"{path} is not valid JSON ({e}); download the export again.") from None
    where = f"{path}"
    if not isinstance(data, dict) or data.get("schema_version") != CONTRACT_SCHEMA:
        raise DistilledError(f"{where}: schema_version must be {CONTRACT_SCHEMA!r}, got "
                             f"{data.get('schema_version') if isinstance(data, dict) else data!r}.")
    if "pdd_steps" in data or data.get("model_type") not in (None, "t2va", "t2av"):
        raise DistilledError(f"{where} describes a {data.get('model_type', 'PDD')} export (pdd_steps / model_type); "
                             "h3trt serves FastH3's T2VA exports as checkpoints, and PDD as its Acc LoRA file "
                             "(--distilled FILE).")
    if data.get("task", "t2av") != "t2av":
        raise DistilledError(f"{where}: task {data.get('task')!r}; a FastH3 export serves t2av (T2VA) only.")
    if data.get("guidance_scale", 1.0) != 1.0:
        raise DistilledError(f"{where} declares guidance_scale {data['guidance_scale']!r}; FastH3 runs CFG off.")
    rungs = data.get("dmd_denoising_steps")
    if not isinstance(rungs, list) or data.get("transformer_forwards") != len(rungs) or data.get(
            "num_inference_steps") != len(rungs) + 1:
        raise DistilledError(f"{where}: dmd_denoising_steps {rungs!r} must be a list of as many rungs as "
                             f"transformer_forwards ({data.get('transformer_forwards')!r}), one fewer than "
                             f"num_inference_steps ({data.get('num_inference_steps')!r}).")
    for i, key in enumerate(("video_scheduler_shift", "audio_scheduler_shift")):
        if key in data and data[key] != shifts[i]:
            raise DistilledError(f"{where}: {key} {data[key]!r} disagrees with the checkpoint's scheduler config "
                                 f"({shifts[i]:g}); the export is inconsistent.")
    serving = DistilledServing("fasth3", fasth3_schedule(tuple(rungs), shifts), ("t2va",))
    record = {**serving.record(), "file": CONTRACT_FILE, "path": str(path), "sha256": hashlib.sha256(raw).hexdigest(),
              "layout": "full export (checkpoint + fastvideo_inference.json)", "contract": data,
              "vsa": {k: data[k] for k in VSA_FIELDS if k in data} or None}
    return serving, record
