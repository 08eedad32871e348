//! What the reader guard's system call watch (`tp_btf/sys_enter`) costs every
//! process of the node: a getppid() loop with no data path, with the data path
//! and its watch, and with the watch off, interleaved in one run.
//!
//! `cargo bench -p meshwarp-benches --bench syscall` (as root).

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use meshwarp_testbed::KernelTest;

fn getppid_loop(iters: u64) -> Duration {
    let t = Instant::now();
    for _ in 0..iters {
        // SAFETY: a system call without arguments or side effects.
        std::hint::black_box(unsafe { libc::syscall(libc::SYS_getppid) });
    }
    t.elapsed()
}

fn syscall(c: &mut Criterion) {
    let mut g = c.benchmark_group("syscall_getppid");
    g.sample_size(30).measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_millis(500));
    // Two interleaved rounds: the host's noise shows as a spread between them.
    for round in 1..=2 {
        g.bench_function(format!("no_data_path/{round}"), |b| b.iter_custom(getppid_loop));
        {
            let Some(k) = KernelTest::start(1024) else { return };
            assert!(k.dp().syscall_watch() || !k.dp().guard_enabled(), "the watch is on where the guard needs it");
            g.bench_function(format!("guard_with_syscall_watch/{round}"), |b| b.iter_custom(getppid_loop));
        }
        {
            let Some(_k) = KernelTest::start_with(1024, 64, |c| c.syscall_watch = false) else { return };
            g.bench_function(format!("guard_without_syscall_watch/{round}"), |b| b.iter_custom(getppid_loop));
        }
    }
    g.finish();
}

criterion_group!(benches, syscall);
criterion_main!(benches);
