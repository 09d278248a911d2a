//! Control-channel messages as the controller and the worker agents read them off a socket:
//! whole frames in both directions, under the default and a small maximum, and a stream of
//! frames through `read_frame`. Decoding must never panic or allocate past the announced (and
//! capped) length, and a message that decodes must re-encode to a frame that decodes to itself.
#![no_main]

use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use libfuzzer_sys::fuzz_target;
use weightsync_common::protocol::{
    decode_body, decode_frame, encode_frame, read_frame, FromWorker, ToWorker, DEFAULT_MAX_FRAME,
};

/// Polls a future whose I/O is an in-memory slice (always ready) to completion.
fn ready<F: Future>(f: F) -> F::Output {
    let mut f = pin!(f);
    let mut cx = Context::from_waker(Waker::noop());
    loop {
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
    }
}

/// Re-encodes a decoded message and checks it decodes to itself.
macro_rules! round_trip {
    ($msg:expr, $ty:ty) => {{
        let bytes = encode_frame($msg, DEFAULT_MAX_FRAME).expect("a decoded message re-encodes");
        let again: $ty =
            decode_frame(&bytes, DEFAULT_MAX_FRAME).expect("a re-encoded message decodes");
        assert_eq!(&again, $msg, "round trip changed the message");
    }};
}

fuzz_target!(|data: &[u8]| {
    for max in [DEFAULT_MAX_FRAME, 4096] {
        if let Ok(m) = decode_frame::<FromWorker>(data, max) {
            round_trip!(&m, FromWorker);
        }
        if let Ok(m) = decode_frame::<ToWorker>(data, max) {
            round_trip!(&m, ToWorker);
        }
    }
    let _ = decode_body::<FromWorker>(data);
    let _ = decode_body::<ToWorker>(data);
    // A stream: read frames until the end, an error, or a bound on the count.
    let mut stream = data;
    for _ in 0..64 {
        match ready(read_frame::<_, FromWorker>(&mut stream, 1 << 16)) {
            Ok(Some(_)) => {}
            Ok(None) | Err(_) => break,
        }
    }
});
