"""``toolsentry trace`` against what a running processor and an executor really wrote.

A processor (``toolsentry run``) decides, an executor driven from the test runs the
routed calls, and the trace is read back from the committed topics: in process for the
order of a life, and once as a user runs it, ``python -m processor trace ... --json``; a
run's view as a user runs it, ``python -m processor trace --run-id RUN --json``.
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest
from typer.testing import CliRunner

from processor.cli import app
from processor.client import ToolsentryClient
from processor.config import Settings
from processor.executor import Call, Executor, Failed, Succeeded
from processor.reference_data import publish_references, wait_until_loaded
from processor.trace import RunView, Trace, read_run, read_trace
from tests.integration.harness import (
    ROOT,
    ProcessorProcess,
    existing,
    isolated,
    settings_env,
    token,
)

pytestmark = pytest.mark.integration

TENANT = "acme-trace"
ORDER = {"order_id": "WO-55502-A"}


@dataclass
class Bench:
    settings: Settings
    client: ToolsentryClient
    executor: Executor
    started_ms: int

    def completed(self, run_id: str) -> str:
        """A lookup proposed, routed, run by the executor and answered: its proposal id."""
        pid = self.client.propose("lookup_order", ORDER, run_id=run_id)
        assert self.client.wait(pid, 60)["decision"] == "ROUTED"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            self.executor.run_once(0.3)
            if any(o["decision"] == "COMPLETED" for o in self.client.history(pid)):
                return pid
        raise AssertionError(f"no result for {pid}")

    def trace(self, pid: str, run_id: str | None = None) -> Trace:
        return read_trace(self.settings, pid, self.started_ms, None, run_id)

    def run_view(self, run_id: str) -> RunView:
        return read_run(self.settings, run_id, self.started_ms, None)

    def env(self) -> dict[str, str]:
        return settings_env(self.settings, "trace-cli")

    def command(self, *args: str) -> subprocess.CompletedProcess[bytes]:
        """``toolsentry trace`` as a user runs it."""
        return subprocess.run(
            [sys.executable, "-m", "processor", "trace", *args],
            cwd=ROOT, env=self.env(), capture_output=True, timeout=120, check=False,
        )  # fmt: skip


def _lookup(call: Call) -> Succeeded | Failed:
    order = {"order_id": call.arguments["order_id"], "status": "processing"}
    return Succeeded({"orders": [order], "match_count": 1, "next_action": None})


@pytest.fixture(scope="module")
def bench(stack_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bench]:
    settings = isolated(stack_settings, "trace")
    started_ms = int(time.time() * 1000) - 60_000
    logs: Path = tmp_path_factory.mktemp("trace-logs")
    proc = ProcessorProcess(settings, "trace-1", logs).start().wait_ready()
    publish_references(settings, existing(TENANT, "lookup_order", ORDER))
    wait_until_loaded(settings)
    executor = Executor(settings, {"lookup_order": _lookup}, group_id="trace-exec",
                        executor_id="trace-exec")  # fmt: skip
    client = ToolsentryClient(settings, TENANT, principal_token=token(settings, TENANT))
    try:
        yield Bench(settings, client, executor, started_ms)
    finally:
        client.close()
        executor.close()
        proc.terminate()


def _run() -> str:
    return f"run-{uuid.uuid4().hex[:10]}"


def test_a_completed_call_is_traced_from_proposal_to_final_observation(bench: Bench) -> None:
    run = _run()
    pid = bench.completed(run)
    for narrowed in (None, run):
        t = bench.trace(pid, narrowed)
        steps = [(e.kind, e.gist.get("decision") or e.gist.get("outcome")) for e in t.entries]
        assert steps == [
            ("proposal", None),
            ("observation", "ROUTED"),
            ("call", None),
            ("result", "SUCCEEDED"),
            ("observation", "COMPLETED"),
        ], narrowed
        assert t.entries[2].topic == bench.settings.topics.execution("READ_ONLY")
        assert t.final is t.entries[-1] and t.warnings == []
    shown = CliRunner().invoke(app, ["trace", pid, "--since", "1h"], env=bench.env())
    assert shown.exit_code == 0, shown.output
    assert "final answer: decision=COMPLETED class=SUCCESS gate=result" in shown.output


def test_a_rejected_proposal_is_its_proposal_and_one_rejection(bench: Bench) -> None:
    pid = bench.client.propose("lookup_order", {"order": "not the field"}, run_id=_run())
    assert bench.client.wait(pid, 60)["decision"] == "REJECTED"
    t = bench.trace(pid)
    assert [e.kind for e in t.entries] == ["proposal", "observation"]
    assert t.entries[1].gist["decision"] == "REJECTED"
    assert t.entries[1].gist["class"] == "STRUCTURAL_VIOLATION"
    assert t.final is t.entries[1] and t.warnings == []


def test_an_unknown_proposal_exits_1_naming_what_was_searched(bench: Bench) -> None:
    missing = f"prop-{uuid.uuid4().hex}"
    shown = CliRunner().invoke(app, ["trace", missing, "--since", "1h"], env=bench.env())
    assert shown.exit_code == 1, shown.output
    assert f"no record of {missing}" in shown.output
    assert bench.settings.topics.observations in shown.output


def test_the_command_prints_one_json_document_as_a_user_runs_it(bench: Bench) -> None:
    run = _run()
    pid = bench.completed(run)
    done = subprocess.run(
        [sys.executable, "-m", "processor", "trace", pid, "--since", "1h", "--run-id", run,
         "--json"],
        cwd=ROOT, env=bench.env(), capture_output=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()
    doc = orjson.loads(done.stdout)
    assert doc["proposal_id"] == pid and doc["found"] is True
    assert [e["kind"] for e in doc["entries"]] == [
        "proposal", "observation", "call", "result", "observation"
    ]  # fmt: skip
    assert doc["final"]["gist"]["decision"] == "COMPLETED"
    assert doc["warnings"] == [] and doc["undecodable"] == {}
    assert all(e["proposal_id"] == pid for e in doc["entries"])


def test_a_run_is_shown_one_row_per_proposal_as_a_user_runs_it(bench: Bench) -> None:
    run = _run()
    completed = bench.completed(run)
    rejected = bench.client.propose("lookup_order", {"order": "not the field"}, run_id=run)
    assert bench.client.wait(rejected, 60)["decision"] == "REJECTED"
    dead = f"prop-{uuid.uuid4().hex[:10]}"
    twice = {"proposal_id": dead, "run_id": run, "tool": {"name": "lookup_order"}}
    # A key given twice: the processor dead-letters it, a reader can still read it.
    value = orjson.dumps(twice).replace(b'"run_id"', b'"run_id":"%s","run_id"' % run.encode())
    bench.client.send_raw(value, run.encode())
    bench.client.flush(30)
    deadline = time.monotonic() + 60
    while len(rows := bench.run_view(run).rows) < 3 or rows[2].decision is None:
        assert time.monotonic() < deadline, "the dead letter was not written"
        time.sleep(0.5)
    done = bench.command("--run-id", run, "--since", "1h", "--json")
    assert done.returncode == 0, done.stderr.decode()
    doc = orjson.loads(done.stdout)
    assert doc["run_id"] == run and doc["found"] is True
    assert [r["proposal_id"] for r in doc["rows"]] == [completed, rejected, dead]
    assert [r["tool"] for r in doc["rows"]] == ["lookup_order@newest"] * 3
    said = [(r["decision"]["gist"], r["last"]["gist"]) for r in doc["rows"]]
    assert [(d["decision"], d["gate"], last["decision"], last["gate"]) for d, last in said] == [
        ("ROUTED", "route", "COMPLETED", "result"),
        ("REJECTED", "schema", "REJECTED", "schema"),
        ("DEAD_LETTER", "parse", "DEAD_LETTER", "parse"),
    ]
    assert said[0][1]["data"] is not None and said[2][1]["reason"] == "duplicate_key"
    assert doc["summary"] == {
        "proposals": 3,
        "final_classes": {"SUCCESS": 1, "STRUCTURAL_VIOLATION": 1, "SYNTACTIC_PARSE_FAIL": 1},
    }
    assert doc["warnings"] == [] and doc["undecodable"] == {}
    unknown = _run()
    missing = bench.command("--run-id", unknown, "--since", "1h")
    assert missing.returncode == 1, missing.stderr.decode()
    assert f"no proposal of run {unknown}" in missing.stdout.decode()
    assert bench.settings.topics.proposals in missing.stdout.decode()
