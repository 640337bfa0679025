"""Authentication: ZeroMQ CURVE (preferred) or an HMAC-SHA256 shared secret on every message.

* ``auth=none``: allowed only on loopback (127.0.0.1 / localhost / ::1).
* ``auth=curve``: the server has a key pair and a list of authorised client public keys
  (``curve_client_public`` and/or every ``*.key`` file in ``curve_authorized_dir``); traffic is
  encrypted and a peer whose key is not listed is refused by the ZAP handler (and logged).
  Keys are z85 strings or paths to files written by :func:`generate_keys`.
* ``auth=hmac``: every message ends with a 32-byte HMAC-SHA256 over its frames. Weights are not
  encrypted (use CURVE across untrusted networks); a message whose MAC fails is refused and logged.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import struct
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import zmq

from rlhf_core.choices import WeightServerAuth
from rlhf_core.config import ConfigError, WeightServerConfig

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = b"rlhf-weights"
MAC_BYTES = 32
MIN_SECRET_CHARS = 16


class Signer:
    """HMAC-SHA256 over a message's frames (each prefixed by its 8-byte length, so frame
    boundaries are authenticated too)."""

    def __init__(self, secret: str) -> None:
        self._key = secret.encode()

    def sign(self, frames: Sequence[Any]) -> bytes:
        mac = hmac.new(self._key, digestmod=hashlib.sha256)
        for frame in frames:
            mac.update(struct.pack("<Q", memoryview(frame).nbytes))
            mac.update(frame)
        return mac.digest()

    def verify(self, frames: Sequence[Any], mac: Any) -> bool:
        return hmac.compare_digest(self.sign(frames), bytes(mac))


def signer_for(cfg: WeightServerConfig) -> Signer | None:
    """The HMAC signer when ``auth=hmac`` (checking the secret), else None."""
    check_auth_mode(cfg)
    if cfg.auth != "hmac":
        return None
    if not cfg.secret or len(cfg.secret) < MIN_SECRET_CHARS:
        raise ConfigError(
            f"weight_server.auth=hmac needs weight_server.secret of at least {MIN_SECRET_CHARS} characters "
            "(a long random string shared by the weight server, the learner and every worker)"
        )
    return Signer(cfg.secret)


def check_auth_mode(cfg: WeightServerConfig) -> None:
    if cfg.auth not in list(WeightServerAuth):  # a config built in Python: running unauthenticated by a typo is no option
        raise ConfigError(f"weight_server.auth='{cfg.auth}' is not one of {', '.join(WeightServerAuth)}")


def generate_keys(directory: str | os.PathLike) -> dict[str, str]:
    """Write a server and a client CURVE key pair into ``directory`` (``server.key`` /
    ``server.key_secret``, ``client.key`` / ``client.key_secret``, secrets 0600); return the config overrides."""
    import zmq.auth

    out = Path(directory).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for who in ("server", "client"):
        public, secret = zmq.auth.create_certificates(str(out), who)
        os.chmod(secret, 0o600)
        paths[f"curve_{who}_public"] = str(Path(public).resolve())
        paths[f"curve_{who}_secret"] = str(Path(secret).resolve())
    return paths


def load_key(value: str, setting: str, want_secret: bool = False) -> bytes:
    """A z85 key from a 40-character string or a certificate file; ConfigError naming the setting."""
    if len(value) == 40 and not os.path.exists(value):
        return value.encode()
    path = Path(value).expanduser()
    if not path.is_file():
        raise ConfigError(
            f"weight_server.{setting}={value!r} is neither a 40-character z85 key nor a key file; "
            "create keys with `rlhf-weight-server --gen-keys DIR`"
        )
    import zmq.auth

    try:
        public, secret = zmq.auth.load_certificate(str(path))
    except (ValueError, OSError) as exc:
        raise ConfigError(f"weight_server.{setting}: cannot read key file {path}: {exc}") from None
    if want_secret:
        if secret is None:
            raise ConfigError(f"weight_server.{setting}: {path} holds no secret key; use the *.key_secret file")
        return secret
    return public


def authorized_client_keys(cfg: WeightServerConfig) -> set[bytes]:
    """Raw 32-byte public keys of the clients the server accepts under CURVE."""
    import zmq.auth
    from zmq.utils import z85

    keys: set[bytes] = set()
    if cfg.curve_client_public:
        keys.add(z85.decode(load_key(cfg.curve_client_public, "curve_client_public")))
    if cfg.curve_authorized_dir:
        folder = Path(cfg.curve_authorized_dir).expanduser()
        if not folder.is_dir():
            raise ConfigError(f"weight_server.curve_authorized_dir={folder} is not a directory")
        for path in sorted(folder.glob("*.key")):
            public, _ = zmq.auth.load_certificate(str(path))
            keys.add(z85.decode(public))
    if not keys:
        raise ConfigError(
            "weight_server.auth=curve needs the clients' public keys: set weight_server.curve_client_public "
            "(or weight_server.curve_authorized_dir, a folder of *.key files)"
        )
    return keys


def configure_server_socket(sock: zmq.Socket, cfg: WeightServerConfig) -> None:
    """Make ``sock`` a CURVE server (before bind) when ``auth=curve``."""
    if cfg.auth != "curve":
        return
    if not cfg.curve_server_secret:
        raise ConfigError("weight_server.auth=curve needs weight_server.curve_server_secret (see `rlhf-weight-server --gen-keys DIR`)")
    secret = load_key(cfg.curve_server_secret, "curve_server_secret", want_secret=True)
    sock.curve_server = True
    sock.curve_secretkey = secret
    sock.zap_domain = ZAP_DOMAIN


def configure_client_socket(sock: zmq.Socket, cfg: WeightServerConfig) -> None:
    """Make ``sock`` a CURVE client (before connect) when ``auth=curve``."""
    if cfg.auth != "curve":
        return
    server, public, secret = cfg.curve_server_public, cfg.curve_client_public, cfg.curve_client_secret
    if not (server and public and secret):
        missing = [s for s in ("curve_server_public", "curve_client_public", "curve_client_secret") if not getattr(cfg, s)]
        raise ConfigError(
            f"weight_server.auth=curve: clients need {', '.join('weight_server.' + m for m in missing)} "
            "(see `rlhf-weight-server --gen-keys DIR`)"
        )
    sock.curve_serverkey = load_key(server, "curve_server_public")
    sock.curve_publickey = load_key(public, "curve_client_public")
    sock.curve_secretkey = load_key(secret, "curve_client_secret", want_secret=True)


#: a refused client (address, key) is logged at most once in this many seconds
REFUSAL_LOG_S = 10.0


class ZapHandler:
    """ZeroMQ's authentication hook (ZAP, RFC 27), served from the server's poll loop and bound
    before any CURVE socket binds: accepts a client whose public key is authorised, logs refusals."""

    def __init__(self, ctx: zmq.Context, cfg: WeightServerConfig) -> None:
        self.allowed = authorized_client_keys(cfg)
        self.sock = ctx.socket(zmq.REP)
        self.sock.linger = 0
        self.sock.bind(ZAP_ENDPOINT)
        self.refused = 0
        self._last_log: dict[tuple[bytes, bytes], float] = {}  # (address, key) -> logged at, the oldest first

    def handle(self) -> None:
        """Answer one pending ZAP request (call when the socket is readable)."""
        frames = self.sock.recv_multipart()
        if len(frames) < 6:
            return  # not a ZAP request; REP needs a reply anyway
        version, request_id, _domain, address, _identity, mechanism = frames[:6]
        creds = frames[6:]
        ok = mechanism == b"CURVE" and len(creds) == 1 and creds[0] in self.allowed
        if ok:
            self.sock.send_multipart([version, request_id, b"200", b"OK", b"", b""])
            return
        self.refused += 1
        key = creds[0] if creds else b""
        now, logged = time.monotonic(), self._last_log
        while logged and now - next(iter(logged.values())) > REFUSAL_LOG_S:  # oldest first: those that hold nothing back
            del logged[next(iter(logged))]
        if (address, key) not in logged:
            logged[(address, key)] = now
            from zmq.utils import z85

            shown = z85.encode(key).decode() if len(key) == 32 else "-"
            log.warning(
                "refused %s client from %s: public key %s is not authorised "
                "(weight_server.curve_client_public / curve_authorized_dir)",
                mechanism.decode(errors="replace"), address.decode(errors="replace"), shown,
            )
        self.sock.send_multipart([version, request_id, b"400", b"client key not authorised", b"", b""])

    def close(self) -> None:
        self.sock.close(linger=0)
