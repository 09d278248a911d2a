//! A shared-memory file exported by the training process, attached read-only.
//!
//! The normal deployment: the worker is a sidecar launched with the training job; the training
//! process keeps (or copies, after its optimizer step) its shards in a file under `/dev/shm`
//! laid out as the plan's source arena, and the worker maps it read-only.
//!
//! Why a header: the mapping alone cannot tell a sync what it read. A file rewritten while a
//! sync copies it ships a mix of two versions whose checksums verify (they are computed from
//! what was read); a file replaced by a new one (written beside it, renamed over it) leaves the
//! mapping on the old file's bytes, which verify too; a file truncated under the mapping kills
//! the reader with SIGBUS. So a stamped file ([`ShmHeader`]) opens with a seqlock generation the
//! writer makes odd while it writes and even when done ([`ShmWriter`]): a sync reads it before
//! its first byte and after its last ([`ShmSource::begin_read`], [`ShmSource::end_read`]) and
//! fails, naming the file, when it moved (kind `modified`); and every read checks first that the
//! path still names the mapped file and that the file is still as long as the mapping.
//!
//! A file without the header's magic is attached as before (its arena at offset 0) with a
//! warning: replacement and truncation are still caught, a rewrite during a sync is not.
//! A truncation that races the copy of one shard (after its length check) can still fault;
//! the training process must not shrink the file while a sync may read it.

use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{Ordering, fence};
use std::time::{Duration, Instant};

use memmap2::{Mmap, MmapOptions};

use super::view::ReadStamp;
use crate::error::SourceError;

/// The stamped file's layout: a 4096-byte header (so the arena stays page aligned), then the
/// arena. All fields little-endian.
///
/// | bytes | field |
/// |---|---|
/// | 0..8 | magic `WSSHM001` |
/// | 8..16 | generation (u64): odd while the writer writes, even when the bytes are whole |
/// | 16..24 | arena length in bytes (u64) |
/// | 24..4096 | zero |
#[derive(Debug)]
pub struct ShmHeader;

impl ShmHeader {
    /// The header's first 8 bytes.
    pub const MAGIC: [u8; 8] = *b"WSSHM001";
    /// Header length: the arena starts here.
    pub const LEN: u64 = 4096;
    /// Byte offset of the generation.
    pub const GENERATION: u64 = 8;
    /// Byte offset of the arena length.
    pub const ARENA_LEN: u64 = 16;
}

/// How long a sync waits for a writer to finish (an odd generation) before failing.
const WRITER_WAIT: Duration = Duration::from_secs(2);

/// A read-only mapping of a shared-memory file.
#[derive(Debug)]
pub struct ShmSource {
    path: PathBuf,
    file: File,
    // The mapped file's identity, to notice the path naming another file.
    dev: u64,
    ino: u64,
    // `None` for an empty file (zero-length mappings are not allowed).
    map: Option<Mmap>,
    // Where the arena lies in the mapping, and whether a header stamps it.
    arena_at: usize,
    arena_len: usize,
    stamped: bool,
}

impl ShmSource {
    /// Maps `path` read-only. If `need` is given, an arena shorter than `need` bytes is refused.
    pub fn open(path: impl AsRef<Path>, need: Option<u64>) -> Result<ShmSource, SourceError> {
        let path = path.as_ref().to_path_buf();
        let io = |source| SourceError::Io {
            path: path.clone(),
            source,
        };
        let file = File::open(&path).map_err(io)?;
        let meta = file.metadata().map_err(io)?;
        let have = meta.len();
        let mut magic = [0u8; 8];
        let stamped = have >= ShmHeader::LEN
            && file.read_exact_at(&mut magic, 0).is_ok()
            && magic == ShmHeader::MAGIC;
        let (arena_at, arena_len) = if stamped {
            let arena = read_u64(&file, ShmHeader::ARENA_LEN).map_err(io)?;
            if arena > have - ShmHeader::LEN {
                return Err(SourceError::TooShort {
                    what: format!(
                        "shared-memory file {} (its header says a {arena}-byte arena)",
                        path.display()
                    ),
                    need: ShmHeader::LEN + arena,
                    have,
                });
            }
            (ShmHeader::LEN, arena)
        } else {
            tracing::warn!(
                "{}: no weightsync header (magic WSSHM001): attached without a generation \
                 stamp, so a rewrite during a sync is not detected",
                path.display()
            );
            (0, have)
        };
        if let Some(need) = need
            && arena_len < need
        {
            return Err(SourceError::TooShort {
                what: format!("shared-memory file {}", path.display()),
                need,
                have: arena_len,
            });
        }
        let map = if have == 0 {
            None
        } else {
            // SAFETY: the mapping is read-only and only ever read through `as_slice`, after
            // `check_intact` confirmed the file still covers it (a truncation racing that check
            // is the residue the module doc states). Writes by the training process are
            // expected; `begin_read` / `end_read` detect those that overlap a sync.
            Some(unsafe { MmapOptions::new().map(&file) }.map_err(io)?)
        };
        Ok(ShmSource {
            path,
            file,
            dev: meta.dev(),
            ino: meta.ino(),
            map,
            arena_at: arena_at as usize,
            arena_len: arena_len as usize,
            stamped,
        })
    }

