"""TLS material for the admission webhook server.

In a cluster the certificate and key are mounted files (from cert-manager or the chart);
:class:`CertificateReloader` keeps the server's SSL context presenting them as they are
renewed, without a restart. For local runs a small self-signed CA and a server
certificate signed by it are generated here with ``cryptography`` (kopf's own generator
needs oscrypto, which does not load OpenSSL 3).
"""

from __future__ import annotations

import datetime
import enum
import hashlib
import ipaddress
import logging
import ssl
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.types import PublicKeyTypes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

logger = logging.getLogger(__name__)

EXPIRY_WARNING = datetime.timedelta(days=7)
"""A served certificate closer than this to its notAfter is logged as a warning."""


class TLSConfigError(ValueError):
    """The webhook's certificate files cannot be used."""


@dataclass(frozen=True)
class TLSFiles:
    """PEM files of a webhook server: its certificate (chain), key, and the CA clients trust."""

    certfile: Path
    keyfile: Path
    cafile: Path | None = None

    def client_context(self) -> ssl.SSLContext:
        """An SSL context for clients that trust this server (tests, the demo)."""
        context = ssl.create_default_context(cafile=str(self.cafile or self.certfile))
        return context


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _san(hostnames: Sequence[str]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for host in dict.fromkeys(hostnames):
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            entries.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(entries)


def generate_self_signed(directory: Path | str, hostnames: Sequence[str], *, days: int = 365) -> TLSFiles:
    """Write ``ca.pem``, ``tls.crt`` and ``tls.key`` into ``directory``.

    The server certificate is valid for every name or IP address in ``hostnames`` and is
    signed by a fresh CA whose certificate is the ``caBundle`` clients must trust.
    """
    if not hostnames:
        raise TLSConfigError("a webhook certificate needs at least one hostname or IP address")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    not_before = now - datetime.timedelta(minutes=5)  # tolerate small clock skew
    not_after = now + datetime.timedelta(days=days)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(_name("loraserve-webhook-ca"))
        .issuer_name(_name("loraserve-webhook-ca"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(hostnames[0]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(_san(hostnames), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )

    files = TLSFiles(directory / "tls.crt", directory / "tls.key", directory / "ca.pem")
    files.cafile.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    # The chain (server, then CA) so that clients given only the CA can verify it.
    files.certfile.write_bytes(
        cert.public_bytes(serialization.Encoding.PEM) + ca_cert.public_bytes(serialization.Encoding.PEM)
    )
    files.keyfile.touch(mode=0o600)
    files.keyfile.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return files


def check_files(certfile: Path | str, keyfile: Path | str, cafile: Path | str | None = None) -> TLSFiles:
    """Mounted certificate files, checked to load as a server certificate and key.

    Raises :class:`TLSConfigError` naming the file at fault, so that a bad mount fails the
    operator at start-up instead of every admission request.
    """
    files = TLSFiles(Path(certfile), Path(keyfile), Path(cafile) if cafile else None)
    for label, path in (("certificate", files.certfile), ("key", files.keyfile), ("CA bundle", files.cafile)):
        if path is not None and not path.is_file():
            raise TLSConfigError(f"webhook TLS {label} file {str(path)!r} does not exist or is not a file")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(str(files.certfile), str(files.keyfile))
    except (ssl.SSLError, OSError) as error:
        raise TLSConfigError(
            f"webhook TLS certificate {str(files.certfile)!r} and key {str(files.keyfile)!r} do not load "
            f"as a pair ({error}); mount a PEM certificate and its matching private key"
        ) from None
    if files.cafile is not None:
        try:
            ssl.create_default_context(cafile=str(files.cafile))
        except (ssl.SSLError, OSError) as error:
            raise TLSConfigError(f"webhook CA bundle {str(files.cafile)!r} does not load ({error})") from None
    return files


# --------------------------------------------------------------------------- renewal


def _utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


@dataclass(frozen=True)
class CertificateInfo:
    """What identifies a served certificate in logs: serial, names and end of validity."""

    serial: int
    subject: str
    issuer: str
    not_after: datetime.datetime

    @classmethod
    def of(cls, cert: x509.Certificate) -> CertificateInfo:
        """The identity of ``cert``."""
        return cls(
            serial=cert.serial_number,
            subject=cert.subject.rfc4514_string(),
            issuer=cert.issuer.rfc4514_string(),
            not_after=cert.not_valid_after_utc,
        )

    def describe(self) -> str:
        """One line for logs: ``serial 0x…, subject …, issuer …, notAfter …``."""
        return (
            f"serial {self.serial:#x}, subject {self.subject!r}, issuer {self.issuer!r}, "
            f"notAfter {self.not_after.isoformat()}"
        )


@dataclass(frozen=True)
class CertificatePair:
    """One read of the mounted files, checked to be a certificate chain and its key."""

    cert_pem: bytes = field(repr=False)
    key_pem: bytes = field(repr=False)
    ca_pem: bytes | None = field(repr=False)
    info: CertificateInfo
    digest: str
    """SHA-256 over the three files' contents: equal digests, same files."""

    @property
    def ca_bundle(self) -> bytes:
        """What clients must trust: the CA bundle, or the chain itself when none is mounted
        (what kopf puts into the webhook configurations' ``caBundle``)."""
        return self.ca_pem if self.ca_pem is not None else self.cert_pem


def _digest(cert_pem: bytes, key_pem: bytes, ca_pem: bytes | None) -> str:
    hasher = hashlib.sha256()
    for part in (cert_pem, key_pem, ca_pem or b""):
        # Length-prefixed, so that bytes moving from one file to the next change the digest.
        hasher.update(len(part).to_bytes(8, "big"))
        hasher.update(part)
    return hasher.hexdigest()


def _read(files: TLSFiles) -> tuple[bytes, bytes, bytes | None]:
    parts: list[bytes | None] = []
    for label, path in (("certificate", files.certfile), ("key", files.keyfile), ("CA bundle", files.cafile)):
        if path is None:
            parts.append(None)
            continue
        try:
            parts.append(path.read_bytes())
        except OSError as error:
            raise TLSConfigError(
                f"webhook TLS {label} file {str(path)!r} cannot be read ({error.strerror or error})"
            ) from None
    cert_pem, key_pem, ca_pem = parts
    assert cert_pem is not None and key_pem is not None
    return cert_pem, key_pem, ca_pem


def _public_der(key: PublicKeyTypes) -> bytes:
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def read_pair(files: TLSFiles) -> CertificatePair:
    """Read ``files`` once and check them in memory: the certificate chain and the CA
    bundle parse, and the key is the private key of the chain's first certificate.

    Raises :class:`TLSConfigError` naming the file at fault. A renewal caught half-way
    (the new certificate with the old key) fails here as a mismatched pair.
    """
    return _check_pair(files, *_read(files))


def _check_pair(files: TLSFiles, cert_pem: bytes, key_pem: bytes, ca_pem: bytes | None) -> CertificatePair:
    try:
        chain = x509.load_pem_x509_certificates(cert_pem)
    except ValueError as error:
        raise TLSConfigError(
            f"webhook TLS certificate file {str(files.certfile)!r} does not parse as PEM certificates "
            f"({error}); mount the PEM certificate chain, server certificate first"
        ) from None
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as error:
        raise TLSConfigError(
            f"webhook TLS key file {str(files.keyfile)!r} does not parse as an unencrypted PEM private key "
            f"({error}); mount the certificate's private key without a passphrase"
        ) from None
    leaf = chain[0]
    info = CertificateInfo.of(leaf)
    if _public_der(key.public_key()) != _public_der(leaf.public_key()):
        raise TLSConfigError(
            f"webhook TLS certificate {str(files.certfile)!r} ({info.describe()}) and key "
            f"{str(files.keyfile)!r} are not a pair; a renewal may be half-written, or the Secret holds "
            "a key of another certificate"
        )
    if ca_pem is not None:
        try:
            x509.load_pem_x509_certificates(ca_pem)
        except ValueError as error:
            raise TLSConfigError(
                f"webhook CA bundle {str(files.cafile)!r} does not parse as PEM certificates ({error})"
            ) from None
    return CertificatePair(cert_pem, key_pem, ca_pem, info, _digest(cert_pem, key_pem, ca_pem))


def _load_pair(pair: CertificatePair, *contexts: ssl.SSLContext) -> None:
    """Load ``pair`` into each of ``contexts`` in turn, from one private copy of its bytes.

    ``load_cert_chain`` only reads files: loading the mounted paths again could meet the
    next renewal half-way. The copy lives in a fresh 0700 directory for the duration of
    the call. Raises :class:`TLSConfigError` (OpenSSL refused) before the next context
    is touched.
    """
    with tempfile.TemporaryDirectory(prefix="loraserve-webhook-tls-") as directory:
        certfile, keyfile = Path(directory) / "tls.crt", Path(directory) / "tls.key"
        certfile.write_bytes(pair.cert_pem)
        keyfile.touch(mode=0o600)
        keyfile.write_bytes(pair.key_pem)
        for context in contexts:
            try:
                context.load_cert_chain(str(certfile), str(keyfile))
            except (ssl.SSLError, OSError) as error:
                raise TLSConfigError(
                    f"webhook TLS certificate ({pair.info.describe()}) and its key do not load into "
                    f"OpenSSL ({error})"
                ) from None


def _server_context() -> ssl.SSLContext:
    # What kopf's WebhookServer creates for itself when given no context.
    return ssl.create_default_context(purpose=ssl.Purpose.CLIENT_AUTH)


class Reload(enum.Enum):
    """What one :meth:`CertificateReloader.poll` did."""

    UNCHANGED = "unchanged"
    APPLIED = "applied"
    REJECTED = "rejected"


_MAX_REMEMBERED_FAILURES = 64


class CertificateReloader:
    """Keeps a server's SSL context presenting the mounted certificate as it is renewed.

    The kubelet replaces a mounted Secret's files by an atomic symlink swap (a subPath
    mount never changes); cert-manager renews well before expiry. Each :meth:`poll`
    rereads the files and, when their content changed and the new pair checks out, loads
    it into the same :attr:`context`: new handshakes present it, established connections
    keep theirs. A pair that does not check out (half-written, mismatched, unreadable) is
    not applied: the previous one keeps serving, a warning is logged once per distinct
    failure, and the next poll tries again.

    Polls must run on the thread that serves the context (the event loop's): OpenSSL does
    not guard a context changed while another thread creates connections from it.
    """

    def __init__(
        self,
        files: TLSFiles,
        *,
        context: ssl.SSLContext | None = None,
        expiry_warning: datetime.timedelta = EXPIRY_WARNING,
        clock: Callable[[], datetime.datetime] = _utcnow,
    ) -> None:
        self.files = files
        self.context = context if context is not None else _server_context()
        self.expiry_warning = expiry_warning
        self._clock = clock
        self._current: CertificatePair | None = None
        self._failures: set[tuple[str, str]] = set()
        self._expiry_logged: set[tuple[int, str]] = set()

    @property
    def current(self) -> CertificatePair:
        """The pair the context presents (after :meth:`load`)."""
        if self._current is None:
            raise RuntimeError("CertificateReloader.load() has not run: the context presents no certificate")
        return self._current

    def load(self) -> CertificatePair:
        """Load the files into the context for the first time.

        Raises :class:`TLSConfigError` naming the file at fault, so that a bad mount stops
        the operator at start-up rather than failing every admission request.
        """
        pair = read_pair(self.files)
        _load_pair(pair, _server_context(), self.context)
        self._current = pair
        logger.info("webhook TLS certificate loaded from %s: %s", self.files.certfile, pair.info.describe())
        self.check_expiry()
        return pair

    def poll(self) -> Reload:
        """Reread the files; load them into the context if they changed and check out."""
        current = self.current
        digest = ""
        try:
            cert_pem, key_pem, ca_pem = _read(self.files)
            digest = _digest(cert_pem, key_pem, ca_pem)
            if digest == current.digest:
                self.check_expiry()
                return Reload.UNCHANGED
            # Checked from the bytes just read: a second read could meet the next swap.
            pair = _check_pair(self.files, cert_pem, key_pem, ca_pem)
            # OpenSSL's own check runs on a scratch context first: a refused pair would
            # leave the live context with the new certificate and no key.
            _load_pair(pair, _server_context())
        except TLSConfigError as error:
            self._reject(digest, str(error), current)
            self.check_expiry()
            return Reload.REJECTED
        try:
            _load_pair(pair, self.context)
        except TLSConfigError as error:
            # OpenSSL took the pair a moment ago (the copy vanished, memory ran out): put
            # back the pair that was serving rather than leave a certificate without its key.
            _load_pair(current, self.context)
            self._reject(digest, str(error), current)
            return Reload.REJECTED
        self._current = pair
        self._failures.clear()
        logger.info("webhook TLS certificate renewed, now serving %s", pair.info.describe())
        self.check_expiry()
        return Reload.APPLIED

    def _reject(self, digest: str, reason: str, current: CertificatePair) -> None:
        key = (digest, reason)
        if key in self._failures:
            return
        if len(self._failures) >= _MAX_REMEMBERED_FAILURES:
            self._failures.clear()  # a bound on memory; at worst a failure is logged again
        self._failures.add(key)
        logger.warning(
            "webhook TLS files changed but are not applied: %s. Still serving %s; trying again at each check",
            reason,
            current.info.describe(),
        )

    def check_expiry(self) -> datetime.timedelta:
        """Time left until the served certificate expires; a warning, once per certificate,
        when it is under :attr:`expiry_warning` and again when it has expired."""
        info = self.current.info
        left = info.not_after - self._clock()
        where = self.files.certfile.parent
        if left <= datetime.timedelta(0):
            state = "expired"
            message = (
                f"webhook TLS certificate has EXPIRED ({info.describe()}): the API server refuses its "
                f"calls, so every LoRAServe and Adapter write fails; renew the Secret mounted at {where} "
                "(with cert-manager, check the Certificate's status)"
            )
        elif left <= self.expiry_warning:
            state = "expiring"
            message = (
                f"webhook TLS certificate expires in {left.total_seconds() / 86400:.1f} days "
                f"({info.describe()}); renew the Secret mounted at {where} (with cert-manager, check the "
                "Certificate's status and renewBefore)"
            )
        else:
            return left
        if (info.serial, state) not in self._expiry_logged:
            self._expiry_logged.add((info.serial, state))
            logger.warning("%s", message)
        return left
