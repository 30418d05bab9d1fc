"""The event journal: every event is named by an ``Event`` member, and one emit reaches every sink once."""

from __future__ import annotations

import ast
import json
import logging

import pytest

from services.common.observe.events import RECORDED_AS, Event, EventLog, Journal, JournalEntry
from tests.support.paths import ROOT

pytestmark = pytest.mark.unit

# Where events are named: the services and the benches (tests' fake children print JSON of their own).
SOURCES = ("services", "bench")
# Where an event is passed on, not named: the journal hands the member it was given on to its log line, and an HTTP
# dependency logs the members of its ``DependencyEvents`` (which refuses anything but members).
FORWARDERS = {
    ROOT / "services" / "common" / "observe" / "events.py": {"event"},
    ROOT / "services" / "common" / "transport" / "http_dependency.py": {
        "self.events.failed",
        "self.events.down",
        "self.events.recovered",
    },
}


def event_argument(call: ast.Call) -> ast.expr | None:
    """The argument naming the event of a ``log_event(logger, event, ...)`` or ``<journal>.emit(event, ...)`` call."""
    func = call.func
    if isinstance(func, ast.Name) and func.id == "log_event":
        return call.args[1] if len(call.args) > 1 else next((k.value for k in call.keywords if k.arg == "event"), None)
    if isinstance(func, ast.Attribute) and func.attr == "emit" and "journal" in ast.unparse(func.value):
        return call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "event"), None)
    return None


def named_members(node: ast.expr) -> list[str] | None:
    """The ``Event`` members ``node`` names (``Event.X``, or one of two by a condition); None for anything else."""
    if isinstance(node, ast.IfExp):
        branches = [named_members(node.body), named_members(node.orelse)]
        return None if None in branches else [name for branch in branches for name in branch]
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "Event":
        return [node.attr]
    return None


def test_every_log_event_and_journal_emit_in_the_tree_names_a_member_of_the_event_enum():
    calls, free = 0, []
    for root in SOURCES:
        for path in sorted((ROOT / root).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.Call) or (argument := event_argument(node)) is None:
                    continue
                calls += 1
                if ast.unparse(argument) in FORWARDERS.get(path, set()):
                    continue
                members = named_members(argument)
                if members is None or not all(name in Event.__members__ for name in members):
                    free.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(argument)}")
    assert free == [], "events named outside the Event enum:\n" + "\n".join(free)
    assert calls > 100  # the scan found the tree's call sites, not an empty directory


def test_the_event_enum_lists_one_member_per_name_sorted_and_each_is_its_lowercased_name():
    names = list(Event.__members__)
    assert names == sorted(names)
    assert all(member.value == name.lower() for name, member in Event.__members__.items())
    assert json.dumps({"event": Event.PAUSED}) == '{"event": "paused"}'  # the JSON is the plain string


class Collected:
    """A role's sink: keeps what it is given."""

    def __init__(self) -> None:
        self.entries: list[JournalEntry] = []

    def write(self, entry: JournalEntry) -> None:
        self.entries.append(entry)


def test_one_emit_writes_the_log_line_the_events_file_under_its_recorded_kind_and_each_sink_once(tmp_path, caplog):
    sink = Collected()
    journal = Journal(EventLog(tmp_path / "events.jsonl"), [sink])
    with caplog.at_level(logging.INFO, logger="rlpipe.journal"):
        journal.emit(Event.PAUSED, "held by an operator", step=7, reason="held by an operator")
    [line] = [record for record in caplog.records if record.name == "rlpipe.journal"]
    assert line.getMessage() == "paused"
    assert line.fields == {"step": 7, "message": "held by an operator", "reason": "held by an operator"}
    [row] = [json.loads(text) for text in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert {k: v for k, v in row.items() if k != "time"} == {
        "step": 7,
        "kind": "pause",  # the kind events.jsonl's readers know
        "message": "held by an operator",
        "reason": "held by an operator",
    }
    assert sink.entries == [
        JournalEntry(Event.PAUSED, "held by an operator", logging.INFO, 7, {"reason": "held by an operator"})
    ]


def test_an_event_the_run_does_not_record_is_logged_and_given_to_the_sinks_but_not_written_to_events_jsonl(
    tmp_path, caplog
):
    sink = Collected()
    journal = Journal(EventLog(tmp_path / "events.jsonl"), [sink])
    with caplog.at_level(logging.INFO, logger="rlpipe.journal"):
        journal.emit(Event.PURGED, experience_below=5)
    assert Event.PURGED not in RECORDED_AS
    assert [record.getMessage() for record in caplog.records if record.name == "rlpipe.journal"] == ["purged"]
    assert not (tmp_path / "events.jsonl").exists()
    assert [entry.event for entry in sink.entries] == [Event.PURGED]


def test_an_alert_flag_marks_only_the_log_line():
    """``alert: true`` is for log-based alerting; the record and the sinks see the event's own fields."""
    sink = Collected()
    Journal(None, [sink]).emit(Event.STEP_SKIPPED, "step 3: updates skipped", level=logging.ERROR, alert=True, step=3)
    assert sink.entries[0].fields == {}


def test_an_events_file_that_cannot_be_written_costs_its_line_never_the_caller(tmp_path, caplog):
    """The trainer's done goes through the journal at the end of a run: a full or unwritable run folder must not
    turn a finished run into a crashed trainer (the log line and the sinks still have it)."""
    sink = Collected()
    journal = Journal(EventLog(tmp_path / "events.jsonl"), [sink])
    (tmp_path / "events.jsonl").mkdir()  # opening it to append fails as a full disk's write would: an OSError
    with caplog.at_level(logging.INFO, logger="rlpipe.journal"):
        journal.emit(Event.DONE, "4 steps done", step=4, steps=4)
    logged = [(record.getMessage(), record.fields) for record in caplog.records if record.name == "rlpipe.journal"]
    assert [message for message, _ in logged] == ["done", "event_record_failed"]
    assert logged[1][1]["kind"] == "done" and "IsADirectoryError" in logged[1][1]["error"]
    assert [entry.event for entry in sink.entries] == [Event.DONE]
