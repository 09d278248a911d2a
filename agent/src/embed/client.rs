//! [`ApiClient`]: the HTTP trigger (`POST /v1/syncs`) as a blocking call, for a training loop
//! (or a driver outside it) that triggers syncs itself instead of pushing from every trainer.

use std::time::Duration;

use parking_lot::Mutex;
use tokio::runtime::Runtime;

use crate::api_client::{ClientError, SyncResult, sync};

/// A client of one controller's HTTP API.
pub struct ApiClient {
    addr: String,
    token: String,
    rt: Mutex<Runtime>,
}

impl std::fmt::Debug for ApiClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiClient")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl ApiClient {
    /// A client of the controller at `url` (`http://host:port` or `host:port`) with the API
    /// token `token` (`None`: `$WEIGHTSYNC_API_TOKEN`).
    pub fn new(url: &str, token: Option<&str>) -> Result<ApiClient, ClientError> {
        let addr = url
            .trim_start_matches("http://")
            .trim_end_matches('/')
            .to_string();
        if addr.is_empty() || addr.contains('/') || url.starts_with("https://") {
            return Err(ClientError::Malformed(format!(
                "{url}: expected http://host:port (plain HTTP, no path)"
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
        rt.block_on(sync(&self.addr, &self.token, version, wait, timeout))
    }
}
