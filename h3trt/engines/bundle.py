"""Loading a bundle: checks, the shipped compiled code, weights, and the DiT runner built from the segments (every
file checked against the manifest on the way, by bundle_files.py's BundleVerification).

`EngineDiT` is a DiT runner (models/runner.py), so the pipeline never knows which backend compiled what.
"""

from __future__ import annotations

import functools
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

# Imported to register h3trt::attention and h3trt::fp8_sdpa, which compiled blocks call by name.
from ..adapters.slots import ADALN_TARGET, LORA_INPUTS, AdapterRun, AdapterSlots, gather_rows, adapter_delta
from ..calibration import fp8_attention  # noqa: F401
from ..calibration.modules import ATTENTION_SCALES
from ..models.attention import bound_attention, dense_kernel
from ..models.block_stack import run_block_stack
from ..models.config import NUM_MODALITIES, H3Config
from ..models.dit import layer_attention, rope_inv_freq, rope_tables, sdpa_attention
from ..models.packing import PackedLayout
from ..models.distilled.pdd import HEAD_WEIGHTS, PDD_PREFIX, StepHeads
from ..models.runner import NO_EXTRAS, EvalExtras, RunnerCaps
from ..models.sampler import Schedule
from ..models.sparse.fp8 import FP8_SPARSE_KERNELS
from ..models.sparse.run import load_sparse_kernel, warm_sparse
from ..models.vsa.plan import VsaServing, load_vsa_kernel, vsa_call
from ..parallel.ulysses import RowShard
from .adaln import adaln_runner
from .bundle_files import BundleVerification
from .caps import NO_SPARSE_HALVES, bundle_caps
from .load_checks import check_load
from .loaders import LoadedSegment, load_segments
from .manifest import BundleError, Manifest, hash_threads, read_manifest
from .signing import read_trusted_manifest
from .tensorrt_runtime import load_trt_engine
from .video_decoder import TileDecoder, parse_video_decoder_name

# Files a load must have verified before it runs them: the compiled code (shared objects, Triton binaries).
CODE_PREFIXES = ("segments/", "inductor_cache/")
HALVES = ("block_pre", "block_post")  # the block's two halves around its attention (build/segments.py)
DIT_WEIGHT_FILES = ("embed", "blocks", "final")


