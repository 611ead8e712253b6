"""Where the job is in its life (coordinator/job.py: ``Phase`` and its ``Life``): each event
moves it by one method, and the table below is the whole of what may happen."""
from __future__ import annotations

import pytest

from slurm_etc.coordinator.job import Life, Phase
from slurm_etc.lifecycle import JobState

FAILED, CANCELLED = JobState.FAILED, JobState.CANCELLED


def moved(start: Life, event: str) -> Phase:
    phase = Phase(life=start)
    match event:
        case "start":
            phase.started()
        case "commit":
            phase.trains()
        case "backend ends":
            phase.end_training("the allocation ends")
        case "fatal":
            phase.end(FAILED, "the model differs")
        case "cancel":
            phase.end(CANCELLED, "SIGTERM")
    return phase


S, T, E, X = Life.STARTING, Life.TRAINING, Life.ENDING, Life.ENDED


@pytest.mark.parametrize("start,event,after", [
    (S, "start", S), (S, "commit", T), (S, "backend ends", E), (S, "fatal", X),
    (S, "cancel", X),
    (T, "start", S), (T, "commit", T), (T, "backend ends", E), (T, "fatal", X),
    (T, "cancel", X),
    # ending: no start goes back, a commit of the resize in flight leaves it ending
    (E, "start", E), (E, "commit", E), (E, "backend ends", E), (E, "fatal", X),
    (E, "cancel", X),
    (X, "start", X), (X, "commit", X), (X, "backend ends", X), (X, "fatal", X),
    (X, "cancel", X),
])
def test_each_event_moves_the_life_by_the_table(start, event, after):
    assert moved(start, event).life is after


def test_the_first_word_stands():
    phase = Phase()
    phase.end_training("the allocation ends")
    phase.end_training("scancel")
    assert (phase.life, phase.why, phase.failed) == (E, "the allocation ends", None)
    phase.end(FAILED, "vrank 1 never joined")
    phase.end(CANCELLED, "SIGTERM")  # after a fatal report: the job still ends failed
    assert (phase.life, phase.ends_as, phase.failed) == (X, FAILED, "vrank 1 never joined")
    cancelled = Phase()
    cancelled.end(CANCELLED, "SIGTERM")
    cancelled.end(FAILED, "the model differs")
    assert (cancelled.ends_as, cancelled.why, cancelled.failed) == (CANCELLED, "SIGTERM", None)
