"""Two simulated "nodes" on one Linux host, for multi-node tests under pytest.

Each node is a network namespace (``ip netns add``) with its own address in a
private test subnet, joined to the other node by a veth pair created directly
inside the namespaces (it never exists in the host namespace).  Commands run on
a node through::

    nsenter --net=/var/run/netns/NS  unshare --uts --mount --propagation private \
        sh -c 'hostname "$1" && mount --bind "$2" /etc/hosts && shift 2 && exec "$@"' \
        sh NODENAME HOSTSFILE  ARGV...

so every process on a node sees its own hostname (``nodea``/``nodeb``) and its
own ``/etc/hosts`` mapping both node names to their subnet addresses.  That is
what makes gloo advertise the subnet address instead of 127.0.0.1 and what lets
torchrun's c10d rendezvous recognise the endpoint host as "this machine".
``nsenter --net`` is used instead of ``ip netns exec`` because the latter
remounts ``/sys`` (which breaks e.g. slurmd).

Network safety: before anything is created, ``ip route add unreachable SUBNET``
is installed in the host namespace, so no packet for the test subnet can ever
leave the machine.  Everything (processes, namespaces, veth, route, temp files)
is removed in ``close()``, which runs on ``__exit__`` (also on exceptions) and,
as a fallback, from ``atexit``.  Processes are killed by process group, by
descendant tree (torchrun workers live in their own sessions) and finally by
``ip netns pids`` (anything left in the namespaces).  If the test process itself
is SIGKILLed, atexit cannot run: ``cleanup_stale()`` (e.g. at the start of the
next session) removes what instances with a dead owner left behind, using the
records they keep in ``/run/twonodes``.

Usage::

    from twonodes import TwoNodes, require_root

    def test_two_nodes():
        require_root()
        with TwoNodes() as nodes:
            a = nodes.popen("a", ["python", "-c", "import socket; print(socket.gethostname())"],
                            stdout=subprocess.PIPE, text=True)
            assert a.communicate(timeout=30)[0].strip() == "nodea"
"""

from __future__ import annotations

import atexit
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Literal

__all__ = ["TwoNodes", "TwoNodesError", "cleanup_stale", "missing_requirements", "require_root"]

Node = Literal["a", "b"]

#: Candidate third octets for the default subnet 10.231.X.0/24 (first is the usual one).
_DEFAULT_OCTETS: tuple[int, ...] = (77, *range(78, 120))

#: Shell snippet run inside the new UTS+mount namespace before exec'ing the command.
_NODE_INIT = 'hostname "$1" && mount --bind "$2" /etc/hosts && shift 2 && exec "$@"'

_REQUIRED_TOOLS: tuple[str, ...] = ("ip", "nsenter", "unshare", "mount", "hostname", "sh")

#: Where each open instance records what it created, so that ``cleanup_stale()``
#: can remove leftovers of a test process that was SIGKILLed (atexit never ran).
STATE_DIR = "/run/twonodes"


class TwoNodesError(RuntimeError):
    """Raised when the two-node setup cannot be created."""


def missing_requirements() -> str | None:
    """Return why two-node tests cannot run here, or ``None`` if they can.

    Checks for root (network namespaces, veth and routes need CAP_NET_ADMIN,
    ``unshare --mount``/``hostname`` need CAP_SYS_ADMIN), Linux, and the tools
    ``ip`` (iproute2), ``nsenter``/``unshare``/``mount`` (util-linux), ``hostname``
    and ``sh``.
    """
    if not os.uname().sysname == "Linux":
        return "two-node tests need Linux network namespaces"
    if os.geteuid() != 0:
        return "two-node tests need root (ip netns / veth / routes / unshare --mount)"
    missing = [t for t in _REQUIRED_TOOLS if shutil.which(t) is None]
    if missing:
        return "two-node tests need these tools on PATH: " + ", ".join(missing)
    return None


def require_root() -> None:
    """``pytest.skip`` (with the reason) unless two-node tests can run here."""
    reason = missing_requirements()
    if reason is not None:
        import pytest

        pytest.skip(reason)


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a host-side setup command, capturing output."""
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise TwoNodesError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _proc_start_time(pid: int) -> str | None:
    """Start time (clock ticks since boot) of ``pid``, or None if it does not exist."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()[19]


def _ns_pids(ns: str) -> list[int]:
    """Pids of the processes in network namespace ``ns`` (``ip netns pids``)."""
    proc = _run(["ip", "netns", "pids", ns], check=False)
    return [int(p) for p in proc.stdout.split() if p.strip().isdigit()]


