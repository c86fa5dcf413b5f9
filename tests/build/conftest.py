"""The build floor's fixtures: the 4-layer tiny model both streamed-build files compare on, and the guard their
in-process phases run under (`pytestmark = pytest.mark.usefixtures("no_bundle_served_here")`)."""

import pytest
from safetensors.torch import save_file

from h3trt.models.config import H3Config

from lora_cases import every_linear_lora
from stream_pairs import LAYERS, tiny_checkpoint


@pytest.fixture
def no_bundle_served_here(monkeypatch):
    """The streamed-build files' in-process phases load, calibrate and bake but compile nothing, so a bundle that
    another file of the same worker served (engines/loaders.py bundle_activated) cannot leave a kernel out of anything
    they compare; the refusal it triggers (build/plan.py) guards compiled builds, which run there in fresh processes
    (stream_pairs.build_pair)."""
    from h3trt.build import plan as plan_module

    monkeypatch.setattr(plan_module, "bundle_activated", lambda: None)


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory, tiny_root):
    """The tiny model with 4 main blocks (random, float32, official layout in 3 shards), its other components the
    tiny default's; a calibration prompt file and a LoRA over every linear (AdaLN included)."""
    root = tmp_path_factory.mktemp("tiny4")
    cfg = H3Config.tiny(num_layers=LAYERS)
    tiny_checkpoint(root, tiny_root, cfg, 3)
    (root / "prompts.txt").write_text("a red fox runs through fresh snow\nwaves break on a rocky shore\n")
    save_file(every_linear_lora(cfg, 7, lambda name: 2), str(root / "lora.safetensors"), metadata={"alpha": "2"})
    return root
