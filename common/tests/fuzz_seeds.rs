//! The committed `control_message` fuzz seeds are frames of the current protocol: a version bump
//! that forgets to rewrite them would leave the fuzzer starting from frames refused at the header.

use weightsync_common::protocol::{decode_frame, FromWorker, ToWorker, DEFAULT_MAX_FRAME};

#[test]
fn control_message_seeds_decode_at_the_current_version() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/fuzz/corpus/control_message");
    let mut checked = 0;
    for entry in std::fs::read_dir(dir).expect("seed directory") {
        let path = entry.expect("seed entry").path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let bytes = std::fs::read(&path).expect("seed readable");
        // Single-frame seeds are named after the direction; the stream seed holds several.
        if name.starts_with("from-") && name != "from-stream.bin" {
            decode_frame::<FromWorker>(&bytes, DEFAULT_MAX_FRAME)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            checked += 1;
        } else if name.starts_with("to-") {
            decode_frame::<ToWorker>(&bytes, DEFAULT_MAX_FRAME)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            checked += 1;
        }
    }
    assert!(checked >= 10, "only {checked} seeds found in {dir}");
}
