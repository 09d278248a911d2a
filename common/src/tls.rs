//! TLS for the control channel and the HTTP API (rustls with `ring`), with mutual
//! authentication: the controller shows a certificate that workers check against their CA, and
//! each worker shows a client certificate that the controller checks against its CA
//! (`WebPkiClientVerifier`). Both sides read PEM files that the operator names ([`TlsFiles`]:
//! by flag, environment or TOML); none set means plain TCP, which every caller says in its log.
//! An optional CRL file ([`TlsFiles::crl`]) lists revoked certificates: the controller refuses a
//! worker's certificate it lists, a worker the controller's.
//!
//! The role secrets' challenge and proof still run inside the TLS stream: a certificate gets a
//! peer onto the channel, the role secret decides what it may register as.
//!
//! [`ByteStream`] is the one stream type the control channel and the HTTP server read and write,
//! plain or TLS, so the handshake, the frame loop and the HTTP connection are written once.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, CertificateRevocationListDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio_rustls::{TlsAcceptor, TlsConnector};

/// The variable naming this process's certificate chain (PEM).
pub const CERT_VAR: &str = "WEIGHTSYNC_TLS_CERT";
/// The variable naming the private key of that certificate (PEM: PKCS#8, PKCS#1 or SEC1).
pub const KEY_VAR: &str = "WEIGHTSYNC_TLS_KEY";
/// The variable naming the CA certificate(s) the peer's certificate must chain to (PEM).
pub const CA_VAR: &str = "WEIGHTSYNC_TLS_CA";
/// The variable naming the certificate revocation list(s) (PEM `X509 CRL`) of the peer's CA:
/// a peer certificate listed there is refused. Optional.
pub const CRL_VAR: &str = "WEIGHTSYNC_TLS_CRL";
/// The variable of the name a worker expects in the controller's certificate (default: the
/// host of the controller's address).
pub const SERVER_NAME_VAR: &str = "WEIGHTSYNC_TLS_SERVER_NAME";

/// Why TLS could not be set up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TlsError {
    /// A file could not be read.
    #[error("cannot read the TLS {what} {path}: {source}")]
    Read {
        /// Which file (certificate, key, CA).
        what: &'static str,
        /// Its path.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A file holds no usable PEM item of the kind it should.
    #[error("the TLS {what} {path} holds no usable PEM {expected}: {detail}")]
    Pem {
        /// Which file.
        what: &'static str,
        /// Its path.
        path: PathBuf,
        /// What it should hold.
        expected: &'static str,
        /// What went wrong.
        detail: String,
    },
    /// Some of the three files are named and some are not.
    #[error("TLS needs a certificate, its key and a CA; {missing} is not set")]
    Incomplete {
        /// The setting not given.
        missing: &'static str,
    },
    /// rustls refused the combination (a key that does not match the certificate...).
    #[error("TLS setup: {0}")]
    Config(String),
    /// A CRL file is named but no certificate, key and CA: a CRL only narrows TLS.
    #[error("a TLS CRL ({path}) is named but TLS is not set up (no certificate, key and CA)")]
    CrlWithoutTls {
        /// The CRL file.
        path: PathBuf,
    },
    /// The name the worker expects in the controller's certificate is not a valid DNS name or IP.
    #[error("{name:?} is not a valid TLS server name (a DNS name or an IP address)")]
    ServerName {
        /// The name.
        name: String,
    },
}

/// The PEM files of one side of a mutually authenticated connection: three, and a CRL when the
/// operator revoked certificates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// This side's certificate chain (leaf first).
    pub cert: PathBuf,
    /// Its private key.
    pub key: PathBuf,
    /// The CA certificate(s) the other side's certificate must chain to.
    pub ca: PathBuf,
    /// Certificate revocation list(s) (PEM `X509 CRL` blocks) of the CA(s) in `ca`: a peer
    /// certificate listed there is refused. Every certificate of the peer's chain below the
    /// trust anchor is checked, and one whose issuer has no CRL in the file is refused too (a
    /// CRL file must cover the chain it is used for).
    pub crl: Option<PathBuf>,
}

