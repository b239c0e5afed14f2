import json

import pytest

from deltaserve.core import DataConfig, InputError, load_dataset
from deltaserve.core.data import IGNORE_INDEX, read_conversations
from tests.conftest import make_word_tokenizer

ALPACA = [
    {"instruction": "Add two numbers .", "input": "2 3", "output": "5"},
    {"instruction": "Say hi", "input": "", "output": "hello there"},
]


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_alpaca_json_masks_the_prompt(tmp_path, word_tokenizer):
    path = write(tmp_path, "a.json", json.dumps(ALPACA, indent=2))
    samples, report = load_dataset(DataConfig(path), word_tokenizer)
    assert report.num_samples == 2 and report.num_bad_rows == 0
    s = samples[0]
    text = word_tokenizer.decode(list(s.input_ids))
    assert text.split() == ("<|im_start|> user Add two numbers . 2 3 <|im_end|> "
                            "<|im_start|> assistant 5 <|im_end|>").split()
    target = [t for t in s.labels if t != IGNORE_INDEX]
    assert word_tokenizer.decode(target).split() == ["5", "<|im_end|>"]
    assert s.labels[: len(s.labels) - 2] == (IGNORE_INDEX,) * (len(s.labels) - 2)
    assert s.num_loss_tokens == 2 and report.num_tokens == sum(x.num_tokens for x in samples)


def test_jsonl_and_chat_formats_agree(tmp_path, word_tokenizer):
    alpaca = write(tmp_path, "a.jsonl", "\n".join(json.dumps(r) for r in ALPACA))
    chat = write(tmp_path, "c.jsonl", "\n".join(json.dumps({"messages": [
        {"role": "user", "content": "Add two numbers .\n\n2 3"},
        {"role": "assistant", "content": "5"}]}) for _ in range(1)))
    a, _ = load_dataset(DataConfig(alpaca), word_tokenizer)
    c, _ = load_dataset(DataConfig(chat, format="chat"), word_tokenizer)
    assert a[0].input_ids == c[0].input_ids and a[0].labels == c[0].labels


