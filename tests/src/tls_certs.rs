//! Certificates for the TLS suites, made with `rcgen`: a job's CA, a controller certificate for
//! `localhost` and `127.0.0.1`, a worker client certificate, a second worker certificate the CA
//! revoked and CRLs, and the same from a second, unrelated CA (what an attacker or a
//! misconfigured host would hold). Written as PEM files to a temporary folder, as an operator
//! would hand them over.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, CertificateRevocationListParams, DnType,
    ExtendedKeyUsagePurpose, IsCa, Issuer, KeyIdMethod, KeyPair, KeyUsagePurpose, RevocationReason,
    RevokedCertParams, SerialNumber, date_time_ymd,
};
use weightsync_common::tls::TlsFiles;

/// One CA and the PEM files of certificates it signed.
#[derive(Debug)]
pub struct TestCa {
    /// The CA certificate's file.
    pub ca: PathBuf,
    /// The controller's files (certificate for `localhost` and `127.0.0.1`, key, this CA).
    pub controller: TlsFiles,
    /// A worker's files (client certificate, key, this CA).
    pub worker: TlsFiles,
    /// Another worker's files, whose certificate [`TestCa::crl`] revokes.
    pub revoked_worker: TlsFiles,
    /// This CA's CRL: it lists `revoked_worker`'s certificate (only).
    pub crl: PathBuf,
    /// A CRL of this CA that lists the controller's certificate (only).
    pub controller_crl: PathBuf,
}

const CONTROLLER_SERIAL: u64 = 1;
const WORKER_SERIAL: u64 = 2;
const REVOKED_WORKER_SERIAL: u64 = 3;

/// Two CAs in one folder: the job's and a stranger's.
#[derive(Debug)]
pub struct TestPki {
    /// The folder (removed on drop).
    pub dir: tempfile::TempDir,
    /// The job's CA and its certificates.
    pub job: TestCa,
    /// An unrelated CA and its certificates.
    pub other: TestCa,
}

impl TestPki {
    /// Makes both CAs and their certificates.
    pub fn new() -> TestPki {
        let dir = tempfile::tempdir().expect("temp dir");
        let job = make_ca(dir.path(), "job");
        let other = make_ca(dir.path(), "other");
        TestPki { dir, job, other }
    }
}

impl Default for TestPki {
    fn default() -> Self {
        TestPki::new()
    }
}

fn make_ca(dir: &Path, name: &str) -> TestCa {
    let ca_key = KeyPair::generate().expect("CA key");
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    ca_params
        .distinguished_name
        .push(DnType::CommonName, format!("weightsync test CA {name}"));
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_cert = ca_params.self_signed(&ca_key).expect("CA certificate");
    let issuer = Issuer::new(ca_params, ca_key);
    let write = |file: &str, text: String| {
        let p = dir.join(format!("{name}-{file}"));
        std::fs::write(&p, text).expect("write PEM");
        p
    };
    let ca = write("ca.pem", ca_cert.pem());
    let leaf = |file: &str, serial: u64, sans: Vec<String>, purpose: ExtendedKeyUsagePurpose| {
        let key = KeyPair::generate().expect("leaf key");
        let mut params = CertificateParams::new(sans).expect("leaf params");
        params.serial_number = Some(SerialNumber::from(serial));
        params
            .distinguished_name
            .push(DnType::CommonName, format!("{name} {file}"));
        params.extended_key_usages = vec![purpose];
        let cert = params.signed_by(&key, &issuer).expect("leaf certificate");
        TlsFiles {
            cert: write(&format!("{file}.pem"), cert.pem()),
            key: write(&format!("{file}-key.pem"), key.serialize_pem()),
            ca: ca.clone(),
            crl: None,
        }
    };
    let controller = leaf(
        "controller",
        CONTROLLER_SERIAL,
        vec!["localhost".into(), "127.0.0.1".into()],
        ExtendedKeyUsagePurpose::ServerAuth,
    );
    let worker = leaf(
        "worker",
        WORKER_SERIAL,
        vec!["worker.weightsync.test".into()],
        ExtendedKeyUsagePurpose::ClientAuth,
    );
    let revoked_worker = leaf(
        "revoked-worker",
        REVOKED_WORKER_SERIAL,
        vec!["revoked.weightsync.test".into()],
        ExtendedKeyUsagePurpose::ClientAuth,
    );
    let crl = |number: u64, revoked: u64| {
        CertificateRevocationListParams {
            this_update: date_time_ymd(2024, 1, 1),
            next_update: date_time_ymd(2099, 1, 1),
            crl_number: SerialNumber::from(number),
            issuing_distribution_point: None,
            revoked_certs: vec![RevokedCertParams {
                serial_number: SerialNumber::from(revoked),
                revocation_time: date_time_ymd(2024, 1, 1),
                reason_code: Some(RevocationReason::KeyCompromise),
                invalidity_date: None,
            }],
            key_identifier_method: KeyIdMethod::Sha256,
        }
        .signed_by(&issuer)
        .expect("CRL")
        .pem()
        .expect("CRL PEM")
    };
    TestCa {
        crl: write("crl.pem", crl(1, REVOKED_WORKER_SERIAL)),
        controller_crl: write("controller-crl.pem", crl(2, CONTROLLER_SERIAL)),
        ca,
        controller,
        worker,
        revoked_worker,
    }
}
