"""`--adapter NAME=FILE[:SCALE]` of `h3trt serve` / `h3trt run` (`AdapterSpec`; SCALE: the adapter's default
strength) and `--lora-dir DIR`'s files (`folder_specs`). Unlike a merged LoRA (`--lora FILE[:SCALE]`, merge.py), an
adapter stays beside the weights in slots (slots.py) and only the requests that name it get it. It may bring its own
schedule (a Turbo LoRA's steps and shifts: `@steps=8,video_shift=5`, or its file's metadata), which a request that
names it and leaves those out runs (schedule.py)."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError
from ..models.lora_format import LoraError
from ..models.sampler import ScheduleValues
from .merge import LoraScaleError, LoraSpec
from .use import SCALE_RANGE
from .schedule import split_spec

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class AdapterSpecError(LoraError, argparse.ArgumentTypeError):
    """A malformed --adapter value (an ArgumentTypeError too: argparse shows its message as the flag's error)."""


@dataclass(frozen=True)
class AdapterSpec:
    """One `--adapter NAME=FILE[:SCALE]`: a resident adapter's name, its file and its default strength."""

    name: str
    path: Path
    scale: float = 1.0
    schedule: ScheduleValues = ScheduleValues()  # @steps=..: over its file's own (schedule.py)
    # A --lora-dir file: a server that cannot use it starts without it (skipped, and says why); an --adapter's
    # refusal stops the start instead (the operator named that file)
    from_folder: bool = False

    @classmethod
    def parse(cls, text: str) -> "AdapterSpec":
        """NAME=FILE[:SCALE][@KEY=VALUE,...] (a file whose name holds ':' keeps it unless the last part is a number;
        the schedule's keys: models/sampler.py SCHEDULE_KEYS)."""
        name, sep, rest = str(text).partition("=")
        if not sep or not NAME_PATTERN.fullmatch(name) or not rest:
            raise AdapterSpecError(f"--adapter {text!r}: expected NAME=FILE[:SCALE][@steps=N,video_shift=S], NAME 1-64 "
                                   "of [A-Za-z0-9._-] (requests pick it by that name), e.g. --adapter "
                                   "style=style.safetensors:0.8.")
        try:
            rest, schedule = split_spec(rest, f"--adapter {text!r}")
            file = LoraSpec.parse(rest)  # FILE[:SCALE] as --lora reads it
        except LoraScaleError:
            raise AdapterSpecError(f"--adapter {text!r}: the scale must be {SCALE_RANGE}.") from None
        except UserError as e:  # argparse shows an ArgumentTypeError's own words
            raise AdapterSpecError(str(e)) from None
        return cls(name, file.path, file.scale, schedule)


def folder_specs(folder: Path) -> tuple[AdapterSpec, ...]:
    """`--lora-dir DIR`: every *.safetensors in DIR, named by its file stem, at scale 1.0 (sorted by name). Nothing
    is read here: the server's catalog checks each file at start and skips those it cannot use
    (catalog.py)."""
    if not folder.is_dir():
        raise UserError(f"--lora-dir {folder}: not a folder; pass the folder that holds the LoRA .safetensors files.")
    return tuple(AdapterSpec(path.stem, path, from_folder=True) for path in sorted(folder.glob("*.safetensors")))
