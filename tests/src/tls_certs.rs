//! Certificates for the TLS suites, made with `rcgen`: a job's CA, a controller certificate for
//! `localhost` and `127.0.0.1`, a worker client certificate, and the same from a second,
//! unrelated CA (what an attacker or a misconfigured host would hold). Written as PEM files to a
//! temporary folder, as an operator would hand them over.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
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
}

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
    let ca_cert = ca_params.self_signed(&ca_key).expect("CA certificate");
    let issuer = Issuer::new(ca_params, ca_key);
    let write = |file: &str, text: String| {
        let p = dir.join(format!("{name}-{file}"));
        std::fs::write(&p, text).expect("write PEM");
        p
    };
    let ca = write("ca.pem", ca_cert.pem());
    let leaf = |file: &str, sans: Vec<String>, purpose: ExtendedKeyUsagePurpose| {
        let key = KeyPair::generate().expect("leaf key");
        let mut params = CertificateParams::new(sans).expect("leaf params");
        params
            .distinguished_name
            .push(DnType::CommonName, format!("{name} {file}"));
        params.extended_key_usages = vec![purpose];
        let cert = params.signed_by(&key, &issuer).expect("leaf certificate");
        TlsFiles {
            cert: write(&format!("{file}.pem"), cert.pem()),
            key: write(&format!("{file}-key.pem"), key.serialize_pem()),
            ca: ca.clone(),
        }
    };
    let controller = leaf(
        "controller",
        vec!["localhost".into(), "127.0.0.1".into()],
        ExtendedKeyUsagePurpose::ServerAuth,
    );
    let worker = leaf(
        "worker",
        vec!["worker.weightsync.test".into()],
        ExtendedKeyUsagePurpose::ClientAuth,
    );
    TestCa {
        ca,
        controller,
        worker,
    }
}
