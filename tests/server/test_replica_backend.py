"""The replicas' front (:class:`ReplicaBackend`) against fake engines: requests routed as the
router says and counted in flight until their last output (an abort's included), ids unique
across replicas, aborts sent to the replica that holds the request, adapters on every replica;
and a job's counters read across the group (:func:`group_stats`)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from deltaserve.core.requests import RequestOutput, SamplingParams
from deltaserve.core.router import create_router
from deltaserve.server.replicas import ReplicaBackend, group_stats
from deltaserve.train.events import CoServeStats


class FakeEngine:
    """Holds requests until told to finish them; an abort finishes one at once."""

    model_name, tokenizer, max_model_len = "m", None, 64

    def __init__(self):
        self.live: dict[str, object] = {}
        self.loras: list[str] = []
        self.refuse = False

    def add_request(self, prompt, params, *, adapter=None, callback=None, request_id=None):
        if self.refuse:
            raise ValueError("refused")
        self.live[request_id] = callback
        return request_id

    def finish(self, rid: str, reason: str = "length") -> None:
        self.live.pop(rid)(RequestOutput(rid, (), (1,), None, True, reason, 0.0, None, ()))

    def abort_request(self, rid: str) -> None:
        if rid in self.live:
            self.finish(rid, "abort")

    def add_lora(self, name, path):
        self.loras.append(name)

    def remove_lora(self, name):
        self.loras.remove(name)

    def lora_names(self):
        return list(self.loras)


def test_requests_go_where_the_router_says_and_count_until_their_last_output():
    engines = [FakeEngine(), FakeEngine()]
    backend = ReplicaBackend(engines, create_router("least-loaded", 2))
    seen: list[str] = []
    ids = [backend.add_request([1], SamplingParams(), callback=lambda o: seen.append(o.request_id))
           for _ in range(3)]
    assert len(set(ids)) == 3  # the backend's own ids, unique across replicas
    assert [len(e.live) for e in engines] == [2, 1]
    assert backend.router.in_flight == (2, 1)
    backend.abort_request(ids[1])  # on replica 1: it finishes there, abort as its reason
    assert ids[1] in seen and backend.router.in_flight == (2, 0)
    backend.abort_request("no-such-request")  # a no-op
    engines[0].finish(ids[0])
    assert backend.router.in_flight == (1, 0)
    # least-loaded: the next one goes to the idle replica
    backend.add_request([1], SamplingParams(), request_id="mine")
    assert "mine" in engines[1].live
    with pytest.raises(ValueError, match="in flight"):
        backend.add_request([1], SamplingParams(), request_id="mine")


def test_a_refused_request_is_not_left_in_flight_and_adapters_reach_every_replica():
    engines = [FakeEngine(), FakeEngine()]
    backend = ReplicaBackend(engines, create_router("round-robin", 2))
    engines[0].refuse = True
    with pytest.raises(ValueError, match="refused"):
        backend.add_request([1], SamplingParams())
    assert backend.router.in_flight == (0, 0)
    backend.add_lora("a", "/x")
    assert [e.lora_names() for e in engines] == [["a"], ["a"]] == [backend.lora_names()] * 2
    backend.remove_lora("a")
    assert backend.lora_names() == [] == engines[1].lora_names()


def test_group_stats_take_what_the_adapter_holds_from_rank_0_and_sum_the_rest():
    base = CoServeStats(100, 10, 5, 7, 3, 1, 0, 0, 0, 1, 0.5, {"budget_exhausted": 2},
                        ft_tokens_admitted=40, steps_timed=9, step_time_predicted_s=1.0,
                        step_time_measured_s=1.5, backward_busy_s=2.0,
                        steps_lost={"worker_died": 1})
    other = replace(base, ft_tokens_committed=999, skips={"budget_exhausted": 1, "no_room": 4},
                    steps_lost={})
    got = group_stats([base, other])
    assert (got.ft_tokens_committed, got.ft_samples_committed, got.optimizer_steps) == (
        100, 10, 7)
    assert got.skips == {"budget_exhausted": 3, "no_room": 4}
    assert (got.ft_tokens_admitted, got.steps_timed, got.backward_busy_s) == (80, 18, 4.0)
    assert got.steps_lost == {"worker_died": 1} and got.aborted_steps == 2


def test_a_replica_marked_down_gets_no_more_requests():
    engines = [FakeEngine(), FakeEngine()]
    backend = ReplicaBackend(engines, create_router("round-robin", 2))
    backend.replica_down(0)
    for _ in range(3):
        backend.add_request([1], SamplingParams())
    assert [len(e.live) for e in engines] == [0, 3]
