"""The step SGLang will run next, as the co-server sees it, on hand-built scheduler states
(pure: stand-ins with the fields SGLang's scheduler and requests have; runs without SGLang)."""

from __future__ import annotations

from types import SimpleNamespace

from deltaserve.core.shape import StepShape
from deltaserve.hosts.sglang.view import ClientClock, batch_shape, proposed_view


class Req:
    """An SGLang request as the view reads it. ``cached``: the prefix the radix cache holds."""

    def __init__(self, rid, prompt, output=0, cached=0, done=False):
        self.rid = rid
        self.origin_input_ids = list(range(prompt))
        self.output_ids = list(range(output))
        self.full_untruncated_fill_ids = self.origin_input_ids + self.output_ids
        self.cached, self.done = cached, done
        self.prefix_len = self.extend_end = 0

    @property
    def seqlen(self):
        return len(self.origin_input_ids) + len(self.output_ids)

    def finished(self):
        return self.done

    def init_next_round_input(self, tree_cache):
        self.prefix_len = self.cached


def mode(extend):
    return SimpleNamespace(is_extend=lambda: extend, is_decode=lambda: not extend)


def batch(reqs, extend_lens=None, prefix_lens=None):
    return SimpleNamespace(reqs=reqs, forward_mode=mode(extend_lens is not None),
                           extend_lens=extend_lens, prefix_lens=prefix_lens)


def sched(waiting=(), chunked=None, budget=256, seats=16):
    return SimpleNamespace(waiting_queue=list(waiting), chunked_req=chunked, tree_cache=None,
                           chunked_prefill_size=budget, max_prefill_tokens=4096,
                           max_running_requests=seats)


def clock(*reqs, at=0.0):
    c = ClientClock()
    for i, r in enumerate(reqs):
        c.arrived(r.rid, at + i)
    return c


EMPTY = batch([])


def test_an_idle_scheduler_proposes_an_empty_step():
    view = proposed_view(sched(), EMPTY, None, ClientClock(), 5.0)
    assert view.proposed == StepShape() and view.waiting == ()
    assert view.oldest_decode_token_s is None and view.deferred_decode is None


def test_running_clients_propose_their_decode():
    a, b = Req("a", 10, output=1), Req("b", 20, output=3)
    c = clock(a, b)
    c.last_token_s.update(a=1.5, b=2.5)
    view = proposed_view(sched(), batch([a, b]), None, c, 5.0)
    assert view.proposed == StepShape(num_decode=2, kv_tokens=10 + 22)
    assert view.oldest_decode_token_s == 1.5 and view.deferred_decode is None


def test_waiting_prompts_fill_the_budget_in_order_after_their_cached_prefix():
    r1, r2, r3 = Req("r1", 100, cached=40), Req("r2", 200), Req("r3", 50)
    d = Req("d", 30, output=2)
    c = clock(d, r1, r2, r3, at=1.0)
    c.last_token_s["d"] = 4.0
    view = proposed_view(sched([r1, r2, r3]), batch([d]), None, c, 9.0)
    # r1: 60 new tokens behind 40 cached; r2 chunked to the 196 left; r3 waits
    assert view.proposed == StepShape((60, 196), 0, 40, prefill_prefix_lens=(40, 0))
    assert view.deferred_decode == StepShape(num_decode=1, kv_tokens=31)
    assert [(w.arrival_s, w.tokens_after_step) for w in view.waiting] == [
        (2.0, 0), (3.0, 4), (4.0, 54)]
    assert view.oldest_decode_token_s == 4.0


def test_a_chunked_prompt_continues_first_and_seats_bound_the_step():
    ch = Req("ch", 300)
    ch.prefix_len, ch.extend_end = 0, 256  # its first chunk ran
    r1, r2 = Req("r1", 10), Req("r2", 10)
    view = proposed_view(sched([r1, r2], chunked=ch, seats=1), EMPTY, None,
                         clock(ch, r1, r2), 9.0)
    assert view.proposed == StepShape((44, 10), 0, 256, prefill_prefix_lens=(256, 0))
    assert [w.tokens_after_step for w in view.waiting] == [0, 0, 10]


def test_hidden_and_finished_requests_are_not_clients():
    hidden, done = Req("h", 50), Req("x", 5, output=5, done=True)
    view = proposed_view(sched([hidden]), batch([done]), None, ClientClock(), 1.0)
    assert view.proposed == StepShape() and view.waiting == ()


def test_last_steps_prefills_decode_next():
    p = Req("p", 12, output=1)  # prefilled by the last step, not yet in the running batch
    view = proposed_view(sched(), EMPTY, batch([p], [12], [0]), clock(p), 1.0)
    assert view.proposed == StepShape(num_decode=1, kv_tokens=12)


def test_batch_shape_splits_inference_and_training_rows():
    c1, s1, c2, s2 = Req("c1", 8), Req("s1", 7), Req("c2", 2), Req("s2", 3)
    shape, ft = batch_shape(batch([c1, s1, c2, s2], [5, 7, 2, 3], [3, 0, 0, 0]), ["s1", "s2"])
    assert shape == StepShape((5, 2), 0, 3, prefill_prefix_lens=(3, 0)) and ft == (7, 3)
    d1, d2 = Req("d1", 4, output=2), Req("d2", 9, output=1)
    assert batch_shape(batch([d1, d2]), ()) == (StepShape(num_decode=2, kv_tokens=5 + 9), ())


def test_clock_keeps_last_tokens_and_forgets_finished_clients():
    a, b, hidden = Req("a", 4, output=1), Req("b", 4, output=2, done=True), Req("h", 3)
    c = clock(a, b)
    c.stepped([a, b, hidden], 7.0)
    assert c.last_token_s == {"a": 7.0} and "b" not in c and "h" not in c
