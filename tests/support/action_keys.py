"""The tests' action keys: the workers' signing key, and what trainers, the sink and the remediator hold
(its public key, which cannot sign)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from runwatch.contract.schema import Action
from runwatch.contract.signing import ActionPublicKeys, ActionSigningKey
from runwatch.contract.topics import PUBLIC_KEYS_ENV, SIGNING_KEY_ENV


@dataclass(frozen=True)
class ActionKeys:
    signing: ActionSigningKey  # the workers'

    @classmethod
    def generate(cls) -> ActionKeys:
        return cls(ActionSigningKey.generate())

    @property
    def public(self) -> ActionPublicKeys:
        return ActionPublicKeys([self.signing.public])

    @property
    def public_text(self) -> str:
        """``$RUNWATCH_ACTION_PUBLIC_KEYS``."""
        return self.public.text

    @property
    def pem(self) -> str:
        """``$RUNWATCH_ACTION_SIGNING_KEY`` (the workers only)."""
        return self.signing.pem().decode()

    @property
    def trainer_env(self) -> dict[str, str]:
        """What a trainer (and the sink, the remediator) is given: the public key only."""
        return {PUBLIC_KEYS_ENV: self.public_text}

    @property
    def worker_env(self) -> dict[str, str]:
        return {SIGNING_KEY_ENV: self.pem}


# The unit tests' keys, the same every run (the integration tests make theirs per session).
UNIT = ActionKeys(ActionSigningKey.from_seed(hashlib.sha256(b"runwatch tests: the workers' key").digest()))
WORKERS = UNIT.signing
PUBLIC = UNIT.public
SEED = WORKERS.seed  # what TelemetryProcessor and DetectorProcess take


def trainer_materials(*values: str | bytes) -> list[bytes]:
    """Every key-like thing in ``values`` (a trainer's environment values, the text of `runwatch up`'s
    `.runwatch/env`, an old shared secret...): each value whole, each of its words, and each comma-separated
    part of those, as bytes; and each public key found there, raw."""
    import base64
    import re

    found: list[bytes] = []
    for value in values:
        text = value.decode(errors="replace") if isinstance(value, bytes) else value
        parts = {text, *re.split(r"[\s=\"']+", text)}
        parts |= {piece.strip() for part in list(parts) for piece in part.split(",")}
        for part in sorted(p for p in parts if p):
            found.append(part.encode())
            if part.startswith("ed25519:"):
                try:
                    found.append(base64.b64decode(part.removeprefix("ed25519:")))
                except ValueError:
                    pass
    return list(dict.fromkeys(found))


def forgeries(action: Action, materials: list[bytes], claimed_key_id: str) -> list[Action]:
    """``action`` signed every way the material allows: the old HMAC-SHA256 of its body under each; an
    Ed25519 signature naming the workers' key id (``claimed_key_id``) made with each as a private key (a
    32-byte value as the seed, any value's SHA-256 as one, a PEM as itself). If any verifies, the material
    held a key that signs."""
    import base64
    import hmac
    from hashlib import sha256

    body = action.body_bytes()
    signed: list[Action] = []
    for material in materials:
        signed.append(action.model_copy(update={"signature": hmac.new(material, body, sha256).hexdigest()}))
        keys = [ActionSigningKey.from_seed(sha256(material).digest())]
        if len(material) == 32:
            keys.append(ActionSigningKey.from_seed(material))
        if b"PRIVATE KEY" in material:
            try:
                keys.append(ActionSigningKey.from_pem(material))
            except ValueError:
                pass
        for key in keys:
            raw = base64.b64encode(key._private.sign(body)).decode()
            signed.append(action.model_copy(update={"signature": f"ed25519:{claimed_key_id}:{raw}"}))
            signed.append(key.sign(action))  # under its own id too
    return signed
