use leasehold::locked;

#[locked(key = "job")]
async fn run() -> u32 {
    7
}

fn main() {}
