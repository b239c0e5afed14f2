"""The shared validation pass: what it rejects names the field and value, before any model
loads; what it drops it counts and logs."""

import json
import logging

import pytest

from deltaserve.cli import main
from deltaserve.core.data import DataConfig
from deltaserve.core.errors import InputError
from deltaserve.train.preflight import preflight, writable_dir, writable_file


def test_checkpoint_dir_must_be_a_writable_directory(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(InputError) as e:
        preflight(checkpoint_dir=blocker)
    assert e.value.field == "checkpoint_dir" and e.value.value == str(blocker)
    assert writable_dir(tmp_path / "new" / "ck", "checkpoint_dir").is_dir()
    with pytest.raises(InputError, match="is a directory"):
        writable_file(tmp_path, "out")


def test_latency_model_file_is_checked(tmp_path):
    bad = tmp_path / "lm.json"
    bad.write_text(json.dumps([]))
    with pytest.raises(InputError) as e:
        preflight(latency_model=bad)
    assert str(bad) in str(e.value)


def test_dataset_rows_are_all_parsed_and_overlong_ones_counted(tmp_path, word_tokenizer, caplog):
    data = tmp_path / "d.jsonl"
    rows = [{"instruction": "Say hi", "output": "hello there"},
            {"instruction": " ".join(["hello"] * 80), "output": "hi"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with caplog.at_level(logging.WARNING, logger="deltaserve"):
        checked = preflight(dataset=DataConfig(str(data), max_tokens=32),
                            tokenizer=word_tokenizer)
    assert checked.report.num_samples == 1 and checked.report.num_dropped_overlength == 1
    assert "dropped 1 longer than 32 tokens" in caplog.text
    data.write_text(json.dumps(rows[0]) + "\n{not json\n")
    with pytest.raises(InputError) as e:
        preflight(dataset=DataConfig(str(data)), tokenizer=word_tokenizer)
    assert e.value.line == 2


def test_calibrate_checks_its_output_path_before_any_work(tmp_path, capsys):
    assert main(["calibrate", "--out", str(tmp_path), "--model", "/nonexistent"]) == 2
    assert "out=" in capsys.readouterr().err
