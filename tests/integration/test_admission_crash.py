"""Admission survives crashes: a processor SIGKILLed again and again decides exactly as
one that never crashed, and moves no counter twice.

Three tenants propose a few thousand calls under tight budgets (their own, from
``budgets.tenants``): valid calls; the same call again under its derived key (in
flight) and under a new logical operation (the loop guard); an explicit idempotency
key again with the same payload (in flight) and with another (signature mismatch);
invalid calls (repairs, the same invalid call twice); more of them per run than the
step cap, the class budgets and the run cost cap allow. Every tool is READ_ONLY,
LOW_RISK_INTERNAL or MEDIUM_RISK_WRITE, names no reference entity and needs no
approval, so admission state alone decides what the gates do not.

All of it is produced first. One processor decides it with fault points armed
(``after_redis``: the batch's verdicts are in Redis, nothing produced;
``before_commit``: outputs produced, transaction open; the processor names the point
on stderr as it dies) and is also SIGKILLed by the test at random moments, and once
more while idle after its last commit; it is restarted every time, until each cause
has killed it ``QUOTA`` times, then the rest is decided with the faults off. The same
proposals go into a second namespace (topics, group and Redis keys of its own),
decided alongside by one processor that is never disturbed. Then, read with
read_committed: every proposal has exactly one observation, the same in both
(decision, gate, taxonomy class, error codes, attempt, key); every run's counters,
every tenant's day cost and every idempotency record are the same in both Redis
namespaces; no idempotency key was routed twice; and only the last batch's replay
markers are left: those a crash left behind are dropped when the partition is next
assigned.

What would differ between two runs for reasons that are not crashes is kept out:
rate limits are GCRA, a function of the wall clock (``rate_limit_scale`` makes them
never bite); the tenant day cap is shared by runs on different partitions, whose
interleaving is not the same twice (it is set too high to bite; the day cost is still
compared, as a sum); an in-flight key would become retryable once its deadline and
grace pass, a wall-clock matter (the grace is an hour). Explicit idempotency keys
are per run, so one run's proposals, in order on one partition, decide its keys.
"""

from __future__ import annotations

import math
import random
import re
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import orjson
import pytest

