//! [`ApiClient`]: the HTTP trigger (`POST /v1/syncs`) as a blocking call, for a training loop
//! (or a driver outside it) that triggers syncs itself instead of pushing from every trainer.
//! Plain `http://` or `https://` with the controller's CA (and a CRL, and a client certificate
//! where the operator gives one): the same files and variables the workers use.

use std::path::PathBuf;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::runtime::Runtime;
use weightsync_common::tls::{self, TlsClient, TlsFiles};

use crate::api_client::{ClientError, SyncResult, sync_over};

/// A client of one controller's HTTP API.
pub struct ApiClient {
    addr: String,
    token: String,
    tls: Option<TlsClient>,
    rt: Mutex<Runtime>,
}

impl std::fmt::Debug for ApiClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiClient")
            .field("addr", &self.addr)
            .field("tls", &self.tls)
            .finish_non_exhaustive()
    }
}

impl ApiClient {
    /// A client of the controller at `url` (`http://host:port`, `host:port` or
    /// `https://host:port`) with the API token `token` (`None`: `$WEIGHTSYNC_API_TOKEN`).
    /// `https://` reads its trust from the environment as a worker does: the CA the controller's
    /// certificate must chain to from `WEIGHTSYNC_TLS_CA` (required: there is no system store
    /// here), a CRL from `WEIGHTSYNC_TLS_CRL`, the expected name from
    /// `WEIGHTSYNC_TLS_SERVER_NAME` (default: the URL's host), and a client certificate from
    /// `WEIGHTSYNC_TLS_CERT` and `WEIGHTSYNC_TLS_KEY` when both are set.
    pub fn new(url: &str, token: Option<&str>) -> Result<ApiClient, ClientError> {
        let tls = if url.starts_with("https://") {
            Some(tls_from_env(&|k| std::env::var(k).ok())?)
        } else {
            None
        };
        ApiClient::with_tls(url, token, tls)
    }

    /// A client of the controller at `url` over `tls` (`None`: plain HTTP). `url` is
    /// `https://host:port` or `host:port` with TLS, `http://host:port` or `host:port` without;
    /// a scheme that contradicts `tls` is refused.
    pub fn with_tls(
        url: &str,
        token: Option<&str>,
        tls: Option<TlsClient>,
    ) -> Result<ApiClient, ClientError> {
        let (scheme, rest) = match url.split_once("://") {
            Some((scheme, rest)) => (Some(scheme), rest),
            None => (None, url),
        };
        let addr = rest.trim_end_matches('/').to_string();
        let expected = if tls.is_some() {
            "https://host:port (TLS given, no path)"
        } else {
            "http://host:port (plain HTTP, no path; https:// needs the controller's CA)"
        };
        let scheme_ok = match scheme {
            None => true,
            Some("https") => tls.is_some(),
            Some("http") => tls.is_none(),
            Some(_) => false,
        };
        if addr.is_empty() || addr.contains('/') || !scheme_ok {
            return Err(ClientError::Malformed(format!(
                "{url}: expected {expected}"
            )));
        }
        let token = token
            .map(str::to_string)
            .or_else(|| std::env::var("WEIGHTSYNC_API_TOKEN").ok())
            .unwrap_or_default();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|source| ClientError::Io {
                addr: addr.clone(),
                source,
            })?;
        Ok(ApiClient {
            addr,
            token,
            tls,
            rt: Mutex::new(rt),
        })
    }

    /// Triggers the sync of `version` (idempotent per version); with `wait`, returns when it
    /// ended (a failed sync is `Ok` with `state == "failed"` and the failure). `timeout` bounds
    /// the whole request.
    pub fn sync(
        &self,
        version: u64,
        wait: bool,
        timeout: Duration,
    ) -> Result<SyncResult, ClientError> {
        let rt = self.rt.lock();
        rt.block_on(sync_over(
            &self.addr,
            self.tls.as_ref(),
            &self.token,
            version,
            wait,
            timeout,
        ))
    }
}

/// The HTTPS trust of an API client from `env`: the CA (required), an optional CRL and server
/// name, and a client certificate when both its files are named.
fn tls_from_env(env: &dyn Fn(&str) -> Option<String>) -> Result<TlsClient, ClientError> {
    let var = |k: &str| env(k).filter(|v| !v.is_empty());
    let path = |k: &str| var(k).map(PathBuf::from);
    let name = var(tls::SERVER_NAME_VAR);
    let Some(ca) = path(tls::CA_VAR) else {
        return Err(ClientError::Malformed(format!(
            "https:// needs the controller's CA: set {} (or use ApiClient::with_tls)",
            tls::CA_VAR
        )));
    };
    let crl = path(tls::CRL_VAR);
    let client = match (path(tls::CERT_VAR), path(tls::KEY_VAR)) {
        (None, None) => TlsClient::server_only(&ca, crl.as_deref(), name.as_deref())?,
        (cert, key) => {
            // With the CA named this is a full set or an error naming the missing file.
            let files = TlsFiles::from_parts_with_crl(cert, key, Some(ca.clone()), crl)?
                .ok_or_else(|| ClientError::Malformed(format!("{}: no TLS set", ca.display())))?;
            TlsClient::new(&files, name.as_deref())?
        }
    };
    Ok(client)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scheme_that_contradicts_the_tls_setting_is_refused() {
        let e = ApiClient::with_tls("https://127.0.0.1:1", Some("t"), None).unwrap_err();
        assert!(e.to_string().contains("CA"), "{e}");
        assert!(ApiClient::with_tls("127.0.0.1:1/v1", Some("t"), None).is_err());
        assert!(ApiClient::with_tls("ftp://127.0.0.1:1", Some("t"), None).is_err());
        assert!(ApiClient::with_tls("http://127.0.0.1:1/", Some("t"), None).is_ok());
    }

    #[test]
    fn https_without_a_ca_names_the_variable() {
        let e = tls_from_env(&|_| None).unwrap_err().to_string();
        assert!(e.contains(tls::CA_VAR), "{e}");
        let only_key = |k: &str| match k {
            tls::CA_VAR => Some("/nonexistent/ca.pem".to_string()),
            tls::KEY_VAR => Some("/nonexistent/key.pem".to_string()),
            _ => None,
        };
        let e = tls_from_env(&only_key).unwrap_err().to_string();
        assert!(e.contains("WEIGHTSYNC_TLS_CERT"), "{e}");
    }
}
