"""Prefect progress of a task: steps and public stage names only (a loss passed along never reaches a
log line), and a later stage of the same task (DP-OPT's leakage audit) has its own progress bar."""

import tasks.prefect_tasks as pt


def test_progress_shows_steps_and_stages_never_a_loss(monkeypatch):
    lines, created, updates = [], [], []

    class Logger:
        def info(self, fmt, *args):
            lines.append(fmt % args)

    monkeypatch.setattr(pt, "get_run_logger", lambda: Logger())
    monkeypatch.setattr(pt, "create_progress_artifact",
                        lambda progress, description: created.append(description) or f"id{len(created)}")
    monkeypatch.setattr(pt, "update_progress_artifact", lambda aid, progress: updates.append((aid, progress)))
    report = pt.progress_reporter("dp_opt")
    report(1, 4, 0.123456)  # a mean training loss: an exact statistic of private data
    report(4, 4)
    report(5, 10, stage="leakage audit")
    assert lines == ["dp_opt: step 1/4 (25%)", "dp_opt: step 4/4 (100%)", "dp_opt leakage audit: step 5/10 (50%)"]
    assert created == ["dp_opt progress", "dp_opt leakage audit progress"]
    assert updates == [("id1", 25.0), ("id1", 100.0), ("id2", 50.0)]
    assert not any("0.123" in line for line in lines)