class EngineDiT:
    """The DiT forward from compiled segments: embed, the block segment(s) once per layer (models/block_stack.py),
    final. With an sp group the block is the two halves around the Ulysses exchange, on this rank's rows. In one
    process the block is the fused segment; a bundle built with --sparse-attention also has the halves, which a
    sparse evaluation runs around its block-sparse attention (the exchange of one rank is the identity); with
    --lora-slots each of them has its twin with adapters (block_lora; block_pre_lora, block_post_lora). A FastH3-VSA
    bundle has the halves only: every evaluation runs VSA between them, its gate in the exchange's buffer."""

    def __init__(self, cfg: H3Config, segments: dict[str, LoadedSegment], entries: dict, weights: dict, adaln,
                 device, group=None, layer_segments: list[str] | None = None, attention_kernel: str | None = None,
                 sparse_kernel: str | None = None, lora_slots: AdapterSlots | None = None,
                 vsa: VsaServing | None = None, final_heads: StepHeads | None = None):
        """`sparse_kernel`: the block-sparse attention kernel served between the halves (sp > 1, or a one-process
        bundle that has them beside its fused block); None: none. An FP8 one (models/sparse/fp8.py) gets each layer's
        calibrated q/k/v scales. `lora_slots`: the banks of a bundle built with --lora-slots (allocated at load;
        adapters are loaded into them), which its block_lora segments take (and, built with --sparse-attention too,
        its halves' twins block_pre_lora / block_post_lora, for a sparse evaluation with adapters). `vsa`: a
        FastH3-VSA bundle's settings and kernel (its manifest's, warmed at load). `final_heads`: a PDD bundle's fused
        head per forward (models/distilled/pdd.py), given to the final segment in place of its own for the evaluation's
        forward. `caps` (models/runner.py): these (the loader's come from the manifest: engines/caps.py bundle_caps)."""
        self.cfg, self.segments, self.adaln, self.device, self.group = cfg, segments, adaln, device, group
        self.caps = RunnerCaps(sparse_kernel, vsa=vsa, adapter_slots=lora_slots.num_slots if lora_slots else None)
        self.halves = all(h in entries for h in HALVES)
        if sparse_kernel is not None and not self.halves:
            raise ValueError("a bundle without the block halves serves no sparse attention (its compiled block "
                             "holds its attention): pass sparse_kernel None.")
        self.sparse_scales = None  # per layer: (q, k, v) scales, for an FP8 sparse kernel
        if sparse_kernel in FP8_SPARSE_KERNELS:
            names = [[f"blocks.{i}.attn.{n}" for n in ATTENTION_SCALES] for i in range(cfg.num_layers)]
            if any(n not in weights["blocks"] for layer in names for n in layer):
                raise ValueError(f"the {sparse_kernel} sparse kernel needs every layer's FP8 attention scales "
                                 "(attn.q_scale, ...): a bundle built with --fp8-attention has them.")
            self.sparse_scales = [tuple(weights["blocks"][n] for n in layer) for layer in names]
        self.embed_w = [weights["embed"][n] for n in entries["embed"]["weights"]]
        block_segments = tuple(n for n in ("block", "block_pre", "block_post") if n in entries)
        # A quantized bundle may keep some layers in bf16: those run the "block_hp" segment with its own weight names.
        self.layer_segments = layer_segments or ["block"] * cfg.num_layers
        serving = {"block": self.layer_segments}
        self.block_w = {name: [[weights["blocks"][f"blocks.{i}.{n}"]
                                for n in entries[serving.get(name, [name] * cfg.num_layers)[i]]["weights"]]
                               for i in range(cfg.num_layers)] for name in block_segments}
        self.final_names = entries["final"]["weights"]
        self.final_w = [weights["final"][n] for n in self.final_names]
        self.final_heads = final_heads
        self.lora_slots = lora_slots
        # With --sparse-attention too, the halves' twins with adapters (an earlier h3trt's bundle has none).
        self.lora_halves = lora_slots is not None and all(f"{h}_lora" in entries for h in HALVES)
        if lora_slots is not None:  # each layer's twin with adapters, and its banks in the twin's order
            self.lora_segments = [f"{name}_lora" for name in self.layer_segments]
            twins = [*self.lora_segments, *(f"{h}_lora" for h in HALVES if self.lora_halves)]
            _check_lora_twins(entries, set(twins))

            def twin_inputs(seg: str, i: int) -> list[torch.Tensor]:
                return ([weights["blocks"][f"blocks.{i}.{n}"] for n in entries[seg]["weights"]]
                        + lora_slots.segment_inputs(i, entries[seg]["lora"]))

            self.lora_w = [twin_inputs(seg, i) for i, seg in enumerate(self.lora_segments)]
            self.half_lora_w = {f"{h}_lora": [twin_inputs(f"{h}_lora", i) for i in range(cfg.num_layers)]
                                for h in HALVES if self.lora_halves}
        self.inv_freq = rope_inv_freq(cfg).to(device)
        # Sharded attention, between the halves (at sp=1 it is inside the compiled block): the bundle's kernel
        # (`attention_kernel`; None: a bundle from before kernels were recorded, bf16 SDPA), or FP8 attention as its
        # own compiled segment bound to each layer's calibrated q/k/v scales.
        dense = bound_attention(attention_kernel) if attention_kernel is not None else None
        self.sharded_attention = [dense] * cfg.num_layers
        if "attention" in entries:
            self.sharded_attention = [self._bound_attention([weights["blocks"][f"blocks.{i}.{n}"]
                                                             for n in entries["attention"]["weights"]])
                                      for i in range(cfg.num_layers)]

    def __call__(self, video, audio, text, unique_t, t_index, layout: PackedLayout, extras: EvalExtras = NO_EXTRAS):
        """The runner contract (models/runner.py). `extras.adapters`: the evaluation's adapters (from this engine's
        `lora_slots`); None runs exactly the plain path. A FastH3-VSA bundle takes its request's VsaRun as
        `extras.sparse` (models/vsa/plan.py), in every evaluation."""
        sparse, adapters = extras.sparse, extras.adapters
        if self.cfg.vsa_gate:  # VSA between the halves: dense evaluations run the bundle's own dense kernel
            core = vsa_call(sparse, layout, self.sharded_attention[0] or sdpa_attention)
        else:
            core = sparse.attention(layout) if sparse is not None else None
        if core is not None and not self.halves:
            raise ValueError("this bundle's compiled block holds its attention and it has no halves; it serves no "
                             "sparse attention (its caps say so, which admission checks before denoising).")
        if adapters is not None:
            self._check_adapters(adapters, core)
        if unique_t.numel() == 1:
            # Compiled for T >= 2 distinct timesteps; a duplicate row is never indexed, so outputs are unchanged.
            unique_t = unique_t.repeat(2)
        x, temb = self.segments["embed"](video, audio, text, unique_t, layout.video_index, layout.audio_index,
                                         layout.text_index, layout.token_tags, *self.embed_w)
        rows = self.adaln.rows(unique_t)
        adaln_index = t_index * NUM_MODALITIES + layout.token_tags
        cos, sin = rope_tables(layout.position_ids, self.inv_freq)
        shard = RowShard(self.group, layout.seq_len) if self.group is not None else None
        if shard is not None:
            block_fn = self._sharded_block(rows, temb, shard.exchange(), core)
        elif core is not None:  # a sparse evaluation in one process: the halves (their twins with adapters) around it
            block_fn = self._sharded_block(rows, temb, one_rank_exchange, core, adapters)
        elif adapters is not None:  # dense with adapters: each layer's block_lora twin
            block_fn = self._block_adapters(rows, temb, adapters)
        else:  # dense: the fused block, its attention (FP8 attention in an fp8 bundle) inside it
            block_fn = self._block(rows, temb)
        x = run_block_stack(x, self.cfg.num_layers, block_fn, adaln_index, (cos, sin), extras.cache, shard)
        final_w = self.final_w
        if self.final_heads is not None:  # PDD: this forward's fused head (chosen on the device: no sync)
            chosen = self.final_heads.select(self.final_heads.index(unique_t, t_index, layout.video_index))
            final_w = [chosen.get(n, w) for n, w in zip(self.final_names, self.final_w)]
        return self.segments["final"](x, self.adaln.final_table(rows, temb).contiguous(), t_index, layout.video_index,
                                      layout.audio_index, *final_w)

    def _bound_attention(self, scales: list[torch.Tensor]):
        segment = self.segments["attention"]
        return lambda q, k, v: segment(q, k, v, *scales)[0]

    def _block(self, rows, temb):
        """Layer i as one compiled block segment (attention inside it)."""
        def block_fn(i, x, adaln_index, rope):
            mod = self.adaln.block(i, rows, temb).contiguous()
            return self.segments[self.layer_segments[i]](x, mod, adaln_index, *rope, *self.block_w["block"][i])[0]

        return block_fn

    def _check_adapters(self, adapters: AdapterRun, core) -> None:
        if self.lora_slots is None or adapters.blocks is not self.lora_slots.by_block:
            raise ValueError("this evaluation carries LoRA adapters, but not from this bundle's slots (a bundle "
                             "built without --lora-slots has none): load them with ResidentAdapters(..., "
                             "engine.dit.lora_slots).")
        if core is not None and not self.lora_halves:
            raise ValueError("this bundle's halves have no twin with adapters (built by an earlier h3trt), so a "
                             "sparse evaluation runs none: admission refuses such a request (check_bundle_sparse).")
        if len(adapters.uses) > self.lora_slots.num_slots:
            raise ValueError(f"{len(adapters.uses)} adapters in one evaluation; this bundle holds at most "
                             f"{self.lora_slots.num_slots} at once (--lora-slots).")

    def _block_adapters(self, rows, temb, adapters: AdapterRun):
        """Layer i as its compiled twin with adapters, given the evaluation's rank rows (adapters/slots.py: the
        rows of each adapter's own rank, none of an adapter at scale 0). An AdaLN adapter is the runner's: its side
        branch on silu(temb) [T, E] (T rows, eager) added to the table the bundle serves, as the eager AdaLNProj adds
        it to its projection."""
        def block_fn(i, x, adaln_index, rope):
            mod = self._adapted_modulation(i, rows, temb, adapters)
            return self.segments[self.lora_segments[i]](x, mod, adaln_index, *rope, adapters.rows, adapters.row_scales,
                                                        *self.lora_w[i])[0]

        return block_fn

    def _adapted_modulation(self, i: int, rows, temb, adapters: AdapterRun) -> torch.Tensor:
        """Layer i's modulation table with the evaluation's AdaLN adapters, where the slots adapt AdaLN."""
        mod = self.adaln.block(i, rows, temb)
        if ADALN_TARGET in self.lora_slots.targets:
            rows_E = adapters.rows.reshape(-1)
            down, up = (gather_rows(bank, rows_E) for bank in self.lora_slots.by_block[i][ADALN_TARGET])
            delta = adapter_delta(F.silu(temb).to(mod.dtype), down, up, adapters.row_scales.reshape(-1))
            mod = mod + delta.to(mod.dtype).view(mod.shape)
        return mod.contiguous()

    def _sharded_block(self, rows, temb, exchange, core=None, adapters: AdapterRun | None = None):
        """Layer i on this rank's rows: pre half (compiled), exchange + attention (eager), post half (compiled).
        `core`: a sparse evaluation's attention (block-sparse in place of the bundle's: bf16, or FP8 with the
        layer's scales where the kernel is FP8); in one process `exchange` is `one_rank_exchange` and `core` is always
        given. `adapters` (one process, a bundle with the halves' twins): the halves' twins with the evaluation's rank
        rows, and the modulation table with its AdaLN adapters, as `_block_adapters` runs the dense block."""
        adapter_inputs = () if adapters is None else (adapters.rows, adapters.row_scales)
        pre_name, post_name = (h if adapters is None else f"{h}_lora" for h in HALVES)
        pre, post = self.segments[pre_name], self.segments[post_name]
        weights = self.block_w if adapters is None else self.half_lora_w

        def block_fn(i, x, adaln_index, rope):
            mod = (self.adaln.block(i, rows, temb).contiguous() if adapters is None
                   else self._adapted_modulation(i, rows, temb, adapters))
            (qkv,) = pre(x, mod, adaln_index, *rope, *adapter_inputs, *weights[pre_name][i])
            if core is None:
                attention = self.sharded_attention[i]
            elif self.sparse_scales is not None:  # FP8 block-sparse: this layer's calibrated scales
                attention = functools.partial(layer_attention(core, i), scales=self.sparse_scales[i])
            else:
                attention = layer_attention(core, i)
            attn = exchange(qkv, attention)
            return post(x, attn, mod, adaln_index, *adapter_inputs, *weights[post_name][i])[0]

        return block_fn


