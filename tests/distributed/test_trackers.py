"""What users expect around a run: trackers (a real MLflow server on 127.0.0.1, read back through its REST
API; W&B offline; metrics.csv), early stopping on 1 and 2 gloo ranks, and the best checkpoints kept beside
last.pt (plain and sharded), evaluated and exported by `best`."""

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

mlflow = pytest.importorskip("mlflow")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """`mlflow server` on 127.0.0.1, with a database and an artifact store of its own; its URI."""
    where = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    log = open(where / "server.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                               "--backend-store-uri", f"sqlite:///{where}/mlflow.db",
                               "--artifacts-destination", str(where / "artifacts"), "--workers", "1"],
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                              env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})  # (no job runners)
    uri = f"http://127.0.0.1:{port}"
    deadline = time.time() + 90
    while True:
        try:
            with urllib.request.urlopen(uri + "/health", timeout=2) as answer:
                if answer.status == 200:
                    break
        except OSError:
            pass
        if server.poll() is not None or time.time() > deadline:
            server.kill()
            pytest.fail("mlflow server did not start: " + (where / "server.log").read_text()[-2000:])
        time.sleep(0.5)
    yield uri
    os.killpg(server.pid, 15)
    server.wait(timeout=30)
    log.close()


def rest(uri: str, endpoint: str, **query) -> dict:
    with urllib.request.urlopen(f"{uri}/api/2.0/mlflow/{endpoint}?{urllib.parse.urlencode(query)}", timeout=30) as a:
        return json.loads(a.read())


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_run_logs_its_config_metrics_and_artifacts_to_an_mlflow_server(launch, tmp_path, mlflow_server):
    result = launch("gpus=[]", "epochs=3", "log=[tensorboard,mlflow,csv]", f"log.mlflow.tracking_uri={mlflow_server}",
                    "hydra.run.dir=run")
    assert result.returncode == 0, result.output
    run_dir = tmp_path / "run"
    epochs = rows(run_dir)
    run_id = json.loads((run_dir / ".mlflow-run.json").read_text())["run_id"]
    run = rest(mlflow_server, "runs/get", run_id=run_id)["run"]
    assert run["info"]["status"] == "FINISHED" and run["info"]["run_name"] == "run"
    # the run's address said once, in the launcher's words (not MLflow's own "View run" lines)
    address = f"{mlflow_server}/#/experiments/{run['info']['experiment_id']}/runs/{run_id}"
    assert result.output.count(f"mlflow: this run is at {address}") == 1 and "View run" not in result.output
    experiment = rest(mlflow_server, "experiments/get", experiment_id=run["info"]["experiment_id"])["experiment"]
    assert experiment["name"] == "digits"  # the recipe's name
    params = {p["key"]: p["value"] for p in run["data"]["params"]}
    assert params["epochs"] == "3" and params["recipe.name"] == "digits" and params["optim.name"] == "sgd"
    assert float(params["lr"]) == 0.05 and params["strategy.name"] == "auto"
    tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
    assert tags["launch.run_dir"] == str(run_dir.resolve())
    for key in ("loss", "test_acc", "test_loss", "img_per_s", "lr"):
        history = rest(mlflow_server, "metrics/get-history", run_id=run_id, metric_key=key)["metrics"]
        assert [(m["step"], m["value"]) for m in sorted(history, key=lambda m: m["step"])] == \
               [(r["epoch"], pytest.approx(r[key])) for r in epochs], key
    listed = rest(mlflow_server, "artifacts/list", run_id=run_id)["files"]
    assert {f["path"] for f in listed} == {"curves.png", "results.json", "model"}
    [weights] = rest(mlflow_server, "artifacts/list", run_id=run_id, path="model")["files"]
    assert weights["path"] == "model/model.pt" and weights["file_size"] > 100_000  # digits' CNN, a state_dict
    # the run's own files, as without trackers; metrics.csv holds what metrics.jsonl holds
    assert (run_dir / "tensorboard").is_dir() and (run_dir / "checkpoints" / "last.pt").is_file()
    import csv

    with open(run_dir / "metrics.csv") as f:
        table = list(csv.DictReader(f))
    assert [(int(r["epoch"]), float(r["test_acc"])) for r in table] == [(r["epoch"], r["test_acc"]) for r in epochs]


