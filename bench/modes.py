"""The processors the benchmark compares, each run as its own process.

``python -m bench.modes MODE COUNT [--log]`` consumes COUNT records from the
topics named by the TOOLSENTRY_* environment and prints one JSON line: records/s
from the first batch to the last commit, and the process's peak RSS (``--log``:
and logs as the processor does).

* ``passthrough`` — the processor's own transactional loop with no gates:
  each input value is copied to the observations topic. The pipe's limit.
* ``foundation`` — the processor with the foundation's gates only: parse,
  tool resolution, schema, route. The same loop and the same gate code; the
  gates on identity, meaning, policy and approval are left out.
* ``toolsentry`` — the processor as shipped: every gate, tokens verified,
  reference data read from Redis, calls that need approval parked, every
  proposal admitted in Redis (idempotency record, budgets, rate limit, guards).
* ``naive`` — the obvious implementation: one record at a time, validate
  with python-jsonschema, encode, produce, commit a transaction per record.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import orjson
from confluent_kafka import Consumer, Message, Producer
from jsonschema import Draft202012Validator

from processor.app import Output, Processor, consumer_config, producer_config
from processor.codec.avro import codec
from processor.config import Settings
from processor.contracts.registry import ContractSet, load_contracts
from processor.gates.parse import DeadLetter, Limits, parse_proposal
from processor.gates.resolve import resolve_tool
from processor.gates.schema import check_arguments
from processor.kafka.offsets import next_offsets, source_record
from processor.model import Decision, Gate, Outcome, Rejection, SourceRecord
from processor.pipeline import _route


def peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


STACK_PIDS = "BENCH_STACK_PIDS"
"""``name=pid,...``: the stack's processes (the broker, redis-server) whose CPU time each
reading takes as well, when the benchmark started them."""


def stack_pids() -> dict[str, int]:
    pairs = (item.split("=") for item in os.environ.get(STACK_PIDS, "").split(",") if item)
    return {name: int(pid) for name, pid in pairs}


def cpu_seconds(pid: int) -> float:
    """CPU time (user and system, every thread) process ``pid`` has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Clocks:
    """Wall time, this process's CPU time (every thread: the loop's, the committer's and
    librdkafka's), the calling thread's own CPU time, and the stack's CPU time, read
    together."""

    __slots__ = ("process", "stack", "thread", "wall")

    def __init__(self) -> None:
        self.wall = time.perf_counter()
        self.process = time.process_time()
        self.thread = time.thread_time()
        self.stack = {name: cpu_seconds(pid) for name, pid in PIDS.items()}


PIDS = stack_pids()


def spent(first: Clocks, last: Clocks, records: int, loop_cpu: float) -> dict[str, Any]:
    """Throughput between two readings, with the CPU each record cost: the process's, and
    the loop thread's alone (``loop_cpu`` seconds), which bounds a loop of one thread
    however idle the other cores are."""
    elapsed = last.wall - first.wall
    return {
        "records": records,
        "seconds": elapsed,
        "per_second": records / elapsed,
        "cpu_us": (last.process - first.process) / records * 1e6,
        "loop_cpu_us": loop_cpu / records * 1e6,
        "stack_cpu_us": {
            name: (last.stack[name] - first.stack[name]) / records * 1e6 for name in first.stack
        },
        "rss_mb": peak_rss_mb(),
    }


class Timed(Processor):
    """The shipped processor, stopping itself after ``count`` records. Timed from its
    first batch to its last commit (on the committer thread); the loop thread's CPU time
    is read on that thread, when it takes a batch's commit as done."""

    def __init__(self, settings: Settings, count: int) -> None:
        super().__init__(settings)
        self.count = count
        self.first: Clocks | None = None
        self.last: Clocks | None = None
        self.loop_cpu_last = 0.0

    def started(self) -> None:
        if self.first is None:
            self.first = Clocks()

    def decide_batch(self, records: list[Message]) -> list[Decision]:
        self.started()
        return super().decide_batch(records)

    def _commit(self, producer: Producer) -> None:
        super()._commit(producer)
        self.last = Clocks()

    def _settle_inflight(self, consumer: Consumer, after: list[Message] | None = None) -> bool:
        settled = super()._settle_inflight(consumer, after)
        self.loop_cpu_last = time.thread_time()
        return settled

    def watch(self) -> None:
        while self.records_committed < self.count:
            time.sleep(0.01)
        self.stop()


def foundation_decide(src: SourceRecord, contracts: ContractSet, limits: Limits) -> Decision:
    """Parse, resolve, schema, route: the decision before this processor had the gates on
    identity, meaning, policy and approval (built from the same gate functions)."""
    started = time.perf_counter()
    now_ms = int(time.time() * 1000)
    parsed = parse_proposal(src, limits)
    if isinstance(parsed, DeadLetter):
        d = Decision(src, Outcome.DEAD_LETTER, Gate.PARSE, None, dlq_reason=parsed.reason)
    else:
        p, rejection, warnings = parsed
        resolved = rejection or resolve_tool(p, contracts)
        if isinstance(resolved, Rejection):
            d = Decision(src, Outcome.REJECTED, resolved.gate, p, rejection=resolved)
        else:
            refusal = check_arguments(p.arguments, resolved)
            if refusal is not None:
                d = Decision(src, Outcome.REJECTED, Gate.SCHEMA, p, rejection=refusal)
            else:
                d = Decision(
                    src,
                    Outcome.ROUTED,
                    Gate.ROUTE,
                    p,
                    contract_name=resolved.name,
                    contract_version=resolved.version,
                    side_effect_class=resolved.side_effect_class,
                    call=_route(p, resolved, now_ms),
                    warnings=warnings,
                )
        d.decided_at_ms = now_ms
    d.latency_ms = (time.perf_counter() - started) * 1000
    return d


