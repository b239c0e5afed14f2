"""Receiving an uploaded training file: capped in size while it arrives, validated by the
project's loader before it is kept."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path, PurePath

from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.types import Message, Receive

from deltaserve.core.data import DataConfig, read_conversations
from deltaserve.core.errors import InputError
from deltaserve.server.errors import APIError

MULTIPART_SLACK_BYTES = 64 * 1024  # boundaries, part headers and the small form fields
_CHUNK = 1 << 20


def too_large(limit: int) -> APIError:
    return APIError(413, f"the file is larger than this server's upload limit of {limit} bytes"
                    " (--max-upload-bytes)", param="file", code="file_too_large")


def capped(request: Request, max_upload_bytes: int) -> Request:
    """The same request, but reading its body fails with 413 past the cap (plus multipart
    overhead), whether or not the client declared a Content-Length."""
    limit = max_upload_bytes + MULTIPART_SLACK_BYTES
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(max_upload_bytes)
    seen = 0
    inner: Receive = request.receive

    async def receive() -> Message:
        nonlocal seen
        message = await inner()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise too_large(max_upload_bytes)
        return message

    return Request(request.scope, receive)


def client_filename(upload: UploadFile) -> str:
    """The client's name for the file, for display only: its last component, bounded."""
    name = PurePath((upload.filename or "upload.jsonl").replace("\\", "/")).name
    return (name or "upload.jsonl")[:255]


async def save_upload(upload: UploadFile, dst: Path, max_upload_bytes: int) -> int:
    """Copy the upload to ``dst`` (fsynced); returns its size in bytes."""
    size = 0
    with open(dst, "wb") as out:
        while chunk := await upload.read(_CHUNK):
            size += len(chunk)
            if size > max_upload_bytes:
                raise too_large(max_upload_bytes)
            out.write(chunk)
        out.flush()
        os.fsync(out.fileno())
    if size == 0:
        raise APIError(400, "the file is empty", param="file", code="invalid_file")
    return size


def _validate(path: Path, shown_name: str) -> int:
    try:
        conversations, _ = read_conversations(DataConfig(path=str(path)))
    except InputError as e:
        # The loader names the file by its path; the client knows it by its own name.
        message = str(e).replace(str(path), shown_name)
        raise APIError(400, f"{shown_name}: {message}", param=e.field,
                       code="invalid_file") from None
    except UnicodeDecodeError as e:
        line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise APIError(400, f"{shown_name}: line {line}: not UTF-8 text ({e.reason})",
                       param="file", code="invalid_file") from None
    return len(conversations)


async def validate_training_file(path: Path, shown_name: str) -> int:
    """Every record parsed (Alpaca JSON/JSONL or chat ``messages`` JSONL); returns the count.
    A bad record is a 400 whose ``message`` holds its line and whose ``param`` its field."""
    return await asyncio.to_thread(_validate, path, shown_name)