def _kill_ns_pids(namespaces: Sequence[str], rounds: int = 50) -> None:
    """SIGKILL everything living in ``namespaces`` until they are empty."""
    for _ in range(rounds):
        pids = [p for ns in namespaces for p in _ns_pids(ns)]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def _teardown(namespaces: Sequence[str], subnet: str | None) -> None:
    """Kill processes in, and delete, ``namespaces``; then delete the guard route."""
    existing = set(_run(["ip", "netns", "list"], check=False).stdout.split())
    namespaces = [ns for ns in namespaces if ns in existing]
    _kill_ns_pids(namespaces)
    for ns in namespaces:
        _run(["ip", "netns", "del", ns], check=False)  # also destroys the veth inside
    if subnet:
        _run(["ip", "route", "del", "unreachable", subnet], check=False)


def cleanup_stale() -> list[str]:
    """Remove namespaces/routes left by TwoNodes instances whose process is gone.

    Call e.g. from a session-scoped pytest fixture.  Returns the state files handled.
    """
    handled: list[str] = []
    if not os.path.isdir(STATE_DIR):
        return handled
    for name in sorted(os.listdir(STATE_DIR)):
        path = os.path.join(STATE_DIR, name)
        try:
            with open(path) as f:
                st = json.load(f)
        except (OSError, ValueError):
            continue
        if _proc_start_time(st["pid"]) == st["start"]:
            continue  # owner still alive
        _teardown(st["namespaces"], st["subnet"])
        if st.get("tmpdir"):
            shutil.rmtree(st["tmpdir"], ignore_errors=True)
        os.unlink(path)
        handled.append(path)
    return handled


