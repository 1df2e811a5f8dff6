"""The main job's demo, as the README runs it: the scripted agent against a processor
with the shipped policy, identity verification on, and the reference executor."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from processor.config import IdentitySettings, Settings
from processor.keys import init_keys
from tests.integration.harness import ROOT, ProcessorProcess, isolated, settings_env

pytestmark = pytest.mark.integration


def test_the_demo_plays_every_step_as_scripted(stack_settings: Settings, tmp_path: Path) -> None:
    keys = init_keys(tmp_path / "keys")
    settings = isolated(stack_settings, "demo").model_copy(
        update={
            "identity": IdentitySettings(jwks_file=keys.jwks, delegation_key_file=keys.delegation),
            "approvers_file": keys.approvers,
            "policy_file": ROOT / "policy" / "policy.yaml",
        }
    )
    proc = ProcessorProcess(settings, "demo-1", tmp_path).start().wait_ready()
    try:
        demo = subprocess.run(
            [sys.executable, "-m", "processor", "demo", "--keys", str(tmp_path / "keys"),
             "--executor-db", str(tmp_path / "support.db"), "--timeout", "60"],
            cwd=ROOT, env={**settings_env(settings, "demo-agent"), "COLUMNS": "240"},
            capture_output=True, text=True,
            timeout=600,
        )  # fmt: skip
    finally:
        proc.terminate()
    out = demo.stdout + demo.stderr
    assert demo.returncode == 0, out[-6000:]
    assert "decisions as expected" in out
    for seen in ("BUDGET_EXHAUSTED", "COMPLETED", "idempotency hit", "PERMISSION_DENIED"):
        assert seen in out, seen
    # The command it ends with reads the refund's life back from the topics.
    [command] = re.findall(r"toolsentry trace (\S+)", out)
    traced = subprocess.run(
        [sys.executable, "-m", "processor", "trace", command, "--since", "1h", "--json"],
        cwd=ROOT, env=settings_env(settings, "demo-trace"), capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert traced.returncode == 0, traced.stdout[-3000:] + traced.stderr[-3000:]
    life = json.loads(traced.stdout)
    kinds = [e["kind"] for e in life["entries"]]
    assert kinds.count("approval") == 2 and "call" in kinds and "result" in kinds, kinds
    assert life["final"]["gist"]["decision"] == "COMPLETED"
