"""``CoServingScheduler``: SGLang's ``Scheduler`` with DeltaServe's pieces inside it.

SGLang runs its scheduler and model runner in one process (the scheduler calls its TP worker's
model runner directly when the overlap schedule is off), so the co-server will live there too:

* in the caller's process with :class:`~deltaserve.hosts.sglang.engine.InProcessEngine`;
* in the scheduler process SGLang spawns (``sglang.Engine``, ``sglang serve``), where DeltaServe's
  plugin replaces SGLang's ``Scheduler`` with this class (``HookRegistry`` ``REPLACE``).

What it adds, each through an override of a ``Scheduler`` method or SGLang's factory methods:

* hidden requests (:mod:`.hidden`): ``get_output_streamer_class`` returns a streamer that never
  sends them to the detokenizer;
* forward hooks on the model runner's model (:mod:`.hooks`): every forward timed, the training
  rows' layer inputs captured, training-only steps interruptible;
* ``run_batch``: arms the hooks with the rows of the training requests in the batch and records
  each step's :class:`~deltaserve.hosts.sglang.records.StepTiming`.

Supports the normal (non-overlapped) event loop only: with the overlap schedule the next batch
is prepared while the previous forward runs, and a step could not be observed before the next is
planned.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import sglang
from sglang.srt.managers.scheduler import Scheduler

from deltaserve.core.errors import InputError
from deltaserve.hosts.sglang.hidden import HiddenRequests, streamer_class
from deltaserve.hosts.sglang.hooks import ForwardHooks, row_index
from deltaserve.hosts.sglang.publish import AdapterPublisher
from deltaserve.hosts.sglang.records import Capture, StepTiming, TrainingRows
from deltaserve.hosts.sglang.version import check_version

logger = logging.getLogger("deltaserve.sglang")


class CoServingScheduler(Scheduler):
    def __init__(self, *args: Any, **kwargs: Any):
        check_version(str(sglang.__version__))
        # needed while Scheduler.__init__ builds its output streamer
        self.deltaserve_hidden = HiddenRequests(self)
        super().__init__(*args, **kwargs)
        if self.enable_overlap:
            raise InputError("disable_overlap_schedule", False, "DeltaServe observes each step "
                             "before the next is planned; pass disable_overlap_schedule=True")
        runner = self.tp_worker.model_runner
        self.deltaserve_hooks = ForwardHooks(runner.model,
                                             synchronize=runner.device.startswith("cuda"))
        self.deltaserve_hooks.install()
        self.deltaserve_pending: TrainingRows | None = None
        self.deltaserve_last_step: StepTiming | None = None
        self.deltaserve_on_step: Callable[[StepTiming], None] | None = None
        logger.info("DeltaServe: SGLang runs DeltaServe's scheduler in pid %d (%d decoder "
                    "layers hooked)", os.getpid(), self.deltaserve_hooks.num_layers)

    def get_output_streamer_class(self) -> type:
        return streamer_class(self.deltaserve_hidden)

    # ---- training requests ------------------------------------------------------------------
    def deltaserve_lora_id(self, lora_name: str) -> str:
        """SGLang's internal id of the loaded adapter ``lora_name`` (hidden requests name their
        adapter by it, as the tokenizer manager does for clients)."""
        manager = self.tp_worker.model_runner.lora_manager
        if manager is None:
            raise InputError("enable_lora", False, "the training adapter needs --enable-lora")
        for lora_id, ref in manager.lora_refs.items():
            if ref.lora_name == lora_name:
                return lora_id
        raise InputError("lora_name", lora_name, "no such adapter is loaded in SGLang")

    def deltaserve_add_training(self, samples: Sequence[Sequence[int]], lora_id: str,
                                capture: Capture, *, should_abort: Callable[[], bool] | None = None
                                ) -> TrainingRows:
        """Queue each sample as a hidden prefill-only request on ``lora_id``; their rows are
        captured in the forward that runs them (all whole in that forward, else the returned
        rows are marked invalid and nothing is captured)."""
        ids = tuple(self.deltaserve_hidden.add(s, lora_id=lora_id) for s in samples)
        rows = TrainingRows(ids, tuple(len(s) for s in samples), capture, should_abort)
        self.deltaserve_pending = rows
        return rows

    def deltaserve_publisher(self, lora_name: str) -> AdapterPublisher:
        """The publisher into the slot of the loaded adapter ``lora_name`` (load it pinned)."""
        return AdapterPublisher(self.tp_worker.model_runner.lora_manager,
                                self.deltaserve_lora_id(lora_name))

    # ---- one step ---------------------------------------------------------------------------
    def run_batch(self, batch: Any, *args: Any, **kwargs: Any) -> Any:
        rows, index = self._rows_in(batch)
        hooks = self.deltaserve_hooks
        hooks.arm(rows, index)
        t0 = time.perf_counter()
        result = super().run_batch(batch, *args, **kwargs)
        seconds = time.perf_counter() - t0
        fwd = hooks.take()
        num_tokens = (batch.extend_num_tokens or 0) if batch.forward_mode.is_extend() \
            else len(batch.reqs)
        step = StepTiming(seconds, batch.forward_mode.name, num_tokens, fwd)
        self.deltaserve_last_step = step
        if self.deltaserve_on_step is not None:
            self.deltaserve_on_step(step)
        return result

    def _rows_in(self, batch: Any) -> tuple[TrainingRows | None, Any]:
        """The pending training rows if this batch holds any of their requests."""
        rows = self.deltaserve_pending
        if rows is None:
            return None, None
        rids = [r.rid for r in batch.reqs]
        if not set(rows.req_ids) & set(rids):
            return None, None
        self.deltaserve_pending = None
        rows.abortable = not any(r not in self.deltaserve_hidden for r in rids)
        lens = list(batch.extend_lens) if batch.forward_mode.is_extend() else [1] * len(rids)
        index = row_index(rids, lens, rows, self.tp_worker.model_runner.device)
        return rows, index
