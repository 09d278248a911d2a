//! Tests of [`super`]: descriptors round-trip and map, unsealed ones are refused, and a reader
//! that `process_vm_readv` refuses (the writer non-dumpable, the reader without
//! `CAP_SYS_PTRACE`) still reads every byte through the descriptor, in another process.

use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::Instant;

use super::*;

fn pattern(i: usize) -> u8 {
    (i.wrapping_mul(2_654_435_761) >> 13) as u8
}

#[test]
fn a_descriptor_round_trips_and_maps_the_same_bytes() {
    let mem = SharedMemory::create("weightsync-test", 1 << 20).unwrap();
    assert!(mem.writable());
    // SAFETY: the mapping is 1 MiB, exclusively ours, no reference into it exists.
    let bytes = unsafe { std::slice::from_raw_parts_mut(mem.as_ptr(), mem.len()) };
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = pattern(i);
    }
    let (a, b) = UnixStream::pair().unwrap();
    send_with_fd(&a, b"region 1", mem.fd()).unwrap();
    let mut buf = [0u8; 16];
    let (n, fd) = recv_with_fd(&b, &mut buf).unwrap();
    assert_eq!(&buf[..n], b"region 1");
    let seen = SharedMemory::from_fd(fd.expect("a descriptor")).unwrap();
    assert!(!seen.writable());
    assert_eq!(seen.len(), 1 << 20);
    let mut out = vec![0u8; 4096];
    seen.read_at(12_345, &mut out).unwrap();
    assert!(
        out.iter()
            .enumerate()
            .all(|(i, &v)| v == pattern(12_345 + i))
    );
    // Shared, not copied: a later write by the creator is what the reader sees.
    bytes[12_345] ^= 0xff;
    seen.read_at(12_345, &mut out[..1]).unwrap();
    assert_eq!(out[0], pattern(12_345) ^ 0xff);
    let err = seen.read_at((1 << 20) - 10, &mut out[..11]).unwrap_err();
    assert!(err.to_string().contains("outside shared memory"), "{err}");
    // A message without a descriptor gives none.
    (&a).write_all(b"x").unwrap();
    assert!(recv_with_fd(&b, &mut buf).unwrap().1.is_none());
}

