//! Immediates that name their sync: `imm = epoch bits | destination unit`.
//!
//! A receiver learns that a sync has landed by counting immediates
//! ([`ImmCounter`](weightsync_common::fabric::ImmCounter)). If every sync used the same immediate
//! for a destination, a write from an earlier sync that was aborted half-way (a trainer died, a
//! timeout fired) could still arrive after the next sync armed its counter and be counted toward
//! it: a false "landed". So each immediate carries the sync's epoch:
//!
//! ```text
//!  31                    12 11          0
//! +-----------------------+-------------+
//! | epoch mod 2^20        | unit        |
//! +-----------------------+-------------+
//! ```
//!
//! The *unit* is what the receiver counts separately inside one sync: a destination rank's
//! arena (rollout ranks), or a trainer's gather buffer for fp8 blocks straddling shards. Units are
//! numbered per receiving process, so 4096 of them are plenty.
//!
//! # Why a stale write can never count toward a later sync
//! 1. A sync that fails is cancelled at every receiver with
//!    [`ImmCounter::cancel`](weightsync_common::fabric::ImmCounter::cancel) on each of its
//!    immediates: the immediate is *retired*, so arrivals carrying it, however late, go to a stray
//!    count and never satisfy an expectation.
//! 2. The next sync uses the next epoch, hence different immediates, so it neither sees the old
//!    arrivals nor is refused by the retired ones.
//! 3. Wraparound: epoch `e` and `e + 2^20` share immediates. A write of sync `e` could only be
//!    miscounted by sync `e + 2^20` if it were still in flight 1,048,576 syncs later. A trainer's
//!    `run_sync` always drains every write it posted (success or failure) before it returns, and a
//!    dead trainer's lanes are torn down by the receiver (partial payloads are never counted), so
//!    nothing from sync `e` is in flight once the controller starts sync `e + 1`. At one sync
//!    per second, wraparound takes 12 days; at the same time the counter would refuse (not
//!    miscount) an expectation of a wrapped immediate that was retired in its earlier life
//!    ([`FabricError::ImmRetired`](weightsync_common::fabric::FabricError::ImmRetired)), so the worst
//!    case after wraparound is a clear error, never a false "landed".

use serde::{Deserialize, Serialize};

/// Bits of the immediate that carry the destination unit.
pub const UNIT_BITS: u32 = 12;
/// Bits of the immediate that carry the epoch (the rest).
pub const EPOCH_BITS: u32 = 32 - UNIT_BITS;
/// Number of distinct units per receiving process.
pub const MAX_UNITS: u32 = 1 << UNIT_BITS;
/// Epochs repeat after this many syncs.
pub const EPOCH_PERIOD: u64 = 1 << EPOCH_BITS;

/// A decoded immediate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ImmTag {
    /// The sync's epoch, modulo [`EPOCH_PERIOD`].
    pub epoch_bits: u32,
    /// The destination unit inside the receiving process.
    pub unit: u32,
}

/// A unit number that does not fit in [`UNIT_BITS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "destination unit {unit} does not fit in the immediate's {UNIT_BITS} unit bits (at most {} units per process)",
    MAX_UNITS
)]
pub struct UnitOutOfRange {
    /// The unit that was asked for.
    pub unit: u32,
}

impl ImmTag {
    /// The tag for `unit` in the sync with `epoch`.
    pub fn new(epoch: u64, unit: u32) -> Result<ImmTag, UnitOutOfRange> {
        if unit >= MAX_UNITS {
            return Err(UnitOutOfRange { unit });
        }
        Ok(ImmTag {
            epoch_bits: (epoch % EPOCH_PERIOD) as u32,
            unit,
        })
    }

    /// The 32-bit immediate.
    pub fn imm(self) -> u32 {
        (self.epoch_bits << UNIT_BITS) | self.unit
    }

    /// Decodes an immediate.
    pub fn decode(imm: u32) -> ImmTag {
        ImmTag {
            epoch_bits: imm >> UNIT_BITS,
            unit: imm & (MAX_UNITS - 1),
        }
    }

    /// Whether this tag belongs to the sync with `epoch`.
    pub fn is_epoch(self, epoch: u64) -> bool {
        self.epoch_bits as u64 == epoch % EPOCH_PERIOD
    }
}

/// Shorthand for `ImmTag::new(epoch, unit)?.imm()`.
pub fn imm_for(epoch: u64, unit: u32) -> Result<u32, UnitOutOfRange> {
    ImmTag::new(epoch, unit).map(ImmTag::imm)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_separates_epochs() {
        let a = ImmTag::new(7, 3).unwrap();
        assert_eq!(ImmTag::decode(a.imm()), a);
        assert!(a.is_epoch(7));
        assert!(!a.is_epoch(8));
        // Consecutive epochs never share an immediate for the same unit.
        for unit in [0, 1, MAX_UNITS - 1] {
            for e in [0u64, 1, 41, EPOCH_PERIOD - 1] {
                assert_ne!(imm_for(e, unit).unwrap(), imm_for(e + 1, unit).unwrap());
            }
        }
        // Units never collide inside one epoch.
        assert_ne!(imm_for(5, 1).unwrap(), imm_for(5, 2).unwrap());
    }

    #[test]
    fn wraps_after_the_period_and_refuses_big_units() {
        assert_eq!(
            imm_for(3, 9).unwrap(),
            imm_for(3 + EPOCH_PERIOD, 9).unwrap()
        );
        let err = ImmTag::new(0, MAX_UNITS).unwrap_err();
        assert!(err.to_string().contains("4096"), "{err}");
    }
}
