//! The shared-memory source: the header's seqlock catches a write during a read, a replaced file
//! and a truncated one are named errors (no SIGBUS), and an unstamped file still attaches.

use super::*;
use std::io::Write;

use crate::source::SourceMemory;
use crate::source::view::SourceView;

#[test]
fn maps_an_unstamped_file_and_refuses_a_short_one() {
    let mut f = tempfile::NamedTempFile::new().unwrap();
    f.write_all(&[7u8; 4096]).unwrap();
    f.flush().unwrap();
    let src = ShmSource::open(f.path(), Some(4096)).unwrap();
    assert!(!src.is_stamped());
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

#[test]
fn a_stamped_file_maps_its_arena_after_the_header() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ws-0");
    let mut w = ShmWriter::create(&path, 100).unwrap();
    w.write(0, &[5u8; 100]).unwrap();
    let src = ShmSource::open(&path, Some(100)).unwrap();
    assert!(src.is_stamped());
    assert_eq!(src.as_slice(), &[5u8; 100][..]);
    // The arena, not the file, must hold what the plan needs.
    let err = ShmSource::open(&path, Some(101)).unwrap_err();
    assert!(
        matches!(
            err,
            SourceError::TooShort {
                need: 101,
                have: 100,
                ..
            }
        ),
        "{err}"
    );
    // A read with no write in between passes.
    let stamp = src.begin_read().unwrap();
    assert_eq!(stamp, ReadStamp(Some(2)));
    src.end_read(stamp).unwrap();
    assert!(w.write(90, &[0u8; 11]).is_err(), "past the arena");
}

#[test]
fn a_write_during_a_read_fails_it_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ws-0");
    let mut w = ShmWriter::create(&path, 64).unwrap();
    w.write(0, &[1u8; 64]).unwrap();
    let src = ShmSource::open(&path, Some(64)).unwrap();
    let stamp = src.begin_read().unwrap();
    let first = src.as_slice()[..32].to_vec();
    // The optimizer step lands between the two halves of the copy: a torn read.
    w.write(0, &[2u8; 64]).unwrap();
    let second = src.as_slice()[32..].to_vec();
    assert_ne!(first[0], second[0], "the copy mixes two versions");
    let err = src.end_read(stamp).unwrap_err();
    assert!(
        matches!(
            err,
            SourceError::Torn {
                before: 2,
                after: 4,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("ws-0"), "{err}");
    // The next read, after the write, is whole.
    let stamp = src.begin_read().unwrap();
    assert!(src.as_slice().iter().all(|&b| b == 2));
    src.end_read(stamp).unwrap();
}

#[test]
fn a_read_waits_for_a_writer_mid_write_and_gives_up_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ws-0");
    let mut w = ShmWriter::create(&path, 64).unwrap();
    let src = ShmSource::open(&path, Some(64)).unwrap();
    // A writer that finishes within the wait: the read takes the new generation.
    w.begin_write().unwrap();
    let finisher = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        w.file().write_all_at(&[3u8; 64], ShmHeader::LEN).unwrap();
        w.end_write().unwrap();
        w
    });
    let stamp = src.begin_read().unwrap();
    assert_eq!(stamp, ReadStamp(Some(2)));
    assert!(src.as_slice().iter().all(|&b| b == 3));
    src.end_read(stamp).unwrap();
    // A writer that died mid-write (generation left odd): a named error, not stale bytes.
    let mut w = finisher.join().unwrap();
    w.begin_write().unwrap();
    let t0 = Instant::now();
    let err = src.begin_read().unwrap_err();
    assert!(t0.elapsed() >= WRITER_WAIT);
    assert!(
        matches!(err, SourceError::BeingWritten { generation: 3, .. }),
        "{err}"
    );
}

#[test]
fn a_replaced_file_is_refused_not_read_stale() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ws-0");
    let mut w = ShmWriter::create(&path, 64).unwrap();
    w.write(0, &[1u8; 64]).unwrap();
    let src = ShmSource::open(&path, Some(64)).unwrap();
    src.end_read(src.begin_read().unwrap()).unwrap();
    // The training process writes the next version beside it and renames it over.
    let next = dir.path().join("ws-0.next");
    let mut w2 = ShmWriter::create(&next, 64).unwrap();
    w2.write(0, &[2u8; 64]).unwrap();
    std::fs::rename(&next, &path).unwrap();
    // The mapping still holds version 1, whose bytes would verify: refused instead.
    assert!(src.as_slice().iter().all(|&b| b == 1));
    let err = src.begin_read().unwrap_err();
    assert!(matches!(err, SourceError::Replaced { .. }), "{err}");
    assert!(err.to_string().contains("ws-0 was replaced"), "{err}");
    // Replaced during a read: the read fails too.
    let src = ShmSource::open(&path, Some(64)).unwrap();
    let stamp = src.begin_read().unwrap();
    let mut w3 = ShmWriter::create(&next, 64).unwrap();
    w3.write(0, &[3u8; 64]).unwrap();
    std::fs::rename(&next, &path).unwrap();
    let err = src.end_read(stamp).unwrap_err();
    assert!(matches!(err, SourceError::Replaced { .. }), "{err}");
}

#[test]
fn a_truncated_file_is_a_named_error_not_sigbus() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ws-0");
    let mut w = ShmWriter::create(&path, 3 * 4096).unwrap();
    w.write(0, &[1u8; 3 * 4096]).unwrap();
    let src = SourceMemory::Shm(ShmSource::open(&path, Some(3 * 4096)).unwrap());
    // Shrunk under the mapping: touching the last pages would raise SIGBUS.
    w.file().set_len(4096).unwrap();
    let err = SourceView::begin_read(&src).unwrap_err();
    assert!(
        err.to_string()
            .contains("truncated to 4096 bytes while 16384 are mapped"),
        "{err}"
    );
    // A shard read checks first as well (the file may shrink after the sync began).
    let SourceMemory::Shm(shm) = &src else {
        unreachable!()
    };
    let err = shm.check_intact().unwrap_err();
    assert!(
        matches!(
            err,
            SourceError::Truncated {
                mapped: 16384,
                now: 4096,
                ..
            }
        ),
        "{err}"
    );
}
