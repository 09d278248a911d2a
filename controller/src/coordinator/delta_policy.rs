//! Whether a sync offers deltas: the job's choice (`auto`, `on`, `off`) and, under `auto`, what
//! the syncs so far measured.
//!
//! Whether deltas pay depends on the wire, not on the code: on loopback a delta sync's memory
//! passes (staging, comparing, applying) cost more than the bytes it saves, between hosts on a
//! slow link it is several times faster. So `auto` (the default) decides from measurements,
//! per sync:
//! - a sync where no engine can take a delta (nothing committed yet, every engine restarted or
//!   took part in a failed sync) is full, and so is the first eligible sync of a plan while no
//!   full sync of that plan was measured;
//! - the next eligible sync *probes*: it offers deltas;
//! - deltas stay on while the last delta sync was faster than the last full sync;
//! - once one is not, syncs go full, and every [`REPROBE_EVERY`]-th full sync after that the
//!   next one probes again, so the job notices when changes thin out or a link gets slower.
//!
//! The time compared is a sync's `Start` to its commit: everything a delta changes happens in
//! it (trainers staging, comparing and encoding, the wire, the engines applying and verifying),
//! while what comes before (`Prepare`: engines pausing, trainers refreshing their sources,
//! waiting behind a drain) is the same for both kinds and can be long and noisy (an engine
//! waiting for its requests to finish), which would drown the difference. Only a sync that
//! went one way for every engine counts: one with deltas to some engines and full writes to
//! others (an engine restarted) measures neither. Measurements belong to the plan they were
//! taken under; a new plan (other routes) starts measuring again.
//!
//! This is a pure state machine inside the coordinator: it is told what each committed sync
//! measured ([`DeltaPolicy::measured`]) and asked before each `Start` ([`DeltaPolicy::decide`]).

use std::fmt;
use std::str::FromStr;

/// Under `auto`, after a delta sync lost to a full one, this many full syncs run before the
/// next probe.
pub const REPROBE_EVERY: u32 = 16;

/// The job's choice of delta syncs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeltaMode {
    /// Deltas where measurements say they pay (see the module docs).
    #[default]
    Auto,
    /// Deltas to every engine that can take them.
    On,
    /// Every sync full; trainers keep no bases and engines register no inbox.
    Off,
}

impl DeltaMode {
    /// Whether trainers keep bases and engines register inboxes (`auto` and `on`).
    pub fn keeps_bases(self) -> bool {
        self != DeltaMode::Off
    }
}

impl fmt::Display for DeltaMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DeltaMode::Auto => "auto",
            DeltaMode::On => "on",
            DeltaMode::Off => "off",
        })
    }
}

/// A delta mode that is none of `auto`, `on`, `off`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("delta must be auto, on or off (or true / false), got {0:?}")]
pub struct BadDeltaMode(pub String);

impl FromStr for DeltaMode {
    type Err = BadDeltaMode;

    /// `auto`, `on`, `off`; `true` and `false` too (what `--delta` took before it had modes).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(DeltaMode::Auto),
            "on" | "true" => Ok(DeltaMode::On),
            "off" | "false" => Ok(DeltaMode::Off),
            _ => Err(BadDeltaMode(s.into())),
        }
    }
}

/// What a decision was, in a word (the `/metrics` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecisionKind {
    /// `off`: full.
    Off,
    /// `on`: deltas where engines can take them.
    On,
    /// `auto`, no engine can take a delta: full.
    Unavailable,
    /// `auto`, no full sync of this plan measured yet: full.
    Measure,
    /// `auto`, no delta sync of this plan measured yet (or a re-probe): deltas.
    Probe,
    /// `auto`, the last delta sync beat the last full one: deltas.
    DeltaPays,
    /// `auto`, the last delta sync did not: full.
    FullPays,
}

