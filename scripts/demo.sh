#!/usr/bin/env bash
# The main job: install everything, start the local stack (Kafka + Redis),
# run a processor, and play the demo agent against it. The stack stays up
# afterwards; `.venv/bin/toolsentry stack down` stops it.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
ts=.venv/bin/toolsentry
$ts stack up
mkdir -p .stack/logs
# Identity verification stays on: a development issuer signs the demo agent's token,
# and two operators' keys approve what needs approval.
$ts keys init .stack/keys
export TOOLSENTRY_IDENTITY__JWKS_FILE=.stack/keys/jwks.json
export TOOLSENTRY_IDENTITY__DELEGATION_KEY_FILE=.stack/keys/delegation.jwk
export TOOLSENTRY_APPROVERS_FILE=.stack/keys/approvers.yaml
$ts run --instance-id demo > .stack/logs/processor.log 2>&1 &
processor=$!
trap 'kill -TERM $processor 2>/dev/null; wait $processor 2>/dev/null || true' EXIT
$ts demo
echo
echo "processor log: .stack/logs/processor.log; metrics were on http://127.0.0.1:9464/metrics"
echo "the stack is still running: '$ts stack status', '$ts stack down'"
