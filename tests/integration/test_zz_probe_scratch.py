"""Scratch: after every death, which replay markers lie below the committed offsets?"""
from __future__ import annotations
import math, random, re, time
from collections import Counter
from pathlib import Path
from confluent_kafka import ConsumerGroupTopicPartitions, TopicPartition
from processor.state.connection import connect
from tests.integration.harness import GroupLag, ProcessorProcess, isolated, policy_with_budgets
from tests.integration import test_admission_crash as t

def committed(lag: GroupLag) -> dict[int, int]:
    topic = lag.settings.topics.proposals
    meta = lag.admin.list_topics(topic, timeout=10)
    parts = [TopicPartition(topic, p) for p in meta.topics[topic].partitions]
    [f] = lag.admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(lag.settings.group_id, parts)]).values()
    return {tp.partition: tp.offset for tp in f.result(10).topic_partitions}

def stale(settings, lag):
    c = connect(settings.redis_url)
    offs = committed(lag)
    out = set()
    for tn in t.TENANTS:
        for k in c.hkeys(f"{settings.redis_namespace}:{{{tn}}}:done"):
            _, p, o = k.decode().rsplit("/", 2)
            if int(o) < offs.get(int(p), -1):
                out.add(k.decode())
    return out

def test_probe(stack_settings, tmp_path: Path) -> None:
    policy = policy_with_budgets(tmp_path / "policy.yaml", t.BUDGETS)
    s = isolated(stack_settings, f"probe-{time.time_ns()}").model_copy(update={"policy_file": policy})
    props = t._corpus(s)[:-3]
    t._produce(s, props)
    proc = ProcessorProcess(s, "probe-1", tmp_path, TOOLSENTRY_FAULT_POINT=t.FAULTS, TOOLSENTRY_BATCH_MAX_RECORDS="40")
    lag = GroupLag(s)
    seen: set[str] = set()
    while True:
        proc.start().wait_ready()
        while proc.alive() and lag() > 0:
            time.sleep(0.05)
        if proc.alive():
            proc.terminate(); break
        m = re.search(r"fault point (\w+)", proc.life_log())
        time.sleep(0.5)
        now = stale(s, lag)
        new = now - seen
        seen |= now
        print("death", m.group(1) if m else "?", "stale markers new:", len(new), sorted(new)[:3])
    print("final stale", len(stale(s, lag)))
