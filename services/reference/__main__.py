from services.common.service import run_service
from services.reference.service import main

run_service("reference", main)
