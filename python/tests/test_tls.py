"""TLS from Python (issue 39): a controller given its certificate, key and CA, and a trainer and
an engine given theirs, sync a version over mutual TLS (their fabric keyed by the controller
over TLS), the HTTP API answers over https and not over plain HTTP; a worker whose certificate
another CA signed is refused by name; a worker certificate the controller's CRL lists is refused
and a valid one registers, and a client given a CRL that lists the controller's certificate
refuses it. Certificates come from the openssl CLI, CRLs from ``cryptography``. Seconds."""

from __future__ import annotations

import datetime
import http.client
import json
import shutil
import subprocess
import threading
import urllib.request
from pathlib import Path
from typing import Any

import pytest

import weightsync

np = pytest.importorskip("numpy")

if shutil.which("openssl") is None:
    pytest.skip("needs the openssl CLI to make certificates", allow_module_level=True)

# A small dense Qwen3 (the one of test_embedded.py), one trainer and one engine.
CONFIG = {"model_type": "qwen3", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 320,
          "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_ca(d: Path, name: str) -> dict[str, str]:
    """A CA `name` and a controller (localhost, 127.0.0.1) and a worker certificate it signed:
    their PEM paths."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *ec, "-keyout", f"{name}-ca.key", "-out", f"{name}-ca.pem", "-days", "2",
            "-subj", f"/CN={name} test CA", "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)
    out = {"ca": str(d / f"{name}-ca.pem")}
    leaves = {"controller": ("subjectAltName=DNS:localhost,IP:127.0.0.1", "serverAuth"),
              "worker": ("subjectAltName=DNS:worker.weightsync.test", "clientAuth")}
    for serial, (leaf, (san, usage)) in enumerate(leaves.items(), start=1):
        (d / f"{name}-{leaf}.ext").write_text(f"{san}\nextendedKeyUsage={usage}\n")
        openssl("req", *ec, "-keyout", f"{name}-{leaf}.key", "-out", f"{name}-{leaf}.csr",
                "-subj", f"/CN={name} {leaf}", cwd=d)
        openssl("x509", "-req", "-in", f"{name}-{leaf}.csr", "-CA", f"{name}-ca.pem", "-CAkey",
                f"{name}-ca.key", "-set_serial", str(serial), "-days", "2", "-extfile",
                f"{name}-{leaf}.ext", "-out", f"{name}-{leaf}.pem", cwd=d)
        out[f"{leaf}_cert"] = str(d / f"{name}-{leaf}.pem")
        out[f"{leaf}_key"] = str(d / f"{name}-{leaf}.key")
    return out


def in_threads(*fns: Any) -> None:
    errors: list[BaseException] = []

    def run(f: Any) -> None:
        try:
            f()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(f,)) for f in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]


def test_a_job_over_mutual_tls_and_a_stranger_refused_by_name(tmp_path: Path) -> None:
    job, other = make_ca(tmp_path, "job"), make_ca(tmp_path, "other")
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(CONFIG))
    tls = {"tls_cert": job["worker_cert"], "tls_key": job["worker_key"], "tls_ca": job["ca"]}
    with weightsync.Controller(cfg, "fsdp=1", "tp=1,dp=1,format=hf", tls_cert=job["controller_cert"],
                               tls_key=job["controller_key"], tls_ca=job["ca"]) as c:
        assert c.http_url.startswith("https://")
        # Another CA's worker certificate: refused by name before it proves a secret.
        with pytest.raises(weightsync.ConnectError) as refused:
            weightsync.Engine(c.control_address, 0, job_token=c.job_token, tls_cert=other["worker_cert"],
                              tls_key=other["worker_key"], tls_ca=job["ca"])
        assert "TLS" in str(refused.value) and "rollout-0" in str(refused.value), refused.value

        engine = weightsync.Engine(c.control_address, 0, job_token=c.job_token, **tls)
        trainer = weightsync.Trainer(c.control_address, 0, job_token=c.job_token, **tls)
        try:
            dst = {t.name: np.zeros(t.shape, np.uint16) for t in engine.layout()}
            src = {s.name: np.full(s.shape, 0x3F80, np.uint16) for s in trainer.layout()}
            in_threads(lambda: engine.register({n: (a, "bf16") for n, a in dst.items()}, format="hf"),
                       lambda: trainer.register({n: (a, "bf16") for n, a in src.items()}))
            outcome = trainer.push(1).wait(timeout=60)
            assert outcome.version == 1 and outcome.bytes > 0, outcome
            assert engine.wait_for_version(1, timeout=30).version == 1
            for name, a in dst.items():
                assert np.array_equal(a, src[name]), f"{name} did not land over TLS"
            # The HTTP API over https (the client trusts the job's CA), not over plain HTTP: the
            # TLS port answers a plaintext request with a TLS alert, which is no HTTP response.
            assert c.client(timeout=10).of_version(1) is not None
            with pytest.raises((OSError, http.client.HTTPException)):
                urllib.request.urlopen(f"http://{c.http_address}/healthz", timeout=5).read()
        finally:
            trainer.close()
            engine.close()


def make_crl(d: Path, ca: dict[str, str], name: str, revoked: list[int]) -> str:
    """A CRL of the CA of :func:`make_ca` (``d``, ``name``) listing the certificate serials
    ``revoked`` (the controller's is 1, the worker's 2): its PEM path."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization

    key = serialization.load_pem_private_key((d / f"{name}-ca.key").read_bytes(), password=None)
    issuer = x509.load_pem_x509_certificate(Path(ca["ca"]).read_bytes())
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateRevocationListBuilder().issuer_name(issuer.subject)
         .last_update(now - datetime.timedelta(minutes=5)).next_update(now + datetime.timedelta(days=1))
         .add_extension(x509.CRLNumber(1), critical=False))  # webpki requires it (RFC 5280 5.2.3)
    for serial in revoked:
        b = b.add_revoked_certificate(x509.RevokedCertificateBuilder().serial_number(serial)
                                      .revocation_date(now - datetime.timedelta(minutes=1)).build())
    path = d / f"{name}-{'-'.join(map(str, revoked)) or 'none'}.crl.pem"
    path.write_bytes(b.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))  # type: ignore[arg-type]
    return str(path)


