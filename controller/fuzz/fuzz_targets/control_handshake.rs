//! The controller's side of a worker's control-channel handshake, fed any bytes as the worker's.
//!
//! The controller's challenge is random and the input cannot know it, so no input may ever get a
//! registration: each must end in a refusal (never a panic, a hang or an allocation beyond the
//! pre-authentication frame limit). Seeds (`corpus/control_handshake`, rewritten by the
//! `control_handshake_seeds` test in `tests/tests/control_security.rs`) are well-formed Hellos
//! of both roles with registrations, the other role's registration, huge announcements, a
//! Register before any Hello and truncated frames.
#![no_main]

use std::sync::OnceLock;
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use weightsync_common::protocol::WorldSpec;
use weightsync_common::DType;
use weightsync_controller::control_channel::worker_handshake;
use weightsync_controller::coordinator::CoordinatorConfig;
use weightsync_controller::ControllerConfig;

fn setup() -> &'static (tokio::runtime::Runtime, ControllerConfig) {
    static S: OnceLock<(tokio::runtime::Runtime, ControllerConfig)> = OnceLock::new();
    S.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a tokio runtime");
        let coordinator = CoordinatorConfig {
            world: WorldSpec {
                model: "qwen3-0.6b".into(),
                train: "fsdp=2".into(),
                infer: "tp=1".into(),
                dtype: DType::BF16,
                verify: true,
            },
            trainers: 2,
            rollouts: 1,
            heartbeat_interval: Duration::from_millis(500),
            heartbeat_timeout: Duration::from_secs(5),
            sync_timeout: Duration::from_secs(5),
            failure_grace: Duration::ZERO,
            history: 16,
        };
        let cfg = ControllerConfig::new(
            coordinator,
            "fuzz-job-token-0123456789".into(),
            "fuzz-api-token-0123456789".into(),
        );
        (rt, cfg)
    })
}

fuzz_target!(|data: &[u8]| {
    let (rt, cfg) = setup();
    let mut rd = data;
    let mut wr = tokio::io::sink();
    let got = rt.block_on(worker_handshake(&mut rd, &mut wr, cfg));
    assert!(got.is_err(), "bytes that cannot know the challenge registered: {got:?}");
});
