use leasehold::locked;

#[locked(key = "job")]
struct Job;

fn main() {}
