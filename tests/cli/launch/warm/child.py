"""Run by the warm-start tests as ``python -m tests.cli.launch.warm.child ACTION``: prints what a role would see."""

import json
import os
import sys
import time

import tests.cli.launch.warm.marker as marker

if sys.argv[1] == "sleep":
    print("sleeping", flush=True)
    time.sleep(600)
print(
    json.dumps(
        {
            "argv": sys.argv[1:],
            "main": __name__,
            "pid": os.getpid(),
            "imported_by": marker.IMPORTED_BY,
            "cwd": os.getcwd(),
            "env": os.environ.get("WARM_TEST"),
            "home_seen": "HOME_SHOULD_GO" in os.environ,
        }
    )
)
sys.exit(int(sys.argv[2]))
