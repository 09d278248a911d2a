//! Staging and source memory on a device: pinned round trips, source copies, IPC.

use rand::{Rng, SeedableRng};
use serde_json::json;

use super::{device, emit};
use crate::gpu::{BorrowedDevice, DeviceStaging, GpuError, GpuSource, IpcExport, IpcMapping};
use crate::gpu::{IPC_HANDLE_BYTES, PinnedStaging};

fn random_bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n).map(|_| rng.random()).collect()
}

#[test]
#[ignore = "needs a CUDA GPU (worker/gpu-check.sh)"]
fn pinned_staging_round_trips_ranges() {
    let dev = device();
    let n = 4 << 20;
    let a = random_bytes(n, 1);
    let b = random_bytes(n, 2);
    let mut pinned = PinnedStaging::new(&dev, n).unwrap();
    let mut staging = DeviceStaging::new(&dev, 2 * n).unwrap();
    pinned.as_mut_slice().unwrap().copy_from_slice(&a);
    // Two halves, swapped, into the second half of the staging.
    staging.h2d_async(&dev, &pinned, n / 2..n, n).unwrap();
    staging
        .h2d_async(&dev, &pinned, 0..n / 2, n + n / 2)
        .unwrap();
    // Rewriting the pinned buffer waits for the copies reading it.
    pinned.as_mut_slice().unwrap().copy_from_slice(&b);
    staging.h2d_async(&dev, &pinned, 0..n, 0).unwrap();
    let mut back = PinnedStaging::new(&dev, 2 * n).unwrap();
    staging.d2h_async(&dev, 0..2 * n, &mut back, 0).unwrap();
    let got = back.as_slice().unwrap();
    let mut want = b.clone();
    want.extend_from_slice(&a[n / 2..]);
    want.extend_from_slice(&a[..n / 2]);
    let ok = got == want.as_slice();
    let e = staging
        .h2d_async(&dev, &pinned, 0..n, 2 * n - 1)
        .unwrap_err();
    let oob = matches!(e, GpuError::OutOfBounds { .. });
    emit(
        json!({"check": "pinned_staging", "bytes": 2 * n, "round_trip_equal": ok,
                "out_of_bounds_refused": oob}),
    );
    assert!(ok && oob, "{e}");
}

#[test]
#[ignore = "needs a CUDA GPU (worker/gpu-check.sh)"]
fn owned_and_borrowed_sources_copy_ranges_into_staging() {
    let dev = device();
    let n = 1 << 20;
    let bytes = random_bytes(n, 3);
    let owned = GpuSource::Owned(dev.upload(&bytes).unwrap());
    // A plain cuMemAlloc allocation (not the stream-ordered pool), so its extent is exact.
    let mut lent = IpcExport::new(&dev, n).unwrap();
    lent.write(0, &bytes).unwrap();
    let ptr = lent.device_ptr();
    // SAFETY: `lent` stays allocated and unwritten until `borrowed` is dropped below.
    let borrowed = GpuSource::Borrowed(unsafe { BorrowedDevice::new(&dev, ptr, n) }.unwrap());
    let mut ok = true;
    for (name, src) in [("owned", &owned), ("borrowed", &borrowed)] {
        let mut staging = dev.alloc(n).unwrap();
        src.copy_to(&dev, 1000, 5000, &mut staging, 7).unwrap();
        src.copy_to(&dev, n - 100, 100, &mut staging, n - 100)
            .unwrap();
        let got = dev.download(&staging).unwrap();
        let this = got[7..5007] == bytes[1000..6000] && got[n - 100..] == bytes[n - 100..];
        let oob = matches!(
            src.copy_to(&dev, n - 10, 11, &mut staging, 0),
            Err(GpuError::OutOfBounds { .. })
        );
        emit(
            json!({"check": "source_copy", "source": name, "equal": this, "out_of_bounds_refused": oob}),
        );
        ok &= this && oob;
    }
    drop(borrowed);
    // A borrowed range well past its allocation (beyond any rounding to pages) is refused.
    // SAFETY: the call fails before anything is borrowed.
    let too_long = unsafe { BorrowedDevice::new(&dev, ptr, n + (4 << 20)) };
    assert!(matches!(too_long, Err(GpuError::OutOfBounds { .. })));
    assert!(ok);
}

