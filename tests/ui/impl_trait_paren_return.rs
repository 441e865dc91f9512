use std::fmt::Debug;

use leasehold::locked;

// Parenthesised, the return type is still `impl Trait`.
#[locked(key = "job")]
async fn run() -> (impl Debug) {
    42
}

/// Takes only a future whose output is `Debug`, as `run` is written.
fn debug_output<T: std::fmt::Debug>(_: impl std::future::Future<Output = T>) {}

fn main() {
    debug_output(run());
}