def _check_lora_twins(entries: dict, names: set[str]) -> None:
    """A bundle's twins with adapters take the evaluation's rank rows (build/segments.py LORA_INPUTS); one built by an
    earlier h3trt took a slot list and is refused, naming the rebuild."""
    for name in sorted(names):
        taken = entries[name]["inputs"][-len(LORA_INPUTS):]
        if tuple(taken) != LORA_INPUTS:
            raise BundleError(f"this bundle's {name} segment takes {taken}, the adapter "
                              f"inputs of an earlier h3trt (this one passes {list(LORA_INPUTS)}); rebuild it with "
                              "this h3trt's h3trt build ... --lora-slots N --lora-max-rank R.")


def one_rank_exchange(qkv_send: torch.Tensor, attention) -> torch.Tensor:
    """The Ulysses exchange of a group of one (parallel/ulysses.py UlyssesExchange's contract at sp=1): the send buffer
    [1, 3, B, S, N, D] holds every row and head, so q/k/v go to `attention` as they are and its [B, S, N, D] output
    comes back as the received buffer [1, B, S, N, D]. A FastH3-VSA block's buffer holds its gate too ([1, 4, ...])."""
    return attention(*qkv_send[0].unbind(0)).unsqueeze(0)


class Engine:
    """A loaded bundle. `load_report` is the cold-start split (seconds, bytes, GB/s, what was hashed);
    `component_ready(name)` waits until the files of an eager component (video_vae/, text_encoder/, ...) are verified,
    which continues in the background after `load` returns."""

    def __init__(self, root: Path, manifest: Manifest, dit: EngineDiT, segments: dict[str, LoadedSegment],
                 load_report: dict | None = None, verification: "BundleVerification | None" = None,
                 compiled_video_decoder: bool = True):
        """`compiled_video_decoder` False: the bundle has none (a TensorRT bundle's plans cover the DiT only), and
        `video_decoders` answers None, which VideoVAE takes as "decode eagerly"."""
        self.root, self.manifest, self.dit, self.segments = Path(root), manifest, dit, segments
        self.load_report = load_report or {}
        self.verification = verification
        self.compiled_video_decoder = compiled_video_decoder

    def component_ready(self, component: str) -> None:
        """Block until every file under `component`/ matched the manifest; raise BundleError if one did not."""
        if self.verification is not None:
            self.verification.wait_prefix(component.rstrip("/") + "/")


    def video_decoders(self, vae) -> dict[tuple[int, int, int], TileDecoder] | None:
        """The compiled tile decoders, by (window latents, tile h, tile w), bound to `vae`'s tensors (the VAE loaded
        at the bundle's --vae-precision: its weights are the compiled segments' inputs); None without any."""
        if not self.compiled_video_decoder:
            return None
        parts: dict[tuple[int, int, int], dict[str, str]] = {}
        for name in self.manifest.segments:
            parsed = parse_video_decoder_name(name)
            if parsed is not None:
                parts.setdefault(parsed[1], {})[parsed[0]] = name
        cuda_graph = self.manifest.video_decoder_cuda_graph
        return {key: TileDecoder({p: self.segments[n] for p, n in names.items()},
                                 {p: self.manifest.segments[n] for p, n in names.items()}, vae, cuda_graph)
                for key, names in parts.items()}

    @classmethod
    def load(cls, root: Path, device: str | torch.device, mesh=None, sp_group=None, trust=None,
             threads: int | None = None, early: tuple[str, ...] = (),
             alongside: Callable[["BundleVerification"], None] | None = None) -> "Engine":
        """Load a bundle for one rank: `mesh` is the launched MeshConfig (None: one process), `sp_group` this
        rank's sequence-parallel group when the bundle's sp > 1. With `trust` (an Ed25519 public key file) the
        manifest must carry that key's signature, and every file is hashed (the verified-once record is not
        consulted); the compiled code is checked before any of it loads.

        Cold start, overlapped (each file hashed in chunks on `threads` threads, the default one per core up to 16):
          1. the manifest and environment checks; the size of every file; which files the verified-once record trusts
          2. the compiled code (segments/, inductor_cache/) verified first, then loaded on this thread, while
          3. the DiT weight files are read straight into device memory, each chunk hashed as it is read, and
          4. the eager components' files (VAEs, text encoder) are verified once the weights are read, in the
             background: the pipeline waits for a component's files (`component_ready`) before loading it.
        `early`: components (top-level folders) verified right after the code, before the weights; `alongside` is
        called with the verification once everything is queued, so a caller can load those components on its own
        thread while the weights stream (the text encoder, which the first step needs)."""
        t0 = time.perf_counter()
        root = Path(root)
        device = torch.device(device)
        manifest = read_trusted_manifest(root, trust) if trust is not None else read_manifest(root)
        if manifest.backend == "tensorrt":  # plans: their own GPU check, runner and loader
            return load_trt_engine(cls, root, manifest, device, mesh)
        check_load(root, manifest, device, mesh)
        verification = BundleVerification(root, manifest, threads or hash_threads(), use_record=trust is None)
        marks = {"t0": t0, "checks": time.perf_counter()}
        segments, weights = _stream(root, manifest, device, verification, early, alongside, marks)
        dit = _engine_dit(root, manifest, segments, weights, device, sp_group, marks)
        return cls(root, manifest, dit, segments, _load_report(manifest, verification, marks), verification)



