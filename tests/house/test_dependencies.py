"""setup.py's version ranges for the dependencies whose exact behaviour a fixture, an oracle or a compiled artifact
depends on: each is pinned or bounded above (a release the day CI runs on a fresh machine must not be installed
untested), and the installed one lies inside (what was tested is what runs). Widening a bound is a deliberate step,
after the check its reason names."""

from __future__ import annotations

import importlib.metadata

import pytest

from h3trt.calibration.recipe import MODELOPT_VERSION
from helpers import setup_requirements

# distribution: why its exact behaviour matters (and how a new release is admitted)
BEHAVIOUR_MATTERS = {
    "transformers": "its Qwen3VLVideoProcessor is recorded in tests/data/qwen_video_reference.npz and reproduced by "
                    "h3trt/models/qwen_video.py: run scripts/make_qwen_video_fixtures.py --check under the new release",
    "diffusers": "the correctness oracle of every parity test, and the VAE modules h3trt's decode plan reproduces",
    "peft": "diffusers loads LoRAs through it: the oracle of tests/adapters/test_lora.py",
    "torch": "compiled bundles are specific to the torch version that built them",
    "nvidia-modelopt": "h3trt/calibration/calibrate.py is written against one release (recipe.py MODELOPT_VERSION)",
    "tensorrt-rtx": "plans run only under the TensorRT version that built them",
    "polygraphy": "h3trt inspect and the onnxruntime parity checks run through its Comparator",
    "ray": "the fleet's autoscaling hooks are Ray Serve 2.60's",
    "openai": "the server's tests drive the API through its client.videos, deprecated in 3.x (the Sora API's end): a "
              "major without it fails them; admit one after the server tests pass under it",
}
BOUNDING = ("<", "<=", "==", "===", "~=")


@pytest.mark.parametrize("name", sorted(BEHAVIOUR_MATTERS))
def test_a_dependency_whose_behaviour_matters_is_bounded_above(name):
    requirements = setup_requirements(name)
    assert requirements, f"setup.py does not name {name}"
    for requirement in requirements:
        assert any(s.operator in BOUNDING for s in requirement.specifier), (
            f"setup.py's {requirement} has no upper bound: the next {name} release would be installed untested "
            f"({BEHAVIOUR_MATTERS[name]}); bound it at the newest release checked")


@pytest.mark.parametrize("name", sorted(BEHAVIOUR_MATTERS))
def test_the_installed_version_is_in_setup_pys_range(name):
    installed = importlib.metadata.version(name)
    for requirement in setup_requirements(name):
        assert requirement.specifier.contains(installed, prereleases=True), (
            f"{name} {installed} is installed; setup.py's tested range is {requirement} ({BEHAVIOUR_MATTERS[name]}): "
            f"pip install -e '.[test]' installs one inside it")


def test_setup_pins_the_modelopt_the_calibration_accepts():
    assert {str(r.specifier) for r in setup_requirements("nvidia-modelopt")} == {f"=={MODELOPT_VERSION}"}


def test_the_sdks_videos_deprecation_is_the_one_warning_silenced():
    """The server's tests call `client.videos` thousands of times a run; the SDK's deprecation warning for it is
    filtered in setup.cfg (nothing else is), so that the run's other warnings stay readable."""
    import warnings

    import openai

    client = openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="unused", max_retries=0, timeout=0.1)
    with warnings.catch_warnings(record=True) as seen:  # records what the suite's filters let through
        with pytest.raises(openai.APIConnectionError):
            client.videos.retrieve("video_1")
        warnings.warn("another deprecation", DeprecationWarning)
    assert [str(w.message) for w in seen] == ["another deprecation"]
