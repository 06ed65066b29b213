"""``ft-ddp``: data parallelism across replica groups that keeps stepping when a group dies (torchft).

Why torchft and not a restart: with ``ddp`` one failed rank stops every rank and the whole job restarts
from its last checkpoint. Here each replica group (``multigpu run --replica-groups R``) is its own
torch.distributed world; torchft's lighthouse forms a quorum of the live groups before every step and its
fault-tolerant DDP averages gradients over that quorum only. A group that dies is left out after the
lighthouse's heartbeat timeout; a group that comes back fetches the live weights, optimizer and counters
from a peer (torchft's "heal") and steps again at the same step as the others.

What this module adds to torchft's ``Manager`` and ``DistributedDataParallel``:

- the quorum opens at the first training forward of each step (a forward pre-hook) and is *synchronous*
  (``use_async_quorum=False``): a group that heals loads the peer's state before its forward, so its
  gradient counts in that very step, and nothing else in the process can change the state being sent;
- the optimizer is wrapped so that ``step()`` asks the quorum whether to commit and returns the answer
  (torchft's own wrapper opens the quorum in ``zero_grad``, which the Trainer calls after the step - too
  late for the counters a heal carries);
- the peer-to-peer heal uses torchft's ``PGTransport`` (over the replica process group), not its HTTP
  server, which would listen on every interface;
- the gradient hook: torchft 0.2.0's DDP hook fails an assertion when a peer dies *during* the all-reduce
  (``assert fut._fut``: the error was reported to the manager, the future never completed) and takes the
  surviving group down with it. Ours (a subclass overriding the hook) returns the bucket instead; the
  manager already knows of the error, so the step does not commit and is dropped. With several processes
  per group, the hook first averages each bucket inside the group (the group's own process group), then
  across groups: torchft's DDP alone reduces only between equal group ranks.

Semantics, as the Trainer uses them: the step counter is the quorum's committed step count (a step that
does not commit - a peer died during it - is dropped with its batch and not counted); while a group is
gone its share of each global batch is skipped, not redistributed, so the global batch shrinks to
``batch x processes x live groups``. See docs/fault-tolerance.md.
"""

from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, ContextManager, Optional

import torch
import torch.distributed as dist
from torch import nn
from typing_extensions import override

from multigpu.config import bounds
from multigpu.distributed.world import World
from multigpu.errors import ConfigError, MultiGPUError
from multigpu.strategies.base import (
    BuildContext,
    OptimizerLike,
    PlainGradients,
    StrategySpec,
    build_optimizer,
)

#: How the quorum names each group: torchft takes the trailing digits as the group's number.
REPLICA_ID = "multigpu_replica_group_{}"


def import_torchft() -> Any:
    """torchft, or one line saying how to install it (it is an optional dependency)."""
    try:
        import torchft
    except ImportError as exc:
        raise ConfigError(
            f"replica groups need torchft, which is not installed ({exc.name or 'torchft'}).",
            "pip install 'multigpu[ft]' (or pip install torchft); it installs beside a CPU or CUDA "
            "torch without changing it.",
        ) from None
    return torchft


@dataclass(frozen=True)
class FaultTolerantOptions:
    #: How long a collective, a heal transfer or a commit vote may wait for a peer before the step is
    #: dropped (a group killed in the middle of an all-reduce costs this much, once).
    timeout_s: float = field(default=60.0, metadata=bounds(0.001, 1e7))
    #: How long a step may wait for the lighthouse to form a quorum before the process fails.
    quorum_timeout_s: float = field(default=120.0, metadata=bounds(0.001, 1e7))


