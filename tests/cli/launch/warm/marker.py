"""Preloaded by the warm-start tests: records the pid of the process that imported it."""

import os

IMPORTED_BY = os.getpid()
