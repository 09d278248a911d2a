//! Packed lists: fixed-width integer records stored as runs of arithmetic progressions, the form
//! the routing table keeps its long lists in (a trainer's tasks, their destinations, its shards).
//!
//! Why: a large model repeats a handful of shapes. The experts of a layer have the same tasks,
//! with only the parameter, the shard and the destination offsets moved by the same amount from
//! one expert to the next, and every layer repeats the layer before. Kimi-K2 plans 2 million
//! tasks; stored as progressions, a trainer's 48 experts of a layer cost a few records instead
//! of one per task and write.
//!
//! A [`Packed`] list is a sequence of [`Run`]s over records of `W` `u64` fields (`W` is fixed by
//! what the list holds). A run stores its first `period` records and, when it repeats
//! (`count > 1`), one step per record: repetition `r` of record `j` is `first[j] + r * step[j]`,
//! field by field, in wrapping arithmetic (a step may be negative). A run that does not repeat
//! holds `period` records as they are. [`Packed::push`] packs greedily (periods up to
//! [`MAX_PERIOD`], at least [`MIN_REPEATS`] repetitions), the same records always the same way.
//!
//! A list decoded from bytes is not trusted: [`Packed::len`] never overflows, iteration stops
//! where the stored fields end, and [`Packed::check`] says whether the fields match the runs.

use serde::{Deserialize, Serialize};

/// Longest period [`Packed::push`] looks for: the tasks of one expert on one trainer (gate, up,
/// down; two destination writes each) repeat with period 3, their writes with period 6.
pub const MAX_PERIOD: usize = 12;

/// Fewest repetitions [`Packed::push`] stores as a run (two cost as much stored as they are).
pub const MIN_REPEATS: usize = 3;

/// `period` records repeated `count` times (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Run {
    /// Records in one repetition.
    pub period: u32,
    /// Repetitions (1: the records as they are).
    pub count: u32,
}

impl Run {
    /// Records this run stands for.
    pub fn len(&self) -> u64 {
        self.period as u64 * self.count as u64
    }

    /// Whether the run stands for no record.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Records stored for this run: its first repetition, and its steps when it repeats.
    fn stored(&self) -> u64 {
        self.period as u64 * if self.count > 1 { 2 } else { 1 }
    }
}

/// A list of records stored as runs (see the module docs).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Packed {
    /// The runs, in list order.
    pub runs: Vec<Run>,
    /// Per run: its first `period` records, then (when it repeats) its `period` steps; `W`
    /// fields each.
    pub fields: Vec<u64>,
}

impl Packed {
    /// A list of `records`, packed.
    pub fn of<const W: usize>(records: &[[u64; W]]) -> Packed {
        let mut p = Packed::default();
        p.push(records);
        p.shrink_to_fit();
        p
    }

    /// Gives back the room the lists grew into beyond what they hold (a finished list).
    pub fn shrink_to_fit(&mut self) {
        self.runs.shrink_to_fit();
        self.fields.shrink_to_fit();
    }

    /// Number of records (saturating: a decoded list may claim more than `u64` counts).
    pub fn len(&self) -> u64 {
        self.runs
            .iter()
            .fold(0u64, |n, r| n.saturating_add(r.len()))
    }

    /// Whether the list has no record.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Records stored (first repetitions and steps), a measure of the packed size.
    pub fn stored(&self, width: usize) -> usize {
        self.fields.len() / width.max(1)
    }

    /// Whether the stored fields are exactly what the runs need at `width` fields a record.
    pub fn check(&self, width: usize) -> Result<(), String> {
        let need = self
            .runs
            .iter()
            .fold(0u64, |n, r| n.saturating_add(r.stored()))
            .saturating_mul(width as u64);
        if need != self.fields.len() as u64 {
            return Err(format!(
                "its runs need {need} stored fields, it has {}",
                self.fields.len()
            ));
        }
        Ok(())
    }