def _adaln_file(manifest: Manifest) -> str:
    return "adaln_tables" if manifest.adaln.baked else "adaln_weights"


def _stream(root: Path, manifest: Manifest, device: torch.device, verification: "BundleVerification",
            early: tuple[str, ...], alongside, marks: dict) -> tuple[dict[str, LoadedSegment], dict]:
    """Steps 2-4 of a load (Engine.load): the segments loaded and the DiT weight files read, {name: tensors}, while
    the rest is verified in the background; `marks` gets when the code was verified, the segments loaded and the
    last weight file was on the device."""
    adaln_file = _adaln_file(manifest)
    try:
        # 2-4 are queued in this order on one pool: code first (small), then weights, then components.
        code = verification.verify([rel for rel in manifest.files if rel.startswith(CODE_PREFIXES)])
        first = tuple(f"{c.rstrip('/')}/" for c in early)
        verification.verify([rel for rel in manifest.files if rel.startswith(first)])
        weight_futures = {name: verification.read(f"weights/{name}.safetensors", device)
                          for name in (*DIT_WEIGHT_FILES, adaln_file)}
        # The components' files only once the weights are read: queued beside them they split the disk (a full
        # fp8 bundle's 21 GB of weights and 11 GB of VAE files, read together, both finished at 22.3 s on the
        # H200's disk), and nothing needs the VAEs before the first step.
        verification.verify_after(list(weight_futures.values()),
                                  [rel for rel in manifest.files if not rel.startswith((*CODE_PREFIXES, *first))
                                   and not rel.startswith("weights/")])
        verification.close_submissions()
        if alongside is not None:
            alongside(verification)
        verification.wait(code)
        marks["code"] = time.perf_counter()
        segments = load_segments(root, manifest.backend, manifest.segments, device)
        marks["segments"] = time.perf_counter()
        weights = {name: verification.result(f) for name, f in weight_futures.items()}
        # When the last weight file was on the device (each reader synchronised its own copies).
        marks["weights"] = max(verification.done_at[f"weights/{name}.safetensors"] for name in weight_futures)
    except BaseException:
        verification.abandon()
        raise
    return segments, weights