impl TlsFiles {
    /// The files as given (by flags, or a TOML file): all three, none (plain TCP), or an error
    /// naming the one missing.
    pub fn from_parts(
        cert: Option<PathBuf>,
        key: Option<PathBuf>,
        ca: Option<PathBuf>,
    ) -> Result<Option<TlsFiles>, TlsError> {
        match (cert, key, ca) {
            (None, None, None) => Ok(None),
            (Some(cert), Some(key), Some(ca)) => Ok(Some(TlsFiles {
                cert,
                key,
                ca,
                crl: None,
            })),
            (None, _, _) => Err(TlsError::Incomplete {
                missing: "the certificate (--tls-cert, WEIGHTSYNC_TLS_CERT)",
            }),
            (_, None, _) => Err(TlsError::Incomplete {
                missing: "the key (--tls-key, WEIGHTSYNC_TLS_KEY)",
            }),
            (_, _, None) => Err(TlsError::Incomplete {
                missing: "the CA (--tls-ca, WEIGHTSYNC_TLS_CA)",
            }),
        }
    }

    /// [`TlsFiles::from_parts`] with a CRL file: a CRL without the three files is refused
    /// naming it (it would otherwise be ignored, and the operator believe a certificate revoked).
    pub fn from_parts_with_crl(
        cert: Option<PathBuf>,
        key: Option<PathBuf>,
        ca: Option<PathBuf>,
        crl: Option<PathBuf>,
    ) -> Result<Option<TlsFiles>, TlsError> {
        match (TlsFiles::from_parts(cert, key, ca)?, crl) {
            (Some(files), crl) => Ok(Some(TlsFiles { crl, ..files })),
            (None, Some(path)) => Err(TlsError::CrlWithoutTls { path }),
            (None, None) => Ok(None),
        }
    }

    /// The files named by [`CERT_VAR`], [`KEY_VAR`], [`CA_VAR`] and [`CRL_VAR`] (empty values
    /// count as unset).
    pub fn from_env(env: &dyn Fn(&str) -> Option<String>) -> Result<Option<TlsFiles>, TlsError> {
        let var = |k: &str| env(k).filter(|v| !v.is_empty()).map(PathBuf::from);
        TlsFiles::from_parts_with_crl(var(CERT_VAR), var(KEY_VAR), var(CA_VAR), var(CRL_VAR))
    }

    fn chain(&self) -> Result<Vec<CertificateDer<'static>>, TlsError> {
        read_certs(&self.cert, "certificate")
    }

    fn private_key(&self) -> Result<PrivateKeyDer<'static>, TlsError> {
        let bytes = read(&self.key, "key")?;
        PrivateKeyDer::from_pem_slice(&bytes).map_err(|e| TlsError::Pem {
            what: "key",
            path: self.key.clone(),
            expected: "private key",
            detail: e.to_string(),
        })
    }

    fn roots(&self) -> Result<RootCertStore, TlsError> {
        read_roots(&self.ca)
    }
}

fn read_roots(ca: &Path) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    for cert in read_certs(ca, "CA")? {
        roots.add(cert).map_err(|e| TlsError::Pem {
            what: "CA",
            path: ca.to_path_buf(),
            expected: "CA certificate",
            detail: e.to_string(),
        })?;
    }
    Ok(roots)
}

/// The CRLs of `path` (none when no file is named); a named file without one is refused by name.
fn read_crls(path: Option<&Path>) -> Result<Vec<CertificateRevocationListDer<'static>>, TlsError> {
    let Some(path) = path else {
        return Ok(Vec::new());
    };
    let bytes = read(path, "CRL")?;
    let pem = |detail: String| TlsError::Pem {
        what: "CRL",
        path: path.to_path_buf(),
        expected: "X509 CRL",
        detail,
    };
    let crls = CertificateRevocationListDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem(e.to_string()))?;
    if crls.is_empty() {
        return Err(pem("no X509 CRL block".into()));
    }
    Ok(crls)
}