    /// The records, in order. A malformed list yields the records its stored fields hold.
    pub fn iter<const W: usize>(&self) -> Records<'_, W> {
        Records {
            packed: self,
            run: 0,
            at: 0,
            j: 0,
            r: 0,
        }
    }

    /// Appends `records`, packing them into runs. A literal record continues a literal run
    /// that ends the list.
    pub fn push<const W: usize>(&mut self, records: &[[u64; W]]) {
        let n = records.len();
        let mut i = 0;
        while i < n {
            let (period, count) = best_run(records, i);
            if count < MIN_REPEATS {
                self.push_literal(&records[i]);
                i += 1;
                continue;
            }
            self.runs.push(Run {
                period: period as u32,
                count: count as u32,
            });
            for rec in &records[i..i + period] {
                self.fields.extend_from_slice(rec);
            }
            for j in 0..period {
                let (a, b) = (&records[i + j], &records[i + period + j]);
                self.fields.extend((0..W).map(|f| b[f].wrapping_sub(a[f])));
            }
            i += period * count;
        }
    }

    /// Appends one record as it is.
    fn push_literal<const W: usize>(&mut self, rec: &[u64; W]) {
        match self.runs.last_mut() {
            Some(last) if last.count == 1 && last.period < u32::MAX => last.period += 1,
            _ => self.runs.push(Run {
                period: 1,
                count: 1,
            }),
        }
        self.fields.extend_from_slice(rec);
    }
}

/// The longest run starting at record `i`: `(period, repetitions)`, the shortest period on ties;
/// repetitions below [`MIN_REPEATS`] when there is none worth storing.
///
/// Periods are tried in increasing order, and a period's run is not walked again where a
/// divisor's run already covers it: records that repeat with period `d` for `c` repetitions
/// also repeat with period `m * d` for `c / m` repetitions, so the walk for `m * d` starts
/// there (the experts of a layer repeat with period 3 for 48 repetitions, and periods 6, 9 and
/// 12 would walk the same records again). The result is the same as walking every period from
/// its start.
fn best_run<const W: usize>(records: &[[u64; W]], i: usize) -> (usize, usize) {
    let n = records.len();
    let mut best = (1, 1);
    // Per period tried: the records its run covers from `i` (0: not a run).
    let mut covered = [0usize; MAX_PERIOD + 1];
    let mut steps = [[0u64; W]; MAX_PERIOD];
    for p in 1..=MAX_PERIOD.min((n - i) / MIN_REPEATS) {
        // Three terms of a progression in the first record, before checking the whole period.
        let (a, b, c) = (&records[i], &records[i + p], &records[i + 2 * p]);
        if (0..W).any(|f| c[f].wrapping_sub(b[f]) != b[f].wrapping_sub(a[f])) {
            continue;
        }
        // The steps of the first repetition, once; repetition `k` holds when it is repetition
        // `k - 1` plus those steps.
        for (s, (x, y)) in steps
            .iter_mut()
            .zip(records[i..i + p].iter().zip(&records[i + p..i + 2 * p]))
        {
            *s = std::array::from_fn(|f| y[f].wrapping_sub(x[f]));
        }
        let steps = &steps[..p];
        let steps_hold = |k: usize| {
            let (prev, cur) = records[i + (k - 1) * p..i + (k + 1) * p].split_at(p);
            steps
                .iter()
                .zip(prev.iter().zip(cur))
                .all(|(s, (w, z))| (0..W).all(|f| z[f].wrapping_sub(w[f]) == s[f]))
        };
        let known = (1..p)
            .filter(|d| p.is_multiple_of(*d))
            .map(|d| covered[d] / p)
            .max()
            .unwrap_or(0);
        let mut count = known.max(2);
        while i + (count + 1) * p <= n && steps_hold(count) {
            count += 1;
        }
        covered[p] = count * p;
        if count >= MIN_REPEATS && count * p > best.0 * best.1 {
            best = (p, count);
        }
    }
    best
}

/// The records of a [`Packed`] list: [`Packed::iter`].
#[derive(Debug, Clone)]
pub struct Records<'a, const W: usize> {
    packed: &'a Packed,
    /// Current run.
    run: usize,
    /// Where the current run's fields start.
    at: usize,
    /// Record within the repetition, and repetition.
    j: u32,
    r: u32,
}

/// The run the next record of a [`Records`] walk is in, where that record is in it, and the
/// run's stored fields: what lets a reader take many records of a run at once
/// ([`Records::run_ahead`], [`Records::skip_in_run`]) rather than one by one.
#[derive(Debug, Clone, Copy)]
pub struct RunAhead<'a, const W: usize> {
    /// Records in one repetition.
    pub period: u32,
    /// Repetitions of the run.
    pub count: u32,
    /// The next record's place in its repetition.
    pub j: u32,
    /// The next record's repetition.
    pub r: u32,
    /// The first repetition's records (`period * W` fields).
    pub first: &'a [u64],
    /// Per record of a repetition, its step (`period * W` fields); empty when the run does not
    /// repeat (`count == 1`).
    pub step: &'a [u64],
}

