"""``toolsentry``: the one command for operators, tool owners and newcomers."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from processor.config import Settings, load_settings

app = typer.Typer(
    help="toolsentry: validate, authorize and route LLM agent tool calls on Kafka, exactly once.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)
stack_app = typer.Typer(
    help="The local Kafka broker and redis-server (no Docker needed).", no_args_is_help=True
)
contracts_app = typer.Typer(help="Tool contracts: check and list.", no_args_is_help=True)
app.add_typer(stack_app, name="stack")
app.add_typer(contracts_app, name="contracts")
console = Console()

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


def _settings(config: Path | None, **overrides: Any) -> Settings:
    return load_settings(config, **overrides)


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
    from processor.app import Processor, stop_on_signals

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
    try:
        processor = Processor(s, stop_requested=stop, reload_requested=reload)
    except ContractError as exc:
        console.print(f"[red]contracts refused[/red]\n{exc}")
        raise typer.Exit(2) from exc
    serve(s.metrics_port)
    processor.run()


@app.command()
def demo(
    config: ConfigOpt = None,
    tenant: Annotated[str, typer.Option(help="Tenant the demo agent acts for.")] = "acme",
    timeout: Annotated[float, typer.Option(help="Seconds to wait for each observation.")] = 60.0,
) -> None:
    """Play a scripted support agent against the running stack and show each decision."""
    from processor.demo import play

    s = _settings(config)
    ok = play(s, tenant, timeout, console)
    raise typer.Exit(0 if ok else 1)


@app.command("config")
def show_config(config: ConfigOpt = None) -> None:
    """Print the effective settings (file + environment + defaults) as JSON."""
    s = _settings(config)
    console.print_json(json.dumps(s.model_dump(mode="json")))


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
    lines: Annotated[int, typer.Option("-n", help="Lines from the end.")] = 50,
    config: ConfigOpt = None,
) -> None:
    """Print the end of a service's log."""
    from processor.stack import LocalStack

    path = LocalStack(_settings(config)).log_path(service)
    if not path.exists():
        console.print(f"no log at {path}")
        raise typer.Exit(1)
    for line in path.read_text(errors="replace").splitlines()[-lines:]:
        typer.echo(line)


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
    path: Annotated[Path, typer.Argument(help="Contracts folder.")] = Path("contracts"),
) -> None:
    """Load a contract set the way the processor does; exit 1 with every problem if refused."""
    from processor.contracts.registry import ContractError, load_contracts

    try:
        cs = load_contracts(path)
    except ContractError as exc:
        for p in exc.problems:
            console.print(f"[red]{p.file}[/red] {p.path}: {p.reason}")
        raise typer.Exit(1) from exc
    console.print(f"{len(cs)} contracts, {len(cs.names)} tools, set {cs.fingerprint}")


@contracts_app.command("list")
def contracts_list(
    path: Annotated[Path, typer.Argument(help="Contracts folder.")] = Path("contracts"),
) -> None:
    """List tools, versions, lifecycle and side-effect class."""
    from processor.contracts.registry import load_contracts

    cs = load_contracts(path)
    table = Table("tool", "version", "lifecycle", "side-effect class", "timeout ms")
    for name in cs.names:
        for c in cs.versions(name):
            table.add_row(
                name, c.version, c.lifecycle.status, c.side_effect_class.value, str(c.timeout_ms)
            )
    console.print(table)


@contracts_app.command("lint")
def contracts_lint(
    path: Annotated[Path, typer.Argument(help="Contracts folder.")] = Path("contracts"),
    output_format: Annotated[
        str, typer.Option("--format", help="text or json.", case_sensitive=False)
    ] = "text",
) -> None:
    """Check contracts against the design rules; exit 1 if any finding is an error."""
    from processor.contracts.lint import lint_folder

    if output_format not in ("text", "json"):
        raise typer.BadParameter("must be text or json", param_hint="--format")
    findings = lint_folder(path)
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
    path: Annotated[Path, typer.Argument(help="Contracts folder.")] = Path("contracts"),
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
        cs = load_contracts(path)
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
    path: Annotated[Path, typer.Argument(help="Contracts folder.")] = Path("contracts"),
) -> None:
    """Show one contract: what it does, its risk, what it needs, its limits and arguments."""
    from processor.contracts.registry import ContractError, load_contracts
    from processor.contracts.show import UnknownContract, show

    try:
        cs = load_contracts(path)
    except ContractError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(1) from exc
    try:
        show(cs, tool, console)
    except UnknownContract as exc:
        hint = f"; did you mean: {', '.join(exc.suggestions)}" if exc.suggestions else ""
        typer.echo(f"{exc}{hint}", err=True)
        raise typer.Exit(1) from exc


def main() -> None:
    app()
