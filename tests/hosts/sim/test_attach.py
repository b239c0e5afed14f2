"""The simulated host attaches through the recipe every host shares
(:func:`deltaserve.train.attach.attach`, from :meth:`BaseHost.attach`), with its timed trainer
as the training half: what the shared recipe does (latency-model files, the data check, the
refusals) the simulated host does too."""

from __future__ import annotations

import pytest

from deltaserve.core.errors import InputError
from deltaserve.core.shape import StepShape
from deltaserve.core.slo import SLOConfig
from deltaserve.hosts import base
from deltaserve.hosts.sim.config import SimHostConfig
from deltaserve.hosts.sim.engine import SimEngine, SimTraining
from deltaserve.hosts.sim.trainer import SimTrainer
from deltaserve.train.config import CoServeConfig
from tests.hosts.sim.conftest import samples

CONFIG = CoServeConfig(SLOConfig(0.4, 0.12))


def test_the_shared_recipe_builds_the_sim_co_server(hardware, monkeypatch):
    calls = []
    recipe = base.attach

    def spy(host, config, **kw):
        calls.append((host, config, kw))
        return recipe(host, config, **kw)

    monkeypatch.setattr(base, "attach", spy)
    eng = SimEngine(SimHostConfig(), hardware=hardware, seed=3)
    co = eng.attach(CONFIG, dataset=samples(20))
    ((host, config, kw),) = calls
    assert host is eng and config is CONFIG
    assert isinstance(kw["training"], SimTraining) and kw["clock"] is eng.clock
    assert isinstance(co.trainer, SimTrainer) and eng.coserver is co
    assert eng.latency_model is co.latency


def test_a_latency_model_file_is_loaded_as_on_every_host(hardware, tmp_path):
    eng = SimEngine(SimHostConfig(), hardware=hardware, seed=3)
    fitted = eng.calibrate(CONFIG.lora, None, CONFIG.latency)
    path = tmp_path / "latency.json"
    fitted.save(path)
    co = eng.attach(CONFIG, dataset=samples(20), latency_model=str(path))
    assert co.latency is not fitted
    for shape in (StepShape((512,)), StepShape(num_decode=32), StepShape((128,), 16)):
        assert co.latency.predict(shape) == pytest.approx(fitted.predict(shape))


def test_a_data_file_needs_a_tokenizer_the_sim_host_has_not(hardware, tmp_path):
    eng = SimEngine(SimHostConfig(), hardware=hardware, seed=3)
    path = tmp_path / "train.jsonl"
    path.write_text('{"instruction": "hi", "output": "there"}\n')
    with pytest.raises(InputError, match="dataset"):
        eng.attach(CONFIG, dataset=str(path))
    assert eng.coserver is None


def test_validation_samples_are_refused_not_ignored(hardware):
    eng = SimEngine(SimHostConfig(), hardware=hardware, seed=3)
    with pytest.raises(InputError, match="validation"):
        eng.attach(CONFIG, dataset=samples(20), validation=samples(4))
    assert eng.coserver is None
