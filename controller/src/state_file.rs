//! The controller's durable state on disk: one small JSON file, written atomically (a temporary
//! file in the same directory, fsynced, renamed over the old one, and the directory fsynced), so
//! a crash at any instant leaves either the old state or the new one, never a torn file.
//!
//! Why a file and not a store: four numbers change at most twice per sync (its creation and its
//! end); an embedded database or etcd would add a dependency and an operational burden for that.
//! See `crate::coordinator::durable` for what is kept and why.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::coordinator::durable::Durable;

/// Why the state file could not be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StateFileError {
    /// Reading or writing it failed.
    #[error("state file {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// It exists but is not a state file this controller wrote.
    #[error("state file {path} is not a weightsync controller state file: {reason}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
}

/// Where the state lives.
#[derive(Debug, Clone)]
pub struct StateFile {
    path: PathBuf,
}

impl StateFile {
    /// The state file at `path` (nothing is read yet).
    pub fn new(path: impl Into<PathBuf>) -> StateFile {
        StateFile { path: path.into() }
    }

    /// Its path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn io(&self, source: std::io::Error) -> StateFileError {
        StateFileError::Io {
            path: self.path.clone(),
            source,
        }
    }

    /// The saved state, or `None` when there is no file yet (a first start).
    pub fn load(&self) -> Result<Option<Durable>, StateFileError> {
        let text = match std::fs::read_to_string(&self.path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(self.io(e)),
        };
        serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| StateFileError::Corrupt {
                path: self.path.clone(),
                reason: e.to_string(),
            })
    }

    /// Replaces the saved state with `state`, atomically and durably.
    pub fn save(&self, state: &Durable) -> Result<(), StateFileError> {
        let dir = match self.path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let name = self
            .path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "state".into());
        let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
        let body = serde_json::to_vec_pretty(state).map_err(|e| self.io(e.into()))?;
        let write = || -> std::io::Result<()> {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(&body)?;
            f.write_all(b"\n")?;
            f.sync_all()?;
            std::fs::rename(&tmp, &self.path)?;
            // The rename itself must reach the disk.
            std::fs::File::open(&dir)?.sync_all()
        };
        write().map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            self.io(e)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn saves_and_loads_back_and_a_missing_file_is_a_first_start() {
        let dir = tempfile::tempdir().unwrap();
        let f = StateFile::new(dir.path().join("controller.json"));
        assert_eq!(f.load().unwrap(), None);
        let s = Durable {
            incarnation: 7,
            run: 2,
            committed: Some((2, 41)),
            next_sync_id: 99,
        };
        f.save(&s).unwrap();
        assert_eq!(f.load().unwrap(), Some(s));
        let t = Durable {
            next_sync_id: 100,
            ..s
        };
        f.save(&t).unwrap();
        assert_eq!(f.load().unwrap(), Some(t));
        // No temporary file is left behind.
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(names.len(), 1);
    }

    #[test]
    fn a_corrupt_file_is_refused_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("controller.json");
        std::fs::write(&p, "{\"run\": ").unwrap();
        let err = StateFile::new(&p).load().unwrap_err().to_string();
        assert!(err.contains("controller.json"), "{err}");
    }

    #[test]
    fn a_reopened_controller_carries_on_as_a_new_incarnation() {
        use crate::coordinator::{CoordinatorConfig, Now};
        use crate::planning::NullPlanner;
        use crate::service::{AppState, ControllerConfig};

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.json");
        let coord = CoordinatorConfig {
            world: weightsync_common::protocol::WorldSpec {
                model: "m".into(),
                train: "fsdp=1".into(),
                infer: "tp=1".into(),
                dtype: weightsync_common::DType::BF16,
                verify: false,
            },
            trainers: 1,
            rollouts: 1,
            heartbeat_interval: std::time::Duration::from_millis(100),
            heartbeat_timeout: std::time::Duration::from_secs(1),
            sync_timeout: std::time::Duration::from_secs(5),
            failure_grace: std::time::Duration::ZERO,
            history: 8,
        };
        let mut cfg = ControllerConfig::new(coord, "job".into(), "api".into());
        cfg.state_file = Some(path.clone());
        let first = AppState::open(cfg.clone(), Box::new(NullPlanner)).unwrap();
        let inc1 = first.read(|c| c.incarnation());
        // Saved at once, and on every change that must survive.
        assert_eq!(
            StateFile::new(&path).load().unwrap().unwrap().incarnation,
            inc1
        );
        first.step(|c| ((), c.begin_run(3, Now::wall()).unwrap()));
        assert_eq!(StateFile::new(&path).load().unwrap().unwrap().run, 3);
        drop(first);
        let second = AppState::open(cfg, Box::new(NullPlanner)).unwrap();
        let (run, inc2) = second.read(|c| (c.run(), c.incarnation()));
        assert_eq!(run, 3);
        assert_ne!(inc1, inc2);
        assert_eq!(
            StateFile::new(&path).load().unwrap().unwrap().incarnation,
            inc2
        );
    }
}
