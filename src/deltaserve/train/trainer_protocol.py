"""What the co-server's facade asks of its training half: the seam between the policy (admission,
the sample book, the grant around host steps) and whatever trains the captured samples.

:class:`deltaserve.train.trainer.Trainer` is the real one (adapter, activation buffer, backward
process, checkpoints); a simulated host supplies a timed stand-in on its simulated clock
(:mod:`deltaserve.hosts.sim.trainer`). The facade (:class:`deltaserve.train.facade.CoServer`)
depends on these Protocols only, so both run the same policy code.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from deltaserve.core.admission import AdmissionPlan
from deltaserve.core.contract import TrainingRows, TrainingStep
from deltaserve.core.shape import StepShape

if TYPE_CHECKING:
    from deltaserve.train.config import CoServeConfig
    from deltaserve.train.events import Listener
    from deltaserve.train.group_ledger import GroupLedger
    from deltaserve.train.samples import SampleBook


class CoTrainer(Protocol):
    """Captured samples to committed optimizer steps. ``config``: the co-server's config with
    the grant policy resolved for the device; ``counts``: the facade's and the trainer's
    counters (``aborted_steps``, ``steps_with_ft``, ``ft_tokens_forwarded``, failures)."""

    config: CoServeConfig
    counts: Counter[str]
    optimizer_steps: int
    last_loss: float | None
    backward_busy_s: float  # seconds the backward has computed (a production counter)
    ledger: GroupLedger | None  # data parallel: what the group's adapter holds (else None)

    @property
    def steps_lost(self) -> dict[str, int]:
        """Optimizer steps lost, by kind (empty where none can be lost)."""
        ...

    # the grant around host steps (see :class:`deltaserve.train.config.GrantPolicy`): the
    # co-server reaches the backward only through these
    @property
    def backward_busy(self) -> bool:
        """A backward job is in flight (its outcome not yet handled)."""
        ...

    @property
    def backward_exclusive(self) -> bool:
        """The backward computes only while the host waits (idle time and yields)."""
        ...

    @property
    def backward_layer_s(self) -> float:
        """The backward's time per layer: the grain at which it yields."""
        ...

    def before_step(self, shape: StepShape) -> None:
        """Take the machine back for a step that needs it."""
        ...

    def after_step(self) -> None: ...

    def release_backward(self) -> None:
        """The host runs nothing: the backward may use the whole machine."""
        ...

    def lend(self, seconds: float, wake: threading.Event) -> float:
        """Let the backward run for ``seconds`` or until ``wake``; the time given."""
        ...

    @property
    def has_pending(self) -> bool:
        """Samples captured or in the backward but not yet committed, or work owed (a
        validation)."""
        ...

    def step(self, plan: AdmissionPlan, rows: TrainingRows, abortable: bool,
             abort: threading.Event) -> TrainingStep:
        """The step object the host's forward calls (captures go wherever this trainer keeps
        activations)."""
        ...

    def poll(self, timeout_s: float = 0.0) -> None:
        """Handle backward outcomes (waiting up to ``timeout_s`` for one), then launch the
        next batch if it is due."""
        ...

    def maybe_launch(self, force: bool = False) -> None: ...

    def subscribe(self, listener: Listener) -> None: ...

    def drain(self, timeout_s: float) -> None:
        """Train every captured sample now and wait for it."""
        ...

    def close(self, *, drain: bool, checkpoint: bool, timeout_s: float) -> None: ...


# Builds the training half once the facade has its sample book.
TrainerFactory = Callable[["CoServeConfig", "SampleBook"], CoTrainer]


class BackwardGrant(Protocol):
    """The grant side of a backward, real (:class:`~deltaserve.train.backward.driver.
    BackwardDriver`) or simulated (:class:`~deltaserve.hosts.sim.trainer.SimBackward`)."""

    @property
    def busy(self) -> bool: ...

    @property
    def exclusive(self) -> bool: ...

    @property
    def layer_s(self) -> float: ...

    def before_step(self, shape: StepShape) -> None: ...

    def after_step(self) -> None: ...

    def release(self) -> None: ...

    def lend(self, seconds: float, wake: threading.Event) -> float: ...


class GrantDelegation:
    """The grant around host steps, the co-server's only way to the backward: a trainer's
    :class:`CoTrainer` grant methods forwarded to its ``backward`` (one copy for the real and
    the simulated trainer)."""

    backward: BackwardGrant

    @property
    def backward_busy(self) -> bool:
        """A backward job is in flight (its outcome not yet handled)."""
        return self.backward.busy

    @property
    def backward_exclusive(self) -> bool:
        """The backward computes only while the host waits (idle time and yields)."""
        return self.backward.exclusive

    @property
    def backward_layer_s(self) -> float:
        """The backward's time per layer: the grain at which it yields."""
        return self.backward.layer_s

    def before_step(self, shape: StepShape) -> None:
        self.backward.before_step(shape)

    def after_step(self) -> None:
        self.backward.after_step()

    def release_backward(self) -> None:
        self.backward.release()

    def lend(self, seconds: float, wake: threading.Event) -> float:
        return self.backward.lend(seconds, wake)
