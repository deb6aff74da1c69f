"""Before any worker starts: is every tracker `log=[...]` picks installed, is an MLflow server reachable, and
has W&B a login where it is to log online?

A tracker that is not: one line and exit 2 (`log.required=true`, the default), or, with `log.required=false`,
a warning, and the run goes on without it (the config the workers get no longer picks it). Nothing here
imports a tracker's package: `importlib.util.find_spec` says whether it is installed, and an MLflow server is
asked for its /health over plain HTTP. The trackers themselves live in launcher/train/trackers.py.
"""

from __future__ import annotations

import importlib.util
import os
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from launcher.config import TRACKER_PACKAGES, Config, derive
from launcher.errors import LaunchError

REACH_TIMEOUT_S = 5.0
# The tracking URIs MLflow takes: a server, a database, a folder (file:, or a plain path), Databricks
MLFLOW_SCHEMES = ("http", "https", "file", "sqlite", "postgresql", "mysql", "mssql", "databricks", "databricks-uc",
                  "uc")
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
    if name == "wandb" and str(cfg.log.wandb.mode) == "online" and wandb_login() is None:
        return ("log.wandb.mode=online, and W&B has no login here (none in WANDB_API_KEY, ~/.netrc or its settings "
                "files): run wandb login first, or keep log.wandb.mode=offline and wandb sync the run later")
    uri = mlflow_uri(cfg) if name == "mlflow" else None
    store = _store_problem(uri, probe=not cfg.dry_run) if uri else None
    if store:
        return store
    if uri and uri.split(":", 1)[0].lower() in ("http", "https") and not cfg.dry_run:  # (a dry run contacts nothing)
        try:
            with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=REACH_TIMEOUT_S) as answer:
                if answer.status >= 400:
                    raise urllib.error.HTTPError(uri, answer.status, "", answer.headers, None)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", None) or exc
            where = urllib.parse.urlsplit(uri)
            return (f"the MLflow server at {uri} is not reachable ({str(reason).strip()[:120]}); start it "
                    f"(mlflow server --host {where.hostname or '127.0.0.1'} --port {where.port or 5000}) or give "
                    f"its address with log.mlflow.tracking_uri=http://HOST:PORT")
    return None


