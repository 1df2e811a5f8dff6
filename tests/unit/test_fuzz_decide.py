"""Fuzzing the decision core: hostile records in, exactly one typed decision out.

Over 10,000 generated records per run (truncated, huge, deeply nested, invalid
UTF-8, lone surrogates, NaN, duplicate keys, wrong types, look-alike tool names,
broken model JSON) must each get one ``Decision``: a dead letter with a reason, a
rejection with a real taxonomy class and a next action, or a route, and a route
only for arguments the reference validator accepts. Every non-dead-letter
decision must encode to an observation that decodes back, and fit in a Kafka
message. The builders live in ``tests/strategies.py``.
"""

from __future__ import annotations

import json
import logging
import random
from collections import Counter
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis import strategies as st

from processor.codec.avro import codec
from processor.codec.records import dlq_headers, encode_approved_call, encode_observation
from processor.contracts.registry import ContractSet, load_contracts
from processor.gates.parse import Limits
from processor.gates.semantic import RefAnswers
from processor.model import Decision, Gate, Outcome, SourceRecord, TaxonomyClass
from processor.pipeline import Gates, decide
from tests.strategies import (
    BUILDERS,
    TOOLS,
    Case,
    Verdict,
    arbitrary_envelopes,
    b_deep,
    build,
    cases,
    corpus,
    envelope,
)
from tests.unit.helpers import CONTRACTS_DIR, references_in_record

CONTRACTS: ContractSet = load_contracts(CONTRACTS_DIR)
LIMITS = Limits()
GATES = Gates.development(CONTRACTS, LIMITS)
PASSED = (Outcome.ROUTED, Outcome.PARKED)
"""Through every gate: routed, or parked at the last one until someone approves."""
DECIDE_OUTCOMES = [o for o in Outcome if o not in (Outcome.IGNORED, Outcome.SETTLED)]
"""IGNORED is for approval decisions and SETTLED for results and idempotency hits, which
decide() never sees (they come from Redis state)."""


def _references(value: bytes | None) -> RefAnswers:
    """Reference data in which the ids a record names exist, in states its tool allows,
    so a valid call passes the semantic gates and the fuzzers reach the ones after."""
    return references_in_record(value, CONTRACTS)


NOW_MS = 1_700_000_000_000
FINGERPRINT = "sha256:0123456789abcdef"
# librdkafka's default message.max.bytes; an observation must fit in one record.
KAFKA_MESSAGE_MAX = 1_000_000
OBS = codec("observation")
CALL = codec("approved_call")


def fuzz(examples: int) -> settings:
    return settings(
        max_examples=examples,
        deadline=None,
        database=None,
        print_blob=True,  # with no database, the blob is what replays a failure
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                               HealthCheck.large_base_example],
    )  # fmt: skip


@pytest.fixture(autouse=True)
def _quiet_pipeline_log() -> Iterator[None]:
    """decide() logs a traceback when it fails closed; the assertions say it instead."""
    logger = logging.getLogger("processor.pipeline")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    yield
    logger.setLevel(level)


# -- the oracle ------------------------------------------------------------------------------


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    assert len(set(keys)) == len(keys), f"duplicate keys {keys}"
    return dict(pairs)


def _refuse_constant(name: str) -> Any:
    raise AssertionError(f"routed a record holding {name}")


def _strict(text: bytes | str) -> Any:
    """An independent strict parse: the standard library, no NaN, no duplicate keys."""
    if isinstance(text, bytes):
        text = text.decode("utf-8")  # strict: invalid UTF-8 raises
    return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_refuse_constant)


def _printable_id(v: Any) -> bool:
    return type(v) is str and 0 < len(v) <= 256 and v.isprintable()


def assert_really_routable(value: bytes, d: Decision) -> None:
    """A ROUTED record, re-checked without the processor's parser or fast validator."""
    env = _strict(value)
    assert type(env) is dict
    for name in ("run_id", "proposal_id", "tenant_id"):
        assert _printable_id(env.get(name)), f"routed with {name}={env.get(name)!r}"
    assert ("arguments" in env) != ("arguments_raw" in env)
    args = env["arguments"] if "arguments" in env else _strict(env["arguments_raw"])
    assert type(args) is dict
    tool = env["tool"]
    assert type(tool) is dict and set(tool) <= {"name", "version"}
    versions = CONTRACTS.versions(tool["name"])
    assert versions, f"routed an unknown tool {tool['name']!r}"
    assert d.proposal is not None and d.call is not None
    contract = next(c for c in versions if c.version == d.contract_version)
    assert contract.validator.reference.is_valid(args), f"routed invalid arguments {args!r}"
    assert contract.validator.reference.is_valid(d.proposal.arguments)
    assert orjson.loads(d.call.canonical_arguments) == d.proposal.arguments
    assert d.call.tool_name == tool["name"] and d.call.call_id == env["proposal_id"]


