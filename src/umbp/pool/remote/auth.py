"""Tenant keys and sealed values of the shared tier: a keyed MAC on every value, optional AES-GCM.

Why: the shared Redis is reachable by every tenant that has its URL (and by whoever runs it). Without a
secret, a value's name is computable offline and its header and checksum are public functions of its
bytes, so anyone who can write to the server can plant a value that loads as a verified hit, and anyone
who can read it gets another tenant's KV cache. With a tenant secret (the operator's, from
`auth_key_env` or `auth_key_file`):

* every value carries a tag over its header, its Redis-side name (namespace + umbp key) and its bytes,
  keyed by a key derived from the secret: a value forged, altered, or copied under another key or into
  another tenant's namespace fails verification and is a counted miss;
* the tenant's Redis namespace is derived from the secret too, so its key names cannot be computed
  offline (they are still visible to anyone allowed to SCAN the server: see docs/remote.md);
* with `encrypt`, values are AES-GCM ciphertext (the GCM tag is then the MAC), so co-tenants and the
  server see only sizes and key names.

The MAC is HMAC-SHA256 (hashlib, always available) or AES-GMAC (the `cryptography` package, the
`remote-crypto` extra): GMAC runs at ~10 GB/s with AES-NI where HMAC-SHA256 is one SHA-256 pass (~0.7 GB/s
on the dev VM), which would halve the tier's throughput. A reader verifies whichever scheme the value's
header names, so writers with and without the package interoperate.

Key rotation: the current secret writes and reads; `auth_old_key_envs` / `auth_old_key_files` name
previous secrets whose values (in their own namespaces) are still accepted for reads. Derived keys are
never logged; a value names the key that sealed it by a 4-byte id, never by the key.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from umbp.pool.checksum import checksum_u8
from umbp.pool.errors import OptionValueError
from umbp.pool.remote.format import (
    CHECKSUM_SIZE,
    FORMAT_VERSION,
    HEADER_SIZE,
    MAGIC,
    header_after_checksum,
    header_before_checksum,
    inspect_header,
    key_crc,
    pack_header,
)

SEALED_VERSION = 2
SEALED_HEADER = struct.Struct("<4sHHQHHIQ12s16sI")  # see SealedCodec
SEALED_HEADER_SIZE = SEALED_HEADER.size  # 64
_FIXED = struct.Struct("<4sHHQHHI")  # the fields a reader knows in advance (24 bytes)
_FIELD_AT, _FIELD_SIZE = 24, 36  # psum64, nonce, tag: the fields only the stored value knows
_TAG_AT, _TAG_SIZE = 44, 16
SCHEMES = {"hmac-sha256": 1, "aes-gmac": 2, "aes-gcm": 3}
_SCHEME_NAMES = {v: k for k, v in SCHEMES.items()}


def _kdf(secret: bytes, label: bytes) -> bytes:
    """HKDF-style expansion (HMAC-SHA256 with a fixed extract salt): independent keys per purpose."""
    prk = hmac.digest(b"umbp shared tier v2", secret, "sha256")
    return hmac.digest(prk, label, "sha256")


@lru_cache(maxsize=16)
def namespace_of(secret: bytes) -> str:
    """The tenant's Redis namespace: 16 hex characters derived from its secret."""
    return "t" + _kdf(secret, b"namespace").hex()[:16]


@dataclass(frozen=True, repr=False)
class TenantKeys:
    """Keys derived from one tenant secret. repr shows only the public key id."""

    key_id: int
    namespace: str
    mac_key: bytes
    aes_key: bytes

    @classmethod
    def derive(cls, secret: bytes) -> TenantKeys:
        return cls(
            int.from_bytes(_kdf(secret, b"key id")[:4], "little"),
            namespace_of(secret),
            _kdf(secret, b"mac"),
            _kdf(secret, b"aes"),
        )

    def __repr__(self) -> str:
        return f"TenantKeys(key_id={self.key_id:08x}, namespace={self.namespace!r})"


def have_cryptography() -> bool:
    try:
        import cryptography.hazmat.primitives.ciphers.aead  # noqa: F401
    except ImportError:
        return False
    return True


