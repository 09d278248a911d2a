//! Fuzzes the TCP fabric's wire decoders: write-frame headers (WRITE and PULL), completions and
//! handshake messages (hellos and the same-host pull offer). Decoding must never panic, and every accepted input must be canonical (encoding the
//! decoded value gives back the same bytes), so two peers can never disagree on a frame's meaning.
#![no_main]

use libfuzzer_sys::fuzz_target;
use weightsync_common::fabric::tcp::frame::{Completion, FrameHeader, COMPLETION_LEN, HEADER_LEN};
use weightsync_common::fabric::tcp::handshake::{
    ClientHello, ServerHello, CLIENT_HELLO_LEN, SERVER_HELLO_LEN,
};
use weightsync_common::fabric::tcp::same_host::{PullOffer, OFFER_LEN};

fuzz_target!(|data: &[u8]| {
    if let Some(b) = data.get(..HEADER_LEN) {
        let b: &[u8; HEADER_LEN] = b.try_into().expect("length checked");
        if let Ok(h) = FrameHeader::decode(b) {
            assert_eq!(&h.encode(), b, "header encoding is not canonical");
            assert!(h.addr.checked_add(h.len).is_some());
            if let Some(source) = h.source {
                assert!(source.checked_add(h.len).is_some());
                assert_eq!(h.wire_payload(), 0, "a PULL carries no payload");
            }
        }
    }
    if let Some(b) = data.get(..COMPLETION_LEN) {
        let b: &[u8; COMPLETION_LEN] = b.try_into().expect("length checked");
        if let Ok(c) = Completion::decode(b) {
            assert_eq!(&c.encode(), b, "completion encoding is not canonical");
        }
    }
    if let Some(b) = data.get(..CLIENT_HELLO_LEN) {
        let b: &[u8; CLIENT_HELLO_LEN] = b.try_into().expect("length checked");
        if let Ok(h) = ClientHello::decode(b) {
            assert_eq!(&h.encode(), b, "client hello encoding is not canonical");
        }
    }
    if let Some(b) = data.get(..OFFER_LEN) {
        let b: &[u8; OFFER_LEN] = b.try_into().expect("length checked");
        if let Ok(o) = PullOffer::decode(b) {
            assert_eq!(&o.encode(), b, "pull offer encoding is not canonical");
            assert!(!o.offered || (o.pid != 0 && o.probe != 0));
        }
    }
    if let Some(b) = data.get(..SERVER_HELLO_LEN) {
        let b: &[u8; SERVER_HELLO_LEN] = b.try_into().expect("length checked");
        if let Ok(h) = ServerHello::decode(b) {
            assert_eq!(&h.encode(), b, "server hello encoding is not canonical");
        }
    }
});
