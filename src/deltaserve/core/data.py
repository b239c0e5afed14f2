"""Fine-tuning data: read Alpaca, chat or ShareGPT records (:mod:`deltaserve.core.dataset_files`),
tokenize with the chat template, mask prompts.

Formats:
* Alpaca, as a JSON array or JSONL: ``{"instruction", "input" (optional), "output"}``;
* chat JSONL: ``{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}``,
  ending with an assistant turn;
* ShareGPT: ``{"conversations": [{"from": "system"|"human"|"gpt", "value": str}, ...]}``
  (speakers "user"/"assistant" too, an optional top-level ``system``), ending with a gpt turn.

``auto`` picks a record's format by its keys (``messages``, ``conversations``, else Alpaca). Files
are JSONL or one JSON array, UTF-8.

The loss covers assistant tokens only (labels of every other token are ``IGNORE_INDEX``, as in
Hugging Face). The tokenizer is duck-typed (``apply_chat_template``, ``__call__``), so this module
needs no torch. A malformed row (bytes that are not UTF-8, broken JSON, a record of the wrong
shape; in a JSON array, one element) raises :class:`InputError` with its line number, or, with
``skip_bad_rows``, is skipped and counted in the :class:`DatasetReport`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from deltaserve.core.dataset_files import Conversation, Message, iter_rows, to_conversation
from deltaserve.core.errors import InputError, require, require_choice
from deltaserve.core.tokenizer import Tokenizer

IGNORE_INDEX = -100
@dataclass(frozen=True)
class TrainingSample:
    """One tokenized sample. ``labels[i]`` is the target of position i before the causal shift
    (Hugging Face convention): the token itself where it counts for the loss, else -100."""

    sample_id: int
    input_ids: tuple[int, ...]
    labels: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_loss_tokens(self) -> int:
        """Positions that predict a counted label (labels shifted by one)."""
        return sum(1 for t in self.labels[1:] if t != IGNORE_INDEX)


@dataclass(frozen=True)
class DataConfig:
    """``max_tokens``: longest sample; longer ones are dropped or truncated (``overlength``)."""

    path: str
    format: str = "auto"
    max_tokens: int = 1024
    overlength: str = "drop"
    skip_bad_rows: bool = False
    system_prompt: str | None = None

    def __post_init__(self) -> None:
        require_choice("format", self.format, ("auto", "alpaca", "chat", "sharegpt"))
        require_choice("overlength", self.overlength, ("drop", "truncate"))
        require(self.max_tokens >= 2, "max_tokens", self.max_tokens, "must be >= 2")


@dataclass(frozen=True)
class DatasetReport:
    """What loading did to a dataset; :meth:`summary` is the line a host prints, so no row is
    dropped without the operator seeing it."""

    num_rows: int
    num_bad_rows: int
    bad_rows: tuple[int, ...]  # first few: line numbers (JSONL) or record numbers (JSON array)
    num_samples: int
    num_dropped_overlength: int
    num_truncated: int
    num_dropped_no_loss: int
    num_tokens: int
    max_tokens: int  # the limit the over-long samples were measured against

    def summary(self) -> str:
        where = ", ".join(map(str, self.bad_rows)) + (", ..." if self.num_bad_rows > len(
            self.bad_rows) else "")
        return (f"{self.num_samples} samples ({self.num_tokens} tokens) from {self.num_rows} "
                f"rows; {self.num_bad_rows} bad rows skipped" + (f" ({where})" if where else "")
                + f"; {self.num_dropped_overlength} dropped and {self.num_truncated} truncated "
                f"as longer than {self.max_tokens} tokens; {self.num_dropped_no_loss} dropped "
                "with no response tokens")


def read_conversations(cfg: DataConfig) -> tuple[list[Conversation], list[int]]:
    """All well-formed records, and the line numbers of skipped bad ones."""
    path = Path(cfg.path)
    if not path.is_file():
        raise InputError("dataset", str(path), "no such file")
    good: list[Conversation] = []
    bad: list[int] = []
    for line, record, obj in iter_rows(path):
        try:
            if isinstance(obj, InputError):
                raise obj
            good.append(to_conversation(obj, cfg.format, line, cfg.system_prompt))
        except InputError as e:
            if not cfg.skip_bad_rows:
                raise InputError(e.field, e.value, e.reason + " (use skip_bad_rows to skip it)",
                                 line=e.line, record=record) from None
            bad.append(line if record is None else record)
    if not good:
        raise InputError("dataset", str(path), "holds no usable records"
                         + (f" ({len(bad)} bad rows skipped)" if bad else ""))
    return good, bad


# ---- tokenizing ------------------------------------------------------------------------------
def _ids(tokenizer: Tokenizer, text: str) -> list[int]:
    out = tokenizer(text, add_special_tokens=False)
    return list(out["input_ids"] if not isinstance(out, list) else out)


def _render(tokenizer: Tokenizer, msgs: Sequence[Message], generation_prompt: bool) -> str:
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": m.role, "content": m.content} for m in msgs],
            tokenize=False, add_generation_prompt=generation_prompt)
    # No chat template: the plain Alpaca prompt, responses closed by EOS.
    parts = []
    for m in msgs:
        if m.role == "assistant":
            parts.append(f"### Response:\n{m.content}{tokenizer.eos_token or ''}\n\n")
        else:
            parts.append(f"### {m.role.capitalize()}:\n{m.content}\n\n")
    if generation_prompt:
        parts.append("### Response:\n")
    return "".join(parts)


def tokenize_conversation(tokenizer: Tokenizer, conv: Conversation,
                          ) -> tuple[list[int], list[int]]:
    """Token ids and labels; every assistant turn counts, every other token is masked."""
    ids: list[int] = []
    labels: list[int] = []
    for k, m in enumerate(conv.messages):
        if m.role != "assistant":
            continue
        prompt = _ids(tokenizer, _render(tokenizer, conv.messages[:k], True))
        full = _ids(tokenizer, _render(tokenizer, conv.messages[: k + 1], False))
        if full[: len(prompt)] != prompt or full[: len(ids)] != ids:
            raise InputError("chat_template", "<template>",
                             "rendering a conversation turn by turn does not give a common "
                             "prefix, so prompt tokens cannot be masked", line=conv.line)
        labels += [IGNORE_INDEX] * (len(prompt) - len(ids)) + full[len(prompt):]
        ids = full
    return ids, labels


def tokenize(conversations: Sequence[Conversation], tokenizer: Tokenizer, cfg: DataConfig,
             num_bad_rows: int = 0, bad_rows: Sequence[int] = ()) -> tuple[
                 list[TrainingSample], DatasetReport]:
    samples: list[TrainingSample] = []
    dropped = truncated = no_loss = 0
    for conv in conversations:
        ids, labels = tokenize_conversation(tokenizer, conv)
        if len(ids) > cfg.max_tokens:
            if cfg.overlength == "drop":
                dropped += 1
                continue
            ids, labels = ids[: cfg.max_tokens], labels[: cfg.max_tokens]
            truncated += 1
        if all(t == IGNORE_INDEX for t in labels[1:]):
            no_loss += 1  # nothing to learn: the response was cut away entirely
            continue
        samples.append(TrainingSample(len(samples), tuple(ids), tuple(labels)))
    if not samples:
        raise InputError("dataset", cfg.path,
                         f"no sample fits max_tokens={cfg.max_tokens} "
                         f"({dropped} dropped as too long, {no_loss} with no response tokens)")
    report = DatasetReport(len(conversations) + num_bad_rows, num_bad_rows, tuple(bad_rows[:10]),
                           len(samples), dropped, truncated, no_loss,
                           sum(s.num_tokens for s in samples), cfg.max_tokens)
    return samples, report


def load_dataset(cfg: DataConfig, tokenizer: Tokenizer) -> tuple[list[TrainingSample],
                                                                 DatasetReport]:
    """Read, validate and tokenize ``cfg.path``."""
    conversations, bad = read_conversations(cfg)
    return tokenize(conversations, tokenizer, cfg, len(bad), bad)
