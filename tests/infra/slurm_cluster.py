"""A real, throw-away, local Slurm cluster for tests.

Starts, under a private directory and with its own ``SLURM_CONF``:

* a private ``munged`` (own key, socket, pid and seed file; it runs in the
  foreground, so its log goes to ``log/munged.stdout``),
* one ``slurmctld``,
* N ``slurmd`` daemons on this host, each acting as one node (``n1``, ``n2``, ...),
  all with ``NodeAddr=127.0.0.1`` and their own port,
* with ``accounting=True``: job accounting, so ``sacct`` works - a private MariaDB
  (``mariadbd`` on an empty data folder, loopback port, no grant tables: nothing
  but this cluster can reach it) and a ``slurmdbd`` storing into it,
* with ``gpus_per_node=G``: G fake GPUs per node (``Gres=gpu:G``, ``AutoDetect=off``,
  links to ``/dev/null`` as device files), enough for Slurm to allocate them and set
  ``CUDA_VISIBLE_DEVICES`` in the job; nothing can compute on them.

Nothing touches ``/etc/slurm`` or the system munged; every daemon runs in the
foreground as a child of this process and everything it started (daemons,
``slurmstepd``, job processes) is killed on :meth:`SlurmCluster.stop`.

Requires root (slurmd must be able to start jobs as any user) and the Debian
packages ``slurmctld slurmd slurm-client munge`` (Slurm 22.05 on Debian 12), plus
``slurmdbd mariadb-server`` for accounting; :func:`ensure_slurm_installed` installs
them with apt if they are missing.

Example (pytest)::

    @pytest.fixture(scope="session")
    def slurm(tmp_path_factory):
        ensure_slurm_installed()
        with SlurmCluster(tmp_path_factory.mktemp("slurm")) as cluster:
            yield cluster

    def test_two_nodes(slurm):
        job = slurm.sbatch("#!/bin/bash\\nsrun hostname\\n", "--nodes=2", "--ntasks-per-node=1")
        info = slurm.wait_job(job, timeout=60)
        assert info["JobState"] == "COMPLETED", info
"""

from __future__ import annotations

import fcntl
import os
import random
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO

__all__ = [
    "ACCOUNTING_PACKAGES",
    "SLURM_PACKAGES",
    "SlurmError",
    "SlurmCluster",
    "TERMINAL_JOB_STATES",
    "ensure_slurm_installed",
    "find_slurm_binary",
    "slurm_available",
]

#: Debian packages providing the daemons and client commands.
SLURM_PACKAGES: Sequence[str] = ("slurmctld", "slurmd", "slurm-client", "munge")
#: Debian packages for job accounting (``sacct``): slurmdbd and the database it stores into.
ACCOUNTING_PACKAGES: Sequence[str] = ("slurmdbd", "mariadb-server")

#: Binaries the cluster needs (sbin ones are not on a non-root PATH).
_REQUIRED_BINARIES: Sequence[str] = (
    "munged",
    "slurmctld",
    "slurmd",
    "sbatch",
    "srun",
    "squeue",
    "sinfo",
    "scontrol",
    "scancel",
)
_ACCOUNTING_BINARIES: Sequence[str] = ("slurmdbd", "mariadbd", "sacct")
_SEARCH_DIRS: Sequence[str] = (
    "/usr/sbin",
    "/usr/bin",
    "/sbin",
    "/bin",
    "/usr/local/sbin",
    "/usr/local/bin",
)

#: Job states after which a job will not run again by itself.
TERMINAL_JOB_STATES = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "PREEMPTED",
        "BOOT_FAIL",
        "DEADLINE",
        "OUT_OF_MEMORY",
        "SPECIAL_EXIT",
        "REVOKED",
    }
)


class SlurmError(RuntimeError):
    """The cluster could not be started or a Slurm command failed."""


# --------------------------------------------------------------------------- install


def find_slurm_binary(name: str) -> str | None:
    """Absolute path of a Slurm/munge binary, also looking in sbin dirs not on PATH."""
    found = shutil.which(name)
    if found:
        return found
    for d in _SEARCH_DIRS:
        p = os.path.join(d, name)
        if os.path.isfile(p) and os.access(p, os.X_OK):
            return p
    return None


def _binary(name: str) -> str:
    path = find_slurm_binary(name)
    if path is None:
        raise SlurmError(f"{name} not found; call ensure_slurm_installed() first")
    return path


