use leasehold::{Error, locked};

#[locked(key = "job")]
fn run() -> Result<(), Error> {
    Ok(())
}

fn main() {
    // The original item is still emitted, so callers of `run` type-check.
    let _ = run();
}
