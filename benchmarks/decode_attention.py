"""A decode step's attention, two ways, on this machine: SDPA with ``enable_gqa`` over the
query heads (what the engine called before) against :func:`decode_attention` (grouped heads
as query rows, no KV head repeated). Same inputs, medians of ``--repeats`` timed calls after
warm-up, interleaved; their largest difference beside the time. Writes JSON.

    python benchmarks/decode_attention.py --out results/X/decode_attention.json [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from deltaserve.bench.provenance import cpu_model
from deltaserve.model.attention import attention_kernels, decode_attention

# (name, batch, context, query heads, KV heads, head dim): SmolLM2-135M's heads, and the H200
# floor's Llama-3-8B decodes (h200/README.md)
SHAPES = (("smollm2 B=8 L=1024", 8, 1024, 9, 3, 64),
          ("llama-3-8b B=8 L=1024", 8, 1024, 32, 8, 128),
          ("llama-3-8b B=32 L=1024", 32, 1024, 32, 8, 128))


def gqa_call(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
             ) -> torch.Tensor:
    o = F.scaled_dot_product_attention(q.unsqueeze(2), keys.transpose(1, 2),
                                       values.transpose(1, 2), attn_mask=mask, enable_gqa=True)
    return o.squeeze(2).reshape(q.shape[0], -1)


def _time_ms(fn, args, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn(*args)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) * 1e3


def measure(shape: tuple, dtype: torch.dtype, device: torch.device, repeats: int) -> dict:
    name, b, length, hq, hkv, d = shape
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, hq, d, generator=g).to(device, dtype)
    keys = torch.randn(b, length, hkv, d, generator=g).to(device, dtype)
    values = torch.randn(b, length, hkv, d, generator=g).to(device, dtype)
    lengths = torch.randint(1, length + 1, (b,), generator=g)
    mask = (torch.arange(length)[None, :] < lengths[:, None])[:, None, None, :].to(device)
    args = (q, keys, values, mask)
    with attention_kernels(device):
        diff = (gqa_call(*args).float() - decode_attention(*args).float()).abs().max().item()
        times: dict[str, list[float]] = {"enable_gqa": [], "grouped_rows": []}
        for _ in range(3):
            gqa_call(*args), decode_attention(*args)
        for _ in range(repeats):
            times["enable_gqa"].append(_time_ms(gqa_call, args, device))
            times["grouped_rows"].append(_time_ms(decode_attention, args, device))
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"shape": name, "dtype": str(dtype).removeprefix("torch."), "max_abs_diff": diff,
            "enable_gqa_ms": med["enable_gqa"], "grouped_rows_ms": med["grouped_rows"],
            "speedup": med["enable_gqa"] / med["grouped_rows"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    rows = [measure(s, dt, device, args.repeats) for dt in (torch.float32, torch.bfloat16)
            for s in SHAPES]
    for r in rows:
        print(f"{r['shape']} {r['dtype']}: enable_gqa {r['enable_gqa_ms']:.3f} ms, grouped rows "
              f"{r['grouped_rows_ms']:.3f} ms ({r['speedup']:.2f}x), max diff "
              f"{r['max_abs_diff']:.1e}", flush=True)
    doc = {"device": args.device, "cpu": cpu_model(), "threads": torch.get_num_threads(),
           "torch": torch.__version__, "platform": platform.platform(),
           "repeats": args.repeats, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
