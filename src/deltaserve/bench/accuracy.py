"""The trained adapter's exact-match accuracy on the generated task's held-out split."""

from __future__ import annotations

from dataclasses import replace

from deltaserve.bench.config import BenchConfig
from deltaserve.bench.results import HeldoutAccuracy
from deltaserve.core import synthetic_task
from deltaserve.core.requests import SamplingParams
from deltaserve.core.synthetic_task import TaskExample
from deltaserve.hosts.registry import create_host

MAX_ANSWER_TOKENS = 16


def heldout_accuracy(cfg: BenchConfig, heldout: list[TaskExample], adapter_dir: str | None,
                     threads: int, system: str) -> HeldoutAccuracy:
    """Accuracy of the base model, and of ``adapter_dir`` (trained by ``system``) if any."""
    engine = create_host("native", replace(cfg.engine, num_threads=threads))
    tok = engine.tokenizer
    assert tok is not None
    texts = [tok.apply_chat_template([{"role": "user", "content": ex.instruction}],
                                     tokenize=False, add_generation_prompt=True)
             for ex in heldout]
    params = SamplingParams(max_tokens=MAX_ANSWER_TOKENS)

    def score(adapter: str | None) -> float:
        outs = engine.generate(texts, params, adapter=adapter)
        hits = [synthetic_task.exact_match(o.text or "", ex.answer)
                for o, ex in zip(outs, heldout, strict=True)]
        return sum(hits) / len(hits)

    try:
        before = score(None)
        after = None
        if adapter_dir:
            engine.add_lora("trained", adapter_dir)
            after = score("trained")
    finally:
        engine.close()
    return HeldoutAccuracy(before, after, system)
