"""What a bundle serves: a request's task, canvas and schedule checked against its manifest, each refusal naming
what the bundle serves and the rebuild that would serve the request."""

from __future__ import annotations

from .manifest import BundleError, Manifest
from .schedules import schedule_refusal


def check_request(manifest: Manifest, width: int, height: int, num_frames: int, steps: int, video_shift: float,
                  audio_shift: float, task: str, schedule_field: str = "steps", schedule_note: str = "") -> None:
    """Refuse a request the bundle was not built to serve, naming what it serves; a schedule it does not serve is
    about `schedule_field`, the request's words on where it came from in `schedule_note`."""
    if task not in manifest.tasks:
        raise BundleError(f"This bundle serves {list(manifest.tasks)}, not {task}; build one from the "
                          f"{'Ref2VA' if task == 'ref2va' else 'FL2VA'} partition (h3trt build --task {task}).",
                          field="task")
    profiles = manifest.profiles
    if not any(p.width == width and p.height == height and p.num_frames == num_frames for p in profiles):
        built = ", ".join(f"{p.width}x{p.height}x{p.seconds:g}s" for p in profiles)
        raise BundleError(f"This bundle was not built for {width}x{height}, {num_frames} frames; its profiles are "
                          f"{built}. Rebuild with --canvas {width}x{height}x{num_frames / 24:.4g}.",
                          field="resolution")
    refusal = schedule_refusal(manifest.schedules, steps, video_shift, audio_shift, schedule_note)
    if manifest.adaln.baked and refusal:
        raise BundleError(refusal, field=schedule_field)
