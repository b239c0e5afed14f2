"""Every host side by side: issue 23's goal checked on hand-made results (the verdicts written
out by hand from the goal's wording), the block rendered from a fixture, ``--update``
idempotent, and docs/hosts.md equal to what its committed runs render."""

import json
from pathlib import Path

import pytest

from deltaserve.bench.parity import (
    Verdict,
    attainment_check,
    ceiling_note,
    ft_check,
    goal_checks,
    harvest_check,
    host_checks,
    load_runs,
    overall,
    render,
)
from deltaserve.bench.tables import PARITY, blocks, update

ROOT = Path(__file__).resolve().parents[2]
MET, NOT_MET, NOT_MEASURED = Verdict.MET, Verdict.NOT_MET, Verdict.NOT_MEASURED


def system(ft, slo, harvest, ft_range=None, slo_range=None, harvest_range=None, mape=None):
    s = {"ft_tokens_per_s": ft, "slo_attainment": slo,
         "latency_model_by_mode": [] if mape is None else
         [{"mode": "eager", "online_mape": mape, "online_steps": 10}]}
    if harvest is not None:
        s["harvest"] = {"ratio": harvest}
    spread = {k: list(v) for k, v in (("ft_tokens_per_s", ft_range), ("slo_attainment", slo_range),
                                      ("harvest_ratio", harvest_range)) if v}
    return s | ({"range": spread} if spread else {})


def results(systems, repeats=3, host="native"):
    return {"repeats": repeats, "systems": systems,
            "machine": {"host": host, "model": "m", "threads": 2},
            "trace": {"name": "t", "source": "t", "requests": 10, "duration_s": 30.0},
            "slo": {"text": "TTFT 100 ms, TPOT 50 ms"}, "config": {"latency_error_min_ms": 20.0}}


def repeated(llmstation_ft_range=(95.0, 110.0), **changes):
    """Three repeats where every part of the goal is met, with ``changes`` to its systems."""
    systems = {
        "inference-only": system(0.0, 1.0, 0.0, (0.0, 0.0), (1.0, 1.0), (0.0, 0.0), 0.05),
        "deltaserve": system(120.0, 1.0, 0.9, (112.0, 130.0), (1.0, 1.0), (0.85, 0.95), 0.15),
        "deltaserve-pipeline": system(125.0, 0.995, 0.95, (118.0, 131.0), (0.99, 1.0),
                                      (0.9, 1.0)),
        "llmstation": system(100.0, 1.0, 0.8, llmstation_ft_range, (1.0, 1.0), (0.75, 0.9)),
        "greedy": system(140.0, 0.6, 1.1, (130.0, 150.0), (0.5, 0.7), (1.0, 1.2)),
    }
    for name, s in changes.items():
        if s is None:
            del systems[name.replace("_", "-")]
        else:
            systems[name.replace("_", "-")] = s
    return results(systems)


def verdicts(doc):
    return [c.verdict for c in goal_checks(doc)]


def test_every_part_met():
    doc = repeated()
    assert verdicts(doc) == [MET, MET, MET, MET]
    assert overall(goal_checks(doc)) == MET


def test_ft_margin_within_the_repeats_range_is_not_met():
    # deltaserve's median is above llmstation's, but its lowest repeat (112) is not above
    # llmstation's highest: the margin is within the noise the repeats showed
    for top in (112.0, 115.0):
        doc = repeated(llmstation_ft_range=(95.0, top))
        check = ft_check(doc)
        assert check.verdict == NOT_MET and "within the repeats' range" in check.why
        assert overall(goal_checks(doc)) == NOT_MET
    assert ft_check(repeated(llmstation_ft_range=(95.0, 111.9))).verdict == MET


def _split(*repeats):
    """A machine_time report whose llmstation repeats had (ceiling, tokens) each."""
    return {"systems": {"llmstation": {"repeats": [
        {"ceiling": c, "backward_tokens": t} for c, t in repeats]}}}


def test_a_ceiling_below_llmstations_spread_says_no_policy_could_part_the_ranges():
    # at 1.1x in every repeat, the worst repeat reaches 5500 tokens, under the best's 7000
    tight = _split((1.1, 5000.0), (1.2, 7000.0), (1.1, 6000.0))
    note = ceiling_note(tight)
    assert "1.10–1.20× llmstation's tokens" in note and "reaches 5500 tokens" in note
    assert "trained 7000" in note and "no admission policy could have" in note
    # a ceiling wide enough to clear the best repeat from the worst: 1.5 x 6000 > 6500
    assert "a policy could still" in ceiling_note(_split((1.5, 6000.0), (1.5, 6500.0)))
    assert ceiling_note(None) == "" and ceiling_note({"systems": {}}) == ""
    doc = repeated(llmstation_ft_range=(95.0, 115.0))
    assert ft_check(doc, tight).why.endswith(note) and ft_check(doc).why.endswith("115.0]")
    below = repeated(deltaserve=system(90.0, 1.0, 0.9, (85.0, 95.0), (1.0, 1.0), (0.85, 0.95)))
    assert ft_check(below, tight).why.endswith(note)
    # a margin that is met carries no note
    assert ft_check(repeated(), tight).why == ft_check(repeated()).why


