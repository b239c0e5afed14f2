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

import torch
import torch.nn.functional as F

from deltaserve.core.data import IGNORE_INDEX
from deltaserve.model.attention import CausalSegments, attention_kernels
from deltaserve.model.llama import ForwardContext, LlamaModel
from deltaserve.model.lora import AdapterWeights, DropoutSegment, LoRAGroup
from deltaserve.train.backward.messages import JobSample
from deltaserve.train.buffer import ActivationBuffer

# Called before recomputing each layer; blocks while inference holds the grant and returns the
# seconds it waited.
GrantWait = Callable[[int], float]


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
    ctx = ForwardContext(positions, CausalSegments(lengths), (group,), mlp_saved=mlp_saved)
    return _Batch(rows, targets.to(device), counted.to(device), int(counted.numel()), ctx)


def layerwise_backward(model: LlamaModel, adapter: AdapterWeights, buffer: ActivationBuffer,
                       samples: Sequence[JobSample], dropout: float,
                       wait_grant: GrantWait | None = None,
                       on_layer: Callable[[int], None] | None = None) -> BackwardStats:
    """Accumulate into the adapter's matrices (trainable: see ``make_trainable_``) the gradient
    of the mean response-token loss; ``gather_grad_`` collects it into ``flat.grad``."""
    device = model.weights.device
    b = _batch(model, adapter, buffer, samples, dropout)
    counted, targets = b.counted, b.targets
    paused = 0.0
    grad_out: torch.Tensor | None = None
    loss_value, num_correct = 0.0, 0
    with attention_kernels(device):
        for layer in reversed(range(model.num_layers)):
            if wait_grant is not None:
                paused += wait_grant(layer)
            h = buffer.residual[layer].index_select(0, b.rows).to(device)
            h.requires_grad_(layer > 0)
            out = model.layer(layer, h, b.ctx)
            if grad_out is None:  # the last layer: through the head to the loss
                # Only positions with a target reach the LM head: masked prompt positions add
                # nothing to the loss, and the head is a fifth of a small model's FLOPs.
                logits = model.logits(out[counted])
                loss = F.cross_entropy(logits, targets[counted],
                                       reduction="sum") / b.num_loss_tokens
                loss.backward()
                loss_value = float(loss.detach())
                num_correct = int((logits.detach().argmax(-1) == targets[counted]).sum())
            else:
                out.backward(grad_out)
            grad_out = h.grad if layer > 0 else None
            if on_layer is not None:
                on_layer(layer)
    return BackwardStats(loss_value, b.num_loss_tokens, paused, num_correct)
