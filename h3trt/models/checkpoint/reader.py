"""Reading MiniMax-H3 transformer checkpoints (checkpoint/writer.py writes them, for tests and the tiny default; their
two naming schemes are checkpoint/names.py's).

Layouts read (see h3_reference.md section 3 and the sglang/VideoX-Fun loaders):
- official: `<root>/FL2VA/` (t2va, fl2va) and `<root>/Ref2VA/` (ref2va), each a partition with its own
  `model_index.json` carrying a `_minimax_h3` block, and `transformer/` holding `config.json` (native field names,
  `_class_name` "MiniMaxH3DiTModel") and sharded `*.safetensors` with native tensor names. QKV rows are interleaved
  per head, `[h0: q k v, h1: q k v, ...]`, and are de-interleaved here to `[q; k; v]` (weight_layout.py).
- diffusers: `<root>/transformer/` (t2va, fl2va) and `<root>/transformer_ref/` (ref2va) with diffusers names
  (`_class_name` "MiniMaxH3Transformer3DModel"); to_q/to_k/to_v fused, the fc1 halves swapped back to [gate; value].
  The root holds `model_index.json`, or `modular_model_index.json` where diffusers' modular pipeline saved it
  (`MiniMaxH3ModularPipeline.save_pretrained`); `scheduler/` and `audio_scheduler/` configs carry the sigma shifts.
- Comfy single file: native names under the `model.diffusion_model.` prefix, QKV already `[q; k; v]`.

The model is built on the meta device and loaded with `assign=True`; loading is strict: every missing key, unexpected
key and shape mismatch is reported in one `CheckpointError`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from ...errors import UserError
from ..config import H3Config
from ..dit import H3DiT, build_dit, parameter_dtype, rope_inv_freq
from ..sampler import DEFAULT_AUDIO_SHIFT, DEFAULT_VIDEO_SHIFT
from ..weight_layout import deinterleave_qkv, swap_halves
from .names import COMFY_PREFIX, DIFFUSERS_CLASS, NATIVE_CLASS, NATIVE_CONFIG_FIELDS, native_name

TASK_PARTITIONS = {"t2va": "FL2VA", "fl2va": "FL2VA", "ref2va": "Ref2VA"}
TASKS = tuple(TASK_PARTITIONS)  # t2va (the default), fl2va, ref2va
DIFFUSERS_COMPONENTS = {"t2va": "transformer", "fl2va": "transformer", "ref2va": "transformer_ref"}
RELEASED_SHIFTS = (DEFAULT_VIDEO_SHIFT, DEFAULT_AUDIO_SHIFT)  # (video, audio) sigma shifts of the released checkpoints
# diffusers' folders name their pipeline in one of these; the modular pipeline's save_pretrained writes the second.
PIPELINE_INDEXES = ("model_index.json", "modular_model_index.json")
# The diffusers layout's two MiniMaxH3Scheduler folders, (video, audio); each config's `shift` is that schedule's.
SCHEDULER_FOLDERS = ("scheduler", "audio_scheduler")
INDEX_NAMES = ("model.safetensors.index.json", "diffusion_pytorch_model.safetensors.index.json")


class CheckpointError(UserError):
    """A checkpoint that is missing, malformed, or does not match the model."""


@dataclass(frozen=True)
class ReleaseMetadata:
    """The `_minimax_h3` block of an official partition's model_index.json."""

    partition: str  # "fl2va" | "ref2va"
    tasks: tuple[str, ...]
    video_shift: float
    audio_shift: float


@dataclass(frozen=True)
class TransformerSource:
    """Where a transformer's weights live and how they are named."""

    files: tuple[Path, ...]
    naming: str  # "native" | "diffusers"
    qkv_interleaved: bool  # official shards interleave QKV per head
    prefix: str  # "" or the Comfy prefix
    config: H3Config
    component_root: Path  # the folder holding the other components (text encoder, VAEs) for this task
    metadata: ReleaseMetadata | None = None
    scheduler_shifts: tuple[float, float] | None = None  # diffusers layout: (video, audio) from its scheduler configs

    @property
    def shifts(self) -> tuple[float, float]:
        """The checkpoint's (video, audio) sigma shifts: the official `_minimax_h3` block's, else a diffusers
        layout's scheduler configs, else the released values."""
        if self.metadata is not None:
            return self.metadata.video_shift, self.metadata.audio_shift
        return self.scheduler_shifts or RELEASED_SHIFTS


