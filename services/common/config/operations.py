"""The operations sections: ports, hosts and logs, the admin API, telemetry and trackers, cost, and supervision."""

from __future__ import annotations

import importlib.util
import ipaddress
import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import NoDecode

from services.common.config.base import DeployTime, Restart, Section, Security

# The roles of a run's processes, as service.role_torch_threads and service.gpu_memory_fraction name them.
Role = Literal["trainer", "reference", "rollout", "reward"]


class ServiceConfig(Section):
    host: Security[str] = Field(
        default="127.0.0.1", description="address this service's gRPC servers bind and announce"
    )
    instance: Restart[str] = Field(
        default="", description="this replica's name in status and metrics; defaults to <role>-<hostname>"
    )
    trainer_grpc_port: Restart[int] = Field(
        default=50051,
        ge=0,
        le=65535,
        description="WeightSync server; 0: the trainer binds a free port and a rollout reads it from the trainer's "
        "presence entry (how rlpipe run starts the rollouts together with the trainer)",
    )
    trainer_host: Security[str] = Field(
        default="",
        description="where other services reach the trainer (a service name in compose/k8s); defaults to host",
    )
    grpc_port: Restart[int] = Field(
        default=0, ge=0, le=65535, description="health port of non-trainer services; 0 = any free port"
    )
    torch_threads: Restart[int] = Field(
        default=1, ge=1, description="CPU threads torch may use in this process (threads)"
    )
    role_torch_threads: Restart[
        dict[Literal["trainer", "rollout", "reward", "reference"], Annotated[int, Field(ge=1)]]
    ] = Field(
        default_factory=dict,
        description="torch_threads for the named roles' processes, the others keeping torch_threads (threads per "
        "process). Where one role sets the pace and the others mostly wait, as the trainer does on SmolLM2 on a "
        "few cores, giving it the cores the others leave speeds the run up; where every role computes most of the "
        "time, their OpenMP threads contend and more threads slow it (docs/performance.md)",
    )
    gpu_memory_fraction: Restart[dict[Literal["trainer", "reference", "rollout", "reward"], float]] = Field(
        default_factory=dict,
        description="each named role's share of its GPU's memory, per process (above 0, at most 1), for roles that "
        "share one GPU. A role that starts on a GPU caps torch's caching allocator at its share less a CUDA "
        "context's allowance (torch.cuda.set_per_process_memory_fraction), so it fails with an out-of-memory "
        "error rather than take a neighbour's memory; on a CPU the cap is not applied and its log says so. A vLLM "
        "rollout's share replaces rollout.gpu_memory_utilization, vLLM's own setting (with rollout.kv_cache_mib "
        "set, vLLM checks it against the memory free at its start and sizes its cache by kv_cache_mib). The shares "
        "of the processes named here (a role's share times its replicas) may not sum past 1. rollout.replicas: "
        "auto fills in the roles left out from `rlpipe plan`; empty with a count of replicas = no caps",
    )

    warm_start: Restart[bool] = Field(
        default=True,
        description="`rlpipe run` forks each role (and each restart) from one process that imported torch, "
        "transformers and vLLM once, instead of starting a fresh interpreter per role, which spends 6 to 10 CPU s "
        "importing them (services/cli/launch/warm_start.py); false: every role a fresh interpreter",
    )
    warm_start_pool: Security[Path | None] = Field(
        default=None,
        description="with warm_start, the socket of a warm-start pool "
        "(`python -m services.cli.launch.warm_start --listen SOCKET MODULES...`) to fork the roles from, sharing its "
        "imports with the other runs of this machine "
        "(tuning trials, a test suite); unset: each run starts a warm starter of its own. A pool that is not there "
        "or dies means cold starts, said once as warm_start_failed in events.jsonl",
    )
    log_level: Restart[Literal["DEBUG", "INFO", "WARNING", "ERROR"]] = Field(
        default="INFO", description="the least severe log records written"
    )
    log_max_mib: Restart[int] = Field(
        default=100,
        ge=1,
        description="`rlpipe run` rotates a service's log file in <runs_dir>/<run>/logs past this size (MiB), as "
        "do the embedded broker and a service with log_dir",
    )
    log_keep: Restart[int] = Field(
        default=5, ge=0, description="rotated log files kept per service (<name>.log.1 is the newest)"
    )
    exit_when_stalled_s: Restart[float] = Field(
        default=0.0,
        ge=0,
        description="seconds a service whose loop is stalled (past its bound, health NOT_SERVING: a stage's "
        "2 x nats.max_work_s + nats.fetch_timeout_s, the trainer's train.stall_bound_s) may stay so before the "
        "process exits with code 3 and logs stalled_exit, for a supervisor that restarts on exit and not on health "
        "(Docker's restart policy never restarts an unhealthy container); 0 = never, health alone reports it. "
        "The deploy configs set it (compose and Kubernetes)",
    )
    log_dir: Security[Path | None] = Field(
        default=None,
        description="a folder each service also writes its JSON log lines to, as <instance>.log (service.instance; "
        "by default <role>-<hostname>) rotated by log_max_mib and log_keep, for `rlpipe archive` to copy into the "
        "run archive (compose and Kubernetes, where stdout belongs to the container runtime); unset: stderr only "
        "(`rlpipe run` keeps its children's logs itself)",
    )

    @field_validator("gpu_memory_fraction")
    @classmethod
    def _shares_of_a_gpu(cls, shares: dict[str, float]) -> dict[str, float]:
        wrong = {role: share for role, share in shares.items() if not 0 < share <= 1}
        if wrong:
            raise ValueError(f"a share of a GPU's memory is above 0 and at most 1: {wrong}")
        return shares

    def threads_for(self, role: Role) -> int:
        """The torch threads of ``role``'s processes."""
        return self.role_torch_threads.get(role, self.torch_threads)


