"""The launcher's supervision rules, against real processes: a rerun never destroys a run by accident,
restarts are limited by a rate rather than a lifetime count, and each service gets its own stop grace."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console
from rich.progress import Progress

from services.cli.launch.children import Child, RestartPolicy, RoleCrashLoop, RoleRefused, restart_env
from services.cli.launch.command import interrupt, stop_or_kill
from services.cli.launch.credentials import RunCredentials
from services.cli.launch.launcher import Launcher
from services.cli.launch.lock import hold_run, launcher_lock
from services.cli.launch.summary import summarize
from services.common.config import ConfigError, SupervisionConfig, load_config
from services.common.observe.events import Event
from services.common.observe.records import RunDone, read_events
from services.common.service import EXIT_REFUSED
from services.common.transport.nats_auth import write_run_credentials
from tests.support.paths import ROOT
from tests.support.runs import RLPIPE_RUN, config_file, metric_rows, run_pipeline, running_pipeline, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def config(tmp_path: Path, config_only_model: tuple[Path, Path]) -> Path:
    # Enough for the config to load; the refusals under test come before anything reads the model.
    return config_file(tmp_path, config_only_model, run_id="kept")


def rlpipe_run(config: Path, *options: str) -> subprocess.CompletedProcess:
    return subprocess.run([*RLPIPE_RUN, str(config), *options], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_rerunning_a_config_refuses_to_delete_its_checkpoints_and_metrics(config, tmp_path):
    run_dir = tmp_path / "runs" / "kept"
    (run_dir / "step-00000005").mkdir(parents=True)
    (run_dir / "step-00000010").mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')

    done = rlpipe_run(config)

    assert done.returncode == 2, done.stderr
    message = " ".join(done.stderr.split())
    assert f"{run_dir} already holds a run (2 checkpoints (step-00000005 to step-00000010), metrics in" in message
    assert f"rlpipe run {config} --resume" in message and f"rlpipe run {config} --overwrite" in message
    assert sorted(p.name for p in run_dir.iterdir()) == ["metrics.jsonl", "step-00000005", "step-00000010"]


def test_a_run_directory_without_checkpoints_or_metrics_is_not_refused(config, tmp_path):
    # Left by a start that failed early: nothing in it is worth a refusal. The run then goes on to the
    # start-up checks, which this config's weightless model folder fails (exit 2 as well, but saying so).
    (tmp_path / "runs" / "kept" / "logs").mkdir(parents=True)
    done = rlpipe_run(config)
    assert done.returncode == 2
    assert "already holds a run" not in done.stderr and "start-up checks failed" in " ".join(done.stderr.split())


def test_resume_and_overwrite_together_are_refused(config, tmp_path):
    (tmp_path / "runs" / "kept" / "step-00000005").mkdir(parents=True)
    done = rlpipe_run(config, "--resume", "--overwrite")
    assert done.returncode == 2 and "choose one" in done.stderr
    assert (tmp_path / "runs" / "kept" / "step-00000005").is_dir()


def test_a_smoke_run_started_paused_is_refused_before_anything_starts(config, tmp_path):
    # The smoke run holds itself until its roles are checked, then resumes: --paused would be overruled.
    done = rlpipe_run(config, "--smoke", "--paused")
    assert done.returncode == 2 and "--smoke runs the config file as it is" in done.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.integration
def test_resume_and_overwrite_of_a_live_run_are_refused_naming_its_launcher_and_a_killed_launcher_frees_it(
    config, tmp_path
):
    run_dir = tmp_path / "runs" / "kept"
    (run_dir / "step-00000005").mkdir(parents=True)
    (run_dir / "run.json").write_text('{"nats_url": "nats://127.0.0.1:4999"}')
    # A live launcher of the run, as far as the hold goes: it holds the run until it dies.
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from services.cli.launch.lock import hold_run\n"
            "from services.common.config import load_config\n"
            f"hold = hold_run(load_config({str(config)!r}))\n"
            "print('held', flush=True)\n"
            "time.sleep(600)\n",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        for option in ("--resume", "--overwrite"):
            done = rlpipe_run(config, option)
            message = " ".join(done.stderr.split())
            assert done.returncode == 2, message
            assert (
                f"run kept in {run_dir} is live: launcher pid {holder.pid} runs it, its broker at "
                "nats://127.0.0.1:4999; nothing was changed" in message
            )
            assert sorted(p.name for p in run_dir.iterdir()) == ["run.json", "step-00000005"]
    finally:
        holder.kill()
        holder.wait(timeout=30)
    # SIGKILLed, it holds nothing: the kernel dropped its lock with the process.
    with hold_run(load_config(config)) as hold:
        assert launcher_lock(load_config(config)).read_text() == str(os.getpid())
        assert not hold.closed


@pytest.mark.unit
def test_restarts_are_limited_per_window_not_per_run():
    supervision = SupervisionConfig(max_restarts=3, restart_window_s=100, backoff_s=1, max_backoff_s=30)
    policy = RestartPolicy(supervision)
    # A crash loop: three restarts with doubling backoff, then the fourth inside the window is refused.
    assert [policy.next_restart("rollout-0", now) for now in (0.0, 1.0, 3.0)] == [1, 2, 4]
    assert policy.next_restart("rollout-0", 7.0) is None
    # Other services have their own count.
    assert policy.next_restart("reward-0", 7.0) == 1
    # Once the first restart has left the window there is room for one more, backed off by the two still in it.
    assert policy.next_restart("rollout-0", 100.0) == 4
    # After a quiet window the backoff starts over.
    assert policy.next_restart("rollout-0", 1000.0) == 1
    assert policy.total == {"rollout-0": 5, "reward-0": 1}


@pytest.mark.unit
def test_a_service_that_crashes_now_and_then_is_restarted_for_ever():
    # The default budget, and a crash every 10 minutes for a week: a lifetime count would have ended the run.
    policy = RestartPolicy(SupervisionConfig())
    delays = [policy.next_restart("trainer", minute * 60.0) for minute in range(0, 7 * 24 * 60, 10)]
    assert None not in delays and policy.total == {"trainer": 7 * 24 * 6}


@pytest.mark.unit
def test_a_restart_window_a_crash_loop_cannot_fill_is_refused_naming_the_field(config):
    # 10 restarts backed off 1, 2, 4, 8, 16, then 30 s each take 181 s: a 120 s window never holds 11.
    with pytest.raises(ConfigError) as error:
        load_config(config, supervision={"max_restarts": 10, "restart_window_s": 120})
    assert "supervision: restart_window_s (120) must be longer than the backoff of max_restarts restarts (181s" in str(
        error.value
    )


@pytest.mark.integration
def test_a_service_dying_too_often_fails_the_run_naming_the_window(config, tmp_path):
    cfg = load_config(config, supervision={"max_restarts": 1, "restart_window_s": 600, "backoff_s": 0.1})
    cfg.run_dir.mkdir(parents=True)
    launcher = Launcher(cfg, config, resume=False)
    crashed = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    crashed.wait(timeout=30)
    child = Child("reward-0", "reward", crashed, cfg.run_dir / "reward-0.log", log_max_bytes=2**20, log_keep=1)
    progress = Progress(console=Console(file=io.StringIO()))
    assert launcher.schedule_restart(child, progress) > time.monotonic()
    with pytest.raises(RuntimeError) as error:
        launcher.schedule_restart(child, progress)
    assert "reward-0 exited with 3 after 1 restarts within supervision.restart_window_s=600s" in str(error.value)
    assert launcher.restarts == {"reward-0": 1}


# A role refusing to run as run_service does: its reason as a start_refused event, exit EXIT_REFUSED.
REFUSING = """
import json, sys
print("loading", flush=True)
print(json.dumps({"event": "start_refused", "error": "consumer rollout of PROMPTS cannot be updated"}))
sys.exit(2)
"""


def piped_child(name: str, role: str, code: str, log: Path) -> Child:
    """A real process whose output the launcher's pump reads, as ``Launcher.spawn`` wires it."""
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    child = Child(name, role, process, log, log_max_bytes=2**30, log_keep=1)
    child.pump_thread = threading.Thread(target=child.pump, args=(process.stdout,), daemon=True)
    child.pump_thread.start()
    return child