# ----------------------------------------------------------------------------------------------------------------------
# Locating


# What to do about a file that does not read back whole: it was cut short or damaged on its way here.
DAMAGED_FILE_FIX = "it is corrupted or truncated (an interrupted download or copy?): download or copy it again"


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_bytes())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing.") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); {DAMAGED_FILE_FIX}.") from None


def parse_release_metadata(model_index: dict, where: Path) -> ReleaseMetadata:
    block = model_index.get("_minimax_h3")
    if not isinstance(block, dict):
        raise CheckpointError(f"{where}: model_index.json has no `_minimax_h3` object; this is not an official partition.")
    if block.get("schema_version") != 1:
        raise CheckpointError(f"{where}: _minimax_h3.schema_version must be 1, got {block.get('schema_version')!r}.")
    partition = block.get("partition")
    if partition not in ("fl2va", "ref2va"):
        raise CheckpointError(f"{where}: _minimax_h3.partition must be 'fl2va' or 'ref2va', got {partition!r}.")
    tasks = block.get("tasks")
    if not isinstance(tasks, list) or not tasks or not all(isinstance(t, str) for t in tasks):
        raise CheckpointError(f"{where}: _minimax_h3.tasks must be a non-empty list of task names, got {tasks!r}.")
    shifts = block.get("sigma_shift_scales")
    if not isinstance(shifts, dict) or not all(isinstance(shifts.get(k), (int, float)) for k in ("video", "audio")):
        raise CheckpointError(f"{where}: _minimax_h3.sigma_shift_scales needs numeric 'video' and 'audio', got {shifts!r}.")
    return ReleaseMetadata(partition, tuple(tasks), float(shifts["video"]), float(shifts["audio"]))


def _shard_files(folder: Path) -> tuple[Path, ...]:
    for name in INDEX_NAMES:
        index = folder / name
        if index.exists():
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{index} has no `weight_map`.")
            files = tuple(folder / f for f in sorted(set(weight_map.values())))
            absent = [str(f) for f in files if not f.exists()]
            if absent:
                raise CheckpointError(f"{index} names shards that are missing: {absent}.")
            return files
    files = tuple(sorted(folder.glob("*.safetensors")))
    if not files:
        raise CheckpointError(f"{folder} holds no *.safetensors weights.")
    return files


def native_config(data: dict) -> H3Config:
    """H3Config from an official transformer config.json (native field names)."""
    eps = {data.get(k, 1e-5) for k in ("norm_eps", "qk_norm_eps", "final_norm_eps")}
    if len(eps) != 1:
        raise CheckpointError(f"h3trt uses one epsilon for every RMSNorm; this config has {sorted(eps)}.")
    fields = {ours: data[theirs] for theirs, ours in NATIVE_CONFIG_FIELDS.items() if theirs in data}
    cfg = H3Config.from_dict(fields)
    for key, expected in (("adaln_out_features", cfg.modulation_dim), ("final_adaln_out_features", 2 * cfg.hidden_size)):
        if key in data and data[key] != expected:
            raise CheckpointError(f"config.json {key}={data[key]} does not match the H3 block shape ({expected}).")
    return cfg


def _transformer_folder(folder: Path, component_root: Path, metadata: ReleaseMetadata | None) -> TransformerSource:
    config = _read_json(folder / "config.json")
    cls = config.get("_class_name")
    if cls in (NATIVE_CLASS, DIFFUSERS_CLASS):
        try:  # H3Config's own checks (eps, dims) are the checkpoint's problem here, not a bug: one line naming the file
            cfg = native_config(config) if cls == NATIVE_CLASS else H3Config.from_diffusers_config(config)
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"{folder / 'config.json'} is not an H3 transformer config ({e}); use the "
                                  "checkpoint's own config.json.") from None
        files = _shard_files(folder)
        cfg = with_vsa_gate(cfg, [k for f in files for k in _safetensors_keys(f)])
        return TransformerSource(files, "native" if cls == NATIVE_CLASS else "diffusers",
                                 cls == NATIVE_CLASS, "", cfg, component_root, metadata)
    raise CheckpointError(
        f"{folder / 'config.json'}: _class_name {cls!r} is not a MiniMax-H3 transformer "
        f"(expected {NATIVE_CLASS!r} or {DIFFUSERS_CLASS!r}). Pruned checkpoints are not supported."
    )


