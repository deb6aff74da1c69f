"""The bytecode cache: kept only where torch has no .pyc and Python would write none, and then never
beside the sources."""

import importlib.util
import sys
from pathlib import Path

import pytest

from launcher import bytecode


@pytest.fixture
def package_without_bytecode(tmp_path, monkeypatch):
    src = tmp_path / "src" / "heavy_pkg"
    src.mkdir(parents=True)
    (src / "__init__.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(src.parent))
    monkeypatch.setattr(sys, "pycache_prefix", None)
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    return src


def test_a_package_without_bytecode_under_pythondontwritebytecode_needs_the_cache(package_without_bytecode):
    assert bytecode.lacks_bytecode("heavy_pkg", dont_write=True)
    assert not bytecode.lacks_bytecode("heavy_pkg", dont_write=False)  # Python writes it beside the sources
    pyc = Path(importlib.util.cache_from_source(str(package_without_bytecode / "__init__.py")))
    pyc.parent.mkdir()
    pyc.write_bytes(b"")
    assert not bytecode.lacks_bytecode("heavy_pkg", dont_write=True)  # installed with bytecode: nothing to do


def test_enabling_points_this_and_later_processes_at_the_cache(tmp_path, package_without_bytecode):
    env = {"LAUNCH_PYCACHE": "1", "LAUNCH_PYCACHE_DIR": str(tmp_path / "cache")}
    note = bytecode.enable(env)
    assert note and str(tmp_path / "cache") in note and "LAUNCH_PYCACHE=0" in note
    assert env["PYTHONPYCACHEPREFIX"] == str(tmp_path / "cache")
    assert sys.pycache_prefix == str(tmp_path / "cache") and sys.dont_write_bytecode is False
    assert bytecode.enable(dict(env, PYTHONPYCACHEPREFIX=str(tmp_path / "cache"))) is None  # said once


def test_switched_off_or_a_users_own_prefix_changes_nothing(tmp_path, package_without_bytecode):
    off = {"LAUNCH_PYCACHE": "0", "LAUNCH_PYCACHE_DIR": str(tmp_path / "cache")}
    assert bytecode.enable(off) is None and "PYTHONPYCACHEPREFIX" not in off and not (tmp_path / "cache").exists()
    own = {"PYTHONPYCACHEPREFIX": str(tmp_path / "mine")}
    assert bytecode.enable(own) is None and own == {"PYTHONPYCACHEPREFIX": str(tmp_path / "mine")}
    assert sys.pycache_prefix is None and sys.dont_write_bytecode is True


def test_where_torch_has_its_bytecode_no_cache_is_kept(tmp_path, monkeypatch, package_without_bytecode):
    monkeypatch.setattr(bytecode, "lacks_bytecode", lambda package, dont_write: False)
    env = {"LAUNCH_PYCACHE_DIR": str(tmp_path / "cache")}  # (LAUNCH_PYCACHE: auto)
    assert bytecode.enable(env) is None and "PYTHONPYCACHEPREFIX" not in env and not (tmp_path / "cache").exists()