def _crypto() -> Any:
    """The `cryptography` package's AEAD and cipher modules, imported only when a scheme needs them."""
    try:
        from cryptography.exceptions import InvalidTag
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError:
        raise OptionValueError(
            "umbp: remote options encrypt / auth_mac='aes-gmac' need the cryptography "
            "package: pip install 'umbp[remote-crypto]'"
        ) from None
    return InvalidTag, Cipher, algorithms, modes, AESGCM


def resolve_scheme(auth_mac: str, encrypt: bool) -> str:
    """The scheme this process writes with; a clear config error when it needs a missing package."""
    if encrypt:
        _crypto()
        return "aes-gcm"
    if auth_mac == "auto":
        return "aes-gmac" if have_cryptography() else "hmac-sha256"
    if auth_mac == "aes-gmac":
        _crypto()
    return auth_mac


class PlainCodec:
    """Format 1 (remote_format): header + psum64, no secret. Detects accidents, not attacks."""

    header_size = HEADER_SIZE
    field_size = CHECKSUM_SIZE
    sealed = False

    def describe(self) -> str:
        return "unauthenticated (checksum only)"

    def lead(self, nbytes: int) -> bytes:
        return header_before_checksum(nbytes)

    def tail(self, key: str) -> bytes:
        return header_after_checksum(key)

    def seal(self, key: str, payload: np.ndarray, digest: int | None) -> tuple[bytes, np.ndarray]:
        return pack_header(key, payload.size, checksum_u8(payload) if digest is None else digest), payload

    def inspect(self, header: bytes | memoryview, key: str, nbytes: int) -> tuple[str | None, int]:
        return inspect_header(header, key, nbytes)

    def open(self, header: bytes, key: str, dst: np.ndarray) -> str | None:
        return None

    def stream(self, header: bytes, key: str) -> None:
        return None


