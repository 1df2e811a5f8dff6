"""``toolsentry``: the one command for operators, tool owners and newcomers."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import typer
from rich.console import Console, RenderableType
from rich.table import Table
from rich.text import Text

from processor.config import Settings, load_settings

T = TypeVar("T")

app = typer.Typer(
    help="toolsentry: validate, authorize and route LLM agent tool calls on Kafka, exactly once.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)
stack_app = typer.Typer(
    help="The local Kafka broker and redis-server (no Docker needed).", no_args_is_help=True
)
contracts_app = typer.Typer(
    help="Tool contracts: check, list, lint, show and export.", no_args_is_help=True
)
approvals_app = typer.Typer(
    help="The approval queue: list, show, approve, reject parked calls.", no_args_is_help=True
)
keys_app = typer.Typer(
    help="Key material: a development issuer, approvers, the processor's delegation key."
)
reference_app = typer.Typer(
    help="Publish reference data (entity states) to tool.reference.", no_args_is_help=True
)
app.add_typer(stack_app, name="stack")
app.add_typer(contracts_app, name="contracts")
app.add_typer(approvals_app, name="approvals")
app.add_typer(keys_app, name="keys")
app.add_typer(reference_app, name="reference")
console = Console(markup=False)
"""Markup off: what the commands print (contract problems, exceptions, ids read from Kafka
and Redis) is shown as it is. Colour goes through ``_alarm`` and Text styles."""


def _alarm(head: str, rest: str = "") -> None:
    """One line with its head in red and the rest as it is."""
    console.print(Text.assemble((head, "red"), rest), soft_wrap=True)


ConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--config",
        "-c",
        help="YAML/JSON settings file (also TOOLSENTRY_CONFIG).",
        exists=True,
        dir_okay=False,
    ),
]


ContractsDirArg = Annotated[
    Path | None, typer.Argument(help="Contracts folder (default: the settings' contracts_dir).")
]


def _settings(config: Path | None, **overrides: Any) -> Settings:
    """The settings, or exit 2 naming each one that is invalid (a traceback would bury it):
    a value refused, a variable that is not the JSON its setting takes, or a settings file
    that cannot be read or is not a mapping."""
    import yaml
    from pydantic import ValidationError

    try:
        return load_settings(config, **overrides)
    except ValidationError as exc:
        problems = "".join(
            f"\n  {'.'.join(str(part) for part in e['loc']) or 'settings'}: {e['msg']}"
            for e in exc.errors()
        )
        _alarm("invalid settings", problems)
        raise typer.Exit(2) from exc
    except (ValueError, OSError, yaml.YAMLError) as exc:
        _alarm("invalid settings", f": {exc}")
        raise typer.Exit(2) from exc


def _contracts_dir(path: Path | None, config: Path | None) -> Path:
    """The folder named on the command line, else the one the processor loads."""
    return path if path is not None else _settings(config).contracts_dir


def _logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


@app.command()
def run(
    config: ConfigOpt = None,
    instance_id: Annotated[str | None, typer.Option(help="Stable id of this instance.")] = None,
    contracts_dir: Annotated[
        Path | None, typer.Option("--contracts", help="Contracts folder.")
    ] = None,
    metrics_port: Annotated[int | None, typer.Option(help="Prometheus port; 0 disables.")] = None,
    bootstrap_servers: Annotated[str | None, typer.Option(help="Kafka bootstrap servers.")] = None,
) -> None:
    """Run one processor instance until SIGTERM/SIGINT (the batch in hand is finished first)."""
    from processor.app import Processor, StuckForGood, UnsafeSetting, stop_on_signals

    stop, reload = stop_on_signals()
    from processor.contracts.registry import ContractError
    from processor.metrics import serve

    s = _settings(
        config,
        instance_id=instance_id,
        contracts_dir=contracts_dir,
        metrics_port=metrics_port,
        bootstrap_servers=bootstrap_servers,
    )
    _logging(s.log_level)
    from processor.approvals import ApproverError
    from processor.identity import KeyError_
    from processor.policy import PolicyError

    try:
        processor = Processor(s, stop_requested=stop, reload_requested=reload)
    except ContractError as exc:
        _alarm("contracts refused", f"\n{exc}")
        raise typer.Exit(2) from exc
    except (PolicyError, ApproverError, KeyError_, UnsafeSetting, OSError) as exc:
        _alarm("cannot start", f": {exc}")
        raise typer.Exit(2) from exc
    serve(s.metrics_port)
    try:
        processor.run()
    except StuckForGood as exc:
        logging.getLogger("processor").error("%s", exc)
        raise typer.Exit(3) from exc


@app.command()
def demo(
    config: ConfigOpt = None,
    tenant: Annotated[str, typer.Option(help="Tenant the demo agent acts for.")] = "acme",
    timeout: Annotated[float, typer.Option(help="Seconds to wait for each observation.")] = 60.0,
    keys: Annotated[
        Path, typer.Option(help="Development keys (issuer, approvers); created if missing.")
    ] = Path(".stack/keys"),
    executor_db: Annotated[
        Path | None,
        typer.Option(
            help="Run the reference support executor in-process over this SQLite file "
            "(recreated each time); --no-executor when an executor already runs."
        ),
    ] = Path(".stack/support.db"),
    no_executor: Annotated[
        bool, typer.Option("--no-executor", help="Do not run an executor in-process.")
    ] = False,
) -> None:
    """Play a scripted support agent against the running stack and show each decision,
    and, for the calls that ran, their results. Exit status 1 when a decision differs
    from the script or does not come, 2 when the broker, Redis or the processors'
    reference loader does not answer."""
    from processor.demo import WIDE, StackUnavailable, play

    _positive(timeout, "--timeout")
    s = _settings(config)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console.width = WIDE  # a log or a pipe has no width to fit
    try:
        ok = play(s, tenant, timeout, console, keys, None if no_executor else executor_db)
    except StackUnavailable as exc:
        _alarm("the demo cannot run", f": {exc}")
        console.print("Is the stack up (toolsentry stack up) and a processor running "
                      "(toolsentry run)?", soft_wrap=True)  # fmt: skip
        raise typer.Exit(2) from exc
    raise typer.Exit(0 if ok else 1)


def _positive(seconds: float, hint: str) -> None:
    """A wait of no time, or less, would report every answer as missing."""
    if not seconds > 0:
        raise typer.BadParameter("must be more than 0 seconds", param_hint=hint)


@app.command("taxonomy")
def taxonomy(
    readme: Annotated[
        Path | None,
        typer.Option(
            help="Rewrite the table between the markers in this file.",
            exists=True,
            dir_okay=False,
        ),
    ] = None,
) -> None:
    """The error taxonomy: each class's response vector, who raises it, the next action."""
    from processor.taxonomy import BEGIN, END, table_markdown

    table = table_markdown()
    if readme is None:
        typer.echo(table, nl=False)
        return
    text = readme.read_text()
    head, _, rest = text.partition(BEGIN + "\n")
    _, _, tail = rest.partition(END)
    readme.write_text(f"{head}{BEGIN}\n{table}{END}{tail}")


