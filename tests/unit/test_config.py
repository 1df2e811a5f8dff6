"""Settings: frozen, env over file over defaults, topic names, the librdkafka configs."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pydantic
import pytest

from processor.app import consumer_config, producer_config
from processor.config import Settings, Topics, load_settings
from processor.model import SideEffectClass
from processor.stack.local import free_ports

EXEC_TOPICS = [
    "tool.exec.read_only",
    "tool.exec.ephemeral_write",
    "tool.exec.low_risk_internal",
    "tool.exec.medium_risk_write",
    "tool.exec.high_risk_external",
    "tool.exec.critical_mutation",
]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No TOOLSENTRY_* variable of the caller leaks in; TOOLSENTRY_CONFIG is restored after
    (load_settings writes it into os.environ)."""
    for name in list(os.environ):
        if name.startswith("TOOLSENTRY_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("TOOLSENTRY_CONFIG", "")
    yield


def write_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "toolsentry.yaml"
    path.write_text(text)
    return path


def test_defaults() -> None:
    s = Settings()
    assert s.bootstrap_servers == "127.0.0.1:9092"
    assert s.topics.prefix == "tool."
    assert s.group_id == "toolsentry"
    assert s.instance_id == os.uname().nodename
    assert s.client_config() == {
        "bootstrap.servers": "127.0.0.1:9092",
        "socket.nagle.disable": True,
    }


def test_settings_are_frozen() -> None:
    s = Settings()
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        s.bootstrap_servers = "elsewhere:9092"  # type: ignore[misc]
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        s.topics.prefix = "x."  # type: ignore[misc]
    assert s.bootstrap_servers == "127.0.0.1:9092"


def test_unknown_settings_are_refused() -> None:
    with pytest.raises(pydantic.ValidationError, match="bootstrap_server"):
        Settings(bootstrap_server="typo:9092")  # type: ignore[call-arg]


@pytest.mark.parametrize("records", [0, -1, 1_000_001])
def test_a_batch_size_the_consumer_cannot_take_is_refused_at_start(records: int) -> None:
    """The loop asks librdkafka for the batch less its first record: anything but 1 to a
    million would be accepted here and stop the processor when the first record came."""
    with pytest.raises(pydantic.ValidationError, match="batch_max_records"):
        Settings(batch_max_records=records)
    assert Settings(batch_max_records=1).batch_max_records == 1


@pytest.mark.parametrize(
    ("name", "value"),
    [("batch_wait_s", -1), ("batch_wait_s", 0), ("batch_wait_s", 61), ("contracts_poll_s", -1)],
)
def test_a_wait_the_loop_cannot_use_is_refused_at_start(name: str, value: float) -> None:
    """A negative wait would block the loop for ever (a stop never noticed), none would
    spin it."""
    with pytest.raises(pydantic.ValidationError, match=name):
        Settings(**{name: value})


def test_environment_reaches_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOOLSENTRY_BOOTSTRAP_SERVERS", "broker-1:9093,broker-2:9093")
    monkeypatch.setenv("TOOLSENTRY_TOPICS__PREFIX", "acme.tool.")
    monkeypatch.setenv("TOOLSENTRY_KAFKA", '{"security.protocol":"SASL_SSL"}')
    monkeypatch.setenv("TOOLSENTRY_BATCH_MAX_RECORDS", "77")
    s = Settings()
    assert s.bootstrap_servers == "broker-1:9093,broker-2:9093"
    assert s.topics.prefix == "acme.tool."
    assert s.topics.proposals == "acme.tool.proposals"
    assert s.kafka == {"security.protocol": "SASL_SSL"}
    assert s.batch_max_records == 77
    assert s.client_config() == {
        "bootstrap.servers": "broker-1:9093,broker-2:9093",
        "socket.nagle.disable": True,
        "security.protocol": "SASL_SSL",
    }
    assert s.client_config(**{"client.id": "x"})["client.id"] == "x"


def test_pass_through_kafka_settings_win_over_defaults() -> None:
    s = Settings(kafka={"socket.nagle.disable": False, "bootstrap.servers": "other:1"})
    assert s.client_config(**{"socket.nagle.disable": True}) == {
        "bootstrap.servers": "other:1",
        "socket.nagle.disable": False,
    }


def test_config_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = write_config(
        tmp_path,
        "bootstrap_servers: file-broker:9092\n"
        "group_id: from-file\n"
        "topics: {prefix: 'f.'}\n"
        "kafka: {sasl.mechanism: PLAIN}\n"
        "stack: {partitions: 3}\n",
    )
    monkeypatch.setenv("TOOLSENTRY_CONFIG", str(path))
    s = Settings()
    assert s.bootstrap_servers == "file-broker:9092"
    assert s.group_id == "from-file"
    assert s.topics.dlq == "f.proposals.dlq"
    assert s.kafka == {"sasl.mechanism": "PLAIN"}
    assert s.stack.partitions == 3


def test_environment_beats_the_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = write_config(tmp_path, "bootstrap_servers: file:9092\ngroup_id: from-file\n")
    monkeypatch.setenv("TOOLSENTRY_CONFIG", str(path))
    monkeypatch.setenv("TOOLSENTRY_BOOTSTRAP_SERVERS", "env:9092")
    s = Settings()
    assert s.bootstrap_servers == "env:9092"
    assert s.group_id == "from-file"


def test_overrides_beat_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = write_config(tmp_path, "bootstrap_servers: file:9092\nlog_level: DEBUG\n")
    monkeypatch.setenv("TOOLSENTRY_BOOTSTRAP_SERVERS", "env:9092")
    s = load_settings(path, bootstrap_servers="flag:9092", group_id=None)
    assert s.bootstrap_servers == "flag:9092"
    assert s.group_id == "toolsentry"
    assert s.log_level == "DEBUG"
    assert os.environ["TOOLSENTRY_CONFIG"] == str(path)


def test_config_file_must_hold_a_mapping(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TOOLSENTRY_CONFIG", str(write_config(tmp_path, "- a\n- b\n")))
    with pytest.raises(ValueError, match="must hold a mapping"):
        Settings()


def test_topic_names_derive_from_the_prefix() -> None:
    t = Topics()
    assert t.all() == [
        "tool.proposals",
        "tool.observations",
        "tool.results",
        "tool.approval.requests",
        "tool.approvals",
        "tool.reference",
        "tool.proposals.dlq",
        "tool.calls.dlq",
        *EXEC_TOPICS,
    ]
    assert [t.execution(c.value) for c in SideEffectClass] == EXEC_TOPICS
    acme = Topics(prefix="acme.")
    assert acme.all() == [name.replace("tool.", "acme.", 1) for name in t.all()]
    assert acme.execution("CRITICAL_MUTATION") == "acme.exec.critical_mutation"


def test_consumer_config() -> None:
    s = Settings(
        bootstrap_servers="b:9092",
        kafka={"security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512"},
        consumer={"fetch.min.bytes": 1024},
        producer={"compression.type": "zstd"},
        group_id="grp",
        instance_id="inst-1",
    )
    conf = consumer_config(s)
    assert conf["bootstrap.servers"] == "b:9092"
    assert conf["security.protocol"] == "SASL_SSL"
    assert conf["sasl.mechanism"] == "SCRAM-SHA-512"
    assert conf["fetch.min.bytes"] == 1024
    assert "compression.type" not in conf
    assert conf["group.id"] == "grp"
    assert conf["isolation.level"] == "read_committed"
    assert conf["enable.auto.commit"] is False
    assert conf["enable.auto.offset.store"] is False
    assert conf["group.instance.id"].startswith("inst-1.")
    assert "transactional.id" not in conf


def test_a_changed_subscription_is_a_new_static_member() -> None:
    """The broker would hand a returning static member its old assignment, new topics
    left out: the instance's group member id follows what it subscribes to."""
    s = Settings(instance_id="inst-1")
    before = consumer_config(s, ["tool.proposals", "tool.approvals"])["group.instance.id"]
    after = consumer_config(s, ["tool.proposals", "tool.approvals", "tool.results"])
    assert before != after["group.instance.id"]
    again = consumer_config(s, ["tool.approvals", "tool.proposals"])["group.instance.id"]
    assert again == before


def test_consumer_without_static_membership() -> None:
    conf = consumer_config(Settings(static_membership=False, instance_id="inst-1"))
    assert "group.instance.id" not in conf


def test_producer_config() -> None:
    s = Settings(
        kafka={"security.protocol": "SASL_SSL"},
        consumer={"fetch.min.bytes": 1024},
        producer={"compression.type": "zstd"},
        group_id="grp",
        instance_id="inst-1",
        transaction_timeout_ms=12345,
    )
    conf = producer_config(s)
    assert s.transactional_id == "grp-inst-1"
    assert conf["transactional.id"] == "grp-inst-1"
    assert conf["transaction.timeout.ms"] == 12345
    assert conf["enable.idempotence"] is True
    assert conf["acks"] == "all"
    assert conf["security.protocol"] == "SASL_SSL"
    assert conf["compression.type"] == "zstd"
    assert "fetch.min.bytes" not in conf
    assert "isolation.level" not in conf


def test_client_configs_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOOLSENTRY_KAFKA", '{"security.protocol":"SASL_SSL"}')
    monkeypatch.setenv("TOOLSENTRY_GROUP_ID", "g2")
    monkeypatch.setenv("TOOLSENTRY_INSTANCE_ID", "pod-7")
    s = Settings()
    assert consumer_config(s)["security.protocol"] == "SASL_SSL"
    assert producer_config(s)["security.protocol"] == "SASL_SSL"
    assert producer_config(s)["transactional.id"] == "g2-pod-7"


@pytest.mark.parametrize(
    ("field", "setting"),
    [
        ("kafka", {"isolation.level": "read_uncommitted"}),
        ("consumer", {"enable.auto.commit": True}),
        ("producer", {"enable.idempotence": False}),
        ("kafka", {"transactional.id": "someone-else"}),
        ("producer", {"acks": "1"}),
        ("producer", {"partitioner": "consistent_random"}),  # a run's order across producers
    ],
)
def test_pass_through_settings_cannot_switch_off_exactly_once(
    field: str, setting: dict[str, object]
) -> None:
    from processor.app import UnsafeSetting, consumer_config, producer_config

    s = Settings(**{field: setting})  # type: ignore[arg-type]
    with pytest.raises(UnsafeSetting):
        consumer_config(s)
        producer_config(s)


@pytest.mark.parametrize(
    ("setting", "says"),
    [
        ({"isolation.level": "read_uncommitted"}, "client consumer: isolation.level"),
        ({"partitioner": "consistent_random"}, "client producer: partitioner"),
        ({"acks": "1"}, "client producer: acks"),
        ({"enable.idempotence": False}, "client producer: enable.idempotence"),
    ],
)
def test_pass_through_settings_cannot_change_what_the_client_rests_on(
    setting: dict[str, object], says: str
) -> None:
    """They were applied over the client's own: it read the observations of aborted
    transactions, or put a run's proposals on partitions a Java producer would not. Refused
    before any connection is tried, as the processor refuses them."""
    from processor.app import UnsafeSetting
    from processor.client import ToolsentryClient

    (port,) = free_ports(1)  # nothing listens there: nothing is reached
    s = Settings(bootstrap_servers=f"127.0.0.1:{port}", kafka=setting)  # type: ignore[arg-type]
    with pytest.raises(UnsafeSetting, match=says):
        ToolsentryClient(s, "acme").close()


def test_pass_through_settings_that_agree_with_the_client_are_accepted() -> None:
    from processor.client import ToolsentryClient

    s = Settings(kafka={"acks": "all", "partitioner": "murmur2_random", "linger.ms": 5})
    ToolsentryClient(s, "acme", watch=False).close()


def test_pass_through_settings_that_agree_with_exactly_once_are_accepted() -> None:
    from processor.app import consumer_config, producer_config

    s = Settings(
        kafka={"acks": "all", "security.protocol": "PLAINTEXT"},
        consumer={"isolation.level": "read_committed", "fetch.wait.max.ms": 10},
    )
    assert consumer_config(s)["fetch.wait.max.ms"] == 10
    assert producer_config(s)["acks"] == "all"


@pytest.mark.parametrize(
    ("field", "setting"),
    [
        ("consumer", {"partition.assignment.strategy": "cooperative-sticky"}),
        ("kafka", {"partition.assignment.strategy": "range,cooperative-sticky"}),
        ("consumer", {"group.protocol": "consumer"}),
    ],
)
def test_incremental_rebalancing_is_refused(field: str, setting: dict[str, object]) -> None:
    """With only some partitions revoked, a batch in flight on a kept partition could be
    skipped by the rewind: refused when the settings load, for every consumer."""
    with pytest.raises(pydantic.ValidationError, match="not supported"):
        Settings(**{field: setting})  # type: ignore[arg-type]
    eager = Settings(consumer={"partition.assignment.strategy": "roundrobin"})
    assert eager.consumer["partition.assignment.strategy"] == "roundrobin"


@pytest.mark.parametrize(
    ("text", "knob"),
    [
        ("stack: {partitons: 3}\n", "stack.partitons"),
        ("identity: {jwks_fle: keys.json}\n", "identity.jwks_fle"),
        ("topics: {prefx: acme.}\n", "topics.prefx"),
    ],
)
def test_a_misspelt_nested_setting_in_the_file_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, text: str, knob: str
) -> None:
    """A misspelt key would otherwise be dropped and its default used without a word."""
    monkeypatch.setenv("TOOLSENTRY_CONFIG", str(write_config(tmp_path, text)))
    with pytest.raises(pydantic.ValidationError) as refused:
        Settings()
    assert [".".join(map(str, e["loc"])) for e in refused.value.errors()] == [knob]


@pytest.mark.parametrize(
    ("variable", "says"),
    [
        ("TOOLSENTRY_BOOTSTRAP_SERVER", "did you mean TOOLSENTRY_BOOTSTRAP_SERVERS?"),
        ("TOOLSENTRY_REDIS_URI", "did you mean TOOLSENTRY_REDIS_URL?"),
        ("TOOLSENTRY_CONFIG_FILE", "TOOLSENTRY_CONFIG_FILE is not a setting"),
    ],
)
def test_a_misspelt_environment_variable_is_refused(
    monkeypatch: pytest.MonkeyPatch, variable: str, says: str
) -> None:
    monkeypatch.setenv(variable, "x")
    with pytest.raises(ValueError, match=f"{variable} is not a setting") as refused:
        Settings()
    assert says in str(refused.value)


def test_a_misspelt_nested_environment_variable_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TOOLSENTRY_STACK__PARTITONS", "3")
    with pytest.raises(pydantic.ValidationError, match=r"stack\.partitons"):
        Settings()


def test_variables_under_the_prefix_that_are_not_settings_are_accepted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in (
        "TOOLSENTRY_TEST_BOOTSTRAP",
        "TOOLSENTRY_FAULT_POINT",
        "TOOLSENTRY_JSON_SCHEMA_SUITE",
    ):
        monkeypatch.setenv(name, "x")
    monkeypatch.setenv("TOOLSENTRY_STACK__PARTITIONS", "3")
    assert Settings().stack.partitions == 3


@pytest.mark.parametrize(
    ("knob", "value"),
    [
        ("stack.partitions", 0),
        ("stack.partitions", -3),
        ("stack.kafka_port", 0),
        ("stack.kafka_port", 65536),
        ("stack.kafka_controller_port", -1),
        ("stack.redis_port", 70000),
        ("stack.ready_timeout_s", 0),
        ("metrics_port", -1),
        ("metrics_port", 65536),
        ("max_record_bytes", -1),
        ("max_arguments_bytes", 0),
        ("max_arguments_depth", 0),
        ("transaction_timeout_ms", -15000),
        ("identity.leeway_s", -1),
        ("identity.delegation_ttl_s", 0),
    ],
)
def test_a_size_port_or_time_out_of_range_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch, knob: str, value: int
) -> None:
    monkeypatch.setenv("TOOLSENTRY_" + knob.upper().replace(".", "__"), str(value))
    with pytest.raises(pydantic.ValidationError) as refused:
        Settings()
    assert [".".join(map(str, e["loc"])) for e in refused.value.errors()] == [knob]


