"""Where this process stands: read once from torchrun, Slurm or nothing, into one immutable value.

Why: every other module needs rank, local rank and world size, and each launcher spells them
differently. Reading them once, here, in a fixed order (torchrun before Slurm, because torchrun also
runs inside Slurm jobs; then a plain single process) means a single process is simply
``world_size == 1`` and no other module touches the environment. Standard library only; this module
reads the environment and never writes it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

from multigpu import validate as checks
from multigpu.distributed.job import JOB_VAR, Job, Workers, parse_job
from multigpu.errors import WorldError

#: Slurm jobs without an explicit MASTER_PORT get one derived from the job id, in this range.
SLURM_PORT_BASE = 15000
SLURM_PORT_SPAN = 20000
#: Set by ``multigpu run --replica-groups R`` for each group (torchft's own names for the first three, so
#: a job launched the torchft way is read the same): which group this process belongs to, how many there
#: are, where the lighthouse that holds the per-step quorum listens, and the fewest groups a step needs.
REPLICA_GROUP_VAR = "REPLICA_GROUP_ID"
REPLICA_GROUPS_VAR = "NUM_REPLICA_GROUPS"
LIGHTHOUSE_VAR = "TORCHFT_LIGHTHOUSE"
MIN_REPLICAS_VAR = "MULTIGPU_MIN_REPLICAS"
#: More replica groups than this is a typo (each is a whole data-parallel replica of the model).
MAX_REPLICA_GROUPS = 1024


@dataclass(frozen=True)
class World:
    """This process's place in the job. ``World()`` is a plain single process."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    master_addr: str = "127.0.0.1"
    master_port: Optional[int] = None
    source: str = "single"  # "torchrun", "env", "slurm" or "single"
    devices_per_process: int = 1
    #: Processes sharing one device (``--procs-per-gpu``); they talk over gloo, not NCCL.
    processes_per_device: int = 1
    restart_count: int = 0
    max_restarts: int = 0
    #: The launcher's id for this job: torchrun's rendezvous run id, or the Slurm job id ("" for none).
    launch_id: str = ""
    #: torchrun's agent already hosts the rendezvous store; workers must join it, not create one.
    agent_store: bool = False
    #: CUDA_VISIBLE_DEVICES as the launcher left it (None: not set, every GPU is visible).
    visible_devices: Optional[str] = None
    nodes: tuple[str, ...] = field(default=())
    #: The Slurm job this process runs in, whatever launched it inside the job ("" outside Slurm).
    slurm_job_id: str = ""
    #: Replica groups (``multigpu run --replica-groups R``): this process's group, how many there are,
    #: the lighthouse's address (None: not a fault-tolerant job) and the fewest groups a step needs.
    #: ``rank``/``world_size`` stay the group's own: torch.distributed's world is one group.
    replica_group: int = 0
    replica_groups: int = 1
    lighthouse: Optional[str] = None
    min_replicas: int = 1

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Global rank 0: the one process that writes checkpoints, logs and progress bars."""
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        """Local rank 0: the one process per node for node-local work (caches, downloads)."""
        return self.local_rank == 0

    @property
    def global_rank(self) -> int:
        """This process's number across every replica group (``rank`` when there are none)."""
        return self.replica_group * self.world_size + self.rank

    def describe(self) -> str:
        group = (
            f", replica group {self.replica_group}/{self.replica_groups}" if self.lighthouse else ""
        )
        return (
            f"rank {self.rank}/{self.world_size} (local {self.local_rank}/{self.local_world_size}, "
            f"node {self.node_rank}/{self.num_nodes}{group}) from {self.source}"
        )


Env = Mapping[str, str]
Reader = Callable[[Env], Optional[World]]


def _int(env: Env, name: str, default: Optional[int] = None, hint: str = "") -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is None:
            raise WorldError(
                f"{name} is not set.", hint or f"set {name} or launch with `multigpu run`."
            )
        return default
    return checks.whole_number(
        raw,
        name,
        WorldError,
        hint or f"fix or unset {name}; it is normally set by the launcher, not by hand.",
    )


