"""Fault: a malformed dataset. What survives: every good record, tokenized exactly as in a clean
file holding only the good records; each bad one is a clear InputError with its line (and its
record in a JSON array), or, with ``skip_bad_rows``, skipped and counted. Over-long samples are
counted in the report, never dropped silently."""

from __future__ import annotations

import json

import pytest

from deltaserve.core import DataConfig, InputError, load_dataset
from deltaserve.core.data import read_conversations

GOOD = [
    {"instruction": "Add two numbers .", "input": "2 3", "output": "5"},
    {"instruction": "Say hi", "output": "hello there"},
    {"instruction": "reverse abc", "output": "cba"},
]


def _clean(tmp_path, records, tok):
    """The reference: the good records alone, in a clean JSONL file."""
    path = tmp_path / "clean.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records))
    return load_dataset(DataConfig(str(path)), tok)[0]


def _ids(samples):
    return [(s.input_ids, s.labels) for s in samples]


# ---- bytes that are not UTF-8 ----------------------------------------------------------------
def test_non_utf8_row_is_an_error_with_its_line_or_skipped(tmp_path, word_tokenizer):
    rows = [json.dumps(GOOD[0]).encode(), json.dumps(GOOD[1]).encode(),
            '{"instruction": "caf\u00e9", "output": "x"}'.encode("latin-1"),
            json.dumps(GOOD[2]).encode()]
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b"\n".join(rows))
    with pytest.raises(InputError) as e:
        load_dataset(DataConfig(str(path)), word_tokenizer)
    assert e.value.line == 3 and e.value.field == "encoding"
    assert b"\xe9" in e.value.value and "UTF-8" in str(e.value)
    samples, report = load_dataset(DataConfig(str(path), skip_bad_rows=True), word_tokenizer)
    assert (report.num_rows, report.num_bad_rows, report.bad_rows) == (4, 1, (3,))
    assert _ids(samples) == _ids(_clean(tmp_path, GOOD, word_tokenizer))


def test_non_utf8_inside_a_json_array_names_the_line_of_the_byte(tmp_path, word_tokenizer):
    text = json.dumps([GOOD[0], {"instruction": "BAD", "output": "x"}, GOOD[1]], indent=2)
    path = tmp_path / "bad.json"
    path.write_bytes(text.encode().replace(b"BAD", b"B\xffD"))
    bad_line = text[: text.index("BAD")].count("\n") + 1
    with pytest.raises(InputError) as e:
        load_dataset(DataConfig(str(path)), word_tokenizer)
    assert (e.value.field, e.value.line, e.value.record) == ("encoding", bad_line, 2)
    samples, report = load_dataset(DataConfig(str(path), skip_bad_rows=True), word_tokenizer)
    assert report.num_bad_rows == 1 and report.bad_rows == (2,)
    assert _ids(samples) == _ids(_clean(tmp_path, GOOD[:2], word_tokenizer))


# ---- ShareGPT --------------------------------------------------------------------------------
CHAT = {"messages": [{"role": "system", "content": "Say hi"}, {"role": "user", "content": "hi"},
                     {"role": "assistant", "content": "hello"},
                     {"role": "user", "content": "reverse abc"},
                     {"role": "assistant", "content": "cba"}]}
SPEAKER = {"system": "system", "user": "human", "assistant": "gpt"}
SHAREGPT_VARIANTS = {
    "from/value, human/gpt": {"conversations": [
        {"from": SPEAKER[m["role"]], "value": m["content"]} for m in CHAT["messages"]]},
    "top-level system": {"system": "Say hi", "conversations": [
        {"from": SPEAKER[m["role"]], "value": m["content"]} for m in CHAT["messages"][1:]]},
    "user/assistant speakers": {"conversations": [
        {"from": m["role"], "value": m["content"]} for m in CHAT["messages"]]},
    "role/content keys": {"id": "x1", "conversations": [
        {"role": SPEAKER[m["role"]], "content": m["content"]} for m in CHAT["messages"]]},
}


@pytest.mark.parametrize("variant", list(SHAREGPT_VARIANTS))
@pytest.mark.parametrize("fmt", ["auto", "sharegpt"])
def test_sharegpt_is_accepted_and_reads_as_the_same_chat(tmp_path, word_tokenizer, variant, fmt):
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps(CHAT))
    share = tmp_path / "share.json"  # a JSON array, as ShareGPT dumps usually are
    share.write_text(json.dumps([SHAREGPT_VARIANTS[variant]] * 2, indent=2))
    want, _ = load_dataset(DataConfig(str(chat)), word_tokenizer)
    got, report = load_dataset(DataConfig(str(share), format=fmt), word_tokenizer)
    assert report.num_samples == 2 and report.num_bad_rows == 0
    assert _ids(got) == _ids(want) * 2


