"""``CoServeConfig.data_parallel``: one typed object makes a co-server replica r of N. It is
checked before anything starts (a bad group names its field; a dataset with fewer samples than
replicas fails before the host calibrates), it reaches the sample book as the replica's shard,
it has no CLI flag of its own, and its default, one replica, changes nothing."""

import argparse

import pytest

from deltaserve.cli_flags import add_dataclass_flags
from deltaserve.core.errors import InputError
from deltaserve.core.shard import DataShard
from deltaserve.core.slo import SLOConfig
from deltaserve.hosts.sim.engine import SimEngine
from deltaserve.train.attach import attach
from deltaserve.train.config import BackwardConfig, CoServeConfig, DataParallelConfig
from deltaserve.train.samples import SampleBook
from tests.train import fixtures as fx

SEED = 5
NUM_SAMPLES = 7


def dp_config(rank: int = 0, world_size: int = 2) -> CoServeConfig:
    return CoServeConfig(slo=SLOConfig(1.0, 0.5), backward=BackwardConfig(threads=1),
                         seed=SEED, data_parallel=DataParallelConfig(world_size, rank))


def test_one_replica_is_the_default_and_changes_nothing():
    cfg = CoServeConfig(SLOConfig(1.0, 0.5))
    assert cfg.data_parallel == DataParallelConfig() and cfg.data_shard is None
    assert dp_config(1).data_shard == DataShard(1, 2, SEED)


@pytest.mark.parametrize("dp, field", [
    (dict(world_size=2, rank=2), "rank"),
    (dict(world_size=0), "world_size"),
])
def test_a_bad_group_names_its_field(dp, field):
    with pytest.raises(InputError) as e:
        CoServeConfig(SLOConfig(1.0, 0.5), data_parallel=DataParallelConfig(**dp))
    assert e.value.field == field


def test_data_parallel_must_be_a_data_parallel_config():
    with pytest.raises(InputError) as e:
        CoServeConfig(SLOConfig(1.0, 0.5), data_parallel={"world_size": 2})
    assert e.value.field == "data_parallel"


def test_the_book_trains_the_replicas_shard_and_refuses_another_pool():
    samples = fx.samples(NUM_SAMPLES)
    shard = DataShard(1, 2, SEED)
    book = SampleBook(samples, num_epochs=1, seed=SEED, buffer_tokens=256, shard=shard)
    assert book.pool.shard == shard and book.progress().num_samples == 3
    with pytest.raises(InputError) as e:
        SampleBook(samples, num_epochs=1, seed=SEED, buffer_tokens=256, shard=shard,
                   pool=SampleBook(samples, num_epochs=1, seed=SEED, buffer_tokens=256).pool)
    assert e.value.field == "pool"


class _NoModelHost:
    """A host that must not be reached: attach has to fail on the config first."""

    limits = fx.LIMITS

    def training_dropout(self, lora):
        return lora.dropout

    def calibrate(self, *args, **kwargs):
        raise AssertionError("calibrated before the data-parallel config was checked")


def test_attach_refuses_fewer_samples_than_replicas_before_calibrating():
    with pytest.raises(InputError) as e:
        attach(_NoModelHost(), dp_config(0), dataset=fx.samples(1))
    assert e.value.field == "dataset"


def test_the_config_has_no_flag_of_its_own():
    flags = add_dataclass_flags(argparse.ArgumentParser(), CoServeConfig, "finetune-",
                                "finetune.")
    assert not any("data_parallel" in dest for dest in flags)


def test_the_simulated_host_refuses_a_group():
    with pytest.raises(InputError) as e:
        SimEngine().attach(dp_config(1), dataset=fx.samples(NUM_SAMPLES))
    assert e.value.field == "data_parallel"
