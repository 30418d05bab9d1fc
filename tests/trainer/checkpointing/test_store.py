import json
import threading
import uuid

import pytest
import torch

from services.common.config import CheckpointConfig
from services.common.transport.lifecycle_tags import CHECKPOINT_TAG
from services.common.transport.storage import open_store
from services.trainer.checkpointing.manifest import FENCE, MANIFEST, STABLE
from services.trainer.checkpointing.state import CheckpointCorrupt, TrainerState
from services.trainer.checkpointing.step_store import FencedOut
from services.trainer.checkpointing.store import AbandonedStep, CheckpointStore
from services.trainer.lease import LeaseLost
from tests.support.trainer import checkpoint, stored_objects, tiny_state

pytestmark = pytest.mark.unit


def round_trip(store_url: str, cfg: CheckpointConfig, tmp_path) -> None:
    model_dir = tmp_path / "hf"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"model_type": "tiny"}')
    store = CheckpointStore(open_store(store_url, cfg), "run-a", keep_last=2)
    incarnation = store.start_fresh()
    for step in (1, 2, 3):
        store.save(checkpoint(step, incarnation, data_cursor={"epoch": 0, "index": 8 * step}), model_dir)
    assert store.steps() == [2, 3]  # keep_last prunes the oldest
    loaded = store.load_latest()
    model, optimizer = tiny_state(3)
    assert loaded.state == TrainerState(
        step=3,
        policy_version=3,
        data_cursor={"epoch": 0, "index": 24},
        last_experience_seq=30,
        incarnation=incarnation,
    )
    assert loaded.step == 3 and loaded.incarnation == incarnation and loaded.scheduler == {"last_epoch": 3}
    restored = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10))
    restored[1].weight = restored[0].weight
    restored.load_state_dict(loaded.model, strict=False)
    for (name, a), b in zip(model.state_dict().items(), restored.state_dict().values(), strict=False):
        assert torch.equal(a, b), name
    assert torch.equal(loaded.optimizer["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])
    assert json.loads(store.store.get("run-a/step-00000003/config.json")) == {"model_type": "tiny"}

    # A corrupted part makes its step invisible: the previous valid step loads instead.
    store.store.put("run-a/step-00000003/optimizer.pt", b"bitrot")
    assert store.load_latest().step == 2
    # A step without a manifest does not exist.
    store.store.put("run-a/step-00000009/model.safetensors", b"partial upload")
    assert store.steps() == [2, 3]


def test_file_store_round_trip(tmp_path):
    round_trip((tmp_path / "ckpt").as_uri(), CheckpointConfig(), tmp_path)


@pytest.mark.integration
def test_s3_store_round_trip(tmp_path, s3_env):
    round_trip("s3://rlpipe-test/ckpts", CheckpointConfig(s3_endpoint=s3_env, s3_secure=False), tmp_path)


@pytest.mark.integration
@pytest.mark.parametrize("prefix", ["", "/"])
def test_an_s3_store_refuses_to_delete_the_empty_prefix_and_keeps_every_run(tmp_path, s3_env, prefix):
    # A prefix of its own: the moto server is shared by the session's tests, which write their own steps.
    url = f"s3://rlpipe-test/empty-prefix-{uuid.uuid4().hex}"
    store = open_store(url, CheckpointConfig(s3_endpoint=s3_env, s3_secure=False))
    store.put("run-a/step-1/weights", b"a")
    store.put("run-b/step-1/weights", b"b")
    with pytest.raises(ValueError, match="names the whole store"):
        store.delete_prefix(prefix)
    assert store.list("run-") == ["run-a/step-1/weights", "run-b/step-1/weights"]


def test_s3_without_endpoint_is_a_clear_error():
    with pytest.raises(ValueError, match="s3_endpoint"):
        open_store("s3://bucket/x", CheckpointConfig())


@pytest.mark.integration
def test_mirror_bucket_gets_every_step_and_covers_a_corrupt_primary(tmp_path, s3_env):
    cfg = CheckpointConfig(s3_endpoint=s3_env, s3_secure=False, s3_part_mib=5)
    primary, mirror = open_store("s3://rlpipe-primary/x", cfg), open_store("s3://rlpipe-mirror/y", cfg)
    store = CheckpointStore(primary, "run-m", keep_last=2, mirror=mirror, incarnation="inc-m")
    model_dir = tmp_path / "hf"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    for step in (1, 2, 3):
        # A 12 MB tensor makes a multipart upload (5 MiB parts, several in parallel).
        store.save(checkpoint(step, "inc-m", extra={"big": torch.randn(3_000_000)}), model_dir)
    assert store.steps(primary) == store.steps(mirror) == [2, 3]
    primary.put("run-m/step-00000003/model.safetensors", b"bitrot")
    loaded = store.load_latest()
    assert loaded.step == 3 and loaded.model["big"].shape == (3_000_000,)  # read from the mirror


def test_stable_marks_survive_pruning_and_abandoned_steps_are_skipped(tmp_path):
    model_dir = tmp_path / "hf"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    store = CheckpointStore(
        open_store((tmp_path / "ckpt").as_uri(), CheckpointConfig()), "run-s", keep_last=2, incarnation="inc-s"
    )

    def save(step: int) -> None:
        store.save(checkpoint(step, "inc-s", policy_version=100 + step), model_dir)

    save(1)
    store.mark(1, "STABLE")
    for step in (2, 3, 4):
        save(step)
    assert store.steps() == [1, 3, 4]  # the stable step outlives keep_last
    assert store.latest_stable() == 1
    save(4)  # saving a step again keeps its marks
    store.mark(4, "STABLE")
    save(4)
    assert store.latest_stable() == 4

    for step in (3, 4):  # a rollback to step 1 disowns what came after
        store.mark(step, "ABANDONED")
    assert store.load_latest().step == 1 and store.latest_stable() == 1
    catalog = {entry.step: entry for entry in store.catalog()}
    assert catalog[4].abandoned and catalog[4].stable and catalog[4].policy_version == 104
    assert catalog[1].stable and not catalog[1].abandoned and catalog[1].bytes > 0

    store.save(checkpoint(3, "inc-s", policy_version=200), model_dir)  # the new branch reaches step 3 again:
    assert store.load_latest().state.policy_version == 200  # its own checkpoint replaces the abandoned one
    assert store.load_latest().step == 3 and not {e.step: e for e in store.catalog()}[3].abandoned
    save(5)
    assert store.steps(include_abandoned=True) == [1, 3, 5]  # abandoned steps are pruned first; stable 1 stays

    with pytest.raises(KeyError, match="no checkpoint at step 9"):
        store.mark(9, "STABLE")


class PruneAfterListing:
    """A file store that prunes one step right after listing it: what a status read meets mid-prune."""

    def __init__(self, store, victim: str):
        self.store, self.victim, self.url = store, victim, store.url

    def list(self, prefix: str) -> list[str]:
        keys = self.store.list(prefix)
        self.store.delete_prefix(self.victim)
        return keys

    def __getattr__(self, name):
        return getattr(self.store, name)


def test_catalog_skips_a_step_pruned_while_it_is_read(tmp_path):
    model_dir = tmp_path / "hf"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    files = open_store((tmp_path / "ckpt").as_uri(), CheckpointConfig())
    writer = CheckpointStore(files, "run-p", keep_last=5, incarnation="inc-p")
    for step in (1, 2):
        writer.save(checkpoint(step, "inc-p"), model_dir)
    reader = CheckpointStore(
        PruneAfterListing(files, "run-p/step-00000001/"), "run-p", keep_last=5, incarnation="inc-p"
    )
    assert [entry.step for entry in reader.catalog()] == [2]


def test_file_store_lists_while_folders_are_removed(tmp_path):
    store = open_store((tmp_path / "ckpt").as_uri(), CheckpointConfig())
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            for step in range(20):
                store.put(f"run/step-{step:08d}/a/b/part", b"x")
            store.delete_prefix("run/")

    worker = threading.Thread(target=churn)
    worker.start()
    try:
        listed = [store.list("run/step-") for _ in range(300)]
    finally:
        stop.set()
        worker.join()
    assert all(all(key.startswith("run/step-") for key in keys) for keys in listed)


@pytest.mark.integration
def test_a_missing_object_is_file_not_found_in_every_store(tmp_path, s3_env):
    for url, cfg in (
        (tmp_path.as_uri(), CheckpointConfig()),
        ("s3://rlpipe-missing/p", CheckpointConfig(s3_endpoint=s3_env, s3_secure=False)),
    ):
        with pytest.raises(FileNotFoundError):
            open_store(url, cfg).get("run/step-00000001/manifest.json")


def test_after_a_rollback_the_new_branch_is_kept_on_the_mirror_and_abandoned_steps_cannot_be_vouched_for(tmp_path):
    model_dir = tmp_path / "hf"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    primary, mirror = (open_store((tmp_path / name).as_uri(), CheckpointConfig()) for name in ("primary", "mirror"))
    store = CheckpointStore(primary, "run-r", keep_last=5, mirror=mirror, incarnation="inc-r")
    for step in (1, 2, 3):
        store.save(checkpoint(step, "inc-r"), model_dir)
    for step in (2, 3):  # a rollback to step 1
        store.mark(step, "ABANDONED")
    with pytest.raises(AbandonedStep, match="step 3 was abandoned"):
        store.mark(3, "STABLE")
    store.save(checkpoint(2, "inc-r", policy_version=7), model_dir)  # the new branch's step 2 replaces the abandoned
    assert store.steps(primary) == store.steps(mirror) == [1, 2]  # one on both stores
    assert store.load(2, mirror).state.policy_version == 7


# ------------------------------------------------------------------ fencing: a stale trainer's writes


def test_a_writer_whose_epoch_a_successor_passed_is_refused_every_write_and_leaves_the_store_as_it_was(tmp_path):
    model_dir = tmp_path / "hf"
    model_dir.mkdir()
    url = f"file://{tmp_path / 'store'}"
    stale = CheckpointStore(open_store(url, CheckpointConfig()), "run-a", keep_last=1)
    stale.claim_fence(1, "host:1")
    incarnation = stale.start_fresh()
    stale.save(checkpoint(1, incarnation), model_dir)
    successor = CheckpointStore(open_store(url, CheckpointConfig()), "run-a", keep_last=1, incarnation=incarnation)
    successor.claim_fence(2, "host:2")
    before = stored_objects(stale)

    with pytest.raises(FencedOut, match=r"a trainer of lease epoch 2 took over run run-a; this one \(epoch 1\)"):
        stale.save(checkpoint(2, incarnation), model_dir)  # would also have pruned step 1 (keep_last 1)
    with pytest.raises(FencedOut):
        stale.record_purge(10, "stream-life")  # the note that precedes an EXPERIENCE purge
    with pytest.raises(FencedOut):
        stale.mark(1, "STABLE")
    with pytest.raises(FencedOut):
        stale.abandon_after(0)
    with pytest.raises(FencedOut):
        stale.claim_fence(1, "host:1")  # nor can it claim the prefix back

    assert stored_objects(stale) == before
    successor.save(checkpoint(2, incarnation), model_dir)  # the holder of the highest epoch writes on
    assert successor.steps() == [2]
    assert json.loads(successor.store.get("run-a/step-00000002/manifest.json"))["fence_epoch"] == 2


def test_the_fence_is_read_from_the_store_so_a_writer_that_believes_its_epoch_current_is_still_refused(tmp_path):
    url = f"file://{tmp_path / 'store'}"
    writer = CheckpointStore(open_store(url, CheckpointConfig()), "run-a", keep_last=2)
    writer.claim_fence(3, "host:1")
    assert writer.stored_fence() == 3
    # Another process raised the fence; this writer's own state still says epoch 3.
    CheckpointStore(open_store(url, CheckpointConfig()), "run-a", keep_last=2).claim_fence(4, "host:2")
    assert writer.epoch == 3
    with pytest.raises(FencedOut, match="epoch 4"):
        writer.record_purge(10, "stream-life")
    assert writer.stored_fence() == 4 and writer.purged_through("stream-life") == 0


def test_a_writer_whose_own_lease_ran_out_writes_nothing_even_before_a_successor_raised_the_fence(tmp_path):
    url = f"file://{tmp_path / 'store'}"
    writer = CheckpointStore(open_store(url, CheckpointConfig()), "run-a", keep_last=2)
    writer.claim_fence(1, "host:1")
    before = stored_objects(writer)

    def expired() -> None:
        raise LeaseLost("the lease of epoch 1 expired 2.0s ago", taken_over=False)

    writer.guard = expired
    with pytest.raises(LeaseLost, match="expired"):
        writer.record_purge(10, "stream-life")
    assert stored_objects(writer) == before


def test_a_save_without_optimizer_state_is_format_3_and_loads_without_one_while_a_full_save_stays_format_2(tmp_path):
    """An older rlpipe refuses the first by name (it cannot resume it exactly) and still resumes the second."""
    model_dir = tmp_path / "hf"
    model_dir.mkdir()
    store = CheckpointStore(open_store((tmp_path / "store").as_uri(), CheckpointConfig()), "run", keep_last=5)
    incarnation = store.start_fresh()
    weights_only = checkpoint(1, incarnation)
    weights_only.optimizer = None
    store.save(weights_only, model_dir)
    store.save(checkpoint(2, incarnation), model_dir)
    first = json.loads(store.store.get("run/step-00000001/manifest.json"))
    second = json.loads(store.store.get("run/step-00000002/manifest.json"))
    assert (first["format"], "optimizer.pt" in first["files"]) == (3, False)
    assert (second["format"], "optimizer.pt" in second["files"]) == (2, True)
    assert store.load(1).optimizer is None
    assert store.load(2).optimizer["state"].keys() == tiny_state(2)[1].state_dict()["state"].keys()
    # Only format 3 may lack it: a format 2 step without optimizer.pt is still a corrupt one.
    del second["files"]["optimizer.pt"]
    store.store.put("run/step-00000002/manifest.json", json.dumps(second).encode())
    with pytest.raises(
        CheckpointCorrupt, match=r"step 2 \(checkpoint format 2\): its manifest lists no \['optimizer.pt'\]"
    ):
        store.load(2)


@pytest.mark.integration
def test_every_object_of_a_step_on_s3_is_tagged_for_the_checkpoint_rule_and_the_fence_is_not(tmp_path, s3_env):
    raw = open_store(
        f"s3://rlpipe-test/tagged-{uuid.uuid4().hex}", CheckpointConfig(s3_endpoint=s3_env, s3_secure=False)
    )
    store = CheckpointStore(raw, "run-t", keep_last=2)
    incarnation = store.start_fresh()
    store.claim_fence(1, "test")
    model_dir = tmp_path / "hf"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"model_type": "tiny"}')
    store.save(checkpoint(1, incarnation), model_dir)
    store.mark(1, STABLE)  # a marker written later is the step's too

    def tags(key: str) -> dict[str, str]:
        return dict(raw.client.get_object_tags(raw.bucket, raw._key(key)) or {})

    keys = raw.list("run-t/")
    in_step = [key for key in keys if key.startswith("run-t/step-00000001/")]
    assert {key.rsplit("/", 1)[1] for key in in_step} >= {MANIFEST, STABLE, "model.safetensors", "config.json"}
    assert {key: tags(key) for key in in_step} == {key: dict([CHECKPOINT_TAG]) for key in in_step}
    assert tags(f"run-t/{FENCE}") == {}  # the run's bookkeeping is no rule's to expire


@pytest.mark.integration
def test_a_store_told_it_has_no_object_tagging_stores_what_would_be_tagged_untagged(s3_env):
    cfg = CheckpointConfig(s3_endpoint=s3_env, s3_secure=False, s3_object_tags=False)
    raw = open_store(f"s3://rlpipe-test/untagged-{uuid.uuid4().hex}", cfg)
    raw.put("run-u/step-00000001/manifest.json", b"{}", dict([CHECKPOINT_TAG]))
    assert raw.get("run-u/step-00000001/manifest.json") == b"{}"
    assert dict(raw.client.get_object_tags(raw.bucket, raw._key("run-u/step-00000001/manifest.json")) or {}) == {}


def test_a_step_a_fenced_out_writer_landed_after_its_successors_step_is_no_resume_candidate(tmp_path):
    """The fence check and the write are two requests: a writer paused between them lands one late manifest."""
    model_dir = tmp_path / "hf"
    model_dir.mkdir()
    url = f"file://{tmp_path / 'store'}"
    stale = CheckpointStore(open_store(url, CheckpointConfig()), "run-a", keep_last=5)
    stale.claim_fence(1, "host:1")
    incarnation = stale.start_fresh()
    stale.save(checkpoint(1, incarnation), model_dir)
    successor = CheckpointStore(open_store(url, CheckpointConfig()), "run-a", keep_last=5, incarnation=incarnation)
    successor.claim_fence(2, "host:2")
    successor.save(checkpoint(2, incarnation, policy_version=20), model_dir)
    stale.stored_fence = lambda: 1  # it read the fence before the successor claimed it
    stale.save(checkpoint(3, incarnation), model_dir)
    assert json.loads(stale.store.get("run-a/step-00000003/manifest.json"))["fence_epoch"] == 1

    restarted = CheckpointStore(open_store(url, CheckpointConfig()), "run-a", keep_last=5)
    resumed = restarted.load_latest(saved_step=2)
    assert (resumed.step, resumed.state.policy_version) == (2, 20)
