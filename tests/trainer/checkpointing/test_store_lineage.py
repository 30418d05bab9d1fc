"""Checkpoints belong to one run incarnation and one branch; saving never leaves a live step without a copy.

Checkpoints of another run or branch are never trusted, and a prune failure after the manifest landed neither fails
the save nor lets a re-save delete the good copy first.
"""

import json
import logging
from collections.abc import Mapping

import pytest

from services.common.config import CheckpointConfig
from services.common.transport.storage import ObjectStore, open_store
from services.trainer.checkpointing.lineage import RestartRecord
from services.trainer.checkpointing.manifest import ABANDONED, STABLE, sha256
from services.trainer.checkpointing.state import TrainerState
from services.trainer.checkpointing.step_reader import ForeignCheckpoints
from services.trainer.checkpointing.store import CheckpointStore
from tests.support.trainer import checkpoint

pytestmark = pytest.mark.unit


@pytest.fixture
def model_dir(tmp_path):
    path = tmp_path / "hf"
    path.mkdir()
    (path / "config.json").write_text("{}")
    return path


def file_store(tmp_path, name: str = "ckpt") -> ObjectStore:
    return open_store((tmp_path / name).as_uri(), CheckpointConfig())


class DeletesFail:
    """A real store whose deletes fail while ``failing``: an S3 outage or a denied DeleteObjects."""

    def __init__(self, store: ObjectStore):
        self.store, self.url, self.failing = store, store.url, True

    def delete_prefix(self, prefix: str) -> None:
        if self.failing:
            raise OSError("delete refused")
        self.store.delete_prefix(prefix)

    def delete(self, keys: list[str]) -> None:
        if self.failing:
            raise OSError("delete refused")
        self.store.delete(keys)

    def __getattr__(self, name):
        return getattr(self.store, name)


class Observed:
    """A real store that runs ``look()`` before every write or delete: what a reader meets mid-save."""

    def __init__(self, store: ObjectStore, look):
        self.store, self.url, self.look, self.writes = store, store.url, look, []

    def put(self, key: str, data: bytes, tags: Mapping[str, str] | None = None) -> None:
        self.look()
        self.writes.append(("put", key))
        self.store.put(key, data, tags)

    def delete(self, keys: list[str]) -> None:
        self.look()
        self.writes.append(("delete", *keys))
        self.store.delete(keys)

    def delete_prefix(self, prefix: str) -> None:
        self.look()
        self.writes.append(("delete_prefix", prefix))
        self.store.delete_prefix(prefix)

    def __getattr__(self, name):
        return getattr(self.store, name)


class PutsFailAfter:
    """A real store whose puts fail after the first ``allowed``: the store going away mid-way."""

    def __init__(self, store: ObjectStore, allowed: int):
        self.store, self.url, self.allowed, self.puts = store, store.url, allowed, []

    def put(self, key: str, data: bytes, tags: Mapping[str, str] | None = None) -> None:
        if len(self.puts) == self.allowed:
            raise OSError("store went away")
        self.puts.append(key)
        self.store.put(key, data, tags)

    def __getattr__(self, name):
        return getattr(self.store, name)


# -- trainer state --------------------------------------------------------------------------


def test_trainer_state_round_trips_and_reads_files_from_before_the_new_fields():
    state = TrainerState(
        step=4,
        policy_version=9,
        config_version=2,
        data_cursor={"epoch": 1, "index": 16},
        last_experience_seq=44,
        in_flight=["g-7", "g-8"],
        eval_accuracy=0.5,
        baseline_accuracy=0.25,
        metrics={"loss": 1.5},
        incarnation="abc",
        applied_ids=["g-1", "g-2"],
        claim_keys=[(40, "claims/g-1.x"), (41, "claims/g-2.y")],
    )
    assert TrainerState.from_json(state.to_json()) == state  # claim keys come back as tuples
    old = {
        "step": 3,
        "policy_version": 5,
        "config_version": 1,
        "data_cursor": {"epoch": 0, "index": 24},
        "last_experience_seq": 30,
        "in_flight": ["g-9"],
        "eval_accuracy": None,
        "baseline_accuracy": 0.1,
        "metrics": {},
        "written_by_a_newer_trainer": True,  # ignored
    }
    assert TrainerState.from_json(json.dumps(old)) == TrainerState(
        step=3,
        policy_version=5,
        config_version=1,
        data_cursor={"epoch": 0, "index": 24},
        last_experience_seq=30,
        in_flight=["g-9"],
        baseline_accuracy=0.1,
        incarnation="",
        applied_ids=[],
        claim_keys=[],
    )
    with pytest.raises(ValueError, match=r"lacks \['last_experience_seq'\]"):
        TrainerState.from_json('{"step": 1, "policy_version": 1}')


