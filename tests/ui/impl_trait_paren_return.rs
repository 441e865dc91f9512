use std::fmt::Debug;

use leasehold::locked;

// Parenthesised, the return type is still `impl Trait`. (The lint allowed: the expected
// output is the macro's error alone, whatever a compiler's wording of that warning.)
#[allow(unused_parens)]
#[locked(key = "job")]
async fn run() -> (impl Debug) {
    42
}

/// Takes only a future whose output is `Debug`, as `run` is written.
fn debug_output<T: std::fmt::Debug>(_: impl std::future::Future<Output = T>) {}

fn main() {
    debug_output(run());
}