# Loopback and the private ranges (RFC 1918, IPv6 unique local): where operators, a port-forward and a container
# network's gateway connect from, and no address of the public internet.
LOCAL_AND_PRIVATE = ("127.0.0.0/8", "::1/128", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fc00::/7")


class AdminConfig(Section):
    port: Restart[int] = Field(
        default=50052, ge=0, le=65535, description="Admin gRPC port on the trainer (0 = any free port)"
    )
    token_file: Security[Path | None] = Field(
        default=None, description="file holding the bearer token; RLPIPE_ADMIN_TOKEN wins over it"
    )
    read_token_file: Security[Path | None] = Field(
        default=None,
        description="file holding a second, read-only bearer token: it may make the Admin calls that only read "
        "(rlpipe status, config show, config history, checkpoints) and is refused (PERMISSION_DENIED) on every "
        "other; for dashboards and on-call people. RLPIPE_ADMIN_READ_TOKEN wins over it; re-read when it changes, "
        "like token_file; a start with it equal to the admin token is refused. Unset = no read-only access (the "
        "admin token still makes every call)",
    )
    tls_cert: Security[Path | None] = Field(
        default=None, description="PEM certificate chain; with tls_key, the admin port speaks TLS"
    )
    tls_key: Security[Path | None] = Field(default=None, description="PEM private key of tls_cert")
    allowed_sources: Security[Annotated[list[str], NoDecode]] = Field(
        default_factory=lambda: list(LOCAL_AND_PRIVATE),
        min_length=1,
        description="the networks (CIDRs) an Admin call may come from; a call from any other address is "
        "refused (PERMISSION_DENIED) before its token is looked at. Default: loopback and the private ranges "
        "(10/8, 172.16/12, 192.168/16, fc00::/7); 0.0.0.0/0 and ::/0 open it to all. In the environment a "
        "comma-separated list or a JSON list (RLPIPE_ADMIN__ALLOWED_SOURCES=127.0.0.0/8,10.0.0.0/8)",
    )

    @field_validator("allowed_sources", mode="before")
    @classmethod
    def _networks(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = json.loads(value) if value.lstrip().startswith("[") else value.split(",")
        if not isinstance(value, list):
            return value  # pydantic names the wrong type
        networks = []
        for entry in value:
            try:
                networks.append(str(ipaddress.ip_network(str(entry).strip())))
            except ValueError as error:  # bad address, or host bits set (10.0.0.1/8): name the entry
                raise ValueError(f"{str(entry).strip()!r} is not a network in CIDR notation: {error}") from None
        return networks

    @model_validator(mode="after")
    def _cert_and_key_together(self) -> AdminConfig:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("set both tls_cert and tls_key, or neither")
        for path in (self.tls_cert, self.tls_key, self.token_file, self.read_token_file):
            if path is not None and not path.is_file():
                raise ValueError(f"file {str(path)!r} does not exist")
        return self


class TelemetryConfig(Section):
    metrics_port: Restart[int] = Field(
        default=0, ge=0, le=65535, description="Prometheus endpoint of each service (0 = any free port)"
    )
    otlp_endpoint: Security[str] = Field(
        default="", description="host:port of an OTLP/gRPC collector for traces and metrics; empty = none"
    )
    export_interval_s: Restart[float] = Field(default=10.0, gt=0, description="OTLP metric export interval")
    link_mib_s: Restart[float | None] = Field(
        default=None,
        gt=0,
        description="the capacity of each role's network link, each direction (MiB/s; 1 Gbit/s is about 119): every "
        "role exports it beside its rlpipe_network_bytes_total, the trainer's step rows carry "
        "network/link_use_frac, and the network_saturated rule fires above 0.8 of it; null = unknown, none of these",
    )
    jsonl_max_mib: Restart[int] = Field(
        default=256,
        ge=1,
        description="metrics.jsonl and events.jsonl roll to numbered parts (metrics.00001.jsonl, ...) past this "
        "size (MiB); every reader (report, metrics --follow, tune, alert drill, tests) reads the parts kept in order",
    )
    jsonl_keep_parts: Restart[int] = Field(
        default=20,
        ge=0,
        description="rolled parts of metrics.jsonl and of events.jsonl kept (count); at each roll past it the "
        "oldest part is deleted, so a record holds at most (jsonl_keep_parts + 1) x jsonl_max_mib MiB on disk and "
        "in the run archive; 0 keeps every part",
    )
    samples_keep_steps: Restart[int] = Field(
        default=50,
        ge=0,
        description="steps whose applied groups the trainer keeps in runs/<run>/samples/step_<N>.jsonl for "
        "`rlpipe samples` (prompts, completions, rewards, logprob and KL summaries); 0 keeps none",
    )
    report_to: Restart[list[Literal["tensorboard", "mlflow", "wandb"]]] = Field(
        default_factory=list,
        description="experiment trackers the trainer sends every metrics row, config version, alert and checkpoint "
        "to, under the run id, metric names in the actor/ critic/ reward/ response_length/ namespaces "
        "(docs/metrics.md); each needs the `trackers` extra",
    )
    mlflow_tracking_uri: Security[str] = Field(
        default="",
        description="MLflow store or server; empty = sqlite:///<run dir>/mlflow.db, a local store without a server",
    )
    mlflow_experiment: Restart[str] = Field(
        default="rlpipe", min_length=1, description="MLflow experiment the run is logged under"
    )
    wandb_project: Restart[str] = Field(
        default="rlpipe", min_length=1, description="W&B project the run is logged under"
    )
    wandb_mode: Security[Literal["offline", "online"]] = Field(
        default="offline",
        description="offline writes <run dir>/wandb for `wandb sync`; online needs W&B credentials (WANDB_API_KEY)",
    )

    @field_validator("report_to")
    @classmethod
    def _each_tracker_once_and_installed(cls, trackers: list[str]) -> list[str]:
        if len(trackers) != len(set(trackers)):
            raise ValueError(f"names a tracker twice: {trackers}")
        # Looked up, not imported: the trainer imports them when it opens the trackers.
        missing = [name for name in trackers if importlib.util.find_spec(name) is None]
        if missing:
            raise ValueError(f"{missing} not installed: pip install 'rlpipe[trackers]'")
        return trackers


class CostConfig(Section):
    per_device_hour: Restart[dict[Literal["cpu-core", "gpu"], float]] = Field(
        default_factory=dict,
        description="price of one hour of each device kind the run uses (your currency): cpu-core (one core busy "
        "for an hour, measured from the processes' CPU time) and gpu (one GPU held for an hour, from NVML). With "
        "both kinds the run used priced, the run summary and report show the cost, per step and per held-out "
        "accuracy point gained; device-hours per role are shown either way",
    )

    @field_validator("per_device_hour")
    @classmethod
    def _prices_not_negative(cls, prices: dict[str, float]) -> dict[str, float]:
        negative = sorted(kind for kind, price in prices.items() if price < 0)
        if negative:
            raise ValueError(f"a price cannot be negative: {negative}")
        return prices


class SupervisionConfig(Section):
    """How ``rlpipe run`` restarts the services it started, and how long it lets them stop."""

    max_restarts: Restart[int] = Field(
        default=10,
        ge=0,
        description="restarts of one service within restart_window_s; one more and the run is declared failed",
    )
    restart_window_s: Restart[float] = Field(
        default=3600.0,
        gt=0,
        description="the sliding window max_restarts counts over: a service that crashes once a day runs for ever, "
        "one in a crash loop fails the run",
    )
    backoff_s: Restart[float] = Field(
        default=1.0, gt=0, description="first restart delay, doubled for each earlier restart still in the window"
    )
    max_backoff_s: Restart[float] = Field(
        default=30.0, gt=0, description="longest delay before a restart, however many came before (seconds)"
    )
    trainer_stop_grace_s: Restart[float] = Field(
        default=300.0,
        gt=0,
        description="on stop, how long the trainer may take after SIGTERM before SIGKILL: it saves a final "
        "checkpoint, which for a large model takes minutes",
    )
    stop_grace_s: Restart[float] = Field(
        default=20.0, gt=0, description="on stop, how long every other service may take after SIGTERM before SIGKILL"
    )
    scaler: DeployTime[Literal["launcher", "orchestrator"]] = Field(
        default="orchestrator",
        description="who starts and stops the stage replicas: `launcher`, `rlpipe run` (which sets it for its "
        "services), where `rlpipe scale ROLE N` changes their count while the run goes on; `orchestrator`, "
        "Kubernetes (KEDA sizes each stage's Deployment) or compose (`--scale`), where `rlpipe scale` is refused "
        "naming where to scale instead",
    )
    max_replicas: Restart[int] = Field(
        default=16,
        ge=1,
        description="the most replicas of one stage role `rlpipe scale` may ask for (count): a typo such as 300 "
        "would start hundreds of processes on one machine",
    )
    presence_retention_s: Restart[float] = Field(
        default=3600.0,
        ge=0,
        description="how long `rlpipe status` lists a replica that stopped or went silent before the trainer "
        "removes its presence entry (seconds; 0 keeps them for the whole run): Kubernetes names each new pod "
        "afresh, so without it a long run with autoscaling or rolling updates lists every pod it ever had",
    )

    @model_validator(mode="after")
    def _window_outlasts_the_backoff(self) -> SupervisionConfig:
        # The restarts of a crash loop are spaced by their backoff; if max_restarts of them cannot fit in the
        # window, the count in the window never exceeds max_restarts and the loop goes on for ever.
        backoff = sum(min(self.backoff_s * 2**k, self.max_backoff_s) for k in range(self.max_restarts))
        if self.restart_window_s <= backoff:
            raise ValueError(
                f"restart_window_s ({self.restart_window_s:g}) must be longer than the backoff of max_restarts "
                f"restarts ({backoff:g}s with backoff_s={self.backoff_s:g}, max_backoff_s={self.max_backoff_s:g}), "
                "or a service in a crash loop is restarted for ever"
            )
        return self
