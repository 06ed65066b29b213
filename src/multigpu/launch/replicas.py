"""``multigpu run --replica-groups R``: torchft's lighthouse and R replica groups, each on its own elastic agent.

Why this shape: a replica group is an ordinary ``multigpu run`` (its own torch.distributed world, its
own agent that restarts its workers with ``--max-restarts``), told which group it is and where the
lighthouse listens. The lighthouse - torchft's quorum server, one per job - runs *inside this launcher
process* (``torchft.coordination.LighthouseServer``), bound to 127.0.0.1 on a port the OS picks (as our
rendezvous ports are), so it cannot outlive the job: when the launcher ends, by any signal, so does the
lighthouse. Each group's agent asks the kernel to kill it when this launcher dies, and each worker
already dies with its agent: no orphans, even after a SIGKILL of the launcher.

Signals: the groups run in sessions of their own (Ctrl-C reaches this launcher only), and SIGINT, SIGTERM,
SIGHUP and SIGUSR1 are forwarded to every group's agent, which forwards them to its workers - so a
preemption checkpoints every group and Ctrl-C stops everything. A group that fails for good (its
restarts used up) is reported and the others go on. The launcher's status: 0 when training finished in
some group, 75 when every group was preempted after its checkpoint, else the first failure's.

On several machines (``multigpu slurm --replica-groups R``) each machine runs one group with
``--replica-group G --lighthouse HOST:PORT``, and ``python -m multigpu.launch.replicas --bind HOST:PORT``
hosts the lighthouse on the first node. Environment variables for the workers are written here and
read in :mod:`multigpu.distributed.world`.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from multigpu import validate
from multigpu.distributed.job import JOB_VAR, job_env, parse_job
from multigpu.distributed.world import (
    LIGHTHOUSE_VAR,
    MAX_REPLICA_GROUPS,
    MIN_REPLICAS_VAR,
    REPLICA_GROUP_VAR,
    REPLICA_GROUPS_VAR,
)
from multigpu.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED, LaunchError
from multigpu.launch.children import Children
from multigpu.validate import whole_flag

if TYPE_CHECKING:
    from torchft.coordination import LighthouseServer

#: Set for each group's agent: this launcher's pid (the agent stops itself when the launcher dies).
#: How long a new quorum waits for a group that heartbeats but has not asked to join (one that is still
#: loading after a restart): short, so the live groups pause at most this long for it.
JOIN_TIMEOUT_MS = 1000
QUORUM_TICK_MS = 100
DEFAULT_HEARTBEAT_TIMEOUT_S = 5.0
MAX_HEARTBEAT_TIMEOUT_S = 3600.0
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)


@dataclass(frozen=True)
class ReplicaSettings:
    groups: int
    min_replicas: int = 1
    heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S

    def check(self) -> "ReplicaSettings":
        validate.count(
            self.groups,
            "--replica-groups",
            LaunchError,
            high=MAX_REPLICA_GROUPS,
            hint=f"use 2 or more groups (at most {MAX_REPLICA_GROUPS}): each is a whole replica of the job.",
        )
        validate.count(
            self.min_replicas,
            "--min-replicas",
            LaunchError,
            high=self.groups,
            hint=f"use 1 to --replica-groups ({self.groups}): the fewest live groups a step needs.",
        )
        if (
            isinstance(self.heartbeat_timeout_s, bool)
            or not isinstance(self.heartbeat_timeout_s, (int, float))
            or not 0.1 <= self.heartbeat_timeout_s <= MAX_HEARTBEAT_TIMEOUT_S
        ):
            raise LaunchError(
                f"--heartbeat-timeout {self.heartbeat_timeout_s!r} must be 0.1 to "
                f"{MAX_HEARTBEAT_TIMEOUT_S:.0f} seconds.",
                "e.g. --heartbeat-timeout 5: the pause per failure (too short evicts slow groups).",
            )
        return self


def parse_address(text: str, flag: str = "--lighthouse") -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too), checked."""
    host, _, port = str(text).rpartition(":")
    if (
        not host
        or not validate.is_digits(port)
        or len(port) > 5
        or not 0 < int(port) < 65536
        or not re.fullmatch(r"[\w.\-]{1,253}|\[[0-9A-Fa-f:.%\w]{2,60}\]", host)
    ):
        raise LaunchError(
            f"{flag} {str(text)[:60]!r} is not HOST:PORT.",
            f"write {flag} node1:29510 (the first node's address and the lighthouse's port).",
        )
    return host, int(port)


def group_env(
    group: int,
    settings: ReplicaSettings,
    lighthouse: str,
    *,
    loopback: bool,
    verbose: bool,
    threads: Optional[int] = None,
) -> dict[str, str]:
    """What a group's agent passes its workers: which group, how many, the lighthouse, and quiet torchft
    servers (their Rust logs print every quorum at INFO; ``--verbose`` or your own RUST_LOG keeps them)."""
    env = {
        REPLICA_GROUP_VAR: str(group),
        REPLICA_GROUPS_VAR: str(settings.groups),
        LIGHTHOUSE_VAR: lighthouse if lighthouse.startswith("http") else f"http://{lighthouse}",
        MIN_REPLICAS_VAR: str(settings.min_replicas),
    }
    if not verbose and "RUST_LOG" not in os.environ:
        env["RUST_LOG"] = "warn"
    if loopback and "GLOO_SOCKET_IFNAME" not in os.environ:
        # every group on this machine: gloo listens on loopback only
        env["GLOO_SOCKET_IFNAME"] = "lo"
    if threads is not None and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