class SealedCodec:
    """Format 2: a 64-byte header, every value MACed (or AES-GCM encrypted) under the tenant's keys.

        offset size field
        0      4    magic b"UMBP"
        4      2    format version (2)
        6      2    header size (64)
        8      8    payload length (stored bytes: ciphertext has the plaintext's length)
        16     2    scheme: 1 hmac-sha256, 2 aes-gmac, 3 aes-gcm (encrypted)
        18     2    reserved, zero (not covered by the tag: a value with anything else there is refused)
        20     4    key id of the tenant key that sealed it
        24     8    psum64 of the stored bytes (cheap first check; the tag is what authenticates)
        32     12   nonce (random per value; zero for hmac-sha256)
        44     16   tag over: header with the tag zeroed, the value's Redis name, the stored bytes
        60     4    crc32 of the umbp key

    The tag covers the Redis-side name (tenant namespace + umbp key), so a value copied under another
    key or into another namespace does not verify even under the same secret."""

    header_size = SEALED_HEADER_SIZE
    field_size = _FIELD_SIZE
    sealed = True

    def __init__(self, keys: TenantKeys, scheme: str, readable: tuple[TenantKeys, ...] = ()) -> None:
        self.keys, self.scheme, self.code = keys, scheme, SCHEMES[scheme]
        self._by_id = {k.key_id: k for k in (keys, *readable)}
        self._aes: dict[int, Any] = {}

    def describe(self) -> str:
        return "encrypted (aes-gcm)" if self.code == 3 else f"authenticated ({self.scheme})"

    def lead(self, nbytes: int) -> bytes:
        return _FIXED.pack(MAGIC, SEALED_VERSION, SEALED_HEADER_SIZE, nbytes, self.code, 0, self.keys.key_id)

    def tail(self, key: str) -> bytes:
        return struct.pack("<I", key_crc(key))

    def seal(self, key: str, payload: np.ndarray, digest: int | None) -> tuple[bytes, np.ndarray]:
        """(header, stored bytes) for `payload` stored under `key`. `digest`, the payload's psum64
        when the caller has it, saves a pass (not for aes-gcm, whose stored bytes are the ciphertext)."""
        nbytes = payload.size
        nonce = b"\0" * 12 if self.code == 1 else os.urandom(12)
        if self.code == 3:
            stored = np.empty(nbytes + _TAG_SIZE, np.uint8)
            aad = self._fields(nbytes, 3, self.keys.key_id, 0, nonce, key) + _name(self.keys, key)
            aes = self._aesgcm(self.keys)
            if hasattr(aes, "encrypt_into"):  # cryptography >= 45: no intermediate bytes object
                aes.encrypt_into(nonce, payload, aad, stored)
            else:
                stored[:] = np.frombuffer(aes.encrypt(nonce, payload.tobytes(), aad), np.uint8)
            tag, payload = stored[nbytes:].tobytes(), stored[:nbytes]
            digest = checksum_u8(payload)
        else:
            digest = checksum_u8(payload) if digest is None else digest
            fields = self._fields(nbytes, self.code, self.keys.key_id, digest, nonce, key)
            tag = _mac(self.code, self.keys, fields, key, payload, nonce)
        return self._pack(nbytes, self.code, self.keys.key_id, digest, nonce, tag, key), payload

    def inspect(self, header: bytes | memoryview, key: str, nbytes: int) -> tuple[str | None, int]:
        """(None, stored psum64) when the header fits `key`, `nbytes` and a key this reader holds; else
        (the counter naming why not, the psum64 field)."""
        if len(header) < SEALED_HEADER_SIZE:
            return "header_failures", 0
        magic, version, size, length, scheme, reserved, key_id, psum, _, _, crc = SEALED_HEADER.unpack(header)
        if magic != MAGIC or size != SEALED_HEADER_SIZE or reserved:  # the tag does not cover `reserved`
            return "header_failures", psum
        if version != SEALED_VERSION:
            return ("unauthenticated_values" if version == FORMAT_VERSION else "version_mismatches"), psum
        if length != nbytes:
            return "size_mismatches", psum
        if crc != key_crc(key):
            return "key_mismatches", psum
        if scheme not in _SCHEME_NAMES or key_id not in self._by_id:
            return "auth_failures", psum
        return None, psum

    def stream(self, header: bytes, key: str) -> TagStream | None:
        """For a header that inspect() accepted: a TagStream to feed the payload into as it arrives, whose
        verdict() replaces open(); None where open() must run (aes-gcm, or a scheme this reader lacks)."""
        _, _, _, nbytes, scheme, _, key_id, psum, nonce, tag, _ = SEALED_HEADER.unpack(header)
        if scheme == 3 or (scheme != 1 and not have_cryptography()):
            return None
        out = TagStream(
            scheme, self._by_id[key_id], self._fields(nbytes, scheme, key_id, psum, nonce, key), key, nonce
        )
        out.expected = tag
        return out

    def open(self, header: bytes, key: str, dst: np.ndarray) -> str | None:
        """After inspect and the psum64 check passed: verify the tag (and decrypt dst in place for
        aes-gcm). None, or "auth_failures" (dst then holds bytes that must not be used)."""
        _, _, _, nbytes, scheme, _, key_id, psum, nonce, tag, _ = SEALED_HEADER.unpack(header)
        keys = self._by_id[key_id]
        if scheme != 1 and not have_cryptography():  # sealed by a writer that has the package
            return "unsupported_values"
        fields = self._fields(nbytes, scheme, key_id, 0 if scheme == 3 else psum, nonce, key)
        if scheme == 3:
            return self._decrypt(keys, nonce, tag, fields + _name(keys, key), dst)
        expected = _mac(scheme, keys, fields, key, dst, nonce)
        return None if hmac.compare_digest(expected, tag) else "auth_failures"

    # ---- primitives ----------------------------------------------------------------------------------

    def _fields(self, nbytes: int, code: int, key_id: int, digest: int, nonce: bytes, key: str) -> bytes:
        """The header as authenticated: every field but the tag (for aes-gcm also without the psum64,
        which is computed after encryption, over the ciphertext the tag already covers)."""
        return self._pack(nbytes, code, key_id, digest, nonce, b"\0" * _TAG_SIZE, key)

    @staticmethod
    def _pack(nbytes: int, code: int, key_id: int, digest: int, nonce: bytes, tag: bytes, key: str) -> bytes:
        return SEALED_HEADER.pack(
            MAGIC,
            SEALED_VERSION,
            SEALED_HEADER_SIZE,
            nbytes,
            code,
            0,
            key_id,
            digest,
            nonce,
            tag,
            key_crc(key),
        )

    def _aesgcm(self, keys: TenantKeys) -> Any:
        aes = self._aes.get(keys.key_id)
        if aes is None:
            aes = self._aes[keys.key_id] = _crypto()[4](keys.aes_key)
        return aes

    def _decrypt(self, keys: TenantKeys, nonce: bytes, tag: bytes, aad: bytes, dst: np.ndarray) -> str | None:
        invalid_tag = _crypto()[0]
        sealed = np.empty(dst.size + _TAG_SIZE, np.uint8)
        sealed[: dst.size] = dst
        sealed[dst.size :] = np.frombuffer(tag, np.uint8)
        try:
            aes = self._aesgcm(keys)
            if hasattr(aes, "decrypt_into"):
                aes.decrypt_into(nonce, sealed, aad, dst)
            else:
                dst[:] = np.frombuffer(aes.decrypt(nonce, sealed.tobytes(), aad), np.uint8)
        except invalid_tag:
            return "auth_failures"
        return None


