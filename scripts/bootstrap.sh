#!/usr/bin/env bash
# Installs everything toolsentry needs on a fresh Debian machine, idempotently:
# system packages (JDK, Maven, redis-server, Prometheus), the Python venv with the project,
# and, with --test, the official JSON-Schema-Test-Suite. The Kafka broker jars
# are fetched from Maven Central by `toolsentry stack up` on first use.
set -euo pipefail
cd "$(dirname "$0")/.."

want_test_suite=0
[[ "${1:-}" == "--test" ]] && want_test_suite=1

need=()
command -v java >/dev/null 2>&1 || need+=(openjdk-17-jre-headless)
command -v mvn >/dev/null 2>&1 || need+=(maven)
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
# tests/integration/test_dashboards.py runs both binaries itself (the package's service is not used).
command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 || need+=(prometheus)
python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || need+=(python3-venv)
if ((${#need[@]})); then
  echo "bootstrap: installing ${need[*]}"
  # (through env: sudo resets the environment, and a package's prompt would hang the run)
  as_root=(env DEBIAN_FRONTEND=noninteractive)
  [[ $(id -u) -ne 0 ]] && as_root=(sudo "${as_root[@]}")
  "${as_root[@]}" apt-get update -qq
  "${as_root[@]}" apt-get install -y -qq "${need[@]}" >/dev/null
fi

if [[ ! -x .venv/bin/python ]]; then
  python3 -m venv .venv
fi
stamp=".venv/.toolsentry-installed"
digest=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$digest" ]]; then
  echo "bootstrap: installing Python packages into .venv"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e '.[dev]'
  echo "$digest" > "$stamp"
fi

if ((want_test_suite)); then
  suite="${TOOLSENTRY_JSON_SCHEMA_SUITE:-$HOME/.cache/toolsentry/json-schema-test-suite}"
  if [[ ! -d "$suite/tests/draft2020-12" ]]; then
    echo "bootstrap: fetching the JSON-Schema-Test-Suite (shipped in the jsonschema sdist)"
    tmp=$(mktemp -d)
    version=$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("jsonschema"))')
    .venv/bin/python -m pip download -q --no-deps --no-binary :all: "jsonschema==$version" -d "$tmp"
    tar -xzf "$tmp"/jsonschema-*.tar.gz -C "$tmp"
    mkdir -p "$suite"
    cp -r "$tmp"/jsonschema-*/json/. "$suite"/
    rm -rf "$tmp"
  fi
fi
