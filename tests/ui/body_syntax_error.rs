// A body with a syntax error: rustc reports it once, itself; the attribute adds nothing.
use leasehold::{Error, locked};

#[locked(key = "k")]
async fn run() -> Result<(), Error> {
    let x = ;
    Ok(())
}

fn main() {
    let _ = run();
}