@app.command("config")
def show_config(config: ConfigOpt = None) -> None:
    """Print the effective settings (file + environment + defaults) as JSON, secrets masked."""
    s = _settings(config)
    console.print_json(json.dumps(s.shown()))


# -- stack -------------------------------------------------------------------------------------


@stack_app.command("up")
def stack_up(config: ConfigOpt = None) -> None:
    """Fetch what is missing, start Kafka and Redis, wait until ready, create the topics."""
    from processor.stack import LocalStack

    s = _settings(config)
    _logging("INFO")
    LocalStack(s).up()
    _print_status(s)


@stack_app.command("down")
def stack_down(config: ConfigOpt = None) -> None:
    """Stop Kafka and Redis cleanly."""
    from processor.stack import LocalStack

    s = _settings(config)
    LocalStack(s).down()
    _print_status(s)


@stack_app.command("status")
def stack_status(config: ConfigOpt = None) -> None:
    """Show whether each service runs and answers."""
    _print_status(_settings(config))


@stack_app.command("logs")
def stack_logs(
    service: Annotated[str, typer.Argument(help="kafka or redis")] = "kafka",
    lines: Annotated[int, typer.Option("-n", help="Lines from the end.", min=1)] = 50,
    config: ConfigOpt = None,
) -> None:
    """Print the end of a service's log."""
    from processor.stack import LocalStack

    try:
        path = LocalStack(_settings(config)).log_path(service)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="SERVICE") from exc
    if not path.exists():
        console.print(f"no log at {path}")
        raise typer.Exit(1)
    for line in tail(path, lines):
        typer.echo(line)


def tail(path: Path, lines: int, block: int = 65_536) -> list[str]:
    """The last ``lines`` lines of ``path``, read backwards a block at a time: a broker's
    log may be gigabytes, of which the end is wanted."""
    with path.open("rb") as f:
        end = f.seek(0, os.SEEK_END)
        start, data = end, b""
        # (one newline more than asked for: the first line read may have begun earlier)
        while start > 0 and data.count(b"\n") <= lines:
            step = min(block, start)
            start -= step
            f.seek(start)
            data = f.read(step) + data
    return data.decode(errors="replace").splitlines()[-lines:]


@stack_app.command("topics")
def stack_topics(
    config: ConfigOpt = None,
    partitions: Annotated[int | None, typer.Option(help="Partitions for new topics.")] = None,
) -> None:
    """Create every topic that is missing on the configured cluster (also for production)."""
    from processor.kafka.topics import ensure_topics

    created = ensure_topics(_settings(config), partitions)
    console.print(f"created: {', '.join(created) or 'nothing (all topics exist)'}")


