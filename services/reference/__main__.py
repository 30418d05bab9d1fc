from services.common.service import run_service
from services.reference.service import main

# Guarded: worker processes that vLLM (tensor parallelism) or torch start with spawn import __main__ again.
if __name__ == "__main__":
    run_service("reference", main)