impl<const W: usize> RunAhead<'_, W> {
    /// Records left in the run from the next one on.
    pub fn left(&self) -> u64 {
        (self.count - self.r) as u64 * self.period as u64 - self.j as u64
    }

    /// Field `f` of the run's record `i` (counted from the run's start): `first + (i / period)
    /// * step`, wrapping, as the walk yields it. `i` must be below the run's length.
    #[inline]
    pub fn field(&self, i: u64, f: usize) -> u64 {
        let (rep, j) = (i / self.period as u64, (i % self.period as u64) as usize);
        let x = self.first[j * W + f];
        if self.step.is_empty() {
            x
        } else {
            x.wrapping_add(self.step[j * W + f].wrapping_mul(rep))
        }
    }

    /// Where the next record is from the run's start.
    pub fn at(&self) -> u64 {
        self.r as u64 * self.period as u64 + self.j as u64
    }
}

impl<'a, const W: usize> Records<'a, W> {
    /// The run the next record is in, if its stored fields are all there (a malformed list's
    /// last run may lack some: then `None`, and [`Iterator::next`] says what it still yields).
    /// `None` at the end too.
    pub fn run_ahead(&mut self) -> Option<RunAhead<'a, W>> {
        let run = self.enter_run()?;
        let n = (run.period as usize).checked_mul(W)?;
        let fields: &'a [u64] = &self.packed.fields;
        let first = fields.get(self.at..self.at.checked_add(n)?)?;
        let step = if run.count > 1 {
            fields.get(self.at + n..self.at.checked_add(2 * n)?)?
        } else {
            &[]
        };
        Some(RunAhead {
            period: run.period,
            count: run.count,
            j: self.j,
            r: self.r,
            first,
            step,
        })
    }

    /// The run the next record is in, after moving past the runs used up (and empty ones);
    /// `None` at the end.
    fn enter_run(&mut self) -> Option<Run> {
        loop {
            let run = *self.packed.runs.get(self.run)?;
            if self.r < run.count && run.period != 0 {
                return Some(run);
            }
            self.run += 1;
            self.at = self
                .at
                .saturating_add((run.stored() as usize).saturating_mul(W));
            self.j = 0;
            self.r = 0;
        }
    }

    /// Skips `n` records of the current run, as `n` calls of [`Iterator::next`] would, when
    /// [`Records::run_ahead`] just gave the run and `n` is at most its [`RunAhead::left`].
    pub fn skip_in_run(&mut self, n: u64) {
        let Some(run) = self.packed.runs.get(self.run) else {
            return;
        };
        let p = run.period as u64;
        let at = self.r as u64 * p + self.j as u64 + n;
        debug_assert!(at <= run.len());
        self.r = (at / p) as u32;
        self.j = (at % p) as u32;
    }
}

