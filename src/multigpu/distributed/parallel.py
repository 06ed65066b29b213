"""The degrees of parallelism of a run, and the DeviceMesh built from them - once, asked by everyone.

Why: data parallelism is not the only dimension. With tensor parallelism (``tp``) several ranks share
one batch; with HSDP (``dp_replicate`` x ``dp_shard``) the data-parallel ranks form two mesh dimensions.
Every consumer asks this object for its own dimension instead of assuming "data-parallel size ==
world size": the sampler shards by :attr:`dp_rank` / :attr:`dp_size`, the global batch is batch x
``dp_size``, metrics reduce over the data-parallel group, the sharded strategies take their sub-mesh.
Learned from torchtitan's ``ParallelDims`` (degrees validated once, one mesh, everyone asks it for a
dimension) and Lightning Fabric's ``distributed_sampler_kwargs``.

Rank layout: ``rank = ((stage * dp_replicate + replicate) * dp_shard + shard) * tp + tp_rank`` -
tensor parallelism innermost, so a tp group is consecutive ranks of one node (its collectives run
every layer and must not cross the network); data-parallel groups are strided; pipeline parallelism
(``pp``) outermost, so pipeline stage s is the consecutive block of ranks ``s * world/pp`` to
``(s + 1) * world/pp - 1`` - whole nodes when a stage fills them, and only the stage-to-stage
activations (point to point, once per micro-batch) cross between them (torchtitan's order).

The mesh is built only when a strategy needs one (fsdp, hsdp, fsdp+tp, pp): plain DDP uses the default
group and pays nothing. Its dimensions are (dp_replicate, dp_shard, tp), with ``pp`` first when pp > 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Optional

from multigpu.errors import ConfigError

if TYPE_CHECKING:
    from multigpu.distributed.world import World

DIM_NAMES = ("dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class Parallelism:
    """Degrees whose product is the world size. ``Parallelism.plain(world)`` is pure data parallelism."""

    world_size: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    #: Pipeline stages: ranks s * world/pp .. (s + 1) * world/pp - 1 hold stage s.
    pp: int = 1

    @classmethod
    def plain(cls, world_size: int) -> "Parallelism":
        return cls(world_size, 1, world_size, 1)

    @classmethod
    def from_degrees(
        cls,
        world_size: int,
        local_world_size: int,
        *,
        dp_replicate: int = 1,
        dp_shard: Optional[int] = None,
        tp: int = 1,
        pp: int = 1,
    ) -> "Parallelism":
        """Validate requested degrees; ``dp_shard`` None (or -1) takes what is left of the world."""
        for name, value in (("tp", tp), ("dp_replicate", dp_replicate), ("pp", pp)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(
                    f"{name}={value!r} must be a whole number of at least 1.",
                    f"use {name}: 1 or more.",
                )
        staged = f"pp={pp} x " if pp > 1 else ""
        rest = dp_replicate * tp * pp
        if dp_shard is None or dp_shard == -1:
            if world_size % rest:
                raise ConfigError(
                    f"{staged}dp_replicate={dp_replicate} x tp={tp} = {rest} does not divide the world "
                    f"size {world_size}.",
                    f"choose degrees whose product divides {world_size}.",
                )
            dp_shard = world_size // rest
        if isinstance(dp_shard, bool) or not isinstance(dp_shard, int) or dp_shard < 1:
            raise ConfigError(
                f"dp_shard={dp_shard!r} must be a whole number of at least 1 (or -1: the rest).",
                "leave dp_shard out to use the rest of the world.",
            )
        if dp_replicate * dp_shard * tp * pp != world_size:
            raise ConfigError(
                f"{staged}dp_replicate={dp_replicate} x dp_shard={dp_shard} x tp={tp} = "
                f"{dp_replicate * dp_shard * tp * pp}, but the world has {world_size} processes.",
                f"choose degrees whose product is {world_size} (dp_shard -1 takes the rest).",
            )
        if tp > 1 and local_world_size % tp:
            raise ConfigError(
                f"tp={tp} would span nodes: each node runs {local_world_size} process(es).",
                f"tensor parallelism talks every layer; keep it within a node: tp must divide "
                f"{local_world_size}.",
            )
        return cls(world_size, dp_replicate, dp_shard, tp, pp)

    # ---------------------------------------------------------------- who am I in each dimension
    @property
    def dp_size(self) -> int:
        """Ranks that see different data: the sampler's number of shards, the global batch's factor."""
        return self.dp_replicate * self.dp_shard

    @property
    def stage_size(self) -> int:
        """Ranks per pipeline stage (the whole world without pp)."""
        return self.world_size // self.pp

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def pp_rank(self, rank: int) -> int:
        """The pipeline stage (group of consecutive ranks) this rank belongs to."""
        return rank // self.stage_size

    def dp_rank(self, rank: int) -> int:
        """This rank's data shard: ranks of one tensor-parallel group (and of one pipeline) read the same batch."""
        return (rank % self.stage_size) // self.tp

    def dp_group_ranks(self, rank: int) -> list[int]:
        """The ranks that hold the same tensor-parallel slice of the same stage and different data (metrics
        reduce here)."""
        return [
            r
            for r in range(self.world_size)
            if r % self.tp == rank % self.tp and self.pp_rank(r) == self.pp_rank(rank)
        ]

    def dp_groups(self) -> list[list[int]]:
        """Every data-parallel group, in rank order (each rank creates each group, torch's rule)."""
        groups: list[list[int]] = []
        for rank in range(self.world_size):
            ranks = self.dp_group_ranks(rank)
            if ranks not in groups:
                groups.append(ranks)
        return groups

    def pp_group_ranks(self, rank: int) -> list[int]:
        """The ranks of this rank's pipeline: one per stage, at the same place in each stage's block."""
        return [stage * self.stage_size + rank % self.stage_size for stage in range(self.pp)]

    @property
    def is_plain(self) -> bool:
        return self.tp == 1 and self.dp_replicate == 1 and self.pp == 1

    def describe(self) -> str:
        parts = [f"pp {self.pp}"] if self.pp > 1 else []
        if self.dp_replicate > 1:
            parts.append(f"dp_replicate {self.dp_replicate}")
        parts.append(
            f"dp_shard {self.dp_shard}"
            if (self.dp_replicate > 1 or self.tp > 1)
            else f"dp {self.dp_shard}"
        )
        if self.tp > 1:
            parts.append(f"tp {self.tp}")
        return " x ".join(parts)

    # ---------------------------------------------------------------- the mesh
    def build_mesh(self, device_type: str) -> Any:
        """``init_device_mesh`` over (dp_replicate, dp_shard, tp), with ``pp`` first when pp > 1: a collective,
        every rank calls it once."""
        from torch.distributed.device_mesh import init_device_mesh

        staged = self.pp > 1
        shape = ((self.pp,) if staged else ()) + (self.dp_replicate, self.dp_shard, self.tp)
        return init_device_mesh(
            device_type, shape, mesh_dim_names=(("pp",) if staged else ()) + DIM_NAMES
        )


def check_replica_groups(fault_tolerance: Optional[Mapping[str, int]], world: "World") -> None:
    """The Trainer's ``fault_tolerance`` setting (replica groups: a dimension across torch.distributed
    worlds), when given, against how the job was launched - before any model is wrapped."""
    if fault_tolerance is None:
        return
    wanted, least = fault_tolerance["replica_groups"], fault_tolerance["min_replicas"]
    flags = f"--replica-groups {wanted}" + (f" --min-replicas {least}" if least != 1 else "")
    if world.lighthouse is None:
        raise ConfigError(
            f"this recipe asks for fault_tolerance with {wanted} replica groups, but the job was not "
            "launched with replica groups.",
            f"launch it with `multigpu run {flags} ...`, or remove "
            "fault_tolerance from the settings.",
        )
    if (world.replica_groups, world.min_replicas) != (wanted, least):
        raise ConfigError(
            f"fault_tolerance asks for {wanted} replica group(s), at least {least} per step, but the job "
            f"was launched with {world.replica_groups}, at least {world.min_replicas}.",
            f"launch with `multigpu run {flags} ...`, or change fault_tolerance to match.",
        )
