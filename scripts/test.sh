#!/usr/bin/env bash
# Install everything, then run the static checks and the whole test suite.
# Integration tests start their own Kafka broker, redis-server and 3-master Redis Cluster
# on free ports.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh --test
.venv/bin/ruff check processor tests bench
.venv/bin/ruff format --check processor tests bench
.venv/bin/mypy
.venv/bin/python -m pytest "$@"
