"""Data-parallel training: the backward processes of N replicas form one ``torch.distributed``
group and all-reduce every optimizer step's LoRA gradient, so that each replica takes the step
one replica would take on the whole global batch.

Loss normalisation. A replica's recompute gives the gradient of the mean loss over its own
response tokens, ``g_r = ∇S_r / n_r`` (``S_r`` the summed token losses, ``n_r`` their count).
The global batch's loss is the mean over all its response tokens, ``Σ S_r / N`` with
``N = Σ n_r``, so each replica contributes ``n_r · g_r = ∇S_r``, the sum is all-reduced together
with the token counts, and divided by ``N``. (Averaging the replicas' means, DDP's rule for
equal shards, would weigh a token of a short shard more than one of a long shard.)

Every rank then holds the same gradient (an all-reduce hands every rank the same sum), clips it
by the same global norm and steps the same AdamW from the same state: the adapters stay
identical without ever being exchanged. That rests on every replica starting from the same
adapter and optimizer state, which :meth:`GradientAllReduce.check_same_start` verifies when the
group forms (and fails start-up otherwise: silently overwriting a replica's adapter would change
what its engine serves).

The group uses the standard env rendezvous (``MASTER_ADDR``/``MASTER_PORT``, rank and world size
given explicitly), so torchrun-launched replicas and several machines work the same way.
"""

from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from deltaserve.train.config import DataParallelBackend, DataParallelConfig
from deltaserve.train.optim import OptimizerState


@dataclass(frozen=True)
class ReducedGradient:
    """The step's gradient now in ``flat.grad`` is that of the global batch's mean loss."""

    num_loss_tokens: int  # over every replica's share of the batch
    seconds: float  # spent in the all-reduce, waiting for the slowest peer included


def backend_for(config: DataParallelConfig, device: torch.device) -> str:
    if config.backend is DataParallelBackend.AUTO:
        return "nccl" if device.type == "cuda" else "gloo"
    return config.backend.value


class GradientAllReduce:
    """This process's membership of the replicas' group (one per backward process)."""

    def __init__(self, config: DataParallelConfig, device: torch.device):
        assert config.distributed, "one replica forms no group"
        self.config, self.device = config, device
        # env rendezvous: the variables torchrun sets, here from the config (which
        # DataParallelConfig.from_env reads from them); this process is the backward's own
        os.environ["MASTER_ADDR"] = config.master_addr
        os.environ["MASTER_PORT"] = str(config.master_port)
        if device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)  # NCCL binds its communicator to the current device
        dist.init_process_group(backend_for(config, device), init_method="env://",
                                rank=config.rank, world_size=config.world_size,
                                timeout=datetime.timedelta(seconds=config.timeout_s))

    def check_same_start(self, flat: torch.Tensor, state: OptimizerState) -> None:
        """Raise unless this replica's adapter and optimizer state equal rank 0's."""
        mine = torch.cat([flat.detach().reshape(-1).float(), state.exp_avg.to(flat.device),
                          state.exp_avg_sq.to(flat.device), state.step.reshape(1).to(flat.device)])
        theirs = mine.clone()
        dist.broadcast(theirs, src=0)
        if not torch.equal(mine, theirs):
            raise RuntimeError(
                f"data-parallel rank {self.config.rank} starts from another adapter or optimizer "
                f"state than rank 0 ({int((mine != theirs).sum())} of {mine.numel()} values "
                f"differ): every replica must start from the same seed or checkpoint")

    def reduce_(self, grad: torch.Tensor, num_loss_tokens: int) -> ReducedGradient:
        """Replace ``grad`` (of this replica's mean loss over ``num_loss_tokens`` tokens) with
        the gradient of the global batch's mean loss, in one collective."""
        t0 = time.perf_counter()
        # the count rides in the gradient's own buffer (fp32, exact below 2**24 tokens a step)
        packed = torch.cat([grad.reshape(-1) * num_loss_tokens,
                            torch.tensor([float(num_loss_tokens)], device=grad.device,
                                         dtype=grad.dtype)])
        dist.all_reduce(packed, op=dist.ReduceOp.SUM)
        total = round(float(packed[-1]))
        grad.copy_(packed[:-1].reshape(grad.shape).div_(total))
        return ReducedGradient(total, time.perf_counter() - t0)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def join_group(config: DataParallelConfig, device: torch.device) -> GradientAllReduce | None:
    """The group for a data-parallel replica; ``None`` for one replica (nothing changes)."""
    return GradientAllReduce(config, device) if config.distributed else None
