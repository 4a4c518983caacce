"""Query commands over the results database: results, screens, compare."""

from typing import Annotated

import typer

from cli.common import DbUrl, Json, open_store
from cli.summary import print_json, screen_summary, table, verdict_table


def register(app: typer.Typer) -> None:
    app.command()(results)


def results(
    screen: Annotated[str, typer.Option("--screen", help="Screen id, or `latest`.")] = "latest",
    db: DbUrl = None,
    json_out: Json = False,
) -> None:
    """Show a screen's verdicts and episodes from the database."""
    summary = screen_summary(open_store(db), screen)
    if json_out:
        print_json(summary)
        return
    typer.echo(f"screen {summary['screen_id']} ({summary['protocol']}, {summary['status']}) "
               f"archive {summary['archive_path']}")
    typer.echo(table(summary["episodes"], ["index", "condition", "role", "prompt", "status", "h2d_bytes",
                                           "d2h_bytes", "wall_s"]))
    typer.echo(verdict_table(summary["verdicts"]) if summary["verdicts"] else "no verdicts")