def slurm_available(accounting: bool = False) -> bool:
    """True when every binary the cluster needs is installed (``accounting``: also slurmdbd and MariaDB)."""
    needed = (*_REQUIRED_BINARIES, *(_ACCOUNTING_BINARIES if accounting else ()))
    return all(find_slurm_binary(b) for b in needed)


def ensure_slurm_installed(timeout: float = 900.0, accounting: bool = False) -> None:
    """Install :data:`SLURM_PACKAGES` (and :data:`ACCOUNTING_PACKAGES`) with apt-get when a needed
    binary is missing.

    Must run as root on Debian/Ubuntu. Tries the install first and runs
    ``apt-get update`` only if that fails (stale or missing package lists).
    Raises :class:`SlurmError` when the binaries are still missing afterwards.
    """
    if slurm_available(accounting):
        return
    packages = (*SLURM_PACKAGES, *(ACCOUNTING_PACKAGES if accounting else ()))
    if os.geteuid() != 0:
        raise SlurmError("Slurm is not installed and installing it needs root")
    apt = find_slurm_binary("apt-get")
    if apt is None:
        raise SlurmError("Slurm is not installed and apt-get is not available")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = [apt, "install", "-y", "--no-install-recommends", *packages]
    t0 = time.monotonic()
    res = subprocess.run(install, env=env, capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        subprocess.run([apt, "update"], env=env, capture_output=True, text=True, timeout=timeout)
        res = subprocess.run(install, env=env, capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0 or not slurm_available(accounting):
        raise SlurmError(
            f"apt-get install {' '.join(packages)} failed:\n"
            f"{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
        )
    print(
        f"[slurm_cluster] installed {' '.join(packages)} in {time.monotonic() - t0:.1f}s",
        file=sys.stderr,
    )


# --------------------------------------------------------------------------- helpers


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def _pick_ports(count: int, low: int = 20000, high: int = 32000) -> list[int]:
    """``count`` distinct free TCP ports below the usual ephemeral range.

    Ports below ``ip_local_port_range`` are never handed out for outgoing
    connections, so a port that is free now is unlikely to be taken before the
    daemon binds it.
    """
    rng = random.Random()
    ports: list[int] = []
    for _ in range(10000):
        if len(ports) == count:
            return ports
        p = rng.randrange(low, high)
        if p not in ports and _port_is_free(p):
            ports.append(p)
    raise SlurmError(f"could not find {count} free TCP ports in [{low}, {high})")


#: Job ids come in blocks, one per live cluster on this machine (a lock file each, held while the cluster runs):
#: jobs of two clusters never share an id, even when two test runs each start theirs at the same time. Why it
#: matters: multigpu derives a Slurm job's rendezvous port from its id (15000 + id), so two clusters whose
#: jobs 1003 ran at once put both on port 16003. Blocks 2-9 of 500: ids 1000-4999, ports 16000-19999, below
#: the daemons' ports (``_pick_ports``: 20000 and up) and the ephemeral range.
JOB_ID_BLOCK = 500
JOB_ID_BLOCKS = range(2, 10)
#: A fixed path, not TMPDIR's: the ports are the machine's, whatever TMPDIR each test run has.
JOB_ID_LEASES = Path("/tmp/slurmlab-job-ids")


def _lease_job_ids() -> tuple[int, int]:
    """(the first job id of a free block, the open lock file that holds it: close it to give it back).
    A lock (``flock``) ends with its process, so a killed test run leaves no block taken (its daemons, in
    sessions of their own, may outlive it: ``stop`` is what ends them, and a killed run never calls it)."""
    try:
        JOB_ID_LEASES.mkdir(mode=0o700)
    except FileExistsError:
        pass
    info = JOB_ID_LEASES.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o022:
        raise SlurmError(
            f"{JOB_ID_LEASES} is not a folder of this user's test clusters (a link, another owner, "
            "or writable by others): remove it"
        )
    for block in JOB_ID_BLOCKS:
        fd = os.open(
            JOB_ID_LEASES / f"block-{block}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600
        )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return block * JOB_ID_BLOCK, fd
    raise SlurmError(f"every job-id block ({len(JOB_ID_BLOCKS)}) is held by a running test cluster")


def _parse_scontrol(text: str) -> dict[str, str]:
    """Parse one-line ``scontrol show ... -o`` output into a dict.

    Values never contain spaces except for a few fields (``Command``, ``WorkDir``,
    ``Reason`` ...); a token without ``=`` is appended to the previous value.
    """
    out: dict[str, str] = {}
    last: str | None = None
    for tok in text.strip().split():
        m = re.match(r"^([A-Za-z][\w:/\.]*)=(.*)$", tok)
        if m:
            last = m.group(1)
            out[last] = m.group(2)
        elif last is not None:
            out[last] += " " + tok
    return out


def _read_environ(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _stat_fields(pid: int) -> list[bytes] | None:
    """Fields of /proc/PID/stat after the command name: [state, ppid, ...]."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        # comm may contain spaces/parens: fields start after the last ')'
        return data[data.rindex(b")") + 2 :].split()
    except (OSError, ValueError):
        return None


def _ppid(pid: int) -> int | None:
    fields = _stat_fields(pid)
    try:
        return int(fields[1]) if fields else None
    except (ValueError, IndexError):
        return None


def _is_zombie(pid: int) -> bool:
    fields = _stat_fields(pid)
    return not fields or fields[0] in (b"Z", b"X")


def _all_pids() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def _ancestors(pid: int) -> set[int]:
    seen: set[int] = set()
    cur: int | None = pid
    while cur and cur not in seen:
        seen.add(cur)
        cur = _ppid(cur)
    return seen


# --------------------------------------------------------------------------- cluster


class SlurmCluster:
    """A private Slurm cluster (munged + slurmctld + ``nodes`` slurmd) under ``root``.

    Use as a context manager, or call :meth:`start` / :meth:`stop` (idempotent;
    ``stop`` also runs when ``start`` fails). :attr:`env` is the environment to run
    ``sbatch``/``srun``/``squeue``/``scontrol``/``scancel`` with.

    Args:
        root: directory for config, keys, sockets, state, spool and logs
            (created; should be short, munge/slurm socket paths must fit 108 bytes).
        nodes: number of slurmd daemons / nodes (named ``n1`` .. ``nN``).
        cpus_per_node: ``CPUs=`` of every node (may exceed the real cores,
            ``SlurmdParameters=config_overrides`` is set).
        cred_expire: ``AuthInfo=cred_expire`` seconds; this is also how long a
            requeued job waits (``BeginTime``) before it can start again
            (Slurm default 120; values below 5 are rejected by Slurm, so here too).
        start_timeout: seconds to wait for all nodes to become ``idle``.
        conf_overrides: ``slurm.conf`` keys to replace (value ``None`` removes the key),
            e.g. ``{"SchedulerType": "sched/backfill"}``.
        extra_conf: extra lines appended after the node and partition lines
            (e.g. another ``PartitionName=``); a repeated key wins but slurmctld
            logs "specified more than once", prefer ``conf_overrides``.
        verbose: print timings to stderr.
        accounting: start MariaDB and slurmdbd too, so ``sacct`` answers
            (about 3 s more at start; needs :data:`ACCOUNTING_PACKAGES`).
        gpus_per_node: fake GPUs per node (0: none); see the module docstring.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        nodes: int = 2,
        cpus_per_node: int = 2,
        cred_expire: int = 5,
        start_timeout: float = 60.0,
        conf_overrides: Mapping[str, str | None] | None = None,
        extra_conf: Iterable[str] = (),
        verbose: bool = True,
        accounting: bool = False,
        gpus_per_node: int = 0,
    ) -> None:
        if nodes < 1:
            raise ValueError("nodes must be >= 1")
        if cred_expire < 5:
            # slurmctld logs "AuthInfo=cred_expire=N invalid" and silently uses 120
            raise ValueError("cred_expire must be >= 5 (Slurm ignores smaller values)")
        self.root = Path(root).resolve()
        self.node_names: list[str] = [f"n{i}" for i in range(1, nodes + 1)]
        self.cpus_per_node = cpus_per_node
        self.cred_expire = cred_expire
        self.start_timeout = start_timeout
        self.conf_overrides: dict[str, str | None] = dict(conf_overrides or {})
        self.extra_conf = list(extra_conf)
        self.verbose = verbose
        self.accounting = accounting
        self.gpus_per_node = gpus_per_node
        self.db_port: int | None = None
        self.dbd_port: int | None = None
        self.tag = uuid.uuid4().hex  # marks every process we start (env var)
        self.conf_path = self.root / "etc" / "slurm.conf"
        self.munge_socket = self.root / "munge" / "run" / "munge.socket"
        self.log_dir = self.root / "log"
        self.ctld_port: int | None = None
        self.node_ports: dict[str, int] = {}
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._log_handles: list[IO[bytes]] = []
        self._started = False
        self.start_seconds: float | None = None
        self._lease_fd: int | None = None

    # ------------------------------------------------------------------ public API

    @property
    def env(self) -> dict[str, str]:
        """Environment for client commands (and daemons): ``os.environ`` without any
        inherited ``SLURM_*`` variables, plus ``SLURM_CONF`` and the cleanup tag."""
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))
        }
        env["SLURM_CONF"] = str(self.conf_path)
        env["SLURMLAB_CLUSTER_TAG"] = self.tag
        path = env.get("PATH", "")
        for d in ("/usr/sbin", "/usr/bin"):
            if d not in path.split(":"):
                path = f"{path}:{d}" if path else d
        env["PATH"] = path
        return env

    def __enter__(self) -> SlurmCluster:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> SlurmCluster:
        """Write the config, start all daemons and wait until every node is idle."""
        if self._started:
            return self
        missing = [
            b
            for b in (*_REQUIRED_BINARIES, *(_ACCOUNTING_BINARIES if self.accounting else ()))
            if not find_slurm_binary(b)
        ]
        if missing:
            raise SlurmError(f"missing binaries {missing}; call ensure_slurm_installed() first")
        if os.geteuid() != 0:
            raise SlurmError("SlurmCluster must run as root")
        self._started = True
        t0 = time.monotonic()
        try:
            self._prepare_dirs()
            self._start_munged()
            self._write_conf()
            if self.accounting:
                self._start_accounting(t0 + self.start_timeout)
            self._spawn("slurmctld", [_binary("slurmctld"), "-D", "-c", "-i"])
            # a client started before slurmctld listens sleeps ~1 s before retrying
            self._wait_port(self.ctld_port or 0, t0 + self.start_timeout)
            for name in self.node_names:
                self._spawn(f"slurmd.{name}", [_binary("slurmd"), "-D", "-N", name])
            self._wait_nodes_idle(t0 + self.start_timeout)
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - t0
        if self.verbose:
            print(
                f"[slurm_cluster] {len(self.node_names)} nodes idle after {self.start_seconds:.2f}s "
                f"(SLURM_CONF={self.conf_path})",
                file=sys.stderr,
            )
        return self

    def stop(self, job_grace: float = 3.0, daemon_grace: float = 2.0) -> None:
        """Cancel jobs, stop the daemons and kill every process this cluster started.

        Jobs get ``job_grace`` seconds to be cancelled through Slurm, daemons
        ``daemon_grace`` seconds after SIGTERM; then every remaining process that
        carries this cluster's tag in its environment (``slurmstepd``, job
        tasks, also ones that called ``setsid``) and all their descendants get
        SIGKILL. Safe to call more than once and after a failed :meth:`start`.
        """
        if not self._started:
            return
        self._started = False
        t0 = time.monotonic()
        # 1. let slurm cancel the jobs while the daemons are still up (best effort)
        ctld = self._procs.get("slurmctld")
        if ctld is not None and ctld.poll() is None and self.conf_path.exists():
            try:
                jobs = self.run(
                    ["squeue", "-h", "-o", "%i"], check=False, timeout=10
                ).stdout.split()
                if jobs:
                    self.run(["scancel", "--quiet", *jobs], check=False, timeout=10)
                    deadline = time.monotonic() + job_grace
                    while time.monotonic() < deadline:
                        r = self.run(["squeue", "-h", "-o", "%i"], check=False, timeout=10)
                        if r.returncode != 0 or not r.stdout.strip():
                            break
                        time.sleep(0.1)
            except (subprocess.SubprocessError, OSError):
                pass
        # 2. daemons: SIGTERM all, short grace, then SIGKILL (slurmd can hang on
        #    shutdown while a step it launched is still being torn down)
        for p in self._procs.values():
            if p.poll() is None:
                try:
                    p.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + daemon_grace
        for p in self._procs.values():
            try:
                p.wait(timeout=max(0.05, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        # 3. anything left that carries our tag (slurmstepd, job tasks) and its descendants
        self._kill_tagged()
        for h in self._log_handles:
            try:
                h.close()
            except OSError:
                pass
        self._log_handles.clear()
        self._procs.clear()
        if self._lease_fd is not None:  # the job ids go back once every job of theirs is gone
            os.close(self._lease_fd)
            self._lease_fd = None
        if self.verbose:
            print(f"[slurm_cluster] stopped in {time.monotonic() - t0:.2f}s", file=sys.stderr)

    def run(
        self,
        cmd: Sequence[str],
        check: bool = True,
        timeout: float | None = 60,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run a command against this cluster (text mode, output captured)."""
        full_env = self.env
        if env:
            full_env.update(env)
        res = subprocess.run(
            list(cmd), env=full_env, capture_output=True, text=True, timeout=timeout, cwd=cwd
        )
        if check and res.returncode != 0:
            raise SlurmError(
                f"{' '.join(cmd)} -> rc={res.returncode}\nstdout: {res.stdout}\nstderr: {res.stderr}"
            )
        return res

    def sbatch(self, script: str, *args: str, cwd: str | os.PathLike[str] | None = None) -> int:
        """Submit ``script`` (text) with extra ``sbatch`` args; return the job id.

        Output goes to ``<root>/jobs/slurm-%j.out`` unless ``--output`` is given.
        """
        jobs = self.root / "jobs"
        jobs.mkdir(exist_ok=True)
        path = jobs / f"script-{uuid.uuid4().hex[:8]}.sh"
        path.write_text(script)
        path.chmod(0o755)
        opts = list(args)
        if not any(a.startswith(("--output", "-o")) for a in opts):
            opts.append(f"--output={jobs}/slurm-%j.out")
        res = self.run(["sbatch", "--parsable", *opts, str(path)], cwd=str(cwd or jobs))
        return int(res.stdout.strip().split(";")[0])

    def job_output(self, job_id: int) -> str:
        """Content of the default output file of ``job_id`` ('' if missing)."""
        p = self.root / "jobs" / f"slurm-{job_id}.out"
        return p.read_text() if p.exists() else ""

    def job_info(self, job_id: int) -> dict[str, str] | None:
        """``scontrol show job -o`` as a dict, or None when the job is unknown/purged."""
        res = self.run(["scontrol", "show", "job", "-o", str(job_id)], check=False, timeout=30)
        if res.returncode != 0 or not res.stdout.strip():
            return None
        return _parse_scontrol(res.stdout.splitlines()[0])

    def wait_job(
        self,
        job_id: int,
        timeout: float = 60.0,
        poll: float = 0.2,
        states: Iterable[str] = TERMINAL_JOB_STATES,
    ) -> dict[str, str]:
        """Poll ``scontrol show job`` until the job reaches one of ``states``.

        Returns the job record (``JobState``, ``ExitCode`` "rc:signal", ``Restarts``,
        ``NodeList`` ...). Raises :class:`SlurmError` on timeout (with the last
        record and the output file) or when the job disappears. No slurmdbd/sacct
        needed: completed jobs stay visible for ``MinJobAge`` seconds.
        """
        wanted = set(states)
        deadline = time.monotonic() + timeout
        info: dict[str, str] | None = None
        while True:
            info = self.job_info(job_id)
            if info is None:
                raise SlurmError(f"job {job_id} unknown to slurmctld")
            state = info.get("JobState", "")
            if state in wanted:
                return info
            if time.monotonic() >= deadline:
                raise SlurmError(
                    f"job {job_id} not in {sorted(wanted)} after {timeout}s: "
                    f"{info}\n--- output ---\n{self.job_output(job_id)}"
                )
            time.sleep(poll)

    def node_info(self, node: str) -> dict[str, str]:
        """``scontrol show node -o NODE`` as a dict (``NodeAddr``, ``State``, ...)."""
        return _parse_scontrol(self.run(["scontrol", "show", "node", "-o", node]).stdout)

    def node_states(self) -> dict[str, str]:
        """Compact state of every node as reported by ``sinfo`` (e.g. ``idle``)."""
        res = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False, timeout=10)
        out: dict[str, str] = {}
        for line in res.stdout.splitlines():
            parts = line.split()
            if len(parts) == 2:
                out[parts[0]] = parts[1]
        return out

    def logs(self, tail: int = 40) -> str:
        """Last ``tail`` lines of every daemon log and stdout/stderr capture
        (munged runs in the foreground and logs to ``munged.stdout``)."""
        chunks = []
        for p in sorted([*self.log_dir.glob("*.log"), *self.log_dir.glob("*.stdout")]):
            lines = p.read_text(errors="replace").splitlines()[-tail:]
            chunks.append(f"==> {p} <==\n" + "\n".join(lines))
        return "\n".join(chunks)

    # ------------------------------------------------------------------ internals

    def _prepare_dirs(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in ("state", "spool", "run", "munge/run"):  # never recover an old cluster
            shutil.rmtree(self.root / stale, ignore_errors=True)
        os.chmod(self.root, 0o755)
        for sub, mode in (
            ("etc", 0o755),
            ("munge", 0o755),
            ("munge/run", 0o755),
            ("munge/key", 0o700),
            ("munge/lib", 0o700),
            ("log", 0o755),
            ("state", 0o755),
            ("spool", 0o755),
            ("run", 0o755),
            ("jobs", 0o777),
            ("tmp", 0o1777),
        ):
            d = self.root / sub
            d.mkdir(parents=True, exist_ok=True)
            os.chmod(d, mode)
        for name in self.node_names:
            (self.root / "spool" / name).mkdir(exist_ok=True)
        if len(str(self.munge_socket)) > 100:
            raise SlurmError(f"path too long for a unix socket: {self.munge_socket}")

    def _start_munged(self) -> None:
        key = self.root / "munge" / "key" / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
        os.chmod(key, stat.S_IRUSR)  # 0400
        self._spawn(
            "munged",
            [
                _binary("munged"),
                "--foreground",
                "--force",
                f"--socket={self.munge_socket}",
                f"--key-file={key}",
                f"--pid-file={self.root / 'munge' / 'run' / 'munged.pid'}",
                f"--seed-file={self.root / 'munge' / 'lib' / 'munged.seed'}",
                f"--log-file={self.log_dir / 'munged.log'}",
                "--num-threads=4",
            ],
        )
        deadline = time.monotonic() + 15
        while not self.munge_socket.exists():
            self._check_alive()
            if time.monotonic() > deadline:
                raise SlurmError("munged did not create its socket\n" + self.logs())
            time.sleep(0.02)

    def _start_accounting(self, deadline: float) -> None:
        """MariaDB on an empty data folder (it creates its system tablespace itself; without grant tables
        no ``mariadb-install-db`` is needed, and it listens on loopback only), then slurmdbd, which
        creates its tables on first start. slurmctld registers the cluster when it starts."""
        data = self.root / "db"
        data.mkdir(exist_ok=True)
        self._spawn(
            "mariadbd",
            [
                _binary("mariadbd"),
                "--no-defaults",
                f"--datadir={data}",
                "--user=root",
                f"--socket={self.root / 'run' / 'mariadb.sock'}",
                f"--pid-file={self.root / 'run' / 'mariadb.pid'}",
                "--bind-address=127.0.0.1",
                f"--port={self.db_port}",
                "--skip-grant-tables",
                "--skip-name-resolve",
                "--skip-log-bin",
                "--innodb-buffer-pool-size=32M",
                "--innodb-log-file-size=8M",
                "--innodb-flush-log-at-trx-commit=0",
                f"--log-error={self.log_dir / 'mariadb.log'}",
            ],
        )
        self._wait_port(self.db_port or 0, deadline)
        conf = self.root / "etc" / "slurmdbd.conf"  # found next to SLURM_CONF
        conf.write_text(
            "\n".join(
                [
                    "# generated by slurm_cluster.py",
                    "AuthType=auth/munge",
                    f"AuthInfo=socket={self.munge_socket}",
                    "DbdHost=localhost",
                    "DbdAddr=127.0.0.1",
                    f"DbdPort={self.dbd_port}",
                    "SlurmUser=root",
                    f"PidFile={self.root / 'run' / 'slurmdbd.pid'}",
                    f"LogFile={self.log_dir / 'slurmdbd.log'}",
                    "DebugLevel=info",
                    "StorageType=accounting_storage/mysql",
                    "StorageHost=127.0.0.1",
                    f"StoragePort={self.db_port}",
                    "StorageUser=root",
                    "StorageLoc=slurm_acct_db",
                ]
            )
            + "\n"
        )
        os.chmod(conf, 0o600)  # slurmdbd refuses a config others can read
        self._spawn("slurmdbd", [_binary("slurmdbd"), "-D"])
        self._wait_port(self.dbd_port or 0, deadline)

    def _write_gres(self) -> list[str]:
        """``Gres=`` of each node, after writing gres.conf and the fake device files."""
        if not self.gpus_per_node:
            return []
        dev = self.root / "dev"
        dev.mkdir(exist_ok=True)
        for i in range(self.gpus_per_node):  # slurmd wants character devices: links to /dev/null
            link = dev / f"gpu{i}"
            if not link.is_symlink():
                link.symlink_to("/dev/null")
        files = (
            f"{dev}/gpu[0-{self.gpus_per_node - 1}]" if self.gpus_per_node > 1 else f"{dev}/gpu0"
        )
        (self.root / "etc" / "gres.conf").write_text(f"AutoDetect=off\nName=gpu File={files}\n")
        return [f"Gres=gpu:{self.gpus_per_node}"]

    def _write_conf(self) -> None:
        ports = _pick_ports(3 + len(self.node_names))
        self.ctld_port = ports[0]
        self.db_port, self.dbd_port = ports[-2:]
        self.node_ports = {name: ports[1 + i] for i, name in enumerate(self.node_names)}
        host = socket.gethostname().split(".")[0]
        r = self.root
        plugstack = r / "etc" / "plugstack.conf"
        plugstack.write_text("")
        opts: dict[str, str] = {  # order kept; conf_overrides replace/remove keys
            "ClusterName": "slurmlab",
            "SlurmctldHost": f"{host}(127.0.0.1)",
            "SlurmctldPort": str(self.ctld_port),
            "SlurmdPort": str(ports[1]),  # per-node Port= below
            "SlurmUser": "root",
            "SlurmdUser": "root",
            "AuthType": "auth/munge",
            "CredType": "cred/munge",
            # cred_expire also sets the requeue delay (EligibleTime = requeue + cred_expire + 1)
            "AuthInfo": f"socket={self.munge_socket},cred_expire={self.cred_expire}",
            "StateSaveLocation": str(r / "state"),
            "SlurmdSpoolDir": f"{r / 'spool'}/%n",  # %n = node name (one per slurmd)
            "SlurmctldPidFile": str(r / "run" / "slurmctld.pid"),
            "SlurmdPidFile": f"{r / 'run'}/slurmd.%n.pid",
            "SlurmctldLogFile": str(self.log_dir / "slurmctld.log"),
            "SlurmdLogFile": f"{self.log_dir}/slurmd.%n.log",
            "SlurmctldDebug": "info",
            "SlurmdDebug": "info",
            "PlugStackConfig": str(plugstack),  # ignore /etc/slurm/plugstack.conf
            "TmpFS": str(r / "tmp"),
            "ProctrackType": "proctrack/linuxproc",
            "TaskPlugin": "task/none",
            "MpiDefault": "none",
            "MailProg": "/bin/true",  # silences "Configured MailProg is invalid"
            "SwitchType": "switch/none",
            "JobContainerType": "job_container/none",
            "SelectType": "select/cons_tres",
            "SelectTypeParameters": "CR_Core",
            "SchedulerType": "sched/builtin",
            # sbatch jobs start on the next 1 s tick of the main loop either way
            "SchedulerParameters": "sched_interval=1,sched_min_interval=0",
            "SlurmdParameters": "config_overrides",  # CPUs= may exceed the real cores
            "AccountingStorageType": "accounting_storage/none",
            **(
                {
                    "AccountingStorageType": "accounting_storage/slurmdbd",
                    "AccountingStorageHost": "127.0.0.1",
                    "AccountingStoragePort": str(self.dbd_port),
                    # with slurmdbd, the munge socket of its connection is given here, not by AuthInfo
                    "AccountingStoragePass": str(self.munge_socket),
                }
                if self.accounting
                else {}
            ),
            **({"GresTypes": "gpu"} if self.gpus_per_node else {}),
            "JobAcctGatherType": "jobacct_gather/none",
            "JobCompType": "jobcomp/none",
            "JobRequeue": "1",  # batch jobs requeueable unless --no-requeue
            "ReturnToService": "2",  # DOWN nodes come back when slurmd registers
            "MinJobAge": "600",  # finished jobs stay in `scontrol show job` (no slurmdbd)
            "KillWait": "5",  # SIGTERM -> SIGKILL on cancel/time limit/requeue
            "InactiveLimit": "0",
            "MessageTimeout": "10",
            "BatchStartTimeout": "10",
            "SlurmctldTimeout": "30",
            "SlurmdTimeout": "60",
        }
        if "FirstJobId" not in self.conf_overrides:  # a block of ids of its own (JOB_ID_BLOCK)
            first, self._lease_fd = _lease_job_ids()
            opts.update(FirstJobId=str(first), MaxJobId=str(first + JOB_ID_BLOCK - 1))
        for key, value in self.conf_overrides.items():
            if value is None:
                opts.pop(key, None)
            else:
                opts[key] = value
        lines = ["# generated by slurm_cluster.py"] + [f"{k}={v}" for k, v in opts.items()]
        gres = self._write_gres()
        for name in self.node_names:
            lines.append(
                " ".join(
                    [
                        f"NodeName={name} NodeAddr=127.0.0.1 Port={self.node_ports[name]}",
                        f"CPUs={self.cpus_per_node}",
                        *gres,
                        "State=UNKNOWN",
                    ]
                )
            )
        lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        lines.extend(self.extra_conf)
        self.conf_path.write_text("\n".join(lines) + "\n")

    def _spawn(self, name: str, cmd: list[str]) -> None:
        out = open(self.log_dir / f"{name}.stdout", "ab")
        self._log_handles.append(out)
        self._procs[name] = subprocess.Popen(
            cmd,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=str(self.root),
            start_new_session=True,
        )

    def _check_alive(self) -> None:
        for name, p in self._procs.items():
            if p.poll() is not None:
                raise SlurmError(
                    f"{name} exited with {p.returncode}\n"
                    + self._stdout_tail(name)
                    + "\n"
                    + self.logs()
                )

    def _stdout_tail(self, name: str) -> str:
        p = self.log_dir / f"{name}.stdout"
        return (
            f"==> {p} <==\n" + "\n".join(p.read_text(errors="replace").splitlines()[-40:])
            if p.exists()
            else ""
        )

    def _wait_port(self, port: int, deadline: float) -> None:
        """Wait until something accepts TCP connections on 127.0.0.1:port."""
        while True:
            self._check_alive()
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.settimeout(0.5)
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return
            if time.monotonic() > deadline:
                raise SlurmError(f"nothing listens on port {port}\n" + self.logs())
            time.sleep(0.01)

    def _wait_nodes_idle(self, deadline: float) -> None:
        states: dict[str, str] = {}
        while True:
            self._check_alive()
            states = self.node_states()
            if all(states.get(n) == "idle" for n in self.node_names):
                return
            if time.monotonic() > deadline:
                raise SlurmError(f"nodes not idle: {states}\n" + self.logs())
            time.sleep(0.05)

    def _kill_tagged(self) -> None:
        """SIGKILL every process carrying our tag in its environment, plus descendants."""
        needle = f"SLURMLAB_CLUSTER_TAG={self.tag}".encode()
        protected = _ancestors(os.getpid())
        for _ in range(20):
            pids = _all_pids()
            parent = {p: _ppid(p) for p in pids}
            victims = {
                p for p in pids if p not in protected and needle in _read_environ(p).split(b"\0")
            }
            changed = True
            while changed:  # add descendants of victims
                changed = False
                for p, pp in parent.items():
                    if pp in victims and p not in victims and p not in protected:
                        victims.add(p)
                        changed = True
            victims = {p for p in victims if not _is_zombie(p)}  # zombies die with their parent
            if not victims:
                return
            for p in victims:
                try:
                    os.kill(p, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            time.sleep(0.1)
        raise SlurmError(f"processes survived SIGKILL: {sorted(victims)}")


if __name__ == "__main__":  # quick manual check: python tests/infra/slurm_cluster.py [DIR]
    import tempfile

    ensure_slurm_installed()
    with tempfile.TemporaryDirectory(prefix="slurm-") as d:
        with SlurmCluster(sys.argv[1] if len(sys.argv) > 1 else d) as c:
            print(c.run(["sinfo"]).stdout)
            t = time.monotonic()
            jid = c.sbatch("#!/bin/bash\nsrun hostname\n", "--nodes=2", "--ntasks-per-node=1")
            info = c.wait_job(jid, timeout=60)
            print(info["JobState"], info["ExitCode"], f"{time.monotonic() - t:.2f}s")
            print(c.job_output(jid))
