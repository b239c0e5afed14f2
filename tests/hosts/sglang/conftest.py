"""One in-process SGLang engine (SmolLM2-135M, fp32, CPU) shared by the SGLang host's engine
tests, with two adapters: ``a1`` (a fixed random PEFT adapter, never changed) and ``train``
(the reserved training slot; tests publish into it). SGLang's runtime context is process-global,
so the session builds one engine and every test uses it."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from deltaserve.model.lora import AdapterWeights
from tests.hosts.sglang.common import LORA, random_adapter


@pytest.fixture(scope="session")
def smollm2():
    from deltaserve.model.loading import read_config, resolve_model

    path = resolve_model("smollm2")
    return path, read_config(path)


@pytest.fixture(scope="session")
def adapter_a1(smollm2):
    return random_adapter(smollm2[1], seed=1)


@pytest.fixture(scope="session")
def engine(smollm2, adapter_a1, tmp_path_factory):
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("needs the SGLang venv (.venv-sglang: bash scripts/bootstrap.sh --sglang)")
    from deltaserve.hosts.sglang.engine import EngineConfig, InProcessEngine
    from deltaserve.model.peft_io import save_adapter

    path, cfg = smollm2
    root = tmp_path_factory.mktemp("adapters")
    a1 = save_adapter(root / "a1", adapter_a1, str(path))
    train = save_adapter(root / "train", AdapterWeights(cfg, LORA).init_peft_(0), str(path))
    eng = InProcessEngine(EngineConfig(model_path=str(path),
                                       lora_paths=(("a1", str(a1)), ("train", str(train)))))
    yield eng
    eng.close()


@pytest.fixture(scope="session")
def hf_model(smollm2):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2[0], dtype=torch.float32).eval()


