use leasehold::{Error, locked};

#[locked(key = "job")]
fn run() -> Result<(), Error> {
    Ok(())
}

fn main() {
    let _: Result<(), leasehold::Error> = run();
}
