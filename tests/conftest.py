import os

import pytest
import torch

from h3trt.models.checkpoint_writer import random_state_dict, save_comfy, save_diffusers, save_official
from h3trt.models.config import H3Config


@pytest.fixture(scope="session")
def tiny_cfg() -> H3Config:
    return H3Config.tiny()


@pytest.fixture(scope="session")
def tiny_states(tiny_cfg):
    """Native float32 weights of the two partitions."""
    return {"FL2VA": random_state_dict(tiny_cfg, 0), "Ref2VA": random_state_dict(tiny_cfg, 1)}


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory, tiny_cfg, tiny_states):
    """The same float32 weights written in the official, diffusers and Comfy layouts."""
    root = tmp_path_factory.mktemp("ckpt")
    official = save_official(root / "official", tiny_cfg, tiny_states, torch.float32, shards=3)
    diffusers = save_diffusers(root / "diffusers", tiny_cfg,
                               {"transformer": tiny_states["FL2VA"], "transformer_ref": tiny_states["Ref2VA"]},
                               torch.float32)
    comfy = save_comfy(root / "comfy" / "h3.safetensors", tiny_cfg, tiny_states["FL2VA"], torch.float32)
    return {"official": official, "diffusers": diffusers, "comfy": comfy}


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory):
    """A private cache for the embedded tiny default, shared by every test of the session."""
    cache = tmp_path_factory.mktemp("cache")
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(cache)
    yield cache
    if old is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = old


@pytest.fixture(scope="session")
def tiny_root(tiny_cache):
    from h3trt.models.tiny import ensure_tiny_checkpoint

    return ensure_tiny_checkpoint()
