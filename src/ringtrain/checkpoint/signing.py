"""HMAC-SHA256 signatures for what ringtrain reads back from storage (docs/security.md).

A checkpoint's ``manifest.json``, a run's ``payload.pkl`` and ``config.json`` and a sweep's
``tuner.pkl`` are signed with a key that does **not** live in the storage, so that someone who
can write the bucket (but lacks the key) cannot make a driver or a worker load their bytes.

Where the key comes from, first match wins:

1. ``RunConfig(signing_key=...)`` (bytes or str) or ``RunConfig(signing_key_file=PATH)``
   (``ringtrain run --signing-key-file PATH``): multi-user and cloud set-ups;
2. the environment variable ``RINGTRAIN_SIGNING_KEY`` (the key itself);
3. the user-private key file ``$RINGTRAIN_KEY_DIR/signing.key``, else
   ``$XDG_CONFIG_HOME/ringtrain/signing.key``, else ``~/.config/ringtrain/signing.key``, created
   on first use with mode 0600 (its directory 0700). A key file that group or others can read or
   write, or that another user owns, is refused.

A signature binds what is signed (``purpose``: "manifest", "payload", ...) and the run's name, so
that a signed file cannot be replayed as another kind of file or into another run.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger("ringtrain")

ENV_SIGNING_KEY = "RINGTRAIN_SIGNING_KEY"
ENV_KEY_DIR = "RINGTRAIN_KEY_DIR"
KEY_FILE = "signing.key"
SIG_SUFFIX = ".sig"
MIN_KEY_BYTES = 16

_FIX = (
    "sign it with the key that wrote it (RunConfig(signing_key_file=...) / "
    "--signing-key-file / $RINGTRAIN_SIGNING_KEY), or, only if you trust whoever can write this "
    "storage, accept unsigned data with RunConfig(trust_unsigned=True) / --trust-unsigned"
)


class SignatureError(ValueError):
    """Data read back from storage has no valid signature under this user's key."""


@dataclass(frozen=True)
class Signer:
    """Signs and checks data with one HMAC-SHA256 key.

    Attributes:
        key: the secret (never printed, never written to storage).
        source: where the key came from, for messages ("key file ~/.config/...").
        trust_unsigned: accept data without a valid signature (a warning is logged each time).
    """

    key: bytes = field(repr=False)
    source: str = "explicit key"
    trust_unsigned: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.key, bytes) or len(self.key) < MIN_KEY_BYTES:
            raise ValueError(
                f"a signing key must be at least {MIN_KEY_BYTES} bytes, got "
                f"{len(self.key) if isinstance(self.key, bytes) else type(self.key).__name__} "
                "(generate one with: python -c 'import secrets; print(secrets.token_hex(32))')"
            )

    @property
    def fingerprint(self) -> str:
        """A public name of the key (16 hex digits; reveals nothing about the key)."""
        return hmac.new(self.key, b"ringtrain key id", hashlib.sha256).hexdigest()[:16]

    def sign(self, data: bytes, purpose: str, run: str) -> str:
        """The hex HMAC-SHA256 of ``data`` for ``purpose`` in run ``run``."""
        mac = hmac.new(self.key, digestmod=hashlib.sha256)
        mac.update(f"ringtrain/{purpose}/v1\0{run}\0".encode())
        mac.update(data)
        return mac.hexdigest()

    def check(self, data: bytes, purpose: str, run: str, signature: Any, what: str) -> bool:
        """Whether ``signature`` is this key's signature of ``data`` (constant-time compare).

        Returns:
            True when it is; False when it is not but ``trust_unsigned`` accepts it (a warning
            is logged).

        Raises:
            SignatureError: naming ``what`` and the fix, when it is not and unsigned data is not
                trusted.
        """
        if isinstance(signature, str) and hmac.compare_digest(
            signature, self.sign(data, purpose, run)
        ):
            return True
        why = (
            "has no signature"
            if signature is None
            else f"is not signed for run {run!r} with your key ({self.source}, id "
            f"{self.fingerprint})"
        )
        if self.trust_unsigned:
            logger.warning("%s %s; loading it anyway (trust_unsigned=True)", what, why)
            return False
        raise SignatureError(f"{what} {why}: refusing to load it; {_FIX}")

    # ---------------------------------------------------------------- sidecar signatures
    def sidecar(self, data: bytes, purpose: str, run: str) -> bytes:
        """The content of ``<file>.sig`` for a file holding ``data``."""
        record = {
            "purpose": purpose,
            "run": run,
            "key": self.fingerprint,
            "hmac": self.sign(data, purpose, run),
        }
        return json.dumps(record).encode()

    def check_sidecar(
        self, data: bytes, sidecar: bytes | None, purpose: str, run: str, what: str
    ) -> bool:
        """Check ``data`` against the content of its ``.sig`` file (``None``: there is none).
        Returns and raises as :meth:`check`."""
        signature = None
        if sidecar is not None:
            try:
                record = json.loads(sidecar)
                signature = record.get("hmac") if isinstance(record, dict) else None
            except (ValueError, UnicodeDecodeError):
                signature = None
            if signature is None:
                signature = "malformed"
        return self.check(data, purpose, run, signature, what)


