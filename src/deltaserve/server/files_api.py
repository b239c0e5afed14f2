"""The Files API, as OpenAI defines it (``purpose=fine-tune`` only)."""

from __future__ import annotations

import os
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse
from starlette.datastructures import UploadFile

from deltaserve.server.context import Services, Svc
from deltaserve.server.data_dir import is_id
from deltaserve.server.db_records import FILE_PREFIX, FileRecord, new_id
from deltaserve.server.errors import APIError, not_found
from deltaserve.server.schemas_ft import (
    FileDeleted,
    FileObject,
    ListObject,
    file_object,
    page_of,
)
from deltaserve.server.store import now_s
from deltaserve.server.uploads import (
    capped,
    client_filename,
    save_upload,
    validate_training_file,
)

PURPOSE = "fine-tune"
router = APIRouter(prefix="/v1/files")


def lookup_file(svc: Services, file_id: str, param: str = "file_id") -> FileRecord:
    rec = svc.store.get_file(file_id) if is_id(FILE_PREFIX, file_id) else None
    if rec is None:
        raise not_found("file", file_id, param)
    return rec


@router.post("")
async def create_file(svc: Svc, request: Request) -> FileObject:
    limit = svc.config.max_upload_bytes
    form = await capped(request, limit).form(max_files=1, max_fields=4)
    purpose, upload = form.get("purpose"), form.get("file")
    if purpose != PURPOSE:
        raise APIError(400, f"purpose={purpose!r}: this server accepts '{PURPOSE}' files only",
                       param="purpose", code="invalid_value")
    if not isinstance(upload, UploadFile):
        raise APIError(400, "a multipart 'file' part is required", param="file",
                       code="invalid_value")
    name = client_filename(upload)
    tmp = svc.data_dir.temp_path()
    try:
        size = await save_upload(upload, tmp, limit)
        num_records = await validate_training_file(tmp, name)
        rec = FileRecord(new_id(FILE_PREFIX), name, PURPOSE, size, now_s(), num_records)
        os.rename(tmp, svc.data_dir.file(rec.id))
    finally:
        tmp.unlink(missing_ok=True)
    svc.store.add_file(rec)
    return file_object(rec)


@router.get("")
async def list_files(svc: Svc, purpose: str | None = None, after: str | None = None,
                     limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
                     ) -> ListObject[FileObject]:
    page = svc.store.list_files(purpose, after, limit)
    return page_of([file_object(f) for f in page.data], page.has_more)


@router.get("/{file_id}")
async def retrieve_file(svc: Svc, file_id: str) -> FileObject:
    return file_object(lookup_file(svc, file_id))


@router.get("/{file_id}/content")
async def file_content(svc: Svc, file_id: str) -> FileResponse:
    rec = lookup_file(svc, file_id)
    return FileResponse(svc.data_dir.file(rec.id), media_type="application/octet-stream",
                        filename=rec.filename)


@router.delete("/{file_id}")
async def delete_file(svc: Svc, file_id: str) -> FileDeleted:
    rec = lookup_file(svc, file_id)
    users = [j.id for j in svc.store.jobs_using_file(rec.id) if not j.status.is_final]
    if users:
        raise APIError(409, f"file {rec.id} is used by unfinished job(s) {', '.join(users)}",
                       param="file_id", code="file_in_use")
    svc.store.delete_file(rec.id)
    svc.data_dir.file(rec.id).unlink(missing_ok=True)
    return FileDeleted(id=rec.id)
