"""The start-up timeline: milestones in order, the first mark of each kept, one readable line."""

import time

from launcher.train.timeline import ORDER, StartupTimeline


def test_marks_are_seconds_since_launch_in_milestone_order():
    timeline = StartupTimeline(time.time() - 2.0, {"spawn": 0.5})
    timeline.mark("first_step")
    timeline.mark("worker_process")
    timeline.mark("worker_process")  # a second mark (e.g. after a restart) does not move the first
    marks = timeline.as_dict()
    assert list(marks) == ["spawn", "worker_process", "first_step"]
    assert marks["spawn"] == 0.5 and 2.0 <= marks["worker_process"] < 3.0
    assert timeline.describe().startswith("start-up, seconds since launch: spawn 0.5, worker process 2.")
    assert set(ORDER) >= set(marks)


def test_a_second_mark_keeps_the_first_time_even_seconds_later(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(time, "time", lambda: now[0])
    timeline = StartupTimeline(990.0)
    timeline.mark("spawn")
    now[0] = 1030.0  # a restart, half a minute later, reaches the same milestone again
    timeline.mark("spawn")
    timeline.mark("first_step")
    assert timeline.as_dict() == {"spawn": 10.0, "first_step": 40.0}
