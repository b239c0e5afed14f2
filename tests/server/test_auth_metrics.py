"""The API key on every route, the default bind address, and ``/metrics`` against the stats
snapshot it reports."""

from __future__ import annotations

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deltaserve.core.errors import InputError
from deltaserve.server import ServerConfig
from deltaserve.server.config import DEFAULT_BIND
from tests.server.fakes import BASE_MODEL, SKIPS, STEPS_LOST
from tests.server.live import (
    API_KEY,
    alpaca_records,
    jsonl,
    raw_request,
    server_config,
    start_server,
    upload,
)
from tests.server.test_jobs import PROMPT

JOB = "ftjob-" + "0" * 24
FILE = "file-" + "0" * 24


def _every_route(live) -> list[tuple[str, str]]:
    """(method, path) of every route in the app's OpenAPI schema, path parameters filled."""
    out = []
    for path, ops in live.app.openapi()["paths"].items():
        path = (path.replace("{job_id}", JOB).replace("{file_id}", FILE)
                .replace("{model}", BASE_MODEL))
        out += [(method.upper(), path) for method in ops]
    return out


def test_every_route_needs_the_key(live):
    routes = _every_route(live)
    assert len(routes) >= 20
    extra = [("GET", "/docs"), ("GET", "/openapi.json"), ("GET", "/no/such/path")]
    for method, path in [*routes, *extra]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
            r = raw_request(live, method, path, headers=headers)
            if path == "/dashboard":  # the page holds no data; its data route is guarded
                assert r.status == 200 and b"/dashboard/data" in r.body
                continue
            assert r.status == 401, (method, path, headers)
            err = r.json()["error"]
            assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
    bad = live.client(api_key="wrong")
    for call in (bad.models.list, bad.files.list, bad.fine_tuning.jobs.list,
                 lambda: bad.chat.completions.create(model=BASE_MODEL, messages=PROMPT)):
        with pytest.raises(openai.AuthenticationError):
            call()
    assert live.client().models.list().data[0].id == BASE_MODEL


def test_bind_defaults_to_loopback_and_config_is_checked(tmp_path):
    assert ServerConfig(data_dir=tmp_path).bind == DEFAULT_BIND == "127.0.0.1"
    for bad in ({"bind": "example.com"}, {"port": 70000}, {"max_upload_bytes": 0},
                {"api_key": ""}, {"checkpoint_every_steps": 0}):
        with pytest.raises(InputError) as err:
            ServerConfig(data_dir=tmp_path, **bad)
        assert err.value.field == next(iter(bad))
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(InputError) as err:
        start_server(server_config(blocker / "data"))
    assert err.value.field == "data_dir"


def _metrics(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_report_the_snapshot(live):
    client = live.client()
    for _ in range(3):
        client.chat.completions.create(model=BASE_MODEL, messages=PROMPT, max_tokens=4)
    f = upload(client, jsonl(alpaca_records(5)))
    client.fine_tuning.jobs.cancel(
        client.fine_tuning.jobs.create(model=BASE_MODEL, training_file=f.id).id)
    r = raw_request(live, "GET", "/metrics", headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status == 200
    m = _metrics(r.body.decode())
    snap = live.app.state.services.stats.snapshot()
    assert m[("deltaserve:generation_tokens_total", ())] == snap.inference_tokens == 12
    assert m[("deltaserve:requests_finished_total", ())] == 3
    assert m[("deltaserve:ft_tokens_committed_total", ())] == snap.ft_tokens_committed
    assert m[("deltaserve:ft_tokens_admitted_total", ())] == snap.ft_tokens_admitted
    for reason, n in SKIPS.items():
        assert m[("deltaserve:admission_skips_total", (("reason", reason.value),))] == n
    for reason, n in STEPS_LOST.items():
        assert m[("deltaserve:ft_steps_lost_total", (("reason", reason),))] == n
    assert m[("deltaserve:step_time_predicted_seconds_sum", ())] == 1.5
    assert m[("deltaserve:step_time_measured_seconds_count", ())] == 40
    assert m[("deltaserve:latency_model_mape", ())] == pytest.approx(0.042)
    assert m[("deltaserve:slo_misses_total", (("kind", "ttft"),))] == 0
    assert m[("deltaserve:backward_busy_ratio", ())] == 0.25
    assert m[("deltaserve:fine_tuning_jobs", (("status", "cancelled"),))] == 1
    assert m[("deltaserve:fine_tuning_jobs", (("status", "running"),))] == 0


def test_metrics_can_be_opened_by_flag(tmp_path):
    server = start_server(server_config(tmp_path / "data", metrics_public=True))
    try:
        assert raw_request(server, "GET", "/metrics").status == 200
        assert raw_request(server, "GET", "/v1/models").status == 401
    finally:
        server.stop()
        server.backend.close()
