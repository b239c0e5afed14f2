"""Publishing an optimizer step so that a crash never leaves a torn or unreported update.

The backward process writes each step's adapter and optimizer state over the shared ones, then
reports the step; the parent commits the step's samples when the report arrives. A process that
dies while writing leaves a torn state, and one that dies after writing but before its report
reaches the parent leaves an update whose samples go back to the pool and would be trained
twice. So before writing, the process keeps the state it overwrites (which is what the parent
has committed: one job is in flight at a time, submitted after the last report was read) and
marks the step it is publishing. If the process is lost with that step in flight, the parent
restores the kept state: the shared state is then exactly that of the last committed step.
"""

from __future__ import annotations

import torch

from deltaserve.train.optim import OptimizerState, export_state


class PublishGuard:
    """The committed state a publish overwrites, and the step being published (-1: none)."""

    def __init__(self, adapter_flat: torch.Tensor, numel: int):
        self.adapter_flat = torch.empty_like(adapter_flat)  # same device: IPC-shared on CUDA
        self.optimizer = OptimizerState(numel)
        self.publishing_step = torch.full((), -1, dtype=torch.int64)

    def share_memory_(self) -> PublishGuard:
        if self.adapter_flat.device.type == "cpu":
            self.adapter_flat.share_memory_()
        self.optimizer.share_memory_()
        self.publishing_step.share_memory_()
        return self


def _sync(t: torch.Tensor) -> None:
    # a CUDA copy is only queued; a process that dies with it queued never made it
    if t.is_cuda:
        torch.cuda.synchronize(t.device)


def publish(step: int, trainable_flat: torch.Tensor, opt: torch.optim.Optimizer,
            adapter_flat: torch.Tensor, optimizer: OptimizerState, guard: PublishGuard) -> None:
    """Write step ``step``'s adapter and optimizer state over the shared ones (worker side)."""
    with torch.no_grad():
        guard.adapter_flat.copy_(adapter_flat)
        guard.optimizer.copy_(optimizer)
        _sync(adapter_flat)
        guard.publishing_step.fill_(step)  # from here on, the kept state is complete
        adapter_flat.copy_(trainable_flat)
        export_state(opt, trainable_flat, optimizer)
        _sync(adapter_flat)


def roll_back(step: int, adapter_flat: torch.Tensor, optimizer: OptimizerState,
              guard: PublishGuard) -> bool:
    """After losing the process with ``step`` in flight (parent side): restore the committed
    state if that step had begun publishing. ``True`` if it had."""
    if int(guard.publishing_step) != step:
        return False  # it died before publishing: the shared state was never touched
    with torch.no_grad():
        adapter_flat.copy_(guard.adapter_flat)
        optimizer.copy_(guard.optimizer)
        _sync(adapter_flat)
    return True