@pytest.mark.parametrize("record,field", [
    ({"conversations": [{"from": "human", "value": "hi"}, {"from": "function_call",
                                                           "value": "f()"}]},
     "conversations[1].from"),
    ({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": 3}]},
     "conversations[1].value"),
    ({"conversations": [{"from": "human", "value": "hi"}]}, "messages"),
    ({"conversations": []}, "conversations"),
    ({"conversations": ["hi"]}, "conversations[0]"),
])
def test_a_bad_sharegpt_record_names_its_field_and_line(tmp_path, record, field):
    path = tmp_path / "s.jsonl"
    path.write_text(json.dumps({"conversations": [{"from": "human", "value": "a"},
                                                  {"from": "gpt", "value": "b"}]})
                    + "\n" + json.dumps(record))
    with pytest.raises(InputError) as e:
        read_conversations(DataConfig(str(path)))
    assert e.value.field == field and e.value.line == 2
    good, bad = read_conversations(DataConfig(str(path), skip_bad_rows=True))
    assert len(good) == 1 and bad == [2]


# ---- a bad element in a JSON array -----------------------------------------------------------
def _array(elements: list[str]) -> tuple[str, list[int]]:
    """A pretty JSON array of raw element texts, and the line each element starts on."""
    text, lines = "[\n", []
    for k, e in enumerate(elements):
        lines.append(text.count("\n") + 1)
        text += "  " + e.replace("\n", "\n  ") + (",\n" if k < len(elements) - 1 else "\n")
    return text + "]\n", lines


BROKEN = {
    "missing value": '{"instruction": "x",\n "output": }',
    "trailing comma": '{"instruction": "x", "output": "y",}',
    "bad literal": '{"instruction": "x", "output": nope}',
    "missing quote": '{"instruction": "x,\n "output": "y"}',
    "unbalanced bracket": '{"instruction": ["x", "output": "y"}',
    "bare word": "garbage",
}


@pytest.mark.parametrize("kind", list(BROKEN))
def test_a_broken_array_element_is_skipped_and_reading_resumes(tmp_path, word_tokenizer, kind):
    elements = [json.dumps(GOOD[0], indent=1), BROKEN[kind], "42",
                json.dumps({"instruction": "no output"}), json.dumps(GOOD[1], indent=1),
                json.dumps(GOOD[2])]
    text, lines = _array(elements)
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(InputError) as e:
        load_dataset(DataConfig(str(path)), word_tokenizer)
    assert (e.value.record, e.value.line) == (2, lines[1]) and "skip_bad_rows" in str(e.value)
    samples, report = load_dataset(DataConfig(str(path), skip_bad_rows=True), word_tokenizer)
    assert report.bad_rows == (2, 3, 4) and report.num_bad_rows == 3 and report.num_rows == 6
    assert _ids(samples) == _ids(_clean(tmp_path, GOOD, word_tokenizer))


HARDER = {
    # a missing quote before a list of strings: its items pass for elements, each a bad record
    "missing quote before a list": '{"instruction": "x,\n "tags": ["a", "b"], "output": "y"}',
    "missing quote on one line": '{"instruction": "x, "output": "y"}',
    "stray closing bracket": "]",
    "stray closing brace": "}",
}


@pytest.mark.parametrize("kind", list(HARDER))
def test_whatever_the_breakage_no_good_record_is_lost(tmp_path, word_tokenizer, kind):
    text, _ = _array([json.dumps(GOOD[0], indent=1), HARDER[kind], json.dumps(GOOD[1]),
                      json.dumps(GOOD[2], indent=1)])
    path = tmp_path / "bad.json"
    path.write_text(text)
    samples, report = load_dataset(DataConfig(str(path), skip_bad_rows=True), word_tokenizer)
    assert report.num_bad_rows >= 1 and report.bad_rows[0] == 2
    assert _ids(samples) == _ids(_clean(tmp_path, GOOD, word_tokenizer))


def test_a_valid_value_that_is_not_a_record_names_record_and_line(tmp_path, word_tokenizer):
    text, lines = _array([json.dumps(GOOD[0]), '"just a string"', json.dumps(GOOD[1])])
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(InputError) as e:
        load_dataset(DataConfig(str(path)), word_tokenizer)
    assert (e.value.field, e.value.record, e.value.line) == ("record", 2, lines[1])


def test_a_truncated_array_is_a_clear_error_even_when_skipping(tmp_path, word_tokenizer):
    text, lines = _array([json.dumps(g, indent=1) for g in GOOD])
    path = tmp_path / "cut.json"
    path.write_text(text[: text.rindex('"cba"')])
    for skip in (False, True):
        with pytest.raises(InputError) as e:
            load_dataset(DataConfig(str(path), skip_bad_rows=skip), word_tokenizer)
        assert e.value.record == 3 and e.value.line == lines[2]
    path.write_text(text[: text.rindex("]")])  # every record complete, no closing bracket
    with pytest.raises(InputError, match="not closed"):
        load_dataset(DataConfig(str(path), skip_bad_rows=True), word_tokenizer)


# ---- over-long rows --------------------------------------------------------------------------
def test_over_long_rows_are_counted_and_reported(tmp_path, word_tokenizer):
    path = tmp_path / "long.jsonl"
    long = {"instruction": "Say hi", "output": "hello there " * 30}
    path.write_text("\n".join(json.dumps(r) for r in [GOOD[0], long, GOOD[1], long]))
    full, _ = load_dataset(DataConfig(str(path)), word_tokenizer)
    limit = sorted(s.num_tokens for s in full)[1]  # the two short ones fit, the long ones not
    kept, report = load_dataset(DataConfig(str(path), max_tokens=limit), word_tokenizer)
    assert (report.num_rows, report.num_samples, report.num_dropped_overlength) == (4, 2, 2)
    assert _ids(kept) == _ids(_clean(tmp_path, GOOD[:2], word_tokenizer))
    assert f"2 dropped and 0 truncated as longer than {limit} tokens" in report.summary()
    cut, report = load_dataset(DataConfig(str(path), max_tokens=limit, overlength="truncate"),
                               word_tokenizer)
    assert report.num_truncated == 2 and report.num_samples == 4
    assert max(s.num_tokens for s in cut) == limit
    assert f"0 dropped and 2 truncated as longer than {limit} tokens" in report.summary()
