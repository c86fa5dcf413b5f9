"""The command line's parser: argparse, with a usage mistake reported as every other user error is (cli.main): one
line, `h3trt: error: <message>`, exit status 2, without argparse's usage block in front of it. Where argparse's own
message leaves out the flag or the fix, the line names them.

    parser = OneLineParser(prog="h3trt", description=...)   # subparsers from add_subparsers are OneLineParsers too
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import NoReturn

from ..errors import UserError

# argparse's name of a flag's type -> what the flag takes
TYPE_KINDS = {"int": "a whole number", "float": "a number"}

_INVALID_TYPE = re.compile(r"argument (?P<flag>[^:/ ]+)\S*: invalid (?P<type>\w+) value: (?P<value>.+)")
_NOT_ALLOWED = re.compile(r"argument (?P<flag>[^:/ ]+)\S*: not allowed with argument (?P<other>[^:/ ]+)\S*")
_NO_VALUE = re.compile(r"argument (?P<flag>[^:/ ]+)\S*: expected (?:one|at least one) argument")


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line and exit status 2; `--help` is argparse's. `add_subparsers`
    makes the subcommands' parsers of this class too (argparse's default parser_class is the parent's class)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"h3trt: error: {explain(message, self.prog)}\n")


def explain(message: str, prog: str) -> str:
    """argparse's `message` as one line that names the flag and the fix; `prog` the command, e.g. "h3trt run"."""
    message = " ".join(message.split())
    if m := _INVALID_TYPE.fullmatch(message):
        kind = TYPE_KINDS.get(m["type"])
        if kind is not None:
            return f"{m['flag']} takes {kind}, got {m['value']}."
        return f"{m['flag']} got {m['value']}, which it cannot read; `{prog} --help` says what it takes."
    if m := _NOT_ALLOWED.fullmatch(message):
        return f"{m['flag']} and {m['other']} cannot be given together; pass one of them."
    if m := _NO_VALUE.fullmatch(message):
        # argparse reads a value that starts with '-' (and is not a plain negative number) as the next flag.
        return f"{m['flag']} needs a value (one that starts with '-' is written {m['flag']}=-VALUE)."
    if message.startswith(("the following arguments are required", "unrecognized arguments",
                           "one of the arguments")):
        return f"{message}; see `{prog} --help`."
    return message


# Flag types: a value is checked when the arguments are read, before anything loads.

def positive_float(text: str) -> float:
    """An amount (GiB of memory): a finite number above 0."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"takes a number above 0, got {text!r}")
    return value


def positive(text: str) -> int:
    """A count of ranks, groups or jobs: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"takes a whole number of at least 1, got {text!r}")
    return value


def crf(text: str) -> int:
    """--crf: H.264's constant rate factor, checked when the arguments are read (not after the generation)."""
    from ..media.output_files import DEFAULT_CRF

    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not 0 <= value <= 51:
        raise argparse.ArgumentTypeError(f"takes a whole number in H.264's range 0..51 (lower is better quality, "
                                         f"default {DEFAULT_CRF}), got {text!r}")
    return value


def steps_list(text: str) -> tuple[int, ...]:
    """build --steps 50,8: the sigma grid points of each schedule a bundle bakes (checked again by BuildConfig)."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes whole numbers separated by commas (one schedule each, e.g. 50,8), "
                                         f"got {text!r}") from None


def shift_list(text: str) -> tuple[float, ...]:
    """build --video-shift 12,5: one sigma shift for every schedule, or one per --steps value."""
    try:
        return tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes numbers separated by commas (one for every schedule, or one per "
                                         f"--steps value, e.g. 12,5), got {text!r}") from None


def device(text: str) -> str:
    """--device: checked when the arguments are read (torch.device takes mps, xla, ... and a run would fall back to
    the CPU for any of them)."""
    if text in ("cpu", "cuda") or (text.startswith("cuda:") and text[len("cuda:"):].isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"takes cpu, cuda or cuda:N (N a GPU index), got {text!r}")


def profile_fields_from_args(args) -> dict:
    """The request fields `h3trt run`'s --profile, step-cache flags and sparse flags give (request/parse.py profile_fields): a
    flag stated explicitly overrides the profile's value for its knob."""
    from ..request.parse import profile_fields

    ratios = parse_mag_ratios(args.mag_ratios) if args.mag_ratios is not None else None
    return profile_fields(args.profile, args.cache, args.sparse_attention, args.sparse_dense_steps,
                          args.sparse_min_seq, threshold=args.cache_threshold,
                          warmup=args.cache_warmup, max_skip_steps=args.cache_max_skip,
                          retention_ratio=args.cache_retention, mag_ratios=ratios,
                          calibrate=True if args.mag_calibrate else None)


def parse_mag_ratios(text: str) -> tuple[float, ...]:
    """R1,R2,... or a .json file: a list of numbers, {"mag_ratios": [...]}, or an --mag-calibrate clip record."""
    if text.endswith(".json"):
        path = Path(text)
        if not path.is_file():
            raise UserError(f"--mag-ratios {path} does not exist; pass R1,R2,... or an existing .json file.")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UserError(f"--mag-ratios {path} cannot be read as JSON ({e}); pass a JSON list of numbers, or the "
                            "clip record of an --mag-calibrate run.") from None
        if isinstance(data, dict) and isinstance(data.get("step_cache"), dict):  # an --mag-calibrate run's record
            data = ((data["step_cache"].get("branches") or {}).get("cond") or {}).get("mag_ratios_calibrated")
        values = data.get("mag_ratios") if isinstance(data, dict) else data
        if not isinstance(values, list):
            raise UserError(f"--mag-ratios {path} must hold a JSON list of numbers, {{\"mag_ratios\": [...]}}, or "
                            "the clip record of an --mag-calibrate run.")
    else:
        values = text.split(",")
    try:
        return tuple(float(v) for v in values)
    except (TypeError, ValueError):
        raise UserError(f"--mag-ratios must be numbers (R1,R2,... or a .json list), got {text!r}.") from None
