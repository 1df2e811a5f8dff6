"""The incident tools over a busy range: replay and trace against reading the same records
alone, in one run, printed as ratios.

    .venv/bin/python -m bench.incident              # starts a private stack
    .venv/bin/python -m bench.incident --count 200000

A processor with every gate first decides ``--count`` proposals of the benchmark's
corpus (``bench.run``), so the range holds what a busy hour does: proposals,
observations, approval requests and calls. Then, each ``--rounds`` times, interleaved:

* the read alone: the committed proposals and observations of the range, through the
  reader both tools use, each record's value touched and nothing decoded;
* replay: every proposal decided again against the shipped contracts and compared;
* trace: one proposal found among every topic's records of the range.

The read is the floor: what is left above it is the tools' own work.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.run import ROOT, child_env, corpus, isolated, load_references, preload, with_identity
from processor.config import Settings
from processor.kafka.retained import RetainedReader
from processor.replay import Match, Report, reference_lookup, replay, replay_gates
from processor.stack import LocalStack, private_stack_settings
from processor.trace import read_trace, topic_roles


def timed_read(s: Settings, topics: list[str], since_ms: int) -> tuple[float, int]:
    started, count = time.perf_counter(), 0
    for m in RetainedReader(s, topics, since_ms=since_ms):
        m.value()
        count += 1
    return time.perf_counter() - started, count


def timed_replay(s: Settings, since_ms: int) -> tuple[float, Report]:
    gates = replay_gates(s, ROOT / "contracts", s.policy_file)
    report = Report(since_ms, None, "contracts", gates.contracts.fingerprint, None, True)
    started = time.perf_counter()
    replay(s, gates, reference_lookup(s), report)
    return time.perf_counter() - started, report


def timed_trace(s: Settings, proposal_id: str, since_ms: int) -> tuple[float, int]:
    started = time.perf_counter()
    found = read_trace(s, proposal_id, since_ms, None)
    if not found.found:
        raise RuntimeError(f"trace did not find {proposal_id}")
    return time.perf_counter() - started, len(found.entries)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--count", type=int, default=50_000, help="proposals in the range")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    settings = private_stack_settings(Path(tempfile.mkdtemp(prefix="bench-incident-")))
    stack = LocalStack(settings)
    stack.up()
    try:
        settings = settings.model_copy(update={"contracts_dir": ROOT / "contracts"})
        settings, tokens = with_identity(settings, Path(tempfile.mkdtemp(prefix="bench-keys-")))
        s = isolated(settings, f"bench-incident-{int(time.time())}")
        records = corpus(args.count, tokens=tokens)
        load_references(s, len(records))
        since_ms = int(time.time() * 1000) - 1000
        preload(s, records)
        print(f"deciding {args.count} proposals with every gate ...", flush=True)
        subprocess.run(
            [sys.executable, "-m", "bench.modes", "toolsentry", str(args.count)],
            cwd=ROOT, env=child_env(s), check=True, capture_output=True, timeout=900,
        )  # fmt: skip
        pair = [s.topics.proposals, s.topics.observations]
        every = list(topic_roles(s.topics))
        traced = f"p-{args.count // 2}"
        reads, everything, replays, traces = [], [], [], []
        report: Report | None = None
        entries = 0
        for n in range(args.rounds):
            print(f"round {n + 1}/{args.rounds} ...", flush=True)
            reads.append(timed_read(s, pair, since_ms))
            seconds, report = timed_replay(s, since_ms)
            replays.append(seconds)
            everything.append(timed_read(s, every, since_ms))
            seconds, entries = timed_trace(s, traced, since_ms)
            traces.append(seconds)
    finally:
        stack.down()
    assert report is not None
    read_s, read_n = statistics.median(r[0] for r in reads), reads[0][1]
    all_s, all_n = statistics.median(r[0] for r in everything), everything[0][1]
    replay_s, trace_s = statistics.median(replays), statistics.median(traces)
    same = report.counts[Match.SAME]
    print(f"\nthe range: {args.count} proposals; {read_n} proposals and observations; "
          f"{all_n} records on every topic trace reads")  # fmt: skip
    print(f"read alone (proposals, observations): {read_s:.2f} s, {read_n / read_s:,.0f} records/s")
    print(f"replay: {replay_s:.2f} s, {report.read / replay_s:,.0f} proposals/s "
          f"({same} same, {report.changed} changed, "
          f"{report.counts[Match.ADMISSION]} admission not replayed); "
          f"{replay_s / read_s:.1f}x the read of the same records")  # fmt: skip
    print(f"read alone (every topic): {all_s:.2f} s, {all_n / all_s:,.0f} records/s")
    print(f"trace of {traced} ({entries} entries): {trace_s:.2f} s, "
          f"{trace_s / all_s:.2f}x the read of the same records")  # fmt: skip
    print("(medians of the interleaved rounds)")


if __name__ == "__main__":
    main()
