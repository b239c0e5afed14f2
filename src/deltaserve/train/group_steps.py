"""How data-parallel replicas agree on their optimizer steps, so that none waits forever in the
all-reduce for a peer that has nothing more to send.

Every optimizer step of a replica is one collective of the group: step k of every replica is
the global step k, and a replica that submits step k waits in the all-reduce until every peer
has submitted its step k. A co-serving replica forms its steps as its captures fill a batch, so
how many steps its share of an epoch takes depends on its shard (shards differ by up to one
sample), on the lengths in it and on timing; and a replica that closes stops stepping. Left to
themselves, a replica with one batch fewer, or one that closed, would leave its peers blocked
in their next step (until the group's ``timeout_s``, then lost).

The rule: **every replica takes part in every global step until the group says it may stop;
one with nothing to train contributes an empty share** (no samples, no loss tokens: the
token-weighted all-reduce then gives the peers' gradient, and every replica takes the same
optimizer step). To know when that is, each share carries two votes, summed in the same
all-reduce as the gradient, so every replica reads the same totals after every step:

* ``epoch_open``: this replica has samples of the current epoch left after this step;
* ``staying``: this replica will submit another real step (it is not closing, and its pool does
  not finish with this step).

After a global step, with totals ``E`` and ``S``:

* ``S == 0``: the group is done; nobody steps again (a closing or finished replica leaves).
* ``E > 0`` and this replica's share of the epoch is trained: it contributes empty shares, and
  holds back the next epoch's samples, until a step ends with ``E == 0``. So an epoch ends at
  one global step on every replica: **every replica takes the same number of optimizer steps in
  every epoch**, the number of the replica that needed most, and no step mixes two epochs.
* a replica that closes (or finished) contributes empty shares while ``S > 0``: its peers may
  still step, and they need it in every collective until they close too.

A replica that still trains in the epoch (``E`` counts it) submits real steps as its captures
fill them: the peers' empty shares wait for it. The slowest replica paces the group, as in any
synchronous data parallelism; waiting in the all-reduce computes nothing (the backward counts
as parked, so a host step never waits for it). Every replica must close eventually: one that
detaches keeps sending empty shares until its peers close too (within its close's timeout),
and a lost replica is outside this rule (its peers' next step fails after ``timeout_s``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from deltaserve.core.pool import PoolProgress


class Share(Enum):
    """What this replica may submit next."""

    NONE = "none"  # nothing: it waits for its own samples, or the group is done
    REAL = "real"  # its ready samples (once they fill a batch, as one replica's would)
    EMPTY = "empty"  # an empty share, now: a peer's step needs it


@dataclass(frozen=True)
class Votes:
    """One replica's votes on one global step (see the module's rule)."""

    epoch_open: bool
    staying: bool


class GroupSteps:
    """This replica's view of the group's agreement: the totals of the last global step, and
    whether its own share of the group's epoch is trained."""

    def __init__(self, world_size: int):
        # before the first step every replica counts as open and staying
        self.world_size = world_size
        self.epoch_open = world_size
        self.staying = world_size
        self.share_done = False  # this replica's share of the group's current epoch is trained

    @property
    def done(self) -> bool:
        """Nobody will step again: this replica may submit nothing more."""
        return self.staying == 0

    def holds_back(self) -> bool:
        """This replica's share of the epoch is trained and a peer's is not: its new samples
        (the next epoch's) wait, and it contributes empty shares."""
        return self.share_done and self.epoch_open > 0 and not self.done

    def share(self, has_ready: bool, leaving: bool) -> Share:
        """What this replica may submit next. ``has_ready``: it has captured samples waiting;
        ``leaving``: it is closing, or its pool is finished."""
        if self.done:
            return Share.NONE
        if self.holds_back():
            return Share.EMPTY
        if has_ready:
            return Share.REAL
        # the peers still step (a staying one will submit again): they need this replica
        return Share.EMPTY if leaving and self.staying > 0 else Share.NONE

    def votes(self, progress: PoolProgress, num_job_samples: int, closing: bool) -> Votes:
        """The votes of a step taking ``num_job_samples`` of this replica's samples (0: an
        empty share), given its pool's progress before the step commits."""
        left = progress.num_samples - progress.samples_committed - num_job_samples
        if progress.finished:
            left = 0  # a finished pool keeps its last epoch's samples, all committed
        last_epoch = progress.num_epochs is not None and progress.epoch >= progress.num_epochs - 1
        staying = not closing and not (last_epoch and left <= 0)
        # while holding back, the pool is already in the next epoch: its samples are not the
        # group's current epoch's
        return Votes(staying and left > 0 and not self.share_done, staying)

    def observe(self, votes: Votes, epoch_open: int, staying: int) -> None:
        """A global step ended with these totals; ``votes``: this replica's in it."""
        self.epoch_open, self.staying = epoch_open, staying
        if not votes.epoch_open:
            self.share_done = True
        if epoch_open == 0:  # the epoch ended on every replica at this step
            self.share_done = False