#[test]
fn an_unsealed_or_foreign_descriptor_is_refused() {
    let fd = rustix::fs::memfd_create("unsealed", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    rustix::fs::ftruncate(&fd, 4096).unwrap();
    let err = SharedMemory::from_fd(fd).unwrap_err();
    assert!(err.to_string().contains("not sealed"), "{err}");
    let (a, _b) = UnixStream::pair().unwrap();
    let err = SharedMemory::from_fd(OwnedFd::from(a)).unwrap_err();
    assert!(err.to_string().contains("not a sealable memfd"), "{err}");
    assert!(SharedMemory::create("empty", 0).is_err());
}

const CHILD_ENV: &str = "WEIGHTSYNC_SHM_TEST_SOCKET";
const LEN: usize = 8 << 20;

/// Held by a test while it makes this process non-dumpable (tests run in parallel threads of
/// one process; one restoring the flag must not end another's window).
pub(crate) static NON_DUMPABLE: parking_lot::Mutex<()> = parking_lot::Mutex::new(());

/// Drops `CAP_SYS_PTRACE` from this process (a no-op without it): after this the kernel's ptrace
/// access check applies to it as to any unprivileged reader.
pub(crate) fn drop_cap_sys_ptrace() {
    use rustix::thread::{CapabilitySet, capabilities, set_capabilities};
    let mut caps = capabilities(None).unwrap();
    caps.effective.remove(CapabilitySet::SYS_PTRACE);
    caps.permitted.remove(CapabilitySet::SYS_PTRACE);
    caps.inheritable.remove(CapabilitySet::SYS_PTRACE);
    set_capabilities(None, caps).unwrap();
}

/// Makes this process non-dumpable (`prctl(PR_SET_DUMPABLE, 0)`), or dumpable again.
pub(crate) fn set_dumpable(on: bool) {
    use rustix::process::{DumpableBehavior, set_dumpable_behavior};
    let b = if on {
        DumpableBehavior::Dumpable
    } else {
        DumpableBehavior::NotDumpable
    };
    set_dumpable_behavior(b).unwrap();
}

/// The reader, in its own process (run by [`a_reader_refused_by_ptrace_reads_through_the_descriptor`]
/// with [`CHILD_ENV`] set; a no-op otherwise): receives the writer's pid, the address of a plain
/// heap copy of the bytes and the memfd holding them; tries `process_vm_readv` on the copy, then
/// reads the memfd; answers one line with both outcomes.
#[test]
#[ignore = "a child process of a_reader_refused_by_ptrace_reads_through_the_descriptor"]
fn shared_memory_reader_child() {
    let Ok(path) = std::env::var(CHILD_ENV) else {
        return;
    };
    drop_cap_sys_ptrace();
    let sock = UnixStream::connect(path).unwrap();
    let mut head = [0u8; 12];
    let (n, fd) = recv_with_fd(&sock, &mut head).unwrap();
    assert_eq!(n, 12);
    let pid = u32::from_le_bytes(head[..4].try_into().unwrap());
    let addr = u64::from_le_bytes(head[4..].try_into().unwrap());
    let mut out = vec![0u8; LEN];
    let local = libc::iovec {
        iov_base: out.as_mut_ptr().cast(),
        iov_len: 4096,
    };
    let remote = libc::iovec {
        iov_base: addr as usize as *mut libc::c_void,
        iov_len: 4096,
    };
    // SAFETY: `local` is 4096 bytes of our own buffer; the remote range is only read by the
    // kernel from the writer.
    let rc = unsafe { libc::process_vm_readv(pid as libc::pid_t, &local, 1, &remote, 1, 0) };
    let pvr = if rc < 0 {
        format!(
            "errno{}",
            std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
        )
    } else {
        format!("read{rc}")
    };
    let mem = SharedMemory::from_fd(fd.expect("the writer's memfd")).unwrap();
    let t = Instant::now();
    mem.read_at(0, &mut out).unwrap();
    let secs = t.elapsed().as_secs_f64();
    let equal = out.iter().enumerate().all(|(i, &v)| v == pattern(i));
    writeln!(&sock, "pvr={pvr} shm_equal={equal} shm_s={secs}").unwrap();
}

#[test]
fn a_reader_refused_by_ptrace_reads_through_the_descriptor() {
    let dir = std::env::temp_dir().join(format!("weightsync-shm-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("sock");
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).unwrap();
    let mem = SharedMemory::create("weightsync-test-writer", LEN).unwrap();
    let heap: Vec<u8> = (0..LEN).map(pattern).collect();
    let _one = NON_DUMPABLE.lock();
    // SAFETY: the mapping is LEN bytes, exclusively ours; no reference into it exists.
    unsafe { std::ptr::copy_nonoverlapping(heap.as_ptr(), mem.as_ptr(), LEN) };
    // This process is the writer: non-dumpable, so a reader without CAP_SYS_PTRACE is refused
    // ptrace access to it (restored below; only this test binary is affected meanwhile).
    set_dumpable(false);
    let child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "fabric::shared_memory::tests::shared_memory_reader_child",
            "--include-ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, &path)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    listener.set_nonblocking(false).unwrap();
    let (sock, _) = listener.accept().unwrap();
    sock.set_read_timeout(Some(std::time::Duration::from_secs(60)))
        .unwrap();
    let mut head = [0u8; 12];
    head[..4].copy_from_slice(&std::process::id().to_le_bytes());
    head[4..].copy_from_slice(&(heap.as_ptr() as u64).to_le_bytes());
    send_with_fd(&sock, &head, mem.fd()).unwrap();
    let mut line = String::new();
    let read = (&sock).read_to_string(&mut line);
    let out = child.wait_with_output().unwrap();
    set_dumpable(true);
    let _ = std::fs::remove_dir_all(&dir);
    read.unwrap();
    assert!(
        out.status.success(),
        "reader child failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        line.contains(&format!("pvr=errno{}", libc::EPERM)),
        "process_vm_readv was not refused: {line}"
    );
    assert!(line.contains("shm_equal=true"), "{line}");
}
