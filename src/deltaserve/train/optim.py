"""AdamW with the usual knobs, over the adapter's flat tensor, with its state in shared memory
so a restarted backward process continues where the last one published."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from deltaserve.core.errors import require, require_choice


@dataclass(frozen=True)
class OptimizerConfig:
    """``total_steps`` is used by ``linear``/``cosine`` schedules (decay to ``min_lr_ratio``);
    ``max_grad_norm`` ≤ 0 disables clipping."""

    lr: float = 1e-3
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    max_grad_norm: float = 1.0
    schedule: str = "constant"
    warmup_steps: int = 0
    total_steps: int | None = None
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        require(self.lr > 0, "lr", self.lr, "must be > 0")
        require(self.weight_decay >= 0, "weight_decay", self.weight_decay, "must be >= 0")
        require(0 <= self.beta1 < 1, "beta1", self.beta1, "must be in [0, 1)")
        require(0 <= self.beta2 < 1, "beta2", self.beta2, "must be in [0, 1)")
        require(self.eps > 0, "eps", self.eps, "must be > 0")
        require_choice("schedule", self.schedule, ("constant", "linear", "cosine"))
        require(self.warmup_steps >= 0, "warmup_steps", self.warmup_steps, "must be >= 0")
        require(self.schedule == "constant" or (self.total_steps or 0) > 0, "total_steps",
                self.total_steps, f"the {self.schedule} schedule needs total_steps > 0")
        require(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", self.min_lr_ratio,
                "must be in [0, 1]")

    def lr_at(self, step: int) -> float:
        """Learning rate of optimizer step ``step`` (0-based)."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return self.lr
        total = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / total)
        if self.schedule == "linear":
            factor = 1.0 - progress
        else:
            factor = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * factor)


class OptimizerState:
    """AdamW moments and step count, shaped like the adapter's flat tensor."""

    def __init__(self, numel: int):
        self.exp_avg = torch.zeros(numel, dtype=torch.float32)
        self.exp_avg_sq = torch.zeros(numel, dtype=torch.float32)
        self.step = torch.zeros((), dtype=torch.float32)

    def share_memory_(self) -> OptimizerState:
        for t in (self.exp_avg, self.exp_avg_sq, self.step):
            t.share_memory_()
        return self

    @property
    def num_steps(self) -> int:
        return int(self.step.item())

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"exp_avg": self.exp_avg.clone(), "exp_avg_sq": self.exp_avg_sq.clone(),
                "step": self.step.clone()}

    def copy_(self, other: OptimizerState) -> OptimizerState:
        self.exp_avg.copy_(other.exp_avg)
        self.exp_avg_sq.copy_(other.exp_avg_sq)
        self.step.copy_(other.step)
        return self

    def load_state_dict_(self, state: dict[str, torch.Tensor]) -> OptimizerState:
        self.exp_avg.copy_(state["exp_avg"])
        self.exp_avg_sq.copy_(state["exp_avg_sq"])
        self.step.copy_(state["step"])
        return self


def build_adamw(param: torch.Tensor, config: OptimizerConfig, state: OptimizerState
                ) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` over ``param`` starting from (private copies of) ``state``.

    The fused implementation: one kernel over the adapter's flat tensor instead of a dozen
    element-wise passes (torch has it on the CPU and CUDA). The shared state lives in host
    memory; the moments and the step count are copied to ``param``'s device, where fused AdamW
    keeps and updates them (a host copy fails every step on a GPU after a resume or a lost
    job)."""
    opt = torch.optim.AdamW([param], lr=config.lr, betas=(config.beta1, config.beta2),
                            eps=config.eps, weight_decay=config.weight_decay, fused=True)
    if state.num_steps > 0:
        dev = param.device
        opt.state[param] = {"step": state.step.to(dev, copy=True),
                            "exp_avg": state.exp_avg.to(dev, copy=True),
                            "exp_avg_sq": state.exp_avg_sq.to(dev, copy=True)}
    return opt


def export_state(opt: torch.optim.AdamW, param: torch.Tensor, state: OptimizerState) -> None:
    s = opt.state[param]
    state.exp_avg.copy_(s["exp_avg"])
    state.exp_avg_sq.copy_(s["exp_avg_sq"])
    state.step.copy_(s["step"])
