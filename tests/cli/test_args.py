"""Usage mistakes on the command line: one line `h3trt: error: <message>` naming the flag and the fix, exit status 2,
and no usage block (cli/args.py OneLineParser). The real `h3trt` parser (cli/parser.py, built of OneLineParsers) is
fed the mistakes. --mag-ratios values that are not finite and positive are refused before any model loads."""

from __future__ import annotations

import argparse

import pytest

import h3trt.cli as cli
from h3trt.models.step_cache import StepCacheConfig
from h3trt.cli.args import OneLineParser, explain

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("argv, line", [
    (["run", "--engine", "b", "--model", "m", "--prompt", "a fox", "--output", "o.mp4"],
     "--model and --engine cannot be given together; pass one of them."),
    (["run", "--seed", "1.5"], "--seed takes a whole number, got '1.5'."),
    (["run", "--duration", "five"], "--duration takes a number, got 'five'."),
    (["run", "--cache", "mag", "--mag-ratios", "-1,0,inf"],
     "--mag-ratios needs a value (one that starts with '-' is written --mag-ratios=-VALUE)."),
    (["run", "--ref"], "--ref needs a value (one that starts with '-' is written --ref=-VALUE)."),
    (["eval", "--engine", "b"], "the following arguments are required: --requests; see `h3trt eval --help`."),
    (["run", "--cache", "teacache"], "argument --cache: invalid choice: 'teacache' (choose from 'first-block', 'mag')"),
    (["frob"], "argument command: invalid choice: 'frob' (choose from " + ", ".join(
        repr(c) for c in cli.COMMANDS) + ")"),
    (["run", "--prompt", "a fox", "--frobnicate"], "unrecognized arguments: --frobnicate; see `h3trt --help`."),
])
def test_a_usage_mistake_is_one_line_and_exit_2(h3trt, no_model_load, argv, line):
    assert h3trt(*argv) == (2, [f"h3trt: error: {line}"])


def test_the_first_mistake_of_several_is_the_one_reported(h3trt, no_model_load):
    """The issue's command: argparse stops at the first mistake, which is now a line, not 16 lines of usage."""
    code, err = h3trt("run", "--engine", "b", "--model", "m", "--seed", "1.5", "--mag-ratios", "-1,0,inf")
    assert code == 2 and err == ["h3trt: error: --model and --engine cannot be given together; pass one of them."]


@pytest.mark.parametrize("ratios, named", [
    ("-1,0,inf", "not -1.0 (#1), 0.0 (#2), inf (#3)"),
    ("1,inf", "not inf (#2)"),  # accepted before: inf > 0
    ("0.99,nan", "not nan (#2)"),
])
def test_mag_ratios_must_be_finite_and_positive(h3trt, no_model_load, tmp_path, ratios, named):
    code, err = h3trt("run", "--prompt", "a fox", "--output", str(tmp_path / "c.mp4"), "--cache", "mag",
                      f"--mag-ratios={ratios}")
    assert code == 2 and len(err) == 1 and f"--mag-ratios must be finite positive numbers, {named}" in err[0], err


def test_mag_ratios_from_a_json_file_are_checked_too(tmp_path):
    from h3trt.cli.args import parse_mag_ratios

    path = tmp_path / "ratios.json"
    path.write_text('{"mag_ratios": [0.99, Infinity, -0.5]}')  # Python's json reads Infinity
    with pytest.raises(ValueError, match=r"not inf \(#2\), -0.5 \(#3\)"):
        StepCacheConfig("mag", 0.06, parse_mag_ratios(str(path)))


def test_help_is_argparses_and_exits_0(h3trt, capsys):
    code, _ = h3trt("run", "--help")
    assert code == 0


def test_subcommand_parsers_are_one_line_parsers_too():
    parser = OneLineParser(prog="h3trt")
    sub = parser.add_subparsers(dest="command").add_parser("run")
    assert isinstance(sub, OneLineParser) and isinstance(parser, argparse.ArgumentParser)


def test_a_type_function_without_a_known_kind_points_to_help():
    assert explain("argument --lora: invalid parse value: 'x:y'", "h3trt run") == (
        "--lora got 'x:y', which it cannot read; `h3trt run --help` says what it takes.")


@pytest.mark.parametrize("argv, line", [
    (["serve", "--store", "sqlite:///x.db"], "--store is for a fleet; add --ray ADDRESS (README, 'A fleet'). One node "
                                             "keeps its jobs and clips in --data-dir."),
    (["serve", "--storage", "s3://b/p", "--max-replicas", "2"], "--storage --max-replicas are for a fleet; add --ray "
                                                                "ADDRESS (README, 'A fleet'). One node keeps its jobs "
                                                                "and clips in --data-dir."),
])
def test_fleet_flags_without_ray_are_refused(h3trt, no_model_load, tmp_path, argv, line):
    """Checked before anything loads or binds (this raised a NameError before the fix)."""
    assert h3trt(*argv, "--data-dir", str(tmp_path / "d")) == (2, [f"h3trt: error: {line}"])
    assert not (tmp_path / "d").exists()