def _engine_dit(root: Path, manifest: Manifest, segments: dict[str, LoadedSegment], weights: dict,
                device: torch.device, sp_group, marks: dict) -> EngineDiT:
    """The DiT runner over the loaded segments and weights, with its AdaLN runner and its block-sparse kernel
    or VSA kernel (compiled and warmed now: `marks` gets how long that took)."""
    cfg, quant, attention = manifest.model_config, manifest.quant or {}, manifest.attention
    adaln = adaln_runner(manifest, weights.pop(_adaln_file(manifest)), cfg, device)
    sharded = manifest.mesh.sp > 1
    t_sparse = time.perf_counter()
    vsa = manifest.vsa
    if vsa is None:
        sparse_kernel, sparse_problem = bundle_sparse_kernel(root, manifest, device)
    else:  # a FastH3-VSA bundle: VSA's kernel, warmed now; no SubBlock sparse attention (pipeline refuses it)
        load_vsa_kernel(device, cfg.num_heads // manifest.mesh.sp, cfg.head_dim, manifest.precision.spec.dtype,
                        vsa.kernel, vsa.tile)
        sparse_kernel, sparse_problem = None, None
    marks["sparse_s"] = time.perf_counter() - t_sparse
    slots = manifest.lora_slots  # --lora-slots: the banks are allocated here, zeros until an adapter loads
    lora_slots = (AdapterSlots(cfg, manifest.task, slots.slots, slots.max_rank, manifest.precision.spec.dtype, device,
                            slots.targets) if slots is not None else None)
    dit = EngineDiT(cfg, segments, manifest.segments, weights, adaln, device, sp_group if sharded else None,
                    quant.get("layer_segments"), dense_kernel(attention) if attention else None, sparse_kernel,
                    lora_slots, vsa, _final_heads(manifest, weights["final"], device))
    # The manifest's caps, narrowed by the load: a sharded bundle's fa4 that did not warm, with why
    dit.caps = replace(bundle_caps(manifest), sparse_kernel=sparse_kernel, sparse_problem=sparse_problem)
    return dit


