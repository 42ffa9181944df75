"""TLS material for the admission webhook server.

In a cluster the certificate and key are mounted files (from cert-manager or the chart);
kopf reloads them when they change. For local runs a small self-signed CA and a server
certificate signed by it are generated here with ``cryptography`` (kopf's own generator
needs oscrypto, which does not load OpenSSL 3).
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


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
