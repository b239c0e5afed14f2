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

A replica with nothing to train in a step contributes an empty share (``n_r = 0``, a zero
gradient): the others' gradient is then the step's. Each share also carries the replica's votes
on whether the group steps on (:mod:`deltaserve.train.group_steps`), summed in the same
collective. A step in which no replica had a loss token (``N = 0``) takes no optimizer step on
any replica.

After the all-reduce every rank gathers every rank's sample ids of the step (a second, small
collective), so each replica knows what the group's adapter holds: the group's ledger
(:mod:`deltaserve.train.group_ledger`), which rank 0's checkpoint records once for the group.

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


class GroupLost(RuntimeError):
    """A collective of the replicas' group failed: a peer is gone (its process died, or it did
    not answer within ``DataParallelConfig.timeout_s``). The group cannot step again."""


@dataclass(frozen=True)
class ReducedGradient:
    """The step's gradient now in ``flat.grad`` is that of the global batch's mean loss (zero,
    and no step to take, when ``num_loss_tokens`` is 0)."""

    num_loss_tokens: int  # over every replica's share of the batch
    seconds: float  # spent in the all-reduce, waiting for the slowest peer included
    epoch_open: int = 0  # replicas that voted to have samples of the epoch left
    staying: int = 0  # replicas that voted to submit another real step
    group_sample_ids: tuple[int, ...] = ()  # every replica's samples of the step, rank order


def backend_for(config: DataParallelConfig, device: torch.device) -> str:
    if config.backend is DataParallelBackend.AUTO:
        return "nccl" if device.type == "cuda" else "gloo"
    return config.backend.value


class GradientAllReduce:
    """This process's membership of the replicas' group (one per backward process)."""

    def __init__(self, config: DataParallelConfig, device: torch.device):
        assert config.distributed, "one replica forms no group"
        self.config, self.device = config, device
        self.broken = False  # a collective failed: the group is unusable
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

    def reduce_(self, grad: torch.Tensor, num_loss_tokens: int, epoch_open: bool = True,
                staying: bool = True, sample_ids: tuple[int, ...] = ()) -> ReducedGradient:
        """Replace ``grad`` (of this replica's mean loss over ``num_loss_tokens`` tokens; zero
        for an empty share) with the gradient of the global batch's mean loss, in one
        collective that also sums the replicas' votes; then gather every replica's
        ``sample_ids`` of the step."""
        t0 = time.perf_counter()
        # the count and the votes ride in the gradient's own buffer (fp32: exact integers
        # below 2**24 tokens a step)
        tail = torch.tensor([float(num_loss_tokens), float(epoch_open), float(staying)],
                            device=grad.device, dtype=grad.dtype)
        packed = torch.cat([grad.reshape(-1) * num_loss_tokens, tail])
        shares: list[list[int] | None] = [None] * self.config.world_size
        try:
            dist.all_reduce(packed, op=dist.ReduceOp.SUM)
            dist.all_gather_object(shares, list(sample_ids))
        except Exception as e:
            # the ranks are out of step now (a peer died, or one gave up waiting): no later
            # collective of this group can pair up, and a new member cannot join it
            self.broken = True
            raise GroupLost(f"the data-parallel all-reduce failed (rank {self.config.rank} of "
                            f"{self.config.world_size}): {e}") from e
        total, opened, stay = (round(float(v)) for v in packed[-3:])
        if total > 0:
            grad.copy_(packed[:-3].reshape(grad.shape).div_(total))
        else:  # every share was empty: nothing to learn, no step anywhere
            grad.zero_()
        group_ids = tuple(sid for share in shares for sid in share or ())
        return ReducedGradient(total, time.perf_counter() - t0, opened, stay, group_ids)

    def close(self) -> None:
        # a broken group is left to the process's exit (tearing it down may wait on the peer
        # that is gone)
        if dist.is_initialized() and not self.broken:
            dist.destroy_process_group()


def join_group(config: DataParallelConfig, device: torch.device) -> GradientAllReduce | None:
    """The group for a data-parallel replica; ``None`` for one replica (nothing changes)."""
    return GradientAllReduce(config, device) if config.distributed else None