def _final_heads(manifest: Manifest, final: dict[str, torch.Tensor], device) -> StepHeads | None:
    """A PDD bundle's heads per forward, keyed by the video timestep of each forward of its one schedule."""
    if not any(name.startswith(PDD_PREFIX) for name in final):
        return None
    s = manifest.schedule
    video_t = torch.tensor([tv for tv, _ in Schedule(s.steps, s.video_shift, s.audio_shift, s.rungs).timesteps()],
                           dtype=torch.float32)
    return StepHeads(video_t, {n: final[PDD_PREFIX + n] for n in HEAD_WEIGHTS}).to(device)


def _load_report(manifest: Manifest, verification: "BundleVerification", marks: dict) -> dict:
    """The cold-start split of one load (Engine.load_report), from the phases' `marks`."""
    end = time.perf_counter()
    t0, t_checks, t_code, t_segments, t_weights = (marks[k] for k in ("t0", "checks", "code", "segments", "weights"))
    stats = verification.weight_stats
    return {
        "threads": verification.threads,
        "checks_s": round(t_checks - t0, 4),  # manifest, environment, sizes, verified-once record
        "code_verified_s": round(t_code - t_checks, 4),  # compiled code hashed (segments/, inductor_cache/)
        "segments_s": round(t_segments - t_code, 4),  # compiled segments loaded (overlaps the weight read)
        "weights_s": round(t_weights - t_checks, 4),  # DiT weights read, hashed and on the device
        "weights_bytes": stats.bytes,
        "weights_GBps": round(stats.bytes / 1e9 / max(t_weights - t_checks, 1e-9), 3),
        "weights_read": stats.to_dict(),
        "files_trusted": len(verification.trusted), "files_hashed": len(manifest.files) - len(verification.trusted),
        "bundle_bytes": manifest.total_bytes,
        # the sparse kernel compiled and warmed (0 where none is served)
        "sparse_kernel_s": round(marks["sparse_s"], 4),
        "total_s": round(end - t0, 4),
    }


