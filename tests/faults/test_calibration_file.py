"""Fault: a corrupt calibration (latency-model) file. What survives: nothing is served on it; the
load fails with an InputError naming the field and the value, never an AttributeError, a
KeyError or a crash at the first prediction. A good file (format 2 or 1) still loads."""

from __future__ import annotations

import json
import math

import pytest

from deltaserve.core import HostLimits, InputError, LatencyModel, StepShape, build_plan
from deltaserve.core.latency_model import fit_from

LIMITS = HostLimits(max_tokens_per_step=512, max_seqs_per_step=16, max_model_len=512,
                    max_kv_tokens=8192)


def _true_s(s: StepShape) -> float:
    return 2e-3 + 1e-5 * s.num_tokens + 1e-8 * s.prefill_sq_tokens + 1e-7 * s.kv_tokens


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A real calibration file and the document it holds."""
    path = tmp_path_factory.mktemp("lm") / "lm.json"
    fit_from([(p.shape, _true_s(p.shape)) for p in build_plan(LIMITS)]).save(path)
    return path, json.loads(path.read_text())


def _mixed(doc: dict) -> int:
    return next(i for i, e in enumerate(doc["keys"])
                if e["equation"] == "mixed" and e["coefficients"] is not None)


def _corrupt(doc: dict, form: str):
    """Apply ``form`` to a copy of ``doc``; returns (document, field named, value named)."""
    doc = json.loads(json.dumps(doc))
    i = _mixed(doc)
    entry = doc["keys"][i]
    coef = entry["coefficients"]
    if form == "coefficients too short":
        entry["coefficients"] = coef[:-1]
        return doc, f"keys[{i}].coefficients", entry["coefficients"]
    if form == "coefficients too long":
        entry["coefficients"] = [*coef, 1e-3]
        return doc, f"keys[{i}].coefficients", entry["coefficients"]
    if form in ("negative coefficient", "NaN coefficient", "infinite coefficient"):
        coef[1] = {"negative coefficient": -16.0, "NaN coefficient": math.nan,
                   "infinite coefficient": math.inf}[form]
        return doc, f"keys[{i}].coefficients", coef[1]
    if form in ("negative margin", "NaN margin"):
        entry["margin"] = -0.5 if form == "negative margin" else math.nan
        return doc, f"keys[{i}].margin", entry["margin"]
    if form == "coefficients not a list":
        entry["coefficients"] = {"alpha": 1.0}
        return doc, f"keys[{i}].coefficients", "alpha"
    if form == "short observation row":
        entry["anchors"][0] = entry["anchors"][0][:-2]
        return doc, f"keys[{i}].anchors[0]", entry["anchors"][0][0]
    if form.startswith("missing "):
        name = form.removeprefix("missing ")
        if name in ("keys", "config"):
            del doc[name]
            return doc, name, "None"
        del entry[name]
        return doc, f"keys[{i}].{name}", "None"
    if form == "unknown equation":
        entry["equation"] = "cubic"
        return doc, f"keys[{i}].equation", "cubic"
    if form == "unknown config setting":
        doc["config"]["windw"] = 64
        return doc, "config", "windw"
    if form == "config of the wrong type":
        doc["config"]["window"] = "large"
        return doc, "config", "large"
    raise AssertionError(form)


FORMS = ["coefficients too short", "coefficients too long", "negative coefficient",
         "NaN coefficient", "infinite coefficient", "negative margin", "NaN margin",
         "coefficients not a list", "short observation row", "missing keys", "missing config",
         "missing coefficients", "missing margin", "missing equation", "missing mode",
         "unknown equation", "unknown config setting", "config of the wrong type"]


@pytest.mark.parametrize("form", FORMS)
def test_each_corrupt_field_is_named_with_its_value(saved, tmp_path, form):
    _, doc = saved
    bad, field, value = _corrupt(doc, form)
    path = tmp_path / "lm.json"
    path.write_text(json.dumps(bad))  # NaN and Infinity are written as JSON extensions
    with pytest.raises(InputError) as e:
        LatencyModel.load(path)
    assert e.value.field == field
    assert str(value)[:100] in str(e.value)  # the value, shown (long ones are cut at 120)
    assert str(path) in e.value.reason  # which file, when several are in play


@pytest.mark.parametrize("text,kind", [("[]", "list"), ('"lm"', "str"), ("42", "int"),
                                       ("null", "NoneType"), ("{", None), ("", None)])
def test_a_document_that_is_not_an_object(tmp_path, text, kind):
    path = tmp_path / "lm.json"
    path.write_text(text)
    with pytest.raises(InputError) as e:
        LatencyModel.load(path)
    assert e.value.field == "latency_model_path" and e.value.value == str(path)
    assert kind is None or f"JSON {kind}" in e.value.reason


def test_non_utf8_file_is_an_input_error(tmp_path):
    path = tmp_path / "lm.json"
    path.write_bytes(b'{"format": "\xff\xfe"}')
    with pytest.raises(InputError, match="cannot read"):
        LatencyModel.load(path)


def test_a_good_file_still_loads_and_predicts_as_saved(saved):
    path, _ = saved
    original = fit_from([(p.shape, _true_s(p.shape)) for p in build_plan(LIMITS)])
    loaded = LatencyModel.load(path)
    for p in build_plan(LIMITS)[:20]:
        assert loaded.predict_upper(p.shape) == original.predict_upper(p.shape)


def test_format_1_checks_its_own_layout(saved, tmp_path):
    """A format-1 file has five Equation I coefficients (no ζ): five load, six do not."""
    _, doc = saved
    old = json.loads(json.dumps(doc))
    old["format"] = "deltaserve.latency_model/1"
    for entry in old["keys"]:
        if entry["equation"] == "mixed":
            entry["coefficients"] = entry["coefficients"] and entry["coefficients"][:5]
            for name in ("anchors", "online"):
                entry[name] = [r[:5] + r[6:] for r in entry[name]]
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(old))
    plain = StepShape((100,), num_decode=2, kv_tokens=300)
    assert LatencyModel.load(path).predict(plain) == pytest.approx(_true_s(plain), rel=0.05)
    i = _mixed(old)
    old["keys"][i]["coefficients"].append(0.0)
    path.write_text(json.dumps(old))
    with pytest.raises(InputError) as e:
        LatencyModel.load(path)
    assert e.value.field == f"keys[{i}].coefficients" and "5 numbers" in e.value.reason
