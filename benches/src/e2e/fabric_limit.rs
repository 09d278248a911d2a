//! The fabric limit of `bench e2e` and the calibration: [`weightsync_common::fabric::limit`]
//! with its errors said as the bench's.

use weightsync_common::fabric::{FabricConfig, limit};

use super::E2eError;

/// [`limit::FabricLimit`], its errors as [`E2eError`]s.
pub(crate) struct FabricLimit(limit::FabricLimit);

impl FabricLimit {
    /// Starts the fabrics for `pairs` (trainer, rollout, bytes), each configured as `config`
    /// (the sync's own: same lanes, same local addresses).
    pub(crate) async fn start(
        pairs: &[(u32, u32, u64)],
        config: &FabricConfig,
    ) -> Result<FabricLimit, E2eError> {
        limit::FabricLimit::start(pairs, config)
            .await
            .map(FabricLimit)
            .map_err(|e| E2eError::Setup(format!("fabric limit: {e}")))
    }

    /// Moves every pair's bytes once, all pairs at once; returns the seconds it took.
    pub(crate) async fn sync(&self) -> Result<f64, E2eError> {
        self.0
            .sync()
            .await
            .map_err(|e| E2eError::Sync(format!("fabric limit: {e}")))
    }
}