/// What a CRL the verifier could not use is refused with: naming the file.
fn verifier_error(side: &str, crl: Option<&Path>, e: impl std::fmt::Display) -> TlsError {
    match crl {
        Some(p) => TlsError::Config(format!("{side} verifier (CRL {}): {e}", p.display())),
        None => TlsError::Config(format!("{side} verifier: {e}")),
    }
}

/// rustls's `ring` provider: no cmake or C toolchain beyond `cc` (aws-lc-rs needs both). It
/// lacks the post-quantum key exchange (hence rustls's deprecation note); classical ECDHE is
/// what it offers.
#[allow(deprecated)]
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn read(path: &Path, what: &'static str) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        what,
        path: path.to_path_buf(),
        source,
    })
}

fn read_certs(path: &Path, what: &'static str) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let bytes = read(path, what)?;
    let pem = |detail: String| TlsError::Pem {
        what,
        path: path.to_path_buf(),
        expected: "certificate",
        detail,
    };
    let certs = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem(e.to_string()))?;
    if certs.is_empty() {
        return Err(pem("no CERTIFICATE block".into()));
    }
    Ok(certs)
}

/// The controller's TLS: the control channel's acceptor (client certificates required, checked
/// against the CA) and the HTTP API's (no client certificate: its bearer tokens authenticate).
#[derive(Clone)]
pub struct TlsServer {
    control: TlsAcceptor,
    http: TlsAcceptor,
    files: TlsFiles,
    /// BLAKE3 of the controller's private key: what [`TlsServer::fabric_key`] derives from.
    key_digest: [u8; 32],
}

impl std::fmt::Debug for TlsServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsServer")
            .field("files", &self.files)
            .finish_non_exhaustive()
    }
}

impl TlsServer {
    /// Reads the files and builds both acceptors.
    pub fn new(files: &TlsFiles) -> Result<TlsServer, TlsError> {
        let chain = files.chain()?;
        let key = files.private_key()?;
        let key_digest = *blake3::hash(key.secret_der()).as_bytes();
        let verifier =
            WebPkiClientVerifier::builder_with_provider(Arc::new(files.roots()?), provider())
                .with_crls(read_crls(files.crl.as_deref())?)
                .build()
                .map_err(|e| verifier_error("client", files.crl.as_deref(), e))?;
        let config = |client_auth: bool| -> Result<ServerConfig, TlsError> {
            let builder = ServerConfig::builder_with_provider(provider())
                .with_safe_default_protocol_versions()
                .map_err(|e| TlsError::Config(e.to_string()))?;
            let builder = if client_auth {
                builder.with_client_cert_verifier(verifier.clone())
            } else {
                builder.with_no_client_auth()
            };
            builder
                .with_single_cert(chain.clone(), key.clone_key())
                .map_err(|e| TlsError::Config(format!("{}: {e}", files.cert.display())))
        };
        let mut http = config(false)?;
        http.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(TlsServer {
            control: TlsAcceptor::from(Arc::new(config(true)?)),
            http: TlsAcceptor::from(Arc::new(http)),
            files: files.clone(),
            key_digest,
        })
    }

    /// The fabric key of this controller's job: derived from its TLS private key and the
    /// workers' `secrets`, so it is the same after a restart with the same files and secrets, and
    /// no worker can compute it: each learns it over mutual TLS.
    pub fn fabric_key(&self, secrets: &[&str]) -> [u8; 32] {
        let mut h = blake3::Hasher::new_derive_key("weightsync fabric key delivered over TLS v1");
        h.update(&self.key_digest);
        for s in secrets {
            h.update(&(s.len() as u64).to_le_bytes());
            h.update(s.as_bytes());
        }
        *h.finalize().as_bytes()
    }

    /// Accepts a worker's TLS connection, requiring a client certificate that chains to the CA.
    pub async fn accept_control(&self, tcp: TcpStream) -> std::io::Result<ByteStream> {
        Ok(Box::new(self.control.accept(tcp).await?))
    }

