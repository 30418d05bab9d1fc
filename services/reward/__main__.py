from services.common.service import run_service
from services.reward.service import main

run_service("reward", main)
