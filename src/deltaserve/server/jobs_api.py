"""The Fine-tuning Jobs API, with OpenAI's paths and objects."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from deltaserve.server.context import Svc
from deltaserve.server.schemas_ft import (
    FineTuningJob,
    JobCheckpoint,
    JobCreate,
    JobEvent,
    ListObject,
    checkpoint_object,
    event_object,
    job_object,
    page_of,
)

router = APIRouter(prefix="/v1/fine_tuning/jobs")
Limit = Annotated[int, Query(ge=1, le=100)]
EventLimit = Annotated[int, Query(ge=1, le=10_000)]  # a loss curve is one event per step


@router.post("")
async def create_job(svc: Svc, body: JobCreate) -> FineTuningJob:
    return job_object(svc.jobs.create(body))


@router.get("")
async def list_jobs(svc: Svc, after: str | None = None, limit: Limit = 20
                    ) -> ListObject[FineTuningJob]:
    page = svc.store.list_jobs(after, limit)
    return page_of([job_object(j) for j in page.data], page.has_more)


@router.get("/{job_id}")
async def retrieve_job(svc: Svc, job_id: str) -> FineTuningJob:
    return job_object(svc.jobs.get(job_id))


@router.post("/{job_id}/cancel")
async def cancel_job(svc: Svc, job_id: str) -> FineTuningJob:
    return job_object(await svc.jobs.command("cancel", job_id))


@router.post("/{job_id}/pause")
async def pause_job(svc: Svc, job_id: str) -> FineTuningJob:
    return job_object(await svc.jobs.command("pause", job_id))


@router.post("/{job_id}/resume")
async def resume_job(svc: Svc, job_id: str) -> FineTuningJob:
    return job_object(svc.jobs.resume(job_id))


@router.get("/{job_id}/events")
async def list_events(svc: Svc, job_id: str, after: str | None = None, limit: EventLimit = 20
                      ) -> ListObject[JobEvent]:
    job = svc.jobs.get(job_id)
    page = svc.store.list_events(job.id, after, limit)
    return page_of([event_object(e) for e in page.data], page.has_more)


@router.get("/{job_id}/checkpoints")
async def list_checkpoints(svc: Svc, job_id: str, after: str | None = None, limit: Limit = 10
                           ) -> ListObject[JobCheckpoint]:
    job = svc.jobs.get(job_id)
    page = svc.store.list_checkpoints(job.id, after, limit)
    return page_of([checkpoint_object(c) for c in page.data], page.has_more)
