"""Before any worker starts: is every tracker `log=[...]` picks installed, and is an MLflow server reachable?

A tracker that is not: one line and exit 2 (`log.required=true`, the default), or, with `log.required=false`,
a warning, and the run goes on without it (the config the workers get no longer picks it). Nothing here
imports a tracker's package: `importlib.util.find_spec` says whether it is installed, and an MLflow server is
asked for its /health over plain HTTP. The trackers themselves live in launcher/train/trackers.py.
"""

from __future__ import annotations

import importlib.util
import os
import urllib.error
import urllib.request

from launcher.config import TRACKER_PACKAGES, Config, derive
from launcher.errors import LaunchError

REACH_TIMEOUT_S = 5.0
INSTALL = {"mlflow": "pip install mlflow", "wandb": "pip install wandb", "tensorboard": "pip install tensorboard"}


def mlflow_uri(cfg: Config) -> str | None:
    """The tracking URI the workers will use, where the config or MLFLOW_TRACKING_URI names one."""
    section = cfg.log.mlflow
    given = section.tracking_uri if section is not None else None
    return str(given) if given else (os.environ.get("MLFLOW_TRACKING_URI") or None)


def _problem(cfg: Config, name: str) -> str | None:
    """What keeps tracker `name` from working here, or None."""
    package = TRACKER_PACKAGES[name]
    if package is not None and importlib.util.find_spec(package) is None:
        return f"log picks {name}, and the {package} package is not installed here ({INSTALL[name]})"
    uri = mlflow_uri(cfg) if name == "mlflow" and not cfg.dry_run else None  # (a dry run contacts nothing)
    if uri and uri.split(":", 1)[0].lower() in ("http", "https"):
        try:
            with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=REACH_TIMEOUT_S) as answer:
                if answer.status >= 400:
                    raise urllib.error.HTTPError(uri, answer.status, "", answer.headers, None)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", None) or exc
            return (f"the MLflow server at {uri} is not reachable ({str(reason).strip()[:120]}); start it "
                    f"(mlflow server --host 127.0.0.1 --port 5000) or give its address with "
                    f"log.mlflow.tracking_uri=http://HOST:PORT")
    return None


def check(cfg: Config) -> tuple[Config, list[str]]:
    """(the config the workers get, warnings). Raises a LaunchError (exit 2) for a tracker that cannot work
    where log.required is true; otherwise that tracker is left out, with a warning."""
    picked = cfg.log.chosen
    if cfg.tensorboard is False and "tensorboard" in picked:  # (the older switch turns it off)
        cfg = derive(cfg, log=derive(cfg.log, tensorboard=None))
        picked.remove("tensorboard")
    warnings: list[str] = []
    for name in picked:
        problem = _problem(cfg, name)
        if problem is None:
            continue
        if cfg.log.required:
            raise LaunchError(f"{problem}; or drop it from log=[...], or log.required=false to run without it")
        warnings.append(f"{problem}; the run goes on without {name} (log.required=false)")
        cfg = derive(cfg, log=derive(cfg.log, **{name: None}))
    return cfg, warnings
