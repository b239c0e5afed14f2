"""One co-serving system's configuration, for both benches: a :class:`SystemSpec` and what the
bench gives every system (:class:`BenchTraining`) become one :class:`CoServeConfig`. The CPU
bench (:mod:`deltaserve.bench.execute`) and the simulated bench
(:mod:`deltaserve.bench.sim.run`) each build a ``BenchTraining`` from their own config and call
:func:`coserve_config`; nothing else turns a spec into a co-server's configuration.

The pipelined systems' activation buffer (:func:`pipelined_buffer_tokens`). Buffer rows are
reserved when a sample is admitted (:class:`~deltaserve.core.buffer_ledger.BufferLedger`) and
freed only when its optimizer step commits (:class:`~deltaserve.train.samples.SampleBook`).
Under Algorithm 1 nothing is admitted while the backward runs, so one batch at a time is live and
the co-server's default (``BackwardConfig.buffer_tokens`` None: one batch plus the longest sample)
holds it. A pipelined system admits the next batch while the backward reads this one
(``admit_during_backward``), so two batches are live at once: the one the backward reads (its
rows stay held until it commits) and the one being filled. Each ends past ``batch_tokens`` by
less than its last sample (admission starts a sample only while the batch is short), and a
sample is at most one host step's tokens (``max_num_batched_tokens``;
:func:`~deltaserve.train.samples.buffer_capacity` refuses a longer one). Two live batches thus
take at most ``2 * (batch_tokens + longest - 1)`` rows. The ledger is first-fit and gives each
step's samples one contiguous run, so when a committed batch frees its rows the free space lies
on both sides of the batch being filled; a step whose samples do not fit the largest free run
admits fewer (``Skip.BUFFER_FULL``) and leaves its slack unspent. The pipelined buffer is
``3 * batch_tokens + max_num_batched_tokens``: the two live batches and, beside them, a third batch
and one full step of room against that fragmentation. It holds two live batches outright
whenever the longest sample is at most half a batch plus half a step (always when a batch is at
least one step, as on the CPU bench; on the simulated GPU, with its 1,024-token steps, samples
up to 640 tokens). It is headroom, not a bound the code relies on: a shorter buffer costs
fine-tuning throughput (steps that admit less), never correctness (rows are reserved, or the
sample is not admitted). ``--backward-buffer-tokens`` overrides it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from deltaserve.bench.systems import SystemSpec
from deltaserve.core.admission import AdmissionConfig
from deltaserve.core.slo import SLOConfig
from deltaserve.model.lora import LoRAConfig
from deltaserve.train.checkpoint_store import CheckpointConfig
from deltaserve.train.config import BackwardConfig, CoServeConfig, GrantPolicy
from deltaserve.train.optim import OptimizerConfig

# batches a pipelined system's buffer holds: the one the backward reads, the one being filled,
# and one of room against the first-fit ledger's fragmentation (see the module's docstring)
PIPELINE_BUFFER_BATCHES = 3
# host steps of room beside them: the most one step may admit, placed as one contiguous run
PIPELINE_BUFFER_STEPS = 1


def pipelined_buffer_tokens(batch_tokens: int, max_step_tokens: int) -> int:
    """Activation-buffer rows of a system that admits while the backward runs."""
    return PIPELINE_BUFFER_BATCHES * batch_tokens + PIPELINE_BUFFER_STEPS * max_step_tokens


def system_grant(spec: SystemSpec, bench_grant: GrantPolicy, host_grant: GrantPolicy
                 ) -> GrantPolicy:
    """How ``spec``'s backward shares the device: the bench's ``--backward-grant-policy``
    where given (every system then runs under it), else the system's own
    (:attr:`SystemSpec.grant`), else the host's (``host_grant``; ``auto`` leaves it to the
    co-server, which resolves it for the device)."""
    if bench_grant is not GrantPolicy.AUTO:
        return bench_grant
    return host_grant if spec.grant is GrantPolicy.AUTO else spec.grant


@dataclass(frozen=True)
class BenchTraining:
    """What a bench gives every co-serving system. ``max_step_tokens``: the host's
    ``max_num_batched_tokens``. ``pipeline``: every system admits while the backward runs (the
    CPU bench's ``--pipeline``; a pipelined spec does so regardless). ``host_grant``: the
    host's grant when neither the bench nor the system names one. ``checkpoint``: where the
    co-server writes (the CPU bench: a folder per run; the simulated trainer writes none)."""

    slo: SLOConfig
    lora: LoRAConfig
    optimizer: OptimizerConfig
    backward: BackwardConfig
    max_step_tokens: int
    seed: int
    pipeline: bool = False
    host_grant: GrantPolicy = GrantPolicy.AUTO
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


def coserve_config(spec: SystemSpec, training: BenchTraining) -> CoServeConfig:
    """``spec``'s co-server: its admission mode and interruption, its grant
    (:func:`system_grant`), a pipelined buffer where it admits while the backward runs, and
    the bench's LoRA, optimizer and seed; it trains until the bench stops it."""
    b = training.backward
    pipeline = training.pipeline or spec.pipeline
    buffer = b.buffer_tokens or (pipelined_buffer_tokens(b.batch_tokens,
                                                         training.max_step_tokens)
                                 if pipeline else None)
    grant = system_grant(spec, b.grant_policy, training.host_grant)
    return CoServeConfig(
        slo=training.slo, admission=AdmissionConfig(mode=spec.mode,
                                                    admit_during_backward=pipeline),
        lora=training.lora, optimizer=training.optimizer,
        backward=replace(b, buffer_tokens=buffer, grant_policy=grant),
        checkpoint=training.checkpoint, interrupt=spec.interrupt, num_epochs=None,
        seed=training.seed)