def check(src: SourceRecord, case: Case | None = None) -> Decision:
    """decide() one record and hold the decision to every invariant."""
    d = decide(src, GATES, NOW_MS, _references(src.value))
    assert isinstance(d, Decision)
    assert d.source is src
    assert d.outcome in (Outcome.ROUTED, Outcome.PARKED, Outcome.REJECTED, Outcome.DEAD_LETTER)
    assert d.gate is not Gate.INTERNAL, f"failed closed on an internal error: {d}"
    if d.outcome is Outcome.DEAD_LETTER:
        assert d.dlq_reason, d
        assert d.proposal is None and d.rejection is None and d.call is None
        headers = dict(dlq_headers(d))
        assert headers["toolsentry.error.reason"] == d.dlq_reason.encode()
        assert headers["toolsentry.source.partition"] == str(src.partition).encode()
        assert headers["toolsentry.source.offset"] == str(src.offset).encode()
        assert all(type(v) is bytes for v in headers.values())
    else:
        p = d.proposal
        assert p is not None and _printable_id(p.run_id)
        if d.outcome is Outcome.PARKED:
            assert d.taxonomy is TaxonomyClass.CONFIRMATION_MISSING and d.approval_request
            assert d.call is not None and src.value is not None
            assert_really_routable(src.value, d)
        elif d.outcome is Outcome.REJECTED:
            r = d.rejection
            assert r is not None and d.call is None
            assert isinstance(r.taxonomy, TaxonomyClass)
            assert r.taxonomy not in (TaxonomyClass.SUCCESS, TaxonomyClass.UNKNOWN_ERROR), r
            assert r.next_action.strip() and r.errors
        else:
            assert d.rejection is None and d.call is not None and src.value is not None
            assert_really_routable(src.value, d)
            call = CALL.decode(encode_approved_call(d, FINGERPRINT))
            assert call["call_id"] == p.proposal_id and call["run_id"] == p.run_id
        obs = encode_observation(d, FINGERPRINT)
        assert len(obs) < KAFKA_MESSAGE_MAX - 1_000, f"observation of {len(obs)} bytes"
        back = OBS.decode(obs)
        assert back["proposal_id"] == p.proposal_id
        assert back["decision"] == {Outcome.PARKED: "PENDING_APPROVAL"}.get(
            d.outcome, d.outcome.value
        )
        assert back["status"]["taxonomy_class"] == d.taxonomy.value
        assert back["next_action"].strip()
        meta = back["execution_metadata"]
        assert (meta["source_partition"], meta["source_offset"]) == (src.partition, src.offset)
    if case is not None:
        problems = case.problems(Verdict.of(d), LIMITS)
        assert not problems, (problems, case.note, (case.value or b"")[:400])
    return d


def source(value: bytes | None, key: bytes | None = b"run-1", offset: int = 7) -> SourceRecord:
    return SourceRecord("tool.proposals", 2, offset, key, value, NOW_MS - 1)


# -- the fuzzers (10,500 examples in all) ----------------------------------------------------


@fuzz(6_000)
@given(cases())
def test_hostile_records_get_one_typed_decision(case: Case) -> None:
    check(source(case.value, case.key, case.marker), case)


class _ArgumentsRawAtTheDepthLimit(random.Random):
    """Draws ``b_deep``'s arguments_raw case at 32 levels, the limit itself."""

    def randint(self, a: int, b: int) -> int:
        return 32 if (a, b) == (10, 5_000) else super().randint(a, b)

    def randrange(self, *args: Any, **kw: Any) -> int:
        return 3 if args == (5,) else super().randrange(*args, **kw)


def test_arguments_raw_nested_to_the_limit_is_expected_to_pass_the_parse_gate() -> None:
    """The oracle expected a parse failure for arguments_raw nested 32 levels, which is
    within the limit: an object that deep reaches the schema gate. One case in some
    hundred thousand draws it, so the fuzzer failed now and then, never on a rerun."""
    drawn = [b_deep(_ArgumentsRawAtTheDepthLimit(seed), seed, LIMITS.max_record_bytes)
             for seed in range(12)]  # fmt: skip
    objects = [c for c in drawn if c.note == "raw 32" and b'{\\"a\\":' in (c.value or b"")]
    assert objects, [c.note for c in drawn]
    for case in objects:
        d = check(source(case.value, case.key, case.marker), case)
        assert d.rejection is not None and d.rejection.gate is Gate.SCHEMA


@fuzz(2_000)
@given(arbitrary_envelopes())
def test_envelopes_with_any_value_in_any_field(drawn: tuple[dict[str, Any], bytes]) -> None:
    _, text = drawn
    check(source(text))


@fuzz(1_000)
@given(
    st.none()
    | st.binary(max_size=300)
    | st.builds(
        lambda prefix, junk, cut: prefix[:cut] + junk + prefix[cut:],
        st.sampled_from([orjson.dumps(envelope(random.Random(i), i))
                         for i in range(20)]),
        st.binary(min_size=1, max_size=8),
        st.integers(0, 400),
    )
)  # fmt: skip
def test_arbitrary_bytes(value: bytes | None) -> None:
    d = check(source(value))
    if value is None:
        assert d.dlq_reason == "empty"