def test_a_refused_setting_never_echoes_what_was_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """The value refused sits beside passwords in the same setting; a traceback or a log
    line would carry them."""
    monkeypatch.setenv(
        "TOOLSENTRY_KAFKA", '{"group.protocol": "consumer", "sasl.password": "s3cr3t"}'
    )
    with pytest.raises(pydantic.ValidationError, match=r"group\.protocol") as refused:
        Settings()
    assert "s3cr3t" not in str(refused.value)
    assert "s3cr3t" not in repr(refused.value)


def test_shown_settings_mask_every_secret() -> None:
    s = Settings(
        kafka={
            "security.protocol": "SASL_SSL",
            "sasl.username": "toolsentry",
            "sasl.password": "kafka-s3cret",
            "ssl.key.password": "key-s3cret",
            "ssl.key.pem": "-----BEGIN PRIVATE KEY-----pem-s3cret",
        },
        consumer={"sasl.oauthbearer.client.secret": "oauth-s3cret", "fetch.min.bytes": 1},
        producer={"ssl.keystore.password": "store-s3cret"},
        redis_url="rediss://ops:redis-s3cret@cache:6380/0?ssl_cert_reqs=required",
    )
    shown = s.shown()
    text = str(shown)
    assert "s3cret" not in text, text
    assert shown["kafka"]["sasl.username"] == "toolsentry"
    assert shown["kafka"]["sasl.password"] == "***"
    assert shown["consumer"]["fetch.min.bytes"] == 1
    assert shown["redis_url"] == "rediss://ops:***@cache:6380/0?ssl_cert_reqs=required"
    cluster = Settings(redis_url="redis+cluster://:pw-s3cret@a:1,b:2?password=q-s3cret").shown()
    assert "s3cret" not in cluster["redis_url"], cluster["redis_url"]
    assert Settings().shown()["redis_url"] == "redis://127.0.0.1:6379/0"
