use leasehold::locked;

#[locked(key = "job")]
async fn run() {}

fn main() {}
