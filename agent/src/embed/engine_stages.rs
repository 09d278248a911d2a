//! An engine's own stages of a version (pause, load, resume), checked and put on the time base
//! of the version's sync before they go to the controller (`EngineStages`).
//!
//! The engine stamps its spans with [`super::EngineHandle::now_ns`], a clock that starts when
//! the handle connects and never jumps, rather than with the sync's own zero (the instant this
//! worker received `Prepare`): an engine may measure a version's load while the next version's
//! `Prepare` already arrived, and a clock whose zero moved under it would place the spans in the
//! wrong sync. Here each span is shifted to the zero of the sync of the version it names, which
//! is what every other span of that sync is relative to. A pause that began before `Prepare`
//! (an engine that holds its requests ahead of a sync) starts, on the timeline, at the sync's
//! zero: nothing is drawn before a sync exists.
//!
//! The checks are the controller's own (it refuses the same things, since it cannot trust a
//! worker), made here first so the caller learns at once what was wrong.

use weightsync_common::protocol::{MAX_ENGINE_STAGE_EVENTS, Stage, TimelineEvent, WHOLE_SYNC};

use super::EmbedError;

/// `spans` (`(stage, start_ns, end_ns)` on the engine's clock) of `version`, whose sync's zero
/// is `zero_ns` on that clock, checked and shifted to the sync's zero; `now_ns` is the engine's
/// clock now.
pub(crate) fn sync_events(
    worker: &str,
    version: u64,
    zero_ns: u64,
    now_ns: u64,
    spans: &[(Stage, u64, u64)],
) -> Result<Vec<TimelineEvent>, EmbedError> {
    let refuse = |reason: String| EmbedError::InvalidStageReport {
        worker: worker.to_string(),
        version,
        reason,
    };
    if spans.len() > MAX_ENGINE_STAGE_EVENTS {
        return Err(refuse(format!(
            "{} spans, more than {MAX_ENGINE_STAGE_EVENTS}",
            spans.len()
        )));
    }
    spans
        .iter()
        .enumerate()
        .map(|(i, &(stage, start_ns, end_ns))| {
            let span = format!("span {i} ({stage} {start_ns}..{end_ns} ns)");
            if !stage.is_engine() {
                return Err(refuse(format!(
                    "{span}: {stage} is not a stage an engine reports (pause, load or resume)"
                )));
            }
            if end_ns < start_ns {
                return Err(refuse(format!("{span} ends before it starts")));
            }
            if end_ns > now_ns {
                return Err(refuse(format!(
                    "{span} ends in the future (now_ns() is {now_ns})"
                )));
            }
            if end_ns < zero_ns {
                return Err(refuse(format!(
                    "{span} ended before this engine was told to prepare version {version} \
                     (at {zero_ns} ns)"
                )));
            }
            Ok(TimelineEvent {
                task: WHOLE_SYNC,
                piece: 0,
                stage,
                start_ns: start_ns.saturating_sub(zero_ns),
                end_ns: end_ns - zero_ns,
                bytes: 0,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn events(spans: &[(Stage, u64, u64)]) -> Result<Vec<TimelineEvent>, EmbedError> {
        sync_events("rollout-1", 7, 1_000, 50_000, spans)
    }

    fn reason(spans: &[(Stage, u64, u64)]) -> String {
        match events(spans) {
            Err(e @ EmbedError::InvalidStageReport { .. }) => e.to_string(),
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn spans_move_to_the_syncs_zero() {
        let got = events(&[
            (Stage::Pause, 500, 9_000),
            (Stage::Load, 2_000, 8_000),
            (Stage::Resume, 8_000, 9_000),
        ])
        .unwrap();
        let got: Vec<_> = got
            .iter()
            .map(|e| (e.stage, e.task, e.start_ns, e.end_ns))
            .collect();
        assert_eq!(
            got,
            [
                // Began before Prepare: drawn from the sync's zero.
                (Stage::Pause, WHOLE_SYNC, 0, 8_000),
                (Stage::Load, WHOLE_SYNC, 1_000, 7_000),
                (Stage::Resume, WHOLE_SYNC, 7_000, 8_000),
            ]
        );
        assert!(events(&[]).unwrap().is_empty());
    }

    #[test]
    fn bad_spans_are_refused_naming_the_span_and_why() {
        let r = reason(&[(Stage::Pause, 2_000, 3_000), (Stage::Load, 5_000, 4_000)]);
        assert!(r.starts_with("rollout-1: "), "{r}");
        assert!(r.contains("version 7"), "{r}");
        assert!(
            r.contains("span 1 (load 5000..4000 ns) ends before it starts"),
            "{r}"
        );
        let r = reason(&[(Stage::Land, 2_000, 3_000)]);
        assert!(r.contains("land is not a stage an engine reports"), "{r}");
        let r = reason(&[(Stage::Resume, 2_000, 60_000)]);
        assert!(r.contains("ends in the future (now_ns() is 50000)"), "{r}");
        let r = reason(&[(Stage::Pause, 100, 900)]);
        assert!(
            r.contains("ended before this engine was told to prepare"),
            "{r}"
        );
        let many = vec![(Stage::Pause, 2_000, 3_000); MAX_ENGINE_STAGE_EVENTS + 1];
        let r = reason(&many);
        let want = format!(
            "{} spans, more than {MAX_ENGINE_STAGE_EVENTS}",
            MAX_ENGINE_STAGE_EVENTS + 1
        );
        assert!(r.contains(&want), "{r}");
    }
}
