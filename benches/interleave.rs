//! A finer A/B than criterion's back-to-back groups on a noisy machine
//! (`#[path]`-included by the benches that compare paths).

use std::time::{Duration, Instant};

/// `n` contenders take turns of `turn` round trips (`rounds` times, in a
/// new order every round; `prepare(i)` runs before contender i's turn, e.g.
/// to flip a switch, and `one(i)` is one of its round trips); each one's
/// median time per round trip over its turns, in ns. Drift of the host
/// between turns hits every contender alike.
pub fn interleaved_medians(
    n: usize,
    rounds: usize,
    turn: u32,
    mut prepare: impl FnMut(usize),
    mut one: impl FnMut(usize),
) -> Vec<f64> {
    interleaved_timed(n, rounds, |i| {
        prepare(i);
        let start = Instant::now();
        for _ in 0..turn {
            one(i);
        }
        start.elapsed() / turn
    })
}

/// `n` contenders take turns (`rounds` times); `turn(i)` runs contender i's
/// turn and returns the time it measured (without its setup); each one's
/// median, in ns. The contenders go in a new order every round: a turn may
/// pay for the one before it (a program's exit, a server warm from its last
/// turn, sockets torn down in the background, the scheduler's recent load),
/// and in a fixed order each contender would always follow the same one.
pub fn interleaved_timed(n: usize, rounds: usize, mut turn: impl FnMut(usize) -> Duration) -> Vec<f64> {
    let mut times = vec![Vec::with_capacity(rounds); n];
    let mut order: Vec<usize> = (0..n).collect();
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    for _ in 0..rounds {
        // Fisher-Yates with a fixed-seed xorshift: runs are repeatable.
        for i in (1..n).rev() {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            order.swap(i, (seed % (i as u64 + 1)) as usize);
        }
        for &i in &order {
            times[i].push(turn(i).as_nanos() as f64);
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

/// Cells whose id contains the bench's free argument (`a|b`: either); all
/// without one. (`paths` has its own, which knows criterion's options.)
#[allow(dead_code)]
pub fn selected(id: &str) -> bool {
    match std::env::args().skip(1).find(|a| !a.starts_with('-')) {
        Some(f) => f.split('|').any(|p| id.contains(p)),
        None => true,
    }
}
