"""Topic administration: creating the processor's topics and reading their layout.

Owns which topics exist and how they are configured (partition count, the compacted
``reference`` topic). Every call goes through ``Settings.client_config()`` so the
pass-through librdkafka settings (security, SASL, ...) apply to the admin client too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient

# confluent_kafka.admin re-exports NewTopic without marking it public for type checkers.
from confluent_kafka.cimpl import NewTopic

from processor.config import Settings

# -1 takes the broker's default.replication.factor: 1 on the local stack, the
# cluster's own choice elsewhere.
_BROKER_DEFAULT_REPLICATION = -1

logger = logging.getLogger(__name__)


def _topic_config(settings: Settings, topic: str) -> dict[str, str]:
    if topic == settings.topics.reference:
        # Reference data is keyed and read as a table: only the latest value per key matters.
        return {"cleanup.policy": "compact"}
    return {}


def ensure_topics(
    settings: Settings, partitions: int | None = None, timeout_s: float = 30.0
) -> list[str]:
    """Create every topic in ``settings.topics.all()`` that does not exist yet.

    Partitions default to ``settings.stack.partitions``; the replication factor is
    the broker's default (1 on the local stack); the ``reference`` topic is compacted.
    Existing topics are left alone (adding partitions would move keys to other
    partitions), with a warning naming each whose partition count differs. Returns the
    names created, once they are visible in the metadata with a leader for every partition.
    """
    deadline = time.monotonic() + timeout_s
    count = partitions if partitions is not None else settings.stack.partitions
    admin = AdminClient(settings.client_config())
    existing = admin.list_topics(timeout=timeout_s).topics
    _warn_other_counts(
        {t: len(existing[t].partitions) for t in settings.topics.all() if t in existing}, count
    )
    missing = [t for t in settings.topics.all() if t not in existing]
    if not missing:
        return []
    futures = admin.create_topics(
        [
            NewTopic(
                t,
                num_partitions=count,
                replication_factor=_BROKER_DEFAULT_REPLICATION,
                config=_topic_config(settings, t),
            )
            for t in missing
        ],
        operation_timeout=timeout_s,
        request_timeout=timeout_s,
    )
    created: list[str] = []
    for name in missing:
        try:
            futures[name].result()
        except KafkaException as e:
            if e.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise
        else:
            created.append(name)
    _wait_for_leaders(admin, created, deadline)
    return created


def _warn_other_counts(found: dict[str, int], count: int) -> None:
    other = {t: n for t, n in found.items() if n != count}
    if other:
        logger.warning(
            "existing topics keep their partition count, not the %d asked for: %s",
            count,
            ", ".join(f"{t} ({n})" for t, n in sorted(other.items())),
        )


def _wait_for_leaders(admin: AdminClient, topics: list[str], deadline: float) -> None:
    # A created topic can lack a leader for a moment; producers would see errors then.
    pending = set(topics)
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"topics without a leader after creation: {sorted(pending)}")
        metadata = admin.list_topics(timeout=remaining)
        for name in list(pending):
            topic = metadata.topics.get(name)
            if (
                topic is not None
                and topic.error is None
                and topic.partitions
                and all(p.leader >= 0 for p in topic.partitions.values())
            ):
                pending.discard(name)
        if pending:
            time.sleep(0.1)


def topic_partitions(settings: Settings, topic: str, timeout_s: float = 10.0) -> int:
    """How many partitions ``topic`` has; LookupError if it does not exist."""
    found = topics_partitions(settings, [topic], timeout_s)
    if topic not in found:
        raise LookupError(f"topic {topic!r} not found")
    return found[topic]


def topics_partitions(
    settings: Settings, topics: Iterable[str], timeout_s: float = 10.0
) -> dict[str, int]:
    """How many partitions each of ``topics`` has, from one metadata request; a topic that
    does not exist (or whose metadata is in error) is left out."""
    admin = AdminClient(settings.client_config())
    wanted = list(topics)
    if len(wanted) == 1:
        metadata = admin.list_topics(topic=wanted[0], timeout=timeout_s)
    else:
        metadata = admin.list_topics(timeout=timeout_s)
    out: dict[str, int] = {}
    for name in wanted:
        found = metadata.topics.get(name)
        if found is not None and found.error is None and found.partitions:
            out[name] = len(found.partitions)
    return out