# -- incarnations ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["file", pytest.param("s3", marks=pytest.mark.integration)])
def test_a_fresh_start_on_a_prefix_holding_another_runs_steps_is_refused(kind, tmp_path, model_dir, request):
    if kind == "file":
        url, cfg = (tmp_path / "ckpt").as_uri(), CheckpointConfig()
    else:
        endpoint = request.getfixturevalue("s3_env")
        url, cfg = "s3://rlpipe-fresh/ckpts", CheckpointConfig(s3_endpoint=endpoint, s3_secure=False)
    old = CheckpointStore(open_store(url, cfg), "run-f", keep_last=3)
    first = old.start_fresh()  # an empty prefix: a fresh start goes ahead
    assert len(first) == 32 and old.incarnation == first
    for step in (1, 2, 3):
        old.save(checkpoint(step, first), model_dir)
    old.abandon_after(2)  # abandoned steps are still another run's data in the way

    fresh = CheckpointStore(open_store(url, cfg), "run-f", keep_last=3)
    with pytest.raises(ForeignCheckpoints) as raised:
        fresh.start_fresh()
    prefix = f"{url}/run-f/"
    assert str(raised.value) == (
        f"checkpoints of an earlier run are in the way of a fresh start: {prefix} holds steps [1, 2, 3]. "
        "Continue that run with `rlpipe run --resume`, or start a new one under another run_id."
    )
    assert raised.value.found == {prefix: [1, 2, 3]}
    assert fresh.incarnation is None  # nothing was taken on: it still cannot save
    with pytest.raises(RuntimeError, match="no incarnation yet"):
        fresh.save(checkpoint(1, ""), model_dir)
    # Another run id on the same store is a clean prefix.
    assert CheckpointStore(open_store(url, cfg), "run-g", keep_last=3).start_fresh() != first


def test_an_old_runs_steps_on_the_mirror_also_refuse_a_fresh_start(tmp_path, model_dir):
    primary, mirror = file_store(tmp_path, "primary"), file_store(tmp_path, "mirror")
    CheckpointStore(mirror, "run-f", keep_last=3, incarnation="old").save(checkpoint(7, "old"), model_dir)
    with pytest.raises(ForeignCheckpoints) as raised:
        CheckpointStore(primary, "run-f", keep_last=3, mirror=mirror).start_fresh()
    assert raised.value.found == {f"{mirror.url}/run-f/": [7]}


def test_foreign_steps_are_neither_seen_nor_pruned_nor_overwritten(tmp_path, model_dir):
    files = file_store(tmp_path)
    old = CheckpointStore(files, "run-x", keep_last=2, incarnation="old")
    for step in (5, 6, 7):
        old.save(checkpoint(step, "old", last_experience_seq=500 + step), model_dir)
    old.mark(6, STABLE)

    new = CheckpointStore(files, "run-x", keep_last=2, incarnation="new")
    for step in (1, 2, 3):
        new.save(checkpoint(step, "new"), model_dir)
    # Its own checkpoint of step 3 is the newest it knows: the old run's higher steps do not prune it.
    assert new.steps() == [2, 3]
    assert old.steps() == [6, 7]  # and the new run's pruning left them alone
    assert new.steps(include_foreign=True) == [2, 3, 6, 7]
    assert new.load_latest().step == 3 and new.load_latest().incarnation == "new"
    assert new.latest_stable() is None  # the old run's stable step is not this run's to roll back to
    assert new.replay_floor(read_seq=30) == 20  # the old run's sequences (506, 507) play no part
    assert [(e.step, e.incarnation, e.foreign) for e in new.catalog()] == [
        (2, "new", False),
        (3, "new", False),
    ]
    assert [(e.step, e.foreign) for e in new.catalog(include_foreign=True)] == [
        (2, False),
        (3, False),
        (6, True),
        (7, True),
    ]
    with pytest.raises(KeyError, match=r"step 6 belongs to another run incarnation \(old\)"):
        new.mark(6, STABLE)
    with pytest.raises(ForeignCheckpoints, match="belongs to another run incarnation"):
        new.load(7)
    # A step of the same number is refused, and the old run's copy is untouched.
    with pytest.raises(ForeignCheckpoints, match="holds step 7 of another run incarnation \\(old\\); not overwriting"):
        new.save(checkpoint(7, "new"), model_dir)
    assert old.load(7).state.last_experience_seq == 507
    assert new.abandon_after(0) == [2, 3]  # only its own steps
    assert old.steps() == [6, 7]
    # A store that has not chosen yet (a trainer about to resume) sees every step.
    assert CheckpointStore(files, "run-x", keep_last=2).steps() == [6, 7]


