"""Decode attention with grouped heads as query rows (:func:`decode_attention`) against a
brute-force reference: each sequence's query head attends over its real keys only, through an
explicit softmax, the KV head it reads picked by hand."""

import math

import pytest
import torch

from deltaserve.model.attention import additive_mask, decode_attention


def reference(q, keys, values, lengths):
    """Per sequence and query head: softmax(q·k / sqrt(D)) over the first ``length`` keys of
    KV head ``h // group``, times their values."""
    b, hq, d = q.shape
    group = hq // keys.shape[2]
    out = torch.empty(b, hq, d, dtype=q.dtype)
    for s in range(b):
        n = lengths[s]
        for h in range(hq):
            k, v = keys[s, :n, h // group], values[s, :n, h // group]
            w = torch.softmax(k @ q[s, h] / math.sqrt(d), dim=0)
            out[s, h] = w @ v
    return out.reshape(b, hq * d)


@pytest.mark.parametrize("hq,hkv", [(4, 2), (9, 3), (8, 8), (6, 1)])
def test_grouped_heads_as_query_rows_equal_the_brute_force(hq, hkv):
    g = torch.Generator().manual_seed(hq * 10 + hkv)
    b, width, d = 5, 24, 8
    lengths = [1, 7, 24, 13, 2]  # padded to the widest; the mask hides the rest
    q = torch.randn(b, hq, d, generator=g, dtype=torch.float64)
    keys = torch.randn(b, width, hkv, d, generator=g, dtype=torch.float64)
    values = torch.randn(b, width, hkv, d, generator=g, dtype=torch.float64)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :]
    got = decode_attention(q, keys, values, mask)
    torch.testing.assert_close(got, reference(q, keys, values, lengths), rtol=1e-10, atol=1e-10)


def test_keys_past_a_rows_length_change_nothing():
    # garbage in the padded positions (another request's blocks, a scratch block) is masked out
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 8, generator=g)
    keys, values = torch.randn(2, 16, 2, 8, generator=g), torch.randn(2, 16, 2, 8, generator=g)
    mask = (torch.arange(16)[None, :] < torch.tensor([5, 16])[:, None])[:, None, None, :]
    before = decode_attention(q, keys, values, mask)
    keys[0, 5:], values[0, 5:] = 1e4, -1e4
    torch.testing.assert_close(decode_attention(q, keys, values, mask), before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_additive_mask_built_once_equals_the_boolean_one(dtype):
    # the step converts its mask once; SDPA would convert a boolean one in every layer's call
    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, 6, 8, generator=g).to(dtype)
    keys = torch.randn(3, 32, 2, 8, generator=g).to(dtype)
    values = torch.randn(3, 32, 2, 8, generator=g).to(dtype)
    mask = (torch.arange(32)[None, :] < torch.tensor([1, 17, 32])[:, None])[:, None, None, :]
    additive = additive_mask(mask, dtype)
    assert additive.dtype == dtype and torch.equal(additive == 0, mask)
    assert torch.isinf(additive[~mask]).all() and (additive[~mask] < 0).all()
    assert torch.equal(decode_attention(q, keys, values, additive),
                       decode_attention(q, keys, values, mask))
