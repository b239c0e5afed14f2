"""Worker-side hooks on vLLM's model: time every forward, capture the training rows' input of
every decoder layer, and cut a training-only step short at a layer boundary.

Row layout: vLLM flattens a step's tokens request by request in ``input_batch.req_ids`` order
(not ``SchedulerOutput`` order); request ``i`` owns rows
``query_start_loc[i]:query_start_loc[i+1]``.
The training rows are gathered in the plan's sample order, so the co-server receives them as the
one contiguous run of the buffer it reserved.

Residual input: vLLM's ``LlamaDecoderLayer`` takes ``(positions, hidden_states, residual)`` and
its residual stream is ``hidden_states + residual`` (layer 0: the embeddings, ``residual`` None).
The first op of the layer may update both in place (fused add-RMSNorm), so the sum is formed in
the pre-hook, before the layer runs.

Two capture paths:

* ``hooks`` (eager execution: always on CPU with LoRA, and with ``enforce_eager`` on GPU): a
  forward pre-hook per decoder layer.
* ``aux``: vLLM's EAGLE-3 auxiliary hidden-state outputs, which are outputs of the compiled
  graph, so they survive ``torch.compile``. vLLM traces its model once at start-up, so under
  compilation they must be requested when the model is built (:mod:`aux_model`); in eager mode
  they can be switched on here. A hook on
  the top-level model reads them after the forward. This path cannot interrupt a step.

Interrupting: raising inside vLLM's forward would kill the engine, and a forward hook cannot skip
a module. With ``interrupt`` on, each decoder layer's ``forward`` is wrapped (on the module
instance; no vLLM code changes) by a check of one flag: once the co-server asks a training-only
step to stop, the remaining layers pass their input through untouched. Only hidden requests are
in such a step, and their one sampled token is discarded, so nothing a client sees changes; the
step ends after the layers already run plus vLLM's logits and sampling for those rows.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from deltaserve.core.shape import ExecMode
from deltaserve.hosts.vllm.registry import EngineLink, ForwardRecord, TrainingRows


def decoder_layers(model: Any) -> list[Any]:
    """The decoder layers of a vLLM Llama-family model (``model.model.layers``)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__}: no model.layers; DeltaServe's vLLM host "
                        "supports Llama-family decoders")
    return list(layers)


def _runtime_mode() -> ExecMode:
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return ExecMode.EAGER
    mode = get_forward_context().cudagraph_runtime_mode
    return ExecMode.GRAPH if mode else ExecMode.EAGER  # CUDAGraphMode.NONE is falsy