def test_ft_below_llmstation_is_not_met():
    doc = repeated(deltaserve=system(90.0, 1.0, 0.9, (85.0, 95.0), (1.0, 1.0), (0.85, 0.95)))
    check = ft_check(doc)
    assert check.verdict == NOT_MET and "below llmstation's" in check.why


def test_attainment_below_the_mark_where_greedy_misses_is_not_met():
    doc = repeated(deltaserve_pipeline=system(125.0, 0.965, 0.95, (118.0, 131.0),
                                              (0.9, 0.98), (0.9, 1.0)))
    assert verdicts(doc) == [MET, NOT_MET, MET, MET]
    assert overall(goal_checks(doc)) == NOT_MET


def test_harvest_below_llmstation_is_not_met():
    doc = repeated(deltaserve=system(120.0, 1.0, 0.7, (112.0, 130.0), (1.0, 1.0), (0.6, 0.8)))
    assert harvest_check(doc).verdict == NOT_MET
    assert verdicts(doc)[:3] == [MET, MET, MET]


def test_one_run_is_not_measured_and_says_why():
    doc = repeated()
    doc["repeats"] = 1
    checks = goal_checks(doc)
    assert [c.verdict for c in checks] == [NOT_MEASURED] * 4
    assert all("N=1, below the issue's N≥3" in c.why for c in checks)
    assert overall(checks) == NOT_MEASURED


def test_a_system_not_run_is_not_measured():
    doc = repeated(llmstation=None, deltaserve_pipeline=None)
    assert verdicts(doc) == [MET, NOT_MEASURED, NOT_MEASURED, NOT_MEASURED]
    assert ft_check(doc).why == "llmstation not run"
    assert overall(goal_checks(doc)) == NOT_MEASURED


def test_an_slo_that_does_not_bind_is_not_measured():
    loose = repeated(greedy=system(140.0, 0.995, 1.1, (130.0, 150.0), (0.99, 1.0), (1.0, 1.2)))
    assert attainment_check(loose, "deltaserve").verdict == NOT_MEASURED
    assert "greedy meets this SLO" in attainment_check(loose, "deltaserve").why
    tight = repeated(inference_only=system(0.0, 0.5, 0.0, None, (0.4, 0.6)))
    assert attainment_check(tight, "deltaserve").verdict == NOT_MEASURED
    assert "inference alone misses" in attainment_check(tight, "deltaserve").why


def test_not_met_outweighs_not_measured():
    doc = repeated(llmstation=None, deltaserve=system(120.0, 0.9, 0.9, (112.0, 130.0),
                                                       (0.85, 0.95), (0.85, 0.95)))
    assert verdicts(doc) == [NOT_MET, MET, NOT_MEASURED, NOT_MEASURED]
    assert overall(goal_checks(doc)) == NOT_MET


def _folder(base: Path, name: str, doc: dict, command: str | None) -> str:
    (base / name).mkdir()
    (base / name / "results.json").write_text(json.dumps(doc))
    if command is not None:
        (base / name / "COMMAND").write_text(command)
    return name


ONE_RUN = results({"inference-only": system(0.0, 1.0, 0.0, mape=0.1),
                   "deltaserve": system(23.0, 1.0, None, mape=0.212)}, repeats=1, host="vllm")
EXPECTED = """\
- **vLLM**, [b](b/): m on 2 CPU threads; trace t, 10 requests over 30 s; SLO: TTFT 100 ms, \
TPOT 50 ms; N=1, below the issue's N≥3; latency MAPE over steps ≥ 20 ms.

| host | system | FT tokens/s | SLO attainment | harvest | latency MAPE online, per mode |
|---|---|---|---|---|---|
| vLLM, N=1 | inference-only | 0.0 | 100.0 % | 0.00 | eager 10.0 % |
| vLLM, N=1 | deltaserve | 23.0 | 100.0 % | — | eager 21.2 % |
| vLLM, N=1 | deltaserve-pipeline (not run) | — | — | — | — |
| vLLM, N=1 | llmstation (not run) | — | — | — | — |
| vLLM, N=1 | greedy (not run) | — | — | — | — |

The goal (issue 23), per host:

- **vLLM**: goal not measured.
  - deltaserve ≥ 99 % SLO attainment where greedy is below it: not measured (greedy not run).
  - deltaserve-pipeline ≥ 99 % SLO attainment where greedy is below it: not measured \
(deltaserve-pipeline and greedy not run).
  - deltaserve FT tokens/s ≥ llmstation's, outside the repeats' range: not measured \
(llmstation not run).
  - deltaserve harvest ≥ llmstation's: not measured (llmstation not run).

The commands that produced the runs (each folder's `COMMAND`):

vLLM, `b`:

```
(no COMMAND file in the folder)
```
"""


def test_render_of_one_run_without_repeats(tmp_path):
    folder = _folder(tmp_path, "b", ONE_RUN, None)
    assert render(load_runs(tmp_path, [folder])) == EXPECTED


