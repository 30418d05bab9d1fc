"""The trainer across devices and machines: torchrun starts one process per device, FSDP2 shards the models.

Roles. Rank 0, the *leader*, is the trainer a single process knows: it alone talks to NATS, serves
Admin and WeightSync, and reads and writes checkpoints. Every other rank, a *follower*, holds its
shard of the policy (and critic) and of their AdamW state and runs ``follower.follow``: it waits for the
leader's next command and does its part of it. Every command is collective, so the ranks go from
command to command in lockstep; the ``Learner`` issues them (``Mesh.command``) from the same
methods the leader's driver already calls, so the driver barely knows the trainer is sharded.

Batch distribution: the leader broadcasts the step's whole batch (the groups as msgpack, their wire
format on EXPERIENCE) and every rank builds the same ``Batch``. The whole batch rather than per-rank
shards, because advantages (group baselines, batch whitening) and the loss normalisation need every
row; token ids are small beside a forward pass. Each rank then takes a contiguous share of every
optimizer step's rows (``Mesh.shares``).

Equal gradients. A rank's micro-batch losses are weighted by their share of the *whole* step's tokens
or sequences (``micro_batch_weight`` against the step's mask), so the ranks' gradients add up to the
single process's: FSDP's reduce-scatter sums instead of averaging (gradient divide factor 1).
FSDP2 all-gathers parameters in every forward and reduce-scatters gradients in every backward, so
every rank must run as many passes as the busiest one; a rank with fewer micro-batches runs passes
that count for nothing (weight 0) to keep the collectives matched.

Checkpoints are the gathered full state, in exactly the single-process format (model and critic as
full tensors by name, AdamW's ``state_dict`` keyed by parameter index). That is one format for every
world size: a step saved by N processes resumes in M, or in one, and stays a loadable Hugging Face
model folder. Gathering goes tensor by tensor into host memory, so a device never holds a second
copy of the model; the cost is that rank 0's host memory holds the full model and optimizer state
while it saves (sharded ``torch.distributed.checkpoint`` is the way on when that no longer fits).
Loading sends each tensor from rank 0 and each rank keeps its shard.

Environment: torchrun's ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` (and ``MASTER_ADDR``/``MASTER_PORT``,
which ``init_process_group`` reads through its ``env://`` rendezvous) are torch.distributed's
documented contract with the processes it starts, not rlpipe configuration; ``Mesh.from_env`` is the
one place that reads them, with ``RLPIPE_TORCHRUN_PID``, which ``launch`` adds (below).

Launching. ``rlpipe run`` starts torchrun through ``launch`` (``python -m services.trainer.learning.distributed``,
torchrun's own arguments), which runs torchrun in its process and keeps two things torchrun loses:

- A refusal. torchrun exits 1 whenever a rank fails, whatever the rank's exit code, so a trainer that
  refused to run (``EXIT_REFUSED``: a bad config, another run's checkpoints, a broker that lost its
  state) would look like a crash and be restarted into the same refusal. ``launch`` exits
  ``EXIT_REFUSED`` when a rank did, else 1 for any failure, from the ranks' own exit codes.
- A stop. Stopped by SIGTERM or SIGINT, torchrun passes the signal on to its ranks (rank 0 saves its
  step), waits ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` for them, and then raises, which would exit 1: a
  supervisor would count an orderly stop as a crash. ``launch`` ends by that same signal instead, as a
  single trainer process stopped by it does.
- The ranks' lives. torchrun stops its ranks when it is stopped, but a SIGKILLed torchrun (the
  launcher's kill after the stop grace, the OOM killer) cannot, and its ranks would live on as orphans
  holding memory and devices. Each rank asks Linux, as it starts (``Mesh.from_env``), to SIGKILL it when
  its parent dies (``PR_SET_PDEATHSIG``), and exits at once if that parent, named by ``launch`` in
  ``RLPIPE_TORCHRUN_PID``, already died before it asked. ``rlpipe run`` and the Kubernetes trainer
  both start torchrun through ``launch``; under a plain torchrun the second holds without that check.

Timeouts. Commands travel on their own gloo group whose timeout is long (``COMMAND_WAIT``): a paused
or starved trainer leaves its followers waiting for hours, and that is not a failure. Compute
collectives keep torch's default timeout, so a rank that really hangs still fails the step.

Failure. A rank that raises inside a command exits non-zero; torchrun then stops every rank, and the
trainer is restarted and resumes from its checkpoint like a single process that crashed. Only a
leader that leaves at a command boundary says STOP; one that fails inside a collective does not try
to handshake with followers stuck in it (``close``).

Teardown. Process groups are destroyed explicitly, after STOP and a barrier on the command group:
each process then closes its gloo connections only once every other has finished its last
collective. Leaving them to interpreter exit tears them down in whatever order the garbage collector
and atexit run, while a peer may still be sending (see tests/trainer/learning/test_distributed.py).
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor, distribute_tensor

from services.common.config import RunConfig
from services.common.model.modeling import to_host
from services.common.parent_death import die_with_parent
from services.common.service import EXIT_REFUSED

# A follower waits for the leader's next command as long as the leader goes without one (paused, no
# experience); a year stands for "forever" in a timeout that must be finite.
COMMAND_WAIT = datetime.timedelta(days=365)
# torchrun's pid, which ``launch`` gives the ranks it starts (see the module docstring).
TORCHRUN_PID_ENV = "RLPIPE_TORCHRUN_PID"


class Op(IntEnum):
    """What the leader asks of every rank."""

    STOP = 0
    STEP = 1  # payload: the step's groups and policy version
    RECONFIGURE = 2  # payload: the config now in force
    WEIGHTS = 3  # gather the policy's full weights (weight sync)
    STATE = 4  # gather model, critic and optimizer state (a checkpoint)
    LOAD = 5  # load a checkpoint that rank 0 read
    EVALUATE = 6  # payload: held-out rows, the generation budget and whether they are episodes


@dataclass(frozen=True)
class _Sharded:
    """Stands in, in the optimizer state sent ahead, for a tensor shaped like its parameter: it follows shard by
    shard."""

    dtype: torch.dtype


class Mesh:
    """This process's place among the trainer's processes, and the collectives the trainer uses.

    Attributes: ``rank``, ``world`` (process count), ``local_rank`` (the device index on this
    machine); after ``start``, ``device_mesh`` (what FSDP shards over) and ``commands`` (the group
    commands travel on). ``Mesh()`` is a single process: every method is then a no-op or the
    identity, and nothing in torch.distributed is touched.
    """

    def __init__(self, rank: int = 0, world: int = 1, local_rank: int = 0):
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is outside a world of {world} processes")
        self.rank = rank
        self.world = world
        self.local_rank = local_rank
        self.device_mesh: DeviceMesh | None = None
        self.commands: dist.ProcessGroup | None = None
        self.broken = False  # a command failed midway: the ranks are no longer at a command boundary

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Mesh:
        """torchrun's view of this process (see the module docstring); a single process without it. A rank is
        bound to die with the torchrun that started it."""
        env = os.environ if env is None else env
        world = int(env.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls()
        die_with_parent(int(env[TORCHRUN_PID_ENV]) if TORCHRUN_PID_ENV in env else None)
        return cls(int(env["RANK"]), world, int(env.get("LOCAL_RANK", "0")))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def leads(self) -> bool:
        """Rank 0 of several: the one that sends commands (and so builds their payloads)."""
        return self.distributed and self.is_main

    # -- process groups ----------------------------------------------------------------

    def start(self, device: torch.device) -> torch.device:
        """Join the process group; returns this rank's device (``device``'s type, this machine's ``local_rank``-th
        one for CUDA)."""
        if not self.distributed:
            return device
        if device.type == "cuda":
            device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(device)
        if self.device_mesh is not None:
            return device
        # CPU tensors (commands, small state) take gloo; CUDA tensors NCCL.
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, rank=self.rank, world_size=self.world)
        commands = dist.new_group(backend="gloo", timeout=COMMAND_WAIT)
        if not isinstance(commands, dist.ProcessGroup):  # every rank is in it: a group, not a non-member marker
            raise RuntimeError(f"rank {self.rank} is not in the trainer's command group ({commands!r})")
        self.commands = commands
        self.device_mesh = init_device_mesh(device.type, (self.world,))
        return device

    def close(self) -> None:
        """Leave the process group: the leader tells followers to stop, everyone meets at a barrier, then destroys
        its groups. After a failure inside a command nothing is awaited: the peers are stuck in that command's
        collective, and torchrun stops them when this process exits non-zero."""
        if self.device_mesh is None or self.broken:
            return
        if self.is_main:
            self._send(Op.STOP, b"")
        dist.barrier(group=self.commands)
        dist.destroy_process_group()
        self.device_mesh = self.commands = None

    # -- commands ----------------------------------------------------------------------

    @contextmanager
    def command(self, op: Op, payload: bytes = b"") -> Iterator[None]:
        """Around a collective operation the learner runs on every rank: on the leader it first sends ``op`` (the
        followers are in ``receive``); an exception inside marks the mesh broken (see ``close``)."""
        if not self.distributed:
            yield
            return
        if self.is_main:
            self._send(op, payload)
        try:
            yield
        except BaseException:
            self.broken = True
            raise

    def _send(self, op: Op, payload: bytes) -> None:
        header = torch.tensor([int(op), len(payload)], dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.commands)
        if payload:
            dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0, group=self.commands)

    def receive(self) -> tuple[Op, bytes]:
        """A follower: wait for the leader's next command."""
        header = torch.zeros(2, dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.commands)
        op, size = Op(int(header[0])), int(header[1])
        if not size:
            return op, b""
        payload = torch.empty(size, dtype=torch.uint8)
        dist.broadcast(payload, src=0, group=self.commands)
        return op, payload.numpy().tobytes()

    def share(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (small things: a config, optimizer hyperparameters, RNG states).

        Pickled: between processes of one job, running the same code, it crosses no trust boundary."""
        if not self.distributed:
            return value
        box = [value if self.is_main else None]
        dist.broadcast_object_list(box, src=0, group=self.commands)
        return box[0]

    def agree(self, cfg: RunConfig) -> RunConfig:
        """The leader's config on every rank: it applied what was stored through Admin, the followers only read
        the file."""
        if not self.distributed:
            return cfg
        return RunConfig.model_validate(self.share(cfg.model_dump(mode="python")))

    # -- sharding and reductions --------------------------------------------------------

    def shard(
        self, module: torch.nn.Module, units: list[torch.nn.Module], forward_methods: tuple[str, ...] = ()
    ) -> None:
        """``fully_shard`` each of ``units`` (decoder layers: one all-gather each, freed after use), then
        ``module`` (what is left: embeddings, norms, heads; tied weights stay together there). Gradients are
        summed across ranks, not averaged (see the module docstring). ``forward_methods``: methods other than
        ``forward`` that run the module (the critic's ``values``) and must gather its parameters too."""
        if not self.distributed:
            return
        for unit in units:
            fully_shard(unit, mesh=self.device_mesh)
        fully_shard(module, mesh=self.device_mesh)
        for name in forward_methods:
            register_fsdp_forward_method(module, name)
        for sub in module.modules():
            if isinstance(sub, FSDPModule):
                # A plain sum: no division, and no pre-scaled sum either (PREMUL_SUM), which gloo lacks.
                sub.set_gradient_divide_factor(1.0)
                sub.set_force_sum_reduction_for_comms(True)

    def shares(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's contiguous share of ``rows`` (rank r's is item r); some may be empty."""
        if not self.distributed:
            return [rows]
        return list(torch.tensor_split(rows, self.world))

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place."""
        if self.distributed:
            dist.all_reduce(tensor)
        return tensor

    def sum_values(self, values: dict[str, float]) -> dict[str, float]:
        """Each value summed over the ranks (every rank must have the same keys)."""
        if not self.distributed:
            return values
        names = sorted(values)
        total = torch.tensor([values[name] for name in names], dtype=torch.float64)
        dist.all_reduce(total)
        return dict(zip(names, total.tolist(), strict=True))

    # -- full state: gather and load ------------------------------------------------------

    def gather_module(self, module: torch.nn.Module, only: Collection[str] | None = None) -> dict[str, torch.Tensor]:
        """``module``'s full state dict (with ``only``, those names of it) in host memory on rank 0 (tied names
        share one tensor, as in the module's own ``state_dict``), ``{}`` elsewhere; gathered one tensor at a time."""
        copies: dict[int, torch.Tensor] = {}
        entries = _entries(module, only)
        for _, tensor in entries:
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            if self.is_main:
                copies[id(tensor)] = to_host(full)
        if not self.is_main:
            return {}
        state = module.state_dict(keep_vars=True).items()
        return {name: copies[id(tensor)] for name, tensor in state if only is None or name in only}

    def gather_optimizer(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's ``state_dict()`` as one process would have it (full tensors, in host memory) on rank 0,
        ``{}`` elsewhere."""
        local = optimizer.state_dict()
        state: dict[int, dict[str, Any]] = {}
        for index in sorted(local["state"]):  # the same order on every rank: each full_tensor() is a collective
            entry = {}
            for key in sorted(local["state"][index]):
                value = local["state"][index][key]
                if isinstance(value, DTensor):
                    value = value.full_tensor()
                entry[key] = to_host(value) if isinstance(value, torch.Tensor) else value
            state[index] = entry
        if not self.is_main:
            return {}
        return {"state": state, "param_groups": local["param_groups"]}

    def load_module(
        self, module: torch.nn.Module, state: Mapping[str, torch.Tensor] | None, only: Collection[str] | None = None
    ) -> None:
        """Load a full state dict that rank 0 holds (``state``; None elsewhere) into the sharded ``module``; with
        ``only``, a state of just those names (a LoRA policy's adapters; the rest stay as they are).

        Names may lack the aliases of tied tensors (a checkpoint stores them once). A state that does not fit
        raises ValueError on every rank, before anything is sent."""
        entries = _entries(module, only)
        problem = None
        if self.is_main:
            assert state is not None, "rank 0 loads the state it read"
            known = {name for names, _ in entries for name in names}
            missing = [names[0] for names, _ in entries if not any(name in state for name in names)]
            unexpected = sorted(set(state) - known)
            if missing or unexpected:
                problem = f"checkpoint does not fit the model: missing {sorted(missing)}, unexpected {unexpected}"
        problem = self.share(problem)
        if problem:
            raise ValueError(problem)
        with torch.no_grad():
            for names, target in entries:
                if self.is_main and state is not None:  # (rank 0's, checked above)
                    source = next(state[name] for name in names if name in state)
                else:
                    source = torch.empty(target.shape, dtype=target.dtype)
                _load_into(target, source)

    def load_optimizer(self, optimizer: torch.optim.Optimizer, state: Mapping[str, Any] | None) -> None:
        """Load an optimizer ``state_dict()`` saved by one process (or gathered), which rank 0 holds (None
        elsewhere), into the optimizer of sharded parameters. Tensors shaped like their parameter are sent shard
        by shard; the rest (hyperparameters, step counts) travel whole."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        outline = None
        if self.is_main:
            assert state is not None, "rank 0 loads the state it read"
            outline = {
                "param_groups": state["param_groups"],
                "state": {
                    index: {
                        key: _Sharded(value.dtype) if _shaped_like(value, params[index]) else value
                        for key, value in entry.items()
                    }
                    for index, entry in state["state"].items()
                },
            }
        outline = self.share(outline)
        local: dict[int, dict[str, Any]] = {}
        for index in sorted(outline["state"]):
            param = params[index]
            entry = {}
            for key in sorted(outline["state"][index]):
                value = outline["state"][index][key]
                if isinstance(value, _Sharded):
                    if self.is_main and state is not None:  # (rank 0's, checked above)
                        source = state["state"][index][key]
                    else:
                        source = torch.empty(param.shape, dtype=value.dtype)
                    value = distribute_tensor(
                        source.to(param.device), param.device_mesh, param.placements, src_data_rank=0
                    )
                entry[key] = value
            local[index] = entry
        optimizer.load_state_dict({"state": local, "param_groups": outline["param_groups"]})


def _entries(module: torch.nn.Module, only: Collection[str] | None = None) -> list[tuple[list[str], torch.Tensor]]:
    """``module``'s state-dict tensors, each once with all its names (tied weights have two), in state-dict order;
    with ``only``, just those of these names (a LoRA policy's adapters).

    Told apart by tensor identity, which is the same on every rank (a shard's storage address is not: an
    empty shard has none), so every rank runs the same collectives in the same order."""
    by_id: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        if only is None or name in only:
            by_id.setdefault(id(tensor), ([], tensor))[0].append(name)
    return list(by_id.values())


def _shaped_like(value: Any, param: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and isinstance(param, DTensor) and value.shape == param.shape


def _load_into(target: torch.Tensor, source: torch.Tensor) -> None:
    """Rank 0's ``source`` into ``target``: a sharded tensor keeps its own shard, a replicated one all of it."""
    if isinstance(target, DTensor):
        placed = distribute_tensor(
            source.to(target.device, target.dtype), target.device_mesh, target.placements, src_data_rank=0
        )
        target.to_local().copy_(placed.to_local())
        return
    whole = source.to(target.device, target.dtype)
    dist.broadcast(whole, src=0)
    target.copy_(whole)


# -- launching ---------------------------------------------------------------------------


def launch(argv: list[str]) -> int:
    """torchrun with ``argv`` (its own arguments), run in this process; returns the exit code: 0, EXIT_REFUSED
    when a rank exited with it, else 1; stopped by a signal, it dies of that signal (see the module docstring)."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    os.environ[TORCHRUN_PID_ENV] = str(os.getpid())  # the ranks inherit it: the agent starts them from here
    try:
        torchrun.run(torchrun.parse_args(argv))
    except ChildFailedError as failed:
        print(failed.format_msg(), file=sys.stderr)
        exit_codes = {failure.exitcode for failure in failed.failures.values()}
        return EXIT_REFUSED if EXIT_REFUSED in exit_codes else 1
    except SignalException as stopped:
        # The ranks have had the signal and their time to stop: end as a process that signal stops.
        signal.signal(stopped.sigval, signal.SIG_DFL)
        os.kill(os.getpid(), stopped.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(launch(sys.argv[1:]))
