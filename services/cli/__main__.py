"""``python -m services.cli``: the ``rlpipe`` command, for tests and machines without the console script."""

from services.cli.app import main

main()