def test_a_sweeps_runs_are_children_of_one_mlflow_parent_run(launch, tmp_path, mlflow_server):
    result = launch("-m", "gpus=[]", "epochs=1", "lr=0.05,0.1", "log=[mlflow]",
                    f"log.mlflow.tracking_uri={mlflow_server}", "log.mlflow.experiment=sweep-test",
                    "hydra.sweep.dir=sweep", timeout=300)
    assert result.returncode == 0, result.output
    ids = [json.loads((tmp_path / "sweep" / n / ".mlflow-run.json").read_text())["run_id"] for n in ("0", "1")]
    runs = [rest(mlflow_server, "runs/get", run_id=i)["run"] for i in ids]
    parents = {({t["key"]: t["value"] for t in r["data"]["tags"]})["mlflow.parentRunId"] for r in runs}
    assert len(parents) == 1
    parent = rest(mlflow_server, "runs/get", run_id=parents.pop())["run"]
    assert parent["info"]["run_name"] == "sweep"
    assert "View run" not in result.output  # (MLflow's own lines, for the parent run too)
    assert sorted(float({p["key"]: p["value"] for p in r["data"]["params"]}["lr"]) for r in runs) == [0.05, 0.1]


def test_an_unreachable_tracker_is_one_line_before_any_worker_or_a_warning_with_required_false(launch, tmp_path):
    port = free_port()  # (nothing listens there)
    result = launch("gpus=[]", "epochs=1", "log=[mlflow]", f"log.mlflow.tracking_uri=http://127.0.0.1:{port}",
                    timeout=120)
    lines = [x for x in result.stderr.splitlines() if x.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.output
    assert f"the MLflow server at http://127.0.0.1:{port} is not reachable" in lines[0]
    assert "log.required=false" in lines[0]
    assert not list(tmp_path.glob("outputs/*/*/train.log"))  # nothing started
    going = launch("gpus=[]", "epochs=1", "log=[mlflow,csv]", f"log.mlflow.tracking_uri=http://127.0.0.1:{port}",
                   "log.required=false", "hydra.run.dir=on", timeout=120)
    assert going.returncode == 0, going.output
    assert "the run goes on without mlflow" in going.output
    assert (tmp_path / "on" / "metrics.csv").is_file() and (tmp_path / "on" / "results.json").is_file()


class Refusing(BaseHTTPRequestHandler):
    """A 'tracking server' that is up (/health answers) and then unavailable to every call of the tracking API
    (503: what a server going down behind its proxy answers, and what MLflow's client retries)."""

    def do_GET(self):
        self.send_response(200 if self.path.startswith("/health") else 503)
        self.end_headers()
        self.wfile.write(b"OK" if self.path.startswith("/health") else b'{"error_code": "TEMPORARILY_UNAVAILABLE"}')

    do_POST = do_GET

    def log_message(self, *args):
        pass


def test_a_tracker_failing_mid_run_is_said_once_and_the_run_and_its_files_go_on(launch, tmp_path):
    server = HTTPServer(("127.0.0.1", 0), Refusing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    started = time.perf_counter()
    try:
        result = launch("gpus=[]", "epochs=2", "log=[mlflow,csv]",
                        f"log.mlflow.tracking_uri=http://127.0.0.1:{server.server_port}", "hydra.run.dir=run",
                        timeout=180)
    finally:
        server.shutdown()
    assert result.returncode == 0, result.output
    assert result.output.count("log: mlflow failed") == 1, result.output
    assert "Retrying" not in result.output  # (urllib3's retry lines stay out of the console)
    assert time.perf_counter() - started < 90  # (a few seconds of retries, not MLflow's two minutes)
    run_dir = tmp_path / "run"
    assert len(rows(run_dir)) == 2 and (run_dir / "checkpoints" / "last.pt").is_file()
    assert json.loads((run_dir / "results.json").read_text())["epochs_run"] == 2
    assert len((run_dir / "metrics.csv").read_text().splitlines()) == 3  # (the other tracker went on)


def wandb_records(path: Path):
    """The records of a W&B run file (its LevelDB-style log of protobuf Records), to read an offline run."""
    from wandb.proto import wandb_internal_pb2

    data, pos, pending = path.read_bytes(), 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def test_wandb_offline_keeps_every_epoch_under_the_run_dir_and_leaves_no_process(launch, tmp_path):
    pytest.importorskip("wandb")
    result = launch("gpus=[]", "epochs=2", "log=[wandb]", "hydra.run.dir=run", timeout=180)
    assert result.returncode == 0, result.output
    run_dir = tmp_path / "run"
    [record_file] = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    assert f"W&B offline: wandb sync {record_file.parent}" in result.output  # (the way to send it, said)
    history, artifacts, names = [], set(), []
    for record in wandb_records(record_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item})
        elif kind == "artifact":
            artifacts.add(record.artifact.type)
        elif kind == "run":
            names.append((record.run.project, record.run.display_name))
    assert names[0] == ("launch-digits", "run")
    assert [(h["_step"], h["test_acc"]) for h in history] == [(r["epoch"], pytest.approx(r["test_acc"]))
                                                              for r in rows(run_dir)]
    assert artifacts == {"run-outputs", "model"}
    assert not (run_dir / "tensorboard").exists()  # (log=[wandb] picks W&B alone)
    time.sleep(1)
    leftover = subprocess.run(["pgrep", "-f", "wandb-core"], capture_output=True, text=True).stdout.split()
    assert not leftover, "a W&B service process outlived the launch"


# ---- early stopping ---------------------------------------------------------------------------------

@pytest.mark.parametrize("ranks", [1, 2])
def test_early_stopping_stops_a_stalled_figure_at_the_expected_epoch_on_every_rank(launch, tmp_path, ranks):
    # lr=1e-9: the held-out loss is flat from the first epoch on, so with patience 2 the run stops after epoch 3
    world = ["strategy=ddp", f"nprocs={ranks}"] if ranks > 1 else []
    result = launch("gpus=[]", *world, "epochs=8", "lr=1e-9", "early_stop.metric=val/loss", "early_stop.patience=2",
                    "early_stop.min_delta=0.001", "hydra.run.dir=outputs/run", timeout=240)
    assert result.returncode == 0, result.output
    run_dir = tmp_path / "outputs" / "run"
    results = json.loads((run_dir / "results.json").read_text())
    stopped = results["stopped_early"]
    assert stopped["epoch"] == 3 and stopped["metric"] == "test_loss" and stopped["best_epoch"] == 1
    assert results["epochs_run"] == 3 and results["epochs"] == 8 and len(rows(run_dir)) == 3
    assert "stopping early: test_loss has not fallen by more than 0.001 in 2 evaluations" in result.output
    assert "stopped early after epoch 3 of 8" in result.output
    assert results["ranks_agree"] and len(results["weights_sha256"]) == ranks
    import torch

    assert torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["epoch"] == 3
    listed = launch("runs", "--json", timeout=120)
    [shown] = json.loads(listed.stdout)
    assert shown["state"] == "stopped early (test_loss)" and shown["epochs"] == "3/8"


def test_a_run_whose_patience_ends_with_its_last_epoch_finished_and_did_not_stop_early(launch, tmp_path):
    """The same stalled figure over exactly 3 epochs: the run trained every epoch it was given, so it reports
    none of early stopping (the judgement is only for epochs still to come)."""
    result = launch("gpus=[]", "epochs=3", "lr=1e-9", "early_stop.metric=val/loss", "early_stop.patience=2",
                    "early_stop.min_delta=0.001", "hydra.run.dir=outputs/run", timeout=240)
    assert result.returncode == 0, result.output
    results = json.loads((tmp_path / "outputs" / "run" / "results.json").read_text())
    assert results["epochs_run"] == 3 and results["stopped_early"] is None, results["stopped_early"]
    assert "stopped early" not in result.output


# ---- the best checkpoints ---------------------------------------------------------------------------

def test_keep_best_keeps_exactly_the_best_two_and_eval_best_gives_the_best_epochs_figure(launch, tmp_path):
    result = launch("gpus=[]", "epochs=6", "lr=0.02", "checkpoint.keep_best=2", "checkpoint.metric=test/accuracy",
                    "hydra.run.dir=run", timeout=240)
    assert result.returncode == 0, result.output
    run_dir = tmp_path / "run"
    epochs = rows(run_dir)
    ranked = sorted(epochs, key=lambda r: (-r["test_acc"], r["epoch"]))[:2]  # (a tie keeps the earlier epoch)
    folder = run_dir / "checkpoints"
    names = sorted(p.name for p in folder.iterdir())
    assert names == sorted(["best.json", "best.pt", "last.pt", "previous.pt",
                            *(f"best-epoch-{r['epoch']:04d}.pt" for r in ranked)])
    assert os.path.samefile(folder / "best.pt", folder / f"best-epoch-{ranked[0]['epoch']:04d}.pt")
    evaluated = launch("eval", "run", "best", "gpus=[]", timeout=240)
    assert evaluated.returncode == 0, evaluated.output
    [report] = [json.loads(p.read_text()) for p in tmp_path.glob("outputs/*/*/eval.json")]
    assert report["trained_epochs"] == ranked[0]["epoch"]
    assert report["test_acc"] == pytest.approx(ranked[0]["test_acc"], abs=1e-9)
    assert report["test_loss"] == pytest.approx(ranked[0]["test_loss"], rel=1e-5)
    exported = launch("export", "run", "best", timeout=120)
    assert exported.returncode == 0, exported.output
    assert (run_dir / "model-best.pt").is_file() and f"after epoch {ranked[0]['epoch']}" in exported.output


def test_keep_best_with_sharded_checkpoints_keeps_their_shard_folders(launch, tmp_path):
    result = launch("recipe=text", f"data.root={tmp_path / 'text-data'}", "gpus=[]", "strategy=fsdp", "nprocs=2",
                    "epochs=3", "recipe.layers=1",
                    "recipe.width=32", "recipe.heads=2", "recipe.context=32", "recipe.max_bytes=30000",
                    "recipe.sample_bytes=0", "batch_size=32", "checkpoint.keep_best=1", "checkpoint.metric=val/loss",
                    # (the highest loss ranks first: the best is epoch 1, older than both folders last.pt (3) and
                    # previous.pt (2) name, so only best.json keeps its shards)
                    "checkpoint.mode=max", "hydra.run.dir=run",
                    timeout=300)
    assert result.returncode == 0, result.output
    run_dir = tmp_path / "run"
    index = json.loads((run_dir / "checkpoints" / "best.json").read_text())
    [best] = index["kept"]
    assert index["metric"] == "test_loss" and best["shards"] == f"epoch-{best['epoch']}.dcp"
    assert (run_dir / "checkpoints" / best["shards"] / ".metadata").is_file()
    held = {r["epoch"]: r["test_loss"] for r in rows(run_dir)}
    assert best["epoch"] == max(held, key=lambda e: (held[e], -e)) < 3
    evaluated = launch("eval", "run", "best", "gpus=[]", timeout=240)
    assert evaluated.returncode == 0, evaluated.output
    [report] = [json.loads(p.read_text()) for p in tmp_path.glob("outputs/*/*/eval.json")]
    assert report["trained_epochs"] == best["epoch"]
    assert report["test_loss"] == pytest.approx(held[best["epoch"]], rel=1e-4)
