"""Admission against a real redis-server and a real 3-master Redis Cluster: every budget
and limit at its boundary, every idempotency state transition, replays after an aborted
transaction, and racing processors."""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from bench.admission import calls as bench_calls
from processor.config import Settings
from processor.state.admission import (
    AdmissionStore,
    Item,
    Verdict,
    _segments,
    call_item,
    comp_failed_item,
    held_record,
    lapse_item,
    parse_verdict,
    rate_of,
    void_item,
    withdraw_item,
)
from processor.state.connection import connect, is_script_error
from tests.integration.harness import RedisServer

pytestmark = pytest.mark.integration

DAY_MS = 86_400_000
NOW = (int(time.time() * 1000) // DAY_MS + 1) * DAY_MS + DAY_MS // 2
"""Noon tomorrow (UTC). The store sets its hashes to expire at the end of the day of
``now`` (Redis's own clock decides when): a fixed date would have them expire on write
once that day had passed, and every test here would fail from then on."""
TENANT = "acme"


@pytest.fixture
def store(redis_backend: str) -> Iterator[AdmissionStore]:
    yield AdmissionStore(connect(redis_backend), f"adm-{uuid.uuid4().hex[:8]}")


_pos = iter(range(10**9))


Sent = tuple[str, Item]
"""An item as the tests send it: its kind and its fields."""


def call(**kw: Any) -> tuple[str, Item]:
    """A call with generous limits unless told otherwise; its own key and signature."""
    fields: dict[str, Any] = {
        "pos": f"t/0/{next(_pos)}", "run": "run-1", "tool": "search_kb", "group": "read",
        "cost": 0.0, "sig": uuid.uuid4().hex, "now": NOW, "rate": None, "steps": 1000,
        "class_budget": 1000, "cost_cap": 1e9, "day_cap": None, "day": "20270115",
        "repeats": 1000, "ikey": uuid.uuid4().hex, "hash": "h1", "call": uuid.uuid4().hex,
        "deadline": NOW + 8000, "grace": 1000, "ttl": 3_600_000, "park": False, "grant": "",
        "exempt": False,
    }  # fmt: skip
    tenant = kw.pop("tenant", TENANT)
    fields.update(kw)
    return tenant, call_item(**fields)


def step(sig: str = "bad", repair: bool = True, **kw: Any) -> tuple[str, Item]:
    item = {"kind": "step", "pos": f"t/0/{next(_pos)}", "now": NOW, "run": "run-1", "sig": sig,
            "steps": 1000, "repair": repair, "max_repairs": 3}  # fmt: skip
    item.update(kw)
    return TENANT, item


def result(
    of: tuple[str, Item], state: str = "COMPLETED", result_id: str | None = None, **kw: Any
) -> tuple[str, Item]:
    tenant, c = of
    item = {"kind": "result", "pos": f"r/0/{next(_pos)}", "now": NOW, "ikey": c["ikey"],
            "call": c["call"], "tool": c["tool"], "hash": c["hash"], "run": c["run"],
            "version": c.get("version"),
            "result_id": result_id or uuid.uuid4().hex, "state": state,
            "cached": orjson.dumps({"class": "SUCCESS", "data": '{"n":1}'}).decode(),
            "ttl": 3_600_000, "compensation_key": None, "compensation_hash": None,
            "compensates": None}  # fmt: skip
    item.update(kw)
    if item.get("committed") and "record" not in item:
        # (as the processor sends a failure after committed steps: its record, kept should
        # it be held)
        item["record"] = held_record(
            "r", 0, next(_pos), None, f"result {item['result_id']}".encode()
        )
    return tenant, item


def whys(verdicts: list[Verdict]) -> list[str | None]:
    return [None if v.get("ok") else v.get("why") for v in verdicts]


# -- budgets and limits ------------------------------------------------------------------------


def test_the_nth_step_is_allowed_and_the_next_refused(store: AdmissionStore) -> None:
    verdicts = store.apply([call(steps=12) for _ in range(13)])
    assert whys(verdicts) == [None] * 12 + ["step_cap"]
    assert store.run_counters(TENANT, "run-1", NOW)["steps"] == 13  # refused proposals count too
    # A refused proposal of the same run is a step as well, and is stopped at the cap.
    assert whys(store.apply([step(repair=False, steps=12)])) == ["step_cap"]


def test_the_hand_off_is_never_refused_for_steps_or_budgets(store: AdmissionStore) -> None:
    spent = store.apply([call(steps=2, class_budget=1, group="write") for _ in range(3)])
    assert whys(spent) == [None, "class_budget", "step_cap"]
    handoff = store.apply([call(steps=2, class_budget=1, group="write", tool="handoff_to_human",
                                exempt=True, cost=1.0, cost_cap=0.5)])  # fmt: skip
    assert whys(handoff) == [None]


def test_class_budgets_and_a_zero_budget(store: AdmissionStore) -> None:
    writes = store.apply([call(group="write", class_budget=5) for _ in range(6)])
    assert whys(writes) == [None] * 5 + ["class_budget"]
    assert whys(store.apply([call(group="critical", class_budget=0)])) == ["class_budget"]
    reads = store.apply([call(group="read", class_budget=30) for _ in range(3)])
    assert whys(reads) == [None] * 3  # another group's budget is its own


def test_the_cost_caps_count_what_was_allowed(store: AdmissionStore) -> None:
    verdicts = store.apply([call(cost=4.0, cost_cap=10.0) for _ in range(3)])
    assert whys(verdicts) == [None, None, "cost_cap"]
    assert store.run_counters(TENANT, "run-1", NOW)["cost"] == 8.0
    # The tenant's day: across runs, per tenant, per day.
    day = [call(run=f"d{i}", cost=3.0, day_cap=10.0, day="20270116") for i in range(4)]
    assert whys(store.apply(day)) == [None, None, None, "day_cost_cap"]
    assert store.day_cost(TENANT, "20270116") == 9.0
    assert whys(store.apply([call(run="d9", cost=3.0, day_cap=10.0, day="20270117")])) == [None]
    other = call(tenant="globex", run="d0", cost=3.0, day_cap=10.0, day="20270116")
    assert whys(store.apply([other])) == [None]


def test_the_third_identical_call_of_a_run_is_a_loop(store: AdmissionStore) -> None:
    same = [call(sig="cancel_order:abc", repeats=2) for _ in range(3)]
    assert whys(store.apply(same)) == [None, None, "loop"]
    assert whys(store.apply([call(sig="cancel_order:other", repeats=2)])) == [None]
    assert whys(store.apply([call(sig="cancel_order:abc", run="run-2", repeats=2)])) == [None]


def test_a_repair_loop_and_the_repair_cap(store: AdmissionStore) -> None:
    assert whys(store.apply([step("bad-1"), step("bad-1")])) == [None, "repair_loop"]
    assert whys(store.apply([step("bad-2", run="r2"), step("bad-3", run="r2"),
                             step("bad-4", run="r2"), step("bad-5", run="r2")])) == [
        None, None, None, "repair_cap"]  # fmt: skip
    # Refusals that are not repairs (policy, identity) only count as steps.
    assert whys(store.apply([step("p", repair=False, run="r3") for _ in range(5)])) == [None] * 5
    assert store.run_counters(TENANT, "r3", NOW) == {"steps": 5.0}


def test_a_run_out_of_repairs_counts_no_more_of_them(store: AdmissionStore) -> None:
    """Past the repair cap or the step cap every repair is refused, and nothing more is
    counted: a looping agent's run stays a few counters, however long it loops."""
    spam = [step(f"bad-{i}", run="r4") for i in range(50)]
    verdicts = whys(store.apply(spam))
    assert verdicts == [None, None, None] + ["repair_cap"] * 47
    counters = store.run_counters(TENANT, "r4", NOW)
    assert counters == {"steps": 50.0, "repairs": 3.0, "bad:bad-0": 1.0, "bad:bad-1": 1.0,
                        "bad:bad-2": 1.0}  # fmt: skip
    again = whys(store.apply([step("bad-1", run="r4"), step("bad-9", run="r4")]))
    assert again == ["repair_loop", "repair_cap"]  # still told apart where it was counted
    capped = [step(f"x-{i}", run="r5", steps=2) for i in range(5)]
    assert whys(store.apply(capped)) == [None, None] + ["step_cap"] * 3
    assert store.run_counters(TENANT, "r5", NOW)["repairs"] == 2


def test_gcra_allows_a_burst_then_one_per_interval(store: AdmissionStore) -> None:
    rate = rate_of(window_sec=60, max_requests=30)
    assert rate == (2000, 30)
    burst = store.apply([call(rate=rate, tool="send_email") for _ in range(31)])
    assert whys(burst) == [None] * 30 + ["rate_limited"]
    assert burst[-1]["retry_after_ms"] == 2000
    later = store.apply([call(rate=rate, tool="send_email", now=NOW + 1999)])
    assert whys(later) == ["rate_limited"] and later[0]["retry_after_ms"] == 1
    assert whys(store.apply([call(rate=rate, tool="send_email", now=NOW + 2000)])) == [None]
    assert whys(store.apply([call(rate=rate, tool="search_kb")])) == [None]  # per tool


def test_a_replayed_batch_gets_the_same_verdicts_and_counts_nothing_twice(
    store: AdmissionStore,
) -> None:
    key = call()[1]["ikey"]
    batch = [call(steps=3, sig="same", ikey=key) for _ in range(2)] + [call(steps=3), call(steps=3)]
    first = store.apply(batch)
    counters = store.run_counters(TENANT, "run-1", NOW)
    record = store.record(TENANT, key, NOW)
    assert store.apply(batch) == first  # the transaction aborted; the batch comes again
    assert store.apply(list(reversed(batch))) == list(reversed(first))
    assert store.run_counters(TENANT, "run-1", NOW) == counters
    assert store.record(TENANT, key, NOW) == record
    done = f"{store.ns}:{{{TENANT}}}:done"
    assert store.client.hlen(done) == len(batch)
    # Committed: the markers go with the next batch's round trip, so memory stays flat.
    store.apply([call()], forget=batch)
    assert store.client.hlen(done) == 1


def test_a_position_decided_again_as_another_kind_of_item_is_not_let_through(
    store: AdmissionStore,
) -> None:
    # First a gate refused the proposal (a step); its transaction aborted, and decided
    # again it passes every gate (reference data arrived meanwhile). The refusal's "ok"
    # must not become the call's: it would go with no idempotency record and no charge.
    refused = step(repair=False)
    [first] = store.apply([refused])
    assert first == {"ok": True}
    counters = store.run_counters(TENANT, "run-1", NOW)
    now_a_call = call(pos=refused[1]["pos"])
    assert whys(store.apply([now_a_call])) == ["replay_changed"]
    assert store.record(TENANT, now_a_call[1]["ikey"], NOW) == {}
    assert store.run_counters(TENANT, "run-1", NOW) == counters
    assert store.apply([refused]) == [first]  # the same kind gets its verdict again


TIGHT = {"group": "write", "class_budget": 1, "cost": 2.0, "cost_cap": 2.0, "day_cap": 100.0,
         "rate": (60_000, 1), "repeats": 1, "approvals": ["appr-1"],
         "approvals_ttl": 3_600_000}  # fmt: skip
"""Limits one call uses up: a second is refused by each of them unless the first gives back."""


@pytest.mark.parametrize("change", ["key", "payload", "tool", "version", "parked", "refused"])
def test_a_call_decided_again_as_something_else_gives_back_what_it_took_once(
    store: AdmissionStore, change: str
) -> None:
    # A call was admitted; its transaction aborted, and decided again (contracts or
    # policy reloaded meanwhile) the same record is something else: another version's
    # derived key, another payload, tool or version of the tool under the caller's own
    # key (its record would name a version it does not run as, and its result be
    # refused), a call that now waits for approval, or a proposal a gate now refuses.
    # The first call's "ok" must not route it (it would run with no record of its own,
    # or stay parked under a record that waits for no approval). The first call never
    # ran: its record, budgets, day's cost, rate and approval are given back, once, and
    # only its step stays counted.
    run = f"run-{change}"
    tool = "charge_tight"
    day_before = store.day_cost(TENANT, "20270115")
    first = call(run=run, tool=tool, version="2.0.0", **TIGHT)
    assert store.apply([first]) == [{"ok": True, "attempt": 1}]
    taken = store.run_counters(TENANT, run, NOW)
    assert taken == {"steps": 1, "class:write": 1, "cost": 2.0, f"sig:{first[1]['sig']}": 1}
    assert store.day_cost(TENANT, "20270115") == day_before + 2.0
    pos, key = first[1]["pos"], first[1]["ikey"]
    same = {"run": run, "ikey": key, "hash": "h1", "version": "2.0.0"}
    again = {
        "key": call(pos=pos, run=run, tool=tool, version="2.0.0"),
        "payload": call(pos=pos, run=run, tool=tool, ikey=key, hash="h2", version="2.0.0"),
        "tool": call(pos=pos, tool="lookup_order", **same),
        "version": call(pos=pos, tool=tool, **{**same, "version": "2.1.0"}),
        "parked": call(pos=pos, tool=tool, park=True, **same),
        "refused": step(pos=pos, run=run, repair=False),
    }[change]
    answer = None if change == "refused" else "replay_changed"
    for _ in range(2):  # given back once: a second replay gives back nothing more
        assert whys(store.apply([again])) == [answer]
        assert store.record(TENANT, key, NOW)["state"] == "FAILED_RETRYABLE"
        assert store.run_counters(TENANT, run, NOW) == {"steps": 1}
        assert store.day_cost(TENANT, "20270115") == day_before
    # The first call decided again at its old position is refused: it would go with its
    # record no longer waiting for it.
    assert whys(store.apply([first])) == ["replay_changed"]
    assert store.record(TENANT, key, NOW)["state"] == "FAILED_RETRYABLE"
    # Proposed again, the call goes, and takes what it took the first time: its approval,
    # budget, cost, loop-guard count and rate are its own again.
    retry = call(run=run, tool=tool, ikey=key, sig=first[1]["sig"], **TIGHT)
    assert store.apply([retry]) == [{"ok": True, "attempt": 2}]
    assert store.run_counters(TENANT, run, NOW) == {**taken, "steps": 2}
    assert store.day_cost(TENANT, "20270115") == day_before + 2.0
    # ... and nothing more: a second call is refused by the limits it used up.
    other = call(run=run, tool=tool, sig=first[1]["sig"], **{**TIGHT, "approvals": ["appr-9"]})
    assert whys(store.apply([other])) == ["loop"]


def test_a_call_marker_an_earlier_version_wrote_is_still_read(store: AdmissionStore) -> None:
    """An instance of the version before ("\\1<key>\\1<hash>\\1<tool>\\1<parked>\\1<verdict>",
    no record of what the call took) admitted a call and its transaction aborted: replayed
    as the same call it gets its verdict; as another, it is refused, and what the first
    took stays taken (its marker does not say); voided, its record becomes retryable."""
    first = call()
    pos, key, fields = first[1]["pos"], first[1]["ikey"], first[1]
    assert store.apply([first]) == [{"ok": True, "attempt": 1}]
    old = f"\x01{key}\x01{fields['hash']}\x01{fields['tool']}\x010\x01ok|1"
    store.client.hset(f"{store._base(TENANT)}:done", pos, old)
    assert store.apply([first]) == [{"ok": True, "attempt": 1}]
    taken = store.run_counters(TENANT, "run-1", NOW)
    assert whys(store.apply([call(pos=pos)])) == ["replay_changed"]
    assert store.run_counters(TENANT, "run-1", NOW) == taken
    assert store.record(TENANT, key, NOW)["state"] == "PENDING"
    void = void_item(fields)
    assert void is not None
    assert store.apply([(TENANT, void)]) == [{"status": "voided"}]
    assert store.record(TENANT, key, NOW)["state"] == "FAILED_RETRYABLE"
    assert store.run_counters(TENANT, "run-1", NOW) == taken


def test_an_approved_call_decided_again_as_another_waits_for_its_approval_again(
    store: AdmissionStore,
) -> None:
    """A parked call resubmitted with its approvals was charged when it was parked. If the
    resubmission's transaction aborts and it is decided again as something else, its record
    goes back to waiting for approval and its approvals are unspent; resubmitted again, it
    goes, still charged once."""
    parked = call(park=True, group="critical", class_budget=1, deadline=NOW + 600_000)
    key = parked[1]["ikey"]
    assert whys(store.apply([parked])) == [None]
    spend = {"approvals": ["appr-1"], "approvals_ttl": 3_600_000}
    resubmitted = call(ikey=key, group="critical", class_budget=1, **spend)
    assert whys(store.apply([resubmitted])) == [None]
    assert store.record(TENANT, key, NOW)["awaiting"] == "0"
    changed = call(pos=resubmitted[1]["pos"], ikey=key, hash="h2", group="critical",
                   class_budget=1, **spend)  # fmt: skip
    assert whys(store.apply([changed])) == ["replay_changed"]
    record = store.record(TENANT, key, NOW)
    assert (record["state"], record["awaiting"]) == ("PENDING", "1")
    assert store.run_counters(TENANT, "run-1", NOW)["class:critical"] == 1
    again = call(ikey=key, group="critical", class_budget=1, **spend)
    assert whys(store.apply([again])) == [None]
    assert store.run_counters(TENANT, "run-1", NOW)["class:critical"] == 1
    # The same when the resubmission fails alone on a defect (voided): it waits again.
    void = void_item(again[1])
    assert void is not None and store.apply([(TENANT, void)]) == [{"status": "voided"}]
    record = store.record(TENANT, key, NOW)
    assert (record["state"], record["awaiting"]) == ("PENDING", "1")
    # ... until the deadline it was parked until, in flight as before: proposed again
    # without its approvals, it is not parked a second time.
    assert record["deadline"] == str(NOW + 600_000)
    repark = call(ikey=key, park=True, group="critical", class_budget=1, now=NOW + 10_000)
    assert whys(store.apply([repark])) == ["in_flight"]
    last = call(ikey=key, group="critical", class_budget=1, **spend)
    assert whys(store.apply([last])) == [None]
    assert store.run_counters(TENANT, "run-1", NOW)["class:critical"] == 1


def test_a_script_that_fails_on_its_input_is_a_defect_not_redis_down(redis_backend: str) -> None:
    client = connect(redis_backend)
    with pytest.raises(redis.exceptions.ResponseError) as failed:
        client.eval("return nil .. 'x'", 1, "{acme}:k")
    assert is_script_error(failed.value)
    down = connect("redis://127.0.0.1:1/0", socket_connect_timeout=0.5)
    with pytest.raises(redis.exceptions.ConnectionError) as unreachable:
        down.ping()
    assert not is_script_error(unreachable.value)
    with pytest.raises(redis.exceptions.ResponseError) as wrong:
        client.execute_command("HGET", "{acme}:only-one-argument")
    assert not is_script_error(wrong.value)


def test_a_script_refused_by_redis_out_of_memory_is_redis_unwell_not_a_defect(
    stack_settings: Settings,
) -> None:
    """At maxmemory (noeviction) the script's first write is refused: Redis is unwell, and
    the processor must wait it out as an outage, not answer every proposal as a defect."""
    client = connect(stack_settings.redis_url)
    store = AdmissionStore(client, f"adm-{uuid.uuid4().hex[:8]}")
    saved = client.config_get("maxmemory")["maxmemory"]
    client.config_set("maxmemory", 1)
    try:
        with pytest.raises(redis.exceptions.ResponseError) as refused:
            store.apply([call()])
    finally:
        client.config_set("maxmemory", saved)
    assert isinstance(refused.value, redis.exceptions.OutOfMemoryError), refused.value
    assert not is_script_error(refused.value)
    assert whys(store.apply([call()])) == [None]


def test_tenant_ids_that_make_no_hash_tag_of_their_own_still_share_one_slot(
    store: AdmissionStore,
) -> None:
    """'}acme' would end its key's hash tag at once ('{}' tags nothing), and its keys would
    scatter over a cluster's slots: the script is refused there. Such a tenant is tagged by
    its digest, and each tenant still counts alone."""
    odd = ["}acme", "", "a}b", "#acme", "acme}"]
    verdicts = store.apply([call(tenant=t, run="r", steps=1) for t in odd])
    assert whys(verdicts) == [None] * len(odd)
    again = store.apply([call(tenant=t, run="r", steps=1) for t in odd])
    assert whys(again) == ["step_cap"] * len(odd)
    assert whys(store.apply([call(tenant="acme", run="r", steps=1)])) == [None]


def test_a_batch_longer_than_a_lua_stack_is_decided_whole(store: AdmissionStore) -> None:
    verdicts = store.apply([call(steps=2500, class_budget=5000) for _ in range(2600)])
    assert whys(verdicts) == [None] * 2500 + ["step_cap"] * 100


def test_batched_and_one_by_one_decide_alike(store: AdmissionStore) -> None:
    rate = rate_of(60, 10)
    keys = [uuid.uuid4().hex for _ in range(5)]
    batch = [call(run=f"r{i % 3}", rate=rate, steps=5, sig=f"s{i % 4}", repeats=2,
                  ikey=keys[i % 5], hash=f"h{i % 2}") for i in range(40)]  # fmt: skip
    other = AdmissionStore(store.client, store.ns + "-b")
    assert store.apply(batch) == other.apply_one_by_one(batch)


def test_two_processors_racing_never_exceed_a_limit(redis_backend: str) -> None:
    ns = f"adm-race-{uuid.uuid4().hex[:8]}"
    rate = rate_of(60, 50)
    shared_key = uuid.uuid4().hex

    def racer(name: str) -> tuple[int, int]:
        store = AdmissionStore(connect(redis_backend), ns)
        ok = won = 0
        for n in range(20):
            batch = [call(pos=f"{name}/{n}/{i}", rate=rate, tool="send_email",
                          run=f"{name}-{i}") for i in range(10)]  # fmt: skip
            ok += sum(v.get("ok", False) for v in store.apply(batch))
            same = call(pos=f"{name}/{n}/k", ikey=shared_key, run=f"{name}-k{n}")
            won += sum(v.get("ok", False) for v in store.apply([same]))
        return ok, won

    with ThreadPoolExecutor(2) as pool:  # a racer's exception is raised here, not lost
        outcomes = list(pool.map(racer, ["p0", "p1"]))
    assert sum(o for o, _ in outcomes) == 50, outcomes  # 400 attempts at once: the burst
    assert sum(w for _, w in outcomes) == 1, outcomes  # one key, one call in flight


# -- idempotency ---------------------------------------------------------------------------------


def test_a_key_in_flight_conflicts_until_its_deadline_and_grace_pass(store: AdmissionStore) -> None:
    first = call()
    key = first[1]["ikey"]
    assert store.apply([first]) == [{"ok": True, "attempt": 1}]
    assert store.record(TENANT, key, NOW)["state"] == "PENDING"
    busy = store.apply([call(ikey=key, now=NOW + 500)])
    assert whys(busy) == ["in_flight"] and busy[0]["retry_after_ms"] == 8000 + 1000 - 500
    # Another payload under the same key: refused, whatever the state.
    assert whys(store.apply([call(ikey=key, hash="h2")])) == ["signature_mismatch"]
    # The deadline and the grace passed with no result: retryable, as a new attempt.
    late = store.apply([call(ikey=key, now=NOW + 9000)])
    assert late == [{"ok": True, "attempt": 2}]


def test_a_completed_key_answers_with_its_cached_result(store: AdmissionStore) -> None:
    first = call()
    key = first[1]["ikey"]
    store.apply([first])
    settled = result(first, result_id="res-1", digest="d-1")
    assert store.apply([settled]) == [{"status": "settled"}]
    assert store.record(TENANT, key, NOW)["state"] == "COMPLETED"
    [hit] = store.apply([call(ikey=key)])
    assert hit["why"] == "idempotent_hit" and hit["state"] == "COMPLETED"
    assert orjson.loads(hit["cached"])["data"] == '{"n":1}'
    assert whys(store.apply([call(ikey=key, hash="h2")])) == ["signature_mismatch"]
    # The same key and arguments for another tool (a tenant-wide key reused): another
    # operation, not this one's cached answer.
    assert store.record(TENANT, key, NOW)["tool"] == "search_kb"
    assert whys(store.apply([call(ikey=key, tool="lookup_faq")])) == ["signature_mismatch"]
    # Refused on the world's state, the same call is answered from its record; another
    # tool's is not.
    same = step(repair=False, ikey=key, hash="h1", tool="search_kb")
    other = step(repair=False, ikey=key, hash="h1", tool="lookup_faq")
    assert whys(store.apply([same, other])) == ["idempotent_hit", None]
    # The same result again (another record): nothing changes.
    again = result(first, result_id="res-1", digest="d-1")
    assert store.apply([again]) == [{"status": "duplicate"}]
    # Another result of the same attempt under another result id that reports the same (an
    # executor that ran it again and named its result afresh): a copy too, not a second
    # answer. One that reports something else is a conflict (see the next test).
    rerun = result(first, result_id="res-2", digest="d-1")
    assert store.apply([rerun]) == [{"status": "duplicate"}]
    other = result(first, result_id="res-2", state="FAILED_RETRYABLE", digest="d-2")
    assert store.apply([other]) == [{"status": "conflict", "state": "COMPLETED", "result": "res-1"}]
    assert store.record(TENANT, key, NOW)["state"] == "COMPLETED"


@pytest.mark.parametrize("same_id", [True, False])
def test_a_second_result_of_an_attempt_that_reports_another_outcome_is_a_conflict(
    store: AdmissionStore, same_id: bool
) -> None:
    """Settled by its first result; a second result of the same attempt (the same id, as an
    executor's deterministic ids give it, or named afresh) reports another outcome: a
    conflict, every time and on a replay of its position, naming the first result and the
    state it left. The first stands. A copy that reports the same outcome is a duplicate,
    and so is any second result where either side has no digest (written, or sent, by an
    earlier version)."""
    first = call()
    key = first[1]["ikey"]
    store.apply([first])
    settled = result(first, result_id="res-1", digest="d-success")
    assert store.apply([settled]) == [{"status": "settled"}]
    before = store.record(TENANT, key, NOW)
    assert (before["state"], before["digest"]) == ("COMPLETED", "d-success")
    second = "res-1" if same_id else "res-2"
    failed = result(first, result_id=second, state="FAILED_RETRYABLE", digest="d-failure")
    conflict = {"status": "conflict", "state": "COMPLETED", "result": "res-1"}
    assert store.apply([failed]) == [conflict]
    assert store.apply([failed]) == [conflict]  # its replay
    copy = (failed[0], {**failed[1], "pos": f"r/0/{next(_pos)}"})
    assert store.apply([copy]) == [conflict]
    assert store.record(TENANT, key, NOW) == before
    same = result(first, result_id=second, digest="d-success")
    unknown = result(first, result_id=second, state="FAILED_RETRYABLE")
    assert store.apply([same, unknown]) == [{"status": "duplicate"}] * 2
    # Within one batch, the first of two results settles and the second is held to it.
    both = call()
    store.apply([both])
    pair = [result(both, result_id="res-a", digest="d-a"),
            result(both, result_id="res-a", digest="d-b", state="FAILED_FINAL")]  # fmt: skip
    assert store.apply(pair) == [
        {"status": "settled"}, {"status": "conflict", "state": "COMPLETED", "result": "res-a"},
    ]  # fmt: skip


def test_a_conflict_with_an_earlier_attempt_that_settled_the_key_is_its_attempts_alone(
    store: AdmissionStore,
) -> None:
    """The first attempt completed after the key moved on to a second, and settled it.
    Another result of the first attempt that reports another outcome is a conflict; the
    second attempt's own result is not (another attempt: a copy, the proposal answered)."""
    first = call(deadline=NOW + 8000)
    key, call_id = first[1]["ikey"], first[1]["call"]
    store.apply([first])
    second = call(ikey=key, call=call_id, now=NOW + 9001, deadline=NOW + 600_000)
    assert store.apply([second]) == [{"ok": True, "attempt": 2}]
    late = result(first, attempt=1, result_id="res-first", digest="d-charged")
    assert store.apply([late]) == [{"status": "settled"}]
    assert store.record(TENANT, key, NOW)["result_attempt"] == "1"
    conflict = {"status": "conflict", "state": "COMPLETED", "result": "res-first"}
    for result_id in ("res-first", "res-other"):
        other = result(first, attempt=1, result_id=result_id, state="FAILED_RETRYABLE",
                       digest="d-declined")  # fmt: skip
        assert store.apply([other]) == [conflict]
    own = result(second, attempt=2, result_id="res-second", state="EXPIRED", digest="d-late")
    assert store.apply([own]) == [{"status": "duplicate"}]
    assert store.record(TENANT, key, NOW)["result"] == "res-first"


def _held_for_a_second_attempt(store: AdmissionStore) -> tuple[Sent, Sent, Sent, str]:
    """A first attempt whose failure after a committed step ("res-first") is held for the
    second, routed and in flight: both attempts' calls, the failure, and the key."""
    first = call(deadline=NOW + 8000)
    key, call_id = first[1]["ikey"], first[1]["call"]
    store.apply([first])
    second = call(ikey=key, call=call_id, now=NOW + 9001, deadline=NOW + 600_000)
    store.apply([second])
    late = _partly_committed(first, attempt=1, result_id="res-first", committed=True,
                             digest="d-charged-then-failed")  # fmt: skip
    assert store.apply([late]) == [{"status": "held"}]
    return first, second, late, key


def test_a_result_that_contradicts_a_held_failure_of_its_attempt_is_a_conflict(
    store: AdmissionStore,
) -> None:
    """The first attempt's failure after a committed step is held for the second, in
    flight. A success of the first attempt then says the opposite: a conflict, which
    neither settles the key nor drops what was held; a copy of the failure under another
    id is a duplicate. Once the second attempt has answered, a result of the first that
    contradicts the held failure is still a conflict."""
    first, second, late, key = _held_for_a_second_attempt(store)
    success = result(first, attempt=1, result_id="res-first", digest="d-succeeded")
    conflict = {"status": "conflict", "state": "FAILED_FINAL", "result": "res-first"}
    assert store.apply([success]) == [conflict]
    renamed = (late[0], {**late[1], "pos": f"r/0/{next(_pos)}", "result_id": "res-again"})
    assert store.apply([renamed]) == [{"status": "duplicate"}]
    record = store.record(TENANT, key, NOW)
    assert record["state"] == "PENDING" and "compensation" not in record
    assert "'f': 'res-first'" in record["missed_attempts"]
    assert store.apply([result(second, attempt=2, digest="d-second")]) == [{"status": "settled"}]
    late_success = (success[0], {**success[1], "pos": f"r/0/{next(_pos)}"})
    assert store.apply([late_success]) == [conflict]
    assert store.record(TENANT, key, NOW)["state"] == "COMPLETED"


@pytest.mark.parametrize(
    ("state", "retry"),
    [("FAILED_RETRYABLE", True), ("EXPIRED", True), ("FAILED_FINAL", False)],
)
def test_failed_keys_retry_or_answer(store: AdmissionStore, state: str, retry: bool) -> None:
    first = call()
    key = first[1]["ikey"]
    store.apply([first])
    store.apply([result(first, state=state)])
    [again] = store.apply([call(ikey=key)])
    if retry:
        assert again == {"ok": True, "attempt": 2}
        assert store.record(TENANT, key, NOW)["state"] == "PENDING"
    else:
        assert again["why"] == "idempotent_hit" and again["state"] == "FAILED_FINAL"


@pytest.mark.parametrize("call_id", ["agent-7|step-3", "a|b|c", "|", "ü|ñ"])
def test_a_call_id_with_a_bar_keeps_its_cached_answer_whole(
    store: AdmissionStore, call_id: str
) -> None:
    """The verdict string separates its fields with '|'; a call id may hold one."""
    first = call(call=call_id)
    key = first[1]["ikey"]
    store.apply([first])
    failed = orjson.dumps({"class": "COMPENSATION_REQUIRED", "data": "a|b"}).decode()
    assert store.apply([result(first, state="FAILED_FINAL", cached=failed)]) == [
        {"status": "settled"}
    ]
    [again] = store.apply([call(ikey=key)])
    assert again["why"] == "idempotent_hit" and again["state"] == "FAILED_FINAL"
    assert again["call"] == call_id
    assert orjson.loads(again["cached"]) == {"class": "COMPENSATION_REQUIRED", "data": "a|b"}


def test_a_replay_marker_of_the_earlier_hit_format_still_reads() -> None:
    cached = '{"class":"SUCCESS","data":"x|y"}'
    assert parse_verdict(f"hit|COMPLETED|call-1|{cached}") == {
        "ok": False, "why": "idempotent_hit", "state": "COMPLETED", "call": "call-1",
        "cached": cached,
    }  # fmt: skip


def test_a_result_for_an_older_attempt_settles_nothing(store: AdmissionStore) -> None:
    first = call()
    key = first[1]["ikey"]
    store.apply([first])
    retry = call(ikey=key, now=NOW + 9000)
    store.apply([retry])  # the first attempt was given up; the retry holds the key
    assert store.apply([result(first)]) == [{"status": "stale", "state": "PENDING"}]
    assert store.record(TENANT, key, NOW)["state"] == "PENDING"
    assert store.apply([result(retry)]) == [{"status": "settled"}]
    assert store.apply([result(call())]) == [{"status": "unknown"}]


def test_a_late_result_of_an_earlier_attempt_under_the_same_call_id_settles_nothing(
    store: AdmissionStore,
) -> None:
    """The proposal was sent again under its own id once its key became retryable: both
    attempts have one call id, and only the attempt the record waits for settles it. A
    failure of the first, come late, is superseded (the second, idempotent under the key,
    meets what it committed), and so is a result of an attempt answered already."""
    first = call()
    key, call_id = first[1]["ikey"], first[1]["call"]
    store.apply([first])
    retry = call(ikey=key, call=call_id, now=NOW + 9000)
    assert store.apply([retry]) == [{"ok": True, "attempt": 2}]
    for state in ("FAILED_RETRYABLE", "EXPIRED", "FAILED_FINAL"):
        assert store.apply([result(first, state=state, attempt=1)]) == [{"status": "superseded"}]
    assert store.record(TENANT, key, NOW)["state"] == "PENDING"
    assert store.apply([result(retry, attempt=2)]) == [{"status": "settled"}]
    assert store.apply([result(first, attempt=1)]) == [{"status": "superseded"}]
    # Answered (its deadline passed, then its result came: EXPIRED), the first attempt's
    # key moved on: another result of it (an executor that named it afresh) is superseded.
    answered = call()
    store.apply([answered, result(answered, state="EXPIRED", attempt=1)])
    again = call(ikey=answered[1]["ikey"], call=answered[1]["call"])
    assert store.apply([again]) == [{"ok": True, "attempt": 2}]
    assert store.apply([result(answered, attempt=1)]) == [{"status": "superseded"}]
    assert store.record(TENANT, answered[1]["ikey"], NOW)["state"] == "PENDING"


@pytest.mark.parametrize("later", ["routed", "parked", "answered", "lapsed"])
def test_an_earlier_attempt_that_completed_after_its_key_moved_on_settles_it(
    store: AdmissionStore, later: str
) -> None:
    """Routed, then no result before its deadline and the grace passed (the executor or the
    results behind), so the proposal, sent again under its own id, is a second attempt.
    The first did run, and completed: its result, come late, settles the key instead of
    being dropped. The second attempt may never get as far as the handler's stored answer
    (parked again, its approvers may decline it; it may time out unstarted); the proposal
    is told the call completed, a retry gets that answer, and the second attempt's own
    result is a copy. A second attempt still parked never goes: its park's take comes
    back, and its request's end, release included, finds the key gone ahead."""
    limits = {"sig": "charge", "group": "financial", "class_budget": 2, "tool": "charge",
              "version": "2.1.0"}  # fmt: skip
    first = call(deadline=NOW + 8000, **limits)
    key, call_id = first[1]["ikey"], first[1]["call"]
    assert store.apply([first]) == [{"ok": True, "attempt": 1}]
    park = later in ("parked", "lapsed")
    second = call(ikey=key, call=call_id, now=NOW + 9001, park=park, rid="req-2" if park else "",
                  deadline=NOW + 600_000, **limits)  # fmt: skip
    assert store.apply([second]) == [{"ok": True, "attempt": 2}]
    assert store.run_counters(TENANT, "run-1", NOW)["class:financial"] == 2
    if later == "answered":  # it timed out unstarted: "nothing ran", retry
        assert store.apply([result(second, state="EXPIRED", attempt=2)]) == [{"status": "settled"}]
    elif later == "lapsed":  # its approvers declined it: "not approved", and it never ran
        assert store.apply([_lapse(second, attempt=2)]) == [{"status": "lapsed"}]
    late = result(first, attempt=1, result_id="res-first")
    assert store.apply([late]) == [{"status": "settled"}]
    record = store.record(TENANT, key, NOW)
    assert (record["state"], record["result"]) == ("COMPLETED", "res-first")
    assert record["awaiting"] == "0" and "missed_attempts" not in record
    assert store.apply([late]) == [{"status": "settled"}]  # its replay
    copy = (late[0], {**late[1], "pos": f"r/0/{next(_pos)}"})
    assert store.apply([copy]) == [{"status": "duplicate"}]
    assert store.apply([result(second, attempt=2)]) == [{"status": "duplicate"}]
    if park:
        # What parking the second attempt took came back (the first's stays: it ran).
        assert store.run_counters(TENANT, "run-1", NOW)["class:financial"] == 1
    if later == "parked":
        assert store.apply([_lapse(second, attempt=2)]) == [{"status": "moved_on"}]
        assert whys(store.apply([_release(second, attempt=2)])) == ["moved_on"]
        assert store.run_counters(TENANT, "run-1", NOW)["class:financial"] == 1
    retry = store.apply([call(ikey=key, call=call_id, now=NOW + 700_000, **limits)])
    assert whys(retry) == ["idempotent_hit"] and retry[0]["state"] == "COMPLETED"


def test_an_earlier_attempt_completed_late_is_held_to_the_version_it_was_routed_as(
    store: AdmissionStore,
) -> None:
    """Routed as 2.0.0; the second attempt, after a reload, as 2.1.0. The first attempt's
    late result is held to 2.0.0, the version it ran as, not the record's."""
    first = call(deadline=NOW + 8000, version="2.0.0")
    key, call_id = first[1]["ikey"], first[1]["call"]
    store.apply([first])
    second = call(ikey=key, call=call_id, now=NOW + 9001, version="2.1.0")
    assert store.apply([second]) == [{"ok": True, "attempt": 2}]
    claimed = result(first, attempt=1, version="2.1.0")
    assert store.apply([claimed]) == [{"status": "mismatch"}]
    assert store.record(TENANT, key, NOW)["state"] == "PENDING"
    assert store.apply([result(first, attempt=1)]) == [{"status": "settled"}]


def test_a_result_of_an_attempt_the_key_never_made_is_refused_not_dropped(
    store: AdmissionStore,
) -> None:
    """No executor was handed an attempt after the one the record is at: its result is not
    one. It settles nothing, and is refused (for the DLQ) rather than taken for an earlier
    attempt's result, which is counted and dropped unseen."""
    routed = call()
    key = routed[1]["ikey"]
    assert store.apply([routed]) == [{"ok": True, "attempt": 1}]
    for attempt in (2, 2**31 - 1):
        claimed = result(routed, attempt=attempt)
        assert store.apply([claimed]) == [{"status": "unrouted_attempt"}]
    assert store.record(TENANT, key, NOW)["state"] == "PENDING"
    assert store.apply([result(routed, attempt=1)]) == [{"status": "settled"}]


def test_an_earlier_attempt_that_never_ran_settles_nothing_when_it_says_it_completed(
    store: AdmissionStore,
) -> None:
    """Parked, its request's end unseen past its deadline and the grace, the proposal sent
    again (parked again) as a second attempt: the first was never routed, so nothing it says settles
    the key (and nor does an attempt the key never made)."""
    parked = call(park=True, rid="req-1", deadline=NOW + 8000)
    key, call_id = parked[1]["ikey"], parked[1]["call"]
    store.apply([parked])
    second = call(ikey=key, call=call_id, now=NOW + 9001, park=True, rid="req-2",
                  deadline=NOW + 600_000)  # fmt: skip
    assert store.apply([second]) == [{"ok": True, "attempt": 2}]
    assert store.apply([result(parked, attempt=1)]) == [{"status": "superseded"}]
    assert store.apply([result(parked, attempt=3)]) == [{"status": "unrouted_attempt"}]
    assert store.record(TENANT, key, NOW)["state"] == "PENDING"


GRANT = '{"sub":"u-1","agent_id":"a-1","scope":"orders:refund","clearance":"internal"}'


def _partly_committed(of: tuple[str, Item], **kw: Any) -> tuple[str, Item]:
    """A result of ``of`` that failed after a committed step, asking for a compensation."""
    key = of[1]["ikey"]
    return result(of, state="FAILED_FINAL", compensation_key="compensate:" + key,
                  compensation_hash="h-undo", compensation_tool="refund_order", **kw)  # fmt: skip


@pytest.mark.parametrize(
    ("later", "state"),
    [("parked", "FAILED_FINAL"), ("parked", "FAILED_RETRYABLE"), ("answered", "FAILED_FINAL"),
     ("lapsed", "FAILED_FINAL"), ("unstarted", "FAILED_FINAL")],
)  # fmt: skip
def test_an_earlier_attempt_that_failed_after_committing_settles_a_key_no_attempt_runs(
    store: AdmissionStore, later: str, state: str
) -> None:
    """Routed, no result before its deadline and the grace passed, the proposal sent again
    under its own id as a second attempt; the first then reports a failure after a
    committed step. No later attempt can meet that step: parked (it never goes now), its
    park ended, answered (timed out unstarted: nothing in flight), or given back. The
    failure settles the key as its own attempt's would: a compensation asked for
    (FAILED_FINAL), or resumed (FAILED_RETRYABLE: PARTIAL_SUCCESS). Before, it was dropped
    as superseded, and the half-changed world was never compensated nor reported."""
    limits = {"sig": "charge", "group": "financial", "class_budget": 2, "tool": "charge"}
    first = call(deadline=NOW + 8000, **limits)
    key, call_id = first[1]["ikey"], first[1]["call"]
    store.apply([first])
    park = later in ("parked", "lapsed")
    second = call(ikey=key, call=call_id, now=NOW + 9001, park=park, rid="req-2" if park else "",
                  deadline=NOW + 600_000, **limits)  # fmt: skip
    assert store.apply([second]) == [{"ok": True, "attempt": 2}]
    if later == "answered":
        assert store.apply([result(second, state="EXPIRED", attempt=2)]) == [{"status": "settled"}]
    elif later == "lapsed":
        assert store.apply([_lapse(second, attempt=2)]) == [{"status": "lapsed"}]
    elif later == "unstarted":  # its batch aborted, and its position was decided as a step
        _, item = second
        assert store.apply([step(sig="charge", repair=False, pos=item["pos"])]) == [{"ok": True}]
    if state == "FAILED_FINAL":
        late = _partly_committed(first, attempt=1, result_id="res-first", committed=True)
    else:
        late = result(first, state=state, attempt=1, result_id="res-first", committed=True)
    assert store.apply([late]) == [{"status": "settled"}]
    assert store.apply([late]) == [{"status": "settled"}]  # its replay
    record = store.record(TENANT, key, NOW)
    assert (record["state"], record["result"]) == (state, "res-first")
    assert record["awaiting"] == "0" and "missed_attempts" not in record
    if state == "FAILED_FINAL":
        assert record["compensation"] == "compensate:" + key
    copy = (late[0], {**late[1], "pos": f"r/0/{next(_pos)}"})
    assert store.apply([copy]) == [{"status": "duplicate"}]
    if park:
        # What parking the second attempt took came back (the first's stays: it ran).
        assert store.run_counters(TENANT, "run-1", NOW)["class:financial"] == 1
    if later == "parked":
        # Its request's end finds the key gone ahead, a resumed one's too (retryable, not
        # given back: the failure settled it while the park was its record's).
        assert store.apply([_lapse(second, attempt=2)]) == [{"status": "moved_on"}]
        assert whys(store.apply([_release(second, attempt=2)])) == ["moved_on"]
        assert store.apply([result(second, attempt=2)]) == [{"status": "duplicate"}]


def test_an_earlier_attempt_that_failed_after_committing_is_compensated_in_its_callers_name(
    store: AdmissionStore,
) -> None:
    """The second attempt was answered (timed out unstarted: nothing ran) before the first
    reported its failure after a committed step. Settling the second must not drop the
    claims its record keeps while an earlier attempt may still ask for a compensation:
    the first's failure asks for one in the caller's name, not an escalation as if the
    record had none to sign with."""
    first = call(deadline=NOW + 8000, grant=GRANT)
    key, call_id = first[1]["ikey"], first[1]["call"]
    store.apply([first])
    second = call(ikey=key, call=call_id, now=NOW + 9001, deadline=NOW + 600_000, grant=GRANT)
    assert store.apply([second]) == [{"ok": True, "attempt": 2}]
    assert store.apply([result(second, state="EXPIRED", attempt=2)]) == [{"status": "settled"}]
    late = _partly_committed(first, attempt=1, committed=True,
                             cached_unsigned='{"class":"COMPENSATION_FAILED"}')  # fmt: skip
    assert store.apply([late]) == [{"status": "settled", "grant": GRANT}]
    record = store.record(TENANT, key, NOW)
    assert record["compensation"] == "compensate:" + key and "grant" not in record


def test_an_earlier_attempt_that_failed_after_committing_is_held_while_a_later_one_runs(
    store: AdmissionStore,
) -> None:
    """The second attempt is routed and may be running: idempotent under the key, it meets
    the first's committed step and may finish the call, which a compensation proposed now
    would undo. The first's failure is held (once: a copy, or its replay, says so too) and
    the second's result settles the key."""
    first = call(deadline=NOW + 8000)
    key, call_id = first[1]["ikey"], first[1]["call"]
    store.apply([first])
    second = call(ikey=key, call=call_id, now=NOW + 9001, deadline=NOW + 600_000)
    assert store.apply([second]) == [{"ok": True, "attempt": 2}]
    late = _partly_committed(first, attempt=1, result_id="res-first", committed=True)
    assert store.apply([late]) == [{"status": "held"}]
    assert store.apply([late]) == [{"status": "held"}]  # its replay
    copy = (late[0], {**late[1], "pos": f"r/0/{next(_pos)}"})
    assert store.apply([copy]) == [{"status": "duplicate"}]
    record = store.record(TENANT, key, NOW)
    assert record["state"] == "PENDING" and "compensation" not in record
    assert record["missed_attempts"] == str([{"a": 1, "f": "res-first", "fs": "FAILED_FINAL"}])
    assert store.apply([result(second, attempt=2)]) == [{"status": "settled"}]
    assert store.record(TENANT, key, NOW)["state"] == "COMPLETED"
    again = (late[0], {**late[1], "pos": f"r/0/{next(_pos)}"})
    assert store.apply([again]) == [{"status": "superseded"}]


@pytest.mark.parametrize("resumable", [False, True])
def test_a_failure_held_for_a_later_attempt_that_never_ran_the_call_answers_it(
    store: AdmissionStore, resumable: bool
) -> None:
    """The first attempt's failure after a committed step was held for the second, routed;
    the second then times out unstarted (or fails committing nothing). "Nothing ran" would
    leave the committed step unseen: the key is final with the answer the result carries
    for that case (an escalation), which a retry gets too. A resumable call's held failure
    is finished by a retry under the key, as the second attempt would have: its answer
    stands."""
    first = call(deadline=NOW + 8000)
    key, call_id = first[1]["ikey"], first[1]["call"]
    store.apply([first])
    second = call(ikey=key, call=call_id, now=NOW + 9001, deadline=NOW + 600_000)
    store.apply([second])
    if resumable:
        late = result(first, state="FAILED_RETRYABLE", attempt=1, committed=True)
    else:
        late = _partly_committed(first, attempt=1, committed=True)
    assert store.apply([late]) == [{"status": "held"}]
    # (a third attempt, past the second's deadline and the grace, keeps what was held)
    third = call(ikey=key, call=call_id, now=NOW + 602_000, deadline=NOW + 900_000)
    assert store.apply([third]) == [{"ok": True, "attempt": 3}]
    held = orjson.dumps({"class": "COMPENSATION_REQUIRED"}).decode()
    unstarted = result(third, state="EXPIRED", attempt=3, cached_held=held)
    expected = {"status": "settled"} if resumable else {"status": "settled", "held": True}
    assert store.apply([unstarted]) == [expected]
    assert store.apply([unstarted]) == [expected]  # its replay
    record = store.record(TENANT, key, NOW)
    if resumable:
        assert record["state"] == "EXPIRED"
        return
    assert (record["state"], record["cached"]) == ("FAILED_FINAL", held)
    # Of the missed attempts only the held failure stays, with its digest (see the next test).
    [kept] = orjson.loads(record["missed_attempts"].replace("'", '"'))
    assert (kept["a"], kept["fs"]) == (1, late[1]["state"])
    retry = store.apply([call(ikey=key, call=call_id, now=NOW + 950_000)])
    assert whys(retry) == ["idempotent_hit"] and retry[0]["cached"] == held


def test_a_result_that_contradicts_a_failure_held_for_an_attempt_that_never_ran_conflicts(
    store: AdmissionStore,
) -> None:
    """The first attempt's failure after a committed step was held for the second, which
    then timed out unstarted: the call is final and escalates on the held failure. A
    result of the first attempt that now says it completed contradicts what the escalation
    stands on: a conflict, for the operator handling it, not a copy. A copy of the held
    failure is still superseded, and the record stands."""
    first, second, late, key = _held_for_a_second_attempt(store)
    held = orjson.dumps({"class": "COMPENSATION_REQUIRED"}).decode()
    unstarted = result(second, state="EXPIRED", attempt=2, cached_held=held, digest="d-unstarted")
    assert store.apply([unstarted]) == [{"status": "settled", "held": True}]
    escalated = store.record(TENANT, key, NOW)
    assert escalated["state"] == "FAILED_FINAL"
    success = result(first, attempt=1, result_id="res-first", digest="d-succeeded")
    conflict = {"status": "conflict", "state": "FAILED_FINAL", "result": "res-first"}
    assert store.apply([success]) == [conflict]
    assert store.apply([success]) == [conflict]  # its replay
    copy = (late[0], {**late[1], "pos": f"r/0/{next(_pos)}"})
    assert store.apply([copy]) == [{"status": "superseded"}]
    assert store.record(TENANT, key, NOW) == escalated


def _held_resumable_failure() -> tuple[tuple[str, Item], tuple[str, Item], tuple[str, Item]]:
    """A resumable call's first attempt, routed, its key moved on to a second attempt that
    is routed too, and the first's failure after a committed step, held for the second:
    (the first, the second, the held failure)."""
    first = call(deadline=NOW + 8000)
    key, call_id = first[1]["ikey"], first[1]["call"]
    second = call(ikey=key, call=call_id, now=NOW + 9001, deadline=NOW + 600_000)
    late = result(first, state="FAILED_RETRYABLE", attempt=1, committed=True,
                  result_id="res-first", digest="d-first")  # fmt: skip
    return first, second, late


@pytest.mark.parametrize("later", ["unstarted", "failed", "partial"])
def test_a_copy_of_a_held_failure_answers_nothing_once_the_later_attempt_answered(
    store: AdmissionStore, later: str
) -> None:
    """A resumable call's first attempt failed after a committed step while the second was
    in flight: held. The second then ends and answers the proposal, leaving the key
    retryable: timed out unstarted or failed committing nothing (its answer stands, a
    retry finishes the call), or failed after committing steps of its own
    (PARTIAL_SUCCESS). A copy of the held failure redelivered after that is superseded by
    that answer: it neither settles the key again nor answers the proposal a second time
    (it did, with PARTIAL_SUCCESS); nor does it once a retry has taken the key."""
    first, second, late = _held_resumable_failure()
    key, call_id = first[1]["ikey"], first[1]["call"]
    store.apply([first])
    assert store.apply([second]) == [{"ok": True, "attempt": 2}]
    assert store.apply([late]) == [{"status": "held"}]
    if later == "partial":
        own = result(second, state="FAILED_RETRYABLE", attempt=2, committed=True,
                     result_id="res-second")  # fmt: skip
    else:
        state = "EXPIRED" if later == "unstarted" else "FAILED_RETRYABLE"
        own = result(second, state=state, attempt=2, result_id="res-second",
                     cached_held='{"class":"COMPENSATION_REQUIRED"}')  # fmt: skip
    assert store.apply([own]) == [{"status": "settled"}]
    answered = store.record(TENANT, key, NOW)
    assert answered["result"] == "res-second"
    copy = (late[0], {**late[1], "pos": f"r/0/{next(_pos)}"})
    assert store.apply([copy]) == [{"status": "superseded"}]
    assert store.apply([copy]) == [{"status": "superseded"}]  # its replay
    assert store.record(TENANT, key, NOW) == answered
    retry = call(ikey=key, call=call_id, now=NOW + 700_000, deadline=NOW + 900_000)
    assert store.apply([retry]) == [{"ok": True, "attempt": 3}]
    again = (late[0], {**late[1], "pos": f"r/0/{next(_pos)}"})
    assert store.apply([again]) == [{"status": "superseded"}]
    assert store.record(TENANT, key, NOW)["state"] == "PENDING"


def test_a_held_failure_whose_later_attempt_never_ran_settles_the_key_once(
    store: AdmissionStore,
) -> None:
    """Held for the second attempt, which was then given back without running (its batch
    aborted and its position was decided as a refused proposal): nothing answered the
    proposal, and nothing is in flight. A copy of the held failure settles the key, once
    (PARTIAL_SUCCESS); its own copies are copies."""
    first, second, late = _held_resumable_failure()
    key = first[1]["ikey"]
    store.apply([first])
    store.apply([second])
    assert store.apply([late]) == [{"status": "held"}]
    _, item = second
    assert store.apply([step(sig=item["sig"], repair=False, pos=item["pos"])]) == [{"ok": True}]
    assert store.record(TENANT, key, NOW)["state"] == "FAILED_RETRYABLE"
    copies = [(late[0], {**late[1], "pos": f"r/0/{next(_pos)}"}) for _ in range(2)]
    assert store.apply(copies) == [{"status": "settled"}, {"status": "duplicate"}]
    record = store.record(TENANT, key, NOW)
    assert (record["state"], record["result"]) == ("FAILED_RETRYABLE", "res-first")


def _given_back(store: AdmissionStore, later: Sent, how: str) -> Sent:
    """``later``, admitted and routed, given back without running: voided (its record
    failed alone on a defect), or its batch aborted and its position decided again as a
    refused proposal, as another call, or as nothing (a token that lapsed since). Returns
    the item decided at the position that gave it back, whose replay decides it again."""
    _, item = later
    if how == "void":
        void = void_item(item)
        assert void is not None
        assert store.apply([(TENANT, void)]) == [{"status": "voided"}]
        return later
    if how == "step":
        refused = step(sig=item["sig"], repair=False, pos=item["pos"])
        assert store.apply([refused]) == [{"ok": True}]
        return refused
    if how == "changed":
        other = call(pos=item["pos"])
        assert whys(store.apply([other])) == ["replay_changed"]
        return other
    gone = withdraw_item(TENANT, item["pos"], item["run"], NOW + 10_000)
    assert store.apply([gone]) == [{"status": "withdrawn"}]
    return gone


def _delivered_again(store: AdmissionStore, late: Sent, at: str) -> Sent:
    """The one held failure the store delivered again, ``late``'s record as it came, given
    back at position ``at``; and that record as the processor reads it next, a copy of
    ``late`` at a new position."""
    [again] = store.take_redeliveries()
    kept = orjson.loads(late[1]["record"])
    assert (again.tenant, again.at, again.state, again.of) == (
        TENANT, at, late[1]["state"], kept["of"]
    )  # fmt: skip
    assert (again.key, again.value) == (None, base64.b64decode(kept["v"]))
    return late[0], {**late[1], "pos": f"r/0/{next(_pos)}"}


def _held_kept(store: AdmissionStore, key: str, attempt: int = 1) -> bool:
    return bool(store.client.exists(f"{store._base(TENANT)}:held:{attempt}:{key}"))


@pytest.mark.parametrize("how", ["void", "step", "changed", "withdraw"])
def test_a_held_failure_is_delivered_again_when_its_later_attempt_is_given_back(
    store: AdmissionStore, how: str
) -> None:
    """The first attempt's failure after a committed step is held for the second, routed;
    the second is then given back without running. Nothing is in flight, and nothing
    answered the proposal: the held failure's record is delivered again, once, and a
    replay of the position that gave the attempt back delivers it again (its batch may
    abort too). Read again, it settles the key as it would have had the second attempt
    not existed (a compensation asked for), answered once; its kept record goes, and so
    does the replay's copy once the batch commits."""
    _, second, late, key = _held_for_a_second_attempt(store)
    assert store.take_redeliveries() == []
    assert _held_kept(store, key)
    at = _given_back(store, second, how)
    again = _delivered_again(store, late, at[1]["pos"])
    assert store.record(TENANT, key, NOW)["state"] == "FAILED_RETRYABLE"
    store.apply([at])  # its replay (the batch aborted)
    _delivered_again(store, late, at[1]["pos"])
    store.forget([at])  # the batch committed
    assert store.client.hlen(f"{store._base(TENANT)}:redeliver") == 0
    assert store.apply([again]) == [{"status": "settled"}]
    record = store.record(TENANT, key, NOW)
    assert (record["state"], record.get("result")) == ("FAILED_FINAL", "res-first")
    assert record.get("compensation") == "compensate:" + key
    assert not _held_kept(store, key)
    copy = (late[0], {**late[1], "pos": f"r/0/{next(_pos)}"})
    assert store.apply([copy]) == [{"status": "duplicate"}]
    assert store.take_redeliveries() == []


def test_a_delivery_again_left_behind_by_a_processor_that_died_after_its_commit_goes(
    store: AdmissionStore,
) -> None:
    """The batch that gave the later attempt back committed, and its processor died before
    its next round trip would have forgotten its markers: whoever takes the partition next
    drops the delivery kept for a replay with them (forget_committed)."""
    _, second, _, _ = _held_for_a_second_attempt(store)
    at = _given_back(store, second, "withdraw")
    assert len(store.take_redeliveries()) == 1
    kept = f"{store._base(TENANT)}:redeliver"
    assert store.client.hlen(kept) == 1
    topic, partition, offset = at[1]["pos"].rsplit("/", 2)
    assert store.forget_committed({(topic, int(partition)): int(offset)}) >= 0
    assert store.client.hlen(kept) == 1  # (not below the committed offset: kept)
    assert store.forget_committed({(topic, int(partition)): int(offset) + 1}) >= 1
    assert store.client.hlen(kept) == 0


def test_a_delivery_again_goes_with_the_round_trip_that_forgets_its_markers(
    tmp_path: Path,
) -> None:
    """The batch that gave the later attempt back committed, and the round trip that was
    to forget its markers failed (Redis down): the processor keeps the batch's items and
    forgets them with its next round trip. The delivery kept for a replay goes then, with
    the markers (it was left behind for good, the store having already let it go)."""
    server = RedisServer(tmp_path / "redis", "--appendonly", "yes", "--appendfsync", "always",
                         "--save", "").start()  # fmt: skip
    try:
        store = AdmissionStore(connect(server.url), f"adm-{uuid.uuid4().hex[:8]}")
        _, second, _, _ = _held_for_a_second_attempt(store)
        at = _given_back(store, second, "withdraw")
        assert len(store.take_redeliveries()) == 1
        kept = f"{store._base(TENANT)}:redeliver"
        assert store.client.hlen(kept) == 1
        server.stop()
        with pytest.raises(redis.ConnectionError):
            store.apply([], forget=[at])
        server.start()
        store.apply([], forget=[at])
        assert store.client.hlen(kept) == 0
        assert store.client.hget(f"{store._base(TENANT)}:done", at[1]["pos"]) is None
    finally:
        server.kill()


def test_what_the_store_keeps_of_deliveries_again_ends_with_the_assignment(
    store: AdmissionStore,
) -> None:
    """A batch that gave the later attempt back aborted, and its partition went to another
    processor, which decided it again (delivering the held failure again) and committed
    it. The first processor never commits that position, so nothing it forgets names it:
    when it is next assigned partitions, what it kept of the delivery goes (Redis holds
    none of it by then), so a long-lived processor does not keep such positions for ever."""
    _, second, _, _ = _held_for_a_second_attempt(store)
    at = _given_back(store, second, "withdraw")
    assert len(store.take_redeliveries()) == 1
    other = AdmissionStore(store.client, store.ns)
    other.apply([at])  # the other processor's replay
    assert len(other.take_redeliveries()) == 1
    other.forget([at])  # its commit
    assert store.client.hlen(f"{store._base(TENANT)}:redeliver") == 0
    assert store._redelivered_at
    topic, partition, offset = at[1]["pos"].rsplit("/", 2)
    store.forget_committed({(topic, int(partition)): int(offset) + 1})
    assert not store._redelivered_at


def test_a_held_failure_delivered_again_while_a_retry_runs_is_held_for_it(
    store: AdmissionStore,
) -> None:
    """Delivered again when the second attempt was given back, the held failure is read
    while a third attempt (a retry) is routed and in flight: held for that one, as it was
    for the second, answering nothing. Should the third be given back too, it is
    delivered again, and then settles the key."""
    first, second, late, key = _held_for_a_second_attempt(store)
    call_id = first[1]["call"]
    at = _given_back(store, second, "withdraw")
    again = _delivered_again(store, late, at[1]["pos"])
    retry = call(ikey=key, call=call_id, now=NOW + 20_000, deadline=NOW + 900_000)
    assert store.apply([retry]) == [{"ok": True, "attempt": 3}]
    assert store.apply([again]) == [{"status": "duplicate"}]
    assert store.record(TENANT, key, NOW)["state"] == "PENDING"
    at = _given_back(store, retry, "void")
    once_more = _delivered_again(store, late, at[1]["pos"])
    assert store.apply([once_more]) == [{"status": "settled"}]
    record = store.record(TENANT, key, NOW)
    assert (record["state"], record.get("result")) == ("FAILED_FINAL", "res-first")


def test_a_held_failure_answered_by_its_later_attempt_is_not_delivered_again(
    store: AdmissionStore,
) -> None:
    """The second attempt answered the proposal (it timed out unstarted: the call is final
    and escalates on the held failure). Its kept record goes; a retry given back later has
    nothing held to deliver again."""
    _, second, _, key = _held_for_a_second_attempt(store)
    held = orjson.dumps({"class": "COMPENSATION_REQUIRED"}).decode()
    unstarted = result(second, state="EXPIRED", attempt=2, cached_held=held)
    assert store.apply([unstarted]) == [{"status": "settled", "held": True}]
    assert not _held_kept(store, key)
    assert store.take_redeliveries() == []


@pytest.mark.parametrize("how", ["void", "withdraw"])
def test_a_held_failure_is_delivered_again_when_a_resubmission_is_given_back_to_its_park(
    store: AdmissionStore, how: str
) -> None:
    """The key moved on from the first attempt to a second, parked; resubmitted with its
    approvals, the second went, and the first's failure after a committed step was held
    for it. The resubmission is then given back: it waits for its approvers again, and a
    parked later attempt never goes once an earlier attempt's failure settles the key (see
    settle). The held failure is delivered again; read, it settles the key and gives back
    what parking took; the request's end, later, gives back nothing a second time."""
    limits = {"sig": "charge", "group": "financial", "class_budget": 5, "tool": "charge"}
    first = call(deadline=NOW + 8000, **limits)
    key, call_id = first[1]["ikey"], first[1]["call"]
    store.apply([first])
    parked = call(ikey=key, call=call_id, now=NOW + 9001, park=True, rid="req-2",
                  deadline=NOW + 600_000, **limits)  # fmt: skip
    assert store.apply([parked]) == [{"ok": True, "attempt": 2}]
    approved = call(ikey=key, call=call_id, now=NOW + 60_000, deadline=NOW + 600_000, **limits)
    assert store.apply([approved]) == [{"ok": True, "attempt": 2}]
    late = _partly_committed(first, attempt=1, result_id="res-first", committed=True)
    assert store.apply([late]) == [{"status": "held"}]
    at = _given_back(store, approved, how)
    assert store.record(TENANT, key, NOW)["awaiting"] == "1"
    again = _delivered_again(store, late, at[1]["pos"])
    taken = store.run_counters(TENANT, "run-1", NOW)
    assert store.apply([again]) == [{"status": "settled"}]
    record = store.record(TENANT, key, NOW)
    assert (record["state"], record.get("result")) == ("FAILED_FINAL", "res-first")
    assert record.get("awaiting") != "1"
    given = store.run_counters(TENANT, "run-1", NOW)
    assert given["class:financial"] == taken["class:financial"] - 1
    assert store.apply([_lapse(parked, attempt=2)]) == [{"status": "moved_on"}]  # (answered)
    assert store.run_counters(TENANT, "run-1", NOW) == given
    assert store.take_redeliveries() == []


@pytest.mark.parametrize("how", ["undone", "voided"])
def test_a_held_failure_is_delivered_again_when_the_release_it_was_held_for_never_ran(
    store: AdmissionStore, how: str
) -> None:
    """The second attempt, parked, was released and routed, and the first's failure after a
    committed step was held for it. The released call then never ran: its batch aborted,
    and on its replay the release was refused at its recheck (undone, see unrelease), the
    held failure having been decided in the half of a split batch after the release; or
    the release's approval record failed alone on a defect (voided, see void_release). The
    held failure is delivered again, and settles the key."""
    first = call(deadline=NOW + 8000)
    key, call_id = first[1]["ikey"], first[1]["call"]
    store.apply([first])
    parked = call(ikey=key, call=call_id, now=NOW + 9001, park=True, rid="req-2",
                  deadline=NOW + 600_000)  # fmt: skip
    assert store.apply([parked]) == [{"ok": True, "attempt": 2}]
    released = _release(parked, attempt=2, call=call_id)
    assert store.apply([released]) == [{"ok": True, "attempt": 2}]
    late = _partly_committed(first, attempt=1, result_id="res-first", committed=True)
    assert store.apply([late]) == [{"status": "held"}]
    if how == "undone":
        lapse = _lapse(parked, released[1]["pos"], attempt=2)
        assert store.apply([lapse]) == [{"status": "lapsed"}]
    else:
        void = void_item(released[1])
        assert void is not None and store.apply([(TENANT, void)]) == [{"status": "voided"}]
    again = _delivered_again(store, late, released[1]["pos"])
    assert store.apply([again]) == [{"status": "settled"}]
    record = store.record(TENANT, key, NOW)
    assert (record["state"], record.get("result")) == ("FAILED_FINAL", "res-first")


def test_a_copy_of_a_held_failure_answered_under_the_previous_version_answers_nothing(
    store: AdmissionStore,
) -> None:
    """Held for the second attempt, which answered the proposal, all under the version
    before (its record marks no held failure answered for, and keeps no digests). A copy
    of the held failure delivered after the upgrade is superseded by that answer, as it is
    on a record this version wrote: it neither settles the key again nor answers twice."""
    first, second, late = _held_resumable_failure()
    key = first[1]["ikey"]
    store.apply([first])
    store.apply([second])
    assert store.apply([late]) == [{"status": "held"}]
    own = result(second, state="FAILED_RETRYABLE", attempt=2, result_id="res-second",
                 cached_held='{"class":"COMPENSATION_REQUIRED"}')  # fmt: skip
    assert store.apply([own]) == [{"status": "settled"}]
    [bucket] = [
        k for k in store.client.scan_iter(f"{store._base(TENANT)}:idem:*")
        if store.client.hexists(k, key)
    ]  # fmt: skip
    rec = orjson.loads(store.client.hget(bucket, key) or b"")
    rec.pop("g", None)
    rec["ua"] = [{k: v for k, v in m.items() if k not in ("fa", "g")} for m in rec["ua"]]
    store.client.hset(bucket, key, orjson.dumps(rec))
    answered = store.record(TENANT, key, NOW)
    copy = (late[0], {**late[1], "pos": f"r/0/{next(_pos)}"})
    assert store.apply([copy]) == [{"status": "superseded"}]
    assert store.record(TENANT, key, NOW) == answered


@pytest.mark.parametrize(
    ("claim", "value"),
    [("tool", "charge_customer_card_v2"), ("version", "2.0.0"), ("version", None),
     ("hash", "h-other"), ("run", "run-other"), ("hash", "")],
)  # fmt: skip
def test_a_result_that_is_not_its_calls_settles_nothing(
    store: AdmissionStore, claim: str, value: str | None
) -> None:
    """A result settles its call only if it names the call's tool, the version the call
    was routed as, its payload and run: the tool and version it claims pick the output
    schema its data is checked against and the compensation its contract names (or none),
    the run where its answer goes, and with committed steps it would have a compensation
    proposed in the caller's name."""
    original = call(grant=GRANT, run="run-a", version="2.1.0")
    key = original[1]["ikey"]
    store.apply([original])
    claimed = _partly_committed(original, result_id="res-1", **{claim: value})
    assert store.apply([claimed]) == [{"status": "mismatch"}]
    record = store.record(TENANT, key, NOW)
    assert (record["state"], record["grant"]) == ("PENDING", GRANT)
    assert "compensation" not in record
    # The call's own result settles it, though it has the result id the other one named.
    own = _partly_committed(original, result_id="res-1")
    assert store.apply([own]) == [{"status": "settled", "grant": GRANT}]
    assert store.record(TENANT, key, NOW)["compensation_tool"] == "refund_order"


def test_a_stale_result_is_held_to_its_keys_tool_and_payload(store: AdmissionStore) -> None:
    """Every call a key holds has its tool and payload (another is refused), so a stale
    result is held to them; its run is its own call's, which the record no longer names."""
    first = call(run="run-a")
    key = first[1]["ikey"]
    store.apply([first])
    store.apply([call(ikey=key, run="run-b", now=NOW + 9000)])
    assert store.apply([result(first, tool="lookup_order")]) == [{"status": "mismatch"}]
    assert store.apply([result(first, hash="h2")]) == [{"status": "mismatch"}]
    assert store.apply([result(first)]) == [{"status": "stale", "state": "PENDING"}]


def _written_before(store: AdmissionStore, key: str, *fields: str) -> None:
    """Take ``fields`` off the stored record of ``key``, as a version of the script that
    kept none of them wrote it."""
    [bucket] = [
        k for k in store.client.scan_iter(f"{store._base(TENANT)}:idem:*")
        if store.client.hexists(k, key)
    ]  # fmt: skip
    rec = orjson.loads(store.client.hget(bucket, key) or b"")
    for field in fields:
        rec.pop(field, None)
    store.client.hset(bucket, key, orjson.dumps(rec))


def test_a_record_written_before_tools_were_kept_is_settled_by_its_own_result(
    store: AdmissionStore,
) -> None:
    first = call()
    key = first[1]["ikey"]
    store.apply([first])
    _written_before(store, key, "n")
    assert store.apply([result(first, hash="h2")]) == [{"status": "mismatch"}]
    assert store.apply([result(first, tool="lookup_order")]) == [{"status": "settled"}]


def test_a_record_written_before_versions_were_kept_is_settled_by_its_own_result(
    store: AdmissionStore,
) -> None:
    """A call the version before admitted: its record names no version, and its result is
    not refused for the one it names (nothing says which version the call was routed as)."""
    first = call(version="2.1.0")
    key = first[1]["ikey"]
    store.apply([first])
    _written_before(store, key, "nv")
    assert store.apply([result(first, version="2.0.0")]) == [{"status": "settled"}]


def test_a_released_call_is_bound_to_the_version_it_goes_as(store: AdmissionStore) -> None:
    """Parked as 2.0.0; resubmitted with its approvals as 2.1.0 (contracts reloaded while it
    waited), which took the record; that resubmission's position then decided again as a
    refusal (its transaction aborted: it never ran), so the park waits again, and its
    approvers release it: the call that runs is the parked one, as 2.0.0, and its result
    is held to that version, not the resubmission's."""
    parked = call(park=True, deadline=NOW + 600_000, version="2.0.0")
    key = parked[1]["ikey"]
    assert whys(store.apply([parked])) == [None]
    resubmitted = call(ikey=key, call=parked[1]["call"], version="2.1.0", now=NOW + 1000)
    assert store.apply([resubmitted]) == [{"ok": True, "attempt": 1}]
    assert store.record(TENANT, key, NOW)["version"] == "2.1.0"
    assert whys(store.apply([step(repair=False, pos=resubmitted[1]["pos"])])) == [None]
    assert store.record(TENANT, key, NOW)["awaiting"] == "1"
    released = _release(parked, version="2.0.0")
    assert store.apply([released]) == [{"ok": True, "attempt": 1}]
    assert store.record(TENANT, key, NOW)["version"] == "2.0.0"
    assert store.apply([result(resubmitted)]) == [{"status": "mismatch"}]
    assert store.apply([result(parked)]) == [{"status": "settled"}]


@pytest.mark.parametrize("before", [False, True], ids=["current", "written_before"])
@pytest.mark.parametrize(
    "how",
    ["parked", "lapsed", "lapsed_as_parked_before", "unreleased", "resubmission_given_back"],
)
def test_a_result_for_a_call_that_was_never_routed_settles_nothing(
    store: AdmissionStore, how: str, before: bool
) -> None:
    """A parked call waits for its approvers; one whose request ended without it (its end
    named by its request, or only by its deadline, as a request parked by an earlier
    version is), one released whose release was undone (its batch aborted, and refused at
    its recheck on the replay), or a resubmission carrying approvals that never went (its
    position decided again as something else, its request ended meanwhile), never ran. A
    result for it completes nothing, and proposes no compensation; the call, released, is
    settled by its own. So for a record the version before wrote (``before``), which did
    not mark a call that never ran."""
    parked = call(park=True, grant=GRANT, deadline=NOW + 600_000, rid="req-1")
    key = parked[1]["ikey"]
    store.apply([parked])
    if how == "lapsed":
        assert store.apply([_lapse(parked)]) == [{"status": "lapsed"}]
    elif how == "lapsed_as_parked_before":
        entry = {"tenant_id": TENANT, "idempotency_key": key, "payload_hash": "h1",
                 "expires_at": NOW + 600_000}  # fmt: skip
        assert store.apply([lapse_item(entry, f"a/0/{next(_pos)}", NOW)]) == [{"status": "lapsed"}]
    elif how == "unreleased":
        released = _release(parked)
        assert store.apply([released]) == [{"ok": True, "attempt": 1}]
        assert store.apply([_lapse(parked, released[1]["pos"])]) == [{"status": "lapsed"}]
    elif how == "resubmission_given_back":
        resubmitted = call(ikey=key, grant=GRANT)
        assert whys(store.apply([resubmitted])) == [None]
        assert store.apply([_lapse(parked)]) == [{"status": "superseded"}]
        # Its batch aborted, and its position is a refused proposal now: it never ran.
        again = step(repair=False, pos=resubmitted[1]["pos"], run="run-1")
        assert whys(store.apply([again])) == [None]
        parked = resubmitted
    if before:
        _written_before(store, key, "u")
    record = store.record(TENANT, key, NOW)
    assert record["state"] == "PENDING"
    assert store.apply([_partly_committed(parked)]) == [{"status": "unrouted"}]
    record = store.record(TENANT, key, NOW)
    assert (record["state"], record["grant"]) == ("PENDING", GRANT)
    assert "compensation" not in record
    if how == "parked":
        assert store.apply([_release(parked)]) == [{"ok": True, "attempt": 1}]
        assert store.apply([result(parked)]) == [{"status": "settled"}]


@pytest.mark.parametrize("how", ["admitted", "released", "resubmitted", "released_no_record"])
def test_a_call_routed_by_the_version_before_is_settled_by_its_own_result(
    store: AdmissionStore, how: str
) -> None:
    """Its record names no u (the version before kept none): a call it admitted unparked,
    released, or resubmitted with its approvals, ran, and its result settles it."""
    parked = call(park=True, deadline=NOW + 600_000, rid="req-1")
    key, ran = parked[1]["ikey"], parked
    if how == "admitted":
        ran = call(rid="")
        key = ran[1]["ikey"]
        store.apply([ran])
    elif how == "released":
        store.apply([parked])
        assert store.apply([_release(parked)]) == [{"ok": True, "attempt": 1}]
    elif how == "resubmitted":
        store.apply([parked])
        ran = call(ikey=key)
        assert store.apply([ran]) == [{"ok": True, "attempt": 1}]
    else:  # released with no record of its park (none was found: it wrote its own)
        assert store.apply([_release(parked)]) == [{"ok": True, "attempt": 1}]
    _written_before(store, key, "u")
    assert store.apply([result(ran)]) == [{"status": "settled"}]


def test_a_stale_result_is_answered_once(store: AdmissionStore) -> None:
    """A result of a call whose key moved on to another call answers its own proposal,
    once: a copy (twice in one batch, or redelivered) is a duplicate; the batch replayed
    after an aborted transaction gets the verdicts it got. So is a copy of a result that
    settled the key before it moved on."""
    first = call()
    key = first[1]["ikey"]
    store.apply([first])
    second = call(ikey=key, now=NOW + 9000)
    store.apply([second])
    late = result(first, state="FAILED_FINAL", result_id="res-first")
    copy = (late[0], {**late[1], "pos": f"r/0/{next(_pos)}"})
    batch = [late, copy]
    stale = {"status": "stale", "state": "PENDING"}
    assert store.apply(batch) == [stale, {"status": "duplicate"}]
    assert store.apply(batch) == [stale, {"status": "duplicate"}]  # replayed: the same
    redelivered = (late[0], {**late[1], "pos": f"r/0/{next(_pos)}"})
    assert store.apply([redelivered]) == [{"status": "duplicate"}]
    assert store.record(TENANT, key, NOW)["state"] == "PENDING"
    # The second call's result settles the key, which then moves on to a third call: a
    # copy of either result is answered by now.
    assert store.apply([result(second, state="EXPIRED", result_id="res-second")]) == [
        {"status": "settled"}
    ]
    store.apply([call(ikey=key, now=NOW + 9000)])
    copies = [result(first, result_id="res-first"), result(second, result_id="res-second")]
    assert store.apply(copies) == [{"status": "duplicate"}] * 2
    # A record keeps the last few: an old copy past them is answered as stale again.
    others = [result(first, result_id=f"res-{n}") for n in range(8)]
    assert store.apply(others) == [stale] * 8
    assert store.apply([result(first, result_id="res-first")]) == [stale]


def test_a_call_whose_record_failed_alone_does_not_hold_its_key(store: AdmissionStore) -> None:
    """Admitted, then its record failed on a defect (answered UNKNOWN_ERROR, never routed):
    the key's record must not stay PENDING, blocking a retry until its deadline."""
    admitted = call()
    key = admitted[1]["ikey"]
    assert whys(store.apply([admitted])) == [None]
    assert store.record(TENANT, key, NOW)["state"] == "PENDING"
    void = void_item(admitted[1])
    assert void is not None
    # A copy of it refused as in flight holds nothing: voiding that copy changes nothing.
    copy = call(ikey=key, call=admitted[1]["call"])
    assert whys(store.apply([copy])) == ["in_flight"]
    copy_void = void_item(copy[1])
    assert copy_void is not None
    assert store.apply([(TENANT, copy_void)]) == [{"status": "unchanged"}]
    assert store.record(TENANT, key, NOW)["state"] == "PENDING"

    assert store.apply([(TENANT, void)]) == [{"status": "voided"}]
    assert store.record(TENANT, key, NOW)["state"] == "FAILED_RETRYABLE"
    # What it took from the budgets is given back: only the two proposals' steps stay.
    assert store.run_counters(TENANT, "run-1", NOW) == {"steps": 2}
    assert store.apply([(TENANT, void)]) == [{"status": "voided"}]  # idempotent: it says so
    # A replay of its batch refuses it too, even should the defect not recur: it must not
    # go with its record no longer waiting for it.
    assert whys(store.apply([admitted])) == ["voided"]
    # Nothing ran: the same call may go again under its key.
    retry = call(ikey=key, run="run-2")
    assert store.apply([retry]) == [{"ok": True, "attempt": 2}]
    assert store.record(TENANT, key, NOW)["state"] == "PENDING"
    # A void for a call that does not hold the key (another took it, or it completed)
    # changes nothing.
    store.apply([(TENANT, void)])
    assert store.record(TENANT, key, NOW)["state"] == "PENDING"
    store.apply([result(retry)])
    assert store.apply([(TENANT, void_item(retry[1]))]) == [{"status": "unchanged"}]
    assert store.record(TENANT, key, NOW)["state"] == "COMPLETED"
    assert void_item(step()[1]) is None


def test_a_parked_call_is_released_once_whichever_path_comes_first(store: AdmissionStore) -> None:
    parked = call(park=True, group="critical", class_budget=1, deadline=NOW + 600_000)
    key = parked[1]["ikey"]
    assert whys(store.apply([parked])) == [None]
    assert store.record(TENANT, key, NOW)["awaiting"] == "1"
    # The same call parked again while it waits: in flight.
    assert whys(store.apply([call(ikey=key, park=True, group="critical", class_budget=1)])) == [
        "in_flight"
    ]
    # Resubmitted with its approvals attached: it goes, without a second charge.
    resubmitted = call(ikey=key, group="critical", class_budget=1)
    assert whys(store.apply([resubmitted])) == [None]
    assert store.run_counters(TENANT, "run-1", NOW)["class:critical"] == 1
    # A release by the approvers afterwards finds the key taken: not routed again.
    release = {"kind": "release", "pos": f"a/0/{next(_pos)}", "now": NOW, "run": "run-1",
               "ikey": key,
               "hash": "h1", "call": "released", "deadline": NOW + 8000,
               "ttl": 3_600_000}  # fmt: skip
    assert whys(store.apply([(TENANT, release)])) == ["superseded"]

    other = call(park=True, deadline=NOW + 600_000)
    store.apply([other])
    release2 = {**release, "pos": f"a/0/{next(_pos)}", "ikey": other[1]["ikey"]}
    assert whys(store.apply([(TENANT, release2)])) == [None]
    assert store.record(TENANT, other[1]["ikey"], NOW)["awaiting"] == "0"


def test_a_parked_call_resubmitted_by_another_run_is_in_flight(store: AdmissionStore) -> None:
    """Only the run that parked a call goes on what its park took: another run naming the
    key (an agent reusing a key and a trace across runs) would run it on a step and a
    budget that run never spent, past its own caps."""
    parked = call(park=True, group="financial", class_budget=1, deadline=NOW + 600_000)
    assert whys(store.apply([parked])) == [None]
    other = call(ikey=parked[1]["ikey"], run="run-2", group="financial", class_budget=1,
                 steps=1, now=NOW + 1000)  # fmt: skip
    assert whys(store.apply([other])) == ["in_flight"]
    assert store.run_counters(TENANT, "run-2", NOW) == {"steps": 1.0}
    own = call(ikey=parked[1]["ikey"], group="financial", class_budget=1, now=NOW + 2000)
    assert store.apply([own]) == [{"ok": True, "attempt": 1}]
    assert store.run_counters(TENANT, "run-1", NOW)["class:financial"] == 1.0


def test_a_release_replayed_where_its_request_ended_the_first_time_does_not_go(
    store: AdmissionStore,
) -> None:
    """Approved, but refused at its recheck (the order moved on): the approval record's
    position gives back what parking took (a lapse). That batch aborts, and on its replay
    the recheck passes: the release at the same position must not go, on a take already
    given back (with a budget of one, a second call of the class would then run too)."""
    limits = {"group": "financial", "class_budget": 1, "tool": "charge"}
    parked = call(park=True, deadline=NOW + 600_000, **limits)
    assert whys(store.apply([parked])) == [None]
    pos = f"a/0/{next(_pos)}"
    assert store.apply([_lapse(parked, pos)]) == [{"status": "lapsed"}]
    assert "class:financial" not in store.run_counters(TENANT, "run-1", NOW)
    release = {"kind": "release", "pos": pos, "run": "run-1", "ikey": parked[1]["ikey"],
               "hash": "h1", "call": "released", "deadline": NOW + 8000, "ttl": 3_600_000,
               "parked_until": ""}  # fmt: skip
    assert store.apply([(TENANT, release)]) == [
        {"ok": False, "why": "replay_changed", "retry_after_ms": 0}
    ]
    record = store.record(TENANT, parked[1]["ikey"], NOW)
    assert (record["state"], record["awaiting"]) == ("PENDING", "0")
    # Its own release, replayed, answers as before.
    other = call(park=True, deadline=NOW + 600_000)
    assert whys(store.apply([other])) == [None]
    again = {**release, "pos": f"a/0/{next(_pos)}", "ikey": other[1]["ikey"]}
    assert store.apply([(TENANT, again)]) == [{"ok": True, "attempt": 1}]
    assert store.apply([(TENANT, again)]) == [{"ok": True, "attempt": 1}]


def test_a_released_retry_runs_as_its_own_attempt_and_its_result_settles_it(
    store: AdmissionStore,
) -> None:
    """A parked call whose request lapsed, parked again later under the same key (attempt
    2) and released: the release says attempt 2, and a result for attempt 2 settles it."""
    first = call(park=True, deadline=NOW + 8000)
    key = first[1]["ikey"]
    store.apply([first])
    again = call(ikey=key, call=first[1]["call"], park=True, now=NOW + 9000,
                 deadline=NOW + 600_000)  # fmt: skip
    assert store.apply([again]) == [{"ok": True, "attempt": 2}]
    release = {"kind": "release", "pos": f"a/0/{next(_pos)}", "now": NOW + 10_000,
               "run": "run-1", "ikey": key, "hash": "h1", "call": first[1]["call"],
               "deadline": NOW + 18_000, "ttl": 3_600_000}  # fmt: skip
    assert store.apply([(TENANT, release)]) == [{"ok": True, "attempt": 2}]
    assert store.apply([result(again, attempt=1)]) == [{"status": "superseded"}]
    assert store.apply([result(again, attempt=2)]) == [{"status": "settled"}]


def test_a_spent_approval_stops_its_call_before_anything_is_charged(
    store: AdmissionStore,
) -> None:
    """An approval is good for one execution. The call that carries it spends it when it
    is admitted; a later call with the same approval (another key, or the same key retried
    after a retryable failure) is refused, and takes a step and nothing else: no class
    budget, no loop-guard count, no record that would answer its next retry "in flight"."""
    spend = {"approvals": ["appr-1"], "approvals_ttl": 3_600_000}
    first = call(sig="cancel:1", group="write", class_budget=2, repeats=2, **spend)
    assert store.apply([first]) == [{"ok": True, "attempt": 1}]
    assert store.apply([first]) == [{"ok": True, "attempt": 1}]  # its own replay
    assert store.apply([result(first, state="FAILED_RETRYABLE")]) == [{"status": "settled"}]
    before = store.run_counters(TENANT, "run-1", NOW)
    key = first[1]["ikey"]
    retry = call(sig="cancel:1", group="write", class_budget=2, repeats=2, ikey=key, **spend)
    other = call(sig="cancel:1", group="write", class_budget=2, repeats=2, **spend)
    assert whys(store.apply([retry, other])) == ["approval_reused", "approval_reused"]
    after = store.run_counters(TENANT, "run-1", NOW)
    assert after == {**before, "steps": before["steps"] + 2}
    assert store.record(TENANT, key, NOW)["state"] == "FAILED_RETRYABLE"
    assert store.record(TENANT, other[1]["ikey"], NOW) == {}
    # Without the spent approval (a fresh one), the retry goes, as its second attempt.
    fresh = call(sig="cancel:1", group="write", class_budget=2, repeats=2, ikey=key,
                 approvals=["appr-2"], approvals_ttl=3_600_000)  # fmt: skip
    assert store.apply([fresh]) == [{"ok": True, "attempt": 2}]


def test_a_parked_call_resubmitted_with_its_approvals_counts_once_for_the_loop_guard(
    store: AdmissionStore,
) -> None:
    """Parked, then sent again with its approvals attached: one call, one count. Counted
    twice, its one retry after a retryable failure would be refused as a loop."""
    parked = call(sig="charge", repeats=2, park=True, deadline=NOW + 600_000)
    key = parked[1]["ikey"]
    assert whys(store.apply([parked])) == [None]
    approved = call(sig="charge", repeats=2, ikey=key, now=NOW + 60_000)
    assert whys(store.apply([approved])) == [None]
    assert store.run_counters(TENANT, "run-1", NOW)["sig:charge"] == 1
    failed = result(approved, state="FAILED_RETRYABLE", now=NOW + 90_000)
    assert store.apply([failed]) == [{"status": "settled"}]
    retry = call(sig="charge", repeats=2, ikey=key, park=True, now=NOW + 120_000,
                 deadline=NOW + 720_000)  # fmt: skip
    assert whys(store.apply([retry])) == [None]
    third = call(sig="charge", repeats=2, now=NOW + 130_000)
    assert whys(store.apply([third])) == ["loop"]


def test_a_parked_call_that_was_the_last_repeat_allowed_is_not_a_loop_of_itself(
    store: AdmissionStore,
) -> None:
    """The second of two identical calls (the loop guard allows two) is parked; sent again
    with its approvals, it is the same call, not a third one, as its release would be."""
    first = call(sig="charge", repeats=2)
    parked = call(sig="charge", repeats=2, park=True, deadline=NOW + 600_000)
    assert whys(store.apply([first, parked])) == [None, None]
    approved = call(sig="charge", repeats=2, ikey=parked[1]["ikey"], now=NOW + 60_000)
    assert store.apply([approved]) == [{"ok": True, "attempt": 1}]
    assert store.run_counters(TENANT, "run-1", NOW)["sig:charge"] == 2
    third = call(sig="charge", repeats=2, now=NOW + 70_000)
    assert whys(store.apply([third])) == ["loop"]


def _lapse(parked: tuple[str, Item], pos: str = "", attempt: int = 1) -> tuple[str, Item]:
    """The end of the request ``parked`` waits for; one parked with a request id (``rid``)
    names it, as the processor's parked entries do, else only its deadline, as an entry an
    earlier version parked does."""
    tenant, c = parked
    entry = {"tenant_id": tenant, "idempotency_key": c["ikey"], "payload_hash": c["hash"],
             "expires_at": c["deadline"], "proposal_id": c["call"]}  # fmt: skip
    if c.get("rid"):
        entry.update({"first_request_id": c["rid"], "attempt": attempt})
    return lapse_item(entry, pos or f"a/0/{next(_pos)}", NOW)


def test_a_parked_call_whose_request_ends_gives_back_what_it_took(store: AdmissionStore) -> None:
    """Declined or lapsed, a parked call never ran: its class budget, cost, day cost, rate
    arrival and loop-guard count come back, once; its step stays. Its key stays in flight
    until the request's deadline plus the grace, then the same call is a new attempt,
    charged as one: with a budget of one, it parks again instead of running out."""
    limits = {"sig": "charge", "group": "financial", "class_budget": 1, "cost": 2.0,
              "cost_cap": 3.0, "day_cap": 10.0, "rate": rate_of(60, 1), "tool": "charge",
              "repeats": 2}  # fmt: skip
    parked = call(park=True, deadline=NOW + 600_000, **limits)
    assert whys(store.apply([parked])) == [None]
    taken = store.run_counters(TENANT, "run-1", NOW)
    assert taken == {"steps": 1.0, "class:financial": 1.0, "cost": 2.0, "sig:charge": 1.0}
    assert store.day_cost(TENANT, limits_day := parked[1]["day"]) == 2.0
    lapse = _lapse(parked)
    assert store.apply([lapse]) == [{"status": "lapsed"}]
    assert store.run_counters(TENANT, "run-1", NOW) == {"steps": 1.0}
    assert store.day_cost(TENANT, limits_day) == 0.0
    assert store.apply([lapse]) == [{"status": "lapsed"}]  # its replay: nothing twice
    assert store.run_counters(TENANT, "run-1", NOW) == {"steps": 1.0}
    record = store.record(TENANT, parked[1]["ikey"], NOW)
    assert (record["state"], record["awaiting"]) == ("PENDING", "0")
    key = parked[1]["ikey"]
    early = call(park=True, ikey=key, now=NOW + 600_500, deadline=NOW + 1_200_000, **limits)
    assert whys(store.apply([early])) == ["in_flight"]
    again = call(park=True, ikey=key, now=NOW + 601_001, deadline=NOW + 1_200_000, **limits)
    assert store.apply([again]) == [{"ok": True, "attempt": 2}]
    assert store.run_counters(TENANT, "run-1", NOW)["class:financial"] == 1.0
    # The first request's lapse again, late (a fresh position): the second attempt, parked
    # until another deadline, keeps what it took.
    assert store.apply([_lapse(parked)]) == [{"status": "unchanged"}]
    assert store.run_counters(TENANT, "run-1", NOW)["class:financial"] == 1.0
    assert store.apply([_lapse(again)]) == [{"status": "lapsed"}]
    assert "class:financial" not in store.run_counters(TENANT, "run-1", NOW)


def test_a_lapsed_parked_call_is_given_back_once_whatever_its_position_is_decided_as_later(
    store: AdmissionStore,
) -> None:
    """The request can end (expiry, an operator's decline) before the batch that parked
    the call commits: the parked position is then decided again. Whether as nothing
    (withdraw: its token expired), another call or a refusal (a changed replay), or alone
    on a defect (void), the take the lapse gave back is not given back again, and what the
    run's other calls took stays taken."""
    limits = {"sig": "charge", "group": "financial", "class_budget": 2, "cost": 2.0}
    for replay in ("withdraw", "changed", "void"):
        run = f"run-{replay}"
        other = call(run=run, **limits)
        parked = call(run=run, park=True, deadline=NOW + 600_000, **limits)
        assert whys(store.apply([other, parked])) == [None, None]
        assert store.apply([_lapse(parked)]) == [{"status": "lapsed"}]
        kept = store.run_counters(TENANT, run, NOW)
        assert (kept["class:financial"], kept["cost"], kept["sig:charge"]) == (1.0, 2.0, 1.0)
        pos = parked[1]["pos"]
        if replay == "withdraw":
            assert store.apply([withdraw_item(TENANT, pos, run, NOW)]) == [{"status": "none"}]
        elif replay == "changed":
            assert whys(store.apply([step(repair=False, run=run, pos=pos)])) == [None]
        else:
            voided = void_item(parked[1])
            assert voided is not None
            store.apply([(TENANT, voided)])
        assert store.run_counters(TENANT, run, NOW) == kept, replay


def test_a_lapse_keeps_the_rate_limit_arrival(store: AdmissionStore) -> None:
    """GCRA cannot tell the parked call's arrival from the calls since: given back minutes
    later, it would let the next call through faster than the rate."""
    rate = rate_of(window_sec=60, max_requests=1)
    parked = call(tool="charge", rate=rate, park=True, deadline=NOW + 600_000)
    assert whys(store.apply([parked])) == [None]
    later = call(tool="charge", rate=rate, now=NOW + 590_000)
    assert whys(store.apply([later])) == [None]
    assert store.apply([_lapse(parked)]) == [{"status": "lapsed"}]
    too_soon = call(tool="charge", rate=rate, now=NOW + 600_000)
    assert whys(store.apply([too_soon])) == ["rate_limited"]


def test_a_resubmission_given_back_after_its_request_ended_waits_for_nobody(
    store: AdmissionStore,
) -> None:
    """Resubmitted with approvals, the call took its key over; its request then ended
    ("superseded": the resubmission was another proposal); then the resubmission's position
    was decided again as nothing. Nobody can approve the call any more: its record does not
    wait for approval, and what parking it took comes back."""
    parked, approved = _resubmitted(store)
    key = parked[1]["ikey"]
    assert store.apply([_lapse(parked)]) == [{"status": "superseded"}]
    assert store.run_counters(TENANT, "run-1", NOW)["class:financial"] == 1.0
    gone = withdraw_item(TENANT, approved[1]["pos"], "run-1", NOW + 61_000)
    assert store.apply([gone]) == [{"status": "withdrawn"}]
    record = store.record(TENANT, key, NOW)
    assert (record["state"], record["awaiting"]) == ("PENDING", "0")
    assert record["deadline"] == str(NOW + 600_000)  # in flight until then, as it was
    assert "class:financial" not in store.run_counters(TENANT, "run-1", NOW)


def test_a_lapse_marker_is_dropped_with_its_partitions_committed_positions(
    store: AdmissionStore,
) -> None:
    parked = call(park=True, deadline=NOW + 600_000)
    store.apply([parked])
    tenant, lapse = _lapse(parked, "tool.approvals/0/5")
    assert store.apply([(tenant, lapse)]) == [{"status": "lapsed"}]
    done = f"{store._base(TENANT)}:done"
    assert store.client.hget(done, "tool.approvals/0/5") == b"lapsed"
    assert store.forget_committed({("tool.approvals", 0): 6}) >= 1
    assert store.client.hget(done, "tool.approvals/0/5") is None


def _resubmitted(store: AdmissionStore) -> tuple[tuple[str, Item], tuple[str, Item]]:
    """A financial call (a budget of one) parked, then sent again with its approvals a
    minute later, which takes its key over: (the parked call, the resubmission)."""
    limits = {"sig": "charge", "group": "financial", "class_budget": 1}
    parked = call(park=True, deadline=NOW + 600_000, **limits)
    assert whys(store.apply([parked])) == [None]
    approved = call(ikey=parked[1]["ikey"], now=NOW + 60_000, **limits)
    assert store.apply([approved]) == [{"ok": True, "attempt": 1}]
    return parked, approved


@pytest.mark.parametrize("goes", ["resubmitted", "released"])
def test_a_parked_call_that_went_is_not_given_back_by_a_replay_of_its_park(
    store: AdmissionStore, goes: str
) -> None:
    """The park's batch aborted; meanwhile the call went (resubmitted with approvals, or
    released by its approvers), and ran. The park's position decided again as nothing, or
    as a refusal, gives nothing back and leaves the running call's record alone: its
    result still settles it (else the key would be retryable and the call run twice)."""
    if goes == "resubmitted":
        parked, went = _resubmitted(store)
    else:
        parked = call(sig="charge", group="financial", class_budget=1, park=True,
                      deadline=NOW + 600_000)  # fmt: skip
        store.apply([parked])
        c = parked[1]
        went = (TENANT, {"kind": "release", "pos": f"a/0/{next(_pos)}", "run": "run-1",
                         "ikey": c["ikey"], "hash": c["hash"], "call": c["call"],
                         "deadline": NOW + 70_000, "ttl": 3_600_000,
                         "now": NOW + 60_000})  # fmt: skip
        assert store.apply([went]) == [{"ok": True, "attempt": 1}]
    key, pos = parked[1]["ikey"], parked[1]["pos"]
    taken = store.run_counters(TENANT, "run-1", NOW)
    assert store.apply([withdraw_item(TENANT, pos, "run-1", NOW)]) == [{"status": "none"}]
    assert whys(store.apply([step(repair=False, pos=pos)])) == [None]
    assert store.run_counters(TENANT, "run-1", NOW) == taken
    assert store.record(TENANT, key, NOW)["state"] == "PENDING"
    if goes == "resubmitted":
        assert store.apply([result(went)]) == [{"status": "settled"}]
        assert store.record(TENANT, key, NOW)["state"] == "COMPLETED"


def test_an_older_request_ended_late_leaves_a_newer_park_alone(store: AdmissionStore) -> None:
    """The first park lapsed unseen (its expiry check late); the key was parked again,
    which gives the first park's take back, and resubmitted. The first request's end, come
    at last, answers its proposal ("lapsed": it has had no final answer) and gives nothing
    back twice; a give-back of the resubmission still waits for the second request's
    approvers."""
    limits = {"sig": "charge", "group": "financial", "class_budget": 2, "cost": 2.0}
    first = call(park=True, deadline=NOW + 60_000, **limits)
    key = first[1]["ikey"]
    store.apply([first])
    second = call(park=True, ikey=key, now=NOW + 62_000, deadline=NOW + 600_000, **limits)
    assert store.apply([second]) == [{"ok": True, "attempt": 2}]
    assert store.run_counters(TENANT, "run-1", NOW)["cost"] == 2.0  # the first's came back
    approved = call(ikey=key, now=NOW + 63_000, **limits)
    assert store.apply([approved]) == [{"ok": True, "attempt": 2}]
    assert store.apply([_lapse(first)]) == [{"status": "lapsed"}]
    assert store.run_counters(TENANT, "run-1", NOW)["cost"] == 2.0
    voided = void_item(approved[1])
    assert voided is not None
    assert store.apply([(TENANT, voided)]) == [{"status": "voided"}]
    record = store.record(TENANT, key, NOW)
    assert (record["awaiting"], record["deadline"]) == ("1", str(NOW + 600_000))
    assert store.apply([_lapse(second)]) == [{"status": "lapsed"}]
    assert "cost" not in store.run_counters(TENANT, "run-1", NOW)


def test_a_request_that_ends_after_its_call_went_ahead_gives_nothing_back(
    store: AdmissionStore,
) -> None:
    """Resubmitted with its approvals, the parked call took its key over and runs: the
    request's later end is "superseded" (the resubmission was another proposal, so the
    parked one is told so: see app.py, _end_requests), and what the call took stays
    taken."""
    parked, _ = _resubmitted(store)
    key = parked[1]["ikey"]
    assert store.apply([_lapse(parked)]) == [{"status": "superseded"}]
    assert store.run_counters(TENANT, "run-1", NOW)["class:financial"] == 1.0
    other = call(hash="h2", ikey=key, park=True, deadline=NOW + 600_000)
    assert store.apply([_lapse(other)]) == [{"status": "unchanged"}]  # another payload
    assert store.apply([_lapse(call(park=True))]) == [{"status": "unchanged"}]  # no record


@pytest.mark.parametrize("replay", ["withdraw", "changed", "void"])
def test_a_request_that_ends_after_its_park_was_given_back_on_replay_is_not_moved_on(
    store: AdmissionStore, replay: str
) -> None:
    """The park's batch aborted, and its position was decided again as something else
    (its token expired, a changed call, or alone on a defect): the parked call never ran,
    its take came back and its record is retryable, while its request stayed parked. That
    request's end finds the park given back already: not "moved_on" (which tells its
    approver the call went ahead with approvals attached), and nothing comes back twice."""
    limits = {"sig": "charge", "group": "financial", "class_budget": 2, "cost": 2.0}
    other = call(**limits)
    parked = call(park=True, deadline=NOW + 600_000, **limits)
    assert whys(store.apply([other, parked])) == [None, None]
    pos, key = parked[1]["pos"], parked[1]["ikey"]
    if replay == "withdraw":
        assert store.apply([withdraw_item(TENANT, pos, "run-1", NOW)]) == [{"status": "withdrawn"}]
    elif replay == "changed":
        assert whys(store.apply([step(repair=False, pos=pos)])) == [None]
    else:
        voided = void_item(parked[1])
        assert voided is not None
        assert store.apply([(TENANT, voided)]) == [{"status": "voided"}]
    assert store.record(TENANT, key, NOW)["state"] == "FAILED_RETRYABLE"
    kept = store.run_counters(TENANT, "run-1", NOW)
    assert (kept["class:financial"], kept["cost"], kept["sig:charge"]) == (1.0, 2.0, 1.0)
    assert store.apply([_lapse(parked)]) == [{"status": "given_back"}]
    assert store.run_counters(TENANT, "run-1", NOW) == kept
    assert store.record(TENANT, key, NOW)["state"] == "FAILED_RETRYABLE"


def test_a_release_of_a_park_given_back_on_replay_is_given_back_not_superseded(
    store: AdmissionStore,
) -> None:
    """Its approvers release a call whose park was given back (its batch aborted and its
    position was decided as something else, which answered its proposal): not
    "superseded" (answered as in flight: wait for a result that never comes)."""
    parked = call(park=True, deadline=NOW + 600_000, group="financial", class_budget=1)
    assert whys(store.apply([parked])) == [None]
    c = parked[1]
    assert whys(store.apply([step(repair=False, pos=c["pos"])])) == [None]
    release = {"kind": "release", "pos": f"a/0/{next(_pos)}", "run": "run-1",
               "ikey": c["ikey"], "hash": c["hash"], "call": c["call"], "deadline": NOW + 70_000,
               "ttl": 3_600_000, "parked_until": c["deadline"]}  # fmt: skip
    assert whys(store.apply([(TENANT, release)])) == ["given_back"]
    assert store.record(TENANT, c["ikey"], NOW)["state"] == "FAILED_RETRYABLE"
    # Another request's release under the key (parked until another deadline) is not it.
    other = {**release, "pos": f"a/0/{next(_pos)}", "parked_until": NOW + 1}
    assert whys(store.apply([(TENANT, other)])) == ["superseded"]


def _release(parked: tuple[str, Item], attempt: int = 1, **kw: Any) -> tuple[str, Item]:
    """Its approvers' release of the request ``parked`` waits for (see _lapse)."""
    tenant, c = parked
    item = {"kind": "release", "pos": f"a/0/{next(_pos)}", "now": NOW, "run": c["run"],
            "ikey": c["ikey"], "hash": c["hash"], "call": c["call"], "deadline": NOW + 70_000,
            "ttl": 3_600_000, "parked_until": c["deadline"], "rid": c.get("rid", ""),
            "attempt": attempt}  # fmt: skip
    item.update(kw)
    return tenant, item


@pytest.mark.parametrize("end", ["release", "lapse"])
@pytest.mark.parametrize("given_back", ["changed", "withdraw"])
@pytest.mark.parametrize("same_proposal", [True, False])
def test_the_end_of_a_request_given_back_leaves_a_later_park_of_its_key_alone(
    store: AdmissionStore, end: str, given_back: str, same_proposal: bool
) -> None:
    """Parked (request R1), then given back: its batch aborted and its position was decided
    again as something else, which answered its proposal. Its key is parked again (R2: the
    same proposal sent again, asking afresh under a reissued id, or another proposal). R1's
    end (a release, a rejection, its expiry) finds its park given back: it answers nothing
    a second time, and R2's park waits on, for R2 alone."""
    limits = {"sig": "charge", "group": "financial", "class_budget": 2, "cost": 2.0}
    first = call(park=True, rid="req_first", deadline=NOW + 600_000, **limits)
    assert whys(store.apply([first])) == [None]
    pos, key = first[1]["pos"], first[1]["ikey"]
    if given_back == "changed":
        assert whys(store.apply([step(repair=False, pos=pos)])) == [None]
    else:
        assert store.apply([withdraw_item(TENANT, pos, "run-1", NOW)]) == [{"status": "withdrawn"}]
    assert store.record(TENANT, key, NOW)["state"] == "FAILED_RETRYABLE"
    again = {"call": first[1]["call"], "rid": "req_first"} if same_proposal else {"rid": "req_2"}
    second = call(park=True, ikey=key, now=NOW + 1000, deadline=NOW + 601_000, **limits, **again)
    assert store.apply([second]) == [{"ok": True, "attempt": 2}]
    taken = store.run_counters(TENANT, "run-1", NOW)
    if end == "release":
        assert whys(store.apply([_release(first)])) == ["given_back"]
    else:  # (rejected or expired)
        assert store.apply([_lapse(first)]) == [{"status": "given_back"}]
    record = store.record(TENANT, key, NOW)
    assert (record["state"], record["awaiting"], record["attempt"]) == ("PENDING", "1", "2")
    assert store.run_counters(TENANT, "run-1", NOW) == taken
    # R2's own end ends R2's park, once.
    assert store.apply([_lapse(second, attempt=2)]) == [{"status": "lapsed"}]
    assert "class:financial" not in store.run_counters(TENANT, "run-1", NOW)


@pytest.mark.parametrize("next_attempt", ["parked", "routed"])
def test_a_request_that_lapsed_unseen_still_answers_its_proposal_when_it_ends(
    store: AdmissionStore, next_attempt: str
) -> None:
    """Parked (R1); its expiry check is late, and past its deadline and the grace another
    attempt takes the key: parked afresh (R2), or routed for another run with approvals
    attached. That attempt gave R1's take back, but R1's proposal was told only that it
    waits: R1's end, when it comes, is its final answer ("lapsed"), once, and gives
    nothing back twice; R2 waits on."""
    limits = {"sig": "charge", "group": "financial", "class_budget": 2, "cost": 2.0}
    first = call(park=True, rid="req_first", deadline=NOW + 60_000, **limits)
    assert whys(store.apply([first])) == [None]
    key = first[1]["ikey"]
    if next_attempt == "parked":
        later = call(park=True, ikey=key, rid="req_2", now=NOW + 62_000,
                     deadline=NOW + 662_000, **limits)  # fmt: skip
    else:
        later = call(ikey=key, run="run-2", now=NOW + 62_000, approvals=["appr-1"],
                     approvals_ttl=3_600_000, **limits)  # fmt: skip
    assert store.apply([later]) == [{"ok": True, "attempt": 2}]
    kept = store.run_counters(TENANT, "run-1", NOW)
    # R1's take came back when the key moved on (what run-1 holds now is R2's).
    assert kept.get("cost") == (2.0 if next_attempt == "parked" else None)
    end = _lapse(first)
    assert store.apply([end]) == [{"status": "lapsed"}]
    assert store.apply([end]) == [{"status": "lapsed"}]  # its replay
    assert store.run_counters(TENANT, "run-1", NOW) == kept
    record = store.record(TENANT, key, NOW)
    assert record["awaiting"] == ("1" if next_attempt == "parked" else "0")
    assert "unseen_ends" not in record  # (R1's end is seen: nothing of it is kept)
    if next_attempt == "parked":
        assert store.apply([_lapse(later, attempt=2)]) == [{"status": "lapsed"}]


def test_an_attempt_refused_past_a_lapsed_park_leaves_its_take_to_the_requests_end(
    store: AdmissionStore,
) -> None:
    """Parked (R1), its expiry check late; past its deadline and the grace another run's
    attempt under the key is refused (that run is out of its class budget). R1's take is
    given back once, by R1's end: the refused attempt writes no record, so a give-back of
    its own would have left the park's take in Redis for the end to give back again, out
    of what the run's other calls took."""
    limits = {"group": "financial", "class_budget": 5, "cost": 2.0}
    kept = call(sig="kept", **limits)  # another call of run-1, which stays counted
    first = call(park=True, rid="req_first", sig="parked", deadline=NOW + 60_000, **limits)
    assert whys(store.apply([kept, first])) == [None, None]
    key = first[1]["ikey"]
    later = call(ikey=key, run="run-2", now=NOW + 62_000, **{**limits, "class_budget": 0})
    assert whys(store.apply([later])) == ["class_budget"]
    assert store.apply([_lapse(first)]) == [{"status": "lapsed"}]
    counters = store.run_counters(TENANT, "run-1", NOW)
    assert (counters.get("class:financial"), counters.get("cost")) == (1, 2.0)


def test_a_request_whose_resubmission_went_ahead_and_let_its_key_go_is_still_superseded(
    store: AdmissionStore,
) -> None:
    """Parked (R1), resubmitted with approvals by another proposal, which ran and failed
    retryably; the key then went to a later attempt before R1 ended. R1's end still knows
    that its key went ahead as another proposal: its own proposal is told so, once."""
    limits = {"sig": "charge", "group": "financial", "class_budget": 2}
    parked = call(park=True, rid="req_first", deadline=NOW + 600_000, **limits)
    assert whys(store.apply([parked])) == [None]
    key = parked[1]["ikey"]
    approved = call(ikey=key, now=NOW + 60_000, **limits)
    assert store.apply([approved]) == [{"ok": True, "attempt": 1}]
    assert store.apply([result(approved, state="FAILED_RETRYABLE")]) == [{"status": "settled"}]
    later = call(ikey=key, now=NOW + 90_000, **limits)
    assert store.apply([later]) == [{"ok": True, "attempt": 2}]
    assert whys(store.apply([_release(parked)])) == ["superseded"]
    assert store.apply([_lapse(parked)]) == [{"status": "given_back"}]  # (ended once only)


def test_a_release_and_a_lapse_at_one_position_read_each_others_verdicts(
    store: AdmissionStore,
) -> None:
    """A release and a lapse share the approval record's position, and a replay sends one
    or the other as the recheck goes: each answers as the other did the first time (a
    park given back, a key gone ahead), so a proposal answered already is not answered
    again; and a release answered given back answers the same on its replay."""
    parked = call(park=True, deadline=NOW + 600_000, group="financial", class_budget=1)
    assert whys(store.apply([parked])) == [None]
    c = parked[1]
    assert whys(store.apply([step(repair=False, pos=c["pos"])])) == [None]  # given back
    release = {"kind": "release", "pos": f"a/0/{next(_pos)}", "run": "run-1",
               "ikey": c["ikey"], "hash": c["hash"], "call": c["call"], "deadline": NOW + 70_000,
               "ttl": 3_600_000, "parked_until": c["deadline"]}  # fmt: skip
    assert whys(store.apply([(TENANT, release)])) == ["given_back"]
    assert whys(store.apply([(TENANT, release)])) == ["given_back"]  # its replay
    assert store.apply([_lapse(parked, release["pos"])]) == [{"status": "given_back"}]
    # The other order: the lapse first, then the release at its position.
    pos = f"a/0/{next(_pos)}"
    assert store.apply([_lapse(parked, pos)]) == [{"status": "given_back"}]
    assert whys(store.apply([(TENANT, {**release, "pos": pos})])) == ["given_back"]
    # A key gone ahead as another proposal: superseded for either, either way.
    gone, _ = _resubmitted(store)
    g = gone[1]
    went = {**release, "pos": f"a/0/{next(_pos)}", "ikey": g["ikey"], "hash": g["hash"],
            "call": g["call"], "parked_until": g["deadline"]}  # fmt: skip
    assert whys(store.apply([(TENANT, went)])) == ["superseded"]
    assert store.apply([_lapse(gone, went["pos"])]) == [{"status": "superseded"}]
    pos = f"a/0/{next(_pos)}"
    assert store.apply([_lapse(gone, pos)]) == [{"status": "superseded"}]
    assert whys(store.apply([(TENANT, {**went, "pos": pos})])) == ["superseded"]
    # Gone ahead as this very proposal sent again: moved on for either, either way.
    own = call(park=True, deadline=NOW + 600_000)
    assert whys(store.apply([own])) == [None]
    o = own[1]
    again = call(ikey=o["ikey"], call=o["call"], now=NOW + 1000)
    assert whys(store.apply([again])) == [None]
    went = {**went, "pos": f"a/0/{next(_pos)}", "ikey": o["ikey"], "call": o["call"],
            "parked_until": o["deadline"]}  # fmt: skip
    assert whys(store.apply([(TENANT, went)])) == ["moved_on"]
    assert store.apply([_lapse(own, went["pos"])]) == [{"status": "moved_on"}]
    pos = f"a/0/{next(_pos)}"
    assert store.apply([_lapse(own, pos)]) == [{"status": "moved_on"}]
    assert whys(store.apply([(TENANT, {**went, "pos": pos})])) == ["moved_on"]


def test_a_release_that_went_then_is_refused_on_its_replay_gives_back_the_park(
    store: AdmissionStore,
) -> None:
    """Released and routed, then its batch aborted (the call never ran), and on the replay
    the recheck refuses it: the lapse at the release's position undoes the release once,
    and what parking took comes back (with a budget of one, the run could otherwise make
    no other call of the class)."""
    limits = {"sig": "charge", "group": "financial", "class_budget": 1, "cost": 2.0}
    parked = call(park=True, deadline=NOW + 600_000, **limits)
    assert whys(store.apply([parked])) == [None]
    c = parked[1]
    pos = f"a/0/{next(_pos)}"
    release = {"kind": "release", "pos": pos, "now": NOW, "run": "run-1", "ikey": c["ikey"],
               "hash": c["hash"], "call": c["call"], "deadline": NOW + 70_000,
               "ttl": 3_600_000, "parked_until": c["deadline"]}  # fmt: skip
    assert store.apply([(TENANT, release)]) == [{"ok": True, "attempt": 1}]
    assert store.run_counters(TENANT, "run-1", NOW)["class:financial"] == 1.0
    assert store.apply([_lapse(parked, pos)]) == [{"status": "lapsed"}]
    kept = store.run_counters(TENANT, "run-1", NOW)
    assert "class:financial" not in kept and "cost" not in kept, kept
    assert store.apply([_lapse(parked, pos)]) == [{"status": "lapsed"}]  # once
    assert store.run_counters(TENANT, "run-1", NOW) == kept
    assert whys(store.apply([(TENANT, release)])) == ["replay_changed"]
    assert "class:financial" not in store.run_counters(TENANT, "run-1", NOW)
    another = call(**limits)
    assert whys(store.apply([another])) == [None]
    assert store.run_counters(TENANT, "run-1", NOW)["class:financial"] == 1.0


def test_a_released_call_whose_approval_record_failed_alone_does_not_hold_its_key(
    store: AdmissionStore,
) -> None:
    """Released and routed in Redis, then its approval record failed alone on a defect: the
    call was never routed, and its proposal is answered UNKNOWN_ERROR. Its record must not
    stay in flight as routed (a retry met IDEMPOTENCY_CONFLICT until its deadline, and one
    after it was charged again), and what parking took comes back, once (with a budget of
    one, the run could otherwise make no other call of the class)."""
    limits = {"sig": "charge", "group": "financial", "class_budget": 1, "cost": 2.0}
    parked = call(park=True, rid="req-1", deadline=NOW + 600_000, **limits)
    assert whys(store.apply([parked])) == [None]
    key = parked[1]["ikey"]
    released = _release(parked)
    # A release not admitted at its position holds nothing: its void changes nothing.
    unadmitted = void_item(_release(parked)[1])
    assert unadmitted is not None and unadmitted["released"] is True
    assert store.apply([(TENANT, unadmitted)]) == [{"status": "unchanged"}]
    assert store.apply([released]) == [{"ok": True, "attempt": 1}]
    assert store.run_counters(TENANT, "run-1", NOW)["class:financial"] == 1.0
    void = void_item(released[1])
    assert void is not None

    assert store.apply([(TENANT, void)]) == [{"status": "voided"}]
    record = store.record(TENANT, key, NOW)
    assert (record["state"], record["awaiting"], record["unrouted"]) == (
        "FAILED_RETRYABLE", "0", "1"
    )  # fmt: skip
    assert "released_took" not in record and "parked_took" not in record
    # The park's step stays: it was a proposal of its run.
    given_back = store.run_counters(TENANT, "run-1", NOW)
    assert given_back == {"steps": 1}, given_back
    assert store.apply([(TENANT, void)]) == [{"status": "voided"}]  # idempotent: it says so
    # A replay of its batch refuses the release too, even should the defect not recur; and
    # decided then as its request's end (refused at its recheck) gives back nothing twice.
    assert whys(store.apply([released])) == ["voided"]
    assert whys(store.apply([_lapse(parked, released[1]["pos"])])) == ["voided"]
    assert store.run_counters(TENANT, "run-1", NOW) == given_back
    # Nothing ran: proposed again under its key, the call parks afresh, charged as new.
    again = call(ikey=key, park=True, rid="req-2", deadline=NOW + 600_000, **limits)
    assert store.apply([again]) == [{"ok": True, "attempt": 2}]
    assert store.run_counters(TENANT, "run-1", NOW)["class:financial"] == 1.0


def test_a_release_refused_as_superseded_ends_the_request_for_the_resubmission(
    store: AdmissionStore,
) -> None:
    """Resubmitted with approvals, the call took its key over; its approvers then released
    the request, too late ("superseded"): the request has ended, as if it had lapsed
    ("moved_on"). The resubmission's position decided again as nothing then: nobody can
    approve the call any more, so its record does not wait for approval, and what parking
    it took comes back."""
    parked, approved = _resubmitted(store)
    c = parked[1]
    release = (TENANT, {"kind": "release", "pos": f"a/0/{next(_pos)}", "now": NOW + 62_000,
                        "run": "run-1", "ikey": c["ikey"], "hash": c["hash"],
                        "call": c["call"], "deadline": NOW + 70_000, "ttl": 3_600_000,
                        "parked_until": c["deadline"]})  # fmt: skip
    assert whys(store.apply([release])) == ["superseded"]
    assert store.record(TENANT, c["ikey"], NOW)["request_ended"] == "1"
    assert store.run_counters(TENANT, "run-1", NOW)["class:financial"] == 1.0
    gone = withdraw_item(TENANT, approved[1]["pos"], "run-1", NOW + 63_000)
    assert store.apply([gone]) == [{"status": "withdrawn"}]
    record = store.record(TENANT, c["ikey"], NOW)
    assert (record["state"], record["awaiting"]) == ("PENDING", "0")
    assert record["deadline"] == str(NOW + 600_000)  # in flight until then, as it was
    assert "class:financial" not in store.run_counters(TENANT, "run-1", NOW)
    # Sent again with approvals before then, it is in flight: its request has ended.
    again = call(ikey=c["ikey"], now=NOW + 64_000, sig="charge", group="financial",
                 class_budget=1)  # fmt: skip
    assert whys(store.apply([again])) == ["in_flight"]


def test_a_release_refused_as_superseded_leaves_another_requests_resubmission_alone(
    store: AdmissionStore,
) -> None:
    """The key's record was taken over by the resubmission of another request (parked
    until another deadline): a late release of this one ends nothing of that one's."""
    parked, approved = _resubmitted(store)
    c = parked[1]
    release = (TENANT, {"kind": "release", "pos": f"a/0/{next(_pos)}", "now": NOW + 62_000,
                        "run": "run-1", "ikey": c["ikey"], "hash": c["hash"],
                        "call": c["call"], "deadline": NOW + 70_000, "ttl": 3_600_000,
                        "parked_until": c["deadline"] - 1})  # fmt: skip
    assert whys(store.apply([release])) == ["superseded"]
    assert "request_ended" not in store.record(TENANT, c["ikey"], NOW)
    gone = withdraw_item(TENANT, approved[1]["pos"], "run-1", NOW + 63_000)
    assert store.apply([gone]) == [{"status": "withdrawn"}]
    assert store.record(TENANT, c["ikey"], NOW)["awaiting"] == "1"


def test_a_resubmission_given_back_waits_for_approval_and_can_still_lapse(
    store: AdmissionStore,
) -> None:
    """A resubmission carrying approvals, admitted, then decided as something else on
    replay, gives its key back to the parked call; that call's request lapsing later
    still gives back what the call took when it was parked."""
    parked, approved = _resubmitted(store)
    key = parked[1]["ikey"]
    changed = step(repair=False, pos=approved[1]["pos"])
    assert whys(store.apply([changed])) == [None]  # decided as a refusal this time
    record = store.record(TENANT, key, NOW)
    assert (record["state"], record["awaiting"]) == ("PENDING", "1")
    assert store.apply([_lapse(parked)]) == [{"status": "lapsed"}]
    assert "class:financial" not in store.run_counters(TENANT, "run-1", NOW)


def test_a_call_whose_position_asks_nothing_on_replay_gives_back_what_it_took(
    store: AdmissionStore,
) -> None:
    """Admitted, its transaction aborted, then decided again as nothing admission counts
    (its token expired meanwhile): the call never ran. What it took comes back, once, its
    record becomes retryable, and its position answers a later replay as a call with a
    refusal (it is proposed again) and as a refused proposal with a pass."""
    limits = {"sig": "refund", "group": "financial", "class_budget": 1, "cost": 2.0}
    admitted = call(**limits)
    pos, key = admitted[1]["pos"], admitted[1]["ikey"]
    assert store.apply([admitted]) == [{"ok": True, "attempt": 1}]
    withdraw = withdraw_item(TENANT, pos, "run-1", NOW)
    assert store.apply([withdraw]) == [{"status": "withdrawn"}]
    assert store.run_counters(TENANT, "run-1", NOW) == {"steps": 1.0}
    assert store.record(TENANT, key, NOW)["state"] == "FAILED_RETRYABLE"
    assert store.apply([withdraw]) == [{"status": "none"}]  # once
    assert whys(store.apply([call(pos=pos, ikey=key, **limits)])) == ["replay_changed"]
    assert whys(store.apply([step(pos=pos)])) == [None]
    assert store.run_counters(TENANT, "run-1", NOW) == {"steps": 1.0}
    # Retried under its key, it goes as its second attempt, charged once.
    assert store.apply([call(ikey=key, **limits)]) == [{"ok": True, "attempt": 2}]
    assert store.run_counters(TENANT, "run-1", NOW)["class:financial"] == 1.0


def test_a_position_never_admitted_is_withdrawn_without_a_trace(store: AdmissionStore) -> None:
    refused = step(repair=False)
    assert whys(store.apply([refused])) == [None]
    done = f"{store._base(TENANT)}:done"
    nothing = withdraw_item(TENANT, "t/0/999999", "run-1", NOW)
    stepped = withdraw_item(TENANT, refused[1]["pos"], "run-1", NOW)
    assert store.apply([nothing, stepped]) == [{"status": "none"}, {"status": "none"}]
    assert store.client.hget(done, "t/0/999999") is None  # no marker written for it
    assert store.run_counters(TENANT, "run-1", NOW) == {"steps": 1.0}


def test_a_withdrawn_resubmission_waits_for_its_approvers_again(store: AdmissionStore) -> None:
    parked, approved = _resubmitted(store)
    key = parked[1]["ikey"]
    gone = withdraw_item(TENANT, approved[1]["pos"], "run-1", NOW + 61_000)
    assert store.apply([gone]) == [{"status": "withdrawn"}]
    record = store.record(TENANT, key, NOW)
    assert (record["state"], record["awaiting"]) == ("PENDING", "1")
    assert store.run_counters(TENANT, "run-1", NOW)["class:financial"] == 1.0  # still parked


LAST_STEP = {"sig": "charge", "group": "financial", "class_budget": 1, "cost": 2.0,
             "cost_cap": 2.0, "day_cap": 2.0, "rate": rate_of(60, 1), "tool": "charge",
             "repeats": 1, "steps": 2}  # fmt: skip
"""A run of two steps whose second, a call parked for approval, uses up every limit."""


def _parked_at_the_last_step(
    store: AdmissionStore,
) -> tuple[tuple[str, Item], tuple[str, Item], dict[str, float]]:
    """(the parked call, its resubmission with approvals, what the park took)."""
    first = step(repair=False, steps=2)  # (a refused proposal: a step and nothing else)
    parked = call(park=True, deadline=NOW + 600_000, **LAST_STEP)
    assert whys(store.apply([first, parked])) == [None, None]
    taken = store.run_counters(TENANT, "run-1", NOW)
    assert taken == {"steps": 2.0, "class:financial": 1.0, "cost": 2.0, "sig:charge": 1.0}
    approved = call(ikey=parked[1]["ikey"], now=NOW + 30_000, deadline=NOW + 600_000,
                    approvals=["appr-1"], approvals_ttl=3_600_000, **LAST_STEP)  # fmt: skip
    return parked, approved, taken


def test_a_call_parked_at_its_runs_last_step_goes_when_resubmitted_with_its_approvals(
    store: AdmissionStore,
) -> None:
    """The park took the run's last step, and its class budget, cost, day's cost, rate
    arrival and loop-guard count. Resubmitted with its approvals, the same call reuses all
    of it and takes none of it again (as its release by the approvers would), so it goes.
    A replay of the resubmission's batch answers the same and counts nothing twice; what
    else the run proposes is past its cap."""
    parked, approved, taken = _parked_at_the_last_step(store)
    for _ in range(2):  # the resubmission, then its batch replayed after an abort
        assert store.apply([approved]) == [{"ok": True, "attempt": 1}]
        assert store.run_counters(TENANT, "run-1", NOW) == taken
        assert store.day_cost(TENANT, approved[1]["day"]) == 2.0
    record = store.record(TENANT, parked[1]["ikey"], NOW)
    assert (record["state"], record["awaiting"]) == ("PENDING", "0")
    # Sent once more, it is a proposal of its own: refused, and a step.
    copy = call(ikey=parked[1]["ikey"], now=NOW + 40_000, approvals=["appr-1"],
                approvals_ttl=3_600_000, **LAST_STEP)  # fmt: skip
    assert whys(store.apply([copy])) == ["in_flight"]
    assert store.run_counters(TENANT, "run-1", NOW) == {**taken, "steps": 3.0}
    assert whys(store.apply([call(steps=2, now=NOW + 40_000)])) == ["step_cap"]


@pytest.mark.parametrize("now", ["refused", "another_call", "void", "withdraw"])
def test_a_resubmission_that_does_not_go_after_all_counts_its_step_then(
    store: AdmissionStore, now: str
) -> None:
    """The resubmission's batch aborted, and its position is decided again as something
    else, or failed alone on a defect: the call never went, and waits for its approvers
    again. That position is then a proposal of its run as any other, and counts its step,
    once (past the cap here: a refused proposal is told so); a proposal whose token
    expired meanwhile (withdraw) spends nothing, as any unverified one. Resubmitted
    afresh, the call still goes, on the step its park took."""
    parked, approved, taken = _parked_at_the_last_step(store)
    key, pos = parked[1]["ikey"], approved[1]["pos"]
    assert store.apply([approved]) == [{"ok": True, "attempt": 1}]
    again: tuple[str, Item]
    if now == "refused":
        again, answer = step(repair=False, pos=pos, steps=2), ["step_cap"]
    elif now == "another_call":
        again = call(pos=pos, ikey=key, hash="h2", **LAST_STEP)
        answer = ["replay_changed"]
    elif now == "void":
        voided = void_item(approved[1])
        assert voided is not None
        again, answer = (TENANT, voided), [None]
    else:
        again, answer = withdraw_item(TENANT, pos, "run-1", NOW + 31_000), [None]
    steps = 2.0 if now == "withdraw" else 3.0
    for _ in range(2):  # once: decided again, it counts nothing more
        assert whys(store.apply([again])) == answer
        assert store.run_counters(TENANT, "run-1", NOW) == {**taken, "steps": steps}
        record = store.record(TENANT, key, NOW)
        assert (record["state"], record["awaiting"]) == ("PENDING", "1")
    fresh = call(ikey=key, now=NOW + 50_000, deadline=NOW + 600_000, approvals=["appr-1"],
                 approvals_ttl=3_600_000, **LAST_STEP)  # fmt: skip
    assert store.apply([fresh]) == [{"ok": True, "attempt": 1}]
    assert store.run_counters(TENANT, "run-1", NOW) == {**taken, "steps": steps}


@pytest.mark.parametrize("first", ["admitted", "parked_then_released", "parked_then_lapsed"])
def test_a_call_decided_again_as_a_repair_counts_the_repair_once(
    store: AdmissionStore, first: str
) -> None:
    """A call was admitted (or parked, and went or lapsed since); its batch's transaction
    aborted, and decided again a gate refuses it for its arguments (its order deleted
    meanwhile, a contract reloaded): a repair, counted once as any other, so the same
    invalid call again is a repair loop and the repair cap counts it."""
    admitted = call(park=first != "admitted", deadline=NOW + 600_000)
    pos = admitted[1]["pos"]
    assert whys(store.apply([admitted])) == [None]
    if first == "parked_then_released":
        c = admitted[1]
        release = {"kind": "release", "pos": f"a/0/{next(_pos)}", "run": "run-1",
                   "ikey": c["ikey"], "hash": c["hash"], "call": c["call"],
                   "deadline": NOW + 70_000, "ttl": 3_600_000, "now": NOW}  # fmt: skip
        assert store.apply([(TENANT, release)]) == [{"ok": True, "attempt": 1}]
    elif first == "parked_then_lapsed":
        assert store.apply([_lapse(admitted)]) == [{"status": "lapsed"}]
    repair = step("bad-1", pos=pos)
    for _ in range(2):  # counted once: a second replay answers the same, counts nothing
        assert whys(store.apply([repair])) == [None]
        counters = store.run_counters(TENANT, "run-1", NOW)
        assert (counters["steps"], counters["repairs"], counters["bad:bad-1"]) == (1, 1, 1)
    assert whys(store.apply([step("bad-1")])) == ["repair_loop"]
    assert whys(store.apply([step("bad-2"), step("bad-3")])) == [None, "repair_cap"]


def test_a_call_decided_again_as_a_repair_past_the_repair_cap_is_refused(
    store: AdmissionStore,
) -> None:
    spent = [step(f"bad-{i}") for i in range(3)]
    admitted = call()
    assert whys(store.apply([*spent, admitted])) == [None, None, None, None]
    assert whys(store.apply([step("bad-9", pos=admitted[1]["pos"])])) == ["repair_cap"]
    assert store.run_counters(TENANT, "run-1", NOW)["repairs"] == 3


def _awaiting_compensation(store: AdmissionStore, payload: str = "h-undo") -> tuple[str, str]:
    """A call that failed after a committed step, its compensation proposed with the
    payload hash ``payload``: (the call's key, the compensation's key)."""
    grant = '{"sub":"u-1","agent_id":"a-1","scope":"orders:refund","clearance":"internal"}'
    original = call(grant=grant)
    key = original[1]["ikey"]
    store.apply([original])
    assert store.record(TENANT, key, NOW)["grant"] == grant
    comp_key = "compensate:" + key
    settled = result(original, state="FAILED_FINAL", compensation_key=comp_key,
                     compensation_hash=payload, compensation_tool="refund_order")  # fmt: skip
    assert store.apply([settled]) == [{"status": "settled", "grant": grant}]
    assert "grant" not in store.record(TENANT, key, NOW)  # not kept once it was handed out
    assert store.record(TENANT, key, NOW)["compensation_hash"] == payload
    assert store.record(TENANT, key, NOW)["compensation_tool"] == "refund_order"
    return key, comp_key


def test_a_compensation_nobody_can_sign_escalates_and_a_retry_is_told_so(
    store: AdmissionStore,
) -> None:
    """A record an earlier version wrote keeps the caller's token, not its claims: the
    processor cannot sign the compensation. The record keeps the escalation as its answer
    (not the one that says a compensation is on its way), and names no compensation."""
    for kept in ("eyJhbGciOiJFZERTQSJ9.eyJzdWIiOiJ1In0.c2ln", ""):
        original = call(grant=kept)
        key = original[1]["ikey"]
        store.apply([original])
        settled = result(original, state="FAILED_FINAL", compensation_key="compensate:" + key,
                         compensation_hash="h-undo", compensation_tool="refund_order",
                         cached_unsigned='{"class":"COMPENSATION_FAILED"}')  # fmt: skip
        assert store.apply([settled]) == [{"status": "settled", "unsigned": True}]
        rec = store.record(TENANT, key, NOW)
        assert rec["cached"] == '{"class":"COMPENSATION_FAILED"}'
        assert "compensation" not in rec and "grant" not in rec
        assert store.apply([settled]) == [{"status": "settled", "unsigned": True}]  # replayed
    # With claims to sign with, the same result asks for the compensation.
    grant = '{"sub":"u-1","agent_id":"a-1","scope":"","clearance":"internal"}'
    original = call(grant=grant)
    store.apply([original])
    key = original[1]["ikey"]
    settled = result(original, state="FAILED_FINAL", compensation_key="compensate:" + key,
                     compensation_hash="h-undo", compensation_tool="refund_order",
                     cached_unsigned='{"class":"COMPENSATION_FAILED"}')  # fmt: skip
    assert store.apply([settled]) == [{"status": "settled", "grant": grant}]
    assert store.record(TENANT, key, NOW)["compensation"] == "compensate:" + key


def test_a_compensated_call_is_marked_once_its_compensation_completes(
    store: AdmissionStore,
) -> None:
    key, comp_key = _awaiting_compensation(store)
    compensation = call(ikey=comp_key, hash="h-undo", tool="refund_order")
    assert whys(store.apply([compensation])) == [None]
    done = store.apply([result(compensation, compensates=key)])
    assert done == [{"status": "settled", "compensated": key}]
    assert store.record(TENANT, key, NOW)["state"] == "COMPENSATED"
    [hit] = store.apply([call(ikey=key)])
    assert hit["why"] == "idempotent_hit" and hit["state"] == "COMPENSATED"
    # The compensation's own key answers from its record, as any other.
    [again] = store.apply([call(ikey=comp_key, hash="h-undo", tool="refund_order")])
    assert again["why"] == "idempotent_hit" and again["state"] == "COMPLETED"


def test_a_call_whose_compensation_failed_answers_a_retry_with_that(
    store: AdmissionStore,
) -> None:
    """The original's record cached "a compensation is on its way, wait" when the call
    failed. Once the compensation fails (its result) or a gate refuses it (comp_failed),
    a retry of the original is told so (COMPENSATION_FAILED), not to wait for ever."""
    key, comp_key = _awaiting_compensation(store)
    [hit] = store.apply([call(ikey=key)])
    assert (hit["why"], hit["state"]) == ("idempotent_hit", "FAILED_FINAL")
    compensation = call(ikey=comp_key, hash="h-undo", tool="refund_order")
    assert whys(store.apply([compensation])) == [None]
    failed = result(compensation, state="FAILED_FINAL", compensates=key)
    assert store.apply([failed]) == [{"status": "settled"}]
    assert store.record(TENANT, key, NOW)["compensation_failed"] == "1"
    [hit] = store.apply([call(ikey=key)])
    assert (hit["why"], hit["state"]) == ("idempotent_hit", "COMPENSATION_FAILED")
    assert store.record(TENANT, key, NOW)["state"] == "FAILED_FINAL"

    # Refused by a gate: the processor says so with a comp_failed item, idempotently; one
    # for a key whose record names no such compensation changes nothing.
    key, comp_key = _awaiting_compensation(store)
    refused = (TENANT, comp_failed_item(comp_key, "t/0/1"))
    assert store.apply([refused, refused]) == [{"status": "marked"}] * 2
    [hit] = store.apply([call(ikey=key)])
    assert hit["state"] == "COMPENSATION_FAILED"
    stray = (TENANT, comp_failed_item("compensate:" + uuid.uuid4().hex, "t/0/2"))
    assert store.apply([stray]) == [{"status": "unchanged"}]
    assert store.apply([(TENANT, comp_failed_item(key, "t/0/3"))]) == [{"status": "unchanged"}]

    # A compensation that completes after all (a copy the gate refused while the real one
    # ran) leaves the original compensated.
    compensation = call(ikey=comp_key, hash="h-undo", tool="refund_order")
    assert whys(store.apply([compensation])) == [None]
    assert store.apply([result(compensation, compensates=key)]) == [
        {"status": "settled", "compensated": key}
    ]
    [hit] = store.apply([call(ikey=key)])
    assert hit["state"] == "COMPENSATED"


def test_only_the_proposed_compensation_is_admitted_under_its_key(store: AdmissionStore) -> None:
    key, comp_key = _awaiting_compensation(store, payload="h-undo")
    # Another payload under the key (a refund to another account, say), or another tool
    # with the same payload: refused, and neither takes the key nor stops the real one.
    other = call(ikey=comp_key, hash="h-other", tool="refund_order")
    elsewhere = call(ikey=comp_key, hash="h-undo", tool="search_kb")
    assert whys(store.apply([other, elsewhere])) == ["compensation_unrequested"] * 2
    assert store.record(TENANT, comp_key, NOW) == {}
    assert store.record(TENANT, key, NOW)["compensation"] == comp_key
    assert whys(store.apply([call(ikey=comp_key, hash="h-undo", tool="refund_order")])) == [None]


def test_a_refused_compensation_is_checked_as_an_admitted_one(store: AdmissionStore) -> None:
    # Proposals an earlier gate refused are steps; under a compensation key Redis tells the
    # one the processor proposed (a failed compensation) from any other.
    key, comp_key = _awaiting_compensation(store, payload="h-undo")
    assert store.record(TENANT, key, NOW)["state"] == "FAILED_FINAL"
    fields = {"repair": False, "comp": comp_key, "comp_hash": "h-undo", "tool": "refund_order"}
    real = step(sig="s1", **fields)
    borrowed = [step(sig="s2", **{**fields, "comp_hash": "h-other"}),
                step(sig="s3", **{**fields, "tool": "search_kb"}),
                step(sig="s4", **{**fields, "comp": "compensate:nobody"})]  # fmt: skip
    assert whys(store.apply([real, *borrowed])) == [None] + ["compensation_unrequested"] * 3


def test_a_compensation_key_nobody_asked_for_is_refused(store: AdmissionStore) -> None:
    # A call still in flight, and one that failed with nothing to undo: no compensation
    # was proposed for either, so their compensation keys take nothing.
    pending = call()
    plain = call()
    store.apply([pending, plain])
    store.apply([result(plain, state="FAILED_FINAL")])
    ghost = f"never-used-{uuid.uuid4().hex}"
    borrowed = [call(ikey="compensate:" + k, hash="h1")
                for k in (pending[1]["ikey"], plain[1]["ikey"], ghost)]  # fmt: skip
    assert whys(store.apply(borrowed)) == ["compensation_unrequested"] * 3
    for _, item in borrowed:
        assert store.record(TENANT, item["ikey"], NOW) == {}
    assert store.record(TENANT, plain[1]["ikey"], NOW)["state"] == "FAILED_FINAL"
    assert store.record(TENANT, pending[1]["ikey"], NOW)["state"] == "PENDING"
    # Refused calls are still steps of their run.
    assert store.run_counters(TENANT, "run-1", NOW)["steps"] >= 5


def test_a_batch_of_calls_and_refusals_is_one_script_call() -> None:
    """A tenant's batch shares one header (one policy, one clock), so mixing calls and
    refused proposals must not split it into many script calls."""
    batch = [call() if i % 2 else step(f"s{i}", run=f"r{i}") for i in range(200)]
    assert len(_segments(batch)) == 1
    assert len(_segments([*batch, call(tenant="globex")])) == 2
    assert len(_segments([*batch, call(steps=5)])) == 2  # another limit: its own call


def test_the_benchmarks_calls_are_what_the_script_takes(store: AdmissionStore) -> None:
    """bench.admission builds its calls by hand: they must stay valid items."""
    batch = bench_calls(12, tenants=1)
    assert whys(store.apply([(TENANT, item) for _, item in batch])) == [None] * 12