class Foundation(Timed):
    def decide_batch(self, records: list[Message]) -> list[Decision]:
        self.started()
        return [foundation_decide(source_record(m), self.contracts, self.limits) for m in records]


class Passthrough(Timed):
    def decide_batch(self, records: list[Message]) -> list[Decision]:
        self.started()
        return []

    def encode_batch(self, records: list[Message], decisions: list[Decision]) -> list[Output]:
        topic = self.settings.topics.observations
        return [(topic, m.key(), m.value(), None) for m in records]


def run_loop(processor: Timed) -> dict[str, Any]:
    threading.Thread(target=processor.watch, daemon=True).start()
    processor.run()
    first, last = processor.first, processor.last
    assert first is not None and last is not None
    return spent(first, last, processor.records_committed, processor.loop_cpu_last - first.thread)


def run_naive(settings: Settings, count: int) -> dict[str, Any]:
    contracts = load_contracts(settings.contracts_dir)
    validators = {n: Draft202012Validator(v[0].input_schema) for n, v in contracts.by_name.items()}
    obs_codec = codec("observation")
    consumer = Consumer(consumer_config(settings))
    producer = Producer(producer_config(settings))
    producer.init_transactions(30)
    consumer.subscribe([settings.topics.proposals])
    done, first, last = 0, None, Clocks()
    while done < count:
        msgs = consumer.consume(1, 0.5)
        if not msgs or msgs[0].error() is not None:
            continue
        m = msgs[0]
        if first is None:
            first = Clocks()
        try:
            env = orjson.loads(m.value() or b"")
            v = validators.get(env["tool"]["name"])
            errors = [e.message for e in v.iter_errors(env["arguments"])] if v else ["unknown tool"]
        except Exception as exc:
            env, errors = {"proposal_id": "?", "run_id": "?"}, [str(exc)]
        producer.begin_transaction()
        producer.produce(
            settings.topics.observations,
            key=m.key(),
            value=obs_codec.encode(_naive_observation(env, errors)),
        )
        producer.send_offsets_to_transaction(
            next_offsets([m]),
            consumer.consumer_group_metadata(),
        )
        producer.commit_transaction()
        done += 1
        last = Clocks()
    consumer.close()
    assert first is not None
    return spent(first, last, done, last.thread - first.thread)


def _naive_observation(env: dict[str, Any], errors: list[str]) -> dict[str, Any]:
    ok = not errors
    return {
        "observation_id": str(env.get("proposal_id")),
        "proposal_id": str(env.get("proposal_id")),
        "run_id": str(env.get("run_id")),
        "tenant_id": env.get("tenant_id"),
        "decision": "ROUTED" if ok else "REJECTED",
        "gate": "schema",
        "tool_identity": {"name": "", "version": None, "call_id": "", "side_effect_class": None},
        "execution_metadata": {
            "timestamp": 0,
            "latency_ms": 0.0,
            "idempotency_hit": False,
            "idempotency_key": None,
            "trace_id": "",
            "attempt_number": 1,
            "source_partition": 0,
            "source_offset": 0,
        },
        "status": {
            "code": 200 if ok else 422,
            "is_error": not ok,
            "taxonomy_class": "SUCCESS" if ok else "OUT_OF_BOUNDS",
            "retryable": False,
            "repairable": not ok,
            "requires_approval": False,
            "fail_closed": False,
            "escalate": False,
        },
        "result_payload": {
            "data": None,
            "errors": [
                {
                    "field": None,
                    "message": e,
                    "code": "x",
                    "expected": None,
                    "actual": None,
                    "hint": None,
                }
                for e in errors
            ],
            "warnings": [],
        },
        "verification": {
            "post_action_verification_required": False,
            "target_state_reference": None,
            "expected_state": None,
            "delay_seconds": 0,
        },
        "next_action": "",
        "allowed_tools": [],
        "contract_set": None,
        "approval_request_id": None,
        "retry_after_ms": None,
    }


def main() -> None:
    mode, count = sys.argv[1], int(sys.argv[2])
    if "--log" in sys.argv[3:]:  # as ``toolsentry run`` logs (the latency run waits for it)
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    settings = Settings()
    if mode == "naive":
        result = run_naive(settings, count)
    else:
        cls = {"passthrough": Passthrough, "foundation": Foundation, "toolsentry": Timed}[mode]
        result = run_loop(cls(settings, count))
    print(orjson.dumps({"mode": mode, **result}).decode(), flush=True)


if __name__ == "__main__":
    main()
