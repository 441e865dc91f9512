use leasehold::{Error, locked};

#[locked(key = "job", ttl = "0ms")]
async fn run() -> Result<(), Error> {
    Ok(())
}

fn main() {
    let _: &dyn std::future::Future<Output = Result<(), leasehold::Error>> = &run();
}