    /// Accepts an HTTP client's TLS connection.
    pub async fn accept_http(
        &self,
        tcp: TcpStream,
    ) -> std::io::Result<tokio_rustls::server::TlsStream<TcpStream>> {
        self.http.accept(tcp).await
    }

    /// The files it was built from.
    pub fn files(&self) -> &TlsFiles {
        &self.files
    }
}

/// A worker's (or an HTTP client's) TLS: the CA (and CRL) the controller's certificate is
/// checked against, and this side's client certificate (a worker's always; an HTTP client's
/// when it has one: [`TlsClient::server_only`] shows none).
#[derive(Clone)]
pub struct TlsClient {
    connector: TlsConnector,
    server_name: Option<ServerName<'static>>,
    ca: PathBuf,
    cert: Option<PathBuf>,
    crl: Option<PathBuf>,
}

impl std::fmt::Debug for TlsClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsClient")
            .field("ca", &self.ca)
            .field("cert", &self.cert)
            .field("crl", &self.crl)
            .field("server_name", &self.server_name)
            .finish_non_exhaustive()
    }
}

impl TlsClient {
    /// Reads the files (mutual TLS: this side shows `files.cert`); `server_name` is the name
    /// expected in the controller's certificate (`None`: the host of the address connected to).
    pub fn new(files: &TlsFiles, server_name: Option<&str>) -> Result<TlsClient, TlsError> {
        let identity = (files.chain()?, files.private_key()?, files.cert.as_path());
        TlsClient::build(&files.ca, files.crl.as_deref(), Some(identity), server_name)
    }

    /// A client that checks the server's certificate against `ca` (and `crl`) and shows none of
    /// its own: what an HTTP API client needs (the API's bearer token authenticates it).
    pub fn server_only(
        ca: &Path,
        crl: Option<&Path>,
        server_name: Option<&str>,
    ) -> Result<TlsClient, TlsError> {
        TlsClient::build(ca, crl, None, server_name)
    }

    fn build(
        ca: &Path,
        crl: Option<&Path>,
        identity: Option<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>, &Path)>,
        server_name: Option<&str>,
    ) -> Result<TlsClient, TlsError> {
        let server_name = server_name.map(parse_server_name).transpose()?;
        let roots = Arc::new(read_roots(ca)?);
        let builder = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Config(e.to_string()))?;
        let crls = read_crls(crl)?;
        let builder = if crls.is_empty() {
            builder.with_root_certificates(roots)
        } else {
            let verifier = WebPkiServerVerifier::builder_with_provider(roots, provider())
                .with_crls(crls)
                .build()
                .map_err(|e| verifier_error("server", crl, e))?;
            builder.with_webpki_verifier(verifier)
        };
        let cert = identity.as_ref().map(|(_, _, path)| path.to_path_buf());
        let config = match identity {
            Some((chain, key, path)) => builder
                .with_client_auth_cert(chain, key)
                .map_err(|e| TlsError::Config(format!("{}: {e}", path.display())))?,
            None => builder.with_no_client_auth(),
        };
        Ok(TlsClient {
            connector: TlsConnector::from(Arc::new(config)),
            server_name,
            ca: ca.to_path_buf(),
            cert,
            crl: crl.map(Path::to_path_buf),
        })
    }

    /// [`TlsClient::new`] from the environment ([`TlsFiles::from_env`], [`SERVER_NAME_VAR`]):
    /// `None` when no TLS file is named.
    pub fn from_env(env: &dyn Fn(&str) -> Option<String>) -> Result<Option<TlsClient>, TlsError> {
        let Some(files) = TlsFiles::from_env(env)? else {
            return Ok(None);
        };
        let name = env(SERVER_NAME_VAR).filter(|v| !v.is_empty());
        TlsClient::new(&files, name.as_deref()).map(Some)
    }

    /// Runs the TLS handshake over `tcp`, connected to `addr` (`host:port`), checking the
    /// controller's certificate. The error names what failed (an unknown issuer, a name that
    /// does not match, a revoked certificate...).
    pub async fn connect(&self, tcp: TcpStream, addr: &str) -> std::io::Result<ByteStream> {
        let name = match &self.server_name {
            Some(n) => n.clone(),
            None => parse_server_name(host_of(addr))
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?,
        };
        Ok(Box::new(self.connector.connect(name, tcp).await?))
    }

    /// The CA file the server's certificate is checked against.
    pub fn ca(&self) -> &Path {
        &self.ca
    }

    /// The client certificate it shows (`None`: [`TlsClient::server_only`]).
    pub fn cert(&self) -> Option<&Path> {
        self.cert.as_deref()
    }
}

