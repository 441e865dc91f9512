use leasehold::{Error, locked};

#[locked(key = "job", ttl = "0ms")]
async fn run() -> Result<(), Error> {
    Ok(())
}

fn main() {
    let _ = run();
}