def _common(env: Env) -> dict[str, Any]:
    """Settings that every launcher passes the same way."""
    # what `multigpu run` told its workers (none: torchrun's)
    workers = read_job(env).workers or Workers()
    per_proc, sharing = workers.devices_per_process, workers.processes_per_device
    if sharing > 1 and per_proc > 1:
        raise WorldError(
            f"{JOB_VAR}: processes_per_device={sharing} with devices_per_process={per_proc}: processes "
            "share a device or own several, not both.",
            "use `multigpu run --procs-per-gpu K` or `--gpus-per-proc K`, not both.",
        )
    return {
        "devices_per_process": per_proc,
        "processes_per_device": sharing,
        "visible_devices": env.get("CUDA_VISIBLE_DEVICES"),
        "slurm_job_id": env.get("SLURM_JOB_ID", ""),
        **_replica_groups(env),
    }


def _replica_groups(env: Env) -> dict[str, Any]:
    """The replica-group variables, all or none: a group id without a lighthouse (or the reverse) is a
    half-configured fault-tolerant job, which would train alone without anyone noticing."""
    lighthouse = env.get(LIGHTHOUSE_VAR) or None
    if lighthouse is None:
        if env.get(REPLICA_GROUP_VAR) or env.get(REPLICA_GROUPS_VAR):
            raise WorldError(
                f"{REPLICA_GROUP_VAR}/{REPLICA_GROUPS_VAR} are set but {LIGHTHOUSE_VAR} is not.",
                "launch with `multigpu run --replica-groups R`, which sets all of them, or unset them.",
            )
        return {}
    hint = "these are set by `multigpu run --replica-groups R`; unset them when running by hand."
    if len(lighthouse) > 300 or not re.fullmatch(r"https?://[\w.\-\[\]:%]+:[0-9]{1,5}", lighthouse):
        raise WorldError(f"{LIGHTHOUSE_VAR}={lighthouse[:60]!r} is not http://HOST:PORT.", hint)
    groups = _int(env, REPLICA_GROUPS_VAR, hint=hint)
    group = _int(env, REPLICA_GROUP_VAR, hint=hint)
    least = _int(env, MIN_REPLICAS_VAR, 1, hint)
    if not 1 <= groups <= MAX_REPLICA_GROUPS or not 0 <= group < groups or not 1 <= least <= groups:
        raise WorldError(
            f"replica group {group} of {groups} with {least} needed per step is not possible "
            f"(need 0 <= {REPLICA_GROUP_VAR} < {REPLICA_GROUPS_VAR} <= {MAX_REPLICA_GROUPS} and "
            f"1 <= {MIN_REPLICAS_VAR} <= {REPLICA_GROUPS_VAR}).",
            hint,
        )
    return {
        "replica_group": group,
        "replica_groups": groups,
        "lighthouse": lighthouse,
        "min_replicas": least,
    }


