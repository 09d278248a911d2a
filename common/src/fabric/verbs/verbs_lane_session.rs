//! The life of a lane's bootstrap connection after the queue pairs are connected.
//!
//! Receiving side ([`serve_receiver_lane`]): report re-posted receives to the writer (its receive
//! credits, `verbs_credits`), and when the writer sends a teardown (it reset its lanes) or goes
//! away, *fence* the queue pair (move it to the error state, so nothing in flight lands any
//! more) before answering or dropping it. Without the fence, a reset writer's packets still on
//! the wire (a PFC pause, a deep switch buffer) could land at a responder that stays in RTS until
//! it notices the closed connection, and overwrite the next sync's bytes.
//!
//! Writing side ([`read_writer_lane`]): apply credit reports to the lane, and end on the peer's
//! teardown answer or when the connection closes (then the peer's queue pair is gone, and the
//! lane is marked broken at once instead of after the transport retries).

use tokio::io::{AsyncRead, AsyncWrite};

use super::verbs_bootstrap::{LaneMsg, recv_frame, send_frame};
use super::verbs_credits::ReceiveCredits;

/// How a receiving lane's session ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionEnd {
    /// The writer asked for a teardown; the queue pair was fenced and the writer told so.
    TornDown,
    /// The writer closed the connection (or it failed); the queue pair was fenced.
    WriterGone,
    /// This fabric is shutting down.
    Shutdown,
}

/// Serves one receiving lane until it ends; `fence` moves its queue pair to the error state and
/// runs before the writer hears back (or at once when the writer is gone).
pub async fn serve_receiver_lane<S>(
    stream: S,
    credits: &ReceiveCredits,
    mut closed: tokio::sync::watch::Receiver<()>,
    fence: impl FnOnce(),
) -> SessionEnd
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let (mut rd, mut wr) = tokio::io::split(stream);
    // The writer only ever sends a teardown; one read covers the whole session, and keeping the
    // same future across iterations never cancels a half-read frame.
    let incoming = recv_frame::<_, LaneMsg>(&mut rd);
    tokio::pin!(incoming);
    let mut reported = 0;
    loop {
        tokio::select! {
            msg = &mut incoming => {
                fence();
                return match msg {
                    Ok(LaneMsg::Teardown) => {
                        let _ = send_frame(&mut wr, &LaneMsg::TornDown).await;
                        SessionEnd::TornDown
                    }
                    Ok(other) => {
                        tracing::warn!(?other, "unexpected lane message from a writer");
                        SessionEnd::WriterGone
                    }
                    Err(_) => SessionEnd::WriterGone,
                };
            }
            _ = credits.changed() => {
                let total = credits.total();
                if total != reported {
                    reported = total;
                    if send_frame(&mut wr, &LaneMsg::Credit { reposted: total }).await.is_err() {
                        fence();
                        return SessionEnd::WriterGone;
                    }
                }
            }
            _ = closed.changed() => {
                fence();
                return SessionEnd::Shutdown;
            }
        }
    }
}

/// How a writing lane's reader ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReaderEnd {
    /// The peer confirmed the teardown.
    TornDown,
    /// The connection closed or failed: the peer's queue pair is gone.
    Closed,
}

/// Reads what the peer sends on a writing lane's bootstrap connection: credit reports go to
/// `on_credit` (receives re-posted in total) until the peer confirms a teardown or the
/// connection ends.
pub async fn read_writer_lane<R>(mut rd: R, mut on_credit: impl FnMut(u64)) -> ReaderEnd
where
    R: AsyncRead + Unpin,
{
    loop {
        match recv_frame::<_, LaneMsg>(&mut rd).await {
            Ok(LaneMsg::Credit { reposted }) => on_credit(reposted),
            Ok(LaneMsg::TornDown) => return ReaderEnd::TornDown,
            Ok(LaneMsg::Teardown) | Err(_) => return ReaderEnd::Closed,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    /// V9: a writer that resets sends a teardown; the receiver fences its queue pair *before*
    /// the writer hears back, so when the writer's reset resolves nothing can land any more.
    #[tokio::test]
    async fn a_teardown_is_answered_only_after_the_fence() {
        let (writer_end, receiver_end) = tokio::io::duplex(4096);
        let credits = Arc::new(ReceiveCredits::default());
        let fenced = Arc::new(AtomicBool::new(false));
        let (_keep, closed) = tokio::sync::watch::channel(());
        let receiver = {
            let credits = credits.clone();
            let fenced = fenced.clone();
            tokio::spawn(async move {
                serve_receiver_lane(receiver_end, &credits, closed, || {
                    fenced.store(true, Ordering::SeqCst)
                })
                .await
            })
        };
        let (rd, mut wr) = tokio::io::split(writer_end);
        send_frame(&mut wr, &LaneMsg::Teardown).await.unwrap();
        let fenced_at_answer = fenced.clone();
        let end = tokio::time::timeout(Duration::from_secs(10), read_writer_lane(rd, |_| {}))
            .await
            .expect("the receiver never answered the teardown");
        assert_eq!(end, ReaderEnd::TornDown);
        assert!(
            fenced_at_answer.load(Ordering::SeqCst),
            "the writer heard back before the queue pair was fenced"
        );
        assert_eq!(receiver.await.unwrap(), SessionEnd::TornDown);
    }

    /// V4: re-posted receives reach the writer as credit reports (running totals).
    #[tokio::test]
    async fn reposted_receives_reach_the_writer_as_credits() {
        let (writer_end, receiver_end) = tokio::io::duplex(4096);
        let credits = Arc::new(ReceiveCredits::default());
        let (_keep, closed) = tokio::sync::watch::channel(());
        let fenced = Arc::new(AtomicBool::new(false));
        let receiver = {
            let credits = credits.clone();
            let fenced = fenced.clone();
            tokio::spawn(async move {
                serve_receiver_lane(receiver_end, &credits, closed, || {
                    fenced.store(true, Ordering::SeqCst)
                })
                .await
            })
        };
        let (mut rd, wr) = tokio::io::split(writer_end);
        credits.reposted(5);
        let first: LaneMsg = recv_frame(&mut rd).await.unwrap();
        assert_eq!(first, LaneMsg::Credit { reposted: 5 });
        credits.reposted(3);
        credits.reposted(2);
        // Reports may coalesce, but the last one carries the running total.
        let mut last = 0;
        while last < 10 {
            match recv_frame::<_, LaneMsg>(&mut rd).await.unwrap() {
                LaneMsg::Credit { reposted } => last = reposted,
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(last, 10);
        // The writer goes away: the receiver fences its queue pair.
        drop(wr);
        drop(rd);
        assert_eq!(receiver.await.unwrap(), SessionEnd::WriterGone);
        assert!(fenced.load(Ordering::SeqCst));
    }
}
