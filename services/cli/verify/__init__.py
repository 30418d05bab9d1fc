"""``rlpipe verify`` and its relatives (``run --smoke``, ``alerts test``, ``checkpoints verify``, ``samples``): the
post-deployment checklist as commands, and the record each verification leaves."""
