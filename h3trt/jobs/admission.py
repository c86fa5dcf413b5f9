"""Admission: whether the loaded model serves a request, asked once by every front door before anything is queued or
loaded, so that each refuses the same request with the same words (its own names for the fields):

  - `h3trt run --prompt` (run/commands.py run_clip), in the CLI's flags
  - each line of `h3trt run --requests` (run/commands.py run_requests, through batch_file.parse_requests), in the
    file's keys
  - `POST /v1/videos` (server/service.py VideoService.create), in the API's fields; a 400 names the field the error
    carries (UserError.field, mapped to the API's name)
  - `h3trt eval` (eval.py), each side's requests against the model of that side

What is checked where it is cheapest lives where it belongs: what a request states and its inputs read in
pipeline/prepare.py `prepare`, a bundle's task, canvas and schedule in `check_bundle_serves`, the text
encoder's files in models/text_encoder.py,
the prompt's tokens in `check_prompt_tokens`. This is the one place that asks all of them, in order. What only a
front door knows stays there: an output's name, folder and space (run/commands.py), the mesh's replicas (run_clip), a
batch's --max-batch and cfg (run_requests), the queue's bound (the server).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ..adapters.checks import check_adapters, check_bundle_sparse
from ..engines.caps import bundle_caps
from ..errors import UserError
from ..models.text_encoder import check_text_encoder_files
from ..pipeline.prepare import Prepared, check_bundle_serves, check_prompt_tokens, prepare
from ..request.fields import FLAGS, Names
from ..request.request import CanvasDefaults, Request
from .model_source import Entry

if TYPE_CHECKING:
    from ..adapters.catalog import AdapterCatalog


def admit(entry: Entry, request: Request, names: Names = FLAGS, *, guidance_branches: int = 1,
          canvas: CanvasDefaults | None = None, checked: set[Path] | None = None,
          own: Callable[[Prepared], None] | None = None, adapters: AdapterCatalog | None = None) -> Prepared:
    """`request`, prepared, when `entry`'s model serves it; else the UserError that says why not, about one field
    where it is about one, its words `names`:

      1. every input read and checked, the geometry resolved (pipeline/prepare.py prepare, on `canvas`: None, the
         entry's)
      1b. the LoRA adapters it names are resident (adapters/checks.py check_adapters; a bundle only if built with
          LoRA slots): in the model's fixed set, or in a server's current set (`adapters`), which resolves them: the
          prepared request names each adapter's file and sha256 as they are now (adapters/catalog.py); and a
          bundle from an earlier h3trt runs them dense only (check_bundle_sparse: its halves have no adapter slots)
      1c. a distilled model (models/distilled/families.py DistilledServing) serves its family's tasks and schedule,
          CFG off
      2. a bundle's runner serves its block-sparse attention and adapters (its caps from its manifest:
         models/runner.py RunnerCaps.check; a checkpoint's are known once loaded, and its pipeline checks them), the
         task, the canvas and the schedule (check_bundle_serves)
      3. on cfg=2 rank groups (`guidance_branches` 2: the launched mesh's cfg degree) each group runs one of
         guidance's two branches, so the request must be guided
      4. `own`: the front door's own checks of the prepared request (run_clip's output: its name, folder and space)
      5. the text encoder's files read back whole (a truncated file: one line, before any load), and the prompts
         within the token budget, by the checkpoint's own tokenizer. Last: the model's files are the first thing
         read of the model (the embedded tiny one is built then), so a bad request is refused without that wait

    `checked`: the component roots whose files this run checked already (a requests file checks each once); None
    checks them for every request (the server: a file cut short since the last request is seen)."""
    model, resident = entry.model, entry.adapters
    prepared = prepare(request, model.canvas if canvas is None else canvas, names)
    if adapters is not None and model.adapters_refusal is None:
        prepared = replace(prepared, request=replace(request, adapters=adapters.resolve(request.adapters)))
    else:
        check_adapters(request.adapters, resident.specs, model.adapters_refusal, resident.per_request)
    if model.distilled_serving is not None:  # a distilled family's task, guidance, cache and schedule
        serving = model.distilled_serving
        s = request.schedule
        serving.check(request.task, request.guidance.scale, request.speed.cache)
        serving.schedule(s.steps, s.video_shift, s.audio_shift)
    if model.manifest is not None:  # what the bundle's runner serves, from its manifest (engines/caps.py)
        check_bundle_sparse(request.adapters, request.speed.sparse_attention, model.manifest.segments)
        caps = bundle_caps(model.manifest, pinned=len(model.loras))
        caps.check(sparse=request.speed.sparse.enabled and caps.vsa is None, adapters=len(request.adapters))
        check_bundle_serves(model.manifest, prepared)
    if guidance_branches == 2 and request.guidance.scale == 1.0:
        n = names
        raise UserError(f"{n.guidance} is 1 (off, H3's default), but this model runs guidance's two branches side by "
                        f"side on cfg=2 rank groups; pass {n.guidance} > 1 with {n.negative_prompt}, or run it with "
                        "cfg 1.", field="guidance")
    if own is not None:
        own(prepared)
    root = model.component_root(request.task)  # a checkpoint without the task's transformer fails here
    if checked is None or root not in checked:
        check_text_encoder_files(root)
        if checked is not None:
            checked.add(root)
    check_prompt_tokens(root, request, names)
    return prepared
