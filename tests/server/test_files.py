"""The Files API through the official client: upload, list, retrieve, content, delete; bad
files refused with the loader's line and field; the size cap; ids that are not ours."""

from __future__ import annotations

import json

import openai
import pytest

from tests.server.live import (
    API_KEY,
    alpaca_records,
    jsonl,
    raw_request,
    server_config,
    start_server,
    upload,
)


def test_upload_list_retrieve_content_delete(live):
    client = live.client()
    content = jsonl(alpaca_records(12))
    f = upload(client, content, "my data.jsonl")
    assert f.id.startswith("file-") and len(f.id) == len("file-") + 24
    assert (f.bytes, f.filename, f.purpose, f.status) == (len(content), "my data.jsonl",
                                                          "fine-tune", "processed")
    assert client.files.retrieve(f.id).bytes == len(content)
    assert client.files.content(f.id).content == content
    second = upload(client, json.dumps(alpaca_records(3)).encode(), "array.json")
    listed = client.files.list()
    assert [x.id for x in listed.data] == [second.id, f.id]  # newest first
    assert client.files.delete(f.id).deleted
    assert [x.id for x in client.files.list().data] == [second.id]
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)
    # the content is gone from disk too, and only ids name files there
    assert sorted(p.name for p in (live.config.data_dir / "files").iterdir()) == [second.id]


def test_chat_format_accepted(live):
    records = [{"messages": [{"role": "user", "content": "Say hi"},
                             {"role": "assistant", "content": "hello there"}]}] * 3
    assert upload(live.client(), jsonl(records)).bytes > 0


@pytest.mark.parametrize(("lines", "line", "param"), [
    (['{"instruction": "Add 1 and 2", "output": "3"}', '{"instruction": "Add 2 and 2"}'],
     2, "output"),
    (['{"instruction": "Add 1 and 2", "output": "3"}', "", "{not json"], 3, "json"),
    (['{"messages": [{"role": "user", "content": "hi"}]}'], 1, "messages"),
    (['{"messages": [{"role": "robot", "content": "hi"}]}'], 1, "messages.role"),
])
def test_malformed_file_is_a_400_with_its_line(live, lines, line, param):
    client = live.client()
    with pytest.raises(openai.BadRequestError) as err:
        upload(client, "\n".join(lines).encode(), "bad.jsonl")
    body = err.value.body
    assert f"line {line}" in body["message"] and "bad.jsonl" in body["message"]
    assert body["param"] == param
    assert str(live.config.data_dir) not in body["message"]  # no server path leaks
    assert client.files.list().data == []  # nothing kept
    assert list((live.config.data_dir / "tmp").iterdir()) == []


def test_non_utf8_file_is_a_400_with_its_line(live):
    content = jsonl(alpaca_records(2)) + b'{"instruction": "caf\xe9", "output": "x"}\n'
    with pytest.raises(openai.BadRequestError) as err:
        upload(live.client(), content)
    assert "line 3" in err.value.body["message"]


def test_wrong_purpose_and_unknown_ids(live):
    client = live.client()
    with pytest.raises(openai.BadRequestError) as err:
        client.files.create(file=("a.jsonl", jsonl(alpaca_records(2))), purpose="batch")
    assert err.value.body["param"] == "purpose"
    for bad in ("file-" + "0" * 24, "file-../../state.sqlite3", "..%2F..%2Fstate.sqlite3"):
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(bad)
        with pytest.raises(openai.NotFoundError):
            client.files.content(bad)


def test_upload_over_the_cap_is_a_413(tmp_path):
    server = start_server(server_config(tmp_path / "data", max_upload_bytes=2000))
    try:
        client = server.client()
        small = jsonl(alpaca_records(5))
        assert len(small) < 2000
        upload(client, small)
        big = jsonl(alpaca_records(200))
        with pytest.raises(openai.APIStatusError) as err:
            upload(client, big)
        assert err.value.status_code == 413
        # a chunked body (no Content-Length) is cut off too
        boundary = "xyz"
        body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\n"
                f"fine-tune\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
                f"filename=\"a.jsonl\"\r\n\r\n").encode() + big + f"\r\n--{boundary}--\r\n".encode()
        r = raw_request(server, "POST", "/v1/files", body=iter([body[:1000], body[1000:]]),
                        chunked=True,
                        headers={"Authorization": f"Bearer {API_KEY}",
                                 "Content-Type": f"multipart/form-data; boundary={boundary}"})
        assert r.status == 413 and r.json()["error"]["code"] == "file_too_large"
        assert [f.bytes for f in client.files.list().data] == [len(small)]
    finally:
        server.stop()
        server.backend.close()


def test_file_of_an_unfinished_job_cannot_be_deleted(live):
    client = live.client()
    f = upload(client, jsonl(alpaca_records(40)))
    live.runner.step_delay_s = 0.5
    job = client.fine_tuning.jobs.create(model="tiny-llama", training_file=f.id)
    with pytest.raises(openai.ConflictError):
        client.files.delete(f.id)
    client.fine_tuning.jobs.cancel(job.id)
    assert client.files.delete(f.id).deleted