def _print_status(s: Settings) -> None:
    from processor.stack import LocalStack

    table = Table("service", "running", "ready", "pid", "address", "detail")
    for name, st in LocalStack(s).status().items():
        table.add_row(
            name, str(st.running), str(st.ready), str(st.pid or "-"), st.address, st.detail
        )
    console.print(table)


# -- contracts ---------------------------------------------------------------------------------


@contracts_app.command("check")
def contracts_check(
    path: ContractsDirArg = None,
    config: ConfigOpt = None,
) -> None:
    """Load a contract set the way the processor does; exit 1 with every problem if refused."""
    from processor.contracts.registry import ContractError, load_contracts

    try:
        cs = load_contracts(_contracts_dir(path, config))
    except ContractError as exc:
        for p in exc.problems:
            _alarm(str(p.file), f" {p.path}: {p.reason}")
        raise typer.Exit(1) from exc
    console.print(f"{len(cs)} contracts, {len(cs.names)} tools, set {cs.fingerprint}")


@contracts_app.command("list")
def contracts_list(
    path: ContractsDirArg = None,
    config: ConfigOpt = None,
) -> None:
    """List tools, versions, lifecycle and side-effect class."""
    from processor.contracts.registry import load_contracts

    cs = load_contracts(_contracts_dir(path, config))
    table = Table("tool", "version", "lifecycle", "side-effect class", "timeout ms")
    for name in cs.names:
        for c in cs.versions(name):
            table.add_row(
                name, c.version, c.lifecycle.status, c.side_effect_class.value, str(c.timeout_ms)
            )
    console.print(table)


@contracts_app.command("lint")
def contracts_lint(
    path: ContractsDirArg = None,
    config: ConfigOpt = None,
    output_format: Annotated[
        str, typer.Option("--format", help="text or json.", case_sensitive=False)
    ] = "text",
) -> None:
    """Check contracts against the design rules; exit 1 if any finding is an error."""
    from processor.contracts.lint import lint_folder

    if output_format not in ("text", "json"):
        raise typer.BadParameter("must be text or json", param_hint="--format")
    findings = lint_folder(_contracts_dir(path, config))
    errors = sum(1 for f in findings if f.severity == "error")
    warnings = len(findings) - errors
    if output_format == "json":
        typer.echo(json.dumps([f.to_dict() for f in findings], indent=2))
    else:
        for f in findings:
            typer.echo(str(f))
    # The summary goes to stderr in json mode so stdout stays one parseable document.
    typer.echo(f"{errors} error(s), {warnings} warning(s)", err=output_format == "json")
    raise typer.Exit(1 if errors else 0)


@contracts_app.command("export")
def contracts_export(
    output_format: Annotated[
        str, typer.Option("--format", help="openai, anthropic or mcp.", case_sensitive=False)
    ],
    path: ContractsDirArg = None,
    config: ConfigOpt = None,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Write here instead of stdout.")
    ] = None,
) -> None:
    """Write the model-facing tool definitions of every callable tool as JSON."""
    from processor.contracts.export import TARGETS, export_tools
    from processor.contracts.registry import ContractError, load_contracts

    target = next((t for t in TARGETS if t == output_format.lower()), None)
    if target is None:
        raise typer.BadParameter(f"must be one of {', '.join(TARGETS)}", param_hint="--format")
    try:
        cs = load_contracts(_contracts_dir(path, config))
    except ContractError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(1) from exc
    text = json.dumps(export_tools(cs, target), indent=2, ensure_ascii=False) + "\n"
    if output is None:
        typer.echo(text, nl=False)
    else:
        output.write_text(text, encoding="utf-8")
        typer.echo(f"wrote {output}", err=True)


@contracts_app.command("show")
def contracts_show(
    tool: Annotated[str, typer.Argument(help="TOOL or TOOL@VERSION.")],
    path: ContractsDirArg = None,
    config: ConfigOpt = None,
) -> None:
    """Show one contract: what it does, its risk, what it needs, its limits and arguments."""
    from processor.contracts.registry import ContractError, load_contracts
    from processor.contracts.show import UnknownContract, show

    try:
        cs = load_contracts(_contracts_dir(path, config))
    except ContractError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(1) from exc
    try:
        show(cs, tool, console)
    except UnknownContract as exc:
        hint = f"; did you mean: {', '.join(exc.suggestions)}" if exc.suggestions else ""
        typer.echo(f"{exc}{hint}", err=True)
        raise typer.Exit(1) from exc