impl DecisionKind {
    /// The label, e.g. `delta_pays`.
    pub fn label(self) -> &'static str {
        match self {
            DecisionKind::Off => "off",
            DecisionKind::On => "on",
            DecisionKind::Unavailable => "unavailable",
            DecisionKind::Measure => "measure",
            DecisionKind::Probe => "probe",
            DecisionKind::DeltaPays => "delta_pays",
            DecisionKind::FullPays => "full_pays",
        }
    }
}

/// Whether a sync offers deltas, and why.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// Offer deltas to the engines that can take them.
    pub deltas: bool,
    /// In a word.
    pub kind: DecisionKind,
    /// Why, for the sync's JSON, e.g. `auto: delta pays (120.0 ms vs full 480.0 ms)`.
    pub reason: String,
}

/// How a committed sync went, as far as the policy cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncKind {
    /// No engine was offered deltas.
    Full,
    /// Every engine was.
    Delta,
    /// Some were (measures nothing).
    Mixed,
}

/// The policy's state: the job's mode and, under `auto`, the last measurements.
#[derive(Debug, Clone, Default)]
pub struct DeltaPolicy {
    mode: DeltaMode,
    /// The plan the measurements were taken under.
    plan_id: u64,
    /// `Start` to commit of the last full sync, ns.
    last_full_ns: Option<u64>,
    /// `Start` to commit of the last delta sync, ns.
    last_delta_ns: Option<u64>,
    /// Full syncs measured since the last delta sync (which lost).
    fulls_since_delta: u32,
}

fn ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

impl DeltaPolicy {
    /// A policy in `mode`, with nothing measured.
    pub fn new(mode: DeltaMode) -> Self {
        DeltaPolicy {
            mode,
            ..DeltaPolicy::default()
        }
    }

    /// The job's mode.
    pub fn mode(&self) -> DeltaMode {
        self.mode
    }

    /// Decides for the next sync, under plan `plan_id`; `unavailable` says why no engine can
    /// take a delta (then the sync is full, whatever the mode).
    pub fn decide(&self, plan_id: u64, unavailable: Option<&str>) -> Decision {
        let d = |deltas, kind, reason: String| Decision {
            deltas,
            kind,
            reason,
        };
        match self.mode {
            DeltaMode::Off => return d(false, DecisionKind::Off, "off".into()),
            DeltaMode::On => {
                let reason = match unavailable {
                    Some(why) => format!("on: full ({why})"),
                    None => "on".into(),
                };
                return d(unavailable.is_none(), DecisionKind::On, reason);
            }
            DeltaMode::Auto => {}
        }
        if let Some(why) = unavailable {
            return d(
                false,
                DecisionKind::Unavailable,
                format!("auto: full ({why})"),
            );
        }
        let (full, delta) = if plan_id == self.plan_id {
            (self.last_full_ns, self.last_delta_ns)
        } else {
            (None, None)
        };
        let Some(full) = full else {
            return d(
                false,
                DecisionKind::Measure,
                "auto: full (measuring a full sync first)".into(),
            );
        };
        let Some(delta) = delta else {
            return d(
                true,
                DecisionKind::Probe,
                format!("auto: probe (full {:.1} ms)", ms(full)),
            );
        };
        if delta < full {
            return d(
                true,
                DecisionKind::DeltaPays,
                format!(
                    "auto: delta pays ({:.1} ms vs full {:.1} ms)",
                    ms(delta),
                    ms(full)
                ),
            );
        }
        if self.fulls_since_delta >= REPROBE_EVERY {
            return d(
                true,
                DecisionKind::Probe,
                format!(
                    "auto: probe again after {} full syncs (delta {:.1} ms vs full {:.1} ms)",
                    self.fulls_since_delta,
                    ms(delta),
                    ms(full)
                ),
            );
        }
        d(
            false,
            DecisionKind::FullPays,
            format!(
                "auto: full pays (delta {:.1} ms vs full {:.1} ms; probe again in {} syncs)",
                ms(delta),
                ms(full),
                REPROBE_EVERY - self.fulls_since_delta
            ),
        )
    }

