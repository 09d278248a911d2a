//! A sync's timeline as a Chrome trace (the JSON Perfetto and chrome://tracing open): one thread
//! per worker, one complete event (`ph: "X"`) per span, times in microseconds since the sync was
//! triggered. An engine's own stages (pause, load, resume) are spans on its thread like the
//! others; they may lie after the sync's end mark (a staged engine loads once it committed).

use serde_json::{Value, json};

use crate::sync_record::SyncRecord;

/// Builds the trace document.
pub fn chrome_trace(s: &SyncRecord) -> Value {
    let mut events = vec![json!({
        "name": "process_name", "ph": "M", "pid": 1,
        "args": {"name": format!("sync {} (version {})", s.id, s.version)},
    })];
    for (tid, (worker, lane)) in s.lanes.iter().enumerate() {
        let tid = tid + 1;
        events.push(json!({
            "name": "thread_name", "ph": "M", "pid": 1, "tid": tid,
            "args": {"name": format!("{worker}{}", if lane.critical { " (critical)" } else { "" })},
        }));
        for span in &lane.spans {
            let dur_ns = span.end_ns.saturating_sub(span.start_ns);
            let gbps = (dur_ns > 0 && span.bytes > 0).then(|| span.bytes as f64 / dur_ns as f64);
            events.push(json!({
                "name": span.stage.name(),
                "cat": span.stage.name(),
                "ph": "X",
                "pid": 1,
                "tid": tid,
                "ts": span.start_ns as f64 / 1e3,
                "dur": dur_ns as f64 / 1e3,
                "args": {"task": span.task, "bytes": span.bytes, "gbps": gbps, "critical": lane.critical},
            }));
        }
    }
    if let Some(end) = s.ended_ns {
        events.push(json!({
            "name": format!("{:?}", s.state).to_lowercase(), "ph": "i", "s": "g", "pid": 1, "tid": 0,
            "ts": end as f64 / 1e3,
        }));
    }
    json!({
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "sync_id": s.id, "version": s.version, "bytes": s.bytes_written(), "gbps": s.gbps(),
            "failure": s.failure.as_ref().map(ToString::to_string),
            "failure_kind": s.failure.as_ref().map(|f| f.kind),
        },
    })
}
