"""``/dashboard`` (the page, which holds no data) and ``/dashboard/data`` (its series, behind
the API key like every other route)."""

from __future__ import annotations

from dataclasses import asdict

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

from deltaserve.server.context import Svc
from deltaserve.server.dashboard_page import render
from deltaserve.server.db_records import JobStatus

router = APIRouter(prefix="/dashboard")


@router.get("", response_class=HTMLResponse)
async def page(svc: Svc) -> HTMLResponse:
    return HTMLResponse(render(svc.config.dashboard_interval_s),
                        headers={"Content-Security-Policy": "default-src 'self'; "
                                 "script-src 'unsafe-inline'; style-src 'unsafe-inline'"})


@router.get("/data")
async def data(svc: Svc) -> dict:
    counts = svc.store.job_status_counts()
    return {"interval_s": svc.timeline.interval_s,
            "points": [asdict(p) for p in svc.timeline.points()],
            "jobs_running": counts[JobStatus.RUNNING], "jobs_queued": counts[JobStatus.QUEUED]}
