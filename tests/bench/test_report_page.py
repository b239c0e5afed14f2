"""The report page lists every missed request's late events, and nothing without misses."""

from deltaserve.bench.miss_source import LateEvent, MissSources
from deltaserve.bench.report.page import _late_events_html


def test_missed_requests_table_lists_each_late_event_with_its_repeat():
    late = MissSources(1, 1, 0, 0, (LateEvent(27, "ttft", 51.2, 1.793, 5, 1.4, 0.31, 0, 0.083,
                                             repeat=1, predicted_s=1.21,
                                             longest="prefill 512 (2) + 3 decodes"),))
    doc = {"systems": {"deltaserve": {"misses": MissSources(0, 0, 0, 0).as_json()},
                       "deltaserve-pipeline": {"misses": late.as_json()},
                       "split-pool": {"misses": None}}}
    page = _late_events_html(doc)
    assert page.count("<tr>") == 2  # the head and the one event
    row = page.split("<tr>")[2]
    assert [c.split("</td>")[0] for c in row.split("<td>")[1:]] == [
        "deltaserve-pipeline", "2", "27", "ttft", "51", "1.79", "5", "1.40", "0.31", "0", "0.08",
        "1.21", "prefill 512 (2) + 3 decodes"]
    doc["systems"]["deltaserve-pipeline"]["misses"] = None
    assert _late_events_html(doc) == ""
