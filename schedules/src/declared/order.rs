//! The order of a declared model's parameters: every trainer's declaration order merged, each
//! name a rank declares first placed just before the next name of that rank's list that an
//! earlier rank declared (or last). Why not "rank 0's, then rank 1's new ones": with expert
//! parallelism rank 1 holds experts rank 0 does not, and they belong after rank 0's experts of
//! the same layer, not after the whole model; merged so, a known family's trainers declare
//! their parameters in the family's own order, and a declared plan of it is the config path's
//! plan, byte for byte (parameters are numbered by this order in the table).

/// The merged order being built, as a doubly linked list over parameter numbers (in the order
/// they were first declared).
#[derive(Debug)]
pub(super) struct MergedOrder {
    next: Vec<u32>,
    prev: Vec<u32>,
    head: u32,
    tail: u32,
    /// Parameters first declared by the current rank, not yet placed.
    pending: Vec<u32>,
}

const NONE: u32 = u32::MAX;

impl Default for MergedOrder {
    fn default() -> Self {
        MergedOrder {
            next: Vec::new(),
            prev: Vec::new(),
            head: NONE,
            tail: NONE,
            pending: Vec::new(),
        }
    }
}

impl MergedOrder {
    /// Parameter `pid` (numbered `params.len()` at its first declaration) was declared first
    /// by the current rank.
    pub(super) fn new_param(&mut self, pid: u32) {
        debug_assert_eq!(pid as usize, self.next.len());
        self.next.push(NONE);
        self.prev.push(NONE);
        self.pending.push(pid);
    }

    /// The current rank declares `pid`, which an earlier rank declared: its new parameters so
    /// far go just before it.
    pub(super) fn known(&mut self, pid: u32) {
        if self.pending.is_empty() {
            return;
        }
        let before = self.prev[pid as usize];
        let run = std::mem::take(&mut self.pending);
        self.link(before, &run, pid);
    }

    /// The current rank's declarations are done: its remaining new parameters go last.
    pub(super) fn end_rank(&mut self) {
        if self.pending.is_empty() {
            return;
        }
        let run = std::mem::take(&mut self.pending);
        self.link(self.tail, &run, NONE);
    }

    /// Links `run` between `a` and `b` (`NONE`: the list's start or end).
    fn link(&mut self, a: u32, run: &[u32], b: u32) {
        let mut last = a;
        for &p in run {
            self.prev[p as usize] = last;
            if last == NONE {
                self.head = p;
            } else {
                self.next[last as usize] = p;
            }
            last = p;
        }
        self.next[last as usize] = b;
        if b == NONE {
            self.tail = last;
        } else {
            self.prev[b as usize] = last;
        }
    }

    /// The parameters in merged order; `None` when it is the order of first declaration.
    pub(super) fn finish(mut self) -> Option<Vec<u32>> {
        self.end_rank();
        let mut out = Vec::with_capacity(self.next.len());
        let mut p = self.head;
        while p != NONE {
            out.push(p);
            p = self.next[p as usize];
        }
        debug_assert_eq!(out.len(), self.next.len());
        (!out.iter().enumerate().all(|(i, &p)| i as u32 == p)).then_some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_names_go_before_the_next_known_one() {
        let mut o = MergedOrder::default();
        // Rank 0: a b c; rank 1: a x b y; rank 2: z.
        for p in 0..3 {
            o.new_param(p);
        }
        o.end_rank();
        o.known(0);
        o.new_param(3);
        o.known(1);
        o.new_param(4);
        o.end_rank();
        o.new_param(5);
        assert_eq!(o.finish(), Some(vec![0, 3, 1, 2, 4, 5]));
        let mut same = MergedOrder::default();
        same.new_param(0);
        same.new_param(1);
        same.end_rank();
        same.known(0);
        same.known(1);
        assert_eq!(same.finish(), None);
    }
}