@fuzz(1_500)
@given(
    st.sampled_from(TOOLS),
    st.text(max_size=300)
    | st.text(alphabet='{}[]":,0123456789.eE+-tfnrul\\ ' + "abNIy", max_size=120)
    | st.recursive(st.text(max_size=10) | st.integers() | st.floats() | st.booleans(),
                   lambda k: st.lists(k, max_size=3) | st.dictionaries(st.text(max_size=5), k,
                                                                       max_size=3),
                   max_leaves=8).map(json.dumps),
)  # fmt: skip
def test_any_text_as_arguments_raw(tool: str, raw: str) -> None:
    env = {"proposal_id": "p-1", "run_id": "run-1", "tenant_id": "t-1", "tool": {"name": tool},
           "arguments_raw": raw}  # fmt: skip
    d = check(source(orjson.dumps(env)))
    assert d.outcome is not Outcome.DEAD_LETTER
    try:
        parsed = _strict(raw)
    except (ValueError, AssertionError, RecursionError):
        parsed = None
    if type(parsed) is not dict:
        assert d.gate is Gate.PARSE and d.taxonomy is TaxonomyClass.SYNTACTIC_PARSE_FAIL
        assert d.rejection is not None and d.rejection.errors[0].field == "arguments_raw"


# -- deterministic companions: nothing passes vacuously --------------------------------------


def test_a_seeded_corpus_reaches_every_outcome() -> None:
    """5,000 seeded records: every kind built, every outcome, gate and class reached."""
    cs = corpus(seed=20261122, hostile=4_800, valid=200)
    outcomes: Counter[str] = Counter()
    gates: Counter[str] = Counter()
    classes: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    for i, case in enumerate(cs):
        d = check(source(case.value, case.key, i), case)
        kinds[case.kind] += 1
        outcomes[d.outcome.value] += 1
        if d.outcome is Outcome.DEAD_LETTER:
            reasons[d.dlq_reason or ""] += 1
        else:
            gates[d.gate.value] += 1
            classes[d.taxonomy.value] += 1
        if case.valid:
            assert d.outcome in PASSED
    assert set(kinds) == {*BUILDERS, "valid"}
    assert all(outcomes[o.value] > 0 for o in DECIDE_OUTCOMES), outcomes
    assert {"parse", "resolve", "schema", "route"} <= set(gates), gates
    assert {
        "SUCCESS", "SYNTACTIC_PARSE_FAIL", "STRUCTURAL_VIOLATION", "TYPE_MISMATCH",
        "OUT_OF_BOUNDS",
    } <= set(classes), classes  # fmt: skip
    assert {
        "empty", "too_large", "not_object", "no_run_id", "duplicate_key", "invalid_json",
        "truncated", "too_deep",
    } <= set(reasons), reasons  # fmt: skip


@pytest.mark.parametrize("seed", [9121, 19289, 27593, 33970])
def test_an_invalid_utf8_case_is_invalid_utf8(seed: int) -> None:
    """For these seeds the builder's insertions completed each other into valid UTF-8
    (b"\\x80" inside b"\\xf0\\x9f\\x98" is U+1F018; 1 case in about 11,000 did so): the
    record parsed, and a proposal rightly routed or answered failed the fuzzer, whose
    oracle expected the dead letter of an undecodable record."""
    case = build("invalid_utf8", random.Random(seed), seed)
    assert case.value is not None
    with pytest.raises(UnicodeDecodeError):
        case.value.decode("utf-8")
    assert check(source(case.value, case.key, seed), case).outcome is Outcome.DEAD_LETTER


@pytest.mark.parametrize("outcome", [*(o.value for o in DECIDE_OUTCOMES),
                                     "parse", "resolve", "schema", "route"])  # fmt: skip
def test_the_hypothesis_strategies_reach_every_outcome(outcome: str) -> None:
    """The same, for what the fuzzers draw: each outcome and gate is found among the
    strategies' draws. (Found, not counted in a fixed sample: which values hypothesis
    draws first depends on the constants of the modules the whole test run has loaded,
    and a sample of 600 once held no parked call.)"""

    def reaches(case: Case) -> bool:
        d = check(source(case.value, case.key, case.marker), case)
        return outcome in (d.outcome.value, d.gate.value)

    find(
        cases(),
        reaches,
        settings=settings(max_examples=5_000, database=None, derandomize=True, deadline=None,
                          phases=[Phase.generate], suppress_health_check=list(HealthCheck)),
    )  # fmt: skip


def test_an_accepted_record_at_the_size_limit_gets_an_observation_that_fits_kafka() -> None:
    """The largest record the processor parses has its observation fit in one message.

    An ignored envelope field's name is echoed in a warning; a megabyte-long name
    must not make the observation too big to produce (the transaction would abort
    and the batch be retried for ever).
    """
    env = envelope(random.Random(1), 1, prefix="ok", tool="lookup_order")
    base = len(orjson.dumps(env))
    env["x" * (LIMITS.max_record_bytes - base - 10)] = 1
    value = orjson.dumps(env)
    assert len(value) <= LIMITS.max_record_bytes
    d = check(source(value))
    assert d.outcome is Outcome.ROUTED
    assert d.warnings and len(d.warnings[0]) < 2_000
