"""Reading dataset files into conversations, one record at a time, each with its line.

Files are JSONL or one JSON array. A row is checked for UTF-8 on its own, so one bad row is
reported with its line (and can be skipped) without losing the rest of the file; in a JSON array,
reading resumes at the next element after a broken one. Records are Alpaca, chat (``messages``)
or ShareGPT (``conversations``); see :mod:`deltaserve.core.data`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from deltaserve.core.errors import InputError
from deltaserve.core.jsontypes import JsonObject, JsonValue

ROLES = ("system", "user", "assistant")
# ShareGPT speakers (``from``) and the role each one is; "user"/"assistant" appear in exports too
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant"}


@dataclass(frozen=True)
class Message:
    role: str
    content: str


@dataclass(frozen=True)
class Conversation:
    messages: tuple[Message, ...]
    line: int  # where the record starts in its file


# Bytes that are not UTF-8 are decoded as lone surrogates (``surrogateescape``), so one bad row
# is found, reported with its line, and skipped, without losing the rest of the file.
_NOT_UTF8 = re.compile("[\udc80-\udcff]")
_BLANK = " \t\r\n"


def _read_text(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise InputError("dataset", str(path), f"cannot read: {e}") from e
    return data.decode("utf-8", errors="surrogateescape").removeprefix("\ufeff")


def _encoding_error(span: str, first_line: int) -> InputError | None:
    """An error naming the line and the bytes of the first non-UTF-8 byte in ``span``."""
    m = _NOT_UTF8.search(span)
    if m is None:
        return None
    shown = span[max(0, m.start() - 12): m.start() + 12].encode("utf-8", "surrogateescape")
    return InputError("encoding", shown, "not valid UTF-8 (re-encode the file as UTF-8)",
                      line=first_line + span.count("\n", 0, m.start()))


def _skip_blank(text: str, i: int, also: str = "") -> int:
    while i < len(text) and (text[i] in _BLANK or text[i] in also):
        i += 1
    return i


def _broken_element_end(text: str, i: int) -> int | None:
    """Where the syntactically broken array element at ``i`` ends: the index of the ``,`` or
    ``]`` after it, found by bracket structure (a closer pops back to its opener, so a missing
    bracket inside the element is tolerated). None when the structure is no guide: a string
    cut by a line end (JSON strings hold no raw newline: a quote is missing) or the end of the
    text."""
    closers: list[str] = []
    in_string = False
    j = i
    while j < len(text):
        c = text[j]
        if in_string:
            if c == "\\":
                j += 1
            elif c == '"':
                in_string = False
            elif c == "\n":
                return None
        elif c == '"':
            in_string = True
        elif c in "[{":
            closers.append("]" if c == "[" else "}")
        elif c in "]}" and c in closers:
            while closers.pop() != c:
                pass
        elif (c == "," or c == "]") and not closers:
            return j
        j += 1
    return None


def _is_final_close(text: str, k: int) -> bool:
    """``text[k]`` is the ``]`` that closes the top-level array: nothing but blanks follows."""
    return text[k] == "]" and not text[k + 1:].strip()


def _next_element(text: str, i: int, dec: json.JSONDecoder) -> int | None:
    """Fallback for :func:`_broken_element_end`: the first ``,`` after ``i`` followed by a value
    that decodes and is itself followed by ``,`` or the array's final ``]``. A value inside the
    broken element may pass for one (a list of strings): it is then read as a bad record and
    counted, never silently dropped."""
    q = text.find(",", i + 1)
    while q != -1:
        try:
            _, end = dec.raw_decode(text, _skip_blank(text, q + 1))
        except json.JSONDecodeError:
            pass
        else:
            k = _skip_blank(text, end)
            if k < len(text) and (text[k] == "," or _is_final_close(text, k)):
                return q
        q = text.find(",", q + 1)
    return None


def _broken(text: str, i: int, line: int, record: int, reason: str,
            dec: json.JSONDecoder) -> tuple[InputError, int]:
    """The error of the broken element at ``i`` and where reading resumes; raises when it
    cannot resume (the file looks truncated)."""
    end = _broken_element_end(text, i + (text[i] == "]"))
    end = end if end is not None else _next_element(text, i, dec)
    if end is None:
        raise InputError("json", text[i:i + 40], f"{reason}, and where the next record begins "
                         "cannot be found: the file looks truncated or its brackets are "
                         "unbalanced", line=line, record=record)
    error = _encoding_error(text[i:end], line) or InputError("json", text[i:i + 40], reason,
                                                             line=line)
    return error, end


def _iter_json_array(text: str) -> Iterator[tuple[int, int, JsonValue | InputError]]:
    """``(line, record, element or its error)`` of a top-level JSON array, each element with the
    line it starts on. Reading resumes after a broken element; a file in which the next element
    cannot be found (truncated) raises."""
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    line = text.count("\n", 0, i) + 1
    record = 0
    while True:
        start = i
        i = _skip_blank(text, i, ",")
        line += text.count("\n", start, i)
        if i >= len(text):
            raise InputError("json", "<eof>", "the array is not closed: the file looks "
                             "truncated", line=line)
        if _is_final_close(text, i):
            return
        record += 1
        if text[i] == "]":  # not the last one: a stray bracket, or text after the array
            item, end = _broken(text, i, line, record, "unexpected ']'", dec)
        else:
            try:
                obj, end = dec.raw_decode(text, i)
            except json.JSONDecodeError as e:
                item, end = _broken(text, i, line, record,
                                    f"not valid JSON: {e.msg} (at line {e.lineno})", dec)
            else:
                item = _encoding_error(text[i:end], line) or obj
        yield line, record, item
        line += text.count("\n", i, end)
        i = end


def iter_rows(path: Path) -> Iterator[tuple[int, int | None, JsonValue | InputError]]:
    text = _read_text(path)
    if text.lstrip().startswith("["):
        yield from _iter_json_array(text)
        return
    # split on "\n" only: str.splitlines would also split at U+2028 and friends, which JSON
    # strings may hold raw, and so misnumber every later line
    for lineno, raw in enumerate(text.split("\n"), start=1):
        if not raw.strip():
            continue
        bad = _encoding_error(raw, lineno)
        if bad is not None:
            yield lineno, None, bad
            continue
        try:
            yield lineno, None, json.loads(raw)
        except json.JSONDecodeError as e:
            yield lineno, None, InputError("json", raw[:40], f"not valid JSON: {e.msg}",
                                           line=lineno)


def _alpaca(obj: JsonObject, line: int) -> list[Message]:
    for key in ("instruction", "output"):
        if not isinstance(obj.get(key), str) or not obj[key].strip():
            raise InputError(key, obj.get(key), "must be a non-empty string", line=line)
    extra = obj.get("input", "")
    if not isinstance(extra, str):
        raise InputError("input", extra, "must be a string", line=line)
    prompt = obj["instruction"] + (f"\n\n{extra}" if extra.strip() else "")
    return [Message("user", prompt), Message("assistant", obj["output"])]


def _chat(obj: JsonObject, line: int) -> list[Message]:
    raw = obj.get("messages")
    if not isinstance(raw, list) or not raw:
        raise InputError("messages", raw, "must be a non-empty list", line=line)
    msgs = []
    for m in raw:
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise InputError("messages.role", m, f"role must be one of {ROLES}", line=line)
        if not isinstance(m.get("content"), str):
            raise InputError("messages.content", m, "content must be a string", line=line)
        msgs.append(Message(m["role"], m["content"]))
    return msgs


def _sharegpt(obj: JsonObject, line: int) -> list[Message]:
    """ShareGPT as FastChat, axolotl, LLaMA-Factory and torchtune write it: turns under
    ``conversations`` as ``{"from", "value"}`` (or ``{"role", "content"}``), an optional
    top-level ``system`` string."""
    raw = obj.get("conversations")
    if not isinstance(raw, list) or not raw:
        raise InputError("conversations", raw, "must be a non-empty list", line=line)
    system = obj.get("system")
    if system is not None and not isinstance(system, str):
        raise InputError("system", system, "must be a string", line=line)
    msgs = [Message("system", system)] if system and system.strip() else []
    for k, turn in enumerate(raw):
        if not isinstance(turn, dict):
            raise InputError(f"conversations[{k}]", turn, "must be an object with from and "
                             "value", line=line)
        role = turn.get("from", turn.get("role"))
        if role not in SHAREGPT_ROLES:
            raise InputError(f"conversations[{k}].from", role,
                             f"must be one of {', '.join(SHAREGPT_ROLES)}", line=line)
        value = turn.get("value", turn.get("content"))
        if not isinstance(value, str):
            raise InputError(f"conversations[{k}].value", value, "must be a string", line=line)
        msgs.append(Message(SHAREGPT_ROLES[role], value))
    return msgs


_READERS = {"alpaca": _alpaca, "chat": _chat, "sharegpt": _sharegpt}


def to_conversation(obj: JsonValue, fmt: str, line: int, system: str | None) -> Conversation:
    if not isinstance(obj, dict):
        raise InputError("record", obj, "must be a JSON object", line=line)
    if fmt == "auto":
        fmt = ("chat" if "messages" in obj else "sharegpt" if "conversations" in obj
               else "alpaca")
    msgs = [Message("system", system)] if system else []
    msgs += _READERS[fmt](obj, line)
    if msgs[-1].role != "assistant":
        raise InputError("messages", msgs[-1].role, "the last turn must be the assistant's",
                         line=line)
    return Conversation(tuple(msgs), line)
