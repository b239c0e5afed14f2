"""``/dashboard`` in a real browser: headless Chromium (Debian's package) loads the page during
a job and inference traffic; the chart it draws has data points. The screenshot is kept under
the test's tmp dir."""

from __future__ import annotations

import re
import shutil
import subprocess
import threading

import pytest

from tests.server.fakes import BASE_MODEL
from tests.server.live import API_KEY, alpaca_records, jsonl, upload, wait_for
from tests.server.test_jobs import PROMPT

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def chromium(url: str, tmp_path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
         "--disable-background-networking", "--disable-component-update", "--no-first-run",
         f"--user-data-dir={tmp_path / 'chromium-profile'}", "--virtual-time-budget=4000",
         *extra, url],
        capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium)")
def test_dashboard_draws_live_data(live, tmp_path):
    client = live.client()
    stop = threading.Event()

    def traffic():
        while not stop.is_set():
            client.chat.completions.create(model=BASE_MODEL, messages=PROMPT, max_tokens=8)

    sender = threading.Thread(target=traffic, daemon=True)
    sender.start()
    try:
        live.runner.step_delay_s = 0.05
        f = upload(client, jsonl(alpaca_records(200)))
        client.fine_tuning.jobs.create(model=BASE_MODEL, training_file=f.id,
                                       hyperparameters={"batch_size": 2})
        timeline = live.app.state.services.timeline
        wait_for(lambda: sum(p.ft_tokens_per_s > 0 and p.inference_tokens_per_s > 0
                             for p in timeline.points()) >= 5, 60, "busy dashboard samples")
        url = f"{live.base_url}/dashboard#key={API_KEY}"
        dom = chromium(url, tmp_path, "--dump-dom")
        shot = tmp_path / "dashboard.png"
        chromium(url, tmp_path, f"--screenshot={shot}", "--window-size=1040,560")
    finally:
        stop.set()
        sender.join(30)
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    points = int(re.search(r'id="chart"[^>]*data-points="(\d+)"', html).group(1))
    assert points >= 5
    assert html.count('class="point"') == points
    assert 'class="inference"' in html and 'class="finetune"' in html
    assert 'class="slo"' in html  # requests finished, so attainment is drawn
    assert "fine-tuning" in html and "tok/s" in html
    assert shot.is_file() and shot.stat().st_size > 10_000


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium)")
def test_dashboard_without_the_key_shows_no_data(live, tmp_path):
    dom = chromium(f"{live.base_url}/dashboard", tmp_path, "--dump-dom")
    assert 'data-points="0"' in dom.stdout
    assert "add #key=YOUR_API_KEY" in dom.stdout
