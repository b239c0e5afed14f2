import json

import pytest

from deltaserve.core import InputError
from deltaserve.workloads.loaders import load_azure, load_burstgpt, load_mooncake, load_trace


def test_azure_shared_trace(shared_data):
    trace, report = load_azure(shared_data / "traces" / "azure_llm_code_2023.csv")
    assert len(trace) == report.rows == 8819
    assert trace.requests[0].arrival_s == 0
    assert 3300 < trace.duration_s < 3600  # ~57 minutes
    prompts = sorted(r.prompt_tokens for r in trace.requests)
    assert 1300 < prompts[len(prompts) // 2] < 1700  # median context ~1.5k tokens (Splitwise)
    w = trace.window(600, 60)
    assert all(0 <= r.arrival_s < 60 for r in w.requests) and len(w) > 0


def test_azure_fixture_and_bad_row(tmp_path):
    p = tmp_path / "a.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                 "2023-11-16 18:17:03.9799600,4808,10\n2023-11-16 18:17:05.4799600,100,3\n")
    t, _ = load_azure(p)
    assert [r.arrival_s for r in t.requests] == pytest.approx([0, 1.5])
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03,x,10\n")
    with pytest.raises(InputError) as e:
        load_azure(p)
    assert e.value.line == 2 and e.value.field == "ContextTokens"


def test_mooncake(tmp_path):
    p = tmp_path / "m.jsonl"
    rows = [{"timestamp": 0, "input_length": 100, "output_length": 5, "hash_ids": [1]},
            {"timestamp": 2500, "input_length": 30, "output_length": 7, "hash_ids": [2]}]
    p.write_text("\n".join(json.dumps(r) for r in rows))
    t, _ = load_mooncake(p)
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in t.requests] == [
        (0, 100, 5), (2.5, 30, 7)]
    assert load_trace(str(p)) == t


def test_burstgpt_drops_failed_requests(tmp_path):
    p = tmp_path / "b.csv"
    p.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                 "5,ChatGPT,100,20,120,Conversation log\n"
                 "6,ChatGPT,50,0,50,Conversation log\n"
                 "9,GPT-4,10,5,15,API log\n")
    t, report = load_burstgpt(p)
    assert report.dropped_failed == 1 and report.kept == 2
    assert [r.arrival_s for r in t.requests] == [0, 4]
    assert load_trace(str(p)) == t


def test_unknown_trace():
    with pytest.raises(InputError, match="burst-light"):
        load_trace("nope")
