"""Settings: one frozen object, read from a file, the environment and flags.

Precedence, highest first: explicit overrides (CLI flags), environment
variables (``TOOLSENTRY_…``, nested with ``__``), the YAML/JSON file named by
``--config`` or ``TOOLSENTRY_CONFIG``, then the defaults below. Every knob is
documented on its field; ``toolsentry config`` prints the effective values.

librdkafka settings pass through untouched: ``kafka`` applies to every client
(consumer, producer, admin), ``consumer``/``producer`` only to one. That is
how a secured cluster is reached, e.g.
``TOOLSENTRY_KAFKA='{"security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512", ...}'``.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from pathlib import Path
from typing import Any, Literal
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

SIDE_EFFECT_TOPIC_SUFFIXES = (
    "read_only",
    "ephemeral_write",
    "low_risk_internal",
    "medium_risk_write",
    "high_risk_external",
    "critical_mutation",
)


class Topics(BaseModel):
    """Topic names, all derived from one prefix so a deployment can namespace them."""

    model_config = ConfigDict(frozen=True, extra="forbid", hide_input_in_errors=True)

    prefix: str = "tool."

    @property
    def proposals(self) -> str:
        return f"{self.prefix}proposals"

    @property
    def observations(self) -> str:
        return f"{self.prefix}observations"

    @property
    def results(self) -> str:
        return f"{self.prefix}results"

    @property
    def approval_requests(self) -> str:
        return f"{self.prefix}approval.requests"

    @property
    def approvals(self) -> str:
        return f"{self.prefix}approvals"

    @property
    def reference(self) -> str:
        return f"{self.prefix}reference"

    @property
    def dlq(self) -> str:
        return f"{self.prefix}proposals.dlq"

    @property
    def call_dlq(self) -> str:
        """Records on the execution topics that executors cannot read as approved calls.
        Not under ``exec.``: a subscription or ACL by that prefix must not take it for an
        execution topic."""
        return f"{self.prefix}calls.dlq"

    def execution(self, side_effect_class: str) -> str:
        """``tool.exec.<class>`` for a side-effect class such as ``READ_ONLY``."""
        return f"{self.prefix}exec.{side_effect_class.lower()}"

    def all(self) -> list[str]:
        execs = [f"{self.prefix}exec.{s}" for s in SIDE_EFFECT_TOPIC_SUFFIXES]
        return [
            self.proposals,
            self.observations,
            self.results,
            self.approval_requests,
            self.approvals,
            self.reference,
            self.dlq,
            self.call_dlq,
            *execs,
        ]


class StackSettings(BaseModel):
    """The local development stack: one Kafka broker and one redis-server."""

    model_config = ConfigDict(frozen=True, extra="forbid", hide_input_in_errors=True)

    data_dir: Path = Path(".stack")
    """Broker log dirs, Redis dump, logs and pid files live here."""
    kafka_port: int = Field(default=9092, ge=1, le=65535)
    kafka_controller_port: int = Field(default=9093, ge=1, le=65535)
    kafka_version: str = "4.2.0"
    kafka_heap: str = "512m"
    """Enough for a single node on loopback; the log cleaner buffer is sized to fit."""
    kafka_cache_dir: Path = Path.home() / ".cache" / "toolsentry"
    """Where the broker jars from Maven Central are kept, outside git, fetched once."""
    redis_port: int = Field(default=6379, ge=1, le=65535)
    partitions: int = Field(default=6, ge=1)
    """Partitions per topic created by ``stack up``; caps how many processors share the load."""
    ready_timeout_s: float = Field(default=120.0, gt=0)


class IdentitySettings(BaseModel):
    """Who is asking: principals come only from signed tokens verified with these keys."""

    model_config = ConfigDict(frozen=True, extra="forbid", hide_input_in_errors=True)

    mode: Literal["verify", "development"] = "verify"
    """``development`` trusts the envelope's tenant and grants every scope. It is for a
    laptop only: the processor logs it loudly, exports it as a metric, and every
    observation carries a warning."""
    jwks_file: Path | None = None
    """A JWKS document (RFC 7517): Ed25519 (OKP), P-256 (EC) and HMAC (oct) keys."""
    key_files: tuple[Path, ...] = ()
    """Single keys: a PEM public key (kid = the file's stem) or one JWK in JSON."""
    audience: str = "toolsentry"
    issuer: str | None = None
    """When set, tokens must carry exactly this ``iss``."""
    leeway_s: int = Field(default=30, ge=0)
    """Clock skew tolerated on ``exp`` and ``nbf``."""
    delegation_key_file: Path | None = None
    """A private JWK (Ed25519) the processor signs the compensating calls it proposes
    with, in the original caller's name (an RFC 8693 ``act`` claim names the processor).
    Every instance of a deployment needs the same key. Its tokens are accepted only for
    the one compensation each is bound to. Without it, a call that needs compensating
    cannot be compensated (``COMPENSATION_FAILED``, escalated) unless identity runs in
    development mode."""
    delegation_trusted_key_files: tuple[Path, ...] = ()
    """Other delegation keys whose tokens verify (JWKs, public halves suffice; each with
    a kid of its own): during a rotation, the next key before any instance signs with
    it, and the previous one for ``delegation_ttl_s`` (and until lag is gone) after."""
    delegation_ttl_s: int = Field(default=900, ge=1)
    """Lifetime of a compensating call's token: how long it may wait on
    ``tool.proposals`` (a backlog, an outage) and still be decided."""


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class Settings(BaseSettings):
    """Everything the processor, the client and the CLI read."""

    model_config = SettingsConfigDict(
        env_prefix="TOOLSENTRY_",
        env_nested_delimiter="__",
        frozen=True,
        extra="forbid",
        env_parse_none_str="null",
        # A refused value is named, never echoed: it may sit beside a password.
        hide_input_in_errors=True,
    )

    bootstrap_servers: str = "127.0.0.1:9092"
    kafka: dict[str, Any] = Field(default_factory=dict)
    """librdkafka settings for every client (security.protocol, sasl.*, ssl.*, ...)."""
    consumer: dict[str, Any] = Field(default_factory=dict)
    """librdkafka settings for consumers only (fetch tuning, ...): the processor's, its
    reference loader's and executors' (``processor.executor``)."""
    producer: dict[str, Any] = Field(default_factory=dict)
    """librdkafka settings for transactional producers only (linger, compression, ...):
    the processor's and executors'."""
    topics: Topics = Topics()

    @field_validator("kafka", "consumer")
    @classmethod
    def _eager_rebalancing(cls, conf: dict[str, Any]) -> dict[str, Any]:
        """Incremental rebalancing is refused. The processor rewinds a batch's partitions
        when they are revoked and assumes every partition is revoked at a rebalance; with
        only some revoked (cooperative-sticky, or the KIP-848 'consumer' protocol), a batch
        in flight on a kept partition could be skipped, and the reference loader's
        assign() is not allowed at all."""
        strategy = str(conf.get("partition.assignment.strategy", "")).lower()
        if "cooperative" in strategy:
            raise ValueError(
                f"partition.assignment.strategy={strategy!r}: incremental (cooperative) "
                "rebalancing is not supported; use range or roundrobin"
            )
        if str(conf.get("group.protocol", "classic")).lower() != "classic":
            raise ValueError(
                f"group.protocol={conf['group.protocol']!r} is not supported: the 'consumer' "
                "protocol rebalances incrementally; use the classic protocol"
            )
        return conf

    group_id: str = "toolsentry"
    instance_id: str = Field(default_factory=lambda: os.uname().nodename)
    """Stable per processor instance: the transactional.id is built from it, so a
    restarted instance fences its predecessor's open transaction at once instead of
    waiting for transaction.timeout.ms."""
    static_membership: bool = True
    """Use ``group.instance.id`` = instance_id (plus a digest of the subscribed topics),
    so a restarted instance gets its partitions back without a rebalance."""
    transaction_timeout_ms: int = Field(default=15000, ge=1)
    """Upper bound on how long a crashed instance's open transaction blocks readers."""
    processing_guarantee: Literal["exactly-once"] = "exactly-once"
    batch_max_records: int = Field(default=2000, ge=1, le=1_000_000)
    """Records per transaction at most. The loop takes whatever is already fetched
    up to this many, so under light load batches stay small and latency low, and
    under heavy load one commit is shared by many records. (librdkafka consumes at most
    a million at once: any other number would start, then fail at the first record.)"""
    batch_wait_s: float = Field(default=0.1, gt=0, le=60)
    """How long the loop blocks waiting for the first record of a batch (only
    bounds how quickly it notices a stop request when idle; librdkafka reads a negative
    wait as for ever, and none at all would spin)."""
    max_record_bytes: int = Field(default=1_048_576, ge=1)
    """A proposal larger than this is not parsed; it goes to the DLQ."""
    max_arguments_bytes: int = Field(default=65_536, ge=1)
    max_arguments_depth: int = Field(default=32, ge=1)
    contracts_dir: Path = Path("contracts")
    contracts_poll_s: float = Field(default=2.0, ge=0)
    """How often the contract folder and the key, policy and approvers files are checked
    for changes; a change is taken once it has held still for one poll (SIGHUP checks
    them all at once)."""
    metrics_port: int = Field(default=9464, ge=0, le=65535)
    """Prometheus /metrics port; 0 disables the endpoint."""
    redis_url: str = "redis://127.0.0.1:6379/0"
    """One server: ``redis://[user:password@]host:port/db``, ``rediss://`` (TLS) or
    ``unix://``. A Redis Cluster: ``redis+cluster://[user:password@]host:port[,host:port...]``
    (``rediss+cluster://`` for TLS), any reachable nodes to discover it from; no db, the
    query options apply to every node. See ``processor.state.connection``."""
    redis_namespace: str = "ts"
    """Prefix of every Redis key, so deployments (or test runs) can share one Redis."""
    identity: IdentitySettings = IdentitySettings()
    policy_file: Path | None = Path("policy/policy.yaml")
    """Tenant classes, confirmation, egress and secret-scanning policy; None means the
    built-in defaults (every class allowed, approvals for the two riskiest classes)."""
    approvers_file: Path | None = None
    """Approvers and their Ed25519 public keys; without it no approval is ever valid."""
    reference_group_id: str = "toolsentry.reference"
    """Consumer group that materialises ``tool.reference`` into Redis."""
    log_level: str = "INFO"
    stack: StackSettings = StackSettings()

    @field_validator("log_level")
    @classmethod
    def _known_level(cls, level: str) -> str:
        """A level logging knows, in any case: any other would stop the start only once
        logging was set up, in a traceback."""
        if level.upper() not in LOG_LEVELS:
            raise ValueError(f"{level!r} is not a log level ({', '.join(LOG_LEVELS)})")
        return level.upper()

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        _refuse_unknown_variables(settings_cls)
        return (init_settings, env_settings, _FileSource(settings_cls))

    def client_config(self, **extra: Any) -> dict[str, Any]:
        """Common librdkafka config: bootstrap, our defaults, then the pass-through settings.

        Nagle's algorithm is off: a transaction is a chain of small request/response
        round trips, and Nagle plus delayed ACKs adds tens of milliseconds to each.
        """
        base = {"bootstrap.servers": self.bootstrap_servers, "socket.nagle.disable": True}
        return {**base, **extra, **self.kafka}

    def as_env(self, **overrides: str) -> dict[str, str]:
        """These settings as TOOLSENTRY_* variables, to hand to a child process."""
        env = {
            "TOOLSENTRY_BOOTSTRAP_SERVERS": self.bootstrap_servers,
            "TOOLSENTRY_REDIS_URL": self.redis_url,
            "TOOLSENTRY_REDIS_NAMESPACE": self.redis_namespace,
            "TOOLSENTRY_TOPICS__PREFIX": self.topics.prefix,
            "TOOLSENTRY_GROUP_ID": self.group_id,
            "TOOLSENTRY_REFERENCE_GROUP_ID": self.reference_group_id,
            "TOOLSENTRY_INSTANCE_ID": self.instance_id,
            "TOOLSENTRY_METRICS_PORT": str(self.metrics_port),
            "TOOLSENTRY_CONTRACTS_DIR": str(Path(self.contracts_dir).resolve()),
            "TOOLSENTRY_KAFKA": json.dumps(self.kafka),
            "TOOLSENTRY_CONSUMER": json.dumps(self.consumer),
            "TOOLSENTRY_PRODUCER": json.dumps(self.producer),
            "TOOLSENTRY_IDENTITY": self.identity.model_dump_json(),
            "TOOLSENTRY_POLICY_FILE": _abs(self.policy_file),
            "TOOLSENTRY_APPROVERS_FILE": _abs(self.approvers_file),
        }
        env.update(overrides)
        return env

    @property
    def transactional_id(self) -> str:
        return f"{self.group_id}-{self.instance_id}"

    def shown(self) -> dict[str, Any]:
        """These settings as JSON data with every secret masked, for showing to a person:
        the passwords and private keys of the librdkafka settings and of ``redis_url``."""
        data = self.model_dump(mode="json")
        for field in ("kafka", "consumer", "producer"):
            data[field] = {
                k: SECRET_MASK if _SECRET_KAFKA_KEY.search(k) else v for k, v in data[field].items()
            }
        data["redis_url"] = _masked_url(self.redis_url)
        return data


SECRET_MASK = "***"
_SECRET_KAFKA_KEY = re.compile(r"password|secret|key\.pem", re.IGNORECASE)
"""librdkafka settings that hold a secret: ``sasl.password``, ``ssl.key.password``,
``ssl.keystore.password``, ``sasl.oauthbearer.client.secret``, ``ssl.key.pem``."""


class UnsafeSetting(ValueError):
    """A pass-through setting would switch off what exactly-once processing rests on, in
    the processor or in an agent's client."""


def enforce(conf: dict[str, Any], fixed: dict[str, Any], where: str) -> dict[str, Any]:
    """Pass-through settings may tune clients but never change what exactly-once rests on."""
    for key, value in fixed.items():
        if key in conf and str(conf[key]).lower() != str(value).lower():
            raise UnsafeSetting(f"{where}: {key}={conf[key]!r} is not allowed (must be {value!r})")
        conf[key] = value
    return conf


def _masked_url(url: str) -> str:
    """``url`` with the password of its user info and of a ``password`` query option
    masked (redis-py reads both)."""
    parts = urlsplit(url)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    netloc = parts.netloc
    if at and ":" in userinfo:
        netloc = f"{userinfo.split(':', 1)[0]}:{SECRET_MASK}@{hosts}"
    query = parts.query
    if "password" in query.lower():
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode(
            [(k, SECRET_MASK if "password" in k.lower() else v) for k, v in pairs], safe="*"
        )
    return urlunsplit(parts._replace(netloc=netloc, query=query))


ENV_PREFIX = "TOOLSENTRY_"
NOT_SETTINGS = frozenset({"CONFIG", "JSON_SCHEMA_SUITE"})
NOT_SETTINGS_PREFIXES = ("TEST_", "FAULT_")
"""Variables under the prefix that are not settings: the settings file, the
JSON-Schema-Test-Suite, the test suite's external stack and fault injection
(``processor.faults``)."""


def _refuse_unknown_variables(settings_cls: type[BaseSettings]) -> None:
    """A ``TOOLSENTRY_`` variable that names no setting is refused, naming the closest one:
    a misspelt variable would otherwise be ignored and its default used without a word."""
    fields = {name.upper() for name in settings_cls.model_fields}
    for variable in sorted(os.environ):
        name = variable.upper()
        if not name.startswith(ENV_PREFIX):
            continue
        rest = name[len(ENV_PREFIX) :]
        head = rest.split("__", 1)[0]
        if head in fields or rest in NOT_SETTINGS or rest.startswith(NOT_SETTINGS_PREFIXES):
            continue
        close = difflib.get_close_matches(head, sorted(fields), n=1)
        hint = f" (did you mean {ENV_PREFIX}{close[0]}?)" if close else ""
        raise ValueError(f"environment variable {variable} is not a setting{hint}")


def _abs(path: Path | None) -> str:
    return "null" if path is None else str(Path(path).resolve())


class _FileSource(PydanticBaseSettingsSource):
    """Reads the YAML or JSON file named by ``TOOLSENTRY_CONFIG`` (if any)."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        path = os.environ.get("TOOLSENTRY_CONFIG")
        if not path:
            return {}
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: the config file must hold a mapping")
        return data


def load_settings(config_file: Path | None = None, **overrides: Any) -> Settings:
    """Build the settings; ``overrides`` (from flags) win over everything else."""
    if config_file is not None:
        os.environ["TOOLSENTRY_CONFIG"] = str(config_file)
    return Settings(**{k: v for k, v in overrides.items() if v is not None})
