"""The adapters floor's fixtures: the LoRA slot tests' base weights (test_lora_slots.py, test_lora_layouts.py)."""

import pytest

from h3trt.models.checkpoint.writer import random_state_dict

from lora_cases import CFG


@pytest.fixture(scope="module")
def state():
    """lora_cases.CFG's random native weights (seed 0): the base model the slots' adapters are added to."""
    return random_state_dict(CFG, 0)
