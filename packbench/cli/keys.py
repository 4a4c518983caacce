"""`packbench keys`: the deployment's archive signing key and the keys it trusts.

init      create an Ed25519 key (private PEM 0600, never in an archive or the database) and
          register its public half in the database as this deployment's own
register  trust another lab's public key (for `packbench ingest`)
list      the registered keys
revoke    stop trusting a key (lost, or its lab no longer trusted): `ingest` refuses its archives,
          the dispatcher refuses to sign with it, `screens show` / `compare` mark what it signed;
          the key and every screen it signed are kept
"""

from pathlib import Path
from typing import Annotated

import typer

from packbench.cli.common import DbUrl, Json, echo_json, open_store
from packbench.core.errors import PackbenchError
from packbench.core.text import one_line

DEFAULT_KEY = Path("~/.config/packbench/signing-key.pem")
MAX_KEY_NAME = 200  # `keys list` and `compare` print it in a row, as screens list does a protocol's name


def key_name(ctx: typer.Context, param: typer.CallbackParam, value: str) -> str:
    """--name: one printable line of 1-200 characters. Unchecked, `keys init --name $'a\\nb'` split
    every later `keys list` row in two, and a name of 100,000 characters was stored."""
    if not 0 < len(value) <= MAX_KEY_NAME or not value.isprintable():
        raise typer.BadParameter(f"'{one_line(value[:40])}' must be one line of 1-{MAX_KEY_NAME} printable characters")
    return value

keys_app = typer.Typer(no_args_is_help=True, help="Archive signing keys (Ed25519): create, trust, list, revoke.")


@keys_app.command("init")
def keys_init(
    key: Annotated[Path, typer.Option(help="Where to write the private key (its public half goes to KEY.pub).")] = DEFAULT_KEY,
    name: Annotated[str, typer.Option(help="A name for this deployment's key in the database.",
                                      callback=key_name)] = "local",
    db: DbUrl = None,
    no_db: Annotated[bool, typer.Option("--no-db", metavar="", help="Write the key files only.")] = False,
    json_out: Json = False,
) -> None:
    """Create this deployment's signing key; the dispatcher signs sealed archives with it
    (--signing-key / PACKBENCH_SIGNING_KEY)."""
    from packbench.core.provenance import generate_key, load_public_key

    # The database is opened (and checked to be at the head) before the key is written: before, a
    # missing or older database was refused only after the files existed, and the rerun its
    # message asked for refused the existing key, so that key could never be registered as local.
    store = None if no_db else open_store(db)
    try:
        path, pub, kid = generate_key(key.expanduser())
    except OSError as e:
        raise PackbenchError(f"--key {key}: cannot write the key there ({e.strerror or type(e).__name__}); "
                             f"choose a --key in a writable directory") from None
    if not json_out:  # said before the database is asked: the files exist whatever it answers
        typer.echo(f"wrote signing key {path} (keep it private) and public key {pub}; key id {kid}")
    if store is not None:
        store.put_signer(key_id=kid, public_key=load_public_key(pub).hex(), name=name, local=True)
    if json_out:
        echo_json({"key": str(path), "public_key": str(pub), "key_id": kid, "registered": not no_db, "name": name})
    elif not no_db:
        typer.echo(f"registered key {kid} as {name!r} (this deployment's own)")


@keys_app.command("register")
def keys_register(
    public_key: Annotated[Path, typer.Argument(help="Another lab's .pub file.")],
    name: Annotated[str, typer.Option(help="Whose key it is (shown by `keys list` and `compare`).", callback=key_name)],
    db: DbUrl = None,
    json_out: Json = False,
) -> None:
    """Trust another lab's public key for `packbench ingest`."""
    from packbench.core.provenance import key_id, load_public_key

    raw = load_public_key(public_key)
    row = open_store(db).put_signer(key_id=key_id(raw), public_key=raw.hex(), name=name, local=False)
    if row.revoked_at is not None:  # registering it again said "trusting key ...", and trusted nothing
        raise PackbenchError(f"key {row.key_id} ({one_line(row.name)!r}) was revoked at {row.revoked_at:%Y-%m-%d %H:%M} "
                             f"UTC and stays revoked: a revoked key is never trusted again (nothing changed); ask "
                             f"its lab for a new key and register that")
    if json_out:
        echo_json({"key_id": row.key_id, "name": row.name, "local": False})
        return
    typer.echo(f"trusting key {row.key_id} as {row.name!r}")


@keys_app.command("list")
def keys_list(db: DbUrl = None, json_out: Json = False) -> None:
    """The registered public keys."""
    signers = open_store(db).signers()
    if json_out:
        echo_json({"keys": [{"key_id": s.key_id, "name": s.name, "local": s.local,
                             "revoked_at": None if s.revoked_at is None else s.revoked_at.isoformat()}
                            for s in signers]})
        return
    for s in signers:
        revoked = "" if s.revoked_at is None else f"  REVOKED {s.revoked_at:%Y-%m-%d %H:%M} UTC"
        typer.echo(f"{s.key_id}  {'local ' if s.local else 'remote'}  {one_line(s.name)}{revoked}")  # one row, whatever is stored


@keys_app.command("revoke")
def keys_revoke(
    key_id: Annotated[str, typer.Argument(help="The key id `packbench keys list` shows.")],
    db: DbUrl = None,
    json_out: Json = False,
) -> None:
    """Revoke a registered key: its archives are refused at `ingest` from now on, the dispatcher
    refuses to sign with it, and the screens it signed are kept, shown as signed by a revoked key."""
    row, revoking = open_store(db).revoke_signer(key_id)
    if json_out:
        echo_json({"key_id": row.key_id, "name": row.name, "local": row.local,
                   "revoked_at": row.revoked_at.isoformat(), "revoked_now": revoking})
        return
    when = f"{row.revoked_at:%Y-%m-%d %H:%M} UTC"
    typer.echo(f"revoked key {row.key_id} ({one_line(row.name)!r}) at {when}" if revoking
               else f"key {row.key_id} ({one_line(row.name)!r}) was already revoked at {when}")


def register(app: typer.Typer) -> None:
    app.add_typer(keys_app, name="keys")
