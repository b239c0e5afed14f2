"""SGLang's scheduler and model runner in the caller's process, stepped one batch at a time.

``sglang.Engine`` always spawns its scheduler (and, with it, the model runner) in a child
process and talks to it over ZMQ; the HTTP server does the same. A co-server must share a
process with the scheduler and the model runner (it plans in the scheduler, captures inside the
forward, publishes into the LoRA pool), so either DeltaServe lives in that child (the plugin's
``REPLACE`` of ``Scheduler``: ``deltaserve serve --engine sglang``), or the scheduler is built
here. :class:`InProcessRuntime` does what SGLang's ``run_scheduler_process`` does, minus the
process-level parts (no SIGQUIT handler, which would kill the caller's process tree on a
scheduler error; no parent-death signal; no process title), and runs one iteration of SGLang's
``event_loop_normal`` per :meth:`~InProcessRuntime.step`.

The scheduler's outputs still go to its detokenizer socket, which this class binds and reads
(``BatchTokenIDOutput``: new token ids and finish reasons per request), after every step until
every message the scheduler's streamer sent has arrived. SGLang's parallel
runtime is process-global: one runtime lives at a time, and :meth:`~InProcessRuntime.close`
tears it down with SGLang's own ``cleanup_dist_env_and_memory`` so the next can start.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import zmq
from sglang.srt.distributed.parallel_state import cleanup_dist_env_and_memory
from sglang.srt.managers.io_struct import sock_recv
from sglang.srt.plugins import load_plugins
from sglang.srt.runtime_context import SpawnRanks, publish, spawn_world_rank
from sglang.srt.server_args import PortArgs
from sglang.srt.utils.network import get_zmq_socket

from deltaserve.hosts.sglang.scheduler import CoServingScheduler
from deltaserve.hosts.sglang.version import import_sglang

logger = logging.getLogger("deltaserve.sglang")

# how long a step's outputs may take from SGLang's socket to this process's end (microseconds
# on one machine; past this bound the host goes on and warns)
DELIVERY_TIMEOUT_S = 1.0
_live: list[InProcessRuntime] = []  # at most one: SGLang's parallel runtime is per process


@dataclass(frozen=True)
class Output:
    """New token ids of one request, and SGLang's finish reason once it finished."""

    rid: str
    new_token_ids: list[int]
    finish_reason: dict | None


class InProcessRuntime:
    def __init__(self, server_args: Any):
        import_sglang()  # marks this process as driven by DeltaServe: the plugin acts
        if _live:
            raise RuntimeError("one SGLang host per process: close the running one first "
                               "(SGLang's parallel runtime is process-global)")
        load_plugins()  # the pin_memory shim, as in every SGLang process
        server_args.resolve_once()
        server_args.check_server_args()
        port_args = PortArgs.init_new(server_args)
        publish(server_args, role="scheduler", ranks=SpawnRanks(
            world_rank=spawn_world_rank(server_args, tp_rank=0, pp_rank=0), dp_rank=None,
            gpu_id=0))
        self._zmq = zmq.Context(1)
        self._outputs = get_zmq_socket(self._zmq, zmq.PULL, port_args.detokenizer_ipc_name,
                                       True)
        self.scheduler = CoServingScheduler(server_args, port_args)
        # messages read from the detokenizer socket. In this process only the streamer sends on
        # it (SGLang's control requests come from its tokenizer manager, absent here), so this
        # pairs with the streamer's count of messages sent.
        self._num_received = 0
        _live.append(self)

    def step(self) -> bool:
        return self.scheduler.deltaserve_step()

    def has_unfinished(self) -> bool:
        return self.scheduler.deltaserve_has_unfinished()

    def drain(self, wait_s: float = 0.0) -> list[Output]:
        """Every output message SGLang sent since the last call. Blocks until every message
        the scheduler's streamer has sent arrived, up to ``DELIVERY_TIMEOUT_S``: ZMQ hands
        messages over asynchronously, and reading without waiting found some steps' tokens
        only after the next step, the yield to the backward before it included, which broke
        TPOT objectives. With nothing due, waits up to ``wait_s`` for a first message."""
        out: list[Output] = []
        sent = self.scheduler.output_streamer.num_sent
        deadline = time.monotonic() + DELIVERY_TIMEOUT_S
        timeout_ms = int(wait_s * 1000)
        while True:
            due = self._num_received < sent
            if due:
                timeout_ms = max(0, int((deadline - time.monotonic()) * 1000))
            if not self._outputs.poll(timeout_ms):
                if due:
                    logger.warning("SGLang's outputs: %d message(s) sent did not arrive within "
                                   "%.1f s", sent - self._num_received, DELIVERY_TIMEOUT_S)
                    self._num_received = sent  # wait for none of them again
                return out
            msg = sock_recv(self._outputs, flags=zmq.NOBLOCK)
            self._num_received += 1
            for i, rid in enumerate(msg.rids or []):
                out.append(Output(rid, list(msg.output_ids[i]), msg.finished_reasons[i]))
            timeout_ms = 0

    def close(self) -> None:
        """Remove DeltaServe's hooks, close the sockets and tear SGLang's runtime down."""
        if self not in _live:
            return
        self.scheduler.deltaserve_hooks.remove()
        self._outputs.close(linger=0)
        self._zmq.term()
        _live.remove(self)
        cleanup_dist_env_and_memory()

