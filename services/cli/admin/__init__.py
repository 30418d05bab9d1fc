"""``rlpipe status|pause|resume|scale|config|checkpoint|checkpoints|rollback|mark-stable|stop|metrics|logs``.

Each command is one Admin call to the trainer with a deadline. The address defaults to
the one recorded in the newest ``runs/*/run.json`` and the token to
``RLPIPE_ADMIN_TOKEN``, else the run directory's ``admin.token``, so next to a local
``rlpipe run`` the commands just work. ``--read-only`` calls with the read token instead
(``RLPIPE_ADMIN_READ_TOKEN``, else ``admin-read.token``): the commands that read answer, the others are refused.

Exit codes a script can rely on: 0 done; 1 refused (invalid value, unknown step, a read-only token on a command
that changes the run); 2 bad usage or no run found; 3 trainer unreachable or out of time; 4 token refused.

``client``: where the trainer's Admin service is and how a call to it goes (deadlines, exit codes); ``views``: how
its answers, the run's metric rows and its logs are printed; ``commands``: the typer commands.
"""