def test_legacy_steps_without_an_incarnation_belong_to_whoever_resumes_them(tmp_path, model_dir):
    files = file_store(tmp_path)
    writer = CheckpointStore(files, "run-l", keep_last=2, incarnation="tmp")
    for step in (1, 2):
        writer.save(checkpoint(step, "tmp"), model_dir)
    for step in (1, 2):  # rewrite both as a trainer from before incarnations stored them
        prefix = f"run-l/step-{step:08d}/"
        state = json.loads(files.get(prefix + "trainer_state.json"))
        for new_field in ("incarnation", "applied_ids", "claim_keys"):
            del state[new_field]
        data = json.dumps(state).encode()
        files.put(prefix + "trainer_state.json", data)
        manifest = json.loads(files.get(prefix + "manifest.json"))
        del manifest["incarnation"]
        manifest["files"]["trainer_state.json"] = {"size": len(data), "sha256": sha256(data)}
        files.put(prefix + "manifest.json", json.dumps(manifest).encode())

    resumer = CheckpointStore(files, "run-l", keep_last=2)
    ckpt = resumer.load_latest()
    assert ckpt.step == 2 and ckpt.incarnation == "" and ckpt.state.claim_keys == []
    incarnation = resumer.adopt_incarnation(ckpt)
    assert len(incarnation) == 32 and resumer.incarnation == incarnation
    assert resumer.steps() == [1, 2]  # still its own
    resumer.save(checkpoint(3, incarnation), model_dir)
    assert resumer.steps() == [2, 3]  # and pruned like its own
    assert [e.incarnation for e in resumer.catalog()] == [None, incarnation]
    # A resume adopts the id of the checkpoint it continues.
    again = CheckpointStore(files, "run-l", keep_last=2)
    assert again.adopt_incarnation(again.load_latest()) == incarnation


def test_a_save_with_another_incarnations_state_is_a_programming_error(tmp_path, model_dir):
    store = CheckpointStore(file_store(tmp_path), "run-e", keep_last=2, incarnation="mine")
    with pytest.raises(ValueError, match="its state names incarnation 'theirs', the store writes for 'mine'"):
        store.save(checkpoint(1, "theirs"), model_dir)
    assert store.steps(include_foreign=True) == []


# -- branches -----------------------------------------------------------------------------------


def test_resuming_from_an_older_step_abandons_the_later_branch_on_both_stores(tmp_path, model_dir):
    primary, mirror = file_store(tmp_path, "primary"), file_store(tmp_path, "mirror")
    store = CheckpointStore(primary, "run-b", keep_last=3, mirror=mirror, incarnation="inc")
    for step in (1, 2, 3, 4):
        store.save(checkpoint(step, "inc"), model_dir)
    store.mark(4, STABLE)
    assert store.steps() == [2, 3, 4]

    assert store.abandon_after(2) == [3, 4]
    assert store.abandon_after(2) == []  # idempotent: the trainer may run it again after a failure
    for copy in (primary, mirror):
        assert store.steps(copy) == [2] and store.steps(copy, include_abandoned=True) == [2, 3, 4]
    assert store.latest_stable() is None  # `rollback --stable` no longer offers the abandoned step 4
    assert store.load_latest().step == 2
    assert store.replay_floor(read_seq=20) == 20

    # The new branch: pruning drops the abandoned steps first, and step 3 is the new branch's.
    store.save(checkpoint(3, "inc", policy_version=30), model_dir)
    store.save(checkpoint(4, "inc", policy_version=40), model_dir)
    for copy in (primary, mirror):
        assert store.steps(copy, include_abandoned=True) == [2, 3, 4]
        assert store.load(4, copy).state.policy_version == 40
    assert store.latest_stable() is None  # the old step 4's mark did not pass to the new one
    assert not primary.list("run-b/step-00000004/" + ABANDONED)