class ForwardHooks:
    """The hook set on one model runner. ``capture``: ``hooks``, ``aux`` or ``auto`` (``aux``
    when vLLM compiled the model)."""

    def __init__(self, runner: Any, link: EngineLink, *, capture: str = "auto",
                 interrupt: bool = True):
        from vllm.config import CompilationMode

        if capture not in ("auto", "hooks", "aux"):
            raise ValueError(f"capture={capture!r}: expected auto, hooks or aux")
        self.runner = runner
        self.link = link
        self.model = runner.model
        self.layers = decoder_layers(self.model)
        compiled = runner.vllm_config.compilation_config.mode != CompilationMode.NONE
        self.path = capture if capture != "auto" else ("aux" if compiled else "hooks")
        # the model class of aux_model requests the aux outputs itself, at build time
        self._builtin_aux = hasattr(self.model, "deltaserve_aux")
        if self.path == "aux" and compiled and not self._builtin_aux:
            raise RuntimeError(
                "vLLM compiled the model without DeltaServe's auxiliary hidden-state outputs: "
                "start it with VLLMHostConfig(capture='aux') (engine_kwargs then selects "
                "aux_model.ARCHITECTURE), or with enforce_eager=True")
        if self.path == "hooks" and compiled:
            raise RuntimeError("decoder-layer hooks do not run inside a compiled model: use "
                               "capture='aux' or enforce_eager=True")
        self.interrupt = interrupt and self.path == "hooks"
        self._cuda = runner.device.type == "cuda"
        self._handles: list[Any] = []
        self._wrapped: list[Any] = []
        self._rows: TrainingRows | None = None
        self._index: torch.Tensor | None = None
        self._bypass = False
        self._layers_run = len(self.layers)
        self._mode = ExecMode.EAGER
        self._t0 = 0.0

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    # ---- install / remove -------------------------------------------------------------------
    def install(self) -> None:
        m = self.model
        self._handles.append(m.register_forward_pre_hook(self._pre_model, with_kwargs=True))
        self._handles.append(m.register_forward_hook(self._post_model, with_kwargs=True))
        if self.path == "aux":
            if not self._builtin_aux:  # eager: the model's next forwards emit them
                m.set_aux_hidden_state_layers(tuple(range(self.num_layers)))
        else:
            for i, layer in enumerate(self.layers):
                self._handles.append(layer.register_forward_pre_hook(self._layer_hook(i)))
        if self.interrupt:
            for layer in self.layers:
                layer.forward = self._bypassable(layer.forward)
                self._wrapped.append(layer)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for layer in self._wrapped:
            del layer.forward  # back to the class's forward
        self._wrapped.clear()
        if self.path == "aux" and not self._builtin_aux:
            self.model.set_aux_hidden_state_layers(())

    def _bypassable(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        def layer_forward(positions, hidden_states, residual, *args, **kwargs):
            if self._bypass:  # an interrupted training-only step: pass the stream through
                if residual is None:
                    residual = torch.zeros_like(hidden_states)
                return hidden_states, residual
            return forward(positions, hidden_states, residual, *args, **kwargs)

        return layer_forward

    # ---- per forward ------------------------------------------------------------------------
    def _pre_model(self, module: Any, args: Any, kwargs: Any) -> None:
        if self._cuda:
            torch.cuda.synchronize()
        self._t0 = time.perf_counter()
        self._bypass = False
        self._layers_run = self.num_layers
        self._mode = _runtime_mode()
        rows = self.link.rows
        self._rows = rows if rows is not None and rows.valid else None
        self._index = self._row_index(self._rows) if self._rows is not None else None
        if self._index is None:
            self._rows = None

    def _row_index(self, rows: TrainingRows) -> torch.Tensor | None:
        """Row numbers of the training requests in this forward, in plan order; None (and the
        step marked invalid) if any request is not in the batch whole."""
        batch = self.runner.input_batch
        n = batch.num_reqs
        where = {rid: i for i, rid in enumerate(batch.req_ids[:n])}
        qsl = self.runner.query_start_loc.np[: n + 1]
        index: list[int] = []
        for rid, length in zip(rows.req_ids, rows.lengths, strict=True):
            i = where.get(rid)
            if i is None or int(qsl[i + 1] - qsl[i]) != length:
                rows.valid = False
                return None
            index.extend(range(int(qsl[i]), int(qsl[i + 1])))
        return torch.tensor(index, dtype=torch.long, device=self.runner.device)

    def _layer_hook(self, i: int) -> Callable[[Any, Any], None]:
        def hook(module: Any, args: Any) -> None:
            rows = self._rows
            if rows is None or self._bypass:
                return
            if self.interrupt and rows.abortable and rows.should_abort is not None \
                    and rows.should_abort():
                self._bypass = True
                self._layers_run = rows.aborted_at = i
                return
            hidden, residual = args[1], args[2]
            x = hidden.index_select(0, self._index)
            if residual is not None:
                x = x + residual.index_select(0, self._index)
            rows.capture(i, x)

        return hook

    def _post_model(self, module: Any, args: Any, kwargs: Any, output: Any) -> Any:
        replaced = aux = None
        if self.path == "aux":
            if isinstance(output, tuple):  # eager, aux switched on after start-up
                replaced, aux = output
            elif self._builtin_aux:
                aux, module.deltaserve_aux = module.deltaserve_aux, None
            if self._rows is not None:
                if aux is None or len(aux) != self.num_layers:
                    self._rows.valid = False  # nothing to capture from: the step gives back
                else:
                    for i, stream in enumerate(aux):
                        self._rows.capture(i, stream.index_select(0, self._index))
        if self._cuda:
            torch.cuda.synchronize()
        out = replaced if replaced is not None else output
        self.link.forwards += 1
        self.link.last_forward = ForwardRecord(
            time.perf_counter() - self._t0, self._mode, int(out.shape[0]), self._layers_run,
            self._bypass)
        self._rows = None
        self._index = None
        self._bypass = False
        return replaced