def test_render_shows_medians_with_ranges_and_each_hosts_verdict(tmp_path):
    a = _folder(tmp_path, "a", repeated(), "deltaserve bench --repeats 3\n")
    b = _folder(tmp_path, "b", ONE_RUN, None)
    text = render(load_runs(tmp_path, [a, b]))
    assert ("| embedded (native), N=3 | deltaserve | 120.0 [112.0–130.0] | "
            "100.0 % [100.0–100.0 %] | 0.90 [0.85–0.95] | eager 15.0 % |") in text
    assert "N=3, medians [min–max]" in text and "N=1, below the issue's N≥3" in text
    assert "- **embedded (native)**: goal met." in text and "- **vLLM**: goal not measured." in text
    assert "```\ndeltaserve bench --repeats 3\n```" in text
    assert text.index("embedded (native), N=3") < text.index("vLLM, N=1")  # block order


def _two_runs_of_one_host(tmp_path, pipelined_greedy_slo):
    """The check command's systems in one run, the pipelined one beside greedy in another."""
    check = repeated(deltaserve_pipeline=None)
    pipelined = results({"greedy": system(150.0, pipelined_greedy_slo, 1.2, (140.0, 160.0),
                                          (0.5, 1.0), (1.1, 1.3)),
                         "deltaserve-pipeline": system(125.0, 1.0, 0.95, (118.0, 131.0),
                                                       (1.0, 1.0), (0.9, 1.0))})
    a = _folder(tmp_path, "a", check, "deltaserve bench\n")
    b = _folder(tmp_path, "b", pipelined, "deltaserve bench --systems pipelined\n")
    return load_runs(tmp_path, [a, b])


def test_a_host_with_two_runs_decides_each_part_within_the_run_that_ran_it(tmp_path):
    runs = _two_runs_of_one_host(tmp_path, pipelined_greedy_slo=0.6)
    checks = host_checks(runs)
    assert [c.verdict for c in checks] == [MET, MET, MET, MET]
    assert [c.why.rsplit("; in ", 1)[1] for c in checks] == ["a", "b", "a", "a"]
    assert "deltaserve-pipeline 100.0 % [100.0–100.0 %], greedy 60.0 %" in checks[1].why
    text = render(runs)
    assert "- **embedded (native)**: goal met." in text
    assert "| embedded (native) (b), N=3 | deltaserve-pipeline | 125.0 [118.0–131.0] |" in text
    assert "(not run)" not in text  # every goal system ran in one of the host's runs
    assert text.count("- **embedded (native)**: goal") == 1  # one verdict per host


def test_a_second_run_is_never_judged_against_the_first_runs_greedy(tmp_path):
    # greedy met the SLO in the pipelined run: that run cannot show deltaserve-pipeline's
    # attainment binding, even though greedy missed it in the other run
    checks = host_checks(_two_runs_of_one_host(tmp_path, pipelined_greedy_slo=0.995))
    assert checks[1].verdict == NOT_MEASURED and "greedy meets this SLO" in checks[1].why
    assert checks[1].why.endswith("; in b")


def test_update_fills_the_block_and_is_idempotent(tmp_path):
    a = _folder(tmp_path, "a", repeated(), "deltaserve bench --repeats 3\n")
    b = _folder(tmp_path, "b", ONE_RUN, None)
    doc = tmp_path / "hosts.md"
    doc.write_text(f"intro\n\n<!-- hosts-parity: {a} {b} -->\nstale\n<!-- /hosts-parity -->\n"
                   "\noutro\n")
    assert not all(x.matches for x in blocks(doc))
    assert update(doc) == 1
    first = doc.read_text()
    assert first.startswith("intro\n\n") and first.endswith("<!-- /hosts-parity -->\n\noutro\n")
    assert "stale" not in first and "| embedded (native), N=3 | deltaserve |" in first
    assert update(doc) == 1 and doc.read_text() == first
    assert [x.matches for x in blocks(doc)] == [True]


def test_hosts_page_is_its_committed_runs_rendered():
    holding = {str(p.relative_to(ROOT)) for p in [ROOT / "README.md", *ROOT.glob("docs/*.md")]
               if PARITY.search(p.read_text())}
    assert holding == {"docs/hosts.md"}
    found = blocks(ROOT / "docs/hosts.md")
    assert found, "docs/hosts.md has no '<!-- hosts-parity: DIR ... -->' block"
    for b in found:
        assert b.matches, (f"docs/hosts.md's block for {b.path} differs from its runs; run "
                           "python -m deltaserve.bench.tables --update docs/hosts.md")


@pytest.mark.parametrize("host", ["native", "vllm", "sglang", "sim"])
def test_hosts_page_names_a_run_of_every_host(host):
    text = (ROOT / "docs/hosts.md").read_text()
    folders = PARITY.search(text)["path"].split()
    hosts = [json.loads((ROOT / "docs" / f / "results.json").read_text())["machine"]["host"]
             for f in folders]
    assert hosts.count(host) >= 1
