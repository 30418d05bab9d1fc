import argparse

from services.common.config import load_config
from services.common.observe.logs import setup_logging
from services.common.service import run_service
from services.trainer.learning.distributed import Mesh
from services.trainer.role import follower_main, main

mesh = Mesh.from_env()
if mesh.is_main:
    run_service("trainer", main)
else:
    # A torchrun rank other than 0: no NATS, no admin, no metrics port (it would collide with rank 0's on the
    # same machine); the config is rank 0's, which the learner takes over when the ranks meet.
    parser = argparse.ArgumentParser(prog="python -m services.trainer")
    parser.add_argument("--config", required=True)
    cfg = load_config(parser.parse_args().config)
    setup_logging(f"trainer-rank{mesh.rank}", cfg.run_id, cfg.service.log_level)
    follower_main(mesh, cfg)