def test_a_role_that_refuses_is_not_restarted_and_its_own_reason_ends_the_run(config, tmp_path):
    cfg = load_config(config, supervision={"max_restarts": 5, "backoff_s": 0.1})
    cfg.run_dir.mkdir(parents=True)
    launcher = Launcher(cfg, config, resume=False)
    child = piped_child("reward-0", "reward", REFUSING, tmp_path / "reward-0.log")
    assert child.process.wait(timeout=30) == EXIT_REFUSED
    with pytest.raises(RoleRefused) as refused:
        launcher.schedule_restart(child, Progress(console=Console(file=io.StringIO())))
    assert refused.value.name == "reward-0"
    assert refused.value.reason == "consumer rollout of PROMPTS cannot be updated"
    assert launcher.restarts == {}


# A role dying of an exception as run_service logs it: the crashed event with its traceback, through the roles' own
# JSON formatter, then exit 1. argv[1] names the line it fails at, so two runs can crash alike or not.
CRASHING = """
import logging, sys
from services.common.observe.events import Event
from services.common.observe.logs import JsonFormatter
handler = logging.StreamHandler(sys.stdout)
handler.setFormatter(JsonFormatter("trainer", "test"))
log = logging.getLogger("role")
log.addHandler(handler)
def evaluate(where):
    if where == "a":
        raise RuntimeError("Could not infer dtype of NoneType")
    raise RuntimeError("Could not infer dtype of NoneType")
try:
    evaluate(sys.argv[1])
except Exception:
    log.exception(Event.CRASHED, extra={"fields": {}})
    sys.exit(1)
"""