class TwoNodes:
    """Context manager: two network namespaces joined by a veth pair.

    Attributes:
        addr_a, addr_b: the nodes' IPv4 addresses (strings) in ``subnet``.
        host_a, host_b: the nodes' hostnames (default ``nodea``/``nodeb``).
        ns_a, ns_b: the namespace names (unique per instance).
        subnet: the test subnet; an ``unreachable`` route for it exists on the
            host while the instance is open.
    """

    def __init__(
        self,
        subnet: str | None = None,
        hostnames: tuple[str, str] = ("nodea", "nodeb"),
        hosts_file: bool = True,
    ) -> None:
        """Describe (but do not yet create) the two nodes.

        Args:
            subnet: an IPv4 network of at least 4 addresses, e.g. ``"10.231.77.0/24"``.
                Default: the first of 10.231.77.0/24, 10.231.78.0/24, ... for
                which no host route exists (so concurrent instances don't clash).
            hostnames: hostnames of node A and node B.
            hosts_file: if False, the nodes keep the host's /etc/hosts (only the
                hostname is changed); meant for demonstrating why it is needed.
        """
        self._requested_subnet = subnet
        self.host_a, self.host_b = hostnames
        self._hosts_file = hosts_file
        tag = f"{os.getpid()}{uuid.uuid4().hex[:4]}"
        self.ns_a = f"mgpu-{tag}-a"
        self.ns_b = f"mgpu-{tag}-b"
        # Interface names: max 15 characters.
        short = uuid.uuid4().hex[:8]
        self._veth_a = f"mva{short}"
        self._veth_b = f"mvb{short}"
        self.subnet: str = ""
        self.addr_a: str = ""
        self.addr_b: str = ""
        self._prefixlen = 0
        self._route_added = False
        self._ns_created: list[str] = []
        self._procs: list[subprocess.Popen[Any]] = []
        self._tmpdir: str | None = None
        self._hosts_paths: dict[str, str] = {}
        self._state_path: str | None = None
        self._closed = True

    # ------------------------------------------------------------------ setup
    def __enter__(self) -> TwoNodes:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> None:
        """Create route guard, namespaces, veth, addresses and hosts files."""
        reason = missing_requirements()
        if reason is not None:
            raise TwoNodesError(reason)
        self._closed = False
        atexit.register(self.close)
        try:
            self._add_guard_route()
            self._tmpdir = tempfile.mkdtemp(prefix="twonodes-")
            self._write_state()
            net = ipaddress.ip_network(self.subnet)
            hosts = list(net.hosts())
            self.addr_a, self.addr_b = str(hosts[0]), str(hosts[1])
            self._prefixlen = net.prefixlen
            for ns in (self.ns_a, self.ns_b):
                _run(["ip", "netns", "add", ns])
                self._ns_created.append(ns)
                _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            # Create the veth pair directly inside the two namespaces.
            _run(
                [
                    "ip",
                    "link",
                    "add",
                    "name",
                    self._veth_a,
                    "netns",
                    self.ns_a,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    self._veth_b,
                    "netns",
                    self.ns_b,
                ]
            )
            for ns, dev, addr in (
                (self.ns_a, self._veth_a, self.addr_a),
                (self.ns_b, self._veth_b, self.addr_b),
            ):
                _run(["ip", "-n", ns, "addr", "add", f"{addr}/{self._prefixlen}", "dev", dev])
                _run(["ip", "-n", ns, "link", "set", dev, "up"])
            self._write_hosts_files()
            self._wait_link_up()
        except BaseException:
            self.close()
            raise

    def _write_state(self) -> None:
        os.makedirs(STATE_DIR, exist_ok=True)
        self._state_path = os.path.join(STATE_DIR, f"{self.ns_a[:-2]}.json")
        with open(self._state_path, "w") as f:
            json.dump(
                {
                    "pid": os.getpid(),
                    "start": _proc_start_time(os.getpid()),
                    "subnet": self.subnet,
                    "namespaces": [self.ns_a, self.ns_b],
                    "tmpdir": self._tmpdir,
                },
                f,
            )

    def _add_guard_route(self) -> None:
        """Install ``unreachable SUBNET`` on the host; pick a free subnet if none given."""
        if self._requested_subnet is not None:
            candidates = [self._requested_subnet]
        else:
            candidates = [f"10.231.{o}.0/24" for o in _DEFAULT_OCTETS]
        used = self._host_networks()
        errors: list[str] = []
        for cand in candidates:
            net = ipaddress.ip_network(cand)
            if net.num_addresses < 4:
                raise TwoNodesError(f"subnet {cand} too small")
            if any(net.overlaps(u) for u in used):
                errors.append(f"{cand}: overlaps a host route/address")
                continue
            # `ip route add` fails if the route exists: acts as a lock between runs.
            proc = _run(["ip", "route", "add", "unreachable", str(net)], check=False)
            if proc.returncode == 0:
                self.subnet = str(net)
                self._route_added = True
                return
            errors.append(f"{cand}: {proc.stderr.strip()}")
        raise TwoNodesError("no usable test subnet: " + "; ".join(errors))

    @staticmethod
    def _host_networks() -> list[ipaddress.IPv4Network]:
        """Networks of the host's routes and addresses (ignoring the default route)."""
        nets: list[ipaddress.IPv4Network] = []
        out = _run(["ip", "-4", "route", "show", "table", "all"]).stdout
        for line in out.splitlines():
            words = line.split()
            for w in words[:2]:
                try:
                    nets.append(ipaddress.IPv4Network(w, strict=False))
                except ValueError:
                    pass
        out = _run(["ip", "-4", "-o", "addr", "show"]).stdout
        for line in out.splitlines():
            words = line.split()
            if "inet" in words:
                nets.append(ipaddress.IPv4Interface(words[words.index("inet") + 1]).network)
        return [n for n in nets if n.prefixlen > 0 and not n.is_loopback]

    def _write_hosts_files(self) -> None:
        assert self._tmpdir is not None
        for node in ("a", "b"):
            path = os.path.join(self._tmpdir, f"hosts-{node}")
            with open(path, "w") as f:
                f.write("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n")
                f.write(f"{self.addr_a}\t{self.host_a}\n{self.addr_b}\t{self.host_b}\n")
            os.chmod(path, 0o644)
            self._hosts_paths[node] = path if self._hosts_file else "/etc/hosts"

    def _wait_link_up(self, timeout: float = 5.0) -> None:
        """Wait until both veth ends report carrier (LOWER_UP)."""
        deadline = time.monotonic() + timeout
        for ns, dev in ((self.ns_a, self._veth_a), (self.ns_b, self._veth_b)):
            while "LOWER_UP" not in _run(["ip", "-n", ns, "-o", "link", "show", dev]).stdout:
                if time.monotonic() > deadline:
                    raise TwoNodesError(f"{dev} in {ns} did not come up within {timeout}s")
                time.sleep(0.05)

    # ------------------------------------------------------------------ running
    def ns(self, node: Node) -> str:
        """Namespace name of node ``"a"`` or ``"b"``."""
        return {"a": self.ns_a, "b": self.ns_b}[node]

    def addr(self, node: Node) -> str:
        """IPv4 address of node ``"a"`` or ``"b"``."""
        return {"a": self.addr_a, "b": self.addr_b}[node]

    def hostname(self, node: Node) -> str:
        """Hostname of node ``"a"`` or ``"b"``."""
        return {"a": self.host_a, "b": self.host_b}[node]

    def wrap(self, node: Node, argv: Sequence[str]) -> list[str]:
        """The full command line that runs ``argv`` on ``node``."""
        if self._closed:
            raise TwoNodesError("TwoNodes is not open")
        tool = {t: shutil.which(t) or t for t in ("nsenter", "unshare", "sh")}
        return [
            tool["nsenter"],
            f"--net=/var/run/netns/{self.ns(node)}",
            tool["unshare"],
            "--uts",
            "--mount",
            "--propagation",
            "private",
            tool["sh"],
            "-c",
            _NODE_INIT,
            "sh",
            self.hostname(node),
            self._hosts_paths[node],
            *argv,
        ]

    def popen(
        self,
        node: Node,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        **kw: Any,
    ) -> subprocess.Popen[Any]:
        """Start ``argv`` on ``node``; returns the Popen (of the nsenter wrapper,
        which execs into unshare -> sh -> argv, so its pid *is* the command's pid).

        ``env`` defaults to a copy of ``os.environ`` (PATH etc. pass through).
        The process gets its own session (``start_new_session=True``) so the
        whole process group can be signalled; it is killed in ``close()``.
        Other keyword arguments go to ``subprocess.Popen``.
        """
        kw.setdefault("start_new_session", True)
        proc = subprocess.Popen(
            self.wrap(node, argv), env=dict(os.environ if env is None else env), **kw
        )
        self._procs.append(proc)
        return proc

    def run(
        self,
        node: Node,
        argv: Sequence[str],
        timeout: float = 60,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` on ``node`` to completion, capturing text output."""
        proc = self.popen(
            node, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill(proc)
            try:
                out, err = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:  # an orphan still holds the pipes
                self.kill_node(node)
                out, err = proc.communicate()
            raise subprocess.TimeoutExpired(proc.args, timeout, out, err) from None
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    # ------------------------------------------------------------------ cleanup
    @staticmethod
    def _descendants(pid: int) -> list[int]:
        """All current descendants of ``pid`` (children first-level first), from /proc.

        Needed because torchrun starts its workers with ``start_new_session=True``:
        killing the agent's process group does not reach them.
        """
        children: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
            children.setdefault(ppid, []).append(int(entry))
        out: list[int] = []
        todo = [pid]
        while todo:
            kids = children.get(todo.pop(), [])
            out.extend(kids)
            todo.extend(kids)
        return out

    def kill(self, proc: subprocess.Popen[Any]) -> None:
        """SIGKILL ``proc``, its process group and all its descendants (any session)."""
        if proc.poll() is not None:
            return
        victims = self._descendants(proc.pid)  # snapshot before anything is reparented
        for sig_target in ("group", "proc", "tree"):
            try:
                if sig_target == "group":
                    os.killpg(proc.pid, signal.SIGKILL)
                elif sig_target == "proc":
                    proc.kill()
                else:
                    for pid in victims:
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
            except (ProcessLookupError, PermissionError):
                pass

    def kill_node(self, node: Node) -> None:
        """SIGKILL every process living in ``node``'s network namespace."""
        _kill_ns_pids([self.ns(node)])

    def close(self) -> None:
        """Kill every process started, remove namespaces, veth, route and temp files.

        Idempotent; never raises for cleanup failures of individual steps.
        """
        if self._closed and not (self._ns_created or self._route_added):
            return
        self._closed = True
        try:
            atexit.unregister(self.close)
        except Exception:
            pass
        # 1. Processes we started, their groups and descendants.
        for proc in self._procs:
            self.kill(proc)
        # 2. Anything else still living in our namespaces (e.g. orphaned torchrun
        #    workers, which run in their own sessions).
        _kill_ns_pids(self._ns_created)
        for proc in self._procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    try:
                        stream.close()
                    except Exception:
                        pass
        self._procs.clear()
        # 3. Namespaces (deleting a namespace destroys the veth pair inside it).
        for ns in list(self._ns_created):
            _run(["ip", "netns", "del", ns], check=False)
            self._ns_created.remove(ns)
        # 4. The guard route, last, after nothing can use the subnet any more.
        if self._route_added:
            _run(["ip", "route", "del", "unreachable", self.subnet], check=False)
            self._route_added = False
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None
        if self._state_path is not None:
            try:
                os.unlink(self._state_path)
            except OSError:
                pass
            self._state_path = None