def test_revoked_certificates_are_refused_by_name(tmp_path: Path) -> None:
    job = make_ca(tmp_path, "job")
    worker_revoked, controller_revoked = make_crl(tmp_path, job, "job", [2]), make_crl(tmp_path, job, "job", [1])
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(CONFIG))
    tls = {"tls_cert": job["worker_cert"], "tls_key": job["worker_key"], "tls_ca": job["ca"]}
    server = {"tls_cert": job["controller_cert"], "tls_key": job["controller_key"], "tls_ca": job["ca"]}
    with weightsync.Controller(cfg, "fsdp=1", "tp=1,dp=1,format=hf", tls_crl=worker_revoked, **server) as c:
        with pytest.raises(weightsync.ConnectError) as refused:
            weightsync.Trainer(c.control_address, 0, job_token=c.job_token, **tls)
        assert "TLS" in str(refused.value) and "trainer-0" in str(refused.value), refused.value
        assert c.client(timeout=10)._request("GET", "/v1/workers")["workers"] == [], "a revoked worker registered"
    # A CRL that lists no worker: the same certificate registers.
    with weightsync.Controller(cfg, "fsdp=1", "tp=1,dp=1,format=hf", tls_crl=make_crl(tmp_path, job, "job", []),
                               **server) as c:
        weightsync.Trainer(c.control_address, 0, job_token=c.job_token, **tls).close()
        # A client whose CRL lists the controller's certificate refuses it; without it, it talks.
        with pytest.raises(weightsync.ClientError, match="revoked"):
            weightsync.Client(c.http_url, c.api_token, ca=job["ca"], crl=controller_revoked, timeout=10).healthz()
        assert weightsync.Client(c.http_url, c.api_token, ca=job["ca"], crl=worker_revoked, timeout=10).healthz()["status"] == "ok"
    with pytest.raises(ValueError, match="not https"):
        weightsync.Client("http://127.0.0.1:1", crl=worker_revoked)
