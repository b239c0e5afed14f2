"""Open-loop replay against a fake host with known service times."""

import threading
import time

import pytest

from deltaserve.bench.replay import PromptSource, replay
from deltaserve.core.requests import RequestOutput
from deltaserve.workloads.trace import from_arrivals


class FakeHost:
    """Answers each request with ``n`` tokens, 10 ms apart, starting 20 ms after arrival,
    regardless of load (an open loop must keep sending anyway)."""

    tokenizer = None
    coserver = None
    latency_model = None
    limits = None

    def __init__(self):
        self.listeners = []
        self.sent: list[tuple[float, list[int]]] = []
        self._threads = []

    def add_request(self, prompt, params=None, *, adapter=None, callback=None, request_id=None):
        t0 = time.monotonic()
        self.sent.append((t0, list(prompt)))

        def emit():
            times = []
            for k in range(params.max_tokens):
                time.sleep(self.token_gap_s(k))
                times.append(time.monotonic())
                callback(RequestOutput("r", tuple(prompt), tuple(range(k + 1)), None,
                                       k + 1 == params.max_tokens, None, t0, times[0],
                                       tuple(times)))
        th = threading.Thread(target=emit)
        th.start()
        self._threads.append(th)
        return "r"

    def token_gap_s(self, k: int) -> float:
        """Seconds before token ``k`` of an answer (after arrival for the first)."""
        return 0.02 if k == 0 else 0.01

    def subscribe_steps(self, listener):
        self.listeners.append(listener)

    def unsubscribe_steps(self, listener):
        self.listeners.remove(listener)

    def run_loop(self, stop, idle_wait_s=0.005):
        stop.wait()

    def has_unfinished(self):
        return any(t.is_alive() for t in self._threads)


def test_requests_go_out_on_schedule_and_tokens_are_recorded():
    trace = from_arrivals("t", [0.0, 0.1, 0.1, 0.3], [5, 7, 3, 9], [3, 1, 2, 4], 0.5, "test")
    prompts = PromptSource(list(range(100)))
    host = FakeHost()
    res = replay(host, trace, prompts, progress=False)
    sent_at = [t - res.start_s for t, _ in host.sent]
    assert sent_at == pytest.approx([0.0, 0.1, 0.1, 0.3], abs=0.03)
    assert [len(p) for _, p in host.sent] == [5, 7, 3, 9]
    for r in res.records:
        assert r.finished and len(r.token_times_s) == r.output_tokens
        assert r.ttft_s == pytest.approx(0.02, abs=0.03)
        assert r.max_tpot_s < 0.05
    assert not res.timed_out


def test_prompt_source_cuts_exact_lengths_and_wraps():
    src = PromptSource(list(range(100)))
    assert src.prompt(0, 10) == list(range(10))
    long = src.prompt(3, 250)
    assert len(long) == 250 and long[:2] == [(3 * 7919) % 100, (3 * 7919) % 100 + 1]


def test_the_loop_runs_until_the_window_closes_after_the_requests_drained():
    trace = from_arrivals("t", [0.0, 0.05], [5, 5], [2, 2], 0.1, "test")
    host = FakeHost()
    res = replay(host, trace, PromptSource(list(range(100))), min_wall_s=1.0, progress=False)
    # every request drained within about 0.1 s; the loop (and training in it) ran on to 1 s
    last = max(r.token_times_s[-1] for r in res.records)
    assert res.drained_s == pytest.approx(last - res.start_s)
    assert res.wall_s >= 1.0 and not res.timed_out
