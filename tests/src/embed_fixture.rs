//! What the in-process embed suites (`tests/tests/embed*.rs`) share: memory a test owns and
//! registers in place ([`Buffer`]), a controller of one job served on loopback on its own
//! runtime ([`serve_job`]), and the element values every trainer writes and every engine is
//! checked against ([`bf16_value`]).
//!
//! Why one module: each suite had its own copy of these (the buffer with its `unsafe` blocks,
//! the controller's start), and copies of code with `unsafe` in it drift apart.

use std::sync::Arc;
use std::time::Duration;

use weightsync_agent::embed::{DstTensorInfo, HostMemory};
use weightsync_common::DType;
use weightsync_common::protocol::WorldSpec;
use weightsync_controller::{AppState, ControllerConfig, SchedulesPlanner};

use crate::controller_harness::{API_TOKEN, JOB_TOKEN, ServedController};

/// One tensor's memory, owned here and registered in place: bytes `at..at + len` of a vector
/// that the registration keeps alive (it holds a clone of the `Arc`) for as long as it lives.
#[derive(Debug)]
pub struct Buffer {
    bytes: Arc<Vec<u8>>,
    at: usize,
    len: usize,
}

impl Buffer {
    /// `len` zero bytes of a vector of their own.
    pub fn zeroed(len: usize) -> Buffer {
        Buffer {
            bytes: Arc::new(vec![0u8; len]),
            at: 0,
            len,
        }
    }

    /// Zeroed memory of its own for every tensor of an engine's planned layout (what an
    /// engine registers before its first version), paired with the layout's entry.
    pub fn zeroed_layout(layout: Vec<DstTensorInfo>) -> Vec<(DstTensorInfo, Buffer)> {
        layout
            .into_iter()
            .map(|t| {
                let len = t.shape.iter().product::<u64>() as usize * t.dtype.size();
                (t, Buffer::zeroed(len))
            })
            .collect()
    }

    /// Tensors of `lens` bytes back to back in one allocation, the last first (so where each
    /// lies differs from the planned layout's order).
    pub fn carved(lens: &[usize]) -> Vec<Buffer> {
        let bytes = Arc::new(vec![0u8; lens.iter().sum()]);
        let mut at = lens.iter().sum::<usize>();
        lens.iter()
            .map(|&len| {
                at -= len;
                Buffer {
                    bytes: bytes.clone(),
                    at,
                    len,
                }
            })
            .collect()
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn ptr(&self) -> *mut u8 {
        self.bytes[self.at..].as_ptr() as *mut u8
    }

    /// The memory to register.
    pub fn memory(&self) -> HostMemory {
        // SAFETY: heap memory inside the vector that never moves; the registration keeps a
        // clone of the Arc, so it outlives every read and write; the test writes it (`fill`)
        // only between syncs and reads it (`read`) only after a commit.
        unsafe { HostMemory::from_raw(self.ptr(), self.len, Box::new(self.bytes.clone())) }
    }

    /// The owner rewriting its tensor between syncs (as an optimizer step does).
    pub fn fill(&self, data: &[u8]) {
        assert_eq!(data.len(), self.len, "fill with the buffer's length");
        // SAFETY: the range lies in the vector; no sync runs (the test fills before it pushes),
        // so nothing reads these bytes meanwhile.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr(), data.len()) };
    }

    /// A copy of what landed.
    pub fn read(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.len];
        // SAFETY: read after the version committed: no write to these bytes is in flight.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr(), out.as_mut_ptr(), out.len()) };
        out
    }
}

/// A controller of the job `config` (a `config.json`'s text, written into `dir`), `train`,
/// `infer` and `dtype`, served on loopback on its own runtime (keep the runtime alive as long
/// as the controller), with the harness's tokens, a 3 s heartbeat and a 30 s sync timeout.
pub fn serve_job(
    dir: &tempfile::TempDir,
    config: &str,
    train: &str,
    infer: &str,
    dtype: DType,
) -> (tokio::runtime::Runtime, ServedController) {
    let path = dir.path().join("config.json");
    std::fs::write(&path, config).expect("writing config.json");
    let world = WorldSpec {
        model: path.to_string_lossy().into_owned(),
        train: train.into(),
        infer: infer.into(),
        dtype,
        verify: true,
    };
    let cfg = ControllerConfig::for_job(
        world,
        JOB_TOKEN.into(),
        API_TOKEN.into(),
        Duration::from_secs(3),
        Duration::from_secs(30),
        64,
    )
    .expect("a valid job");
    let rt = tokio::runtime::Runtime::new().expect("a tokio runtime");
    let ctl = rt.block_on(ServedController::start(AppState::new(
        cfg,
        Box::new(SchedulesPlanner),
    )));
    (rt, ctl)
}

/// The value of element `flat` of tensor `name` at `version`: a bf16 bit pattern, small and
/// finite (so an f32 holding it converts to bf16 exactly), different for every tensor, element
/// and version.
pub fn bf16_value(name: &str, flat: u64, version: u64) -> u16 {
    let h = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    });
    let x = h ^ flat.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ version.wrapping_mul(0x85eb_ca6b);
    (x >> 17) as u16 & 0x3fff
}