def test_an_interrupted_abandon_leaves_the_newest_steps_abandoned_first(tmp_path, model_dir):
    files = file_store(tmp_path)
    store = CheckpointStore(files, "run-i", keep_last=5, incarnation="inc")
    for step in (1, 2, 3, 4):
        store.save(checkpoint(step, "inc"), model_dir)
    flaky = PutsFailAfter(files, 1)
    with pytest.raises(OSError, match="store went away"):
        CheckpointStore(flaky, "run-i", keep_last=5, incarnation="inc", attempts=1).abandon_after(1)
    assert flaky.puts == ["run-i/step-00000004/ABANDONED"]
    assert store.steps() == [1, 2, 3]  # still one unbroken branch: a restart resumes 3, not a step past a gap
    assert store.abandon_after(1) == [2, 3]  # the retry finishes the job


def test_the_replay_floor_never_exceeds_what_the_trainer_has_read(tmp_path, model_dir):
    store = CheckpointStore(file_store(tmp_path), "run-f", keep_last=3, incarnation="inc")
    assert store.replay_floor(read_seq=50) == 50  # nothing stored: no step reads anything again
    for step in (1, 2):
        store.save(checkpoint(step, "inc"), model_dir)
    assert store.replay_floor(read_seq=50) == 10
    assert store.replay_floor(read_seq=4) == 4
    store.abandon_after(0)
    assert store.replay_floor(read_seq=50) == 50


def test_the_replay_floor_is_held_by_the_kept_window_not_by_older_stable_steps(tmp_path, model_dir):
    store = CheckpointStore(file_store(tmp_path), "run-w", keep_last=2, incarnation="inc")
    for step in (1, 2, 3, 4):
        store.save(checkpoint(step, "inc"), model_dir)
        if step == 1:
            store.mark(1, STABLE)
    assert store.steps() == [1, 3, 4]
    assert store.replay_floor(read_seq=50) == 30  # steps 3 and 4 (sequences 30, 40); STABLE step 1 does not pin


def test_a_purge_record_is_read_back_from_the_mirror_and_only_for_the_same_stream(tmp_path):
    primary, mirror = file_store(tmp_path, "primary"), file_store(tmp_path, "mirror")
    store = CheckpointStore(primary, "run-p", keep_last=2, mirror=mirror, incarnation="inc")
    assert store.purged_through("stream-a") == 0  # never purged
    store.record_purge(70, "stream-a")
    assert store.purged_through("stream-a") == 70
    assert store.purged_through("stream-b") == 0  # a stream re-created since: the record says nothing of it
    primary.delete_prefix("run-p/")
    assert CheckpointStore(mirror, "run-p", keep_last=2).purged_through("stream-a") == 70


# -- saving -------------------------------------------------------------------------------------


def test_a_prune_failure_after_the_manifest_landed_does_not_fail_the_save(tmp_path, model_dir, caplog):
    files = DeletesFail(file_store(tmp_path))
    store = CheckpointStore(files, "run-p", keep_last=1, incarnation="inc", attempts=2, backoff_s=0)
    store.save(checkpoint(1, "inc"), model_dir)
    with caplog.at_level(logging.WARNING, logger="services.trainer.checkpointing.store"):
        location = store.save(checkpoint(2, "inc"), model_dir)
    assert location == f"{files.url}/run-p/step-00000002/"
    assert store.steps() == [1, 2] and store.load_latest().step == 2
    assert [(r.getMessage(), r.fields["step"]) for r in caplog.records if r.getMessage() == "prune_failed"] == [
        ("prune_failed", 2)
    ]
    files.failing = False
    store.save(checkpoint(3, "inc"), model_dir)  # the next save prunes again
    assert store.steps(include_abandoned=True) == [3]


def test_saving_a_stored_step_again_keeps_the_stored_copy_loadable_throughout(tmp_path, model_dir):
    files = file_store(tmp_path)
    store = CheckpointStore(files, "run-s", keep_last=3, incarnation="inc")
    store.save(checkpoint(1, "inc"), model_dir)
    store.mark(1, STABLE)
    reader = CheckpointStore(files, "run-s", keep_last=3, incarnation="inc")
    seen = []
    observed = Observed(files, lambda: seen.append(reader.load_latest().step))
    store.store = observed
    assert store.save(checkpoint(1, "inc"), model_dir) == f"{files.url}/run-s/step-00000001/"
    assert observed.writes == []  # the same state again: nothing is rewritten
    assert reader.load_latest().step == 1 and reader.latest_stable() == 1


