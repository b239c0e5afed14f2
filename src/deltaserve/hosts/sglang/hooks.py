"""Hooks on SGLang's model: time every forward, capture the training rows' input of every decoder
layer, and cut a training-only step short at a layer boundary.

Residual stream: SGLang 0.5.23's Llama decoder layers no longer pass ``residual`` between
layers; the residual stream lives in ``forward_batch.residual_stream`` and each layer's
attention boundary (``attn_boundary.prepare``) completes the previous layer's contribution. That
boundary has an official capture point, the layer's ``capture_output`` argument (what EAGLE-3's
auxiliary hidden states use): it is called with the *updated residual stream*, i.e. the
layer's input hidden state, on the producer's rows. A forward pre-hook (torch's hook API, with
kwargs) puts DeltaServe's callback into that argument for the layers of a forward that holds
training rows; when SGLang captures the layer itself (EAGLE-3), both callbacks run.

Row layout: a forward's tokens are the batch's requests in ``ScheduleBatch.reqs`` order, each
contributing ``extend_input_len`` rows in an extend (prefill) forward and one in a decode. The
scheduler computes the training rows' indices from that order before the forward
(:func:`row_index`).

Interrupting: raising inside SGLang's forward would kill the engine, and a hook cannot skip a
module. With ``interrupt`` on, each decoder layer's ``forward`` is wrapped on the module instance
(no SGLang code changes; documented in docs/sglang.md as the one instance-attribute wrapper):
once the co-server asks a training-only step to stop, every remaining layer returns its input
untouched instead of computing. SGLang's residual stream checks that a layer's output is the
handle the previous layer recorded (``residual/stream.py``, ``check``): passing that same object
on keeps it consistent, and the final norm then completes the stream as it stood after the last
layer run. The step ends after the layers already run plus the final norm, logits and sampling of
rows whose one token is thrown away. Only hidden requests are in
such a step, so nothing a client sees changes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from deltaserve.core.shape import ExecMode
from deltaserve.hosts.sglang.records import ForwardRecord, TrainingRows


def decoder_stack(model: Any) -> tuple[Any, list[Any]]:
    """The decoder stack (``model.model``) of an SGLang Llama-family model and its layers."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__}: no model.layers; DeltaServe's SGLang host "
                        "supports Llama-family decoders")
    return inner, list(layers)


def row_index(batch_req_ids: Sequence[str], batch_lens: Sequence[int], rows: TrainingRows,
              device: torch.device | str) -> torch.Tensor | None:
    """Rows of the training requests in a forward whose requests are ``batch_req_ids`` with
    ``batch_lens`` new tokens each, in ``rows``' order; None if any is not there whole."""
    start: dict[str, tuple[int, int]] = {}
    offset = 0
    for rid, n in zip(batch_req_ids, batch_lens, strict=True):
        start[rid] = (offset, n)
        offset += n
    index: list[int] = []
    for rid, length in zip(rows.req_ids, rows.lengths, strict=True):
        got = start.get(rid)
        if got is None or got[1] != length:
            return None
        index.extend(range(got[0], got[0] + length))
    return torch.tensor(index, dtype=torch.long, device=device)


class ForwardHooks:
    """The hook set on one SGLang model. The scheduler sets :meth:`arm` before each forward."""

    def __init__(self, model: Any, *, interrupt: bool = True, synchronize: bool = False):
        # SGLang's runners call ``model.forward`` directly (hooks on the top-level model never
        # fire); the decoder stack and its layers are called as modules, so the hooks go there
        self.stack, self.layers = decoder_stack(model)
        self.interrupt = interrupt
        self.synchronize = synchronize  # CUDA: wait for the device before reading the clock
        self._handles: list[Any] = []
        self._wrapped: list[Any] = []
        self._rows: TrainingRows | None = None
        self._index: torch.Tensor | None = None
        self._bypass = False
        self._layers_run = len(self.layers)
        self._t0 = 0.0
        self.last: ForwardRecord | None = None
        self.forwards = 0

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    # ---- install / remove -------------------------------------------------------------------
    def install(self) -> None:
        self._handles.append(self.stack.register_forward_pre_hook(self._pre_model))
        self._handles.append(self.stack.register_forward_hook(self._post_model, with_kwargs=True))
        for i, layer in enumerate(self.layers):
            self._handles.append(
                layer.register_forward_pre_hook(self._layer_hook(i), with_kwargs=True))
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

    # ---- per forward ------------------------------------------------------------------------
    def arm(self, rows: TrainingRows | None, index: torch.Tensor | None) -> None:
        """The training rows of the next forward (None: none) and their row indices."""
        if rows is not None and index is None:
            rows.valid = False
        self._rows = rows if rows is not None and rows.valid else None
        self._index = index if self._rows is not None else None

    def take(self) -> ForwardRecord | None:
        rec, self.last = self.last, None
        return rec

    def _bypassable(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        def layer_forward(positions, hidden_states, forward_batch, *args, **kwargs):
            if self._bypass:  # an interrupted training-only step: pass the stream through
                return hidden_states
            return forward(positions, hidden_states, forward_batch, *args, **kwargs)

        return layer_forward

    def _pre_model(self, module: Any, args: Any) -> None:
        if self.synchronize:
            torch.cuda.synchronize()
        self._t0 = time.perf_counter()
        self._bypass = False
        self._layers_run = self.num_layers

    def _layer_hook(self, i: int) -> Callable[[Any, Any, dict], Any]:
        def hook(module: Any, args: Any, kwargs: dict) -> Any:
            rows = self._rows
            if rows is None or self._bypass:
                return None
            if self.interrupt and rows.abortable and rows.should_abort is not None \
                    and rows.should_abort():
                self._bypass = True
                self._layers_run = rows.aborted_at = i
                return None
            index = self._index
            theirs = kwargs.get("capture_output")

            def capture(value: torch.Tensor, *, owned: bool = False) -> None:
                rows.capture(i, value.index_select(0, index))  # a copy: never SGLang's storage
                if theirs is not None:
                    theirs(value, owned=owned)

            return args, {**kwargs, "capture_output": capture}

        return hook

    def _post_model(self, module: Any, args: Any, kwargs: dict, output: Any) -> None:
        if self.synchronize:
            torch.cuda.synchronize()
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        num_tokens = int(input_ids.shape[0]) if isinstance(input_ids, torch.Tensor) else 0
        self.forwards += 1
        self.last = ForwardRecord(time.perf_counter() - self._t0, ExecMode.EAGER, num_tokens,
                                  self._layers_run, self._bypass)
        self._rows = None
        self._index = None
        self._bypass = False