@app.command("eval")
def evaluate(
    suite: Annotated[
        Path,
        typer.Option(help="Suite folder (suite.yaml, cases/).", exists=True, file_okay=False),
    ] = Path("tests/conformance"),
    keys: Annotated[Path, typer.Option(help="Where the suite's keys are (or go).")] = Path(
        ".stack/eval-keys"
    ),
    prepare: Annotated[
        bool, typer.Option("--prepare", help="Only write the keys the processor must trust.")
    ] = False,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for each observation.")] = 60.0,
    report: Annotated[Path | None, typer.Option(help="Also write the results as JSON.")] = None,
    config: ConfigOpt = None,
) -> None:
    """Run a labelled conformance suite through the running processors; per-category accuracy.

    First run it with --prepare: that writes the keys and prints the settings to start the
    processors with (JWKS, approvers, the suite's policy). Exit status 1 below 100%, 2 when
    the keys or the topics are missing."""
    from processor.demo import UNAVAILABLE
    from processor.evaluate import Runner, load_suite, prepare_keys, summary

    _positive(timeout, "--timeout")
    loaded = load_suite(suite)
    if prepare:
        k = _written(keys, lambda: prepare_keys(loaded, keys))
        # Plain lines, never wrapped or read as markup: they are meant to be exported.
        typer.echo(f"TOOLSENTRY_IDENTITY__JWKS_FILE={k.jwks.resolve()}")
        typer.echo(f"TOOLSENTRY_IDENTITY__DELEGATION_KEY_FILE={k.delegation.resolve()}")
        typer.echo(f"TOOLSENTRY_APPROVERS_FILE={k.approvers.resolve()}")
        typer.echo(f"TOOLSENTRY_POLICY_FILE={loaded.policy.resolve()}")
        return
    from processor.evaluate import SuiteKeys

    s = _settings(config)
    try:
        runner = Runner(s, loaded, SuiteKeys(keys))
    except FileNotFoundError as exc:
        _alarm(f"no suite keys in {keys}", f": {exc.filename} is missing")
        console.print(f"Write them first: toolsentry eval --prepare --keys {keys}", soft_wrap=True)
        raise typer.Exit(2) from exc
    except UNAVAILABLE as exc:
        _unavailable(exc)
    try:
        runner.publish_references()
        results = runner.run(timeout)
    except UNAVAILABLE as exc:
        _unavailable(exc)
    finally:
        runner.close()
    table = Table("category", "passed", "cases", "accuracy")
    for category, (good, total) in summary(results).items():
        table.add_row(category, str(good), str(total), f"{100 * good / total:.1f}%")
    passed = sum(r.passed for r in results)
    table.add_row("all", str(passed), str(len(results)), f"{100 * passed / len(results):.1f}%")
    console.print(table)
    for r in results:
        if not r.passed:
            _alarm("FAIL", f" {r.case_id} ({r.category}): {'; '.join(r.problems)}")
    if report is not None:
        doc = {
            "passed": passed,
            "total": len(results),
            "categories": {c: {"passed": g, "total": t} for c, (g, t) in summary(results).items()},
            "failures": [
                {"id": r.case_id, "category": r.category, "problems": r.problems}
                for r in results
                if not r.passed
            ],
        }
        report.write_text(json.dumps(doc, indent=2) + "\n")
    raise typer.Exit(0 if passed == len(results) else 1)


def _unavailable(exc: Exception) -> NoReturn:
    """Exit 2 for a suite the stack cannot run (no broker, no topics, no Redis): the reason,
    not a traceback."""
    _alarm("the suite cannot run", f": {exc}")
    console.print("Is the stack up (toolsentry stack up) and a processor running "
                  "(toolsentry run)?", soft_wrap=True)  # fmt: skip
    raise typer.Exit(2) from exc


# -- keys, reference data, approvals ----------------------------------------------------------


def _written(directory: Path, write: Callable[[], T]) -> T:
    """What ``write`` returns, or exit 2 when it cannot write into ``directory`` (read-only,
    not a folder, no permission): the reason, not a traceback."""
    try:
        return write()
    except OSError as exc:
        _alarm(f"cannot write keys into {directory}", f": {exc.strerror or exc}")
        raise typer.Exit(2) from exc


@keys_app.command("init")
def keys_init(
    directory: Annotated[Path, typer.Argument(help="Where to write the keys.")] = Path(
        ".stack/keys"
    ),
) -> None:
    """Create a development issuer key (and its JWKS), two approvers' keys and the
    processor's delegation key."""
    from processor.keys import init_keys

    bundle = _written(directory, lambda: init_keys(directory))
    typer.echo(f"issuer private key  {bundle.issuer}")
    typer.echo(f"JWKS for processors {bundle.jwks}   (TOOLSENTRY_IDENTITY__JWKS_FILE)")
    typer.echo(f"approvers           {bundle.approvers}   (TOOLSENTRY_APPROVERS_FILE)")
    typer.echo(
        f"delegation key      {bundle.delegation}   (TOOLSENTRY_IDENTITY__DELEGATION_KEY_FILE)"
    )