def locate_transformer(path: str | Path, task: str = "t2va") -> TransformerSource:
    """Find the transformer serving `task` under `path`: an official root, one official partition, a diffusers root,
    a transformer folder, or a single (Comfy) .safetensors file."""
    if task not in TASK_PARTITIONS:
        raise CheckpointError(f"Unknown task {task!r}; H3 serves {sorted(TASK_PARTITIONS)}.")
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"Model path {path} does not exist. Pass a local folder in the official MiniMax-H3 layout.")
    if path.is_file():
        if path.suffix != ".safetensors":
            raise CheckpointError(f"{path} is not a .safetensors file or a checkpoint folder.")
        return _single_file(path)

    partition_dir = path / TASK_PARTITIONS[task]
    if partition_dir.is_dir():
        path = partition_dir
    index_path = next((path / name for name in PIPELINE_INDEXES if (path / name).exists()), None)
    if index_path is not None:
        index = _read_json(index_path)
        if "_minimax_h3" in index:
            meta = parse_release_metadata(index, index_path)
            if task not in meta.tasks:
                raise CheckpointError(
                    f"{index_path}: partition {meta.partition!r} serves {list(meta.tasks)}, not {task!r}. Point "
                    f"--model at the checkpoint root so h3trt can pick {TASK_PARTITIONS[task]}/."
                )
            return _transformer_folder(path / "transformer", path, meta)
        component = path / DIFFUSERS_COMPONENTS[task]
        if not component.is_dir():
            raise CheckpointError(f"{path} is a diffusers layout without {component.name}/, which serves {task!r}.")
        source = _transformer_folder(component, path, None)
        return dataclasses.replace(source, scheduler_shifts=diffusers_shifts(path))
    if (path / "config.json").exists():
        return _transformer_folder(path, path.parent, None)
    raise CheckpointError(
        f"{path} is not a MiniMax-H3 checkpoint: expected FL2VA/ and Ref2VA/ partitions (official layout), a "
        "model_index.json, or a transformer folder with config.json."
    )


def diffusers_shifts(root: Path) -> tuple[float, float] | None:
    """(video, audio) sigma shifts from a diffusers layout's scheduler/ and audio_scheduler/ configs (a missing folder
    keeps that modality's released shift); None when the folder has neither."""
    configs = [root / name / "scheduler_config.json" for name in SCHEDULER_FOLDERS]
    if not any(c.exists() for c in configs):
        return None
    shifts = []
    for config, released in zip(configs, RELEASED_SHIFTS):
        if not config.exists():
            shifts.append(released)
            continue
        shift = _read_json(config).get("shift", released)  # MiniMaxH3Scheduler's only field, omitted at its default
        if isinstance(shift, bool) or not isinstance(shift, (int, float)) or shift <= 0:
            raise CheckpointError(f"{config}: shift must be a positive number, got {shift!r}.")
        shifts.append(float(shift))
    return shifts[0], shifts[1]


def _single_file(path: Path) -> TransformerSource:
    keys = _safetensors_keys(path)
    prefix = COMFY_PREFIX if any(k.startswith(COMFY_PREFIX) for k in keys) else ""
    names = [k[len(prefix):] for k in keys]
    naming = "diffusers" if any(n.startswith("transformer_blocks.") for n in names) else "native"
    shapes = _safetensors_shapes(path)
    cfg = with_vsa_gate(infer_config({n: shapes[prefix + n] for n in names}, naming), names)
    # Published single files (Comfy, GGUF) store [q; k; v]; only the official shards interleave.
    return TransformerSource((path,), naming, False, prefix, cfg, path.parent, None)


VSA_GATE_KEY = ".attn.to_gate_compress.weight"  # FastH3-VSA's gate, in native and diffusers names alike


def with_vsa_gate(cfg: H3Config, keys) -> H3Config:
    """`cfg` with vsa_gate set where the checkpoint's tensors hold `attn.to_gate_compress` (FastH3-VSA): no config
    field of the releases says so, the tensors do (a block without one is then a missing key of the strict load)."""
    return dataclasses.replace(cfg, vsa_gate=True) if any(k.endswith(VSA_GATE_KEY) for k in keys) else cfg


