"""``InProcessEngine``: SGLang's scheduler and model runner in the caller's process, one step at a
time.

``sglang.Engine`` always spawns its scheduler (and, with it, the model runner) in a child
process (``Engine._launch_scheduler_processes``) and talks to it over ZMQ; the HTTP server does
the same. A co-server must share a process with the scheduler and the model runner (it plans in
``run_batch``, captures inside the forward, publishes into the LoRA pool), so DeltaServe either
lives in that child (the plugin's ``REPLACE`` of ``Scheduler``) or builds the scheduler here, as
this class does. It does what ``run_scheduler_process`` does in SGLang's child, minus the
process-level parts (no SIGQUIT handler, no parent-death signal, no process title), and runs
one iteration of SGLang's ``event_loop_normal`` per :meth:`step`, so the caller drives it like
the vLLM host drives ``llm_engine.step()``.

Client requests enter as ``TokenizedGenerateReqInput`` through ``Scheduler.handle_generate_request``
(the tokenizer manager's path, without its process); the scheduler's outputs still go to its
detokenizer socket, which this class binds and reads (``BatchTokenIDOutput``: token ids, finish
reasons). There is no detokenizer process: callers tokenize and detokenize themselves.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from deltaserve.core.errors import require
from deltaserve.hosts.sglang.version import import_sglang

# Bound on how long step() waits for the scheduler's output message of a finished request
# (ZMQ delivers it asynchronously, within microseconds on one machine).
_OUTPUT_WAIT_S = 2.0


@dataclass(frozen=True)
class EngineConfig:
    """The SGLang server arguments DeltaServe's CPU runs use. ``lora_paths``: (name, PEFT dir)
    pairs loaded at start-up (and pinned: never evicted from their pool slot)."""

    model_path: str
    dtype: str = "float32"
    device: str = "cpu"
    attention_backend: str = "torch_native"
    max_total_tokens: int = 8192
    # the share of *available* memory SGLang may plan with; on a shared CPU machine other
    # processes move that number, and 0.05 can leave "no memory for the KV cache"
    mem_fraction_static: float = 0.5
    chunked_prefill_size: int = 4096
    lora_paths: tuple[tuple[str, str], ...] = ()
    max_lora_rank: int = 16
    max_loras_per_batch: int = 4
    lora_target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    log_level: str = "warning"

    def __post_init__(self) -> None:
        require(0 < self.mem_fraction_static <= 1, "mem_fraction_static",
                self.mem_fraction_static, "must be in (0, 1]")
        require(self.max_total_tokens > 0, "max_total_tokens", self.max_total_tokens, "> 0")

    def server_args(self) -> Any:
        from sglang.srt.server_args import ServerArgs

        lora: dict[str, Any] = {}
        if self.lora_paths:
            lora = dict(enable_lora=True, lora_backend="torch_native",
                        max_lora_rank=self.max_lora_rank,
                        max_loras_per_batch=self.max_loras_per_batch,
                        lora_target_modules=list(self.lora_target_modules),
                        lora_paths=[dict(lora_name=n, lora_path=p, pinned=True)
                                    for n, p in self.lora_paths])
        return ServerArgs(model_path=self.model_path, dtype=self.dtype, device=self.device,
                          attention_backend=self.attention_backend,
                          disable_overlap_schedule=True, skip_tokenizer_init=True,
                          mem_fraction_static=self.mem_fraction_static,
                          max_total_tokens=self.max_total_tokens,
                          chunked_prefill_size=self.chunked_prefill_size,
                          log_level=self.log_level, **lora)


@dataclass
class Finished:
    """A client request's result: its generated token ids and SGLang's finish reason."""

    request_id: str
    token_ids: list[int]
    finish_reason: dict | None


@dataclass
class _Outputs:
    finished: dict[str, Finished] = field(default_factory=dict)


class InProcessEngine:
    """See the module docstring. One engine per process (SGLang's runtime context is global)."""

    def __init__(self, config: EngineConfig):
        import zmq

        import_sglang()
        from sglang.srt.plugins import load_plugins
        from sglang.srt.runtime_context import SpawnRanks, publish, spawn_world_rank
        from sglang.srt.server_args import PortArgs
        from sglang.srt.utils.network import get_zmq_socket

        from deltaserve.hosts.sglang.scheduler import CoServingScheduler

        self.config = config
        args = config.server_args()
        load_plugins()  # the pin_memory shim, as in every SGLang process
        args.resolve_once()
        args.check_server_args()
        self.port_args = PortArgs.init_new(args)
        publish(args, role="scheduler", ranks=SpawnRanks(
            world_rank=spawn_world_rank(args, tp_rank=0, pp_rank=0), dp_rank=None, gpu_id=0))
        self._zmq = zmq.Context(1)
        # skip_tokenizer_init: the scheduler sends its outputs to the tokenizer's socket
        self._outputs_socket = get_zmq_socket(self._zmq, zmq.PULL,
                                              self.port_args.tokenizer_ipc_name, True)
        self.scheduler = CoServingScheduler(args, self.port_args)
        self._out = _Outputs()
        self._clients: set[str] = set()  # client requests added and not yet returned
        # called with the id of every request in every output message SGLang sends towards
        # clients (the point where a server would stream tokens)
        self.on_output: Callable[[str], None] | None = None
        self._ids = 0

    # ---- SGLang's objects -------------------------------------------------------------------
    @property
    def model_runner(self) -> Any:
        return self.scheduler.tp_worker.model_runner

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, token_ids: Sequence[int], *, max_new_tokens: int,
                    lora_name: str | None = None, request_id: str | None = None) -> str:
        """Queue a greedy client request; returns its id."""
        from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
        from sglang.srt.sampling.sampling_params import SamplingParams

        require(len(token_ids) > 0, "token_ids", list(token_ids), "at least one token")
        require(max_new_tokens > 0, "max_new_tokens", max_new_tokens, "> 0")
        if request_id is None:
            self._ids += 1
            request_id = f"client-{self._ids}"
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
        params.normalize(None)
        params.verify(self.scheduler.model_config.vocab_size)
        lora_id = self.scheduler.deltaserve_lora_id(lora_name) if lora_name else None
        self.scheduler.handle_generate_request(TokenizedGenerateReqInput(
            rid=request_id, input_text=None, input_ids=array("q", token_ids),
            input_embeds=None, mm_inputs=None, token_type_ids=None, sampling_params=params,
            return_logprob=False, logprob_start_len=-1, top_logprobs_num=0,
            token_ids_logprob=None, stream=False, lora_id=lora_id))
        self._clients.add(request_id)
        return request_id

    # ---- the loop ---------------------------------------------------------------------------
    def step(self) -> bool:
        """One iteration of SGLang's normal event loop (without receiving from sockets: requests
        were handed over by :meth:`add_request`). Returns whether a batch ran."""
        s = self.scheduler
        plan = s.get_next_batch_to_run(running_batch=s.running_batch, last_batch=s.last_batch)
        s.running_batch = plan.running_batch
        batch = plan.batch_to_run
        if batch:
            result = s.run_batch(batch)
            s.process_batch_result(batch, result)
        else:
            s.on_idle()
        s.last_batch = batch
        self._drain(0.0)
        return bool(batch)

    def has_unfinished(self) -> bool:
        s = self.scheduler
        # a prefill batch joins running_batch only at the next get_next_batch_to_run
        last = s.last_batch
        return bool(s.waiting_queue) or not s.running_batch.is_empty() or (
            last is not None and any(not r.finished() for r in last.reqs))

    def run_until_idle(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.has_unfinished():
                break
            self.step()
        deadline = time.monotonic() + _OUTPUT_WAIT_S
        while self._clients - set(self._out.finished) and time.monotonic() < deadline:
            self._drain(0.05)
        self._drain(0.0)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 lora_name: str | None = None) -> list[list[int]]:
        """Greedy completions of ``prompts`` (token ids), all batched together."""
        ids = [self.add_request(p, max_new_tokens=max_new_tokens, lora_name=lora_name)
               for p in prompts]
        self.run_until_idle()
        return [self.take(r) for r in ids]

    def take(self, request_id: str) -> list[int]:
        """The generated token ids of finished client request ``request_id`` (waits up to
        :data:`_OUTPUT_WAIT_S` for SGLang's message)."""
        deadline = time.monotonic() + _OUTPUT_WAIT_S
        while request_id not in self._out.finished and time.monotonic() < deadline:
            self._drain(0.05)
        if request_id not in self._out.finished:
            raise RuntimeError(f"SGLang sent no finished output for {request_id!r}")
        self._clients.discard(request_id)
        return self._out.finished.pop(request_id).token_ids

    def _drain(self, wait_s: float) -> None:
        import zmq
        from sglang.srt.managers.io_struct import sock_recv

        deadline = time.monotonic() + wait_s
        while True:
            timeout_ms = max(0, int((deadline - time.monotonic()) * 1000))
            if not self._outputs_socket.poll(timeout_ms):
                return
            msg = sock_recv(self._outputs_socket, flags=zmq.NOBLOCK)
            for i, rid in enumerate(msg.rids or []):
                if self.on_output is not None:
                    self.on_output(rid)
                reason = msg.finished_reasons[i]
                if reason is not None:
                    self._out.finished[rid] = Finished(rid, list(msg.output_ids[i]), reason)
            wait_s = 0.0
            deadline = time.monotonic()

    def close(self) -> None:
        """Remove the hooks and close the sockets (the model stays until garbage-collected)."""
        self.scheduler.deltaserve_hooks.remove()
        self._outputs_socket.close(linger=0)