class Lighthouse:
    """torchft's lighthouse in this process: ``with Lighthouse(...) as house: house.address``."""

    def __init__(
        self, host: str, port: int, settings: ReplicaSettings, verbose: bool = False
    ) -> None:
        self.host, self.port, self.settings, self.verbose = host, port, settings, verbose
        self._server: Optional[LighthouseServer] = None

    def __enter__(self) -> "Lighthouse":
        if not self.verbose and "RUST_LOG" not in os.environ:
            os.environ["RUST_LOG"] = "warn"  # read once, when torchft's native module loads
        try:
            from torchft.coordination import LighthouseServer
        except ImportError as exc:  # the same words as the strategy's (which launch may not import)
            raise LaunchError(
                f"replica groups need torchft, which is not installed ({exc.name or 'torchft'}).",
                "pip install 'multigpu[ft]' (or pip install torchft); it installs beside a CPU or "
                "CUDA torch without changing it.",
            ) from None

        try:
            self._server = LighthouseServer(
                bind=f"{self.host}:{self.port}",
                min_replicas=self.settings.min_replicas,
                join_timeout_ms=JOIN_TIMEOUT_MS,
                quorum_tick_ms=QUORUM_TICK_MS,
                heartbeat_timeout_ms=int(self.settings.heartbeat_timeout_s * 1000),
            )
        except Exception as exc:
            raise LaunchError(
                f"cannot start the lighthouse on {self.host}:{self.port}: {' '.join(str(exc).split())[:200]}",
                "choose a free port (or leave it to the launcher on one machine).",
            ) from None
        self.port = int(self._server.address().rpartition(":")[2])
        return self

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"{host}:{self.port}"

    def __exit__(self, *exc_info: object) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server = None


def follow_launcher() -> None:
    """In a group's agent: die when the replica launcher dies. SIGKILL, not SIGTERM: the lighthouse died
    with the launcher, so no quorum can form and the workers could not reach their next checkpoint (they
    would wait in the quorum until its timeout). Each worker dies with its agent; the job resumes from
    the last periodic checkpoint."""
    from multigpu.launch.process import die_with_parent

    expected = parse_job(os.environ.get(JOB_VAR)).replica_launcher_pid
    if expected and die_with_parent(signal.SIGKILL) and os.getppid() != expected:
        os._exit(1)  # the launcher died before prctl took effect


def run_groups(
    commands: Sequence[Sequence[str]],
    envs: Sequence[dict[str, Any]],
    lighthouse: Lighthouse,
    say: Callable[[str], None],
    poll_s: float = 0.1,
    grace_s: float = 180.0,
) -> int:
    """Start every group's agent, forward stop signals to them, report groups that end; the status."""

    def ended(group: int, code: int) -> bool:
        if code not in (0, EXIT_PREEMPTED) and not children.received and children.running():
            say(
                f"replica group {group} ended with status {code} (its restarts are used up); the other groups go "
                "on without it"
            )
        return False  # the others keep training

    with Children(_FORWARDED, grace_s, poll_s) as children:
        for command, env in zip(commands, envs):
            parent = job_env(os.environ.get(JOB_VAR), replica_launcher_pid=os.getpid())
            children.start(command, {**os.environ, **env, **parent})
        say(
            f"lighthouse {lighthouse.address} (at least {lighthouse.settings.min_replicas} group(s) per step, a "
            f"silent group is left out after {lighthouse.settings.heartbeat_timeout_s:g} s); {len(commands)} replica "
            "groups started"
        )
        codes = children.watch(ended)
    return _status(codes, children.received, say)


def _status(codes: dict[int, int], received: list[int], say: Callable[[str], None]) -> int:
    values = [codes[g] for g in sorted(codes)]
    if values and all(code == EXIT_PREEMPTED for code in values):
        say(
            "every replica group wrote its checkpoint and stopped (run the same command again to resume)."
        )
        return EXIT_PREEMPTED
    if received:
        name = signal.Signals(received[0]).name
        say(f"stopped by {name}: every replica group and the lighthouse were stopped.")
        return EXIT_INTERRUPTED if received[0] == signal.SIGINT else 128 + int(received[0])
    if 0 in values:
        failed = [g for g, code in sorted(codes.items()) if code != 0]
        if failed:
            say(
                f"training finished; replica group(s) {', '.join(map(str, failed))} had failed for good on the way."
            )
        return 0
    return next((code for code in values if code != 0), 1)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m multigpu.launch.replicas --bind HOST:PORT``: host the lighthouse until stopped (the
    first node of a Slurm job of replica groups runs this in the background)."""
    parser = argparse.ArgumentParser(
        prog="python -m multigpu.launch.replicas",
        description="Host torchft's lighthouse for a job of replica groups.",
    )
    parser.add_argument("--bind", required=True, metavar="HOST:PORT")
    parser.add_argument("--replica-groups", type=whole_flag, required=True, metavar="R")
    parser.add_argument("--min-replicas", type=whole_flag, default=1, metavar="M")
    parser.add_argument(
        "--heartbeat-timeout", type=float, default=DEFAULT_HEARTBEAT_TIMEOUT_S, metavar="S"
    )
    args = parser.parse_args(argv)
    try:
        host, port = parse_address(args.bind, "--bind")
        settings = ReplicaSettings(
            args.replica_groups, args.min_replicas, args.heartbeat_timeout
        ).check()
        stop: list[int] = []
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, lambda signum, frame: stop.append(signum))
        with Lighthouse(host, port, settings) as house:
            print(
                f"multigpu: lighthouse {house.address} for {settings.groups} replica groups",
                file=sys.stderr,
                flush=True,
            )
            while not stop:
                time.sleep(0.2)
    except LaunchError as exc:
        print(exc.one_line(), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
