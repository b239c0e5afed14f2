"""The service's pure parts, each against a closed form: the hyperparameter mapping, text deltas
of a byte-level tokenizer, the store's paging, and the pace of progress lines."""

from __future__ import annotations

import logging
import math

import pytest

from deltaserve.core.data import TrainingSample
from deltaserve.core.errors import InputError
from deltaserve.core.slo import SLOConfig
from deltaserve.server.db import Database
from deltaserve.server.db_records import JOB_PREFIX, JobRecord, JobStatus, new_id
from deltaserve.server.hyperparameters import Hyperparameters, job_defaults, resolve
from deltaserve.server.progress import ProgressLog
from deltaserve.server.protocols import StepMetrics
from deltaserve.server.store import Store
from deltaserve.server.streaming import TextDelta
from deltaserve.train.config import BackwardConfig, CoServeConfig
from deltaserve.train.optim import OptimizerConfig


def samples(*lengths: int) -> list[TrainingSample]:
    return [TrainingSample(i, tuple(range(n)), tuple(range(n))) for i, n in enumerate(lengths)]


def test_hyperparameters_map_onto_the_coserver():
    data = samples(10, 21, 30)  # mean 20.33 → 21 tokens per example
    server = CoServeConfig(slo=SLOConfig(1.0, 0.1), num_epochs=2,
                           optimizer=OptimizerConfig(lr=3e-4),
                           backward=BackwardConfig(batch_tokens=256))
    defaults = job_defaults(server, max_sample_tokens=128)
    reported, training = resolve(Hyperparameters(3, 0.25, 4), data, defaults)
    assert (training.n_epochs, training.backward_batch_tokens) == (3, 4 * 21)
    assert training.learning_rate == pytest.approx(0.25 * 3e-4)
    assert reported == Hyperparameters(3, 0.25, 4)
    reported, training = resolve(Hyperparameters(), data, defaults)  # auto: the server's
    assert training.backward_batch_tokens == 256
    assert training.n_epochs == 2
    assert training.learning_rate == 3e-4
    with pytest.raises(InputError) as err:  # a service job must end
        job_defaults(CoServeConfig(slo=SLOConfig(1.0, 0.1), num_epochs=None), 128)
    assert err.value.field == "num_epochs"
    assert reported.batch_size == round(256 / 21) and reported.learning_rate_multiplier == 1.0
    for bad in ({"n_epochs": 0}, {"n_epochs": 51}, {"batch_size": 1.5}, {"n_epochs": True},
                {"learning_rate_multiplier": math.inf}, {"batch_size": "big"}):
        with pytest.raises(InputError) as err:
            Hyperparameters(**bad)
        assert err.value.field == f"hyperparameters.{next(iter(bad))}"


class ByteTokenizer:
    """Each id is one byte: decoding a cut multi-byte character gives U+FFFD, as byte-level
    BPE tokenizers do."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_text_delta_never_sends_half_a_character():
    text = "naïve café → ok"
    ids = list(text.encode())
    delta = TextDelta(ByteTokenizer(), stops=())
    sent = [delta.update(ids[: k + 1]) for k in range(len(ids))]
    assert all("\ufffd" not in s for s in sent)
    assert "".join(sent) + delta.finish(text) == text


def test_text_delta_holds_back_a_possible_stop_string():
    text = "abc STOP def"
    ids = list(text.encode())
    delta = TextDelta(ByteTokenizer(), stops=("STOP",))
    sent = "".join(delta.update(ids[: k + 1]) for k in range(ids.index(ord("S")) + 3))
    assert "STO" not in sent  # "STO" could still become the stop string
    assert sent + delta.finish("abc ") == "abc "


def _job(store: Store) -> JobRecord:
    job = JobRecord(new_id(JOB_PREFIX), 0, "m", "file-x", None, JobStatus.QUEUED,
                    Hyperparameters(), None, 0, None, 0)
    return store.add_job(job)


def test_store_pages_newest_first_and_requeues_at_the_back(tmp_path):
    store = Store(Database(tmp_path / "s.sqlite3"))
    jobs = [_job(store) for _ in range(5)]
    assert [j.queue_seq for j in jobs] == [1, 2, 3, 4, 5]
    page = store.list_jobs(None, 2)
    assert [j.id for j in page.data] == [jobs[4].id, jobs[3].id] and page.has_more
    page = store.list_jobs(jobs[1].id, 2)
    assert [j.id for j in page.data] == [jobs[0].id] and not page.has_more
    assert store.set_status(jobs[0].id, JobStatus.PAUSED, expect=(JobStatus.QUEUED,))
    assert not store.set_status(jobs[0].id, JobStatus.RUNNING, expect=(JobStatus.QUEUED,))
    assert store.set_status(jobs[0].id, JobStatus.QUEUED, expect=(JobStatus.PAUSED,),
                            requeue=True)
    queue = [j.id for j in store.jobs_with_status(JobStatus.QUEUED)]
    assert queue == [j.id for j in jobs[1:]] + [jobs[0].id]
    for step in (1, 2, 3):
        store.add_event(jobs[1].id, "m", metrics=StepMetrics(step, 1.0, 0.5, 10 * step))
    assert store.drop_metrics_after(jobs[1].id, 1) == 2
    events = store.list_events(jobs[1].id, None, 10).data
    assert [e.metrics.step for e in events] == [1]


def test_progress_lines_are_paced(caplog):
    progress = ProgressLog(interval_s=3600)
    with caplog.at_level(logging.INFO, logger="deltaserve.server.jobs"):
        for step in range(1, 101):
            progress.step("ftjob-a", StepMetrics(step, 1.0, 0.5, step))
        progress.step("ftjob-b", StepMetrics(1, 1.0, 0.5, 1))
        progress.state("ftjob-a", "Job paused")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["job ftjob-a: step 1, train_loss 1.0000, token accuracy 0.500, "
                     "1 tokens trained",
                     "job ftjob-b: step 1, train_loss 1.0000, token accuracy 0.500, "
                     "1 tokens trained",
                     "job ftjob-a: Job paused"]