# ------------------------------------------------------------------------------- key sources


def default_key_path() -> Path:
    """``$RINGTRAIN_KEY_DIR/signing.key``, else ``$XDG_CONFIG_HOME/ringtrain/signing.key``, else
    ``~/.config/ringtrain/signing.key``."""
    override = os.environ.get(ENV_KEY_DIR)
    if override:
        return Path(override) / KEY_FILE
    config = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(config) / "ringtrain" / KEY_FILE


def read_key_file(path: str | os.PathLike[str]) -> bytes:
    """The key in ``path`` (its text, stripped of surrounding whitespace).

    Raises:
        PermissionError: the file is readable or writable by group or others, is not a regular
            file, or is owned by another user.
        FileNotFoundError: there is no such file.
    """
    path = os.fspath(path)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise PermissionError(f"signing key {path} is not a regular file")
        if hasattr(os, "getuid") and st.st_uid != os.getuid():
            raise PermissionError(
                f"signing key {path} is owned by uid {st.st_uid}, not by you ({os.getuid()}): "
                "use your own key file"
            )
        if st.st_mode & 0o077:
            raise PermissionError(
                f"signing key {path} has mode {stat.S_IMODE(st.st_mode):o}: others can read or "
                f"change it; run `chmod 600 {path}` (and make a new key if it may have leaked)"
            )
        with os.fdopen(fd, "rb", closefd=False) as f:
            text = f.read(1 << 16)
    finally:
        os.close(fd)
    key = text.strip()
    if len(key) < MIN_KEY_BYTES:
        raise PermissionError(f"signing key {path} is shorter than {MIN_KEY_BYTES} bytes")
    return key


def create_key_file(path: Path) -> bytes:
    """Create ``path`` with a fresh random key (mode 0600, directory 0700) unless it exists;
    return the key it holds."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    key = secrets.token_hex(32).encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return read_key_file(path)  # created by a concurrent first use
    try:
        os.write(fd, key + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    logger.info("created the checkpoint signing key %s (keep it private)", path)
    return key


def resolve(
    signing_key: bytes | str | None = None,
    signing_key_file: str | os.PathLike[str] | None = None,
    trust_unsigned: bool = False,
) -> Signer:
    """The :class:`Signer` of this process (see the module docstring for the order).

    Raises:
        PermissionError / FileNotFoundError: the key file is unsafe or missing.
        ValueError: the key is too short.
    """
    if signing_key is not None:
        key = signing_key.encode() if isinstance(signing_key, str) else bytes(signing_key)
        return Signer(key, "RunConfig.signing_key", trust_unsigned)
    if signing_key_file is not None:
        path = os.fspath(signing_key_file)
        return Signer(read_key_file(path), f"key file {path}", trust_unsigned)
    env = os.environ.get(ENV_SIGNING_KEY)
    if env:
        return Signer(env.encode(), f"${ENV_SIGNING_KEY}", trust_unsigned)
    default = default_key_path()
    key = read_key_file(default) if default.exists() else create_key_file(default)
    return Signer(key, f"key file {default}", trust_unsigned)


def from_run_config(run_config: Any) -> Signer:
    """The signer a :class:`ringtrain.RunConfig` asks for."""
    return resolve(
        getattr(run_config, "signing_key", None),
        getattr(run_config, "signing_key_file", None),
        bool(getattr(run_config, "trust_unsigned", False)),
    )
