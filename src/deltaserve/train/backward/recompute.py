"""Loss and LoRA gradients from saved layer inputs, one decoder layer at a time.

For the last layer, the saved input is recomputed through the layer, the final norm and the LM
head to the loss; for every earlier layer, the layer is recomputed from its saved input and the
gradient of its output (the next layer's input) is pushed through it. The LoRA gradients equal a
normal backward's, provided each layer replays the forward's dropout masks (seeded per sample).
Only one layer's graph is alive at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from deltaserve.core.data import IGNORE_INDEX
from deltaserve.model.attention import CausalSegments, attention_kernels
from deltaserve.model.llama import ForwardContext, LlamaModel
from deltaserve.model.lora import AdapterWeights, DropoutSegment, LoRAGroup
from deltaserve.train.backward.messages import JobSample
from deltaserve.train.buffer import ActivationBuffer

# Called before each unit of work (a decoder layer's index, or one of the units below); blocks
# while inference holds the grant and returns the seconds it waited.
GrantWait = Callable[[int], float]
# The work of the last decoder layer, in units a yield can hold: its recompute, then the final
# norm, LM head and loss over each chunk of loss positions (forward and back), then its backward
# under its own index. (-1 is the optimizer step.) As one unit it was priced at its rate per
# token times a job's tokens, though the head grows with the loss positions only: on this 2-core
# CPU its parts, timed apart, took about 0.10 s on 128 positions (SmolLM2, 49,152-token vocab),
# so a 281-token job's was priced near 0.23 s, longer than every yield vLLM lent under
# continuous load (0.10-0.14 s): the backward never started it, and trained nothing
# (results/2026-12-06-vllm-burst-light-r3-tail).
LAST_FORWARD = -3
HEAD = -2
HEAD_CHUNK_TOKENS = 32


@dataclass(frozen=True)
class BackwardStats:
    loss: float
    num_loss_tokens: int
    paused_s: float
    num_correct: int = 0  # counted positions whose argmax prediction is the target


def shifted_targets(samples: Sequence[JobSample]) -> torch.Tensor:
    """Position t of each sample predicts its label t+1; a sample's last position predicts
    nothing."""
    out: list[int] = []
    for s in samples:
        out += [*s.labels[1:], IGNORE_INDEX]
    return torch.tensor(out, dtype=torch.long)


def buffer_rows(samples: Sequence[JobSample], buffer: ActivationBuffer) -> torch.Tensor:
    """The buffer rows of ``samples`` (each its contiguous run, in batch order), as an index on
    the device the buffer's tensors live on: CUDA refuses to index a CUDA tensor with a CPU
    index, and an offloaded buffer (pinned host memory) takes a CPU one."""
    store = buffer.residual.device
    return torch.cat([torch.arange(s.row_start, s.row_start + s.length, device=store)
                      for s in samples])


@dataclass(frozen=True)
class _Batch:
    rows: torch.Tensor  # buffer rows, on the buffer's device
    targets: torch.Tensor  # [T] on the compute device
    counted: torch.Tensor  # positions with a target, on the compute device
    num_loss_tokens: int
    ctx: ForwardContext


def _batch(model: LlamaModel, adapter: AdapterWeights, buffer: ActivationBuffer,
           samples: Sequence[JobSample], dropout: float) -> _Batch:
    """Device invariant: the recompute runs where the model's weights are; the rows are gathered
    where the buffer is (the same device, or pinned host memory when offloaded) and then moved.
    Every other index and the targets are made on the CPU from Python lists and moved once."""
    device = model.weights.device
    lengths = [s.length for s in samples]
    rows = buffer_rows(samples, buffer)
    segments, offset = [], 0
    for s in samples:
        segments.append(DropoutSegment(offset, s.length, s.dropout_seed))
        offset += s.length
    targets = shifted_targets(samples)
    counted = (targets != IGNORE_INDEX).nonzero().squeeze(1)
    if counted.numel() == 0:
        raise ValueError("the batch has no response tokens to learn from")
    positions = torch.cat([torch.arange(n) for n in lengths]).to(device)
    group = LoRAGroup(adapter, slice(None), dropout, tuple(segments))
    mlp_saved = None
    if buffer.config.saves_mlp:
        assert buffer.gate is not None and buffer.up is not None
        gate_store, up_store = buffer.gate, buffer.up

        def mlp_saved(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
            return (gate_store[layer].index_select(0, rows).to(device),
                    up_store[layer].index_select(0, rows).to(device))
    ctx = ForwardContext(positions, CausalSegments(lengths, device), (group,), mlp_saved=mlp_saved)
    return _Batch(rows, targets.to(device), counted.to(device), int(counted.numel()), ctx)


def layerwise_backward(model: LlamaModel, adapter: AdapterWeights, buffer: ActivationBuffer,
                       samples: Sequence[JobSample], dropout: float,
                       wait_grant: GrantWait | None = None,
                       on_layer: Callable[[int], None] | None = None) -> BackwardStats:
    """Accumulate into the adapter's matrices (trainable: see ``make_trainable_``) the gradient
    of the mean response-token loss; ``gather_grad_`` collects it into ``flat.grad``.

    The work comes in units, each announced to ``wait_grant`` before it starts and to
    ``on_layer`` when it ends: the last decoder layer's recompute (:data:`LAST_FORWARD`), the
    head over each chunk of loss positions (:data:`HEAD`), then each decoder layer's backward
    (the last one's) or recompute and backward (every earlier one's), by its index."""
    device = model.weights.device
    b = _batch(model, adapter, buffer, samples, dropout)
    last = model.num_layers - 1

    def wait(unit: int) -> float:
        return wait_grant(unit) if wait_grant is not None else 0.0

    def done(unit: int) -> None:
        if on_layer is not None:
            on_layer(unit)

    paused, loss, num_correct = 0.0, 0.0, 0
    grad_out: torch.Tensor | None = None
    with attention_kernels(device):
        for layer in reversed(range(model.num_layers)):
            paused += wait(LAST_FORWARD if layer == last else layer)
            h = buffer.residual[layer].index_select(0, b.rows).to(device)
            h.requires_grad_(layer > 0)
            out = model.layer(layer, h, b.ctx)
            if layer == last:  # through the head to the loss, then back into the layer
                done(LAST_FORWARD)
                head = _head(model, out, b, wait, done)
                grad_out, loss, num_correct = head.grad, head.loss, head.num_correct
                paused += head.paused_s + wait(layer)
            out.backward(grad_out)
            grad_out = h.grad if layer > 0 else None
            done(layer)
    return BackwardStats(loss, b.num_loss_tokens, paused, num_correct)


class _HeadResult(NamedTuple):
    grad: torch.Tensor  # of the loss with respect to the last layer's output
    loss: float
    num_correct: int
    paused_s: float


def _head(model: LlamaModel, out: torch.Tensor, b: _Batch, wait: Callable[[int], float],
          done: Callable[[int], None]) -> _HeadResult:
    """The final norm, LM head and loss over the loss positions, :data:`HEAD_CHUNK_TOKENS` at a
    time (each chunk a :data:`HEAD` unit), forward and back to the last layer's output. Only
    positions with a target reach the head: masked prompt positions add nothing to the loss.
    The loss and the correct count stay on the device until the last chunk."""
    x = out.detach().requires_grad_(True)
    loss_sum = torch.zeros((), device=x.device)
    correct = torch.zeros((), dtype=torch.long, device=x.device)
    paused = 0.0
    for idx in b.counted.split(HEAD_CHUNK_TOKENS):
        paused += wait(HEAD)
        logits = model.logits(x[idx])
        targets = b.targets[idx]
        loss = F.cross_entropy(logits, targets, reduction="sum") / b.num_loss_tokens
        loss.backward()
        loss_sum += loss.detach()
        correct += (logits.detach().argmax(-1) == targets).sum()
        done(HEAD)
    assert x.grad is not None
    return _HeadResult(x.grad, float(loss_sum), int(correct), paused)
