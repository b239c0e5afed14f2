"""Worker-side hooks on vLLM's model: time every forward, capture the training rows' input of
every decoder layer, and cut a training-only step short at a layer boundary.

Row layout: vLLM flattens a step's tokens request by request in ``input_batch.req_ids`` order
(not ``SchedulerOutput`` order); request ``i`` owns rows
``query_start_loc[i]:query_start_loc[i+1]``.
The training rows are gathered in ``step.rows`` order, the order the contract asks of
``TrainingStep.capture``.

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

Interrupting (``hooks`` path): raising inside vLLM's forward would kill the engine, and a forward
hook cannot skip a module, so each decoder layer's ``forward`` is wrapped (on the module
instance; no vLLM code changes) by a check of one flag: once ``step.should_abort()`` says stop
at a layer boundary, the remaining layers pass their input through untouched. Only hidden
requests are in such a step, and their one sampled token is discarded, so nothing a client sees
changes; the step ends after the layers already run plus vLLM's logits and sampling for those
rows.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle
from vllm.config import CompilationMode
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from deltaserve.core.shape import ExecMode
from deltaserve.hosts.vllm.config import CAPTURE_PATHS, TRAINING_LORA_PATHS
from deltaserve.hosts.vllm.direct_lora import DirectLoRA
from deltaserve.hosts.vllm.link import EngineLink, ForwardRecord, RowLayout

LayerForward = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a vLLM Llama-family model (``model.model.layers``)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__}: no model.layers; DeltaServe's vLLM host "
                        "supports Llama-family decoders")
    return list(layers)


def _runtime_mode() -> ExecMode:
    if not is_forward_context_available():
        return ExecMode.EAGER
    mode = get_forward_context().cudagraph_runtime_mode
    return ExecMode.GRAPH if mode else ExecMode.EAGER  # CUDAGraphMode.NONE is falsy


def capture_path(runner: GPUModelRunner, capture: str) -> str:
    """The path ``capture`` resolves to on this model (``auto``: ``aux`` when vLLM compiled
    it); raises where the asked-for path cannot work."""
    if capture not in CAPTURE_PATHS:
        raise ValueError(f"capture={capture!r}: expected one of {CAPTURE_PATHS}")
    compiled = runner.vllm_config.compilation_config.mode != CompilationMode.NONE
    path = capture if capture != "auto" else ("aux" if compiled else "hooks")
    if path == "aux" and compiled and not hasattr(runner.model, "deltaserve_aux"):
        raise RuntimeError(
            "vLLM compiled the model without DeltaServe's auxiliary hidden-state outputs: "
            "start it with VLLMHostConfig(capture='aux') (engine_kwargs then selects "
            "aux_model's architecture), or with enforce_eager=True")
    if path == "hooks" and compiled:
        raise RuntimeError("decoder-layer hooks do not run inside a compiled model: use "
                           "capture='aux' or enforce_eager=True")
    return path


def training_lora_path(runner: GPUModelRunner, capture_path: str, training_lora: str) -> str:
    """Who applies the training adapter to the training rows (:mod:`.direct_lora`): ``direct``
    where the layer hooks run on one tensor-parallel rank (``auto`` picks it there), else
    ``vllm``; raises where ``direct`` is asked for and cannot run."""
    if training_lora not in TRAINING_LORA_PATHS:
        raise ValueError(f"training_lora={training_lora!r}: expected one of "
                         f"{TRAINING_LORA_PATHS}")
    one_rank = runner.vllm_config.parallel_config.tensor_parallel_size == 1
    possible = capture_path == "hooks" and one_rank and \
        getattr(runner, "lora_manager", None) is not None
    if training_lora == "direct" and not possible:
        raise RuntimeError("training_lora='direct' needs the layer hooks (capture='hooks', "
                           "eager), one tensor-parallel rank and vLLM's LoRA slots")
    if training_lora == "auto":
        return "direct" if possible else "vllm"
    return training_lora


class ForwardHooks:
    """The hook set on one model runner: time every forward, capture the rows of
    ``link.rows``, and (``hooks`` path) cut a training-only step short."""

    def __init__(self, runner: GPUModelRunner, link: EngineLink, capture: str = "auto",
                 training_lora: str = "auto"):
        self.runner = runner
        self.link = link
        self.model: nn.Module = runner.model
        self.layers = decoder_layers(self.model)
        self.path = capture_path(runner, capture)
        self.training_lora = training_lora_path(runner, self.path, training_lora)
        self.direct = DirectLoRA(self.layers) if self.training_lora == "direct" else None
        # the model class of aux_model requests the aux outputs itself, at build time
        self._builtin_aux = hasattr(self.model, "deltaserve_aux")
        self.interrupt = self.path == "hooks"
        self._cuda = runner.device.type == "cuda"
        self._handles: list[RemovableHandle] = []
        self._wrapped: list[nn.Module] = []
        self._layout: RowLayout | None = None
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
        if self.direct is not None:
            self.direct.install()
        self.link.direct_lora = self.direct is not None
        self._handles.append(m.register_forward_pre_hook(self._pre_model, with_kwargs=True))
        self._handles.append(m.register_forward_hook(self._post_model, with_kwargs=True))
        if self.path == "aux":
            if not self._builtin_aux:  # eager: the model's next forwards emit them
                m.set_aux_hidden_state_layers(tuple(range(self.num_layers)))
            return
        for i, layer in enumerate(self.layers):
            self._handles.append(layer.register_forward_pre_hook(self._layer_hook(i)))
            layer.forward = self._bypassable(layer.forward)
            self._wrapped.append(layer)

    def remove(self) -> None:
        if self.direct is not None:
            self.direct.remove()
        self.link.direct_lora = False
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for layer in self._wrapped:
            del layer.forward  # back to the class's forward
        self._wrapped.clear()
        if self.path == "aux" and not self._builtin_aux:
            self.model.set_aux_hidden_state_layers(())

    def _bypassable(self, forward: LayerForward) -> LayerForward:
        def layer_forward(positions: torch.Tensor, hidden_states: torch.Tensor,
                          residual: torch.Tensor | None, *args: object, **kwargs: object
                          ) -> tuple[torch.Tensor, torch.Tensor]:
            if self._bypass:  # an interrupted training-only step: pass the stream through
                if residual is None:
                    residual = torch.zeros_like(hidden_states)
                return hidden_states, residual
            return forward(positions, hidden_states, residual, *args, **kwargs)

        return layer_forward

    # ---- per forward ------------------------------------------------------------------------
    def _pre_model(self, module: nn.Module, args: tuple[object, ...],
                   kwargs: dict[str, object]) -> None:
        if self._cuda:
            torch.cuda.synchronize()
        self._t0 = time.perf_counter()
        self._bypass = False
        self._layers_run = self.num_layers
        self._mode = _runtime_mode()
        layout = self.link.rows
        self._layout = layout if layout is not None and layout.valid else None
        self._index = self._row_index(self._layout) if self._layout is not None else None
        if self._index is not None and self.direct is not None:
            self._begin_direct(self._index)
        if self._index is None:
            self._layout = None

    def _begin_direct(self, index: torch.Tensor) -> None:
        publisher = self.link.publisher
        if publisher is None:  # no adapter to add: the step gives its samples back
            assert self._layout is not None
            self._layout.valid = False
            self._index = None
            return
        assert self.direct is not None and self._layout is not None
        self.direct.begin(index, self._layout.step.rows, publisher)

    def _row_index(self, layout: RowLayout) -> torch.Tensor | None:
        """Row numbers of the training requests in this forward, in ``step.rows`` order; None
        (and the layout marked invalid) if any request is not in the batch whole."""
        batch = self.runner.input_batch
        n = batch.num_reqs
        where = {rid: i for i, rid in enumerate(batch.req_ids[:n])}
        qsl = self.runner.query_start_loc.np[: n + 1]
        index: list[int] = []
        for rid, length in zip(layout.req_ids, layout.step.rows.lengths, strict=True):
            i = where.get(rid)
            if i is None or int(qsl[i + 1] - qsl[i]) != length:
                layout.valid = False
                return None
            index.extend(range(int(qsl[i]), int(qsl[i + 1])))
        return torch.tensor(index, dtype=torch.long, device=self.runner.device)

    def _layer_hook(self, i: int) -> Callable[[nn.Module, tuple[torch.Tensor, ...]], None]:
        def hook(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            layout, index = self._layout, self._index
            if layout is None or index is None or self._bypass:
                return
            if layout.step.should_abort():
                self._bypass = True
                self._layers_run = i
                return
            hidden, residual = args[1], args[2]
            x = hidden.index_select(0, index)
            if residual is not None:
                x = x + residual.index_select(0, index)
            layout.step.capture(i, x)

        return hook

    def _post_model(self, module: nn.Module, args: tuple[object, ...],
                    kwargs: dict[str, object], output: torch.Tensor | tuple[torch.Tensor, ...]
                    ) -> torch.Tensor | None:
        replaced = None
        if self.path == "aux":
            replaced, aux = self._aux_outputs(module, output)
            self._capture_aux(aux)
        if self._cuda:
            torch.cuda.synchronize()
        out = replaced if replaced is not None else output
        assert isinstance(out, torch.Tensor)
        self.link.last_forward = ForwardRecord(
            time.perf_counter() - self._t0, self._mode, int(out.shape[0]), self._layers_run,
            self._bypass)
        self._layout = None
        self._index = None
        self._bypass = False
        if self.direct is not None:
            self.direct.end()
        return replaced

    def _aux_outputs(self, module: nn.Module, output: torch.Tensor | tuple[torch.Tensor, ...]
                     ) -> tuple[torch.Tensor | None, list[torch.Tensor] | None]:
        """The plain hidden states to hand vLLM (None: unchanged) and the aux outputs."""
        if isinstance(output, tuple):  # eager, aux switched on after start-up
            hidden, aux = output
            return hidden, list(aux)
        if self._builtin_aux:
            aux, module.deltaserve_aux = module.deltaserve_aux, None
            return None, aux
        return None, None

    def _capture_aux(self, aux: list[torch.Tensor] | None) -> None:
        layout, index = self._layout, self._index
        if layout is None or index is None:
            return
        if aux is None or len(aux) != self.num_layers:
            layout.valid = False  # nothing to capture from: the step gives its samples back
            return
        for i, stream in enumerate(aux):
            layout.step.capture(i, stream.index_select(0, index))
