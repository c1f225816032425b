"""``runwatch keys``: the action signing key's generation, rotation and distribution (docs/security.md).

The workers sign actions with a private Ed25519 key (``$RUNWATCH_ACTION_SIGNING_KEY``); trainers, the sink
and the remediator verify with its public key (``$RUNWATCH_ACTION_PUBLIC_KEYS``), which cannot sign.
What goes to stdout is the value to hand on; what to do with it goes to stderr."""

from __future__ import annotations

from pathlib import Path

import click

from runwatch.cli.failure import CommandError
from runwatch.contract import topics

DEFAULT_KEY_FILE = Path("action-signing-key.pem")


@click.group()
def keys() -> None:
    """The workers' action signing key and the public keys that verify it."""


def _new_key_file(out: Path) -> str:
    """A new key pair, the private key written to ``out`` (mode 0600, never over an existing file); the
    public key's text."""
    from runwatch.contract.signing import ActionSigningKey
    from runwatch.local.secret import write_private_file

    key = ActionSigningKey.generate()
    try:
        write_private_file(out, key.pem().decode())
    except FileExistsError:
        raise CommandError(f"{out} exists: give another --out (a key file is never overwritten)") from None
    except OSError as exc:
        raise CommandError(f"cannot write {out}: {exc.strerror or exc}") from None
    return key.public.text


out_option = click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=DEFAULT_KEY_FILE,
    show_default=True,
    help="the private key file to write (mode 0600; an existing file is never overwritten)",
)


@keys.command()
@out_option
def generate(out: Path) -> None:
    """Make a key pair: the private key to --out, for the workers only; print the public key."""
    public = _new_key_file(out)
    click.echo(public)
    click.echo(
        f"wrote {out} (mode 0600): give it to the workers only, as {topics.SIGNING_KEY_ENV}={out.resolve()} "
        f"(or its text). Give the line above to the trainers, the sink and the remediator as "
        f"{topics.PUBLIC_KEYS_ENV}.",
        err=True,
    )


@keys.command()
@out_option
@click.option(
    "--keep",
    envvar=topics.PUBLIC_KEYS_ENV,
    help=f"the public keys in use now (default ${topics.PUBLIC_KEYS_ENV}), kept valid beside the new one",
)
def rotate(out: Path, keep: str | None) -> None:
    """Start a rotation: a new key pair (private key to --out) and print the public keys of the rotation,
    the new one first and the ones in use after it."""
    from runwatch.contract.signing import ActionPublicKeys, MissingKeyError, resolve_public_keys

    try:
        kept = resolve_public_keys(keep or "")  # (before a key file is written)
    except MissingKeyError as exc:
        raise CommandError(f"{exc} (or give --keep)") from None
    public = _new_key_file(out)
    both = ActionPublicKeys([*ActionPublicKeys.parse(public).keys, *kept.keys])
    click.echo(both.text)
    click.echo(
        f"wrote {out} (mode 0600). 1: give the line above to the trainers, the sink and the remediator as "
        f"{topics.PUBLIC_KEYS_ENV} (both keys verify); 2: then switch the workers' {topics.SIGNING_KEY_ENV} "
        f"to {out.resolve()}; 3: once the old key's actions have expired, hand out `runwatch keys public "
        f"{out}` alone.",
        err=True,
    )


@keys.command()
@click.argument("keys_given", metavar="[KEY]...", nargs=-1)
def public(keys_given: tuple[str, ...]) -> None:
    """Print the value of RUNWATCH_ACTION_PUBLIC_KEYS for the given keys, each a private key file or
    public key(s) (comma-separated); none: the public key of $RUNWATCH_ACTION_SIGNING_KEY."""
    from runwatch.contract.signing import (
        ActionPublicKey,
        ActionPublicKeys,
        MissingKeyError,
        resolve_signing_key,
    )

    found: list[ActionPublicKey] = []
    try:
        if not keys_given:
            found.append(resolve_signing_key().public)
        for given in keys_given:
            if given.strip().startswith("ed25519:"):
                found.extend(ActionPublicKeys.parse(given).keys)
            else:
                found.append(resolve_signing_key(given).public)
    except MissingKeyError as exc:
        raise CommandError(str(exc)) from None
    except ValueError as exc:
        raise CommandError(f"{topics.PUBLIC_KEYS_ENV}: {exc}") from None
    click.echo(ActionPublicKeys(found).text)