@keys_app.command("delegation")
def keys_delegation(
    path: Annotated[Path, typer.Argument(help="Where to write the new private key (JWK).")],
) -> None:
    """Create a new delegation key with a kid of its own, for a rotation (README: In whose
    name). Refuses to overwrite a file."""
    from processor.keys import new_delegation_key

    if path.exists():
        _alarm(f"{path} exists", ": pick a new file")
        raise typer.Exit(2)
    kid = new_delegation_key(path)
    console.print(f"delegation key {path} (kid {kid})")


@reference_app.command("put")
def reference_put(
    key: Annotated[str, typer.Argument(help="tenant/entity/id, e.g. acme/order/WO-12345-A")],
    state: Annotated[str | None, typer.Option(help="The entity's state; omit to delete.")] = None,
    owner: Annotated[str | None, typer.Option(help="Who the entity belongs to.")] = None,
    config: ConfigOpt = None,
) -> None:
    """Publish one entity (or its tombstone) to tool.reference."""
    from processor.kafka.produce import DeliveryError
    from processor.reference_data import publish_references
    from processor.state.references import BadReference

    if state is None and owner is not None:
        # (without a state the entity is deleted: not what an owner given asks for)
        _alarm("not published", ": --owner needs --state; omit both to delete the entity")
        raise typer.Exit(2)
    s = _settings(config)
    value = None if state is None else {"state": state, **({"owner": owner} if owner else {})}
    try:
        publish_references(s, [(key, value)])
    except BadReference as exc:
        _alarm("not published", f": {exc}")
        raise typer.Exit(2) from exc
    except (TimeoutError, DeliveryError) as exc:
        _alarm("not published", f": {exc}")
        raise typer.Exit(1) from exc
    console.print(f"{key}: {'deleted' if value is None else state}")


def _approval_store(s: Settings) -> Any:
    """The approval queue, or exit 2 saying Redis does not answer (not a traceback)."""
    from redis.exceptions import RedisClusterException, RedisError

    from processor.state.approvals import ApprovalStore
    from processor.state.connection import connect

    try:
        client = connect(s.redis_url, socket_timeout=5)
        client.ping()
    except (RedisError, RedisClusterException) as exc:
        _alarm("Redis does not answer", f": {exc}")
        raise typer.Exit(2) from exc
    return ApprovalStore(client, s.redis_namespace)


@approvals_app.command("list")
def approvals_list(
    config: ConfigOpt = None,
    all_: Annotated[bool, typer.Option("--all", help="Include ended requests.")] = False,
) -> None:
    """Parked calls waiting for approval, oldest first."""
    from processor.approvals import iso

    s = _settings(config)
    entries = _approval_store(s).list_parked(include_ended=all_)
    table = Table("request", "state", "tenant", "tool", "class", "approvals", "expires")
    for e in entries:
        table.add_row(
            e["request_id"],
            e["state"],
            e["tenant_id"],
            f"{e['tool_name']}@{e['tool_version']}",
            e["side_effect_class"],
            f"{len(e.get('approvers') or [])}/{e['needed']}",
            iso(int(e["expires_at"])),
        )
    console.print(table)
    console.print(f"{len(entries)} request(s)")


@approvals_app.command("show")
def approvals_show(request_id: str, config: ConfigOpt = None) -> None:
    """The confirmation packet of one request: exactly what would run."""
    from processor.approvals import iso
    from processor.codec.records import printable

    s = _settings(config)
    e = _approval_store(s).find(request_id)
    if e is None:
        typer.echo(f"no request {request_id}", err=True)
        raise typer.Exit(1)
    rows = [
        ("request", e["request_id"]),
        ("state", e["state"]),
        ("action", e["action"]),
        ("consequence", e["consequence"]),
        ("arguments", e["arguments"]),
        ("before state", e.get("before_state") or "(no reference data)"),
        ("risk", f"{e['side_effect_class']}: {e['risk_reason']}"),
        ("approvals", f"{len(e.get('approvers') or [])} of {e['needed']}"),
        ("requested by", f"{e['requested_by_user']} via {e['requested_by_agent']}"),
        ("tenant / run", f"{e['tenant_id']} / {e['run_id']}"),
        ("trace", e["trace_id"]),
        ("payload hash", e["payload_hash"]),
        ("idempotency", e["idempotency_key"]),
        ("expires", iso(int(e["expires_at"]))),
        ("if rejected", e["rejection_path"]),
    ]
    table = Table(show_header=False)
    for k, v in rows:
        # Agents' arguments and ids, and systems of record's states: an escape sequence or
        # a bidirectional override among them must not reach the approver's terminal.
        table.add_row(k, printable(str(v)))
    console.print(table)