impl<const W: usize> Iterator for Records<'_, W> {
    type Item = [u64; W];

    fn next(&mut self) -> Option<[u64; W]> {
        let run = self.enter_run()?;
        let fields = &self.packed.fields;
        let first = self.at.checked_add(self.j as usize * W)?;
        let mut out = [0u64; W];
        out.copy_from_slice(fields.get(first..first.checked_add(W)?)?);
        if run.count > 1 {
            let step = first.checked_add((run.period as usize).checked_mul(W)?)?;
            let step = fields.get(step..step.checked_add(W)?)?;
            for f in 0..W {
                out[f] = out[f].wrapping_add(step[f].wrapping_mul(self.r as u64));
            }
        }
        self.j += 1;
        if self.j == run.period {
            self.j = 0;
            self.r += 1;
        }
        Some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip<const W: usize>(recs: &[[u64; W]]) -> Packed {
        let p = Packed::of(recs);
        p.check(W).unwrap();
        assert_eq!(p.len(), recs.len() as u64);
        assert_eq!(p.iter::<W>().collect::<Vec<_>>(), recs);
        p
    }

    #[test]
    fn progressions_with_a_period_pack_into_one_run() {
        // Three kinds of task per expert (period 3), each moving by its own step.
        let recs: Vec<[u64; 3]> = (0..48u64)
            .flat_map(|e| {
                [
                    [7, 3 * e, 1000 + 3 * e],
                    [8, 3 * e + 1, 1000 + 3 * e + 1],
                    [9, 3 * e + 2, 5000 - 7 * e],
                ]
            })
            .collect();
        let p = round_trip(&recs);
        assert_eq!(
            p.runs,
            vec![Run {
                period: 3,
                count: 48
            }]
        );
        assert_eq!(p.stored(3), 6);
    }

    #[test]
    fn irregular_records_stay_literal_and_runs_follow() {
        let mut recs: Vec<[u64; 2]> = vec![[5, 1], [9, 4], [2, 2]];
        recs.extend((0..10u64).map(|i| [1, 100 + 8 * i]));
        recs.extend([[3, 3], [3, 3]]);
        let p = round_trip(&recs);
        assert_eq!(
            p.runs,
            vec![
                Run {
                    period: 3,
                    count: 1
                },
                Run {
                    period: 1,
                    count: 10
                },
                Run {
                    period: 2,
                    count: 1
                },
            ]
        );
        // Appending continues the trailing literal run.
        let mut q = p.clone();
        q.push(&[[4, 4]]);
        assert_eq!(q.runs.last().unwrap().period, 3);
        assert_eq!(q.len(), 16);
    }

    /// [`best_run`] as it was before it reused divisors' runs: every period walked from its
    /// start.
    fn best_run_walking_every_period<const W: usize>(
        records: &[[u64; W]],
        i: usize,
    ) -> (usize, usize) {
        let n = records.len();
        let mut best = (1, 1);
        for p in 1..=MAX_PERIOD.min((n - i) / MIN_REPEATS) {
            let (a, b, c) = (&records[i], &records[i + p], &records[i + 2 * p]);
            if (0..W).any(|f| c[f].wrapping_sub(b[f]) != b[f].wrapping_sub(a[f])) {
                continue;
            }
            let mut count = 2;
            while i + (count + 1) * p <= n
                && (0..p).all(|j| {
                    (0..W).all(|f| {
                        records[i + count * p + j][f]
                            .wrapping_sub(records[i + (count - 1) * p + j][f])
                            == records[i + p + j][f].wrapping_sub(records[i + j][f])
                    })
                })
            {
                count += 1;
            }
            if count >= MIN_REPEATS && count * p > best.0 * best.1 {
                best = (p, count);
            }
        }
        best
    }

    #[test]
    fn runs_found_by_reusing_divisors_are_the_runs_found_by_walking() {
        // Pieces of progressions of periods 1 to 12 (some repeated past a multiple, some cut
        // short, some with a broken record), with literal records between them.
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for _ in 0..200 {
            let mut recs: Vec<[u64; 2]> = Vec::new();
            while recs.len() < 300 {
                let p = (next() % 12 + 1) as usize;
                let reps = (next() % 30) as usize;
                let first: Vec<[u64; 2]> = (0..p).map(|_| [next() % 5, next() % 1000]).collect();
                let step: Vec<[u64; 2]> = (0..p).map(|_| [next() % 3, next() % 7]).collect();
                for r in 0..reps as u64 {
                    for j in 0..p {
                        recs.push([
                            first[j][0].wrapping_add(r.wrapping_mul(step[j][0])),
                            first[j][1].wrapping_add(r.wrapping_mul(step[j][1])),
                        ]);
                    }
                }
                if next() % 4 == 0 {
                    recs.push([next() % 5, next() % 5]);
                }
            }
            for i in 0..recs.len() {
                assert_eq!(
                    best_run(&recs, i),
                    best_run_walking_every_period(&recs, i),
                    "at record {i}"
                );
            }
            round_trip(&recs);
        }
    }

    #[test]
    fn nothing_and_short_lists_round_trip() {
        round_trip::<4>(&[]);
        round_trip(&[[1u64]]);
        round_trip(&[[1u64], [2], [3]]);
        round_trip(&[[u64::MAX, 0], [0, u64::MAX], [1, u64::MAX - 1]]);
    }

    #[test]
    fn malformed_lists_never_panic_or_overflow() {
        let p = Packed {
            runs: vec![
                Run {
                    period: u32::MAX,
                    count: u32::MAX,
                };
                5
            ],
            fields: vec![1, 2, 3],
        };
        assert_eq!(p.len(), u64::MAX, "saturates");
        assert!(p.check(3).is_err());
        assert_eq!(p.iter::<3>().count(), 0, "no step fields: nothing to yield");
        let q = Packed {
            runs: vec![
                Run {
                    period: 0,
                    count: 9,
                },
                Run {
                    period: 2,
                    count: 1,
                },
            ],
            fields: vec![1, 2, 3],
        };
        assert_eq!(q.iter::<2>().collect::<Vec<_>>(), vec![[1, 2]]);
    }
}