def read_torchrun(env: Env) -> Optional[World]:
    """torchrun / TorchElastic (and ``multigpu run``, which is built on it), or plain RANK/WORLD_SIZE."""
    names = ("RANK", "WORLD_SIZE")
    present = [n for n in names if env.get(n)]
    if not present:
        return None
    if len(present) != len(names):
        missing = [n for n in names if n not in present]
        raise WorldError(
            f"{present[0]} is set but {missing[0]} is not.",
            "launch with `multigpu run` or torchrun, which set both, or unset the stray variable.",
        )
    world_size = _int(env, "WORLD_SIZE")
    local_world_size = _int(env, "LOCAL_WORLD_SIZE", world_size)
    rank = _int(env, "RANK")
    world = World(
        rank=rank,
        local_rank=_int(env, "LOCAL_RANK", rank % max(local_world_size, 1)),
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=_int(env, "GROUP_RANK", rank // max(local_world_size, 1)),
        num_nodes=_int(env, "GROUP_WORLD_SIZE", max(world_size // max(local_world_size, 1), 1)),
        master_addr=env.get("MASTER_ADDR") or "127.0.0.1",
        master_port=_int(env, "MASTER_PORT", 0) or None,
        source="torchrun" if env.get("TORCHELASTIC_RUN_ID") else "env",
        restart_count=_int(env, "TORCHELASTIC_RESTART_COUNT", 0),
        max_restarts=_int(env, "TORCHELASTIC_MAX_RESTARTS", 0),
        launch_id=env.get("TORCHELASTIC_RUN_ID", ""),
        agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
        **_common(env),
    )
    if world.source == "env" and world.world_size > 1 and world.master_port is None:
        raise WorldError(
            f"RANK and WORLD_SIZE={world_size} are set but MASTER_PORT is not.",
            "set MASTER_ADDR and MASTER_PORT too, or launch with `multigpu run` / torchrun.",
        )
    if world.source == "torchrun" and world.world_size != world.local_world_size * world.num_nodes:
        raise WorldError(
            f"WORLD_SIZE={world.world_size} but LOCAL_WORLD_SIZE={world.local_world_size} x "
            f"GROUP_WORLD_SIZE={world.num_nodes} = {world.local_world_size * world.num_nodes}.",
            "every node must start the same number of processes (same --nproc / --gpus on each node).",
        )
    return world


# ---------------------------------------------------------------------------------------- Slurm


#: The most names a Slurm node list may expand to (Slurm's own limit on nodes is far below): a list such
#: as ``node[1-100000000]`` is refused before it is built, not expanded into gigabytes.
MAX_NODELIST = 65_536


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand Slurm's compressed host lists (``gpu[01-03,07],cpu5``) without calling ``scontrol``.

    Several bracket groups in one name (``r[1-2]-n[01-02]``) expand to their product, in Slurm's order.
    """
    nodelist = nodelist.strip()
    if not nodelist:
        return []
    items, depth, start = [], 0, 0
    for i, ch in enumerate(nodelist):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                break
        elif ch == "," and depth == 0:
            items.append(nodelist[start:i])
            start = i + 1
    if depth != 0:
        raise WorldError(
            f"cannot parse the Slurm node list {nodelist!r}: unbalanced brackets.",
            "check SLURM_JOB_NODELIST; it should look like gpu[01-03,07],cpu5.",
        )
    items.append(nodelist[start:])
    hosts: list[str] = []
    for item in items:
        if item:
            hosts.extend(_expand_one(item, nodelist, MAX_NODELIST - len(hosts)))
        if len(hosts) > MAX_NODELIST:
            raise _too_many(nodelist)
    return hosts


def _too_many(whole: str) -> WorldError:
    return WorldError(
        f"the Slurm node list {whole[:80]!r} names more than {MAX_NODELIST:,} nodes.",
        "check SLURM_JOB_NODELIST/SLURM_NODELIST: no job spans that many nodes (a typo in a range?).",
    )


def _expand_one(name: str, whole: str, room: int) -> list[str]:
    """The names of one item, at most ``room`` of them (counted before any list is built)."""
    match = re.search(r"\[([^\]]*)\]", name)
    if match is None:
        return [name]
    prefix, rest = name[: match.start()], name[match.end() :]
    values: list[str] = []
    for part in match.group(1).split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if (
            not checks.is_digits(lo)
            or (sep and not checks.is_digits(hi))
            or len(lo) > 18
            or len(hi) > 18
        ):
            raise WorldError(
                f"cannot parse {part!r} in the Slurm node list {whole!r}.",
                "check SLURM_JOB_NODELIST; ranges look like [01-03,07].",
            )
        if not sep:
            values.append(lo)
        elif int(hi) < int(lo):
            raise WorldError(
                f"descending range {part!r} in the Slurm node list {whole!r}.",
                "check SLURM_JOB_NODELIST.",
            )
        elif int(hi) - int(lo) + 1 > room - len(values):
            raise _too_many(whole)
        else:
            values.extend(str(v).zfill(len(lo)) for v in range(int(lo), int(hi) + 1))
        if len(values) > room:
            raise _too_many(whole)
    tails = _expand_one(rest, whole, max(room // max(len(values), 1), 1))
    if len(values) * len(tails) > room:
        raise _too_many(whole)
    return [prefix + v + t for v in values for t in tails]


def expand_tasks_per_node(spec: str) -> list[int]:
    """Expand Slurm's ``SLURM_TASKS_PER_NODE`` form ``2(x3),1`` into ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"\s*([0-9]{1,9})(?:\(x([0-9]{1,9})\))?\s*", part)
        if match is None:
            raise WorldError(
                f"cannot parse SLURM_TASKS_PER_NODE={spec[:80]!r}.", "it should look like 2(x3),1."
            )
        repeat = int(match.group(2) or 1)
        if len(counts) + repeat > MAX_NODELIST:
            raise WorldError(
                f"SLURM_TASKS_PER_NODE={spec[:80]!r} names more than {MAX_NODELIST:,} nodes.",
                "check SLURM_TASKS_PER_NODE: no job spans that many nodes.",
            )
        counts.extend([int(match.group(1))] * repeat)
    return counts


def slurm_port(job_id: str) -> int:
    """A port derived from the job id, so all tasks of a job agree on it without talking first."""
    digits = re.sub(r"[^0-9]", "", job_id) or "0"
    return SLURM_PORT_BASE + int(digits) % SLURM_PORT_SPAN


def read_slurm(env: Env) -> Optional[World]:
    """Tasks started by ``srun`` (one task per process). A batch script or salloc shell is not a step."""
    if "SLURM_PROCID" not in env or "SLURM_STEP_ID" not in env:
        return None
    if env.get("SLURM_JOB_NAME") in ("bash", "interactive"):
        return None
    hint = (
        "these come from srun; run the script with `srun` inside the job, or with `multigpu slurm`."
    )
    rank = _int(env, "SLURM_PROCID", hint=hint)
    world_size = _int(env, "SLURM_STEP_NUM_TASKS", _int(env, "SLURM_NTASKS", 1, hint), hint)
    node_rank = _int(env, "SLURM_NODEID", 0, hint)
    num_nodes = _int(env, "SLURM_STEP_NUM_NODES", _int(env, "SLURM_NNODES", 1, hint), hint)
    nodes = tuple(
        expand_nodelist(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "")
    )
    per_node_spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if per_node_spec:
        per_node = expand_tasks_per_node(per_node_spec)
        if len(per_node) != num_nodes:
            raise WorldError(
                f"SLURM_TASKS_PER_NODE={per_node_spec!r} lists {len(per_node)} nodes but the step has {num_nodes}.",
                hint,
            )
        local_world_size = per_node[node_rank] if node_rank < len(per_node) else 1
    else:
        local_world_size = _int(
            env, "SLURM_NTASKS_PER_NODE", max(world_size // max(num_nodes, 1), 1), hint
        )
    job_id = env.get("SLURM_JOB_ID", "")
    port_raw = env.get("MASTER_PORT")
    world = World(
        rank=rank,
        local_rank=_int(env, "SLURM_LOCALID", 0, hint),
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=node_rank,
        num_nodes=num_nodes,
        master_addr=env.get("MASTER_ADDR") or (nodes[0] if nodes else "127.0.0.1"),
        master_port=_int(env, "MASTER_PORT") if port_raw else slurm_port(job_id),
        source="slurm",
        restart_count=_int(env, "SLURM_RESTART_COUNT", 0, hint),
        launch_id=job_id,
        nodes=nodes,
        **_common(env),
    )
    if nodes and len(nodes) != num_nodes:
        raise WorldError(
            f"the Slurm node list has {len(nodes)} hosts but SLURM_NNODES={num_nodes}.", hint
        )
    return world


# ------------------------------------------------------------------------------------- detection

#: Ordered: the first reader that recognises its launcher wins.
READERS: tuple[Reader, ...] = (read_torchrun, read_slurm)


def validate(world: World) -> World:
    """Reject impossible combinations at once, naming the numbers, instead of hanging at rendezvous."""
    where = f"(from {world.source})"
    if world.world_size < 1:
        raise WorldError(
            f"world size {world.world_size} {where} must be at least 1.",
            "check the launcher's variables.",
        )
    if not 0 <= world.rank < world.world_size:
        raise WorldError(
            f"rank {world.rank} is outside world size {world.world_size} {where}.",
            "RANK/SLURM_PROCID must be below WORLD_SIZE/SLURM_NTASKS; relaunch instead of setting them by hand.",
        )
    if not 0 <= world.node_rank < world.num_nodes:
        raise WorldError(
            f"node rank {world.node_rank} is outside the {world.num_nodes} node(s) {where}.",
            "give each machine a --node-rank from 0 to --nnodes minus 1.",
        )
    if not 0 <= world.local_rank < world.local_world_size:
        raise WorldError(
            f"local rank {world.local_rank} is outside local world size {world.local_world_size} {where}.",
            "LOCAL_RANK/SLURM_LOCALID must be below LOCAL_WORLD_SIZE/SLURM_NTASKS_PER_NODE.",
        )
    if world.local_world_size > world.world_size:
        raise WorldError(
            f"local world size {world.local_world_size} exceeds world size {world.world_size} {where}.",
            "check --ntasks-per-node against --ntasks, or --nproc against the job size.",
        )
    return world


def read_job(env: Optional[Env] = None) -> Job:
    """What the command that started this process asks of it (:mod:`multigpu.distributed.job`), checked."""
    return parse_job((os.environ if env is None else env).get(JOB_VAR))


def detect_world(env: Optional[Env] = None, readers: Sequence[Reader] = READERS) -> World:
    """Read the world from ``env`` (default: this process's environment), validated."""
    env = os.environ if env is None else env
    for reader in readers:
        world = reader(env)
        if world is not None:
            return validate(world)
    return validate(World(**_common(env)))