def wandb_login() -> str | None:
    """Where W&B would find a login, as its client looks (WANDB_API_KEY or an identity token file, a .netrc
    entry for its host, an api_key in its settings files), or None where there is none."""
    import configparser
    import netrc

    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return "the environment"
    host = urllib.parse.urlsplit(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or ""
    home = Path.home()
    for path in [Path(os.environ["NETRC"])] if os.environ.get("NETRC") else [home / ".netrc", home / "_netrc"]:
        try:
            if path.is_file() and netrc.netrc(str(path)).authenticators(host):
                return str(path)
        except (OSError, netrc.NetrcParseError):
            continue
    config_dir = Path(os.environ.get("WANDB_CONFIG_DIR") or home / ".config" / "wandb")
    for path in (config_dir / "settings", Path.cwd() / "wandb" / "settings"):
        settings = configparser.ConfigParser()
        try:
            settings.read(path)
        except (OSError, configparser.Error):
            continue
        if any(settings.get(section, "api_key", fallback=None) for section in settings.sections()):
            return str(path)
    return None


# A database store's URI scheme (before any +driver) -> the modules of the drivers SQLAlchemy may use for it, one
# needed; and a driver named in the URI (postgresql+psycopg2://) -> its module, where the two names differ
DATABASE_DRIVERS = {"postgresql": ("psycopg2", "psycopg", "pg8000"), "mysql": ("pymysql", "MySQLdb", "mysql.connector"),
                    "mssql": ("pyodbc", "pymssql")}
PIP_NAMES = {"psycopg2": "psycopg2-binary", "MySQLdb": "mysqlclient", "mysql.connector": "mysql-connector-python"}
DRIVER_MODULES = {"psycopg2": "psycopg2", "psycopg": "psycopg", "pg8000": "pg8000", "pymysql": "pymysql",
                  "mysqldb": "MySQLdb", "mysqlconnector": "mysql.connector", "pyodbc": "pyodbc", "pymssql": "pymssql"}


def _store_problem(uri: str, probe: bool) -> str | None:
    """What keeps MLflow from opening a database store here, found without opening it, or None: a SQLite file
    whose folder does not exist or cannot be written (MLflow retries for about two minutes, then the tracker
    fails mid-run), or a database whose driver is not installed. `probe`: make and remove a file beside the
    SQLite file to know (not in a dry run, which touches nothing)."""
    scheme = uri.split(":", 1)[0].lower()
    if scheme == "sqlite" and uri.lower().startswith("sqlite:///"):
        path = Path(os.path.abspath(uri[len("sqlite:///"):]))  # (sqlite:////abs/x.db: an absolute path)
        folder = path.parent
        if path.is_dir():
            return f"the MLflow store {uri} cannot be opened: {path} is a folder, not a database file"
        if not folder.is_dir():
            return (f"the MLflow store {uri} cannot be opened: the folder {folder} does not exist (create it, or "
                    f"give log.mlflow.tracking_uri=sqlite:///mlflow.db for a file where launch runs)")
        if probe and not path.exists():  # (root passes os.access where files still cannot be made: /proc)
            import tempfile

            try:
                with tempfile.NamedTemporaryFile(dir=folder, prefix=".launch-probe-"):
                    pass
            except OSError as exc:
                return (f"the MLflow store {uri} cannot be opened: no file can be made in {folder} "
                        f"({exc.strerror or exc})")
        elif not os.access(path if path.exists() else folder, os.W_OK):
            return f"the MLflow store {uri} cannot be opened: {path if path.exists() else folder} is not writable"
    base = scheme.split("+", 1)[0]
    if base in DATABASE_DRIVERS:
        driver = scheme.split("+", 1)[1] if "+" in scheme else None
        wanted = (DRIVER_MODULES.get(driver),) if driver else DATABASE_DRIVERS[base]
        if None not in wanted and not any(importlib.util.find_spec(module) for module in wanted):
            return (f"the MLflow store {uri} needs a {base} driver, and none is installed here ({', '.join(wanted)}; "
                    f"e.g. pip install {PIP_NAMES.get(wanted[0], wanted[0])})")
    return None


def _not_a_uri(uri: str) -> str | None:
    """What is wrong with a tracking URI MLflow would misread, or None: a server's address without http://
    (MLflow takes `127.0.0.1:5000` for a folder of that name), or a scheme it has no store for."""
    import re

    if re.fullmatch(r"[\w.-]+:\d+(/.*)?", uri):
        return (f"log.mlflow.tracking_uri={uri} is not valid: a server's address starts with http:// (MLflow would "
                f"take it for a folder named so): log.mlflow.tracking_uri=http://{uri}")
    scheme = uri.split("://", 1)[0].lower() if "://" in uri else None
    if scheme is not None and scheme not in MLFLOW_SCHEMES:
        return (f"log.mlflow.tracking_uri={uri} is not valid: MLflow has no store for {scheme}://; it takes "
                f"http(s)://HOST:PORT (a server), sqlite:///FILE, file:/FOLDER or a database URI "
                f"(e.g. log.mlflow.tracking_uri=http://127.0.0.1:5000)")
    return None


def check(cfg: Config) -> tuple[Config, list[str]]:
    """(the config the workers get, warnings). Raises a LaunchError (exit 2) for a tracker that cannot work
    where log.required is true; otherwise that tracker is left out, with a warning."""
    picked = cfg.log.chosen
    if cfg.tensorboard is False and "tensorboard" in picked:  # (the older switch turns it off)
        cfg = derive(cfg, log=derive(cfg.log, tensorboard=None))
        picked.remove("tensorboard")
    uri = mlflow_uri(cfg) if "mlflow" in picked else None
    wrong = _not_a_uri(uri) if uri else None
    if wrong:  # (bad input, whatever log.required says)
        raise LaunchError(wrong)
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