def infer_config(shapes: dict[str, tuple[int, ...]], naming: str) -> H3Config:
    """Dimensions from tensor shapes, for single files that ship without a config.json (patch (1, 2, 2) assumed)."""
    if naming == "diffusers":
        shapes = {native_name(k): v for k, v in shapes.items() if not k.startswith("transformer_blocks.0.attn.to_")}
        shapes["blocks.0.attn.qkv_proj.weight"] = None
    try:
        hidden, video_dim = shapes["video_patch_proj.weight"]
        head_dim = shapes["blocks.0.attn.q_norm.weight"][0]
        inv = shapes.get("rope.inv_freq")
        return H3Config(
            num_layers=1 + max(int(k.split(".")[1]) for k in shapes if k.startswith("blocks.")),
            num_refiner_layers=len({k.split(".")[2] for k in shapes if k.startswith("token_refiner.blocks.")}),
            hidden_size=hidden,
            num_heads=shapes["blocks.0.attn.out_proj.weight"][1] // head_dim,
            head_dim=head_dim,
            ffn_dim=shapes["blocks.0.mlp.fc2.weight"][1],
            in_channels=video_dim // 4,
            audio_in_channels=shapes["audio_patch_proj.weight"][1],
            text_dim=shapes["condition_proj.weight"][1],
            freq_dim=shapes["time_embedder.proj_in.weight"][1],
            time_embed_hidden_dim=shapes["time_embedder.proj_in.weight"][0],
            time_embed_dim=shapes["time_embedder.proj_out.weight"][0],
            rope_freq_dim=inv[0] if inv else head_dim // 8,
        )
    except (KeyError, ValueError, TypeError) as e:
        raise CheckpointError(f"Cannot infer the H3 dimensions from this single file ({e!r}); is it an H3 DiT?") from None


# ----------------------------------------------------------------------------------------------------------------------
# Reading


def _safe_open(path: Path):
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own error types for bad headers
        raise CheckpointError(f"{path} is not a readable safetensors file ({e}); {DAMAGED_FILE_FIX}.") from None


def check_component_files(folder: Path, weights: bool) -> None:
    """Read back every JSON file of a component folder (and, with `weights`, every safetensors file its index names,
    or all of them): JSON must parse, and a safetensors header must parse and cover its file exactly, which a file
    cut short anywhere does not. The first bad file is named with the fix, before a loader that would fail on it
    with a traceback (transformers) reads anything; the weights themselves are not read. A file that read back whole
    is not read again while its size and modification time are the same (a server checks the text encoder's files at
    every admission: a full checkpoint's tokenizer.json alone is ~11 MB of JSON)."""
    for path in sorted(folder.glob("*.json")):
        with _unless_seen_whole(path) as read:
            if read:
                _read_json(path)
    for path in _shard_files(folder) if weights else ():
        with _unless_seen_whole(path) as read:
            if read:
                with _safe_open(path):
                    pass


_WHOLE: dict[str, tuple[int, int, int]] = {}  # a file that read back whole -> its (inode, size, mtime_ns) then


@contextlib.contextmanager
def _unless_seen_whole(path: Path):
    """Yields whether `path` must be read back (not seen whole as it is now); remembers it once the read passed. Its
    stat is taken before the read: a file written meanwhile differs from it next time and is read again."""
    try:
        st = path.stat()
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
    except OSError:
        key = None  # the read names what is wrong
    if key is not None and _WHOLE.get(str(path)) == key:
        yield False
        return
    yield True
    if key is not None:
        _WHOLE[str(path)] = key


def _safetensors_keys(path: Path) -> list[str]:
    with _safe_open(path) as f:
        return list(f.keys())