from processor.codec.avro import codec
from processor.config import Settings
from processor.state.admission import AdmissionStore
from processor.state.connection import connect
from tests.integration.harness import (
    GroupLag,
    ProcessorProcess,
    isolated,
    observations,
    policy_with_budgets,
    produce_at_rate,
    read_all,
    token,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TENANTS = ("crash-a", "crash-b", "crash-c")
RUNS_PER_TENANT = 40
FAULTS = "after_redis:0.16,before_commit:0.16"
"""A batch passes ``after_redis`` each time it is decided and ``before_commit`` each time it
commits: measured, a life passes the first only about 1.3 times as often as the second
(not twice), so equal odds make both causes reach their quota at about the same pace, long
before the input runs out. (With ``after_redis`` at half the odds it came last in most
runs, needed about half of the input on average and once more than 90 % of it; the input
running out first fails the test as surely as a counter moved twice.)"""
BATCH = 40
"""Records per transaction at most: many small batches, so the fault points fire often."""
KILLED, IDLE = "killed by the test", "killed by the test, idle"
CAUSES = ("after_redis", "before_commit", KILLED)
QUOTA = 4
"""Deaths of each cause after which the rest is decided with the fault points off."""
BUDGETS: dict[str, Any] = {
    "steps": 12,
    "classes": {"read": 6, "write": 2, "external": 0, "financial": 0, "critical": 0},
    "run_cost": 0.03,
    "day_cost": 1000.0,
    "repeats": 2,
    "repairs": 2,
    "rate_limit_scale": 1_000_000,
    "in_flight_grace_ms": 3_600_000,
    "tenants": {
        "crash-b": {"steps": 16, "classes": {"read": 8, "write": 3}, "run_cost": 0.05,
                    "repeats": 1, "repairs": 3},
        "crash-c": {"steps": 10, "classes": {"read": 4, "write": 1}, "run_cost": 0.02,
                    "repairs": 1},
    },
}  # fmt: skip
STORY = (
    "The customer ordered a sofa three weeks ago. It arrived with a torn cover and a "
    "broken leg, the courier left it outside in the rain, and two earlier emails asking "
    "for a replacement went unanswered. They now ask for a refund instead."
)


def _fresh(tool: str, n: int) -> dict[str, Any]:
    """Valid arguments of ``tool``, different for every ``n``."""
    if tool == "search_kb":  # read, 0.001
        return {"query": f"return policy {n}", "limit": 5}
    if tool == "summarise":  # read, 0.01
        return {"text": f"{STORY} Case {n}.", "max_words": 60, "style": "paragraph"}
    if tool == "score_sentiment":  # read, 0.0005
        return {"text": f"My parcel {n} is late again and nobody answers."}
    if tool == "create_ticket":  # write (MEDIUM_RISK_WRITE)
        summary = f"Parcel {n} arrived damaged; the customer wants a replacement."
        return {"customer_id": f"CUS-{n:06d}", "category": "delivery", "priority": "normal",
                "summary": summary}  # fmt: skip
    assert tool == "escalate"  # write (LOW_RISK_INTERNAL)
    summary = f"The same failure for the {n}th time today; the customer is upset."
    return {"severity": "high", "reason_code": "repeated_failure", "summary": summary}


FRESH_TOOLS = ("search_kb", "summarise", "score_sentiment", "create_ticket", "escalate")
INVALID: tuple[tuple[str, dict[str, Any]], ...] = (
    ("search_kb", {"query": "return policy", "limit": "10"}),
    ("search_kb", {"query": "x"}),
    ("create_ticket", {"customer_id": "CUS-000001", "category": "delivery", "priority": "asap",
                       "summary": "Parcel arrived crushed; a replacement is wanted."}),
    ("no_such_tool", {}),
)  # fmt: skip
KINDS = ("fresh", "retry", "repeat", "same_key", "other_payload", "invalid")


@dataclass(frozen=True)
class Proposal:
    pid: str
    tenant: str
    run: str
    key: bytes
    value: bytes


def _run(rng: random.Random, tenant: str, run: str, principal: str) -> list[Proposal]:
    """One agent run: fresh calls, then more and more repeats, retries and mistakes."""
    made: list[tuple[str, dict[str, Any], dict[str, str]]] = []
    """Earlier calls: tool, arguments, envelope extras (an idempotency key, an operation)."""
    keyed: list[tuple[str, dict[str, Any], str]] = []
    out = []
    for step in range(rng.randint(18, 26)):
        kind = rng.choices(KINDS, (10, 2, 3, 1.5, 1.5, 2))[0] if made else "fresh"
        if kind == "retry":  # the same envelope again: the same (derived or explicit) key
            tool, args, extra = rng.choice(made)
        elif kind == "repeat":  # the same call as a new operation: a new key, the same signature
            tool, args, _ = rng.choice(made)
            extra = {"logical_operation_id": f"op-{step}"}
        elif kind in ("same_key", "other_payload") and keyed:
            tool, args, ikey = rng.choice(keyed)
            if kind == "other_payload":
                args = _fresh(tool, 10_000 + step)
            extra = {"idempotency_key": ikey}
        elif kind == "invalid":
            tool, args = rng.choice(INVALID)
            extra = {}
        else:
            tool = rng.choices(FRESH_TOOLS, (3, 2, 1, 1.5, 1))[0]
            args, extra = _fresh(tool, step), {}
            if rng.random() < 0.3:
                extra = {"idempotency_key": f"{run}-key-{step}"}
                keyed.append((tool, args, extra["idempotency_key"]))
            made.append((tool, args, extra))
        pid = f"{run}-{step}"
        env = {"proposal_id": pid, "tenant_id": tenant, "run_id": run, "tool": {"name": tool},
               "arguments": args, "principal_token": principal, **extra}  # fmt: skip
        out.append(Proposal(pid, tenant, run, run.encode(), orjson.dumps(env)))
    return out


def _corpus(settings: Settings) -> list[Proposal]:
    rng = random.Random(20261122)
    principals = {t: token(settings, t, ttl_s=3600) for t in TENANTS}
    corpus = [
        p
        for r in range(RUNS_PER_TENANT)
        for t in TENANTS
        for p in _run(rng, t, f"{t}-run-{r}", principals[t])
    ]
    sentinels = [
        Proposal(f"{t}-sentinel", t, f"{t}-sentinel", f"{t}-sentinel".encode(), orjson.dumps({
            "proposal_id": f"{t}-sentinel", "tenant_id": t, "run_id": f"{t}-sentinel",
            "tool": {"name": "search_kb"}, "arguments": _fresh("search_kb", 0),
            "principal_token": principals[t]}))
        for t in TENANTS
    ]  # fmt: skip
    return corpus + sentinels


def _produce(settings: Settings, proposals: list[Proposal]) -> None:
    produce_at_rate(settings, TENANTS[0], [(p.key, p.value) for p in proposals], math.inf)


def _drain(
    settings: Settings, proc: ProcessorProcess, lag: GroupLag, sentinels: list[Proposal]
) -> None:
    """Until every proposal is decided; then the sentinels, one per tenant, after all of
    it: their batch is the last, so only its replay markers may be left behind."""
    deadline = time.monotonic() + 120
    while lag() > 0:
        assert proc.alive() and time.monotonic() < deadline, proc.log()[-3000:]
        time.sleep(0.2)
    _produce(settings, sentinels)
    while lag() > 0:
        assert proc.alive() and time.monotonic() < deadline, proc.log()[-3000:]
        time.sleep(0.2)


def _crash_loop(
    chaotic: ProcessorProcess, calm: ProcessorProcess, sentinels: list[Proposal], seed: int
) -> Counter[str]:
    """Start, let it die at a fault point or kill it at a random moment, start again,
    until every proposal is decided. Returns the deaths by cause.

    ``chaotic`` has the fault points armed; once both fault points have killed it
    ``QUOTA`` times, ``calm`` (the same instance, faults off) decides the rest: the count
    of deaths, and the wall time, stay bounded. The test's own kills go on, every life,
    until they too reach ``QUOTA`` (a life that dies at a fault point first, as most do
    while they are armed, leaves them behind), idle if the input has run out. Once
    everything is decided it is killed once more, idle: the moment a crash is most likely
    in production, just after a commit and before the next batch."""
    rng = random.Random(seed)
    settings = chaotic.settings
    lag = GroupLag(settings)
    deaths: Counter[str] = Counter()
    sentinels_sent = False
    # A liveness bound only: a life costs a process start and a group join, 1-2 s on an
    # idle host and up to 8 s on a loaded one, and the lives needed are random.
    deadline = time.monotonic() + 600
    while True:
        assert time.monotonic() < deadline, f"not done in time: {deaths}"
        faults_met = all(deaths[cause] >= QUOTA for cause in CAUSES if cause != KILLED)
        to_kill = deaths[KILLED] < QUOTA
        proc = calm if faults_met else chaotic
        proc.start().wait_ready()
        kill_at = math.inf
        if to_kill and (faults_met or rng.random() < 0.6):
            kill_at = time.monotonic() + rng.uniform(0.02, 0.4)
        killed_idle = False
        while proc.alive() and time.monotonic() < kill_at:
            if lag() == 0:
                if sentinels_sent:
                    assert proc.terminate() == 0, proc.log()[-3000:]
                    return deaths
                if not deaths[IDLE]:
                    killed_idle = True
                    break
                if to_kill:
                    if kill_at == math.inf:
                        kill_at = time.monotonic() + rng.uniform(0.02, 0.4)
                else:
                    _produce(settings, sentinels)
                    sentinels_sent = True
            time.sleep(0.05)
        proc.kill()  # a no-op when it died on its own
        fault = re.search(r"fault point (\w+): SIGKILL", proc.life_log())
        assert proc.returncode == -9, proc.life_log()[-3000:]
        deaths[fault.group(1) if fault else IDLE if killed_idle else KILLED] += 1


@dataclass(frozen=True)
class Outcome:
    """What an observation says, less what depends on the clock or the input position."""

    decision: str
    gate: str
    taxonomy: str
    codes: tuple[str, ...]
    attempt: int
    idempotency_key: str | None
    idempotency_hit: bool


def _outcomes(settings: Settings, expect: int) -> tuple[dict[str, Outcome], Counter[str]]:
    """Each proposal's outcome, and how many observations each has."""
    outcomes: dict[str, Outcome] = {}
    count: Counter[str] = Counter()
    for o in observations(settings, timeout=120, idle=2, expect=expect):
        meta = o["execution_metadata"]
        count[o["proposal_id"]] += 1
        outcomes[o["proposal_id"]] = Outcome(
            o["decision"], o["gate"], o["status"]["taxonomy_class"],
            tuple(e["code"] for e in o["result_payload"]["errors"]),
            meta["attempt_number"], meta["idempotency_key"], meta["idempotency_hit"],
        )  # fmt: skip
    return outcomes, count


RECORD_FIELDS = ("state", "hash", "attempt", "call", "run", "awaiting")
"""An idempotency record less its deadline, the decision's clock plus the tool's timeout."""


@dataclass
class AdmissionState:
    runs: dict[tuple[str, str], dict[str, float]]
    day_cost: dict[str, float]
    records: dict[tuple[str, str], dict[str, str]]
    markers: dict[str, set[str]]


def _admission_state(
    settings: Settings, runs: set[tuple[str, str]], keys: set[tuple[str, str]]
) -> AdmissionState:
    """What admission keeps in Redis for these runs and (tenant, idempotency key)s, read
    through the store's own accessors; and every tenant's replay markers."""
    client = connect(settings.redis_url)
    store = AdmissionStore(client, settings.redis_namespace)
    records = {}
    for t, key in keys:
        record = store.record(t, key)
        records[(t, key)] = {f: record[f] for f in RECORD_FIELDS if f in record}
    day_cost: dict[str, float] = {}
    markers: dict[str, set[str]] = {}
    for t in TENANTS:
        base = f"{settings.redis_namespace}:{{{t}}}"
        # summed over the days it spans, should the test cross midnight UTC
        days = [k.decode().rpartition(":")[2] for k in client.scan_iter(match=f"{base}:day:*")]
        day_cost[t] = sum(store.day_cost(t, d) for d in days)
        markers[t] = {k.decode() for k in client.hkeys(f"{base}:done")}
    return AdmissionState(
        {(t, r): store.run_counters(t, r) for t, r in runs}, day_cost, records, markers
    )


@dataclass
class Scenario:
    """The crashed and the clean run, decided and read back."""

    proposals: list[Proposal]
    deaths: Counter[str]
    crashed: Settings
    clean: Settings
    sentinel_positions: set[str]
    """Input positions of the last batch's proposals: the only markers allowed to stay."""


@pytest.fixture(scope="module")
def scenario(stack_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Scenario:
    """Both runs, once for the module's tests. The undisturbed one decides alongside the
    crashing one (its own topics, group and Redis keys), to save wall time."""
    started = time.monotonic()
    logs = tmp_path_factory.mktemp("admission-crash")
    policy = policy_with_budgets(logs / "policy.yaml", BUDGETS)
    stamp = time.time_ns()
    crashed, clean = (
        isolated(stack_settings, f"adm-{name}-{stamp}").model_copy(update={"policy_file": policy})
        for name in ("crash", "clean")
    )
    proposals = _corpus(crashed)
    corpus, sentinels = proposals[: -len(TENANTS)], proposals[-len(TENANTS) :]
    _produce(crashed, corpus)
    _produce(clean, corpus)
    undisturbed = ProcessorProcess(clean, "adm-clean-1", logs).start()
    batch = str(BATCH)
    chaotic = ProcessorProcess(
        crashed, "adm-crash-1", logs, TOOLSENTRY_FAULT_POINT=FAULTS,
        TOOLSENTRY_BATCH_MAX_RECORDS=batch,
    )  # fmt: skip
    calm = ProcessorProcess(crashed, "adm-crash-1", logs, TOOLSENTRY_BATCH_MAX_RECORDS=batch)
    try:
        deaths = _crash_loop(chaotic, calm, sentinels, seed=7)
        undisturbed.wait_ready()
        _drain(clean, undisturbed, GroupLag(clean), sentinels)
        assert undisturbed.terminate() == 0, undisturbed.log()[-3000:]
    finally:
        chaotic.kill()
        calm.kill()
        undisturbed.kill()
    print(f"\ndeaths {dict(deaths)}; {len(proposals)} proposals; "
          f"{time.monotonic() - started:.0f} s to decide both runs")  # fmt: skip
    # (every record, however long the broker takes to answer: an idle period alone
    # would end the read early on a loaded host and miss sentinels)
    positions = {
        f"{crashed.topics.proposals}/{m.partition()}/{m.offset()}"
        for m in read_all(crashed, crashed.topics.proposals, idle=1, expect=len(proposals))
        if m.key() is not None and m.key().endswith(b"-sentinel")
    }
    return Scenario(proposals, deaths, crashed, clean, positions)


def test_a_crashing_processor_admits_as_one_that_never_crashed(scenario: Scenario) -> None:
    proposals, deaths, crashed, clean = (
        scenario.proposals, scenario.deaths, scenario.crashed, scenario.clean
    )  # fmt: skip
    assert all(deaths[cause] >= QUOTA for cause in CAUSES) and deaths[IDLE] == 1, deaths
    assert sum(deaths.values()) >= 10, deaths

    got, count = _outcomes(crashed, len(proposals))
    want, clean_count = _outcomes(clean, len(proposals))
    ids = {p.pid for p in proposals}
    assert set(count) == ids and set(count.values()) == {1}, "a proposal lost or answered twice"
    assert set(clean_count) == ids and set(clean_count.values()) == {1}
    differ = {pid: (got[pid], want[pid]) for pid in ids if got[pid] != want[pid]}
    assert not differ, f"{len(differ)} decided otherwise, e.g. {list(differ.items())[:3]}"

    # The corpus exercises what it claims to (else equality would prove little).
    codes = Counter(c for o in want.values() for c in o.codes)
    for code in ("step_cap", "class_budget", "run_cost_cap", "repeated_call",
                 "idempotency_in_flight", "idempotency_key_reused", "repair_loop"):  # fmt: skip
        assert codes[code] > 0, f"no proposal was refused with {code}: {codes}"
    assert sum(o.decision == "ROUTED" for o in want.values()) > len(proposals) // 5

    # Routed at most once per idempotency key, and each routed call exactly once. (At
    # least as many calls as routed decisions are waited for, then 2 s more for any
    # extra: an idle period alone would end the read early on a loaded host.)
    routed = {pid for pid, o in got.items() if o.decision == "ROUTED"}
    execs = [f"{crashed.topics.prefix}exec.{s}"
             for s in ("read_only", "low_risk_internal", "medium_risk_write")]  # fmt: skip
    calls = [codec("approved_call").decode(m.value())
             for m in read_all(crashed, execs, idle=2, expect=len(routed))]  # fmt: skip
    per_key = Counter(c["idempotency_key"] for c in calls)
    assert max(per_key.values()) == 1, [k for k, n in per_key.items() if n > 1][:5]
    assert Counter(c["proposal_id"] for c in calls) == Counter(routed)

    runs = {(p.tenant, p.run) for p in proposals}
    tenant_of = {p.pid: p.tenant for p in proposals}
    keys = {(tenant_of[pid], o.idempotency_key) for outcomes in (got, want)
            for pid, o in outcomes.items() if o.idempotency_key}  # fmt: skip
    after, before = _admission_state(crashed, runs, keys), _admission_state(clean, runs, keys)
    assert after.runs == before.runs, "a run's counters moved twice (or not at all)"
    assert after.day_cost == pytest.approx(before.day_cost, abs=1e-9)
    assert after.day_cost[TENANTS[0]] > 0
    assert after.records == before.records
    assert sum(r.get("state") == "PENDING" for r in after.records.values()) == len(routed)
    # Undisturbed, only the last batch's markers stay (the sentinels', one per tenant);
    # test_no_replay_marker_outlives_a_crash asks the same of the crashed run.
    left = [m for t in before.markers.values() for m in t]
    assert len(left) <= len(TENANTS), left


def test_no_replay_marker_outlives_a_crash(scenario: Scenario) -> None:
    """Memory stays flat: once the sentinels' batch, the last, has committed, the only
    markers left are its own, however the earlier lives ended."""
    markers = _admission_state(scenario.crashed, set(), set()).markers
    leaked = {t: sorted(m - scenario.sentinel_positions) for t, m in markers.items()}
    leaked = {t: m for t, m in leaked.items() if m}
    assert not leaked, f"markers of committed batches left behind ({scenario.deaths}): {leaked}"
