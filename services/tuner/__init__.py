"""``rlpipe tune``: hyperparameter search over isolated ``rlpipe run`` trials, driven by an Optuna study.

spec.py    the tune file (base config, search space, objective, pruner, budget, per-trial limits, storage)
procs.py   a trial's process group read from /proc: members, host RSS, device memory; stopping it
trial.py   one trial: launch ``rlpipe run``, follow its metrics, enforce its limits, clean up after it
study.py   the study loop: ask, de-duplicate, run, tell; recovery of trials a killed tuner left running
records.py what the study holds per trial, the status table, the best config, the report

A CLI-level package: it drives ``rlpipe run`` as a subprocess and imports only ``services.common``.
"""
