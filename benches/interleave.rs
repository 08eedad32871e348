//! A finer A/B than criterion's back-to-back groups on a noisy machine
//! (`#[path]`-included by the benches that compare round trips).

use std::time::Instant;

/// `n` contenders take turns of `turn` round trips (`rounds` times, in
/// order; `prepare(i)` runs before contender i's turn, e.g. to flip a
/// switch, and `one(i)` is one of its round trips); each one's median time
/// per round trip over its turns, in ns. Drift of the host between turns
/// hits every contender alike.
pub fn interleaved_medians(
    n: usize,
    rounds: usize,
    turn: u32,
    mut prepare: impl FnMut(usize),
    mut one: impl FnMut(usize),
) -> Vec<f64> {
    let mut times = vec![Vec::with_capacity(rounds); n];
    for _ in 0..rounds {
        for (i, t) in times.iter_mut().enumerate() {
            prepare(i);
            let start = Instant::now();
            for _ in 0..turn {
                one(i);
            }
            t.push(start.elapsed().as_nanos() as f64 / f64::from(turn));
        }
    }
    times
        .into_iter()
        .map(|mut t| {
            t.sort_by(f64::total_cmp);
            t[t.len() / 2]
        })
        .collect()
}
