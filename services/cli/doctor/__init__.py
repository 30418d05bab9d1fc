"""``rlpipe doctor``: is this machine, with this config, ready for a run? One module per group of checks."""
