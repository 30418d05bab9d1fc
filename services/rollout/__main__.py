from services.common.service import run_service
from services.rollout.service import main

run_service("rollout", main)
