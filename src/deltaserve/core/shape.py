"""``StepShape``: the one object a host uses to describe a batch to the co-server."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum

from deltaserve.core.errors import require


class ExecMode(StrEnum):
    """How a host executes a step. Graph replay is cheaper per step than eager launch."""

    GRAPH = "graph"
    EAGER = "eager"


class StepKind(StrEnum):
    """What a step carries, for the latency model's per-kind level and its error reports."""

    DECODE = "decode"  # Equation II: decode tokens only
    PREFILL = "prefill"  # Equation I with inference rows only
    MIXED_FT = "mixed+ft"  # Equation I: inference rows beside fine-tuning rows
    FT_ONLY = "ft-only"  # Equation I: fine-tuning rows alone (an idle engine's training step)


@dataclass(frozen=True)
class StepShape:
    """The work of one engine step, in tokens.

    ``prefill_lens``: tokens of each inference prefill (or prefill chunk) in the step (the ``n_i``).
    ``num_decode``: decode requests in the step, one token each (``B_d``).
    ``kv_tokens``: KV-cache tokens attended by the inference requests, context before this step's
    tokens (``K``).
    ``ft_lens``: tokens of each fine-tuning sample riding in the step; their sum is ``T_ft``.
    ``mode``: execution mode. A step carrying fine-tuning tokens is always eager.
    ``prefill_prefix_lens``: for each prefill chunk, the tokens of its request already in the
    cache (empty: none has a prefix). They are part of ``kv_tokens`` too; they also set the
    attention area of the chunk (see :attr:`prefill_sq_tokens`).
    ``after_yield``: the step follows a yield to the backward. Not the step's work but where it
    runs (steps after a yield run slower than the same shape without one: the latency model
    keeps a level for each), so it takes no part in equality: a host's record of the step
    equals the co-server's.
    """

    prefill_lens: tuple[int, ...] = ()
    num_decode: int = 0
    kv_tokens: int = 0
    ft_lens: tuple[int, ...] = ()
    mode: ExecMode = ExecMode.EAGER
    prefill_prefix_lens: tuple[int, ...] = ()
    after_yield: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        require(not self.prefill_prefix_lens
                or len(self.prefill_prefix_lens) == len(self.prefill_lens),
                "prefill_prefix_lens", self.prefill_prefix_lens,
                "one prefix per prefill chunk (or none)")
        require(min(self.prefill_prefix_lens, default=0) >= 0, "prefill_prefix_lens",
                self.prefill_prefix_lens, "must be >= 0")
        require(min(self.prefill_lens, default=1) > 0, "prefill_lens", self.prefill_lens,
                "every prefill length must be > 0")
        require(min(self.ft_lens, default=1) > 0, "ft_lens", self.ft_lens,
                "every fine-tuning sample length must be > 0")
        require(self.num_decode >= 0, "num_decode", self.num_decode, "must be >= 0")
        require(self.kv_tokens >= 0, "kv_tokens", self.kv_tokens, "must be >= 0")
        require(isinstance(self.mode, ExecMode), "mode", self.mode, "must be an ExecMode")
        require(not (self.ft_lens and self.mode is ExecMode.GRAPH), "mode", self.mode,
                "a step carrying fine-tuning tokens runs eager")

    @property
    def num_prefill_tokens(self) -> int:
        """``T_in``: inference prefill tokens."""
        return sum(self.prefill_lens)

    @property
    def num_ft_tokens(self) -> int:
        """``T_ft``: fine-tuning tokens."""
        return sum(self.ft_lens)

    @property
    def num_tokens(self) -> int:
        """Every token the forward processes."""
        return self.num_prefill_tokens + self.num_decode + self.num_ft_tokens

    @property
    def num_seqs(self) -> int:
        return len(self.prefill_lens) + self.num_decode + len(self.ft_lens)

    @property
    def prefill_sq_tokens(self) -> int:
        """``Σ n_i²`` over every prefill-shaped sequence (inference chunks and fine-tuning
        samples): the causal self-attention among a sequence's own new tokens grows with its
        square. A chunk behind a cached prefix ``p`` attends to it too, so it counts
        ``n² + 2·n·p`` (twice its attention area, as ``n²`` is for a chunk alone)."""
        sq = sum(n * n for n in self.prefill_lens) + sum(m * m for m in self.ft_lens)
        return sq + 2 * sum(n * p for n, p in zip(self.prefill_lens, self.prefill_prefix_lens,
                                                   strict=False))

    @property
    def has_inference(self) -> bool:
        return bool(self.prefill_lens) or self.num_decode > 0

    @property
    def is_decode_only(self) -> bool:
        """Only decode tokens: priced by Equation II."""
        return self.num_decode > 0 and not self.prefill_lens and not self.ft_lens

    @property
    def is_empty(self) -> bool:
        return self.num_tokens == 0

    def with_ft(self, ft_lens: tuple[int, ...]) -> StepShape:
        """This step with fine-tuning samples added; the result runs eager."""
        return StepShape(self.prefill_lens, self.num_decode, self.kv_tokens,
                         self.ft_lens + tuple(ft_lens), ExecMode.EAGER, self.prefill_prefix_lens,
                         self.after_yield)

    def inference_only(self) -> StepShape:
        return replace(self, ft_lens=())


def kind_of(shape: StepShape) -> StepKind:
    if not shape.ft_lens:
        return StepKind.DECODE if shape.is_decode_only else StepKind.PREFILL
    return StepKind.MIXED_FT if shape.num_prefill_tokens + shape.num_decode else StepKind.FT_ONLY