def _decide(
    request_id: str, decision: str, key: Path, approver_id: str, reason: str | None, s: Settings
) -> None:
    import time

    from processor.approval_flow import publish_approvals
    from processor.approvals import load_private_key, sign_for_request
    from processor.kafka.produce import DeliveryError

    e = _approval_store(s).find(request_id)
    if e is None:
        typer.echo(f"no request {request_id}", err=True)
        raise typer.Exit(1)
    if e["state"] != "parked":
        typer.echo(f"request {request_id} is already {e['state']}", err=True)
        raise typer.Exit(1)
    now_ms = int(time.time() * 1000)
    approval = sign_for_request(load_private_key(key), approver_id, e, now_ms, decision, reason)
    try:
        publish_approvals(s, e["run_id"], [approval])
    except (TimeoutError, DeliveryError) as exc:
        typer.echo(f"the decision was not delivered: {exc}", err=True)
        raise typer.Exit(1) from exc
    console.print(f"{decision} {request_id} as {approver_id} ({approval['approval_id']})")


KeyOpt = Annotated[
    Path, typer.Option("--key", help="The approver's Ed25519 private key (JWK or PEM).")
]
ApproverOpt = Annotated[str, typer.Option("--as", help="Approver id, as in approvers.yaml.")]


@approvals_app.command("approve")
def approvals_approve(
    request_id: str,
    key: KeyOpt,
    approver_id: ApproverOpt,
    reason: Annotated[str | None, typer.Option(help="Why (kept with the decision).")] = None,
    config: ConfigOpt = None,
) -> None:
    """Sign and publish an approval for a parked call."""
    _decide(request_id, "approved", key, approver_id, reason, _settings(config))


@approvals_app.command("reject")
def approvals_reject(
    request_id: str,
    key: KeyOpt,
    approver_id: ApproverOpt,
    reason: Annotated[str, typer.Option(help="Why; the agent is told.")],
    config: ConfigOpt = None,
) -> None:
    """Sign and publish a rejection: the parked call ends without running."""
    _decide(request_id, "rejected", key, approver_id, reason, _settings(config))


# -- incident analysis: trace and replay ------------------------------------------------------


