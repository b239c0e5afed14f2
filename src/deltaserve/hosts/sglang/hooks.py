"""Hooks on SGLang's model: time every forward, hand the training rows' input of every decoder
layer to the step's ``capture``, and cut a training-only step short at a layer boundary.

Residual stream: SGLang 0.5.23's Llama decoder layers no longer pass ``residual`` between
layers; the residual stream lives in ``forward_batch.residual_stream`` and each layer's
attention boundary (``attn_boundary.prepare``) completes the previous layer's contribution. That
boundary has an official capture point, the layer's ``capture_output`` argument (what EAGLE-3's
auxiliary hidden states use): it is called with the *updated residual stream*, i.e. the
layer's input hidden state, on the producer's rows. A forward pre-hook (torch's hook API, with
kwargs) puts DeltaServe's callback into that argument for the layers of a forward that holds
training rows; when SGLang captures the layer itself (EAGLE-3), both callbacks run.

Row layout: a forward's tokens are the batch's requests in ``ScheduleBatch.reqs`` order, each
contributing ``extend_lens[i]`` rows in an extend (prefill) forward and one in a decode
(:func:`row_index`).

Interrupting: raising inside SGLang's forward would kill the engine, and a hook cannot skip a
module. Each decoder layer's ``forward`` is wrapped on the module instance (no SGLang code
changes; the one instance-attribute wrapper DeltaServe installs): once the step says stop, every
remaining layer returns its input untouched. SGLang's residual stream checks that a layer's
output is the handle the previous layer recorded (``residual/stream.py``, ``check``): passing
that same object on keeps it consistent, and the final norm then completes the stream as it
stood after the last layer run. Only steps with no client request are ever cut short.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from deltaserve.core.contract import TrainingStep


def decoder_stack(model: Any) -> tuple[Any, list[Any]]:
    """The decoder stack (``model.model``) of an SGLang Llama-family model and its layers."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__}: no model.layers; DeltaServe's SGLang host "
                        "supports Llama-family decoders")
    return inner, list(layers)


def row_index(batch_req_ids: Sequence[str], batch_lens: Sequence[int],
              train_ids: Sequence[str], train_lens: Sequence[int]) -> list[int] | None:
    """Rows of the training requests ``train_ids`` (``train_lens`` tokens each) in a forward
    whose requests are ``batch_req_ids`` with ``batch_lens`` new tokens each, in
    ``train_ids``' order; None if any is not there whole."""
    start: dict[str, tuple[int, int]] = {}
    offset = 0
    for rid, n in zip(batch_req_ids, batch_lens, strict=True):
        start[rid] = (offset, n)
        offset += n
    index: list[int] = []
    for rid, length in zip(train_ids, train_lens, strict=True):
        got = start.get(rid)
        if got is None or got[1] != length:
            return None
        index.extend(range(got[0], got[0] + length))
    return index


@dataclass(frozen=True)
class ArmedStep:
    """The training rows of the next forward: the co-server's step, their row indices, and
    whether the forward may be cut short (no client request in it)."""

    step: TrainingStep
    index: torch.Tensor
    can_stop: bool


@dataclass(frozen=True)
class ForwardRecord:
    """One forward of the decoder stack as the hooks saw it: wall seconds (embeddings to
    final norm) and the decoder layers computed (fewer when a step was cut short)."""

    seconds: float
    layers_run: int
    stopped: bool


class ForwardHooks:
    """The hook set on one SGLang model. The scheduler :meth:`arm`\\ s it before each forward;
    ``on_boundary`` runs at each layer boundary of a forward that may stop (the scheduler looks
    for arrivals there)."""

    def __init__(self, model: Any, on_boundary: Callable[[], None] = lambda: None):
        # SGLang's runners call ``model.forward`` directly (hooks on the top-level model never
        # fire); the decoder stack and its layers are called as modules, so the hooks go there
        self.stack, self.layers = decoder_stack(model)
        self.on_boundary = on_boundary
        self._handles: list[Any] = []
        self._armed: ArmedStep | None = None
        self._bypass = False
        self._layers_run = len(self.layers)
        self._t0 = 0.0
        self._last: ForwardRecord | None = None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    # ---- install / remove -------------------------------------------------------------------
    def install(self) -> None:
        self._handles.append(self.stack.register_forward_pre_hook(self._pre_model))
        self._handles.append(self.stack.register_forward_hook(self._post_model))
        for i, layer in enumerate(self.layers):
            self._handles.append(
                layer.register_forward_pre_hook(self._layer_hook(i), with_kwargs=True))
            self._handles.append(layer.mlp.gate_up_proj.register_forward_pre_hook(
                self._mlp_hook(i, layer.mlp.gate_up_proj)))
            layer.forward = self._bypassable(layer.forward)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for layer in self.layers:
            layer.__dict__.pop("forward", None)  # back to the class's forward

    # ---- per forward ------------------------------------------------------------------------
    def arm(self, armed: ArmedStep | None) -> None:
        self._armed = armed

    def take(self) -> ForwardRecord | None:
        """The record of the last forward (None: no forward ran since the last take)."""
        rec, self._last = self._last, None
        return rec

    def _bypassable(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        def layer_forward(positions, hidden_states, forward_batch, *args, **kwargs):
            if self._bypass:  # a training-only step cut short: pass the stream through
                return hidden_states
            return forward(positions, hidden_states, forward_batch, *args, **kwargs)

        return layer_forward

    def _pre_model(self, module: Any, args: Any) -> None:
        self._t0 = time.perf_counter()
        self._bypass = False
        self._layers_run = self.num_layers

    def _layer_hook(self, i: int) -> Callable[[Any, Any, dict], Any]:
        def hook(module: Any, args: Any, kwargs: dict) -> Any:
            armed = self._armed
            if armed is None or self._bypass:
                return None
            if armed.can_stop:
                self.on_boundary()
            if armed.step.should_abort() and armed.can_stop:
                self._bypass = True
                self._layers_run = i
                return None
            theirs = kwargs.get("capture_output")

            def capture(value: torch.Tensor, *, owned: bool = False) -> None:
                armed.step.capture(i, value.index_select(0, armed.index))  # a copy
                if theirs is not None:
                    theirs(value, owned=owned)

            return args, {**kwargs, "capture_output": capture}

        return hook

    def _mlp_hook(self, i: int, gate_up: Any) -> Callable[[Any, Any], None]:
        """The training rows' base (pre-LoRA) gate and up projections, where the step's buffer
        keeps them: recomputed from the MLP input, as SGLang's fused kernel never exposes its
        base output."""
        def hook(module: Any, args: Any) -> None:
            armed = self._armed
            if armed is None or self._bypass or not armed.step.saves_mlp:
                return
            base = getattr(gate_up, "base_layer", gate_up)
            rows = F.linear(args[0].index_select(0, armed.index), base.weight)
            gate, up = rows.chunk(2, dim=-1)
            armed.step.capture_mlp(i, gate, up)

        return hook

    def _post_model(self, module: Any, args: Any, output: Any) -> None:
        self._last = ForwardRecord(time.perf_counter() - self._t0, self._layers_run,
                                   self._bypass)
        self._armed = None
        self._bypass = False
