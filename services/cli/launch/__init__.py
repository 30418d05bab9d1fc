"""``rlpipe run``: the launcher that starts a whole pipeline on one machine, its broker, its children and their
supervision, warm starts, the files a run writes about itself, and what it leaves when it ends."""