def _safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    with _safe_open(path) as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def read_native_state_dict(source: TransformerSource) -> dict[str, torch.Tensor]:
    """All tensors of `source` under native names with QKV as [q; k; v] and fc1 as [gate; value]."""
    cfg = source.config
    raw: dict[str, torch.Tensor] = {}
    for file in source.files:
        with _safe_open(file) as f:
            for key in f.keys():
                if key in raw:
                    raise CheckpointError(f"Tensor {key!r} appears in more than one shard (again in {file}).")
                try:
                    raw[key] = f.get_tensor(key)
                except Exception as e:
                    raise CheckpointError(f"{file}: tensor {key!r} cannot be read ({e}); the file is corrupted.") from None
    if source.prefix:
        raw = {k[len(source.prefix):] if k.startswith(source.prefix) else k: v for k, v in raw.items()}
    check_unpruned(raw)

    out: dict[str, torch.Tensor] = {}
    if source.naming == "diffusers":
        fused: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in raw.items():
            m = re.match(r"^(.*)\.attn\.to_([qkv])\.weight$", key)
            if m:
                fused.setdefault(m.group(1), {})[m.group(2)] = value
                continue
            name = native_name(key)
            out[name] = swap_halves(value) if name.endswith(".mlp.fc1.weight") else value
        for prefix, parts in fused.items():
            if set(parts) != {"q", "k", "v"}:
                raise CheckpointError(f"{prefix}.attn has only to_{'/to_'.join(sorted(parts))}; to_q, to_k, to_v are all needed.")
            out[native_name(prefix) + ".attn.qkv_proj.weight"] = torch.cat([parts["q"], parts["k"], parts["v"]])
    else:
        for key, value in raw.items():
            if source.qkv_interleaved and key.endswith(".attn.qkv_proj.weight") and value.ndim == 2 \
                    and value.shape[0] == 3 * cfg.inner_dim:
                value = deinterleave_qkv(value, cfg.num_heads, cfg.head_dim)
            out[key] = value

    inv = out.pop("rope.inv_freq", None)  # recomputed by the model; checked so a wrong config cannot hide
    if inv is not None:
        check_rope_inv_freq(inv, cfg)
    return out


def check_unpruned(names) -> None:
    """A checkpoint's stored names hold no pruned AdaLN table (read_native_state_dict's and CheckpointTensors')."""
    if "adaln_t_table" in names or "time_embedder.table" in names:
        raise CheckpointError("This is a pruned MiniMax-H3 checkpoint (adaln_t_table); h3trt needs the unpruned "
                              "weights.")


def check_rope_inv_freq(inv: torch.Tensor, cfg: H3Config) -> None:
    """A stored rope.inv_freq (the model recomputes it) is the config's: a wrong config cannot hide."""
    ref = rope_inv_freq(cfg)
    if inv.shape != ref.shape or not torch.equal(inv, ref.to(inv.dtype)):
        raise CheckpointError(f"rope.inv_freq {tuple(inv.shape)} does not match rope_theta {cfg.rope_theta} and "
                              f"rope_freq_dim {cfg.rope_freq_dim} from the config.")


def check_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor], where: str) -> None:
    """Raise one CheckpointError listing every missing key, unexpected key and shape mismatch."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shapes = sorted(f"{k}: checkpoint {tuple(state[k].shape)}, model {expected[k]}"
                    for k in set(expected) & set(state) if tuple(state[k].shape) != expected[k])
    if missing or unexpected or shapes:
        def listing(title, items):
            head = "\n    ".join(items[:25])
            more = f"\n    ... and {len(items) - 25} more" if len(items) > 25 else ""
            return f"\n  {title} ({len(items)}):\n    {head}{more}" if items else ""
        raise CheckpointError(
            f"Checkpoint {where} does not match the H3 model."
            + listing("missing keys", missing) + listing("unexpected keys", unexpected)
            + listing("shape mismatches", shapes)
        )


def load_dit(
    path: str | Path,
    task: str = "t2va",
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    supplied: dict[str, torch.Tensor] | None = None,
) -> tuple[H3DiT, TransformerSource]:
    """Build the DiT on the meta device and load the checkpoint for `task` into it with assign=True. `supplied`:
    parameters (native names) a distilled file assigns where the checkpoint has none (FastH3's VSA gates,
    `.set_weight`): the model is built with them (H3Config.vsa_gate) and the strict load takes them as the
    checkpoint's (the checkpoint's own tensor wins where it has one; the fusion assigns the file's after)."""
    source = locate_transformer(path, task)
    state = read_native_state_dict(source)
    if supplied:
        state = {**supplied, **state}
        source = dataclasses.replace(source, config=with_vsa_gate(source.config, supplied))
    model = build_dit(source.config, dtype, device="meta")
    check_state_dict(model, state, str(source.files[0].parent if len(source.files) > 1 else source.files[0]))
    state = {k: v.to(device=device, dtype=parameter_dtype(k, dtype)) for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    model.rope_inv_freq = rope_inv_freq(source.config).to(device)  # a non-persistent buffer: still on meta
    return model, source
