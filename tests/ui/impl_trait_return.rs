use std::fmt::Debug;

use leasehold::locked;

#[locked(key = "job")]
async fn run() -> impl Debug {
    42
}

fn main() {
    let _ = run();
}