def _name(keys: TenantKeys, key: str) -> bytes:
    """What a tag binds besides the header: the tenant's namespace and the umbp key, length-prefixed."""
    name = f"{keys.namespace}:{key}".encode()
    return struct.pack("<I", len(name)) + name


class TagStream:
    """The tag of a MAC-only value (HMAC-SHA256 truncated, or AES-GMAC), fed in pieces: the authenticated
    header fields and the value's name first, then its bytes chunk by chunk — so a load can feed each
    chunk while it is still in cache, right after it was received, instead of a second pass afterwards."""

    def __init__(self, scheme: int, keys: TenantKeys, fields: bytes, key: str, nonce: bytes) -> None:
        named = _name(keys, key)
        if scheme == 1:
            self._h: Any = hmac.new(keys.mac_key, fields, hashlib.sha256)
            self._h.update(named)
            self.update = self._h.update
        else:
            _, cipher, algorithms, modes, _ = _crypto()
            self._h = cipher(algorithms.AES(keys.mac_key), modes.GCM(nonce)).encryptor()
            self._h.authenticate_additional_data(fields)
            self._h.authenticate_additional_data(named)
            self.update = self._h.authenticate_additional_data
        self._scheme = scheme
        self.expected = b""

    def digest(self) -> bytes:
        if self._scheme == 1:
            return self._h.digest()[:_TAG_SIZE]
        self._h.finalize()
        return self._h.tag

    def verdict(self) -> str | None:
        """None when the bytes fed match the stored tag, else "auth_failures"."""
        return None if hmac.compare_digest(self.digest(), self.expected) else "auth_failures"


_ONE_SHOT_GMAC = 256 << 10  # below this a one-shot AESGCM call on a joined copy beats a Cipher object (~6 us)


@lru_cache(maxsize=16)
def _gmac_of(mac_key: bytes) -> Any:
    return _crypto()[4](mac_key)


def _mac(scheme: int, keys: TenantKeys, fields: bytes, key: str, payload: np.ndarray, nonce: bytes) -> bytes:
    """The 16-byte tag of a MAC-only value over the header fields, the value's name and its bytes. AES-GMAC
    of a small value is one AESGCM call over a joined copy (the same tag as TagStream's pieces: GCM
    authenticates the concatenation of its associated data)."""
    if scheme == 2 and payload.size <= _ONE_SHOT_GMAC:
        aad = b"".join((fields, _name(keys, key), memoryview(payload)))
        return _gmac_of(keys.mac_key).encrypt(nonce, b"", aad)
    stream = TagStream(scheme, keys, fields, key, nonce)
    stream.update(memoryview(payload))
    return stream.digest()


def codec_for(cfg: Any) -> PlainCodec | SealedCodec:
    """The value codec a RemoteConfig asks for (the plain format without a secret)."""
    if cfg.auth_key is None:
        return PlainCodec()
    return SealedCodec(TenantKeys.derive(cfg.auth_key), resolve_scheme(cfg.auth_mac, cfg.encrypt))


def old_codecs(cfg: Any) -> list[tuple[str, SealedCodec]]:
    """(namespace, codec) for every previous secret of a rotation: read-only fallbacks."""
    out = []
    for secret in cfg.auth_old_keys:
        keys = TenantKeys.derive(secret)
        out.append((keys.namespace, SealedCodec(keys, "hmac-sha256")))
    return out
