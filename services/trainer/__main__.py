from services.common.service import run_service
from services.trainer.service import main

run_service("trainer", main)
