//! Device memory planned up front: a model's activations, gradients and kept
//! buffers as ranges of one allocation (the arena).
//!
//! Each buffer is live over a span of the training step's timeline (see
//! [`crate::model`] for the model's spans); two buffers may share bytes only
//! where their spans do not meet. Offsets come from a greedy first fit,
//! largest buffer first: each buffer goes to the lowest aligned offset that
//! overlaps no buffer placed before it whose span meets its own.

use std::ops::Range;

/// Floats between buffer starts: 256 bytes, what `cuMemAlloc` guarantees, so
/// every buffer keeps the alignment a separate allocation would give it.
pub const ALIGN: usize = 64;

/// One buffer to place: its length in floats and the steps of the timeline
/// where it holds a value (`a..b`: written at `a` or later, last read before
/// `b`; an empty span is a buffer nothing touches).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArenaBuf {
    pub len: usize,
    pub live: Range<usize>,
}

/// Where each buffer of a plan starts (floats) and how big the arena is.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ArenaPlan {
    pub lens: Vec<usize>,
    pub offsets: Vec<usize>,
    /// Floats in the arena.
    pub total: usize,
    /// Floats the buffers would take as separate allocations (each rounded
    /// up to [`ALIGN`]).
    pub separate: usize,
}

fn padded(len: usize) -> usize {
    len.max(1).next_multiple_of(ALIGN)
}

fn meet(a: &Range<usize>, b: &Range<usize>) -> bool {
    !a.is_empty() && !b.is_empty() && a.start < b.end && b.start < a.end
}

impl ArenaPlan {
    pub fn new(bufs: &[ArenaBuf]) -> Self {
        let mut order: Vec<usize> = (0..bufs.len()).collect();
        order.sort_by_key(|&i| (std::cmp::Reverse(padded(bufs[i].len)), i));
        let mut offsets = vec![0; bufs.len()];
        let mut placed: Vec<usize> = Vec::with_capacity(bufs.len());
        for i in order {
            let size = padded(bufs[i].len);
            let mut taken: Vec<Range<usize>> = placed
                .iter()
                .filter(|&&j| meet(&bufs[i].live, &bufs[j].live))
                .map(|&j| offsets[j]..offsets[j] + padded(bufs[j].len))
                .collect();
            taken.sort_by_key(|r| r.start);
            let mut at = 0;
            for r in taken {
                if at + size <= r.start {
                    break;
                }
                at = at.max(r.end);
            }
            offsets[i] = at;
            placed.push(i);
        }
        let total = bufs
            .iter()
            .zip(&offsets)
            .map(|(b, o)| o + padded(b.len))
            .max()
            .unwrap_or(0);
        Self {
            lens: bufs.iter().map(|b| b.len).collect(),
            offsets,
            total,
            separate: bufs.iter().map(|b| padded(b.len)).sum(),
        }
    }

    /// The floats buffer `i` spans in the arena.
    pub fn range(&self, i: usize) -> Range<usize> {
        self.offsets[i]..self.offsets[i] + self.lens[i]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn buf(len: usize, live: Range<usize>) -> ArenaBuf {
        ArenaBuf { len, live }
    }

    /// No two buffers whose spans meet share a float; every start aligned.
    fn check(bufs: &[ArenaBuf], plan: &ArenaPlan) {
        for i in 0..bufs.len() {
            assert_eq!(plan.offsets[i] % ALIGN, 0);
            assert!(plan.range(i).end <= plan.total);
            for j in 0..i {
                if meet(&bufs[i].live, &bufs[j].live) {
                    let (a, b) = (plan.range(i), plan.range(j));
                    assert!(
                        a.end <= b.start || b.end <= a.start,
                        "buffers {i} {a:?} and {j} {b:?} are live together but overlap"
                    );
                }
            }
        }
    }

    #[test]
    fn buffers_live_together_get_their_own_bytes() {
        let bufs = [buf(100, 0..10), buf(1000, 0..10), buf(1, 0..10)];
        let plan = ArenaPlan::new(&bufs);
        check(&bufs, &plan);
        assert_eq!(plan.total, plan.separate);
        assert_eq!(plan.total, 1024 + 128 + 64);
    }

    #[test]
    fn a_chain_of_gradients_takes_two_slots() {
        // Each gradient is live from its consumer's backward (written) to its
        // producer's backward (read): neighbours meet, others do not.
        let lens = [500, 300, 800, 200, 100];
        let bufs: Vec<_> = lens
            .iter()
            .enumerate()
            .map(|(i, &l)| buf(l, i..i + 2))
            .collect();
        let plan = ArenaPlan::new(&bufs);
        check(&bufs, &plan);
        // The largest (800, at 2) meets 300 and 200; 500 and 100 can share
        // its bytes; the rest fit beside it.
        assert_eq!(plan.offsets[2], 0);
        assert!(plan.total <= padded(800) + padded(500));
        assert!(plan.total < plan.separate);
    }

    #[test]
    fn untouched_buffers_take_no_bytes_of_their_own() {
        let bufs = [buf(4096, 0..4), buf(4096, 2..2)];
        let plan = ArenaPlan::new(&bufs);
        assert_eq!(plan.total, 4096);
    }

    #[test]
    fn random_spans_never_overlap_when_live() {
        let mut rng = StdRng::seed_from_u64(7);
        for _ in 0..200 {
            let n = rng.random_range(1..30);
            let bufs: Vec<_> = (0..n)
                .map(|_| {
                    let a = rng.random_range(0..20);
                    buf(rng.random_range(0..5000), a..a + rng.random_range(0..8))
                })
                .collect();
            let plan = ArenaPlan::new(&bufs);
            check(&bufs, &plan);
            assert!(plan.total <= plan.separate);
        }
    }
}
