"""A full FastH3 export loaded as a checkpoint: FastVideo's `fastvideo_inference.json` sidecar
(`fasth3-inference-contract-v1`, beside the diffusers layout's model_index.json) declares the trained ladder, which
the checkpoint then serves in place of H3's 50-step default (FastVideo's own pipeline binds it: "a distilled
export's schedule is explicit; never silently use a uniform grid"; SGLang's FastH3InferenceContract likewise).

Read as FastVideo and SGLang read it: `dmd_denoising_steps` strictly decreasing integers in (0, 1000], as many as
`transformer_forwards`, one fewer than `num_inference_steps`; `guidance_scale` 1; a stated `task` t2av; a stated
`video_scheduler_shift` / `audio_scheduler_shift` equal to the scheduler configs' (the configs own the shifts: V1's
12 / 3, V2's 10 / 3). The VSA fields (`attention_backend` VIDEO_SPARSE_ATTN_H3, `vsa_sparsity`, `vsa_tile_size`) need
a checkpoint whose blocks carry the gate (`attn.to_gate_compress`), 64-token tiles (h3trt's, and the other readers'
check), and a sparsity in [0, 1): the distilled record's `vsa` keeps that sparsity as the one the export was distilled
at, the bundle's default, which --vsa-sparsity may override (FastVideo: the metadata "does not silently change ...
sparsity"; models/vsa/plan.py served_vsa_settings). A PDD or Ref2VA export's sidecar (`pdd_steps`, `model_type`
ref2va) is refused by name.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..vsa.plan import DEFAULT_VSA_SPARSITY, trained_vsa
from ..vsa.tiles import VSA_TILE_ROWS
from .families import DistilledServing, check_task
from .files import DistilledError
from .schedule import fasth3_schedule

CONTRACT_FILE = "fastvideo_inference.json"
CONTRACT_SCHEMA = "fasth3-inference-contract-v1"
VSA_FIELDS = ("attention_backend", "vsa_sparsity", "vsa_tile_size", "vsa_kernel")


def checkpoint_contract(root: Path, shifts: tuple[float, float], vsa_gate: bool = False,
                        task: str | None = None) -> tuple[DistilledServing, dict] | None:
    """(what the export serves, its manifest/clip record) from `root`'s sidecar, `shifts` the checkpoint's scheduler
    configs' (video, audio), `vsa_gate` whether its blocks carry the VSA gate, `task` the one asked for (None: not
    checked here); None when `root` has no sidecar (a base checkpoint)."""
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
    if task is not None:  # before the VSA fields: another partition (transformer_ref) is no VSA model
        check_task("fasth3", ("t2va",), task, path)
    vsa = _trained_vsa(data, where, vsa_gate)
    serving = DistilledServing("fasth3", fasth3_schedule(tuple(rungs), shifts), ("t2va",), vsa)
    record = {**serving.record(), "file": CONTRACT_FILE, "path": str(path), "sha256": hashlib.sha256(raw).hexdigest(),
              "layout": "full export (checkpoint + fastvideo_inference.json)", "contract": data}
    return serving, record


def refuse_export_base(component_root: Path, distilled_path: Path) -> None:
    """A --distilled file is fused into a base checkpoint: one whose folder holds an export's sidecar is refused."""
    if (Path(component_root) / CONTRACT_FILE).is_file():
        raise DistilledError(f"--distilled {distilled_path}: {component_root} is a distilled export already "
                             f"({CONTRACT_FILE}); fuse a distilled file into a base checkpoint only.")


def _trained_vsa(data: dict, where: str, vsa_gate: bool) -> dict | None:
    """The sidecar's VSA fields against the checkpoint (module doc): the distilled record's `vsa`, None for a dense
    export."""
    declared = {k: data[k] for k in VSA_FIELDS if k in data}
    says_vsa = "vsa_sparsity" in declared or str(declared.get("attention_backend", "")).startswith("VIDEO_SPARSE")
    if says_vsa and not vsa_gate:
        raise DistilledError(f"{where} declares VSA attention ({declared}), but the checkpoint's blocks carry no VSA "
                             "gate (attn.to_gate_compress): the export is incomplete; download it again.")
    if not vsa_gate:
        return None
    tile = declared.get("vsa_tile_size", VSA_TILE_ROWS)
    if tile != VSA_TILE_ROWS:
        raise DistilledError(f"{where}: vsa_tile_size {tile!r}; h3trt's VSA tiles are FastH3's {VSA_TILE_ROWS} tokens "
                             "(its kernels tile 64 rows), so this export cannot run as it was distilled.")
    sparsity = declared.get("vsa_sparsity", DEFAULT_VSA_SPARSITY)
    if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)) or not 0.0 <= sparsity < 1.0:
        raise DistilledError(f"{where}: vsa_sparsity must be a number in [0, 1), got {sparsity!r}.")
    source = (f"{CONTRACT_FILE} vsa_sparsity" if "vsa_sparsity" in declared
              else f"FastH3 v1's default ({CONTRACT_FILE} states no vsa_sparsity)")
    return trained_vsa(sparsity, source)