const IPC_CHILD_ENV: &str = "WEIGHTSYNC_GPU_CHECK_IPC_CHILD";
const IPC_TEST: &str = "gpu::check::memory::ipc_source_maps_another_processes_memory";

fn to_hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn from_hex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap())
        .collect()
}

/// Two roles in one test: the parent exports device memory and re-runs this test binary as the
/// child (named by the environment variable), which maps it and copies a range out.
#[test]
#[ignore = "needs a CUDA GPU (worker/gpu-check.sh)"]
fn ipc_source_maps_another_processes_memory() {
    let dev = device();
    if let Ok(arg) = std::env::var(IPC_CHILD_ENV) {
        // Child: handle:offset:len:xxh3 of those bytes.
        let parts: Vec<&str> = arg.split(':').collect();
        let handle: [u8; IPC_HANDLE_BYTES] = from_hex(parts[0]).try_into().unwrap();
        let offset: usize = parts[1].parse().unwrap();
        let len: usize = parts[2].parse().unwrap();
        let want: u64 = u64::from_str_radix(parts[3], 16).unwrap();
        let short = IpcMapping::open(&dev, &handle, offset, usize::MAX / 2);
        assert!(
            matches!(short, Err(GpuError::OutOfBounds { .. })),
            "{short:?}"
        );
        let src = GpuSource::Ipc(IpcMapping::open(&dev, &handle, offset, len).unwrap());
        let mut staging = dev.alloc(len).unwrap();
        src.copy_to(&dev, 0, len, &mut staging, 0).unwrap();
        // Dropping the source right after queuing waits for the copy before unmapping.
        drop(src);
        let got = dev.download(&staging).unwrap();
        let hash = xxhash_rust::xxh3::xxh3_64(&got);
        println!("ipc-child: mapped {len} bytes at offset {offset}, xxh3 {hash:016x}");
        assert_eq!(hash, want);
        return;
    }
    let (total, offset, len) = (8 << 20, 4096 + 64, 6 << 20);
    let bytes = random_bytes(total, 9);
    let mut export = IpcExport::new(&dev, total).unwrap();
    export.write(0, &bytes).unwrap();
    let handle = export.handle().unwrap();
    let want = xxhash_rust::xxh3::xxh3_64(&bytes[offset..offset + len]);
    let child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            IPC_TEST,
            "--exact",
            "--include-ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(
            IPC_CHILD_ENV,
            format!("{}:{offset}:{len}:{want:016x}", to_hex(&handle)),
        )
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // A sandbox may hang cuIpcOpenMemHandle: the child gets its own short limit, so the step
    // fails here, named, instead of eating the whole step's time (device review N8).
    let (out, timed_out) = output_within(child, IPC_CHILD_TIMEOUT);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let ran = stdout.contains("ipc-child: mapped");
    emit(
        json!({"check": "ipc_source", "bytes": len, "offset": offset, "child_ok": out.status.success(),
                "child_ran": ran, "child_timed_out": timed_out,
                "child_timeout_s": IPC_CHILD_TIMEOUT.as_secs()}),
    );
    assert!(
        !timed_out,
        "the IPC child did not finish within {IPC_CHILD_TIMEOUT:?} (cuIpcOpenMemHandle hung?): \
         {stdout}"
    );
    assert!(
        out.status.success() && ran,
        "child failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The exporter's memory is unchanged by the import.
    assert_eq!(export.read(offset, 16).unwrap(), bytes[offset..offset + 16]);
}

/// How long the IPC child may take (it maps 6 MiB and copies it once: seconds at most).
const IPC_CHILD_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// The child's output once it exited, or, after `limit`, once it was killed (`true`). Its
/// output is a few lines, well under a pipe's buffer, so waiting before reading cannot block it.
fn output_within(
    mut child: std::process::Child,
    limit: std::time::Duration,
) -> (std::process::Output, bool) {
    let deadline = std::time::Instant::now() + limit;
    let mut timed_out = false;
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() >= deadline {
            let _ = child.kill();
            timed_out = true;
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    (child.wait_with_output().unwrap(), timed_out)
}