def crashed_child(where: str, log: Path) -> Child:
    process = subprocess.Popen(
        [sys.executable, "-c", CRASHING, where], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT
    )
    child = Child("trainer", "trainer", process, log, log_max_bytes=2**30, log_keep=1)
    child.pump_thread = threading.Thread(target=child.pump, args=(process.stdout,), daemon=True)
    child.pump_thread.start()
    assert process.wait(timeout=60) == 1
    return child


def test_a_role_crashing_twice_alike_before_any_step_is_not_restarted_again_and_the_run_names_its_error(
    config, tmp_path
):
    cfg = load_config(config, supervision={"max_restarts": 10, "backoff_s": 0.1})
    cfg.run_dir.mkdir(parents=True)
    launcher, progress = Launcher(cfg, config, resume=False), Progress(console=Console(file=io.StringIO()))
    assert launcher.schedule_restart(crashed_child("a", tmp_path / "1.log"), progress) > time.monotonic()
    with pytest.raises(RoleCrashLoop) as loop:
        launcher.schedule_restart(crashed_child("a", tmp_path / "2.log"), progress)
    assert loop.value.name == "trainer" and launcher.restarts == {"trainer": 1}
    message = str(loop.value)
    assert "RuntimeError: Could not infer dtype of NoneType (at <string>:11 in evaluate)" in message, message
    assert f"its log: {tmp_path / '2.log'}" in message
    events = read_events(cfg.run_dir / "events.jsonl")
    assert [event.kind for event in events if event.kind == Event.CRASH_LOOP] == [Event.CRASH_LOOP]


def test_a_crash_that_moves_or_follows_progress_is_restarted_as_the_policy_allows(config, tmp_path):
    cfg = load_config(config, supervision={"max_restarts": 10, "backoff_s": 0.1})
    cfg.run_dir.mkdir(parents=True)
    launcher, progress = Launcher(cfg, config, resume=False), Progress(console=Console(file=io.StringIO()))
    launcher.schedule_restart(crashed_child("a", tmp_path / "1.log"), progress)
    launcher.schedule_restart(crashed_child("b", tmp_path / "2.log"), progress)  # the same error at another line
    again = crashed_child("b", tmp_path / "3.log")
    launcher.last_step = again.step_at_spawn + 1  # a step was applied while it ran
    launcher.schedule_restart(again, progress)
    assert launcher.restarts == {"trainer": 3}


# Injected into the trainer's process (a sitecustomize module on its PYTHONPATH; cold starts, so every process
# imports it): its first step raises, as a tokenizer without a pad token once made the step-0 evaluation raise.
FAILING_STEP = """
import os
if os.environ.get("RLPIPE_SERVICE__INSTANCE") == "trainer":
    from services.trainer.service import Trainer

    async def train_step(self, collected):
        raise RuntimeError("Could not infer dtype of NoneType")

    Trainer.train_step = train_step
"""


