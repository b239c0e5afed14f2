"""Issue #26 item 5: in the simulated bench each reported pair differs in one thing. The grant a
system's backward runs under is the one thing ``run.grant_policy`` decides beyond the spec, so
the check counts it beside the spec's own fields."""

from __future__ import annotations

from dataclasses import fields
from types import SimpleNamespace

import pytest

from deltaserve.bench.sim.config import SIM_SYSTEMS
from deltaserve.bench.sim.run import grant_policy
from deltaserve.bench.sim.systems import SIM_SYSTEM_NAMES, sim_systems
from deltaserve.bench.systems import SystemSpec
from deltaserve.core.errors import InputError
from deltaserve.train.config import BackwardConfig, GrantPolicy

# what a spec says about the system; its name, its pair and whether an SLO sweep reruns it are
# bookkeeping. Co-serving and a split pool are one choice (where the trainer runs).
BOOKKEEPING = {"name", "pair", "slo_aware", "grant"}
PLACEMENT = ("coserve", "split_pool")


def setup(bench_grant: GrantPolicy = GrantPolicy.AUTO) -> SimpleNamespace:
    return SimpleNamespace(cfg=SimpleNamespace(backward=BackwardConfig(grant_policy=bench_grant)),
                           hw=SimpleNamespace(policy=GrantPolicy.PREFILL))


def differences(a: SystemSpec, b: SystemSpec) -> set[str]:
    out = {f.name for f in fields(SystemSpec)
           if f.name not in BOOKKEEPING and getattr(a, f.name) != getattr(b, f.name)}
    if out & set(PLACEMENT):
        out = (out - set(PLACEMENT)) | {"placement"}
    if grant_policy(setup(), a) is not grant_policy(setup(), b):
        out.add("grant")
    return out


def test_every_reported_pair_differs_in_exactly_one_thing():
    specs = {s.name: s for s in sim_systems(",".join(SIM_SYSTEM_NAMES))}
    pairs = [(s, specs[s.pair]) for s in specs.values() if s.pair]
    assert len(pairs) == len(specs) - 1  # every system but the pilot has a pair
    for a, b in pairs:
        assert len(differences(a, b)) == 1, (a.name, b.name, differences(a, b))
    assert differences(specs["deltaserve"], specs["llmstation"]) == {"scheduler_cls"}
    assert differences(specs["llmstation-exclusive"], specs["llmstation"]) == {"grant"}
    assert differences(specs["deltaserve-pipeline"],
                       specs["llmstation-pipeline"]) == {"scheduler_cls"}


def test_grants_the_bench_flag_then_the_system_then_the_host():
    own, shared = sim_systems("llmstation-exclusive,llmstation")
    assert grant_policy(setup(), own) is GrantPolicy.EXCLUSIVE
    assert grant_policy(setup(), shared) is GrantPolicy.PREFILL  # the host's, as deltaserve's
    for spec in (own, shared):  # a flag puts every system under one grant
        assert grant_policy(setup(GrantPolicy.EXCLUSIVE), spec) is GrantPolicy.EXCLUSIVE
        assert grant_policy(setup(GrantPolicy.PREFILL), spec) is GrantPolicy.PREFILL


def test_the_default_list_runs_llmstation_both_ways_and_unknown_names_are_refused():
    names = [s.name for s in sim_systems(SIM_SYSTEMS)]
    assert "llmstation" in names and "llmstation-exclusive" in names
    with pytest.raises(InputError, match="llmstation-exclusive"):
        sim_systems("deltaserve,no-such-system")