def test_replacing_a_live_step_of_another_branch_disowns_it_before_touching_a_part(tmp_path, model_dir):
    files = file_store(tmp_path)
    store = CheckpointStore(files, "run-r", keep_last=3, incarnation="inc")
    store.save(checkpoint(1, "inc"), model_dir)
    store.save(checkpoint(2, "inc"), model_dir)
    store.mark(2, STABLE)
    reader = CheckpointStore(files, "run-r", keep_last=3, incarnation="inc")
    seen = []

    def look() -> None:
        # Every step a reader lists as live loads: the old step 2, then step 1 alone, then the new step 2.
        for step in reader.steps():
            seen.append((step, reader.load(step).state.policy_version))

    store.store = Observed(files, look)
    store.save(checkpoint(2, "inc", policy_version=20), model_dir)  # e.g. a resume that did not abandon step 2
    look()
    assert seen[0] == (1, 1) and seen[1] == (2, 2)  # before: both live
    assert (2, 2) not in seen[2:] and seen[-1] == (2, 20)
    assert store.store.writes[0] == ("put", "run-r/step-00000002/ABANDONED")
    assert store.store.writes[-1] == ("delete", "run-r/step-00000002/ABANDONED")
    assert reader.latest_stable() is None  # the old branch's STABLE mark went with it


@pytest.mark.integration
def test_s3_replacement_of_an_abandoned_step_removes_parts_the_new_copy_lacks(tmp_path, model_dir, s3_env):
    import torch

    cfg = CheckpointConfig(s3_endpoint=s3_env, s3_secure=False)
    s3 = open_store("s3://rlpipe-replace/p", cfg)
    store = CheckpointStore(s3, "run-c", keep_last=3, incarnation="inc")
    with_critic = checkpoint(2, "inc")
    with_critic.critic = {"v": torch.ones(3)}
    store.save(checkpoint(1, "inc"), model_dir)
    store.save(with_critic, model_dir)
    assert "run-c/step-00000002/critic.safetensors" in s3.list("run-c/step-00000002/")
    store.abandon_after(1)
    store.save(checkpoint(2, "inc", policy_version=22), model_dir)
    assert sorted(k.rpartition("/")[2] for k in s3.list("run-c/step-00000002/")) == sorted(
        [*json.loads(s3.get("run-c/step-00000002/manifest.json"))["files"], "manifest.json"]
    )
    loaded = store.load_latest()
    assert loaded.step == 2 and loaded.critic is None and loaded.state.policy_version == 22


def test_a_resave_after_a_mirror_failure_copies_the_step_and_its_stable_mark_to_the_mirror(tmp_path, model_dir, caplog):
    primary = file_store(tmp_path, "primary")
    mirror = PutsFailAfter(file_store(tmp_path, "mirror"), 0)
    store = CheckpointStore(primary, "run-m", keep_last=1, mirror=mirror, incarnation="inc", attempts=1)
    with caplog.at_level(logging.WARNING, logger="services.trainer.checkpointing.store"):
        store.save(checkpoint(1, "inc"), model_dir)  # the mirror is down: the save still succeeds
    assert [r.getMessage() for r in caplog.records] == ["mirror_failed"]
    store.mark(1, STABLE)
    assert store.steps(mirror) == []
    mirror.allowed = None  # back up
    primary_writes = Observed(primary, lambda: None)
    store.store = primary_writes
    store.save(checkpoint(1, "inc"), model_dir)  # "checkpoint now" again: the primary copy stands
    assert primary_writes.writes == []
    assert store.steps(mirror) == [1] and store.load(1, mirror).step == 1
    assert mirror.store.list("run-m/step-00000001/STABLE") == ["run-m/step-00000001/STABLE"]


def test_a_mirror_that_missed_a_rollback_never_hands_the_abandoned_branch_to_the_next_resume(tmp_path, model_dir):
    primary = file_store(tmp_path, "primary")
    mirror = PutsFailAfter(file_store(tmp_path, "mirror"), None)
    store = CheckpointStore(primary, "run-m", keep_last=3, mirror=mirror, incarnation="inc", attempts=1)
    for step in (1, 2, 3):
        store.save(checkpoint(step, "inc"), model_dir)
    mirror.allowed = len(mirror.puts)  # the mirror goes down during the rollback to step 1
    assert store.abandon_after(1) == [2, 3]
    assert store.steps(mirror) == [1, 2, 3]
    mirror.allowed = None  # back up: the new branch saves step 2 on both stores
    store.save(checkpoint(2, "inc", policy_version=20), model_dir)
    assert store.steps(primary, include_abandoned=True) == [1, 2]  # the primary pruned the abandoned step 3

    assert store.steps(mirror) == [1, 2]  # the mirror disowned the old branch's step 3 too
    restarted = CheckpointStore(primary, "run-m", keep_last=3, mirror=mirror.store, incarnation="inc")
    resumed = restarted.load_newest(saved_step=2).checkpoint
    assert (resumed.step, resumed.state.policy_version) == (2, 20)