    /// The arena's mapped bytes. Call [`check_intact`](Self::check_intact) first where the
    /// file may have shrunk.
    pub fn as_slice(&self) -> &[u8] {
        self.map
            .as_deref()
            .map_or(&[], |m| &m[self.arena_at..self.arena_at + self.arena_len])
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the file carries the generation header.
    pub fn is_stamped(&self) -> bool {
        self.stamped
    }

    /// Refuses a file that no longer covers the mapping (truncated: reading it would fault) or
    /// whose path now names another file (replaced: the mapping holds the old one's bytes).
    pub fn check_intact(&self) -> Result<(), SourceError> {
        let mapped = self.map.as_ref().map_or(0, |m| m.len() as u64);
        let now = self
            .file
            .metadata()
            .map_err(|source| self.io(source))?
            .len();
        if now < mapped {
            return Err(SourceError::Truncated {
                path: self.path.clone(),
                mapped,
                now,
            });
        }
        match std::fs::metadata(&self.path) {
            Ok(m) if m.dev() == self.dev && m.ino() == self.ino => Ok(()),
            Ok(_) => Err(SourceError::Replaced {
                path: self.path.clone(),
            }),
            Err(source) => Err(self.io(source)),
        }
    }

    /// Before a sync reads its first byte: checks the file and takes its generation, waiting
    /// (up to 2 s) for a writer that is mid-write.
    pub fn begin_read(&self) -> Result<ReadStamp, SourceError> {
        self.check_intact()?;
        if !self.stamped {
            return Ok(ReadStamp::default());
        }
        let t0 = Instant::now();
        loop {
            let g = self.generation()?;
            if g % 2 == 0 {
                fence(Ordering::SeqCst);
                return Ok(ReadStamp(Some(g)));
            }
            if t0.elapsed() >= WRITER_WAIT {
                return Err(SourceError::BeingWritten {
                    path: self.path.clone(),
                    generation: g,
                });
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// After a sync read its last byte: fails when the file was truncated, replaced or written
    /// since [`begin_read`](Self::begin_read) (what was read may mix two versions).
    pub fn end_read(&self, stamp: ReadStamp) -> Result<(), SourceError> {
        fence(Ordering::SeqCst);
        self.check_intact()?;
        if let Some(before) = stamp.0 {
            let after = self.generation()?;
            if after != before {
                return Err(SourceError::Torn {
                    path: self.path.clone(),
                    before,
                    after,
                });
            }
        }
        Ok(())
    }

    fn generation(&self) -> Result<u64, SourceError> {
        read_u64(&self.file, ShmHeader::GENERATION).map_err(|source| self.io(source))
    }

    fn io(&self, source: std::io::Error) -> SourceError {
        SourceError::Io {
            path: self.path.clone(),
            source,
        }
    }
}

/// A little-endian u64 at `at`, read with `pread` (no mapping: it cannot fault).
fn read_u64(file: &File, at: u64) -> std::io::Result<u64> {
    let mut b = [0u8; 8];
    file.read_exact_at(&mut b, at)?;
    Ok(u64::from_le_bytes(b))
}

/// The training process's side of a stamped file: creates it and writes each version under
/// the seqlock (generation odd while writing, even after). Written with `pwrite`, which the
/// reader's mapping sees (one page cache).
#[derive(Debug)]
pub struct ShmWriter {
    file: File,
    generation: u64,
    arena_len: u64,
}

impl ShmWriter {
    /// Creates (or truncates) `path` as a stamped file with an `arena_len`-byte arena of zeros,
    /// generation 0.
    pub fn create(path: impl AsRef<Path>, arena_len: u64) -> std::io::Result<ShmWriter> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)?;
        file.set_len(ShmHeader::LEN + arena_len)?;
        file.write_all_at(&ShmHeader::MAGIC, 0)?;
        file.write_all_at(&arena_len.to_le_bytes(), ShmHeader::ARENA_LEN)?;
        file.write_all_at(&0u64.to_le_bytes(), ShmHeader::GENERATION)?;
        Ok(ShmWriter {
            file,
            generation: 0,
            arena_len,
        })
    }

    /// Writes `bytes` at arena offset `offset` as one new generation.
    pub fn write(&mut self, offset: u64, bytes: &[u8]) -> std::io::Result<()> {
        if offset.saturating_add(bytes.len() as u64) > self.arena_len {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "{} bytes at offset {offset} do not fit the {}-byte arena",
                    bytes.len(),
                    self.arena_len
                ),
            ));
        }
        self.begin_write()?;
        self.file.write_all_at(bytes, ShmHeader::LEN + offset)?;
        self.end_write()
    }

    /// Marks the file as being written (generation odd).
    pub fn begin_write(&mut self) -> std::io::Result<()> {
        self.generation |= 1;
        self.file
            .write_all_at(&self.generation.to_le_bytes(), ShmHeader::GENERATION)?;
        fence(Ordering::SeqCst);
        Ok(())
    }

    /// Marks the write done (generation even, one past the odd value).
    pub fn end_write(&mut self) -> std::io::Result<()> {
        fence(Ordering::SeqCst);
        self.generation = (self.generation | 1) + 1;
        self.file
            .write_all_at(&self.generation.to_le_bytes(), ShmHeader::GENERATION)
    }

    /// The file, for writes of the caller's own between `begin_write` and `end_write`
    /// (arena offset `o` is file offset `ShmHeader::LEN + o`).
    pub fn file(&self) -> &File {
        &self.file
    }
}

#[cfg(test)]
#[path = "shm_tests.rs"]
mod tests;
