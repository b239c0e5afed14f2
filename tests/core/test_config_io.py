"""Config dataclass trees through JSON and back (what crosses into vLLM's engine process)."""

import json

import pytest

from deltaserve.core.admission import AdmissionConfig, AdmissionMode
from deltaserve.core.config_io import from_dict, to_dict
from deltaserve.core.errors import InputError
from deltaserve.core.slo import SLOConfig
from deltaserve.model.lora import LoRAConfig
from deltaserve.train.buffer import BufferSave
from deltaserve.train.checkpoint_store import CheckpointConfig
from deltaserve.train.config import BackwardConfig, CoServeConfig, GrantPolicy


def test_every_field_survives_json():
    config = CoServeConfig(
        slo=SLOConfig(0.4, 0.12), admission=AdmissionConfig(AdmissionMode.TEMP, 77, True),
        lora=LoRAConfig(r=4, alpha=9.0, dropout=0.0, target_modules=("v_proj", "q_proj")),
        checkpoint=CheckpointConfig(root="/x", every_steps=3, keep=5, resume=False),
        backward=BackwardConfig(batch_tokens=32, buffer_tokens=None,
                                buffer_save=BufferSave.RESIDUAL_MLP, threads=2,
                                grant_policy=GrantPolicy.PARTITION),
        interrupt=False, num_epochs=None, seed=11)
    wire = json.loads(json.dumps(to_dict(config)))
    back = from_dict(CoServeConfig, wire)
    assert back == config
    assert back.admission.mode is AdmissionMode.TEMP  # enums come back as enums
    assert back.lora.target_modules == ("v_proj", "q_proj")  # tuples as tuples, in order
    assert wire["backward"]["grant_policy"] == "partition"


def test_checks_run_again_and_unknown_keys_are_refused():
    wire = to_dict(CoServeConfig(slo=SLOConfig(1.0, 1.0)))
    wire["lora"]["r"] = 0
    with pytest.raises(InputError, match="lora_r"):
        from_dict(CoServeConfig, wire)
    wire["lora"]["r"] = 8
    wire["optimizer"]["learning_rate"] = 1.0
    with pytest.raises(InputError, match="learning_rate"):
        from_dict(CoServeConfig, wire)
    with pytest.raises(TypeError):
        to_dict(CoServeConfig)  # a class, not a config
