"""Kafka's default partitioner: murmur2 as the Java client computes it."""

from __future__ import annotations

import pytest

from processor.kafka.partitioner import murmur2, partition_for

# From Kafka's UtilsTest.testMurmur2 (clients/src/test/java/org/apache/kafka/common/utils).
KAFKA_VECTORS = [
    (b"21", -973932308),
    (b"foobar", -790332482),
    (b"a-little-bit-long-string", -985981536),
    (b"a-little-bit-longer-string", -1486304829),
    (b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8", -58897971),
    (b"abc", 479470107),
]


@pytest.mark.parametrize(("key", "expected"), KAFKA_VECTORS)
def test_murmur2_matches_kafka(key: bytes, expected: int) -> None:
    assert murmur2(key) == expected


@pytest.mark.parametrize("length", range(0, 9))
def test_murmur2_is_a_signed_32_bit_int_for_every_tail_length(length: int) -> None:
    h = murmur2(bytes(range(200, 200 + length)))
    assert -(2**31) <= h < 2**31


def test_murmur2_depends_on_every_byte() -> None:
    assert murmur2(b"run-1") != murmur2(b"run-2")
    assert murmur2(b"abc") != murmur2(b"abd")
    assert murmur2(b"abcd") != murmur2(b"abcd\x00")


@pytest.mark.parametrize(("key", "hashed"), KAFKA_VECTORS)
@pytest.mark.parametrize("partitions", [1, 3, 6, 7, 100])
def test_partition_for_is_kafkas_formula(key: bytes, hashed: int, partitions: int) -> None:
    p = partition_for(key, partitions)
    assert 0 <= p < partitions
    assert p == (hashed & 0x7FFFFFFF) % partitions


def test_partition_for_known_values() -> None:
    # murmur2(b"foobar") & 0x7fffffff = 1357151166
    assert partition_for(b"foobar", 6) == 1357151166 % 6 == 0
    assert partition_for(b"21", 6) == (-973932308 & 0x7FFFFFFF) % 6


def test_partition_for_spreads_keys() -> None:
    seen = {partition_for(f"run-{i}".encode(), 6) for i in range(200)}
    assert seen == set(range(6))
