//! Replica balancing: spread data that several training ranks hold so that the most loaded
//! sending NIC carries as little as possible.
//!
//! Data held by a replica set may be split among the set's members in any proportion (the
//! planner cuts it along its first dimension), so the best possible maximum load is the optimum
//! of a fractional min-max assignment. That is a flow problem: source -> set (its amount) ->
//! member ranks -> sink (capacity `T - fixed load`), and `T` is the smallest value for which the
//! maximum flow carries every amount. We binary-search `T` over integers and run Dinic's
//! algorithm; graphs are small because sets are interned (a layout has few distinct replica
//! sets even when it has millions of regions).

/// Dinic max flow over u64 capacities.
struct Flow {
    head: Vec<usize>,
    next: Vec<usize>,
    to: Vec<usize>,
    cap: Vec<u64>,
    level: Vec<i32>,
    iter: Vec<usize>,
}

const NONE: usize = usize::MAX;

impl Flow {
    fn new(n: usize) -> Flow {
        Flow {
            head: vec![NONE; n],
            next: vec![],
            to: vec![],
            cap: vec![],
            level: vec![0; n],
            iter: vec![0; n],
        }
    }

    fn edge(&mut self, a: usize, b: usize, c: u64) -> usize {
        let e = self.to.len();
        for (x, y, cc) in [(a, b, c), (b, a, 0)] {
            self.to.push(y);
            self.cap.push(cc);
            self.next.push(self.head[x]);
            self.head[x] = self.to.len() - 1;
        }
        e
    }

    fn bfs(&mut self, s: usize, t: usize) -> bool {
        self.level.iter_mut().for_each(|l| *l = -1);
        let mut q = std::collections::VecDeque::new();
        self.level[s] = 0;
        q.push_back(s);
        while let Some(v) = q.pop_front() {
            let mut e = self.head[v];
            while e != NONE {
                let u = self.to[e];
                if self.cap[e] > 0 && self.level[u] < 0 {
                    self.level[u] = self.level[v] + 1;
                    q.push_back(u);
                }
                e = self.next[e];
            }
        }
        self.level[t] >= 0
    }

    fn dfs(&mut self, v: usize, t: usize, f: u64) -> u64 {
        if v == t {
            return f;
        }
        while self.iter[v] != NONE {
            let e = self.iter[v];
            let u = self.to[e];
            if self.cap[e] > 0 && self.level[u] == self.level[v] + 1 {
                let d = self.dfs(u, t, f.min(self.cap[e]));
                if d > 0 {
                    self.cap[e] -= d;
                    self.cap[e ^ 1] += d;
                    return d;
                }
            }
            self.iter[v] = self.next[e];
        }
        0
    }

    fn max_flow(&mut self, s: usize, t: usize) -> u64 {
        let mut total = 0;
        while self.bfs(s, t) {
            self.iter.clone_from(&self.head);
            loop {
                let f = self.dfs(s, t, u64::MAX);
                if f == 0 {
                    break;
                }
                total += f;
            }
        }
        total
    }
}

/// Given fixed loads per rank and sets `(members, amount)`, returns for each set the amount
/// each member should take (same order as `members`), minimising the maximum total load, and
/// that maximum.
pub fn balance(fixed: &[u64], sets: &[(Vec<u32>, u64)]) -> (Vec<Vec<u64>>, u64) {
    let total: u64 = sets.iter().map(|s| s.1).sum();
    let mut ranks: Vec<u32> = sets.iter().flat_map(|s| s.0.iter().copied()).collect();
    ranks.sort_unstable();
    ranks.dedup();
    let fixed_max = ranks.iter().map(|&r| fixed[r as usize]).max().unwrap_or(0);
    if total == 0 {
        return (sets.iter().map(|s| vec![0; s.0.len()]).collect(), fixed_max);
    }
    let build = |t: u64| -> Option<(Flow, Vec<Vec<usize>>)> {
        let n = 2 + sets.len() + ranks.len();
        let (src, sink) = (0, n - 1);
        let mut g = Flow::new(n);
        let mut edges = Vec::with_capacity(sets.len());
        for (j, (members, amount)) in sets.iter().enumerate() {
            g.edge(src, 1 + j, *amount);
            edges.push(
                members
                    .iter()
                    .map(|r| {
                        let ri = ranks.binary_search(r).expect("rank interned");
                        g.edge(1 + j, 1 + sets.len() + ri, u64::MAX / 4)
                    })
                    .collect(),
            );
        }
        for (ri, &r) in ranks.iter().enumerate() {
            g.edge(1 + sets.len() + ri, sink, t - fixed[r as usize]);
        }
        (g.max_flow(src, sink) == total).then_some((g, edges))
    };
    // Smallest feasible T in [fixed_max, fixed_max + total].
    let (mut lo, mut hi) = (fixed_max, fixed_max + total);
    let lower = (ranks.iter().map(|&r| fixed[r as usize]).sum::<u64>() + total)
        .div_ceil(ranks.len() as u64);
    lo = lo.max(lower);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if build(mid).is_some() {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    let (g, edges) = build(lo).expect("the upper bound is always feasible");
    let out = edges
        .iter()
        .map(|es| es.iter().map(|&e| g.cap[e ^ 1]).collect())
        .collect();
    (out, lo)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_loads_across_overlapping_sets() {
        // Rank 0 already carries 10; 20 units may go to {0,1}, 6 units to {1,2}. Rank 2 can
        // take at most 6, so the best is 15 on ranks 0 and 1.
        let (x, t) = balance(&[10, 0, 0], &[(vec![0, 1], 20), (vec![1, 2], 6)]);
        assert_eq!(t, 15);
        assert_eq!(x[0].iter().sum::<u64>(), 20);
        assert_eq!(x[1].iter().sum::<u64>(), 6);
        let loads = [10 + x[0][0], x[0][1] + x[1][0], x[1][1]];
        assert!(loads.iter().all(|&l| l <= 15), "{loads:?}");
        let (_, t) = balance(&[0, 0, 0, 0], &[(vec![0, 1, 2, 3], 40)]);
        assert_eq!(t, 10);
    }
}
