"""Ed25519 signatures over an action's canonical body (``Action.body_bytes()``).

Two keys, two sides (docs/security.md):

- the **action signing key** (private; ``$RUNWATCH_ACTION_SIGNING_KEY``) is the workers' alone: only
  they sign actions;
- the **public keys** (``$RUNWATCH_ACTION_PUBLIC_KEYS``, one or more, comma-separated: two during a
  rotation) are everyone else's: trainers, the sink and the remediator verify with them, and nothing
  they hold can sign.

Text forms (what ``runwatch keys`` writes and prints):

- a public key: ``ed25519:<base64 of the 32-byte raw key>``;
- the signing key: a PKCS#8 PEM file (``-----BEGIN PRIVATE KEY-----``; ``openssl genpkey -algorithm
  ed25519`` writes the same); the variable holds the PEM text or the file's path;
- a signature (the action's ``signature``): ``ed25519:<key id>:<base64 of the 64-byte signature>``, the
  key id being the first 8 bytes of the public key's SHA-256 in hex, so that a verifier holding two keys
  picks the one that signed.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from runwatch.contract.schema import Action
from runwatch.contract.topics import LEGACY_SECRET_ENV, PUBLIC_KEYS_ENV, SIGNING_KEY_ENV

SCHEME = "ed25519"
_PREFIX = SCHEME + ":"
_PEM_PRIVATE = "-----BEGIN PRIVATE KEY-----"
SEED_BYTES = 32  # an Ed25519 private key is its 32-byte seed
_SIGNATURE_BYTES = 64
# What a group report's signature covers before its body: an action's canonical body begins with "{", so
# no signed report can pass for a signed action.
REPORT_CONTEXT = b"runwatch.group_report\n"


class MissingKeyError(RuntimeError):
    """A key that is needed is not given, or is not a key of the kind needed; the message says what to do."""


def key_id(raw_public: bytes) -> str:
    """The id a signature names its key by: the first 8 bytes of the public key's SHA-256, in hex."""
    return hashlib.sha256(raw_public).hexdigest()[:16]


@dataclass(frozen=True)
class ActionPublicKey:
    """One of the workers' public keys: verifies, cannot sign."""

    raw: bytes

    @property
    def key_id(self) -> str:
        return key_id(self.raw)

    @property
    def text(self) -> str:
        return _PREFIX + base64.b64encode(self.raw).decode()

    @classmethod
    def parse(cls, text: str) -> ActionPublicKey:
        """``ed25519:<base64>``; ``ValueError`` saying what is wrong otherwise."""
        text = text.strip()
        if _PEM_PRIVATE in text or "PRIVATE KEY" in text:
            raise ValueError(
                "this is a private key, not a public one: never give the signing key to trainers, the sink "
                "or the remediator; give them what `runwatch keys public` prints"
            )
        if not text.startswith(_PREFIX):
            raise ValueError(
                f"a public key is 'ed25519:<base64>' (what `runwatch keys public` prints), not {text[:20]!r}"
            )
        try:
            raw = base64.b64decode(text[len(_PREFIX) :], validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"{text[:20]!r}...: not base64") from None
        if len(raw) != 32:
            raise ValueError(f"{text[:20]!r}...: an Ed25519 public key is 32 bytes, this is {len(raw)}")
        return cls(raw)


class ActionPublicKeys:
    """The public keys an action may be signed by (two during a rotation); verifies, cannot sign."""

    def __init__(self, keys: Iterable[ActionPublicKey]):
        self._keys: dict[str, Ed25519PublicKey] = {}
        self.keys: list[ActionPublicKey] = []
        for key in keys:
            if key.key_id not in self._keys:
                self._keys[key.key_id] = Ed25519PublicKey.from_public_bytes(key.raw)
                self.keys.append(key)
        if not self.keys:
            raise ValueError("no public key")

    @classmethod
    def parse(cls, text: str) -> ActionPublicKeys:
        """Comma-separated public keys (``$RUNWATCH_ACTION_PUBLIC_KEYS``); ``ValueError`` otherwise."""
        return cls(ActionPublicKey.parse(part) for part in text.split(",") if part.strip())

    @property
    def text(self) -> str:
        """The value of ``$RUNWATCH_ACTION_PUBLIC_KEYS`` for these keys."""
        return ",".join(key.text for key in self.keys)

    @property
    def key_ids(self) -> list[str]:
        return [key.key_id for key in self.keys]

    def verify(self, action: Action) -> bool:
        """Whether ``action`` is signed, over its canonical body, by one of these keys. Never raises,
        whatever the message holds."""
        return self._verify(action.signature, action.body_bytes())

    def verify_report(self, body: str, signature: str) -> bool:
        """Whether a group report's ``body`` is signed by one of these keys
        (``ActionSigningKey.sign_report``); never raises."""
        try:
            data = REPORT_CONTEXT + body.encode()
        except UnicodeError:
            return False
        return self._verify(signature, data)

    def _verify(self, signature_text: str, data: bytes) -> bool:
        try:
            scheme, kid, encoded = signature_text.split(":")
            public = self._keys.get(kid) if scheme == SCHEME else None
            if public is None:
                return False
            signature = base64.b64decode(encoded, validate=True)
            if len(signature) != _SIGNATURE_BYTES:
                return False
            public.verify(signature, data)
        except (InvalidSignature, ValueError, binascii.Error, UnicodeError):
            return False
        return True