def test_multi_turn_trains_every_assistant_turn(tmp_path, word_tokenizer):
    conv = {"messages": [
        {"role": "system", "content": "Say hi"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"}, {"role": "user", "content": "reverse abc"},
        {"role": "assistant", "content": "cba"}]}
    samples, _ = load_dataset(DataConfig(write(tmp_path, "m.jsonl", json.dumps(conv))),
                              word_tokenizer)
    target = [t for t in samples[0].labels if t != IGNORE_INDEX]
    assert word_tokenizer.decode(target).split() == ["hello", "<|im_end|>", "cba", "<|im_end|>"]


def test_malformed_row_reports_its_line(tmp_path, word_tokenizer):
    rows = [json.dumps(ALPACA[0]), "{not json", json.dumps({"instruction": "x"}),
            json.dumps(ALPACA[1])]
    path = write(tmp_path, "bad.jsonl", "\n".join(rows))
    with pytest.raises(InputError) as e:
        load_dataset(DataConfig(path), word_tokenizer)
    assert e.value.line == 2 and "skip_bad_rows" in str(e.value)
    samples, report = load_dataset(DataConfig(path, skip_bad_rows=True), word_tokenizer)
    assert len(samples) == 2 and report.num_bad_rows == 2 and report.bad_rows == (2, 3)
    assert report.num_rows == 4


def test_json_array_line_numbers(tmp_path, word_tokenizer):
    rows = [ALPACA[0], {"instruction": "", "output": "x"}]
    path = write(tmp_path, "bad.json", json.dumps(rows, indent=2))
    with pytest.raises(InputError) as e:
        load_dataset(DataConfig(path), word_tokenizer)
    text = (tmp_path / "bad.json").read_text().splitlines()
    assert e.value.field == "instruction" and e.value.record == 2
    assert text[e.value.line - 1].strip() == "{" and e.value.line > 5


def test_empty_and_missing_datasets(tmp_path, word_tokenizer):
    with pytest.raises(InputError, match="no such file"):
        load_dataset(DataConfig(str(tmp_path / "none.json")), word_tokenizer)
    with pytest.raises(InputError, match="no usable records"):
        load_dataset(DataConfig(write(tmp_path, "e.jsonl", "\n\n")), word_tokenizer)
    with pytest.raises(InputError, match="no usable records"):
        load_dataset(DataConfig(write(tmp_path, "e.json", "[]")), word_tokenizer)


def test_overlength_drop_and_truncate(tmp_path, word_tokenizer):
    path = write(tmp_path, "a.json", json.dumps(ALPACA))
    full, _ = load_dataset(DataConfig(path), word_tokenizer)
    limit = max(s.num_tokens for s in full) - 1
    kept, rep = load_dataset(DataConfig(path, max_tokens=limit), word_tokenizer)
    assert rep.num_dropped_overlength == 1 and len(kept) == 1
    cut, rep = load_dataset(DataConfig(path, max_tokens=limit, overlength="truncate"),
                            word_tokenizer)
    assert rep.num_truncated == 1 and max(s.num_tokens for s in cut) == limit
    with pytest.raises(InputError, match="no sample fits"):
        load_dataset(DataConfig(path, max_tokens=3), word_tokenizer)


def test_without_chat_template_uses_plain_prompt(tmp_path):
    tok = make_word_tokenizer("### User: Response: Say hi hello there".split(), chat_template=None)
    samples, _ = load_dataset(DataConfig(write(tmp_path, "a.json", json.dumps(ALPACA[1:]))), tok)
    target = [t for t in samples[0].labels if t != IGNORE_INDEX]
    assert tok.decode(target).split() == ["hello", "there</s>"] or \
        tok.decode(target).split() == ["hello", "there", "</s>"]


def test_chat_rows_validated(tmp_path):
    bad = [{"messages": []}, {"messages": [{"role": "robot", "content": "x"}]},
           {"messages": [{"role": "user", "content": "x"}]}]
    for i, row in enumerate(bad):
        path = write(tmp_path, f"b{i}.jsonl", json.dumps(row))
        with pytest.raises(InputError) as e:
            read_conversations(DataConfig(path))
        assert e.value.line == 1


@pytest.mark.parametrize("kwargs,field", [
    ({"format": "csv"}, "format"), ({"overlength": "wrap"}, "overlength"),
    ({"max_tokens": 1}, "max_tokens")])
def test_config_validation(kwargs, field):
    with pytest.raises(InputError) as e:
        DataConfig("x", **kwargs)
    assert e.value.field == field


def test_real_alpaca_records(shared_data):
    """The shared Alpaca subset holds two records with an empty output: a real bad row."""
    path = str(shared_data / "alpaca" / "alpaca_5000.json")
    with pytest.raises(InputError) as e:
        read_conversations(DataConfig(path))
    assert e.value.field == "output" and e.value.record is not None and e.value.line == 1
    convs, bad = read_conversations(DataConfig(path, skip_bad_rows=True))
    assert len(convs) == 4998 and len(bad) == 2


def test_line_numbers_count_newlines_only(tmp_path, word_tokenizer):
    """JSON strings may hold U+2028 raw; it must not shift the line of a later bad row."""
    rows = [json.dumps({"instruction": "Say\u2028hi", "output": "hello"}, ensure_ascii=False),
            "{not json", json.dumps(ALPACA[1])]
    path = write(tmp_path, "u.jsonl", "\n".join(rows))
    with pytest.raises(InputError) as e:
        load_dataset(DataConfig(path), word_tokenizer)
    assert e.value.line == 2


def test_utf8_bom_is_accepted(tmp_path, word_tokenizer):
    path = tmp_path / "bom.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(ALPACA).encode())
    _, report = load_dataset(DataConfig(str(path)), word_tokenizer)
    assert report.num_samples == 2 and report.num_bad_rows == 0


def test_report_summary_names_every_count(tmp_path, word_tokenizer):
    rows = [json.dumps(ALPACA[0]), "{bad", json.dumps(ALPACA[1])]
    path = write(tmp_path, "r.jsonl", "\n".join(rows))
    _, report = load_dataset(DataConfig(path, skip_bad_rows=True, max_tokens=64), word_tokenizer)
    assert report.summary() == (f"2 samples ({report.num_tokens} tokens) from 3 rows; 1 bad rows "
                                "skipped (2); 0 dropped and 0 truncated as longer than 64 "
                                "tokens; 0 dropped with no response tokens")
