"""Logging in to a workshop: a code per seat (or one workshop password), checked by the hub.

Each seat gets a code such as ``k7qm-x2pa-9fde`` (about 58 random bits), and
the instructor one of their own. The codes are printed once, when they are
made; the workshop keeps only a salted hash of each (PBKDF2), in a file only
its owner can read, so a copied workshop folder does not give the codes away.
A learner logs in with the seat's name and its code; with ``--password`` every
seat shares one password instead (simpler to hand out, but anyone who has it can
open any seat).

:class:`SeatAuthenticator` is what JupyterHub loads: it compares what was typed
with the stored hash and answers with the seat's name, or refuses.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets

from jupyterhub.auth import Authenticator
from traitlets import Unicode

ALPHABET = "abcdefghjkmnpqrstuvwxyz23456789"  # no 0/o, 1/l/i: codes are read off a screen and typed
ITERATIONS = 200_000


def new_code(groups: int = 3, size: int = 4) -> str:
    """A fresh random code, in groups easy to read aloud: ``k7qm-x2pa-9fde``."""
    return "-".join("".join(secrets.choice(ALPHABET) for _ in range(size)) for _ in range(groups))


def hash_code(code: str, salt: str | None = None) -> str:
    """``salt$hash`` of ``code`` (PBKDF2-SHA256), what the workshop stores instead of the code."""
    salt = salt or secrets.token_hex(16)
    digest = hashlib.pbkdf2_hmac("sha256", _normal(code).encode(), bytes.fromhex(salt), ITERATIONS)
    return f"{salt}${digest.hex()}"


def code_matches(code: str, stored: str) -> bool:
    """Whether ``code`` is the one ``stored`` (from :func:`hash_code`) was made from, in constant time."""
    salt, _, _ = stored.partition("$")
    try:
        return hmac.compare_digest(hash_code(code, salt), stored)
    except ValueError:  # not a salt we wrote
        return False


def _normal(code: str) -> str:
    """Codes are forgiving about case and surrounding spaces."""
    return code.strip().lower()


class SeatAuthenticator(Authenticator):
    """JupyterHub authenticator: user name = seat (or the instructor), password = its code."""

    codes_file = Unicode(help="JSON file {user: salted hash} written by 'gpucourse workshop start'.").tag(config=True)

    async def authenticate(self, handler, data):
        name = self.normalize_username(data.get("username", ""))
        with open(self.codes_file, encoding="utf-8") as f:
            stored = json.load(f).get(name)
        if stored and code_matches(data.get("password", ""), stored):
            return name
        self.log.warning("workshop login refused for %r", name)
        return None