SINCE_HELP = (
    "Earliest record time: a duration before now (2h, 7d), ISO 8601 (UTC unless it says) "
    "or epoch ms"
)
UNTIL_HELP = "Latest record time, as --since (default: now)"
SinceOpt = Annotated[str, typer.Option(help=f"{SINCE_HELP}.")]
UntilOpt = Annotated[str | None, typer.Option(help=f"{UNTIL_HELP}.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="One JSON document, for tooling.")]
DEFAULT_SINCE = "24h"


def _time_range(since: str, until: str | None) -> tuple[int, int | None]:
    """``--since`` and ``--until`` in epoch milliseconds; a bad one is a usage error."""
    import time

    from processor.kafka.retained import parse_time

    now_ms = int(time.time() * 1000)
    try:
        since_ms = parse_time(since, now_ms)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--since") from exc
    if since_ms > now_ms:
        # A mistyped date, say: an empty range would read as nothing having happened.
        raise typer.BadParameter("is after now: the range holds no record yet",
                                 param_hint="--since")  # fmt: skip
    try:
        until_ms = None if until is None else parse_time(until, now_ms)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--until") from exc
    if until_ms is not None and until_ms < since_ms:
        raise typer.BadParameter("is before --since", param_hint="--until")
    return since_ms, until_ms


def _print_all(parts: Iterable[RenderableType]) -> None:
    for part in parts:
        console.print(part, soft_wrap=isinstance(part, Text))


@app.command("trace")
def trace(
    proposal_id: Annotated[
        str | None,
        typer.Argument(help="The proposal to follow; without it, --run-id's proposals."),
    ] = None,
    since: SinceOpt = DEFAULT_SINCE,
    until: UntilOpt = None,
    run_id: Annotated[
        str | None,
        typer.Option(
            "--run-id",
            help="Its run: read only the run's partition where keyed by run. Alone: the "
            "run's proposals, one row each.",
        ),
    ] = None,
    as_json: JsonOpt = False,
    config: ConfigOpt = None,
) -> None:
    """The life of one proposal, read from the retained topics: its decision, approval,
    call, result and final observation, any compensation, any dead letters. With --run-id
    alone, the run's proposals, each with its decision and last answer. Exit status 1
    when the range holds no record of it (or no proposal of the run), 2 for a bad option
    or when the broker cannot be read."""
    from confluent_kafka import KafkaException

    from processor.trace import RunView, Trace, read_run, read_trace, render, render_run

    since_ms, until_ms = _time_range(since, until)
    for given, hint in ((proposal_id, "PROPOSAL_ID"), (run_id, "--run-id")):
        # Bytes that are not UTF-8 reach argv as lone surrogates: no record can hold them.
        try:
            (given or "").encode()
        except UnicodeEncodeError:
            raise typer.BadParameter("is not UTF-8 text", param_hint=hint) from None
    s = _settings(config)
    found: Trace | RunView
    try:
        if proposal_id is not None:
            found = read_trace(s, proposal_id, since_ms, until_ms, run_id)
        elif run_id is not None:
            found = read_run(s, run_id, since_ms, until_ms)
        else:
            raise typer.BadParameter("give a proposal id, or --run-id for a run's proposals",
                                     param_hint="PROPOSAL_ID")  # fmt: skip
    except KafkaException as exc:
        # Not exit status 1, which says the range holds no record of it.
        _alarm("trace failed", f": {exc}")
        raise typer.Exit(2) from exc
    if as_json:
        typer.echo(json.dumps(found.as_json(), indent=2))
    else:
        _print_all(render(found) if isinstance(found, Trace) else render_run(found))
    raise typer.Exit(0 if found.found else 1)


_OFFSET_HINTS = {"partition": "--partition", "first": "--from-offset", "last": "--to-offset"}
"""The option each bound of an offset range comes from (see ``OutOfRange.what``)."""


def _replay_range(
    since: str | None,
    until: str | None,
    partition: int | None,
    from_offset: int | None,
    to_offset: int | None,
) -> tuple[int | None, int | None]:
    """Replay's time range, None for an offset range: a time range (which ``--partition``
    narrows to one partition), or an offset range of one partition instead. Options that
    contradict each other are a usage error; whether the partition holds the offsets is
    known once the broker is asked."""
    if from_offset is None:
        if to_offset is not None:
            raise typer.BadParameter("needs --from-offset", param_hint="--to-offset")
        return _time_range(since or DEFAULT_SINCE, until)
    if partition is None:
        raise typer.BadParameter("needs --partition: offsets are one partition's",
                                 param_hint="--from-offset")  # fmt: skip
    for given, hint in ((since, "--since"), (until, "--until")):
        if given is not None:
            raise typer.BadParameter(
                "cannot be given with --from-offset: an offset range is replayed whole, "
                "whatever its records' times", param_hint=hint,
            )  # fmt: skip
    if to_offset is not None and to_offset < from_offset:
        raise typer.BadParameter("is before --from-offset", param_hint="--to-offset")
    return None, None


@app.command("replay")
def replay_command(
    since: Annotated[
        str | None,
        typer.Option(help=f"{SINCE_HELP} (default: {DEFAULT_SINCE}). Not with --from-offset."),
    ] = None,
    until: Annotated[
        str | None, typer.Option(help=f"{UNTIL_HELP}. Not with --from-offset.")
    ] = None,
    partition: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="Only this partition of tool.proposals; the partition "
            "--from-offset and --to-offset are in.",
        ),
    ] = None,
    from_offset: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="Replay --partition from this offset: an offset range, instead of a time range.",
        ),
    ] = None,
    to_offset: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="The last offset of --partition to replay, included "
            "(default: the partition's end as the replay starts).",
        ),
    ] = None,
    contracts: Annotated[
        Path | None,
        typer.Option(help="Contracts to replay against (default: the settings' contracts_dir)."),
    ] = None,
    policy: Annotated[
        Path | None,
        typer.Option(help="Policy to replay against (default: the settings' policy_file)."),
    ] = None,
    tenant: Annotated[str | None, typer.Option(help="Only this tenant's proposals.")] = None,
    tool: Annotated[str | None, typer.Option(help="Only proposals of this tool.")] = None,
    examples: Annotated[int, typer.Option(min=0, help="Example proposals per change.")] = 3,
    slack_s: Annotated[
        float,
        typer.Option(
            min=0,
            help="Seconds after --until (or the offset range's latest record "
            "time) to look for the answers.",
        ),
    ] = 300.0,
    no_references: Annotated[
        bool, typer.Option("--no-references", help="No Redis: every referenced id unknown.")
    ] = False,
    as_json: JsonOpt = False,
    fail_on_change: Annotated[
        bool, typer.Option("--fail-on-change", help="Exit 1 when any decision would change.")
    ] = False,
    config: ConfigOpt = None,
) -> None:
    """Decide a time range of tool.proposals, or an offset range of one of its partitions,
    again (dry run: nothing written) against these contracts and policy, and report what
    would change against what was decided. Exit status 2 for a bad option (a partition or
    offsets the topic does not hold among them), or a topic it reads that does not exist."""
    from confluent_kafka import KafkaException

    from processor.approvals import ApproverError
    from processor.contracts.registry import ContractError
    from processor.identity import KeyError_
    from processor.kafka.retained import OffsetRange, OutOfRange
    from processor.policy import PolicyError
    from processor.replay import (
        ReplayError,
        Report,
        reference_lookup,
        render,
        replay,
        replay_gates,
        selection,
        unknown_references,
    )

    since_ms, until_ms = _replay_range(since, until, partition, from_offset, to_offset)
    if not math.isfinite(slack_s):  # the option's range lets infinity through
        raise typer.BadParameter("is not a finite number of seconds", param_hint="--slack-s")
    s = _settings(config)
    offsets = None
    if partition is not None:
        offsets = OffsetRange(s.topics.proposals, partition, from_offset, to_offset)
    _logging(s.log_level)
    contracts_dir = contracts if contracts is not None else s.contracts_dir
    policy_file = policy if policy is not None else s.policy_file
    try:
        gates = replay_gates(s, contracts_dir, policy_file)
    except ContractError as exc:
        _alarm("contracts refused", f"\n{exc}")
        raise typer.Exit(2) from exc
    except (PolicyError, ApproverError, KeyError_, OSError) as exc:
        _alarm("cannot load", f": {exc}")
        raise typer.Exit(2) from exc
    report = Report(
        since_ms, until_ms, str(contracts_dir), gates.contracts.fingerprint,
        None if policy_file is None else str(policy_file), not no_references, examples,
        offsets=offsets,
    )  # fmt: skip
    try:
        lookup = unknown_references if no_references else reference_lookup(s)
        replay(
            s, gates, lookup, report, wanted=selection(tenant, tool), slack_ms=int(slack_s * 1000)
        )
    except OutOfRange as exc:
        raise typer.BadParameter(str(exc), param_hint=_OFFSET_HINTS[exc.what]) from exc
    except (ReplayError, KafkaException, ValueError) as exc:
        _alarm("replay failed", f": {exc}")
        raise typer.Exit(2) from exc
    if as_json:
        typer.echo(json.dumps(report.as_dict(), indent=2))
    else:
        _print_all(render(report.as_dict()))
    if report.missing:
        # Nothing read is nothing changed: not a pass for --fail-on-change.
        raise typer.Exit(2)
    raise typer.Exit(1 if fail_on_change and report.changed else 0)


