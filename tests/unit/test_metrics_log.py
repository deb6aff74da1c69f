"""metrics.jsonl as tools read it: valid JSON on every line, and a resume's history written once."""

import json
import math

from launcher.train.metrics import MetricsLog, write_results


def test_every_line_is_json_even_for_an_infinite_or_nan_figure(tmp_path):
    log = MetricsLog(tmp_path)
    log.rewrite([])
    log.append({"epoch": 1, "loss": float("inf"), "test_loss": float("-inf"), "lr": 0.1})
    log.append({"epoch": 2, "loss": float("nan"), "test_loss": 0.5, "lr": 0.05})
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]  # strict JSON
    assert rows == [{"epoch": 1, "loss": None, "test_loss": None, "lr": 0.1},
                    {"epoch": 2, "loss": None, "test_loss": 0.5, "lr": 0.05}]
    write_results(tmp_path, {"test_acc": math.inf, "epochs": 2})
    assert json.loads((tmp_path / "results.json").read_text()) == {"test_acc": None, "epochs": 2}


def test_a_resume_rewrites_the_history_it_carries_instead_of_adding_to_what_was_there(tmp_path):
    log = MetricsLog(tmp_path)
    log.rewrite([{"epoch": 1}, {"epoch": 2}, {"epoch": 3}])  # the old run got to epoch 3, its checkpoint to 2
    MetricsLog(tmp_path).rewrite([{"epoch": 1}, {"epoch": 2}])
    MetricsLog(tmp_path).append({"epoch": 3})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in lines] == [1, 2, 3]
