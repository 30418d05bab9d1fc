"""The trainer's checkpoints: what a step holds, its format on the store, saving, resuming, rollback, retention and
the lineage of applied groups. ``recovery.Recovery`` wires the parts and orders their effects."""
