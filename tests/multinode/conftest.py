"""Two "machines" on one: network namespaces joined by a veth pair, each with its own address, made by
the test session itself (root only) and deleted afterwards. Addresses come from 198.18.0.0/15, the
benchmarking range (RFC 2544), which is never routed anywhere; traffic stays on the veth pair.

`hosts.start(i, *overrides, cwd=...)` starts `launch` inside namespace i as a user would on that machine:
a fork of that namespace's warm launcher (tests/warm.py, started under `ip netns exec`), or a fresh
`python -m launcher` under `ip netns exec` where the test needs one: in a mount namespace of its own where
given folders are hidden (a node that does not share rank 0's file system), or tagged in its environment
(a fork's /proc/PID/environ is its server's) so that the test can find every process it left."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import clean_env, launch_command
from tests.warm import WarmLauncher

SUBNET = "198.18.0"


@dataclass
class Hosts:
    names: list[str]
    addresses: list[str]
    devices: list[str]
    warm: list[WarmLauncher]

    def command(self, i: int, *overrides: str, hide: tuple[Path, ...] = ()) -> list[str]:
        """`launch overrides...` inside namespace i; `hide`: folders this host does not see (each covered
        by an empty tmpfs in a mount namespace of its own)."""
        inner = launch_command(*overrides)
        if hide:
            mounts = " && ".join(f"mount -t tmpfs none {shlex.quote(str(p))}" for p in hide)
            inner = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                     f"{mounts} && exec {shlex.join(inner)}"]
        return ["ip", "netns", "exec", self.names[i], *inner]

    def start(self, i: int, *overrides: str, cwd: Path, tag: str = "", hide: tuple[Path, ...] = ()):
        """The launch on host i, as a subprocess.Popen (or a WarmLaunch, used the same way)."""
        env = clean_env(**({"LAUNCH_TEST_TAG": tag} if tag else {}))
        if not tag and not hide:
            return self.warm[i].start(list(overrides), cwd, env)
        return subprocess.Popen(self.command(i, *overrides, hide=hide), cwd=cwd, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@pytest.fixture(scope="session")
def hosts():
    """Two network namespaces, 198.18.0.1 and 198.18.0.2 on a veth pair, or a skip saying why not."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2 (CI runs as root)")
    tag = f"{os.getpid() % 100000}"
    names = [f"launch-a{tag}", f"launch-b{tag}"]
    devices = [f"lva{tag}", f"lvb{tag}"]
    addresses = [f"{SUBNET}.1", f"{SUBNET}.2"]
    made: list[str] = []
    try:
        for name in names:
            _ip("netns", "add", name)
            made.append(name)
        _ip("link", "add", devices[0], "type", "veth", "peer", "name", devices[1])
        for name, device, address in zip(names, devices, addresses, strict=True):
            _ip("link", "set", device, "netns", name)
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", device)
            _ip("-n", name, "link", "set", device, "up")
            _ip("-n", name, "link", "set", "lo", "up")
    except (subprocess.CalledProcessError, OSError) as err:
        for name in made:
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)
        detail = getattr(err, "stderr", "") or str(err)
        pytest.skip(f"network namespaces cannot be made here: {detail.strip()}")
    # Each "machine" knows both by name, as a cluster's hosts do: `ip netns exec` puts /etc/netns/NAME/hosts
    # over /etc/hosts. (Without it torch's stores look the peers' names up in DNS, which a namespace
    # cannot reach, and warn "The hostname of the client socket cannot be retrieved" on every connection.)
    etc = [Path("/etc/netns") / name for name in names]
    # (both forms of each IPv4 address: torch's sockets are dual-stack and see peers as ::ffff:a.b.c.d)
    table = "".join(f"{a} {n}\n::ffff:{a} {n}\n" for a, n in zip(["127.0.0.1", *addresses], ["localhost", *names],
                                                                  strict=True)) + "::1 localhost\n"
    for folder in etc:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "hosts").write_text(table)
    warm = [WarmLauncher(prefix=("ip", "netns", "exec", name)) for name in names]
    try:
        yield Hosts(names, addresses, devices, warm)
    finally:
        for launcher in warm:
            launcher.close()
        for name in names:  # (deleting a namespace deletes its end of the veth pair, and so the pair)
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=30)
        for folder in etc:
            shutil.rmtree(folder, ignore_errors=True)
