"""The eager H3 pipeline: one request in, one MP4 (and a timing JSON beside it) out.

Reads top to bottom as the stages a request goes through:
  0. validate: inputs readable, canvas and duration allowed (before any model is loaded)
  1. text encode (Qwen3-VL to layer 50)
  2. condition encode: keyframes / reference images through the video VAE, reference audio through the audio VAE
  3. pack the sequence, draw the noise from the seed, denoise (one DiT evaluation per step)
  4. video decode (streamed a window at a time) and audio decode
  5. mux: H.264 + AAC under a temporary name
  6. the record: a `Clip` (records.py), the MP4 under its temporary name and its record, which the job layer commits
     (jobs/work.py): the pipeline puts nothing at the output path
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from ..adapters.merge import LoraSpec
from ..adapters.resident import ResidentAdapters, select_adapters
from ..adapters.shape import SlotShape
from ..adapters.spec import AdapterSpec
from ..media.output_files import DEFAULT_CRF, discard
from ..models.audio_vae import AudioVAE
from ..models.distilled.families import DistilledServing, DistilledSpec
from ..models.packing import AUDIO_SAMPLE_RATE, FPS, PackedLayout, RefBlock, pack_ref2va, pack_t2va
from ..models.runner import NO_EXTRAS, EvalExtras
from ..models.sampler import Latents, Schedule, denoise, denoise_batch, initial_latents
from ..models.sparse.run import SparseRun
from ..models.step_cache import StepCache
from ..models.text_encoder import AudioRef, ImageRef, VideoRef
from ..models.video_vae import VideoVAE, image_to_pixels
from ..models.vsa.plan import VsaRun
from ..request.request import CanvasDefaults, Request
from .evaluation import (DENSE, Branch, StepProfiler, check_finite, counted, guided_denoiser, new_step_cache,
                         sparse_run_for)
from .loading import Components, Deferred, load_bundle, load_checkpoint
from .parallel_decode import DecodeResult, decode_and_write
from .prepare import Encoded, Prepared
from .records import Clip, ClipRecord, ColdStart, KnownFields, StageTimer, clip_record


@dataclass(frozen=True)
class Target:
    """Where a clip is written, and by whom."""

    output: Path  # the clip's path: its record names it, and the MP4 is written beside it under a temporary name
    crf: int = DEFAULT_CRF  # H.264 constant rate factor
    group: object = None  # the ranks that decode the clip together (None: this process alone), the writer first
    writes: bool = True  # this rank writes the MP4 and gets the Clip (a group's first rank)


class H3Pipeline:
    """Loaded components for one task partition. Constructed from built parts; `load` reads a checkpoint,
    `load_engine` a bundle."""

    def __init__(self, dit, text_encoder, video_vae: VideoVAE | None, audio_vae: AudioVAE | None,
                 shifts: tuple[float, float], device: torch.device, canvas: CanvasDefaults = CanvasDefaults(),
                 check_request=None, cfg_group=None, loras: tuple[dict, ...] = (),
                 deferred_vaes: Deferred | None = None, load_report: ColdStart | None = None,
                 adapters: ResidentAdapters | None = None, distilled: DistilledServing | None = None,
                 distilled_record: dict | None = None, text_prefetched: dict | None = None):
        """`deferred_vaes`: the VAEs still loading on a background thread (loading.Components), in place of the two
        (a bundle's cold start: the first denoise step needs neither); the first use waits for them and completes
        `load_report`, a bundle's cold-start split, for every record."""
        if (video_vae is None) != (deferred_vaes is not None) or (audio_vae is None) != (deferred_vaes is not None):
            raise ValueError("H3Pipeline takes either both VAEs or deferred_vaes, not a mix.")
        self.dit, self.text_encoder, self._vaes = dit, text_encoder, (video_vae, audio_vae)
        self._deferred_vaes, self.load_report = deferred_vaes, load_report
        self.shifts, self.device, self.canvas = shifts, torch.device(device), canvas
        self.check_request = check_request  # a bundle's admission check: (prepared) -> None or raise
        self.cfg_group = cfg_group  # the 2-rank group that splits guidance branches (None: both run here)
        self.loras = tuple(loras)  # records of the LoRAs merged into the DiT (adapters/merge.py), for every clip record
        self.adapters = adapters  # resident LoRA adapters a request picks (adapters/resident.py); None: none
        # a distilled checkpoint's schedule and refusals (models/distilled/families.py), and its record for every clip
        self.distilled, self.distilled_record = distilled, distilled_record
        self.text_prefetched = dict(text_prefetched or {})  # t2va prompt -> encoding made while loading (one use)

    def _ready_vaes(self) -> tuple[VideoVAE, AudioVAE]:
        if self._deferred_vaes is not None:
            video_vae, audio_vae, seconds, verified = self._deferred_vaes.result()
            self._vaes, self._deferred_vaes = (video_vae, audio_vae), None
            if self.load_report is not None:
                self.load_report = self.load_report.with_vaes(seconds, verified)
        return self._vaes

    @property
    def video_vae(self) -> VideoVAE:
        return self._ready_vaes()[0]

    @property
    def audio_vae(self) -> AudioVAE:
        return self._ready_vaes()[1]

    @classmethod
    def from_components(cls, parts: Components, device, canvas: CanvasDefaults = CanvasDefaults(), cfg_group=None):
        return cls(parts.dit, parts.text_encoder, parts.video_vae, parts.audio_vae, parts.shifts, device, canvas,
                   parts.check_request, cfg_group, loras=parts.loras, deferred_vaes=parts.deferred_vaes,
                   load_report=parts.load_report, adapters=parts.adapters, distilled=parts.distilled,
                   distilled_record=parts.distilled_record, text_prefetched=parts.text_prefetched)

    @classmethod
    def load(cls, model_root: Path, task: str, device: str = "cpu", canvas: CanvasDefaults = CanvasDefaults(),
             vae_precision: str | None = None, loras: tuple[LoraSpec, ...] = (), sp_group=None, cfg_group=None,
             adapters: tuple[AdapterSpec, ...] = (), lora_slots: SlotShape | None = None,
             distilled: DistilledSpec | None = None):
        """The eager pipeline for `task`'s partition (loading.load_checkpoint); on a mesh, this rank's Ulysses group
        (`sp_group`) and guidance-branch group (`cfg_group`); `adapters` resident beside the DiT, in `lora_slots`;
        `distilled` fused into it."""
        return cls.from_components(load_checkpoint(model_root, task, device, vae_precision, loras, sp_group, adapters,
                                                   lora_slots, distilled), device, canvas, cfg_group)

    @classmethod
    def load_engine(cls, bundle_root: Path, device: str = "cpu", canvas: CanvasDefaults = CanvasDefaults(),
                    mesh=None, sp_group=None, cfg_group=None, vae_precision: str | None = None,
                    trust: Path | None = None, adapters: tuple[AdapterSpec, ...] = (),
                    loras: tuple[LoraSpec, ...] = (), serve_adapters: bool = False,
                    prefetch_prompts: tuple[str, ...] = ()):
        """A bundle's pipeline for one rank (loading.load_bundle); `cfg_group` this rank's guidance-branch group;
        `adapters` and `loras` (an adapter on every request) in the bundle's LoRA slots; `serve_adapters`: requests
        may name adapters that join later (a server's --lora-dir) even when none is given at start."""
        return cls.from_components(load_bundle(bundle_root, device, mesh, sp_group, vae_precision, trust, adapters,
                                               loras, serve_adapters, prefetch_prompts), device, canvas, cfg_group)

    def new_sparse_run(self, request: Request) -> SparseRun | VsaRun | None:
        """A request's block-sparse attention over its evaluations (evaluation.sparse_run_for), or None."""
        return sparse_run_for(self.dit, request, self.device)

    def eval_extras(self, request: Request, cache: StepCache | None,
                    sparse: SparseRun | VsaRun | None) -> EvalExtras:
        """What each of a request's evaluations carries besides its rows (models/runner.py): its step cache's context
        ("cond", the reference's name for the one branch; under guidance each branch gets its own), its block-sparse
        run and its adapters. Its members are also what the clip's record asks of the request's features."""
        return EvalExtras(cache=cache.context("cond") if cache is not None else None, sparse=sparse,
                          adapters=select_adapters(self.adapters, request.adapters))

    def record_parts(self, request: Request, extras: EvalExtras | None = None) -> tuple:
        """What the clip record asks for each feature's fields (records.clip_record): the loaded model's (its merged
        LoRAs, distilled checkpoint, and the resident adapters as the request named them, those at scale 0 too),
        then each member of the request's `extras` (None: a batched denoise's, which carry the adapters' rows only)."""
        model = KnownFields({"loras": list(self.loras) or None, "distilled": self.distilled_record,
                             "adapters": self.adapters.record(request.adapters) if self.adapters is not None else None})
        return (model, *(extras.record_parts() if extras is not None else ()))

    def schedule(self, request: Request) -> Schedule:
        """A request's schedule: its steps and shifts (the model's where it states none); a distilled model's family
        decides its rungs and refuses what it cannot run."""
        s = request.schedule
        if self.distilled is not None:
            return self.distilled.schedule(s.steps, s.video_shift, s.audio_shift)
        return Schedule.resolve(s.steps, s.video_shift, s.audio_shift, self.shifts)

    @torch.no_grad()
    def generate(self, prepared: Prepared, target: Target, timer: StageTimer | None = None,
                 on_step: Callable[[int, int], None] | None = None, on_frames: Callable[[int], None] | None = None,
                 profile_step: int | None = None) -> Clip | None:
        """Stages 1-6 for a prepared request: the finished clip, not committed (None on a rank that does not write).
        Every rank of `target.group` denoises and decodes its share of the video tiles; without a group a rank that
        does not write stops after denoising. `timer` (a fresh StageTimer when None) takes the stages' times;
        `on_step(i, n)` is called after each evaluation (it may raise to stop the job), `on_frames(n)` on the writing
        rank as frames reach the encoder; `profile_step`: the evaluation (from 1) whose host overhead is measured
        (evaluation.py StepProfiler)."""
        timer, start = timer or StageTimer(self.device), time.perf_counter()
        # 1. Prepare: what the request asks of the denoise besides the model (a step cache, block-sparse attention).
        req = prepared.request
        cache, sparse = new_step_cache(req, self.schedule(req)), self.new_sparse_run(req)
        # 2-3. Encode the text and the conditions, pack, denoise (the request's extras: the record asks them too).
        schedule, layout, final, extras = self._denoise_request(prepared, on_step, timer, cache, profile_step, sparse)
        check_finite(final)
        if not target.writes and target.group is None:
            return None
        # 4-5. Decode and mux, streamed: a window of frames is encoded while the next decodes.
        decoded = self._decode_and_mux(prepared, layout, final, target, timer, on_frames)
        if not target.writes:
            return None
        # 6. The record: every feature's part, a request denoised dense saying so.
        dense = () if extras.sparse is not None else (DENSE,)
        return clip_of(decoded, lambda: replace(
            self._record(prepared, schedule, layout, target.output, decoded, timer,
                         (*self.record_parts(prepared.request, extras), *dense)),
            wall_s=round(time.perf_counter() - start, 4)))  # the stages overlap (decode, audio, encode)

    @torch.no_grad()
    def denoise_request(self, prepared: Prepared, on_step: Callable[[int, int], None] | None = None,
                        timer: StageTimer | None = None, cache: StepCache | None = None,
                        profile_step: int | None = None,
                        sparse: SparseRun | VsaRun | None = None) -> tuple[Schedule, PackedLayout, Latents]:
        """Stages 1-3 for a prepared request: the schedule, the packed layout and the final latent rows. A request
        with a step cache fills `cache` (a new one when None) with what it skipped; one with sparsity fills `sparse`
        (a new one when None) with which evaluations ran sparse."""
        return self._denoise_request(prepared, on_step, timer, cache, profile_step, sparse)[:3]

    def _denoise_request(self, prepared: Prepared, on_step: Callable[[int, int], None] | None,
                         timer: StageTimer | None, cache: StepCache | None, profile_step: int | None,
                         sparse: SparseRun | VsaRun | None) -> tuple[Schedule, PackedLayout, Latents, EvalExtras]:
        """denoise_request's stages, and the extras its evaluations carried (for the record)."""
        req, timer = prepared.request, timer or StageTimer(self.device)
        schedule = self.schedule(req)
        cache = cache or new_step_cache(req, schedule)
        sparse = sparse or self.new_sparse_run(req)
        # Last-line guards: every front door admitted the request (jobs/admission.py), but against the model of
        # the process that admitted it; the one loaded here need not be that one (a server's stored job outlives the
        # process that admitted it: a restart with another --engine or --cfg takes it; a fleet's ingress and its
        # worker replicas load their models apart).
        self._guard(prepared)
        if self.cfg_group is not None and req.guidance.scale == 1.0:
            raise ValueError("This job splits guidance branches over cfg=2 rank groups, but the request has no "
                             "guidance (--guidance 1, H3's default); launch with --cfg 1 or pass --guidance > 1.")

        # 1. Text (and the negative branch's text under guidance).
        with timer("text_encode"):
            text = self._encode_text(prepared)
            negative = (self._encode_text(prepared, req.guidance.negative_prompt) if req.guidance.scale > 1.0
                        else None)

        # 2. Conditions, in packed order.
        with timer("condition_encode"):
            conditions = self._encode_conditions(prepared)

        # 3. Pack, noise, denoise.
        layout, latents = self._pack(prepared, text.tags, conditions)
        branches = None
        if negative is not None:
            branches = (Branch(text.embeds.to(self.device), layout.to(self.device)),
                        Branch(negative.embeds.to(self.device),
                               self._pack(prepared, negative.tags, conditions)[0].to(self.device)))
        if profile_step is not None and not 1 <= profile_step <= schedule.num_evaluations:
            raise ValueError(f"--profile-step {profile_step}: this request runs {schedule.num_evaluations} "
                             "evaluations (count from 1).")
        with timer("denoise"):
            begun = time.perf_counter()

            def stepped(i: int, n: int) -> None:
                timer.step_marks.append(time.perf_counter() - begun)
                if on_step is not None:
                    on_step(i, n)

            extras = self.eval_extras(req, cache, sparse)
            final = self._denoise(text.embeds, layout, latents, schedule, stepped, branches, req.guidance.scale,
                                  profile_step, timer, extras)
        if cache is not None and self.cfg_group is not None:  # every rank of the cfg group: a collective
            cache.gather(self.cfg_group)
        return schedule, layout, final, extras

    def _guard(self, prepared: Prepared) -> None:
        """What the model cannot serve, asked again on the rank that runs it: a bundle's task, canvas and schedule;
        a distilled family's task, guidance and step cache."""
        if self.check_request is not None:
            self.check_request(prepared)
        if self.distilled is not None:
            req = prepared.request
            self.distilled.check(req.task, req.guidance.scale, req.speed.cache)

    @torch.no_grad()
    def encode_request(self, prepared: Prepared, timer: StageTimer | None = None) -> Encoded:
        """Stages 1-2 and the pack of a request that will be denoised in a batch (single-branch: no guidance)."""
        req, timer = prepared.request, timer or StageTimer(self.device)
        schedule = self.schedule(req)
        self._guard(prepared)  # the last-line guard of denoise_request
        # What a batch cannot share: only requests with a batch key are batched (request/request.py BatchKey.of);
        # admission does not know which requests will share a batch.
        if req.guidance.scale != 1.0:
            raise ValueError("Batched requests run one branch (guidance 1, H3's default); run a guided request alone.")
        if req.speed.sparse.enabled or self.dit.caps.vsa is not None:
            raise ValueError("Block-sparse attention (SubBlock, or a FastH3-VSA model's VSA) counts one request's "
                             "evaluations; run such a request alone (h3trt run --prompt ...).")
        if req.speed.cache is not None:
            raise ValueError("Step caching decides per request, and a batch shares one evaluation per step; run a "
                             "cached request alone (h3trt run --prompt ... --cache ...).")
        with timer("text_encode"):
            text = self._encode_text(prepared)
        with timer("condition_encode"):
            conditions = self._encode_conditions(prepared)
        layout, latents = self._pack(prepared, text.tags, conditions)
        return Encoded(prepared, schedule, text.embeds, layout, latents)

    @torch.no_grad()
    def denoise_batch(self, batch: list[Encoded], on_step: Callable[[int, int], None] | None = None) -> list[Latents]:
        """Stage 3 for requests of one layout and schedule, stacked along the batch dimension: one DiT evaluation per
        step serves them all; each keeps its own seed's starting rows, so each ends where it would alone."""
        first = batch[0]
        layout = first.layout.digest()
        for other in batch[1:]:
            if other.schedule != first.schedule or other.layout.digest() != layout:
                raise ValueError("denoise_batch needs one schedule and one packed layout (task, canvas, duration and "
                                 f"text length) for the whole batch; {other.prepared.request.inputs.prompt[:40]!r} "
                                 f"differs from {first.prepared.request.inputs.prompt[:40]!r}.")
        device, dit = self.device, self.dit
        lay = first.layout.to(device)
        text_BLC = torch.cat([e.text_embeds for e in batch]).to(device)
        uses = first.prepared.request.adapters
        if any(e.prepared.request.adapters != uses for e in batch[1:]):
            raise ValueError("denoise_batch runs one LoRA adapter set for the whole batch (one evaluation carries one "
                             "set); batch requests with different adapters apart.")
        extras = EvalExtras(adapters=select_adapters(self.adapters, uses))

        def model(video_BVC, audio_BAC, unique_t, t_index):
            return dit(video_BVC, audio_BAC, text_BLC, unique_t, t_index, lay, extras)

        starts = [Latents(e.latents.video.to(device), e.latents.audio.to(device)) for e in batch]
        return denoise_batch(model, starts, first.layout, first.schedule, on_step)

    @torch.no_grad()
    def decode_request(self, encoded: Encoded, final: Latents, target: Target, timer: StageTimer | None = None,
                       on_frames: Callable[[int], None] | None = None) -> Clip | None:
        """Stages 4-6 for one request of a batch: its clip, not committed, as `generate`'s (None on a rank of
        `target.group` that does not write: it decodes its share of the tiles)."""
        timer = timer or StageTimer(self.device)
        check_finite(final)
        decoded = self._decode_and_mux(encoded.prepared, encoded.layout, final, target, timer, on_frames)
        if not target.writes:
            return None
        return clip_of(decoded, lambda: self._record(encoded.prepared, encoded.schedule, encoded.layout, target.output,
                                                     decoded, timer, self.record_parts(encoded.prepared.request)))

    def _record(self, prepared: Prepared, schedule: Schedule, layout: PackedLayout, output: Path,
                decoded: DecodeResult, timer: StageTimer, parts: tuple) -> ClipRecord:
        return clip_record(prepared, schedule, layout, output, decoded.frames, decoded.audio_samples, timer,
                           self.device, self.video_vae, self.load_report, parts)

    def _encode_conditions(self, prepared: Prepared) -> tuple[list[torch.Tensor], list[torch.Tensor], list[RefBlock]]:
        """Stage 2: visual condition latents and reference audio rows in packed order, and the ref2va blocks."""
        conditions, ref_audio, ref_blocks = [], [], []
        for _, image in prepared.keyframes:
            conditions.append(self.video_vae.encode_condition(image_to_pixels(image)))
        for ref in prepared.references:
            block_audio = 0
            if ref.audio is not None:
                rows = self.audio_vae.encode_rows(ref.audio)
                ref_audio.append(rows)
                block_audio = rows.shape[0] // 2
            if ref.kind == "image":
                conditions.append(self.video_vae.encode_condition(image_to_pixels(ref.image)))
            elif ref.kind == "video":
                pixels = torch.from_numpy(ref.frames.copy()).permute(3, 0, 1, 2)[None]
                conditions.append(self.video_vae.encode_condition(pixels))
            latent_shape = tuple(conditions[-1].shape[2:]) if ref.kind != "audio" else None
            ref_blocks.append(RefBlock(ref.kind, latent_shape, block_audio))
        return conditions, ref_audio, ref_blocks

    def _pack(self, prepared: Prepared, text_tags: torch.Tensor, conditions) -> tuple[PackedLayout, Latents]:
        """Stage 3 set-up: the packed layout and the seeded starting rows."""
        req, geo, cfg = prepared.request, prepared.geometry, self.dit.cfg
        visual, ref_audio, ref_blocks = conditions
        lf, lh, lw, la = geo.latent_frames, geo.latent_height, geo.latent_width, geo.audio_latents
        if req.task == "ref2va":
            layout = pack_ref2va(text_tags, ref_blocks, lf, lh, lw, la, cfg.patch_size)
        else:
            layout = pack_t2va(text_tags, lf, lh, lw, la, cfg.patch_size, tuple(a for a, _ in prepared.keyframes))
        latents = initial_latents(req.inputs.seed, lf, lh, lw, la, cfg.patch_size, cfg.in_channels, cfg.audio_in_channels,
                                  tuple(visual), tuple(ref_audio))
        return layout, latents

    def _decode_and_mux(self, prepared: Prepared, layout: PackedLayout, final: Latents, target: Target,
                        timer: StageTimer, on_frames: Callable[[int], None] | None = None) -> DecodeResult:
        """Stages 4-5 for one request's final rows [V, C] / [A, C]: what was decoded, and on the writing rank the
        finished MP4 under its temporary name (mp4_temp), not committed.

        Tile-parallel over `target.group` (None: this process alone; otherwise every rank of the group calls this with
        the same rows and only group rank 0 writes); frames are encoded on a background thread while later windows
        decode, AAC as soon as the audio is ready (h3trt/pipeline/parallel_decode.py)."""
        geo, cfg = prepared.geometry, self.dit.cfg
        lf, lh, lw = geo.latent_frames, geo.latent_height, geo.latent_width
        start = time.perf_counter()
        video_vae, audio_vae = self.video_vae, self.audio_vae  # a bundle's VAEs may still be loading: wait here
        timer.span("wait_vaes", start, time.perf_counter())
        video_rows = final.video[layout.num_condition_video_rows:]
        video_latents = video_rows.reshape(1, lf, lh // cfg.patch_size[1], lw // cfg.patch_size[2], cfg.in_channels,
                                           *cfg.patch_size).permute(0, 4, 1, 5, 2, 6, 3, 7)
        video_latents = video_latents.reshape(1, cfg.in_channels, lf, lh, lw)
        start = time.perf_counter()
        result = decode_and_write(video_vae, audio_vae, video_latents,
                                  final.audio[layout.num_condition_audio_rows:], target.output, group=target.group,
                                  fps=FPS, crf=target.crf, sample_rate=AUDIO_SAMPLE_RATE, commit=False,
                                  on_frames=on_frames)
        timer.span("decode_and_mux", start, time.perf_counter())
        for stage, seconds in result.timings_s.items():  # video_decode, audio_decode, mux, decode_tail_s
            timer.seconds[stage] = timer.seconds.get(stage, 0.0) + seconds
        timer.decode_tail = result.tail_s or None
        return result

    def _encode_text(self, prepared: Prepared, prompt: str | None = None):
        """The request's prompt (or `prompt`: the negative branch's) with the task's visual context."""
        req = prepared.request
        prompt = req.inputs.prompt if prompt is None else prompt
        if req.task == "t2va" and prompt in self.text_prefetched:  # encoded while the bundle loaded
            return self.text_prefetched.pop(prompt)
        if req.task == "t2va":
            return self.text_encoder.encode_t2va(prompt)
        if req.task == "fl2va":
            return self.text_encoder.encode_fl2va(prompt, [img for _, img in prepared.keyframes])
        refs = []
        for ref in prepared.references:
            if ref.kind == "image":
                refs.append(ImageRef(ref.image))
            elif ref.kind == "audio":
                refs.append(AudioRef())
            else:
                refs.append(VideoRef(ref.frames, float(FPS), has_audio=ref.audio is not None))
        return self.text_encoder.encode_ref2va(prompt, refs)

    def _denoise(self, text_embeds, layout: PackedLayout, latents: Latents, schedule: Schedule, on_step,
                 branches: tuple[Branch, Branch] | None = None, guidance: float = 1.0,
                 profile_step: int | None = None, timer: StageTimer | None = None, extras: EvalExtras = NO_EXTRAS):
        dit, device = self.dit, self.device
        lay = layout.to(device)
        text = text_embeds.to(device)
        if branches is None:  # one branch: its extras' step cache context is "cond" already

            def model(video, audio, unique_t, t_index):
                return dit(video, audio, text, unique_t, t_index, lay, extras)
        else:
            model = guided_denoiser(dit, *branches, guidance, self.cfg_group, extras)
        if extras.sparse is not None:
            model = counted(model, extras.sparse)
        profiler = None
        if profile_step is not None:
            model = profiler = StepProfiler(model, profile_step, device)

        start = Latents(latents.video.to(device), latents.audio.to(device))
        final = denoise(model, start, layout, schedule, on_step)
        if profiler is not None and timer is not None:
            timer.step_profile = profiler.report
        return final



def clip_of(decoded: DecodeResult, record: Callable[[], ClipRecord]) -> Clip:
    """The clip of a decode on the writing rank, its record made by `record()`: if that fails, the MP4 under its
    temporary name goes too, and the error is raised."""
    try:
        return Clip(decoded.mp4_temp, record())
    except BaseException:
        discard(decoded.mp4_temp)
        raise
