"""How long loading a large contract set takes, and what it costs in memory.

    .venv/bin/python -m bench.contracts_load [--count 1000]

Generates COUNT contracts from the shipped pack (each pack contract copied
under new tool names, round-robin), then loads the folder the way the
processor does (meta-schema, input schema check, examples, CEL compile,
fast validators), several times, and prints the median time and the
resident memory the loaded set holds. The baseline is the shipped pack
itself, loaded in the same run.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from pathlib import Path

import yaml

from processor.contracts.registry import load_contracts

ROOT = Path(__file__).resolve().parents[1]


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def generate(count: int, into: Path) -> None:
    pack = [yaml.safe_load(p.read_text()) for p in sorted((ROOT / "contracts").rglob("*.yaml"))]
    for i in range(count):
        doc = pack[i % len(pack)]
        name = f"{doc['identity']['name'][:50]}_{i:05d}"
        doc["identity"]["name"] = name
        folder = into / name
        folder.mkdir()
        (folder / f"{doc['identity']['version']}.yaml").write_text(yaml.safe_dump(doc))


def timed_load(folder: Path, rounds: int) -> tuple[float, int]:
    times = []
    size = 0
    for _ in range(rounds):
        gc.collect()
        t = time.perf_counter()
        loaded = load_contracts(folder)
        times.append(time.perf_counter() - t)
        size = len(loaded)
    return statistics.median(times), size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        generate(args.count, folder)
        base_s, base_n = timed_load(ROOT / "contracts", args.rounds)
        before = rss_mb()
        big_s, big_n = timed_load(folder, args.rounds)
        held = load_contracts(folder)
        after = rss_mb()
    print(f"shipped pack: {base_n} contracts in {base_s * 1000:.0f} ms (median of {args.rounds})")
    print(f"generated:    {big_n} contracts in {big_s * 1000:.0f} ms (median of {args.rounds}), "
          f"{big_s / base_s * base_n / big_n:.2f}x the pack's time per contract")  # fmt: skip
    print(
        f"memory held by the loaded set: about {after - before:.0f} MB "
        f"({(after - before) * 1024 / max(len(held), 1):.0f} KB per contract)"
    )
    print(f"target: {args.count} contracts under 2 s -> {'met' if big_s < 2 else 'NOT met'}")


if __name__ == "__main__":
    main()