@pytest.mark.e2e
def test_a_trainer_failing_alike_at_its_first_step_ends_the_run_after_one_restart_naming_its_error(
    tiny_model, tmp_path
):
    config = config_file(
        tmp_path, tiny_model, service={"warm_start": False, "warm_start_pool": None}, supervision={"backoff_s": 0.1}
    )
    (tmp_path / "inject").mkdir()
    (tmp_path / "inject" / "sitecustomize.py").write_text(FAILING_STEP)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "inject"), str(ROOT)])}
    done = subprocess.run([*RLPIPE_RUN, str(config)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stderr[-3000:]
    said = "rlpipe run: trainer crashed twice with the same error and no step between, so it is not restarted again: "
    assert done.stderr.count(said + "RuntimeError: Could not infer dtype of NoneType\n") == 1, done.stderr[-3000:]
    assert f"  its log: {tmp_path / 'runs' / 'test' / 'logs' / 'trainer.log'}\n" in done.stderr
    run = json.loads((tmp_path / "runs" / "test" / "run.json").read_text())
    assert run["restarts"] == {"trainer": 1}, run["restarts"]


# A trainer's and a reward's output, as their JSON logs carry alerts.
ALERTING = """
import json, sys
role = sys.argv[1]
lines = [
    {"event": "resume_waiting", "level": "ERROR", "alert": True, "error": "store unreadable: 403"},
    {"event": "resume_waiting", "level": "ERROR", "alert": True, "error": "store unreadable: 403"},  # a minute's repeat
    {"event": "alert", "level": "WARNING", "alert": True, "message": "kl_ref above 1"},  # in events.jsonl already
    {"event": "breaker_open", "level": "ERROR", "alert": True, "error": "HTTP 401 from the reward service"},
    {"event": "start_refused", "level": "ERROR", "alert": True, "error": "said once at the run's end"},
    {"event": "batch_done", "level": "INFO"},
]
for line in lines:
    print(json.dumps(line), flush=True)
"""


@pytest.mark.parametrize("role", ["trainer", "reward"])
def test_a_roles_alerts_reach_the_console_once_a_minute_with_what_to_do(role, tmp_path):
    process = subprocess.Popen([sys.executable, "-c", ALERTING, role], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    child = Child(f"{role}-0", role, process, tmp_path / "r.log", log_max_bytes=2**20, log_keep=1)
    said: list[str] = []
    child.echo = said.append
    child.pump(process.stdout)
    assert process.wait(timeout=30) == 0
    waiting = f"{role}-0 error: resume_waiting: store unreadable: 403; the trainer waits for its checkpoint store"
    breaker = f"{role}-0 error: breaker_open: HTTP 401 from the reward service; see {tmp_path / 'r.log'}"
    recorded = [] if role == "trainer" else [f"{role}-0 warning: alert: kl_ref above 1; see {tmp_path / 'r.log'}"]
    assert [line.split(" and will not")[0] for line in said] == [waiting, *recorded, breaker]


# Writes 4 MiB, far past a pipe's buffer, then its last word as an event: it ends only if its output is read.
CHATTY = """
import json
for i in range(4096):
    print("x" * 1023, flush=False)
print(json.dumps({"event": "start_refused", "error": "its last word"}), flush=True)
"""


def test_a_log_that_cannot_be_written_costs_lines_never_the_child(config):
    # /dev/full refuses every write with ENOSPC, as a full disk does.
    child = piped_child("trainer", "trainer", CHATTY, Path("/dev/full"))
    assert child.process.wait(timeout=60) == 0, "the child blocked on a pipe nobody drained"
    child.pump_thread.join(timeout=30)
    assert child.dropped_lines == 4097
    assert child.refusal == "its last word"  # its events are still read


# Exits 0 `seconds` after SIGTERM, as a service finishing its work (the trainer's final save) would.
SLOW_TO_STOP = """
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: (time.sleep({seconds}), sys.exit(0)))
print("ready", flush=True)
time.sleep(120)
"""


def slow_child(name: str, role: str, seconds: float, log: Path) -> Child:
    process = subprocess.Popen(
        [sys.executable, "-c", SLOW_TO_STOP.format(seconds=seconds)], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout.readline() == "ready\n"  # its SIGTERM handler is in place
    return Child(name, role, process, log, log_max_bytes=2**20, log_keep=1)


@pytest.mark.integration
def test_each_service_gets_its_own_stop_grace(config, tmp_path):
    cfg = load_config(config, supervision={"trainer_stop_grace_s": 30, "stop_grace_s": 1})
    cfg.run_dir.mkdir(parents=True)
    launcher = Launcher(cfg, config, resume=False)
    # Both take 4 s to stop: the trainer is within its grace, the rollout is not.
    trainer = slow_child("trainer", "trainer", 4, tmp_path / "trainer.log")
    rollout = slow_child("rollout-0", "rollout", 4, tmp_path / "rollout.log")
    rollout.ready = trainer.ready = {"event": "ready"}
    launcher.children = [trainer, rollout]

    started = time.monotonic()
    failed = launcher.stop()

    assert trainer.process.returncode == 0, "the trainer was killed before its save could finish"
    assert rollout.process.returncode == -9, "the rollout outlived its grace and should have been killed"
    assert failed == ["rollout-0"]
    assert 3.5 < time.monotonic() - started < 20


@pytest.mark.integration
def test_a_stage_still_starting_is_killed_at_once_on_stop_as_it_holds_no_work(config, tmp_path):
    cfg = load_config(config, supervision={"stop_grace_s": 20})
    cfg.run_dir.mkdir(parents=True)
    launcher = Launcher(cfg, config, resume=False)
    reward = slow_child("reward-0", "reward", 30, tmp_path / "reward.log")  # never logged ready
    launcher.children = [reward]
    started = time.monotonic()
    assert launcher.stop() == ["reward-0"]
    assert reward.process.returncode == -signal.SIGKILL
    assert time.monotonic() - started < 10  # not its 20 s grace


@pytest.mark.integration
def test_a_second_ctrl_c_during_the_stop_kills_every_service_at_once(config, tmp_path):
    """The first Ctrl-C gives the trainer its long grace for the final save; a person who presses it again
    wants out now, and gets it instead of waiting out supervision.trainer_stop_grace_s."""
    cfg = load_config(config, supervision={"trainer_stop_grace_s": 300})
    cfg.run_dir.mkdir(parents=True)
    launcher = Launcher(cfg, config, resume=False)
    trainer = slow_child("trainer", "trainer", 60, tmp_path / "trainer.log")
    launcher.children = [trainer]
    previous = signal.signal(signal.SIGINT, interrupt)
    second = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    try:
        second.start()
        started = time.monotonic()
        killed = stop_or_kill(launcher)
    finally:
        second.cancel()
        signal.signal(signal.SIGINT, previous)
    assert killed == ["trainer"]
    assert trainer.process.returncode == -signal.SIGKILL
    assert time.monotonic() - started < 30  # not the 60 s its stop would have taken


@pytest.mark.e2e
def test_ctrl_c_stops_the_run_in_order_saves_its_step_and_says_how_to_resume(tiny_model, tmp_path):
    """Ctrl-C is how a person ends a run early: not a failure. Every service stops in order, the trainer saves
    the step in hand, the report is written, and the exit status is 130 (128 + SIGINT) with the resume command."""
    config = config_file(
        tmp_path,
        tiny_model,
        run_id="ctrlc",
        train={"total_steps": 10_000, "batch_size": 4},
        checkpoint={"save_every_steps": 1000, "keep_last": 2},
        # The launcher's stop is under test, not the engine: the transformers rollout starts without vLLM's cost.
        rollout={"backend": "hf", "prompts_per_batch": 4},
    )
    run_dir = tmp_path / "runs" / "ctrlc"
    with running_pipeline(config) as process:
        wait_for(lambda: sum(r.is_step for r in metric_rows(run_dir)) >= 3, "step 3", process)
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=300)
    assert process.returncode == 128 + signal.SIGINT, output[-3000:]
    assert "SIGINT: stopping every service" in output and "run failed" not in output
    assert "services failed" not in output  # a stop asked for is reported as a stop
    assert f"continue it with rlpipe run {config} --resume" in " ".join(output.split())
    last_step = max(r.step for r in metric_rows(run_dir) if r.is_step)
    saved = sorted(path.name for path in run_dir.glob("step-*"))
    assert saved == [f"step-{last_step:08d}"]  # no periodic save came due: this is the stop's own
    assert (run_dir / "report.png").stat().st_size > 0


@pytest.mark.e2e
def test_a_run_whose_warm_start_pool_is_gone_starts_its_roles_cold_and_says_so_once(tiny_model, tmp_path):
    missing = tmp_path / "no-pool.sock"
    config = config_file(
        tmp_path,
        tiny_model,
        run_id="cold",
        train={"total_steps": 2, "batch_size": 4},
        checkpoint={"save_every_steps": 0},
        rollout={"backend": "hf", "prompts_per_batch": 4},
        service={"warm_start_pool": str(missing)},
    )
    done, rows = run_pipeline(config)
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = tmp_path / "runs" / "cold"
    failed = [e for e in read_events(run_dir / "events.jsonl") if e.kind == Event.WARM_START_FAILED]
    assert len(failed) == 1 and f"cannot join the warm-start pool at {missing}" in failed[0].message
    assert max(r.step for r in rows if r.is_step) == 2
    # Every role a fresh interpreter: no warm starter's imports in the run's device-hours.
    usage = json.loads((run_dir / "usage.json").read_text())
    assert sorted(usage["device_hours"]) == ["reference", "reward", "rollout", "trainer"]


@pytest.mark.e2e
def test_a_role_that_refuses_to_start_ends_the_run_with_2_printing_its_reason_once(tiny_model, tmp_path):
    """The trainer refuses a message limit its broker would not take (the embedded nats-server's max_payload is
    1 MiB): ``rlpipe run`` does not restart it, prints its reason and exits 2."""
    config = config_file(tmp_path, tiny_model, nats={"max_message_bytes": 2 * 2**20})
    done = rlpipe_run(config)
    assert done.returncode == EXIT_REFUSED, done.stderr[-3000:]
    reason = (
        "rlpipe run: trainer refused to run: nats.max_message_bytes is 2097152 bytes but the broker takes at most "
        "1048576 (its max_payload)"
    )
    assert done.stderr.count(reason) == 1, done.stderr[-3000:]
    trainer_log = (tmp_path / "runs" / "test" / "logs" / "trainer.log").read_text()
    assert trainer_log.count('"start_refused"') == 1 and '"ready"' not in trainer_log


@pytest.mark.unit
def test_the_run_summary_gives_the_mean_share_of_groups_dynamic_sampling_filtered(config):
    cfg = load_config(config)
    cfg.metrics_file.parent.mkdir(parents=True, exist_ok=True)
    step = {"reward_mean": 0.5, "entropy": 1.0, "kl_ref": 0.0, "response_length_mean": 4.0, "termination_rate": 1.0}
    rows = [
        {**step, "step": n, "completions": 8, "dynamic_sampling/dropped_fraction": share}
        for n, share in enumerate([0.5, 0.25], 1)
    ]
    cfg.metrics_file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = io.StringIO()
    Console(file=out, width=200).print(summarize(cfg, RunDone(steps=2), {}, 10.0))
    assert "groups filtered by dynamic sampling (mean share)" in out.getvalue()
    assert "0.375" in out.getvalue()


@pytest.mark.unit
def test_a_rollout_is_handed_its_own_seed_file_and_the_weight_sync_token_and_nothing_else(config, tmp_path):
    launcher = Launcher(load_config(config), config, resume=False)
    keys = write_run_credentials(tmp_path / "nats-auth")
    launcher.credentials = RunCredentials(tmp_path, nats_keys=keys, weight_sync_token="the-runs-token")
    given = launcher.role_env("rollout")
    # Not the admin token file, not the operator's seed: the Python tool's box then keeps even these from the code.
    assert given == {
        "RLPIPE_NATS__NKEY_SEED_FILE": str(keys["rollout"].seed_file),
        "RLPIPE_WEIGHTSYNC_TOKEN": "the-runs-token",
    }


@pytest.mark.unit
def test_a_restarted_trainer_is_told_the_lease_holder_of_the_process_the_launcher_reaped():
    exited = None  # restart_env is asked only about a child whose exit the launcher has seen
    trainer = Child("trainer", "trainer", exited, Path("/dev/null"), log_max_bytes=1, log_keep=1)
    trainer._note(b'{"event": "lease_acquired", "epoch": 1, "holder": "host:4242"}')
    assert restart_env(trainer) == {"RLPIPE_CHECKPOINT__RESUME": "true", "RLPIPE_TRAINER__TAKEOVER_FROM": "host:4242"}
    rollout = Child("rollout-0", "rollout", exited, Path("/dev/null"), log_max_bytes=1, log_keep=1)
    assert restart_env(rollout) == {"RLPIPE_CHECKPOINT__RESUME": "true"}


@pytest.mark.e2e
def test_an_observation_role_the_models_template_cannot_wrap_ends_the_run_with_2_naming_the_field(tiny_model, tmp_path):
    """The tiny model has no chat template: the rollout (and the trainer, for its held-out episodes) refuse at start
    rather than run episodes they cannot render; whichever refuses first, the reason is the field's."""
    rollout = {"environment": "calculator", "turn_stop": ["</calc>"], "observation_role": "tool"}
    config = config_file(tmp_path, tiny_model, rollout=rollout, reward={"functions": {"final_number": 1.0}})
    done = rlpipe_run(config)
    assert done.returncode == EXIT_REFUSED, done.stderr[-3000:]
    reason = "rollout.observation_role='tool' wraps observations in the model's chat template, and the model has none"
    assert done.stderr.count(reason) == 1, done.stderr[-3000:]