    /// A sync of `kind` under plan `plan_id` committed, `Start` to commit in `ns`.
    pub fn measured(&mut self, plan_id: u64, kind: SyncKind, ns: u64) {
        if plan_id != self.plan_id {
            *self = DeltaPolicy {
                plan_id,
                ..DeltaPolicy::new(self.mode)
            };
        }
        match kind {
            SyncKind::Full => {
                self.last_full_ns = Some(ns);
                if self.last_delta_ns.is_some() {
                    self.fulls_since_delta = self.fulls_since_delta.saturating_add(1);
                }
            }
            SyncKind::Delta => {
                self.last_delta_ns = Some(ns);
                self.fulls_since_delta = 0;
            }
            SyncKind::Mixed => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;
    const PLAN: u64 = 1;

    fn auto() -> DeltaPolicy {
        DeltaPolicy::new(DeltaMode::Auto)
    }

    #[test]
    fn modes_parse_by_name_and_refuse_anything_else_by_name() {
        assert_eq!("auto".parse(), Ok(DeltaMode::Auto));
        assert_eq!("ON".parse(), Ok(DeltaMode::On));
        assert_eq!("true".parse(), Ok(DeltaMode::On));
        assert_eq!("off".parse(), Ok(DeltaMode::Off));
        assert_eq!("false".parse(), Ok(DeltaMode::Off));
        let e = "sometimes".parse::<DeltaMode>().unwrap_err();
        assert!(e.to_string().contains("\"sometimes\""), "{e}");
        assert!(e.to_string().contains("auto, on or off"), "{e}");
        assert_eq!(DeltaMode::default(), DeltaMode::Auto);
        for m in [DeltaMode::Auto, DeltaMode::On, DeltaMode::Off] {
            assert_eq!(m.to_string().parse(), Ok(m));
        }
        assert!(!DeltaMode::Off.keeps_bases() && DeltaMode::Auto.keeps_bases());
    }

    #[test]
    fn off_is_always_full_and_on_always_offers_where_it_can() {
        let mut off = DeltaPolicy::new(DeltaMode::Off);
        let mut on = DeltaPolicy::new(DeltaMode::On);
        for p in [&mut off, &mut on] {
            p.measured(PLAN, SyncKind::Full, 100 * MS);
            p.measured(PLAN, SyncKind::Delta, 900 * MS);
        }
        let d = off.decide(PLAN, None);
        assert!(!d.deltas);
        assert_eq!(d.reason, "off");
        // `on` keeps offering though the delta sync was slower.
        let d = on.decide(PLAN, None);
        assert!(d.deltas);
        assert_eq!(d.reason, "on");
        let d = on.decide(PLAN, Some("no engine holds the last committed version"));
        assert!(!d.deltas);
        assert_eq!(
            d.reason,
            "on: full (no engine holds the last committed version)"
        );
    }

    #[test]
    fn auto_measures_a_full_sync_then_probes() {
        let mut p = auto();
        // The first sync: nothing committed, no engine can take a delta.
        let d = p.decide(PLAN, Some("nothing committed in this run"));
        assert!(!d.deltas);
        assert_eq!(d.kind, DecisionKind::Unavailable);
        assert_eq!(d.reason, "auto: full (nothing committed in this run)");
        // Eligible, but no full sync measured under this plan (e.g. the first ended mixed).
        p.measured(PLAN, SyncKind::Mixed, 5 * MS);
        assert_eq!(p.decide(PLAN, None).kind, DecisionKind::Measure);
        assert!(!p.decide(PLAN, None).deltas);
        p.measured(PLAN, SyncKind::Full, 200 * MS);
        let d = p.decide(PLAN, None);
        assert!(d.deltas);
        assert_eq!(d.kind, DecisionKind::Probe);
        assert_eq!(d.reason, "auto: probe (full 200.0 ms)");
    }

    #[test]
    fn auto_keeps_deltas_while_they_beat_the_last_full_sync() {
        let mut p = auto();
        p.measured(PLAN, SyncKind::Full, 200 * MS);
        for t in [50, 120, 199] {
            p.measured(PLAN, SyncKind::Delta, t * MS);
            let d = p.decide(PLAN, None);
            assert!(d.deltas, "{t} ms: {d:?}");
            assert_eq!(d.kind, DecisionKind::DeltaPays);
            assert_eq!(
                d.reason,
                format!("auto: delta pays ({t}.0 ms vs full 200.0 ms)")
            );
        }
        // A delta sync as slow as the full one does not pay.
        p.measured(PLAN, SyncKind::Delta, 200 * MS);
        let d = p.decide(PLAN, None);
        assert!(!d.deltas);
        assert_eq!(d.kind, DecisionKind::FullPays);
    }

    #[test]
    fn auto_falls_back_to_full_and_probes_again_after_reprobe_every_full_syncs() {
        let mut p = auto();
        p.measured(PLAN, SyncKind::Full, 100 * MS);
        p.measured(PLAN, SyncKind::Delta, 150 * MS);
        for n in 0..REPROBE_EVERY {
            let d = p.decide(PLAN, None);
            assert!(!d.deltas, "after {n} full syncs: {d:?}");
            assert_eq!(
                d.reason,
                format!(
                    "auto: full pays (delta 150.0 ms vs full 100.0 ms; probe again in {} syncs)",
                    REPROBE_EVERY - n
                )
            );
            p.measured(PLAN, SyncKind::Full, 100 * MS);
        }
        let d = p.decide(PLAN, None);
        assert!(d.deltas, "{d:?}");
        assert_eq!(d.kind, DecisionKind::Probe);
        assert!(
            d.reason.starts_with(&format!(
                "auto: probe again after {REPROBE_EVERY} full syncs"
            )),
            "{}",
            d.reason
        );
        // The probe finds the link slower now (full syncs got slower, deltas did not): deltas.
        p.measured(PLAN, SyncKind::Full, 400 * MS);
        p.measured(PLAN, SyncKind::Delta, 150 * MS);
        assert_eq!(p.decide(PLAN, None).kind, DecisionKind::DeltaPays);
    }

    #[test]
    fn a_failed_sync_measures_nothing_and_engines_without_a_base_get_full_syncs() {
        let mut p = auto();
        p.measured(PLAN, SyncKind::Full, 100 * MS);
        p.measured(PLAN, SyncKind::Delta, 40 * MS);
        // A failed sync is never measured; the coordinator drops its engines' bases, so the
        // next sync is unavailable (full) for them, whatever the policy says.
        let d = p.decide(PLAN, Some("no engine holds the last committed version"));
        assert!(!d.deltas);
        assert_eq!(d.kind, DecisionKind::Unavailable);
        // That full sync is measured; deltas pay again after it.
        p.measured(PLAN, SyncKind::Full, 110 * MS);
        let d = p.decide(PLAN, None);
        assert!(d.deltas);
        assert_eq!(d.reason, "auto: delta pays (40.0 ms vs full 110.0 ms)");
        // A mixed sync (one engine restarted) changes nothing.
        p.measured(PLAN, SyncKind::Mixed, 500 * MS);
        assert_eq!(p.decide(PLAN, None), d);
    }

    #[test]
    fn a_new_plan_measures_again() {
        let mut p = auto();
        p.measured(PLAN, SyncKind::Full, 100 * MS);
        p.measured(PLAN, SyncKind::Delta, 40 * MS);
        assert_eq!(p.decide(PLAN + 1, None).kind, DecisionKind::Measure);
        p.measured(PLAN + 1, SyncKind::Full, 100 * MS);
        assert_eq!(p.decide(PLAN + 1, None).kind, DecisionKind::Probe);
    }
}
