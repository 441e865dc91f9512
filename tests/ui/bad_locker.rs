use leasehold::{Error, locked};

#[locked(key = "job", locker = 42)]
async fn run() -> Result<(), Error> {
    Ok(())
}

fn main() {}