# -- executors ---------------------------------------------------------------------------------

executor_app = typer.Typer(
    help="Executors: run approved calls and publish their results to tool.results.",
    no_args_is_help=True,
)
app.add_typer(executor_app, name="executor")


@executor_app.command("run")
def executor_run(
    db: Annotated[Path, typer.Option(help="The support store's SQLite file (created if missing).")],
    classes: Annotated[
        list[str] | None,
        typer.Option(
            "--classes", help="Side-effect classes to consume (repeat, or comma-separate); all six."
        ),
    ] = None,
    fail_after_commit: Annotated[
        list[str] | None,
        typer.Option(
            "--fail-after-commit",
            help="A mutating tool that commits its step, then reports a failure needing "
            "compensation (repeatable; for tests and demos).",
        ),
    ] = None,
    seed_demo: Annotated[
        str | None,
        typer.Option(help="Add the orders the demo (toolsentry demo) publishes for this tenant."),
    ] = None,
    executor_id: Annotated[
        str | None,
        typer.Option(
            help="Stable id of this executor (default: the instance id and a digest of the "
            "classes served)."
        ),
    ] = None,
    metrics_port: Annotated[int, typer.Option(help="Prometheus port; 0 disables.")] = 0,
    config: ConfigOpt = None,
) -> None:
    """Run the reference support executor until SIGTERM/SIGINT (the call in hand is
    finished and committed first; the calls not started yet are left to the next owner
    of their partitions)."""
    import signal
    import sqlite3

    from prometheus_client import REGISTRY

    from processor.executor import Executor
    from processor.metrics import serve
    from processor.support_executor import SupportStore, demo_orders

    s = _settings(config)
    _logging(s.log_level)
    wanted = [c.strip() for arg in classes or () for c in arg.split(",") if c.strip()]
    try:
        store = SupportStore(db, fail_after_commit or ())
        executor = Executor(
            s,
            store.handlers(),
            classes=wanted or None,
            executor_id=executor_id,
            metrics_registry=REGISTRY if metrics_port else None,
            recorded=store.recorded,
        )
    except (ValueError, sqlite3.Error) as exc:
        _alarm("cannot start", f": {exc}")
        raise typer.Exit(2) from exc
    signal.signal(signal.SIGTERM, lambda *_: executor.stop())
    signal.signal(signal.SIGINT, lambda *_: executor.stop())
    if seed_demo:
        console.print(f"seeded {store.seed(demo_orders(seed_demo))} order(s) into {db}")
    serve(metrics_port)
    try:
        executor.run()
    finally:
        store.close()


def main() -> None:
    app()
