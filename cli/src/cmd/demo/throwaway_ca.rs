//! `weightsync demo --tls`: a CA made for one run, and the certificates it signs (the
//! controller's for `127.0.0.1` and `localhost`, one client certificate every worker shows),
//! written as PEM files into the run's log folder, so the demo's control channel and HTTP API
//! run over mutual TLS exactly as a job's would, without an operator's PKI. The CA's key is
//! dropped once they are signed: nothing else can ever be signed by it.

use std::path::Path;

use anyhow::Context;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
};
use weightsync_common::tls::{TlsClient, TlsFiles, TlsServer};

/// The demo's TLS: the controller's side, the workers' files and the API client.
pub(super) struct DemoTls {
    /// The controller's acceptors.
    pub server: TlsServer,
    /// What every worker shows and trusts.
    pub worker: TlsFiles,
    /// The demo's HTTP API client (trusts the CA, shows no certificate).
    pub api: TlsClient,
}

/// Makes the CA and its certificates under `dir`.
pub(super) fn make(dir: &Path) -> anyhow::Result<DemoTls> {
    let ca_key = KeyPair::generate()?;
    let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "weightsync demo throwaway CA");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_cert = ca_params.self_signed(&ca_key)?;
    let issuer = Issuer::new(ca_params, ca_key);
    let write = |file: &str, text: String| -> anyhow::Result<std::path::PathBuf> {
        let p = dir.join(file);
        std::fs::write(&p, text).with_context(|| format!("writing {}", p.display()))?;
        Ok(p)
    };
    let ca = write("tls-ca.pem", ca_cert.pem())?;
    let leaf = |name: &str, sans: Vec<String>, usage| -> anyhow::Result<TlsFiles> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(sans)?;
        params
            .distinguished_name
            .push(DnType::CommonName, format!("weightsync demo {name}"));
        params.extended_key_usages = vec![usage];
        let cert = params.signed_by(&key, &issuer)?;
        Ok(TlsFiles {
            cert: write(&format!("tls-{name}.pem"), cert.pem())?,
            key: write(&format!("tls-{name}-key.pem"), key.serialize_pem())?,
            ca: ca.clone(),
            crl: None,
        })
    };
    let controller = leaf(
        "controller",
        vec!["127.0.0.1".into(), "localhost".into()],
        ExtendedKeyUsagePurpose::ServerAuth,
    )?;
    let worker = leaf(
        "worker",
        vec!["worker.weightsync.demo".into()],
        ExtendedKeyUsagePurpose::ClientAuth,
    )?;
    Ok(DemoTls {
        server: TlsServer::new(&controller)?,
        api: TlsClient::server_only(&ca, None, None)?,
        worker,
    })
}
