//! A shared-memory file exported by the training process, attached read-only.
//!
//! The normal deployment: the worker is a sidecar launched with the training job; the training
//! process keeps (or copies, after its optimizer step) its shards in a file under `/dev/shm`
//! laid out as the plan's source arena, and the worker maps it read-only. The training process
//! must not write the file while a sync runs (it triggers the sync after its step and waits for
//! it before the next step writes the weights), and must not shrink it while mapped.

use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::{Mmap, MmapOptions};

use crate::error::SourceError;

/// A read-only mapping of a shared-memory file.
#[derive(Debug)]
pub struct ShmSource {
    path: PathBuf,
    // `None` for an empty file (zero-length mappings are not allowed).
    map: Option<Mmap>,
}

impl ShmSource {
    /// Maps `path` read-only. If `need` is given, a file shorter than `need` bytes is refused.
    pub fn open(path: impl AsRef<Path>, need: Option<u64>) -> Result<ShmSource, SourceError> {
        let path = path.as_ref().to_path_buf();
        let io = |source| SourceError::Io {
            path: path.clone(),
            source,
        };
        let file = File::open(&path).map_err(io)?;
        let have = file.metadata().map_err(io)?.len();
        if let Some(need) = need
            && have < need
        {
            return Err(SourceError::TooShort {
                what: format!("shared-memory file {}", path.display()),
                need,
                have,
            });
        }
        let map = if have == 0 {
            None
        } else {
            // SAFETY: the mapping is read-only and only ever read through `as_slice`. The
            // deployment contract (module doc) is that the training process neither writes nor
            // truncates the file while a sync reads it; writes between syncs are the point of
            // sharing it, and are not observed while a borrow from `as_slice` is alive.
            Some(unsafe { MmapOptions::new().map(&file) }.map_err(io)?)
        };
        Ok(ShmSource { path, map })
    }

    /// The mapped bytes.
    pub fn as_slice(&self) -> &[u8] {
        self.map.as_deref().unwrap_or(&[])
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn maps_a_file_and_refuses_a_short_one() {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(&[7u8; 4096]).unwrap();
        f.flush().unwrap();
        let src = ShmSource::open(f.path(), Some(4096)).unwrap();
        assert_eq!(src.as_slice().len(), 4096);
        assert!(src.as_slice().iter().all(|&b| b == 7));
        let err = ShmSource::open(f.path(), Some(8192)).unwrap_err();
        assert!(
            matches!(
                err,
                SourceError::TooShort {
                    need: 8192,
                    have: 4096,
                    ..
                }
            ),
            "{err}"
        );
        let err = ShmSource::open("/nonexistent/weightsync-shm", None).unwrap_err();
        assert!(
            err.to_string().contains("/nonexistent/weightsync-shm"),
            "{err}"
        );
    }

    #[test]
    fn sees_writes_made_between_reads() {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(&[0u8; 64]).unwrap();
        f.flush().unwrap();
        let src = ShmSource::open(f.path(), None).unwrap();
        assert_eq!(src.as_slice()[10], 0);
        // The training process writes new weights through its own handle.
        std::fs::write(f.path(), [9u8; 64]).unwrap();
        assert_eq!(src.as_slice()[10], 9);
    }
}