class _QuietTorchft(logging.Filter):
    """torchft's manager log, shortened: its warning at every new quorum that NCCL's flight recorder cannot
    be reset is dropped (on CPU processes there is none), and an error it has handled (a peer died
    during an all-reduce: the step is dropped) is one line, without the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "flight recorder" in str(record.msg):
            return False
        record.exc_info = record.exc_text = None
        return True


class CommittingOptimizer(torch.optim.Optimizer):
    """The user's optimizer, stepped only when the quorum commits; ``step()`` returns whether it did.

    Like torchft's ``OptimizerWrapper`` it does not call ``Optimizer.__init__``: parameter groups and
    state are the wrapped optimizer's own objects, so LR schedulers and checkpoints act on them.
    """

    def __init__(self, strategy: "FaultTolerantDDP", optimizer: torch.optim.Optimizer) -> None:
        self.optim = optimizer
        self._strategy = strategy

    @property
    def param_groups(self) -> list[Any]:  # type: ignore[override]  # torch's Optimizer declares these as attributes
        return self.optim.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]  # (as above)
        return self.optim.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]  # (as above)
        return self.optim.defaults

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optim.add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none)

    def step(self, closure: Optional[Callable[[], Any]] = None) -> bool:  # type: ignore[override]
        if closure is not None:
            raise ConfigError(
                "strategy ft-ddp cannot step an optimizer with a closure (LBFGS).",
                "use an optimizer without a closure.",
            )
        committed = self._strategy.commit()
        if committed:
            self.optim.step()
        return committed

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state and torchft's counters (``Manager.state_dict()``: the committed steps and
        batches), which a checkpoint must hold so a resumed group reports its true step to the quorum."""
        return {**self.optim.state_dict(), "torchft": self._strategy.manager_state()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        counters = state_dict.pop("torchft", None)
        self.optim.load_state_dict(state_dict)
        if isinstance(counters, dict):
            self._strategy.load_manager_state(counters)


class FaultTolerantDDP(PlainGradients):
    """One replica per group rank, gradients averaged over the live replica groups of each step."""

    name = "ft-ddp"
    sharded = False
    fault_tolerant = True

    def __init__(
        self,
        world: World,
        device: torch.device,
        options: FaultTolerantOptions = FaultTolerantOptions(),
    ) -> None:
        self.world = world
        self.device = device
        self.options = options
        self.manager: Any = None
        self._store: Any = None
        #: What a healing group receives, by key, in the order it is loaded (see ``register_state``).
        self._parts: dict[str, tuple[Callable[[Any], None], Callable[[], Any]]] = {}
        #: A quorum is open for the current step (opened by the first training forward, closed by step()).
        self._open = False

    # ------------------------------------------------------------------ the Strategy protocol
    def setup(
        self, model: nn.Module, optimizer: OptimizerLike = None
    ) -> tuple[nn.Module, Optional[torch.optim.Optimizer]]:
        torchft = import_torchft()
        model = model.to(self.device)
        self.manager = self._make_manager()
        self.manager.register_state_dict_fn("multigpu", self._load_parts, self._state_parts)
        self.register_state("model", model.load_state_dict, model.state_dict)
        wrapped = _replica_ddp(torchft)(self.manager, model)
        wrapped.register_forward_pre_hook(self._before_forward)
        inner = build_optimizer(optimizer, model)
        if inner is None:
            return wrapped, None
        self.register_state("optimizer", inner.load_state_dict, inner.state_dict)
        return wrapped, CommittingOptimizer(self, inner)

    @override
    def no_sync(self, model: nn.Module) -> ContextManager[None]:
        # DDP's own method; torch types nn.Module.__getattr__ as Tensor | Module
        sync: ContextManager[None] = model.no_sync()  # type: ignore[operator]
        return sync

    # ------------------------------------------------------------------ the quorum, step by step
    def register_state(
        self, key: str, load: Callable[[Any], None], state: Callable[[], Any], first: bool = False
    ) -> None:
        """What a group that heals receives from its peer, under ``key`` (the Trainer adds its counters).
        ``first``: load this part before the others (a check that must run before anything is changed)."""
        self._parts = (
            {key: (load, state), **self._parts} if first else {**self._parts, key: (load, state)}
        )

    def _state_parts(self) -> dict[str, Any]:
        return {key: state() for key, (_, state) in self._parts.items()}

    def _load_parts(self, received: Any) -> None:
        missing = [
            key for key in self._parts if not isinstance(received, dict) or key not in received
        ]
        if missing:
            raise MultiGPUError(
                f"replica group {self.world.replica_group} cannot heal: the live group sent no "
                f"{', '.join(missing)} state (it runs different code: a Trainer and a loop of your own?).",
                "start every replica group with the same script.",
            )
        for key, (load, _) in self._parts.items():
            load(received[key])

    def begin_step(self) -> None:
        """Open this step's quorum: wait for the lighthouse, reconfigure if the live groups changed, and
        heal (load a peer's state) when this group is behind. Idempotent until ``commit``."""
        if self._open:
            return
        self.manager.start_quorum()
        self._open = True

    def commit(self) -> bool:
        """Close the step: True when every rank of every group in the quorum finished it without error."""
        if not self._open:
            raise MultiGPUError(
                "strategy ft-ddp: optimizer.step() without a training forward before it.",
                "call the model run.setup returned (its forward opens the step's quorum), not its "
                ".module, and keep it in train() mode.",
            )
        self._open = False
        return bool(self.manager.should_commit())

    def join(self, everyone_within_s: float) -> None:
        """The first quorum, before the first batch. A group behind the others heals here. At a fresh
        start (no group has committed a step) it waits up to ``everyone_within_s`` for every group, so the
        job does not begin with part of its global batch because one group imported torch more slowly."""
        self.begin_step()
        deadline = time.monotonic() + everyone_within_s
        retries = 0
        while time.monotonic() < deadline and (
            (self.manager.errored() is not None and retries < 5)
            or (
                self.manager.current_step() == 0 and self.participants() < self.world.replica_groups
            )
        ):
            retries += self.manager.errored() is not None
            time.sleep(0.2)
            self.manager.start_quorum()

    def participants(self) -> int:
        """Replica groups taking part in the open (or last) step."""
        return int(self.manager.num_participants())

    def committed_step(self) -> int:
        """Steps the quorum has committed: the job's step counter (the same in every live group)."""
        return int(self.manager.current_step())

    def manager_state(self) -> dict[str, Any]:
        """torchft's counters, saved with every checkpoint so a resumed group reports its true step."""
        return dict(self.manager.state_dict())

    def load_manager_state(self, state: dict[str, Any]) -> None:
        self.manager.load_state_dict(
            {
                "step": int(state.get("step", 0)),
                "batches_committed": int(state.get("batches_committed", 0)),
            }
        )

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        if module.training and torch.is_grad_enabled():
            self.begin_step()

    def _make_manager(self) -> Any:
        from torchft import Manager, ProcessGroupGloo
        from torchft.checkpointing.pg_transport import PGTransport

        world, timeout = self.world, timedelta(seconds=self.options.timeout_s)
        if world.master_port is None:
            raise ConfigError(
                "strategy ft-ddp needs the replica group's store (MASTER_ADDR/MASTER_PORT).",
                "launch with `multigpu run --replica-groups R`.",
            )
        logging.getLogger("torchft.manager").addFilter(_QuietTorchft())
        # Two warnings torchft's heal transfer prints once per process, about its own code (a read-only
        # buffer it only reads, a deprecated pytree check): nothing a user can act on.
        warnings.filterwarnings("ignore", module=r"torchft\.checkpointing\.pg_transport")
        if not dist.is_initialized() and not world.agent_store:
            # One process per group: mg.init started no process group, so nobody hosts the group's store
            # (torchft keeps its manager's address there, and the quorum's first group hosts the rendezvous
            # of the replica process group in it). Host it here, where init_process_group would have.
            self._store = dist.TCPStore(
                world.master_addr,
                world.master_port,
                1,
                is_master=True,
                wait_for_workers=False,
                timeout=timeout,
            )
        if self.device.type == "cuda" and world.processes_per_device == 1:
            from torchft import ProcessGroupNCCL

            group: Any = ProcessGroupNCCL(timeout=timeout)
        else:
            group = ProcessGroupGloo(timeout=timeout)
        try:
            return Manager(
                pg=group,
                load_state_dict=None,
                state_dict=None,
                min_replica_size=world.min_replicas,
                use_async_quorum=False,
                timeout=timeout,
                quorum_timeout=timedelta(seconds=self.options.quorum_timeout_s),
                connect_timeout=timeout,
                rank=world.rank,
                world_size=world.world_size,
                store_addr=world.master_addr,
                store_port=world.master_port,
                lighthouse_addr=world.lighthouse,
                replica_id=REPLICA_ID.format(world.replica_group),
                hostname=world.master_addr,
                checkpoint_transport=PGTransport(group, timeout=timeout, device=self.device),
                init_sync=True,
            )
        except Exception as exc:  # the lighthouse or the group's store cannot be reached
            text = " ".join(str(exc).split())[:200]
            raise MultiGPUError(
                f"replica group {world.replica_group} could not join the lighthouse at "
                f"{world.lighthouse}: {type(exc).__name__}: {text}",
                "start the job with `multigpu run --replica-groups R` (it starts the lighthouse), or "
                "check --lighthouse HOST:PORT.",
            ) from None


def _replica_ddp(torchft: Any) -> type:
    """torchft's DistributedDataParallel with the gradient hook described in the module docstring."""

    class ReplicaDDP(torchft.DistributedDataParallel):  # type: ignore[misc]  # torchft: untyped here
        @staticmethod
        def _comm_hook(state, bucket):  # type: ignore[no-untyped-def]  # no annotations: torch checks real ones
            buffer = bucket.buffer()
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(buffer)  # SUM (gloo has no AVG), inside this replica group
                buffer.div_(dist.get_world_size())
            # across the live groups, averaged in place; an error is reported
            state.allreduce(buffer).wait()
            done: torch.futures.Future[Any] = torch.futures.Future()
            done.set_result(buffer)
            return done

    return ReplicaDDP


def _build(context: BuildContext, options: FaultTolerantOptions) -> FaultTolerantDDP:
    world = context.world
    if world.lighthouse is None:
        raise ConfigError(
            "strategy ft-ddp needs replica groups and their lighthouse.",
            "launch with `multigpu run --replica-groups R ...`, or use strategy ddp.",
        )
    if not context.parallelism.is_plain:
        raise ConfigError(
            f"ft-ddp keeps a whole replica on every rank, but the degrees are "
            f"{context.parallelism.describe()}.",
            "set tp and dp_replicate back to 1.",
        )
    for name in ("timeout_s", "quorum_timeout_s"):
        value = getattr(options, name)
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not 0 < value <= 7 * 24 * 3600
        ):
            raise ConfigError(
                f"strategy option {name}={value!r} must be a positive number of seconds.",
                f"e.g. strategy_options: {{{name}: 60}}.",
            )
    return FaultTolerantDDP(world, context.device, options)


STRATEGIES = (
    StrategySpec(
        "ft-ddp",
        FaultTolerantOptions,
        _build,
        fault_tolerant=True,
        summary="DDP across replica groups that keeps stepping when a group dies (torchft)",
    ),
)
