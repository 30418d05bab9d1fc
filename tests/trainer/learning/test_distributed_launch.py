"""The trainer's torchrun as the launcher starts it (services.trainer.learning.distributed): a rank's refusal reaches
the
launcher as EXIT_REFUSED, a crash as 1, and no rank outlives a SIGKILLed torchrun. Real torchrun, real ranks of
the real trainer, a real nats-server, real SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from services.cli.launch.children import trainer_command
from services.common.config import load_config
from services.common.service import EXIT_REFUSED
from tests.support.paths import ROOT
from tests.support.runs import config_file

pytestmark = pytest.mark.integration

START_TIMEOUT_S = 240


def launcher_command(config: Path) -> list[str]:
    """The command `rlpipe run` starts the trainer with at trainer.nproc 2."""
    plain = [sys.executable, "-m", "services.trainer", "--config", str(config)]
    return trainer_command(load_config(config), plain, cuda_devices=0)


def rank_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLPIPE_") and k not in ("RANK", "WORLD_SIZE")}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux: each thread's children, as /proc lists them)."""
    found = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        for child in map(int, children.read_text().split()):
            found += [child, *descendants(child)]
    return found


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for whoever adopted it to reap it)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


def test_a_rank_that_refuses_to_start_makes_the_trainer_command_exit_refused(tiny_model, tmp_path):
    """Without an admin token rank 0 refuses (exit 2) while rank 1 waits for it; torchrun alone would say 1."""
    config = config_file(tmp_path, tiny_model, trainer={"nproc": 2})
    done = subprocess.run(
        launcher_command(config), cwd=ROOT, env=rank_env(), capture_output=True, text=True, timeout=START_TIMEOUT_S
    )
    assert done.returncode == EXIT_REFUSED, done.stderr[-4000:]
    assert "RLPIPE_ADMIN_TOKEN" in done.stderr  # rank 0's own reason, passed through


def test_a_rank_that_crashes_makes_the_trainer_command_exit_1_so_it_is_restarted(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text("import os, sys, time\nif os.environ['RANK'] == '0':\n    sys.exit(3)\ntime.sleep(120)\n")
    command = [sys.executable, "-m", "services.trainer.learning.distributed", "--standalone", "--nproc-per-node=2"]
    done = subprocess.run(
        [*command, str(script)], cwd=ROOT, env=rank_env(), capture_output=True, text=True, timeout=START_TIMEOUT_S
    )
    assert done.returncode == 1, done.stderr[-4000:]
    assert "exitcode  : 3" in done.stderr  # torchrun's own account of the failed rank is kept


def test_a_sigterm_stops_every_rank_in_order_and_the_trainer_command_dies_of_it_not_failing(tmp_path):
    """A supervisor's SIGTERM reaches each rank, which finishes (rank 0 would save its step), and the command
    ends by SIGTERM as a single trainer does: the launcher counts that a stop. torchrun alone would exit 1."""
    script = tmp_path / "rank.py"
    script.write_text(
        "import os, signal, sys, time\n"
        "from pathlib import Path\n"
        "here = Path(sys.argv[1])\n"
        "def stop(*_):\n"
        "    time.sleep(1)  # a final save takes a while\n"
        "    (here / f\"stopped-{os.environ['RANK']}\").touch()\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "(here / f\"ready-{os.environ['RANK']}\").touch()\n"
        "time.sleep(120)\n"
    )
    command = [sys.executable, "-m", "services.trainer.learning.distributed", "--standalone", "--nproc-per-node=2"]
    process = subprocess.Popen(
        [*command, str(script), str(tmp_path)], cwd=ROOT, env=rank_env(), stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not all((tmp_path / f"ready-{rank}").exists() for rank in (0, 1)):
            assert process.poll() is None and time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == -signal.SIGTERM, stderr[-4000:]
    assert sorted(p.name for p in tmp_path.glob("stopped-*")) == ["stopped-0", "stopped-1"]


def test_no_trainer_rank_outlives_a_sigkilled_torchrun(tiny_model, tmp_path, nats_url):
    config = config_file(tmp_path, tiny_model, trainer={"nproc": 2})
    env = rank_env(
        RLPIPE_NATS__URL=nats_url,
        RLPIPE_ADMIN_TOKEN="s3cret",
        RLPIPE_SERVICE__TRAINER_GRPC_PORT="0",
        RLPIPE_ADMIN__PORT="0",
    )
    torchrun = subprocess.Popen(
        launcher_command(config), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        # Both ranks are past their start once rank 1 has met rank 0 in the process group.
        met = threading.Event()

        def watch() -> None:
            for line in torchrun.stdout:
                if line.startswith("{") and json.loads(line).get("event") == "follower_ready":
                    met.set()

        threading.Thread(target=watch, daemon=True).start()
        assert met.wait(START_TIMEOUT_S), "rank 1 never joined rank 0"
        ranks = descendants(torchrun.pid)
        commands = [Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") for pid in ranks]
        assert sum(b"services.trainer" in command for command in commands) == 2, commands

        torchrun.send_signal(signal.SIGKILL)
        torchrun.wait()
        deadline = time.monotonic() + 30
        while any(map(running, ranks)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [pid for pid in ranks if running(pid)] == []
    finally:
        torchrun.kill()
        torchrun.wait()


def test_a_rank_whose_parent_died_before_it_could_bind_to_it_kills_itself():
    """The window between torchrun starting a rank and the rank asking to die with it: bound to its live parent
    it goes on; told of a parent that is not its own (it was adopted), it is SIGKILLed on the spot."""
    check = (
        "import os\n"
        "from services.common.parent_death import die_with_parent\n"
        "die_with_parent(os.getppid())\n"
        "print('alive', flush=True)\n"
        "die_with_parent(os.getppid() + 1)\n"
        "print('orphan')\n"
    )
    done = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (-signal.SIGKILL, "alive\n"), done.stderr[-2000:]