fn parse_server_name(name: &str) -> Result<ServerName<'static>, TlsError> {
    ServerName::try_from(name.to_string()).map_err(|_| TlsError::ServerName {
        name: name.to_string(),
    })
}

/// The host of `host:port` (`[v6]:port` too).
fn host_of(addr: &str) -> &str {
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
    host.trim_start_matches('[').trim_end_matches(']')
}

/// Whether `e` is a TLS failure (a certificate the other side refused or that this side
/// refused, an alert) rather than a lost connection: such a failure does not heal by retrying.
/// Returns its description.
pub fn tls_failure(e: &std::io::Error) -> Option<String> {
    let inner = e.get_ref()?;
    inner
        .downcast_ref::<rustls::Error>()
        .map(|tls| tls.to_string())
}

/// Any byte stream the control channel or the HTTP server runs over: plain TCP or TLS.
pub trait ByteIo: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> ByteIo for T {}

/// A connection's stream, plain or TLS.
pub type ByteStream = Box<dyn ByteIo>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_of_strips_the_port_and_brackets() {
        assert_eq!(host_of("127.0.0.1:7000"), "127.0.0.1");
        assert_eq!(host_of("[::1]:7000"), "::1");
        assert_eq!(host_of("ctl.example:7000"), "ctl.example");
    }

    #[test]
    fn a_partial_set_of_files_names_the_missing_one() {
        let env = |k: &str| (k == CERT_VAR || k == CA_VAR).then(|| "/x".to_string());
        let e = TlsFiles::from_env(&env).unwrap_err().to_string();
        assert!(e.contains("WEIGHTSYNC_TLS_KEY"), "{e}");
        assert!(TlsFiles::from_env(&|_| None).unwrap().is_none());
    }

    #[test]
    fn a_file_without_a_certificate_is_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let bad = dir.path().join("cert.pem");
        std::fs::write(&bad, "not pem").unwrap();
        let files = TlsFiles {
            cert: bad.clone(),
            key: bad.clone(),
            ca: bad,
            crl: None,
        };
        let e = TlsServer::new(&files).unwrap_err().to_string();
        assert!(e.contains("cert.pem") && e.contains("certificate"), "{e}");
    }

    #[test]
    fn a_crl_without_the_other_files_is_refused_by_name() {
        let env = |k: &str| (k == CRL_VAR).then(|| "/etc/crl.pem".to_string());
        let e = TlsFiles::from_env(&env).unwrap_err().to_string();
        assert!(e.contains("/etc/crl.pem") && e.contains("CRL"), "{e}");
    }

    #[test]
    fn a_crl_file_without_a_crl_is_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["localhost".to_string()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        let write = |name: &str, text: String| {
            let p = dir.path().join(name);
            std::fs::write(&p, text).unwrap();
            p
        };
        let cert = write("cert.pem", cert.pem());
        let files = TlsFiles {
            key: write("key.pem", key.serialize_pem()),
            ca: cert.clone(),
            crl: Some(cert.clone()),
            cert,
        };
        for e in [
            TlsServer::new(&files).unwrap_err().to_string(),
            TlsClient::new(&files, None).unwrap_err().to_string(),
        ] {
            assert!(e.contains("CRL") && e.contains("cert.pem"), "{e}");
        }
    }
}