def bundle_sparse_kernel(root: Path, manifest: Manifest, device: torch.device) -> tuple[str | None, str | None]:
    """(kernel, problem) of the block-sparse attention a bundle serves, compiled now so that no request compiles it:
      - built with --sparse-attention: the kernel its manifest records (checked before anything loaded), warmed with
        its router (warm_sparse) at one rank's heads in the bundle's dtype; a kernel that does not compile here
        refuses the load, as a bundle whose attention kernel cannot run does (it was built to serve it, and its
        requests default to it);
      - sp > 1 without it: fa4 where it loads (never flex, which a request may compile again), warmed as above (a
        failure, or no fa4, leaves the engine dense-only, with why);
      - sp=1 without it: none, and why (its compiled block holds its attention)."""
    cfg, sp = manifest.model_config, manifest.mesh.sp
    record = manifest.sparse
    if record is None:
        if sp > 1:
            return load_sparse_kernel(device, cfg.num_heads // sp, cfg.head_dim, torch.bfloat16, kernels=("fa4",))
        return None, NO_SPARSE_HALVES
    try:
        warm_sparse(record.kernel, device, cfg.num_heads // sp, cfg.head_dim, manifest.precision.spec.dtype,
                    record.block, record.tile)
    except Exception as e:  # noqa: BLE001 - any failure of a kernel the bundle was built to serve refuses it
        first = str(e).splitlines()[0] if str(e) else ""
        raise BundleError(f"{root}: this bundle serves the {record.kernel} block-sparse attention kernel (h3trt build "
                          f"--sparse-attention), which did not compile on {device} ({type(e).__name__}: {first}). "
                          "Serve it where it was built, or rebuild it here.") from e
    return record.kernel, None
