import pytest

from deltaserve.core import ExecMode, InputError, StepShape


def test_totals():
    s = StepShape((3, 5), num_decode=4, kv_tokens=100, ft_lens=(7,))
    assert s.num_prefill_tokens == 8
    assert s.num_ft_tokens == 7
    assert s.num_tokens == 19
    assert s.num_seqs == 7
    assert s.prefill_sq_tokens == 9 + 25 + 49
    assert s.has_inference and not s.is_decode_only


def test_decode_only_and_empty():
    assert StepShape(num_decode=2, kv_tokens=10).is_decode_only
    assert not StepShape(num_decode=2, ft_lens=(3,)).is_decode_only
    assert StepShape().is_empty and not StepShape().has_inference
    assert not StepShape(ft_lens=(4,)).has_inference


def test_with_ft_is_eager():
    s = StepShape(num_decode=2, mode=ExecMode.GRAPH).with_ft((4, 5))
    assert s.mode is ExecMode.EAGER and s.ft_lens == (4, 5)
    assert s.inference_only().ft_lens == ()


@pytest.mark.parametrize("kwargs,field", [
    ({"prefill_lens": (0,)}, "prefill_lens"),
    ({"ft_lens": (-1,)}, "ft_lens"),
    ({"num_decode": -1}, "num_decode"),
    ({"kv_tokens": -5}, "kv_tokens"),
    ({"ft_lens": (3,), "mode": ExecMode.GRAPH}, "mode"),
])
def test_invalid(kwargs, field):
    with pytest.raises(InputError) as e:
        StepShape(**kwargs)
    assert e.value.field == field


def test_after_yield_is_context_not_work():
    """A host's record of a step (no flag) equals the co-server's shape of it, and adding or
    dropping fine-tuning samples keeps the flag."""
    s = StepShape((30,), num_decode=2, kv_tokens=100, after_yield=True)
    plain = StepShape((30,), num_decode=2, kv_tokens=100)
    assert s == plain and hash(s) == hash(plain)
    assert s.with_ft((8,)).after_yield and s.with_ft((8,)).inference_only().after_yield
    assert not plain.with_ft((8,)).after_yield