class ActionSigningKey:
    """The workers' private key: signs actions. Nothing on the training side holds one."""

    def __init__(self, private: Ed25519PrivateKey):
        self._private = private
        raw = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        self.public = ActionPublicKey(raw)

    @classmethod
    def generate(cls) -> ActionSigningKey:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> ActionSigningKey:
        if len(seed) != SEED_BYTES:
            raise ValueError(f"an Ed25519 signing key is a {SEED_BYTES}-byte seed, not {len(seed)} bytes")
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    @classmethod
    def from_pem(cls, pem: bytes) -> ActionSigningKey:
        """A PKCS#8 PEM Ed25519 private key, unencrypted; ``ValueError`` otherwise."""
        try:
            private = serialization.load_pem_private_key(pem, password=None)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"not an unencrypted PEM private key ({exc})") from None
        except Exception as exc:  # noqa: BLE001 - cryptography's UnsupportedAlgorithm and kin: one message
            raise ValueError(f"not a usable PEM private key ({type(exc).__name__}: {exc})") from None
        if not isinstance(private, Ed25519PrivateKey):
            raise ValueError(f"a {type(private).__name__.removeprefix('_')}, not an Ed25519 private key")
        return cls(private)

    @property
    def key_id(self) -> str:
        return self.public.key_id

    @property
    def seed(self) -> bytes:
        """The 32-byte seed (what the worker hands its detector process)."""
        return self._private.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )

    def pem(self) -> bytes:
        return self._private.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    def sign(self, action: Action) -> Action:
        return action.model_copy(update={"signature": self._signature(action.body_bytes())})

    def sign_report(self, body: str) -> str:
        """The signature of a group report's ``body`` (a worker's message to the worker that merges the run,
        issue 36), over the body after ``REPORT_CONTEXT``: no report signature is an action's."""
        return self._signature(REPORT_CONTEXT + body.encode())

    def _signature(self, data: bytes) -> str:
        signature = base64.b64encode(self._private.sign(data)).decode()
        return f"{_PREFIX}{self.key_id}:{signature}"


def sign_action(action: Action, key: ActionSigningKey) -> Action:
    """``action`` signed with the workers' key over its canonical body."""
    return key.sign(action)


def verify_action(action: Action, keys: ActionPublicKeys | ActionPublicKey) -> bool:
    """Whether ``action`` is signed by one of ``keys``; never raises."""
    return (keys if isinstance(keys, ActionPublicKeys) else ActionPublicKeys([keys])).verify(action)


def _legacy_note() -> str:
    if os.environ.get(LEGACY_SECRET_ENV):
        return (
            f" ({LEGACY_SECRET_ENV} is set but no longer used: actions are signed with the workers' private "
            "key and verified with its public key, docs/security.md)"
        )
    return ""


def resolve_public_keys(value: str | ActionPublicKeys | None = None) -> ActionPublicKeys:
    """The given public keys, else ``$RUNWATCH_ACTION_PUBLIC_KEYS``; ``MissingKeyError`` saying what to do
    when there are none or they are not public keys."""
    if isinstance(value, ActionPublicKeys):
        return value
    text = value if value is not None else os.environ.get(PUBLIC_KEYS_ENV, "")
    if not text.strip():
        raise MissingKeyError(
            f"no action public key: set {PUBLIC_KEYS_ENV} to the workers' public key(s), what "
            "`runwatch keys public` prints (comma-separated during a rotation)" + _legacy_note()
        )
    try:
        return ActionPublicKeys.parse(text)
    except ValueError as exc:
        raise MissingKeyError(f"{PUBLIC_KEYS_ENV}: {exc}") from None


def _pem_lines(text: str) -> str:
    """A PEM as it may arrive in one environment variable's line (newlines written as spaces or ``\\n``, as a
    .env file or ``--from-literal`` holds it), with its lines back."""
    match = re.search(
        r"(-----BEGIN [A-Z ]+-----)(.*?)(-----END [A-Z ]+-----)", text.replace("\\n", "\n"), re.S
    )
    if match is None:
        return text
    body = "".join(match.group(2).split())
    return "\n".join(
        [match.group(1), *(body[i : i + 64] for i in range(0, len(body), 64)), match.group(3), ""]
    )


def resolve_signing_key(value: str | None = None) -> ActionSigningKey:
    """The workers' signing key: ``value`` else ``$RUNWATCH_ACTION_SIGNING_KEY``, a PEM private key's text
    (its line breaks may be spaces or ``\\n``) or its file's path; ``MissingKeyError`` saying what to do
    otherwise."""
    text = value if value is not None else os.environ.get(SIGNING_KEY_ENV, "")
    if not text.strip():
        raise MissingKeyError(
            f"no action signing key: set {SIGNING_KEY_ENV} for the workers (only them) to the private key "
            "file `runwatch keys generate` wrote, or its PEM text" + _legacy_note()
        )
    if "-----BEGIN" in text:
        pem, where = _pem_lines(text).encode(), SIGNING_KEY_ENV
    elif text.strip().startswith(_PREFIX):
        raise MissingKeyError(
            f"{SIGNING_KEY_ENV} holds a public key: the workers sign with the private key file "
            "`runwatch keys generate` wrote (its path or its PEM text)"
        )
    else:
        path = Path(text.strip()).expanduser()
        try:
            pem = _pem_lines(path.read_text(errors="replace")).encode()
        except OSError as exc:
            raise MissingKeyError(
                f"{SIGNING_KEY_ENV}: cannot read the key file {str(path)!r}: {exc.strerror or exc} (give the "
                "private key file `runwatch keys generate` wrote, or its PEM text)"
            ) from None
        where = f"{SIGNING_KEY_ENV} ({path})"
    try:
        return ActionSigningKey.from_pem(pem)
    except ValueError as exc:
        raise MissingKeyError(f"{where}: {exc}") from None
