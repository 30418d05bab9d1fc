"""``rlpipe verify``'s ``tuning`` check: one trial of a one-parameter study over the smoke run's own config, run
as ``rlpipe tune`` runs trials (services/tuner: an isolated ``rlpipe run`` in its own process group, its metrics
followed, its objective scored and recorded in an Optuna study), so a deployment that is to be tuned is known to
run, score and record a trial before a budget is spent on many.

The study lives in the verification's own temporary folder; the trial's run id is ``<smoke run id>-tune-t0``,
whose checkpoints are deleted from the run's stores before and after, as the smoke run's own are.
"""

from __future__ import annotations

import io
import math
import re
from pathlib import Path

from rich.console import Console

from services.cli.verify.check import Check
from services.cli.verify.checkpoints import stores
from services.cli.verify.smoke import SMOKE_TIMEOUT_S
from services.common.config import RunConfig
from services.common.observe import metrics as m

OBJECTIVE = m.REWARD_MEAN  # every step row has it; a smoke config evaluates nothing


def tuning_check(smoke_path: Path, cfg: RunConfig, folder: Path) -> Check:
    """One trial of ``train.learning_rate`` within a factor of two of the configured one, over ``smoke_path``
    (``cfg``, the smoke run's config), its study in ``folder``; passes when the trial completed with a finite
    objective on record."""
    # Deferred: optuna and the tuner are this check's alone, and `rlpipe verify --address` never runs it.
    from services.tuner import records
    from services.tuner.spec import Budget, FloatParam, Objective, Pruner, TrialLimits, TuneSpec
    from services.tuner.study import Tuner

    study = re.sub(r"[^A-Za-z0-9_-]", "-", cfg.run_id)[:43] + "-tune"
    rate = cfg.train.learning_rate
    spec = TuneSpec(
        study=study,
        base_config=smoke_path,
        workdir=folder / "tune",
        space={"train.learning_rate": FloatParam(type="float", low=rate / 2, high=rate * 2, log=True)},
        objective=Objective(metric=OBJECTIVE.key, reduce="final"),
        pruner=Pruner(kind="none"),
        budget=Budget(max_trials=1),
        trial=TrialLimits(max_wall_s=SMOKE_TIMEOUT_S),
        keep_checkpoints=0,
    )
    trial_run_id = spec.trial_run_id(0)
    try:
        _delete_checkpoints(cfg, trial_run_id)
        tuner = Tuner(spec, cfg, Console(file=io.StringIO()))
        tuner.run()
        [trial] = records.records(tuner.study)
    except Exception as error:  # the study could not be opened or run: the check's failure, not verify's
        return Check("tuning", "fail", f"the one-trial study did not run: {error!r}"[:500])
    finally:
        _delete_checkpoints(cfg, trial_run_id)
    end = trial.end
    if end is None or end.status != "complete":
        return Check("tuning", "fail", f"trial {trial_run_id} {trial.status}: {end.reason if end else 'no record'}")
    if end.objective is None or not math.isfinite(end.objective):
        missing = f"trial {trial_run_id} completed without a finite {OBJECTIVE.key}: {end.objective}"
        return Check("tuning", "fail", missing)
    rate_tried = trial.params["train.learning_rate"]
    return Check(
        "tuning",
        "pass",
        f"trial {trial_run_id} (train.learning_rate {rate_tried:.3g}) complete: {OBJECTIVE.key} {end.objective:.4g} "
        f"after {end.steps} steps in {end.wall_s:.0f} s, recorded in its study",
    )


def _delete_checkpoints(cfg: RunConfig, run_id: str) -> None:
    for store in stores(cfg):
        store.delete_prefix(f"{run_id}/")
