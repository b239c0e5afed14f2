"""The validation loss of an adapter, computed in the backward process.

A forward pass with the adapter (no dropout, no gradient) over held-out samples, in chunks of
whole samples, one decoder layer at a time: before each layer it waits on the grant exactly like
the backward's recomputation does, so validation takes no time from inference that the backward
itself would not. The loss is the mean cross-entropy over every response token of every sample
(labels unshifted, Hugging Face's convention: position t predicts label t+1).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F

from deltaserve.core.data import IGNORE_INDEX
from deltaserve.model.attention import CausalSegments, attention_kernels
from deltaserve.model.llama import ForwardContext, LlamaModel
from deltaserve.model.lora import AdapterWeights, LoRAGroup
from deltaserve.train.backward.messages import EvalDone, EvalJob
from deltaserve.train.backward.recompute import GrantWait

# Tokens forwarded at once: bounds the memory of one chunk's activations.
EVAL_CHUNK_TOKENS = 2048


def _chunks(job: EvalJob, max_tokens: int) -> Iterator[list[int]]:
    """Indices of whole samples, at most ``max_tokens`` per chunk (a longer sample alone)."""
    chunk: list[int] = []
    tokens = 0
    for i, ids in enumerate(job.input_ids):
        if chunk and tokens + len(ids) > max_tokens:
            yield chunk
            chunk, tokens = [], 0
        chunk.append(i)
        tokens += len(ids)
    if chunk:
        yield chunk


def _targets(labels: Sequence[Sequence[int]]) -> torch.Tensor:
    out: list[int] = []
    for lab in labels:
        out += [*lab[1:], IGNORE_INDEX]
    return torch.tensor(out, dtype=torch.long)


def _chunk_loss(model: LlamaModel, adapter: AdapterWeights, job: EvalJob, chunk: list[int],
                wait_grant: GrantWait | None, on_layer: Callable[[int], None] | None
                ) -> tuple[float, int, int, float]:
    """(loss sum, loss tokens, correct argmax predictions, seconds waited on the grant)."""
    device = model.weights.device
    ids = [job.input_ids[i] for i in chunk]
    lengths = [len(x) for x in ids]
    tokens = torch.tensor([t for x in ids for t in x], dtype=torch.long, device=device)
    positions = torch.cat([torch.arange(n) for n in lengths]).to(device)
    ctx = ForwardContext(positions, CausalSegments(lengths, device),
                         (LoRAGroup(adapter, slice(None)),))
    targets = _targets([job.labels[i] for i in chunk]).to(device)
    counted = (targets != IGNORE_INDEX).nonzero().squeeze(1)
    paused = 0.0
    h = model.embed(tokens)
    for layer in range(model.num_layers):
        if wait_grant is not None:
            paused += wait_grant(layer)
        h = model.layer(layer, h, ctx)
        if on_layer is not None:
            on_layer(layer)
    if not counted.numel():
        return 0.0, 0, 0, paused
    logits = model.logits(h[counted])
    loss_sum = float(F.cross_entropy(logits, targets[counted], reduction="sum"))
    correct = int((logits.argmax(-1) == targets[counted]).sum())
    return loss_sum, int(counted.numel()), correct, paused


def validation_loss(model: LlamaModel, adapter: AdapterWeights, job: EvalJob,
                    wait_grant: GrantWait | None = None,
                    on_layer: Callable[[int], None] | None = None,
                    chunk_tokens: int = EVAL_CHUNK_TOKENS) -> EvalDone:
    """The mean response-token loss of ``adapter`` on the job's samples."""
    t0 = time.perf_counter()
    loss_sum, num_tokens, num_correct, paused = 0.0, 0, 0, 0.0
    with torch.no_grad(), attention_kernels(model.weights.device):
        for chunk in _chunks(job, chunk_tokens):
            s, n, c, p = _chunk_loss(model, adapter, job, chunk, wait_grant, on_layer)
            loss_sum, num_tokens, num_correct, paused = (loss_sum + s, num_tokens + n,
                                                         num_correct + c, paused + p)
    if num_tokens == 0:
        raise ValueError("the validation samples have no response tokens")
    return EvalDone(job.step, loss_sum / num_tokens, num_tokens, num_correct,
                    time.perf_counter() - t0, paused)