def test_a_mirror_down_for_the_rollback_and_the_next_save_still_hands_back_no_abandoned_step(tmp_path, model_dir):
    primary = file_store(tmp_path, "primary")
    mirror = PutsFailAfter(file_store(tmp_path, "mirror"), None)
    store = CheckpointStore(primary, "run-m", keep_last=3, mirror=mirror, incarnation="inc", attempts=1)
    for step in (1, 2, 3):
        store.save(checkpoint(step, "inc"), model_dir)
    mirror.allowed = len(mirror.puts)  # down through the rollback and the new branch's save of step 2
    store.abandon_after(1)
    store.save(checkpoint(2, "inc", policy_version=20), model_dir)
    assert store.steps(primary, include_abandoned=True) == [1, 2] and store.steps(mirror.store) == [1, 2, 3]

    restarted = CheckpointStore(primary, "run-m", keep_last=3, mirror=mirror.store, incarnation="inc")
    for saved_step in (2, None):  # with the run's record, and on a new machine without it
        resumed = restarted.load_newest(saved_step=saved_step).checkpoint
        assert (resumed.step, resumed.state.policy_version) == (2, 20)


def test_a_resume_from_the_mirror_onto_an_emptied_primary_keeps_the_mirrors_older_steps(tmp_path, model_dir):
    primary, mirror = file_store(tmp_path, "primary"), file_store(tmp_path, "mirror")
    store = CheckpointStore(primary, "run-e", keep_last=3, mirror=mirror, incarnation="inc")
    for step in (1, 2, 3):
        store.save(checkpoint(step, "inc"), model_dir)
    primary.delete_prefix("run-e/")  # a bucket re-created empty
    assert store.load_newest(saved_step=3).checkpoint.step == 3
    store.save(checkpoint(4, "inc"), model_dir)
    assert store.steps(primary) == [4] and store.steps(mirror) == [2, 3, 4]  # rollback targets stay on the mirror


def test_the_requested_resumes_are_read_from_the_newest_live_steps_lineage_alone(tmp_path, model_dir):
    primary, mirror = file_store(tmp_path, "primary"), file_store(tmp_path, "mirror")
    store = CheckpointStore(primary, "run-q", keep_last=3, mirror=mirror, incarnation="inc")
    assert store.requested_resumes() == set()  # never saved
    resumed = RestartRecord(event="resume", from_step=1, policy_version=4, abandoned_steps=[2], requested=True)
    older, newer = checkpoint(1, "inc"), checkpoint(3, "inc")
    newer.lineage = resumed.line().decode() + "\n"
    store.save(older, model_dir)
    store.save(newer, model_dir)
    assert store.requested_resumes(saved_step=3) == {1}
    primary.put("run-q/step-00000003/lineage.jsonl", b"bitrot")
    assert store.requested_resumes(saved_step=3) == {1}  # the mirror's copy


def test_saving_a_step_again_with_optimizer_state_adds_it_to_a_copy_without_and_a_reader_always_loads_one(
    tmp_path, model_dir
):
    primary, mirror = file_store(tmp_path, "primary"), file_store(tmp_path, "mirror")
    store = CheckpointStore(primary, "run-o", keep_last=3, mirror=mirror, incarnation="inc")
    weights_only = checkpoint(75, "inc")
    weights_only.optimizer = None
    store.save(weights_only, model_dir)  # a periodic save under checkpoint.optimizer_every
    store.mark(75, STABLE)
    reader = CheckpointStore(primary, "run-o", keep_last=3, incarnation="inc")
    seen = []
    store.store = Observed(primary, lambda: seen.append(reader.load_latest().step))
    store.save(checkpoint(75, "inc"), model_dir)  # the same state, saved at a stop: with the optimizer's
    assert seen and set(seen) == {75}  # never without a loadable copy, never skipped
    for copy in (primary, mirror):
        assert store.load(75, copy).optimizer is not None
    assert reader.latest_stable() == 75  # still the step the operator vouched for
    writes = store.store.writes
    store.save(checkpoint(75, "inc"), model_dir)  # a copy that holds it stands
    assert store.store.writes == writes
