import argparse
import sys

from services.common.config import load_config
from services.common.observe.logs import setup_logging
from services.common.refusal import StartRefused
from services.common.service import EXIT_REFUSED, run_service
from services.common.transport.model_source import resolve_model
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
    try:  # its own copy of model.path (fetched on this host if need be), checked as rank 0 checks its own
        cfg = resolve_model(cfg)
    except StartRefused as error:
        print(f"trainer rank {mesh.rank}: {error}", file=sys.stderr)
        sys.exit(EXIT_REFUSED)
    follower_main(mesh, cfg)
