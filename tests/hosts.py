"""Test hosts on one machine: network namespaces joined by veth links to one switch, torn down after.

A :class:`Hosts` makes a switch (a namespace holding a bridge) and, per host, a namespace whose ``eth0``
is one end of a veth pair whose other end is a port of that bridge, with an address of its own
(``10.250.0.N/24``: it exists only inside these namespaces, so nothing outside them is ever reached).
``run`` starts a command on a host (``ip netns exec``), ``cut`` / ``mend`` take its link down and up
at the switch (the host and its processes live on, unreachable: a partition, not a crash), and
``close`` kills what ran and deletes every namespace. Needs root and iproute2 (the VM and CI run as
root); :func:`unavailable` says why not where they are missing, for the tests to skip with.

The kernel here has no ``netem``, so links have no added latency.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from typing import Self


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *(["netns", "exec", ns, "ip"] if ns else []), *args]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {res.stderr.strip()}")


def unavailable() -> str | None:
    """Why test hosts cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"kkprobe{uuid.uuid4().hex[:6]}"
    try:
        _ip("netns", "add", probe)
    except (RuntimeError, FileNotFoundError) as exc:
        return f"cannot make a network namespace: {exc}"
    _ip("netns", "del", probe)
    return None


class Hosts:
    """Named hosts on one switch; ``addr[name]`` is a host's address."""

    def __init__(self, names: list[str]):
        self.tag = uuid.uuid4().hex[:5]  # several test workers may each make hosts at once
        self.switch = f"kk{self.tag}sw"
        self.ns: dict[str, str] = {}
        self.addr: dict[str, str] = {}
        self._port: dict[str, str] = {}
        self._procs: list[subprocess.Popen] = []
        try:
            _ip("netns", "add", self.switch)
            _ip("link", "set", "lo", "up", ns=self.switch)
            _ip("link", "add", "br0", "type", "bridge", ns=self.switch)
            _ip("link", "set", "br0", "up", ns=self.switch)
            for i, name in enumerate(names, start=1):
                self._add(name, i)
        except BaseException:
            self.close()
            raise

    def _add(self, name: str, i: int) -> None:
        ns, here, there = f"kk{self.tag}{name}", f"kk{self.tag}h{i}", f"kk{self.tag}p{i}"  # <= 15 chars
        _ip("netns", "add", ns)
        self.ns[name] = ns
        _ip("link", "add", here, "type", "veth", "peer", "name", there)
        _ip("link", "set", here, "netns", ns)
        _ip("link", "set", there, "netns", self.switch)
        _ip("link", "set", here, "name", "eth0", ns=ns)
        _ip("addr", "add", f"10.250.0.{i}/24", "dev", "eth0", ns=ns)
        _ip("link", "set", "eth0", "up", ns=ns)
        _ip("link", "set", "lo", "up", ns=ns)
        _ip("link", "set", there, "master", "br0", ns=self.switch)
        _ip("link", "set", there, "up", ns=self.switch)
        self.addr[name], self._port[name] = f"10.250.0.{i}", there

    def prefix(self, name: str) -> list[str]:
        """The words that run a command on host ``name``."""
        return ["ip", "netns", "exec", self.ns[name]]

    def run(self, name: str, argv: list[str], **popen) -> subprocess.Popen:
        proc = subprocess.Popen([*self.prefix(name), *argv], start_new_session=True, **popen)
        self._procs.append(proc)
        return proc

    def cut(self, name: str) -> None:
        """Take host ``name``'s link down at the switch: its packets go nowhere, its processes live on."""
        _ip("link", "set", self._port[name], "down", ns=self.switch)

    def mend(self, name: str) -> None:
        _ip("link", "set", self._port[name], "up", ns=self.switch)

    def close(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, 9)
                except ProcessLookupError:
                    pass
                proc.wait(10)
        for ns in [*self.ns.values(), self.switch]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.ns.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
