"""What a bundle's DiT runner serves (models/runner.py RunnerCaps), read from its manifest alone, so that admission
checks a request against it before anything loads (jobs/admission.py), and the loaded runner (engines/bundle.py
EngineDiT) carries the same caps, narrowed by what its load found (a kernel that did not warm).
"""

from __future__ import annotations

from ..adapters.checks import NO_LORA_SLOTS
from ..models.runner import RunnerCaps
from .manifest import Manifest

NO_SPARSE_HALVES = ("this bundle serves no block-sparse attention: it was built without --sparse-attention, and its "
                    "compiled block holds its attention. Run the request with --sparse-attention 0 (or a dense "
                    "profile: lossless, quality), or rebuild the bundle with h3trt build ... --sparse-attention "
                    "SPARSITY (0: dense unless a request asks), which adds the block's halves around the sparse "
                    "attention.")
# Where a sharded bundle built without --sparse-attention serves block-sparse attention: fa4 between its halves, if
# it loads on the device (engines/bundle.py bundle_sparse_kernel; the loaded runner's caps say whether it did).
SHARDED_SPARSE_KERNEL = "fa4"


def bundle_caps(manifest: Manifest, pinned: int = 0) -> RunnerCaps:
    """A bundle's caps as built: its block-sparse kernel (None with why: a TensorRT bundle's plans, or one process
    without the halves), the fp8 kernel's tile, its FastH3-VSA serving, its LoRA slots less the `pinned` ones (its
    --lora files, held on every request), and whether its DiT segments batch."""
    sparse, slots = manifest.sparse, manifest.lora_slots
    if manifest.vsa is not None or manifest.backend == "tensorrt":  # VSA's own refusal; the plans': NO_SPARSE_KERNEL
        kernel, problem = None, None
    elif sparse is not None:
        kernel, problem = sparse.kernel, None
    elif manifest.mesh.sp > 1:
        kernel, problem = SHARDED_SPARSE_KERNEL, None
    else:
        kernel, problem = None, NO_SPARSE_HALVES
    return RunnerCaps(kernel, problem, sparse.tile if sparse is not None else None, manifest.vsa,
                      adapter_slots=slots.slots - pinned if slots is not None else None,
                      adapter_problem=NO_LORA_SLOTS if slots is None else None,
                      batches=not static_batch_segments(manifest.segments))


def static_batch_segments(segments: dict) -> list[str]:
    """The DiT segments (a manifest's `segments`) compiled for batch 1: a segment's first activation ([B, ...])
    without a dynamic dimension 0 has its batch size baked into the artifact."""
    return sorted(name for name, entry in segments.items()
                  if not name.startswith(("video_decoder", "audio_decoder"))
                  and "0" not in {str(d) for d in entry.get("dynamic", {}).get(entry["inputs"][0], {})})
